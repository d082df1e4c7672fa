"""Where a decode step's time goes, stock vs Lily: Python graph building, the eval (MLX's
per-primitive dispatch + GPU work), the pipelined interval ``generate_step`` reaches, and
the primitives per step (counted on a steady step after the warm-up: the first step
after a prefill whose length is a multiple of 256 also grows each KV cache,
``prims_first_step``); plus the host's dispatch cost per primitive (long chains of a
built-in add and of a trivial custom kernel).

    python benchmarks/decode_profile.py --synthetic qwen3.6-35b-a3b --context 4096 --out DIR

Per arm, from one Lily-built cache (deep-copied per arm, as in ``benchmarks/ab.py``):
``build_ms`` = wall time of ``model(token, cache)`` + argmax without evaluating (Python and
graph recording only); ``sync_ms`` = build + ``mx.eval`` + synchronize, one step at a time;
``eval_ms`` = sync_ms - build_ms; ``pipelined_ms`` = median interval of ``generate_step``
(next step built while the previous one runs). Medians over ``--steps`` steps after
``--warmup`` untimed ones. ``gpu_ms`` (CUDA): the GPU's own time per step by its
nanosecond timer (``gpu_step_time``), ``dispatch`` the host's ``async_eval`` time per
step in that measurement (MLX's per-primitive dispatch, no Python). Arm ``lily-eager`` is Lily with its compiled decode layers off
(``MLX_LILY_COMPILE=0``); ``--arm-env NAME:VAR=VALUE`` adds Lily arms under another
setting (e.g. this session's fusions switched off), ``--rounds`` alternates all arms
several times (the host's speed drifts between minutes). ``achieved_gbps`` = the step's bytes
(``mlx_lily.bench.traffic.decode_step_bytes``) / the pipelined interval, next to the
device's copy bandwidth. Writes DIR/decode_profile.json and prints a table.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

from mlx_lily.backend import COMPILE_ENV
from mlx_lily.bench import env_override, gpu_clock, parse_arm_envs, write_json
from mlx_lily.bench.ab import (ARMS, arm_context, build_context, copy_cache, environment, ids_array,
                               load_target, log, measure_decode, synthetic_ids, vocab_bounds)
from mlx_lily.bench.primitives import _state_arrays, count_graph
from mlx_lily.bench.traffic import copy_bandwidth_gbps, decode_step_bytes


def _step(model, cache, tok):
    logits = model(ids_array([tok])[None], cache=cache)
    return mx.argmax(logits[:, -1, :], axis=-1)


def python_profile(model, ctx, tok: int, steps: int, path: Path) -> None:
    """cProfile of ``steps`` graph builds (no evaluation in the profiled span) written as
    a text table sorted by own time to ``path``: where the host's build time goes."""
    import cProfile
    import io
    import pstats

    cache = copy_cache(ctx)
    y = _step(model, cache, tok)
    mx.eval(y, *_state_arrays(cache))
    pr = cProfile.Profile()
    for _ in range(steps):
        t = int(y.item())
        pr.enable()
        y = _step(model, cache, t)
        pr.disable()
        mx.eval(y, *_state_arrays(cache))
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(40)
    path.write_text(buf.getvalue())


def profile_arm(model, ctx, tok: int, steps: int, warmup: int, gpu_only: bool = False) -> dict:
    cache = copy_cache(ctx)
    y = _step(model, cache, tok)
    first = count_graph(y, *_state_arrays(cache))
    mx.eval(y, *_state_arrays(cache))
    for _ in range(max(1, warmup)):
        y = _step(model, cache, int(y.item()))
        counts = count_graph(y, *_state_arrays(cache))  # a steady step (no cache growth)
        mx.eval(y, *_state_arrays(cache))
    prims = counts["total"]
    if gpu_only:
        out = {"prims_per_step": prims, "prims_by_label": counts["by_label"],
               "prims_first_step": first["total"]}
        if gpu_clock.available():
            out.update(gpu_step_time(model, cache, int(y.item()), 20.0))
            out["gpu_tok_s"] = 1e3 / out["gpu_ms"]
        return out
    build, sync = [], []
    for _ in range(steps):
        t = int(y.item())
        mx.synchronize()
        t0 = time.perf_counter()
        y = _step(model, cache, t)
        t1 = time.perf_counter()
        mx.eval(y, *_state_arrays(cache))
        mx.synchronize()
        t2 = time.perf_counter()
        build.append(t1 - t0)
        sync.append(t2 - t0)
    b, s = statistics.median(build) * 1e3, statistics.median(sync) * 1e3
    gpu = gpu_step_time(model, cache, int(y.item()), s) if gpu_clock.available() else None
    del cache
    pipe = measure_decode(model, copy_cache(ctx), tok, steps)
    out = {"prims_per_step": prims, "prims_by_label": counts["by_label"],
           "prims_first_step": first["total"], "build_ms": b, "sync_ms": s, "eval_ms": s - b,
           "pipelined_ms": pipe["interval_s_median"] * 1e3,
           "pipelined_tok_s": pipe["tok_s_median"]}
    if gpu is not None:
        out.update(gpu)
    return out


