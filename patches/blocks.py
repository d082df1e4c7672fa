"""Lily forwards of the blocks mlx-lm's ``qwen3_next`` defines and ``qwen3_5`` reuses: gated
attention, the sparse MoE block, Qwen3-Next's GatedDeltaNet and its shared core, the decoder
layer, and the per-layer pieces the stack forward composes (``layer_mixer``, ``layer_tail``,
``layer_input``). Each forward runs the original method unchanged for a call Lily does not
serve (training, sharding, unsupported caches, kill switch)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_next
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlx_lily.backend import current_backend, op_enabled
from mlx_lily.registry import switch_on
from mlx_lily.ops import attention as attn_ops, gated_delta as gdn_ops
from mlx_lily.ops.add_rms_norm import add_rms_norm
from mlx_lily.ops.gated_delta import gated_delta, gated_delta_packed
from mlx_lily.ops.moe_experts import moe_experts, moe_experts_routed
from mlx_lily.ops.moe_router_topk import PRE_NORM_OP, moe_router_topk, moe_router_topk_pending
from mlx_lily.qproj import PendingNorm, QProj, resolve
from .projections import original, projection, run_projection, one_row_linear
from .launch_order import moe_counters, gdn_counters
from .layouts import experts as experts_of


# ---------------------------------------------------------------- attention
def _attention_supported(self, cache) -> bool:
    return (op_enabled(attn_ops.NAME) and not self.training
            and (cache is None or type(cache) is KVCache)
            and type(self.rope) is nn.RoPE)


def attention_call(self, x, mask=None, cache=None):
    """Gated GQA attention (``Qwen3NextAttention.__call__`` with Lily ops)."""
    offset = None
    if type(cache) is BatchKVCache:
        out = _attention_decode_batch(self, x, cache)
        if out is not None:
            return out
        if not _batch_prefill_unpadded(self, x, cache):
            return original(qwen3_next.Qwen3NextAttention)(self, resolve(x), mask, cache)
        # no left padding: the batch's mask is the causal one, every row at one position
        mask, offset = "causal", cache._idx
    elif not _attention_supported(self, cache):
        return original(qwen3_next.Qwen3NextAttention)(self, resolve(x), mask, cache)
    B, L, _ = x.shape
    Hq, Hkv = self.num_attention_heads, self.num_key_value_heads
    proj = projection(self, "qkv", (self.q_proj, self.k_proj, self.v_proj))
    if L == 1 and mask is None and cache is not None and isinstance(proj, QProj) \
            and op_enabled(attn_ops.PACKED_OP):
        out = _attention_decode_packed(self, proj, x, cache)
        if out is not None:
            return out
    q_out, keys, values = run_projection(proj, x)
    queries, gate = mx.split(q_out.reshape(B, L, Hq, -1), 2, axis=-1)
    if offset is None:
        offset = cache.offset if cache is not None else 0
    rope = self.rope
    q, k = attn_ops.qk_norm_rope(
        queries, keys.reshape(B, L, Hkv, -1), self.q_norm.weight, self.k_norm.weight,
        self.q_norm.eps, rope_dims=rope.dims, base=rope.base, scale=rope.scale,
        traditional=rope.traditional, offset=offset)
    v = values.reshape(B, L, Hkv, -1).transpose(0, 2, 1, 3)
    if cache is not None:
        k, v = cache.update_and_fetch(k, v)
    out = attn_ops.sdpa_gated(q, k, v, self.scale, mask, gate)  # [B, L, Hq*D], gate fused
    return one_row_linear(self.o_proj, out)


def _attention_decode_packed(self, proj, x, cache):
    """A decode step with q, k, v, and the gate read straight from the fused projection's
    row: GEMV, q/k norm + RoPE + v copy (one kernel), cache update, split-K SDPA with the
    gate, ``o_proj``; no split/reshape/transpose views. None when the kernels do not
    serve (the caller then runs the general path; nothing was changed)."""
    Hq, Hkv = self.num_attention_heads, self.num_key_value_heads
    D = proj.out_features // (2 * Hq + 2 * Hkv)
    rope = self.rope
    if not attn_ops.packed_supported(x.dtype, self.q_norm.weight, self.k_norm.weight,
                                     head_dim=D, rope_dims=rope.dims,
                                     traditional=rope.traditional, offset=cache.offset):
        return None  # decided before any graph is built
    step = _packed_qkv_step(self, proj, x, cache, Hq, Hkv, D)
    if step is None:
        return None
    y, q, k, v = step
    out = attn_ops.sdpa_gated_packed(q, k, v, self.scale, y, Hq, Hkv, D)
    return one_row_linear(self.o_proj, out)


def _packed_qkv_step(self, proj, x, cache, Hq, Hkv, D):
    """The packed decode step's shared front: the fused q|k|v|gate GEMV of ``x``, q/k
    norm + RoPE + v copy at ``cache.offset`` (one position, or one per row of a
    ``BatchKVCache``) in one kernel, then the cache update. ``(y, q, k, v)``, or None
    (nothing changed) when the norm + RoPE kernel does not serve."""
    rope = self.rope
    (y,) = run_projection(proj, x, split=False)
    qkv = attn_ops.qkv_norm_rope_packed(
        y, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, n_heads=Hq,
        n_kv_heads=Hkv, head_dim=D, rope_dims=rope.dims, base=rope.base, scale=rope.scale,
        traditional=rope.traditional, offset=cache.offset)
    if qkv is None:
        return None
    q, k, v = qkv
    k, v = cache.update_and_fetch(k, v)
    return (y, q, k, v)


#: Most sequences a batched decode step runs through the decode kernels (their row limit).
MAX_BATCH_ROWS = 8


BATCH_OP = "batch_decode"


def batch_kernels_on() -> bool:
    """Whether calls on mlx-lm's batch caches of two or more sequences take the
    one-sequence kernels: the ``batch_decode`` switch is on and ``MLX_LILY_KERNELS``
    allows it here (not in the shipped verified set until its GPU tests pass;
    ``MLX_LILY_KERNELS=all`` turns it on). Off, such calls take mlx-lm's paths; one
    sequence is ``batch_rows_on``'s case."""
    return switch_on(BATCH_OP, current_backend())


