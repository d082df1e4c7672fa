"""Safe first contact: every kernel a model uses is built, launched and checked at load.

MLX builds a custom kernel's library at its first evaluation and only then checks the
threadgroup size against the pipeline's real maximum (``maxTotalThreadsPerThreadgroup``,
below 1024 for kernels with many registers); a kernel that fails there would fail inside
``mlx_lm.load``'s warm-up or midway through a generation. ``check(model)`` runs the
warm-up forwards eagerly instead:

1. Inside ``probing()`` every launch of a Lily kernel (``kernels.GuardedKernel``) has its
   inputs evaluated, runs, and has its outputs evaluated at once. An exception (a build
   error, a threadgroup above the pipeline's maximum, a launch error) is that launch's
   op's: the op is turned off for the process (``kernels.disable_for_process``, one
   warning naming the op and the error), the forward is abandoned and run again, until
   one passes with every remaining kernel launched.
2. The passing forward's logits are compared with the same forward with every kernel off
   (each op's pure-MLX reference, ``kernels.only_ops(())``). Non-finite logits, or logits
   that fail ``agree``, start the attribution (``passing_set``): the prefixes of the ops
   in ``backend.OP_NAMES`` order (base ops before the fusions that need them) are
   bisected for the op whose addition breaks the agreement with the reference; it is
   turned off for the process and the rest checked again.

Coverage: the instantiations the warm-up's shapes reach (``PROMPT_LEN`` and
``PREFILL_LEN`` tokens, one decode step, batch 1). Kernel variants picked only by longer
prompts (the grouped MoE GEMMs' 32/64-row tiles from ~1024 tokens at 256 experts) or by
batches are first launched during a generation, unprobed; on CUDA the warm-up compiles
them ahead of time (``cuda_cache``), on Metal a failure there still surfaces at that
evaluation.

Tolerances (``agree``): kernels round differently from the references (bf16 everywhere,
fp32 accumulators in other orders), and a model's top-k expert routing turns a rounding
difference at a near-tie into an O(1) change of that token's logits. On the tiny
random-weight test models, correct kernels sit up to ~0.4 of the logit scale from the
reference with top-1 agreement ~0.75, so first contact does not test fine parity (that
is qualification's job: ``mlx_lily.qualify``); it rejects what no rounding explains:
non-finite logits, or a position whose logit vector's Pearson correlation with the
reference's is below ``MIN_CORRELATION`` (0.8; every kernel on, emulated, the tiny
qwen3_5_moe / qwen3_5 / qwen3_next test models give >= 0.97 at every position of an
8-token prefill, a decode step and a 40-token prefill; one wrong GEMV in the decode step
gives < 0 at that position).

``census()`` (qualification's launch census) records each launch's ``launch_key``
instead, evaluating nothing.

Fault injection (tests and tooling only): ``MLX_LILY_INJECT_FAULT=op:kind[,op:kind...]``,
read when a kernel object is built (``injected_fault``), with kinds ``build`` (a broken
source: the compiler rejects it), ``threadgroup`` (launched with 2048 threads per
threadgroup, above every pipeline maximum), ``launch`` (the launch raises), ``wrong``
(float outputs replaced by ``1 - 3 * out``), ``nonfinite`` (float outputs + NaN) and
``hang`` (the launch never returns: qualification's child-process time limit).
"""

from __future__ import annotations

import contextlib
import time

import mlx.core as mx

from . import backend as _backend
from . import kernels

INJECT_ENV = "MLX_LILY_INJECT_FAULT"
FAULT_KINDS = ("build", "threadgroup", "launch", "wrong", "nonfinite", "hang")
BROKEN_SOURCE = "\n#error mlx-lily injected build failure\n"
#: Threads per threadgroup of an injected ``threadgroup`` fault (above Apple's and
#: NVIDIA's 1024).
OVERSIZED_THREADGROUP = (2048, 1, 1)
#: Lowest mean per-position logit correlation with the reference that passes (see above).
MIN_CORRELATION = 0.8
#: Tokens of the warm-up's short prefill (the decode-sized kernels: <= 8 rows) and of its
#: longer prefill (attention's prefill kernel from 32/64 rows, the grouped MoE GEMMs'
#: 16-row tiles, the GDN chunked scan) on GPU backends.
PROMPT_LEN = 8
PREFILL_LEN = 256

