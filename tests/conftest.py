import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import mlx.core as mx  # noqa: E402

mx.set_default_device(mx.cpu) if not (mx.metal.is_available() or mx.cuda.is_available()) else None

# The tests exercise every kernel, not only those on by default (mlx_lily.kernels.VERIFIED).
os.environ.setdefault("MLX_LILY_KERNELS", "all")


@pytest.fixture(autouse=True)
def _no_leaked_patch():
    """Every test starts and ends unpatched, whatever it did."""
    import mlx_lily

    yield
    if mlx_lily.is_patched():
        mlx_lily.unpatch()


@pytest.fixture(scope="session")
def tiny_models():
    """Tiny random models of the three supported families (built once per session)."""
    import _models

    return {k: _models.build(k) for k in ("qwen3_5_moe", "qwen3_5", "qwen3_next")}