def batch_rows_on(rows: int) -> bool:
    """Whether a call on mlx-lm's batch caches of ``rows`` sequences takes the
    one-sequence kernels: always for one sequence (``mlx_lm.server`` runs a single
    request in batch caches of one row, and its step is that sequence's own step), else
    when ``batch_kernels_on``."""
    return rows == 1 or batch_kernels_on()


def batch_decode_unsupported(self, x, cache) -> str | None:
    """Why a step of mlx-lm's ``BatchKVCache`` (``BatchGenerator``: left-padded rows,
    per-sequence offsets) does not take ``_attention_decode_batch``, or None."""
    row = x.h0 if isinstance(x, PendingNorm) else x
    if not batch_rows_on(row.shape[0] if row.ndim == 3 else 0):
        return f"{BATCH_OP} off (MLX_LILY_DISABLE / MLX_LILY_KERNELS)"
    if not op_enabled(attn_ops.NAME) or not op_enabled(attn_ops.PACKED_OP):
        return "attention switches off"
    if self.training or type(self.rope) is not nn.RoPE:
        return "training or a scaled RoPE"
    if row.ndim != 3 or row.shape[1] != 1:
        return "not a one-token step"
    if not 1 <= row.shape[0] <= MAX_BATCH_ROWS:
        return f"more than {MAX_BATCH_ROWS} sequences"
    if cache.keys is None or getattr(cache, "_right_padding", None) is not None:
        return "cache not prefilled"
    if not isinstance(cache.offset, mx.array) or cache.offset.shape != (row.shape[0],):
        return "per-sequence offsets"
    if cache.left_padding.shape != (row.shape[0],):
        return "left padding"
    return None


def _batch_prefill_unpadded(self, x, cache) -> bool:
    """Whether a multi-token call on a ``BatchKVCache`` has no left padding in any row
    (``BatchGenerator``'s prefill: prompts right-padded, rows at one common position
    ``cache._idx``): its mask is then exactly the causal one, and the call takes the
    one-sequence prefill path (flash-attention kernel, q/k norm + RoPE kernel) with the
    causal mask. Right padding needs no mask: a valid row's queries see only keys before
    them."""
    row = x.h0 if isinstance(x, PendingNorm) else x
    return (row.ndim == 3 and row.shape[1] > 1
            and batch_rows_on(row.shape[0])
            and _attention_supported(self, None)
            and cache.left_padding.shape == (row.shape[0],)
            and not any(_left_padding(cache)))


