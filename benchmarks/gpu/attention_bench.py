"""One Qwen3.6-35B-A3B attention layer (16 q heads, 2 KV heads, head_dim 256, bf16):
Lily's attention kernels vs MLX's ``mx.fast.scaled_dot_product_attention`` (+ the stock
``out * sigmoid(gate)``), with parity checks.

Run on a CUDA (or Metal) machine, with mlx-lily installed:
    python benchmarks/gpu/attention_bench.py --out DIR        (DIR defaults to $OUT)
Prints tables and writes DIR/attention_bench.json. Budget: ~60 s on an H200 (most of it
NVRTC compiles of the kernel instantiations; reported as "compile").

Measured:
- decode (L = 1) at 4K / 32K / 128K cached tokens, K/V as KVCache views (256-token
  allocation steps): Lily split-K decode with fused gate and without, vs MLX SDPA (+ gate).
  GB/s counts the K and V bytes read: 2 * T * 256 * 2 B * 2 KV heads. Also a sweep of the
  split block (keys per warp) and of ``PF`` (1 or 2 tiles' loads in flight per warp) to
  validate ``attention.decode_block`` and ``attention.DECODE_PREFETCH``.
- prefill (causal, fused gate) for L = 2048 at T = 2048 (first chunk), T = 8192 (the 4th
  mlx-lm chunk: offset 6144), and a single L = T = 8192 call. TFLOP/s counts
  4 * D * Hq * (causal query-key pairs).
- q/k RMSNorm + RoPE at L = 1 and L = 2048.
- the whole attention mixer (4-bit projections, q/k norm + RoPE, KVCache update, SDPA,
  gate, o_proj) for a decode token at 4K / 32K and a 2048-token chunk: stock mlx-lm vs
  ``patches.qwen3_next.attention_call`` as it is vs with the proposed ``sdpa_gated``.
Timing: "batch" = N calls built lazily then one eval (device throughput incl. MLX's host
cost per kernel when that is larger), median over reps; "sync" = one call per eval +
synchronize (latency). Parity: max |err| against an fp32 reference (decode, L = 2048) or
the bf16 MLX SDPA (L = 8192).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import mlx.core as mx

HQ, HKV, D = 16, 2, 256
SCALE = D ** -0.5
BF = mx.bfloat16


def _sync_eval(x):
    mx.eval(x)
    mx.synchronize()


def bench(fn, inner=20, reps=7, warmup=2):
    """(batch_ms, sync_ms): median per call over ``reps`` rounds of ``inner`` calls."""
    for _ in range(warmup):
        _sync_eval(fn())
    batch = []
    for _ in range(reps):
        t0 = time.perf_counter()
        outs = [fn() for _ in range(inner)]
        _sync_eval(outs)
        batch.append((time.perf_counter() - t0) / inner * 1e3)
    sync = []
    for _ in range(max(3, reps)):
        t0 = time.perf_counter()
        _sync_eval(fn())
        sync.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(batch), statistics.median(sync)


def first_call(fn):
    t0 = time.perf_counter()
    _sync_eval(fn())
    return (time.perf_counter() - t0) * 1e3


def _rand(shape, dtype=BF):
    return mx.random.normal(shape).astype(dtype)


def cache_views(T):
    """K/V as mlx-lm's KVCache returns them: [..., :T, :] views of a 256-step buffer."""
    cap = ((T + 255) // 256) * 256
    kb, vb = _rand((1, HKV, cap, D)), _rand((1, HKV, cap, D))
    mx.eval(kb, vb)
    return kb[..., :T, :], vb[..., :T, :]


def maxerr(a, b):
    return float(mx.max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32))).item())


def stock_gated(q, k, v, mask, gate):
    B, _, L, _ = q.shape
    o = mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask=mask)
    o = o.transpose(0, 2, 1, 3).reshape(B, L, -1)
    return o * mx.sigmoid(gate.reshape(B, L, -1))


