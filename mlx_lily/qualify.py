"""Per-device qualification: which Lily kernels pass and pay off on THIS GPU.

``python -m mlx_lily.qualify [--model DIR | --synthetic PRESET] [--layers N] [--report]``

For each op of ``backend.OP_NAMES`` with a kernel on this backend, and each candidate
variant of it (``variants_of``: ``"default"``, the shipped choice, plus ``VARIANTS[op]``,
each a set of environment settings the variant runs under, applied by
``variant_settings``), at the model's shapes:

1. Parity: the model's forward (a short prefill, a decode step, a longer prefill, every
   kernel launch evaluated at once with its outputs pre-filled with NaN,
   ``first_contact.probing(poison=True)``) on fresh random token ids, with an op set's
   kernels on, against the same forward with every kernel off (the references). A set
   passes with finite logits, every position's logits correlated >=
   ``first_contact.MIN_CORRELATION`` with the reference's, and either max |diff| <=
   ``REL_TOL`` of the logit scale or (random-weight models, whose near-tied expert
   routing turns rounding into O(1) logit moves) the fp32 anchor of the A/B gate: no
   further from the fp32 evaluation than the references are, up to x1.5 + 0.05 (and top-1
   within 0.1); the fp32 forward runs only when a set needs the anchor. The first check
   is every candidate op on at once (``first_contact.passing_set``): when it passes,
   every op passes in one forward; a launch failure names its op; a failing set is
   bisected over its prefixes in ``OP_NAMES`` order (base ops before the fusions that
   need them) for the op whose addition breaks it, which fails (with the fusions that
   require it) while the rest is checked again. A non-default variant is checked as the
   passing set with that op in that variant (one forward each).
2. Speed, measured at model level (per-op stock timing would need each op's stock
   subgraph in isolation), with the op on (each passing variant) vs the same set without
   it (where the op runs its reference: mlx-lm's math for that op), in ``OP_NAMES``
   order, the ops kept before it on in both. The two arms are timed in alternation
   (``paired_rounds``: A B, B A, ...), so a drift of the machine's speed weighs on both:
   ``DECODE_ROUNDS`` rounds of ``DECODE_STEPS`` decode steps pipelined as mlx-lm's
   ``generate_step`` runs them (``decode_round``), each arm on its own cache after a
   ``DECODE_CONTEXT``-token context, and ``PREFILL_REPS`` rounds of one
   ``PREFILL_LEN``-token prefill chunk. Decode runs on ``deep_view``: the loaded layers
   repeated to the checkpoint's depth, so a kernel's share of a step is its share in the
   real model (on the layers alone, a step's fixed costs, the LM head and the host's
   work, took most of it). A phase's speed-up is the median over its rounds of base /
   kernel, its noise the standard error of that median (``ratio_stats``). An op is kept
   in its fastest variant that was faster (``faster_speedup``, ``decide``: one phase
   gains, the other loses no more than ``SLOWER_TOL`` or, where the rounds spread more,
   ``NOISE_SIGMAS`` standard errors, at most ``MAX_ALLOWANCE``: a 4.7x prefill gain is
   not thrown away for a 3 % decode loss inside the noise); a fusion whose required ops
   were not kept is not timed (its kernel could not serve).
   Then each op that passed but was not kept is timed once more together with the ops
   that require it (``dependent_chain``, default variants, against the set kept so far:
   an enabler such as ``norm_qgemv``, about even alone, is what the fused projections,
   the fused MoE and the compiled whole step need); a chain that is faster is kept
   whole (the record's ``"chains"``). Last, the whole passing set in default variants
   (``whole_set``: without ops that would serve untimed) is timed against the set kept so
   far, and qualifies instead when it is faster (``overall["whole_set"]``): a variant
   kept early can make later fusions moot (``moe_topk_in_experts``'s ``norm_once`` sets
   a global knob under which the norm-folded projections and ``gdn_proj`` step aside), a
   set one op at a time never reaches. When the whole set wins, each of its ops that
   nothing in it requires and that was not shown faster alone or in a chain is timed
   against the set without it and leaves when that is faster. Before timing,
   a launch census (``launch_census``: the timed work's graph built, not evaluated, the
   decode steps through the compiled path's Python without a trace) compares the kernel
   launches (name, template, grid, shapes) with the set without the op: a phase where
   they are the same is the same work and is not timed (speed-up 1; a prefill-only op
   costs no decode-step trace, a decode-only op no prefill timing); an op that changes
   no launch in either phase is not timed and does not qualify. Ops whose work is MLX's
   own ops (``registry.Op.own_kernels`` False: ``prefill_dequant``, ``shared_dequant``)
   launch no Lily kernel for the census to see: the census carries a mark for each, so
   they are timed in both phases. Ops that
   serve only decode steps of several sequences (``Op.one_sequence`` False:
   ``batch_decode``) are not timed here: the batch phase (4.) decides them.
   That is the greedy method (``--method greedy``, ``GREEDY``). The default,
   ``TOP_DOWN`` (``DEFAULT_METHOD``), builds the set the other way: the whole passing set
   (``whole_set``) is timed against the references, then each member, fusions first
   (reverse ``OP_NAMES`` order), in each of its passing variants, against the set without
   it and the members that require it (``with_dependents``): they leave together unless a
   variant is faster, and the fastest stays. Every comparison then runs at about the
   fast set's speed, and there is one per member and variant.
3. Final check: the kept set, in its chosen variants, passes the parity check once more
   (a fusion can hide a base op's kernel from the all-on check, e.g. a decode path it
   replaces; a failure is bisected as above and drops that op) and is timed against
   unpatched mlx-lm in the same paired rounds (Lily patched and unpatched round by
   round); if it is slower than stock in either phase beyond ``SLOWER_TOL`` nothing
   qualifies (Lily steps aside).
4. Batch phase (``batch_decode``: decode steps of several sequences in mlx-lm's
   ``BatchGenerator``, as ``mlx_lm.server`` runs concurrent requests; ``_batch_phase``),
   when the qualified set holds the ops it requires. Parity first: a prompt alone
   prefilled past the router kernel's row limit (the switch lifts it) against the
   references, as in 1.; each of ``BATCH_PROMPTS`` generated alone (mlx-lm's
   ``generate_step``, greedy, ``BATCH_TOKENS`` tokens) against the same prompts batched,
   the last ``BATCH_JOINING`` of them joining the running batch after
   ``BATCH_JOIN_AFTER`` steps; and two prompts of ``BATCH_LENGTH`` tokens batched. Every
   row's tokens and every step's log-probabilities must equal the prompt alone, bit for
   bit (the contract of ``batch_decode``: an answer does not depend on what else the
   server was doing; checked at these short lengths only). Then timing, the qualified set
   with and without it in paired rounds as above: batched decode steps of
   ``BATCH_ROWS`` sequences on the timed depth (``batch_round``; prompts of one length:
   the compiled batch step; of mixed lengths: left-padded rows), a batch's prefill
   (``batch_prefill_round``) and a prompt alone's prefill (``prefill_round``). It is kept
   when the batched steps are faster (``faster_speedup`` over the two batch shapes) and
   the prompt alone prefills no slower (``allowance``); the batch's prefill, one sequence
   at a time with the switch (what keeps a row equal to its prompt alone), is recorded,
   not a condition. The child writes its result before this phase (``checkpoint``), so a
   crash or the time limit in it leaves the one-sequence verdicts in the record
   (``"batch_phase_stopped"``).

The parity forwards and the references' logits run eagerly; each op set timed in decode
traces its compiled decode step once (a new ``compile_key``; on CUDA MLX also compiles
the new graph's fused kernels) and the model keeps the last few configurations' traces
(``decode_graph.RECENT_KEYS``), so alternating rounds replay them. The record keeps the seconds of each phase
(``"phases"``), the model forwards and decode-step traces per phase (``"counts"``) and,
per comparison, each arm's context prefill and first decode step ms (trace and compile
cost) and every round's times;
the progress lines name each step with the seconds elapsed.

The model is the checkpoint's first ``--layers`` decoder layers (default one
full-attention cycle, ``full_attention_interval``: 3 GDN layers + 1 attention layer at the
real widths), loaded lazily so only those layers occupy memory, or a synthetic model
(``mlx_lily.synth``) of a preset's dims with that many layers; decode is timed on those
layers repeated to the checkpoint's (preset's) depth (``--depth``).

The run happens in a child process with a time limit (``--timeout-s``, default
``TIMEOUT_S``): a kernel that crashes or hangs kills only the child; the parent then
records the attempt as ``"timeout"`` / ``"error"`` with no op qualified. The record
(``record_path``: ``$MLX_LILY_CACHE_DIR/qualify/<backend>-<device>.json``, default
``~/.cache/mlx-lily``) is written atomically (a temporary file renamed into place) and
names the GPU (``mx.device_info()``), OS, MLX / mlx-lm / mlx-lily versions and a SHA-256
of the backend's kernel sources; a record whose identity differs from the running one
is ignored (``record_status`` "stale": qualify again). ``kernels.verified_ops`` reads
the record; ``MLX_LILY_QUALIFY=0`` ignores records and never qualifies automatically
(the shipped ``kernels.VERIFIED`` for devices in ``kernels.SHIPPED_DEVICES`` applies).

Test and tooling only: ``MLX_LILY_QUALIFY_EMULATE=1`` makes the child run its Metal
kernels under the CPU emulator (``mlx_lily.testing.dispatch.emulated_metal``).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from . import backend as _backend
from . import config, tuning

SCHEMA = "mlx-lily-qualify"
SCHEMA_VERSION = 5  # 5: the batch phase (records without it qualify again)
QUALIFY_ENV = "MLX_LILY_QUALIFY"
EMULATE_ENV = "MLX_LILY_QUALIFY_EMULATE"
#: Candidate variants per op besides ``"default"``: ``{op: {variant: {env name: value}}}``
#: (``variants_of``).
from .variants import VARIANTS  # noqa: E402
DEFAULT_VARIANT = "default"
TIMEOUT_S = 900.0  # seconds before the child is killed
REL_TOL = 0.1
ANCHOR_FACTOR, ANCHOR_SLACK, ANCHOR_TOP1_SLACK = 1.5, 0.05, 0.1
#: An op is faster when its better phase (decode or prefill) gains >= FASTER_MARGIN, the
#: product of its phases' speed-ups does too, and no phase loses more than its allowance:
#: SLOWER_TOL, or NOISE_SIGMAS standard errors of that phase's speed-up where its paired
#: rounds spread more (``ratio_stats``), never more than MAX_ALLOWANCE. The
#: final check against stock allows SLOWER_TOL only.
FASTER_MARGIN = 0.01
SLOWER_TOL = 0.02
NOISE_SIGMAS = 2.0
MAX_ALLOWANCE = 0.05
DECODE_CONTEXT = 64
#: Decode timing: pipelined steps per round and paired rounds per comparison (each arm
#: starts a fresh cache per comparison).
DECODE_STEPS = 8
DECODE_ROUNDS = 6
PREFILL_LEN = 512
PARITY_PREFILL = 64
PREFILL_REPS = 3  # paired prefill rounds
#: The batch phase's parity: prompt lengths (tokens), of which the last BATCH_JOINING join
#: the running batch after BATCH_JOIN_AFTER decode steps, and the tokens each row decodes.
BATCH_PROMPTS = (37, 5, 130, 70)
BATCH_JOINING = 2
BATCH_JOIN_AFTER = 2
BATCH_TOKENS = 8
#: The batch phase's timing: batches of BATCH_ROWS sequences, prompts of one length
#: (BATCH_LENGTH tokens) and of mixed lengths (up to BATCH_LENGTH).
BATCH_ROWS = 4
BATCH_LENGTH = 64
#: How the timing step builds the set: ``"greedy"`` (ops one at a time, chains, then the
#: whole passing set and its leave-one-out) or ``"top-down"`` (the whole passing set, then
#: each member, in each of its variants, against the set without it and the members that
#: require it; every comparison runs at about the fast set's speed, not the references')
GREEDY, TOP_DOWN = "greedy", "top-down"
METHODS = (GREEDY, TOP_DOWN)
#: On an H100, warm: top-down 57-60 s, greedy 65-67 s, qualified sets' decode within 4.4%.
DEFAULT_METHOD = TOP_DOWN


# ----------------------------------------------------------------------------- settings
def auto_enabled() -> bool:
    """``MLX_LILY_QUALIFY`` (``mlx_lily.config.qualify``): ``0`` ignores records and never
    qualifies on its own; ``1`` (default): records apply and a GPU without one is
    qualified the first time Lily loads a model on it."""
    return config.qualify


def cache_root() -> Path:
    """``$MLX_LILY_CACHE_DIR`` or ``~/.cache/mlx-lily``."""
    from . import config

    return Path(config.cache_dir)


# ----------------------------------------------------------------------------- identity
def shader_dir(backend: str) -> Path:
    """The folder of ``backend``'s kernel sources (``kernels.shader_path``'s)."""
    from . import kernels

    probe = {"metal": "qgemv.metal", "cuda": "qgemv.cu"}.get(backend)
    if probe is None:
        raise ValueError(f"no kernel sources for backend {backend!r}")
    return kernels.shader_path(backend, probe).parent


def sources_sha256(backend: str) -> str:
    """SHA-256 over the names and bytes of every kernel source file of ``backend``
    (``shader_dir``), in name order: any edit of a kernel or helper changes it."""
    h = hashlib.sha256()
    for f in sorted(p for p in shader_dir(backend).iterdir() if p.is_file()):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def identity(backend: str) -> dict:
    """What a record is valid for: backend, GPU (``mx.device_info()``: name and
    architecture), OS, versions of MLX, mlx-lm and mlx-lily, and ``sources_sha256``."""
    import mlx.core as mx

    import mlx_lily

    try:
        info = mx.device_info()
    except Exception:  # noqa: BLE001
        info = {}
    try:
        import mlx_lm

        lm = getattr(mlx_lm, "__version__", None)
    except Exception:  # noqa: BLE001
        lm = None
    return {"backend": backend, "device_name": str(info.get("device_name", "")),
            "architecture": str(info.get("architecture", "")),
            "os": f"{platform.system()} {platform.release()}",
            "mlx": mx.__version__, "mlx_lm": lm, "mlx_lily": mlx_lily.__version__,
            "sources_sha256": sources_sha256(backend)}


def device_label(backend: str) -> str:
    from . import kernels

    return f"{kernels.device_name() or 'this GPU'} ({backend})"


def _slug(text: str) -> str:
    out = "".join(c.lower() if c.isalnum() else "-" for c in text).strip("-")
    return "-".join(p for p in out.split("-") if p) or "device"


def record_path(backend: str) -> Path:
    """Where this device's record lives: ``<cache_root>/qualify/<backend>-<device>.json``."""
    from . import kernels

    return cache_root() / "qualify" / f"{backend}-{_slug(kernels.device_name())}.json"


