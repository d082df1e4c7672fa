"""Lily forwards for the blocks mlx-lm's ``qwen3_next`` module defines and ``qwen3_5``
reuses: gated attention, the sparse MoE block, Qwen3-Next's GatedDeltaNet and the
decoder layer. Each forward checks first whether this call is one Lily serves and
otherwise runs the original method unchanged (training, sharding, unsupported caches,
kill switch); ops pick kernels or their references inside.
"""

from __future__ import annotations

import operator
import threading
import weakref

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_next
from mlx_lm.models.cache import ArraysCache, KVCache

from mlx_lily.backend import op_enabled
from mlx_lily.patching import module_mutations, mutations_tracked, prefill_eval_layers
from mlx_lily.kernels import device_scalars
from mlx_lily.ops import attention as attn_ops
from mlx_lily.ops import qgemv as _qgemv_ops
from mlx_lily.ops import norm_qgemv as norm_qgemv_ops
from mlx_lily.ops import qmm_dequant
from mlx_lily.ops.add_rms_norm import add_rms_norm
from mlx_lily.ops import gated_delta as gdn_ops
from mlx_lily.ops.gated_delta import gated_delta, gated_delta_packed
from mlx_lily.ops.moe_experts import FUSED_COUNTERS, drop_plans, moe_experts, moe_experts_routed
from mlx_lily.ops.moe_router_topk import PRE_NORM_OP, moe_router_topk, moe_router_topk_pending
from mlx_lily.qproj import PendingNorm, QProj, resolve

MODEL_TYPES = ("qwen3_next",)


class WeightSig:
    """The identity of every array, sub-module and list of modules in one or more module
    trees when it was taken: ``valid()`` turns False once any of them is replaced
    (``load_weights``, ``update``, ``set_dtype``, quantization, a layer swapped for another). A copy (``copy.deepcopy``, pickling) is never valid, so a copied model
    rebuilds what it derived from its weights. Taken while patched (and no module in the
    trees overrides ``mlx.nn.Module``'s item mutators), ``valid()`` first compares the
    count of module item mutations (``mlx_lily.patching.module_mutations``) with the one
    it last saw: equal, nothing can have been replaced; else the full identity check."""

    __slots__ = ("_owners", "_keys", "_values", "_count", "_tracked")

    def __init__(self, module=None, *more):
        count = module_mutations()  # before reading the modules (see valid())
        mods = [] if module is None else [m for top in (module, *more)
                                          for _, m in top.named_modules()]
        entries = [(m, k, v) for m in mods for k, v in m.items()
                   if isinstance(v, (mx.array, nn.Module, list, tuple))]
        # parallel tuples, so that the full check runs in C
        self._owners = None if module is None else tuple(m for m, _, _ in entries)
        self._keys = tuple(k for _, k, _ in entries)
        self._values = tuple(v for _, _, v in entries)
        # while patched, the count of module item mutations answers first: unchanged,
        # nothing was replaced (~0.1 ms per decode step saved on the CPU box, 2631 entries)
        self._tracked = all(mutations_tracked(t) for t in {type(m) for m in mods})
        self._count = count

    def valid(self) -> bool:
        if self._owners is None:
            return False
        count = module_mutations()
        if self._tracked and count is not None and self._count == count:
            return True
        # the count read before the check: a mutation during the check moves it again
        ok = all(map(operator.is_, map(dict.get, self._owners, self._keys), self._values))
        if ok and count is not None:
            self._count = count
        return ok

    def __deepcopy__(self, memo):
        return WeightSig()

    def __reduce__(self):
        return (WeightSig, ())


class LilyState:
    """Per-module prepared data (fused projections); a plain object, so it never enters
    the module's parameter tree. ``rebuild(module)`` prepares the module again; ``sig``
    tells when its weights were replaced since."""

    def __init__(self, owner, rebuild, **projs):
        self.__dict__.update(projs)
        self.rebuild = rebuild
        self.sig = WeightSig(owner)


class _CheckedForward(threading.local):
    """True while a decoder stack whose weights ``_check_weights`` has just validated (and
    whose stale fused projections it rebuilt) runs: ``_proj`` then skips its own check."""

    active = False


_CHECKED = _CheckedForward()


def refresh(module) -> None:
    """Re-prepare ``module`` (fused projections) from its current weights."""
    st = getattr(module, "_lily", None)
    if st is not None:
        module._lily = None
        st.rebuild(module)


def _original(cls, name="__call__"):
    from mlx_lily.patching import original

    return original(cls, name)


def _proj(module, key, layers):
    """The fused projection prepared for ``module`` under ``key``, or per-layer views."""
    st = getattr(module, "_lily", None)
    if st is not None and not _CHECKED.active and not st.sig.valid():  # replaced weights
        refresh(module)
        st = getattr(module, "_lily", None)
    p = getattr(st, key, None) if st is not None else None
    if p is not None:
        return p
    return [QProj.view([l]) or _CallLayer(l) for l in layers]


class _CallLayer:
    """Adapter making any layer look like a one-part QProj."""

    def __init__(self, layer):
        self.layer = layer

    def __call__(self, x):
        return [self.layer(x)]


def _run(proj, x, split=True):
    """The parts of projection ``proj`` (a ``QProj`` or a list of one-part callables) of
    ``x``, an array or a ``PendingNorm`` (folded into the GEMV where the kernel serves);
    ``split=False`` (a ``QProj`` only): the unsplit output as a one-item list."""
    if isinstance(x, PendingNorm):
        if isinstance(proj, QProj):
            return proj.call_pending(x, split)
        x = x.resolve()
    if not split:
        return proj(x, split)
    if isinstance(proj, list):
        out = []
        for p in proj:
            out.extend(p(x))
        return out
    return proj(x)