def _left_padding(cache) -> list:
    """``cache.left_padding`` as host ints, read once per array (it changes only when
    ``BatchGenerator`` filters or extends the batch; every step reuses the list)."""
    lp = cache.left_padding
    hit = cache.__dict__.get("_lily_left_padding")
    if hit is not None and hit[0] is lp:
        return hit[1]
    vals = [int(v) for v in lp.tolist()]
    cache.__dict__["_lily_left_padding"] = (lp, vals)
    return vals


def _attention_decode_batch(self, x, cache):
    """A decode step of B <= ``MAX_BATCH_ROWS`` left-padded sequences
    (``BatchKVCache``) through the packed decode kernels: one fused q|k|v GEMV for the B
    rows, q/k norm + RoPE at each row's own position (one launch), the cache update, then
    each row's split-K attention over its own keys (``attn_ops.sdpa_gated_packed_rows``:
    the left padding is never read) and one ``o_proj`` GEMV. Row b goes through the
    arithmetic of that sequence decoding alone. None when this path does not serve the
    call (decided before anything is built or the cache is changed)."""
    if batch_decode_unsupported(self, x, cache) is not None:
        return None
    proj = projection(self, "qkv", (self.q_proj, self.k_proj, self.v_proj))
    if not isinstance(proj, QProj):
        return None
    Hq, Hkv = self.num_attention_heads, self.num_key_value_heads
    D = proj.out_features // (2 * Hq + 2 * Hkv)
    rope = self.rope
    row = x.h0 if isinstance(x, PendingNorm) else x
    if not attn_ops.packed_supported(row.dtype, self.q_norm.weight, self.k_norm.weight,
                                     head_dim=D, rope_dims=rope.dims,
                                     traditional=rope.traditional):
        return None
    starts = _left_padding(cache)
    if any(s < 0 or s > cache._idx for s in starts):
        return None
    step = _packed_qkv_step(self, proj, x, cache, Hq, Hkv, D)
    if step is None:
        return None
    y, q, k, v = step
    out = attn_ops.sdpa_gated_packed_rows(q, k, v, self.scale, y, starts, Hq, Hkv, D)
    if out is None:  # the cache holds this step's keys now: finish with the reference
        _, gate, _, _ = attn_ops.split_packed(y, Hq, Hkv, D)
        from mlx_lm.models.base import create_causal_mask

        # the mask stock builds before the update (``BatchKVCache.make_mask(1)``)
        mask = create_causal_mask(1, offset=cache._idx - 1, left_padding=cache.left_padding)
        out = attn_ops.sdpa_gated_reference(q, k, v, self.scale, mask, gate)
    return one_row_linear(self.o_proj, out)


# ---------------------------------------------------------------- MoE
def _stock_routing(self, x):
    gates = mx.softmax(self.gate(x), axis=-1, precise=True)
    k = self.top_k
    inds = mx.argpartition(gates, kth=-k, axis=-1)[..., -k:]
    scores = mx.take_along_axis(gates, inds, axis=-1)
    if self.norm_topk_prob:
        scores = scores / scores.sum(axis=-1, keepdims=True)
    return inds, scores, mx.sigmoid(self.shared_expert_gate(x))


def moe_call(self, x):
    """Sparse MoE block (``Qwen3NextSparseMoeBlock.__call__`` with Lily ops)."""
    use_router = op_enabled("moe_router_topk")
    use_experts = op_enabled("moe_experts")
    if self.sharding_group is not None or self.training or not (use_router or use_experts):
        return original(qwen3_next.Qwen3NextSparseMoeBlock)(self, resolve(x))
    if use_router:
        router = projection(self, "router", (self.gate, self.shared_expert_gate))
        if use_experts and isinstance(router, QProj):
            y = moe_experts_routed(x, router, self.top_k, self.norm_topk_prob,
                                   experts_of(self.switch_mlp, self.shared_expert))
            if y is not None:
                return y
        if isinstance(router, list):
            parts = router
            router = lambda t: run_projection(parts, t)  # noqa: E731
        if isinstance(x, PendingNorm):
            inds, scores, shared, x = moe_router_topk_pending(x, router, self.top_k,
                                                              self.norm_topk_prob)
        else:
            inds, scores, shared = moe_router_topk(x, router, self.top_k,
                                                   self.norm_topk_prob)
    else:
        x = resolve(x)
        inds, scores, shared = _stock_routing(self, x)
    if use_experts:
        return moe_experts(x, inds, scores, experts_of(self.switch_mlp, self.shared_expert),
                           shared)
    y = (self.switch_mlp(x, inds) * scores[..., None]).sum(axis=-2)
    return y + shared * self.shared_expert(x)


