"""Time the decode GEMVs of Qwen3.6-35B-A3B at B rows (a decode step of B sequences) and
check that each row gives the same bits as that row alone.

Shapes: the LM head (2048 -> 248320), the output projections (4096 -> 2048) and the
attention q|k|v projection behind its input norm (``lily_norm_qgemv``, 2048 -> 9216);
4-bit, group 64, bf16, random weights. Per launch, over ``--iters`` back-to-back
launches: ``gpu_us``, the device's own time (``mlx_lily.bench.gpu_clock.time_chain``,
median of 3; CUDA only, else None), and ``wall_us``, the wall time of one evaluation of
them, which includes launch overhead (tens of microseconds for the small GEMVs: ncu read
21.7 us for out_proj at 8 rows where the wall time read 55-62 us).

    python3 benchmarks/gpu/gemv_rows_bench.py --out DIR    # DIR/gemv_rows.json
    python3 benchmarks/gpu/gemv_rows_bench.py --shaders OTHER/shaders --out DIR2

``--shaders`` builds the kernels from another tree's ``shaders/`` folder (a candidate
kernel timed against this tree's in the same call). On CUDA the ``qgemv`` shapes also
run the tensor-core form ``lily_qgemv_mma`` at 1, 2 and 4 m-tiles per warp (rows
``kernel: "mma-rtN"``, with
``max_abs_diff_vs_simt``: its largest difference from ``lily_qgemv``'s result).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx

from mlx_lily import kernels
from mlx_lily.bench import gpu_clock
from mlx_lily.ops import norm_qgemv as NQ
from mlx_lily.ops import qgemv as Q

SHAPES = (("lm_head", Q, 2048, 248320), ("out_proj", Q, 4096, 2048),
          ("qkv_norm", NQ, 2048, 9216))


def _weights(o, k):
    w = (mx.random.normal((o, k)) * k ** -0.5).astype(mx.bfloat16)
    return mx.quantize(w, 64, 4)


def _wall_us(fn, x, iters):
    mx.eval(fn(x))
    mx.synchronize()
    t0 = time.perf_counter()
    mx.eval([fn(x) for _ in range(iters)])
    mx.synchronize()
    return (time.perf_counter() - t0) / iters * 1e6


def _gpu_us(fn, x, iters):
    if not gpu_clock.available():
        return None
    ts = [gpu_clock.time_chain(lambda x1: [fn(x1) for _ in range(iters)], x)["gpu_s"]
          for _ in range(3)]
    return statistics.median(ts) / iters * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shaders", type=Path, help="build from this shaders/ folder instead")
    ap.add_argument("--no-mma", action="store_true", help="leave out lily_qgemv_mma")
    args = ap.parse_args()
    if args.shaders is not None:
        root = args.shaders.resolve()
        if not (root / "cuda" / "qgemv.cu").is_file():
            raise SystemExit(f"--shaders {args.shaders}: no cuda/qgemv.cu there")
        kernels.shader_path = lambda backend, filename: root / backend / filename
    backend = "cuda" if mx.cuda.is_available() else "metal"
    out = []
    for name, mod, k, o in SHAPES:
        mx.random.seed(o)
        q, s, b = _weights(o, k)
        kern = kernels.build(mod.SPEC, backend)
        mma = None
        if mod is Q and backend == "cuda" and not args.no_mma:
            try:  # a --shaders tree without qgemv_mma.cu times lily_qgemv alone
                kernels.shader_path("cuda", Q.MMA_SPEC.stem + ".cu")
                mma = kernels.build(Q.MMA_SPEC, backend)
            except FileNotFoundError:
                mma = None
        nw = (1 + 0.1 * mx.random.normal((k,))).astype(mx.bfloat16)
        for rows in (int(r) for r in args.rows.split(",")):
            x = mx.random.normal((rows, 1, k)).astype(mx.bfloat16)
            res = mx.random.normal((rows, 1, k)).astype(mx.bfloat16)

            def run(xx=x, rr=res):
                if mod is Q:
                    return Q.launch(kern, xx, q, s, b, 64, 4)
                return NQ.launch(kern, xx, rr, nw, 1e-6, q, s, b, 64, 4)[0]

            def run_mma(xx=x, rr=None, rt=1):
                return Q.mma_plan(mma, xx.shape, xx.dtype, q, s, b, 64, 4, rt=rt)(xx)

            y_simt = None
            kinds = [("simt", run)]
            if mma is not None:
                kinds += [(f"mma-rt{rt}", lambda xx=x, rr=None, rt=rt: run_mma(xx, rr, rt))
                          for rt in (1, 2, 4)]
            for kind, fn in kinds:
                y = fn()
                alone = mx.concatenate([fn(x[i:i + 1], res[i:i + 1]) for i in range(rows)])
                gpu = _gpu_us(fn, x, args.iters)
                row = dict(op=name, kernel=kind, k=k, o=o, rows=rows,
                           gpu_us=None if gpu is None else round(gpu, 1),
                           wall_us=round(_wall_us(fn, x, args.iters), 1),
                           bits_equal_alone=bool(mx.array_equal(y, alone).item()))
                if kind == "simt":
                    y_simt = y
                else:
                    d = mx.abs(y.astype(mx.float32) - y_simt.astype(mx.float32))
                    row["max_abs_diff_vs_simt"] = round(float(d.max().item()), 5)
                print(json.dumps(row), flush=True)
                out.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gemv_rows.json").write_text(json.dumps(
        dict(backend=backend, device=str(mx.default_device()), iters=args.iters,
             shaders=str(args.shaders) if args.shaders else None, rows=out),
        indent=1))


if __name__ == "__main__":
    main()