# ---------------------------------------------------------------- attention
def _attention_supported(self, cache) -> bool:
    return (op_enabled(attn_ops.NAME) and not self.training
            and (cache is None or type(cache) is KVCache)
            and type(self.rope) is nn.RoPE)


def attention_call(self, x, mask=None, cache=None):
    """Gated GQA attention (``Qwen3NextAttention.__call__`` with Lily ops)."""
    if not _attention_supported(self, cache):
        return _original(qwen3_next.Qwen3NextAttention)(self, resolve(x), mask, cache)
    B, L, _ = x.shape
    Hq, Hkv = self.num_attention_heads, self.num_key_value_heads
    proj = _proj(self, "qkv", (self.q_proj, self.k_proj, self.v_proj))
    if L == 1 and mask is None and cache is not None and isinstance(proj, QProj) \
            and op_enabled(attn_ops.PACKED_OP):
        out = _attention_decode_packed(self, proj, x, cache)
        if out is not None:
            return out
    q_out, keys, values = _run(proj, x)
    queries, gate = mx.split(q_out.reshape(B, L, Hq, -1), 2, axis=-1)
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
    (y,) = _run(proj, x, split=False)
    qkv = attn_ops.qkv_norm_rope_packed(
        y, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, n_heads=Hq,
        n_kv_heads=Hkv, head_dim=D, rope_dims=rope.dims, base=rope.base, scale=rope.scale,
        traditional=rope.traditional, offset=cache.offset)
    if qkv is None:
        return None
    q, k, v = qkv
    k, v = cache.update_and_fetch(k, v)
    out = attn_ops.sdpa_gated_packed(q, k, v, self.scale, y, Hq, Hkv, D)
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
        return _original(qwen3_next.Qwen3NextSparseMoeBlock)(self, resolve(x))
    if use_router:
        router = _proj(self, "router", (self.gate, self.shared_expert_gate))
        if use_experts and isinstance(router, QProj):
            y = moe_experts_routed(x, router, self.top_k, self.norm_topk_prob,
                                   self.switch_mlp, self.shared_expert)
            if y is not None:
                return y
        if isinstance(router, list):
            parts = router
            router = lambda t: _run(parts, t)  # noqa: E731
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
        return moe_experts(x, inds, scores, self.switch_mlp, self.shared_expert, shared)
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


def contiguous_qproj(layer):
    """A one-part ``QProj`` of a bias-free affine ``nn.QuantizedLinear`` whose arrays are
    row-contiguous (``mx.contiguous``, evaluated now: the same memory when they already
    are), for kernels that read weights without strides; None for any other layer."""
    if (type(layer) is not nn.QuantizedLinear or "bias" in layer
            or (getattr(layer, "mode", None) or "affine") != "affine"):
        return None
    w, s, b = (mx.contiguous(a) for a in (layer.weight, layer.scales, layer.biases))
    mx.eval(w, s, b)
    return QProj(w, s, b, layer.group_size, layer.bits, "affine", (int(w.shape[0]),))


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
    if isinstance(cache, _StepCache):
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


def _counters_for(layer, c, h):
    """The arrival counters of a decoder layer's real cache ``c`` (``gdn_counters``) for a
    step of ``h [B, 1, D]``: the GDN launch's (GDN layers), then the one-launch MoE
    block's."""
    return gdn_counters(c, _gdn_counter_count(layer, h.shape[0]) + FUSED_COUNTERS)


def _moe_counters(layer, counters, B, after):
    """``(counters, offset, after)`` of the MoE block of ``layer`` in its cache's counter
    array (``PendingNorm.counters``), or None without counters or ``after``."""
    off = _gdn_counter_count(layer, B)
    if counters is None or after is None or counters.size < off + FUSED_COUNTERS:
        return None
    return counters, off, after


MOE_AFTER_ATTR = "_lily_moe_after"


def _moe_after(c, h):
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


def gdn_core(self, qkv, z, b, a, mask, cache, packed=False):
    """Shared tail of both GDN variants: conv, recurrence, gated norm, cache update,
    ``out_proj``. ``qkv [B,S,C]``, ``z [B,S,Hv,Dv]``, ``b``/``a [B,S,Hv]``; or, with
    ``packed``, ``qkv`` the fused projection ``q|k|v|z|b|a`` and z/b/a None."""
    B, S, _ = qkv.shape
    conv_state = cache[0] if cache is not None else None
    state = cache[1] if cache is not None else None
    dims = _gdn_dims(self, mask, cache)
    if packed:
        out, new_conv, new_state = gated_delta_packed(
            qkv, self.conv1d.weight, conv_state, self.A_log, self.dt_bias, state,
            self.norm.weight, **dims)
    else:
        out, new_conv, new_state = gated_delta(
            qkv, z, b, a, self.conv1d.weight, conv_state, self.A_log, self.dt_bias, state,
            self.norm.weight, **dims)
    return _gdn_finish(self, out, new_conv, new_state, cache, S)


def next_gdn_call(self, inputs, mask=None, cache=None):
    """Qwen3-Next GatedDeltaNet (fused ``in_proj_qkvz``/``in_proj_ba`` layout)."""
    inputs = resolve(inputs)
    if not gdn_supported(self):
        return _original(qwen3_next.Qwen3NextGatedDeltaNet)(self, inputs, mask, cache)
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
            return _original(cls_getter())(self, x, mask, cache)
        mixer = self.linear_attn if self.is_linear else self.self_attn
        r = mixer(self.input_layernorm(x), mask, cache)
        norm = self.post_attention_layernorm
        h, n = add_rms_norm(x, r, norm.weight, norm.eps)
        return h + self.mlp(n)

    return decoder_call


decoder_call = make_decoder_call(lambda: qwen3_next.Qwen3NextDecoderLayer)


