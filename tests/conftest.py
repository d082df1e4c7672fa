import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import mlx.core as mx  # noqa: E402

mx.set_default_device(mx.cpu) if not (mx.metal.is_available() or mx.cuda.is_available()) else None

# The tests exercise every kernel, not only those on by default (mlx_lily.kernels.VERIFIED).
os.environ.setdefault("MLX_LILY_KERNELS", "all")
# ... and the patched forwards even where no kernel runs (the CPU: references through
# them), where patch() would otherwise step aside for mlx-lm's own code.
os.environ.setdefault("MLX_LILY_STEP_ASIDE", "0")


@pytest.fixture(autouse=True)
def _no_leaked_patch():
    """Every test starts and ends unpatched, whatever it did."""
    import mlx_lily

    yield
    if mlx_lily.is_patched():
        mlx_lily.unpatch()
    from mlx_lily import kernels

    kernels.clear_runtime_disabled()  # first-contact failures are per process
    kernels.forget_record()


@pytest.fixture(scope="session")
def tiny_models():
    """Tiny random models of the three supported families (built once per session)."""
    import _models

    return {k: _models.build(k) for k in ("qwen3_5_moe", "qwen3_5", "qwen3_next")}


# MLX's CUDA wheel on the lent H200 lacks CUDA's crt/mma.h, so MLX's own JIT of its
# sm90 quantized matmul (qmm_sm90_*) fails there for some small shapes (stock code the
# reference and the shared expert call, not a Lily kernel: Lily's shaders use inline PTX):
# such a test is reported as skipped, with the error's first line, instead of failed.
# Only that exact error counts: a RuntimeError (not an assertion carrying some process's
# stderr) from MLX's kernel compile naming a qmm_sm90 kernel and the missing header.
MLX_JIT_MISSING_HEADER = 'cannot open source file "crt/mma.h"'


def mlx_jit_missing_header(exc) -> bool:
    """Whether ``exc`` is MLX's own qmm_sm90 JIT failing for the missing crt/mma.h."""
    text = str(exc)
    return (type(exc) is RuntimeError and text.startswith("Failed to compile kernel")
            and MLX_JIT_MISSING_HEADER in text and "qmm_sm90" in text)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if (rep.when == "call" and rep.failed and call.excinfo is not None
            and mlx_jit_missing_header(call.excinfo.value)):
        first = str(call.excinfo.value).splitlines()[0][:200]
        rep.outcome = "skipped"
        rep.longrepr = (str(item.path), (item.location[1] or 0) + 1,
                        f"MLX's own CUDA JIT (qmm_sm90) cannot find crt/mma.h in this "
                        f"install: {first}")
