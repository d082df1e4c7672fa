"""The patch API: turn stock mlx-lm Qwen3.5/3.6 (and Qwen3-Next) models into Lily models.

Patches are class-level (the ``__call__`` of mlx-lm's block classes, where mlx-lm looks
them up), so they reach models loaded before and after ``patch()``. ``mlx_lm.utils.load_model``
is wrapped so that models loaded while patched get their one-time weight re-layouts.
``unpatch()`` restores every original by identity.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import threading

from . import backend, config, tuning

_ORIGINALS: dict = {}
_ACTIVE: "PatchHandle | None" = None
_WARNED_TYPES: set = set()


class PatchHandle:
    """An applied patch: the replaced attributes and their originals.

    Attributes:
        targets: list of ``(owner, attribute, original, replacement)``.
        ops: the op selection given to ``patch`` (None = all).
        announce: print ``backend.status_line`` to stderr once per model Lily prepares
            (set by the ``--lily`` hook and the console scripts).
    """

    def __init__(self, targets, ops):
        self.targets = targets
        self.ops = ops
        self.announce = False
        #: None while Lily's forwards are installed; else the reason it stepped aside
        #: (mlx-lm's own code runs: ``patch``)
        self.stepped_aside: str | None = None
        #: True while a model loaded through ``mlx_lm.load`` is to be qualified first
        self.qualify_pending = False
        #: with ``announce``: the step-aside / qualify line, printed when a supported
        #: model is loaded (never before ``--help`` output or for another model type)
        self.deferred_line: str | None = None

    @property
    def active(self) -> bool:
        return _ACTIVE is self

    def __repr__(self):
        aside = f" stepped_aside={self.stepped_aside!r}" if self.stepped_aside else ""
        return (f"<mlx_lily.PatchHandle {len(self.targets)} targets "
                f"active={self.active}{aside}>")


#: Count of item mutations of ``mlx.nn.Module`` objects (``module[k] = v``, ``del``, ``pop``,
#: ...: every way ``mlx.nn`` replaces a parameter or sub-module) while a patch is active,
#: raised again each time tracking starts (so a count taken before never matches after).
_MUTATIONS = [0]
#: name -> (wrapper installed on ``mlx.nn.Module``, the attribute it replaced or None)
_TRACKING: dict = {}
_TRACKED_NAMES = ("__setitem__", "__delitem__", "pop", "popitem", "clear", "setdefault",
                  "update", "__ior__")
#: Methods a class must inherit from ``mlx.nn.Module`` for its mutations to be counted
#: (its own ``__setattr__`` could write through ``dict.__setitem__``).
_UNWRAPPED_NAMES = ("__setattr__", "__delattr__")
_COUNT_LOCK = threading.Lock()


def module_mutations():
    """The mutation count of ``mlx.nn.Module`` items (``_MUTATIONS``) while tracking is on
    (a patch is active), else None. Equal counts at two moments mean no module of a
    tracked type (``mutations_tracked``) had an item added, replaced or removed between
    them (``mlx_lily.patches.qwen3_next.WeightSig`` skips its full check then): a
    mutation is counted after it took effect, so a count read before a check of the
    modules covers what that check saw. Not counted: writes that bypass the methods, such
    as ``dict.__setitem__(module, k, v)`` called directly."""
    return _MUTATIONS[0] if _TRACKING else None


def _count_mutation() -> None:
    with _COUNT_LOCK:
        _MUTATIONS[0] += 1


_TYPE_TRACKED: dict = {}


def mutations_tracked(cls) -> bool:
    """True when every item mutation of a ``cls`` instance goes through the wrappers
    ``patch()`` installs on ``mlx.nn.Module`` (no class between ``cls`` and it defines one
    of those methods, ``__setattr__`` or ``__delattr__`` itself)."""
    r = _TYPE_TRACKED.get(cls)
    if r is None:
        import mlx.nn as nn

        r = True
        for name in _TRACKED_NAMES + _UNWRAPPED_NAMES:
            for klass in cls.__mro__:
                if name in klass.__dict__:
                    r = r and klass is nn.Module
                    break
        _TYPE_TRACKED[cls] = r
    return r


def _start_tracking() -> None:
    import mlx.nn as nn

    if _TRACKING:
        return
    _count_mutation()

    def counting(name, base):
        # counted after the call: a reader that took the count before checking either
        # saw the change or sees a new count next time
        if name in ("pop", "setdefault"):
            @functools.wraps(base)
            def wrapper(self, key, *args):
                changes = (key in self) != (name == "setdefault")
                try:
                    return base(self, key, *args)
                finally:
                    if changes:
                        _count_mutation()
        else:
            @functools.wraps(base)
            def wrapper(self, *args, **kwargs):
                try:
                    return base(self, *args, **kwargs)
                finally:
                    _count_mutation()
        return wrapper

    for name in _TRACKED_NAMES:
        own = nn.Module.__dict__.get(name)
        w = counting(name, own if own is not None else getattr(dict, name))
        _TRACKING[name] = (w, own)
        setattr(nn.Module, name, w)
    _TYPE_TRACKED.clear()


def _stop_tracking() -> None:
    import mlx.nn as nn

    for name, (w, own) in list(_TRACKING.items()):
        if nn.Module.__dict__.get(name) is w:
            if own is None:
                delattr(nn.Module, name)
            else:
                setattr(nn.Module, name, own)
        else:
            config.warn_user(f"mlx-lily: mlx.nn.Module.{name} was replaced by someone else "
                             "after patching; left as it is", stacklevel=3)
    _TRACKING.clear()
    _TYPE_TRACKED.clear()


def original(owner, name="__call__"):
    """The original attribute ``owner.name`` saved by the active patch.

    Raises:
        KeyError: ``owner.name`` is not patched.
    """
    return _ORIGINALS[(owner, name)]


def _patch_modules():
    from mlx_lily.patches import PATCH_MODULES

    return [importlib.import_module(m) for m in PATCH_MODULES]


def supported_model_types() -> tuple:
    """mlx-lm ``model_type`` values Lily serves."""
    return tuple(t for m in _patch_modules() for t in m.MODEL_TYPES)


def _model_type(model):
    mt = getattr(model, "model_type", None)
    if mt is None:
        args = getattr(model, "args", None)
        mt = getattr(args, "model_type", None)
    return mt


def prepare_model(model, *, warn: bool = True) -> bool:
    """Apply the one-time weight re-layouts (fused projections) to a loaded model.

    Values are unchanged; each fused layer's arrays become slices of the fused buffer.
    Nothing is written to disk. Returns False (with one warning per model type) for a
    model type Lily does not serve, which then runs stock mlx-lm code.
    """
    mt = _model_type(model)
    for m in _patch_modules():
        if mt in m.MODEL_TYPES:
            m.prepare(model)
            model._lily_prepared = True
            if (backend.current_backend() != "cpu" and _ACTIVE is not None
                    and not getattr(model, "_lily_warm", False)):
                warmup(model)
                model._lily_warm = True
            if _ACTIVE is not None and _ACTIVE.announce and not getattr(model, "_lily_announced", False):
                model._lily_announced = True
                print(backend.status_line(mt), file=sys.stderr, flush=True)
            return True
    if warn and mt not in _WARNED_TYPES:
        _WARNED_TYPES.add(mt)
        config.warn_user(
            f"mlx-lily: model type {mt!r} is not supported (supported: "
            f"{', '.join(supported_model_types())}); running stock mlx-lm.",
            stacklevel=2)
    return False


def check_checkpoint(model_path) -> bool:
    """Validate a local checkpoint of a Lily model type before mlx-lm loads it.

    Returns True when it is an MLX-quantized checkpoint Lily can prepare; False (with a
    warning) when it has no ``quantization`` block (stock mlx-lm code then serves it).
    Other model types and non-directories are left to mlx-lm (True).
    Raises:
        mlx_lily.checkpoint.CheckpointError: a missing shard, a tensor of the wrong shape
            or dtype, an unreadable config: the message names the file and tensor.
    """
    import json
    from pathlib import Path

    from .checkpoint import NO_QUANT_MSG, CheckpointError, validate_checkpoint

    root = Path(model_path)
    cfg = root / "config.json"
    if not cfg.is_file():
        return True
    try:
        mt = json.loads(cfg.read_text()).get("model_type")
    except (OSError, ValueError):
        mt = None
    if mt not in supported_model_types():
        return True
    try:
        validate_checkpoint(root)
    except CheckpointError as e:
        if str(e) == NO_QUANT_MSG:
            config.warn_user(f"mlx-lily: {root}: {NO_QUANT_MSG}; running stock mlx-lm for it.",
                             stacklevel=3)
            return False
        raise
    return True


#: Prefill lengths whose graphs the CUDA warm-up records (besides its short prompt): at
#: Qwen3.6-35B-A3B's 256 experts, top-8, 1024 tokens pick 32-row grouped-GEMM tiles, 2048
#: and 8192 (Lily's CUDA chunk) 64-row ones.
WARMUP_RECORD_LENGTHS = (1024, 2048, 8192)
PRECOMPILE_ENV = config.SETTINGS["precompile"].env  # "0": leave CUDA kernels to MLX's JIT
last_warmup: dict = {}


def warmup(model, prompt_len: int = 8, record_lengths=WARMUP_RECORD_LENGTHS) -> float:
    """Build, launch and check every kernel the model's forward uses
    (``mlx_lily.first_contact.check``: a short prefill, one decode step and a
    ``first_contact.PREFILL_LEN``-token prefill on throw-away caches, every launch
    evaluated at once and the logits compared with the references), so the first real
    token pays no JIT cost and a kernel that fails to build, to launch or to give a
    sane result is turned off for the process (one warning naming the op) instead of
    failing the load or a generation. Returns seconds spent.

    On CUDA the graphs of those calls, and of prefills of ``record_lengths`` tokens (built,
    never evaluated: they pick the long-prompt kernel variants), are recorded first and
    their kernels compiled concurrently into MLX's on-disk cache
    (``mlx_lily.cuda_cache.precompile``); a later process finds them there. The report
    (``first_contact``: the check's report) lands in ``last_warmup``. Runs at prepare
    time on GPU backends only.
    """
    import time

    from . import first_contact

    t = time.perf_counter()
    precompile = config.precompile
    report: dict = {} if precompile else {"skipped": f"{PRECOMPILE_ENV}=0"}
    if backend.current_backend() == "cuda" and precompile:
        from . import cuda_cache

        try:
            outs, launches = cuda_cache.record_forward(model, prompt_len, record_lengths)
            del outs
            t_rec = time.perf_counter()
            report = cuda_cache.precompile(launches)
            report["record_s"] = t_rec - t
        except Exception as e:  # noqa: BLE001  (MLX's own JIT still compiles them)
            config.warn_user(f"mlx-lily: compiling CUDA kernels ahead of time failed ({e!r}); "
                             "MLX compiles them at first use", stacklevel=2)
            report = {"skipped": repr(e)}
    t_eval = time.perf_counter()
    if not backend.tracing_active():  # a traced backend records graphs, runs nothing
        report["first_contact"] = first_contact.check(model, prompt_len)
    report["first_eval_s"] = time.perf_counter() - t_eval
    last_warmup.clear()
    last_warmup.update(report)
    return time.perf_counter() - t


def _wrap_load_model(orig):
    def load_model(model_path, *args, **kwargs):
        lily = _ACTIVE is not None and check_checkpoint(model_path)
        if lily and _ACTIVE.deferred_line:
            _announce(_ACTIVE.deferred_line)
            _ACTIVE.deferred_line = None
        if lily and _ACTIVE.qualify_pending:
            _qualify_then_serve(model_path)
        lily = lily and _ACTIVE is not None and _ACTIVE.stepped_aside is None
        model, config = orig(model_path, *args, **kwargs)
        if lily:
            prepare_model(model)
        return model, config

    load_model.__wrapped__ = orig
    load_model.__doc__ = orig.__doc__
    return load_model


#: Prompt tokens per prefill chunk for a model Lily serves, per backend, when the caller
#: leaves ``prefill_step_size`` to mlx-lm's default. H200, ``benchmarks/gpu/prefill_bench.py``:
#: a 4K prompt 16,783 / 21,969 / 21,898 tok/s with 2048 / 4096 / 8192-token
#: chunks, a 32K one 14,358 / 17,309 / 19,399 (peak 30.9 / 32.8 / 34.6 GB, weights
#: included): each chunk pays a fixed ~13-18 ms host build and ~13-22 ms of mlx-lm's
#: ``mx.clear_cache()`` besides its GPU work. Backends not listed keep mlx-lm's default.
PREFILL_STEP_SIZE = {"cuda": 8192}
PREFILL_STEP_ENV = config.SETTINGS["prefill_step"].env  # tokens per chunk; "0": mlx-lm's
#: The ops whose kernels make a prefill chunk's cost what ``PREFILL_STEP_SIZE`` was measured
#: with: with all of them off the chunk stays mlx-lm's.
PREFILL_OPS = ("moe_grouped", "gated_delta", "attention")


#: Decoder layers per ``mx.async_eval`` group inside a multi-token (prefill) call of a
#: patched decoder stack, per backend: the GPU runs the first layers while Python builds
#: the rest, instead of idling for the whole chunk's build and the start of its dispatch.
#: H200, ``benchmarks/gpu/ttft_probe.py``, a 4096-token prompt's time to
#: first token, median of 5: groups of 2 / 4 / 8 layers 167.5 / 174.2 / 175.3 ms, one
#: group 194.8 ms. Backends not listed: one group (mlx-lm's behaviour).
PREFILL_EVAL_LAYERS = {"cuda": 2}
PREFILL_EVAL_ENV = tuning.KNOBS["prefill_eval_layers"].env  # layers per group; "0": one
#: Fewest rows (batch x tokens) a call needs before ``PREFILL_EVAL_LAYERS`` applies: a
#: short call builds in well under a millisecond and would only pay the extra evals.
PREFILL_EVAL_MIN_ROWS = 512


#: The settings' one-warning-per-value record (``config.WARNED``).
_ENV_COUNT_WARNED = config.WARNED


def _recording_launches() -> bool:
    cc = sys.modules.get("mlx_lily.cuda_cache")
    return cc is not None and cc.recording_active()


def prefill_eval_layers(rows: int) -> int:
    """Decoder layers per evaluation group for a multi-token call of ``rows`` rows
    (batch x tokens) of a patched decoder stack; 0 = no groups (the caller's eval runs the
    whole stack at once).

    ``MLX_LILY_PREFILL_EVAL_LAYERS=N`` (N > 0) applies N to every multi-token call on any
    backend ("0": no groups; not an integer: one warning, then unset); unset, ``PREFILL_EVAL_LAYERS`` for the
    current backend applies to calls of at least ``PREFILL_EVAL_MIN_ROWS`` rows. Never
    groups while a graph is only recorded (``backend.tracing_backend``,
    ``cuda_cache.recording``: the warm-up builds long prefills without running them).
    """
    if rows <= 1 or backend.tracing_active() or _recording_launches():
        return 0
    n = tuning.prefill_eval_layers
    if n is not None:
        return n
    if rows < PREFILL_EVAL_MIN_ROWS:
        return 0
    return PREFILL_EVAL_LAYERS.get(backend.current_backend(), 0)


class DefaultStepSize(int):
    """mlx-lm's default prefill chunk (``mlx_lm.generate.DEFAULT_PREFILL_STEP_SIZE``) as the
    patch marks it: equal to the original value, but a value the user did not choose (the
    ``mlx_lm.generate`` CLI passes its argparse default on; a ``--prefill-step-size`` the
    user types arrives as a plain ``int``)."""


def prefill_step_size(model, requested=None) -> int | None:
    """The prefill chunk ``generate_step`` uses for ``model`` while patched.

    Args:
        model: an mlx-lm model.
        requested: the caller's ``prefill_step_size``: None or a ``DefaultStepSize`` means
            the caller left it to the default.
    Returns:
        ``requested`` when the caller chose it (a plain int); else, while patched, for a
        model Lily prepared (``prepare_model``) with one of ``PREFILL_OPS`` enabled, on a
        backend in ``PREFILL_STEP_SIZE`` (or with ``MLX_LILY_PREFILL_STEP`` set to a
        positive integer), that size; else ``requested`` (None: mlx-lm's default).
    """
    if requested is not None and not isinstance(requested, DefaultStepSize):
        return requested
    if (_ACTIVE is None or not getattr(model, "_lily_prepared", False)
            or not any(backend.op_enabled(op) for op in PREFILL_OPS)):
        return requested
    n = config.prefill_step
    if n is not None:
        return n if n > 0 else requested
    return PREFILL_STEP_SIZE.get(backend.current_backend(), requested)


def _wrap_generate_step(orig):
    def generate_step(prompt, model, *args, **kwargs):
        if _ACTIVE is None:  # a reference kept past unpatch()
            return orig(prompt, model, *args, **kwargs)
        step = prefill_step_size(model, kwargs.get("prefill_step_size"))
        if step is not None:
            kwargs["prefill_step_size"] = int(step)
        return orig(prompt, model, *args, **kwargs)

    generate_step.__wrapped__ = orig
    generate_step.__doc__ = orig.__doc__
    return generate_step


def _optional_module(name: str):
    """``importlib.import_module(name)``, or None when it cannot be imported (``mlx_lm.chat``
    needs ``rich``, which mlx-lm does not declare): its names are then left unpatched."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _collect_targets():
    utils = importlib.import_module("mlx_lm.utils")
    triples = []
    for m in _patch_modules():
        triples.extend(m.targets())
    triples.append((utils, "load_model", _wrap_load_model(utils.load_model)))
    # where mlx-lm looks generate_step up (cache_prompt binds it at import) and the CLI
    # defaults of prefill_step_size (generate, chat)
    gen = importlib.import_module("mlx_lm.generate")
    wrapped = _wrap_generate_step(gen.generate_step)
    for name in ("mlx_lm.generate", "mlx_lm.cache_prompt"):
        mod = _optional_module(name)
        if mod is not None and getattr(mod, "generate_step", None) is gen.generate_step:
            triples.append((mod, "generate_step", wrapped))
    # BatchGenerator's prefill: one sequence at a time (patches.batch_prefill)
    ppb = getattr(gen, "PromptProcessingBatch", None)
    if isinstance(ppb, type) and "prompt" in ppb.__dict__:
        from mlx_lily.patches.batch_prefill import wrap_prompt

        triples.append((ppb, "prompt", wrap_prompt(ppb.__dict__["prompt"])))
    for name in ("mlx_lm.generate", "mlx_lm.chat"):
        mod = _optional_module(name)
        default = getattr(mod, "DEFAULT_PREFILL_STEP_SIZE", None)
        if type(default) is int:
            triples.append((mod, "DEFAULT_PREFILL_STEP_SIZE", DefaultStepSize(default)))
    return triples


def _get_raw(owner, name):
    if isinstance(owner, type):
        for klass in owner.__mro__:
            if name in klass.__dict__:
                if klass is not owner:
                    return None
                return klass.__dict__[name]
        return None
    return getattr(owner, name)


def kernel_cache_dir():
    """The folder ``patch()`` points MLX's on-disk CUDA kernel cache at when
    ``MLX_PTX_CACHE_DIR`` is unset: ``<cache_dir>/cuda-kernels`` (a ``Path``)."""
    return config.cache_dir / "cuda-kernels"


def _default_kernel_cache_dir() -> None:
    """Point MLX's on-disk cache of compiled CUDA kernels (``MLX_PTX_CACHE_DIR``, default
    a temp dir that reboots clear) at a persistent per-user folder (``kernel_cache_dir``),
    unless the user chose one. MLX keys each entry by kernel name and source hash, so
    every kernel is compiled once per machine."""
    import os

    global _SET_CACHE_ENV
    if "MLX_PTX_CACHE_DIR" not in os.environ:
        os.environ["MLX_PTX_CACHE_DIR"] = _SET_CACHE_ENV = str(kernel_cache_dir())


_SET_CACHE_ENV: str | None = None  # the MLX_PTX_CACHE_DIR value patch() set, if it did


def _restore_kernel_cache_env() -> None:
    """Unset ``MLX_PTX_CACHE_DIR`` if ``patch()`` set it and nobody changed it since (MLX
    itself keeps whatever folder it read first)."""
    import os

    global _SET_CACHE_ENV
    if _SET_CACHE_ENV is not None and os.environ.get("MLX_PTX_CACHE_DIR") == _SET_CACHE_ENV:
        del os.environ["MLX_PTX_CACHE_DIR"]
    _SET_CACHE_ENV = None


def _prefix_cache(on: bool) -> None:
    """Install (``on``) or remove ``mlx_lily.prefix_cache`` in mlx-lm; a failure warns and
    leaves mlx-lm's own prompt cache."""
    try:
        pc = importlib.import_module("mlx_lily.prefix_cache")
        pc.install_if_enabled() if on else pc.uninstall()
    except Exception as e:  # noqa: BLE001  (the kernels' patch stands without it)
        config.warn_user(f"mlx-lily: prefix cache not {'installed' if on else 'removed'} "
                         f"({type(e).__name__}: {e}); mlx-lm's prompt cache serves", stacklevel=3)


STEP_ASIDE_ENV = "MLX_LILY_STEP_ASIDE"


def step_aside_enabled() -> bool:
    """``MLX_LILY_STEP_ASIDE``: ``0`` (also ``off``, ``no``, ``false``) keeps Lily's
    forwards installed where no kernel would run (the ops' references then run through
    them: the test suite's parity runs on the CPU); anything else, or unset, lets
    ``patch`` step aside."""
    return tuning.step_aside


def kernel_plan(force: bool = False) -> tuple:
    """What ``patch`` does on this device now: ``("serve", "")`` (install Lily's
    forwards), ``("qualify", reason)`` (a GPU with no qualification record, auto
    qualification on: install only the load hook, which qualifies the first Lily model
    loaded and then serves or steps aside) or ``("aside", reason)`` (no op would run a
    kernel here: mlx-lm's own code stays). ``force`` (or ``MLX_LILY_STEP_ASIDE=0``)
    always serves."""
    from . import first_contact, kernels

    if force or not step_aside_enabled():
        return "serve", ""
    be = backend.current_backend()
    if be == "cpu":
        return "aside", "the CPU backend runs no Lily kernels"
    if first_contact.active_ops(be):
        return "serve", ""
    from . import qualify

    dev = f"{kernels.device_name() or 'this GPU'} ({be})"
    status = qualify.record_status(be)
    if status == "valid":
        return "aside", qualify.why_none(be)
    if qualify.auto_enabled():
        return "qualify", f"no qualification record for {dev}"
    return "aside", (f"no Lily kernel is verified for {dev} (no qualification record; "
                     f"{qualify.QUALIFY_ENV}=0)")


_ANNOUNCED: set = set()


def _announce(line: str) -> None:
    """Print ``line`` to stderr once per process."""
    if line not in _ANNOUNCED:
        _ANNOUNCED.add(line)
        print(line, file=sys.stderr, flush=True)


def _aside_line(reason: str) -> str:
    return f"[mlx-lily] stepping aside: {reason}; mlx-lm runs its own code."


#: Features ``patch`` installs whatever the kernels do (pure cache logic, no kernels):
#: ``(install, uninstall)`` pairs, run in order by ``patch`` / in reverse by ``unpatch``,
#: also when Lily steps aside. Each ``install()`` returns an opaque token handed back to
#: its ``uninstall(token)``.
INDEPENDENT_FEATURES: list = [(lambda: _prefix_cache(True), lambda _token: _prefix_cache(False))]


def _install_independent(handle: PatchHandle) -> None:
    handle.features = []
    for install, uninstall in INDEPENDENT_FEATURES:
        handle.features.append((uninstall, install()))


def _uninstall_independent(handle: PatchHandle) -> None:
    for uninstall, token in reversed(getattr(handle, "features", [])):
        uninstall(token)
    handle.features = []


def _apply_targets(triples) -> list:
    applied = []
    for owner, name, repl in triples:
        orig = _get_raw(owner, name)
        if orig is None:
            for o, n, og, _ in reversed(applied):
                setattr(o, n, og)
                _ORIGINALS.pop((o, n), None)
            raise RuntimeError(f"mlx-lily: {owner!r} has no attribute {name!r} of its own; "
                               "this mlx-lm version is not supported")
        _ORIGINALS[(owner, name)] = orig
        setattr(owner, name, repl)
        applied.append((owner, name, orig, repl))
    return applied


def _serve(handle: PatchHandle) -> None:
    """Install Lily's forwards on ``handle`` (stepped aside before: the load hook only)."""
    for owner, name, orig, repl in reversed(handle.targets):
        setattr(owner, name, orig)
        _ORIGINALS.pop((owner, name), None)
    handle.targets = _apply_targets(_collect_targets())
    handle.stepped_aside = None
    handle.qualify_pending = False
    _start_tracking()


def _load_hook_targets():
    utils = importlib.import_module("mlx_lm.utils")
    return [(utils, "load_model", _wrap_load_model(utils.load_model))]


def _qualify_then_serve(model_path) -> None:
    """The first Lily checkpoint loaded while qualification is pending: qualify this
    device at its shapes (``mlx_lily.qualify.auto_qualify``, a child process), then serve
    if some op qualified, else step aside for good."""
    from . import first_contact, qualify

    handle = _ACTIVE
    handle.qualify_pending = False
    try:
        qualify.auto_qualify(model=str(model_path))
    except Exception as e:  # noqa: BLE001  (qualification must never fail a load)
        config.warn_user(f"mlx-lily: qualification failed ({e!r})", stacklevel=3)
    be = backend.current_backend()
    if first_contact.active_ops(be):
        _serve(handle)
        if not handle.announce:  # with announce, prepare_model prints the status line
            _announce(backend.describe())
    else:
        handle.stepped_aside = qualify.why_none(be)
        _announce(_aside_line(handle.stepped_aside))


def patch(model=None, *, ops=None, force: bool = False, announce: bool = False,
          **settings) -> PatchHandle:
    """Patch mlx-lm so Qwen3.5/3.6 and Qwen3-Next models run through Lily's ops.

    Where no op would run a kernel on this device (the CPU backend; a GPU whose
    qualification record passed nothing; no record, no shipped record for the device and
    ``MLX_LILY_QUALIFY=0``), Lily steps aside: mlx-lm's own code stays in place, one
    line on stderr says so and ``backend_info()["patch"]`` is ``"stepped-aside"``. On a
    GPU with no record (auto qualification on) only the load hook is installed: the
    first Lily checkpoint loaded through ``mlx_lm.load`` qualifies the device first
    (``mlx_lily.qualify``), then Lily serves or steps aside. ``INDEPENDENT_FEATURES``
    are installed either way.

    Args:
        model: optionally a loaded mlx-lm model to prepare now (fused projections);
            models loaded later through ``mlx_lm.load`` are prepared automatically. A
            model of an unsupported type gets one warning and stays stock.
        ops: iterable of op names to use (see ``mlx_lily.registry``); None = all.
            ``MLX_LILY_DISABLE`` still applies on top.
        force: install Lily's forwards even where no kernel would run (the references
            then run through them); ``MLX_LILY_STEP_ASIDE=0`` does the same.
        announce: print one line to stderr when a supported model is loaded (the
            status line, or why Lily stepped aside) instead of at this call (the
            ``--lily`` hook and the console scripts use it).
        **settings: user settings replacing their environment variables until
            ``unpatch()`` (``mlx_lily.config``): ``kernels`` (``"verified"``, ``"all"`` or
            op names), ``disable`` (op names or ``"all"``), ``compile`` (bool),
            ``cache_dir`` (a folder), ``precompile`` (bool), ``prefill_step`` (tokens;
            0: mlx-lm's default). A later ``patch(...)`` replaces them all.
    Returns:
        The active ``PatchHandle`` (the same one when already patched: idempotent).
    Raises:
        ValueError: an unknown op name, setting or setting value.
    """
    global _ACTIVE
    backend.select_ops(ops)
    try:
        config.set_overrides(**settings)
    except ValueError:
        if _ACTIVE is None:
            backend.select_ops(None)
        raise
    _default_kernel_cache_dir()
    if _ACTIVE is None:
        handle = PatchHandle([], ops)
        handle.announce = announce
        _install_independent(handle)
        try:
            decision, reason = kernel_plan(force)
        except Exception as e:  # noqa: BLE001  (deciding must not break the caller)
            decision, reason = "aside", f"could not decide ({e!r})"
        try:
            if decision == "serve":
                handle.targets = _apply_targets(_collect_targets())
                _start_tracking()
            else:
                handle.stepped_aside = reason
                if decision == "qualify":
                    handle.qualify_pending = True
                    line = (f"[mlx-lily] {reason}: the first Lily model loaded is "
                            "qualified first (minutes, once per device and version; "
                            "MLX_LILY_QUALIFY=0 skips it).")
                else:
                    line = _aside_line(reason)
                if decision == "qualify" or announce:
                    handle.targets = _apply_targets(_load_hook_targets())
                if announce:
                    handle.deferred_line = line
                else:
                    _announce(line)
        except BaseException:
            _uninstall_independent(handle)
            raise
        _ACTIVE = handle
        fresh = True
    else:
        _ACTIVE.ops = ops
        _ACTIVE.announce = _ACTIVE.announce or announce
        fresh = False
        if force and _ACTIVE.stepped_aside is not None:
            _serve(_ACTIVE)
    if model is not None and _ACTIVE.stepped_aside is None:
        try:
            prepare_model(model)
        except BaseException:
            if fresh:  # leave nothing half-applied
                unpatch(_ACTIVE)
            raise
    return _ACTIVE


def unpatch(handle: PatchHandle | None = None) -> bool:
    """Restore every patched attribute to its original object (by identity).

    Each model's compiled decode steps stay on the model, unused while unpatched, and
    serve the next patch with the same switches and weights (``compile_key``, weight
    signatures): a patch toggled around each call, as the A/B does, does not trace the
    decode step again. ``mlx_lily.patches.qwen3_next.drop_compiled_steps()`` releases them.

    Args:
        handle: the handle to undo; None = whatever is active.
    Returns:
        True if a patch was removed, False if none was active (or ``handle`` is stale).
    """
    global _ACTIVE
    if _ACTIVE is None or (handle is not None and handle is not _ACTIVE):
        return False
    for owner, name, orig, repl in reversed(_ACTIVE.targets):
        if _get_raw(owner, name) is not repl:
            config.warn_user(f"mlx-lily: {owner!r}.{name} was replaced by someone else after "
                             "patching; restoring the original anyway", stacklevel=2)
        setattr(owner, name, orig)
        _ORIGINALS.pop((owner, name), None)
    handle = _ACTIVE
    _ACTIVE = None
    _stop_tracking()
    _uninstall_independent(handle)
    backend.select_ops(None)
    config.clear_overrides()
    from mlx_lily.patches.qwen3_next import drop_views

    drop_views()
    _restore_kernel_cache_env()
    return True


def is_patched() -> bool:
    """True while a Lily patch is active."""
    return _ACTIVE is not None


@contextlib.contextmanager
def patched(model=None, *, ops=None, force: bool = False, **settings):
    """Context manager: patch on entry (``patch(model, ops=ops, force=force,
    **settings)``), restore on exit (only if this call patched; else the previous op
    selection and settings).

    Yields the ``PatchHandle``.
    """
    was = _ACTIVE
    prev_ops = was.ops if was is not None else None
    prev_settings = config.overrides()
    try:
        handle = patch(model, ops=ops, force=force, **settings)
    except BaseException:
        if was is not None:
            patch(ops=prev_ops, **prev_settings)
        raise
    try:
        yield handle
    finally:
        if was is None:
            unpatch(handle)
        else:
            patch(ops=prev_ops, **prev_settings)
