"""Batch invariance on a real checkpoint: each prompt generated alone (``generate_step``,
greedy) against the same prompts batched through mlx-lm's ``BatchGenerator`` (what
``mlx_lm.server`` and ``mlx_lm.benchmark -b N`` use), patched; per row the first token
index where the batch differs from alone (-1: identical), the largest difference of the
first token's log-probabilities (0.0: bit-identical there), the first step whose
log-probabilities differ at all (-1: none; a differing token can follow steps later) with
the largest difference per step, and the batch's aggregate decode
tok/s (tokens over the wall time of the batched generation, prefill excluded as far as
``BatchGenerator`` separates it: the clock starts at the first generated token).

    python benchmarks/gpu/batch_parity.py --model /tmp/q36 --lengths 5,37,130,2049 --gen 32
    python benchmarks/gpu/batch_parity.py --model /tmp/q36 --lengths 37,5,130 --join 1

Writes ``batch_parity.json`` to ``--out`` (default ``$OUT`` or ``.``): per arm the tokens
alone and batched and the first differing index per row, or the error that stopped the
arm (the other arm still runs; exit status 1); for the Lily arm also the ops first
contact turned off.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import mlx.core as mx
import numpy as np


def batched(model, prompts, n, step):
    """(tokens per prompt, aggregate decode tok/s after the first generated token, each
    row's per-step log-probabilities as fp32 numpy); ``step``: prompt tokens per prefill
    chunk."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, stop_tokens=[[-1]], prefill_batch_size=len(prompts),
                         completion_batch_size=len(prompts), prefill_step_size=step)
    uids = gen.insert(prompts, [n] * len(prompts))
    out = {u: [] for u in uids}
    lps = {u: [] for u in uids}
    t0, count = None, 0
    while responses := gen.next_generated():
        for r in responses:
            out[r.uid].append(int(r.token))
            lps[r.uid].append(r.logprobs)  # read back after the clock stops
        if t0 is None:
            t0 = time.perf_counter()
        else:
            count += len(responses)
    dt = time.perf_counter() - t0 if t0 is not None else 0.0
    gen.close()
    return ([out[u] for u in uids], (count / dt if dt > 0 else 0.0),
            [[_np32(x) for x in lps[u]] for u in uids])


def _np32(lp):
    return np.array(lp.astype(mx.float32)).reshape(-1)


def alone(model, prompt, n, step):
    """(the first ``n`` greedy tokens of ``prompt`` through ``generate_step``, every step's
    log-probabilities as fp32 numpy): ``mlx_lily.testing.generation.greedy_trace``."""
    from mlx_lily.testing.generation import greedy_trace

    toks, lps = greedy_trace(model, prompt, n, prefill_step_size=step)
    return toks, [_np32(x) for x in lps]


def onset(alone_lps, batch_lps, tokens_alone, tokens_batch):
    """``(first step whose log-probabilities differ at all, -1 when none; max |diff| per
    step)``, over the steps where both runs had fed the same tokens (up to and including
    the first differing token). Where the tokens differ but no compared step's
    log-probabilities do (some missing), the first differing token's step."""
    td = first_diff(tokens_alone, tokens_batch)
    n = min(len(alone_lps), len(batch_lps)) if td < 0 else td + 1
    per = [max_diff(a, b) for a, b in zip(alone_lps[:n], batch_lps[:n])]
    first = next((i for i, d in enumerate(per) if d is None or d != 0.0), -1)
    if first < 0 and td >= 0:
        first = td
    return first, [None if d is None else round(d, 6) for d in per]


def max_diff(a, b):
    """max |a - b| (NaN-aware: NaN when either holds NaN), None when either is missing."""
    if a is None or b is None or a.shape != b.shape:
        return None
    return float(np.max(np.abs(a - b)))


def stock_safe_step(step: int, batch: int, top_k: int) -> int:
    """``step`` halved until ``batch * step * top_k`` rows fit in 65,535: MLX's CUDA
    ``gather_qmm`` puts those rows on a grid dimension, which CUDA caps there (a 4 x 2,048
    chunk of an 8-expert model fails with "invalid argument"). Lily's prefill experts
    kernel has no such limit."""
    while step > 1 and batch * step * top_k > 65535:
        step //= 2
    return step


