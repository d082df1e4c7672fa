"""Teacher-forced numerics: Lily vs stock mlx-lm on one checkpoint.

Each engine (stock mlx-lm; the same model inside ``mlx_lily.patched``) predicts the next
token from the same prefix at every position of a reference token sequence:

* default mode: one forward over the whole sequence through a fresh mlx-lm cache (teacher
  forcing; exercises the prefill path);
* ``--incremental``: the sequence is fed token by token through the cache (exercises the
  decode path and cache updates).

Reported: perplexity of each engine on the reference continuation, the relative perplexity
difference ``ppl_lily / ppl_stock - 1``, top-1 agreement (same argmax), mean KL(stock ||
lily), max and mean |logit difference|, and each engine's top-1 accuracy on the reference.

Reference sequence (first match wins): ``--ids`` (a JSON list or ``{"ids": [...]}``),
``--text-file`` (tokenised with the checkpoint's tokenizer), the checkpoint directory's
``numerics_reference.json`` (the trained fixture stores 320 ids of a validation-split stdlib
file there), a validation-split stdlib file tokenised with the checkpoint's tokenizer, or
(no tokenizer, e.g. ``--synthetic``) seeded synthetic ids.

Targets for the CPU reference path (reported, not enforced here): perplexity within 0.01%
of stock and top-1 agreement >= 99.5%.

GPU targets (kernels round differently from stock, so they are anchored on an fp32
evaluation of the same weights: stock code with every float parameter in fp32): Lily's
perplexity is no further from the fp32 evaluation's than ``ppl_distance_factor`` x stock's,
and its top-1 agreement with fp32 is at most ``top1_slack`` below stock's: the rule of the
A/B gate's fp32 anchor (``mlx_lily.bench.ab.correctness_gate``) applied to perplexity.
``--no-fp32-anchor`` skips that arm (it doubles the float parameters' memory while it runs).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import math
import sys
import sysconfig
from pathlib import Path

from .ab import (ARMS, _WrongLogits, arm_context, environment, ids_array, json_clean, load_target,
                 log, synthetic_ids, vocab_bounds)

SCHEMA_NAME = "mlx-lily-numerics"
SCHEMA_VERSION = 1
TARGETS = {"ppl_rel_diff_max": 1e-4, "top1_agreement_min": 0.995}
GPU_TARGETS = {"ppl_distance_factor": 1.5, "top1_slack": 0.1}
MIN_POSITIONS = 192
REFERENCE_FILE = "numerics_reference.json"
INJECT_ENV = "MLX_LILY_NUMERICS_INJECT_WRONG"


def default_checkpoint() -> Path:
    """The trained test fixture shipped in the repository."""
    return Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "qwen35moe-tiny-trained"


def _stdlib_val_text(min_chars: int = 4000) -> tuple[str, str]:
    """A validation-split stdlib file (same split rule as benchmarks/train_fixture.py)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    excluded = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    files = sorted(
        p.relative_to(root).as_posix() for p in root.rglob("*.py")
        if not any(part in excluded for part in p.relative_to(root).parts[:-1])
        and not p.name.startswith("test_"))
    for i, f in enumerate(files):
        if i % 20 == 7:
            t = (root / f).read_text(encoding="utf-8", errors="replace")
            if len(t) >= min_chars:
                return t, f"stdlib:{f}"
    raise RuntimeError("no validation-split stdlib file found")


def reference_ids(target, *, ids_file=None, text_file=None, max_tokens: int = 320, seed: int = 0):
    """The reference token ids and a description of their source (see the module doc)."""
    if ids_file is not None:
        data = json.loads(Path(ids_file).read_text())
        ids = data["ids"] if isinstance(data, dict) else data
        return [int(i) for i in ids][:max_tokens], f"ids-file:{ids_file}"
    tok = target.tokenizer
    if text_file is not None:
        if tok is None:
            raise ValueError("--text-file needs a checkpoint with a tokenizer")
        return list(tok.encode(Path(text_file).read_text()))[:max_tokens], f"text-file:{text_file}"
    path = target.identity.get("path")
    if path and (Path(path) / REFERENCE_FILE).is_file():
        data = json.loads((Path(path) / REFERENCE_FILE).read_text())
        return [int(i) for i in data["ids"]][:max_tokens], f"{REFERENCE_FILE}:{data.get('source')}"
    if tok is not None:
        text, src = _stdlib_val_text()
        return list(tok.encode(text))[:max_tokens], src
    hi, exclude = vocab_bounds(target.config, None)
    return [int(i) for i in synthetic_ids(max_tokens, hi, exclude, seed=seed)], f"synthetic:seed{seed}"


