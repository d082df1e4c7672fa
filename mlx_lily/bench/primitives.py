"""MLX primitives (graph nodes) per decode token, stock vs Lily.

For each arm, one decode step is built lazily on a cache holding ``--context`` tokens
(prefilled once, with Lily, and deep-copied per arm as in :mod:`mlx_lily.bench.ab`):
the model forward on one token, the cache updates, and -- for the ``step`` count --
``generate_step``'s sampling tail (last-row logits, log-softmax, argmax).  The graph is
written with ``mx.export_to_dot`` (MLX >= 0.2x) and every primitive node (the
``shape=rectangle`` nodes; inputs and intermediate arrays are ellipses) is counted,
total, per label, and divided by the number of layers.

Counts describe what the host must record per token; on the CPU backend Lily's ops run
their pure-MLX reference forms, so the GPU-kernel counts differ (the backend is recorded).
"""
from __future__ import annotations

import argparse
import collections
import datetime as _dt
import json
import re
import sys
import tempfile
from pathlib import Path

from .ab import (ARMS, arm_context, build_context, copy_cache, environment, ids_array, load_target,
                 log, synthetic_ids, vocab_bounds)

SCHEMA_NAME = "mlx-lily-primitives"
SCHEMA_VERSION = 1
_NODE_RE = re.compile(r'^\{\s*(\S+)\s+\[label\s*=\s*"([^"]*)",\s*shape=rectangle\];\s*\}\s*$')


def count_dot(path: str | Path) -> dict:
    """Count primitive nodes in an ``mx.export_to_dot`` file: ``{"total": n, "by_label": {...}}``."""
    by = collections.Counter()
    ids = set()
    for line in Path(path).read_text().splitlines():
        m = _NODE_RE.match(line.strip())
        if m and m.group(1) not in ids:
            ids.add(m.group(1))
            by[m.group(2)] += 1
    return {"total": sum(by.values()), "by_label": dict(sorted(by.items(), key=lambda kv: (-kv[1], kv[0])))}


def count_graph(*outputs) -> dict:
    """Primitive counts of the unevaluated graph behind ``outputs``."""
    import mlx.core as mx

    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "g.dot"
        mx.export_to_dot(str(f), *outputs)
        return count_dot(f)


def _state_arrays(cache) -> list:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    return [v for c in cache for _, v in tree_flatten(c.state) if isinstance(v, mx.array)]


def _step_graph_counts(logits, cache) -> tuple[dict, list]:
    """``{"forward", "step"}`` counts for the step behind ``logits`` (``step`` adds
    ``generate_step``'s sampling tail), and the arrays that end the step's graph."""
    import mlx.core as mx

    states = _state_arrays(cache)
    last = logits[:, -1, :]
    logprobs = last - mx.logsumexp(last, keepdims=True)
    tok = mx.argmax(logprobs, axis=-1)
    counts = {"forward": count_graph(logits, *states), "step": count_graph(tok, logprobs, *states)}
    return counts, [tok, logprobs, *states]


def decode_step_counts(model, cache, token: int) -> dict:
    """Counts for one decode step of ``model`` on ``cache`` (which it mutates, lazily)."""
    import mlx.core as mx

    counts, ends = _step_graph_counts(model(ids_array([token])[None], cache=cache), cache)
    mx.eval(ends)  # release the graph
    return counts


def traced_step_counts(model, ctx, token: int, backend_name: str, repeats: int = 5) -> dict:
    """Primitive counts and Python build time of one decode step recorded with the
    dispatchers on ``backend_name``'s kernel path (``mlx_lily.backend.tracing_backend``)
    inside ``mx.export_function`` tracing: nothing is evaluated, so a CPU-only machine
    can count the Metal kernel graph. ``build_ms_median`` is the wall time of the forward
    call alone (graph recording), median of ``repeats``, each on a fresh copy of ``ctx``.
    Fast ops that export decomposes (the first layer's ``mx.fast.rms_norm``) count as
    their parts here."""
    import os
    import statistics
    import time

    import mlx.core as mx

    from ..backend import tracing_backend

    res: dict = {}
    times: list[float] = []

    def fn(tok):
        out = None
        for _ in range(repeats):
            cache = copy_cache(ctx)
            t0 = time.perf_counter()
            out = model(tok, cache=cache)
            times.append(time.perf_counter() - t0)
        res.update(_step_graph_counts(out, cache)[0])
        return out

    with tracing_backend(backend_name), tempfile.TemporaryDirectory() as d:
        try:
            mx.export_function(os.path.join(d, "step.mlxfn"), fn, ids_array([token])[None])
        except ValueError as e:  # serialising the traced graph is not needed
            if "serialize" not in str(e) or "step" not in res:
                raise
    res["build_ms_median"] = statistics.median(times) * 1e3
    res["traced_backend"] = backend_name
    return res