def read_record(backend: str) -> dict | None:
    """This device's record as stored (None when absent or not valid JSON)."""
    p = record_path(backend)
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def record_status(backend: str) -> str:
    """``"off"`` (``MLX_LILY_QUALIFY=0``), ``"none"`` (no record), ``"stale"`` (a record
    for another identity: versions or kernel sources changed, or made by another
    ``SCHEMA_VERSION`` of this method) or ``"valid"``."""
    if not auto_enabled():
        return "off"
    rec = read_record(backend)
    if rec is None or rec.get("schema") != SCHEMA:
        return "none"
    return ("valid" if rec.get("identity") == identity(backend)
            and rec.get("schema_version") == SCHEMA_VERSION else "stale")


def why_none(backend: str) -> str:
    """Why this device's record qualifies no op, for the step-aside line:
    ``qualification on <device> passed no kernel faster than stock`` or, for a run that
    did not finish, its status and error; with the record's path."""
    rec = read_record(backend) or {}
    what = ("passed no kernel faster than stock" if rec.get("status", "ok") == "ok"
            else f"ended with status {rec.get('status')!r} ({rec.get('error')})")
    return f"qualification on {device_label(backend)} {what} (record: {record_path(backend)})"


def record_ops(backend: str) -> frozenset | None:
    """The ops this device's valid record qualified (each in its chosen variant), or None
    when there is no valid record or qualification is off (``kernels.verified_ops``)."""
    if record_status(backend) != "valid":
        return None
    return frozenset(read_record(backend).get("qualified", {}))


def record_variant_settings(backend: str) -> dict:
    """``{MLX_LILY_* name: raw value}``: the settings of the variants this device's valid
    record chose (``qualified`` op -> variant other than ``"default"``), which serving
    applies (``tuning.QUALIFIED``); {} without a valid record. A variant name the
    current table no longer has is skipped; a variable two chosen variants set to
    different values is applied by neither (one warning: no such pair was timed)."""
    if record_status(backend) != "valid":
        return {}
    out: dict = {}
    clash: set = set()
    for op, variant in sorted(read_record(backend).get("qualified", {}).items()):
        if variant == DEFAULT_VARIANT:
            continue
        for var, raw in variants_of(op, backend).get(variant, {}).items():
            if var in out and out[var] != raw:
                clash.add(var)
            out[var] = raw
    if clash:
        config.warn_user(f"mlx-lily: the qualification record's variants set {sorted(clash)} to "
                         "different values; the defaults apply for them", stacklevel=2)
    return {k: v for k, v in out.items() if k not in clash}


def write_record(record: dict, path: Path) -> Path:
    """Write ``record`` as JSON to ``path`` atomically (a temporary file in the same
    folder, flushed, then renamed over ``path``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


# ----------------------------------------------------------------------------- decisions
def faster(kernel_ms: dict, base_ms: dict, noise: dict | None = None) -> tuple[bool, dict]:
    """Whether times ``kernel_ms`` (``{"decode": ms, "prefill": ms}``) beat ``base_ms``
    (``faster_speedup`` of their ratios). Returns ``(faster, {phase: base / kernel})``."""
    speed = {k: base_ms[k] / kernel_ms[k] for k in kernel_ms
             if kernel_ms.get(k) and base_ms.get(k)}
    return faster_speedup(speed, noise), speed


def faster_speedup(speed: dict, noise: dict | None = None) -> bool:
    """Whether speed-ups ``speed`` (``{phase: base time / kernel time}``) make an op
    faster: the better phase and the product of the phases' speed-ups gain >=
    ``FASTER_MARGIN``, and no phase loses more than ``allowance(noise, phase)``
    (``noise``: ``{phase: relative standard error of the speed-up}``, ``ratio_stats``;
    None: ``SLOWER_TOL`` alone)."""
    speed = {k: v for k, v in (speed or {}).items() if v}
    if not speed:
        return False
    return (max(speed.values()) >= 1 + FASTER_MARGIN
            and math.prod(speed.values()) >= 1 + FASTER_MARGIN
            and all(x >= 1 - allowance(noise, k) for k, x in speed.items()))


def allowance(noise: dict | None, phase: str) -> float:
    """The loss a phase may show and still count as no loss: ``SLOWER_TOL``, or
    ``NOISE_SIGMAS`` standard errors of the phase's time ratio when that is larger, at
    most ``MAX_ALLOWANCE``."""
    se = float((noise or {}).get(phase) or 0.0)
    if math.isnan(se):
        se = 0.0
    return min(MAX_ALLOWANCE, max(SLOWER_TOL, NOISE_SIGMAS * se))


#: d2(n): the mean range of n normal samples in standard deviations (n = 2, 3).
_RANGE_D2 = {2: 1.128, 3: 1.693}


def median_rel_se(spread_value: float, n: int) -> float:
    """Relative standard error of the median of ``n`` timings whose ``spread`` is
    ``spread_value`` (interquartile range over the median for n >= 4, range over the
    median below), under a normal approximation: sigma = IQR / 1.349 (range / d2(n)),
    se = 1.2533 * sigma / sqrt(n). 0.0 for n < 2 or no spread."""
    if n < 2 or not spread_value or spread_value <= 0:
        return 0.0
    sigma = spread_value / (1.349 if n >= 4 else _RANGE_D2[n])
    return 1.2533 * sigma / n ** 0.5


def decide(results: dict) -> dict:
    """``{op: variant}`` to run: for each op the fastest variant (best decode-plus-prefill
    speed-up product) among those that ``passed`` and were ``faster``. ``results`` is
    ``{op: {variant: {"passed", "faster", "speedup": {phase: x}}}}``."""
    out = {}
    for op, variants in results.items():
        best, best_gain = None, 0.0
        for name, r in variants.items():
            if not (r.get("passed") and r.get("faster")):
                continue
            gain = 1.0
            for v in (r.get("speedup") or {}).values():
                gain *= v
            if best is None or gain > best_gain:
                best, best_gain = name, gain
        if best is not None:
            out[op] = best
    return out


def dependent_chain(seed: str, candidates: list, kept, requires, exclude=()) -> list:
    """The ops that can only serve together with ``seed``: ``seed`` plus every op of
    ``candidates`` (``OP_NAMES`` order, not in ``kept``) that requires an op of the chain,
    directly or through another, together with its other required ops that are
    candidates; an op with a required op neither kept nor a candidate stays out (it
    could not serve). A seed whose own required ops are not all kept has no chain
    (``[]``). ``requires(op)`` gives an op's required ops
    (``first_contact.requires``). Returns the chain in ``candidates`` order; ``[seed]``
    when nothing depends on it. Ops in ``exclude`` join only as another member's
    requirement, not as dependents. Example, with the registry's ``requires``: seed
    ``attention`` with candidates ``attention, attn_packed, batch_decode`` and ``qgemv``
    kept gives all three."""
    kept = set(kept)
    if any(r not in kept for r in requires(seed)):
        return []  # the seed cannot serve: its own requirement's chain covers it
    pool = [op for op in candidates if op not in kept]
    chain = {seed}

    def closure(op, seen):
        """``op`` and the candidate ops it needs (not kept), or None if one is missing."""
        need = {op}
        for req in requires(op):
            if req in kept or req in chain or req in seen:
                continue
            if req not in pool:
                return None
            sub = closure(req, seen | need)
            if sub is None:
                return None
            need |= sub
        return need

    grew = True
    while grew:
        grew = False
        for op in pool:
            if op in chain or op in exclude or not any(r in chain for r in requires(op)):
                continue
            need = closure(op, frozenset())
            if need is not None:
                chain |= need
                grew = True
    return [op for op in pool if op in chain]


def unchained(kept: list, chains: list, results: dict, chosen: dict) -> list:
    """``kept`` without the rest of every kept chain that lost an op (a chain is kept whole:
    its enabler was not faster alone) and without the ops that require a removed op, to a
    fixpoint. Marks each removed op's result (``results[op][chosen[op]]``) and the chain
    (``"dropped_at_final_check"``). Returns the ops left, in ``kept``'s order."""
    from . import first_contact

    kept = list(kept)
    changed = True
    while changed:
        changed = False
        for c in chains:
            lost = [o for o in c["ops"] if o not in kept]
            if not c["faster"] or not lost or not any(o in kept for o in c["ops"]):
                continue
            for o in c["ops"]:
                if o in kept:
                    results[o][chosen[o]].update(
                        faster=False, error=f"final check: its chain lost {', '.join(lost)}")
            kept = [o for o in kept if o not in c["ops"]]
            c["dropped_at_final_check"] = lost
            changed = True
        for o in list(kept):
            missing = [r for r in first_contact.requires(o) if r not in kept]
            if missing:
                results[o][chosen[o]].update(
                    faster=False, error=f"final check: requires {', '.join(missing)}, removed")
                kept.remove(o)
                changed = True
    return kept


def whole_set(passed: list, requires, census) -> list:
    """The whole passing set qualification times against the ops it kept one at a time:
    ``passed`` (``OP_NAMES`` order) without the ops whose requirements are not all in it,
    then without each op (last first) that no other member requires and whose removal
    leaves every launch of the set's timed work as it was (``census(ops)``:
    ``launch_census``'s counters; None when unknown: the op stays), so no op is kept
    that serves untimed. Returns the ops in ``passed``'s order."""
    ops = list(passed)
    changed = True
    while changed:
        changed = False
        for o in list(ops):
            if any(r not in ops for r in requires(o)):
                ops.remove(o)
                changed = True
    if not ops:
        return []
    full = census(ops)
    for m in reversed(list(ops)):
        if any(m in requires(o) for o in ops if o != m):
            continue
        rest = [o for o in ops if o != m]
        if rest and same_phases(census(rest), full) == set(PHASES):
            ops = rest
    return ops