# ---------------------------------------------------------------- Gated DeltaNet
def gdn_supported(self) -> bool:
    return (op_enabled("gated_delta") and not self.training
            and getattr(self, "sharding_group", None) is None
            and self.conv1d.groups == self.conv_dim and "bias" not in self.conv1d)


def _gdn_dims(self, mask, cache):
    lengths = cache.lengths if cache is not None else None
    return dict(num_k_heads=self.num_k_heads, head_k_dim=self.head_k_dim,
                num_v_heads=self.num_v_heads, head_v_dim=self.head_v_dim, eps=self.norm.eps,
                mask=mask, lengths=lengths)


def _gdn_store(cache, new_conv, new_state, S):
    if cache is not None:
        cache[0] = new_conv
        cache[1] = new_state
        cache.advance(S)


def _gdn_finish(self, out, new_conv, new_state, cache, S):
    _gdn_store(cache, new_conv, new_state, S)
    return one_row_linear(self.out_proj, out)


def gdn_core_proj(self, proj, pending, mask, cache):
    """A one-token GDN step whose input projection runs inside the decode kernel
    (``gated_delta_proj``, one launch for add + RMSNorm + q|k|v|z|b|a GEMV + recurrence,
    and ``out_proj`` too where ``gdn_out_proj`` serves) when ``gdn_proj`` is on and the
    kernel takes this call; sets ``pending.h`` and returns the layer's ``out_proj``
    output. None otherwise (the caller projects)."""
    from mlx_lily.backend import current_backend

    backend = current_backend()
    if (not proj.quantized or (proj.mode or "affine") != "affine"
            or not gdn_ops.proj_enabled(backend)):
        return None
    conv_state = cache[0] if cache is not None else None
    state = cache[1] if cache is not None else None
    dims = _gdn_dims(self, mask, cache)
    B = pending.h0.shape[0]
    out_proj = getattr(getattr(self, "_lily", None), "out_proj", None)
    if not gdn_ops.out_enabled(backend) or out_proj is None or (
            out_proj.bits, out_proj.group_size) != (proj.bits, proj.group_size):
        out_proj = None
    counters = None
    if gdn_ops.proj_split(backend) > 1 or out_proj is not None:
        counters = gdn_counters(cache, gdn_ops.counters_needed(B, self.num_v_heads))
    if counters is None:  # no cache to order the launches: one block per head, no OUTP
        out_proj = None
    p = gdn_ops.DecodeProj(pending.h0, pending.res, pending.weight, pending.eps, proj.weight,
                           proj.scales, proj.biases, proj.group_size, proj.bits, counters)
    args = (self.conv1d.weight, conv_state, self.A_log, self.dt_bias, state, self.norm.weight)
    if gdn_ops.proj_unsupported(p, *args, **dims) is not None:
        return None
    o = None if out_proj is None else gdn_ops.OutProj(out_proj.weight, out_proj.scales,
                                                      out_proj.biases)
    if o is not None and gdn_ops.out_proj_unsupported(p, o, **dims) is None:
        _, new_conv, new_state, pending.h, r = gdn_ops.gated_delta_proj(
            p, *args, out_proj=o, **dims)
        _gdn_store(cache, new_conv, new_state, 1)
        return r
    out, new_conv, new_state, pending.h = gdn_ops.gated_delta_proj(p, *args, **dims)
    return _gdn_finish(self, out, new_conv, new_state, cache, 1)


def _packed_out_proj(self, cache, B):
    """``(OutProj, counters)`` for a packed one-token GDN step whose decode kernel applies
    ``out_proj`` (``gated_delta.packed_outp_requested``: CUDA, ``MLX_LILY_GDN_PACKED_OUTP``),
    or None: the layer's prepared row-contiguous ``out_proj`` and its cache's counters."""
    from mlx_lily.backend import current_backend as backend_now  # emulators patch it

    if not gdn_ops.packed_outp_requested(backend_now()):
        return None
    op = getattr(getattr(self, "_lily", None), "out_proj", None)
    counters = gdn_counters(cache, gdn_ops.counters_needed(B, self.num_v_heads))
    if op is None or not op.quantized or counters is None:
        return None
    return (gdn_ops.OutProj(op.weight, op.scales, op.biases, op.group_size, op.bits),
            counters)


