"""Which backends a kernel parity test can run here.

Op tests (``tests/test_op_*.py``) compare a kernel against the reference on
every backend this machine offers::

    from mlx_lily.testing.backends import parity_backends, metal_kernel_factory

    @pytest.mark.parametrize("backend", parity_backends())
    def test_my_op(backend):
        if backend == "reference":
            ...                                   # reference vs. itself / known values
        elif backend in ("metal", "metal-emu"):
            kernel = spec.kernel(metal_kernel_factory(backend))
            ...
        elif backend == "cuda":
            ...                                   # mx.fast.cuda_kernel twin

Backends:

* ``"reference"``: always (the pure-MLX ops implementation).
* ``"metal-emu"``: the CPU Metal emulator works here (clang >= 15 from the
  ``ziglang`` package, and a tiny emulated kernel gives the right answer).
* ``"metal"``: a tiny real ``mx.fast.metal_kernel`` runs and is correct.
* ``"cuda"``: a tiny real ``mx.fast.cuda_kernel`` runs and is correct.

Detection runs a kernel (not just imports) and is cached per process. Probes
run on the GPU stream explicitly, whatever the default device is.
"""

from __future__ import annotations

import functools
from typing import Callable

import mlx.core as mx

__all__ = [
    "cuda_available",
    "metal_available",
    "metal_emu_available",
    "metal_kernel_factory",
    "parity_backends",
]


@functools.lru_cache(maxsize=None)
def metal_available() -> bool:
    """True when a real Metal kernel runs here (checked once)."""
    try:
        if not mx.metal.is_available():
            return False
        k = mx.fast.metal_kernel(
            name="mlx_lily_probe_metal",
            input_names=["a"],
            output_names=["out"],
            source="uint i = thread_position_in_grid.x; out[i] = simd_sum(a[i]) + float(i);",
        )
        if type(k).__module__.startswith("mlx_lily."):
            return False  # the emulator is installed in place of mx.fast.metal_kernel
        out = k(
            inputs=[mx.ones((32,), dtype=mx.float32)],
            output_shapes=[(32,)],
            output_dtypes=[mx.float32],
            grid=(32, 1, 1),
            threadgroup=(32, 1, 1),
            stream=mx.gpu,
        )[0]
        mx.eval(out)
        return bool(mx.array_equal(out, mx.arange(32, dtype=mx.float32) + 32).item())
    except Exception:
        return False


@functools.lru_cache(maxsize=None)
def cuda_available() -> bool:
    """True when a real ``mx.fast.cuda_kernel`` runs here (checked once)."""
    try:
        if not hasattr(mx.fast, "cuda_kernel"):
            return False
        if hasattr(mx, "cuda") and not mx.cuda.is_available():
            return False
        k = mx.fast.cuda_kernel(
            name="mlx_lily_probe_cuda",
            input_names=["a"],
            output_names=["out"],
            source=(
                "int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
                "if (i < 32) out[i] = a[i] * 2.0f + float(i);\n"
            ),
        )
        out = k(
            inputs=[mx.ones((32,), dtype=mx.float32)],
            output_shapes=[(32,)],
            output_dtypes=[mx.float32],
            grid=(32, 1, 1),
            threadgroup=(32, 1, 1),
            stream=mx.gpu,
        )[0]
        mx.eval(out)
        return bool(mx.array_equal(out, mx.arange(32, dtype=mx.float32) + 2).item())
    except Exception:
        return False


def metal_emu_available() -> bool:
    """True when the CPU Metal emulator works here (checked once)."""
    try:
        from . import metal_emu
    except Exception:
        return False
    return metal_emu.available()


@functools.lru_cache(maxsize=None)
def _backends() -> tuple[str, ...]:
    out = ["reference"]
    if metal_emu_available():
        out.append("metal-emu")
    if metal_available():
        out.append("metal")
    if cuda_available():
        out.append("cuda")
    return tuple(out)


def parity_backends() -> list[str]:
    """Backends available for a kernel parity test: ``"reference"`` always, then
    ``"metal-emu"``, ``"metal"``, ``"cuda"`` where they work (cached)."""
    return list(_backends())


def metal_kernel_factory(backend: str, **emulator_options) -> Callable:
    """The ``metal_kernel`` constructor for ``backend``.

    ``"metal"`` gives ``mx.fast.metal_kernel``; ``"metal-emu"`` gives the
    emulator's (``emulator_options`` such as ``max_threads_per_threadgroup=896``
    or ``order="random"`` are bound to it).
    """
    if backend == "metal":
        if emulator_options:
            raise ValueError("emulator options only apply to the 'metal-emu' backend")
        return mx.fast.metal_kernel
    if backend == "metal-emu":
        from . import metal_emu

        if emulator_options:
            return functools.partial(metal_emu.metal_kernel, **emulator_options)
        return metal_emu.metal_kernel
    raise ValueError(f"no Metal kernel factory for backend {backend!r}")