def with_dependents(op: str, ops: list, requires) -> list:
    """``op`` and the members of ``ops`` that require it, directly or through another
    member (``requires(o)``: the ops ``o`` needs), in ``ops``' order: what leaves a set
    with ``op``."""
    out = {op}
    changed = True
    while changed:
        changed = False
        for o in ops:
            if o not in out and any(r in out for r in requires(o)):
                out.add(o)
                changed = True
    return [o for o in ops if o in out]


def parity_ok(agreement: dict, rel_to_fp32: float | None = None,
              ref_rel_to_fp32: float | None = None, top1_fp32: float | None = None,
              ref_top1_fp32: float | None = None) -> bool:
    """The parity rule (module docstring, step 1)."""
    if not agreement.get("ok"):
        return False
    if agreement["rel"] <= REL_TOL:
        return True
    if rel_to_fp32 is None or ref_rel_to_fp32 is None:
        return False
    return (rel_to_fp32 <= ANCHOR_FACTOR * ref_rel_to_fp32 + ANCHOR_SLACK
            and top1_fp32 >= ref_top1_fp32 - ANCHOR_TOP1_SLACK)


# ----------------------------------------------------------------------------- models
def truncate_layers(model, layers: int) -> int:
    """Keep the first ``layers`` decoder layers of an mlx-lm Qwen3.5/3.6/Next model (0:
    all). Returns the count kept."""
    inner = _inner_model(model)
    full = list(inner.layers)
    if layers and layers < len(full):
        inner.layers = full[:layers]
    return len(inner.layers)


def _text_args(model):
    lm = getattr(model, "language_model", model)
    return getattr(lm, "args", getattr(model, "args", None))


def default_layers(model) -> int:
    """One full-attention cycle: ``full_attention_interval`` layers (4 when unknown)."""
    return int(getattr(_text_args(model), "full_attention_interval", 4) or 4)


def load_model(model: str | None = None, synthetic: str | None = None, layers: int = -1,
               seed: int = 0):
    """``(model, description)``: the checkpoint ``model`` loaded lazily with only its
    first ``layers`` layers evaluated (``-1``: ``default_layers``; 0: all), or a
    ``synthetic`` preset's model with that many layers (built only for them). A
    checkpoint's description holds the seconds of the lazy load (``lazy_load_s``) and of
    evaluating the kept weights (``eval_s``)."""
    import mlx.core as mx

    if (model is None) == (synthetic is None):
        raise ValueError("give exactly one of a checkpoint folder or a synthetic preset")
    if synthetic is not None:
        from . import synth

        tc = dict(synth.PRESETS[synthetic]) if synthetic in synth.PRESETS else None
        if tc is None:
            raise ValueError(f"unknown preset {synthetic!r}; choose from {sorted(synth.PRESETS)}")
        n = tc["full_attention_interval"] if layers < 0 else (layers or tc["num_hidden_layers"])
        k = tc["full_attention_interval"]
        tc["num_hidden_layers"] = n
        tc["layer_types"] = ["linear_attention" if (i + 1) % k else "full_attention"
                             for i in range(n)]
        m, _ = synth.build_model(tc, seed=seed)
        return m, {"kind": "synthetic", "preset": synthetic, "layers": n, "seed": seed,
                   "depth": int(synth.PRESETS[synthetic]["num_hidden_layers"])}
    from mlx_lm.utils import load_model as lm_load_model

    t0 = time.perf_counter()
    m = lm_load_model(Path(model), lazy=True)[0]
    depth = full_depth(m)
    n = truncate_layers(m, default_layers(m) if layers < 0 else layers)
    t1 = time.perf_counter()
    mx.eval(m.parameters())
    return m, {"kind": "path", "path": str(model), "layers": n, "depth": depth,
               "lazy_load_s": t1 - t0, "eval_s": time.perf_counter() - t1}


# ----------------------------------------------------------------------------- timing
def _sync_eval(x):
    import mlx.core as mx

    mx.eval(x)


def spread(times) -> float:
    """Timing noise of ``times`` (seconds, or ratios): the interquartile range over the
    median (with fewer than 4 samples: max - min over the median; 0 for one)."""
    med = statistics.median(times)
    if len(times) < 2 or med <= 0:
        return 0.0
    if len(times) < 4:
        return (max(times) - min(times)) / med
    q = statistics.quantiles(times, n=4)
    return (q[2] - q[0]) / med


def full_depth(model) -> int:
    """The decoder layers the checkpoint's config gives (``num_hidden_layers``), or the
    layers ``model`` holds when its config does not say."""
    n = getattr(_text_args(model), "num_hidden_layers", None)
    return int(n) if n else len(_inner_model(model).layers)


def _layer_path(model) -> list:
    """The child names from ``model`` down to the module holding its decoder layers
    (``["language_model", "model"]`` for Qwen3.5/3.6, ``["model"]`` for Qwen3-Next)."""
    path, cur = [], model
    for name in ("language_model", "model"):
        nxt = cur.get(name) if isinstance(cur, dict) else None
        if nxt is not None and hasattr(nxt, "layers"):
            path.append(name)
            cur = nxt
    return path


def _inner_model(model):
    """The module holding ``layers`` (mlx-lm's ``Qwen3_5TextModel`` / ``Qwen3NextModel``)."""
    for name in _layer_path(model):
        model = model[name]
    return model


def deep_view(model, depth: int):
    """A model running the decoder layers ``model`` holds repeated in order up to
    ``depth`` layers (layer ``i`` is loaded layer ``i mod n``), sharing every module and
    weight with ``model``: a decode step of the checkpoint's real depth for the memory of
    its first layers. Qualification times decode on it, so that a kernel's share of the
    step is what it is in the real model rather than drowned by the per-step costs that
    do not grow with depth (embedding, LM head, host work). Returns ``model`` itself when
    ``depth`` is not more than the layers it holds.

    ``model`` is an mlx-lm Qwen3.5/3.6/Next model; the view's own caches come from its
    ``make_cache()`` (one per layer of the view)."""
    import copy

    inner = _inner_model(model)
    layers = list(inner.layers)
    if depth <= len(layers):
        return model

    def shallow(m):
        c = copy.copy(m)  # the same children; a __dict__ of its own
        for k in [k for k in c.__dict__ if k.startswith("_lily")]:
            del c.__dict__[k]  # compiled steps and signatures belong to the original
        return c

    root = cur = shallow(model)
    for name in _layer_path(model):
        cur[name] = shallow(cur[name])
        cur = cur[name]
    cur.layers = [layers[i % len(layers)] for i in range(depth)]
    for k in ("_lily_prepared", "_lily_warm"):  # its layers are prepared with the original's
        if getattr(model, k, False):
            object.__setattr__(root, k, True)
    return root


def _step_token(i: int) -> int:
    """Token id of timed decode step ``i``: a fixed sequence (every op set decodes the same
    tokens), below 500 like ``first_contact.warmup_ids``."""
    return (11 + 37 * i) % 499 + 1


class DecodeRun:
    """One op set's decode state across timed rounds: its own cache holding a
    ``context``-token prefill, then steps fed a fixed token sequence (``_step_token``).
    ``start`` (under the set's settings) prefills and runs two untimed steps (a
    compiled step is traced there); ``decode_round`` times the next steps."""

    def __init__(self, model, context: int):
        self.model, self.context = model, int(context)
        self.cache = None
        self.steps = 0
        self.context_ms = self.first_ms = None

    def start(self) -> None:
        from .first_contact import warmup_ids

        self.cache = self.model.make_cache()
        t0 = time.perf_counter()
        _sync_eval(self.model(warmup_ids(self.context, seed=5), cache=self.cache))
        self.context_ms = 1e3 * (time.perf_counter() - t0)
        t0 = time.perf_counter()
        _sync_eval(self.step())
        self.first_ms = 1e3 * (time.perf_counter() - t0)
        _sync_eval(self.step())

    def step(self):
        import mlx.core as mx

        tok = mx.array([[_step_token(self.steps)]], dtype=mx.int32)
        self.steps += 1
        return self.model(tok, cache=self.cache)


def decode_round(run: DecodeRun, steps: int) -> float:
    """Mean ms per decode step over ``steps`` steps of ``run``, pipelined as mlx-lm's
    ``generate_step`` runs them (each step's graph built and queued with
    ``mx.async_eval`` while the GPU runs the one before; one wait at the end)."""
    import mlx.core as mx

    t0 = time.perf_counter()
    out = None
    for _ in range(steps):
        out = run.step()
        mx.async_eval(out)
    _sync_eval(out)
    return 1e3 * (time.perf_counter() - t0) / steps


def prefill_round(model, length: int) -> float:
    """ms of one ``length``-token prefill chunk on a fresh cache, evaluated."""
    from .first_contact import warmup_ids

    ids = warmup_ids(length, seed=6)
    cache = model.make_cache()
    t0 = time.perf_counter()
    _sync_eval(model(ids, cache=cache))
    return 1e3 * (time.perf_counter() - t0)


def batch_prompts(lengths, seed: int) -> list:
    """Token id lists of the given ``lengths``, varied and deterministic (``seed``), below
    500 like ``first_contact.warmup_ids``."""
    from .first_contact import warmup_ids

    return [warmup_ids(n, seed=seed + i)[0].tolist() for i, n in enumerate(lengths)]


def batch_parity(model, prompts, joining: int, join_after: int, tokens: int) -> dict:
    """``prompts`` (token id lists) each generated alone through mlx-lm's
    ``generate_step`` against the same prompts batched through ``BatchGenerator``, the
    last ``joining`` of them joining the running batch after ``join_after`` decode steps;
    ``tokens`` greedy tokens per row, under the current op set.

    Returns:
        ``{"ok": every row's tokens and every step's log-probabilities equal alone,
        "first_token_diff": [first differing token index per row, -1 none],
        "first_logprobs_diff_step": [per row, -1 none], "max_logprob_diff": [per row],
        "error": None or what differed}``.
    """
    import mlx.core as mx

    from .testing.generation import batch_greedy, batch_greedy_joining, greedy_trace

    alone = [greedy_trace(model, p, tokens) for p in prompts]
    lps: list = []
    n_first = len(prompts) - joining
    if joining:
        got = batch_greedy_joining(model, prompts[:n_first], prompts[n_first:],
                                   [tokens] * len(prompts), join_after=join_after,
                                   logprobs=lps)
    else:
        got = batch_greedy(model, prompts, [tokens] * len(prompts), logprobs=lps)
    tok_diff, lp_diff, lp_max = [], [], []
    for (a_toks, a_lps), b_toks, b_lps in zip(alone, got, lps):
        tok_diff.append(next((i for i, (x, y) in enumerate(zip(a_toks, b_toks)) if x != y),
                             -1 if len(a_toks) == len(b_toks) else min(len(a_toks), len(b_toks))))
        diffs = [float(mx.max(mx.abs(x.astype(mx.float32) - y.astype(mx.float32))))
                 for x, y in zip(a_lps, b_lps)]
        lp_diff.append(next((i for i, d in enumerate(diffs) if d != 0.0),
                            -1 if len(a_lps) == len(b_lps) else min(len(a_lps), len(b_lps))))
        lp_max.append(max(diffs, default=0.0))
    ok = all(d == -1 for d in tok_diff) and all(d == -1 for d in lp_diff)
    error = None if ok else (
        "a batched row differed from the prompt alone (first differing token per row "
        f"{tok_diff}, first differing log-probabilities step {lp_diff}, largest "
        f"difference {max(lp_max):.3g})")
    return {"ok": ok, "first_token_diff": tok_diff, "first_logprobs_diff_step": lp_diff,
            "max_logprob_diff": lp_max, "error": error}


def _batch_generator(model, prompts, max_tokens: int):
    """An mlx-lm ``BatchGenerator`` holding ``prompts`` (token id lists) as requests
    arriving together (``mlx_lm.server``'s path), each to stop after ``max_tokens``."""
    from .testing.generation import batch_generator

    gen = batch_generator(model, len(prompts))
    gen.insert([list(p) for p in prompts], [max_tokens] * len(prompts))
    return gen