def gdn_core(self, qkv, z, b, a, mask, cache, packed=False):
    """Shared tail of both GDN variants: conv, recurrence, gated norm, cache update,
    ``out_proj``. ``qkv [B,S,C]``, ``z [B,S,Hv,Dv]``, ``b``/``a [B,S,Hv]``; or, with
    ``packed``, ``qkv`` the fused projection ``q|k|v|z|b|a`` and z/b/a None."""
    B, S, _ = qkv.shape
    conv_state = cache[0] if cache is not None else None
    state = cache[1] if cache is not None else None
    dims = _gdn_dims(self, mask, cache)
    if packed:
        o = _packed_out_proj(self, cache, B) if S == 1 else None
        res = gated_delta_packed(
            qkv, self.conv1d.weight, conv_state, self.A_log, self.dt_bias, state,
            self.norm.weight, *(o or ()), **dims)
        if o is not None and res[3] is not None:  # out_proj applied inside the kernel
            _gdn_store(cache, res[1], res[2], S)
            return res[3]
        out, new_conv, new_state = res[:3]
    else:
        out, new_conv, new_state = gated_delta(
            qkv, z, b, a, self.conv1d.weight, conv_state, self.A_log, self.dt_bias, state,
            self.norm.weight, **dims)
    return _gdn_finish(self, out, new_conv, new_state, cache, S)


def next_gdn_call(self, inputs, mask=None, cache=None):
    """Qwen3-Next GatedDeltaNet (fused ``in_proj_qkvz``/``in_proj_ba`` layout)."""
    inputs = resolve(inputs)
    if not gdn_supported(self):
        return original(qwen3_next.Qwen3NextGatedDeltaNet)(self, inputs, mask, cache)
    B, S, _ = inputs.shape
    q, k, v, z, b, a = self.fix_query_key_value_ordering(
        self.in_proj_qkvz(inputs), self.in_proj_ba(inputs))
    qkv = mx.concatenate([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)],
                         axis=-1)
    return gdn_core(self, qkv, z, b, a, mask, cache)


# ---------------------------------------------------------------- decoder layer
def make_decoder_call(cls_getter):
    """Decoder layer with the residual add fused into the post-attention RMSNorm."""

    def decoder_call(self, x, mask=None, cache=None):
        if self.training or not op_enabled("add_rms_norm"):
            return original(cls_getter())(self, x, mask, cache)
        mixer = self.linear_attn if self.is_linear else self.self_attn
        r = mixer(self.input_layernorm(x), mask, cache)
        norm = self.post_attention_layernorm
        h, n = add_rms_norm(x, r, norm.weight, norm.eps)
        return h + self.mlp(n)

    return decoder_call


def layer_tail(layer, h, r, counters=None, after=None):
    """``(h, r) -> (h', m)``: the residual add fused into the post-attention RMSNorm (in
    the MoE router's kernel when ``moe_router_norm`` serves), then the MLP/MoE output
    ``m``; the closing residual add is left to the next layer's input norm
    (``layer_input``) or the final norm. ``counters``: the layer's cache counters
    (``counters_for``) and ``after`` (``moe_after``), which let the MoE block run as one
    launch (``moe_fused``)."""
    post = layer.post_attention_layernorm
    if type(layer.mlp) is qwen3_next.Qwen3NextSparseMoeBlock and op_enabled(PRE_NORM_OP):
        pending = PendingNorm(h, r, post.weight, post.eps,  # folded into the router
                              moe_counters(layer, counters, h.shape[0], after))
        m = layer.mlp(pending)
        if pending.h is None:
            pending.resolve()
        return pending.h, m
    h, n = add_rms_norm(h, r, post.weight, post.eps)
    return h, layer.mlp(n)


def layer_input(h, m, norm, defer):
    """The next layer's input from the residual ``h`` and the last MLP output ``m``:
    ``(h, PendingNorm)`` when ``defer`` (its input projection folds the add and the norm
    into its GEMV), else ``add_rms_norm``'s ``(h + m, x)``."""
    if defer:
        return h, PendingNorm(h, m, norm.weight, norm.eps)
    return add_rms_norm(h, m, norm.weight, norm.eps)


def layer_mixer(layer, x, mask, c, h):
    """Run the layer's mixer on ``x`` (array or ``PendingNorm``); returns ``(h, r)`` with
    the residual the pending norm computed on the way."""
    r = layer.linear_attn(x, mask, c) if layer.is_linear else layer.self_attn(x, mask, c)
    if isinstance(x, PendingNorm):
        if x.h is None:
            x.resolve()
        h = x.h
    return h, r
