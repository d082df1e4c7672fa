"""Where a pipelined decode step's time goes, step by step: host phases against the GPU's
own start and end of each step (MLX's CUDA backend), through
``mlx_lily.bench.timeline.run_loop`` (method and figures: see that module and ``KEYS``).

Arms: stock and Lily, one model, one Lily-built context deep-copied per arm, alternating
(``--rounds``); ``--arm-env NAME:VAR=VALUE`` adds Lily under another setting. Per arm and
round: the medians over ``--steps`` steps after ``--warmup``. Prints a table; writes
``decode_timeline.json`` to ``--out``.

    python benchmarks/gpu/decode_timeline.py --synthetic qwen3.6-35b-a3b --context 4096 --out DIR

MLX's graph settings (``MLX_MAX_OPS_PER_BUFFER``, ``MLX_MAX_MB_PER_BUFFER``,
``MLX_USE_CUDA_GRAPHS``) are read once per process: run one process per setting.

``--host-profile N``: after the rounds, each arm runs N more steps of the same loop under
``cProfile`` (the host's Python and the C functions it calls, profiler overhead included;
shares, not times) and writes its 40 costliest functions by own time to
``host_profile_<arm>.txt``.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from mlx_lily.bench import env_override, gpu_clock, parse_arm_envs, write_json
from mlx_lily.bench.ab import (arm_context, build_context, copy_cache, environment, load_target,
                               log, synthetic_ids, vocab_bounds)
from mlx_lily.bench.timeline import GC_MODES, KEYS, run_loop

def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("model", nargs="?")
    src.add_argument("--synthetic", metavar="PRESET")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--arms", default="stock,lily")
    p.add_argument("--arm-env", action="append", default=[], metavar="NAME:VAR=VALUE",
                   help="one more Lily arm run with environment variable VAR=VALUE; repeatable")
    p.add_argument("--ops", default=None)
    p.add_argument("--gc", default="on", choices=GC_MODES,
                   help="Python's cyclic collector during each timed loop: as it is, off, or "
                        "with the objects allocated before the loop frozen out of its scans")
    p.add_argument("--host-profile", type=int, default=0, metavar="N",
                   help="then N steps per arm under cProfile (host_profile_<arm>.txt)")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    arms = {x: None for x in a.arms.split(",") if x}
    try:
        arms.update(parse_arm_envs(a.arm_env, taken=arms))
    except ValueError as e:
        p.error(str(e))
    if not gpu_clock.available():
        print("decode_timeline: needs MLX's CUDA backend; nothing measured")
        return 0
    ops = a.ops.split(",") if a.ops else None
    t = load_target(a.model, synthetic=a.synthetic)
    hi, ex = vocab_bounds(t.config, t.tokenizer)
    ids = synthetic_ids(a.context + 1, hi, ex, seed=0)
    with arm_context("lily", t.model, ops):
        ctx = build_context(t.model, ids[:a.context], 2048)
    env = {k: os.environ.get(k) for k in ("MLX_MAX_OPS_PER_BUFFER", "MLX_MAX_MB_PER_BUFFER",
                                          "MLX_USE_CUDA_GRAPHS")}
    res = {"environment": environment(ops), "mlx_env": env, "gc": a.gc, "context": a.context,
           "steps": a.steps, "warmup": a.warmup, "rounds": a.rounds, "arms": {}}
    for rnd in range(a.rounds):
        for arm, var_val in arms.items():
            with env_override(*(var_val or (None,))), \
                    arm_context("lily" if var_val else arm, t.model, ops):
                r = run_loop(t.model, copy_cache(ctx), int(ids[a.context]), a.steps,
                             a.warmup, gc_mode=a.gc)
            if var_val:
                r["env"] = dict([var_val])
            res["arms"].setdefault(arm, []).append(r)
            log(f"round {rnd + 1} {arm}: " + ", ".join(
                f"{k} {v:.3f}" for k, v in r["median_ms"].items())
                + f" (clock alignment +-{r['clock_align_err_ns'] / 1e3:.0f} us)")
    print(f"\ndecode timeline at context {a.context}, MLX env {env} (ms, medians of "
          f"{a.steps} steps; one row per round)")
    w = max(7, *(len(x) + 1 for x in res["arms"]))
    print(f"{'arm':{w}s}" + "".join(f"{k[:14]:>15s}" for k in KEYS))
    for arm, rs in res["arms"].items():
        for r in rs:
            print(f"{arm:{w}s}" + "".join(f"{r['median_ms'][k]:15.3f}" for k in KEYS))
    if a.out:
        log(f"wrote {write_json(a.out, 'decode_timeline.json', res)}")
    if a.host_profile > 0:
        for arm, var_val in arms.items():
            with env_override(*(var_val or (None,))), \
                    arm_context("lily" if var_val else arm, t.model, ops):
                text = host_profile(t.model, copy_cache(ctx), int(ids[a.context]),
                                    a.host_profile)
            print(f"\nhost profile, {arm}, {a.host_profile} steps:\n{text}")
            if a.out:
                (a.out / f"host_profile_{arm}.txt").write_text(text)
    return 0


def host_profile(model, cache, first: int, steps: int, top: int = 40) -> str:
    """``steps`` decode steps of ``generate_step``'s loop (build, ``mx.async_eval``, the
    previous token's ``.item()``) from ``cache`` and token ``first`` under ``cProfile``,
    after 4 unprofiled steps: the ``top`` functions by own time, as ``pstats`` prints them."""
    import cProfile
    import io
    import pstats

    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    from mlx_lily.bench.timeline import greedy_token

    def step(tok):  # the timed loop's step without its GPU clock kernels
        with mx.stream(generation_stream):
            return greedy_token(model, cache, tok)

    cur = step(mx.array([first], dtype=mx.int32))
    mx.async_eval(*cur)
    prof = cProfile.Profile()
    for i in range(steps + 4):
        if i == 4:
            prof.enable()
        nxt = step(cur[0])
        mx.async_eval(*nxt)
        cur[0].item()
        cur = nxt
    prof.disable()
    cur[0].item()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


if __name__ == "__main__":
    sys.exit(main())
