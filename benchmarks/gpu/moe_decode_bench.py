"""One MoE layer of Qwen3.6-35B-A3B at batch-1 decode: stock mlx-lm vs Lily's kernels,
plus Lily's quantized GEMV vs MLX's own qmv at the model's projection shapes, and (CUDA)
the MoE block's three launches vs the one-launch ``lily_moe_decode`` at several launch
shapes (``fused_variants``).

Run on a CUDA (or Metal) machine from anywhere, with mlx-lily installed:
    python benchmarks/gpu/moe_decode_bench.py --out DIR      (DIR defaults to $OUT)
Prints tables and writes DIR/moe_decode_bench.json. Budget: well under a minute on an H200.

Timing: "chain" = 40 dependent layers (one decode token's worth: x <- rms_norm(x + moe(x)))
built lazily and evaluated once, median over reps, per layer; this includes MLX's host
cost per primitive, which dominates batch-1 decode. "sync" = one layer per eval
(includes the launch-to-completion latency). Weights are random, in the exact MLX 4-bit
layout (8-bit router and shared-expert gate).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import mlx.core as mx

D, I, E, K = 2048, 512, 256, 8
LAYERS = 40


def _setup_block(seed=0):
    """Qwen3.6-35B-A3B's MoE block (``D``, ``E``, ``K``, ``I``) with random 4-bit codes
    (8-bit router and shared-expert gate), evaluated."""
    from mlx_lily.testing.models import moe_block

    blk = moe_block(D, E, K, I, seed=seed, random_codes=True)
    mx.eval(blk.parameters())
    return blk


def _rand_u32(shape):
    hi = mx.random.randint(0, 1 << 16, shape, dtype=mx.uint32)
    lo = mx.random.randint(0, 1 << 16, shape, dtype=mx.uint32)
    return (hi << 16) | lo


def _bench(fn, reps, warmup=3):
    for _ in range(warmup):
        mx.eval(fn())
    mx.synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _nbytes(*arrs):
    return sum(a.nbytes for a in arrs)


def moe_layer(blk, router, reps, out):
    from mlx_lily.ops import moe_experts as M
    from mlx_lily.patches import layouts
    from mlx_lily.ops import moe_router_topk as R

    backend_ok = R.has_kernel(_backend()) and M.has_kernel(_backend())
    x0 = mx.random.normal((1, 1, D)).astype(mx.bfloat16)
    mx.eval(x0)
    sw = blk.switch_mlp
    ex = layouts.experts(sw, blk.shared_expert)
    per_expert = _nbytes(*(getattr(sw, p)[n] for p in ("gate_proj", "up_proj", "down_proj")
                           for n in ("weight", "scales", "biases"))) / E
    shared_b = _nbytes(*(getattr(blk.shared_expert, p)[n]
                         for p in ("gate_proj", "up_proj", "down_proj")
                         for n in ("weight", "scales", "biases")))
    router_b = _nbytes(router.weight, router.scales, router.biases)
    layer_bytes = K * per_expert + shared_b + router_b

    def stock_chain(x=None):
        x = x0 if x is None else x
        for _ in range(LAYERS):
            x = mx.fast.rms_norm(x + blk(x), None, 1e-6)
        return x

    def lily_layer(x, fused_res=False):
        inds, scores, shared = R.moe_router_topk(x, router, K, True)
        if fused_res:
            return M.moe_experts(x, inds, scores, ex, shared, residual=x)
        return x + M.moe_experts(x, inds, scores, ex, shared)

    def lily_chain(fused_res):
        def f(x=None):
            x = x0 if x is None else x
            for _ in range(LAYERS):
                x = mx.fast.rms_norm(lily_layer(x, fused_res), None, 1e-6)
            return x
        return f

    def norm_chain(x=None):
        x = x0 if x is None else x
        for _ in range(LAYERS):
            x = mx.fast.rms_norm(x + x, None, 1e-6)
        return x

    routed0 = R.moe_router_topk(x0, router, K, True) if backend_ok else None

    def router_chain(x=None):
        # router alone: each layer's input depends on the previous router's shared gate
        x = x0 if x is None else x
        for _ in range(LAYERS):
            _, _, shared = R.moe_router_topk(x, router, K, True)
            x = mx.fast.rms_norm(x + shared, None, 1e-6)
        return x

    def experts_chain(x=None):
        # gate_up + down alone, with fixed routing (residual fused into down)
        x = x0 if x is None else x
        inds, scores, shared = routed0
        for _ in range(LAYERS):
            x = mx.fast.rms_norm(M.moe_experts(x, inds, scores, ex, shared, residual=x),
                                 None, 1e-6)
        return x

    from mlx_lily.bench import gpu_clock

    def gpu_us(fn):
        if not gpu_clock.available():
            return None
        ts = [gpu_clock.time_chain(fn, x0, spin_ms=150.0)["gpu_s"] for _ in range(5)]
        return 1e6 * statistics.median(ts) / LAYERS

    rows = []
    t_norm = _bench(norm_chain, reps) / LAYERS
    g_norm = gpu_us(norm_chain)
    for name, fn, sync_fn in (
            ("stock mlx-lm block", stock_chain, lambda: x0 + blk(x0)),
            ("lily kernels (3 launches)", lily_chain(False), lambda: lily_layer(x0)),
            ("lily kernels + fused residual", lily_chain(True), lambda: lily_layer(x0, True)),
            ("lily router alone", router_chain, None),
            ("lily experts alone (fused res)", experts_chain, None)):
        if name.startswith("lily") and not backend_ok:
            continue
        t_chain = _bench(fn, reps) / LAYERS
        t_sync = _bench(sync_fn, reps * 4) if sync_fn is not None else float("nan")
        g = gpu_us(fn)
        rows.append({"variant": name, "us_per_layer_chain": 1e6 * t_chain,
                     "us_per_layer_chain_minus_norm": 1e6 * (t_chain - t_norm),
                     "us_sync": 1e6 * t_sync,
                     "GBps_chain": layer_bytes / (t_chain - t_norm) / 1e9,
                     "gpu_us_per_layer": g,
                     "gpu_us_per_layer_minus_norm": None if g is None else g - g_norm})
    out["moe_layer"] = {"bytes_per_layer": layer_bytes, "rms_norm_add_us": 1e6 * t_norm,
                        "rms_norm_add_gpu_us": g_norm, "rows": rows}
    print(f"\nMoE layer decode, D={D} I={I} E={E} k={K}: {layer_bytes / 1e6:.2f} MB read per "
          f"layer; chain of {LAYERS} layers (x <- rms_norm(x + moe(x)), add+norm alone "
          f"{1e6 * t_norm:.1f} us wall, {g_norm or float('nan'):.1f} us GPU); 'GPU us' = "
          f"device-side time per layer (gpu_clock), add+norm subtracted")
    print(f"{'variant':32s} {'us/layer chain':>15s} {'minus norm':>11s} {'us sync':>9s} "
          f"{'GB/s':>8s} {'GPU us':>8s} {'GPU GB/s':>9s}")
    for r in rows:
        g = r["gpu_us_per_layer_minus_norm"]
        gs = f"{g:8.1f} {layer_bytes / g / 1e3:9.1f}" if g else ""
        print(f"{r['variant']:32s} {r['us_per_layer_chain']:15.1f} "
              f"{r['us_per_layer_chain_minus_norm']:11.1f} {r['us_sync']:9.1f} "
              f"{r['GBps_chain']:8.1f} {gs}")
    if backend_ok:
        _parity(blk, router, x0, out)


def _experts_truth(x, inds, scores, shared, wts):
    """fp32 experts for one row on the CPU stream, with the stock roundings of the
    gate/up outputs and h to bf16."""
    with mx.stream(mx.cpu):
        rb = lambda a: a.astype(mx.bfloat16).astype(mx.float32)  # noqa: E731
        deq = lambda t, e=None: mx.dequantize(  # noqa: E731
            *(a if e is None else a[e] for a in t[:1]),
            *((a if e is None else a[e]).astype(mx.float32) for a in t[1:]),
            group_size=wts.group_size, bits=wts.bits)
        xf = x.reshape(-1).astype(mx.float32)
        ind = inds.reshape(-1).tolist()
        coef = scores.reshape(-1).astype(mx.float32).tolist() + \
            [shared.reshape(-1).astype(mx.float32).item()]
        y = mx.zeros((x.shape[-1],))
        for j, c in enumerate(coef):
            if j < len(ind):
                g, u, dn = (deq(t, ind[j]) for t in (wts.gate, wts.up, wts.down))
            else:
                g, u, dn = (deq(t) for t in (wts.sgate, wts.sup, wts.sdown))
            gv, uv = rb(g @ xf), rb(u @ xf)
            y = y + c * (dn @ rb(gv * mx.sigmoid(gv) * uv))
        mx.eval(y)
        return y


def _parity(blk, router, x, out):
    """Kernels on one token: the router vs the lowest-id reference on fp32-exact
    logits; the expert kernels and MLX's own reference vs an fp32 truth fed the same
    routing; the fused residual vs x + kernel output."""
    from mlx_lily.ops import moe_experts as M
    from mlx_lily.patches import layouts
    from mlx_lily.ops import moe_router_topk as R

    inds, scores, shared = R.moe_router_topk(x, router, K, True)
    with mx.stream(mx.cpu):
        wf = mx.dequantize(router.weight, router.scales.astype(mx.float32),
                           router.biases.astype(mx.float32), 64, 8)
        logits = (x.astype(mx.float32) @ wf.T).astype(mx.bfloat16)
        ti, ts, th = R.moe_router_topk_reference(
            x, lambda t: [logits[..., :E], logits[..., E:]], K, True)
        mx.eval(ti, ts, th)
    same = sorted(inds.reshape(-1).tolist()) == sorted(ti.reshape(-1).tolist())
    ex = layouts.experts(blk.switch_mlp, blk.shared_expert)
    wts = ex.decode
    t = _experts_truth(x, inds, scores, shared, wts)
    y = M.moe_experts(x, inds, scores, ex, shared)
    yr = M.moe_experts_reference(x, inds, scores, blk.switch_mlp, blk.shared_expert, shared)
    yf = M.moe_experts(x, inds, scores, ex, shared, residual=x)
    scale = mx.abs(t).max().item()
    err = mx.abs(y.reshape(-1).astype(mx.float32) - t).max().item()
    err_ref = mx.abs(yr.reshape(-1).astype(mx.float32) - t).max().item()
    err_res = mx.abs(yf.astype(mx.float32) - (x + y).astype(mx.float32)).max().item()
    ok = same and err <= 2 ** -7 * scale + 1e-4 and err_res <= 2 ** -7 * (
        mx.abs(x).max().item() + scale)
    out["parity"] = {"router_same_experts_as_fp32_truth": same,
                     "router_score_max_abs_diff": mx.abs(scores.astype(mx.float32) -
                                                         ts.astype(mx.float32)).max().item(),
                     "experts_truth_max_abs": scale,
                     "experts_kernel_max_abs_err_vs_truth": err,
                     "experts_mlx_reference_max_abs_err_vs_truth": err_ref,
                     "fused_residual_max_abs_err": err_res, "ok": ok}
    print(f"parity: router picks == fp32-truth top-{K}: {same}; experts max err vs fp32 "
          f"truth: kernel {err:.3g}, MLX reference {err_ref:.3g} (truth max {scale:.3g}); "
          f"fused residual {err_res:.3g} -> {'OK' if ok else 'MISMATCH'}")


QGEMV_SHAPES = [  # (name, K, O, bits)
    ("attn q|k|v fused", 2048, 8192 + 512 + 512, 4),
    ("gdn in_proj fused", 2048, 8192 + 4096 + 32 + 32, 4),
    ("gdn out_proj / attn o_proj", 4096, 2048, 4),
    ("router+shared gate (8-bit)", 2048, 257, 8),
    ("shared expert gate|up", 2048, 1024, 4),
    ("lm_head", 2048, 248320, 4),
]


def qgemv_vs_qmv(reps, out):
    from mlx_lily import kernels
    from mlx_lily.ops import qgemv as Q

    if not Q.has_kernel(_backend()):
        return
    kern = kernels.get(Q.SPEC, _backend())
    rows = []
    chain = 20
    print(f"\nquantized GEMV, one row, bf16: Lily qgemv vs MLX quantized_matmul "
          f"(chain of {chain} calls per eval, per call)")
    print(f"{'shape':28s} {'K':>5s} {'O':>7s} {'b':>2s} {'MLX us':>8s} {'lily us':>8s} "
          f"{'lily NW4/RPW2':>13s} {'MLX GB/s':>9s} {'lily GB/s':>9s} {'rel diff':>8s}")
    for name, k, o, bits in QGEMV_SHAPES:
        w = _rand_u32((o, k * bits // 32))
        s = (mx.random.uniform(0.5, 1.5, (o, k // 64)) * (0.03 / (1 << (bits - 1)))).astype(mx.bfloat16)
        b = (-(1 << (bits - 1)) * s).astype(mx.bfloat16)
        xs = [mx.random.normal((1, k)).astype(mx.bfloat16) for _ in range(chain)]
        mx.eval(w, s, b, xs)
        nbytes = _nbytes(w, s, b)

        def mlx_fn():
            return [mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=bits)
                    for x in xs]

        def lily_fn(nw=Q.NW, rpw=Q.RPW):
            return lambda: [Q.launch(kern, x, w, s, b, 64, bits, nw=nw, rpw=rpw) for x in xs]

        t_mlx = _bench(mlx_fn, reps) / chain
        t_lily = _bench(lily_fn(), reps) / chain
        t_alt = _bench(lily_fn(4, 2), reps) / chain
        # launch-shape sweep (warps per block x rows per lane group), device-side time of
        # a dependent chain (call i+1 reads call i's output, cut or repeated to K values:
        # the slice is a view, the repeat one small copy per call in every variant alike)
        def dep_chain(nw, rpw):
            def run(x):
                for _ in range(chain):
                    y = Q.launch(kern, x, w, s, b, 64, bits, nw=nw, rpw=rpw)
                    x = y[:, :k] if o >= k else mx.concatenate([y] * -(-k // o), axis=1)[:, :k]
                return x
            return run

        sweep, sweep_gpu = {}, {}
        for nw, rpw in ((2, 1), (4, 1), (8, 1), (2, 2), (4, 2), (8, 2), (2, 4), (4, 4), (8, 4)):
            sweep[f"{nw},{rpw}"] = 1e6 * _bench(lily_fn(nw, rpw), max(3, reps // 3)) / chain
            sweep_gpu[f"{nw},{rpw}"] = _gpu_us(dep_chain(nw, rpw), xs[0], chain)
        if all(v is not None for v in sweep_gpu.values()):
            sweep = sweep_gpu  # the device-side figures pick the best shape where they exist
        best = min(sweep, key=sweep.get)
        ref = mlx_fn()[0].astype(mx.float32)
        d = mx.abs(ref - lily_fn()()[0].astype(mx.float32)).max() / mx.abs(ref).max()
        rows.append({"shape": name, "K": k, "O": o, "bits": bits, "mlx_us": 1e6 * t_mlx,
                     "lily_us": 1e6 * t_lily, "lily_nw4_rpw2_us": 1e6 * t_alt,
                     "mlx_GBps": nbytes / t_mlx / 1e9, "lily_GBps": nbytes / t_lily / 1e9,
                     "max_rel_diff": d.item(), "sweep_us": sweep, "best_nw_rpw": best,
                     "sweep_gpu_us": sweep_gpu})
        r = rows[-1]
        print(f"{name:28s} {k:5d} {o:7d} {bits:2d} {r['mlx_us']:8.1f} {r['lily_us']:8.1f} "
              f"{r['lily_nw4_rpw2_us']:13.1f} {r['mlx_GBps']:9.1f} {r['lily_GBps']:9.1f} "
              f"{r['max_rel_diff']:8.3g}  best NW,RPW {best}: {sweep[best]:.1f} us")
    out["qgemv"] = rows


def kernel_variants(blk, router, reps, out):
    """Launch-shape alternatives for the two expert kernels (one layer, chained)."""
    from mlx_lily import kernels
    from mlx_lily.ops import moe_experts as M
    from mlx_lily.patches import layouts
    from mlx_lily.ops import moe_router_topk as R

    if not M.has_kernel(_backend()):
        return
    kg = kernels.get(M.GATE_UP_SPEC, _backend())
    kd = kernels.get(M.DOWN_SPEC, _backend())
    wts = layouts.decode_weights(blk.switch_mlp, blk.shared_expert)
    xs = [mx.random.normal((1, 1, D)).astype(mx.bfloat16) for _ in range(LAYERS)]
    routed = [R.moe_router_topk(x, router, K, True) for x in xs]
    mx.eval(xs, routed)
    rows = []
    print(f"\nexpert kernels, launch shapes (gate_up NW,RPW / down NW,RPW): {LAYERS} "
          f"independent layers per eval, per layer")
    # down (NW, RPW[, SL]): SL slot groups of NW warps per threadgroup
    for gu, dn in (((4, 4), (4, 2)), ((4, 4), (4, 2, 3)), ((4, 8), (4, 2, 3))):
        def f():
            return [M.launch_decode(kg, kd, x, *r, wts, gate_up=gu, down=dn)
                    for x, r in zip(xs, routed)]
        t = _bench(f, reps) / LAYERS
        rows.append({"gate_up": gu, "down": dn, "us_per_layer": 1e6 * t})
        print(f"  gate_up {gu} down {dn}: {1e6 * t:7.1f} us")
    out["variants"] = rows


def _gpu_us(fn, x0, per):
    """Device-side microseconds of ``fn(x)`` per unit (``gpu_clock``; median of 5), or
    None where the clock is unavailable (not CUDA)."""
    from mlx_lily.bench import gpu_clock

    if not gpu_clock.available():
        return None
    ts = [gpu_clock.time_chain(fn, x0, spin_ms=150.0)["gpu_s"] for _ in range(5)]
    return 1e6 * statistics.median(ts) / per


def routed_variants(blk, router, reps, out):
    """The routed experts' path as the compiled decode step runs it (softmax + top-k and
    the add + RMSNorm inside every gate+up threadgroup) at several gate+up launch shapes,
    down at its backend default; ``LAYERS`` layers chained (each layer's output is the
    next one's input), router logits fixed."""
    from mlx_lily import kernels
    from mlx_lily.ops import moe_experts as M
    from mlx_lily.patches import layouts
    from mlx_lily.ops.add_rms_norm import add_rms_norm_reference

    be = _backend()
    if not M.has_routed_kernel(be):
        return
    kg, kd = kernels.get(M.GATE_UP_SPEC, be), kernels.get(M.DOWN_SPEC, be)
    wts = layouts.decode_weights(blk.switch_mlp, blk.shared_expert)
    x0 = mx.random.normal((1, 1, D)).astype(mx.bfloat16)
    res = [mx.random.normal((1, 1, D)).astype(mx.bfloat16) for _ in range(LAYERS)]
    nw = (1.0 + 0.1 * mx.random.normal((D,))).astype(mx.bfloat16)
    logits = [router(add_rms_norm_reference(x0, r, nw, 1e-6)[1], split=False)[0]
              for r in res]
    mx.eval(x0, res, nw, logits)
    gu0, dn0 = M.launch_shapes(be)
    rows = []
    print(f"\nrouted experts (top-k + add+norm in gate+up), launch shapes (default gate+up "
          f"{gu0}, down {dn0}): {LAYERS} chained layers, per layer")
    pairs = [(gu, dn0) for gu in ((4, 4), (4, 2), (8, 2), (8, 1), (4, 1), (2, 4), (4, 8))]
    pairs += [(gu0, dn) for dn in ((4, 2, 1), (4, 1, 3), (4, 2, 3), (4, 4, 3), (2, 2, 9),
                                   (8, 1, 3), (2, 1, 9))]
    for gu, dn in pairs:
        try:
            run = M.decode_plan(kg, kd, wts, x0.shape, x0.dtype, K, False, topk=True,
                                norm_topk_prob=True, pre_norm=True, gate_up=gu, down=dn)
        except ValueError as exc:
            print(f"  gate_up {gu} down {dn}: not a valid shape here ({exc})")
            continue

        def chain(x, run=run):
            for r, lg in zip(res, logits):
                x = run(x, r, nw, 1e-6, lg)[0]
            return x

        t = _bench(lambda: chain(x0), reps) / LAYERS
        g = _gpu_us(chain, x0, LAYERS)
        rows.append({"gate_up": gu, "down": dn, "us_per_layer": 1e6 * t, "gpu_us_per_layer": g})
        print(f"  gate_up {gu} down {dn}: {1e6 * t:7.1f} us wall, "
              f"{float('nan') if g is None else g:7.1f} us GPU")
    out["routed_variants"] = rows


#: Rows per lane group (router, gate+up, down) ``fused_variants`` times; the default
#: ``moe_experts.FUSED_RPW`` first.
FUSED_RPWS = ((2, 4, 1), (2, 4, 2), (1, 4, 1), (2, 2, 1), (2, 2, 2), (4, 4, 1), (2, 8, 1))


def fused_variants(blk, router, reps, out, rows=(1,)):
    """The whole MoE block as the compiled decode step runs it: the router GEMV with the
    add + RMSNorm (``norm_qgemv``) and the routed gate+up and down kernels (three
    launches) vs ``lily_moe_decode`` (one launch, ``moe_fused``, CUDA) at several rows
    per lane group (router, gate+up, down); ``LAYERS`` layers chained (each layer's
    output is the next one's residual delta), each layer with its own counters as in
    the model. Wall and device-side us per layer, for each count of token rows in
    ``rows`` (a batched decode step's rows: one per sequence)."""
    from mlx_lily import kernels
    from mlx_lily.ops import moe_experts as M
    from mlx_lily.patches import layouts
    from mlx_lily.ops import norm_qgemv as NQ

    be = _backend()
    if be != "cuda" or not M.has_routed_kernel(be):
        return
    kf = kernels.build(M.FUSED_SPEC, be)
    kg, kd = kernels.get(M.GATE_UP_SPEC, be), kernels.get(M.DOWN_SPEC, be)
    kn = kernels.get(NQ.SPEC, be)
    wts = layouts.decode_weights(blk.switch_mlp, blk.shared_expert)
    nw = (1.0 + 0.1 * mx.random.normal((D,))).astype(mx.bfloat16)
    table = []
    for n in rows:
        table += _fused_rows(kf, kg, kd, kn, wts, router, nw, n, reps)
    out["fused_variants"] = table


def _fused_rows(kf, kg, kd, kn, wts, router, nw, n, reps):
    """``fused_variants`` at ``n`` token rows: the three launches, then each of
    ``FUSED_RPWS``."""
    from mlx_lily.ops import moe_experts as M
    from mlx_lily.ops import norm_qgemv as NQ

    x0 = mx.random.normal((n, 1, D)).astype(mx.bfloat16)
    res = [mx.random.normal((n, 1, D)).astype(mx.bfloat16) for _ in range(LAYERS)]
    ctrs = [mx.zeros((M.FUSED_COUNTERS,), dtype=mx.int32) for _ in range(LAYERS)]
    mx.eval(x0, res, ctrs)
    rows = []
    print(f"\nMoE block at {n} row(s): three launches vs one (lily_moe_decode), {LAYERS} "
          "chained layers, per layer")
    nq = NQ.plan(kn, x0.shape, x0.dtype, router.weight, router.scales, router.biases,
                 router.group_size, router.bits)
    three = M.decode_plan(kg, kd, wts, x0.shape, x0.dtype, K, False, topk=True,
                          norm_topk_prob=True, pre_norm=True)

    def chain3(x):
        for r in res:
            logits, _ = nq(x, r, nw, 1e-6)
            x = three(x, r, nw, 1e-6, logits)[0]
        return x

    t = _bench(lambda: chain3(x0), reps) / LAYERS
    g = _gpu_us(chain3, x0, LAYERS)
    rows.append({"rows": n, "variant": "three launches", "us_per_layer": 1e6 * t,
                 "gpu_us_per_layer": g})
    print(f"  three launches:       {1e6 * t:7.1f} us wall, "
          f"{float('nan') if g is None else g:7.1f} us GPU")
    for rpw in FUSED_RPWS:
        os.environ[M.FUSED_RPW_ENV] = ",".join(map(str, rpw))
        try:
            if not M.fused_supported(router, K, wts, x0.shape, x0.dtype):
                print(f"  fused {rpw}: not supported here")
                continue
            run = M.fused_plan(kf, wts, router, x0.shape, x0.dtype, K, True, 0)
        finally:
            os.environ.pop(M.FUSED_RPW_ENV, None)

        def chain1(x, run=run):
            for r, c in zip(res, ctrs):
                x = run(x, r, nw, 1e-6, c, x)[0]
            return x

        t = _bench(lambda: chain1(x0), reps) / LAYERS
        g = _gpu_us(chain1, x0, LAYERS)
        rows.append({"rows": n, "variant": f"fused {rpw}", "rpw": rpw,
                     "us_per_layer": 1e6 * t, "gpu_us_per_layer": g})
        print(f"  fused rpw {rpw}: {1e6 * t:7.1f} us wall, "
              f"{float('nan') if g is None else g:7.1f} us GPU")
    return rows


def norm_gemv_split(reps, out):
    """``norm_qgemv`` (the add + RMSNorm inside the GEMV) vs ``add_rms_norm`` then
    ``qgemv`` (``MLX_LILY_NORM_GEMV=split``) on the decode projections behind a norm,
    20 chained calls (each call's residual sum feeds the next)."""
    from mlx_lily import kernels
    from mlx_lily.ops import norm_qgemv as NQ
    from mlx_lily.ops import qgemv as Q
    from mlx_lily.ops.add_rms_norm import add_rms_norm

    be = _backend()
    if not (NQ.has_kernel(be) and Q.has_kernel(be)):
        return
    kn, kq = kernels.get(NQ.SPEC, be), kernels.get(Q.SPEC, be)
    chain_n = 20
    rows = []
    print(f"\nnorm-fused GEMV vs add_rms_norm + qgemv ({chain_n} chained calls, per call)")
    for name, k, o, bits in QGEMV_SHAPES:
        if o > 20000:
            continue  # the LM head has no norm in front
        w = _rand_u32((o, k * bits // 32))
        sc = (mx.random.uniform(0.5, 1.5, (o, k // 64)) * (0.03 / (1 << (bits - 1)))).astype(mx.bfloat16)
        bi = (-(1 << (bits - 1)) * sc).astype(mx.bfloat16)
        res = [mx.random.normal((1, k)).astype(mx.bfloat16) for _ in range(chain_n)]
        nw = (1.0 + 0.1 * mx.random.normal((k,))).astype(mx.bfloat16)
        x0 = mx.random.normal((1, k)).astype(mx.bfloat16)
        mx.eval(w, sc, bi, res, nw, x0)

        def fused(h):
            ys = []
            for r in res:
                y, h = NQ.launch(kn, h, r, nw, 1e-6, w, sc, bi, 64, bits)
                ys.append(y)
            return ys + [h]

        def split(h):
            ys = []
            for r in res:
                h, xn = add_rms_norm(h, r, nw, 1e-6)
                ys.append(Q.launch(kq, xn, w, sc, bi, 64, bits))
            return ys + [h]

        row = {"shape": name, "K": k, "O": o, "bits": bits}
        for label, fn in (("fused", fused), ("split", split)):
            row[f"{label}_us"] = 1e6 * _bench(lambda fn=fn: fn(x0), reps) / chain_n
            row[f"{label}_gpu_us"] = _gpu_us(fn, x0, chain_n)
        a, b = fused(x0)[0].astype(mx.float32), split(x0)[0].astype(mx.float32)
        row["max_rel_diff"] = (mx.abs(a - b).max() / mx.abs(a).max()).item()
        rows.append(row)
        gf, gs = row["fused_gpu_us"], row["split_gpu_us"]
        print(f"  {name:28s} fused {row['fused_us']:6.1f} us wall / "
              f"{float('nan') if gf is None else gf:6.1f} GPU, split {row['split_us']:6.1f} / "
              f"{float('nan') if gs is None else gs:6.1f}, rel diff {row['max_rel_diff']:.3g}")
    out["norm_gemv_split"] = rows


def _emulate():
    """Small dims and the Metal emulator posing as the Metal backend (smoke test)."""
    global D, I, E, K, LAYERS, QGEMV_SHAPES
    from mlx_lily import backend, kernels
    from mlx_lily.testing import metal_emu

    D, I, E, K, LAYERS = 256, 128, 16, 4, 2
    os.environ["MLX_LILY_KERNELS"] = "all"  # no Metal kernel is verified on hardware
    QGEMV_SHAPES = [("small 4-bit", 256, 72, 4), ("small 8-bit", 256, 17, 8)]
    mx.fast.metal_kernel = metal_emu.metal_kernel
    kernels._metal_ok = lambda: True
    backend.current_backend = lambda: "metal"
    for mod in ("qgemv", "moe_router_topk", "moe_experts", "norm_qgemv", "add_rms_norm"):
        m = __import__(f"mlx_lily.ops.{mod}", fromlist=["x"])
        m.current_backend = lambda: "metal"


def _backend():
    from mlx_lily.backend import current_backend

    return current_backend()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--rows", default="1",
                    help="fused: token rows per launch, comma-separated (a batched decode "
                         "step has one per sequence)")
    ap.add_argument("--sections", default=None,
                    help="comma-separated subset of: layer, kernels, qgemv, routed, fused, "
                         "norm_gemv (default: all)")
    ap.add_argument("--emulate", action="store_true",
                    help="CPU smoke test: small dims, Metal kernels run by the emulator "
                         "(checks the script, measures nothing meaningful)")
    args = ap.parse_args(argv)
    if args.emulate:
        _emulate()
        args.reps = 2
    from mlx_lily.qproj import QProj

    out = {"backend": _backend(), "device": str(mx.default_device()),
           "mlx": mx.__version__}
    try:
        import mlx_lm
        out["mlx_lm"] = mlx_lm.__version__
    except Exception:
        pass
    print(f"backend={out['backend']} mlx={out['mlx']} mlx_lm={out.get('mlx_lm')}")
    if out["backend"] == "cpu":
        print("no GPU backend: nothing to measure")
        return 0
    t0 = time.time()
    blk = _setup_block()
    router = QProj.fuse([blk.gate, blk.shared_expert_gate])
    print(f"setup {time.time() - t0:.1f}s")
    rows = tuple(int(v) for v in args.rows.split(","))
    steps = {"layer": lambda: moe_layer(blk, router, args.reps, out),
             "kernels": lambda: kernel_variants(blk, router, args.reps, out),
             "qgemv": lambda: qgemv_vs_qmv(args.reps, out),
             "routed": lambda: routed_variants(blk, router, args.reps, out),
             "fused": lambda: fused_variants(blk, router, args.reps, out, rows),
             "norm_gemv": lambda: norm_gemv_split(args.reps, out)}
    wanted = list(steps) if args.sections is None else args.sections.split(",")
    unknown = [w for w in wanted if w not in steps]
    if unknown:
        ap.error(f"unknown --sections {unknown}; choose from {list(steps)}")
    for name in wanted:
        step = steps[name]
        try:
            step()
        except Exception as exc:  # keep what was measured
            print(f"FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
            out.setdefault("errors", []).append(f"{type(exc).__name__}: {exc}")
    out["elapsed_s"] = time.time() - t0
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "moe_decode_bench.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {path} ({out['elapsed_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