class _StepCache:
    """An ``ArraysCache`` stand-in for one traced decode step: it collects the new conv
    and recurrent states instead of mutating the real cache (compiled functions must not
    have Python side effects)."""

    lengths = None
    left_padding = None

    def __init__(self, conv, state, counters=None):
        self.cache = [conv, state]
        self.counters = counters

    def __getitem__(self, i):
        return self.cache[i]

    def __setitem__(self, i, v):
        self.cache[i] = v

    def __bool__(self):
        return True

    def advance(self, n):
        pass


class _CompiledSteps:
    """Per-model compiled decode functions, valid for one dispatch configuration. A copy
    of the model (``copy.deepcopy``, pickling) starts with none."""

    def __init__(self, key=None):
        self.key = key
        self.fns: dict = {}  # (layer index, pending[, "attn"]) -> compiled fn or False
        self.whole = None  # whole-stack step: (KV shapes, compiled fn), False (failed), None
        self.recent: dict = {}  # KV shapes -> whole-stack fn, the last RECENT_WHOLE_STEPS
        self.static: dict = {}  # per-forward facts of the whole step, by dtype/switch

    def clear(self) -> None:
        self.fns.clear()
        self.whole = None
        self.recent.clear()
        self.static.clear()

    def __deepcopy__(self, memo):
        return _CompiledSteps()

    def __reduce__(self):
        return (_CompiledSteps, ())


_MODELS_WITH_STEPS: dict = {}  # id -> weakref of models holding compiled steps


def drop_compiled_steps() -> None:
    """Forget every model's compiled decode functions and cached one-row views (they hold
    traced graphs and weight views; ``unpatch`` keeps the compiled functions for the next
    patch and drops only the views)."""
    drop_views()
    for ref in list(_MODELS_WITH_STEPS.values()):
        m = ref()
        if m is not None:
            m.__dict__.pop("_lily_steps", None)
    _MODELS_WITH_STEPS.clear()


def _compile_key():
    """What the traced functions depend on beyond shapes: backend, op selection, switches.
    Compiled steps outlive ``unpatch``: a later patch reuses them only under an equal key
    and unchanged weights (``_check_weights``)."""
    from mlx_lily import backend

    be = backend.current_backend()
    if backend.compile_mode(be) == "off":
        return None
    from mlx_lily import config, tuning

    return (be, backend.disabled_ops(), backend._selected_ops, config.kernels,
            tuning.decode_pf, norm_qgemv_ops.split_requested(), gdn_ops.proj_split(be),
            tuning.moe_fused_rpw, tuning.moe_tile_rows)


def _layer_tail(layer, h, r, counters=None, after=None):
    """``(h, r) -> (h', m)``: the residual add fused into the post-attention RMSNorm (in
    the MoE router's kernel when ``moe_router_norm`` serves), then the MLP/MoE output
    ``m``; the closing residual add is left to the next layer's input norm
    (``_layer_input``) or the final norm. ``counters``: the layer's cache counters
    (``_counters_for``) and ``after`` (``_moe_after``), which let the MoE block run as one
    launch (``moe_fused``)."""
    post = layer.post_attention_layernorm
    if type(layer.mlp) is qwen3_next.Qwen3NextSparseMoeBlock and op_enabled(PRE_NORM_OP):
        pending = PendingNorm(h, r, post.weight, post.eps,  # folded into the router
                              _moe_counters(layer, counters, h.shape[0], after))
        m = layer.mlp(pending)
        if pending.h is None:
            pending.resolve()
        return pending.h, m
    h, n = add_rms_norm(h, r, post.weight, post.eps)
    return h, layer.mlp(n)


def _layer_input(h, m, norm, defer):
    """The next layer's input from the residual ``h`` and the last MLP output ``m``:
    ``(h, PendingNorm)`` when ``defer`` (its input projection folds the add and the norm
    into its GEMV), else ``add_rms_norm``'s ``(h + m, x)``."""
    if defer:
        return h, PendingNorm(h, m, norm.weight, norm.eps)
    return add_rms_norm(h, m, norm.weight, norm.eps)


def _mixer(layer, x, mask, c, h):
    """Run the layer's mixer on ``x`` (array or ``PendingNorm``); returns ``(h, r)`` with
    the residual the pending norm computed on the way."""
    r = layer.linear_attn(x, mask, c) if layer.is_linear else layer.self_attn(x, mask, c)
    if isinstance(x, PendingNorm):
        if x.h is None:
            x.resolve()
        h = x.h
    return h, r


def _gdn_step_fn(layer, pending):
    """One decode step of a GDN decoder layer as a pure function: ``(h, d, conv, state,
    counters, after) -> (h', m, conv', state')``, where ``d`` is the layer's input ``x``
    or, when ``pending``, the previous MLP output (``x = rms_norm(h + d)`` is then folded
    into the input projection), ``counters`` the cache's ``_counters_for`` and ``after``
    its ``_moe_after`` (store ``m`` there after the step); mixer, post-attention add+norm
    and MLP/MoE."""
    norm = layer.input_layernorm

    def step(h, d, conv, state, counters, after):
        c = _StepCache(conv, state, counters)
        x = PendingNorm(h, d, norm.weight, norm.eps) if pending else d
        h, r = _mixer(layer, x, None, c, h)
        h, m = _layer_tail(layer, h, r, counters, after)
        return h, m, c[0], c[1]

    return step


def _gdn_step(layer, pending):
    """``_gdn_step_fn`` compiled."""
    return mx.compile(_gdn_step_fn(layer, pending))


COMPILE_ATTN_ENV = "MLX_LILY_COMPILE_ATTN"  # tuning.compile_attn