def run_decode(A, rows, contexts, sweep):
    for T in contexts:
        mx.random.seed(T)
        q = _rand((1, HQ, 1, D))
        k, v = cache_views(T)
        gate = _rand((1, 1, HQ, 2 * D))[..., D:]
        mx.eval(q, gate)
        nbytes = 2 * T * D * 2 * HKV
        inner = 50 if T <= 32768 else 20
        ref32 = A.sdpa_gated_reference(q.astype(mx.float32), k.astype(mx.float32),
                                       v.astype(mx.float32), SCALE, None,
                                       gate.astype(mx.float32))
        fns = {
            "lily_gated": lambda: A.sdpa_gated(q, k, v, SCALE, None, gate),
            "lily_sdpa": lambda: A.sdpa(q, k, v, SCALE),
            "mlx_sdpa": lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE),
            "mlx_sdpa+gate": lambda: stock_gated(q, k, v, None, gate),
        }
        for name, fn in fns.items():
            comp = first_call(fn)
            b, s = bench(fn, inner=inner)
            err = None
            if name in ("lily_gated", "mlx_sdpa+gate"):
                err = maxerr(fn().reshape(ref32.shape), ref32)
            rows.append(dict(op="decode", T=T, impl=name, batch_ms=b, sync_ms=s,
                             gbps=nbytes / (b * 1e-3) / 1e9, first_call_ms=comp,
                             max_err=err, block=A.decode_block(T, 1, HKV, A.current_backend())
                             if name.startswith("lily") else None))
        if sweep:
            for ch in sweep:
                for pf in (1, 2):
                    fn = lambda ch=ch, pf=pf: A.decode_attention(  # noqa: E731
                        q, k, v, SCALE, gate, block=ch, prefetch=pf)
                    comp = first_call(fn)
                    b, s = bench(fn, inner=inner, reps=5)
                    err = maxerr(fn().reshape(ref32.shape), ref32)
                    rows.append(dict(op="decode_sweep", T=T, impl=f"block={ch} pf={pf}",
                                     block=ch, prefetch=pf, batch_ms=b, sync_ms=s,
                                     gbps=nbytes / (b * 1e-3) / 1e9, first_call_ms=comp,
                                     max_err=err))


def run_prefill(A, rows, shapes):
    for L, T in shapes:
        mx.random.seed(L + T)
        q = _rand((1, HQ, L, D))
        k, v = cache_views(T)
        gate = _rand((1, L, HQ, 2 * D))[..., D:]
        mx.eval(q, gate)
        pairs = L * (T - L) + L * (L + 1) // 2
        flops = 4.0 * D * HQ * pairs
        if L <= 2048:
            ref = A.sdpa_gated_reference(q.astype(mx.float32), k.astype(mx.float32),
                                         v.astype(mx.float32), SCALE, "causal",
                                         gate.astype(mx.float32))
        else:
            ref = stock_gated(q, k, v, "causal", gate)
        mx.eval(ref)
        fns = {
            "lily_gated": lambda: A.sdpa_gated(q, k, v, SCALE, "causal", gate),
            "lily_sdpa": lambda: A.sdpa(q, k, v, SCALE, "causal"),
            "mlx_sdpa": lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE,
                                                                     mask="causal"),
            "mlx_sdpa+gate": lambda: stock_gated(q, k, v, "causal", gate),
        }
        for name, fn in fns.items():
            comp = first_call(fn)
            b, s = bench(fn, inner=3, reps=5, warmup=1)
            err = None
            if name in ("lily_gated", "mlx_sdpa+gate"):
                err = maxerr(fn(), ref)
            rows.append(dict(op="prefill", L=L, T=T, impl=name, batch_ms=b, sync_ms=s,
                             tflops=flops / (b * 1e-3) / 1e12, first_call_ms=comp,
                             max_err=err))
        del q, k, v, gate, ref