class BatchDecodeRun:
    """One op set's batched decode through mlx-lm's ``BatchGenerator`` (``mlx_lm.server``'s
    path): ``prompts`` prefilled together by ``start`` (under the set's settings; the
    first token and two untimed steps follow, where a compiled step is traced), then
    ``batch_round`` times the next steps; ``steps`` bounds the steps it can take."""

    def __init__(self, model, prompts, steps: int):
        self.model, self.prompts, self.steps = model, prompts, int(steps)
        self.gen = None

    def start(self) -> None:
        self.gen = _batch_generator(self.model, self.prompts, self.steps + 8)
        for _ in range(3):
            self.gen.next_generated()

    def close(self) -> None:
        if self.gen is not None:
            self.gen.close()
            self.gen = None


def batch_round(run: BatchDecodeRun, steps: int) -> float:
    """Mean ms per batched decode step over ``steps`` steps of ``run`` (each one
    ``BatchGenerator.next_generated`` call: a step of every row, its tokens read back, as
    the server does)."""
    import mlx.core as mx

    t0 = time.perf_counter()
    for _ in range(steps):
        run.gen.next_generated()
    mx.synchronize()  # the step queued behind the last one read belongs to this round
    return 1e3 * (time.perf_counter() - t0) / steps


def batch_prefill_round(model, prompts) -> float:
    """ms a fresh ``BatchGenerator`` spends prefilling ``prompts`` (requests arriving
    together): its own prompt-processing time (``BatchGenerator.stats``, each prompt call
    evaluated), decode steps excluded."""
    gen = _batch_generator(model, prompts, 2)
    try:
        with gen.stats() as st:
            gen.next_generated()
        return 1e3 * st.prompt_time
    finally:
        gen.close()


def paired_rounds(arms, measure, rounds: int) -> tuple:
    """Times of two arms taken in alternation: ``rounds`` rounds, each arm once per round,
    in the order A B, B A, A B, ... (a drift of the machine's speed during the rounds
    weighs on both arms alike). ``arms`` are two context-manager factories (the op set
    and settings of each arm); ``measure(i)`` times arm ``i`` once inside its context.
    Returns ``(times of arm 0, times of arm 1)``."""
    out = ([], [])
    for r in range(rounds):
        for i in ((0, 1) if r % 2 == 0 else (1, 0)):
            with arms[i]():
                out[i].append(measure(i))
    return out


def ratio_stats(base_times, kernel_times) -> tuple:
    """``(speed-up, its relative standard error)`` of paired timings: the median over the
    rounds of base / kernel, and ``median_rel_se`` of those ratios' ``spread``."""
    ratios = [b / k for b, k in zip(base_times, kernel_times) if k > 0]
    if not ratios:
        return None, 0.0
    return statistics.median(ratios), median_rel_se(spread(ratios), len(ratios))


# ----------------------------------------------------------------------------- variants
def variants_of(op: str, backend: str | None = None,
                decode_context: int | None = None) -> dict:
    """``{variant: settings}`` qualified for ``op`` on ``backend`` (default: the current
    one): ``"default"`` (no settings: the shipped choice) and ``VARIANTS.get(op)``'s as
    ``variants.for_backend`` keeps them there (no Metal-only variant elsewhere, none equal
    to the backend's default), each a dict of environment variables (``MLX_LILY_*`` name
    -> value; None: unset) the variant runs under. Given the ``decode_context`` a
    qualification decodes at, variants that only act at longer contexts are left out."""
    from .variants import for_backend

    be = backend or _backend.current_backend()
    out = {DEFAULT_VARIANT: {}}
    out.update({k: dict(v) for k, v in for_backend(be, VARIANTS, decode_context).get(op, {}).items()})
    return out


@contextlib.contextmanager
def variant_settings(settings: dict):
    """Within this block the environment holds ``settings`` (name -> value; None: unset);
    the previous values come back after. ``mlx_lily.config`` / ``tuning`` read the
    environment at use (frozen only within one forward), so the next forward sees them.
    Compiled decode steps are keyed by every variant knob (``variants.KNOB_NAMES``), so
    switching variants back and forth replays each one's own traces; settings naming any
    other variable drop the compiled steps on entry and on exit, so no graph traced
    under other settings is replayed."""
    if not settings:
        yield
        return
    from .patches import decode_graph
    from .variants import KNOB_NAMES

    saved = {k: os.environ.get(k) for k in settings}
    unkeyed = any(k not in KNOB_NAMES for k in settings)

    def put(values):
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = str(v)

    if unkeyed:
        decode_graph.drop_compiled_steps()
    try:
        put(settings)
        yield
    finally:
        put(saved)
        if unkeyed:
            decode_graph.drop_compiled_steps()


# ----------------------------------------------------------------------------- the run
def _candidates(backend: str) -> list:
    from . import first_contact, kernels

    with kernels.only_ops(_backend.OP_NAMES):
        return first_contact.active_ops(backend)


def _fp32_logits(model, prompt_len, prefill_len, seed):
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    from .first_contact import forward_logits

    saved = tree_flatten(model.parameters())
    try:
        model.set_dtype(mx.float32)
        return forward_logits(model, prompt_len, prefill_len, seed=seed)
    finally:
        model.update(tree_unflatten(saved))


def _distance(ref, x):
    import mlx.core as mx

    scale = max(float(mx.abs(ref).max().item()), 1e-30)
    return (float(mx.abs(x - ref).max().item()) / scale,
            float((ref.argmax(-1) == x.argmax(-1)).astype(mx.float32).mean().item()))


class _Ledger:
    """Exclusive wall seconds, model forwards (calls of the model) and compiled decode-step
    traces (``decode_graph.TRACES``) per phase of one qualification."""

    def __init__(self):
        self.t0 = self._mark = time.perf_counter()
        self._mark_traces = self._traces_now()
        self.seconds: dict = {}
        self.forwards: dict = {}
        self.traces: dict = {}
        self.parity_forwards = 0  # probed parity forwards (short prefill, step, prefill)
        self.timed_sets = 0  # op sets (with their variants' settings) timed
        self.phases_reused: dict = {}  # phase -> timed sets that reused the base's time
        self._stack: list = []

    @staticmethod
    def _traces_now() -> int:
        from .patches import decode_graph

        return decode_graph.TRACES[0]

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def _charge(self) -> None:
        now, tr = time.perf_counter(), self._traces_now()
        if self._stack:
            top = self._stack[-1]
            self.seconds[top] = self.seconds.get(top, 0.0) + now - self._mark
            self.traces[top] = self.traces.get(top, 0) + tr - self._mark_traces
        self._mark, self._mark_traces = now, tr

    @contextlib.contextmanager
    def phase(self, name: str):
        self._charge()
        self._stack.append(name)
        try:
            yield
        finally:
            self._charge()
            self._stack.pop()

    def count_forward(self) -> None:
        top = self._stack[-1] if self._stack else "other"
        self.forwards[top] = self.forwards.get(top, 0) + 1

    def summary(self) -> dict:
        return {"phases": {k: round(v, 3) for k, v in self.seconds.items()},
                "counts": {"forwards": dict(self.forwards), "traces": dict(self.traces),
                           "parity_forwards": self.parity_forwards,
                           "timed_sets": self.timed_sets,
                           "phases_reused": dict(self.phases_reused)}}


class _Counted:
    """``model`` with each call counted in a ``_Ledger``."""

    def __init__(self, model, ledger: _Ledger):
        self._model, self._ledger = model, ledger

    def __call__(self, *args, **kwargs):
        self._ledger.count_forward()
        return self._model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._model, name)


class _Parity:
    """The parity check of an op set (module docstring, step 1) against the references'
    logits ``ref``; the fp32 anchor is computed on first need only."""

    def __init__(self, model, ledger, ref, prompt_len, prefill_len, seed):
        self.model, self.ledger, self.ref = model, ledger, ref
        self.counted = _Counted(model, ledger)
        self.args = (prompt_len, prefill_len, seed)
        self.truth = None

    def _anchor(self):
        if self.truth is None:
            from . import kernels

            with self.ledger.phase("fp32"), kernels.only_ops(()), \
                    _backend.compile_suspended():
                p, n, seed = self.args
                self.truth = _fp32_logits(_Counted(self.model, self.ledger), p, n, seed)
                self.ref_d, self.ref_t = _distance(self.truth, self.ref)
        return self.truth

    def check(self, opset, settings=None) -> dict:
        """``{"ok", "agreement", "fault" (op whose launch failed, or None), "error",
        "launched" ({op: {kernel: launches}})}`` for the probed, NaN-poisoned forward with
        exactly ``opset`` allowed, under ``settings`` (``variant_settings``)."""
        from . import first_contact, kernels

        p, n, seed = self.args
        self.ledger.parity_forwards += 1
        with variant_settings(settings or {}), kernels.only_ops(opset):
            try:
                with first_contact.probing(poison=True) as probe:
                    got = first_contact.forward_logits(self.counted, p, n, seed=seed)
            except first_contact.KernelFault as f:
                return {"ok": False, "agreement": None, "fault": f.op, "error": str(f),
                        "launched": {}}
        launched: dict = {}
        for (op, k), c in probe.launched.items():
            launched.setdefault(op, {})[k] = c
        a = first_contact.agree(got, self.ref)
        ok = bool(a["ok"] and a["rel"] <= REL_TOL)
        if a["ok"] and not ok:
            truth = self._anchor()
            d, t = _distance(truth, got)
            a.update({"rel_to_fp32": d, "top1_vs_fp32": t,
                      "reference_rel_to_fp32": self.ref_d,
                      "reference_top1_vs_fp32": self.ref_t})
            ok = parity_ok(a, d, self.ref_d, t, self.ref_t)
        error = None
        if not ok:
            error = ("non-finite logits" if not a["finite"] else
                     f"logits off the reference (correlation {a['correlation']:.3f}, max "
                     f"|diff| {a['rel']:.3f} of the logit scale)")
        return {"ok": ok, "agreement": a, "fault": None, "error": error, "launched": launched}


PHASES = ("decode", "prefill")


def launch_census(model, opset, settings, *, context: int = DECODE_CONTEXT,
                  prefill_len: int = PREFILL_LEN) -> dict | None:
    """``{"decode": Counter, "prefill": Counter}`` of the kernel launches
    (``first_contact.launch_key``) the timed work makes with exactly ``opset`` allowed,
    under ``settings``: two decode steps after a ``context``-token prefill (the decode
    steps through the compiled path's Python, untraced: ``first_contact.census``) and a
    ``prefill_len``-token prefill, built and not evaluated. None when building failed."""
    from . import first_contact, kernels

    try:
        with variant_settings(settings), kernels.only_ops(opset), \
                first_contact.census() as keys:
            cache = model.make_cache()
            ids = first_contact.warmup_ids(context, seed=5)
            model(ids, cache=cache)
            n0 = len(keys)
            for _ in range(2):
                model(ids[:, -1:], cache=cache)
            n1 = len(keys)
            model(first_contact.warmup_ids(prefill_len, seed=6), cache=model.make_cache())
            return {"decode": Counter(keys[n0:n1]), "prefill": Counter(keys[n1:])}
    except Exception:  # noqa: BLE001  (no census: every phase is timed)
        return None


#: The record's error for an op variant whose launches equal the set's without it
NO_LAUNCH_DIFFERS = ("not timed: no kernel launch differs from the set without it at these "
                     "shapes")


def census_counts(census: dict | None) -> dict | None:
    """``{phase: launches}`` of a ``launch_census`` result (None stays None): what the
    record keeps of it."""
    return None if census is None else {ph: sum(n.values()) for ph, n in census.items()}


def same_phases(census: dict | None, base: dict | None) -> set:
    """The phases whose launches ``census`` and ``base`` share exactly (none when either
    is unknown): there the op set's work is the base set's, and it is not timed again."""
    if census is None or base is None:
        return set()
    return {ph for ph in PHASES if census[ph] == base[ph]}