def _attn_step_ok(layer, c, x) -> bool:
    """Whether this attention layer's decode step can run as one compiled function
    (on with compiled decode steps; ``MLX_LILY_COMPILE_ATTN=0`` turns it off): a plain
    ``KVCache`` with room for the token (``_attn_cache_ok``), the fused q|k|v projection,
    and the packed decode kernels serving (heads, dims, dtype: ``_attn_static_head_dim``)."""
    d = _attn_static_head_dim(layer, x.dtype)
    return d is not None and _attn_cache_ok(c, x, d)


def _attn_cache_ok(c, x, head_dim) -> bool:
    """The per-step part of ``_attn_step_ok``: a plain ``KVCache`` of ``x``'s batch with
    room for one more token, of head size ``head_dim``."""
    return (type(c) is KVCache and c.keys is not None and c.offset + 1 <= c.keys.shape[2]
            and x.shape[1] == 1 and c.keys.shape[0] == x.shape[0]
            and c.keys.shape[-1] == head_dim)


def _attn_static_head_dim(layer, dtype):
    """The part of ``_attn_step_ok`` that holds for every step of a forward (switches,
    modules, dtype): the head size when the compiled attention step serves, else None."""
    from mlx_lily import backend

    from mlx_lily import tuning

    if not tuning.compile_attn:
        return None
    attn = layer.self_attn
    if not (op_enabled(attn_ops.NAME) and op_enabled(attn_ops.PACKED_OP)
            and not attn.training and type(attn.rope) is nn.RoPE):
        return None
    st = getattr(attn, "_lily", None)
    proj = getattr(st, "qkv", None) if st is not None else None
    Hq, Hkv = attn.num_attention_heads, attn.num_key_value_heads
    if not isinstance(proj, QProj) or Hq % Hkv or Hq // Hkv > 8:
        return None
    D = proj.out_features // (2 * Hq + 2 * Hkv)
    rope = attn.rope
    ok = (D in attn_ops._HEAD_DIMS
          and attn_ops.packed_supported(dtype, attn.q_norm.weight, attn.k_norm.weight,
                                        head_dim=D, rope_dims=rope.dims,
                                        traditional=rope.traditional))
    return D if ok else None


def _attn_step_fn(layer, pending):
    """One decode step of an attention decoder layer as a pure function of arrays:
    ``(h, d, keys, values, offset[, tlen, kv_idx, counters, after]) -> (h', m, keys',
    values')`` with
    ``keys``/``values`` the KV cache's whole buffers, ``offset`` an int32 ``[1]`` (the
    token's position), ``tlen`` = ``offset + 1`` and ``kv_idx`` = ``kv_write_index``
    (computed here when not given; without ``tlen`` both are made device-resident here,
    ``kernels.device_scalars``): fused add+norm+q|k|v GEMV, q/k norm + RoPE + v, the
    cache write (``kv_write_index``), split-K attention over the first ``offset + 1`` keys (DYN_T),
    ``o_proj``, post-attention add+norm, MLP/MoE (one launch with the cache's
    ``counters``, ``_counters_for``). Static shapes for a given cache
    capacity, so ``mx.compile`` replays it until the cache grows."""
    attn = layer.self_attn
    norm = layer.input_layernorm
    Hq, Hkv = attn.num_attention_heads, attn.num_key_value_heads

    def step(h, d, keys, values, offset, tlen=None, kv_idx=None, counters=None,
             after=None):
        if tlen is None:  # one layer on its own: position and key count in device memory
            off4 = device_scalars(offset)
            offset, tlen = off4[:1], (off4 + 1)[:1]
        x = PendingNorm(h, d, norm.weight, norm.eps) if pending else d
        proj = _proj(attn, "qkv", (attn.q_proj, attn.k_proj, attn.v_proj))
        (y,) = _run(proj, x, split=False)
        if pending:
            if x.h is None:
                x.resolve()
            h = x.h
        D = y.shape[-1] // (2 * Hq + 2 * Hkv)
        rope = attn.rope
        q, k, v = attn_ops.qkv_norm_rope_packed(
            y, attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps, n_heads=Hq,
            n_kv_heads=Hkv, head_dim=D, rope_dims=rope.dims, base=rope.base,
            scale=rope.scale, traditional=rope.traditional, offset=offset)
        idx = kv_write_index(offset, k.shape) if kv_idx is None else kv_idx
        keys = mx.put_along_axis(keys, idx, k, axis=2)
        values = mx.put_along_axis(values, idx, v, axis=2)
        out = attn_ops.decode_attention(q, keys, values, attn.scale, y, gate_packed=True,
                                        tlen=tlen)
        h, m = _layer_tail(layer, h, one_row_linear(attn.o_proj, out), counters, after)
        return h, m, keys, values

    return step


def kv_write_index(offset, row_shape):
    """Indices for writing one token's K or V row ``[B, Hkv, 1, D]`` into a whole cache
    buffer at position ``offset`` (int32 ``[1]``) with ``mx.put_along_axis(buf, idx, row,
    axis=2)``: ``offset`` broadcast to ``row_shape``. Not ``mx.slice_update`` at an array
    offset: on MLX's CUDA backend (0.32) that primitive launches its copy kernel over the
    whole buffer (``copy_general_dynamic`` sized by the output), 0.66 ms per write on a
    128K-token cache on the H200 (``benchmarks/gpu/kv_write_probe.py``) vs 0.05 ms for the
    static write stock mlx-lm does; ``put_along_axis`` (``ScatterAxis``) launches over the
    row only and updates the donated buffer in place."""
    return mx.broadcast_to(offset.reshape(1, 1, 1, 1), row_shape)


