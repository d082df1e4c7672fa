"""The A/B gate's numerics authority on GPU machines: a trained checkpoint, teacher-forced.

Random-weight checkpoints give near-flat distributions and near-tied expert routing, so
any rounding change moves their logits far, and the gate on them needs the fp32 anchor
(``ab.correctness_gate``). On a GPU machine that holds the production-width trained model
(``benchmarks/train_production_width.py``, cached per machine under
``<cache_dir>/models/qwen35moe-production-width``), the gate instead compares Lily with
stock on that model's held-out reference ids with fixed thresholds (:data:`THRESHOLDS`,
the targets of the production-width numerics: perplexity within 0.1 %, top-1 agreement
>= 98 %).

The teacher-forced feed (:func:`teacher_forced_logits`; ``benchmarks/numerics_long.py``'s
engines run it too, with routing capture as its ``one`` hook): the
context prefilled in chunks, one measured prefill chunk, then one-token decode steps,
every measured row predicting the next reference id; :func:`compare_logits` gives the
metrics of both (``numerics_long`` uses it too).
"""
from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path
from typing import Callable

CHECKPOINT_NAME = "qwen35moe-production-width"
REFERENCE_FILE = "numerics_reference.json"
#: Fixed thresholds of the authority check (Lily vs stock over the measured rows).
THRESHOLDS = {"ppl_rel_diff_max": 1e-3, "top1_agreement_min": 0.98}
GPU_BACKENDS = ("cuda", "metal")
#: What ``auto`` accepts as the cached model (``benchmarks/train_production_width.py``'s
#: ``summary.json``), and the fewest reference ids any authority must hold.
TRAINER_SCHEMA = "mlx-lily-train-production-width"
TRAINER_PRESET = "production-width"
MIN_REFERENCE_IDS = 64


def current_backend() -> str:
    """``mlx_lily.backend.current_backend()``."""
    from ..backend import current_backend as _cb

    return _cb()


def default_checkpoint() -> Path:
    """``<cache_dir>/models/qwen35moe-production-width`` (``MLX_LILY_CACHE_DIR`` or
    ``~/.cache/mlx-lily``), where the production-width trainer caches its model."""
    from .. import config

    return Path(config.cache_dir) / "models" / CHECKPOINT_NAME


def resolve(spec: str, backend: str, log: Callable | None = None) -> Path | None:
    """The authority checkpoint for ``--gate-authority spec`` on ``backend``.

    ``"none"``: none. ``"auto"``: :func:`default_checkpoint` when ``backend`` is a GPU
    backend, that folder holds ``numerics_reference.json`` and it passes
    :func:`problems` as the production-width trainer's model; else none (``log`` says
    why a cached folder was passed over). Any other value is a checkpoint folder, which
    must pass :func:`problems`.

    Raises:
        ValueError: a named folder with a problem (the message names the file).
    """
    if spec == "none":
        return None
    if spec == "auto":
        p = default_checkpoint()
        if backend not in GPU_BACKENDS or not (p / REFERENCE_FILE).is_file():
            return None
        bad = problems(p, trainer=True)
        if bad:
            if log is not None:
                log(f"gate authority: {p} passed over ({'; '.join(bad)}); the gate keeps its "
                    f"own checks")
            return None
        return p
    p = Path(spec).expanduser()
    bad = problems(p)
    if bad:
        raise ValueError(f"--gate-authority {spec}: {'; '.join(bad)}")
    return p


def problems(path: Path, trainer: bool = False) -> list[str]:
    """What keeps the folder ``path`` from serving as an authority (empty: nothing):
    ``numerics_reference.json`` with at least ``MIN_REFERENCE_IDS`` ids inside the
    vocabulary of ``config.json``; with ``trainer``, also the production-width
    trainer's ``summary.json`` (``TRAINER_SCHEMA``, preset ``TRAINER_PRESET``)."""
    path = Path(path)
    ref, cfg = path / REFERENCE_FILE, path / "config.json"
    if not ref.is_file():
        return [f"{ref} not found (train the model with benchmarks/train_production_width.py)"]
    if not cfg.is_file():
        return [f"{cfg} not found"]
    try:
        ids = reference_ids(path)
        c = json.loads(cfg.read_text())
    except (ValueError, OSError) as e:
        return [str(e)]
    out = []
    if len(ids) < MIN_REFERENCE_IDS:
        out.append(f"{ref}: {len(ids)} ids (at least {MIN_REFERENCE_IDS})")
    vocab = c.get("text_config", c).get("vocab_size") or c.get("vocab_size")
    if vocab and ids and not 0 <= min(ids) <= max(ids) < int(vocab):
        out.append(f"{ref}: ids outside the vocabulary of {cfg} ({vocab})")
    if trainer:
        summary = path / "summary.json"
        try:
            sm = json.loads(summary.read_text())
        except (ValueError, OSError):
            sm = None
        if not isinstance(sm, dict) or sm.get("schema") != TRAINER_SCHEMA:
            out.append(f"{summary}: not the production-width trainer's summary")
        elif sm.get("preset") != TRAINER_PRESET:
            out.append(f"{summary}: preset {sm.get('preset')!r}, not {TRAINER_PRESET!r}")
    return out


