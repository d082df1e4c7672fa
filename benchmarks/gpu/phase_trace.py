"""Where the GPU time of the two big decode launches goes, block by block: the one-launch
MoE block (``lily_moe_decode``) and the GDN decode with its input projection and
out_proj inside (``lily_gdn_decode``, PROJ + OUTP). Each is built once more with
``LILY_PHASE_TRACE`` defined (``shaders/cuda/phase_trace.cuh``) and one more output, so
thread 0 of every block writes the GPU's global timer (ns) at the kernel's phase
boundaries; the production build expands those stamps to nothing.

Production dims (Qwen3.6-35B-A3B), random 4-bit weights, ``--chain`` launches chained as in
a decode step (each layer's output feeds the next), each with its own counters, over
``--distinct`` weight sets cycled so that a launch's weights are not in L2 (as in the
model, where every layer has its own), after a GPU spin that covers the host's dispatch.

    python benchmarks/gpu/phase_trace.py --out DIR [--kernels moe,gdn] [--rows 1] \
        [--chain 40] [--distinct 8] [--reps 5] [--variants base,l2pf --rounds 2]
    python benchmarks/gpu/phase_trace.py --check-compile --nvrtc LIB [--include DIR]
        (CPU: the traced texts of a recorded decode step compile with NVRTC)

Writes ``DIR/phase_trace.json``: per kernel, the chain's GPU time per launch
(``gpu_clock``) and, per launch, microseconds from its first block's start to each
phase's boundaries (medians over launches and reps; the gap from the previous launch's
last block to this one's first). Slots: MoE 0 block start, 1 ticket taken, 2 router: the
row normalised / gate+up and down: the wait over, 3 inputs in shared memory (gate+up, down),
4 math done, 5 the block's arrival done, 6 the ticket, 7 the SM; GDN 0 start, 1 row
normalised, 2 projection rows written, 3 the head's last part goes on, 4 the step done,
5 out_proj's share written, 6 the row's sum written (last head), 7 the SM.

``--variants``: each kernel also built as an experiment (``VARIANTS``: a define ahead of its
headers; ``l2pf``: the L2 prefetch hints of ``shaders/cuda/l2_prefetch.cuh`` for what a
phase reads after a wait, ``l2pf_proj``: also the GDN decode's projection rows during its
norm), measured in
``--rounds`` rounds that alternate the variants in this process; the JSON then holds, per
kernel, one summary per variant and round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

SLOTS = 8
D, I, E, K = 2048, 512, 256, 8
HK, HV, DK, DV, KS = 16, 32, 128, 128, 4
TRACE_DEFINE = "#define LILY_PHASE_TRACE 1\n"
#: Experiments: variant name -> the define added ahead of the kernel's headers.
VARIANTS = {"base": "", "l2pf": "#define LILY_L2_PREFETCH 1\n",
            "l2pf_proj": "#define LILY_L2_PREFETCH 1\n#define LILY_L2_PREFETCH_PROJ 1\n"}


def trace_kernel(spec, variant: str = "base"):
    """``spec``'s CUDA kernel built with ``LILY_PHASE_TRACE`` (and ``variant``'s define)
    and a ``trace`` output."""
    from mlx_lily import kernels

    head, body = kernels.cuda_parts(spec.stem)
    sfx = "" if variant == "base" else "_" + variant
    return mx.fast.cuda_kernel(name=spec.name + "_trace" + sfx, input_names=list(spec.inputs),
                               output_names=list(spec.outputs) + ["trace"], source=body,
                               header=TRACE_DEFINE + VARIANTS[variant] + head,
                               ensure_row_contiguous=spec.ensure_row_contiguous)


class Traced:
    """A kernel callable as the op modules call one (``inputs=..., grid=..., ...``) that
    adds the ``trace`` output (``SLOTS`` uint64 per block), keeps it in ``traces`` and
    returns the other outputs."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.traces = []

    def __call__(self, **kw):
        gx, gy, gz = kw["grid"]
        blocks = (gx // kw["threadgroup"][0]) * gy * gz
        kw = dict(kw, output_shapes=list(kw["output_shapes"]) + [(blocks * SLOTS,)],
                  output_dtypes=list(kw["output_dtypes"]) + [mx.uint64])
        out = self.kernel(**kw)
        self.traces.append(out[-1])
        return out[:-1]


def _run_chain(traced, chain_fn, x0, reps, spin_ms):
    """GPU seconds of ``chain_fn`` per rep (``gpu_clock.time_chain``) and each rep's traces
    as ``[launches, blocks, SLOTS]`` uint64 arrays."""
    from mlx_lily.bench import gpu_clock

    out = []
    for rep in range(reps + 1):  # the first run compiles and warms up
        traced.traces = []
        r = gpu_clock.time_chain(lambda x: [chain_fn(x)] + traced.traces, x0, spin_ms=spin_ms)
        if rep == 0:
            continue
        tr = np.stack([np.array(t).reshape(-1, SLOTS) for t in traced.traces]).astype(np.int64)
        out.append({"gpu_s": r["gpu_s"], "host_covered": r["host_covered"], "trace": tr})
    return out


def _us(a):
    return float(a) / 1e3


def _moe_launch(tr, tiles):
    """Phase boundaries of one ``lily_moe_decode`` launch (us from its first block's start):
    ``tiles`` = (router, gate+up, down) blocks."""
    rt, gt, dt = tiles
    t0 = tr[:, 0].min()
    tick = tr[:, 6].astype(np.int64)
    ph = {"router": tr[tick < rt], "gate_up": tr[(tick >= rt) & (tick < rt + gt)],
          "down": tr[tick >= rt + gt]}
    rel = lambda v: _us(v - t0)  # noqa: E731
    r = {"last_block_start": rel(tr[:, 0].max()), "end": rel(tr[:, 5].max()),
         "sms": int(len(np.unique(tr[:, 7])))}
    r["router_norm_done_max"] = rel(ph["router"][:, 2].max())
    r["router_done_max"] = rel(ph["router"][:, 4].max())
    for name in ("gate_up", "down"):
        p = ph[name]
        r[f"{name}_start_max"] = rel(p[:, 0].max())
        r[f"{name}_wait_over_min"] = rel(p[:, 2].min())
        r[f"{name}_wait_over_max"] = rel(p[:, 2].max())
        r[f"{name}_inputs_max"] = rel(p[:, 3].max())
        r[f"{name}_done_max"] = rel(p[:, 4].max())
        r[f"{name}_inputs_us_median"] = _us(np.median(p[:, 3] - p[:, 2]))
        r[f"{name}_math_us_median"] = _us(np.median(p[:, 4] - p[:, 3]))
        # blocks that started only after the previous phase was done (a later wave)
        prev_done = (ph["router"][:, 4].max() if name == "gate_up"
                     else ph["gate_up"][:, 4].max())
        r[f"{name}_late_starts"] = int((p[:, 0] > prev_done).sum())
    return r, int(t0), int(tr[:, 5].max())


def _gdn_launch(tr):
    """Phase boundaries of one ``lily_gdn_decode`` PROJ + OUTP launch (us from its first
    block's start)."""
    t0 = tr[:, 0].min()
    rel = lambda v: _us(v - t0)  # noqa: E731
    last = tr[tr[:, 3] > 0]
    end = max(tr[:, 6].max(), tr[:, 5].max(), tr[:, 2].max())
    r = {"last_block_start": rel(tr[:, 0].max()), "norm_done_max": rel(tr[:, 1].max()),
         "proj_done_min": rel(tr[:, 2].min()), "proj_done_max": rel(tr[:, 2].max()),
         "step_start_max": rel(last[:, 3].max()), "step_done_max": rel(last[:, 4].max()),
         "outproj_done_max": rel(last[:, 5].max()), "end": rel(end),
         "proj_us_median": _us(np.median(tr[:, 2] - tr[:, 1])),
         "step_us_median": _us(np.median(last[:, 4] - last[:, 3])),
         "outproj_us_median": _us(np.median(last[:, 5] - last[:, 4])),
         "sum_us": _us(tr[:, 6].max() - tr[tr[:, 6] > 0][:, 5].max())
         if (tr[:, 6] > 0).any() else None,
         "sms": int(len(np.unique(tr[:, 7])))}
    return r, int(t0), int(end)


def _summarise(runs, per_launch):
    """Medians over launches and reps of ``per_launch(trace) -> (dict, t0, end)``, the gap
    between consecutive launches, and the GPU time per launch."""
    rows, gaps = [], []
    for run in runs:
        prev_end = None
        for tr in run["trace"]:
            d, t0, end = per_launch(tr)
            rows.append(d)
            if prev_end is not None:
                gaps.append(_us(t0 - prev_end))
            prev_end = end
    keys = [k for k in rows[0] if all(r.get(k) is not None for r in rows)]
    med = {k: statistics.median(r[k] for r in rows) for k in keys}
    n = len(runs[0]["trace"])

    def spread(v):
        q = np.quantile(np.asarray(v, dtype=np.float64), [0.1, 0.5, 0.9, 1.0]) if v else []
        return dict(zip(("p10", "p50", "p90", "max"), (float(x) for x in q)))

    return {"launches": n, "gpu_us_per_launch": [1e6 * r["gpu_s"] / n for r in runs],
            "host_covered": all(r["host_covered"] for r in runs),
            "gap_us_median": statistics.median(gaps) if gaps else None,
            "end_us_spread": spread([r["end"] for r in rows]),
            "gap_us_spread": spread(gaps),
            "phases_us_median": med,
            "first_rep_first_launches": rows[:3]}


def moe(rows, chain, distinct, reps, spin_ms, variant="base"):
    """``lily_moe_decode`` (as ``variant``) traced at ``rows`` token rows: ``_summarise``'s
    dict plus the tiles of each phase."""
    from mlx_lily.ops import moe_experts as M
    from mlx_lily.patches import layouts
    from mlx_lily.qproj import QProj
    from mlx_lily.testing.models import moe_block

    traced = Traced(trace_kernel(M.FUSED_SPEC, variant))
    mx.random.seed(0)  # the same rows (hence routing) for every variant and round
    x0 = mx.random.normal((rows, 1, D)).astype(mx.bfloat16)
    nw = (1.0 + 0.1 * mx.random.normal((D,))).astype(mx.bfloat16)
    plans = []
    for s in range(distinct):
        blk = moe_block(D, E, K, I, seed=s, random_codes=True)
        router = QProj.fuse([blk.gate, blk.shared_expert_gate])
        wts = layouts.decode_weights(blk.switch_mlp, blk.shared_expert)
        mx.eval(blk.parameters(), router.weight, router.scales, router.biases)
        plans.append(M.fused_plan(traced, wts, router, x0.shape, x0.dtype, K, True, 0))
    tiles = M.fused_phase_tiles(D, I, K, E, wts.bits, router.bits, rows)
    res = [mx.random.normal((rows, 1, D)).astype(mx.bfloat16) for _ in range(chain)]
    ctrs = [mx.zeros((M.FUSED_COUNTERS,), dtype=mx.int32) for _ in range(chain)]
    mx.eval(x0, nw, res, ctrs)

    def run_chain(x):
        for i in range(chain):
            x = plans[i % distinct](x, res[i], nw, 1e-6, ctrs[i], x)[0]
        return x

    runs = _run_chain(traced, run_chain, x0, reps, spin_ms)
    out = _summarise(runs, lambda tr: _moe_launch(tr, tiles))
    out.update({"rows": rows, "tiles": dict(zip(("router", "gate_up", "down"), tiles)),
                "rpw": list(M.fused_rpw())})
    return out


def gdn(rows, chain, distinct, reps, spin_ms, variant="base"):
    """``lily_gdn_decode`` (PROJ + OUTP, ``proj_split`` blocks per head; as ``variant``)
    traced at ``rows`` batch rows: ``_summarise``'s dict plus the blocks per launch."""
    from mlx_lily import kernels
    from mlx_lily.ops import gated_delta as G

    traced = Traced(trace_kernel(G.DECODE, variant))
    rng = np.random.default_rng(0)
    T = mx.bfloat16
    C = 2 * HK * DK + HV * DV
    P = 2 * HK * DK + 2 * HV * DV + 2 * HV

    def arr(shape, scale=1.0, offset=0.0, dt=T):
        return mx.array((offset + scale * rng.standard_normal(shape)).astype(np.float32)).astype(dt)

    layers = []
    for _ in range(distinct):
        w = mx.quantize(arr((P, D), D ** -0.5), group_size=64, bits=4)
        ow = mx.quantize(arr((D, HV * DV), (HV * DV) ** -0.5), group_size=64, bits=4)
        lw = dict(conv_weight=arr((C, KS, 1), 0.3),
                  A_log=mx.array(np.log(rng.uniform(1, 16, HV)).astype(np.float32)),
                  dt_bias=arr((HV,), 0.1, 1.0), norm_weight=arr((DV,), 0.1, 1.0),
                  conv_state=arr((rows, KS - 1, C)),
                  state=arr((rows, HV, DV, DK), 0.1, dt=mx.float32))
        mx.eval(w, ow, lw)
        layers.append((w, G.OutProj(*ow), lw, arr((D,), 0.1, 1.0)))
    x0 = arr((rows, 1, D))
    res = [arr((rows, 1, D)) for _ in range(chain)]
    need = G.counters_needed(rows, HV, True)
    ctrs = [G.proj_counters(need) for _ in range(chain)]
    mx.eval(x0, res, ctrs)
    split = G.proj_split("cuda")
    dims = dict(num_k_heads=HK, head_k_dim=DK, num_v_heads=HV, head_v_dim=DV, eps=1e-6)

    def run_chain(x):
        for i in range(chain):
            w, op, lw, inw = layers[i % distinct]
            p = G.DecodeProj(x, res[i], inw, 1e-6, *w, 64, 4, ctrs[i])
            out = G.gated_delta_fused(None, None, None, None, **lw, **dims, proj=p,
                                      proj_split=split, out_proj=op,
                                      get_kernel=lambda spec: traced if spec is G.DECODE
                                      else kernels.get(spec, "cuda"))
            x = out[4]
        return x

    runs = _run_chain(traced, run_chain, x0, reps, spin_ms)
    out = _summarise(runs, _gdn_launch)
    out.update({"rows": rows, "split": split, "blocks": int(runs[0]["trace"].shape[1])})
    return out


def check_compile(nvrtc: str, includes: list, arch=(9, 0), variants=("base",)) -> int:
    """CPU: every ``lily_moe_decode`` / ``lily_gdn_decode`` instantiation of a recorded
    B = 1 and B = 3 decode step (4 layers, stubbed kernels), rendered with
    ``LILY_PHASE_TRACE`` (and each of ``variants``' defines) and the ``trace`` output,
    compiles with NVRTC. Returns the number that failed."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from source_forms import expand, record_step
    from mlx_lily import cuda_cache, kernels

    kset = ",".join(sorted(kernels.VERIFIED["cuda"])) + ",batch_decode"
    nv = cuda_cache.Nvrtc(nvrtc)
    opts = cuda_cache.nvrtc_options(arch, cuda_cache.mlx_include_dirs() + list(includes))
    hdr = {cuda_cache.SHIM_NAME: cuda_cache._SHIM}
    seen, bad = set(), 0
    launches = [ln for rows in (1, 3) for ln in record_step(4, rows, kset)
                if ln.name in ("lily_moe_decode", "lily_gdn_decode")]
    for variant in variants:
        sfx = "" if variant == "base" else "_" + variant
        for ln in launches:
            tl = ln._replace(name=ln.name + "_trace" + sfx,
                             header=TRACE_DEFINE + VARIANTS[variant] + expand(ln.header),
                             source=expand(ln.source),
                             output_names=tuple(ln.output_names) + ("trace",),
                             output_dtypes=tuple(ln.output_dtypes) + (mx.uint64,))
            name = cuda_cache.kernel_name(tl)
            if name in seen:
                continue
            seen.add(name)
            try:
                nv.compile(cuda_cache.render(tl), name, "mlx::core::cu::" + name, opts, hdr)
                print(f"compiles: {name}")
            except Exception as e:  # noqa: BLE001 - report every failure
                bad += 1
                print(f"FAILED: {name}: {e}")
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    ap.add_argument("--kernels", default="moe,gdn")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--chain", type=int, default=40)
    ap.add_argument("--distinct", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--spin-ms", type=float, default=200.0)
    ap.add_argument("--variants", default="base",
                    help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--rounds", type=int, default=1,
                    help="rounds alternating the variants (each --reps reps)")
    ap.add_argument("--check-compile", action="store_true")
    ap.add_argument("--nvrtc", default=None)
    ap.add_argument("--include", action="append", default=[])
    a = ap.parse_args(argv)
    variants = a.variants.split(",")
    if any(v not in VARIANTS for v in variants) or len(set(variants)) != len(variants):
        ap.error(f"--variants: distinct names of {', '.join(VARIANTS)}")
    if a.rounds < 1:
        ap.error("--rounds must be at least 1")
    if a.check_compile:
        if not a.nvrtc:
            ap.error("--check-compile needs --nvrtc")
        return 1 if check_compile(a.nvrtc, a.include, variants=variants) else 0
    from mlx_lily.bench import gpu_clock

    if not gpu_clock.available():
        print("phase_trace: needs MLX's CUDA backend")
        return 1
    res = {"mlx": mx.__version__, "device": str(mx.default_device()), "rows": a.rows,
           "chain": a.chain, "distinct": a.distinct, "reps": a.reps}
    steps = {"moe": moe, "gdn": gdn}
    several = variants != ["base"] or a.rounds > 1
    if several:
        res["variants"], res["rounds"] = variants, a.rounds
    for name in a.kernels.split(","):
        per = {v: [] for v in variants}
        for rnd in range(a.rounds):
            for v in variants:
                t0 = time.time()
                try:
                    r = steps[name](a.rows, a.chain, a.distinct, a.reps, a.spin_ms, v)
                except Exception as e:  # noqa: BLE001 - keep what was measured
                    r = {"error": f"{type(e).__name__}: {e}"}
                r["elapsed_s"] = time.time() - t0
                per[v].append(r)
                if several and "error" in r:
                    print(f"{name} {v} round {rnd + 1}: {r['error']}")
                elif several:
                    ph = r.get("phases_us_median", {})
                    print(f"{name} {v} round {rnd + 1}: gpu us/launch "
                          f"{r.get('gpu_us_per_launch')}; end {r.get('end_us_spread')}; "
                          f"gap {r.get('gap_us_spread')}; "
                          + json.dumps({k: round(x, 3) for k, x in ph.items()}))
                else:
                    print(name, json.dumps({k: x for k, x in r.items()
                                            if k != "first_rep_first_launches"}, indent=1))
        res[name] = per if several else per["base"][0]
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"phase_trace-b{a.rows}.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
