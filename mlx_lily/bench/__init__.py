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

import contextlib
import os

__all__ = ["ab", "numerics", "primitives", "timeline", "gpu_or_explain", "env_override",
           "parse_arm_envs", "write_json"]


def write_json(out_dir, name: str, result):
    """Write ``result`` as ``out_dir/name`` (JSON, values it cannot encode as strings),
    creating the folder; returns the path. The benchmark scripts' ``--out``."""
    import json
    from pathlib import Path

    path = Path(out_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str))
    return path


@contextlib.contextmanager
def env_override(var: str | None, val: str | None = None):
    """``os.environ[var] = val`` inside the block (nothing when ``var`` is None), the
    previous value (or its absence) restored after: one benchmark arm under a switch."""
    if var is None:
        yield
        return
    prev = os.environ.get(var)
    os.environ[var] = val
    try:
        yield
    finally:
        if prev is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = prev


def parse_arm_envs(specs, taken=()) -> dict:
    """``--arm-env NAME:VAR=VALUE`` options as ``{NAME: (VAR, VALUE)}`` in order.

    Raises:
        ValueError: a spec without a name, a ``:`` or a ``=``, or a name already in
            ``taken`` or given twice.
    """
    out: dict = {}
    for spec in specs:
        name, sep, kv = spec.partition(":")
        var, eq, val = kv.partition("=")
        if not name or not sep or not eq or not var or name in taken or name in out:
            raise ValueError(f"--arm-env {spec!r}: want NAME:VAR=VALUE with a new arm name")
        out[name] = (var, val)
    return out


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