def trainer_summary(path: Path) -> dict | None:
    """The recipe fields of ``path / summary.json`` (steps, early stop, recipe key), or
    None without one."""
    try:
        sm = json.loads((Path(path) / "summary.json").read_text())
    except (ValueError, OSError):
        return None
    keys = ("preset", "seed", "steps_schedule", "steps_done", "stopped_early", "recipe_key")
    return {k: sm.get(k) for k in keys} if isinstance(sm, dict) else None


def reference_ids(path: Path) -> list[int]:
    """The token ids of ``path / numerics_reference.json`` (its ``"ids"`` list).

    Raises:
        ValueError: the file has no ``ids`` list of integers.
    """
    f = Path(path) / REFERENCE_FILE
    data = json.loads(f.read_text())
    ids = data.get("ids") if isinstance(data, dict) else None
    if not isinstance(ids, list) or not ids:
        raise ValueError(f"{f}: no 'ids' list")
    return [int(i) for i in ids]


def teacher_forced_logits(model, ids, context: int, measure_prefill: int, decode_steps: int,
                          prefill_step: int = 2048, one: Callable | None = None):
    """Logits of the measured rows of a teacher-forced feed, as float32 numpy ``[P + D, V]``.

    ``ids[:context - P]`` is prefilled in chunks of ``prefill_step`` through a fresh
    ``make_prompt_cache(model)`` (logits dropped), then ``ids[context - P:context]`` in one
    forward (``P = measure_prefill`` rows), then ``D = decode_steps`` one-token forwards on
    ``ids[context:context + D]``. Row ``t`` predicts ``ids[context - P + 1 + t]``
    (:func:`targets`). ``one(tokens [1, T], cache) -> logits`` replaces the plain forward
    (a capture hook). Also returns seconds per phase.

    Raises:
        ValueError: ``ids`` shorter than ``context + decode_steps + 1`` or ``P`` outside
        ``1..context``.
    """
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    L, P, D = int(context), int(measure_prefill), int(decode_steps)
    if len(ids) < L + D + 1:
        raise ValueError(f"teacher-forced feed: {len(ids)} ids; context {L} + {D} decode steps "
                         f"need {L + D + 1}")
    if not 1 <= P <= L:
        raise ValueError(f"teacher-forced feed: measured prefill {P} outside 1..{L}")
    forward = one or (lambda xs, cache: model(xs, cache=cache))
    cache = make_prompt_cache(model)
    x = mx.array(np.asarray(ids[:L + D], dtype=np.int32))
    t0 = time.perf_counter()
    for s in range(0, L - P, prefill_step):
        model(x[s:min(L - P, s + prefill_step)][None], cache=cache)
        mx.eval([c.state for c in cache])
        mx.clear_cache()
    t1 = time.perf_counter()
    rows = []

    def run(xs):
        o = forward(xs[None], cache)[0].astype(mx.float32)
        mx.eval(o)
        return np.array(o)

    rows.append(run(x[L - P:L]))
    t2 = time.perf_counter()
    for j in range(D):
        rows.append(run(x[L + j:L + j + 1]))
    t3 = time.perf_counter()
    return np.concatenate(rows, axis=0), {
        "context_prefill_s": t1 - t0, "measured_prefill_s": t2 - t1, "decode_s": t3 - t2,
        "decode_ms_per_step": 1e3 * (t3 - t2) / max(1, D)}


def targets(ids, context: int, measure_prefill: int, decode_steps: int) -> list[int]:
    """The reference id each measured row of :func:`teacher_forced_logits` predicts."""
    L, P, D = int(context), int(measure_prefill), int(decode_steps)
    return list(ids[L - P + 1:L + 1]) + list(ids[L + 1:L + D + 1])


def log_softmax(x):
    """Row-wise log-softmax of a numpy array, in float64."""
    import numpy as np

    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def routing_agreement(ref, test) -> float:
    """Fraction of ``test``'s (row, expert) choices that ``ref`` also made (``[rows, k]``)."""
    hit = (test[:, :, None] == ref[:, None, :]).any(-1)
    return float(hit.mean())


