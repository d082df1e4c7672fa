"""Prefill projections: MLX's quantized matmul vs ``prefill_dequant`` (dequantize + dense
matmul), device-side time per call on Qwen3.6-35B-A3B's prefill shapes.

For each projection of a 2048-token prefill chunk (bf16 activations, MLX 4-bit affine
weights with group 64, the router 8-bit): ``mx.quantized_matmul`` (stock's path: MLX's
``qmm_sm80`` / ``qmm_naive`` on CUDA), ``mlx_lily.ops.qmm_dequant.try_dequant``'s two
steps (``mx.dequantize`` into scratch, then ``mx.matmul``), and each step alone. Times
are GPU seconds (``mlx_lily.bench.gpu_clock``: the chain queued behind a spinning kernel,
so host dispatch is not counted) of ``--calls`` calls, median of ``--reps``, per call; the
spin doubles (``SPIN_MS``) until it covers the host's dispatch, and a row it never covered
is marked ``*`` (its time includes host work). Also the whole shared expert, stock module
vs ``layouts.mlp``, with a bit-identity check. Prints a table and writes
``qmm_dequant_bench.json`` to ``--out``.

    python benchmarks/gpu/qmm_dequant_bench.py --out DIR          # on MLX's CUDA backend
    python benchmarks/gpu/qmm_dequant_bench.py --small --out DIR  # CPU smoke run (wall time)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import mlx.core as mx

#: (name, K inputs, O outputs, bits) of the projections prefill runs per layer.
SHAPES = [
    ("gdn in_proj fused", 2048, 12352, 4),
    ("attn q|k|v fused", 2048, 9216, 4),
    ("gdn out_proj / attn o_proj", 4096, 2048, 4),
    ("shared expert gate|up", 2048, 1024, 4),
    ("shared expert down", 512, 2048, 4),
    ("router + shared gate (8-bit)", 2048, 257, 8),
]
SMALL_SHAPES = [("small 4-bit", 256, 320, 4), ("small 8-bit", 256, 72, 8)]


def _weights(o: int, k: int, bits: int):
    w = mx.random.normal((o, k)).astype(mx.bfloat16) * 0.02
    q, s, b = mx.quantize(w, group_size=64, bits=bits)
    mx.eval(q, s, b)
    return q, s, b


#: The GPU's wait before a timed chain starts, doubled while the host's dispatch of the
#: chain outlasts it (50 ms did not always cover it, and the times then included host work).
SPIN_MS = (50.0, 100.0, 200.0, 400.0, 800.0)


def _time(fn, x, calls: int, reps: int) -> dict:
    """Seconds per call: device-side where ``gpu_clock`` works, else wall time.
    ``host_covered`` False: even the longest spin did not cover the host's dispatch, so
    the time includes host work (the table marks it ``*``)."""
    from mlx_lily.bench import gpu_clock

    def chain(x0):
        return [fn(x0) for _ in range(calls)]

    if gpu_clock.available():
        mx.eval(chain(x))  # first use: compiles and cuBLAS heuristics outside the timing
        for spin_ms in SPIN_MS:
            runs = [gpu_clock.time_chain(chain, x, spin_ms=spin_ms) for _ in range(reps)]
            covered = all(r["host_covered"] for r in runs)
            if covered:
                break
        return {"s": statistics.median(r["gpu_s"] for r in runs) / calls,
                "host_covered": covered, "spin_ms": spin_ms, "clock": "gpu"}
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(chain(x))
        ts.append(time.perf_counter() - t0)
    return {"s": statistics.median(ts) / calls, "host_covered": None, "clock": "wall"}


def shared_expert_row(rows_n: int, d: int, i: int, calls: int, reps: int) -> dict:
    """The whole shared expert (mlx-lm's ``Qwen3NextMLP``, 4-bit group 64): the stock
    module vs ``layouts.mlp`` (gate|up stacked, down; dequantize + matmul where the
    switch serves), per call, and whether the outputs are bit-identical."""
    import mlx.nn as nn
    from mlx_lm.models import qwen3_next

    from mlx_lily.ops import qmm_dequant as Q
    from mlx_lily.patches import layouts

    mlp = qwen3_next.Qwen3NextMLP(d, i)
    mlp.update({n: {"weight": (mx.random.normal(getattr(mlp, n).weight.shape) * d ** -0.5)
                    .astype(mx.bfloat16)} for n in ("gate_proj", "up_proj", "down_proj")})
    nn.quantize(mlp, 64, 4)
    mx.eval(mlp.parameters())
    x = (mx.random.normal((rows_n, d)) * 0.5).astype(mx.bfloat16)
    mx.eval(x)
    from mlx_lily.backend import current_backend, op_enabled

    served = (op_enabled(Q.SHARED_NAME) and Q.has_shared_kernel(current_backend())
              and Q.stacked_linear((mlp.gate_proj, mlp.up_proj), x) is not None)
    row = {"shape": f"shared expert MLP {d}->{i}->{d}", "served": served}
    for label, fn in (("stock", mlp), ("lily", lambda x0: layouts.mlp(mlp, x0))):
        r = _time(fn, x, calls, reps)
        row[f"{label}_us"] = 1e6 * r["s"]
        row[f"{label}_host_covered"] = r["host_covered"]
        row["clock"] = r["clock"]
    ref, got = mlp(x), layouts.mlp(mlp, x)
    row["bit_identical"] = bool(mx.array_equal(ref, got).item())
    row["max_rel_err"] = (mx.abs(ref.astype(mx.float32) - got.astype(mx.float32)).max()
                          / mx.abs(ref.astype(mx.float32)).max()).item()
    covered = row["stock_host_covered"] is not False and row["lily_host_covered"] is not False
    print(f"{row['shape']}: stock {row['stock_us']:.1f} us, lily {row['lily_us']:.1f} us"
          f"{'' if covered else ' (* host not covered)'} (path served: {served}), "
          f"bit-identical {row['bit_identical']}, max rel err {row['max_rel_err']:.2g}")
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rows", type=int, default=2048, help="activation rows (tokens)")
    ap.add_argument("--calls", type=int, default=8, help="calls per timed chain")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--small", action="store_true", help="small shapes (CPU smoke run)")
    a = ap.parse_args(argv)
    os.environ.setdefault("MLX_LILY_KERNELS", "all")  # shared_dequant is not verified yet
    from mlx_lily.ops.qmm_dequant import qmm_dequant_reference

    shapes = SMALL_SHAPES if a.small else SHAPES
    rows_n = 64 if a.small else a.rows
    out = {"device": str(mx.default_device()), "mlx": mx.__version__, "rows": rows_n,
           "calls": a.calls, "reps": a.reps, "rows_by_shape": []}
    print(f"prefill projections, {rows_n} rows, per call (us; GPU time where available)")
    print(f"{'shape':30s} {'K':>5s} {'O':>6s} {'b':>2s} {'qmm':>9s} {'deq+mm':>9s} "
          f"{'deq':>8s} {'mm':>8s} {'qmm TF/s':>8s} {'d+m TF/s':>8s} {'rel err':>8s}")
    for name, k, o, bits in shapes:
        q, s, b = _weights(o, k, bits)
        x = (mx.random.normal((rows_n, k)) * 0.5).astype(mx.bfloat16)
        wd = mx.dequantize(q, scales=s, biases=b, group_size=64, bits=bits)
        mx.eval(x, wd)

        def qmm(x0):
            return qmm_dequant_reference(x0, q, s, b, 64, bits)

        def deq_mm(x0):
            w = mx.dequantize(q, scales=s, biases=b, group_size=64, bits=bits)
            return mx.matmul(x0, w.T)

        def deq(x0):
            # the dequantize pass alone; x0 joins through the scales (a pass over O*K/64
            # values) so the chain waits for the spin
            s0 = s + (x0[0, 0] * 0).astype(s.dtype)
            return mx.dequantize(q, scales=s0, biases=b, group_size=64, bits=bits)

        def mm(x0):
            return mx.matmul(x0, wd.T)

        row = {"shape": name, "K": k, "O": o, "bits": bits}
        for label, fn in (("qmm", qmm), ("deq_mm", deq_mm), ("deq", deq), ("mm", mm)):
            r = _time(fn, x, a.calls, a.reps)
            row[f"{label}_us"] = 1e6 * r["s"]
            row[f"{label}_host_covered"] = r["host_covered"]
            row[f"{label}_spin_ms"] = r.get("spin_ms")
            row["clock"] = r["clock"]
        mark = "" if all(row[f"{lb}_host_covered"] is not False
                         for lb in ("qmm", "deq_mm", "deq", "mm")) else " *"
        flop = 2.0 * rows_n * k * o
        row["qmm_tflops"] = flop / (row["qmm_us"] * 1e-6) / 1e12
        row["deq_mm_tflops"] = flop / (row["deq_mm_us"] * 1e-6) / 1e12
        ref = qmm(x).astype(mx.float32)
        got = deq_mm(x).astype(mx.float32)
        row["max_rel_err"] = (mx.abs(ref - got).max() / mx.abs(ref).max()).item()
        out["rows_by_shape"].append(row)
        print(f"{name:30s} {k:5d} {o:6d} {bits:2d} {row['qmm_us']:9.1f} {row['deq_mm_us']:9.1f} "
              f"{row['deq_us']:8.1f} {row['mm_us']:8.1f} {row['qmm_tflops']:8.1f} "
              f"{row['deq_mm_tflops']:8.1f} {row['max_rel_err']:8.2g}{mark}")
    out["shared_expert_mlp"] = shared_expert_row(rows_n, 256 if a.small else 2048,
                                                 64 if a.small else 512, a.calls, a.reps)
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "qmm_dequant_bench.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
