"""Backend selection at call time and the per-op kill switch.

The backend is read when an op is called, never cached at import, so a script that
moves the default device between calls gets the right path for each call.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re

import mlx.core as mx

from . import config, registry, tuning
from .config import env_frozen, env_value  # noqa: F401  (the settings' environment reads)

#: Every op and fusion switch (``mlx_lily.registry.OPS`` names, in table order).
OP_NAMES = registry.NAMES

DISABLE_ENV = config.SETTINGS["disable"].env


@functools.lru_cache(maxsize=None)
def _metal_available() -> bool:
    try:
        return bool(mx.metal.is_available())
    except Exception:
        return False


@functools.lru_cache(maxsize=None)
def _cuda_available() -> bool:
    try:
        return bool(mx.cuda.is_available())
    except Exception:
        return False


_TRACE_BACKEND: str | None = None


@contextlib.contextmanager
def tracing_backend(name: str = "metal"):
    """Make dispatchers take ``name``'s kernel path on a machine without that GPU, for
    graph recording only (``mx.export_function`` tracing counts primitives and times the
    Python build without evaluating; evaluating such a graph raises "No Metal back-end").
    ``"metal"`` works with MLX's own ``metal_kernel`` (construction needs no GPU);
    ``"cuda"`` needs a stand-in ``mx.fast.cuda_kernel`` off-GPU (tests record launches
    for ``mlx_lily.cuda_cache`` that way).

    Raises:
        ValueError: ``name`` is not ``"metal"`` or ``"cuda"``.
    """
    global _TRACE_BACKEND
    if name not in ("metal", "cuda"):
        raise ValueError(f"tracing_backend: expected 'metal' or 'cuda', got {name!r}")
    prev, _TRACE_BACKEND = _TRACE_BACKEND, name
    try:
        yield
    finally:
        _TRACE_BACKEND = prev


def tracing_active() -> bool:
    """Whether a ``tracing_backend`` block is open (graphs are recorded, not run)."""
    return _TRACE_BACKEND is not None


def current_backend() -> str:
    """Return the backend a call made now would run on: ``"metal"``, ``"cuda"`` or ``"cpu"``.

    The default device decides: a GPU default on a machine with Metal is ``"metal"``,
    with MLX's CUDA build ``"cuda"``; a CPU default (or no GPU backend) is ``"cpu"``.
    Inside ``tracing_backend(name)`` it is ``name``.
    """
    if _TRACE_BACKEND is not None:
        return _TRACE_BACKEND
    if mx.default_device() != mx.gpu:
        return "cpu"
    if _metal_available():
        return "metal"
    if _cuda_available():
        return "cuda"
    return "cpu"


def warn_unknown_ops(env: str, names, extra=()) -> None:
    """One warning naming what an environment variable lists that is no op."""
    unknown = sorted(set(names) - set(OP_NAMES) - set(extra))
    if unknown:
        config.warn_bad(env, ",".join(sorted(names)), f"op names {list(OP_NAMES)}",
                        f"unknown op(s) {unknown}")


def disabled_ops() -> frozenset:
    """Names of ops turned off by ``MLX_LILY_DISABLE=<op>[,<op>...]`` or ``=all``
    (``config.disable``).

    A disabled op takes the stock mlx-lm code path for every call.
    """
    return config.value("disable")


_selected_ops: frozenset | None = None


def select_ops(ops) -> None:
    """Restrict Lily to ``ops`` (an iterable of op names) or, with None, allow all.

    Raises:
        ValueError: an unknown op name.
    """
    global _selected_ops
    if ops is None:
        _selected_ops = None
        return
    ops = frozenset(ops)
    unknown = ops - set(OP_NAMES)
    if unknown:
        raise ValueError(f"unknown mlx-lily op(s) {sorted(unknown)}; known: {list(OP_NAMES)}")
    _selected_ops = ops


def selected_ops() -> frozenset | None:
    """The op selection of ``patch(ops=...)`` in force (None: every op)."""
    return _selected_ops


def op_enabled(name: str) -> bool:
    """True unless the kill switch names this op (or ``all``) or ``patch(ops=...)`` left
    it out."""
    if _selected_ops is not None and name not in _selected_ops:
        return False
    return name not in config.value("disable")


def backend_info() -> dict:
    """Describe what a call would use now.

    Returns:
        ``{"backend": "metal"|"cuda"|"cpu", "device": str, "patched": bool,
        "ops": {op: mode}, "patch": "patched"|"stepped-aside"|"qualify-pending"|"unpatched",
        "stepped_aside": reason or None, "runtime_disabled": {op: reason},
        "qualification": record status}``. ``patched``: a Lily patch is active now (its
        forwards installed, or stepped aside: see ``patch``). Mode is ``"kernel"`` (a
        custom GPU kernel serves at least its main form on this backend),
        ``"reference"`` (the pure-MLX reference runs), ``"disabled"`` (the kill switch
        sends the op to stock mlx-lm code) or, while the patch stepped aside
        (``mlx_lily.patch``), ``"stock"`` for every op. ``runtime_disabled``: ops whose
        kernels failed their first contact in this process
        (``mlx_lily.first_contact``). ``qualification``: ``"valid"``, ``"stale"``
        (versions or kernel sources changed: re-qualify), ``"none"`` or ``"off"``
        (``mlx_lily.qualify.record_status``; ``"n/a"`` on the CPU). ``reasons``:
        ``registry.why_not``'s answer for every op that does not run its kernel.
    """
    import sys

    from . import kernels

    backend = current_backend()
    patching = sys.modules.get("mlx_lily.patching")
    handle = patching._ACTIVE if patching is not None else None
    aside = handle.stepped_aside if handle is not None else None
    ops, reasons = {}, {}
    for name in OP_NAMES:
        why = registry.why_not(name, backend)
        if why is not None:
            reasons[name] = why
        if aside is not None:
            ops[name] = "stock"
        elif not op_enabled(name):
            ops[name] = "disabled"
        else:
            ops[name] = "kernel" if why is None else "reference"
    qual = "n/a"
    if backend in ("metal", "cuda"):
        try:
            from . import qualify

            qual = qualify.record_status(backend)
        except Exception as e:  # noqa: BLE001  (a description must not fail)
            qual = f"unreadable ({e!r})"
    return {"backend": backend, "device": str(mx.default_device()),
            "patched": handle is not None, "ops": ops, "reasons": reasons,
            "patch": ("unpatched" if handle is None else
                      "qualify-pending" if getattr(handle, "qualify_pending", False) else
                      "stepped-aside" if aside is not None else "patched"),
            "stepped_aside": aside, "runtime_disabled": kernels.runtime_disabled(),
            "qualification": qual}


def _reference_reason(op: str, backend: str) -> str:
    """Why ``op`` runs its pure-MLX reference on ``backend`` (short, for ``status_line``)."""
    from .kernels import KERNELS_ENV, VERIFIED, kernels_allowed

    if backend == "cpu":
        return "no GPU backend"
    if not kernels_allowed(op, backend):
        if config.value("kernels") == {"verified"} and op not in VERIFIED.get(backend, ()):
            return f"not verified on {backend}"
        return f"not in {KERNELS_ENV}"
    return "no kernel for this backend here"


def status_line(model_type: str | None = None) -> str:
    """The one line ``mlx_lm.* --lily`` prints when Lily patches a supported model: the
    backend, how many ops run kernels, why the others do not, where the full list is.

    Example: ``[mlx-lily] qwen3_5_moe on cuda: 18 of 19 ops run kernels; shared_dequant:
    not verified on cuda (every op: mlx_lily.backend_info())``.
    """
    info = backend_info()
    be, ops = info["backend"], info["ops"]
    why: dict = {}
    for op, mode in ops.items():
        if mode == "disabled":
            why.setdefault(f"disabled by {DISABLE_ENV} or patch(ops=...)", []).append(op)
        elif mode == "reference":
            why.setdefault(_reference_reason(op, be), []).append(op)
    n = sum(mode == "kernel" for mode in ops.values())
    parts = [f"{', '.join(names) if len(names) <= 3 else f'{len(names)} ops'}: {reason}"
             for reason, names in why.items()]
    what = f"{model_type} on {be}" if model_type else be
    tail = "; " + "; ".join(parts) if parts else ""
    return (f"[mlx-lily] {what}: {n} of {len(ops)} ops run kernels{tail} "
            f"(every op: mlx_lily.backend_info())")


COMPILE_ENV = config.SETTINGS["compile"].env
COMPILE_WHOLE_ENV = "MLX_LILY_COMPILE_WHOLE"  # tuning.compile_whole


_COMPILE_SUSPENDED = [0]


@contextlib.contextmanager
def compile_suspended():
    """Within this block ``compile_mode`` is ``"off"`` (first contact and qualification
    evaluate each kernel launch eagerly, which ``mx.compile`` tracing forbids)."""
    _COMPILE_SUSPENDED[0] += 1
    try:
        yield
    finally:
        _COMPILE_SUSPENDED[0] -= 1


def compile_mode(backend: str | None = None) -> str:
    """How decode steps run now: ``"whole"`` (the decoder stack as one compiled function),
    ``"per-layer"`` or ``"off"``, from ``MLX_LILY_COMPILE`` / ``MLX_LILY_COMPILE_WHOLE``
    and the backend (compiled by default on GPU backends only). ``"whole"`` is the
    setting: a step where some layer cannot run compiled (its kernels do not serve, a
    cache must grow) runs layer by layer."""
    if _COMPILE_SUSPENDED[0]:
        return "off"
    be = backend or current_backend()
    on = config.compile
    if on is False or (on is None and be not in ("cuda", "metal")):
        return "off"
    return "whole" if tuning.compile_whole else "per-layer"


def describe() -> str:
    """One line for stderr: backend, compiled decode steps, and active ops; "" while the
    patch stepped aside or waits to qualify (``patch`` printed its own line)."""
    info = backend_info()
    if info["patch"] in ("stepped-aside", "qualify-pending"):
        return ""  # patch() printed its own line
    parts = ", ".join(f"{k}={v}" for k, v in info["ops"].items())
    graphs = ""
    if info["backend"] == "cuda":
        graphs = f" cuda_launch={cuda_launch_mode()}"
    return (f"[mlx-lily] backend={info['backend']} compile={compile_mode(info['backend'])}"
            f"{graphs} ops: {parts}")


def _atoi(text: str) -> int:
    """C's ``atoi``: the leading optionally signed decimal integer after blanks, else 0."""
    m = re.match(r"\s*([+-]?\d+)", text)
    return int(m.group(1)) if m else 0


def cuda_launch_mode() -> str:
    """MLX's CUDA launch mode as this process's environment asks for it: ``"graphs"``
    (MLX's default, ``MLX_USE_CUDA_GRAPHS`` unset or a non-zero integer) or ``"direct"``
    (set to anything ``atoi`` reads as 0, as MLX does: ``0``, ``""``, ``false``). MLX
    reads the variable once, at its first GPU evaluation, so a value set later has no
    effect (source: MLX 0.32 ``backend/cuda/device.cpp``, ``utils.cpp`` ``get_var``)."""
    v = os.environ.get("MLX_USE_CUDA_GRAPHS")
    return "graphs" if v is None or _atoi(v) != 0 else "direct"