def _blank(base_ms=None) -> dict:
    return {"passed": False, "faster": False, "error": None, "agreement": None,
            "launched": None, "kernel_ms": None, "base_ms": base_ms, "speedup": None,
            "timing": None}


def _ordered(ops) -> list:
    s = set(ops)
    return [op for op in _backend.OP_NAMES if op in s]


def qualify_model(model, *, ops=None, decode_steps: int = DECODE_STEPS,
                  decode_rounds: int = DECODE_ROUNDS, decode_context: int = DECODE_CONTEXT,
                  prefill_len: int = PREFILL_LEN, parity_prefill: int = PARITY_PREFILL,
                  prefill_reps: int = PREFILL_REPS, depth: int | None = None,
                  seed: int | None = None, progress=None,
                  method: str = DEFAULT_METHOD, checkpoint=None) -> dict:
    """Qualify every op (or ``ops``) in each of its variants (``variants_of``) on the
    current backend with ``model`` (an unpatched mlx-lm model; patched, forced, while
    this runs). Decode is timed on ``deep_view(model, depth)`` (None: ``model`` as it
    is), parity and prefill on ``model``. Returns the result part of a record: ``{"ops":
    {op: {variant: result}}, "qualified": {op: variant}, "overall": {...},
    "first_contact": report, "phases": {phase: seconds}, "counts": {...}, "method": str,
    "seconds": float}``. ``progress`` gets one line per step (with the seconds
    elapsed). ``checkpoint``, when given, gets the result as it stands before the batch
    phase (``batch_decode`` not qualified, its error "the batch phase did not finish"):
    a child that dies or runs out of time in that phase leaves the rest of its result."""
    import mlx.core as mx

    import mlx_lily

    from . import first_contact, kernels, registry

    if method not in METHODS:
        raise ValueError(f"qualify_model: method {method!r} is not one of {METHODS}")
    led = _Ledger()
    blind = {n for n in registry.NAMES if not registry.get(n).own_kernels}  # census-blind
    say = (lambda msg: progress(f"{msg} ({led.elapsed():.1f} s)")) if progress else (
        lambda msg: None)
    be = _backend.current_backend()
    seed = int(time.time()) % 100000 if seed is None else seed
    prompt_len = first_contact.PROMPT_LEN
    if mlx_lily.is_patched():
        raise RuntimeError("qualify_model needs an unpatched mlx-lm to time stock")
    counted = _Counted(model, led)
    deep = deep_view(model, depth) if depth else model
    timed_depth = len(_inner_model(deep).layers)
    counted_deep = counted if deep is model else _Counted(deep, led)
    def compare(base_arm, kernel_arm, phases) -> dict:
        """Paired rounds (``paired_rounds``) of the two arms in ``phases``: ``{"base_ms",
        "kernel_ms" (medians over the rounds), "speedup", "noise" (``ratio_stats``),
        "timing"}``; phases not timed are left out. Each arm decodes on a fresh cache
        (the same context, the same tokens)."""
        t = time.perf_counter()
        arms = (base_arm, kernel_arm)
        detail: dict = {}
        times: dict = {}
        if "decode" in phases:
            runs = [DecodeRun(counted_deep, decode_context) for _ in arms]
            for run, arm in zip(runs, arms):
                with arm():
                    run.start()
            times["decode"] = paired_rounds(
                arms, lambda i: decode_round(runs[i], decode_steps), decode_rounds)
            detail.update(decode_first_ms=runs[1].first_ms, context_ms=runs[1].context_ms,
                          base_decode_first_ms=runs[0].first_ms,
                          base_context_ms=runs[0].context_ms)
        if "prefill" in phases:
            for arm in arms:  # untimed first chunks
                with arm():
                    prefill_round(counted, prefill_len)
            times["prefill"] = paired_rounds(
                arms, lambda i: prefill_round(counted, prefill_len), prefill_reps)
        out = {"base_ms": {}, "kernel_ms": {}, "speedup": {}, "noise": {}}
        for ph, (b, k) in times.items():
            out["base_ms"][ph] = statistics.median(b)
            out["kernel_ms"][ph] = statistics.median(k)
            out["speedup"][ph], out["noise"][ph] = ratio_stats(b, k)
            detail[f"{ph}_rounds"] = {"base": b, "kernel": k}
        led.timed_sets += 1
        for ph in PHASES:
            if ph not in phases:
                led.phases_reused[ph] = led.phases_reused.get(ph, 0) + 1
        detail["reused"] = sorted(set(PHASES) - set(phases))
        detail["seconds"] = time.perf_counter() - t
        out["timing"] = detail
        return out

    def arm(opset, env):
        @contextlib.contextmanager
        def enter():
            with variant_settings(env), kernels.only_ops(_ordered(opset)):
                yield
        return enter

    def speed_note(c) -> str:
        return " ".join(f"{k} x{s:.3f}" for k, s in (c.get("speedup") or {}).items())

    results: dict = {}
    cands = [op for op in _candidates(be) if ops is None or op in ops]
    overall = {"stock_ms": None, "reference_ms": None, "qualified_ms": None,
               "speedup_vs_stock": None, "timing": {}}
    with mlx_lily.patched(force=True):
        from . import patching

        say("warm-up and first contact")
        with led.phase("warmup"), kernels.only_ops(ops or _backend.OP_NAMES):
            model._lily_warm = True  # prepare only; the warm-up follows here
            mlx_lily.prepare_model(model)  # fused projections
            if deep is not model:
                object.__setattr__(deep, "_lily_prepared", True)
                object.__setattr__(deep, "_lily_warm", True)
            patching.last_warmup.clear()
            patching.warmup(model)  # CUDA: compiled ahead of time; first contact
            fc = patching.last_warmup.get("first_contact")
            if fc is None:  # a warm-up that ran no first contact (tests stub it)
                fc = first_contact.check(model, prefill_len=parity_prefill)
        say("references' logits")
        with led.phase("reference"), kernels.only_ops(()):
            with _backend.compile_suspended():  # eager, as the probed forwards run
                ref = first_contact.forward_logits(counted, prompt_len, parity_prefill,
                                                   seed=seed)
        parity = _Parity(model, led, ref, prompt_len, parity_prefill, seed)
        pending = []
        for op in cands:
            results[op] = {name: _blank() for name in variants_of(op, be, decode_context)}
            off = kernels.runtime_disabled().get(op)
            if not registry.get(op).one_sequence:
                for r in results[op].values():
                    r["error"] = ("serves decode steps of several sequences: the batch "
                                  "phase, after the one-sequence ops, decides it")
            elif off is not None:
                for r in results[op].values():
                    r["error"] = off
            else:
                pending.append(op)
        say(f"parity of {len(pending)} ops together (a failing set is bisected)")
        with led.phase("parity"):
            good, verdict, failed = first_contact.passing_set(pending, parity.check)
            for op in good:
                r = results[op][DEFAULT_VARIANT]
                r.update(passed=True, agreement=verdict["agreement"],
                         launched=verdict["launched"].get(op, {}), parity_set=list(good))
            for op, v in failed.items():
                r = results[op][DEFAULT_VARIANT]
                r.update(error=v["error"], agreement=v["agreement"],
                         launched=v["launched"].get(op, {}))
            for op in pending:  # other variants: the passing set with this op's variant
                for name, settings in variants_of(op, be, decode_context).items():
                    if name == DEFAULT_VARIANT:
                        continue
                    opset = _ordered(set(good) | {op})
                    v = parity.check(opset, settings)
                    results[op][name].update(passed=v["ok"], agreement=v["agreement"],
                                             error=v["error"], settings=settings,
                                             launched=v["launched"].get(op, {}),
                                             parity_set=opset)
        n_var = sum(len(v) for v in results.values())
        say(f"parity: {len(good)} of {len(pending)} ops passed"
            + (f", failed: {', '.join(failed)}" if failed else "")
            + f" ({led.parity_forwards} probed forwards for {n_var} op variants)")
        kept: list = []
        chosen: dict = {}
        chains: list = []
        timed = [op for op in pending if any(r["passed"] for r in results[op].values())]
        if timed:
            say(f"timing: decode steps of {timed_depth} layers, {decode_rounds} paired rounds "
                f"of {decode_steps} steps; {prefill_len}-token prefill chunks, "
                f"{prefill_reps} paired rounds")
        last_ms: dict = {}  # the base set's latest time per phase (for phases not timed)

        def env_of(opset):
            env: dict = {}
            for o in opset:
                env.update(variants_of(o, be, decode_context)[chosen[o]])
            return env

        def fill(c, same, times=None):
            """A phase not timed keeps the base set's latest time (``times``, default the
            greedy pass's ``last_ms``), speed-up 1."""
            times = last_ms if times is None else times
            for ph in same:
                if ph in times:
                    c["kernel_ms"][ph] = c["base_ms"][ph] = times[ph]
                c["speedup"][ph], c["noise"][ph] = 1.0, 0.0
            if overall["reference_ms"] is None and not kept:
                overall["reference_ms"] = dict(c["base_ms"])
            last_ms.update(c["base_ms"])

        base_census = {ph: Counter() for ph in PHASES}  # no kernel launches at all

        def census_of(opset, settings):
            """``launch_census``, with one mark per phase for each op of ``opset`` whose
            work is MLX's own ops (no Lily launch to see): adding or removing one always
            changes the census, so it is timed."""
            with led.phase("census"):
                c = launch_census(counted, opset, settings, context=decode_context,
                                  prefill_len=prefill_len)
            for o in sorted(blind & set(opset)) if c is not None else ():
                for ph in PHASES:
                    c[ph][f"MLX ops of {o}"] += 1
            return c

        def pruned_chain(seed, pool, kept, env):
            """``dependent_chain`` without the dependents that change no launch here (a
            switch for batches, at one sequence): they would serve untimed. Returns
            (chain, its census)."""
            exclude: set = set()
            while True:
                chain = dependent_chain(seed, pool, kept, first_contact.requires, exclude)
                if len(chain) < 2:
                    return chain, None
                assert seed in chain
                census = census_of(_ordered(kept + chain), env)
                for m in reversed([o for o in chain if o != seed]):
                    if any(m in first_contact.requires(o) for o in chain if o != m):
                        continue  # another member needs it
                    rest = [o for o in chain if o != m]
                    if same_phases(census_of(_ordered(kept + rest), env),
                                   census) == set(PHASES):
                        exclude.add(m)
                        break
                else:
                    return chain, census

        def top_down():
            """``TOP_DOWN``: the whole passing set (``whole_set``, default variants)
            against the references, then each member (last in ``OP_NAMES`` first: fusions
            before the ops they need), in each of its passing variants, against the set
            without it and the members that require it; those leave together unless a
            variant is faster (the fastest such variant stays, ``decide``). Last, a member
            that nothing requires and whose launches the kept variants made moot leaves."""
            nonlocal kept, chosen
            req = first_contact.requires
            passed = [o for o in timed if results[o][DEFAULT_VARIANT]["passed"]]
            for o in timed:
                if o not in passed:
                    for r in results[o].values():
                        if r["passed"]:
                            r["error"] = ("not timed: the top-down method starts from the "
                                          "default variants, and this op's did not pass")
            whole = whole_set(passed, req, lambda ops: census_of(_ordered(ops), {}))
            for o in passed:
                if o not in whole:
                    results[o][DEFAULT_VARIANT]["error"] = (
                        "not timed: a requirement did not pass, or no kernel launch differs "
                        "with the whole passing set on")
            if not whole:
                return
            cur = list(whole)
            chosen = {o: DEFAULT_VARIANT for o in cur}
            c = compare(arm([], {}), arm(cur, {}), list(PHASES))
            fill(c, ())
            overall["whole_set"] = {"ops": list(cur), "base_ops": [], **c,
                                    "faster": faster_speedup(c["speedup"], c["noise"])}
            say(f"whole passing set ({len(cur)} ops, default variants) against the "
                f"references: {speed_note(c)}")
            cur_ms = dict(c["kernel_ms"])  # the current set's times, for phases not timed

            def leave(ops, why):
                for o in ops:
                    r = results[o][chosen.get(o, DEFAULT_VARIANT)]
                    r["error"], r["faster"] = why(o), False
                    chosen.pop(o, None)

            order = list(reversed(cur))
            for i, op in enumerate(order):
                if op not in cur:
                    continue  # left already, with an op it requires
                drop = with_dependents(op, cur, req)
                rest = [o for o in cur if o not in drop]
                base_env = env_of(rest)
                without = census_of(rest, base_env)
                notes, without_ms = [], None
                for name, settings in variants_of(op, be, decode_context).items():
                    r = results[op][name]
                    if not r["passed"]:
                        continue
                    chosen[op] = name
                    env = env_of(cur)
                    full = census_of(cur, env)
                    same = same_phases(full, without)
                    r["census"] = census_counts(full)
                    if same == set(PHASES):
                        r["error"] = NO_LAUNCH_DIFFERS
                        notes.append(f"{name} changes no launch")
                        continue
                    c = compare(arm(rest, base_env), arm(cur, env),
                                [ph for ph in PHASES if ph not in same])
                    fill(c, same, cur_ms)  # not timed: the same work as the current set's
                    r.update(c)
                    r["faster"] = faster_speedup(c["speedup"], c["noise"])
                    without_ms = c["base_ms"]
                    notes.append(f"{name} {speed_note(r)}")
                best = decide({op: results[op]}).get(op)
                others = [o for o in drop if o != op]
                say(f"[{i + 1}/{len(order)}] {op}"
                    + (f" (leaves with {', '.join(others)})" if others else "")
                    + f": {'; '.join(notes)} -> {best or 'left out'}")
                if best is not None:
                    chosen[op] = best
                    cur_ms.update(results[op][best]["kernel_ms"])
                    continue
                chosen[op] = DEFAULT_VARIANT
                results[op][DEFAULT_VARIANT]["error"] = (
                    results[op][DEFAULT_VARIANT].get("error")
                    or "left out: not faster in the set")
                chosen.pop(op)
                leave(others, lambda o: f"left out with {op}, which it requires")
                cur = rest
                if without_ms:
                    cur_ms.update(without_ms)
            # a variant kept late (a global knob) can make an earlier member's launches moot
            full = census_of(cur, env_of(cur))
            for m in reversed(list(cur)):
                if full is None or any(m in req(o) for o in cur if o != m):
                    continue
                rest = [o for o in cur if o != m]
                if rest and same_phases(census_of(rest, env_of(rest)), full) == set(PHASES):
                    say(f"{m}: no launch of its own under the variants kept -> left out")
                    leave([m], lambda o: "left out: no kernel launch of its own under the "
                                         "variants kept")
                    cur = rest
            kept = _ordered(cur)

        def greedy():
            """Ops one at a time in ``OP_NAMES`` order, then chains, then the whole
            passing set and its leave-one-out (the module docstring, step 2)."""
            nonlocal kept, chosen, base_census
            for i, op in enumerate(timed):
                missing = [q for q in first_contact.requires(op) if q not in kept]
                if missing:
                    for r in results[op].values():
                        if r["passed"]:
                            r["error"] = (f"not timed: requires {', '.join(missing)}, "
                                          "not qualified")
                    say(f"[{i + 1}/{len(timed)}] {op}: skipped (requires "
                        f"{', '.join(missing)})")
                    continue
                notes = []
                for name, settings in variants_of(op, be, decode_context).items():
                    r = results[op][name]
                    if not r["passed"]:
                        continue
                    env = {**env_of(kept), **settings}
                    r["census"] = census_of(kept + [op], env)
                    same = same_phases(r["census"], base_census)
                    if same == set(PHASES):
                        r["error"] = NO_LAUNCH_DIFFERS
                        notes.append(f"{name} changes no launch")
                        continue
                    c = compare(arm(kept, env_of(kept)), arm(kept + [op], env),
                                [ph for ph in PHASES if ph not in same])
                    fill(c, same)
                    r.update(c)
                    r["faster"] = faster_speedup(r["speedup"], r["noise"])
                    notes.append(f"{name} {speed_note(r)}"
                                 + (f" (first step {r['timing']['decode_first_ms']:.0f} ms)"
                                    if r["timing"].get("decode_first_ms") is not None else "")
                                 + "".join(f" ({ph}: same launches, not timed)"
                                           for ph in sorted(same)))
                best = decide({op: results[op]}).get(op)
                say(f"[{i + 1}/{len(timed)}] {op}: {'; '.join(notes)} -> "
                    f"{best or 'not faster'}")
                if best is not None:
                    kept.append(op)
                    chosen[op] = best
                    last_ms.update(results[op][best]["kernel_ms"])
                    base_census = results[op][best]["census"]
                for r in results[op].values():  # counts in the record, not the Counters
                    if r.get("census") is not None:
                        r["census"] = census_counts(r["census"])
            # ops that pay off only together: an op not kept alone (an enabler, e.g.
            # attention for its packed fusion and the batched step) is timed with the
            # ops that require it
            tried: set = set()
            for op in timed:
                if op in kept or not results[op][DEFAULT_VARIANT]["passed"]:
                    continue
                pool = [o for o in timed if results[o][DEFAULT_VARIANT]["passed"]]
                env = env_of(kept)
                chain, census = pruned_chain(op, pool, kept, env)
                if len(chain) < 2 or frozenset(chain) in tried:
                    continue
                tried.add(frozenset(chain))
                c = {"seed": op, "ops": chain, "base_ms": None, "kernel_ms": None,
                     "speedup": None, "faster": False, "error": None}
                chains.append(c)
                same = same_phases(census, base_census)
                if same == set(PHASES):
                    c["error"] = "not timed: no kernel launch differs from the set without it"
                else:
                    c.update(compare(arm(kept, env), arm(_ordered(kept + chain), env),
                                     [ph for ph in PHASES if ph not in same]))
                    fill(c, same)
                    c["faster"] = faster_speedup(c["speedup"], c["noise"])
                c["census"] = census_counts(census)
                say(f"chain {'+'.join(chain)}: " + (c["error"] or speed_note(c))
                    + (" -> kept" if c["faster"] else " -> not faster"))
                if c["faster"]:
                    for o in chain:
                        chosen[o] = DEFAULT_VARIANT
                        results[o][DEFAULT_VARIANT]["error"] = (
                            f"qualified in the chain {'+'.join(chain)} (not alone)")
                    kept = _ordered(kept + chain)
                    last_ms.update(c["kernel_ms"])
                    base_census = census
            # the one-at-a-time pass can miss a set whose ops pay off together in ways no
            # chain covers (a variant kept early, e.g. a global setting, can make later
            # fusions moot): the whole passing set in default variants is timed against it
            whole = whole_set([o for o in timed if results[o][DEFAULT_VARIANT]["passed"]],
                              first_contact.requires,
                              lambda ops: census_of(_ordered(ops), {}))
            if whole and set(whole) != set(kept):
                w = {"ops": whole, "base_ops": list(kept), "faster": False}
                c = compare(arm(kept, env_of(kept)), arm(whole, {}), list(PHASES))
                w.update(c)
                w["faster"] = faster_speedup(c["speedup"], c["noise"])
                overall["whole_set"] = w
                say(f"whole passing set ({len(whole)} ops, default variants) against the "
                    f"set kept ({len(kept)} ops): {speed_note(c)} -> "
                    + ("kept instead" if w["faster"] else "not faster"))
                if w["faster"]:
                    for o in whole:
                        if o not in kept or chosen.get(o) != DEFAULT_VARIANT:
                            results[o][DEFAULT_VARIANT]["error"] = (
                                "qualified in the whole passing set (faster than the ops "
                                "kept one at a time)")
                    kept = list(whole)
                    chosen = {o: DEFAULT_VARIANT for o in whole}
                    # each op of it that nothing in it requires and that was not shown
                    # faster (alone or in a chain) is timed once more against the set
                    # without it, and leaves when that is faster
                    shown = ({o for o, v in results.items()
                              if any(r.get("faster") for r in v.values())}
                             | {o for c in chains if c["faster"] for o in c["ops"]})
                    w["leave_one_out"] = []
                    for o in reversed(whole):
                        if o in shown or any(o in first_contact.requires(x)
                                             for x in kept if x != o):
                            continue
                        rest = [x for x in kept if x != o]
                        c = compare(arm(kept, {}), arm(rest, {}), list(PHASES))
                        out = faster_speedup(c["speedup"], c["noise"])
                        w["leave_one_out"].append({"op": o, "speedup": c["speedup"],
                                                   "noise": c["noise"], "left": out})
                        say(f"whole set without {o}: {speed_note(c)} -> "
                            + ("left out" if out else "kept"))
                        if out:
                            results[o][DEFAULT_VARIANT]["error"] = (
                                "left out of the whole passing set (faster without it)")
                            kept = rest
                            chosen.pop(o)

        with led.phase("timing"):
            if method == TOP_DOWN:
                top_down()
            else:
                greedy()
        with led.phase("final"):
            if kept:
                say(f"final check of the qualified set ({len(kept)} ops)")
                v = parity.check(kept, env_of(kept))
                if not v["ok"]:  # a base op its fusion had hidden from the first check
                    good2, _, failed2 = first_contact.passing_set(
                        kept, lambda s: parity.check(s, env_of(s)))
                    for op, w in failed2.items():
                        results[op][chosen[op]].update(
                            passed=False, faster=False, error=f"final check: {w['error']}")
                    kept = good2
                    overall["final_check_failed"] = sorted(failed2)
                    kept = unchained(kept, chains, results, chosen)
    if kept:  # the qualified set against unpatched mlx-lm, rounds alternating
        say(f"timing the qualified set against stock mlx-lm ({len(kept)} ops)")
        env = env_of(kept)

        @contextlib.contextmanager
        def lily():
            with mlx_lily.patched(force=True), variant_settings(env), kernels.only_ops(kept):
                yield

        with led.phase("final"):
            c = compare(contextlib.nullcontext, lily, list(PHASES))
        overall.update(stock_ms=c["base_ms"], qualified_ms=c["kernel_ms"],
                       speedup_vs_stock=c["speedup"], noise_vs_stock=c["noise"])
        overall["timing"]["qualified"] = c["timing"]
    qualified = {op: chosen[op] for op in kept}
    sp = overall["speedup_vs_stock"]
    # against stock a qualified set may lose SLOWER_TOL only, whatever the noise
    if qualified and sp and min(sp.values()) < 1 - SLOWER_TOL:
        overall["dropped"] = sorted(qualified)
        qualified = {}
    def result() -> dict:
        return {"ops": results, "qualified": dict(qualified), "overall": overall,
                "chains": chains, "first_contact": {k: v for k, v in fc.items()
                                                    if k != "launched"},
                **led.summary(),
                "settings": {"decode_steps": decode_steps, "decode_rounds": decode_rounds,
                             "decode_context": decode_context, "depth": timed_depth,
                             "prefill_len": prefill_len, "parity_prefill": parity_prefill,
                             "prefill_reps": prefill_reps, "seed": seed, "method": method},
                "method": (f"model-level: parity of the forward with every candidate op on "
                           "vs every kernel off (NaN-poisoned outputs, fresh random ids), a "
                           "failing set bisected; "
                           + ("each op on vs off (ops kept before it on in both) timed in "
                              if method == GREEDY else
                              "the whole passing set, then each member on (in each passing "
                              "variant) vs off with the members that require it, the rest "
                              "of the set on in both, timed in ")
                           + "alternating paired rounds: pipelined decode steps "
                           f"of the model at {timed_depth} layers (its loaded layers "
                           "repeated) and prefill chunks, speed-up = the median per-round "
                           "ratio; "
                           + ("an op not kept alone timed again with the ops that require "
                              "it; " if method == GREEDY else "")
                           + "the qualified set checked and timed against stock the same "
                           "way; batch_decode: a prompt alone vs batched through "
                           "BatchGenerator (two joining; one length) bit for bit, then "
                           "batched decode steps and prefills with vs without it in paired "
                           "rounds"),
                "seconds": led.elapsed()}

    if "batch_decode" in results:
        r = results["batch_decode"][DEFAULT_VARIANT]
        need = [o for o in first_contact.requires("batch_decode") if o not in qualified]
        off = kernels.runtime_disabled().get("batch_decode")
        if off is not None:
            r["error"] = off
        elif need:
            r["error"] = (f"batch phase not run: it requires {', '.join(need)}, which did "
                          "not qualify")
        else:
            r["error"] = "the batch phase did not finish"
            if checkpoint is not None:  # kept if the phase never returns (crash, time limit)
                try:
                    checkpoint(result())
                except Exception as e:  # noqa: BLE001  (no checkpoint: the phase still runs)
                    say(f"could not save the result before the batch phase ({e!r})")
            with mlx_lily.patched(force=True), led.phase("batch"):
                _batch_phase(model, deep, r, arm, list(kept), env_of(kept),
                             steps=decode_steps, rounds=decode_rounds,
                             prefill_len=prefill_len, prefill_reps=prefill_reps,
                             prompt_len=prompt_len, seed=seed, led=led, say=say)
            if r["passed"] and r["faster"]:
                qualified["batch_decode"] = DEFAULT_VARIANT
    say(f"qualified {len(qualified)} of {len(cands)} ops"
        + (f"; vs stock: {' '.join(f'{k} x{s:.3f}' for k, s in sp.items())}" if sp else "")
        + ("; slower than stock: Lily steps aside" if overall.get("dropped") else ""))
    mx.clear_cache()
    return result()