_PROBE: list = [None]


class KernelFault(Exception):
    """A Lily kernel failed while probed: ``op`` (its op name), ``kernel`` (the kernel
    name) and ``error`` (the exception MLX raised, or a description)."""

    def __init__(self, op: str, kernel: str, error):
        super().__init__(f"{op}: kernel {kernel}: {_describe(error)}")
        self.op, self.kernel, self.error = op, kernel, error


def _describe(error) -> str:
    if isinstance(error, BaseException):
        text = str(error).strip().splitlines()
        return f"{type(error).__name__}: {text[0][:300] if text else ''}"
    return str(error)


def _parse_faults(raw: str) -> dict:
    out = {}
    for item in raw.split(","):
        item = item.strip()
        if not item:
            continue
        op, _, kind = item.partition(":")
        if kind not in FAULT_KINDS:
            raise ValueError(f"{INJECT_ENV}: {item!r}: expected op:kind with kind one of "
                             f"{FAULT_KINDS}")
        out[op.strip()] = kind
    return out


def injected_fault(op: str | None) -> str | None:
    """The fault ``MLX_LILY_INJECT_FAULT`` injects into ``op``'s kernels (a kind of
    ``FAULT_KINDS``), or None (always None in normal use: the variable is for tests).

    Raises:
        ValueError: the variable is malformed.
    """
    from . import tuning

    raw = tuning.inject_fault
    if not raw or op is None:
        return None
    return _parse_faults(raw).get(op)


def build_broken(spec, backend: str):
    """``spec``'s kernel object built from its source plus ``BROKEN_SOURCE`` (an injected
    ``build`` fault: the failure surfaces at the first evaluation, as a real one does)."""
    base = mx.fast.metal_kernel if backend == "metal" else mx.fast.cuda_kernel

    def factory(**kw):
        kw["source"] = kw["source"] + BROKEN_SOURCE
        return base(**kw)

    return kernels.build(spec, backend, factory=factory)


class _Probe:
    def __init__(self, poison: bool, census: bool = False):
        self.poison = poison
        self.census = census
        self.launched: dict = {}  # (op, kernel name) -> launches
        self.keys: list = []  # census: launch_key of each launch, in order


def launch_key(gk, kw: dict) -> str:
    """What identifies a launch's work: kernel name, template arguments, grid,
    threadgroup, input shapes and output shapes/dtypes (``repr`` of each)."""
    shapes = [tuple(a.shape) for a in kw.get("inputs", ()) if isinstance(a, mx.array)]
    return repr((gk.spec.name, kw.get("template"), kw.get("grid"), kw.get("threadgroup"),
                 shapes, kw.get("output_shapes"), kw.get("output_dtypes")))


@contextlib.contextmanager
def census():
    """Within this block every Lily kernel launch is recorded (``launch_key``) and
    launched as usual, unevaluated; compiled decode steps are built as plain functions
    (``decode_graph.uncompiled``: the launches a compiled step makes, no trace). Yields
    the list of keys, appended in launch order."""
    from .patches import decode_graph

    prev, _PROBE[0] = _PROBE[0], _Probe(False, census=True)
    try:
        with decode_graph.uncompiled():
            yield _PROBE[0].keys
    finally:
        _PROBE[0] = prev


