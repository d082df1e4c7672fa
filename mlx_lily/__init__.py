"""mlx-lily: Qwen3.5/3.6 hybrid-MoE kernels and a reversible patch of mlx-lm.

Importing this package is cheap: it imports neither MLX nor mlx-lm. The patch API
(`patch`, `unpatch`, `patched`, `is_patched`, `backend_info`) loads on first use.

    import mlx_lily
    from mlx_lm import load, generate
    mlx_lily.patch()                      # every Qwen3.5/3.6 model, loaded now or later
    model, tok = load("mlx-community/Qwen3.6-35B-A3B-4bit")
    print(generate(model, tok, "Hello"))
    mlx_lily.unpatch()                    # stock mlx-lm again
"""

__version__ = "0.1.0"

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

__all__ = ["__version__", *_LAZY]


def __dir__():
    return sorted(set(__all__) | {n for n in globals() if not n.startswith("_")})


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'mlx_lily' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(mod), name)