def _batch_phase(model, deep, r: dict, arm, kept: list, env: dict, *, steps: int,
                 rounds: int, prefill_len: int, prefill_reps: int, prompt_len: int,
                 seed: int, led, say) -> None:
    """The batch phase of ``qualify_model`` for ``batch_decode`` (module docstring, 4.):
    fills ``r`` (its result: ``passed``, ``agreement`` = ``{"one_sequence",
    "joining", "equal"}`` verdicts, ``faster``, ``kernel_ms`` / ``base_ms`` /
    ``speedup`` / ``noise`` per timed phase, ``error``). ``arm(opset, env)`` makes an op
    set's context (``qualify_model``'s); ``kept`` is the qualified one-sequence set,
    ``env`` its variants' settings. Parity runs on the patched ``model`` (its loaded
    layers), batched decode timing on ``deep`` (those layers repeated to the model's
    depth), prefill timing on ``model``."""
    from . import first_contact, kernels
    from .ops import moe_router_topk

    on = _ordered(kept + ["batch_decode"])
    r.update(error=None, settings=env, parity_set=on)
    verdicts: dict = {}
    try:
        # the switch also lifts the router kernel's row limit for a prompt alone: the
        # one-sequence parity, with a prefill past that limit
        long = 2 * moe_router_topk.MAX_ROWS + 1
        with kernels.only_ops(()), _backend.compile_suspended():
            ref = first_contact.forward_logits(model, prompt_len, long, seed=seed)
        v = _Parity(model, led, ref, prompt_len, long, seed).check(on, env)
        verdicts["one_sequence"] = {k: v[k] for k in ("ok", "agreement", "error", "launched")}
        with arm(on, env)():
            verdicts["joining"] = batch_parity(model, batch_prompts(BATCH_PROMPTS, seed),
                                               BATCH_JOINING, BATCH_JOIN_AFTER, BATCH_TOKENS)
            verdicts["equal"] = batch_parity(model, batch_prompts([BATCH_LENGTH] * 2, seed + 5),
                                             0, 0, BATCH_TOKENS)
    except Exception as e:  # noqa: BLE001  (a launch or build failure fails the switch)
        r.update(passed=False, agreement=verdicts, error=f"batch parity raised {e!r}")
        say(f"batch_decode: {r['error']}")
        return
    bad = [k for k, v in verdicts.items() if not v["ok"]]
    r.update(passed=not bad, agreement=verdicts,
             error="; ".join(f"{k}: {verdicts[k]['error']}" for k in bad) or None)
    say("batch_decode parity (a prompt alone, a batch with two joining, a batch of one "
        "length): " + ("passed" if not bad else r["error"]))
    if bad:
        return
    lengths = {"batch_equal": [BATCH_LENGTH] * BATCH_ROWS,
               "batch_mixed": [max(1, BATCH_LENGTH * (i + 1) // BATCH_ROWS)
                               for i in range(BATCH_ROWS)]}
    arms = (arm(kept, env), arm(on, env))
    times: dict = {}
    try:
        for name, ls in lengths.items():
            prompts = batch_prompts(ls, seed + 11)
            runs = [BatchDecodeRun(deep, prompts, steps * rounds) for _ in arms]
            try:
                for run, a in zip(runs, arms):
                    with a():
                        run.start()
                times[name] = paired_rounds(arms, lambda i: batch_round(runs[i], steps),
                                            rounds)
            finally:
                for run in reversed(runs):  # the last opened first (mlx-lm's wired limit)
                    run.close()
        prompts = batch_prompts(lengths["batch_mixed"], seed + 17)
        for a in arms:  # untimed first prefills
            with a():
                batch_prefill_round(deep, prompts)
        times["batch_prefill"] = paired_rounds(
            arms, lambda i: batch_prefill_round(deep, prompts), prefill_reps)
        for a in arms:  # untimed first chunks
            with a():
                prefill_round(model, prefill_len)
        times["prefill"] = paired_rounds(arms, lambda i: prefill_round(model, prefill_len),
                                         prefill_reps)
    except Exception as e:  # noqa: BLE001
        r.update(faster=False, error=f"batch timing raised {e!r}")
        say(f"batch_decode: {r['error']}")
        return
    out: dict = {"base_ms": {}, "kernel_ms": {}, "speedup": {}, "noise": {}, "rounds": {}}
    for ph, (b, k) in times.items():
        out["base_ms"][ph] = statistics.median(b)
        out["kernel_ms"][ph] = statistics.median(k)
        out["speedup"][ph], out["noise"][ph] = ratio_stats(b, k)
        out["rounds"][ph] = {"base": b, "kernel": k}
    r.update(out)
    decode = {k: out["speedup"][k] for k in lengths}
    pre = out["speedup"]["prefill"]
    r["faster"] = bool(faster_speedup(decode, out["noise"]) and pre
                       and pre >= 1 - allowance(out["noise"], "prefill"))
    say(f"batch_decode: {BATCH_ROWS} sequences, "
        + " ".join(f"{k} x{x:.3f}" if x else f"{k} -" for k, x in out["speedup"].items())
        + (" -> kept" if r["faster"] else " -> not kept"))


# ----------------------------------------------------------------------------- child
def _emulated():
    if not tuning.qualify_emulate:
        return contextlib.nullcontext()
    from .testing.dispatch import emulated_metal

    return emulated_metal()


def _since_launch(opts) -> float | None:
    """Seconds since the parent launched this child (``--child-launched``, wall clock)."""
    return None if opts.child_launched is None else time.time() - opts.child_launched


def _child(opts) -> int:
    import mlx.core as mx

    started = _since_launch(opts)  # interpreter start-up and this module's imports
    with _emulated():
        be = _backend.current_backend()
        print(f"[mlx-lily] qualify: loading {opts.model or opts.synthetic}", file=sys.stderr,
              flush=True)
        t0 = time.perf_counter()
        model, desc = load_model(opts.model, opts.synthetic, opts.layers, opts.model_seed)
        loaded_s = time.perf_counter() - t0
        print(f"[mlx-lily] qualify: loaded in {loaded_s:.1f} s", file=sys.stderr, flush=True)

        def finish(res: dict, partial: bool) -> None:
            res["model"] = desc
            res["identity"] = identity(be)
            res["peak_memory_bytes"] = int(mx.get_peak_memory())
            res["startup"] = {"launch_to_main_s": started, "load_s": loaded_s,
                              "launch_to_result_s": _since_launch(opts)}
            res["partial"] = partial
            tmp = Path(opts.child_out + ".tmp")
            tmp.write_text(json.dumps(res))
            os.replace(tmp, opts.child_out)

        res = qualify_model(
            model, ops=opts.ops.split(",") if opts.ops else None,
            decode_steps=opts.decode_steps, decode_rounds=opts.decode_rounds,
            decode_context=opts.decode_context, prefill_len=opts.prefill_len,
            parity_prefill=opts.parity_prefill, prefill_reps=opts.prefill_reps,
            depth=desc["depth"] if opts.depth < 0 else opts.depth, method=opts.method,
            progress=lambda m: print(f"[mlx-lily] qualify {m}", file=sys.stderr, flush=True),
            checkpoint=lambda r: finish(json.loads(json.dumps(r)), True))
        finish(res, False)
    return 0


def run(model: str | None = None, synthetic: str | None = None, *, layers: int = -1,
        timeout_s: float = TIMEOUT_S, extra_args=(), env=None, write: bool = True,
        backend: str | None = None) -> dict:
    """Qualify this device in a child process (``python -m mlx_lily.qualify --child``)
    killed after ``timeout_s`` seconds, then write the record (``write``) atomically.
    A child that times out or fails gives a record of that status with nothing
    qualified, unless it failed in the batch phase: then the result it saved before
    that phase is the record (status ok, ``batch_decode`` not qualified,
    ``"batch_phase_stopped"`` saying why). Returns the record. The child's progress lines go to this stderr.
    ``backend`` (default: the current one) names the record (tests: the emulated
    ``"metal"``)."""
    be = backend or _backend.current_backend()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="mlx-lily-qualify-") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "mlx_lily.qualify", "--child", "--child-out", str(out),
               "--child-launched", repr(time.time()), "--layers", str(layers), *extra_args]
        cmd += ["--model", str(model)] if model is not None else ["--synthetic", synthetic]
        status, error, res = "ok", None, {}
        proc = subprocess.Popen(cmd, env=env, start_new_session=True, stderr=subprocess.PIPE,
                                text=True, errors="replace")
        tail: list = []

        def relay():
            for line in proc.stderr:
                sys.stderr.write(line)
                tail.append(line.rstrip("\n"))
                del tail[:-40]

        import threading

        relay_thread = threading.Thread(target=relay, daemon=True)
        relay_thread.start()

        def kill_child():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            proc.wait()

        try:
            # while the child runs: in a fresh CLI process the first MLX device query and
            # the mlx-lm import take seconds
            t_id = time.perf_counter()
            ident = identity(be)
            identity_s = time.perf_counter() - t_id
            rc = proc.wait(timeout=max(0.0, timeout_s - (time.perf_counter() - t0)))
            if rc != 0:
                status, error = "error", f"qualification child exited with status {rc}"
            elif not out.is_file():
                status, error = "error", "qualification child wrote no result"
            else:
                res = json.loads(out.read_text())
                if isinstance(res.get("startup"), dict):  # the child's exit, seen from here
                    res["startup"]["launch_to_exit_s"] = time.perf_counter() - t0
                    res["startup"]["parent_identity_s"] = identity_s
        except subprocess.TimeoutExpired:
            kill_child()
            status, error = "timeout", f"qualification did not finish within {timeout_s:g} s"
        except BaseException:  # the parent failed or was interrupted: no child left behind
            kill_child()
            raise
        if status != "ok" or res.get("partial"):
            # the child's result as it stood before the batch phase, when that phase is
            # what failed or ran out of time: the one-sequence ops keep their verdicts
            try:
                part = json.loads(out.read_text()) if out.is_file() else {}
                if part.get("partial"):
                    why = error or "the child stopped in the batch phase"
                    part["ops"]["batch_decode"]["default"]["error"] = (
                        f"the batch phase did not finish: {why}")
                    part["batch_phase_stopped"] = why
                    status, error, res = "ok", None, part
            except Exception:  # noqa: BLE001  (an unreadable partial result is none)
                pass
        relay_thread.join(timeout=5)
    record = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION,
              "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "status": status,
              "error": error, "identity": ident, "ops": {}, "qualified": {},
              **{k: v for k, v in res.items() if k != "identity"},
              "wall_s": time.perf_counter() - t0, "log_tail": tail}
    if res.get("identity") not in (None, record["identity"]):
        record["status"], record["qualified"] = "error", {}
        record["error"] = "the child ran with another identity"
    if status != "ok":
        record["qualified"] = {}
    if write:
        write_record(record, record_path(be))
        from . import kernels

        kernels.forget_record()
    return record


