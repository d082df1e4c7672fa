"""The prefix cache inside ``mlx_lm.server``.

Hook points (each where mlx-lm looks the name up, each restored by ``uninstall``):

- ``mlx_lm.models.cache.LRUPromptCache`` (and ``mlx_lm.server.LRUPromptCache`` when that
  module is loaded) -> ``PrefixCache``: ``mlx_lm.server.run`` builds its prompt cache from
  the name its module imported, and ``python -m mlx_lm.server`` runs the server as
  ``__main__``, which imports the name only after the ``--lily`` hook has patched.
- ``ResponseGenerator._tokenize`` of the server module (``mlx_lm.server``, or ``__main__``
  when it runs as ``python -m mlx_lm.server``, hooked when its ``PrefixCache`` is built):
  the prompt is split into segments ending at every snapshot point. The batched path
  (``BatchGenerator``) then stops its prefill there and stores each segment end through
  ``insert_cache``; segments carry the ``"snapshot"`` type, so the store keeps them as
  snapshots, except the last (the end of the prefill), kept as a full cache until the
  request's final cache replaces it.
- ``stream_generate`` in the server module: the sequential path (``_serve_single``:
  requests with a seed, KV quantization) prefills up to the last snapshot point itself,
  storing snapshots, before mlx-lm's ``stream_generate`` runs the rest.
"""

from __future__ import annotations

import importlib
import sys
import threading

from .. import config

_PATCHED: list = []  # (owner, name, original, replacement)
_ACTIVE = [False]
_LOCAL = threading.local()
_CAPABLE: dict = {}  # id(model) -> (model, snapshot_capable(model's cache))
_ORIG_LRU: list = []  # mlx-lm's LRUPromptCache while installed
_WARNED: list = []  # server modules warned about


def installed() -> bool:
    """True while ``install`` is in effect."""
    return _ACTIVE[0]


def _set(owner, name, repl):
    orig = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    _PATCHED.append((owner, name, orig, repl))
    setattr(owner, name, repl)


def _patched(owner, name) -> bool:
    return any(o is owner and n == name for o, n, _, _ in _PATCHED)


def _server_modules():
    mods = [sys.modules.get("mlx_lm.server")]
    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None) == "mlx_lm.server":
        mods.append(main)
    return [m for m in mods if m is not None and hasattr(m, "ResponseGenerator")]


def install() -> bool:
    """Install the prefix cache into mlx-lm (idempotent). Returns True if it is installed
    now."""
    from .store import PrefixCache

    if _ACTIVE[0]:
        return True
    cache_mod = importlib.import_module("mlx_lm.models.cache")
    _ORIG_LRU[:] = [cache_mod.LRUPromptCache]
    _set(cache_mod, "LRUPromptCache", PrefixCache)
    _ACTIVE[0] = True
    for mod in _server_modules():
        _hook_server(mod)
    return True


def install_if_enabled() -> bool:
    """``install`` unless ``settings().enabled`` is off (``MLX_LILY_PREFIX_CACHE=0``): what
    ``mlx_lily.patch()`` calls. Returns True if installed."""
    from . import settings

    return install() if settings().enabled else False


def uninstall() -> bool:
    """Restore every name ``install`` replaced (by identity). Returns True if anything
    was installed."""
    if not _ACTIVE[0]:
        return False
    while _PATCHED:
        owner, name, orig, repl = _PATCHED.pop()
        if getattr(owner, name, None) is repl:
            setattr(owner, name, orig)
    _ACTIVE[0] = False
    _CAPABLE.clear()
    _ORIG_LRU.clear()
    return True


def _on_store_created(store) -> None:
    """Called by every new ``PrefixCache``: hooks server modules loaded since ``install``
    (``mlx_lm.server.run`` builds its cache before its ``ResponseGenerator``)."""
    if _ACTIVE[0]:
        for mod in _server_modules():
            _hook_server(mod)


def _hook_server(mod) -> None:
    from .store import PrefixCache

    if (_ORIG_LRU and getattr(mod, "LRUPromptCache", None) is _ORIG_LRU[0]
            and not _patched(mod, "LRUPromptCache")):
        _set(mod, "LRUPromptCache", PrefixCache)
    rg = mod.ResponseGenerator
    if "_tokenize" not in rg.__dict__ or not callable(getattr(mod, "stream_generate", None)):
        if mod not in _WARNED:
            _WARNED.append(mod)
            config.warn_user(f"mlx-lily: {mod.__name__} has no ResponseGenerator._tokenize or "
                             "stream_generate (an mlx-lm version this prefix cache does not "
                             "know): the server keeps mlx-lm's segments, no snapshots",
                             stacklevel=3)
        return
    if not _patched(rg, "_tokenize"):
        _set(rg, "_tokenize", _wrap_tokenize(rg.__dict__["_tokenize"]))
    if not _patched(mod, "stream_generate"):
        _set(mod, "stream_generate", _wrap_stream_generate(mod.stream_generate))


