"""A/B throughput harness: stock mlx-lm vs mlx-lily on ONE loaded checkpoint.

Method (see ``benchmarks/README`` in the result's markdown header too):

* One checkpoint is loaded once (a directory via ``mlx_lm.load`` or an in-memory
  ``--synthetic PRESET`` via :func:`mlx_lily.synth.build_model`).  "stock" runs it with
  no patch; "lily" runs the very same model object inside ``mlx_lily.patched(model)``.
* A correctness gate runs first (greedy tokens + a logits check, Lily vs stock).  If it
  fails, no speed is reported: the JSON carries ``gate.passed = false`` and no rows,
  and the exit code is 2.
* ``--rounds`` per row (default 2); odd rounds run stock then Lily, even rounds Lily then
  stock (drift and background load cancel; rows whose rounds spread by more than 3% of
  their median are flagged). Each arm's figure is the median over its rounds, so with
  three or more rounds one round's one-time cost (a first prompt of a new length: MLX's
  and Lily's kernels compiled, a compiled step traced) does not move it; the drift flag
  still shows such a round (the spread counts every round).
* Timing boundaries are those of mlx-lm's ``generate_step``: prefill tok/s = prompt
  tokens / time to the first yielded token; decode tok/s = intervals over their total
  time between consecutive yielded tokens (``--decode-steps`` intervals): the mean rate,
  as mlx-lm's own commands report generation speed; the median interval's rate is kept
  as ``tok_s_median``.
* Decode rows: the context (prompt of the row's length) is prefilled ONCE with Lily
  (``context_built_by``), and each arm/round decodes from its own deep copy of those
  mlx-lm cache objects (every state array copied with ``mx.array``).
* ``--budget-s``: before running a row, each arm's time is predicted from its previous
  measured length (linear in length); rows whose prediction exceeds the budget are
  reported as ``not_run`` (never extrapolated).
* MLX's buffer cache is cleared between measurements; ``mx.get_peak_memory()`` is
  recorded per measurement (reset just before it).

Outputs: ``ab.json`` (schema ``mlx-lily-ab`` v1, checked by :func:`validate_result`),
``ab.md`` (markdown table) and ``ab.png`` (both sweeps, tok/s vs length on log-x, both
arms, lily/stock ratio on a second y-axis) under
``benchmarks/results/<date>-<backend>-<device>/`` or ``--out DIR``.

JSON schema ``mlx-lily-ab`` version 1 (every key always present; ``None`` where unknown)::

    schema, schema_version, created (ISO time), command (argv)
    backend                 "metal" | "cuda" | "cpu" (as mlx_lily.backend_info() reports it)
    device                  {name, default_device, info (mx.device_info())}
    versions                {python, mlx, mlx_lm, mlx_lily}
    platform                {system, machine, cpu_count}
    git                     {commit, dirty}
    checkpoint              {kind "path"|"synthetic", path, preset, seed, model_type,
                             config_sha256 (canonical JSON of config.json / the preset config),
                             tensors_sha256 (sorted name|shape|dtype of every parameter), n_tensors}
    lily_backend_info       mlx_lily.backend_info() while patched: {backend, ops: {op: mode}, ...}
    mlx_env, cuda_launch_mode   MLX's launch settings for the process (both arms)
    settings                {lengths, sweeps, rounds (--rounds, default 2), order (per round:
                             [stock, lily] in odd rounds, [lily, stock] in even ones),
                             decode_steps, decode_timeline, prefill_timeline, prefill_step_size,
                             budget_s, warmup, seed, drift_flag, ops}
    gate                    {passed, checks {logits_rel_max_diff, top1_agreement, greedy_prefix},
                             injected_wrong, logits_positions, max_abs_logit_diff, mean_abs_logit_diff,
                             logit_scale, rel_max_logit_diff, top1_agreement, greedy_tokens,
                             greedy_prefix_match, greedy_stock, greedy_lily, thresholds}
    rows[]                  {sweep "prefill"|"decode", length, status "ok"|"not_run"|"error", reason,
                             context_built_by ("lily" for decode rows), context_build_s,
                             arms: {stock|lily: {rounds[], tok_s (median over rounds),
                                    [tok_s_median, tok_s_mean (decode)], peak_memory_bytes}},
                             ratio (lily tok_s / stock tok_s), drift {stock, lily}
                             ((max - min) / median over the rounds; for two |r1 - r2| / mean),
                             flags [e.g. "drift>3%:stock"]}
    rows[].arms[a].rounds[] {round (0-based), position (0 = ran first in its round), seconds, tok_s,
                             peak_memory_bytes; decode adds tok_s_median, tok_s_mean,
                             interval_s_median/min/max, n_intervals, and with
                             --decode-timeline on CUDA timeline_ms (mlx_lily.bench.timeline
                             medians: interval, build, dispatch, wait, gpu_busy, ...); Lily's
                             prefill rounds with --prefill-timeline on CUDA: timeline
                             (timeline.prefill_run: per-chunk host phases, GPU busy)}
    summary                 {prefill|decode: {rows_run, rows_not_run, mean_ratio, geomean_ratio,
                             flagged_rows}}
    outputs                 {json, markdown, png (None when not drawn)}

A failed gate has ``rows == []`` (and ``summary == {}``).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime as _dt
import gc
import hashlib
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SCHEMA_NAME = "mlx-lily-ab"
SCHEMA_VERSION = 1
ARMS = ("stock", "lily")
SWEEPS = ("prefill", "decode")
DEFAULT_LENGTHS = [256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]
DRIFT_FLAG = 0.03
INJECT_ENV = "MLX_LILY_AB_INJECT_WRONG"
QWEN_FIRST_ADDED_ID = 248044  # Qwen3.5/3.6: ids >= this are added/special or padding
GATE_TEXT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"

_T0 = time.perf_counter()


def log(msg: str) -> None:
    """Progress line on stderr, prefixed with the running tool's name."""
    tool = os.path.splitext(os.path.basename(sys.argv[0] or "ab"))[0] or "ab"
    tool = tool if tool.startswith("mlx_lily") else f"mlx_lily.{tool}"
    print(f"[{tool} {time.perf_counter() - _T0:8.1f}s] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------
# loading and identity
# ----------------------------------------------------------------------------
class Target:
    """A loaded checkpoint: ``model``, ``tokenizer`` (or None), ``config`` and ``identity``."""

    def __init__(self, model, tokenizer, config: dict, identity: dict):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.identity = identity


def _sha256_json(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def tensor_signature_hash(model) -> tuple[str, int]:
    """sha256 over the sorted ``name|shape|dtype`` of every parameter; and their count."""
    from mlx.utils import tree_flatten

    items = sorted((k, tuple(v.shape), str(v.dtype)) for k, v in tree_flatten(model.parameters()))
    h = hashlib.sha256()
    for k, s, d in items:
        h.update(f"{k}|{s}|{d}\n".encode())
    return h.hexdigest(), len(items)


def _looks_local(path: str) -> bool:
    """Whether ``path`` can only be a local path, not a hub repo id ``owner/name``."""
    return (path.startswith(("/", "./", "../", "~", ".\\")) or path in (".", "..")
            or path.count("/") > 1)


def load_target(path: str | None = None, synthetic: str | dict | None = None,
                model_seed: int = 0) -> Target:
    """Load a checkpoint directory (``mlx_lm.load``) or build ``--synthetic`` in memory
    (a preset name of :data:`mlx_lily.synth.PRESETS` or a text_config dict).

    Must run while mlx-lily is NOT patched (the model is loaded as stock mlx-lm loads it;
    the Lily arm prepares it on entry to ``mlx_lily.patched``).

    Raises:
        FileNotFoundError: ``path`` is written as a local path (absolute, ``./``, ``../``,
            ``~``, or more than ``owner/name``) and does not exist (mlx-lm would otherwise
            look it up on the Hugging Face hub and fail with a network error).
    """
    import mlx_lily

    if mlx_lily.is_patched():
        raise RuntimeError("mlx-lily is already patched; the A/B harness needs stock mlx-lm to start")
    if (path is None) == (synthetic is None):
        raise ValueError("give exactly one of a checkpoint path or --synthetic PRESET")
    if synthetic is not None:
        from mlx_lily import synth

        model, config = synth.build_model(synthetic, seed=model_seed)
        tokenizer = None
        ident: dict[str, Any] = {"kind": "synthetic", "path": None, "preset": synthetic,
                                 "seed": model_seed, "random_weights": True}
    else:
        import mlx_lm
        from mlx_lm.utils import load_config

        p = Path(path).expanduser()
        if not p.exists() and _looks_local(str(path)):
            raise FileNotFoundError(f"checkpoint folder {str(path)!r} does not exist "
                                    f"(resolved: {p.resolve()})")
        model, tokenizer = mlx_lm.load(str(p))
        config = load_config(p) if p.is_dir() else {}
        from mlx_lily import synth

        ident = {"kind": "path", "path": str(p.resolve()) if p.exists() else str(path),
                 "preset": None, "seed": None,
                 "random_weights": bool(p.is_dir() and synth.is_synthetic(p))}
    th, n = tensor_signature_hash(model)
    ident.update({
        "model_type": config.get("model_type"),
        "config_sha256": _sha256_json(config),
        "tensors_sha256": th,
        "n_tensors": n,
    })
    return Target(model, tokenizer, config, ident)


@contextlib.contextmanager
def arm_context(arm: str, model, ops=None):
    """``stock``: assert no patch is active; ``lily``: ``mlx_lily.patched(model, ops=ops)``."""
    import mlx_lily

    if arm == "stock":
        if mlx_lily.is_patched():
            raise RuntimeError("stock arm requested while mlx-lily is patched")
        yield model
    elif arm == "lily":
        with mlx_lily.patched(model, ops=ops):
            yield model
    else:
        raise ValueError(f"unknown arm {arm!r}")


class _WrongLogits:
    """Test hook: wraps a model and reverses its vocabulary axis (a deliberately wrong Lily)."""

    def __init__(self, model):
        self._model = model

    def __call__(self, *args, **kwargs):
        out = self._model(*args, **kwargs)
        return out[..., ::-1]

    def __getattr__(self, name):
        return getattr(self._model, name)


# ----------------------------------------------------------------------------
# prompts
# ----------------------------------------------------------------------------
def vocab_bounds(config: dict, tokenizer=None) -> tuple[int, list[int]]:
    """(upper bound of usable ids, ids to exclude) for synthetic prompts.

    With a tokenizer: ids below ``len(tokenizer)`` minus every special / added id.  Without
    one: ``vocab_size`` (capped at Qwen's first added id 248044 for Qwen-sized vocabs).
    """
    tc = config.get("text_config", config)
    vocab = int(tc.get("vocab_size", 0) or 0)
    exclude: set[int] = set()
    if tokenizer is not None:
        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        try:
            hi = len(hf)
        except TypeError:
            hi = vocab
        hi = min(hi, vocab) if vocab else hi
        exclude.update(int(i) for i in (getattr(hf, "all_special_ids", None) or []))
        added = getattr(hf, "added_tokens_decoder", None) or {}
        exclude.update(int(i) for i in added)
    else:
        hi = vocab
        if hi > QWEN_FIRST_ADDED_ID:
            hi = QWEN_FIRST_ADDED_ID
    return hi, sorted(i for i in exclude if i < hi)


def synthetic_ids(n: int, hi: int, exclude: list[int], seed: int = 0):
    """``n`` deterministic pseudo-random token ids in ``[0, hi)`` avoiding ``exclude``."""
    import numpy as np

    allowed = np.setdiff1d(np.arange(hi, dtype=np.int64), np.asarray(exclude, dtype=np.int64))
    rng = np.random.default_rng(seed)
    return allowed[rng.integers(0, allowed.size, size=n)].astype(np.int32)


def parse_lengths(text: str) -> list[int]:
    """``"256,1K,2k,128K"`` -> ``[256, 1024, 2048, 131072]`` (K = 1024)."""
    out = []
    for tok in text.split(","):
        tok = tok.strip()
        if not tok:
            continue
        m = re.fullmatch(r"(\d+)\s*([kK]?)", tok)
        if not m:
            raise ValueError(f"bad length {tok!r}")
        v = int(m.group(1)) * (1024 if m.group(2) else 1)
        if v < 2:
            raise ValueError("lengths must be >= 2")
        out.append(v)
    return sorted(set(out))


def fmt_len(n: int) -> str:
    """1024 -> '1K', 1536 -> '1536'."""
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


# ----------------------------------------------------------------------------
# measurement primitives (generate_step's own boundaries)
# ----------------------------------------------------------------------------
def ids_array(ids):
    """1-D int32 ``mx.array`` from a list / numpy array of token ids."""
    import mlx.core as mx
    import numpy as np

    return mx.array(np.asarray(ids, dtype=np.int32))


def _sync():
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    mx.synchronize(generation_stream)
    mx.synchronize()


def _fresh_memory():
    import mlx.core as mx

    gc.collect()
    _sync()
    mx.clear_cache()
    mx.reset_peak_memory()


def _fmt_steps(settings: dict) -> str:
    by_arm = settings.get("prefill_step_by_arm") or {}
    if settings.get("prefill_step_size") is not None or len(set(by_arm.values())) <= 1:
        return str(settings.get("prefill_step_size") or next(iter(by_arm.values()), "default"))
    return ", ".join(f"{a} {v}" for a, v in by_arm.items())


def effective_prefill_step(model, requested: int | None = None) -> int:
    """The prefill chunk ``generate_step`` uses for ``model`` now: ``requested`` when given,
    else mlx-lm's default, which while Lily is patched is Lily's per-backend choice for the
    models it serves (``mlx_lily.patching.prefill_step_size``)."""
    import importlib

    from mlx_lily.patching import prefill_step_size

    if requested is not None:
        return int(requested)
    default = importlib.import_module("mlx_lm.generate").DEFAULT_PREFILL_STEP_SIZE
    return int(prefill_step_size(model, default))  # the default itself when not patched


def measure_prefill(model, ids, prefill_step_size: int) -> dict:
    """Prompt tokens / time to the first token yielded by ``mlx_lm.generate.generate_step``."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    prompt = ids_array(ids)
    _fresh_memory()
    gen = generate_step(prompt, model, max_tokens=1, prefill_step_size=prefill_step_size)
    t0 = time.perf_counter()
    tok, _ = next(gen)
    dt = time.perf_counter() - t0
    gen.close()
    _sync()
    peak = mx.get_peak_memory()
    del gen
    return {"seconds": dt, "tok_s": len(ids) / dt, "peak_memory_bytes": int(peak), "first_token": int(tok),
            "prefill_step_size": int(prefill_step_size)}


def build_context(model, ids, prefill_step_size: int) -> list:
    """Prefill ``ids`` into a fresh ``make_prompt_cache`` cache, chunked as generate_step does."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    with mx.stream(generation_stream):
        for i in range(0, len(ids), prefill_step_size):
            chunk = ids_array(ids[i:i + prefill_step_size])
            model(chunk[None], cache=cache)
            mx.eval([c.state for c in cache])
            mx.clear_cache()
    _sync()
    return cache


def _copy_tree(v):
    import mlx.core as mx

    if isinstance(v, mx.array):
        return mx.array(v)  # a real copy (own buffer), not a view
    if isinstance(v, list):
        return [_copy_tree(x) for x in v]
    if isinstance(v, tuple):
        return tuple(_copy_tree(x) for x in v)
    if isinstance(v, dict):
        return {k: _copy_tree(x) for k, x in v.items()}
    return copy.copy(v)


def copy_cache(cache: list) -> list:
    """Deep copy of a list of mlx-lm cache objects (same classes, every state array copied)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    out = []
    for c in cache:
        n = copy.copy(c)
        for k, v in vars(c).items():
            setattr(n, k, _copy_tree(v))
        out.append(n)
    arrays = [v for n in out for _, v in tree_flatten(vars(n)) if isinstance(v, mx.array)]
    mx.eval(arrays)
    return out


def measure_decode(model, cache: list, first_token: int, steps: int) -> dict:
    """Decode ``steps + 1`` tokens with ``generate_step`` from ``cache``; time the ``steps``
    intervals between consecutive yielded tokens. ``tok_s`` is the mean rate (intervals
    over their summed time, as ``mlx_lm.benchmark`` reports generation); ``tok_s_median``
    is 1 / the median interval."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    _fresh_memory()
    gen = generate_step(ids_array([first_token]), model,
                        max_tokens=steps + 1, prompt_cache=cache)
    stamps = []
    tokens = []
    for tok, _ in gen:
        stamps.append(time.perf_counter())
        tokens.append(int(tok))
    _sync()
    peak = mx.get_peak_memory()
    iv = [b - a for a, b in zip(stamps, stamps[1:])]
    med = statistics.median(iv)
    return {
        "seconds": sum(iv),
        "tok_s": len(iv) / sum(iv),
        "tok_s_median": 1.0 / med,
        "tok_s_mean": len(iv) / sum(iv),
        "interval_s_median": med,
        "interval_s_min": min(iv),
        "interval_s_max": max(iv),
        "n_intervals": len(iv),
        "peak_memory_bytes": int(peak),
        "tokens": tokens,
    }


def _prefill_timeline(model, ids, prefill_step_size: int) -> dict | None:
    """``mlx_lily.bench.timeline.prefill_run`` of ``ids`` (per-chunk host phases and GPU
    busy time, ms), or None off CUDA."""
    from mlx_lily.bench import gpu_clock
    from mlx_lily.bench.timeline import prefill_run

    if not gpu_clock.available():
        return None
    r = prefill_run(model, list(ids), prefill_step_size)
    _sync()
    return r


def _decode_timeline(model, ctx: list, first_token: int) -> dict | None:
    """Median host phases and GPU busy time per decode step (ms) from a copy of ``ctx``
    (``mlx_lily.bench.timeline.run_loop``, 24 steps after 3), or None off CUDA. Puts the
    A/B's own decode figures next to the host's work in the same process."""
    from mlx_lily.bench import gpu_clock
    from mlx_lily.bench.timeline import run_loop

    if not gpu_clock.available():
        return None
    r = run_loop(model, copy_cache(ctx), first_token, 24, 3)
    return dict(r["median_ms"], clock_align_err_ms=r["clock_align_err_ns"] / 1e6)


def warmup(model, ids, steps: int = 4, prefill_step_size: int = 2048) -> None:
    """An untimed short generation (prefill + a few decode steps)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    for _ in generate_step(ids_array(ids), model, max_tokens=steps,
                           prefill_step_size=prefill_step_size):
        pass
    _sync()


# ----------------------------------------------------------------------------
# correctness gate
# ----------------------------------------------------------------------------
def _logits_np(model, ids):
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    out = model(ids_array(ids)[None], cache=cache)[0].astype(mx.float32)
    mx.eval(out)
    return np.array(out)


def _greedy(model, ids, n: int) -> list[int]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    toks = [int(t) for t, _ in generate_step(ids_array(ids), model, max_tokens=n)]
    _sync()
    return toks


def fp32_logits(model, ids):
    """Stock logits with every floating parameter in fp32 (quantized weights unchanged):
    the yardstick for bf16 rounding. The model's own arrays are restored by identity."""
    from mlx.utils import tree_flatten, tree_unflatten
    import mlx.core as mx

    saved = tree_flatten(model.parameters())
    try:
        model.set_dtype(mx.float32)
        return _logits_np(model, ids)
    finally:
        model.update(tree_unflatten(saved))


def _distance(ref, x):
    import numpy as np

    scale = float(np.abs(ref).max()) or 1.0
    return float(np.abs(x - ref).max()) / scale, float((ref.argmax(-1) == x.argmax(-1)).mean())


def correctness_gate(target: Target, logits_ids, greedy_ids, *, greedy_tokens: int = 16,
                     rel_tol: float = 0.1, top1_min: float = 0.9, greedy_min_prefix: int = 8,
                     inject_wrong: bool = False, ops=None, anchor: str = "fp32",
                     anchor_factor: float = 1.5, anchor_slack: float = 0.05,
                     anchor_top1_slack: float = 0.1, authority=None) -> dict:
    """Compare Lily with stock before any timing.

    Checks: (1) logits of one forward over ``logits_ids``: max |lily - stock| divided by
    max |stock| (the logit scale) must be <= ``rel_tol`` and the top-1 tokens must agree
    at >= ``top1_min`` of the positions; (2) ``greedy_tokens`` greedy tokens from
    ``greedy_ids`` through ``generate_step``: the two arms must agree on at least the
    first ``min(greedy_min_prefix, greedy_tokens)`` tokens.  ``inject_wrong`` perturbs
    Lily's logits (vocabulary axis reversed) so tests can prove the gate refuses.

    With ``anchor="fp32"`` a gate that fails those fixed thresholds still passes when Lily
    is no further from an fp32 evaluation of the same weights (``fp32_logits``) than
    stock's bf16 path is: relative distance <= ``anchor_factor`` x stock's +
    ``anchor_slack`` and top-1 agreement with fp32 >= stock's - ``anchor_top1_slack``.
    Random-weight models with near-tied expert routing move logits far under any
    rounding change (stock bf16 itself sits 0.35 of the logit scale from fp32 on the tiny
    test model), so fixed thresholds alone reject correct kernels there.

    With ``authority`` (a trained checkpoint folder, :mod:`mlx_lily.bench.authority`) that
    model's teacher-forced check with fixed thresholds must pass too. For a random-weight
    ``target`` (in-memory synthetic, or a folder ``mlx_lily.synth`` wrote) it replaces the
    checks above and the fp32 anchor, which are still measured and reported (Lily's logits
    must be finite); for any other target both must pass.
    """
    import numpy as np

    model = target.model
    res: dict[str, Any] = {}
    for arm in ARMS:
        with arm_context(arm, model, ops):
            m = _WrongLogits(model) if (inject_wrong and arm == "lily") else model
            t0 = time.perf_counter()
            res[arm] = {"logits": _logits_np(m, logits_ids), "greedy": _greedy(m, greedy_ids, greedy_tokens)}
            log(f"gate: {arm} logits + {greedy_tokens} greedy tokens in "
                f"{time.perf_counter() - t0:.1f}s")
    s, l = res["stock"]["logits"], res["lily"]["logits"]
    diff = np.abs(s - l)
    scale = float(np.abs(s).max()) or 1.0
    max_abs = float(diff.max())
    rel = max_abs / scale
    top1 = float((s.argmax(-1) == l.argmax(-1)).mean())
    gs, gl = res["stock"]["greedy"], res["lily"]["greedy"]
    prefix = 0
    for a, b in zip(gs, gl):
        if a != b:
            break
        prefix += 1
    need_prefix = min(greedy_min_prefix, greedy_tokens)
    checks = {
        "logits_rel_max_diff": rel <= rel_tol,
        "top1_agreement": top1 >= top1_min,
        "greedy_prefix": prefix >= need_prefix,
    }
    finite = bool(np.isfinite(l).all())
    ok = all(checks.values()) and finite
    anchored = authority_result = None
    random_target = bool(target.identity.get("random_weights"))
    if authority is not None and finite:
        from . import authority as _authority

        authority_result = _authority.authority_gate(
            Path(authority), lambda mm: arm_context("lily", mm, ops),
            wrap=_WrongLogits if inject_wrong else None, log=log)
    if authority is not None and random_target:
        ok = finite and authority_result is not None and authority_result["passed"]
    elif anchor == "fp32" and not ok and finite:
        t0 = time.perf_counter()
        r = fp32_logits(model, logits_ids)
        log(f"gate: fp32 anchor logits in {time.perf_counter() - t0:.1f}s")
        d_s, t_s = _distance(r, s)
        d_l, t_l = _distance(r, l)
        anchored = {
            "stock_rel_to_fp32": d_s, "lily_rel_to_fp32": d_l,
            "stock_top1_vs_fp32": t_s, "lily_top1_vs_fp32": t_l,
            "passed": bool(d_l <= anchor_factor * d_s + anchor_slack
                           and t_l >= t_s - anchor_top1_slack),
        }
        ok = anchored["passed"]
    if authority is not None and not random_target:
        ok = ok and authority_result is not None and authority_result["passed"]
    return {
        "passed": bool(ok),
        "checks": checks,
        "fp32_anchor": anchored,
        "authority": authority_result,
        "injected_wrong": bool(inject_wrong),
        "logits_positions": int(s.shape[0]),
        "max_abs_logit_diff": max_abs,
        "mean_abs_logit_diff": float(diff.mean()),
        "logit_scale": scale,
        "rel_max_logit_diff": rel,
        "top1_agreement": top1,
        "greedy_tokens": greedy_tokens,
        "greedy_prefix_match": prefix,
        "greedy_stock": gs,
        "greedy_lily": gl,
        "thresholds": {"rel_tol": rel_tol, "top1_min": top1_min, "greedy_min_prefix": need_prefix},
    }


# ----------------------------------------------------------------------------
# environment description
# ----------------------------------------------------------------------------
def device_name() -> str:
    """``mx.device_info()['device_name']`` (or the platform's processor name)."""
    import mlx.core as mx

    try:
        info = mx.device_info()
        name = info.get("device_name") or info.get("architecture")
        if name:
            return str(name)
    except Exception:
        pass
    return platform.processor() or platform.machine() or "unknown"


TREE_REV_ENV = "MLX_LILY_TREE_REV"  # "<sha>[+dirty]" where the installed copy has no git


def git_info() -> dict:
    """``{"commit": sha|None, "dirty": bool|None}`` of the checkout holding mlx_lily; where
    that is no git checkout (an installed copy on a GPU machine), ``MLX_LILY_TREE_REV``
    (``<sha>`` or ``<sha>+dirty``, exported by ``benchmarks/gpu/suite.sh`` from the tree's
    ``.lily-rev``) when set."""
    import os

    import mlx_lily

    root = Path(mlx_lily.__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=10)
        commit = sha.stdout.strip() if sha.returncode == 0 else None
        st = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                            capture_output=True, text=True, timeout=20)
        dirty = bool(st.stdout.strip()) if st.returncode == 0 else None
    except Exception:
        commit, dirty = None, None
    rev = os.environ.get(TREE_REV_ENV, "").strip()
    if commit is None and rev:
        sha, _, flag = rev.partition("+")
        return {"commit": sha, "dirty": flag == "dirty", "source": TREE_REV_ENV}
    return {"commit": commit, "dirty": dirty}


def environment(ops=None) -> dict:
    """Backend, device, versions, git, ``mlx_lily.backend_info()`` (taken while patched),
    MLX's launch settings (``MLX_USE_CUDA_GRAPHS`` and the graph limits: they apply to
    both arms of a run, read once per process) and every ``MLX_LILY*`` variable set."""
    import mlx.core as mx
    import mlx_lm
    import mlx_lily
    from mlx_lily.backend import cuda_launch_mode

    with mlx_lily.patched(ops=ops):
        info = mlx_lily.backend_info()
    try:
        dinfo = {k: (v if isinstance(v, (int, float, str, bool)) or v is None else str(v))
                 for k, v in mx.device_info().items()}
    except Exception:
        dinfo = {}
    return {
        "backend": info.get("backend", "cpu"),
        "device": {"name": device_name(), "default_device": str(mx.default_device()), "info": dinfo},
        "versions": {"python": platform.python_version(), "mlx": mx.__version__,
                     "mlx_lm": mlx_lm.__version__, "mlx_lily": mlx_lily.__version__},
        "platform": {"system": platform.system(), "machine": platform.machine(),
                     "cpu_count": os.cpu_count()},
        "git": git_info(),
        "lily_backend_info": info,
        "mlx_env": {k: os.environ.get(k) for k in ("MLX_USE_CUDA_GRAPHS", "MLX_MAX_OPS_PER_BUFFER",
                                                   "MLX_MAX_MB_PER_BUFFER")},
        "lily_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("MLX_LILY")},
        "cuda_launch_mode": cuda_launch_mode(),
    }


# ----------------------------------------------------------------------------
# the sweeps
# ----------------------------------------------------------------------------
def _drift(*vals: float | None) -> float | None:
    """Spread of the rounds' figures over their median (for two: |a-b| / mean)."""
    if len(vals) < 2 or any(v is None for v in vals):
        return None
    med = statistics.median(vals)
    return (max(vals) - min(vals)) / med if med else None


def _finish_row(row: dict) -> dict:
    flags = list(row.get("flags", []))
    per_arm = {}
    for arm in ARMS:
        rounds = row["arms"][arm]["rounds"]
        vals = [r["tok_s"] for r in rounds]
        med = statistics.median(vals) if vals else None
        row["arms"][arm]["tok_s"] = med
        if row["sweep"] == "decode" and rounds:
            row["arms"][arm]["tok_s_median"] = statistics.median([r["tok_s_median"] for r in rounds])
            row["arms"][arm]["tok_s_mean"] = statistics.median([r["tok_s_mean"] for r in rounds])
        row["arms"][arm]["peak_memory_bytes"] = max((r["peak_memory_bytes"] for r in rounds), default=None)
        d = _drift(*vals) if len(vals) >= 2 else None
        row["drift"][arm] = d
        if d is not None and d > DRIFT_FLAG:
            flags.append(f"drift>{DRIFT_FLAG:.0%}:{arm}")
        per_arm[arm] = med
    if per_arm["stock"] and per_arm["lily"]:
        row["ratio"] = per_arm["lily"] / per_arm["stock"]
    row["flags"] = flags
    return row


def round_orders(rounds: int) -> list[tuple]:
    """The arms' order in each of ``rounds`` rounds: stock first in odd rounds (1, 3, ..),
    Lily first in even ones. Raises ValueError below two rounds (no drift estimate)."""
    if int(rounds) < 2:
        raise ValueError(f"--rounds must be at least 2, got {rounds}")
    return [ARMS if r % 2 == 0 else tuple(reversed(ARMS)) for r in range(int(rounds))]


def _new_row(sweep: str, length: int) -> dict:
    return {
        "sweep": sweep, "length": length, "status": "ok", "reason": None,
        "context_built_by": None, "context_build_s": None,
        "arms": {a: {"rounds": [], "tok_s": None, "peak_memory_bytes": None} for a in ARMS},
        "ratio": None, "drift": {a: None for a in ARMS}, "flags": [],
    }


def run_sweeps(target: Target, opts) -> list[dict]:
    """Run the requested sweeps; return the result rows (see the module docstring)."""
    import mlx.core as mx

    model = target.model
    hi, exclude = vocab_bounds(target.config, target.tokenizer)
    lengths = list(opts.lengths)
    ids = synthetic_ids(max(lengths) + 1, hi, exclude, seed=opts.seed)
    rows: list[dict] = []
    budget = opts.budget_s
    last: dict = {}  # (sweep, arm) -> (length, seconds)
    prefill_lily_s: dict[int, float] = {}

    def predict(key, length):
        if key not in last:
            return None
        l0, t0 = last[key]
        return t0 * length / l0

    if opts.warmup > 0:
        wl = min(256, min(lengths))
        for arm in ARMS:
            with arm_context(arm, model, opts.ops):
                for _ in range(opts.warmup):
                    warmup(model, ids[:wl], 4, effective_prefill_step(model, opts.prefill_step_size))
        log(f"warm-up done ({opts.warmup} x {wl}-token prefill + 4 decode steps per arm)")

    orders = round_orders(getattr(opts, "rounds", 2))
    deadline = getattr(opts, "deadline_s", None)
    t_begin = getattr(opts, "t_begin", None)
    if t_begin is None:
        t_begin = time.perf_counter()
    for sweep in opts.sweeps:
        for L in lengths:
            row = _new_row(sweep, L)
            rows.append(row)
            if deadline is not None and time.perf_counter() - t_begin > deadline:
                row["status"] = "not_run"
                row["reason"] = f"deadline: {deadline:g}s after the start passed"
                log(f"{sweep} L={fmt_len(L)}: not run ({row['reason']})")
                continue
            if budget is not None:
                over = []
                for arm in ARMS:
                    p = predict((sweep, arm), L)
                    if p is not None and p > budget:
                        over.append(f"{arm} predicted {p:.1f}s")
                if sweep == "decode":
                    pb = prefill_lily_s.get(L)
                    if pb is None:
                        pb = predict(("context", "lily"), L)
                    if pb is not None and pb > budget:
                        over.append(f"context build (lily) predicted {pb:.1f}s")
                only_stock = bool(over) and all(o.startswith("stock ") for o in over)
                if over and getattr(opts, "lily_only_over_budget", False) and only_stock:
                    row["status"] = "lily_only"
                    row["reason"] = f"stock over budget {budget:g}s: " + "; ".join(over)
                    if sweep == "prefill":
                        row["stock_predicted_tok_s"] = L / predict((sweep, "stock"), L)
                    log(f"{sweep} L={fmt_len(L)}: Lily only ({row['reason']})")
                elif over:
                    row["status"] = "not_run"
                    row["reason"] = f"over budget {budget:g}s: " + "; ".join(over)
                    log(f"{sweep} L={fmt_len(L)}: not run ({row['reason']})")
                    continue
            run_arms = ("lily",) if row["status"] == "lily_only" else ARMS
            try:
                if sweep == "prefill":
                    for r, order in enumerate(orders):
                        for arm in (a for a in order if a in run_arms):
                            with arm_context(arm, model, opts.ops):
                                step = effective_prefill_step(model, opts.prefill_step_size)
                                m = measure_prefill(model, ids[:L], step)
                                if arm == "lily" and getattr(opts, "prefill_timeline", False):
                                    tl = _prefill_timeline(model, ids[:L], step)
                                    if tl is not None:
                                        m["timeline"] = tl
                            m.update({"round": r, "position": order.index(arm)})
                            row["arms"][arm]["rounds"].append(m)
                            last[(sweep, arm)] = (L, m["seconds"])
                            if arm == "lily":
                                prefill_lily_s[L] = m["seconds"]
                            log(f"prefill L={fmt_len(L)} round {r + 1} {arm:5s}: {m['tok_s']:10.1f} tok/s "
                                f"({m['seconds']:.3f}s, peak {m['peak_memory_bytes'] / 2**20:.0f} MiB)")
                            if m.get("timeline"):
                                ch = m["timeline"]["chunks"]
                                log("  timeline (ms): " + "; ".join(
                                    f"{c['tokens']} tok build {c['build']:.1f} dispatch "
                                    f"{c['dispatch']:.1f} wait {c['wait']:.1f} GPU "
                                    f"{c['gpu_busy']:.1f} clear {c.get('clear', 0.0):.1f}"
                                    for c in ch[:3] + ch[-1:])
                                    + ("" if len(ch) <= 4 else f" ({len(ch)} chunks)")
                                    + f"; total {m['timeline']['total_ms']:.1f}")
                else:
                    t0 = time.perf_counter()
                    with arm_context("lily", model, opts.ops):
                        ctx = build_context(model, ids[:L],
                                            effective_prefill_step(model, opts.prefill_step_size))
                    tb = time.perf_counter() - t0
                    row["context_built_by"] = "lily"
                    row["context_build_s"] = tb
                    last[("context", "lily")] = (L, tb)
                    log(f"decode L={fmt_len(L)}: context built by lily in {tb:.2f}s")
                    for r, order in enumerate(orders):
                        for arm in (a for a in order if a in run_arms):
                            c = copy_cache(ctx)
                            with arm_context(arm, model, opts.ops):
                                m = measure_decode(model, c, int(ids[L]), opts.decode_steps)
                                tl = (_decode_timeline(model, ctx, int(ids[L]))
                                      if getattr(opts, "decode_timeline", False) else None)
                                if tl is not None:
                                    m["timeline_ms"] = tl
                            del c
                            m.update({"round": r, "position": order.index(arm)})
                            row["arms"][arm]["rounds"].append(m)
                            last[(sweep, arm)] = (L, m["seconds"])
                            log(f"decode  L={fmt_len(L)} round {r + 1} {arm:5s}: {m['tok_s_mean']:10.2f} tok/s "
                                f"mean, {m['tok_s_median']:.2f} median (peak {m['peak_memory_bytes'] / 2**20:.0f} MiB)")
                            if m.get("timeline_ms"):
                                log("  timeline (ms): " + ", ".join(
                                    f"{k} {v:.3f}" for k, v in m["timeline_ms"].items()))
                    del ctx
                    # both arms decoded from identical caches: greedy tokens should agree
                    st = [r["tokens"] for r in row["arms"]["stock"]["rounds"]]
                    lt = [r["tokens"] for r in row["arms"]["lily"]["rounds"]]
                    if st and lt and st[0] != lt[0]:
                        n = next((i for i, (a, b) in enumerate(zip(st[0], lt[0])) if a != b), None)
                        row["flags"].append(f"decode-tokens-diverge@{n}")
                    for arm in ARMS:
                        for rr in row["arms"][arm]["rounds"]:
                            rr.pop("tokens", None)
            except Exception as e:  # report, keep going with the next row
                row["status"] = "error"
                row["reason"] = f"{type(e).__name__}: {e}"
                log(f"{sweep} L={fmt_len(L)}: ERROR {row['reason']}")
            finally:
                gc.collect()
                _sync()
                mx.clear_cache()
            for arm in ARMS:
                for rr in row["arms"][arm]["rounds"]:
                    rr.pop("first_token", None)
            if row["status"] == "ok":
                _finish_row(row)
                f = f" flags {row['flags']}" if row["flags"] else ""
                log(f"{sweep} L={fmt_len(L)}: lily/stock = {row['ratio']:.3f}{f}")
            elif row["status"] == "lily_only":
                _finish_row(row)
    return rows


def summarize(rows: list[dict]) -> dict:
    """Mean and geometric-mean lily/stock ratio per sweep over the rows that ran."""
    out = {}
    for sweep in SWEEPS:
        rs = [r["ratio"] for r in rows if r["sweep"] == sweep and r["status"] == "ok" and r["ratio"]]
        out[sweep] = {
            "rows_run": len(rs),
            "rows_not_run": sum(1 for r in rows if r["sweep"] == sweep and r["status"] == "not_run"),
            "rows_lily_only": sum(1 for r in rows if r["sweep"] == sweep and r["status"] == "lily_only"),
            "mean_ratio": (sum(rs) / len(rs)) if rs else None,
            "geomean_ratio": math.exp(sum(math.log(x) for x in rs) / len(rs)) if rs else None,
            "flagged_rows": sum(1 for r in rows if r["sweep"] == sweep and r["flags"]),
        }
    return out


# ----------------------------------------------------------------------------
# schema
# ----------------------------------------------------------------------------
_NUM = (int, float)
_OPT_NUM = (int, float, type(None))
_OPT_STR = (str, type(None))

RESULT_SCHEMA: dict = {
    "schema": str, "schema_version": int, "created": str, "command": list,
    "backend": str,
    "device": {"name": str, "default_device": str, "info": dict},
    "versions": {"python": str, "mlx": str, "mlx_lm": str, "mlx_lily": str},
    "platform": dict,
    "git": {"commit": _OPT_STR, "dirty": (bool, type(None))},
    "checkpoint": {"kind": str, "path": _OPT_STR, "preset": _OPT_STR, "seed": (int, type(None)),
                   "model_type": _OPT_STR, "config_sha256": str, "tensors_sha256": str, "n_tensors": int},
    "lily_backend_info": {"backend": str, "ops": dict},
    "mlx_env": dict, "cuda_launch_mode": str,
    "settings": {"lengths": list, "sweeps": list, "rounds": int, "order": list, "decode_steps": int,
                 "prefill_step_size": (int, type(None)),  # + prefill_step_by_arm in newer files
                 "budget_s": _OPT_NUM, "warmup": int, "seed": int,
                 "drift_flag": _NUM, "ops": (list, type(None))},
    "gate": {"passed": bool, "checks": dict, "injected_wrong": bool},
    "rows": list,
    "summary": dict,
    "outputs": dict,
}
ROW_STATUSES = ("ok", "not_run", "error", "lily_only")
ROW_SCHEMA: dict = {
    "sweep": str, "length": int, "status": str, "reason": _OPT_STR,
    "context_built_by": _OPT_STR, "context_build_s": _OPT_NUM,
    "arms": dict, "ratio": _OPT_NUM, "drift": dict, "flags": list,
}
ROUND_SCHEMA: dict = {"round": int, "position": int, "seconds": _NUM, "tok_s": _NUM,
                      "peak_memory_bytes": int}
DECODE_ROUND_SCHEMA: dict = {"tok_s_median": _NUM, "tok_s_mean": _NUM, "n_intervals": int}


def _check(obj, schema: dict, where: str, errors: list) -> None:
    if not isinstance(obj, dict):
        errors.append(f"{where}: expected object, got {type(obj).__name__}")
        return
    for key, spec in schema.items():
        if key not in obj:
            errors.append(f"{where}.{key}: missing")
            continue
        v = obj[key]
        if isinstance(spec, dict):
            _check(v, spec, f"{where}.{key}", errors)
        elif not isinstance(v, spec) or (isinstance(v, bool) and spec in (int, _NUM, _OPT_NUM)):
            errors.append(f"{where}.{key}: {type(v).__name__} is not {spec}")


def validate_result(d: dict) -> bool:
    """Check an A/B result dict against the ``mlx-lily-ab`` v1 schema.

    Top level: ``RESULT_SCHEMA``; each row ``ROW_SCHEMA``; each ``rows[i].arms[arm].rounds[j]``
    ``ROUND_SCHEMA`` (+ ``DECODE_ROUND_SCHEMA`` for decode rows).  Also: a failed gate must
    come with no rows; a row with status ``ok`` has ``settings.rounds`` rounds per arm and a
    ratio; a ``lily_only`` row (stock predicted over budget, ``--lily-only-over-budget``) has
    that many Lily rounds, no stock rounds and no ratio; statuses are ``ROW_STATUSES``; lengths / sweeps are consistent with the settings.
    Returns True, or raises ``ValueError`` listing every problem.
    """
    errors: list[str] = []
    _check(d, RESULT_SCHEMA, "$", errors)
    if not errors:
        if d["schema"] != SCHEMA_NAME or d["schema_version"] != SCHEMA_VERSION:
            errors.append(f"$.schema: expected {SCHEMA_NAME} v{SCHEMA_VERSION}")
        if not d["gate"]["passed"] and d["rows"]:
            errors.append("$.rows: speed rows present although the gate failed")
        st = d["settings"]
        if not isinstance(st["rounds"], int) or st["rounds"] < 2:
            errors.append(f"$.settings.rounds: expected an int >= 2, got {st['rounds']!r}")
        elif len(st["order"]) != st["rounds"]:
            errors.append(f"$.settings.order: {len(st['order'])} entries for "
                          f"{st['rounds']} rounds")
        for i, row in enumerate(d["rows"]):
            w = f"$.rows[{i}]"
            _check(row, ROW_SCHEMA, w, errors)
            if not isinstance(row, dict) or any(k not in row for k in ROW_SCHEMA):
                continue
            if row["sweep"] not in SWEEPS:
                errors.append(f"{w}.sweep: {row['sweep']!r}")
            if row["status"] not in ROW_STATUSES:
                errors.append(f"{w}.status: {row['status']!r}")
            pred = row.get("stock_predicted_tok_s")
            if pred is not None and not isinstance(pred, _NUM):
                errors.append(f"{w}.stock_predicted_tok_s: not a number")
            if row["length"] not in d["settings"]["lengths"]:
                errors.append(f"{w}.length: {row['length']} not in settings.lengths")
            for arm in ARMS:
                a = row["arms"].get(arm)
                if not isinstance(a, dict) or "rounds" not in a or "tok_s" not in a:
                    errors.append(f"{w}.arms.{arm}: missing or malformed")
                    continue
                measured = row["status"] == "ok" or (row["status"] == "lily_only" and arm == "lily")
                if measured:
                    if len(a["rounds"]) != d["settings"]["rounds"]:
                        errors.append(f"{w}.arms.{arm}.rounds: expected {d['settings']['rounds']}")
                    if not isinstance(a["tok_s"], _NUM):
                        errors.append(f"{w}.arms.{arm}.tok_s: not a number")
                elif row["status"] == "lily_only" and a["rounds"]:
                    errors.append(f"{w}.arms.{arm}.rounds: a Lily-only row has stock rounds")
                for j, rr in enumerate(a["rounds"]):
                    _check(rr, ROUND_SCHEMA, f"{w}.arms.{arm}.rounds[{j}]", errors)
                    if row["sweep"] == "decode":
                        _check(rr, DECODE_ROUND_SCHEMA, f"{w}.arms.{arm}.rounds[{j}]", errors)
            if row["status"] == "ok" and not isinstance(row["ratio"], _NUM):
                errors.append(f"{w}.ratio: missing for an ok row")
            if row["sweep"] == "decode" and row["status"] == "ok" and row["context_built_by"] not in ARMS:
                errors.append(f"{w}.context_built_by: {row['context_built_by']!r}")
    if errors:
        raise ValueError("invalid A/B result:\n  " + "\n  ".join(errors))
    return True


# ----------------------------------------------------------------------------
# outputs
# ----------------------------------------------------------------------------
def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", s).strip("-") or "unknown"


def default_out_dir(result: dict, base: str | Path = "benchmarks/results") -> Path:
    """``benchmarks/results/<YYYY-MM-DD>-<backend>-<device>`` (suffixed -2, -3... if taken)."""
    date = result["created"][:10]
    d = Path(base) / f"{date}-{result['backend']}-{_slug(result['device']['name'])}"
    k = 2
    out = d
    while (out / "ab.json").exists():
        out = Path(f"{d}-{k}")
        k += 1
    return out


def _fmt(v, spec="{:.1f}") -> str:
    return "-" if v is None else spec.format(v)


def _authority_line(a: dict) -> str:
    m, f = a["metrics"], a["feed"]
    if m is None:
        return f"- Gate authority: {a['checkpoint']}: FAILED, not evaluated ({a.get('error')})"
    return (f"- Gate authority: {a['checkpoint']}, teacher-forced at context "
            f"{f['context']} ({m['positions']} rows): {'PASSED' if a['passed'] else 'FAILED'}, ppl "
            f"stock {m['ppl_ref']:.4f} / Lily {m['ppl_test']:.4f} ({m['ppl_rel_diff'] * 100:+.3f}%), "
            f"top-1 agreement {m['top1_agreement']:.4f}, mean KL {m['kl_mean']:.2e}; thresholds "
            f"ppl <= {a['thresholds']['ppl_rel_diff_max'] * 100:.1f}%, top-1 >= "
            f"{a['thresholds']['top1_agreement_min']:.2f}")


def render_markdown(result: dict) -> str:
    """A markdown report: header (device, versions, checkpoint, gate) and one table per sweep."""
    ck = result["checkpoint"]
    ident = ck["path"] if ck["kind"] == "path" else f"synthetic {ck['preset']} seed {ck['seed']}"
    g = result["gate"]
    s = result["settings"]
    lines = [
        f"# mlx-lily A/B: {result['backend']} / {result['device']['name']}",
        "",
        f"- Created: {result['created']}; mlx {result['versions']['mlx']}, mlx-lm "
        f"{result['versions']['mlx_lm']}, mlx-lily {result['versions']['mlx_lily']}; git "
        f"{(result['git']['commit'] or 'n/a')[:12]}{' (dirty)' if result['git']['dirty'] else ''}",
        f"- Checkpoint: {ident} (config {ck['config_sha256'][:12]}, tensors {ck['tensors_sha256'][:12]}, "
        f"{ck['n_tensors']} tensors)",
        f"- Lily ops: " + ", ".join(f"{k}={v}" for k, v in result["lily_backend_info"].get("ops", {}).items()),
        *([f"- MLX CUDA launch mode (both arms, one process): {result['cuda_launch_mode']}"]
          if result.get("backend") == "cuda" and result.get("cuda_launch_mode") else []),
        *([f"- Lily switches set: " + ", ".join(f"{k}={v}" for k, v in result["lily_env"].items())]
          if result.get("lily_env") else []),
        f"- Method: {s['rounds']} rounds per row (odd rounds stock->lily, even rounds lily->stock; "
        f"each arm's figure the median over its rounds); prefill tok/s = prompt / "
        f"time to first token (generate_step, prefill_step_size "
        f"{_fmt_steps(s)}); decode tok/s = "
        f"{s['decode_steps']} inter-token intervals over their total time (the mean rate, as mlx-lm reports it; "
        f"1 / median interval in brackets), from a context built "
        f"once by Lily and deep-copied per arm; rows whose rounds differ > {s['drift_flag']:.0%} are flagged",
        f"- Gate: {'PASSED' if g['passed'] else 'FAILED'} (rel max logit diff "
        f"{_fmt(g.get('rel_max_logit_diff'), '{:.2e}')}, top-1 {_fmt(g.get('top1_agreement'), '{:.3f}')}, "
        f"greedy prefix {g.get('greedy_prefix_match', '-')}/{g.get('greedy_tokens', '-')})",
        *([_authority_line(g["authority"])] if g.get("authority") else []),
        "",
    ]
    if not g["passed"]:
        lines.append("**The correctness gate failed: no speed is reported.**")
        return "\n".join(lines) + "\n"
    for sweep in SWEEPS:
        rows = [r for r in result["rows"] if r["sweep"] == sweep]
        if not rows:
            continue
        unit = "prefill tok/s" if sweep == "prefill" else "decode tok/s"
        lines += [f"## {sweep}", "",
                  f"| length | stock {unit} | lily {unit} | lily/stock | drift stock | drift lily | "
                  f"peak MiB stock / lily | flags |",
                  "|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in rows:
            if r["status"] == "lily_only":
                a = r["arms"]["lily"]
                li = (f"{a['tok_s']:.2f} ({a['tok_s_median']:.2f})" if sweep == "decode"
                      else f"{a['tok_s']:.1f}")
                pred = r.get("stock_predicted_tok_s")
                st = f"not run (predicted {pred:.1f})" if pred else "not run"
                ratio = f"~{a['tok_s'] / pred:.1f} vs predicted" if pred else "-"
                lines.append(f"| {fmt_len(r['length'])} | {st} | {li} | {ratio} | - | "
                             f"{_fmt(r['drift']['lily'], '{:.1%}')} | - / "
                             f"{a['peak_memory_bytes'] / 2**20:.0f} | {r['reason'] or ''} |")
                continue
            if r["status"] != "ok":
                lines.append(f"| {fmt_len(r['length'])} | {r['status'].replace('_', ' ')} | | | | | | "
                             f"{r['reason'] or ''} |")
                continue
            a = r["arms"]
            if sweep == "decode":
                st = f"{a['stock']['tok_s']:.2f} ({a['stock']['tok_s_median']:.2f})"
                li = f"{a['lily']['tok_s']:.2f} ({a['lily']['tok_s_median']:.2f})"
            else:
                st, li = f"{a['stock']['tok_s']:.1f}", f"{a['lily']['tok_s']:.1f}"
            mem = (f"{a['stock']['peak_memory_bytes'] / 2**20:.0f} / "
                   f"{a['lily']['peak_memory_bytes'] / 2**20:.0f}")
            lines.append(f"| {fmt_len(r['length'])} | {st} | {li} | {r['ratio']:.3f} | "
                         f"{_fmt(r['drift']['stock'], '{:.1%}')} | {_fmt(r['drift']['lily'], '{:.1%}')} | "
                         f"{mem} | {', '.join(r['flags'])} |")
        sm = result["summary"].get(sweep, {})
        if sm.get("mean_ratio"):
            lines += ["", f"Mean lily/stock over {sm['rows_run']} rows: {sm['mean_ratio']:.3f} "
                          f"(geomean {sm['geomean_ratio']:.3f})"]
        lines.append("")
    return "\n".join(lines) + "\n"


def render_plot(result: dict, path: Path) -> bool:
    """PNG: one panel per sweep, tok/s vs length (log-x) for both arms, ratio on a twin y-axis."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib not installed: no plot")
        return False
    sweeps = [s for s in SWEEPS if any(r["sweep"] == s and r["status"] == "ok" for r in result["rows"])]
    if not sweeps:
        return False
    fig, axes = plt.subplots(1, len(sweeps), figsize=(6.5 * len(sweeps), 4.5), squeeze=False)
    for ax, sweep in zip(axes[0], sweeps):
        rows = [r for r in result["rows"] if r["sweep"] == sweep and r["status"] == "ok"]
        xs = [r["length"] for r in rows]
        ax.plot(xs, [r["arms"]["stock"]["tok_s"] for r in rows], "o-", label="stock")
        lrows = [r for r in result["rows"] if r["sweep"] == sweep
                 and r["status"] in ("ok", "lily_only")]
        lx = [r["length"] for r in lrows]
        ax.plot(lx, [r["arms"]["lily"]["tok_s"] for r in lrows], "s-", label="lily")
        ax.set_xscale("log", base=2)
        ax.set_xticks(lx)
        ax.set_xticklabels([fmt_len(x) for x in lx], rotation=45)
        ax.set_xlabel("prompt length" if sweep == "prefill" else "context length")
        ax.set_ylabel(f"{sweep} tok/s")
        ax.grid(True, alpha=0.3)
        ax2 = ax.twinx()
        ax2.plot(xs, [r["ratio"] for r in rows], "k--", alpha=0.6, label="lily/stock")
        ax2.axhline(1.0, color="grey", lw=0.8, alpha=0.5)
        ax2.set_ylabel("lily / stock")
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, loc="best", fontsize=8)
        ax.set_title(f"{sweep}: {result['backend']} / {result['device']['name']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def json_clean(obj):
    """Recursively replace non-finite floats (and numpy scalars) with JSON-safe values."""
    if isinstance(obj, dict):
        return {k: json_clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_clean(v) for v in obj]
    if hasattr(obj, "item") and not isinstance(obj, (str, bytes)):
        try:
            obj = obj.item()
        except Exception:
            return str(obj)
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def write_outputs(result: dict, out_dir: Path) -> dict:
    """Write ab.json, ab.md and ab.png into ``out_dir``; return the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": str(out_dir / "ab.json"), "markdown": str(out_dir / "ab.md"), "png": None}
    if result["gate"]["passed"] and render_plot(result, out_dir / "ab.png"):
        paths["png"] = str(out_dir / "ab.png")
    result["outputs"] = paths
    result.update(json_clean(result))
    (out_dir / "ab.md").write_text(render_markdown(result))
    (out_dir / "ab.json").write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")
    return paths


# ----------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """The ``mlx_lily.ab`` argument parser."""
    p = argparse.ArgumentParser(
        prog="mlx_lily.ab",
        description="A/B throughput of stock mlx-lm vs mlx-lily on one checkpoint "
                    "(prefill and decode sweeps, alternating arms, correctness gate first).")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("model", nargs="?", help="MLX checkpoint directory (or anything mlx_lm.load accepts)")
    src.add_argument("--synthetic", metavar="PRESET", help="in-memory synthetic model (mlx_lily.synth preset)")
    p.add_argument("--model-seed", type=int, default=0, help="seed of the synthetic weights")
    p.add_argument("--lengths", type=parse_lengths, default=list(DEFAULT_LENGTHS),
                   help="comma-separated lengths, K = 1024 (default 256..128K)")
    p.add_argument("--sweeps", default="prefill,decode",
                   help="comma-separated subset of prefill,decode")
    p.add_argument("--decode-steps", type=int, default=64, help="timed decode intervals per row")
    p.add_argument("--prefill-timeline", action="store_true",
                   help="CUDA: after each Lily prefill measurement, the same prompt again "
                        "through mlx_lily.bench.timeline.prefill_run (per chunk: host build / "
                        "dispatch / wait and the GPU's busy time), kept as 'timeline' in the "
                        "round (Lily only: stock's prefill is 30-50x longer)")
    p.add_argument("--decode-timeline", action="store_true",
                   help="CUDA: after each decode measurement, the same arm again through "
                        "mlx_lily.bench.timeline (24 steps): host build / dispatch / wait and "
                        "the GPU's busy time per step, kept as 'timeline_ms' in the round")
    p.add_argument("--prefill-step-size", type=int, default=None,
                   help="prompt tokens per prefill chunk for both arms (default: each arm's "
                        "own: mlx-lm's 2048 for stock, mlx_lily.patching.PREFILL_STEP_SIZE "
                        "for Lily)")
    p.add_argument("--rounds", type=int, default=2,
                   help="rounds per row and arm (>= 2; arms alternate who runs first); "
                        "each arm's figure is the median over its rounds")
    p.add_argument("--lily-only-over-budget", action="store_true",
                   help="rows where only stock is predicted over --budget-s run the Lily arm alone "
                        "(status lily_only; the stock figure shown is a linear prediction)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="per-arm, per-measurement time budget; rows predicted over it are not run")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="rows not started this many seconds after the run began are not run "
                        "(status not_run, reason 'deadline'): a run under an outer time limit "
                        "still writes its results")
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up generations per arm")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic prompt ids")
    p.add_argument("--ops", default=None, help="comma-separated Lily ops to enable (default all)")
    p.add_argument("--out", type=Path, default=None, help="output directory")
    p.add_argument("--watchdog-s", type=float, default=0.0,
                   help="print every thread's Python stack to stderr every this many seconds "
                        "(find where a run stalls; 0: off)")
    p.add_argument("--gate-tokens", type=int, default=16)
    p.add_argument("--gate-positions", type=int, default=64)
    p.add_argument("--gate-rel-tol", type=float, default=0.1)
    p.add_argument("--gate-top1", type=float, default=0.9)
    p.add_argument("--gate-greedy-prefix", type=int, default=8)
    p.add_argument("--gate-anchor", choices=("fp32", "none"), default="fp32",
                   help="when the fixed thresholds fail, accept Lily if it is no further from "
                        "an fp32 evaluation than stock's bf16 path (see correctness_gate)")
    p.add_argument("--gate-authority", default="auto", metavar="auto|none|DIR",
                   help="trained checkpoint whose teacher-forced check (fixed thresholds) decides "
                        "the gate; auto: the cached production-width model on GPU backends")
    p.add_argument("--inject-wrong", action="store_true", help=argparse.SUPPRESS)
    return p


def _steps_by_arm(model, opts) -> dict:
    """``{arm: prefill chunk}`` each arm's prefill runs with (``effective_prefill_step``)."""
    out = {}
    for arm in ARMS:
        with arm_context(arm, model, opts.ops):
            out[arm] = effective_prefill_step(model, opts.prefill_step_size)
    return out


def run(opts) -> tuple[dict, int]:
    """Run gate + sweeps for parsed ``opts``; return ``(result, exit_code)`` (not written)."""
    sweeps = [s.strip() for s in opts.sweeps.split(",") if s.strip()]
    bad = [s for s in sweeps if s not in SWEEPS]
    if bad:
        raise SystemExit(f"unknown sweep(s) {bad}; choose from {list(SWEEPS)}")
    opts.sweeps = sweeps
    opts.ops = [o.strip() for o in opts.ops.split(",")] if isinstance(opts.ops, str) else opts.ops
    inject = bool(opts.inject_wrong or os.environ.get(INJECT_ENV, "") not in ("", "0"))

    opts.t_begin = time.perf_counter()
    from . import authority as _authority

    try:  # before loading the target: a bad authority folder fails at once
        authority = _authority.resolve(getattr(opts, "gate_authority", "none"),
                                       _authority.current_backend(), log=log)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    log(f"loading {'synthetic ' + opts.synthetic if opts.synthetic else opts.model}")
    target = load_target(opts.model, opts.synthetic, opts.model_seed)
    env = environment(opts.ops)
    log(f"backend {env['backend']} / {env['device']['name']}; lily ops {env['lily_backend_info'].get('ops')}")

    hi, exclude = vocab_bounds(target.config, target.tokenizer)
    gate_logit_ids = synthetic_ids(opts.gate_positions, hi, exclude, seed=opts.seed + 1)
    if target.tokenizer is not None:
        greedy_ids = list(target.tokenizer.encode(GATE_TEXT))
    else:
        greedy_ids = list(synthetic_ids(32, hi, exclude, seed=opts.seed + 2))
    if authority is not None:
        log(f"gate authority: {authority} (fixed thresholds {_authority.THRESHOLDS})")
    gate = correctness_gate(target, gate_logit_ids, greedy_ids, greedy_tokens=opts.gate_tokens,
                            rel_tol=opts.gate_rel_tol, top1_min=opts.gate_top1,
                            greedy_min_prefix=opts.gate_greedy_prefix, inject_wrong=inject, ops=opts.ops,
                            anchor=opts.gate_anchor, authority=authority)
    log(f"gate {'PASSED' if gate['passed'] else 'FAILED'}: rel max logit diff {gate['rel_max_logit_diff']:.2e}, "
        f"top-1 {gate['top1_agreement']:.3f}, greedy prefix {gate['greedy_prefix_match']}/{gate['greedy_tokens']}")
    if gate.get("authority") and gate["authority"]["metrics"] is not None:
        a, m = gate["authority"], gate["authority"]["metrics"]
        log(f"gate authority {'PASSED' if a['passed'] else 'FAILED'}: ppl rel diff "
            f"{m['ppl_rel_diff']:+.2e}, top-1 {m['top1_agreement']:.4f}, KL mean {m['kl_mean']:.2e} "
            f"over {m['positions']} rows")
    if gate.get("fp32_anchor"):
        a = gate["fp32_anchor"]
        log(f"gate fp32 anchor {'PASSED' if a['passed'] else 'FAILED'}: distance to fp32 stock "
            f"{a['stock_rel_to_fp32']:.3f} / lily {a['lily_rel_to_fp32']:.3f}, top-1 vs fp32 "
            f"stock {a['stock_top1_vs_fp32']:.3f} / lily {a['lily_top1_vs_fp32']:.3f}")

    result = {
        "schema": SCHEMA_NAME,
        "schema_version": SCHEMA_VERSION,
        "created": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": list(getattr(opts, "command", sys.argv)),
        **env,
        "checkpoint": target.identity,
        "settings": {
            "lengths": list(opts.lengths), "sweeps": sweeps, "rounds": int(opts.rounds),
            "order": [list(o) for o in round_orders(opts.rounds)], "decode_steps": opts.decode_steps,
            "decode_timeline": bool(getattr(opts, "decode_timeline", False)),
            "prefill_timeline": bool(getattr(opts, "prefill_timeline", False)),
            "prefill_step_size": opts.prefill_step_size,
            "prefill_step_by_arm": _steps_by_arm(target.model, opts),
            "budget_s": opts.budget_s,
            "deadline_s": getattr(opts, "deadline_s", None),
            "lily_only_over_budget": bool(getattr(opts, "lily_only_over_budget", False)),
            "warmup": opts.warmup, "seed": opts.seed, "drift_flag": DRIFT_FLAG, "ops": opts.ops,
        },
        "gate": gate,
        "rows": [],
        "summary": {},
        "outputs": {},
    }
    if not gate["passed"]:
        log("correctness gate failed: refusing to report speed")
        return result, 2
    result["rows"] = run_sweeps(target, opts)
    result["summary"] = summarize(result["rows"])
    return result, 0


def main(argv=None) -> int:
    """Console entry point ``mlx_lily.ab``. Exit codes: 0 ok, 2 gate failed, 1 error."""
    parser = build_parser()
    opts = parser.parse_args(argv)
    if opts.rounds < 2:
        parser.error(f"--rounds must be at least 2 (got {opts.rounds}): the drift check "
                     "compares rounds")
    opts.command = ["mlx_lily.ab", *(sys.argv[1:] if argv is None else list(argv))]
    if opts.watchdog_s > 0:  # a run that stalls shows where: every thread's stack on stderr
        import faulthandler

        faulthandler.dump_traceback_later(opts.watchdog_s, repeat=True, file=sys.stderr)
    try:
        result, code = run(opts)
    finally:
        if opts.watchdog_s > 0:
            import faulthandler

            faulthandler.cancel_dump_traceback_later()
    out = opts.out or default_out_dir(result)
    paths = write_outputs(result, Path(out))
    validate_result(result)
    md = Path(paths["markdown"]).read_text()
    print(md)
    log(f"wrote {paths['json']}, {paths['markdown']}" + (f", {paths['png']}" if paths["png"] else ""))
    return code


if __name__ == "__main__":
    sys.exit(main())
