"""Long contexts without the A/B harness's gate or stock prefill: Lily's chunked prefill of
16K-128K-token prompts (tok/s and MLX's peak memory per length), then decode at that
context for both arms from the one Lily-built cache (deep-copied per arm, as
``benchmarks/ab.py``'s decode rows do).

    python benchmarks/gpu/long_context_bench.py --lengths 16384,32768,65536,131072 --out DIR

Full-size synthetic Qwen3.6-35B-A3B (``--preset``), batch 1, prefill in
``--prefill-step-size`` chunks as ``mlx_lm.generate`` does. Stock prefill is not timed (at
~225 tok/s a 128K prompt takes ~10 minutes); the A/B harness and its gate cover correctness.
A length stops the sweep when the previous prefill predicts it over ``--budget-s``.
Prints and writes ``DIR/long_context_bench.json``.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--preset", default="qwen3.6-35b-a3b")
    p.add_argument("--lengths", default="16384,32768,65536,131072")
    p.add_argument("--prefill-step-size", type=int, default=2048)
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--budget-s", type=float, default=90.0)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    import os

    from mlx_lily.bench import gpu_or_explain, write_json

    if not gpu_or_explain("long_context_bench"):
        return 0
    os.environ.setdefault("MLX_LILY_KERNELS", "all")
    import mlx.core as mx

    from mlx_lily.bench.ab import (arm_context, copy_cache, environment, load_target, log,
                                   measure_decode, synthetic_ids, vocab_bounds)
    from mlx_lm.generate import generation_stream
    from mlx_lm.models.cache import make_prompt_cache

    lengths = [int(x) for x in a.lengths.split(",") if x]
    t = load_target(None, a.preset, 0)
    hi, ex = vocab_bounds(t.config, t.tokenizer)
    res = {"environment": environment(None), "preset": a.preset,
           "prefill_step_size": a.prefill_step_size, "rows": []}
    rate = None
    with arm_context("lily", t.model):  # kernels compiled and cached before any timing
        warm = make_prompt_cache(t.model)
        with mx.stream(generation_stream):
            t.model(mx.array(synthetic_ids(a.prefill_step_size, hi, ex, seed=1))[None],
                    cache=warm)
            mx.eval([c.state for c in warm])
        del warm
    for L in lengths:
        if rate is not None and L / rate > a.budget_s:
            log(f"L={L}: skipped (predicted {L / rate:.0f}s > {a.budget_s:.0f}s)")
            res["rows"].append({"length": L, "status": "over_budget"})
            continue
        ids = synthetic_ids(L + 1, hi, ex, seed=L)
        row = {"length": L}
        with arm_context("lily", t.model):
            cache = make_prompt_cache(t.model)
            mx.synchronize()
            mx.clear_cache()
            mx.reset_peak_memory()
            chunk_s = []
            t0 = time.perf_counter()
            with mx.stream(generation_stream):
                for i in range(0, L, a.prefill_step_size):
                    c0 = time.perf_counter()
                    chunk = mx.array(ids[i:i + a.prefill_step_size])[None]
                    t.model(chunk, cache=cache)
                    mx.eval([c.state for c in cache])
                    chunk_s.append(time.perf_counter() - c0)
            mx.synchronize()
            dt = time.perf_counter() - t0
            row.update(prefill_s=dt, prefill_tok_s=L / dt,
                       prefill_peak_memory_mib=mx.get_peak_memory() / 2**20,
                       first_chunk_s=chunk_s[0], last_chunk_s=chunk_s[-1])
            rate = L / dt
        log(f"L={L}: Lily prefill {row['prefill_tok_s']:.0f} tok/s ({dt:.1f}s), peak "
            f"{row['prefill_peak_memory_mib']:.0f} MiB, chunk first/last "
            f"{chunk_s[0] * 1e3:.0f}/{chunk_s[-1] * 1e3:.0f} ms")
        for arm in ("stock", "lily"):
            with arm_context(arm, t.model):
                m = measure_decode(t.model, copy_cache(cache), int(ids[L]), a.decode_steps)
            row[f"decode_{arm}_tok_s"] = m["tok_s_median"]
            row[f"decode_{arm}_peak_memory_mib"] = m["peak_memory_bytes"] / 2**20
            log(f"L={L}: decode {arm} {m['tok_s_median']:.1f} tok/s (median of "
                f"{m['n_intervals']})")
        row["decode_ratio"] = row["decode_lily_tok_s"] / row["decode_stock_tok_s"]
        res["rows"].append(row)
        if a.out:  # after every length: a sweep cut short keeps what finished
            write_json(a.out, "long_context_bench.json", res)
        del cache
        mx.clear_cache()
    print(f"\n{'tokens':>8s}{'prefill tok/s':>15s}{'peak MiB':>10s}{'decode stock':>14s}"
          f"{'decode lily':>13s}{'x':>7s}")
    for r in res["rows"]:
        if "prefill_tok_s" not in r:
            print(f"{r['length']:8d}  ({r['status']})")
            continue
        print(f"{r['length']:8d}{r['prefill_tok_s']:15.0f}{r['prefill_peak_memory_mib']:10.0f}"
              f"{r['decode_stock_tok_s']:14.1f}{r['decode_lily_tok_s']:13.1f}"
              f"{r['decode_ratio']:7.2f}")
    if a.out:
        write_json(a.out, "long_context_bench.json", res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
