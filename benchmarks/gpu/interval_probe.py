"""Where a generation's mean decode rate loses to its median: per-token intervals through
mlx-lm's own ``stream_generate`` (what ``mlx_lm.benchmark`` times), patched, batch 1.

For each prompt length, ``--rounds`` generations of ``--gen`` tokens (after one untimed
run) with ``prefill_step_size`` as ``mlx_lm.benchmark`` passes it (2048 unless
``--prefill-step-size``). Per round: mlx-lm's ``generation_tps``, the intervals' mean and
median, and the ``--top`` longest intervals with their token index; a step count of
host-side retraces is not visible here, so the script also records, per interval, whether
the patched stack's compiled-step cache changed size (a new trace) during it.

    python benchmarks/gpu/interval_probe.py --model DIR --lengths 512,4096 --gen 128 --out DIR

Writes DIR/interval_probe.json; prints one line per round.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time


def _trace_count(model) -> tuple:
    """A fingerprint of the compiled decode steps the patched stack holds (whole-stack
    function in use, how many recent ones, per-layer functions): it changes when a step
    traced a new function."""
    for _, m in model.named_modules():
        st = m.__dict__.get("_lily_steps")
        if st is not None:
            whole = st.whole[1] if isinstance(st.whole, tuple) else st.whole
            return (id(whole), len(st.recent), len(st.fns))
    return ()


def one_round(model, tokenizer, prompt, gen: int, step: int, top: int) -> dict:
    from mlx_lm import stream_generate

    stamps, traces, last = [], [], None
    for last in stream_generate(model, tokenizer, prompt, max_tokens=gen, prefill_step_size=step):
        stamps.append(time.perf_counter())
        traces.append(_trace_count(model))
    iv = [b - a for a, b in zip(stamps, stamps[1:])]
    order = sorted(range(len(iv)), key=lambda i: -iv[i])[:top]
    return {
        "generation_tps": last.generation_tps,
        "prompt_tps": last.prompt_tps,
        "interval_ms_mean": 1e3 * sum(iv) / len(iv),
        "interval_ms_median": 1e3 * statistics.median(iv),
        "longest": [{"token": i + 1, "ms": round(1e3 * iv[i], 3),
                     "new_trace": traces[i + 1] != traces[i]} for i in order],
        "excess_ms_over_median": round(1e3 * sum(v - statistics.median(iv) for v in iv
                                                 if v > statistics.median(iv)), 2),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="512,4096")
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--prefill-step-size", type=int, default=2048)
    ap.add_argument("--model", required=True,
                    help="checkpoint directory (python -m mlx_lily.synth writes one)")
    ap.add_argument("--stock", action="store_true", help="also run unpatched")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args(argv)

    import mlx.core as mx

    import mlx_lily
    from mlx_lily.bench.ab import load_target, synthetic_ids

    target = load_target(a.model)
    model, tok, config = target.model, target.tokenizer, target.config
    vocab = int(config.get("vocab_size") or config["text_config"]["vocab_size"])
    tok._eos_token_ids = set()  # as mlx_lm.benchmark: never stop early
    res = {"command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
           "tree": os.environ.get("MLX_LILY_TREE_REV"), "mlx": mx.__version__, "rows": []}
    os.makedirs(a.out, exist_ok=True)
    arms = ["lily"] + (["stock"] if a.stock else [])
    for L in [int(x) for x in a.lengths.split(",") if x]:
        prompt = synthetic_ids(L, vocab, [], seed=1)
        for arm in arms:
            ctx = mlx_lily.patched(model) if arm == "lily" else contextlib.nullcontext()
            with ctx:
                one_round(model, tok, prompt, a.gen, a.prefill_step_size, a.top)
                for r in range(a.rounds):
                    row = one_round(model, tok, prompt, a.gen, a.prefill_step_size, a.top)
                    row.update(arm=arm, length=L, round=r)
                    res["rows"].append(row)
                    print(f"{arm} L={L} round {r}: gen {row['generation_tps']:.1f} tok/s, interval "
                          f"mean {row['interval_ms_mean']:.2f} median {row['interval_ms_median']:.2f} ms, "
                          f"excess {row['excess_ms_over_median']:.0f} ms, longest "
                          + ", ".join(f"#{x['token']}:{x['ms']:.1f}{'T' if x['new_trace'] else ''}"
                                      for x in row["longest"][:5]), flush=True)
                    with open(os.path.join(a.out, "interval_probe.json"), "w") as f:
                        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