def _capable(model) -> bool:
    from mlx_lm.models.cache import make_prompt_cache

    from .store import snapshot_capable

    hit = _CAPABLE.get(id(model))
    if hit is None or hit[0] is not model:
        if len(_CAPABLE) > 8:
            _CAPABLE.clear()
        hit = _CAPABLE[id(model)] = (model, snapshot_capable(make_prompt_cache(model)))
    return hit[1]


def _wrap_tokenize(orig):
    from . import settings
    from .plan import message_boundaries, snapshot_points
    from .store import SNAPSHOT, PrefixCache

    def _tokenize(self, tokenizer, request, args):
        out = orig(self, tokenizer, request, args)
        _LOCAL.plan = None
        prompt, segments, _types, initial_state, vision = out
        store = getattr(self, "prompt_cache", None)
        provider = self.model_provider
        if (not _ACTIVE[0] or vision is not None or not isinstance(store, PrefixCache)
                or len(prompt) < 2 or not _capable(provider.model)):
            return out
        limit = getattr(provider.cli_args, "prompt_cache_bytes", None)
        if limit is not None:
            store.max_bytes = limit
        ends, n = [], 0
        for s in segments[:-1]:
            n += len(s)
            ends.append(n)
        points = snapshot_points(len(prompt), boundaries=message_boundaries(tokenizer, prompt)
                                 + ends, every=settings().every)
        cuts = [0] + points + [len(prompt)]
        segs = [prompt[a:b] for a, b in zip(cuts, cuts[1:])]
        _LOCAL.plan = (prompt, points, store, provider.model_key)
        # the end of the prefill is stored as a full cache: the KV donor of this prompt's
        # snapshots while it generates (a concurrent request can use them at once); the
        # request's final cache turns it into a snapshot
        types = [SNAPSHOT] * len(segs)
        types[-2] = "assistant"
        return prompt, segs, types, initial_state, vision

    _tokenize.__wrapped__ = orig
    _tokenize.__doc__ = orig.__doc__
    return _tokenize


def _wrap_stream_generate(orig):
    from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START, maybe_quantize_kv_cache

    from .plan import prefill_points

    def stream_generate(model, tokenizer, prompt, max_tokens=256, draft_model=None,
                        **kwargs):
        plan, _LOCAL.plan = getattr(_LOCAL, "plan", None), None
        cache = kwargs.get("prompt_cache")
        if (plan is None or not _ACTIVE[0] or draft_model is not None or cache is None
                or kwargs.get("input_embeddings") is not None or not isinstance(prompt, list)):
            yield from orig(model, tokenizer, prompt, max_tokens, draft_model, **kwargs)
            return
        full, points, store, key = plan
        start = len(full) - len(prompt)
        points = [p for p in points if p > start]
        if start < 0 or not points or full[start:] != prompt:
            yield from orig(model, tokenizer, prompt, max_tokens, draft_model, **kwargs)
            return
        from ..patching import prefill_step_size

        step = prefill_step_size(model, kwargs.get("prefill_step_size")) or 2048
        kv = {k: kwargs[k] for k in ("quantized_kv_start", "kv_group_size", "kv_bits")
              if k in kwargs}
        quantize = None
        if kv.get("kv_bits") is not None:
            def quantize(c):
                maybe_quantize_kv_cache(c, kv.get("quantized_kv_start", DEFAULT_QUANTIZED_KV_START),
                                        kv.get("kv_group_size", 64), kv["kv_bits"])
        callback = kwargs.get("prompt_progress_callback")
        pos = prefill_points(model, cache, full, start, points, store, key, step=int(step),
                             stream=kwargs.get("stream"), quantize=quantize,
                             progress=callback)
        if callback is not None:
            kwargs["prompt_progress_callback"] = (
                lambda done, total: callback(done + pos, total + pos))
        yield from orig(model, tokenizer, full[pos:], max_tokens, draft_model, **kwargs)

    stream_generate.__wrapped__ = orig
    stream_generate.__doc__ = orig.__doc__
    return stream_generate
