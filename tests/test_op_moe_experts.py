"""moe_experts: reference vs the stock mlx-lm MoE block, the decode kernels
(``lily_moe_gate_up`` + ``lily_moe_down``) vs an fp32 truth on every parity backend,
dispatch (decode kernels, grouped path, reference), nvcc compile, Metal lint."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_lily import config, kernels
from mlx_lily.ops import moe_experts as M
from mlx_lily.patches import layouts as L
from mlx_lily.testing.dispatch import count_kernel_launches, emulated_metal_dispatch
from mlx_lily.testing.backends import metal_emu_available, parity_backends
from mlx_lily.testing.cuda_check import nvcc_path

from mlx_lily.testing.cuda_emu import (
    HAS_EMU, KERNEL_BACKENDS, aligned_emu_buffers, kernel_for)

from _close import EPS, assert_close, f64
from _models import moe_block


@pytest.fixture(autouse=True)
def _aligned_emu_buffers(monkeypatch):
    yield from aligned_emu_buffers(monkeypatch)


def kernels_for(backend):
    """(gate_up kernel, down kernel, init_value) for a parity backend."""
    kg, init = kernel_for(M.GATE_UP_SPEC, backend)
    kd, _ = kernel_for(M.DOWN_SPEC, backend)
    return kg, kd, init


def route(blk, x):
    """mlx-lm's routing (stock lines)."""
    gates = mx.softmax(blk.gate(x), axis=-1, precise=True)
    k = blk.top_k
    inds = mx.argpartition(gates, kth=-k, axis=-1)[..., -k:]
    scores = mx.take_along_axis(gates, inds, axis=-1)
    scores = scores / scores.sum(axis=-1, keepdims=True)
    return inds, scores, mx.sigmoid(blk.shared_expert_gate(x))


def _deq(t, wts, idx=None):
    w, s, b = t
    if idx is not None:
        w, s, b = w[idx], s[idx], b[idx]
    return mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), wts.group_size,
                         wts.bits)


def truth(x, inds, scores, shared, wts, residual=None):
    """fp32 experts with the stock roundings kept (gate/up outputs and h rounded to the
    activation dtype); returns (y fp32, magnitude bound for fp32 summation error).
    Computed on the CPU stream (no TF32 on a GPU)."""
    with mx.stream(mx.cpu):
        out = _truth(x, inds, scores, shared, wts, residual)
        mx.eval(out)
        return out


def _truth(x, inds, scores, shared, wts, residual):
    dt = x.dtype
    rb = lambda a: a.astype(dt).astype(mx.float32)  # noqa: E731
    d = x.shape[-1]
    xf = x.astype(mx.float32).reshape(-1, d)
    n = xf.shape[0]
    k = inds.shape[-1]
    ind = inds.reshape(n, k)
    sc = scores.reshape(n, k).astype(mx.float32)
    sh = shared.reshape(n, 1).astype(mx.float32)
    out, mags = [], []
    for r in range(n):
        acc = mx.zeros((d,))
        mag = mx.zeros((d,))
        for j in range(k + 1):
            if j < k:
                e = ind[r, j]
                g_, u_, d_ = (_deq(t, wts, e) for t in (wts.gate, wts.up, wts.down))
                c = sc[r, j]
            else:
                g_, u_, d_ = (_deq(t, wts) for t in (wts.sgate, wts.sup, wts.sdown))
                c = sh[r, 0]
            g = rb(g_ @ xf[r])
            u = rb(u_ @ xf[r])
            h = rb(g * mx.sigmoid(g) * u)
            acc = acc + c * (d_ @ h)
            mag = mag + mx.abs(c) * (mx.abs(d_) @ mx.abs(h))
        out.append(acc)
        mags.append(mag)
    y = mx.stack(out).reshape(x.shape)
    if residual is not None:
        y = residual.astype(mx.float32) + rb(y)
    return y, mx.stack(mags).reshape(x.shape)


def check_close(y, t, mag, dtype):
    """``y`` against the fp32 truth ``t``: output rounding, fp32 summation-order error
    (``mag``: the sum of the terms' magnitudes) and a gate/up value landing on the other
    side of a rounding boundary of h (one ulp of one h element)."""
    assert y.shape == t.shape
    assert_close(y, t, dtype=dtype, ulps=1, ulp_of=abs(f64(t)) + f64(mag) / 32,
                 rtol=1e-5, scale=mag, atol=1e-6)


# ------------------------------------------------------------------ reference
def test_reference_is_bit_identical_to_stock_block():
    with mx.stream(mx.cpu):  # the dispatcher takes the reference path on the CPU
        _reference_vs_stock()


def _reference_vs_stock():
    blk = moe_block(seed=1)
    x = mx.random.normal((2, 3, 256)).astype(mx.bfloat16)
    inds, scores, shared = route(blk, x)
    y = M.moe_experts_reference(x, inds, scores, blk.switch_mlp, blk.shared_expert, shared)
    assert y.dtype == mx.bfloat16 and mx.array_equal(y, blk(x)).item()
    # CPU dispatcher: reference path; residual variant adds in the activation dtype
    r = mx.random.normal((2, 3, 256)).astype(mx.bfloat16)
    y2 = M.moe_experts(x, inds, scores, L.experts(blk.switch_mlp, blk.shared_expert), shared,
                       residual=r)
    assert mx.array_equal(y2, r + blk(x)).item()


def test_decode_weights_layouts():
    blk = moe_block(seed=0)
    wts = L.decode_weights(blk.switch_mlp, blk.shared_expert)
    assert wts is not None and (wts.num_experts, wts.hidden, wts.inter) == (16, 256, 128)
    assert L.decode_weights(blk.switch_mlp, None) is None
    blk2 = moe_block(seed=0, d=320)  # 10 words per row: no lane mapping
    assert L.decode_weights(blk2.switch_mlp, blk2.shared_expert) is None
    from mlx_lm.models import qwen3_next
    raw = qwen3_next.Qwen3NextMLP(256, 128)  # not quantized
    assert L.decode_weights(blk.switch_mlp, raw) is None


