"""A/B throughput, numerics and primitive-count harnesses (stock mlx-lm vs mlx-lily).

Modules (each imports MLX only when used):

- :mod:`mlx_lily.bench.ab` -- prefill / decode throughput sweeps, stock vs Lily, with a
  correctness gate; JSON + markdown + PNG outputs (console command ``mlx_lily.ab``).
- :mod:`mlx_lily.bench.numerics` -- teacher-forced perplexity, top-1 agreement, KL and
  logit differences of Lily against stock mlx-lm.
- :mod:`mlx_lily.bench.primitives` -- MLX primitives (graph nodes) per decode token.
- :mod:`mlx_lily.bench.timeline` -- host phases vs the GPU's own time per decode step /
  prefill chunk (CUDA).
"""

__all__ = ["ab", "numerics", "primitives", "timeline", "gpu_or_explain"]


def gpu_or_explain(script: str, cuda_only: bool = False) -> bool:
    """Whether a GPU benchmark should run here: True on MLX's CUDA backend (and on Metal
    unless ``cuda_only``); otherwise prints one line saying why ``script`` measures
    nothing (the caller then exits 0).

    Args:
        script: the benchmark's name, for the message.
        cuda_only: the benchmark needs MLX's CUDA backend.
    """
    from mlx_lily.backend import current_backend

    be = current_backend()
    if be == "cuda" or (be == "metal" and not cuda_only):
        return True
    need = "MLX's CUDA backend" if cuda_only else "a GPU backend (CUDA or Metal)"
    print(f"{script}: needs {need}, this process has '{be}'; nothing measured")
    return False