@contextlib.contextmanager
def probing(poison: bool = False):
    """Within this block every Lily kernel launch is evaluated at once and a failure
    raises ``KernelFault``; decode steps are not compiled (``backend.compile_mode``).
    ``poison=True`` fills outputs the kernel does not initialise itself with NaN
    (``init_value``) when every output is floating point, so an element a kernel leaves
    unwritten and a later op reads shows up as a non-finite result. Yields the probe
    (``launched``: launches per (op, kernel name))."""
    prev, _PROBE[0] = _PROBE[0], _Probe(poison)
    try:
        with _backend.compile_suspended():
            yield _PROBE[0]
    finally:
        _PROBE[0] = prev


def _floating(dt) -> bool:
    return dt in (mx.float32, mx.float16, mx.bfloat16)


def _apply_output_fault(fault, outs):
    if fault not in ("wrong", "nonfinite"):
        return outs
    res = []
    for o in outs:
        if _floating(o.dtype):
            o = (1 - 3 * o) if fault == "wrong" else o + float("nan")
        res.append(o)
    return res


def launch(gk, kw: dict):
    """Launch ``gk`` (a ``kernels.GuardedKernel``) with call arguments ``kw``: probed
    (evaluated at once, failures raised as ``KernelFault``) inside ``probing()``,
    and with its injected fault applied. Outside probing a kernel without a fault never
    gets here."""
    fault = gk.fault
    if fault == "hang":
        import sys

        print(f"[mlx-lily] injected hang in kernel {gk.spec.name}", file=sys.stderr, flush=True)
        while True:
            time.sleep(3600)
    if fault == "threadgroup":
        kw = dict(kw, threadgroup=OVERSIZED_THREADGROUP)
    probe = _PROBE[0]
    if probe is not None and probe.census:
        probe.keys.append(launch_key(gk, kw))
        probe = None
    if probe is None:
        if fault == "launch":
            raise RuntimeError(f"[mlx-lily] injected launch failure ({gk.spec.name})")
        return _apply_output_fault(fault, gk.kernel(**kw))
    inputs = [a for a in kw.get("inputs", ()) if isinstance(a, mx.array)]
    try:
        mx.eval(inputs)
    except Exception:  # noqa: BLE001  (not this launch's failure, e.g. under a transform)
        return _apply_output_fault(fault, gk.kernel(**kw))
    if (probe.poison and kw.get("init_value") is None
            and all(_floating(d) for d in kw.get("output_dtypes", ()))):
        kw = dict(kw, init_value=float("nan"))
    try:
        if fault == "launch":
            raise RuntimeError(f"[mlx-lily] injected launch failure ({gk.spec.name})")
        outs = _apply_output_fault(fault, gk.kernel(**kw))
        mx.eval(outs)
    except Exception as e:  # noqa: BLE001  (any failure of this launch is its op's)
        raise KernelFault(gk.op, gk.spec.name, e) from e
    key = (gk.op, gk.spec.name)
    probe.launched[key] = probe.launched.get(key, 0) + 1
    return outs


def warmup_ids(n: int, vocab: int | None = None, seed: int = 0) -> mx.array:
    """``[1, n]`` int32 token ids, varied and deterministic (``seed``), below ``vocab``
    (default: below 500, which every Qwen vocabulary covers)."""
    hi = min(vocab or 500, 500)
    return mx.array([[(1 + seed * 7 + 37 * i) % (hi - 1) + 1 for i in range(n)]],
                    dtype=mx.int32)


def forward_logits(model, prompt_len: int = PROMPT_LEN, prefill_len: int = 0,
                   seed: int = 0) -> mx.array:
    """fp32 logits ``[P, V]`` of the warm-up forwards, evaluated: a ``prompt_len``-token
    prefill and one decode step on one fresh cache (every position), then, when
    ``prefill_len`` > 0, a ``prefill_len``-token prefill on another (its last 8
    positions)."""
    make_cache = getattr(model, "make_cache", None)
    cache = make_cache() if make_cache else None
    ids = warmup_ids(prompt_len, seed=seed)
    outs = [model(ids, cache=cache)[0]]
    mx.eval(outs)
    outs.append(model(ids[:, -1:], cache=cache)[0])
    mx.eval(outs)
    if prefill_len > 0:
        cache = make_cache() if make_cache else None
        outs.append(model(warmup_ids(prefill_len, seed=seed + 1), cache=cache)[0, -8:])
    out = mx.concatenate(outs, axis=0).astype(mx.float32)
    mx.eval(out)
    return out