def test_experts_cached_per_weights():
    """``layouts.experts``: the arrays and plans are derived once per set of weight arrays;
    replacing an expert array or the shared expert, or ``drop_plans``, derives them again
    (empty plans)."""
    blk = moe_block(seed=0)
    ex = L.experts(blk.switch_mlp, blk.shared_expert)
    assert ex.decode is not None and not isinstance(ex.grouped, str)
    assert ex.routed is blk.switch_mlp and ex.shared_mlp is blk.shared_expert
    ex.plans["decode"] = {"k": "v"}
    again = L.experts(blk.switch_mlp, blk.shared_expert)
    assert again.plans is ex.plans and again.decode is ex.decode
    blk.switch_mlp.up_proj.weight = mx.array(blk.switch_mlp.up_proj.weight)
    ex2 = L.experts(blk.switch_mlp, blk.shared_expert)
    assert ex2.plans == {} and ex2.decode.up[0] is not ex.decode.up[0]
    no_shared = L.experts(blk.switch_mlp, None)
    assert no_shared.decode is None and no_shared.shared_rows is None
    assert no_shared.plans is not ex2.plans
    ex3 = L.experts(blk.switch_mlp, blk.shared_expert)
    ex3.plans["decode"] = {"k": "v"}
    assert L.experts(blk.switch_mlp, blk.shared_expert).plans is ex3.plans
    L.drop_plans(blk.switch_mlp)
    assert L.experts(blk.switch_mlp, blk.shared_expert).plans == {}


# ------------------------------------------------------------------ kernel parity
CASES = [  # (D, I, E, k, rows, bits, gs, dtype, residual)
    (256, 128, 16, 4, 1, 4, 64, mx.bfloat16, False),
    (256, 128, 16, 4, 3, 4, 64, mx.bfloat16, True),
    (2048, 512, 6, 2, 1, 4, 64, mx.bfloat16, True),   # production D and I
    (128, 64, 5, 3, 2, 4, 32, mx.float16, False),     # odd E and k, 2-4 lanes per row
    (256, 128, 8, 8, 2, 8, 128, mx.float32, False),   # 8-bit experts, group 128
]


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("case", CASES,
                         ids=lambda c: "D{}-I{}-E{}-k{}-n{}-b{}-g{}-{}-r{}".format(
                             *c[:7], str(c[7]).split(".")[-1], int(c[8])))
def test_decode_kernels_match_truth(backend, case):
    d, i, e, k, rows, bits, gs, dtype, use_res = case
    blk = moe_block(d=d, e=e, k=k, i=i, seed=d + i + e + k, bits=bits, gs=gs, dtype=dtype)
    x = mx.random.normal((rows, 1, d)).astype(dtype)
    inds, scores, shared = route(blk, x)
    res = mx.random.normal(x.shape).astype(dtype) if use_res else None
    wts = L.decode_weights(blk.switch_mlp, blk.shared_expert)
    assert M.supports_decode(x, inds, scores, shared, wts, res)
    kg, kd, init = kernels_for(backend)
    y = M.launch_decode(kg, kd, x, inds, scores, shared, wts, res, init_value=init)
    assert y.dtype == dtype and y.shape == x.shape
    t, mag = truth(x, inds, scores, shared, wts, res)
    check_close(y, t, mag, dtype)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("shape_of", sorted(M.GATE_UP_SHAPE))
@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[3]],
                         ids=["small-res", "production-DI", "odd-Ek"])
def test_decode_kernels_each_backends_launch_shape(backend, shape_of, case):
    """Every backend's launch shapes (``launch_shapes``) on every parity backend: the
    emulators otherwise run the shape of the backend they pose as."""
    d, i, e, k, rows, bits, gs, dtype, use_res = case
    blk = moe_block(d=d, e=e, k=k, i=i, seed=d + i + e + k + 1, bits=bits, gs=gs, dtype=dtype)
    x = mx.random.normal((rows, 1, d)).astype(dtype)
    inds, scores, shared = route(blk, x)
    res = mx.random.normal(x.shape).astype(dtype) if use_res else None
    wts = L.decode_weights(blk.switch_mlp, blk.shared_expert)
    gu, dn = M.launch_shapes(shape_of)
    kg, kd, init = kernels_for(backend)
    y = M.launch_decode(kg, kd, x, inds, scores, shared, wts, res, init_value=init,
                        gate_up=gu, down=dn)
    t, mag = truth(x, inds, scores, shared, wts, res)
    check_close(y, t, mag, dtype)


def test_launch_shapes_per_backend():
    assert M.launch_shapes("cuda") == (M.GATE_UP_SHAPE["cuda"], M.DOWN_SHAPE["cuda"])
    assert M.launch_shapes("cpu") == M.launch_shapes("metal")


