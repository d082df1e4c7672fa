"""One Qwen3.6-35B-A3B Gated DeltaNet layer (Hk=16, Hv=32, Dk=Dv=128, conv K=4,
C=8192, bf16, fp32 state): Lily's fused kernels vs the op reference (mlx-lm's math) and
vs mlx-lm's ``gated_delta_ops`` per-timestep path, with parity checks.

Run on a CUDA (or Metal) machine, with mlx-lily installed:
    python benchmarks/gpu/gated_delta_bench.py --out DIR        (DIR defaults to $OUT)
Prints tables and writes DIR/gated_delta_bench.json. Budget: ~60 s on an H200.

Measured (inputs are row views of one fused projection output, as the patch passes them):
- decode (S=1, B=1, 4, 16): "batch" = N chained steps (each step's caches feed the
  next) built lazily, one eval, per step; "sync" = one step + eval + synchronize.
  GB/s = (state read + write, 2 x 2 MiB per layer at B=1, + conv state read/write + inputs
  + conv weight + output) / batch time. Also a sweep of the decode warps per block.
- prefill S=512 and S=2048 (B=1, fresh caches): kernels (prep + scan + norm), the
  chunked formulation (prep + ``scan_chunked`` on MLX matmuls + norm), vs the
  reference (stock ops; ~0.2 s per layer at 2048 on CUDA, timed once), and a sweep of the
  scan configuration (LPR lanes per row, RPL rows per lane group, WPB warps per block)
  at S=2048 to pick ``SCAN_CONFIG``.
Parity: max |err| / max |ref| of out and state against the reference (which rounds gates
to bf16: ~1e-3 state differences are expected; > 1e-2 is a bug).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import mlx.core as mx
import numpy as np

from mlx_lily import kernels as K
from mlx_lily.backend import current_backend
from mlx_lily.ops import gated_delta as G

HK, HV, D, KS = 16, 32, 128, 4
C = 2 * HK * D + HV * D
BF = mx.bfloat16
DIMS = dict(num_k_heads=HK, head_k_dim=D, num_v_heads=HV, head_v_dim=D, eps=1e-6)
PREFILL_S = (512, 2048)
SWEEP_S = 2048
DECODE_B = (1, 4, 16)


def _sync_eval(x):
    mx.eval(x)
    mx.synchronize()


def timed(fn, reps=5, warmup=1):
    """Median seconds of ``fn()`` + eval + synchronize."""
    for _ in range(warmup):
        _sync_eval(fn())
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        _sync_eval(fn())
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def inputs(B, S, seed=0):
    rng = np.random.default_rng(seed)

    def arr(shape, scale=1.0, dt=BF, off=0.0):
        return mx.array((off + scale * rng.standard_normal(shape)).astype(np.float32)).astype(dt)

    W = C + HV * D + 2 * HV
    y = arr((B, S, W))
    qkv, z, b, a = mx.split(y, [C, C + HV * D, C + HV * D + HV], axis=-1)
    p = dict(qkv=qkv, z=z.reshape(B, S, HV, D), b=b, a=a,
             conv_weight=arr((C, KS, 1), 0.3), conv_state=arr((B, KS - 1, C)),
             A_log=mx.array(np.log(rng.uniform(1, 16, HV)).astype(np.float32)),
             dt_bias=arr((HV,), 0.1, off=1.0), state=arr((B, HV, D, D), 0.1, mx.float32),
             norm_weight=arr((D,), 0.1, off=1.0))
    mx.eval(list(p.values()))
    return p


def kernel_fn(backend, **kw):
    get = lambda spec: K.get(spec, backend)  # noqa: E731
    return lambda p: G.gated_delta_fused(**p, **DIMS, get_kernel=get, **kw)


def reference_fn(p):
    return G.gated_delta_reference(**p, **DIMS)


def ops_fn(p):
    """mlx-lm's stock per-timestep ``gated_delta_ops`` (use_kernel=False) path."""
    from mlx_lm.models import gated_delta as mg

    orig = mg.gated_delta_update

    def upd(*a, **k):
        k["use_kernel"] = False
        return orig(*a, **k)

    saved = mg.gated_delta_update
    mg.gated_delta_update = upd
    try:
        return G.gated_delta_reference(**p, **DIMS)
    finally:
        mg.gated_delta_update = saved


def parity(got, ref):
    out = {}
    for name, g, r in zip(("out", "conv", "state"), got, ref):
        g = np.array(g.astype(mx.float32))
        r = np.array(r.astype(mx.float32))
        out[name] = float(np.abs(g - r).max() / max(np.abs(r).max(), 1e-30))
        out[name + "_nan"] = int(np.isnan(g).sum())
    return out