def agree(got: mx.array, ref: mx.array, min_correlation: float = MIN_CORRELATION) -> dict:
    """Compare logits ``got`` with ``ref`` (``[P, V]`` fp32): ``{"ok", "finite",
    "correlation" (the lowest over positions of Pearson's r), "rel" (max |got - ref| /
    max |ref|), "top1" (fraction of positions with the same argmax)}``; ``ok`` needs
    finite logits and ``correlation >= min_correlation`` (see the module docstring)."""
    finite = bool(mx.all(mx.isfinite(got)).item())
    if not finite:
        return {"ok": False, "finite": False, "correlation": None, "rel": None, "top1": None}
    g = got - got.mean(axis=-1, keepdims=True)
    r = ref - ref.mean(axis=-1, keepdims=True)
    den = mx.sqrt((g * g).sum(-1) * (r * r).sum(-1))
    corr = mx.where(den > 0, (g * r).sum(-1) / mx.maximum(den, 1e-30), 1.0)
    scale = max(float(mx.abs(ref).max().item()), 1e-30)
    res = {"finite": True, "correlation": float(corr.min().item()),
           "rel": float(mx.abs(got - ref).max().item()) / scale,
           "top1": float((got.argmax(-1) == ref.argmax(-1)).astype(mx.float32).mean().item())}
    res["ok"] = res["correlation"] >= min_correlation
    return res


def active_ops(backend: str) -> list:
    """Ops (``backend.OP_NAMES`` order) whose kernels would serve on ``backend`` now."""
    from .ops import kernel_status

    out = []
    for op in _backend.OP_NAMES:
        if not _backend.op_enabled(op):
            continue
        try:
            if kernel_status(op, backend):
                out.append(op)
        except Exception:  # noqa: BLE001  (a status check that fails serves nothing)
            continue
    return out


def _probe_until_clean(model, prompt_len, prefill_len, report) -> mx.array | None:
    """Run the probed forward until no launch fails (each failure turns its op off);
    the logits, or None when something other than a kernel failed."""
    for _ in range(len(_backend.OP_NAMES) + 1):
        try:
            with probing() as probe:
                out = forward_logits(model, prompt_len, prefill_len)
            report["launched"] = {f"{op}/{k}": n for (op, k), n in probe.launched.items()}
            return out
        except KernelFault as f:
            kernels.disable_for_process(f.op, f"first contact: kernel {f.kernel}: "
                                              f"{_describe(f.error)}")
            report["failed"][f.op] = _describe(f.error)
    return None


def check(model, prompt_len: int = PROMPT_LEN, prefill_len: int | None = None) -> dict:
    """First contact for ``model`` on the current backend (see the module docstring):
    every kernel its warm-up forwards launch is built, run and checked; failures turn
    their ops off for the process. Never raises for a kernel failure; returns a report
    ``{"failed": {op: error}, "active": [ops], "agreement": agree(...) or None,
    "seconds": float}``.

    ``prefill_len`` defaults to ``PREFILL_LEN`` on GPU backends (0 under the emulator's
    ``tracing`` and on the CPU)."""
    t0 = time.perf_counter()
    be = _backend.current_backend()
    if prefill_len is None:
        prefill_len = PREFILL_LEN if be in ("metal", "cuda") else 0
    report: dict = {"failed": {}, "active": [], "agreement": None, "launched": {}}
    try:
        with _backend.compile_suspended():
            _check(model, be, prompt_len, prefill_len, report)
    except Exception as e:  # noqa: BLE001  (a load must not fail because of a kernel)
        for op in active_ops(be):
            kernels.disable_for_process(op, f"first contact failed: {_describe(e)}")
            report["failed"][op] = _describe(e)
        report["active"] = []
    finally:
        report["seconds"] = time.perf_counter() - t0
    return report


