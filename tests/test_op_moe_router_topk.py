"""moe_router_topk: reference vs stock mlx-lm routing, lowest-id tie-breaking, the
``lily_moe_router_topk`` kernel vs the reference on every parity backend (exact-arithmetic
routers, constructed ties, random production-width routers), dispatch, nvcc compile."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_lily import kernels
from mlx_lily.ops import moe_router_topk as R
from mlx_lily.qproj import QProj
from mlx_lily.testing.dispatch import count_kernel_launches, emulated_metal_dispatch
from mlx_lily.testing.backends import metal_emu_available, parity_backends
from mlx_lily.testing.cuda_check import nvcc_path

from mlx_lily.testing.cuda_emu import (
    HAS_EMU, KERNEL_BACKENDS, aligned_emu_buffers, kernel_for)

from _close import EPS, assert_close, binade
from _models import moe_block


@pytest.fixture(autouse=True)
def _aligned_emu_buffers(monkeypatch):
    yield from aligned_emu_buffers(monkeypatch)


def stock_routing(blk, x):
    """mlx-lm 0.32.2 ``Qwen3NextSparseMoeBlock.__call__`` routing lines."""
    gates = mx.softmax(blk.gate(x), axis=-1, precise=True)
    k = blk.top_k
    inds = mx.argpartition(gates, kth=-k, axis=-1)[..., -k:]
    scores = mx.take_along_axis(gates, inds, axis=-1)
    if blk.norm_topk_prob:
        scores = scores / scores.sum(axis=-1, keepdims=True)
    return inds, scores, mx.sigmoid(blk.shared_expert_gate(x))


# ------------------------------------------------------------------ reference
@pytest.mark.parametrize("norm", [True, False])
def test_reference_stock_tie_break_is_bit_identical_to_mlx_lm(norm):
    with mx.stream(mx.cpu):  # the dispatcher takes the reference path on the CPU
        _reference_stock(norm)


def _reference_stock(norm):
    blk = moe_block(seed=1, norm=norm)
    x = mx.random.normal((2, 3, 256)).astype(mx.bfloat16)
    want = stock_routing(blk, x)
    router = QProj.fuse([blk.gate, blk.shared_expert_gate])
    got = R.moe_router_topk_reference(x, router, blk.top_k, norm, tie_break="stock")
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and mx.array_equal(g, w).item()
    # The dispatcher on the CPU is this reference path.
    got = R.moe_router_topk(x, router, blk.top_k, norm)
    for g, w in zip(got, want):
        assert mx.array_equal(g, w).item()


def test_lowest_id_agrees_with_stock_without_ties():
    blk = moe_block(seed=2)
    router = QProj.fuse([blk.gate, blk.shared_expert_gate])
    x = mx.random.normal((64, 256)).astype(mx.bfloat16)
    ia, sa, ha = R.moe_router_topk_reference(x, router, 4, True, tie_break="lowest_id")
    ib, sb, hb = R.moe_router_topk_reference(x, router, 4, True, tie_break="stock")
    probs = mx.softmax(router(x)[0], axis=-1, precise=True).astype(mx.float32)
    srt = mx.sort(probs, axis=-1)
    tie = (srt[:, -4] == srt[:, -5])  # a tie at the k-th place: choice may differ
    same_set = mx.all(mx.sort(ia, -1) == mx.sort(ib, -1), axis=-1)
    assert bool(mx.all(same_set | tie).item())
    assert mx.array_equal(ha, hb).item()
    # lowest_id orders picks by decreasing probability
    p = mx.take_along_axis(probs, ia, axis=-1)
    assert bool(mx.all(p[:, :-1] >= p[:, 1:]).item())


def test_topk_lowest_id_ties():
    p = mx.array([[0.1, 0.3, 0.3, 0.2, 0.3, 0.05],
                  [0.2, 0.2, 0.2, 0.2, 0.2, 0.0]], dtype=mx.bfloat16)
    assert R.topk_lowest_id(p, 2).tolist() == [[1, 2], [0, 1]]
    assert R.topk_lowest_id(p, 4).tolist() == [[1, 2, 4, 3], [0, 1, 2, 3]]
    q = mx.zeros((1, 40), mx.float32).at[0, 33].add(1.0).at[0, 7].add(1.0)
    assert R.topk_lowest_id(q, 3).tolist() == [[7, 33, 0]]


def test_bad_tie_break_raises():
    blk = moe_block(seed=0)
    router = QProj.fuse([blk.gate, blk.shared_expert_gate])
    with pytest.raises(ValueError):
        R.moe_router_topk_reference(mx.zeros((1, 256), mx.bfloat16), router, 4, True,
                                    tie_break="random")


# ------------------------------------------------------------------ kernel parity
def exact_router(d, e, bits, has_shared, seed, tie_rows=()):
    """A quantized router whose logits are exact in fp32 whatever the summation order
    (power-of-two scales, integer codes, x on a 1/8 grid): kernel logits == truth.

    ``tie_rows``: (top_row, tied_rows): top_row gets the largest logit, the tied rows an
    identical second-largest one. Returns (QProj, fp32 dequantized weights [R, D], x grid
    generator)."""
    rng = np.random.default_rng(seed)
    r = e + (1 if has_shared else 0)
    hi = (1 << bits) - 1
    sign = None
    codes = rng.integers(0, hi + 1, size=(r, d))
    if tie_rows:
        top, tied = tie_rows
        sign = rng.integers(0, 2, size=d)
        best = np.where(sign == 1, hi, 0)
        second = best.copy()
        second[:8] = hi // 2
        codes[top] = best
        for t in tied:
            codes[t] = second
    words = np.zeros((r, d * bits // 32), np.uint32)
    per = 32 // bits
    for j in range(per):
        words |= (codes[:, j::per].astype(np.uint32) << np.uint32(bits * j))
    scale = 2.0 ** -(bits + 2)
    scales = mx.full((r, d // 64), scale, mx.bfloat16)
    biases = mx.full((r, d // 64), -(1 << (bits - 1)) * scale, mx.bfloat16)
    w = mx.array(words)
    sizes = (e, 1) if has_shared else (e,)
    proj = QProj(w, scales, biases, 64, bits, "affine", sizes)
    with mx.stream(mx.cpu):
        wf = mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32), 64, bits)
    return proj, wf, sign


def truth_router(wf, e, dtype):
    """Router callable with fp32-exact logits rounded to the activation dtype (computed
    on the CPU stream: no TF32 on a GPU)."""
    def f(x):
        with mx.stream(mx.cpu):
            y = (x.astype(mx.float32) @ wf.T).astype(dtype)
            return [y[..., :e], y[..., e:]] if wf.shape[0] > e else [y]
    return f


def reference_on_cpu(x, router, k, norm):
    """The lowest-id contract evaluated on the CPU stream (host libm-grade exp)."""
    with mx.stream(mx.cpu):
        out = R.moe_router_topk_reference(x, router, k, norm, tie_break="lowest_id")
        mx.eval(out)
        return out


def grid_x(shape, dtype, seed, sign=None):
    rng = np.random.default_rng(seed + 100)
    v = rng.integers(-4, 5, size=shape).astype(np.float32) * 0.125
    if sign is not None:
        v = np.abs(v) * np.where(sign == 1, 1.0, -1.0) + np.where(sign == 1, 0.125, -0.125)
    return mx.array(v).astype(dtype)


def assert_routing_equal(got, want, dtype, ulps=1):
    """Same expert ids; scores and shared gate within ``ulps`` ulps of ``dtype`` at each
    value (its exact spacing there)."""
    gi, gs, gh = got
    wi, ws, wh = want
    assert gi.dtype == mx.uint32 and gi.shape == wi.shape
    assert gi.tolist() == wi.astype(mx.uint32).tolist()
    assert gs.dtype == dtype
    assert_close(gs, ws, dtype=dtype, ulps=ulps, ulp_of=binade(ws), atol=1e-7, what="scores")
    if wh is None:
        assert gh is None
    else:
        assert_close(gh, wh, dtype=dtype, ulps=ulps, ulp_of=binade(wh), atol=1e-7,
                     what="shared gate")


EXACT = [  # (D, E, k, bits, has_shared, norm, rows, dtype)
    (256, 16, 4, 8, True, True, 3, mx.bfloat16),
    (2048, 256, 8, 8, True, True, 1, mx.bfloat16),  # production router (D, E, k, 8-bit)
    (256, 40, 1, 4, False, False, 2, mx.float16),   # E not a multiple of 32, no shared gate
    (128, 16, 5, 8, True, False, 2, mx.float32),
]


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("case", EXACT, ids=lambda c: "D{}-E{}-k{}-b{}-s{}-n{}-r{}".format(*c))
def test_kernel_matches_reference_exact_router(backend, case):
    d, e, k, bits, has_shared, norm, rows, dtype = case
    proj, wf, _ = exact_router(d, e, bits, has_shared, seed=d + e + k)
    x = grid_x((rows, d), dtype, seed=k)
    assert R.supports(x, proj, k)
    kern, init = kernel_for(R.SPEC, backend)
    got = R.launch(kern, x, proj, k, norm, init_value=init)
    want = reference_on_cpu(x, truth_router(wf, e, dtype), k, norm)
    assert_routing_equal(got, want, dtype)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_kernel_ties_go_to_lowest_id(backend):
    d, e, k = 256, 16, 3
    proj, wf, sign = exact_router(d, e, 8, True, seed=7, tie_rows=(11, (13, 4, 9, 2)))
    x = grid_x((2, d), mx.bfloat16, seed=7, sign=sign)
    logits = truth_router(wf, e, mx.bfloat16)(x)[0]
    srt = mx.sort(logits.astype(mx.float32), axis=-1)
    assert bool(mx.all(srt[:, -2] == srt[:, -5]).item())  # four-way tie for 2nd place
    assert bool(mx.all(srt[:, -1] > srt[:, -2]).item())
    kern, init = kernel_for(R.SPEC, backend)
    got = R.launch(kern, x, proj, k, True, init_value=init)
    assert got[0].tolist() == [[11, 2, 4], [11, 2, 4]]
    want = reference_on_cpu(x, truth_router(wf, e, mx.bfloat16), k, True)
    assert_routing_equal(got, want, mx.bfloat16)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("e,k", [(16, 4), (40, 8)])
def test_kernel_nan_rows_give_valid_ids(backend, e, k):
    """A row whose logits are NaN (a NaN or inf activation upstream) still gets k distinct
    ids in [0, E) and NaN scores; finite rows around it route as the reference does. An
    id past E would send the grouped MoE kernels' reads out of bounds."""
    d = 128
    proj, wf, _ = exact_router(d, e, 8, True, seed=e + k)
    x = np.array(grid_x((5, d), mx.float32, seed=3))
    x[1, 7] = np.nan
    x[3, :] = np.inf
    x = mx.array(x).astype(mx.bfloat16)
    kern, init = kernel_for(R.SPEC, backend)
    inds, scores, shared = R.launch(kern, x, proj, k, True, init_value=init)
    ids = np.array(inds)
    assert ids.max() < e
    for r in (1, 3):
        assert len(set(ids[r].tolist())) == k
        assert np.isnan(np.array(scores[r].astype(mx.float32))).all()
    keep = mx.array([0, 2, 4])
    want = reference_on_cpu(x[keep], truth_router(wf, e, mx.bfloat16), k, True)
    assert_routing_equal((inds[keep], scores[keep], shared[keep]), want, mx.bfloat16)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_kernel_random_router_production_width(backend):
    """Random 8-bit router at D=2048, E=256, k=8: the kernel's picks are a top-k of the
    fp32-truth probabilities (logits differ from truth only by summation order)."""
    mx.random.seed(21)
    d, e, k = 2048, 256, 8
    gate = nn.QuantizedLinear.from_linear(_linear(d, e), 64, 8)
    sg = nn.QuantizedLinear.from_linear(_linear(d, 1), 64, 8)
    proj = QProj.fuse([gate, sg])
    x = mx.random.normal((2, d)).astype(mx.bfloat16)
    kern, init = kernel_for(R.SPEC, backend)
    inds, scores, shared = R.launch(kern, x, proj, k, True, init_value=init)
    with mx.stream(mx.cpu):
        wf = mx.dequantize(proj.weight, proj.scales.astype(mx.float32),
                           proj.biases.astype(mx.float32), 64, 8)
        probs = mx.softmax(truth_router(wf, e, mx.bfloat16)(x)[0], axis=-1,
                           precise=True).astype(mx.float32)
    ti, ts, th = reference_on_cpu(x, truth_router(wf, e, mx.bfloat16), k, True)
    picked = mx.take_along_axis(probs, inds.astype(mx.int32), axis=-1)
    best = mx.take_along_axis(probs, ti.astype(mx.int32), axis=-1)
    assert len(set(inds[0].tolist())) == k and len(set(inds[1].tolist())) == k
    # same probability profile, up to one bf16 ulp where logits rounded differently
    assert_close(picked, best, dtype=mx.bfloat16, ulps=1, atol=1e-6, what="probabilities")
    assert_close(scores, ts, dtype=mx.bfloat16, ulps=2, atol=1e-6, what="scores")
    assert_close(shared, th, atol=EPS[mx.bfloat16], what="shared gate")


