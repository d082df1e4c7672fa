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
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

from mlx_lily.bench import gpu_clock
from mlx_lily.bench.ab import (arm_context, build_context, copy_cache, environment, ids_array,
                               load_target, log, synthetic_ids, vocab_bounds)
from mlx_lily.bench.primitives import _state_arrays

_KEYS = ("interval", "build", "dispatch", "wait", "gpu_busy", "gpu_idle_before",
         "start_after_dispatch_begin", "end_after_dispatch_end")


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


def calibrate(tries: int = 15) -> tuple[int, int]:
    """``(offset_ns, half_width_ns)``: GPU timer minus host ``time_ns`` at one instant,
    from the narrowest of ``tries`` host brackets around a lone stamp kernel."""
    x = mx.zeros((4,), mx.float32)
    mx.eval(gpu_clock.stamp(x))
    best = None
    for _ in range(tries):
        mx.synchronize()
        t = gpu_clock.stamp(x)
        h0 = time.time_ns()
        mx.eval(t)
        h1 = time.time_ns()
        g = gpu_clock.ns(t)
        if best is None or h1 - h0 < best[1] - best[0]:
            best = (h0, h1, g)
    h0, h1, g = best
    return g - (h0 + h1) // 2, (h1 - h0) // 2


def run_loop(model, cache, first: int, steps: int, warmup: int) -> dict:
    """The generate_step loop with host and GPU stamps; per-step records and medians (ms)."""
    from mlx_lm.generate import generation_stream

    zero = mx.array([0, 0, 0, 0], dtype=mx.uint32)  # spin 0 us (16 bytes: device memory)
    mx.eval(zero)

    def step(tok):
        with mx.stream(generation_stream):
            t_in, g0 = gpu_clock.spin_us(tok, zero)
            logits = model(t_in[None], cache=cache)[:, -1, :]
            logprobs = logits - mx.logsumexp(logits, keepdims=True)
            y = mx.argmax(logprobs, axis=-1)
            g1 = gpu_clock.stamp(y, logprobs, *_state_arrays(cache))
        return y, logprobs, g0, g1

    cur = step(ids_array([first]))
    mx.async_eval(*cur)
    recs = []
    for _ in range(steps + warmup):
        h0 = time.time_ns()
        nxt = step(cur[0])
        h1 = time.time_ns()
        mx.async_eval(*nxt)
        h2 = time.time_ns()
        cur[0].item()
        h3 = time.time_ns()
        recs.append({"h": (h0, h1, h2, h3), "arrays": nxt})
        cur = nxt
    cur[0].item()
    mx.synchronize()
    off, err = calibrate()
    rows = []
    for i in range(1, len(recs)):
        h0, h1, h2, h3 = recs[i]["h"]
        g0 = gpu_clock.ns(recs[i]["arrays"][2]) - off
        g1 = gpu_clock.ns(recs[i]["arrays"][3]) - off
        pg1 = gpu_clock.ns(recs[i - 1]["arrays"][3]) - off
        rows.append({"interval": h3 - recs[i - 1]["h"][3], "build": h1 - h0,
                     "dispatch": h2 - h1, "wait": h3 - h2, "gpu_busy": g1 - g0,
                     "gpu_idle_before": g0 - pg1, "start_after_dispatch_begin": g0 - h1,
                     "end_after_dispatch_end": g1 - h2})
    rows = rows[warmup:]
    med = {k: statistics.median(r[k] for r in rows) / 1e6 for k in _KEYS}
    return {"median_ms": med, "steps_ms": [{k: r[k] / 1e6 for k in _KEYS} for r in rows],
            "clock_offset_ns": off, "clock_align_err_ns": err,
            "tok_s": 1e3 / med["interval"]}


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
    print(f"{'arm':7s}" + "".join(f"{k[:14]:>15s}" for k in _KEYS))
    for arm, rs in res["arms"].items():
        for r in rs:
            print(f"{arm:7s}" + "".join(f"{r['median_ms'][k]:15.3f}" for k in _KEYS))
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "decode_timeline.json").write_text(json.dumps(res, indent=1, default=str))
        log(f"wrote {a.out / 'decode_timeline.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
