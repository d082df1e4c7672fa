"""Where a compiled decode step loses time at long contexts: one attention layer's KV-cache
write and split-K decode attention, eager vs inside ``mx.compile``, on a cache of
``--context`` tokens (Qwen3.6-35B-A3B's attention shape: 2 KV heads, 16 query heads,
head_dim 256, bf16).

    python benchmarks/gpu/kv_write_probe.py --context 131072 --out DIR

Per variant: median wall ms of build + ``mx.eval`` + synchronize per step (``--steps``
after ``--warmup``), and the peak memory above the active memory during a step (a copy of
the cache shows up as one buffer's size: ``buffer_mib``). Variants:
``write_static`` (stock ``KVCache``: ``keys[..., o:o+1, :] = k``), ``write_dynamic_eager``
(``mx.slice_update`` at an int32 offset array, uncompiled), ``write_dynamic_compiled``
(the same inside ``mx.compile``, as the compiled decode step writes), ``attn_view`` (Lily's
decode attention over the first ``o+1`` keys as a view, as the eager path runs it),
``attn_dyn`` (over the whole buffer with ``tlen``, as the compiled step runs it),
``write_scatter_compiled`` (``mx.put_along_axis`` at the offset, compiled: what the compiled
decode step now writes with), ``step_eager`` (static write + attention on the view),
``step_compiled`` (dynamic write + DYN_T attention in one compiled function),
``step_compiled_scatter`` (the same with the ``put_along_axis`` write). Prints a table, writes DIR/kv_write_probe.json.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from mlx_lily.bench import write_json


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    import os

    os.environ.setdefault("MLX_LILY_KERNELS", "all")
    import mlx.core as mx

    from mlx_lily.ops import attention as attn
    from mlx_lily.patches.qwen3_next import kv_write_index

    B, Hkv, Hq, D = 1, 2, 16, 256
    dt = mx.bfloat16
    cap = a.context + 256
    n = a.warmup + a.steps
    if a.context + n > cap:
        raise SystemExit(f"--warmup + --steps must be <= 256 (got {n})")
    scale = D ** -0.5
    q = mx.random.normal((B, Hq, 1, D)).astype(dt)
    kn = mx.random.normal((B, Hkv, 1, D)).astype(dt)
    st = {"keys": mx.random.normal((B, Hkv, cap, D)).astype(dt)}
    st["values"] = mx.random.normal((B, Hkv, cap, D)).astype(dt)
    mx.eval(q, kn, st["keys"], st["values"])
    buffer_mib = st["keys"].nbytes / 2**20

    def dyn_write(keys, k, off):
        return mx.slice_update(keys, k, off, axes=(2,))

    dyn_write_c = mx.compile(dyn_write)

    def scatter_write(keys, k, off):
        return mx.put_along_axis(keys, kv_write_index(off, k.shape), k, axis=2)

    scatter_write_c = mx.compile(scatter_write)

    def step_scatter(keys, values, k, off):
        idx = kv_write_index(off, k.shape)
        keys = mx.put_along_axis(keys, idx, k, axis=2)
        values = mx.put_along_axis(values, idx, k, axis=2)
        return keys, values, attn.decode_attention(q, keys, values, scale, tlen=off + 1)

    step_scatter_c = mx.compile(step_scatter)

    def step_dyn(keys, values, k, off):
        keys = mx.slice_update(keys, k, off, axes=(2,))
        values = mx.slice_update(values, k, off, axes=(2,))
        return keys, values, attn.decode_attention(q, keys, values, scale, tlen=off + 1)

    step_dyn_c = mx.compile(step_dyn)

    def v_write_static(o):
        st["keys"][..., o:o + 1, :] = kn
        return [st["keys"]]

    def v_write_dyn_eager(o):
        st["keys"] = dyn_write(st["keys"], kn, mx.array([o], dtype=mx.int32))
        return [st["keys"]]

    def v_write_dyn_compiled(o):
        st["keys"] = dyn_write_c(st["keys"], kn, mx.array([o], dtype=mx.int32))
        return [st["keys"]]

    def v_write_scatter_compiled(o):
        st["keys"] = scatter_write_c(st["keys"], kn, mx.array([o], dtype=mx.int32))
        return [st["keys"]]

    def v_step_compiled_scatter(o):
        st["keys"], st["values"], out = step_scatter_c(st["keys"], st["values"], kn,
                                                       mx.array([o], dtype=mx.int32))
        return [out]

    def v_attn_view(o):
        return [attn.decode_attention(q, st["keys"][..., :o + 1, :],
                                      st["values"][..., :o + 1, :], scale)]

    def v_attn_dyn(o):
        return [attn.decode_attention(q, st["keys"], st["values"], scale,
                                      tlen=mx.array([o + 1], dtype=mx.int32))]

    def v_step_eager(o):
        st["keys"][..., o:o + 1, :] = kn
        st["values"][..., o:o + 1, :] = kn
        return [attn.decode_attention(q, st["keys"][..., :o + 1, :],
                                      st["values"][..., :o + 1, :], scale)]

    def v_step_compiled(o):
        st["keys"], st["values"], out = step_dyn_c(st["keys"], st["values"], kn,
                                                   mx.array([o], dtype=mx.int32))
        return [out]

    variants = {"write_static": v_write_static, "write_dynamic_eager": v_write_dyn_eager,
                "write_dynamic_compiled": v_write_dyn_compiled,
                "write_scatter_compiled": v_write_scatter_compiled, "attn_view": v_attn_view,
                "attn_dyn": v_attn_dyn, "step_eager": v_step_eager,
                "step_compiled": v_step_compiled,
                "step_compiled_scatter": v_step_compiled_scatter}
    rows = {}
    for name, fn in variants.items():
        times, extra = [], []
        try:
            mx.eval(fn(a.context - 1))
        except RuntimeError as e:  # no Lily kernel on this backend
            rows[name] = {"skipped": str(e)}
            print(f"{name:24s} skipped: {e}", flush=True)
            continue
        for i in range(n):
            o = a.context + i
            mx.synchronize()
            base = mx.get_active_memory()
            mx.reset_peak_memory()
            t0 = time.perf_counter()
            outs = fn(o)
            mx.eval(outs)
            mx.synchronize()
            dt_s = time.perf_counter() - t0
            del outs
            if i >= a.warmup:
                times.append(dt_s * 1e3)
                extra.append(max(0.0, (mx.get_peak_memory() - base) / 2**20))
        rows[name] = {"ms_median": statistics.median(times), "ms_min": min(times),
                      "peak_over_active_mib_median": statistics.median(extra)}
        print(f"{name:24s} {rows[name]['ms_median']:8.3f} ms  (min {min(times):.3f})  "
              f"peak over active {statistics.median(extra):9.1f} MiB", flush=True)
    res = {"context": a.context, "capacity": cap, "buffer_mib": buffer_mib,
           "steps": a.steps, "warmup": a.warmup, "device": str(mx.default_device()),
           "mlx": mx.__version__, "rows": rows}
    print(f"one KV buffer: {buffer_mib:.1f} MiB")
    if a.out:
        write_json(a.out, "kv_write_probe.json", res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