def compare_logits(ref_logits, test_logits, target_ids, ref_routing=None, test_routing=None) -> dict:
    """Metrics of ``test`` against ``ref`` (``[rows, V]`` numpy; row t predicts
    ``target_ids[t]``): perplexity of each and their relative difference, top-1 agreement,
    mean / max KL(ref || test), logit differences, top-1 accuracy of each, and, with routing
    (per layer ``[rows, k]`` expert ids), the routing agreement per layer and its minimum."""
    import numpy as np

    tgt = np.asarray(target_ids, dtype=np.int64)
    n = len(tgt)
    lr, lt = log_softmax(ref_logits), log_softmax(test_logits)
    nll_r, nll_t = -lr[np.arange(n), tgt], -lt[np.arange(n), tgt]
    kl = (np.exp(lr) * (lr - lt)).sum(axis=-1)
    top_r, top_t = ref_logits.argmax(-1), test_logits.argmax(-1)
    d = np.abs(ref_logits.astype(np.float64) - test_logits.astype(np.float64))
    m = {
        "positions": int(n),
        "ppl_ref": math.exp(nll_r.mean()), "ppl_test": math.exp(nll_t.mean()),
        "ppl_rel_diff": math.exp(nll_t.mean() - nll_r.mean()) - 1.0,
        "top1_agreement": float((top_r == top_t).mean()),
        "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
        "max_abs_logit_diff": float(d.max()), "mean_abs_logit_diff": float(d.mean()),
        "top1_accuracy_ref": float((top_r == tgt).mean()),
        "top1_accuracy_test": float((top_t == tgt).mean()),
        "all_finite": bool(np.isfinite(ref_logits).all() and np.isfinite(test_logits).all()),
    }
    if ref_routing is not None and test_routing is not None:
        per = [routing_agreement(a, b) for a, b in zip(ref_routing, test_routing)]
        m["routing_agreement_per_layer"] = per
        m["routing_agreement_min"] = min(per)
    return m


def authority_gate(path: Path, lily_context: Callable, *, wrap: Callable | None = None,
                   context: int = 2048, measure_prefill: int = 512, decode_steps: int = 16,
                   prefill_step: int = 2048, log: Callable = print) -> dict:
    """Lily against stock on the trained checkpoint at ``path``, teacher-forced.

    ``lily_context(model)`` is the context manager of the Lily arm (``ab.arm_context``);
    ``wrap(model)`` wraps the model inside it (the gate's injected-wrong hook). A reference
    shorter than the feed shrinks it: decode steps to at most an eighth of the ids, the
    context to ``len(ids) - decode_steps - 1``, the measured prefill to at most half of it
    (``feed`` records what ran). Passes when every logit is finite and the metrics meet
    :data:`THRESHOLDS`. Returns ``{"checkpoint", "passed", "checks", "metrics",
    "thresholds", "feed", "times", "summary"}``; a checkpoint that cannot be loaded or
    evaluated gives ``passed`` False with ``"error"`` (no exception).
    """
    import mlx_lm

    try:
        ids = reference_ids(path)
        n = len(ids)
        decode_steps = max(1, min(decode_steps, n // 8))
        context = max(2, min(context, n - decode_steps - 1))
        measure_prefill = max(1, min(measure_prefill, context // 2))
        feed = {"context": context, "measure_prefill": measure_prefill,
                "decode_steps": decode_steps, "prefill_step": prefill_step}
        t0 = time.perf_counter()
        model, _ = mlx_lm.load(str(path))
        log(f"gate authority: loaded {path} in {time.perf_counter() - t0:.1f}s")
        times = {}
        stock, times["stock"] = teacher_forced_logits(model, ids, context, measure_prefill,
                                                      decode_steps, prefill_step)
        with lily_context(model) as m:
            m = wrap(m) if wrap else m
            lily, times["lily"] = teacher_forced_logits(m, ids, context, measure_prefill,
                                                        decode_steps, prefill_step)
        metrics = compare_logits(stock, lily,
                                 targets(ids, context, measure_prefill, decode_steps))
    except Exception as e:  # noqa: BLE001  (a broken authority fails the gate, with the reason)
        log(f"gate authority: {path} could not be evaluated: {e!r}")
        return {"checkpoint": str(path), "passed": False, "error": repr(e), "checks": {},
                "metrics": None, "thresholds": dict(THRESHOLDS), "feed": None, "times": None,
                "summary": trainer_summary(path)}
    checks = {
        "ppl": abs(metrics["ppl_rel_diff"]) <= THRESHOLDS["ppl_rel_diff_max"],
        "top1": metrics["top1_agreement"] >= THRESHOLDS["top1_agreement_min"],
        "finite": metrics["all_finite"],
    }
    del model
    with contextlib.suppress(Exception):
        import mlx.core as mx

        mx.clear_cache()
    return {"checkpoint": str(path), "passed": all(checks.values()), "checks": checks,
            "metrics": metrics, "thresholds": dict(THRESHOLDS), "feed": feed, "times": times,
            "summary": trainer_summary(path)}