def auto_qualify(model: str | None = None, synthetic: str | None = None) -> dict | None:
    """The automatic first run on a GPU with no valid record (``mlx_lily.patch``): runs
    ``run`` with progress on stderr; never on the CPU backend or with
    ``MLX_LILY_QUALIFY=0``. Returns the record, or None when it did not run."""
    be = _backend.current_backend()
    if be == "cpu" or not auto_enabled() or record_status(be) == "valid":
        return None
    print(f"[mlx-lily] qualifying Lily's kernels on {device_label(be)} at this model's "
          f"shapes (once per device and version; {QUALIFY_ENV}=0 skips it) ...",
          file=sys.stderr, flush=True)
    rec = run(model, synthetic)
    n = len(rec.get("qualified", {}))
    print(f"[mlx-lily] qualification {rec['status']} in {rec['wall_s']:.0f} s: {n} of "
          f"{len(rec.get('ops', {}))} ops use their kernels (report: python -m "
          f"mlx_lily.qualify --report-only; record: {record_path(be)})", file=sys.stderr,
          flush=True)
    return rec


# ----------------------------------------------------------------------------- report
def _ms(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def report_rows(record: dict) -> list:
    """One row per (op, variant): op, variant, passed, qualified, kernel / base ms and
    speed-up per phase, error."""
    rows = []
    for op, variants in record.get("ops", {}).items():
        for name, r in variants.items():
            k, b, s = r.get("kernel_ms") or {}, r.get("base_ms") or {}, r.get("speedup") or {}
            batch = "; ".join(
                (f"batch prefill {_ms(b.get(ph))} -> {_ms(k.get(ph))} ms" if ph == "batch_prefill"
                 else f"{ph[len('batch_'):]} batches {_ms(b.get(ph))} -> {_ms(k.get(ph))} ms "
                 "a step") + f" (x{s[ph]:.3f})"
                for ph in s if ph.startswith("batch_") and s[ph])
            rows.append({"op": op, "variant": name, "passed": bool(r.get("passed")),
                         "qualified": record.get("qualified", {}).get(op) == name,
                         "kernel_decode_ms": k.get("decode"), "stock_decode_ms": b.get("decode"),
                         "speedup_decode": s.get("decode"),
                         "kernel_prefill_ms": k.get("prefill"),
                         "stock_prefill_ms": b.get("prefill"),
                         "speedup_prefill": s.get("prefill"),
                         "error": r.get("error") or batch or "".join(
                             f"{ph}: same launches as without it, not timed; "
                             for ph in (r.get("timing") or {}).get("reused", ())) or None})
    return rows


def render_markdown(record: dict) -> str:
    """The shareable table (markdown)."""
    ident = record.get("identity", {})
    lines = [f"# mlx-lily qualification: {ident.get('device_name')} ({ident.get('backend')})",
             "", f"status **{record.get('status')}**"
             + (f" ({record['error']})" if record.get("error") else "")
             + f"; {record.get('created')}; wall {record.get('wall_s', 0):.1f} s",
             f"MLX {ident.get('mlx')}, mlx-lm {ident.get('mlx_lm')}, mlx-lily "
             f"{ident.get('mlx_lily')}, {ident.get('os')}, {ident.get('architecture')}, "
             f"kernel sources sha256 {str(ident.get('sources_sha256'))[:16]}",
             f"model: {record.get('model')}", "",
             "Times: ms of a decode step (at the model's depth, "
             f"{(record.get('settings') or {}).get('depth', '?')} layers) / a prefill chunk "
             "with the op's kernels on (kernel) vs the same step with the op's reference, "
             "i.e. mlx-lm's math for that op (stock math), medians over rounds that "
             "alternate the two; "
             + ("the rest of the set (all but the op and the ops that require it) runs its "
                "kernels in both, and each variant of the op is timed the same way. x = the "
                if (record.get("settings") or {}).get("method") == TOP_DOWN else
                "the ops kept before it run their kernels in both. x = the ")
             + "median per-round ratio stock math / kernel. The overall line compares the "
             "qualified set with unpatched mlx-lm the same way (one sequence: without "
             "batch_decode, whose batch phase times batched steps against the set alone).",
             "",
             "| op | variant | passed | qualified | kernel decode ms | stock-math decode ms | "
             "decode x | kernel prefill ms | stock-math prefill ms | prefill x | error |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report_rows(record):
        sp = (lambda v: "-" if v is None else f"{v:.3f}")
        lines.append(f"| {r['op']} | {r['variant']} | {'yes' if r['passed'] else 'no'} | "
                     f"{'yes' if r['qualified'] else 'no'} | {_ms(r['kernel_decode_ms'])} | "
                     f"{_ms(r['stock_decode_ms'])} | {sp(r['speedup_decode'])} | "
                     f"{_ms(r['kernel_prefill_ms'])} | {_ms(r['stock_prefill_ms'])} | "
                     f"{sp(r['speedup_prefill'])} | {(r['error'] or '')[:120]} |")
    if record.get("chains"):
        lines += ["", "Chains: an op not kept alone, timed with the ops that require it "
                      "(default variants), against the set kept before it.", "",
                  "| chain | kept | decode x | prefill x | error |", "|---|---|---|---|---|"]
        for c in record["chains"]:
            s_ = c.get("speedup") or {}
            x = (lambda v: "-" if v is None else f"{v:.3f}")
            lines.append(f"| {'+'.join(c['ops'])} | {'yes' if c.get('faster') else 'no'} | "
                         f"{x(s_.get('decode'))} | {x(s_.get('prefill'))} | "
                         f"{(c.get('error') or '')[:120]} |")
    ov = record.get("overall") or {}
    w = ov.get("whole_set")
    if w:
        s_ = w.get("speedup") or {}
        top_down = (record.get("settings") or {}).get("method") == TOP_DOWN
        lines += ["", f"Whole passing set in default variants ({', '.join(w['ops'])}) against "
                      + ("the references (each member then timed without it, above): "
                         if top_down else "the ops kept one at a time: ")
                      + " ".join(f"{k} x{v:.3f}" for k, v in s_.items())
                      + ("" if top_down else
                         " -> qualified instead" if w.get("faster") else " -> not faster")]
    if ov:
        lines += ["", f"Overall (unpatched mlx-lm vs the qualified set): stock "
                      f"{ov.get('stock_ms')}, references only {ov.get('reference_ms')}, "
                      f"qualified {ov.get('qualified_ms')}, speed-up "
                      f"{ov.get('speedup_vs_stock')}"
                      + (f"; dropped (slower than stock): {ov['dropped']}"
                         if ov.get("dropped") else "")]
    if record.get("phases"):
        c = record.get("counts") or {}
        lines += ["", "Seconds per phase: " + ", ".join(
            f"{k} {v:.1f}" for k, v in record["phases"].items())
            + f"; probed parity forwards {c.get('parity_forwards')}, op sets timed "
              f"{c.get('timed_sets')}; model forwards {c.get('forwards')}; compiled "
              f"decode-step traces {c.get('traces')}"]
    st = record.get("startup")
    if st:
        marks = ("launch_to_main_s", "launch_to_result_s", "launch_to_exit_s")
        lines += ["", "Child process, seconds from its launch: " + ", ".join(
            f"{k.removesuffix('_s').replace('_', ' ')} {st[k]:.1f}" for k in marks
            if st.get(k) is not None) + f"; loading the model took {st.get('load_s', 0):.1f}"]
        loaded = record.get("model") or {}
        if loaded.get("eval_s") is not None:
            lines[-1] += (f" (lazy load {loaded.get('lazy_load_s', 0):.1f}, evaluating the kept "
                          f"weights {loaded['eval_s']:.1f})")
        if st.get("parent_identity_s") is not None:
            lines[-1] += (f"; the parent's identity check (while the child ran) "
                          f"{st['parent_identity_s']:.1f}")
        if st.get("launch_to_exit_s") is not None and record.get("wall_s") is not None:
            lines[-1] += (f"; the parent after the child's exit "
                          f"{record['wall_s'] - st['launch_to_exit_s']:.1f}")
    lines += ["", f"Qualified: {record.get('qualified', {})}"]
    return "\n".join(lines) + "\n"


def write_report(record: dict, out_dir: Path) -> tuple[Path, Path]:
    """``qualify.json`` and ``qualify.md`` in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    j, m = out_dir / "qualify.json", out_dir / "qualify.md"
    j.write_text(json.dumps(record, indent=1, sort_keys=True))
    m.write_text(render_markdown(record))
    return j, m


# ----------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mlx_lily.qualify",
                                description="Qualify mlx-lily's kernels on this GPU.")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="MLX checkpoint folder (its shapes; first --layers layers)")
    src.add_argument("--synthetic", metavar="PRESET",
                     help="synthetic model of an mlx_lily.synth preset (default qwen3.6-35b-a3b)")
    p.add_argument("--layers", type=int, default=-1,
                   help="decoder layers kept (-1: one full-attention cycle; 0: all)")
    p.add_argument("--model-seed", type=int, default=0)
    p.add_argument("--ops", default=None, help="comma list of ops (default: all with kernels)")
    p.add_argument("--depth", type=int, default=-1,
                   help="decoder layers of the timed decode steps, the loaded ones repeated "
                        "(-1: the checkpoint's own depth; 0: the loaded layers only)")
    p.add_argument("--decode-steps", type=int, default=DECODE_STEPS,
                   help="pipelined decode steps per timed round")
    p.add_argument("--decode-rounds", type=int, default=DECODE_ROUNDS,
                   help="paired rounds per decode comparison")
    p.add_argument("--decode-context", type=int, default=DECODE_CONTEXT)
    p.add_argument("--prefill-len", type=int, default=PREFILL_LEN)
    p.add_argument("--parity-prefill", type=int, default=PARITY_PREFILL)
    p.add_argument("--prefill-reps", type=int, default=PREFILL_REPS)
    p.add_argument("--method", choices=METHODS, default=DEFAULT_METHOD,
                   help="how the timing step builds the set (greedy: ops one at a time, then "
                        "the whole passing set; top-down: the whole passing set, then each "
                        "op left out)")
    p.add_argument("--timeout-s", type=float, default=TIMEOUT_S)
    p.add_argument("--report", action="store_true",
                   help="print the table and write qualify.json + qualify.md (--out)")
    p.add_argument("--report-only", action="store_true",
                   help="report this device's stored record without qualifying again")
    p.add_argument("--out", type=Path, default=None,
                   help="folder for the report (default: beside the record)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-launched", type=float, default=None, help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    """Exit codes: 0 qualified (record written), 1 the run failed or timed out, 2 no
    record to report (``--report-only``)."""
    opts = build_parser().parse_args(argv)
    if opts.child:
        return _child(opts)
    be = _backend.current_backend()
    if be == "cpu" and tuning.qualify_emulate:
        be = "metal"  # the child runs the Metal kernels emulated: a Metal record
    if opts.report_only:
        rec = read_record(be)
        if rec is None:
            print(f"no qualification record at {record_path(be)}", file=sys.stderr)
            return 2
    else:
        if be == "cpu" and not tuning.qualify_emulate:
            print("[mlx-lily] qualify: the CPU backend runs no Lily kernels; nothing to do",
                  file=sys.stderr)
            return 1
        if opts.model is None and opts.synthetic is None:
            opts.synthetic = "qwen3.6-35b-a3b"
        extra = ["--depth", str(opts.depth), "--decode-steps", str(opts.decode_steps),
                 "--decode-rounds", str(opts.decode_rounds), "--decode-context",
                 str(opts.decode_context), "--prefill-len", str(opts.prefill_len),
                 "--parity-prefill", str(opts.parity_prefill), "--prefill-reps",
                 str(opts.prefill_reps), "--model-seed",
                 str(opts.model_seed), "--method", opts.method] + (
                     ["--ops", opts.ops] if opts.ops else [])
        rec = run(opts.model, opts.synthetic, layers=opts.layers, timeout_s=opts.timeout_s,
                  extra_args=extra, backend=be)
        print(f"[mlx-lily] qualification {rec['status']} in {rec['wall_s']:.1f} s; record "
              f"{record_path(be)}", file=sys.stderr)
    if opts.report or opts.report_only:
        j, m = write_report(rec, opts.out or record_path(be).parent)
        print(render_markdown(rec))
        print(f"wrote {j} and {m}", file=sys.stderr)
    return 0 if rec.get("status") == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