def _whole_step_fn(text_model, layers):
    """A whole decode step of the decoder stack as one pure function: ``(h, *states,
    offset) -> (y, *states')`` with ``h`` the token's embedding ``[B, 1, D]``, ``states``
    each layer's cache arrays in order (GDN: conv and recurrent state; attention: the KV
    cache's key and value buffers; then the cache's ``_counters_for`` and ``_moe_after``,
    inputs only; ``states'`` per layer: the two new cache arrays and the layer's MoE
    output, the next step's ``_moe_after``), ``offset`` the attention layers' common
    position (int32 ``[1]``) and ``y`` the final norm's output. The layers' bodies are ``_gdn_step_fn`` / ``_attn_step_fn`` (every
    layer's input norm but the first pending, folded into its input projection), so
    ``mx.compile`` replays the whole step with one Python call until the KV caches grow."""
    first = layers[0].input_layernorm
    fns = [(_gdn_step_fn if l.is_linear else _attn_step_fn)(l, i > 0)
           for i, l in enumerate(layers)]
    norm = text_model.norm

    def step(h, *arrays):
        # the position and key count in device memory (kernels.device_scalars), once for
        # every attention layer, as the write indices
        off4 = device_scalars(arrays[-1])
        offset, tlen = off4[:1], (off4 + 1)[:1]
        idx = {}
        d = mx.fast.rms_norm(h, first.weight, first.eps)
        outs = []
        it = iter(arrays[:-1])
        for layer, f in zip(layers, fns):
            a, b = next(it), next(it)
            ctr, after = next(it), next(it)
            if layer.is_linear:
                h, d, a, b = f(h, d, a, b, ctr, after)
            else:
                row = (a.shape[0], a.shape[1], 1, a.shape[3])
                if row not in idx:
                    idx[row] = kv_write_index(offset, row)
                h, d, a, b = f(h, d, a, b, offset, tlen, idx[row], ctr, after)
            outs += [a, b, d]
        return [add_rms_norm(h, d, norm.weight, norm.eps)[1], *outs]

    return step


#: Compiled whole-stack decode steps kept per model, one per KV-cache capacity.
RECENT_WHOLE_STEPS = 4

KV_STEP_ENV = "MLX_LILY_KV_STEP"  # tuning.kv_step
#: KV-cache capacity growth (tokens) for plain ``KVCache`` objects a patched forward sees.
#: mlx-lm grows by 256; each growth changes the compiled decode step's shapes, so the step
#: that grows runs layer by layer and the next one traces the whole stack again
#: (``benchmarks/build_time.py --layers 40 --growth-steps 1100`` on this repository's CPU
#: box, stubbed kernels, commit f6a157a: at 256, 8 steps of 1100 over 5x the median, 37.4 ms
#: in all, against a 0.32 ms median). 2048 (the prefill chunk) cuts those events 8x for at most 2047 unused cache rows per attention layer (4 MiB per layer for
#: Qwen3.6-35B-A3B's 2 KV heads x 256 dims, bf16 K and V).
DEFAULT_KV_STEP = 2048


def _kv_step() -> int:
    """``MLX_LILY_KV_STEP`` (``tuning.kv_step``: an integer >= 1; a bad value warns once
    and keeps the default), else ``DEFAULT_KV_STEP``."""
    from mlx_lily import tuning

    v = tuning.kv_step
    return DEFAULT_KV_STEP if v is None else v


def _widen_kv_steps(cache) -> None:
    """Raise the growth step of every plain ``KVCache`` in ``cache`` to ``_kv_step()``
    (never lower it). Only the capacity changes: ``offset``, the rows up to it and the
    attention results are those of mlx-lm's growth (which trims to the offset before
    growing when the offset is not a multiple of the step). mlx-lm 0.32's
    ``KVCache.state`` is the whole buffer, so a cache saved with ``save_prompt_cache``
    carries up to step - 1 unused rows per attention layer, as it does at 256."""
    step = _kv_step()
    if step <= 0:
        return
    for c in cache:
        if type(c) is KVCache and c.step < step:
            c.step = step


def _run_whole_step(text_model, cs, layers, cache, h):
    """The decode step through ``_whole_step_fn`` (compiled on first use, kept in
    ``cs.whole``, ``cs`` the model's ``_CompiledSteps``) when every layer can run compiled now (``_gdn_step_ok``,
    ``_attn_step_ok``) with one common KV offset; the caches are updated. None when it
    does not serve this step (the per-layer path then runs; nothing was changed); a
    tracing failure marks it off for this model (one warning)."""
    from mlx_lily import backend

    if backend.compile_mode() != "whole":
        return None
    # what holds for every step (switches, modules, dtype): once per compile key
    from mlx_lily import tuning

    skey = ("whole-ok", h.dtype, tuning.compile_attn)
    dims = cs.static.get(skey)
    if dims is None:
        dims = [0 if l.is_linear and gdn_supported(l.linear_attn) else
                (None if l.is_linear else _attn_static_head_dim(l, h.dtype)) for l in layers]
        dims = cs.static[skey] = dims if all(d is not None for d in dims) else False
    if dims is False:
        return None
    offset = None
    for layer, c, d in zip(layers, cache, dims):
        if layer.is_linear:
            if not _gdn_cache_ok(c):
                return None
        elif not _attn_cache_ok(c, h, d) or offset not in (None, c.offset):
            return None
        else:
            offset = c.offset
    # one compiled function per cache capacity (MLX would scan every trace a function holds
    # at each call), the last RECENT_WHOLE_STEPS kept: caches of other capacities (requests
    # of other lengths) reuse theirs instead of tracing the stack again
    shapes = tuple(c.keys.shape for l, c in zip(layers, cache) if not l.is_linear)
    fn = cs.recent.get(shapes)  # holds cs.whole's function too
    if fn is None:
        fn = mx.compile(_whole_step_fn(text_model, layers))
    args = [h]
    for layer, c in zip(layers, cache):
        args += ([c[0], c[1]] if layer.is_linear else [c.keys, c.values])
        args += [_counters_for(layer, c, h), _moe_after(c, h)]
    args.append(mx.array([offset or 0], dtype=mx.int32))
    try:
        out = fn(*args)
    except Exception as e:  # noqa: BLE001  (any tracing failure: per-layer path)
        import warnings

        warnings.warn(f"mlx-lily: compiling the whole decode step failed ({e!r}); layers "
                      "run one compiled function each", stacklevel=3)
        cs.whole = False
        return None
    if cs.whole is None or cs.whole[1] is not fn:
        cs.whole = (shapes, fn)
        cs.recent.pop(shapes, None)
        cs.recent[shapes] = fn  # most recent last
        while len(cs.recent) > RECENT_WHOLE_STEPS:
            cs.recent.pop(next(iter(cs.recent)))
    it = iter(out[1:])
    for layer, c in zip(layers, cache):
        if layer.is_linear:
            c[0] = next(it)
            c[1] = next(it)
        else:
            c.keys = next(it)
            c.values = next(it)
            c.offset += 1
        setattr(c, MOE_AFTER_ATTR, next(it))
    return out[0]