def _linear(d, o):
    lin = nn.Linear(d, o, bias=False)
    lin.weight = (mx.random.normal((o, d)) * d ** -0.5).astype(mx.bfloat16)
    return lin


# ------------------------------------------------------------------ dispatch
def test_supports(monkeypatch):
    blk = moe_block(seed=0)
    monkeypatch.setattr(R, "switch_on", lambda name, backend: False)  # batch_decode off
    router = QProj.fuse([blk.gate, blk.shared_expert_gate])
    x = mx.zeros((1, 1, 256), mx.bfloat16)
    assert R.supports(x, router, 4)
    assert not R.supports(x, lambda t: router(t), 4)  # unfused parts: reference
    assert not R.supports(x, router, 33)
    many = mx.zeros((R.MAX_ROWS + 1, 256), mx.bfloat16)
    assert not R.supports(many, router, 4)
    assert not R.supports(x.astype(mx.int32), router, 4)
    monkeypatch.setattr(R, "switch_on", lambda name, backend: name == R.BATCH_OP)
    assert R.supports(many, router, 4)  # batched decode on: any row count


@pytest.mark.skipif(not HAS_EMU, reason="Metal emulator unavailable")
def test_dispatcher_uses_kernel_on_gpu_backend(monkeypatch):
    emulated_metal_dispatch(monkeypatch, R)
    calls = count_kernel_launches(monkeypatch)
    monkeypatch.setattr(R, "row_limit", lambda backend: R.MAX_ROWS)  # batch_decode off
    proj, wf, _ = exact_router(256, 16, 8, True, seed=3)
    x = grid_x((1, 1, 256), mx.bfloat16, seed=3)
    got = R.moe_router_topk(x, proj, 4, True)
    assert calls == [R.SPEC.name]
    assert [a.shape for a in got] == [(1, 1, 4), (1, 1, 4), (1, 1, 1)]
    want = reference_on_cpu(x, truth_router(wf, 16, mx.bfloat16), 4, True)
    assert_routing_equal(got, want, mx.bfloat16)
    R.moe_router_topk(x, lambda t: proj(t), 4, True)  # not a QProj: reference
    assert calls == [R.SPEC.name]
    x3 = grid_x((1, R.MAX_ROWS + 1, 256), mx.bfloat16, seed=4)  # too many rows: reference
    R.moe_router_topk(x3, proj, 4, True)
    assert calls == [R.SPEC.name]
    got = R.moe_router_topk(x, proj, 4, True)  # cached plan
    assert calls == [R.SPEC.name] * 2
    assert_routing_equal(got, want, mx.bfloat16)
    monkeypatch.setattr(R, "row_limit", lambda backend: None)  # batch_decode on
    got3 = R.moe_router_topk(x3, proj, 4, True)
    assert calls == [R.SPEC.name] * 3, calls
    want3 = reference_on_cpu(x3, truth_router(wf, 16, mx.bfloat16), 4, True)
    assert_routing_equal(got3, want3, mx.bfloat16)


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc not installed")
def test_cuda_twin_compiles():
    from mlx_lily.testing import cuda_check

    head, body = kernels.cuda_parts("moe_router_topk")
    bf = mx.bfloat16
    cuda_check.check(
        "lily_moe_router_topk",
        [("x", bf, 2), ("w", mx.uint32, 2), ("scales", bf, 2), ("biases", bf, 2),
         ("hin", bf, 2), ("res", bf, 2), ("nw", bf, 1), ("eps", mx.float32, 1)],
        [("inds", mx.uint32), ("scores", bf), ("shared", bf), ("h", bf), ("xn", bf)],
        body, head,
        template=[("T", bf), ("S", bf), ("D", 2048), ("E", 256), ("K", 8), ("BITS", 8),
                  ("GS", 64), ("HAS_SHARED", True), ("NORM", True), ("NW", R.NW),
                  ("RPW", R.router_rpw(257, 2048, 8, backend="cuda")), ("PRE_NORM", True)])


