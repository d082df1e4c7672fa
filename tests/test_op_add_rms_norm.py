"""add_rms_norm op: reference vs stock mlx-lm math, the fused kernel (Metal twin and CUDA
twin on the CPU emulator, real devices when present) vs a float64 oracle and the
reference, dispatcher routing, CUDA compile check."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import mlx.core as mx
import mlx.nn as nn

from mlx_lily import kernels as K
from mlx_lily.ops import add_rms_norm as A
from mlx_lily.testing.backends import metal_kernel_factory
from mlx_lily.testing.cuda_emu import cuda_on_emu
from test_op_gated_delta import KERNEL_BACKENDS, _case_id, _param, cached_nvcc_check

from _close import EPS, assert_close

BF = mx.bfloat16


def f32(x):
    return np.array(x.astype(mx.float32))


def make(shape, dtype=BF, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    D = shape[-1]
    x = mx.array(rng.standard_normal(shape).astype(np.float32) * scale).astype(dtype)
    r = mx.array(rng.standard_normal(shape).astype(np.float32) * scale).astype(dtype)
    w = mx.array((1.0 + 0.1 * rng.standard_normal(D)).astype(np.float32)).astype(dtype)
    return x, r, w


def _rnd(v, dtype):
    v = np.asarray(v, np.float32)
    if dtype == mx.float32:
        return v.astype(np.float64)
    if dtype == mx.float16:
        return v.astype(np.float16).astype(np.float64)
    u = v.view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


def oracle(x, r, w, eps):
    T = x.dtype
    h = _rnd(f32(x).astype(np.float32) + f32(r).astype(np.float32), T)
    rinv = 1.0 / np.sqrt((h * h).mean(-1, keepdims=True) + np.float32(eps))
    return h, _rnd(f32(w).astype(np.float64) * _rnd(h * rinv, T), T)


@functools.lru_cache(maxsize=None)
def _kernel(backend):
    if backend == "cuda":
        return K.build(A.SPEC, "cuda")
    if backend == "cuda-emu":
        return cuda_on_emu(A.SPEC)
    return K.build(A.SPEC, "metal", factory=metal_kernel_factory(backend))


def run(backend, x, r, w, eps):
    assert A.kernel_unsupported(x, r, w, eps) is None
    with mx.stream(mx.gpu if backend in ("metal", "cuda") else mx.cpu):
        init = float("nan") if backend in ("metal", "cuda") else None
        out = A.add_rms_norm_fused(x, r, w, eps, kernel=_kernel(backend), init_value=init)
        mx.eval(out)
    return out


@pytest.mark.parametrize("shape", [(1, 1, 2048), (3, 5, 2048), (7, 96), (2, 4096), (1, 64)])
def test_reference_is_stock(shape):
    """The reference is the stock decoder's ``h = x + r`` then ``nn.RMSNorm``."""
    x, r, w = make(shape, seed=len(shape))
    norm = nn.RMSNorm(shape[-1], eps=1e-6)
    norm.weight = w
    h, n = A.add_rms_norm_reference(x, r, w, 1e-6)
    np.testing.assert_array_equal(f32(h), f32(x + r))
    np.testing.assert_array_equal(f32(n), f32(norm(x + r)))


CASES = [
    dict(shape=(1, 1, 2048)),                 # decode row
    dict(shape=(2, 33, 2048), seed=1),        # prefill rows
    dict(shape=(5, 96), seed=2),              # D = 3 warps, E = 1
    dict(shape=(3, 8192), seed=3),            # E = 8, 1024 threads
    dict(shape=(2, 16384), seed=4),           # E = 16
    dict(shape=(4, 2048), dtype=mx.float16, seed=5),
    dict(shape=(4, 2048), dtype=mx.float32, seed=6),
    dict(shape=(3, 2048), seed=7, scale=300.0),   # large values: fp32 statistics
    dict(shape=(2, 2048), seed=8, slice=True),    # contiguous view with a row offset
]


