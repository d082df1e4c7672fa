"""Where a prompt's time to first token goes beyond its prefill chunks' GPU work, on MLX's
CUDA backend (full-size synthetic Qwen3.6-35B-A3B, patched, batch 1), in one process:

1. ``eval``: the A/B's time-to-first-token figure (``mlx_lily.bench.ab.measure_prefill``:
   ``generate_step`` until it yields the first token) at ``--length`` tokens, ``--rounds``
   times per decoder-layer evaluation group size (``MLX_LILY_PREFILL_EVAL_LAYERS``, 0 = one
   group), after one untimed run each;
2. ``pool``: the same figure with the CUDA default memory pool's release threshold raised
   so freed memory stays reserved (driver API ``cuMemPoolSetAttribute``; the old value is
   restored after), with the pool's reserved bytes before each run: whether handing memory
   back to the driver at each synchronisation costs the next chunk's allocations;
3. ``steps``: ``generate_step``'s sequence by hand (the chunk, ``mx.eval`` of the cache,
   ``mx.clear_cache()``, the last prompt token's step, the next step built before the first
   token is read) with host build / dispatch / wait per step, with and without the
   ``clear_cache``, and six steady decode steps for comparison;
4. ``profile``: cProfile of one time-to-first-token run, top entries by own time.

    python benchmarks/gpu/ttft_probe.py --length 4096 --rounds 5 --out DIR

Writes DIR/ttft_probe.json and DIR/ttft_probe_profile.txt; prints a summary.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time

import mlx.core as mx

CU_MEMPOOL_ATTR_RELEASE_THRESHOLD = 4
CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT = 5


class DriverPool:
    """The device's default CUDA memory pool through the driver API (libcuda)."""

    def __init__(self, ordinal: int = 0):
        self.cu = ctypes.CDLL("libcuda.so.1")
        self.cu.cuInit(0)
        dev = ctypes.c_int()
        if self.cu.cuDeviceGet(ctypes.byref(dev), ordinal):
            raise RuntimeError("cuDeviceGet failed")
        self.pool = ctypes.c_void_p()
        if self.cu.cuDeviceGetDefaultMemPool(ctypes.byref(self.pool), dev):
            raise RuntimeError("cuDeviceGetDefaultMemPool failed")

    def get(self, attr: int) -> int:
        v = ctypes.c_uint64()
        rc = self.cu.cuMemPoolGetAttribute(self.pool, attr, ctypes.byref(v))
        if rc:
            raise RuntimeError(f"cuMemPoolGetAttribute({attr}) failed: {rc}")
        return v.value

    def set(self, attr: int, value: int) -> None:
        v = ctypes.c_uint64(value)
        rc = self.cu.cuMemPoolSetAttribute(self.pool, attr, ctypes.byref(v))
        if rc:
            raise RuntimeError(f"cuMemPoolSetAttribute({attr}) failed: {rc}")


def ttft_runs(model, ids, step, rounds, pool=None) -> dict:
    from mlx_lily.bench.ab import measure_prefill

    measure_prefill(model, ids, step)  # untimed
    secs, reserved = [], []
    for _ in range(rounds):
        if pool is not None:
            reserved.append(pool.get(CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT) / 2**30)
        secs.append(measure_prefill(model, ids, step)["seconds"])
    med = statistics.median(secs)
    return {"ms": [s * 1e3 for s in secs], "median_ms": med * 1e3,
            "tok_s_median": len(ids) / med, "pool_reserved_gib_before": reserved}