def engine_logits(model, ids, incremental: bool = False):
    """float32 numpy logits ``[T, V]`` for ``ids`` through a fresh ``make_prompt_cache`` cache."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    x = ids_array(ids)
    if not incremental:
        out = model(x[None], cache=cache)[0].astype(mx.float32)
        mx.eval(out)
        return np.array(out)
    rows = []
    for i in range(len(ids)):
        o = model(x[i:i + 1][None], cache=cache)[0, -1].astype(mx.float32)
        mx.eval(o)
        rows.append(np.array(o))
    return np.stack(rows)


def _log_softmax(x):
    import numpy as np

    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def compare_logits(stock, lily, ids) -> dict:
    """Metrics over the positions ``0..T-2`` (each predicting ``ids[t+1]``)."""
    import numpy as np

    tgt = np.asarray(ids[1:], dtype=np.int64)
    s, l = stock[:-1], lily[:-1]
    n = len(tgt)
    ls, ll = _log_softmax(s), _log_softmax(l)
    nll_s = -ls[np.arange(n), tgt]
    nll_l = -ll[np.arange(n), tgt]
    ppl_s, ppl_l = math.exp(nll_s.mean()), math.exp(nll_l.mean())
    kl = (np.exp(ls) * (ls - ll)).sum(axis=-1)
    d = np.abs(s.astype(np.float64) - l.astype(np.float64))
    top_s, top_l = s.argmax(-1), l.argmax(-1)
    return {
        "positions": int(n),
        "ppl_stock": ppl_s,
        "ppl_lily": ppl_l,
        "ppl_rel_diff": ppl_l / ppl_s - 1.0,
        "nll_stock": float(nll_s.mean()),
        "nll_lily": float(nll_l.mean()),
        "top1_agreement": float((top_s == top_l).mean()),
        "kl_stock_lily_mean": float(kl.mean()),
        "kl_stock_lily_max": float(kl.max()),
        "max_abs_logit_diff": float(d.max()),
        "mean_abs_logit_diff": float(d.mean()),
        "logit_scale": float(np.abs(s).max()),
        "top1_accuracy_stock": float((top_s == tgt).mean()),
        "top1_accuracy_lily": float((top_l == tgt).mean()),
        "all_finite": bool(np.isfinite(s).all() and np.isfinite(l).all()),
    }


def run_numerics(target, ids, *, incremental: bool = False, inject_wrong: bool = False, ops=None,
                 fp32_anchor: bool = False) -> dict:
    """Run both engines over ``ids`` and return the metrics dict (``compare_logits``);
    with ``fp32_anchor`` also ``metrics["fp32"] = {"stock": ..., "lily": ...}``, each
    engine compared with the fp32 evaluation (``fp32_engine_logits``)."""
    logits = {}
    for arm in ARMS:
        with arm_context(arm, target.model, ops):
            m = _WrongLogits(target.model) if (inject_wrong and arm == "lily") else target.model
            logits[arm] = engine_logits(m, ids, incremental)
            log(f"numerics: {arm} logits done ({'incremental' if incremental else 'teacher-forced'})")
    metrics = compare_logits(logits["stock"], logits["lily"], ids)
    if fp32_anchor:
        with arm_context("stock", target.model, ops):
            f32 = fp32_engine_logits(target.model, ids, incremental)
        log("numerics: fp32 logits done")
        metrics["fp32"] = {arm: compare_logits(f32, logits[arm], ids) for arm in ARMS}
    return metrics


def fp32_engine_logits(model, ids, incremental: bool = False):
    """``engine_logits`` with every floating parameter in fp32 (quantized weights
    unchanged); the model's own arrays are restored by identity afterwards."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    saved = tree_flatten(model.parameters())
    try:
        model.set_dtype(mx.float32)
        return engine_logits(model, ids, incremental)
    finally:
        model.update(tree_unflatten(saved))


def meets_targets(metrics: dict) -> dict:
    """Which of the CPU-reference targets the metrics meet."""
    ppl_ok = abs(metrics["ppl_rel_diff"]) <= TARGETS["ppl_rel_diff_max"]
    top_ok = metrics["top1_agreement"] >= TARGETS["top1_agreement_min"]
    return {"ppl": ppl_ok, "top1": top_ok, "all": ppl_ok and top_ok and metrics["all_finite"]}


def meets_gpu_targets(metrics: dict) -> dict | None:
    """The fp32-anchored targets (``GPU_TARGETS``), or None without the fp32 arm."""
    f = metrics.get("fp32")
    if not f:
        return None
    d_s, d_l = abs(f["stock"]["ppl_rel_diff"]), abs(f["lily"]["ppl_rel_diff"])
    t_s, t_l = f["stock"]["top1_agreement"], f["lily"]["top1_agreement"]
    ppl_ok = d_l <= GPU_TARGETS["ppl_distance_factor"] * d_s
    top_ok = t_l >= t_s - GPU_TARGETS["top1_slack"]
    return {"ppl": ppl_ok, "top1": top_ok, "all": ppl_ok and top_ok and metrics["all_finite"]}