def first_diff(a, b) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return -1 if len(a) == len(b) else min(len(a), len(b))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint directory")
    ap.add_argument("--lengths", default="5,37,130,2049",
                    help="prompt lengths of one batch, comma-separated (up to 8)")
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--stock", action="store_true", help="also run unpatched")
    ap.add_argument("--prefill-step", type=int, default=2048,
                    help="prompt tokens per prefill chunk, alone and batched (the stock arm "
                         "takes less where MLX's CUDA grid limit needs it)")
    ap.add_argument("--join", type=int, default=0,
                    help="the last N prompts join the running batch after --join-after "
                         "decode steps (mlx_lm.server's case); no tok/s is read then")
    ap.add_argument("--join-after", type=int, default=2)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args(argv)

    import mlx_lily
    from mlx_lily.bench.ab import load_target, synthetic_ids

    target = load_target(a.model)
    model, config = target.model, target.config
    text = config.get("text_config", config)
    vocab = int(config.get("vocab_size") or text["vocab_size"])
    top_k = int(text.get("num_experts_per_tok") or 1)
    lengths = [int(x) for x in a.lengths.split(",") if x]
    prompts = [synthetic_ids(L, vocab, [], seed=i + 1).tolist() for i, L in enumerate(lengths)]
    res = {"command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
           "tree": os.environ.get("MLX_LILY_TREE_REV"), "mlx": mx.__version__,
           "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("MLX_LILY_")},
           "arms": {}}
    os.makedirs(a.out, exist_ok=True)
    from mlx_lily import kernels

    failed = False
    for arm in ["lily"] + (["stock"] if a.stock else []):
        ctx = mlx_lily.patched(model) if arm == "lily" else contextlib.nullcontext()
        step = (a.prefill_step if arm == "lily"
                else stock_safe_step(a.prefill_step, len(prompts), top_k))
        entry = {"lengths": lengths, "prefill_step": step, "join": a.join,
                 "join_after": a.join_after if a.join else None}
        try:
            with ctx:
                solo, solo_lp = zip(*[alone(model, p, a.gen, step) for p in prompts])
                batched(model, prompts, 4, step)  # warm-up at this batch size
                if a.join:
                    from mlx_lily.testing.generation import batch_greedy_joining

                    raw = []
                    toks = batch_greedy_joining(model, prompts[:-a.join], prompts[-a.join:],
                                                [a.gen] * len(prompts), a.join_after,
                                                logprobs=raw, prefill_step_size=step)
                    tps, batch_lp = None, [[_np32(x) for x in row] for row in raw]
                else:
                    toks, tps, batch_lp = batched(model, prompts, a.gen, step)
            diffs = [first_diff(s, t) for s, t in zip(solo, toks)]
            lp_diffs = [max_diff(x[0] if x else None, y[0] if y else None)
                        for x, y in zip(solo_lp, batch_lp)]
            onsets = [onset(x, y, s, t) for x, y, s, t in zip(solo_lp, batch_lp, solo, toks)]
            entry.update(first_diff=diffs, first_logprobs_max_diff=lp_diffs,
                         first_logprobs_diff_step=[o[0] for o in onsets],
                         logprobs_max_diff_per_step=[o[1] for o in onsets],
                         batch_decode_tps=tps, solo=list(solo), batched=toks)
            print(f"{arm}: B={len(prompts)} lengths {lengths}: first differing token per row "
                  f"{diffs} (-1 = identical); first token's log-probabilities, max |alone - "
                  f"batched| per row {lp_diffs}; first step whose log-probabilities differ "
                  f"{[o[0] for o in onsets]}; batched decode "
                  f"{'-' if tps is None else f'{tps:.1f}'} tok/s", flush=True)
        except Exception as e:  # noqa: BLE001  (the other arm still runs; the JSON says why)
            failed = True
            entry["error"] = f"{type(e).__name__}: {e}"
            print(f"{arm}: failed: {entry['error']}", flush=True)
        if arm == "lily":  # process-wide: recorded once, for the arm that ran first contact
            entry["runtime_disabled"] = kernels.runtime_disabled()
            print(f"lily: ops off at first contact: "
                  f"{sorted(entry['runtime_disabled']) or 'none'}", flush=True)
        res["arms"][arm] = entry
        with open(os.path.join(a.out, "batch_parity.json"), "w") as f:
            json.dump(res, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