@pytest.mark.skipif(not metal_emu_available(), reason="no clang >= 15 (ziglang) for the MSL lint")
def test_metal_twin_lints_with_small_inputs():
    from mlx_lily.testing import msl_lint

    msl_lint.lint_file(kernels.shader_path("metal", "moe_router_topk.metal")).raise_for_issues()


@pytest.mark.gpu
@pytest.mark.skipif(not any(b in parity_backends() for b in ("cuda", "metal")),
                    reason="no GPU backend")
def test_gpu_dispatcher_production_dims():
    """On the device: the dispatcher routes to the kernel, lowest-id contract holds."""
    mx.random.seed(31)
    d, e, k = 2048, 256, 8
    proj, wf, _ = exact_router(d, e, 8, True, seed=31)
    x = grid_x((1, 1, d), mx.bfloat16, seed=31)
    got = R.moe_router_topk(x, proj, k, True)
    want = reference_on_cpu(x, truth_router(wf, e, mx.bfloat16), k, True)
    assert_routing_equal(got, want, mx.bfloat16)


PRE_NORM_CASES = [  # (d, e, k, bits, has_shared, norm, rows, dtype)
    (256, 16, 4, 8, True, True, 1, mx.bfloat16),
    (2048, 256, 8, 8, True, True, 1, mx.bfloat16),   # production router
    (128, 16, 5, 4, False, False, 3, mx.float16),
]


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("case", PRE_NORM_CASES,
                         ids=lambda c: "D{}-E{}-k{}-b{}-s{}-n{}-r{}".format(*c))
