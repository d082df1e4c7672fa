"""Where snapshots are taken, and the prefill that takes them."""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import numpy as np

from .store import SNAPSHOT, snapshot_capable

_SPECS: dict = {}  # id(tokenizer) -> (tokenizer, message-start token id or None)
_THINK_TAIL = 11  # mlx-lm's window for the thinking tail (ResponseGenerator._tokenize)


def _message_start_token(tokenizer):
    """The token every rendered message starts with (``<|im_start|>`` for ChatML templates):
    the first token of a one-message rendering, after a BOS, when it is an added
    (special) token; else None."""
    hit = _SPECS.get(id(tokenizer))
    if hit is not None and hit[0] is tokenizer:
        return hit[1]
    marker = None
    try:
        ids = list(tokenizer.apply_chat_template([{"role": "user", "content": "x"}],
                                                 tokenize=True, add_generation_prompt=False))
        bos = getattr(tokenizer, "bos_token_id", None)
        while ids and ids[0] == bos:
            ids.pop(0)
        if ids:
            added = tokenizer.get_added_vocab()
            if tokenizer.convert_ids_to_tokens(ids[0]) in added:
                marker = int(ids[0])
    except Exception:  # noqa: BLE001  (no template, a template that needs more: no markers)
        marker = None
    if len(_SPECS) > 16:
        _SPECS.clear()
    _SPECS[id(tokenizer)] = (tokenizer, marker)
    return marker


def message_boundaries(tokenizer, tokens) -> list:
    """Token positions where the rendered chat prompt ``tokens`` starts a message (every
    occurrence of the template's message-start token, the generation prompt's included)
    and where its thinking tail starts (mlx-lm's ``rfind_think_start`` over the last 11
    tokens). Empty when the tokenizer has no chat template with a special message-start
    token and no thinking tokens."""
    out = []
    marker = _message_start_token(tokenizer)
    if marker is not None and len(tokens):
        out.extend(int(i) for i in np.flatnonzero(np.asarray(tokens) == marker))
    if getattr(tokenizer, "has_thinking", False):
        try:
            start = tokenizer.rfind_think_start(list(tokens), start=len(tokens) - _THINK_TAIL)
        except Exception:  # noqa: BLE001
            start = -1
        if start is not None and start > 0:
            out.append(int(start))
    return out


def snapshot_points(n_tokens: int, *, start: int = 0, boundaries=(), every: int = 0) -> list:
    """Sorted token counts after which a prefill of ``n_tokens`` prompt tokens, starting
    from a cache that holds ``start``, takes snapshots: each boundary, each multiple of
    ``every`` (0: none) and ``n_tokens - 1`` (the end of the prefill before the first
    generated token), restricted to ``start < p < n_tokens``."""
    pts = {int(b) for b in boundaries}
    if every and every > 0:
        pts.update(range(every, n_tokens, every))
    pts.add(n_tokens - 1)
    return sorted(p for p in pts if start < p < n_tokens)


class Prefilled(NamedTuple):
    """``prefill``'s result.

    Attributes:
        cache: the model's layer caches, holding ``tokens[:len(tokens) - len(rest)]``.
        rest: the prompt tokens still to process (at least one): pass them, with ``cache``,
            to ``mlx_lm.stream_generate`` / ``generate_step``.
        cached_tokens: tokens restored from the store (not processed by this call).
    """

    cache: list
    rest: list
    cached_tokens: int


def prefill_points(model, cache, tokens, pos: int, points, store, key, *, step: int,
                   stream=None, quantize=None, progress=None) -> int:
    """Run ``model`` over ``tokens[pos:points[-1]]`` into ``cache`` in chunks of at most
    ``step`` tokens that end at each point, storing a snapshot (``store.insert_cache(key,
    tokens[:p], cache, cache_type="snapshot")``) at each. ``quantize(cache)`` runs after
    each chunk (mlx-lm's KV quantization), ``progress(done, len(tokens))`` too. Returns
    the tokens the cache holds."""
    stream = stream if stream is not None else mx.default_stream(mx.default_device())
    with mx.stream(stream):
        for p in points:
            while pos < p:
                n = min(step, p - pos)
                model(mx.array(tokens[pos:pos + n])[None], cache=cache)
                if quantize is not None:
                    quantize(cache)
                mx.eval([c.state for c in cache])
                pos += n
                if progress is not None:
                    progress(pos, len(tokens))
                mx.clear_cache()
            store.insert_cache(key, tokens[:p], cache, cache_type=SNAPSHOT)
    return pos


def prefill(model, tokens, store, *, key="default", tokenizer=None, boundaries=None,
            every: int | None = None, prefill_step_size: int = 2048, stream=None) -> Prefilled:
    """Restore the deepest stored state for ``tokens`` and prefill up to its last token,
    storing snapshots on the way: the Python entry point to the prefix cache for scripts
    that keep their own ``PrefixCache``.

    Args:
        model: an mlx-lm model.
        tokens: the prompt as a list of token ids (the full prompt, not a suffix).
        store: a ``PrefixCache``.
        key: the store's model key (any hashable naming the model; one store may serve
            several models).
        tokenizer: when given, the prompt's message starts and thinking tail
            (``message_boundaries``) are snapshot points.
        boundaries: more snapshot points (token counts), e.g. message starts a script
            tracks itself.
        every: tokens between periodic snapshots; None = ``settings().every``.
        prefill_step_size: most tokens per model call.
        stream: the MLX stream to run on (default: the default device's).
    Returns:
        ``Prefilled(cache, rest, cached_tokens)``. Generate from ``rest`` with ``cache``,
        then store the final state so later snapshots of these tokens have a KV donor:
        ``store.insert_cache(key, tokens + generated_tokens, cache)``.
    Raises:
        ValueError: ``tokens`` is empty.
    """
    from mlx_lm.models.cache import make_prompt_cache

    from . import settings

    tokens = [int(t) for t in tokens]
    if not tokens:
        raise ValueError("mlx-lily prefill: empty prompt")
    cache, rest = store.fetch_nearest_cache(key, tokens)
    start = len(tokens) - len(rest)
    if cache is None:
        cache = make_prompt_cache(model)
    if not snapshot_capable(cache):
        return Prefilled(cache, tokens[start:], start)
    pts = list(boundaries or ())
    if tokenizer is not None:
        pts += message_boundaries(tokenizer, tokens)
    every = settings().every if every is None else every
    points = snapshot_points(len(tokens), start=start, boundaries=pts, every=every)
    pos = prefill_points(model, cache, tokens, start, points, store, key,
                         step=prefill_step_size, stream=stream)
    return Prefilled(cache, tokens[pos:], start)