def _check(model, be, prompt_len, prefill_len, report) -> None:
    got = _probe_until_clean(model, prompt_len, prefill_len, report)
    active = active_ops(be)
    report["active"] = active
    if got is None or not active:
        return
    with kernels.only_ops(()):
        ref = forward_logits(model, prompt_len, prefill_len)
    a = report["agreement"] = agree(got, ref)
    if not a["ok"]:
        _attribute(model, active, ref, prompt_len, prefill_len, report)
        report["active"] = active_ops(be)


def requires(op: str) -> tuple:
    """The ops and switches ``op`` needs on to run (``registry.Op.requires``)."""
    from . import registry

    return registry.get(op).requires


def passing_set(ops: list, check, cascade: bool = True) -> tuple:
    """Split ``ops`` (``OP_NAMES`` order) into a set whose forward passes and the ops that
    break it. ``check(opset)`` returns a verdict ``{"ok", "fault" (the op whose launch
    failed, or None), "error", "agreement", "launched"}`` (``qualify._Parity.check``,
    ``_attribute``); it runs on all of ``ops`` first. A launch failure names its op;
    otherwise a failing set is bisected over its prefixes (the empty prefix is the
    reference itself) for the first op whose addition breaks it (about ``log2(len(ops))``
    forwards per failing op, none when the whole set passes), and the rest is checked
    again. With ``cascade`` a failed op takes the ops that require it (``registry``) with
    it. Returns ``(passing ops, the passing set's verdict or None, {op: verdict})``."""
    pending = list(ops)
    failed: dict = {}

    def drop(op, verdict):
        failed[op] = verdict
        pending.remove(op)
        gone = {op}
        for o in list(pending) if cascade else ():
            missing = [r for r in requires(o) if r in gone or r in failed]
            if missing:
                failed[o] = {"ok": False, "agreement": None, "fault": None, "launched": {},
                             "error": f"requires {', '.join(missing)}, which failed parity"}
                pending.remove(o)
                gone.add(o)

    while pending:
        v = check(list(pending))
        if v["fault"] is not None and v["fault"] in pending:
            drop(v["fault"], v)
            continue
        if v["ok"]:
            return pending, v, failed
        lo, hi, bad = 0, len(pending), v  # prefix [:lo] passes, [:hi] fails
        fault = None
        while hi - lo > 1:
            mid = (lo + hi) // 2
            w = check(pending[:mid])
            if w["fault"] is not None and w["fault"] in pending:
                fault = w
                break
            if w["ok"]:
                lo = mid
            else:
                hi, bad = mid, w
        if fault is not None:
            drop(fault["fault"], fault)
        else:
            drop(pending[hi - 1], bad)
    return [], None, failed


def _attribute(model, active, ref, prompt_len, prefill_len, report) -> None:
    """Find the ops of ``active`` that break the logits (``passing_set``: the failing set
    bisected over its prefixes in ``OP_NAMES`` order) and turn them off for the process."""

    def check(opset):
        with kernels.only_ops(opset):
            try:
                with probing():
                    got = forward_logits(model, prompt_len, prefill_len)
            except KernelFault as f:
                return {"ok": False, "fault": f.op, "agreement": None, "launched": {},
                        "error": _describe(f.error)}
            a = agree(got, ref)
        what = None if a["ok"] else (
            "non-finite result" if not a["finite"] else
            f"wrong result (logit correlation {a['correlation']:.3f} with the reference "
            f"at some position, < {MIN_CORRELATION})")
        return {"ok": a["ok"], "fault": None, "agreement": a, "launched": {}, "error": what}

    _, _, failed = passing_set(active, check, cascade=False)
    for op, v in failed.items():
        kernels.disable_for_process(op, f"first contact: {v['error']}")
        report["failed"][op] = v["error"]