def test_kernel_pre_norm(backend, case):
    """PRE_NORM: the add + RMSNorm computed in the router kernel. ``h`` is exact, ``xn``
    is ``add_rms_norm``'s row (up to one ulp where the sum of squares rounds otherwise),
    and the routing equals the plain kernel's on that very ``xn``."""
    from mlx_lily.ops.add_rms_norm import add_rms_norm_reference

    d, e, k, bits, has_shared, norm, rows, dtype = case
    mx.random.seed(d + e)
    parts = [nn.QuantizedLinear.from_linear(_linear(d, e), 64, bits)]
    if has_shared:
        parts.append(nn.QuantizedLinear.from_linear(_linear(d, 1), 64, bits))
    proj = QProj.fuse(parts)
    h0 = (mx.random.normal((rows, d)) * 2).astype(dtype)
    res = mx.random.normal((rows, d)).astype(dtype)
    nw = (1 + 0.1 * mx.random.normal((d,))).astype(dtype)
    kern, init = kernel_for(R.SPEC, backend)
    run = R.plan(kern, proj, h0.shape, dtype, k, norm, init_value=init, pre_norm=True)
    inds, scores, shared, h, xn = run(h0, res, nw, 1e-6)
    with mx.stream(mx.cpu):
        h_ref, xn_ref = add_rms_norm_reference(h0, res, nw, 1e-6)
    assert mx.array_equal(h, h_ref).item()
    assert_close(xn, xn_ref, dtype=dtype, ulps=1, atol=1e-6, max_diff_frac=0.01)
    want = R.launch(kern, xn, proj, k, norm, init_value=init)
    assert mx.array_equal(inds, want[0]).item() and mx.array_equal(scores, want[1]).item()
    if has_shared:
        assert mx.array_equal(shared, want[2]).item()
    else:
        assert shared is None and want[2] is None


