"""Test helpers that steer the op dispatchers: serve an op's Metal kernels with the CPU
emulator, and record which kernel objects launch.

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