def steps_by_hand(model, ids, step, clear: bool) -> dict:
    """generate_step's order for a prompt of one chunk plus its last token."""
    from mlx_lm.generate import generation_stream
    from mlx_lm.models.cache import make_prompt_cache

    pc = time.perf_counter
    cache = make_prompt_cache(model)
    prompt = mx.array([int(t) for t in ids], dtype=mx.int32)
    out = {}
    with mx.stream(generation_stream):
        mx.synchronize()
        t0 = pc()
        n = min(step, prompt.size - 1)
        model(prompt[None, :n], cache=cache)
        t1 = pc()
        mx.eval([c.state for c in cache])
        t2 = pc()
        if clear:
            mx.clear_cache()
        t3 = pc()
        out["chunk"] = {"build": (t1 - t0) * 1e3, "eval": (t2 - t1) * 1e3,
                        "clear": (t3 - t2) * 1e3}

        def one(y):
            a = pc()
            logits = model(y[None], cache=cache)[:, -1, :]
            lp = logits - mx.logsumexp(logits, keepdims=True)
            tok = mx.argmax(lp, axis=-1)
            b = pc()
            mx.async_eval(tok, lp)
            c = pc()
            return tok, {"build": (b - a) * 1e3, "dispatch": (c - b) * 1e3}

        tok1, s1 = one(prompt[n:n + 1])
        tok2, s2 = one(tok1)
        a = pc()
        tok1.item()
        s1["wait_after_next_built"] = (pc() - a) * 1e3
        out["first"], out["second"] = s1, s2
        out["to_first_token_ms"] = (pc() - t0) * 1e3
        y = tok2
        steady = []
        for _ in range(6):
            y_next, s = one(y)
            a = pc()
            y.item()
            s["wait"] = (pc() - a) * 1e3
            steady.append(s)
            y = y_next
        y.item()
        out["steady"] = steady
    mx.synchronize()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--eval-layers", default="4,2,8,0")
    ap.add_argument("--preset", default="qwen3.6-35b-a3b")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args(argv)

    import cProfile
    import io
    import pstats

    import mlx_lily
    from mlx_lily import patching, synth
    from mlx_lily.bench.ab import effective_prefill_step, measure_prefill, synthetic_ids

    model, config = synth.build_model(a.preset, seed=0)
    vocab = int(config.get("vocab_size") or config["text_config"]["vocab_size"])
    ids = synthetic_ids(a.length, vocab, [], seed=1)
    res = {"command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
           "tree": os.environ.get("MLX_LILY_TREE_REV"), "mlx": mx.__version__,
           "length": a.length, "rounds": a.rounds}
    os.makedirs(a.out, exist_ok=True)

    def dump():
        with open(os.path.join(a.out, "ttft_probe.json"), "w") as f:
            json.dump(res, f, indent=1)

    with mlx_lily.patched(model):
        step = effective_prefill_step(model, None)
        res["step"] = step
        t0 = time.perf_counter()
        measure_prefill(model, ids, step)
        res["first_run_s"] = time.perf_counter() - t0
        res["eval"] = {}
        user_eval = os.environ.get(patching.PREFILL_EVAL_ENV)
        for n in [x for x in a.eval_layers.split(",") if x]:
            os.environ[patching.PREFILL_EVAL_ENV] = n
            r = res["eval"][n] = ttft_runs(model, ids, step, a.rounds)
            print(f"eval layers {n}: ttft median {r['median_ms']:.1f} ms "
                  f"({r['tok_s_median']:.0f} tok/s) runs {[round(x, 1) for x in r['ms']]}", flush=True)
            dump()
        if user_eval is None:
            os.environ.pop(patching.PREFILL_EVAL_ENV, None)
        else:
            os.environ[patching.PREFILL_EVAL_ENV] = user_eval

        try:
            pool = DriverPool()
            old = pool.get(CU_MEMPOOL_ATTR_RELEASE_THRESHOLD)
            res["pool"] = {"release_threshold_before": old}
            r = res["pool"]["default"] = ttft_runs(model, ids, step, a.rounds, pool)
            print(f"pool threshold {old}: ttft median {r['median_ms']:.1f} ms, reserved GiB "
                  f"{[round(x, 2) for x in r['pool_reserved_gib_before']]}", flush=True)
            pool.set(CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, 2**64 - 1)
            try:
                r = res["pool"]["keep"] = ttft_runs(model, ids, step, a.rounds, pool)
            finally:
                pool.set(CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, old)
            print(f"pool threshold max: ttft median {r['median_ms']:.1f} ms, reserved GiB "
                  f"{[round(x, 2) for x in r['pool_reserved_gib_before']]}", flush=True)
        except Exception as e:  # noqa: BLE001
            res["pool"] = {"error": repr(e)}
            print(f"pool probe failed: {e!r}", flush=True)
        dump()

        res["steps"] = {}
        for clear in (True, False):
            runs = [steps_by_hand(model, ids, step, clear) for _ in range(3)]
            res["steps"]["clear" if clear else "no_clear"] = runs
            r = runs[-1]
            print(f"steps ({'clear' if clear else 'no clear'}): chunk {r['chunk']}, first "
                  f"{r['first']}, second {r['second']}, to first token {r['to_first_token_ms']:.1f} ms; "
                  f"steady builds {[round(s['build'], 2) for s in r['steady']]} dispatches "
                  f"{[round(s['dispatch'], 2) for s in r['steady']]}", flush=True)
        dump()

        prof = cProfile.Profile()
        prof.enable()
        m = measure_prefill(model, ids, step)
        prof.disable()
        res["profile_ttft_ms"] = m["seconds"] * 1e3
        s = io.StringIO()
        st = pstats.Stats(prof, stream=s)
        st.sort_stats("tottime").print_stats(30)
        st.sort_stats("cumulative").print_stats(40)
        with open(os.path.join(a.out, "ttft_probe_profile.txt"), "w") as f:
            f.write(f"time to first token under cProfile: {m['seconds'] * 1e3:.1f} ms\n")
            f.write(s.getvalue())
        print("\n".join(s.getvalue().splitlines()[:45]), flush=True)
    dump()
    return 0


if __name__ == "__main__":
    sys.exit(main())