def test_pending_dispatch_on_cpu_resolves_the_norm():
    """On the CPU ``moe_router_topk_pending`` resolves the norm and routes it with the
    reference (stock's answer); ``pending.h`` is the residual sum."""
    from mlx_lily.qproj import PendingNorm

    blk = moe_block(seed=3)
    from mlx_lily.patches.qwen3_next import prepare_moe

    prepare_moe(blk)
    mx.random.seed(4)
    h0 = mx.random.normal((1, 1, 256)).astype(mx.bfloat16)
    res = mx.random.normal((1, 1, 256)).astype(mx.bfloat16)
    nw = (1 + 0.1 * mx.random.normal((256,))).astype(mx.bfloat16)
    pending = PendingNorm(h0, res, nw, 1e-6)
    inds, scores, shared, x = R.moe_router_topk_pending(pending, blk._lily.router, 4, True)
    want_x = mx.fast.rms_norm(h0 + res, nw, 1e-6)
    assert mx.array_equal(x, want_x).item() and mx.array_equal(pending.h, h0 + res).item()
    wi, ws, wsh = R.moe_router_topk(want_x, blk._lily.router, 4, True)
    assert mx.array_equal(inds, wi).item() and mx.array_equal(scores, ws).item()


def test_supports_bounds_the_staged_row_bytes():
    """The router stages its row (plus the logits) in threadgroup memory: an fp32 row of
    8192 would exceed Apple's 32 KiB, a bf16 one does not."""
    for d, dt, ok in ((8192, mx.bfloat16, True), (8192, mx.float32, False)):
        gate = nn.QuantizedLinear.from_linear(_linear(d, 16), 64, 8)
        proj = QProj.fuse([gate])
        assert R.supports(mx.zeros((1, d), dt), proj, 4) is ok, (d, dt)


