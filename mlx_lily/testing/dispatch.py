"""Test helpers that steer the op dispatchers: serve an op's Metal kernels (or the whole
model's CUDA kernel bodies, ``emulated_cuda``) with the CPU emulator, and record which
kernel objects launch.

    from mlx_lily.testing.dispatch import count_kernel_launches, emulated_metal_dispatch

    def test_routes(monkeypatch):
        emulated_metal_dispatch(monkeypatch, qgemv_module)
        calls = count_kernel_launches(monkeypatch)
        ...
        assert calls == ["lily_qgemv"]
"""

from __future__ import annotations

import contextlib

import mlx.core as mx

from .. import kernels


def emulated_metal_dispatch(monkeypatch, *op_modules) -> None:
    """Make the dispatchers of ``op_modules`` (modules of ``mlx_lily.ops``) see a Metal
    backend whose ``mx.fast.metal_kernel`` is the emulator's; other ops stay on this
    machine's backend. Kernel objects built before are dropped."""
    from . import metal_emu

    monkeypatch.setattr(kernels, "_CACHE", {})
    monkeypatch.setattr(kernels, "_metal_ok", lambda: True)
    for m in op_modules:
        monkeypatch.setattr(m, "current_backend", lambda: "metal")
    monkeypatch.setattr(mx.fast, "metal_kernel", metal_emu.metal_kernel)


@contextlib.contextmanager
def emulated_metal():
    """Every Lily dispatcher sees the Metal backend, served by the CPU emulator's kernels,
    with every kernel allowed (``MLX_LILY_KERNELS=all``), no kill switch, no ahead-of-time
    compile and no compiled decode steps (the emulator evaluates a kernel's inputs on the
    host, which ``mx.compile`` forbids). Restores everything on exit."""
    import importlib

    import pytest

    from .. import backend, patching
    from ..ops import _MODULES
    from . import metal_emu

    with metal_emu.install(), pytest.MonkeyPatch.context() as mp:
        mods = [importlib.import_module(m.partition(":")[0]) for m in set(_MODULES.values())]
        emulated_metal_dispatch(mp, backend, *[m for m in mods if hasattr(m, "current_backend")])
        mp.setenv(kernels.KERNELS_ENV, "all")
        mp.delenv(backend.DISABLE_ENV, raising=False)
        mp.setattr(patching, "warmup", lambda model, prompt_len=8: 0.0)
        mp.setenv("MLX_LILY_COMPILE", "0")
        yield


class _CudaBodyOnEmulator:
    """A kernel object running a spec's CUDA body on the emulator (``cuda_emu.cuda_on_emu``),
    or, where the emulator cannot compile that body (PTX tensor-core or half2 intrinsics),
    the spec's Metal twin with the same launch (its name then joins ``twins``)."""

    def __init__(self, spec, twins: list):
        from .cuda_emu import cuda_on_emu

        self.spec, self.twins = spec, twins
        self.kernel, self.on_twin = cuda_on_emu(spec), False

    def __call__(self, **kw):
        from .backends import metal_kernel_factory
        from .metal_emu._kernel import MetalEmuCompileError

        try:
            return self.kernel(**kw)
        except MetalEmuCompileError:
            if self.on_twin:
                raise
            self.on_twin = True
            self.twins.append(self.spec.name)
            self.kernel = kernels.build(self.spec, "metal",
                                        factory=metal_kernel_factory("metal-emu"))
            return self.kernel(**kw)


#: CUDA's static shared memory per block, the emulator's limit under ``emulated_cuda``.
CUDA_STATIC_SHARED = 49152


@contextlib.contextmanager
def emulated_cuda():
    """``emulated_metal``'s twin for CUDA: every Lily dispatcher sees the CUDA backend
    (its launch shapes, CUDA-only ops such as ``moe_fused`` and ``gdn_proj``), each kernel's
    CUDA body run by the CPU emulator (``cuda_emu.cuda_on_emu``: the body's logic, not
    nvcc's code), every kernel allowed, no compiled decode steps (``decode_graph.uncompiled``
    builds them as plain functions when ``MLX_LILY_COMPILE=1`` is set inside). Bodies the
    emulator cannot compile (tensor-core PTX: the prefill attention, the grouped MoE GEMMs,
    the decode attention partial) run their Metal twins with the CUDA launch; yields the
    list their names are appended to. Shared memory is limited to ``CUDA_STATIC_SHARED``.
    Restores everything on exit."""
    import importlib

    import pytest

    from .. import backend, patching
    from ..ops import _MODULES
    from ..patches import decode_graph
    from . import metal_emu

    twins: list = []
    orig_build = kernels.build

    def build(spec, be, **kw):
        return _CudaBodyOnEmulator(spec, twins) if be == "cuda" else orig_build(spec, be, **kw)

    with metal_emu.install(), pytest.MonkeyPatch.context() as mp, decode_graph.uncompiled():
        mods = [importlib.import_module(m.partition(":")[0]) for m in set(_MODULES.values())]
        mp.setattr(kernels, "_CACHE", {})
        mp.setattr(kernels, "_cuda_ok", lambda: True)
        mp.setattr(kernels, "build", build)
        for m in (backend, *mods):
            if hasattr(m, "current_backend"):
                mp.setattr(m, "current_backend", lambda: "cuda")
        mp.setenv(kernels.KERNELS_ENV, "all")
        mp.delenv(backend.DISABLE_ENV, raising=False)
        mp.setenv("MLX_LILY_EMU_TG_MEM", str(CUDA_STATIC_SHARED))
        mp.setattr(patching, "warmup", lambda model, prompt_len=8: 0.0)
        mp.setenv("MLX_LILY_COMPILE", "0")
        decode_graph.drop_compiled_steps()
        try:
            yield twins
        finally:
            decode_graph.drop_compiled_steps()


def count_kernel_launches(monkeypatch) -> list:
    """Wrap ``kernels.get`` so every launch of a kernel object appends its kernel name to
    the returned list."""
    calls: list = []
    orig_get = kernels.get

    def get(spec, backend):
        k = orig_get(spec, backend)
        if k is None:
            return None

        def counted(**kw):
            calls.append(spec.name)
            return k(**kw)

        return counted

    monkeypatch.setattr(kernels, "get", get)
    return calls
