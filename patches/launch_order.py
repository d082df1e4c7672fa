"""Launch-ordering state of the one-launch kernels, kept on each layer's cache: the int32
arrival counters of ``gdn_proj``'s SPLIT / ``gdn_out_proj``'s OUTP launches
(``mlx_lily.ops.gated_delta.proj_counters``) followed by the ``moe_fused`` block's
(``mlx_lily.ops.moe_experts.FUSED_COUNTERS``), and the last MoE output a ``moe_fused``
launch takes as an input so that MLX orders it after the previous one on those counters."""

from __future__ import annotations

import mlx.core as mx

from mlx_lily.ops import gated_delta as gdn_ops
from mlx_lily.ops.moe_experts import FUSED_COUNTERS


COUNTERS_ATTR = "_lily_gdn_counters"


def gdn_counters(cache, n):
    """The arrival counters of a layer's one-launch kernels (GDN: SPLIT / OUTP; every
    layer: the MoE block's ``moe_fused`` launch after them) for the layer's cache
    ``cache`` (``ArraysCache`` or ``KVCache``), at least ``n`` of them
    (``gated_delta.proj_counters``: int32 zeros, left zeros by every launch); None
    without a cache. Kept on the cache object (with its ``id``, so that a copy of the cache
    makes its own): the launches of one cache are ordered by its state (each step reads
    what the previous one wrote), and launches of different caches, which MLX may run
    concurrently, never share counters (a ``moe_fused`` launch sharing them would wait
    for tiles never served, and trap after ~4 s).
    A traced step's ``_StepCache`` carries the real cache's counters as an input."""
    if cache is None:
        return None
    if getattr(cache, "traced_step", False):  # decode_graph._StepCache
        ctr = cache.counters
        return ctr if ctr is not None and ctr.size >= n else None
    owner, ctr = cache.__dict__.get(COUNTERS_ATTR, (None, None))
    # a copy of a cache (copy.copy, copy.deepcopy: MLX's deepcopy of an array keeps its
    # buffer) gets counters of its own
    if ctr is None or ctr.size < n or owner != id(cache):
        ctr = gdn_ops.proj_counters(n)
        setattr(cache, COUNTERS_ATTR, (id(cache), ctr))
    return ctr


def _gdn_counter_count(layer, B):
    """Counters a GDN layer's decode launch uses for ``B`` rows (0 for attention layers):
    the MoE block's (``moe_experts.FUSED_COUNTERS``) follow them in the same array."""
    return gdn_ops.counters_needed(B, layer.linear_attn.num_v_heads) if layer.is_linear else 0


def counters_for(layer, c, h):
    """The arrival counters of a decoder layer's real cache ``c`` (``gdn_counters``) for a
    step of ``h [B, 1, D]``: the GDN launch's (GDN layers), then the one-launch MoE
    block's."""
    return gdn_counters(c, _gdn_counter_count(layer, h.shape[0]) + FUSED_COUNTERS)


def moe_counters(layer, counters, B, after):
    """``(counters, offset, after)`` of the MoE block of ``layer`` in its cache's counter
    array (``PendingNorm.counters``), or None without counters or ``after``."""
    off = _gdn_counter_count(layer, B)
    if counters is None or after is None or counters.size < off + FUSED_COUNTERS:
        return None
    return counters, off, after


MOE_AFTER_ATTR = "_lily_moe_after"


def moe_after(c, h):
    """The last MoE output of the layer whose cache is ``c`` (set by the compiled steps
    after each step), which the next one-launch MoE block on the cache's counters takes as
    an input so that MLX orders the two launches (``moe_experts.fused_plan``): without a
    data dependency, two steps built before one evaluation could run their launches of a
    layer concurrently on the same counters. Zeros of ``h``'s shape and dtype before the
    first step."""
    a = c.__dict__.get(MOE_AFTER_ATTR)
    if a is None or a.shape != h.shape or a.dtype != h.dtype:
        a = mx.zeros(h.shape, h.dtype)
        setattr(c, MOE_AFTER_ATTR, a)
    return a
