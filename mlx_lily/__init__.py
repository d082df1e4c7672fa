"""mlx-lily: Qwen3.5/3.6 hybrid-MoE kernels and a reversible patch of mlx-lm.

Importing this package is cheap: it imports neither MLX nor mlx-lm. The patch API
(`patch`, `unpatch`, `patched`, `is_patched`, `backend_info`) loads on first use.
Importing it sets ``MLX_USE_CUDA_GRAPHS=0`` (MLX's CUDA backend launches kernels directly
instead of through CUDA graphs; see ``_prefer_direct_launches``) unless that variable is
already set or ``MLX_LILY_CUDA_GRAPHS=keep``.

    import mlx_lily
    from mlx_lm import load, generate
    mlx_lily.patch()                      # every Qwen3.5/3.6 model, loaded now or later
    model, tok = load("mlx-community/Qwen3.6-35B-A3B-4bit")
    print(generate(model, tok, "Hello"))
    mlx_lily.unpatch()                    # stock mlx-lm again
"""

import os as _os

__version__ = "0.1.0"

#: ``MLX_LILY_CUDA_GRAPHS=keep`` leaves MLX's CUDA launch mode as it is.
CUDA_GRAPHS_ENV = "MLX_LILY_CUDA_GRAPHS"
#: MLX's own switch (``backend/cuda/device.cpp``), read once, at its first GPU evaluation.
MLX_CUDA_GRAPHS_ENV = "MLX_USE_CUDA_GRAPHS"


def _prefer_direct_launches() -> bool:
    """Set ``MLX_USE_CUDA_GRAPHS=0`` unless the user set it (or ``MLX_LILY_CUDA_GRAPHS=keep``).

    Why: a Lily decode step is ~290 kernel launches and runs at the host's dispatch speed;
    on the H200 (session 10, ``benchmarks/gpu/decode_timeline.py``) MLX's CUDA-graph
    building took ~3.5-5 ms of host time per step where direct launches took ~2.6-3.2.
    MLX reads the variable once, at its first GPU evaluation, so this runs at import
    (before a model is loaded); it applies to the whole process, stock mlx-lm included,
    and has no effect on Metal or the CPU. Returns True when it set the variable."""
    if _os.environ.get(CUDA_GRAPHS_ENV, "") == "keep" or MLX_CUDA_GRAPHS_ENV in _os.environ:
        return False
    _os.environ[MLX_CUDA_GRAPHS_ENV] = "0"
    return True


CUDA_GRAPHS_SET_BY_LILY = _prefer_direct_launches()

_LAZY = {
    "patch": "mlx_lily.patching",
    "unpatch": "mlx_lily.patching",
    "patched": "mlx_lily.patching",
    "is_patched": "mlx_lily.patching",
    "PatchHandle": "mlx_lily.patching",
    "prepare_model": "mlx_lily.patching",
    "supported_model_types": "mlx_lily.patching",
    "backend_info": "mlx_lily.backend",
    "current_backend": "mlx_lily.backend",
}

__all__ = ["__version__", "CUDA_GRAPHS_SET_BY_LILY", *_LAZY]


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'mlx_lily' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(mod), name)
