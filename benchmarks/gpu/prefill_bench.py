"""Prefill variants of the patched full-size synthetic Qwen3.6-35B-A3B (batch 1): chunk size
and MLX's buffer-cache limit, each through
``mlx_lily.bench.timeline.prefill_run`` (``generate_step``'s prefill loop, timed per chunk on
the host and the GPU), in one process.

The H200 also measured ``MLX_LILY_PREFILL_SPLIT=2`` (each chunk as two pieces, the
second built while the GPU ran the first): 15,223 tok/s at 4K vs 17,889 whole; removed.

Run on a CUDA machine with mlx-lily installed:
    python benchmarks/gpu/prefill_bench.py --lengths 4096,32768 --rounds 3 --out DIR
Prints one row per (variant, length) and writes DIR/prefill_bench.json.

Variants (``--variants``, comma list; default all):
  default     the chunk generate_step picks for the patched model (Lily's per-backend
              ``mlx_lily.patching.PREFILL_STEP_SIZE``)
  base        prefill_step_size 2048 (mlx-lm's default)
  step4096    prefill_step_size 4096
  step8192    prefill_step_size 8192 (Lily's CUDA default)
  nocache     base with ``mx.set_cache_limit(0)`` for the run (buffers freed as released,
              so ``mx.clear_cache`` between chunks has nothing to free)
  evalN       default with ``MLX_LILY_PREFILL_EVAL_LAYERS=N`` (N = 0, 4, 8): the decoder
              stack evaluated in groups of N layers inside each chunk (0: one group);
              Lily's CUDA default is ``mlx_lily.patching.PREFILL_EVAL_LAYERS``
  tile32      default with the grouped GEMMs' tiles fixed at 32 rows
              (``MLX_LILY_MOE_TILE_ROWS``; the default picks 64 from a mean of
              ``moe_grouped.TALLER_TILE_MIN_MEAN_ROWS`` rows per expert on CUDA)
Figures: tok/s = prompt tokens / wall time of the whole prefill (the last token's step and
its greedy token included); ttft tok/s = the A/B's figure (``mlx_lily.bench.ab.measure_prefill``:
prompt tokens / time to the first token ``generate_step`` yields, which also builds and
dispatches the next token's step), one per round after the timed run; per chunk (ms,
median over rounds and the prefill chunks): build, dispatch, wait, GPU busy, clear, and
the buffer cache (MiB) before the clear. With evaluation groups, "build" also holds the
dispatch of every group but the last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import mlx.core as mx

VARIANTS = {
    "default": dict(step=None, env={}, cache_limit=None),
    "base": dict(step=2048, env={}, cache_limit=None),
    "step4096": dict(step=4096, env={}, cache_limit=None),
    "step8192": dict(step=8192, env={}, cache_limit=None),
    "nocache": dict(step=2048, env={}, cache_limit=0),
    "eval0": dict(step=None, env={"MLX_LILY_PREFILL_EVAL_LAYERS": "0"}, cache_limit=None),
    "eval4": dict(step=None, env={"MLX_LILY_PREFILL_EVAL_LAYERS": "4"}, cache_limit=None),
    "eval8": dict(step=None, env={"MLX_LILY_PREFILL_EVAL_LAYERS": "8"}, cache_limit=None),
    "tile32": dict(step=None, env={"MLX_LILY_MOE_TILE_ROWS": "32"}, cache_limit=None),
}
CHUNK_KEYS = ("build", "dispatch", "wait", "gpu_busy", "clear", "cache_mb")


def run_variant(model, ids, spec: dict) -> dict:
    """One ``prefill_run`` of ``ids`` under ``spec`` and then the A/B's time-to-first-token
    measure (env and cache limit restored after)."""
    from mlx_lily.bench.ab import effective_prefill_step, measure_prefill
    from mlx_lily.bench.timeline import prefill_run

    old_env = {k: os.environ.get(k) for k in spec["env"]}
    os.environ.update(spec["env"])
    old_limit = mx.set_cache_limit(spec["cache_limit"]) if spec["cache_limit"] is not None else None
    try:
        mx.clear_cache()
        mx.reset_peak_memory()
        step = effective_prefill_step(model, spec["step"])
        r = prefill_run(model, ids, step)
        r["peak_memory_gb"] = mx.get_peak_memory() / 1e9
        r["step"] = step
        r["ttft_tok_s"] = measure_prefill(model, ids, step)["tok_s"]
        return r
    finally:
        if old_limit is not None:
            mx.set_cache_limit(old_limit)
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def summarize(runs: list[dict]) -> dict:
    step = runs[0]["step"]
    full = [c for r in runs for c in r["chunks"][:-1]]
    last = [r["chunks"][-1] for r in runs]
    med = {k: statistics.median(c[k] for c in full) if full else None for k in CHUNK_KEYS}
    return {"step": step, "tok_s_median": statistics.median(r["tok_s"] for r in runs),
            "ttft_tok_s_median": statistics.median(r["ttft_tok_s"] for r in runs),
            "tok_s_rounds": [r["tok_s"] for r in runs],
            "total_ms_median": statistics.median(r["total_ms"] for r in runs),
            "chunk_median_ms": med,
            "last_step_ms": statistics.median(c["build"] + c["dispatch"] + c["wait"] for c in last),
            "peak_memory_gb": max(r["peak_memory_gb"] for r in runs)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="4096")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--preset", default="qwen3.6-35b-a3b")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args(argv)
    names = [v for v in a.variants.split(",") if v]
    bad = [v for v in names if v not in VARIANTS]
    if bad:
        ap.error(f"unknown variants {bad}; known: {list(VARIANTS)}")
    lengths = [int(x) for x in a.lengths.split(",") if x]

    import mlx_lily
    from mlx_lily import synth
    from mlx_lily.bench.ab import synthetic_ids

    model, config = synth.build_model(a.preset, seed=0)
    vocab = int(config.get("vocab_size") or config["text_config"]["vocab_size"])
    out = {"command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
           "tree": os.environ.get("MLX_LILY_TREE_REV"), "mlx": mx.__version__,
           "device": str(mx.default_device()), "rounds": a.rounds, "rows": []}
    with mlx_lily.patched(model):
        t0 = time.perf_counter()
        run_variant(model, synthetic_ids(min(lengths), vocab, [], seed=1), VARIANTS["base"])
        out["first_run_s"] = time.perf_counter() - t0
        for L in lengths:
            ids = synthetic_ids(L, vocab, [], seed=1)
            for name in names:
                spec = VARIANTS[name]
                run_variant(model, ids, spec)  # warm-up: compiles, cache shapes
                runs = [run_variant(model, ids, spec) for _ in range(a.rounds)]
                row = {"variant": name, "length": L, **summarize(runs),
                       "runs": runs}
                out["rows"].append(row)
                m = row["chunk_median_ms"]
                print(f"{name:11s} step {row['step']:5d} L={L:6d} {row['tok_s_median']:9.1f} tok/s "
                      f"(ttft {row['ttft_tok_s_median']:9.1f})  chunk: "
                      + " ".join(f"{k} {m[k]:.1f}" if m[k] is not None else f"{k} -" for k in CHUNK_KEYS)
                      + f"  last {row['last_step_ms']:.1f}  peak {row['peak_memory_gb']:.1f} GB",
                      flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "prefill_bench.json"), "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