def chain(fn, p, n):
    """n decode steps, each fed the previous step's caches; returns all outputs."""
    cs, st, outs = p["conv_state"], p["state"], []
    for _ in range(n):
        o, cs, st = fn(dict(p, conv_state=cs, state=st))
        outs.append(o)
    return outs + [cs, st]


def decode_bytes(B):
    st = B * HV * D * D * 4 * 2
    conv = B * (KS - 1) * C * 2 * 2
    ins = B * (C + HV * D + 2 * HV) * 2 + C * KS * 2 + HV * 4 * 2 + D * 2
    out = B * HV * D * 2
    return st + conv + ins + out


def main():
    # the chunked scan's matmuls in fp32 (MLX's CUDA default is TF32; read at first use)
    os.environ.setdefault("MLX_ENABLE_TF32", "0")
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true", help="fewer reps / sweeps")
    ap.add_argument("--sweep-budget-s", type=float, default=120.0,
                    help="stop the scan-configuration sweep after this many seconds of run time "
                         "(at least one configuration always runs)")
    ap.add_argument("--sweep-only", action="store_true",
                    help="only the scan-configuration sweep (each configuration's output also "
                         "checked against the reference)")
    ap.add_argument("--configs", default=None, metavar="L,R,W;L,R,W",
                    help="scan configurations of the sweep (LPR,RPL,WPB; ';'-separated)")
    args = ap.parse_args()
    backend = current_backend()
    if backend not in ("cuda", "metal"):
        print(f"no GPU backend (current: {backend}); nothing to benchmark")
        return 1
    res = dict(backend=backend, device=str(mx.default_device()), mlx=mx.__version__,
               scan_config_default=list(G.scan_config(backend)),
               decode_nw_default=G.decode_warps(D))
    t_start = time.perf_counter()
    kern = kernel_fn(backend)

    # ---- compile (NVRTC / Metal library builds happen on first use)
    t0 = time.perf_counter()
    _sync_eval(kern(inputs(1, 1)))
    _sync_eval(kern(inputs(1, 4)))
    res["compile_s"] = time.perf_counter() - t0
    print(f"[{backend}] first-use compile of the 4 kernels: {res['compile_s']:.2f} s")

    # ---- decode
    n_chain = 32 if args.quick else 64
    skip = args.sweep_only
    rows = []
    res["decode"] = {}
    for B in () if skip else DECODE_B:
        p = inputs(B, 1, seed=B)
        par = parity(kern(p), reference_fn(p))
        r = {"parity": par}
        for name, fn in (("lily", kern), ("reference", reference_fn)):
            batch = timed(lambda: chain(fn, p, n_chain), reps=3) / n_chain
            sync = timed(lambda: fn(p), reps=9)
            r[name] = dict(batch_ms=batch * 1e3, sync_ms=sync * 1e3)
        r["lily"]["GBps"] = decode_bytes(B) / (r["lily"]["batch_ms"] * 1e-3) / 1e9
        r["speedup_batch"] = r["reference"]["batch_ms"] / r["lily"]["batch_ms"]
        res["decode"][f"B{B}"] = r
        rows.append((f"decode B={B}", r["lily"]["batch_ms"], r["lily"]["sync_ms"],
                     r["reference"]["batch_ms"], r["reference"]["sync_ms"],
                     r["lily"]["GBps"], par))
        print(f"decode B={B}: lily {r['lily']['batch_ms']:.4f} ms/step ({r['lily']['GBps']:.0f} GB/s), "
              f"reference {r['reference']['batch_ms']:.3f} ms/step, parity {par}", flush=True)
    # decode warps sweep (B=1)
    p = inputs(1, 1, seed=7)
    sweep = {}
    for nw in () if skip else (4, 8, 16):
        fn = kernel_fn(backend, decode_nw=nw)
        ok = parity(fn(p), reference_fn(p))
        t = timed(lambda: chain(fn, p, n_chain), reps=3) / n_chain
        sweep[nw] = dict(batch_ms=t * 1e3, parity_state=ok["state"], parity_out=ok["out"])
    res["decode_nw_sweep"] = sweep

    # ---- prefill
    res["prefill"] = {}
    for S in () if skip else PREFILL_S:
        p = inputs(1, S, seed=S)
        p["conv_state"] = None
        p["state"] = None
        got = kern(p)
        t_ref0 = time.perf_counter()
        ref = reference_fn(p)
        _sync_eval(ref)
        t_ref = time.perf_counter() - t_ref0
        par = parity(got, ref)
        t_k = timed(lambda: kern(p), reps=5 if S == 512 else 3)
        r = dict(parity=par, lily_ms=t_k * 1e3, reference_ms=t_ref * 1e3,
                 lily_tok_per_s=S / t_k, speedup=t_ref / t_k)
        # the chunked formulation (prep + scan_chunked with MLX matmuls + norm)
        kc = kernel_fn(backend, scan_cfg=G.scan_config(backend), scan="chunked")
        r["chunked_parity"] = parity(kc(p), ref)
        t_c = timed(lambda: kc(p), reps=5 if S == 512 else 3)
        r.update(chunked_ms=t_c * 1e3, chunked_tok_per_s=S / t_c)
        print(f"prefill S={S}: chunked scan {t_c * 1e3:.2f} ms ({S / t_c:.0f} tok/s per layer), "
              f"parity {r['chunked_parity']}", flush=True)
        if backend == "metal":  # there the reference uses mlx-lm's Metal kernel
            t0 = time.perf_counter()
            _sync_eval(ops_fn(p))
            r["ops_ms"] = (time.perf_counter() - t0) * 1e3
        res["prefill"][f"S{S}"] = r
        print(f"prefill S={S}: lily {t_k * 1e3:.2f} ms ({S / t_k:.0f} tok/s per layer), reference "
              f"{t_ref * 1e3:.1f} ms, parity {par}", flush=True)
        rows.append((f"prefill S={S}", t_k * 1e3, None, t_ref * 1e3, None, None, par))

    # ---- scan configuration sweep
    p = inputs(1, SWEEP_S, seed=3)
    cfgs = [(16, 2, 4), (8, 1, 4), (32, 4, 1), (8, 2, 4), (16, 4, 2), (8, 1, 8),
            (16, 1, 8), (32, 2, 2), (32, 1, 4)]
    if args.configs:
        cfgs = [tuple(int(v) for v in c.split(",")) for c in args.configs.split(";") if c]
    elif args.quick:
        cfgs = cfgs[:4]
    bad = [c for c in cfgs if not G._scan_ok(c, D, D)]
    if bad:
        print(f"skipping scan configurations that do not tile Dk=Dv={D}: {bad}")
        cfgs = [c for c in cfgs if c not in bad] or [G.scan_config(backend)]
    ref = None
    if args.sweep_only:
        ref = reference_fn(p)
        _sync_eval(ref)
    base = None
    sweep = {}
    for cfg in cfgs:
        fn = kernel_fn(backend, scan_cfg=cfg)
        if sweep and time.perf_counter() - t_start > args.sweep_budget_s:
            break
        got = fn(p)
        _sync_eval(got)
        if base is None:
            base = got
        d = float(mx.abs(got[2] - base[2]).max().item())
        t = timed(lambda: fn(p), reps=3)
        sweep[",".join(map(str, cfg))] = dict(ms=t * 1e3, state_vs_first=d)
        if ref is not None:
            sweep[",".join(map(str, cfg))]["parity"] = parity(got, ref)
    res[f"scan_sweep_S{SWEEP_S}"] = sweep
    best = min(sweep.items(), key=lambda kv: kv[1]["ms"])
    res["scan_best"] = best[0]
    res["total_s"] = time.perf_counter() - t_start

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "gated_delta_bench.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)

    print(f"decode NW sweep (B=1, batch ms): " + ", ".join(
        f"NW={k}: {v['batch_ms']:.4f} (state err {v['parity_state']:.1e})"
        for k, v in res["decode_nw_sweep"].items()))
    print(f"scan sweep S={SWEEP_S} (LPR,RPL,WPB: ms): " + ", ".join(
        f"{k}: {v['ms']:.2f}" for k, v in sweep.items()) + f"  -> best {best[0]}")
    for k, v in sweep.items():
        if "parity" in v:
            print(f"  {k}: parity vs reference {v['parity']}")
    print(f"{'case':<15}{'lily ms':>10}{'lily sync':>10}{'ref ms':>10}{'ref sync':>10}"
          f"{'GB/s':>8}  parity max|err|/max|ref| out, state, conv")
    for name, lb, ls, rb, rs, gb, par in rows:
        f = lambda v, w=10, d=4: f"{v:>{w}.{d}f}" if v is not None else " " * w  # noqa: E731
        print(f"{name:<15}{f(lb)}{f(ls)}{f(rb, d=2)}{f(rs)}{f(gb, 8, 1)}  "
              f"{par['out']:.1e}, {par['state']:.1e}, {par['conv']:.0e}"
              + ("  NaN!" if par["out_nan"] or par["state_nan"] else ""))
    for S in () if skip else PREFILL_S:
        r = res["prefill"][f"S{S}"]
        print(f"prefill S={S}: {r['lily_tok_per_s']:.0f} tok/s per layer, "
              f"{r['speedup']:.0f}x the reference")
    print(f"wrote {path} ({res['total_s']:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
