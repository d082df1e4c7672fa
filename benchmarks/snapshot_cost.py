"""Cost of prefix-cache snapshots during a prefill: the same prompt prefilled with
snapshots every N tokens (chunks end at each point) against one run without, plus the
time of one snapshot copy and its bytes.

    python benchmarks/snapshot_cost.py --model DIR --tokens 2048 --every 0,1024,512,256

Prints a table and writes JSON (``--out``). Each arm is timed ``--reps`` times, arms
interleaved, the median reported; the first arm (0: only the end-of-prefill snapshot) is
the baseline the extra time per snapshot is taken against.
"""

import argparse
import json
import statistics
import time

import mlx.core as mx


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--every", default="0,1024,512,256")
    ap.add_argument("--step", type=int, default=2048, help="prefill chunk (mlx-lm default)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--lily", action="store_true", help="apply mlx_lily.patch() first")
    ap.add_argument("--out")
    args = ap.parse_args(argv)

    if args.lily:
        import mlx_lily

        mlx_lily.patch()
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_lily.prefix_cache import PrefixCache
    from mlx_lily.prefix_cache.plan import prefill_points, snapshot_points
    from mlx_lily.prefix_cache.store import capture

    model, _ = load(args.model)
    tokens = [100 + (i * 7919) % 5000 for i in range(args.tokens)]
    arms = [int(x) for x in args.every.split(",")]

    def run(every):
        store = PrefixCache(max_snapshots=1 << 30)
        cache = make_prompt_cache(model)
        pts = snapshot_points(len(tokens), every=every) if every else [len(tokens) - 1]
        t = time.perf_counter()
        prefill_points(model, cache, tokens, 0, pts, store, "m", step=args.step)
        mx.synchronize()
        return time.perf_counter() - t, len(store), cache

    run(0)  # warm-up
    times = {e: [] for e in arms}
    for _ in range(args.reps):
        for e in arms:
            times[e].append(run(e)[0])
    _, _, cache = run(0)
    t = time.perf_counter()
    for _ in range(20):
        snap = capture(cache, _offset(cache))
    copy_ms = (time.perf_counter() - t) / 20 * 1e3
    base = statistics.median(times[arms[0]])
    rows = []
    for e in arms:
        med = statistics.median(times[e])
        n_snap = len(snapshot_points(len(tokens), every=e)) if e else 1
        rows.append({"every": e, "snapshots": n_snap, "median_s": med,
                     "extra_ms_per_snapshot": (med - base) * 1e3 / max(n_snap - 1, 1)
                     if e else 0.0})
    res = {"model": args.model, "tokens": args.tokens, "step": args.step,
           "snapshot_bytes": snap[2], "snapshot_copy_ms": copy_ms, "arms": rows,
           "backend": str(mx.default_device())}
    print(f"snapshot: {snap[2]} bytes, copy {copy_ms:.3f} ms")
    print("| every | snapshots | prefill s (median) | extra ms per snapshot |")
    print("|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['every'] or 'none'} | {r['snapshots']} | {r['median_s']:.3f} | "
              f"{r['extra_ms_per_snapshot']:.1f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


def _offset(cache):
    return next(c.offset for c in cache if hasattr(c, "offset"))


if __name__ == "__main__":
    main()