def test_fit_launch_shapes_register_budget():
    """CUDA: the production dims keep the tuned shapes; larger I or D lower RPW until the
    register estimate fits the launch (nvcc 13 counts: down at I=4096, RPW 2 needed 240
    registers where 384 threads allow 170); what cannot fit goes to the reference; Metal
    keeps its shapes."""
    gu, dn = M.launch_shapes("cuda")
    assert M.fit_launch_shapes(2048, 512, 8, 4, "cuda") == (gu, dn)
    assert M.fit_launch_shapes(2048, 4096, 8, 4, "cuda") == (gu, (dn[0], 1, dn[2]))
    assert M.fit_launch_shapes(4096, 512, 8, 4, "cuda")[0] == (gu[0], gu[1] // 2)
    assert M.fit_launch_shapes(2048, 2048, 10, 8, "cuda") is None
    assert M.fit_launch_shapes(2048, 2048, 10, 8, "metal") == M.launch_shapes("metal")
    assert M.fit_launch_shapes(2048, 100, 8, 4, "cuda") is None  # I maps onto no lanes
    for d, i, k, bits in ((2048, 512, 8, 4), (2048, 4096, 8, 4), (4096, 512, 8, 4)):
        (nw, rpw), (nwd, rpwd, sl) = M.fit_launch_shapes(d, i, k, bits, "cuda")
        assert M._fits("gate_up", M._lane_words(d, bits, rpw, 2), 32 * nw)
        assert M._fits("down", M._lane_words(i, bits, rpwd, -(-(k + 1) // sl)), 32 * nwd * sl)
    # the model against nvcc 13's counts: production gate+up 16 words 166 registers,
    # down 6 words 94 at 384 threads, router-free shapes over the budget rejected
    assert M._lane_words(2048, 4, 4, 2) == 16 and M._fits("gate_up", 16, 128)
    assert M._lane_words(512, 4, 2, 3) == 6 and M._fits("down", 6, 384)
    assert not M._fits("down", M._lane_words(4096, 4, 2, 3), 384)


def test_supports_decode_needs_a_fitting_shape(monkeypatch):
    blk = moe_block()
    wts = L.decode_weights(blk.switch_mlp, blk.shared_expert)
    x = mx.zeros((1, 1, 256), dtype=mx.bfloat16)
    inds = mx.zeros((1, 1, 4), dtype=mx.uint32)
    scores = mx.zeros((1, 1, 4), dtype=mx.bfloat16)
    shared = mx.zeros((1, 1, 1), dtype=mx.bfloat16)
    assert M.supports_decode(x, inds, scores, shared, wts)
    monkeypatch.setattr(M, "fit_launch_shapes", lambda *a, **k: None)
    assert not M.supports_decode(x, inds, scores, shared, wts)


def test_decode_plan_rejects_bad_launch_shapes():
    blk = moe_block()
    wts = L.decode_weights(blk.switch_mlp, blk.shared_expert)
    kg, kd, _ = kernels_for(KERNEL_BACKENDS[0])
    for gu, dn in (((4, 4), (4, 2, 0)), ((4, 4), (8, 2, 8)), ((0, 4), (4, 2)),
                   ((4, 0), (4, 2)), ((64, 1), (4, 2))):
        with pytest.raises(ValueError, match="launch shape"):
            M.decode_plan(kg, kd, wts, (1, 1, 256), mx.bfloat16, 4, False, gate_up=gu,
                          down=dn)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_decode_kernels_int32_inds_and_repeated_experts(backend):
    """int32 ids are accepted; the same expert twice in a row's picks counts twice."""
    blk = moe_block(seed=4)
    x = mx.random.normal((1, 256)).astype(mx.bfloat16)
    inds = mx.array([[3, 3, 15, 0]], dtype=mx.int32)
    scores = mx.array([[0.4, 0.3, 0.2, 0.1]], dtype=mx.bfloat16)
    shared = mx.array([[0.7]], dtype=mx.bfloat16)
    wts = L.decode_weights(blk.switch_mlp, blk.shared_expert)
    kg, kd, init = kernels_for(backend)
    y = M.launch_decode(kg, kd, x, inds, scores, shared, wts, init_value=init)
    t, mag = truth(x, inds, scores, shared, wts)
    check_close(y, t, mag, mx.bfloat16)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_parity_check_can_fail(backend):
    blk = moe_block(seed=5)
    x = mx.random.normal((1, 256)).astype(mx.bfloat16)
    inds, scores, shared = route(blk, x)
    wts = L.decode_weights(blk.switch_mlp, blk.shared_expert)
    kg, kd, init = kernels_for(backend)
    y = M.launch_decode(kg, kd, x, inds, scores, shared, wts, init_value=init)
    wrong = mx.concatenate([scores[:, :1] * 1.1, scores[:, 1:]], axis=-1)
    t, mag = truth(x, inds, wrong, shared, wts)
    with pytest.raises(AssertionError):
        check_close(y, t, mag, mx.bfloat16)


# ------------------------------------------------------------------ dispatch
@pytest.mark.skipif(not HAS_EMU, reason="Metal emulator unavailable")
def test_dispatcher_routes_by_rows(monkeypatch):
    emulated_metal_dispatch(monkeypatch, M)
    calls = count_kernel_launches(monkeypatch)
    decode = [M.GATE_UP_SPEC.name, M.DOWN_SPEC.name]
    grouped = []
    try:
        from mlx_lily.ops import moe_grouped
        monkeypatch.setattr(moe_grouped, "try_grouped",
                            lambda *a, **kw: grouped.append((a[0].shape, kw)) or None)
    except ImportError:
        moe_grouped = None
    blk = moe_block(seed=6)
    x = mx.random.normal((1, 1, 256)).astype(mx.bfloat16)
    inds, scores, shared = route(blk, x)
    y = M.moe_experts(x, inds, scores, L.experts(blk.switch_mlp, blk.shared_expert), shared)
    assert calls == decode
    wts = L.decode_weights(blk.switch_mlp, blk.shared_expert)
    t, mag = truth(x, inds, scores, shared, wts)
    check_close(y, t, mag, mx.bfloat16)
    # residual variant through the dispatcher
    r = mx.random.normal(x.shape).astype(mx.bfloat16)
    y = M.moe_experts(x, inds, scores, L.experts(blk.switch_mlp, blk.shared_expert), shared, r)
    t, mag = truth(x, inds, scores, shared, wts, r)
    check_close(y, t, mag, mx.bfloat16)
    # many rows: grouped path asked (returns None here), then the reference
    xb = mx.random.normal((1, M.MAX_DECODE_ROWS + 1, 256)).astype(mx.bfloat16)
    ib, sb, hb = route(blk, xb)
    yb = M.moe_experts(xb, ib, sb, L.experts(blk.switch_mlp, blk.shared_expert), hb)
    assert calls == decode * 2
    if moe_grouped is not None:
        assert grouped == [(xb.shape, {"min_pairs": 1})]
    # a 5-token prefill chunk [1, 5, D]: the grouped path at any pair count, never the
    # decode kernels (the same path the prompt's rows take inside a batch); 5 one-token
    # rows [5, 1, D] (a decode step of 5 sequences) take the decode kernels
    xp = mx.random.normal((1, 5, 256)).astype(mx.bfloat16)
    ip, sp, hp = route(blk, xp)
    M.moe_experts(xp, ip, sp, L.experts(blk.switch_mlp, blk.shared_expert), hp)
    assert calls == decode * 2
    if moe_grouped is not None:
        assert grouped[-1] == (xp.shape, {"min_pairs": 1})
        assert ip.size < moe_grouped.MIN_PAIRS  # below the many-row minimum
    xd = mx.random.normal((5, 1, 256)).astype(mx.bfloat16)
    idd, sd, hd = route(blk, xd)
    yd = M.moe_experts(xd, idd, sd, L.experts(blk.switch_mlp, blk.shared_expert), hd)
    assert calls == decode * 3
    assert len(grouped) == 2
    t, mag = truth(xd, idd, sd, hd, wts)
    check_close(yd, t, mag, mx.bfloat16)
    assert mx.array_equal(yb, blk(xb)).item()
    # no shared expert: reference
    M.moe_experts(x, inds, scores, L.experts(blk.switch_mlp, None), None)
    assert calls == decode * 3


@pytest.mark.skipif(not HAS_EMU, reason="Metal emulator unavailable")
def test_dispatcher_prefill_chunk_runs_the_grouped_gemm_at_few_pairs(monkeypatch):
    """Unmocked: a 5-token prefill chunk (20 (token, expert) pairs, below ``MIN_PAIRS``)
    runs the grouped GEMM's kernels on the emulator, not the decode kernels, and passes
    the grouped op's own parity check (``test_op_moe_grouped.check``: against the
    reference, and against ``mimic``, the grouped GEMM's roundings: h and each expert's
    output rounded to bf16). Measured: 0.008 of the max from ``mimic`` at 20 pairs,
    0.005-0.007 at 64-256: few pairs are no less accurate. (The decode kernels' ``truth``
    keeps other roundings: the grouped result sits 0.027 from it, the reference 0.036.)"""
    from test_op_moe_grouped import check as grouped_check

    from mlx_lily.ops import moe_grouped, moe_route

    emulated_metal_dispatch(monkeypatch, M, moe_grouped, moe_route)
    calls = count_kernel_launches(monkeypatch)
    blk = moe_block(seed=6)
    xp = mx.random.normal((1, 5, 256)).astype(mx.bfloat16)
    ip, sp, hp = route(blk, xp)
    assert ip.size < moe_grouped.MIN_PAIRS
    y = M.moe_experts(xp, ip, sp, L.experts(blk.switch_mlp, blk.shared_expert), hp)
    mx.eval(y)
    assert M.GATE_UP_SPEC.name not in calls and M.DOWN_SPEC.name not in calls
    assert {moe_grouped.GATE_UP.name, moe_grouped.DOWN.name} <= set(calls) or \
        {moe_grouped.GATE_UP_COOP.name, moe_grouped.DOWN_COOP.name} <= set(calls), calls
    grouped_check(y, xp, ip, sp, blk.switch_mlp, blk.shared_expert, hp)


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc not installed")
@pytest.mark.parametrize("which", ["gate_up", "gate_up_routed", "down_res"])
def test_cuda_twins_compile(which):
    from mlx_lily.testing import cuda_check

    bf = mx.bfloat16
    common = [("T", bf), ("S", bf), ("D", 2048), ("I", 512), ("K", 8), ("E", 256),
              ("BITS", 4), ("GS", 64)]
    if which.startswith("gate_up"):
        head, body = kernels.cuda_parts("moe_gate_up")
        ins = [("x", bf, 2), ("inds", mx.uint32, 2)]
        for p in ("gate", "up"):
            ins += [(f"{p}_w", mx.uint32, 3), (f"{p}_s", bf, 3), (f"{p}_b", bf, 3)]
        for p in ("sgate", "sup"):
            ins += [(f"{p}_w", mx.uint32, 2), (f"{p}_s", bf, 2), (f"{p}_b", bf, 2)]
        ins += [("logits", bf, 2), ("hin", bf, 2), ("res", bf, 2), ("nw", bf, 1),
                ("eps", mx.float32, 1)]
        routed = which == "gate_up_routed"
        cuda_check.check("lily_moe_gate_up", ins,
                         [("h", bf), ("inds_o", mx.uint32), ("scores_o", bf),
                          ("shared_o", bf)], body, head,
                         template=common + [("NW", M.GATE_UP_SHAPE["cuda"][0]),
                                            ("RPW", M.GATE_UP_SHAPE["cuda"][1]),
                                            ("TOPK", routed), ("NORM", True),
                                            ("PRE_NORM", routed)])
    else:
        head, body = kernels.cuda_parts("moe_down")
        ins = [("h", bf, 3), ("inds", mx.uint32, 2), ("scores", bf, 2), ("shared", bf, 2),
               ("down_w", mx.uint32, 3), ("down_s", bf, 3), ("down_b", bf, 3),
               ("sdown_w", mx.uint32, 2), ("sdown_s", bf, 2), ("sdown_b", bf, 2),
               ("res", bf, 2)]
        cuda_check.check("lily_moe_down", ins, [("y", bf)], body, head,
                         template=common + [("NW", M.DOWN_SHAPE["cuda"][0]),
                                            ("RPW", M.DOWN_SHAPE["cuda"][1]),
                                            ("SL", M.DOWN_SHAPE["cuda"][2]),
                                            ("RES", True)])


@pytest.mark.skipif(not metal_emu_available(), reason="no clang >= 15 (ziglang) for the MSL lint")
@pytest.mark.parametrize("stem,small", [("moe_gate_up", {"inds", "eps"}),
                                        ("moe_down", {"inds", "scores", "shared", "res"})])
def test_metal_twins_lint(stem, small):
    """MSL address-space typing, also with the per-row inputs in ``constant`` memory
    (fewer than 8 elements at decode)."""
    from mlx_lily.testing import msl_lint

    spec = msl_lint.parse_body_file(kernels.shader_path("metal", f"{stem}.metal"))
    for kinds, tmpl in [(k, t) for t in spec.templates
                        for k in ([k for _, _, k in spec.inputs],
                                  ["small" if n in small else k
                                   for n, _, k in spec.inputs])]:
        r = msl_lint.lint_metal_source(
            spec.body, spec.header, spec.input_names, spec.output_names,
            tmpl, name=spec.name,
            input_dtypes=[dt for _, dt, _ in spec.inputs], input_kinds=kinds,
            output_dtypes=[dt for _, dt in spec.outputs])
        r.raise_for_issues()


@pytest.mark.gpu
@pytest.mark.skipif(not any(b in parity_backends() for b in ("cuda", "metal")),
                    reason="no GPU backend")
def test_gpu_production_dims():
    """Production layer (D=2048, I=512, E=256, k=8) on the device, through the
    dispatcher, with and without the residual."""
    blk = moe_block(d=2048, i=512, e=256, k=8, seed=41)
    x = mx.random.normal((1, 1, 2048)).astype(mx.bfloat16)
    inds, scores, shared = route(blk, x)
    wts = L.decode_weights(blk.switch_mlp, blk.shared_expert)
    for res in (None, mx.random.normal(x.shape).astype(mx.bfloat16)):
        y = M.moe_experts(x, inds, scores, L.experts(blk.switch_mlp, blk.shared_expert), shared,
                          res)
        t, mag = truth(x, inds, scores, shared, wts, res)
        check_close(y, t, mag, mx.bfloat16)


# ------------------------------------------------------------------ routing in gate+up
ROUTED_CASES = [  # (D, I, E, k, rows, bits, gs, dtype, pre_norm)
    (256, 128, 16, 4, 1, 4, 64, mx.bfloat16, False),
    (256, 128, 16, 4, 1, 4, 64, mx.bfloat16, True),
    (2048, 512, 33, 8, 2, 4, 64, mx.bfloat16, True),   # production D, I, k; E past 32 lanes
    (128, 64, 5, 3, 2, 4, 32, mx.float16, False),      # odd E and k
    (256, 128, 8, 8, 1, 8, 128, mx.float32, True),     # k = E, 8-bit experts
]


def _fused_router(blk):
    from mlx_lily.qproj import QProj

    return QProj.fuse([blk.gate, blk.shared_expert_gate])


def _route_ref(x, router, k):
    from mlx_lily.ops.moe_router_topk import moe_router_topk_reference

    with mx.stream(mx.cpu):
        out = moe_router_topk_reference(x, router, k, True, tie_break="lowest_id")
        mx.eval(out)
    return out


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("shape_of", sorted(M.GATE_UP_SHAPE))
@pytest.mark.parametrize("case", ROUTED_CASES,
                         ids=lambda c: "D{}-I{}-E{}-k{}-n{}-b{}-g{}-{}-pre{}".format(
                             *c[:7], str(c[7]).split(".")[-1], int(c[8])))
def test_routed_decode_matches_router_and_truth(backend, shape_of, case):
    """TOPK (and PRE_NORM) gate+up: the routing it writes equals the router reference
    (ties to the lowest id) on the same logits, and y equals the fp32 truth for it; at
    every backend's launch shapes (``launch_shapes``) on every parity backend."""
    from mlx_lily.ops.add_rms_norm import add_rms_norm_reference

    d, i, e, k, rows, bits, gs, dtype, pre = case
    blk = moe_block(d=d, e=e, k=k, i=i, seed=d + e + k + 7, bits=bits, gs=gs, dtype=dtype)
    router = _fused_router(blk)
    wts = L.decode_weights(blk.switch_mlp, blk.shared_expert)
    kg, kd, init = kernels_for(backend)
    hin = mx.random.normal((rows, 1, d)).astype(dtype)
    res = mx.random.normal((rows, 1, d)).astype(dtype)
    nw = (1.0 + 0.1 * mx.random.normal((d,))).astype(dtype)
    eps = 1e-6
    with mx.stream(mx.cpu):
        x = add_rms_norm_reference(hin, res, nw, eps)[1] if pre else hin
        (logits,) = router(x, split=False)
        mx.eval(x, logits)
    assert M.routed_supported(router, k, wts, x.shape, dtype)
    gu, dn = M.launch_shapes(shape_of)
    run = M.decode_plan(kg, kd, wts, x.shape, dtype, k, False, topk=True,
                        norm_topk_prob=True, pre_norm=pre, init_value=init,
                        gate_up=gu, down=dn)
    args = (hin, res, nw, eps, logits) if pre else (x, logits)
    y, inds, scores, shared = run(*args)
    r_inds, r_scores, r_shared = _route_ref(x, router, k)
    assert inds.shape == r_inds.shape and mx.array_equal(inds, r_inds).item()
    assert_close(scores, r_scores, dtype=dtype, ulps=2, what="scores")
    assert shared.dtype == dtype
    assert_close(shared, r_shared, rtol=EPS[mx.bfloat16] if dtype == mx.bfloat16 else 1e-3, atol=1e-8,
                 what="shared gate")
    t, mag = truth(x, r_inds, r_scores, shared, wts)
    check_close(y, t, mag, dtype)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_routed_parity_check_can_fail(backend):
    """A wrong norm weight in the kernel's PRE_NORM row is caught by the same checks."""
    from mlx_lily.ops.add_rms_norm import add_rms_norm_reference

    blk = moe_block(seed=9)
    router = _fused_router(blk)
    wts = L.decode_weights(blk.switch_mlp, blk.shared_expert)
    kg, kd, init = kernels_for(backend)
    hin = mx.random.normal((1, 1, 256)).astype(mx.bfloat16)
    res = mx.random.normal((1, 1, 256)).astype(mx.bfloat16)
    nw = mx.ones((256,), mx.bfloat16)
    with mx.stream(mx.cpu):
        x = add_rms_norm_reference(hin, res, nw, 1e-6)[1]
        (logits,) = router(x, split=False)
        mx.eval(x, logits)
    run = M.decode_plan(kg, kd, wts, x.shape, mx.bfloat16, 4, False, topk=True,
                        pre_norm=True, init_value=init)
    y, inds, scores, shared = run(hin, res, nw * 1.5, 1e-6, logits)  # wrong weight
    t, mag = truth(x, inds, scores, shared, wts)
    with pytest.raises(AssertionError):
        check_close(y, t, mag, mx.bfloat16)


@pytest.mark.skipif(not HAS_EMU, reason="Metal emulator unavailable")
def test_routed_dispatcher(monkeypatch):
    """``moe_experts_routed``: a plain row and a ``PendingNorm`` (norm folded into the
    router GEMV, then again in gate+up) give the kernel path's result with three launches;
    the switch, a router without the shared gate, and too many rows return None."""
    from mlx_lily import backend as B
    from mlx_lily.ops import norm_qgemv, qgemv
    from mlx_lily.ops.add_rms_norm import add_rms_norm_reference
    from mlx_lily.qproj import PendingNorm, QProj

    emulated_metal_dispatch(monkeypatch, M, qgemv, norm_qgemv)
    monkeypatch.setenv("MLX_LILY_KERNELS", "all")
    calls = count_kernel_launches(monkeypatch)
    blk = moe_block(seed=11)
    router = _fused_router(blk)
    wts = L.decode_weights(blk.switch_mlp, blk.shared_expert)
    hin = mx.random.normal((1, 1, 256)).astype(mx.bfloat16)
    res = mx.random.normal((1, 1, 256)).astype(mx.bfloat16)
    nw = (1.0 + 0.1 * mx.random.normal((256,))).astype(mx.bfloat16)
    with mx.stream(mx.cpu):
        x = add_rms_norm_reference(hin, res, nw, 1e-6)[1]
        mx.eval(x)
    y = M.moe_experts_routed(x, router, 4, True, L.experts(blk.switch_mlp, blk.shared_expert))
    assert calls == ["lily_qgemv", "lily_moe_gate_up", "lily_moe_down"]
    p = PendingNorm(hin, res, nw, 1e-6)
    y2 = M.moe_experts_routed(p, router, 4, True, L.experts(blk.switch_mlp, blk.shared_expert))
    assert calls[3:] == ["lily_norm_qgemv", "lily_moe_gate_up", "lily_moe_down"]
    assert p.h is not None and mx.array_equal(p.h, hin + res).item()
    # the same launches by hand: equal bit for bit
    kg, kd = kernels.get(M.GATE_UP_SPEC, "metal"), kernels.get(M.DOWN_SPEC, "metal")
    (logits,) = router(x, split=False)
    want = M.decode_plan(kg, kd, wts, x.shape, x.dtype, 4, False, topk=True)(x, logits)
    assert mx.array_equal(y, want[0]).item()
    logits2, _ = norm_qgemv.for_qproj(hin, res, nw, 1e-6, router)
    want2 = M.decode_plan(kg, kd, wts, x.shape, x.dtype, 4, False, topk=True,
                          pre_norm=True)(hin, res, nw, 1e-6, logits2)
    assert mx.array_equal(y2, want2[0]).item()
    # and both match the fp32 truth for their routing
    for yy, (_, inds, scores, shared) in ((y, want), (y2, want2)):
        t, mag = truth(x, inds, scores, shared, wts)
        check_close(yy, t, mag, mx.bfloat16)
    # MLX_LILY_NORM_GEMV=split: add_rms_norm, then the plain routed path
    del calls[:]
    with monkeypatch.context() as m:
        m.setenv(norm_qgemv.SPLIT_ENV, "split")
        p3 = PendingNorm(hin, res, nw, 1e-6)
        y3 = M.moe_experts_routed(p3, router, 4, True, L.experts(blk.switch_mlp, blk.shared_expert))
    # (add_rms_norm is not emulated here: its reference ran) the plain router GEMV and
    # gate+up without the norm prologue, bit for bit the unfused row's result
    assert calls == ["lily_qgemv", "lily_moe_gate_up", "lily_moe_down"]
    assert p3.h is not None and mx.array_equal(p3.h, hin + res).item()
    assert mx.array_equal(p3.resolve(), x).item() and mx.array_equal(y3, y).item()
    # not served: nothing launched
    del calls[:]
    monkeypatch.setenv(B.DISABLE_ENV, M.TOPK_OP)
    assert M.moe_experts_routed(x, router, 4, True,
                                L.experts(blk.switch_mlp, blk.shared_expert)) is None
    monkeypatch.delenv(B.DISABLE_ENV)
    gate_only = QProj.view([blk.gate])
    assert M.moe_experts_routed(x, gate_only, 4, True,
                                L.experts(blk.switch_mlp, blk.shared_expert)) is None
    xb = mx.random.normal((1, M.MAX_DECODE_ROWS + 1, 256)).astype(mx.bfloat16)
    assert M.moe_experts_routed(xb, router, 4, True,
                                L.experts(blk.switch_mlp, blk.shared_expert)) is None
    assert calls == []


def test_routed_supported_requires_logits_in_x_dtype():
    """The gate+up kernel reads the router's logits as x's dtype: a router whose scales
    differ from it (``quantized_matmul`` would promote) is not routed there."""
    blk = moe_block(seed=12)
    router = _fused_router(blk)
    wts = L.decode_weights(blk.switch_mlp, blk.shared_expert)
    assert M.routed_supported(router, 4, wts, (1, 1, 256), mx.bfloat16)
    assert not M.routed_supported(router, 4, wts, (1, 1, 256), mx.float16)


# ------------------------------------------------------------------ one-launch MoE block
FUSED_BACKENDS = (["cuda-emu"] if HAS_EMU else []) + [
    pytest.param("cuda", marks=[pytest.mark.gpu] + (
        [] if "cuda" in parity_backends() else
        [pytest.mark.skip(reason="no cuda device here")]))]
FUSED_CASES = [  # (D, I, E, k, rows, bits, gs, dtype, counter offset)
    (256, 128, 16, 4, 1, 4, 64, mx.bfloat16, 0),
    (2048, 512, 33, 8, 2, 4, 64, mx.bfloat16, 33),  # production D, I, k; E past 32 lanes
    (128, 64, 5, 3, 2, 4, 32, mx.float16, 3),       # odd E and k, tiles past the rows
    (256, 128, 8, 8, 1, 8, 128, mx.float32, 1),     # k = E, 8-bit experts
]
FUSED_PRODUCTION = (2048, 512, 256, 8, 1, 4, 64, mx.bfloat16, 33)


def _fused_inputs(case):
    d, i, e, k, rows, bits, gs, dtype, off = case
    blk = moe_block(d=d, e=e, k=k, i=i, seed=d + e + k + 17, bits=bits, gs=gs, dtype=dtype)
    router = _fused_router(blk)
    wts = L.decode_weights(blk.switch_mlp, blk.shared_expert)
    hin = mx.random.normal((rows, 1, d)).astype(dtype)
    res = mx.random.normal((rows, 1, d)).astype(dtype)
    nw = (1.0 + 0.1 * mx.random.normal((d,))).astype(dtype)
    return blk, router, wts, hin, res, nw


def _check_fused(backend, case):
    from mlx_lily.ops.add_rms_norm import add_rms_norm_reference
    from mlx_lily.testing.cuda_emu import cuda_on_emu

    d, i, e, k, rows, bits, gs, dtype, off = case
    blk, router, wts, hin, res, nw = _fused_inputs(case)
    eps = 1e-6
    assert M.fused_supported(router, k, wts, hin.shape, dtype)
    if backend == "cuda-emu":
        kf, init = cuda_on_emu(M.FUSED_SPEC), None
    else:
        kf, init = kernels.build(M.FUSED_SPEC, "cuda"), float("nan")
    counters = mx.zeros((off + M.FUSED_COUNTERS + 2,), dtype=mx.int32)
    run = M.fused_plan(kf, wts, router, hin.shape, dtype, k, True, off, init_value=init)
    y, h = run(hin, res, nw, eps, counters, hin)
    mx.eval(y, h, counters)
    with mx.stream(mx.cpu):
        h_ref, x = add_rms_norm_reference(hin, res, nw, eps)
        (logits,) = router(x, split=False)
        mx.eval(h_ref, x, logits)
    assert mx.array_equal(h, h_ref).item()
    # the three launches it replaces (down with one slot group, the fused kernel's order)
    from mlx_lily.ops.norm_qgemv import SPEC as NQ_SPEC, plan as nq_plan

    kg, kd, init3 = kernels_for(backend)
    kn = cuda_on_emu(NQ_SPEC) if backend == "cuda-emu" else kernels.build(NQ_SPEC, "cuda")
    logits3, _ = nq_plan(kn, hin.shape, dtype, router.weight, router.scales, router.biases,
                         router.group_size, router.bits, rpw=M.FUSED_RPW[0],
                         init_value=init3)(hin, res, nw, eps)
    y3, inds3, sc3, sh3 = M.decode_plan(
        kg, kd, wts, hin.shape, dtype, k, False, topk=True, pre_norm=True, init_value=init3,
        gate_up=(4, M.FUSED_RPW[1]), down=(4, M.FUSED_RPW[2], 1))(hin, res, nw, eps, logits3)
    if backend == "cuda-emu":
        assert mx.array_equal(y, y3).item(), "not the three launches' result bit for bit"
    # within the fp32 truth's bounds for that routing (the in-kernel norm's logits)
    t, mag = truth(x, inds3, sc3, sh3, wts)
    check_close(y, t, mag, dtype)
    check_close(y3, t, mag, dtype)
    return counters, off


@pytest.mark.parametrize("backend", FUSED_BACKENDS)
@pytest.mark.parametrize("case", FUSED_CASES,
                         ids=lambda c: "D{}-I{}-E{}-k{}-n{}-b{}-g{}-{}-co{}".format(
                             *c[:7], str(c[7]).split(".")[-1], c[8]))
def test_fused_decode_matches_three_launches_and_truth(backend, case):
    """``lily_moe_decode`` (one launch): h = hin + res exactly, y within the fp32 truth's
    bounds for the reference routing, and (emulator) bit for bit the three launches it
    replaces; on the GPU its counters are zero again afterwards."""
    counters, off = _check_fused(backend, case)
    if backend == "cuda":
        assert not bool(mx.any(counters).item()), counters


@pytest.mark.gpu
@pytest.mark.skipif("cuda" not in parity_backends(), reason="no cuda device here")
def test_fused_decode_production_dims_repeated():
    """The production block (E=256, k=8) on the GPU: four launches on one counter array
    whose rows do not depend on each other, ordered only through ``after`` (each takes the
    previous one's output, as a layer's steps do), and the same on a second array in the
    same evaluation (MLX may run the two chains concurrently): each launch's result equals
    the launch evaluated alone, counters zero afterwards."""
    counters, off = _check_fused("cuda", FUSED_PRODUCTION)
    blk, router, wts, hin, res, nw = _fused_inputs(FUSED_PRODUCTION)
    kf = kernels.build(M.FUSED_SPEC, "cuda")
    run = M.fused_plan(kf, wts, router, hin.shape, mx.bfloat16, 8, True, off)
    rows = [(hin * (1.0 + 0.25 * i)).astype(mx.bfloat16) for i in range(4)]
    want = []
    for r in rows:
        want.append(run(r, res, nw, 1e-6, counters, hin)[0])
        mx.eval(want[-1])
    c2 = mx.zeros((off + M.FUSED_COUNTERS,), dtype=mx.int32)
    chains = []
    for ctr in (counters, c2):
        prev, ys = hin, []
        for r in rows:
            prev = run(r, res, nw, 1e-6, ctr, prev)[0]
            ys.append(prev)
        chains.append(ys)
    mx.eval(*chains[0], *chains[1], counters, c2)
    for ys in chains:
        for y, w in zip(ys, want):
            assert bool(mx.all(mx.isfinite(y)).item()) and mx.array_equal(y, w).item()
    assert not bool(mx.any(counters).item()) and not bool(mx.any(c2).item())


def test_fused_tiles_and_supported():
    """Tile count of the production block and what ``fused_supported`` refuses."""
    assert M.fused_tiles(2048, 512, 8, 256, 4, 8, 1, (2, 4, 2)) == 33 + 9 * 32 + 128
    assert M.fused_tiles(2048, 512, 8, 256, 4, 8, 2, (2, 4, 2)) == 2 * 449
    assert M.fused_tiles(100, 512, 8, 256, 4, 8, 1) is None
    blk = moe_block(seed=12)
    router = _fused_router(blk)
    wts = L.decode_weights(blk.switch_mlp, blk.shared_expert)
    assert M.fused_supported(router, 4, wts, (1, 1, 256), mx.bfloat16)
    assert not M.fused_supported(router, 4, wts, (1, 1, 256), mx.float16)
    assert not M.fused_supported(router, 4, wts, (1, M.MAX_DECODE_ROWS + 1, 256),
                                 mx.bfloat16)
    assert not M.fused_supported(router, 4, None, (1, 1, 256), mx.bfloat16)


def test_fused_rpw_switch(monkeypatch):
    assert M.fused_rpw() == M.FUSED_RPW
    monkeypatch.setenv(M.FUSED_RPW_ENV, "2,4,2")
    assert M.fused_rpw() == (2, 4, 2)
    assert M.fused_tiles(2048, 512, 8, 256, 4, 8, 1) == 33 + 9 * 32 + 128
    for bad in ("2,4", "0,4,2", "a,b,c", "2,4,9"):  # one warning, then FUSED_RPW
        monkeypatch.setenv(M.FUSED_RPW_ENV, bad)
        config.WARNED.discard((M.FUSED_RPW_ENV, bad))
        with pytest.warns(UserWarning, match=M.FUSED_RPW_ENV):
            assert M.fused_rpw() == M.FUSED_RPW


@pytest.mark.skipif(not HAS_EMU, reason="Metal emulator unavailable")
def test_fused_dispatcher(monkeypatch):
    """``moe_experts_routed`` on CUDA with a ``PendingNorm`` carrying counters: one launch
    (``lily_moe_decode``), the plan's result, ``h`` set; without counters, with the switch
    off or on Metal: the three launches."""
    from mlx_lily import backend as B
    from mlx_lily.ops import norm_qgemv, qgemv
    from mlx_lily.qproj import PendingNorm
    from mlx_lily.testing.cuda_emu import cuda_on_emu

    monkeypatch.setenv("MLX_LILY_KERNELS", "all")
    monkeypatch.setattr(kernels, "_CACHE", {})
    calls = []

    def get(spec, backend):
        def k(**kw):
            calls.append(spec.name)
            return cuda_on_emu(spec)(**kw)
        return k

    monkeypatch.setattr(kernels, "get", get)
    for m in (M, qgemv, norm_qgemv):
        monkeypatch.setattr(m, "current_backend", lambda: "cuda")
    case = FUSED_CASES[0]
    blk, router, wts, hin, res, nw = _fused_inputs(case)
    ctr = mx.zeros((8,), dtype=mx.int32)
    p = PendingNorm(hin, res, nw, 1e-6, (ctr, 2, hin))
    y = M.moe_experts_routed(p, router, 4, True, L.experts(blk.switch_mlp, blk.shared_expert))
    assert calls == ["lily_moe_decode"]
    assert p.h is not None and mx.array_equal(p.h, hin + res).item()
    want = M.fused_plan(cuda_on_emu(M.FUSED_SPEC), wts, router, hin.shape, hin.dtype, 4,
                        True, 2)(hin, res, nw, 1e-6, ctr, hin)[0]
    assert mx.array_equal(y, want).item()
    del calls[:]
    p2 = PendingNorm(hin, res, nw, 1e-6)
    y2 = M.moe_experts_routed(p2, router, 4, True, L.experts(blk.switch_mlp, blk.shared_expert))
    assert calls == ["lily_norm_qgemv", "lily_moe_gate_up", "lily_moe_down"]
    t, mag = truth(p2.resolve(), *_route_ref(p2.resolve(), router, 4), wts)
    check_close(y2, t, mag, mx.bfloat16)
    check_close(y, t, mag, mx.bfloat16)
    del calls[:]
    monkeypatch.setenv(B.DISABLE_ENV, M.FUSED_OP)
    M.moe_experts_routed(PendingNorm(hin, res, nw, 1e-6, (ctr, 2, hin)), router, 4, True,
                         L.experts(blk.switch_mlp, blk.shared_expert))
    assert calls == ["lily_norm_qgemv", "lily_moe_gate_up", "lily_moe_down"]
    monkeypatch.delenv(B.DISABLE_ENV)
    del calls[:]
    short = mx.zeros((5,), dtype=mx.int32)  # fewer than offset + FUSED_COUNTERS
    M.moe_experts_routed(PendingNorm(hin, res, nw, 1e-6, (short, 2, hin)), router, 4, True,
                         L.experts(blk.switch_mlp, blk.shared_expert))
    assert calls == ["lily_norm_qgemv", "lily_moe_gate_up", "lily_moe_down"]
    del calls[:]
    for m in (M, qgemv, norm_qgemv):
        monkeypatch.setattr(m, "current_backend", lambda: "metal")
    monkeypatch.setattr(kernels, "get", lambda spec, backend: None)
    assert M.moe_experts_routed(PendingNorm(hin, res, nw, 1e-6, (ctr, 2, hin)), router, 4, True,
                                L.experts(blk.switch_mlp, blk.shared_expert)) is None


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc not installed")
@pytest.mark.parametrize("rows", [1, 2])
def test_cuda_fused_compiles(rows):
    """nvcc builds ``lily_moe_decode`` at production dims (sm_90a)."""
    from mlx_lily.testing import cuda_check

    bf, u = mx.bfloat16, mx.uint32
    ins = [("hin", bf, 3), ("res", bf, 3), ("nw", bf, 1), ("eps", mx.float32, 1),
           ("rw", u, 2), ("rs", bf, 2), ("rb", bf, 2)]
    for p in ("gate", "up"):
        ins += [(f"{p}_w", u, 3), (f"{p}_s", bf, 3), (f"{p}_b", bf, 3)]
    for p in ("sgate", "sup"):
        ins += [(f"{p}_w", u, 2), (f"{p}_s", bf, 2), (f"{p}_b", bf, 2)]
    ins += [("down_w", u, 3), ("down_s", bf, 3), ("down_b", bf, 3), ("sdown_w", u, 2),
            ("sdown_s", bf, 2), ("sdown_b", bf, 2), ("counters", mx.int32, 1),
            ("after", bf, 3)]
    assert [n for n, _, _ in ins] == list(M.FUSED_SPEC.inputs)
    outs = [("y", bf), ("h", bf), ("work", u)]
    assert [n for n, _ in outs] == list(M.FUSED_SPEC.outputs)
    rr, rg, rd = M.FUSED_RPW
    head, body = kernels.cuda_parts("moe_decode")
    cuda_check.check("lily_moe_decode", ins, outs, body, head,
                     template=[("T", bf), ("S", bf), ("N", rows), ("D", 2048), ("I", 512),
                               ("K", 8), ("E", 256), ("BITS", 4), ("GS", 64), ("RBITS", 8),
                               ("RGS", 64), ("RRPW", rr), ("GRPW", rg), ("DRPW", rd),
                               ("NORM", True), ("CO", 33),
                               ("WPR", M.fused_work_words(2048, 512, 8, 256, 2))])