def test_router_rpw_caps_words_on_cuda_only():
    assert R.router_rpw(257, 2048, 8, backend="cuda") == 2  # 4 words per row
    assert R.router_rpw(257, 2048, 4, backend="cuda") == 4  # 2 words per row
    assert R.router_rpw(257, 2048, 8, backend="metal") == 9  # two passes, no cap


def test_supports_bounds_the_words_per_lane_on_cuda(monkeypatch):
    """On CUDA a lane holds a row's weight words in registers at 512 threads: an 8-bit
    row of 8192 (16 words per lane) would need 156 registers where 128 are allowed
    (nvcc 13); 4096 (8 words) and a 4-bit 8192 (8 words) fit. Other backends: no bound."""
    monkeypatch.setattr(R, "current_backend", lambda: "cuda")
    for d, bits, ok in ((8192, 8, False), (4096, 8, True), (8192, 4, True)):
        gate = nn.QuantizedLinear.from_linear(_linear(d, 16), 64, bits)
        proj = QProj.fuse([gate])
        assert R.supports(mx.zeros((1, d), mx.bfloat16), proj, 4) is ok, (d, bits)
    monkeypatch.setattr(R, "current_backend", lambda: "metal")
    gate = nn.QuantizedLinear.from_linear(_linear(8192, 16), 64, 8)
    assert R.supports(mx.zeros((1, 8192), mx.bfloat16), QProj.fuse([gate]), 4)