def run_primitives(target, context: int = 300, seed: int = 0, ops=None,
                   trace_backend: str | None = None) -> dict:
    """Per-arm primitive counts of one decode step at ``context`` tokens. With
    ``trace_backend`` the Lily arm is recorded on that backend's kernel path without
    evaluation (:func:`traced_step_counts`)."""
    model = target.model
    hi, exclude = vocab_bounds(target.config, target.tokenizer)
    ids = synthetic_ids(context + 1, hi, exclude, seed=seed)
    with arm_context("lily", model, ops):
        ctx = build_context(model, ids[:context], 2048)
    n_layers = len(model.layers)
    out = {}
    for arm in ARMS:
        c = copy_cache(ctx)
        with arm_context(arm, model, ops):
            if trace_backend and arm == "lily":
                r = traced_step_counts(model, c, int(ids[context]), trace_backend)
            else:
                r = decode_step_counts(model, c, int(ids[context]))
        r["per_layer_forward"] = r["forward"]["total"] / n_layers
        r["per_layer_step"] = r["step"]["total"] / n_layers
        out[arm] = r
        log(f"primitives: {arm}: {r['step']['total']} per decode step "
            f"({r['forward']['total']} in the forward), {r['per_layer_step']:.1f} per layer")
    return {"n_layers": n_layers, "context": context, "arms": out,
            "ratio_lily_stock": out["lily"]["step"]["total"] / max(1, out["stock"]["step"]["total"])}


def render_table(result: dict) -> str:
    """Markdown summary (totals and the most frequent labels)."""
    a = result["arms"]
    lines = [f"primitives per decode token ({result['backend']} / {result['device']['name']}, context "
             f"{result['context']}, {result['n_layers']} layers)", "",
             "| arm | step total | forward total | per layer (step) | forward build ms | recorded as |",
             "|---|---:|---:|---:|---:|---|"]
    for arm in ARMS:
        b = a[arm].get("build_ms_median")
        lines.append(f"| {arm} | {a[arm]['step']['total']} | {a[arm]['forward']['total']} | "
                     f"{a[arm]['per_layer_step']:.1f} | {'' if b is None else f'{b:.2f}'} | "
                     f"{a[arm].get('traced_backend') or result['backend']} |")
    lines += ["", "| primitive | stock | lily |", "|---|---:|---:|"]
    labels = sorted(set(a["stock"]["step"]["by_label"]) | set(a["lily"]["step"]["by_label"]),
                    key=lambda k: -(a["stock"]["step"]["by_label"].get(k, 0) + a["lily"]["step"]["by_label"].get(k, 0)))
    for k in labels[:25]:
        lines.append(f"| {k} | {a['stock']['step']['by_label'].get(k, 0)} | {a['lily']['step']['by_label'].get(k, 0)} |")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    """The primitives CLI parser."""
    p = argparse.ArgumentParser(prog="python benchmarks/primitives.py",
                                description="Count MLX primitives per decode token, stock vs Lily.")
    p.add_argument("model", nargs="?", default=None, help="checkpoint directory")
    p.add_argument("--synthetic", metavar="PRESET", default=None)
    p.add_argument("--model-seed", type=int, default=0)
    p.add_argument("--context", type=int, default=300,
                   help="cached tokens before the counted step (300: not a multiple of 256, "
                        "where mlx-lm's KVCache grows its buffer and adds nodes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ops", default=None)
    p.add_argument("--trace-backend", choices=("metal",), default=None,
                   help="record Lily's step on this backend's kernel path without running it "
                        "(counts kernel graphs on a machine without that GPU)")
    p.add_argument("--out", type=Path, default=None, help="write the JSON result here")
    return p


def main(argv=None) -> int:
    """CLI entry point: prints a table, writes ``--out`` JSON."""
    a = build_parser().parse_args(argv)
    if a.model is None and a.synthetic is None:
        from .numerics import default_checkpoint

        a.model = str(default_checkpoint())
    ops = [o.strip() for o in a.ops.split(",")] if a.ops else None
    target = load_target(a.model if a.synthetic is None else None, a.synthetic, a.model_seed)
    env = environment(ops)
    res = run_primitives(target, a.context, a.seed, ops, trace_backend=a.trace_backend)
    result = {"schema": SCHEMA_NAME, "schema_version": SCHEMA_VERSION,
              "created": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
              **env, "checkpoint": target.identity, **res}
    print(render_table(result))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
        log(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
