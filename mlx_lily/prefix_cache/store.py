"""``PrefixCache``: mlx-lm's ``LRUPromptCache`` with snapshots of non-trimmable state."""

from __future__ import annotations

import copy
import dataclasses
from collections import OrderedDict

import mlx.core as mx
from mlx_lm.models.cache import (ArraysCache, LRUPromptCache, can_trim_prompt_cache,
                                 trim_prompt_cache)

#: ``cache_type`` of an insert that stores a snapshot (mid-prompt state) instead of a
#: full cache.
SNAPSHOT = "snapshot"
_VALUE = None  # trie key holding a node's entry (tokens are ints)


@dataclasses.dataclass(eq=False)
class _Entry:
    tokens: tuple
    kind: str  # "full" | "snapshot"
    cache_type: str
    nbytes: int
    # full: the layer caches; snapshot: per layer a list of arrays (ArraysCache state) or
    # None (a trimmable layer whose KV comes from a donor full entry)
    cache: list
    kv_length: int | None = None  # snapshot: the trimmable layers' offset


def _offset(c):
    off = getattr(c, "offset", None)
    return off if type(off) is int else None


def _layer_kind(c) -> str | None:
    """"state" for a single-sequence ``ArraysCache`` (not a subclass: a restore builds an
    ``ArraysCache``), "kv" for a trimmable cache with an integer ``offset``, None for
    anything else."""
    if type(c) is ArraysCache:
        if c.left_padding is not None or c.lengths is not None:
            return None
        if any(a is not None and a.shape[0] != 1 for a in c.cache):
            return None
        return "state"
    if c.is_trimmable() and _offset(c) is not None:
        return "kv"
    return None


def snapshot_capable(prompt_cache) -> bool:
    """True when snapshots of ``prompt_cache`` (a model's list of layer caches) can be taken
    and restored: every layer is an ``ArraysCache`` or a trimmable cache with an integer
    ``offset`` (``KVCache``, ``QuantizedKVCache``), and at least one is an ``ArraysCache``
    (an all-trimmable cache is served by trimming, as mlx-lm does)."""
    kinds = [_layer_kind(c) for c in prompt_cache]
    return bool(kinds) and None not in kinds and "state" in kinds


def capture(prompt_cache, n_tokens: int):
    """A snapshot of ``prompt_cache`` after ``n_tokens`` tokens, or None when it cannot be
    taken (a layer kind ``snapshot_capable`` rejects, an empty state, KV offsets that are
    not ``n_tokens``).

    Returns ``(layers, kv_length, nbytes)``: per layer a list of copied state arrays (same
    dtypes: fp32 stays fp32, evaluated here) or None for a trimmable layer.
    """
    layers, arrays, kv_length = [], [], None
    for c in prompt_cache:
        kind = _layer_kind(c)
        if kind == "state":
            if any(a is None for a in c.cache):
                return None
            own = [mx.array(a) for a in c.cache]  # a copy: never a view of a batch buffer
            layers.append(own)
            arrays.extend(own)
        elif kind == "kv":
            if _offset(c) != n_tokens:
                return None
            kv_length = n_tokens
            layers.append(None)
        else:
            return None
    if not arrays:
        return None
    mx.eval(arrays)
    return layers, kv_length, sum(a.nbytes for a in arrays)


def restore(snapshot: _Entry, donor: _Entry | None) -> list:
    """Layer caches holding ``snapshot``'s state: state layers share the snapshot's arrays
    (MLX arrays are values: later updates make new arrays), KV layers are copies of
    ``donor``'s trimmed to the snapshot's length (mlx-lm's own ``copy.deepcopy`` + ``trim``)."""
    out = []
    for i, layer in enumerate(snapshot.cache):
        if layer is None:
            c = copy.deepcopy(donor.cache[i])
            c.trim(_offset(c) - snapshot.kv_length)
        else:
            c = ArraysCache(len(layer))
            c.cache = [copy.deepcopy(a) for a in layer]
        out.append(c)
    return out