def _mlp_tail(layer):
    """``(h, r) -> (h', m)`` compiled: ``_layer_tail`` of an attention layer."""
    return mx.compile(lambda h, r: _layer_tail(layer, h, r))


def _compiled_steps(model, key):
    st = model.__dict__.get("_lily_steps")
    if st is None or st.key != key:
        st = _CompiledSteps(key)
        object.__setattr__(model, "_lily_steps", st)
        key_id = id(model)
        _MODELS_WITH_STEPS[key_id] = weakref.ref(
            model, lambda _, k=key_id: _MODELS_WITH_STEPS.pop(k, None))
    return st


def _weights_changed(module) -> bool:
    """Whether any weight of ``module`` was replaced since its signature was taken (the
    first call takes it). Fused projections derived from the old weights are rebuilt."""
    sig = module.__dict__.get("_lily_sig")
    if sig is not None and sig.valid():
        return False
    for _, m in module.named_modules():  # first signature, or weights replaced since
        st = getattr(m, "_lily", None)
        if st is not None and not st.sig.valid():
            refresh(m)
    object.__setattr__(module, "_lily_sig", WeightSig(module))
    return sig is not None


def _check_weights(text_model, layers) -> None:
    """Compiled decode functions capture the arrays they were traced with (each layer's
    and the next layer's norm): when any weight or layer was replaced, all are rebuilt.
    One signature over the final norm and every layer answers first (``WeightSig``);
    only when it fails are the layers checked one by one (and stale fused projections
    rebuilt)."""
    whole = text_model.__dict__.get("_lily_sig_all")
    if (whole is not None and len(whole[0]) == len(layers)
            and all(map(operator.is_, whole[0], layers)) and whole[1].valid()):
        return
    changed = _weights_changed(text_model.norm)
    for layer in layers:
        changed |= _weights_changed(layer)
    changed |= whole is not None  # a layer replaced, or an array
    if changed:  # launch plans hold the old arrays: drop them with the compiled steps
        for layer in layers:
            sw = getattr(getattr(layer, "mlp", None), "switch_mlp", None)
            if sw is not None:
                drop_plans(sw)
    st = text_model.__dict__.get("_lily_steps") if changed else None
    if st is not None:
        st.clear()
    object.__setattr__(text_model, "_lily_sig_all",
                       (tuple(layers), WeightSig(text_model.norm, *layers)))


def make_text_model_call(module, cls_name, layer_cls_name, with_embeddings):
    """The decoder stack with each layer's closing residual add fused into the NEXT
    layer's input RMSNorm (and the last one into the final norm): no separate add or
    norm. With the ``norm_qgemv`` op on, that add and norm are handed to the next layer as
    a ``PendingNorm`` and run inside its input projection's GEMV when the kernel serves
    (one-row decode), else as ``add_rms_norm``. Pipeline-parallel models take the stock
    code.

    Decode steps (one token, no masks, plain caches) on a GPU backend run each layer as
    an ``mx.compile``d function (an attention layer whole while its KV cache has room,
    else its mixer eagerly and its MoE half compiled): Python builds the layer's graph
    once, later steps replay it (``MLX_LILY_COMPILE=0`` turns this off,
    ``MLX_LILY_COMPILE_ATTN=0`` keeps attention mixers eager).

    Multi-token calls start evaluating every ``prefill_eval_layers`` layers
    (``mlx_lily.patching.PREFILL_EVAL_LAYERS``) so the GPU overlaps the rest of the build;
    the graph and its results are the same.
    """

    def text_model_call(self, inputs, cache=None, input_embeddings=None):
        from mlx_lily.backend import env_frozen

        with env_frozen():
            return _text_model_forward(self, inputs, cache, input_embeddings)

    def _text_model_forward(self, inputs, cache, input_embeddings):
        stock = _original(getattr(module, cls_name))
        layers = self.pipeline_layers
        layer_cls = getattr(module, layer_cls_name)
        if (self.pipeline_size > 1 or self.training or not op_enabled("add_rms_norm")
                or not layers or any(type(l) is not layer_cls for l in layers)):
            if with_embeddings:
                return stock(self, inputs, cache, input_embeddings=input_embeddings)
            return stock(self, inputs, cache)
        h = input_embeddings if input_embeddings is not None else self.embed_tokens(inputs)
        if cache is None:
            cache = [None] * len(layers)
        fa_mask = (module.create_attention_mask(h, cache[self.fa_idx])
                   if self.fa_idx is not None else None)
        ssm_mask = (module.create_ssm_mask(h, cache[self.ssm_idx])
                    if self.ssm_idx is not None else None)
        first = layers[0].input_layernorm
        x = mx.fast.rms_norm(h, first.weight, first.eps)
        steps = cs = None
        if h.shape[1] == 1 and fa_mask is None and ssm_mask is None:
            key = _compile_key()
            if key is not None:
                cs = _compiled_steps(self, key)
                steps = cs.fns
        _check_weights(self, layers)
        defer = op_enabled("norm_qgemv")
        every = prefill_eval_layers(h.shape[0] * h.shape[1]) if h.shape[1] > 1 else 0
        m = None
        outer, _CHECKED.active = _CHECKED.active, True
        try:
            if cs is not None and defer and cs.whole is not False:
                y = _run_whole_step(self, cs, layers, cache, h)
                if y is not None:
                    return y
            _widen_kv_steps(cache)  # where caches grow: prefill, or a step without room
            for i, (layer, c) in enumerate(zip(layers, cache)):
                if m is not None:
                    h, x = _layer_input(h, m, layer.input_layernorm, defer)
                if steps is not None and (not layer.is_linear or _gdn_step_ok(layer, c)):
                    key_i = (i, isinstance(x, PendingNorm))
                    if not layer.is_linear and _attn_step_ok(layer, c, x):
                        key_a = key_i + ("attn",)
                        if steps.get(key_a) is not False:
                            h, m = _run_compiled(steps, key_a, layer, h, x, c, fa_mask)
                            continue
                    if steps.get(key_i) is not False:
                        h, m = _run_compiled(steps, key_i, layer, h, x, c, fa_mask)
                        continue
                h, r = _mixer(layer, x, ssm_mask if layer.is_linear else fa_mask, c, h)
                h, m = _layer_tail(layer, h, r)
                if every and (i + 1) % every == 0 and i + 1 < len(layers):
                    every = every if _eval_ahead(h, m) else 0
        finally:
            _CHECKED.active = outer
        if h.shape[1] > 1:
            _kv_headroom(cache)
        return add_rms_norm(h, m, self.norm.weight, self.norm.eps)[1]

    return text_model_call


