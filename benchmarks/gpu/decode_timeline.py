"""Where a pipelined decode step's time goes, step by step: host phases against the GPU's
own start and end of each step (MLX's CUDA backend).

The loop is ``mlx_lm.generate.generate_step``'s: build step n+1, ``mx.async_eval`` it, then
``.item()`` on step n's token. Around it the host records ``time.time_ns()`` after each
phase (build, dispatch, wait), and the GPU records its nanosecond timer (PTX
``%globaltimer``) when step n+1 starts (a one-block pass-through kernel on the token, ahead
of the model) and when it ends (a stamp kernel that takes the token, the log-probs and every
cache state array). Both clocks are put on one axis by a calibration: a lone stamp kernel
evaluated between two host reads (the offset with the narrowest bracket of ``--calib``
tries; its half-width is reported as the alignment error).

Per step (medians over ``--steps`` after ``--warmup``): ``interval`` (between consecutive
tokens, what generate_step's user sees), host ``build`` / ``dispatch`` (inside
``async_eval``) / ``wait`` (inside ``.item()``), ``gpu_busy`` (step start to end on the GPU),
``gpu_idle_before`` (GPU end of step n to start of step n+1), ``start_after_dispatch_begin``
(GPU start of step n+1 minus the host's start of its dispatch: how long the GPU waits for
the first committed graph) and ``end_after_dispatch_end``. Arms: stock and Lily, one model,
alternating (``--rounds``); ``--arm-env NAME:VAR=VALUE`` adds Lily under another setting. Prints a table; writes ``decode_timeline.json`` to ``--out``.

    python benchmarks/gpu/decode_timeline.py --synthetic qwen3.6-35b-a3b --context 4096 --out DIR

MLX's graph settings (``MLX_MAX_OPS_PER_BUFFER``, ``MLX_MAX_MB_PER_BUFFER``,
``MLX_USE_CUDA_GRAPHS``) are read once per process: run one process per setting.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

from mlx_lily.bench import gpu_clock
from mlx_lily.bench.ab import (arm_context, build_context, copy_cache, environment, load_target,
                               log, synthetic_ids, vocab_bounds)
from mlx_lily.bench.timeline import KEYS, run_loop

@contextlib.contextmanager
def _env(var_val):
    """``os.environ[var] = val`` inside the block (nothing for None), restored after."""
    if var_val is None:
        yield
        return
    var, val = var_val
    prev = os.environ.get(var)
    os.environ[var] = val
    try:
        yield
    finally:
        if prev is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = prev


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
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
    res = {"environment": environment(ops), "mlx_env": env, "context": a.context,
           "steps": a.steps, "arms": {}}
    arms = {x: None for x in a.arms.split(",") if x}
    for spec in a.arm_env:
        name, _, kv = spec.partition(":")
        arms[name] = tuple(kv.split("=", 1))
    for rnd in range(a.rounds):
        for arm, var_val in arms.items():
            with _env(var_val), arm_context("lily" if var_val else arm, t.model, ops):
                r = run_loop(t.model, copy_cache(ctx), int(ids[a.context]), a.steps,
                             a.warmup)
            if var_val:
                r["env"] = dict([var_val])
            res["arms"].setdefault(arm, []).append(r)
            log(f"round {rnd + 1} {arm}: " + ", ".join(
                f"{k} {v:.3f}" for k, v in r["median_ms"].items())
                + f" (clock alignment +-{r['clock_align_err_ns'] / 1e3:.0f} us)")
    print(f"\ndecode timeline at context {a.context}, MLX env {env} (ms, medians of "
          f"{a.steps} steps; one row per round)")
    print(f"{'arm':7s}" + "".join(f"{k[:14]:>15s}" for k in KEYS))
    for arm, rs in res["arms"].items():
        for r in rs:
            print(f"{arm:7s}" + "".join(f"{r['median_ms'][k]:15.3f}" for k in KEYS))
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "decode_timeline.json").write_text(json.dumps(res, indent=1, default=str))
        log(f"wrote {a.out / 'decode_timeline.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
