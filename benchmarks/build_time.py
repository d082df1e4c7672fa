"""Python graph-build time of one Lily decode step on the CUDA kernel path, measurable on a
machine without a GPU: the production-dims model (lazy weights, ``--layers`` of
Qwen3.6-35B-A3B's 40), dispatchers forced onto the CUDA path
(``mlx_lily.backend.tracing_backend``), every custom kernel stubbed to return zeros, and
nothing evaluated. What it times is the host work Lily adds per token before MLX's own
dispatch: the patched forwards, the checks and the kernel launch plumbing.

    python benchmarks/build_time.py --layers 40 --steps 40 [--kernels shipped] --out DIR

Prints and writes DIR/build_time.json: median milliseconds per step (after ``--warmup``
steps) with the compiled decode steps on (the default: the whole decoder stack as one
compiled function), one compiled function per layer (``MLX_LILY_COMPILE_WHOLE=0``), per
layer with the attention layers' mixers eager (``MLX_LILY_COMPILE_ATTN=0``: only their MLP
halves compiled), and off. ``--growth-steps N``: N compiled steps from an empty cache,
every one timed, with mlx-lm's KV growth step (256) and Lily's default
(``MLX_LILY_KV_STEP``): the steps that grow the cache and retrace show in the mean.
``--ledger-ab ROUNDS``: only the compiled step with and without its replay from the last
step's ledger (``decode_graph._WholeLedger``), alternating in one process.
``--prefill-tokens N``: also the build of one N-token prefill call into a fresh cache (the
Python part of a prefill chunk, which runs with the GPU idle: 12-25 ms for a 4095-token
chunk on the H200's host).
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

from mlx_lily.bench import write_json


@contextlib.contextmanager
def _stubbed_lily(layers: int, kernel_set: str = "all"):
    """The production-dims model (lazy weights, ``layers`` layers, bf16), patched and
    prepared on the CUDA path with the custom kernels of ``kernel_set`` (an
    ``MLX_LILY_KERNELS`` value) stubbed to return zeros and no warm-up; unpatched on
    exit."""
    import mlx.core as mx

    import mlx_lily
    from mlx_lily import backend, kernels, patching, synth

    def stub_factory(**_):
        def call(*, inputs, output_shapes, output_dtypes, **__):
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]
        return call

    kernels._CACHE.clear()
    mx.fast.cuda_kernel = stub_factory
    patching.warmup = lambda *a, **k: 0.0
    os.environ["MLX_LILY_KERNELS"] = kernel_set
    model, _ = synth._lazy_model(synth._text_config(num_hidden_layers=layers))
    model.eval()
    model.set_dtype(mx.bfloat16)
    with backend.tracing_backend("cuda"):
        mlx_lily.patch()
        try:
            mlx_lily.prepare_model(model)
            yield model
        finally:
            mlx_lily.unpatch()


def measure_prefill(layers: int, tokens: int, reps: int) -> float:
    """Median ms of the Python build of a ``tokens``-token prefill call into a fresh cache
    (stubbed kernels, nothing evaluated; one untimed call first)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    toks = mx.array([[5] * tokens])
    ts = []
    with _stubbed_lily(layers) as model:
        for i in range(reps + 1):
            cache = make_prompt_cache(model)
            t0 = time.perf_counter()
            model(toks, cache=cache)
            if i:
                ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def measure(layers: int, steps: int, warmup: int, compile_mode: str,
            detail: bool = False, kernel_set: str = "all"):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    os.environ["MLX_LILY_COMPILE"] = compile_mode
    ts = []
    with _stubbed_lily(layers, kernel_set) as model:
        cache = make_prompt_cache(model)
        tok = mx.array([[5]])
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            model(tok, cache=cache)
            if i >= warmup:
                ts.append(time.perf_counter() - t0)
    med = statistics.median(ts) * 1e3
    if not detail:
        return med
    slow = [t * 1e3 for t in ts if t * 1e3 > 5 * med]
    return {"median_ms": med, "mean_ms": statistics.fmean(ts) * 1e3, "slow_steps": len(slow),
            "slow_ms_total": sum(slow)}