def render_table(result: dict) -> str:
    """A small markdown table of the metrics."""
    m = result["metrics"]
    t = result["targets"]
    rows = [
        ("positions", f"{m['positions']}"),
        ("perplexity stock", f"{m['ppl_stock']:.4f}"),
        ("perplexity lily", f"{m['ppl_lily']:.4f}"),
        ("relative ppl diff", f"{m['ppl_rel_diff'] * 100:+.5f}% (target |x| <= {t['ppl_rel_diff_max'] * 100:.2f}%)"),
        ("top-1 agreement", f"{m['top1_agreement'] * 100:.2f}% (target >= {t['top1_agreement_min'] * 100:.1f}%)"),
        ("mean KL(stock || lily)", f"{m['kl_stock_lily_mean']:.3e}"),
        ("max |logit diff|", f"{m['max_abs_logit_diff']:.3e} (logit scale {m['logit_scale']:.2f})"),
        ("mean |logit diff|", f"{m['mean_abs_logit_diff']:.3e}"),
        ("top-1 accuracy stock / lily", f"{m['top1_accuracy_stock'] * 100:.2f}% / {m['top1_accuracy_lily'] * 100:.2f}%"),
    ]
    head = (f"numerics ({result['mode']}, {result['backend']} / {result['device']['name']}, "
            f"reference {result['reference']['source']})")
    lines = [head, "", "| metric | value |", "|---|---|"] + [f"| {a} | {b} |" for a, b in rows]
    f = m.get("fp32")
    if f:
        g = GPU_TARGETS
        lines += ["", "| vs fp32 evaluation | stock | lily |", "|---|---|---|",
                  f"| relative ppl diff | {f['stock']['ppl_rel_diff'] * 100:+.4f}% | "
                  f"{f['lily']['ppl_rel_diff'] * 100:+.4f}% (target |x| <= "
                  f"{g['ppl_distance_factor']} x stock's) |",
                  f"| top-1 agreement | {f['stock']['top1_agreement'] * 100:.2f}% | "
                  f"{f['lily']['top1_agreement'] * 100:.2f}% (target >= stock's - "
                  f"{g['top1_slack'] * 100:.0f} points) |"]
    lines.append(f"\nmeets CPU-reference targets: {result['meets_targets']['all']}")
    if result.get("meets_gpu_targets") is not None:
        lines.append(f"meets GPU targets (fp32-anchored): {result['meets_gpu_targets']['all']}")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    """The numerics CLI parser."""
    p = argparse.ArgumentParser(prog="python benchmarks/numerics.py",
                                description="Teacher-forced numerics of mlx-lily vs stock mlx-lm.")
    p.add_argument("model", nargs="?", default=None,
                   help="checkpoint directory (default: the trained test fixture)")
    p.add_argument("--synthetic", metavar="PRESET", default=None)
    p.add_argument("--model-seed", type=int, default=0)
    p.add_argument("--ids", default=None, help="JSON file with reference ids")
    p.add_argument("--text-file", default=None, help="text to tokenise as the reference")
    p.add_argument("--max-tokens", type=int, default=320)
    p.add_argument("--incremental", action="store_true", help="token-by-token through the cache")
    p.add_argument("--ops", default=None, help="comma-separated Lily ops to enable (default all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write the JSON result here")
    p.add_argument("--no-fp32-anchor", action="store_true",
                   help="skip the fp32 evaluation (and the GPU targets anchored on it)")
    p.add_argument("--inject-wrong", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    """CLI entry point; prints the table (stdout) and writes ``--out`` JSON. Exit 0."""
    import os

    a = build_parser().parse_args(argv)
    if a.synthetic is None and a.model is None:
        a.model = str(default_checkpoint())
    ops = [o.strip() for o in a.ops.split(",")] if a.ops else None
    target = load_target(a.model if a.synthetic is None else None, a.synthetic, a.model_seed)
    ids, source = reference_ids(target, ids_file=a.ids, text_file=a.text_file,
                                max_tokens=a.max_tokens, seed=a.seed)
    if len(ids) - 1 < MIN_POSITIONS:
        log(f"warning: only {len(ids) - 1} positions (< {MIN_POSITIONS})")
    env = environment(ops)
    inject = bool(a.inject_wrong or os.environ.get(INJECT_ENV, "") not in ("", "0"))
    metrics = run_numerics(target, ids, incremental=a.incremental, inject_wrong=inject, ops=ops,
                           fp32_anchor=not a.no_fp32_anchor)
    result = {
        "schema": SCHEMA_NAME,
        "schema_version": SCHEMA_VERSION,
        "created": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        **env,
        "checkpoint": target.identity,
        "mode": "incremental" if a.incremental else "teacher_forced",
        "injected_wrong": inject,
        "reference": {"source": source, "n_tokens": len(ids),
                      "ids_sha256": hashlib.sha256(json.dumps(list(ids)).encode()).hexdigest()},
        "metrics": metrics,
        "targets": dict(TARGETS),
        "meets_targets": meets_targets(metrics),
        "gpu_targets": dict(GPU_TARGETS),
        "meets_gpu_targets": meets_gpu_targets(metrics),
    }
    print(render_table(result))
    text = json.dumps(json_clean(result), indent=1, allow_nan=False) + "\n"
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text)
        log(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