def gpu_step_time(model, cache, tok: int, sync_ms: float, chain: int = 8,
                  reps: int = 3) -> dict:
    """Device-side time of one decode step (``mlx_lily.bench.gpu_clock``): ``chain`` steps
    built lazily one after the other (each feeds its argmax to the next), queued behind a
    GPU spin long enough for the host to dispatch them all, then run back to back; the
    median over ``reps`` of the GPU time / ``chain``. ``gpu_ms`` is what the GPU alone
    needs per token; ``pipelined_ms`` above it is host-bound."""

    def steps(t):
        y = t
        for _ in range(chain):
            y = mx.argmax(model(y, cache=cache)[:, -1, :], axis=-1)[None]
        return [y, *_state_arrays(cache)]

    spin_ms = 30.0 + 2.0 * chain * sync_ms
    r = gpu_clock.time_chain(steps, ids_array([tok])[None], spin_ms=1.0)  # warm: allocator
    tok = int(r["outputs"][0].item())
    per, host, covered = [], [], True
    for _ in range(reps):
        r = gpu_clock.time_chain(steps, ids_array([tok])[None], spin_ms=spin_ms)
        tok = int(r["outputs"][0].item())
        per.append(r["gpu_s"] / chain * 1e3)
        host.append(r["host_dispatch_s"] / chain * 1e3)
        covered &= r["host_covered"]
    return {"gpu_ms": statistics.median(per), "gpu_ms_reps": per,
            "gpu_dispatch_ms": statistics.median(host), "gpu_timing_host_covered": covered,
            "gpu_chain_steps": chain}


def gpu_breakdown(model, ctx, n: int = 40, reps: int = 5) -> dict:
    """Device-side time of each part of a decode step, from the model's own modules on a
    copy of the Lily-built cache (``gpu_clock``): ``n`` calls of one part chained as
    ``v <- rms_norm(v + part(v))`` on a one-token row, minus the same chain without the
    part; median over ``reps``, microseconds per call. Parts: a Gated DeltaNet mixer, an
    attention mixer (its KV cache grows by one row per call), a MoE block, the LM head."""
    from mlx_lily.bench.traffic import _text_model

    lm, tm = _text_model(model)
    layers = tm.layers
    gi = next(i for i, l in enumerate(layers) if l.is_linear)
    ai = next((i for i, l in enumerate(layers) if not l.is_linear), None)
    d = layers[0].input_layernorm.weight.shape[0]
    x0 = (mx.random.normal((1, 1, d)) * 0.5).astype(layers[0].input_layernorm.weight.dtype)
    mx.eval(x0)
    parts = {"gdn_mixer": lambda v, c: layers[gi].linear_attn(v, None, c[gi]),
             "moe_block": lambda v, c: layers[gi].mlp(v)}
    if ai is not None:
        parts["attention_mixer"] = lambda v, c: layers[ai].self_attn(v, None, c[ai])
    head = getattr(lm, "lm_head", None)
    if head is not None:
        w = head.weight.shape[0]
        parts["lm_head"] = lambda v, c: head(v)[..., :d] * (1.0 / w)

    def chain(part):
        def f(v):
            c = copy_cache(ctx)
            for _ in range(n):
                v = mx.fast.rms_norm(v + (part(v, c) if part else v), None, 1e-6)
            return [v, *_state_arrays(c)]
        return f

    def med_us(part):
        f = chain(part)
        f(x0)  # warm-up (traces, kernel builds)
        ts = [gpu_clock.time_chain(f, x0, spin_ms=200.0)["gpu_s"] for _ in range(reps)]
        return statistics.median(ts) / n * 1e6

    base = med_us(None)
    out = {"chain_norm_add_us": base}
    for name, part in parts.items():
        out[name + "_us"] = med_us(part) - base
    n_gdn = sum(1 for l in layers if l.is_linear)
    n_att = len(layers) - n_gdn
    out["predicted_step_ms"] = (n_gdn * out["gdn_mixer_us"] + n_att * out.get("attention_mixer_us", 0)
                                + len(layers) * out["moe_block_us"] + out.get("lm_head_us", 0)) / 1e3
    return out