def measure_ledger_ab(layers: int, rounds: int, block: int, kernel_set: str) -> dict:
    """The compiled whole step with and without its replay from the previous step's
    ledger (``decode_graph._WholeLedger``; off: ``MLX_LILY_WHOLE_REPLAY=0``, so every step
    takes the full path), in one process: ``rounds`` x (``block`` steps off, ``block``
    on), so that the host's drift falls on both. Median and mean ms per step per arm, and
    how many of its timed steps replayed (all in the replay arm, none in the other)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_lily.patches import decode_graph as dg

    os.environ["MLX_LILY_COMPILE"] = "1"
    ts = {"full": [], "replay": []}
    replays = {"full": 0, "replay": 0, "untimed": 0}
    arm_now = ["untimed"]
    real_replay = dg._replay_whole_step

    def counting(*args):
        replays[arm_now[0]] += 1
        return real_replay(*args)

    dg._replay_whole_step = counting
    with _stubbed_lily(layers, kernel_set) as model:
        cache = make_prompt_cache(model)
        tok = mx.array([[5]])
        for _ in range(20):
            model(tok, cache=cache)
        for _ in range(rounds):
            for arm in ("full", "replay"):
                os.environ["MLX_LILY_WHOLE_REPLAY"] = "1" if arm == "replay" else "0"
                arm_now[0] = "untimed"
                model(tok, cache=cache)  # the arm's first step (the ledger is made here)
                arm_now[0] = arm
                for _ in range(block):
                    t0 = time.perf_counter()
                    model(tok, cache=cache)
                    ts[arm].append(time.perf_counter() - t0)
        os.environ.pop("MLX_LILY_WHOLE_REPLAY", None)
        dg._replay_whole_step = real_replay
    return {arm: {"median_ms": statistics.median(v) * 1e3, "mean_ms": statistics.fmean(v) * 1e3,
                  "steps": len(v), "replayed": replays[arm]} for arm, v in ts.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--layers", type=int, default=40)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--growth-steps", type=int, default=0,
                   help="also: mean vs median over this many compiled steps from an empty "
                        "cache with MLX_LILY_KV_STEP=256 (mlx-lm's growth) and the default")
    p.add_argument("--prefill-tokens", type=int, default=0,
                   help="also: the build of one prefill call of this many tokens")
    p.add_argument("--kernels", default="all",
                   help="MLX_LILY_KERNELS value of the decode steps (default: all; 'shipped': "
                        "the shipped CUDA set plus batch_decode, what a CUDA user runs)")
    p.add_argument("--ledger-ab", type=int, default=0, metavar="ROUNDS",
                   help="only: the compiled step with and without the replay from the last "
                        "step's ledger, ROUNDS alternating blocks of --steps steps each")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    if a.kernels == "shipped":
        from mlx_lily import kernels

        a.kernels = ",".join(sorted(kernels.VERIFIED["cuda"])) + ",batch_decode"
    res = {"layers": a.layers, "steps": a.steps, "warmup": a.warmup, "kernels": a.kernels,
           "build_ms_median": {}}
    if a.ledger_ab:
        res = {"layers": a.layers, "kernels": a.kernels, "rounds": a.ledger_ab,
               "block": a.steps, "ledger_ab": measure_ledger_ab(a.layers, a.ledger_ab,
                                                                a.steps, a.kernels)}
        for arm, r in res["ledger_ab"].items():
            print(f"{arm:7s} {r['median_ms']:.3f} ms median, {r['mean_ms']:.3f} ms mean per "
                  f"decode step ({a.layers} layers, {r['steps']} steps, {r['replayed']} "
                  "replayed)")
        if a.out:
            write_json(a.out, "build_time_ledger_ab.json", res)
        return 0
    import subprocess

    for mode, name, extra in (("1", "compiled", {}),
                              ("1", "compiled-per-layer", {"MLX_LILY_COMPILE_WHOLE": "0"}),
                              ("1", "compiled-eager-attention", {"MLX_LILY_COMPILE_ATTN": "0",
                                                                 "MLX_LILY_COMPILE_WHOLE": "0"}),
                              ("0", "eager", {})):
        env = {k: v for k, v in os.environ.items()
               if k not in ("MLX_LILY_COMPILE_ATTN", "MLX_LILY_COMPILE_WHOLE")}
        env.update(extra)
        out = subprocess.run(
            [sys.executable, __file__, "--_one", mode, str(a.layers), str(a.steps),
             str(a.warmup), a.kernels], capture_output=True, text=True, check=True,
            env=env).stdout
        res["build_ms_median"][name] = float(out.strip().splitlines()[-1])
        print(f"{name:19s} {res['build_ms_median'][name]:.3f} ms per decode step "
              f"({a.layers} layers, median of {a.steps})")
    if a.growth_steps:
        # mean vs median over a long decode: KV-cache growth steps (run layer by layer) and
        # the retrace after each, with mlx-lm's growth step (256) and Lily's default
        res["growth"] = {}
        for kv in ("256", ""):
            env = {k: v for k, v in os.environ.items() if k != "MLX_LILY_KV_STEP"}
            if kv:
                env["MLX_LILY_KV_STEP"] = kv
            out = subprocess.run(
                [sys.executable, __file__, "--_growth", str(a.layers), str(a.growth_steps)],
                capture_output=True, text=True, check=True, env=env).stdout
            r = json.loads(out.strip().splitlines()[-1])
            name = f"kv_step_{kv or 'default'}"
            res["growth"][name] = r
            print(f"{name:17s} {a.growth_steps} steps: median {r['median_ms']:.3f} ms, mean "
                  f"{r['mean_ms']:.3f} ms, steps > 5x median: {r['slow_steps']} "
                  f"({r['slow_ms_total']:.1f} ms)")
    if a.prefill_tokens:
        out = subprocess.run(
            [sys.executable, __file__, "--_prefill", str(a.layers), str(a.prefill_tokens), "5"],
            capture_output=True, text=True, check=True).stdout
        res["prefill_build_ms_median"] = {str(a.prefill_tokens): float(out.strip().splitlines()[-1])}
        print(f"prefill {a.prefill_tokens} tokens: {res['prefill_build_ms_median'][str(a.prefill_tokens)]:.1f} ms "
              f"({a.layers} layers, median of 5)")
    if a.out:
        write_json(a.out, "build_time.json", res)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--_prefill":  # one prefill call's build
        print(measure_prefill(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])))
        sys.exit(0)
    if len(sys.argv) > 1 and sys.argv[1] == "--_growth":  # compiled, every step timed
        print(json.dumps(measure(int(sys.argv[2]), int(sys.argv[3]), 2, "1", detail=True)))
        sys.exit(0)
    if len(sys.argv) > 1 and sys.argv[1] == "--_one":  # one setting per process
        print(measure(int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[2],
                      kernel_set=sys.argv[6]))
        sys.exit(0)
    sys.exit(main())