def run_qk(A, rows):
    for L in (1, 2048):
        mx.random.seed(L)
        qp = _rand((1, L, HQ, 2 * D))
        queries = mx.split(qp, 2, axis=-1)[0]
        keys = _rand((1, L, HKV, D))
        w = (1.0 + 0.1 * mx.random.normal((D,))).astype(BF)
        mx.eval(qp, keys, w)
        kw = dict(rope_dims=64, base=1e7, offset=4096)
        for name, f in (("lily", A.qk_norm_rope), ("reference", A.qk_norm_rope_reference)):
            fn = lambda f=f: f(queries, keys, w, w, 1e-6, **kw)  # noqa: E731
            comp = first_call(fn)
            b, s = bench(fn, inner=50 if L == 1 else 10)
            a, r = A.qk_norm_rope(queries, keys, w, w, 1e-6, **kw)[0], \
                A.qk_norm_rope_reference(queries, keys, w, w, 1e-6, **kw)[0]
            rows.append(dict(op="qk_norm_rope", L=L, impl=name, batch_ms=b, sync_ms=s,
                             first_call_ms=comp, max_err=maxerr(a, r)))


def _mixer_module():
    """Qwen3NextAttention at production dims, 4-bit affine group-64 projections."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.models import qwen3_next

    args = qwen3_next.ModelArgs(
        model_type="qwen3_next", hidden_size=2048, num_hidden_layers=1, intermediate_size=512,
        num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=D, rms_norm_eps=1e-6,
        vocab_size=32, linear_num_value_heads=32, linear_num_key_heads=16,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1,
        shared_expert_intermediate_size=512, moe_intermediate_size=512, mlp_only_layers=[],
        norm_topk_prob=True, rope_theta=1e7, partial_rotary_factor=0.25,
        max_position_embeddings=262144, tie_word_embeddings=False, full_attention_interval=4)
    attn = qwen3_next.Qwen3NextAttention(args)
    mx.random.seed(7)
    params = [(n, (0.02 * mx.random.normal(p.shape)).astype(BF) if "norm" not in n
               else (1.0 + 0.1 * mx.random.normal(p.shape)).astype(BF))
              for n, p in tree_flatten(attn.parameters())]
    attn.update(tree_unflatten(params))
    nn.quantize(attn, group_size=64, bits=4)
    attn.eval()
    mx.eval(attn.parameters())
    return attn


def lily_gated_call(attn, x, mask, cache):
    """patches.qwen3_next.attention_call with the proposed sdpa_gated change."""
    import mlx_lily.ops.attention as A
    from mlx_lily.patches import qwen3_next as P

    B, L, _ = x.shape
    Hq, Hkv = attn.num_attention_heads, attn.num_key_value_heads
    q_out, keys, values = P.run_projection(P.projection(attn, "qkv", (attn.q_proj, attn.k_proj, attn.v_proj)), x)
    queries, gate = mx.split(q_out.reshape(B, L, Hq, -1), 2, axis=-1)
    rope = attn.rope
    q, k = A.qk_norm_rope(
        queries, keys.reshape(B, L, Hkv, -1), attn.q_norm.weight, attn.k_norm.weight,
        attn.q_norm.eps, rope_dims=rope.dims, base=rope.base, scale=rope.scale,
        traditional=rope.traditional, offset=cache.offset)
    v = values.reshape(B, L, Hkv, -1).transpose(0, 2, 1, 3)
    k, v = cache.update_and_fetch(k, v)
    return attn.o_proj(A.sdpa_gated(q, k, v, attn.scale, mask, gate))


def run_mixer(rows, contexts, chunk=2048):
    """Whole attention mixer for one decode token (cache of T tokens) and one 2048-token
    prefill chunk: stock mlx-lm vs the current patch vs the proposed gated call."""
    from mlx_lm.models.cache import KVCache
    from mlx_lm.models.qwen3_next import Qwen3NextAttention

    from mlx_lily.patches import qwen3_next as P

    attn = _mixer_module()
    impls = {
        "stock": lambda x, m, c: Qwen3NextAttention.__call__(attn, x, m, c),
        "lily_patch": lambda x, m, c: P.attention_call(attn, x, m, c),
        "lily_gated": lambda x, m, c: lily_gated_call(attn, x, m, c),
    }
    for T, L in [(t, 1) for t in contexts] + ([(chunk, chunk)] if chunk else []):
        cache = KVCache()
        T0 = T - L
        if T0 > 0:
            cache.update_and_fetch(_rand((1, HKV, T0, D)), _rand((1, HKV, T0, D)))
            mx.eval(cache.keys, cache.values)
        x = _rand((1, L, 2048))
        mask = "causal" if L > 1 else None
        outs = {}
        for name, f in impls.items():
            def fn(f=f):
                cache.offset = T0
                return f(x, mask, cache)
            comp = first_call(fn)
            b, s = bench(fn, inner=20 if L == 1 else 3, reps=5)
            outs[name] = fn()
            # Relative to the output scale: o_proj sums 4096 products, so an input change
            # of one bf16 ulp moves outputs by a few percent of their size in bf16.
            scale = float(mx.max(mx.abs(outs["stock"].astype(mx.float32))).item())
            rows.append(dict(op="mixer", T=T, L=L, impl=name, batch_ms=b, sync_ms=s,
                             first_call_ms=comp,
                             max_err=None if name == "stock"
                             else maxerr(outs[name], outs["stock"]) / max(scale, 1e-6)))


def fmt(rows):
    out = []
    out.append(f"{'op':<13}{'shape':<14}{'impl':<17}{'batch ms':>10}{'sync ms':>9}"
               f"{'GB/s|TF/s':>10}{'1st ms':>8}{'max err':>9}")
    for r in rows:
        shape = f"T={r['T']}" if r["op"].startswith("decode") else (
            f"L={r['L']},T={r['T']}" if r["op"] in ("prefill", "mixer") else f"L={r['L']}")
        rate = r.get("gbps") or r.get("tflops")
        out.append(f"{r['op']:<13}{shape:<14}{r['impl']:<17}{r['batch_ms']:>10.4f}"
                   f"{r['sync_ms']:>9.3f}{(rate or 0):>10.1f}{r['first_call_ms']:>8.0f}"
                   f"{(r['max_err'] if r['max_err'] is not None else float('nan')):>9.2g}")
    return "\n".join(out)


def summary(rows):
    lines = []
    by = {}
    for r in rows:
        key = (r["op"], r.get("T"), r.get("L"))
        by.setdefault(key, {})[r["impl"]] = r
    for (op, T, L), d in by.items():
        if op == "decode":
            lg, ms = d.get("lily_gated"), d.get("mlx_sdpa+gate")
            sweep = [r for r in rows if r["op"] == "decode_sweep" and r["T"] == T]
            best = min(sweep, key=lambda r: r["batch_ms"]) if sweep else None
            lines.append(
                f"decode T={T}: lily+gate {lg['batch_ms']*1e3:.1f} us ({lg['gbps']:.0f} GB/s, "
                f"block {lg['block']}, err {lg['max_err']:.2g}) vs stock {ms['batch_ms']*1e3:.1f} us"
                f" -> x{ms['batch_ms']/lg['batch_ms']:.2f}"
                + (f"; best block {best['block']} pf {best['prefetch']} "
                   f"{best['batch_ms']*1e3:.1f} us ({best['gbps']:.0f} GB/s)" if best else ""))
        elif op == "prefill":
            lg, ms = d.get("lily_gated"), d.get("mlx_sdpa+gate")
            lines.append(
                f"prefill L={L} T={T}: lily+gate {lg['batch_ms']:.3f} ms ({lg['tflops']:.0f} TF/s,"
                f" err {lg['max_err']:.2g}) vs stock {ms['batch_ms']:.3f} ms -> "
                f"x{ms['batch_ms']/lg['batch_ms']:.2f}")
        elif op == "mixer":
            st, lp, lg = d["stock"], d["lily_patch"], d["lily_gated"]
            lines.append(f"mixer L={L} T={T}: stock {st['batch_ms']*1e3:.0f} us, patch "
                         f"{lp['batch_ms']*1e3:.0f} us, patch+sdpa_gated {lg['batch_ms']*1e3:.0f} us"
                         f" (sync {st['sync_ms']*1e3:.0f}/{lp['sync_ms']*1e3:.0f}/"
                         f"{lg['sync_ms']*1e3:.0f} us; rel err {lg['max_err']:.2g})")
        elif op == "qk_norm_rope":
            a, r = d["lily"], d["reference"]
            lines.append(f"qk_norm_rope L={L}: lily {a['batch_ms']*1e3:.1f} us vs reference "
                         f"{r['batch_ms']*1e3:.1f} us (err {a['max_err']:.2g})")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--contexts", default="4096,32768,131072")
    p.add_argument("--prefill", default="2048:2048,2048:8192,8192:8192",
                   help="comma-separated L:T pairs")
    p.add_argument("--sweep", default="32,64,128,256,512",
                   help="decode split blocks to sweep ('' to skip)")
    p.add_argument("--mixer", default="4096,32768",
                   help="decode contexts for the whole-mixer comparison ('' to skip)")
    p.add_argument("--mixer-chunk", type=int, default=2048,
                   help="prefill chunk length for the mixer comparison (0 to skip)")
    args = p.parse_args(argv)

    import mlx_lily.ops.attention as A

    backend = A.current_backend()
    print(f"[attention_bench] mlx {mx.__version__} device {mx.default_device()} "
          f"backend {backend} kernels {A.has_kernel(backend)}", flush=True)
    if not A.has_kernel(backend):
        print("no Lily attention kernels on this backend; nothing to measure")
        return 1
    t0 = time.time()
    rows: list = []
    run_qk(A, rows)
    print(f"  qk done {time.time()-t0:.1f}s", flush=True)
    sweep = [int(s) for s in args.sweep.split(",") if s]
    run_decode(A, rows, [int(t) for t in args.contexts.split(",") if t], sweep)
    print(f"  decode done {time.time()-t0:.1f}s", flush=True)
    shapes = [tuple(int(x) for x in s.split(":")) for s in args.prefill.split(",") if s]
    run_prefill(A, rows, shapes)
    print(f"  prefill done {time.time()-t0:.1f}s", flush=True)
    if args.mixer:
        run_mixer(rows, [int(t) for t in args.mixer.split(",") if t], args.mixer_chunk)
        print(f"  mixer done {time.time()-t0:.1f}s", flush=True)
    print(fmt(rows))
    # decode/prefill outputs are O(1): 0.05 is ~6 bf16 ulps; q/k rows reach |x| ~ 8.
    limit = {"qk_norm_rope": 0.07, "mixer": 0.1}
    bad = [r for r in rows if r.get("max_err") is not None
           and r["max_err"] > limit.get(r["op"], 0.05)]
    print("== summary")
    print(summary(rows))
    print(f"parity: {'FAIL ' + str([(r['op'], r['impl'], r.get('T'), r['max_err']) for r in bad]) if bad else 'ok'}")
    print(f"total {time.time()-t0:.1f}s")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "attention_bench.json")
    with open(path, "w") as f:
        json.dump(dict(mlx=mx.__version__, device=str(mx.default_device()), backend=backend,
                       decode_block={str(t): A.decode_block(int(t), 1, HKV, backend)
                                     for t in args.contexts.split(",") if t},
                       rows=rows), f, indent=1)
    print(f"wrote {path}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