def _eval_ahead(*arrays) -> bool:
    """Start evaluating ``arrays`` (``mx.async_eval``) so the GPU runs the layers built so
    far while Python builds the next ones; False, with nothing evaluated, when the call
    runs under a function transformation (``mx.compile``, ``mx.grad``, ``mx.vmap``,
    export), where MLX refuses evaluation."""
    try:
        mx.async_eval(*arrays)
    except ValueError:
        return False
    return True


#: Rows a multi-token (prefill) call leaves free in each plain ``KVCache`` it grew into:
#: ``generate_step`` runs the prompt's last token and builds the first generated one right
#: after the prefill chunks, and a step without room runs layer by layer and makes the
#: next one retrace the compiled stack. A prompt of 4096 tokens filled the 4096-row cache
#: exactly, so the first generated token paid that inside the time to first token.
KV_HEADROOM = 2


def _kv_headroom(cache, rows: int = KV_HEADROOM) -> None:
    """Grow every plain ``KVCache`` in ``cache`` with fewer than ``rows`` free rows by its
    step (zeros appended along the sequence axis, as mlx-lm's own growth does when the
    offset is a multiple of the step): the growth the next decode step would do, done at
    the end of a prefill call instead. ``offset`` and the rows up to it are unchanged."""
    for c in cache or ():
        if type(c) is not KVCache or c.keys is None or c.step <= 0:
            continue
        cap = c.keys.shape[2]
        if cap - c.offset >= rows:
            continue
        keys, values = c.keys[..., :c.offset, :], c.values[..., :c.offset, :]
        n = ((c.offset + rows + c.step - 1) // c.step) * c.step - c.offset
        kz = mx.zeros((*keys.shape[:2], n, keys.shape[3]), keys.dtype)
        vz = mx.zeros((*values.shape[:2], n, values.shape[3]), values.dtype)
        c.keys = mx.concatenate([keys, kz], axis=2)
        c.values = mx.concatenate([values, vz], axis=2)


def _gdn_step_ok(layer, c) -> bool:
    """Whether this GDN layer's decode step can run compiled: a plain ``ArraysCache``
    holding both states, no batch lengths or padding (``_gdn_cache_ok``), and the Lily GDN
    forward serving."""
    return _gdn_cache_ok(c) and gdn_supported(layer.linear_attn)


def _gdn_cache_ok(c) -> bool:
    return (type(c) is ArraysCache and c.lengths is None and c.left_padding is None
            and c.cache[0] is not None and c.cache[1] is not None)


def _run_compiled(steps, key, layer, h, x, c, fa_mask):
    """A layer's decode step through its compiled function, built on first use. ``key`` =
    (layer index, whether ``x`` is a ``PendingNorm``), plus ``"attn"`` for a whole
    attention step (``_attn_step_fn``; the cache's buffers and offset are updated, and
    ``mx.compile`` retraces when the cache grows); otherwise a GDN layer's step or an
    attention layer's MLP half after its eager mixer. If building or tracing raises, the
    key is marked uncompiled (``steps[key] = False``, one warning) and this step runs
    uncompiled. Returns ``(h, m)``."""
    fn = steps.get(key)
    first = fn is None
    pending = isinstance(x, PendingNorm)
    whole_attn = len(key) > 2
    if first:
        if whole_attn:
            fn = mx.compile(_attn_step_fn(layer, pending))
        else:
            fn = _gdn_step(layer, pending) if layer.is_linear else _mlp_tail(layer)
    if whole_attn:
        args = (h, x.res if pending else x, c.keys, c.values,
                mx.array([c.offset], dtype=mx.int32))
    elif layer.is_linear:
        args = (h, x.res if pending else x, c[0], c[1], _counters_for(layer, c, h),
                _moe_after(c, h))
    else:
        h, r = _mixer(layer, x, fa_mask, c, h)
        args = (h, r)
    if not first:
        out = fn(*args)
    else:
        try:
            out = fn(*args)
            steps[key] = fn
        except Exception as e:  # noqa: BLE001  (any tracing failure: run uncompiled)
            import warnings

            warnings.warn(f"mlx-lily: compiling decode layer {key[0]} failed ({e!r}); it "
                          "runs uncompiled", stacklevel=3)
            steps[key] = False
            if layer.is_linear or whole_attn:
                h, r = _mixer(layer, x, None if layer.is_linear else fa_mask, c, h)
                return _layer_tail(layer, h, r)
            return _layer_tail(layer, *args)
    if whole_attn:
        h, m, c.keys, c.values = out
        c.offset += 1
        return h, m
    if layer.is_linear:
        h, m, c[0], c[1] = out
        setattr(c, MOE_AFTER_ATTR, m)
        return h, m
    return out


model_call = make_text_model_call(qwen3_next, "Qwen3NextModel", "Qwen3NextDecoderLayer", False)


OUT_PROJ_OP = _qgemv_ops.OUT_PROJ_OP
_VIEW_OWNERS: dict = {}  # id -> weakref of modules holding a cached one-row view


def one_row_linear(layer, x, attr="_lily_view", owner=None, op=OUT_PROJ_OP):
    """``layer(x)`` with a one-row input of a plain ``nn.QuantizedLinear`` (no bias)
    through the ``qgemv`` kernel (``QProj.__call__``: MLX's ``quantized_matmul`` exactly as
    ``nn.QuantizedLinear`` computes it wherever the kernel does not serve) while switch
    ``op`` is on and its kernels allowed (None: no switch of its own); any other layer or
    input: ``layer(x)``. The one-part ``QProj`` view is cached on ``owner`` (default
    ``layer``) under ``attr`` per weight array (a weight swap is noticed; ``unpatch``
    drops the views). A many-row input (prefill) takes ``qmm_dequant.linear`` where its
    switch ``prefill_dequant`` serves, else ``layer(x)``."""
    if x.size != x.shape[-1]:  # many rows (prefill): dequantize + matmul where it serves
        y = qmm_dequant.linear(layer, x)
        return layer(x) if y is None else y
    if type(layer) is not nn.QuantizedLinear or "bias" in layer:
        return layer(x)
    if op is not None:
        from mlx_lily import backend, registry

        if not registry.switch_on(op, backend.current_backend()):
            return layer(x)
    owner = layer if owner is None else owner
    cached = owner.__dict__.get(attr)
    if (cached is None or cached[0] is not layer.weight or cached[1] is not layer.scales
            or cached[2] is not layer.get("biases")):
        view = QProj.view([layer])
        if view is None:
            return layer(x)
        cached = (layer.weight, layer.scales, layer.get("biases"), view)
        object.__setattr__(owner, attr, cached)
        _VIEW_OWNERS[id(owner)] = (weakref.ref(owner), attr)
    return cached[3](x, split=False)[0]


def drop_views() -> None:
    """Forget every cached one-row view (``unpatch`` calls this: they hold weight arrays)."""
    for ref, attr in list(_VIEW_OWNERS.values()):
        m = ref()
        if m is not None:
            m.__dict__.pop(attr, None)
    _VIEW_OWNERS.clear()


def lm_head(owner, x):
    """``owner.lm_head(x)`` with a one-row input through the ``qgemv`` kernel (its output
    GEMV over the whole vocabulary; ``one_row_linear``), the view cached on ``owner``."""
    return one_row_linear(owner.lm_head, x, "_lily_head", owner, op=None)


def make_lm_call(cls_getter, with_embeddings):
    """The top model's ``__call__`` (decoder stack, then the LM head) with the LM head of
    a one-token step through ``lm_head``; tied embeddings, sharded heads, training and
    the ``qgemv`` switch take the original."""

    def lm_call(self, inputs, cache=None, input_embeddings=None):
        if (self.args.tie_word_embeddings or getattr(self, "sharding_group", None) is not None
                or self.training or not op_enabled("qgemv")
                or (input_embeddings is not None and not with_embeddings)):
            if with_embeddings or input_embeddings is not None:  # the original decides
                return _original(cls_getter())(self, inputs, cache,
                                              input_embeddings=input_embeddings)
            return _original(cls_getter())(self, inputs, cache)
        if with_embeddings:
            out = self.model(inputs, cache, input_embeddings=input_embeddings)
        else:
            out = self.model(inputs, cache)
        return lm_head(self, out)

    return lm_call


lm_model_call = make_lm_call(lambda: qwen3_next.Model, False)


def targets():
    """``(owner, attribute, replacement)`` triples for ``mlx_lily.patch``."""
    return [
        (qwen3_next.Qwen3NextAttention, "__call__", attention_call),
        (qwen3_next.Qwen3NextSparseMoeBlock, "__call__", moe_call),
        (qwen3_next.Qwen3NextGatedDeltaNet, "__call__", next_gdn_call),
        (qwen3_next.Qwen3NextDecoderLayer, "__call__", decoder_call),
        (qwen3_next.Qwen3NextModel, "__call__", model_call),
        (qwen3_next.Model, "__call__", lm_model_call),
    ]


def prepare_attention(attn) -> None:
    """Fuse q|k|v projections of one attention module (once)."""
    if getattr(attn, "_lily", None) is None:
        attn._lily = LilyState(attn, prepare_attention,
                               qkv=QProj.fuse([attn.q_proj, attn.k_proj, attn.v_proj]))


def prepare_moe(moe) -> None:
    """Fuse the router with the shared-expert gate (once)."""
    if isinstance(moe, qwen3_next.Qwen3NextSparseMoeBlock) and getattr(moe, "_lily", None) is None:
        moe._lily = LilyState(moe, prepare_moe,
                              router=QProj.fuse([moe.gate, moe.shared_expert_gate]))


def prepare(model) -> None:
    """One-time re-layouts for a loaded qwen3_next model."""
    for layer in model.layers:
        if not layer.is_linear:
            prepare_attention(layer.self_attn)
        prepare_moe(layer.mlp)
