"""User settings: one typed table, read from the environment and from ``patch(...)``.

========================  ============================  =====================================
attribute                 variable                      values (default first)
========================  ============================  =====================================
``kernels``               ``MLX_LILY_KERNELS``          ``verified`` | ``all`` | op,op,...
``disable``               ``MLX_LILY_DISABLE``          (none) | ``all`` | op,op,...
``compile``               ``MLX_LILY_COMPILE``          (GPU backends only) | ``1`` | ``0``
``cache_dir``             ``MLX_LILY_CACHE_DIR``        ``~/.cache/mlx-lily`` | a folder
``precompile``            ``MLX_LILY_PRECOMPILE``       ``1`` | ``0``
``prefill_step``          ``MLX_LILY_PREFILL_STEP``     (per backend) | tokens | ``0``
``qualify``               ``MLX_LILY_QUALIFY``          ``1`` | ``0``
``prefix_cache``          ``MLX_LILY_PREFIX_CACHE``     ``1`` | ``0``
``hook``                  ``MLX_LILY``                  ``0`` | ``1`` (patch every mlx-lm command)
========================  ============================  =====================================

Code reads ``config.kernels`` and so on (module properties; ``current()`` returns all as one
``Settings``). A value is read when it is used: from the environment at that moment, or,
inside ``env_frozen()`` (one forward of a patched decoder stack), as the environment held
it at the block's first read; a keyword argument of ``patch(...)`` replaces the variable
until ``unpatch()``. Each distinct raw value is parsed once.

One rule for a bad value: one warning naming the variable and the values it accepts, then
the default (a list with some unknown names keeps the names it knows, after the warning).
Nothing raises during a forward because of a setting; a bad keyword argument to
``patch(...)`` raises ``ValueError`` there.

The benchmarking knobs (``MLX_LILY_COMPILE_WHOLE`` ...) are in ``mlx_lily.tuning``. This
module imports neither MLX nor mlx-lm.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple


class _EnvSnapshot(threading.local):
    values: dict | None = None  # variable -> raw value, inside env_frozen
    parsed: dict | None = None  # setting -> parsed value, inside env_frozen


_ENV = _EnvSnapshot()


def env_value(name: str, default: str = "") -> str:
    """The variable ``name`` as the environment holds it (``os.environ.get``): read at
    every call, or once per ``env_frozen`` block, so a change made while a model runs
    applies from the next forward."""
    snap = _ENV.values
    if snap is None:
        return os.environ.get(name, default)
    if name not in snap:
        snap[name] = os.environ.get(name)
    v = snap[name]
    return default if v is None else v


@contextlib.contextmanager
def env_frozen():
    """Within this block ``env_value`` reads each variable from the environment once (a
    decode step reads the settings hundreds of times). Nested blocks share the outer
    snapshot."""
    if _ENV.values is not None:
        yield
        return
    _ENV.values = {}
    _ENV.parsed = {}
    try:
        yield
    finally:
        _ENV.values = None
        _ENV.parsed = None


class BadValue(ValueError):
    """A parser's verdict on a raw value. ``value`` is what to use instead (None: the
    default); ``detail`` what was wrong, for the warning."""

    def __init__(self, detail: str = "", value: Any = None):
        super().__init__(detail)
        self.detail = detail
        self.value = value


class Setting(NamedTuple):
    """One environment variable: ``parse(raw) -> value`` raises ``BadValue`` for a value
    outside ``accepted`` (text for the warning); an empty or unset variable is
    ``default``."""

    attr: str
    env: str
    default: Any
    parse: Callable[[str], Any]
    accepted: str
    doc: str


def warn_user(message: str, *, stacklevel: int = 2, category: type = UserWarning) -> None:
    """Emit ``message`` as a ``category`` warning attributed ``stacklevel`` frames up from the
    caller. Where the warning filters turn it into an exception (``python -W error``,
    ``warnings.simplefilter("error")``), print it to stderr instead: every Lily warning
    announces a fallback (a kernel off, the stock path for an op, a default setting), and
    that fallback must still happen rather than fail the load or the forward."""
    try:
        warnings.warn(message, category, stacklevel=stacklevel + 1)
    except Warning:
        print(f"{category.__name__}: {message}", file=sys.stderr)


#: (variable, raw value) pairs already warned about (one warning each per process).
WARNED: set = set()
_PARSED: dict = {}


def warn_bad(env: str, raw: str, accepted: str, detail: str = "", default_text: str = "") -> None:
    """The one warning for a bad value of ``env`` (once per raw value)."""
    if (env, raw) in WARNED:
        return
    WARNED.add((env, raw))
    what = f" ({detail})" if detail else ""
    then = default_text or "using the default"
    warn_user(f"mlx-lily: {env}={raw!r} is not valid{what}; accepted: {accepted}; {then}",
              stacklevel=4)


def _parse(s: Setting, raw: str) -> tuple:
    raw_s = raw.strip()
    if not raw_s:
        return s.default, None
    try:
        return s.parse(raw_s), None
    except BadValue as e:
        return (s.default if e.value is None else e.value), e.detail


def read(s: Setting, raw: str | None = None) -> Any:
    """The parsed value of setting ``s`` (the environment now, or ``raw``)."""
    if raw is None:
        raw = env_value(s.env, "")
    key = (s.env, raw)
    hit = _PARSED.get(key)
    if hit is None:
        hit = _PARSED[key] = _parse(s, raw)
    value, detail = hit
    if detail is not None:
        warn_bad(s.env, raw, s.accepted, detail,
                 "" if value is s.default else "using the rest")
    return value


# ---------------------------------------------------------------- parsers


def one_of(*choices: str, values: dict | None = None) -> Callable[[str], Any]:
    """A parser accepting exactly ``choices`` (mapped through ``values`` when given)."""

    def parse(raw: str):
        if raw not in choices:
            raise BadValue()
        return values[raw] if values else raw

    return parse


def flag(raw: str) -> bool:
    """``"1"`` -> True, ``"0"`` -> False."""
    if raw not in ("0", "1"):
        raise BadValue()
    return raw == "1"


def count(raw: str) -> int:
    """An integer; 0 or less reads as 0 (the variable's "off")."""
    try:
        return max(int(raw), 0)
    except ValueError:
        raise BadValue("not an integer") from None


def int_range(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """A parser for one integer in ``lo..hi`` (no upper bound when ``hi`` is None)."""

    def parse(raw: str) -> int:
        try:
            v = int(raw)
        except ValueError:
            raise BadValue("not an integer") from None
        if v < lo or (hi is not None and v > hi):
            raise BadValue("out of range")
        return v

    return parse


def int_tuple(n: int, lo: int, hi: int) -> Callable[[str], tuple]:
    """A parser for ``n`` comma-separated integers, each in ``lo..hi``."""

    def parse(raw: str) -> tuple:
        try:
            v = tuple(int(t) for t in raw.split(","))
        except ValueError:
            raise BadValue("not integers") from None
        if len(v) != n or not all(lo <= x <= hi for x in v):
            raise BadValue(f"needs {n} integers {lo}..{hi}")
        return v

    return parse


def op_list(extra: tuple, expand_all: bool = False) -> Callable[[str], frozenset]:
    """A parser for a comma list of op names from ``mlx_lily.registry`` (and ``extra``);
    with ``expand_all``, ``all`` adds every op name. Unknown names: ``BadValue`` carrying
    the known ones (None when there are none)."""

    def parse(raw: str) -> frozenset:
        from .registry import NAMES

        names = frozenset(t.strip() for t in raw.split(",") if t.strip())
        unknown = sorted(names - set(NAMES) - set(extra))
        if expand_all and "all" in names:
            names = names | frozenset(NAMES)
        if unknown:
            known = names - set(unknown)
            raise BadValue(f"unknown op(s) {unknown}", frozenset(known) if known else None)
        return names

    return parse


def _folder(raw: str) -> Path:
    p = Path(raw).expanduser()
    if p.exists() and not p.is_dir():
        raise BadValue("exists and is not a folder")
    return p


_OPS_TEXT = "op names (see mlx_lily.registry)"

SETTINGS: dict = {s.attr: s for s in (
    Setting("kernels", "MLX_LILY_KERNELS", frozenset({"verified"}),
            op_list(("all", "verified")), f"'verified', 'all', or a comma list of {_OPS_TEXT}",
            "which custom kernels may run: those verified on this backend (default), all, "
            "or the listed ops ('verified' may be one of them); others run the reference"),
    Setting("disable", "MLX_LILY_DISABLE", frozenset(), op_list(("all",), expand_all=True),
            f"'all' or a comma list of {_OPS_TEXT}",
            "ops sent to stock mlx-lm code for every call (the kill switch)"),
    Setting("compile", "MLX_LILY_COMPILE", None, flag, "'0', '1'",
            "compiled decode steps: 1 on every backend, 0 off; unset: on GPU backends only"),
    Setting("cache_dir", "MLX_LILY_CACHE_DIR", Path.home() / ".cache" / "mlx-lily", _folder,
            "a folder path (created on first use)",
            "root of Lily's on-disk caches (compiled CUDA kernels, tokenizer, checkpoints)"),
    Setting("precompile", "MLX_LILY_PRECOMPILE", True, flag, "'1', '0'",
            "0: leave every CUDA kernel to MLX's own JIT (no ahead-of-time compile)"),
    Setting("prefill_step", "MLX_LILY_PREFILL_STEP", None, count,
            "an integer (0: mlx-lm's default)",
            "prompt tokens per prefill chunk when the caller leaves it to the default; "
            "unset: Lily's per-backend size"),
    Setting("qualify", "MLX_LILY_QUALIFY", True, flag, "'1', '0'",
            "0: ignore qualification records and never qualify a GPU on first use "
            "(the shipped record of the devices measured for this release applies)"),
    Setting("prefix_cache", "MLX_LILY_PREFIX_CACHE", True, flag, "'1', '0'",
            "0: patch() does not install the prefix cache for agent loops "
            "(mlx_lily.prefix_cache)"),
    Setting("hook", "MLX_LILY", False, flag, "'0', '1'",
            "1: every mlx-lm command patches itself as with --lily"),
)}


@dataclass(frozen=True)
class Settings:
    """All user settings at one moment (``current()``)."""

    kernels: frozenset
    disable: frozenset
    compile: bool | None
    cache_dir: Path
    precompile: bool
    prefill_step: int | None
    qualify: bool
    prefix_cache: bool
    hook: bool


_OVERRIDES: dict = {}
_NONE = object()


def cached(table: dict, attr: str, where: str, overrides: dict | None = None) -> Any:
    """``overrides[attr]`` or ``read(table[attr])``, kept for the rest of an ``env_frozen``
    block (a decode step reads the settings hundreds of times).

    Raises:
        AttributeError: ``table`` has no ``attr``.
    """
    parsed = _ENV.parsed
    if parsed is not None:
        v = parsed.get(attr, _NONE)
        if v is not _NONE:
            return v
    if overrides and attr in overrides:
        v = overrides[attr]
    else:
        s = table.get(attr)
        if s is None:
            raise AttributeError(f"module {where!r} has no attribute {attr!r}")
        v = read(s)
    if parsed is not None:
        parsed[attr] = v
    return v


def value(attr: str) -> Any:
    """The setting ``attr`` now: a ``patch(...)`` keyword argument, else the environment.

    Raises:
        AttributeError: no setting has that name.
    """
    return cached(SETTINGS, attr, "mlx_lily.config", _OVERRIDES)


def current() -> Settings:
    """Every user setting now, as one ``Settings``."""
    return Settings(**{a: value(a) for a in SETTINGS})


def parse_keyword(attr: str, v: Any) -> Any:
    """A ``patch(...)`` keyword argument as the setting's typed value: the typed value
    itself, or the text the variable would hold.

    Raises:
        ValueError: an unknown setting or a bad value (names the argument and what it
            accepts).
    """
    s = SETTINGS.get(attr)
    if s is None or attr == "hook":
        raise ValueError(f"mlx-lily: patch() has no setting {attr!r}; settings: "
                         f"{[a for a in SETTINGS if a != 'hook']}")
    if v is None:
        return s.default
    if isinstance(v, bool) and s.parse is flag:
        return v
    if attr in ("kernels", "disable") and not isinstance(v, str):
        v = ",".join(v)
    elif isinstance(v, os.PathLike) or (isinstance(v, int) and not isinstance(v, bool)):
        v = str(v)
    if not isinstance(v, str):
        raise ValueError(f"mlx-lily: patch({attr}=...): got {v!r}; accepted: {s.accepted}")
    try:
        return s.parse(v.strip()) if v.strip() else s.default
    except BadValue as e:
        raise ValueError(f"mlx-lily: patch({attr}={v!r}): {e.detail or 'not valid'}; "
                         f"accepted: {s.accepted}") from None


def set_overrides(**kw) -> None:
    """Replace the ``patch(...)`` keyword settings by ``kw`` (validated first: nothing
    changes when one is bad).

    Raises:
        ValueError: see ``parse_keyword``.
    """
    parsed = {a: parse_keyword(a, v) for a, v in kw.items()}
    _OVERRIDES.clear()
    _OVERRIDES.update(parsed)
    if _ENV.parsed is not None:
        _ENV.parsed.clear()


def clear_overrides() -> None:
    """Back to the environment for every setting (``unpatch()``)."""
    _OVERRIDES.clear()
    if _ENV.parsed is not None:
        _ENV.parsed.clear()


def overrides() -> dict:
    """The ``patch(...)`` keyword settings in force (a copy)."""
    return dict(_OVERRIDES)


def install_properties(module_name: str, table: dict, get: Callable[[str], Any]) -> None:
    """Make ``<module>.<attr>`` read ``get(attr)`` for every entry of ``table`` (properties on
    the module's class: an attribute read, no ``__getattr__`` fallback)."""
    import sys
    import types

    mod = sys.modules[module_name]
    ns = {a: property(lambda _m, _a=a: get(_a), doc=e.doc) for a, e in table.items()}
    mod.__class__ = type(f"{module_name}.module", (types.ModuleType,), ns)


install_properties(__name__, SETTINGS, value)