@pytest.mark.parametrize("backend", [_param(b) for b in KERNEL_BACKENDS])
@pytest.mark.parametrize("case", CASES, ids=lambda c: _case_id(c))
def test_kernel(backend, case):
    case = dict(case)
    sliced = case.pop("slice", False)
    shape = case.pop("shape")
    dtype = case.get("dtype", BF)
    if sliced:
        x, r, w = make((shape[0] + 1,) + shape[1:], **case)
        x, r = x[1:], r[:-1]
    else:
        x, r, w = make(shape, **case)
    eps = 1e-6
    h, n = run(backend, x, r, w, eps)
    assert h.shape == x.shape and n.shape == x.shape and h.dtype == dtype
    oh, on = oracle(x, r, w, eps)
    np.testing.assert_array_equal(f32(h), oh.astype(np.float32))
    if dtype == mx.float32:
        assert_close(n, on, rtol=2e-6, atol=1e-6 * np.abs(on).max())
    else:  # one rounding to dtype (1 ulp; normals only), rarely any difference at all
        assert_close(n, on, dtype=dtype, ulps=1.01, ulp_of=np.maximum(np.abs(on), 2.0 ** -14),
                     max_diff_frac=0.01)
    rh, rn = A.add_rms_norm_reference(x, r, w, eps)
    np.testing.assert_array_equal(f32(h), f32(rh))
    # against the reference (its own rounding to dtype): 2 ulps of the largest value; in
    # fp32 (summation order only) 2 ** -9 of it
    rtol = 2 * EPS[dtype] if dtype != mx.float32 else 2.0 ** -9
    assert_close(n, rn, rtol=rtol, scale="max", atol=1e-6)


def test_unsupported_and_dispatch(monkeypatch):
    x, r, w = make((2, 2048))
    assert A.kernel_unsupported(x, r, w) is None
    assert A.kernel_unsupported(x, r.astype(mx.float16), w) == "dtypes"
    assert A.kernel_unsupported(x, r, w.astype(mx.float32)) == "dtypes"
    assert A.kernel_unsupported(x[:, :100], r[:, :100], w[:100]) == "width"
    assert A.kernel_unsupported(x, r[:1], w) == "shapes"
    assert not A.has_kernel("cpu")
    # CPU: the reference, bit for bit
    h, n = A.add_rms_norm(x, r, w, 1e-6)
    rh, rn = A.add_rms_norm_reference(x, r, w, 1e-6)
    np.testing.assert_array_equal(f32(n), f32(rn))
    # a kernel backend: qualifying calls go to the kernel, others to the reference
    calls = []
    monkeypatch.setattr(A, "current_backend", lambda: "cuda")
    monkeypatch.setattr(A._k, "get", lambda spec, backend: "K")
    monkeypatch.setattr(A, "add_rms_norm_fused", lambda *a, **k: calls.append(k["kernel"]) or "F")
    assert A.add_rms_norm(x, r, w, 1e-6) == "F"
    assert A.add_rms_norm(x, r.astype(mx.float32), w, 1e-6)[0].dtype == mx.float32
    assert calls == ["K"]


def test_cuda_body_compiles():
    head, body = K.cuda_parts("add_rms_norm")
    f = mx.float32
    for T, D, E in ((BF, 2048, 8), (mx.float16, 96, 1), (f, 2048, 8)):
        cached_nvcc_check(A.SPEC.name, [("x", T, 2), ("r", T, 2), ("w", T, 1), ("eps", f, 1)],
                          [("h", T), ("normed", T)], body, head,
                          [("T", T), ("D", D), ("E", E)])


def test_metal_body_lints():
    from mlx_lily.testing import msl_lint

    res = msl_lint.lint_file(K.shader_path("metal", "add_rms_norm.metal"))
    assert not res.issues, res.issues