def dispatch_cost(n: int = 2000) -> dict:
    """Host cost per primitive in long chains: built-in add, and a trivial custom kernel
    (CUDA or Metal, when available)."""
    x = mx.zeros((1,), mx.float32)
    mx.eval(x)

    def chain(f):
        y = x
        for _ in range(n):
            y = f(y)
        return y

    out = {}
    for name, f in (("builtin_add", lambda y: y + 1),):
        mx.eval(chain(f))
        t0 = time.perf_counter()
        mx.eval(chain(f))
        mx.synchronize()
        out[name + "_us"] = (time.perf_counter() - t0) / n * 1e6
    kern = None
    if hasattr(mx.fast, "cuda_kernel") and mx.default_device() == mx.gpu:
        try:
            k = mx.fast.cuda_kernel(name="lily_probe_add1", input_names=["a"], output_names=["b"],
                                    source="int i = blockIdx.x * blockDim.x + threadIdx.x;"
                                           " if (i < 1) b[i] = a[i] + 1.0f;")
            kern = lambda y: k(inputs=[y], output_shapes=[(1,)], output_dtypes=[mx.float32],  # noqa: E731
                               grid=(32, 1, 1), threadgroup=(32, 1, 1))[0]
            mx.eval(kern(x))
        except Exception as e:  # Metal-only build or no CUDA backend
            out["custom_kernel_error"] = f"{type(e).__name__}: {e}"
            kern = None
    if kern is None and hasattr(mx.fast, "metal_kernel") and mx.metal.is_available():
        k = mx.fast.metal_kernel(name="lily_probe_add1", input_names=["a"], output_names=["b"],
                                 source="uint i = thread_position_in_grid.x; if (i < 1) b[i] = a[i] + 1.0f;")
        kern = lambda y: k(inputs=[y], output_shapes=[(1,)], output_dtypes=[mx.float32],  # noqa: E731
                           grid=(32, 1, 1), threadgroup=(32, 1, 1))[0]
    if kern is not None:
        mx.eval(chain(kern))
        t0 = time.perf_counter()
        r = chain(kern)
        mx.eval(r)
        mx.synchronize()
        out["custom_kernel_us"] = (time.perf_counter() - t0) / n * 1e6
        out["custom_kernel_check"] = float(r.item()) == float(n)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("model", nargs="?")
    src.add_argument("--synthetic", metavar="PRESET")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--cpu", action="store_true",
                   help="run on MLX's CPU backend too (a full-size model takes many minutes)")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--ops", default=None)
    p.add_argument("--no-eager-arm", action="store_true",
                   help="skip the 'lily-eager' arm (Lily with MLX_LILY_COMPILE=0)")
    p.add_argument("--no-stock-arm", action="store_true", help="skip the 'stock' arm")
    p.add_argument("--arm-env", action="append", default=[], metavar="NAME:VAR=VALUE",
                   help="one more Lily arm run with environment variable VAR=VALUE (e.g. "
                        "'lily-s4:MLX_LILY_DISABLE=norm_qgemv'); repeatable")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the arms this many times, alternating; each arm reports the "
                        "median over rounds of its per-round medians (rounds kept)")
    p.add_argument("--cprofile", action="store_true",
                   help="also write OUT/build_cprofile-<arm>.txt: cProfile of the Lily "
                        "arms' graph builds")
    p.add_argument("--gpu-only", action="store_true",
                   help="only the device-side figures (gpu_ms per arm, --breakdown): run this "
                        "in a process started with MLX_MAX_OPS_PER_BUFFER and "
                        "MLX_MAX_MB_PER_BUFFER raised, so one eval is one CUDA graph and "
                        "MLX's dispatch does not wait for the spinning GPU")
    p.add_argument("--breakdown", action="store_true",
                   help="CUDA: device-side time of a GDN mixer, an attention mixer, a MoE "
                        "block and the LM head, stock and Lily (gpu_breakdown)")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    from mlx_lily.bench import gpu_or_explain

    try:
        arm_env_specs = parse_arm_envs(a.arm_env, taken=(*ARMS, "lily-eager"))
    except ValueError as e:
        p.error(str(e))

    if not a.cpu and not gpu_or_explain("decode_profile (--cpu runs it anyway)"):
        return 0
    ops = a.ops.split(",") if a.ops else None
    t = load_target(a.model, synthetic=a.synthetic)
    hi, ex = vocab_bounds(t.config, t.tokenizer)
    ids = synthetic_ids(a.context + 1, hi, ex, seed=0)
    res = {"environment": environment(ops), "context": a.context, "steps": a.steps,
           "dispatch": dispatch_cost(), "arms": {}}
    log(f"dispatch cost per primitive: {res['dispatch']}")
    res["bytes_per_step"] = decode_step_bytes(t.model, a.context)
    res["copy_gbps"] = copy_bandwidth_gbps()
    log(f"bytes per decode step: {res['bytes_per_step']}; copy bandwidth {res['copy_gbps']:.0f} GB/s")
    with arm_context("lily", t.model, ops):
        ctx = build_context(t.model, ids[:a.context], 2048)
    if a.breakdown and gpu_clock.available():
        for arm in (x for x in ARMS if not (a.no_stock_arm and x == "stock")):
            with arm_context(arm, t.model, ops):
                res.setdefault("gpu_breakdown", {})[arm] = gpu_breakdown(t.model, ctx)
            log(f"GPU time per part ({arm}): {res['gpu_breakdown'][arm]}")
    arm_envs = {"lily-eager": (COMPILE_ENV, "0"), **arm_env_specs}
    arms = [x for x in ARMS if not (a.no_stock_arm and x == "stock")]
    arms += ([] if a.no_eager_arm else ["lily-eager"])
    arms += [name for name in arm_envs if name != "lily-eager"]
    rounds: dict = {arm: [] for arm in arms}
    for rnd in range(max(1, a.rounds)):
        for arm in arms:
            var, val = arm_envs.get(arm, (None, None))
            with env_override(var, val):
                with arm_context("lily" if var else arm, t.model, ops):
                    r = profile_arm(t.model, ctx, int(ids[a.context]), a.steps, a.warmup,
                                    gpu_only=a.gpu_only)
                if "pipelined_ms" in r:
                    r["achieved_gbps"] = (res["bytes_per_step"]["total"]
                                          / (r["pipelined_ms"] / 1e3) / 1e9)
                if "gpu_ms" in r:
                    r["gpu_gbps"] = res["bytes_per_step"]["total"] / (r["gpu_ms"] / 1e3) / 1e9
                if var:
                    r["env"] = {var: val}
                rounds[arm].append(r)
                log(f"round {rnd + 1} {arm}: {r}")
                if a.cprofile and a.out and rnd == 0 and arm != "stock":
                    a.out.mkdir(parents=True, exist_ok=True)
                    with arm_context("lily", t.model, ops):
                        python_profile(t.model, ctx, int(ids[a.context]), a.steps,
                                       a.out / f"build_cprofile-{arm}.txt")
    for arm, rs in rounds.items():
        rs_sorted = sorted(rs, key=lambda r: r.get("pipelined_ms", r.get("gpu_ms", 0.0)))
        r = dict(rs_sorted[len(rs_sorted) // 2])
        if len(rs) > 1:
            r["rounds"] = rs
        res["arms"][arm] = r
    print(f"\ndecode step at context {a.context} (ms, medians of {a.steps})")
    print(f"{'arm':11s}{'prims':>7s}{'build':>9s}{'eval':>9s}{'sync':>9s}{'pipelined':>11s}{'tok/s':>8s}"
          f"{'GB/s':>8s}{'GPU ms':>9s}{'dispatch':>10s}")
    for arm, r in res["arms"].items():
        if "pipelined_ms" not in r:
            print(f"{arm:11s}{r['prims_per_step']:7d}  GPU {r.get('gpu_ms', float('nan')):.2f} ms "
                  f"per step ({r.get('gpu_gbps', float('nan')):.0f} GB/s), dispatch "
                  f"{r.get('gpu_dispatch_ms', float('nan')):.2f} ms, host covered "
                  f"{r.get('gpu_timing_host_covered')}")
            continue
        g = (f"{r['gpu_ms']:9.2f}{r['gpu_dispatch_ms']:10.2f}"
             + ("" if r["gpu_timing_host_covered"] else "  (spin too short)")
             if "gpu_ms" in r else "")
        print(f"{arm:11s}{r['prims_per_step']:7d}{r['build_ms']:9.2f}{r['eval_ms']:9.2f}{r['sync_ms']:9.2f}"
              f"{r['pipelined_ms']:11.2f}{r['pipelined_tok_s']:8.1f}{r['achieved_gbps']:8.0f}{g}")
    print(f"{res['bytes_per_step']['total'] / 1e9:.2f} GB per step; copy bandwidth "
          f"{res['copy_gbps']:.0f} GB/s")
    if a.out:
        log(f"wrote {write_json(a.out, 'decode_profile.json', res)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