def snapshot_nbytes(model) -> int:
    """Bytes one snapshot of ``model`` holds (its ``ArraysCache`` states after a 2-token
    prefill; the KV is not part of a snapshot). 0 when the model's cache is not
    ``snapshot_capable``."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    if not snapshot_capable(cache):
        return 0
    model(mx.array([[1, 2]]), cache=cache)
    snap = capture(cache, 2)
    return 0 if snap is None else snap[2]


class PrefixCache(LRUPromptCache):
    """mlx-lm's ``LRUPromptCache`` (same methods, same use by ``mlx_lm.server``) that also
    holds snapshots of hybrid models' non-trimmable state.

    Full entries (``insert_cache`` with any ``cache_type`` but ``"snapshot"``) behave as in
    mlx-lm: an exact prefix of a prompt is reused, a trimmable cache that extends past the
    prompt is trimmed. A ``"snapshot"`` insert keeps only the ``ArraysCache`` states (copied)
    and the KV length. ``fetch_nearest_cache`` returns the deepest usable entry that is a
    prefix of the prompt, never the whole prompt (at least one token is left to prefill);
    a snapshot is usable while some full entry passes through its tokens (its KV donor).

    Limits: ``max_size`` full entries, ``max_snapshots`` snapshots, ``max_bytes`` for all
    (mlx_lm.server's ``--prompt-cache-bytes``); least recently used (inserted or fetched)
    goes first. Evicting a snapshot's last donor evicts the snapshot.

    Args:
        max_size: most full entries (mlx-lm's ``--prompt-cache-size``).
        max_bytes: most bytes of all entries.
        max_snapshots: most snapshots; None = ``mlx_lily.prefix_cache.settings()``.
    """

    def __init__(self, max_size: int = 10, max_bytes: int = 1 << 63, *,
                 max_snapshots: int | None = None):
        super().__init__(max_size, max_bytes)
        if max_snapshots is None:
            from . import settings

            max_snapshots = settings().max_snapshots
        self.max_snapshots = max_snapshots
        self._roots: dict = {}
        self._entries: OrderedDict = OrderedDict()  # (model, tokens) -> _Entry, LRU first
        self._n_bytes = 0
        self._counts = {"full": 0, SNAPSHOT: 0}
        self._trimmable: dict = {}  # model -> its last full entry was trimmable
        self.counters = {"full_hits": 0, "snapshot_hits": 0, "misses": 0,
                         "cached_tokens": 0, "snapshots_stored": 0, "evicted": 0}
        from .server_hooks import _on_store_created

        _on_store_created(self)

    # -- size and stats (mlx-lm's interface) ---------------------------------------------
    def __len__(self):
        return len(self._entries)

    @property
    def nbytes(self):
        return self._n_bytes

    def stats_by_type(self):
        """``{cache_type: {"n_sequences", "n_bytes"}}`` over mlx-lm's types and
        ``"snapshot"``."""
        out = {t: {"n_sequences": 0, "n_bytes": 0}
               for t in ("assistant", "user", "system", SNAPSHOT)}
        for e in self._entries.values():
            s = out.setdefault(e.cache_type, {"n_sequences": 0, "n_bytes": 0})
            s["n_sequences"] += 1
            s["n_bytes"] += e.nbytes
        return out

    # -- trie ------------------------------------------------------------------------------
    def _node(self, model, tokens, create=False):
        node = self._roots.get(model)
        if node is None:
            if not create:
                return None
            node = self._roots[model] = {}
        for t in tokens:
            nxt = node.get(t)
            if nxt is None:
                if not create:
                    return None
                nxt = node[t] = {}
            node = nxt
        return node

    def _remove(self, model, entry: _Entry):
        self._entries.pop((model, entry.tokens), None)
        self._n_bytes -= entry.nbytes
        self._counts[entry.kind] -= 1
        path = [self._roots[model]]
        for t in entry.tokens:
            path.append(path[-1][t])
        path[-1].pop(_VALUE, None)
        for i in range(len(entry.tokens), 0, -1):
            if path[i]:
                break
            del path[i - 1][entry.tokens[i - 1]]
        if not self._roots[model]:
            del self._roots[model]

    def _add(self, model, entry: _Entry, replace_full: bool = False):
        node = self._node(model, entry.tokens, create=True)
        prev = node.get(_VALUE)
        if prev is not None:
            if prev.kind == "full" and entry.kind == SNAPSHOT and not replace_full:
                self._entries.move_to_end((model, entry.tokens))
                return False
            self._entries.pop((model, prev.tokens))
            self._n_bytes -= prev.nbytes
            self._counts[prev.kind] -= 1
        node[_VALUE] = entry
        self._entries[(model, entry.tokens)] = entry
        self._n_bytes += entry.nbytes
        self._counts[entry.kind] += 1
        return True

    def _donor(self, model, snap: _Entry):
        if snap.kv_length is None:
            return snap  # no KV layers: the snapshot is complete
        n = len(snap.tokens)
        for (m, tokens), e in reversed(self._entries.items()):
            if (m == model and e.kind == "full" and len(tokens) > n
                    and len(e.cache) == len(snap.cache) and tokens[:n] == snap.tokens
                    and all(_offset(e.cache[i]) is not None
                            and _offset(e.cache[i]) >= snap.kv_length
                            for i, layer in enumerate(snap.cache) if layer is None)):
                return e
        return None

    def _evict(self, entry_key):
        model, _ = entry_key
        entry = self._entries[entry_key]
        self._remove(model, entry)
        self.counters["evicted"] += 1
        if entry.kind == "full":  # snapshots on its path that lost their last donor
            node = self._roots.get(model)
            for t in entry.tokens:
                if node is None:
                    break
                node = node.get(t)
                e = node.get(_VALUE) if node is not None else None
                if e is not None and e.kind == SNAPSHOT and self._donor(model, e) is None:
                    self._remove(model, e)
                    self.counters["evicted"] += 1
                    node = self._node(model, e.tokens)

    def _evict_oldest(self, kind=None) -> bool:
        for key, e in self._entries.items():
            if kind is None or e.kind == kind:
                self._evict(key)
                return True
        return False

    def _enforce(self):
        while self._counts["full"] > self.max_size and self._evict_oldest("full"):
            pass
        while self._counts[SNAPSHOT] > self.max_snapshots and self._evict_oldest(SNAPSHOT):
            pass
        while self._n_bytes > self.max_bytes and self._evict_oldest():
            pass

    # -- mlx-lm's interface ---------------------------------------------------------------
    def fetch_nearest_cache(self, model, tokens):
        """The cache to continue ``tokens`` from and the tokens still to process.

        Returns ``(cache, rest)``: ``cache`` a fresh list of layer caches holding
        ``len(tokens) - len(rest)`` tokens (never all of them), or ``(None, tokens)``.
        The stored entries are left as they are.
        """
        tokens = list(tokens)
        limit = len(tokens) - 1
        node = self._roots.get(model)
        on_path = []
        depth = 0
        while node is not None and depth < len(tokens):
            node = node.get(tokens[depth])
            if node is None:
                break
            depth += 1
            e = node.get(_VALUE)
            if e is not None:
                on_path.append((depth, e))
        best = None  # (n_cached, entry, donor)
        for d, e in reversed(on_path):
            if d > limit:
                continue
            if e.kind == "full":
                best = (d, e, None)
                break
            donor = self._donor(model, e)
            if donor is not None:
                best = (d, e, donor)
                break
        # mlx-lm's trimming of a longer (or equal) trimmable entry
        common = min(depth, limit)
        if common > (best[0] if best else 0) and self._trimmable.get(model):
            longer = self._trimmable_below(model, tokens[:depth])
            if longer is not None:
                cache = copy.deepcopy(longer.cache)
                trim_prompt_cache(cache, len(longer.tokens) - common)
                self._entries.move_to_end((model, longer.tokens))
                self.counters["full_hits"] += 1
                self.counters["cached_tokens"] += common
                return cache, tokens[common:]
        if best is None:
            self.counters["misses"] += 1
            return None, tokens
        d, e, donor = best
        self._entries.move_to_end((model, e.tokens))
        if e.kind == "full":
            cache = copy.deepcopy(e.cache)
            self.counters["full_hits"] += 1
        else:
            if donor is not e:
                self._entries.move_to_end((model, donor.tokens))
            cache = restore(e, donor)
            self.counters["snapshot_hits"] += 1
        self.counters["cached_tokens"] += d
        return cache, tokens[d:]

    def _trimmable_below(self, model, prefix):
        node = self._node(model, prefix)
        if node is None:
            return None
        stack = [node]
        while stack:
            n = stack.pop()
            e = n.get(_VALUE)
            if e is not None and e.kind == "full":
                return e if can_trim_prompt_cache(e.cache) else None
            stack.extend(v for k, v in n.items() if k is not _VALUE)
        return None

    def insert_cache(self, model, tokens, prompt_cache, *, cache_type: str = "assistant"):
        """Store ``prompt_cache`` (holding ``tokens``). ``cache_type="snapshot"`` stores a
        snapshot (``capture``; nothing is stored when it cannot be taken); any other type a
        full entry, as mlx-lm does (a trimmable one replaces the entries on its path)."""
        tokens = tuple(tokens)
        if cache_type == SNAPSHOT:
            snap = capture(prompt_cache, len(tokens))
            if snap is None:
                return
            layers, kv_length, nbytes = snap
            entry = _Entry(tokens, SNAPSHOT, SNAPSHOT, nbytes, layers, kv_length)
            if self._add(model, entry):
                self.counters["snapshots_stored"] += 1
        else:
            entry = _Entry(tokens, "full", cache_type, sum(c.nbytes for c in prompt_cache),
                           list(prompt_cache))
            self._add(model, entry)
            self._trimmable[model] = can_trim_prompt_cache(prompt_cache)
            if snapshot_capable(prompt_cache):
                self._shrink_prefixes(model, tokens)
            elif self._trimmable[model]:
                node = self._roots[model]
                for t in tokens:
                    e = node.get(_VALUE)
                    if e is not None:
                        self._remove(model, e)
                        node = self._node(model, e.tokens)
                    node = node[t]
        self._enforce()

    def _shrink_prefixes(self, model, tokens):
        """Full entries on the path of the new full entry ``tokens`` become snapshots: it is
        their KV donor from now on."""
        node = self._roots[model]
        for depth, t in enumerate(tokens):
            e = node.get(_VALUE)
            if e is not None and e.kind == "full" and depth > 0:
                snap = capture(e.cache, depth)
                if snap is not None:
                    layers, kv_length, nbytes = snap
                    self._add(model, _Entry(e.tokens, SNAPSHOT, SNAPSHOT, nbytes, layers,
                                            kv_length), replace_full=True)
            node = node[t]

    def trim_to(self, *, n_sequences=None, n_bytes=None):
        """Evict least recently used entries until at most ``n_sequences`` entries and
        ``n_bytes`` bytes remain (mlx-lm's ``trim_to``)."""
        n_sequences = max(0, n_sequences) if n_sequences is not None else 1 << 63
        n_bytes = max(0, n_bytes) if n_bytes is not None else 1 << 63
        while len(self._entries) > n_sequences and self._evict_oldest():
            pass
        while self._n_bytes > n_bytes and self._evict_oldest():
            pass

    def snapshots(self, model=None) -> list:
        """``(model, n_tokens, nbytes)`` of each stored snapshot, least recently used first."""
        return [(m, len(t), e.nbytes) for (m, t), e in self._entries.items()
                if e.kind == SNAPSHOT and (model is None or m == model)]
