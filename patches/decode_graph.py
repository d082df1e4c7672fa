"""Compiled decode steps: each decoder layer's one-token step as a pure function of arrays
(``_gdn_step_fn``, ``_attn_step_fn``) and the whole stack as one (``_whole_step_fn``), traced
by ``mx.compile`` once per configuration (``compile_key``) and cache capacity, kept per model
(``_CompiledSteps``) and dropped when any weight is replaced (``check_weights``)."""

from __future__ import annotations

import contextlib
import functools
import operator
import weakref

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache

from mlx_lily import backend, config, kernels, tuning
from mlx_lily.variants import KNOB_NAMES
from mlx_lily.backend import op_enabled
from mlx_lily.kernels import device_scalars
from mlx_lily.ops import attention as attn_ops, gated_delta as gdn_ops
from mlx_lily.ops.add_rms_norm import add_rms_norm
from mlx_lily.qproj import PendingNorm, QProj
from .projections import WeightSig, projection, run_projection, drop_views, one_row_linear, refresh
from .launch_order import MOE_AFTER_ATTR, counters_for, moe_after
from .blocks import layer_tail, layer_mixer, gdn_supported
from .kv_growth import kv_rows, kv_write_index
from .layouts import drop_plans


class _StepCache:
    """An ``ArraysCache`` stand-in for one traced decode step: it collects the new conv
    and recurrent states instead of mutating the real cache (compiled functions must not
    have Python side effects)."""

    lengths = None
    left_padding = None
    traced_step = True  # its counters are the real cache's (launch_order.gdn_counters)

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
        self.fns: dict = {}  # (module's first index, pending[, "attn"]) -> compiled fn or False
        self.whole = None  # whole-stack step: (KV shapes, compiled fn), False (failed), None
        self.recent: dict = {}  # KV shapes -> whole-stack fn, the last RECENT_WHOLE_STEPS
        self.static: dict = {}  # per-forward facts of the whole step, by dtype/switch
        self.ledger = None  # _WholeLedger of the last whole step, or None

    def clear(self) -> None:
        self.fns.clear()
        self.whole = None
        self.recent.clear()
        self.static.clear()
        self.ledger = None

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
            m.__dict__.pop("_lily_steps_recent", None)
    _MODELS_WITH_STEPS.clear()


#: Python traces of compiled decode steps in this process (a traced function's body runs
#: once per trace; replays do not run it): qualification's per-phase counts.
TRACES = [0]


_UNCOMPILED = [False]


def _traced(fn):
    """``fn`` counting its calls in ``TRACES`` (wrapped before ``mx.compile``; name and
    qualified name kept)."""
    @functools.wraps(fn)
    def traced(*args, **kwargs):
        TRACES[0] += 1
        return fn(*args, **kwargs)

    return traced


def _compile(fn):
    """``mx.compile(fn)``, counted in ``TRACES``; ``fn`` itself inside ``uncompiled()``."""
    return fn if _UNCOMPILED[0] else mx.compile(_traced(fn))


@contextlib.contextmanager
def uncompiled():
    """Within this block the compiled decode steps are built as plain functions, under
    their own compile key: the same Python builds each step's graph at every call, with
    nothing traced (qualification's launch census sees the kernels a compiled step
    launches without paying its trace)."""
    prev, _UNCOMPILED[0] = _UNCOMPILED[0], True
    try:
        yield
    finally:
        _UNCOMPILED[0] = prev


#: The knobs a traced step depends on, by environment variable: every variant knob (a
#: qualification alternates variants) and the launch knobs the decode ops read.
_KEY_KNOBS = tuple(sorted(set(KNOB_NAMES) | {
    "MLX_LILY_NORM_GEMV", "MLX_LILY_MOE_TILE_ROWS", "MLX_LILY_ATTN_DECODE",
    "MLX_LILY_ATTN_FIXED_BLOCK", "MLX_LILY_ATTN_DECODE_WARPS", "MLX_LILY_MOE_DOWN_SHAPE",
    "MLX_LILY_MOEG_LOAD", "MLX_LILY_QGEMV_SHAPE", "MLX_LILY_QGEMV_BPL",
    "MLX_LILY_GDN_BATCH_FOLD", "MLX_LILY_GDN_PACKED_OUTP"}))


def compile_key():
    """What the traced functions depend on beyond shapes: backend, op selection, switches,
    knobs (``_KEY_KNOBS``). Compiled steps outlive ``unpatch``: a later patch reuses them
    only under an equal key and unchanged weights (``check_weights``)."""
    be = backend.current_backend()
    if backend.compile_mode(be) == "off":
        return None
    return (be, backend.disabled_ops(), backend.selected_ops(), kernels.allowed_key(),
            config.kernels, tuning.decode_pf, gdn_ops.proj_split(be), tuning.moe_fused_rpw,
            _UNCOMPILED[0], tuning.values_of(_KEY_KNOBS))


def _gdn_step_fn(layer, pending):
    """One decode step of a GDN decoder layer as a pure function: ``(h, d, conv, state,
    counters, after) -> (h', m, conv', state')``, where ``d`` is the layer's input ``x``
    or, when ``pending``, the previous MLP output (``x = rms_norm(h + d)`` is then folded
    into the input projection), ``counters`` the cache's ``counters_for`` and ``after``
    its ``moe_after`` (store ``m`` there after the step); mixer, post-attention add+norm
    and MLP/MoE."""
    norm = layer.input_layernorm

    def step(h, d, conv, state, counters, after):
        c = _StepCache(conv, state, counters)
        x = PendingNorm(h, d, norm.weight, norm.eps) if pending else d
        h, r = layer_mixer(layer, x, None, c, h)
        h, m = layer_tail(layer, h, r, counters, after)
        return h, m, c[0], c[1]

    return step


def _gdn_step(layer, pending):
    """``_gdn_step_fn`` compiled."""
    return _compile(_gdn_step_fn(layer, pending))


COMPILE_ATTN_ENV = "MLX_LILY_COMPILE_ATTN"  # tuning.compile_attn


def attn_step_ok(layer, c, x) -> bool:
    """Whether this attention layer's decode step can run as one compiled function
    (on with compiled decode steps; ``MLX_LILY_COMPILE_ATTN=0`` turns it off): a plain
    ``KVCache`` with room for the token (``_attn_cache_ok``), the fused q|k|v projection,
    and the packed decode kernels serving (heads, dims, dtype: ``_attn_static_head_dim``)."""
    d = _attn_static_head_dim(layer, x.dtype)
    return d is not None and _attn_cache_ok(c, x, d)


def _attn_cache_ok(c, x, head_dim) -> bool:
    """The per-step part of ``attn_step_ok``: a plain ``KVCache`` of ``x``'s batch, or an
    unpadded ``BatchKVCache`` (``batch_unpadded``), with room for one more token, of head
    size ``head_dim``."""
    t = type(c)
    return ((t is KVCache or (t is BatchKVCache and batch_unpadded(c)))
            and c.keys is not None and kv_rows(c) + 1 <= c.keys.shape[2]
            and x.shape[1] == 1 and c.keys.shape[0] == x.shape[0]
            and c.keys.shape[-1] == head_dim)


_PAD_MEMO = "_lily_unpadded"


def batch_unpadded(c) -> bool:
    """Whether no sequence of the ``BatchKVCache`` ``c`` is left-padded, so that each row's
    keys are the buffer's first ``_idx`` rows and its position is ``_idx``: the cache of
    one ``BatchGenerator`` request, or of prompts of one length (``mlx_lm.benchmark -b
    N``). A decode step there is the one-sequence step on B rows. The host reads
    ``left_padding`` once per array: ``filter`` and ``extend`` replace it; ``prepare`` and
    ``finalize`` change it in place (``+=``), and the multi-token call between them drops
    the answer (``forget_padding``)."""
    lp = c.left_padding
    memo = c.__dict__.get(_PAD_MEMO)
    if memo is None or memo[0] is not lp:
        memo = (lp, lp is None or not bool(mx.any(lp != 0).item()))
        c.__dict__[_PAD_MEMO] = memo
    return memo[1]


def forget_padding(cache) -> None:
    """Drop ``batch_unpadded``'s answer for every ``BatchKVCache`` in ``cache`` (called
    by each multi-token call: mlx-lm's ``prepare`` / ``finalize`` around it add padding
    to the same array)."""
    for c in cache or ():
        if type(c) is BatchKVCache:
            c.__dict__.pop(_PAD_MEMO, None)
            c.__dict__.pop("_lily_left_padding", None)  # blocks._left_padding's host copy


def advance_kv(c) -> None:
    """Count the row a compiled step wrote into ``c``: ``offset`` of a ``KVCache``;
    ``_idx`` and every sequence's ``offset`` of a ``BatchKVCache``."""
    if type(c) is BatchKVCache:
        c._idx += 1
        c.offset = c.offset + 1
    else:
        c.offset += 1


def _attn_static_head_dim(layer, dtype):
    """The part of ``attn_step_ok`` that holds for every step of a forward (switches,
    modules, dtype): the head size when the compiled attention step serves, else None."""
    if not tuning.compile_attn:
        return None
    attn = layer.self_attn
    if not (op_enabled(attn_ops.NAME) and op_enabled(attn_ops.PACKED_OP)
            and not attn.training and type(attn.rope) is nn.RoPE):
        return None
    # the step's packed q/k/v and gated decode forms need their kernels (an op off by
    # MLX_LILY_KERNELS, its qualification record or a failed first contact has none)
    if not attn_ops.has_packed_kernel(backend.current_backend()):
        return None
    st = getattr(attn, "_lily", None)
    proj = getattr(st, "qkv", None) if st is not None else None
    Hq, Hkv = attn.num_attention_heads, attn.num_key_value_heads
    if not isinstance(proj, QProj) or Hq % Hkv or Hq // Hkv > 8:
        return None
    D = proj.out_features // (2 * Hq + 2 * Hkv)
    rope = attn.rope
    ok = (D in attn_ops.HEAD_DIMS
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
    ``counters``, ``counters_for``). Static shapes for a given cache
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
        proj = projection(attn, "qkv", (attn.q_proj, attn.k_proj, attn.v_proj))
        (y,) = run_projection(proj, x, split=False)
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
        # the split-K block of one sequence at this capacity: a row's arithmetic does not
        # depend on how many rows the step has (batch invariance)
        block = attn_ops.decode_block(keys.shape[2], 1, Hkv, backend.current_backend())
        out = attn_ops.decode_attention(q, keys, values, attn.scale, y, gate_packed=True,
                                        tlen=tlen, block=block)
        h, m = layer_tail(layer, h, one_row_linear(attn.o_proj, out), counters, after)
        return h, m, keys, values

    return step


def _whole_step_fn(text_model, layers):
    """A whole decode step of the decoder stack as one pure function: ``(h, *states,
    offset) -> (y, *states')`` with ``h`` the token's embedding ``[B, 1, D]``, ``states``
    each layer's cache arrays in order (GDN: conv and recurrent state; attention: the KV
    cache's key and value buffers; then the cache's ``counters_for`` and ``moe_after``,
    inputs only; ``states'`` per layer: the two new cache arrays and the layer's MoE
    output, the next step's ``moe_after``), ``offset`` the attention layers' common
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


class _WholeLedger:
    """What a whole-stack step left in the caches it updated, so that the next step can
    take its inputs from there instead of checking and reading every cache again.

    ``refs``: weak references to the step's cache objects in layer order (a cache the
    user drops drops the ledger with it: ``_drop_ledger``); ``args``: the next step's
    inputs after ``h``, four per layer: the two arrays the step stored in the layer's cache
    (GDN: conv state ``[B, KS-1, C]`` and recurrent state ``[B, Hv, Dv, Dk]`` fp32;
    attention: key and value buffers ``[B, Hkv, capacity, D]``), the cache's int32
    counters and the step's MoE output ``[B, 1, D]``; ``offset``: the row count the step
    left in every attention cache (the step's common offset + 1). Valid (``matches``)
    while every cache still holds those very arrays and that row count. The ledger passes
    the caches' own array objects, so an in-place write to one reaches the step as it would
    on the full path; a path that stores other arrays or moves a row count makes
    ``matches`` refuse."""

    __slots__ = ("refs", "linear", "args", "offset", "fn", "batch", "dtype", "compile_attn",
                 "__weakref__")
    # offset stays 0 without attention layers, as the full path passes it

    def matches(self, cache, h) -> bool:
        """Whether ``cache`` (this step's cache list) and ``h [B, 1, D]`` are what the
        ledger's step left: the same cache objects, each holding the arrays and row count
        that step stored, ``h`` of the same batch and dtype, the attention step setting
        (``MLX_LILY_COMPILE_ATTN``, which ``compile_key`` does not hold) as then, and room
        for one more row in every KV buffer (checked when recorded)."""
        refs, args, off = self.refs, self.args, self.offset
        if (len(cache) != len(refs) or h.shape[0] != self.batch or h.dtype != self.dtype
                or tuning.compile_attn != self.compile_attn):
            return False
        for j, (c, r, lin) in enumerate(zip(cache, refs, self.linear)):
            if r() is not c:
                return False
            a, b = args[4 * j], args[4 * j + 1]
            if lin:
                st = c.cache
                if st[0] is not a or st[1] is not b or c.lengths is not None:
                    return False
            elif c.keys is not a or c.values is not b or c.offset != off:
                return False
        return True


def _drop_ledger(cs_ref, led_ref, _dead=None) -> None:
    """Forget the ledger ``led_ref()`` if it is still its model's (``cs_ref()``): one of
    its caches was collected, and the ledger must not keep that cache's arrays alive."""
    cs, led = cs_ref(), led_ref()
    if cs is not None and led is not None and cs.ledger is led:
        cs.ledger = None


def run_whole_step(text_model, cs, layers, cache, h):
    """The decode step through ``_whole_step_fn`` (compiled on first use, kept in
    ``cs.whole``, ``cs`` the model's ``_CompiledSteps``) when every layer can run compiled now (``gdn_step_ok``,
    ``attn_step_ok``) with one common KV offset; the caches are updated. None when it
    does not serve this step (the per-layer path then runs; nothing was changed); a
    tracing failure marks it off for this model (one warning)."""
    if backend.compile_mode() != "whole":
        return None
    led = cs.ledger
    cs.ledger = None
    if led is not None and tuning.whole_replay and led.matches(cache, h):
        y = _replay_whole_step(cs, led, cache, h)
        if y is not None:
            return y
    # what holds for every step (switches, modules, dtype): once per compile key
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
        elif not _attn_cache_ok(c, h, d) or offset not in (None, kv_rows(c)):
            return None
        else:
            offset = kv_rows(c)
    # one compiled function per cache capacity (MLX would scan every trace a function holds
    # at each call), the last RECENT_WHOLE_STEPS kept: caches of other capacities (requests
    # of other lengths) reuse theirs instead of tracing the stack again
    shapes = tuple(c.keys.shape for l, c in zip(layers, cache) if not l.is_linear)
    fn = cs.recent.get(shapes)  # holds cs.whole's function too
    if fn is None:
        fn = _compile(_whole_step_fn(text_model, layers))
    args = [h]
    for layer, c in zip(layers, cache):
        args += ([c[0], c[1]] if layer.is_linear else [c.keys, c.values])
        args += [counters_for(layer, c, h), moe_after(c, h)]
    args.append(mx.array([offset or 0], dtype=mx.int32))
    try:
        out = fn(*args)
    except Exception as e:  # noqa: BLE001  (any tracing failure: per-layer path)
        config.warn_user(f"mlx-lily: compiling the whole decode step failed ({e!r}); layers "
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
            advance_kv(c)
        setattr(c, MOE_AFTER_ATTR, next(it))
    cs.ledger = _new_ledger(cs, fn, layers, cache, h, args, offset)
    return out[0]


def _new_ledger(cs, fn, layers, cache, h, args, offset):
    """The ``_WholeLedger`` of the step that just ran ``fn`` with ``args`` and stored its
    results in ``cache`` (for the model whose ``_CompiledSteps`` is ``cs``), or None where
    the next step could not replay it: a ``BatchKVCache`` (its row counts are arrays),
    another cache type, or a KV buffer without room for one more row."""
    linear = tuple(bool(l.is_linear) for l in layers)
    nxt = []
    for lin, c, i in zip(linear, cache, range(1, len(args), 4)):
        if lin:
            if type(c) is not ArraysCache:
                return None
            a, b = c.cache[0], c.cache[1]
        else:
            if type(c) is not KVCache or c.offset + 1 > c.keys.shape[2]:
                return None
            a, b = c.keys, c.values
        nxt += [a, b, args[i + 2], c.__dict__[MOE_AFTER_ATTR]]
    led = _WholeLedger()
    drop = functools.partial(_drop_ledger, weakref.ref(cs), weakref.ref(led))
    led.refs = tuple(weakref.ref(c, drop) for c in cache)
    led.linear, led.args, led.fn, led.batch, led.dtype = linear, nxt, fn, h.shape[0], h.dtype
    led.offset = 0 if offset is None else offset + 1
    led.compile_attn = tuning.compile_attn
    return led


def _replay_whole_step(cs, led, cache, h):
    """``run_whole_step`` for a step whose caches are as the previous whole step left
    them (``_WholeLedger.matches``): the same compiled function on the arrays that step
    stored, its counters and MoE outputs, and the next row. Returns the final norm's
    output ``y [B, 1, D]`` with the caches updated and the ledger renewed as
    ``run_whole_step`` does, or None, with nothing changed, when the compiled function
    raises (the full path then runs it again and handles the failure)."""
    try:
        out = led.fn(h, *led.args, mx.array([led.offset], dtype=mx.int32))
    except Exception:  # noqa: BLE001  (run_whole_step's full path reports it)
        return None
    it = iter(out[1:])
    nxt, room = led.args, True
    for j, (lin, c) in enumerate(zip(led.linear, cache)):
        a, b, m = next(it), next(it), next(it)
        if lin:
            st = c.cache
            st[0] = a
            st[1] = b
        else:
            c.keys = a
            c.values = b
            c.offset += 1
            room = room and c.offset + 1 <= a.shape[2]
        c.__dict__[MOE_AFTER_ATTR] = m
        nxt[4 * j], nxt[4 * j + 1], nxt[4 * j + 3] = a, b, m
    if room:  # else the next step grows a KV cache on the full path
        led.offset += 1 if led.offset else 0
        cs.ledger = led
    return out[0]


def _mlp_tail(layer):
    """``(h, r) -> (h', m)`` compiled: ``layer_tail`` of an attention layer."""
    return _compile(lambda h, r: layer_tail(layer, h, r))


#: Configurations (``compile_key``) whose compiled steps a model keeps: switching back to
#: a recent one (qualification alternates two op sets round by round) replays its traces.
RECENT_KEYS = 4


def compiled_steps(model, key):
    """The model's compiled decode functions for configuration ``key``: the current ones,
    one of the ``RECENT_KEYS`` configurations used last, or a new empty set."""
    st = model.__dict__.get("_lily_steps")
    if st is None or st.key != key:
        recent = model.__dict__.get("_lily_steps_recent")
        if recent is None:
            recent = {}
            object.__setattr__(model, "_lily_steps_recent", recent)
        st = recent.pop(key, None) or _CompiledSteps(key)
        recent[key] = st  # most recent last
        while len(recent) > RECENT_KEYS:
            del recent[next(iter(recent))]
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


def check_weights(text_model, layers) -> None:
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
    if changed:  # every configuration's traces hold the old arrays
        for st in {id(x): x for x in (text_model.__dict__.get("_lily_steps"),
                   *(text_model.__dict__.get("_lily_steps_recent") or {}).values())
                   if x is not None}.values():
            st.clear()
    object.__setattr__(text_model, "_lily_sig_all",
                       (tuple(layers), WeightSig(text_model.norm, *layers)))


def gdn_step_ok(layer, c) -> bool:
    """Whether this GDN layer's decode step can run compiled: a plain ``ArraysCache``
    holding both states, no batch lengths (``_gdn_cache_ok``), and the Lily GDN forward
    serving."""
    return _gdn_cache_ok(c) and gdn_supported(layer.linear_attn)


def _gdn_cache_ok(c) -> bool:
    """An ``ArraysCache`` holding both states, without ``lengths`` (its ``left_padding``
    matters to a one-token step only through the SSM mask, which the caller knows to be
    None or all true: ``stack._unpadded_batch_step``)."""
    return (type(c) is ArraysCache and c.lengths is None
            and c.cache[0] is not None and c.cache[1] is not None)


def run_compiled(steps, key, layer, h, x, c, fa_mask):
    """A layer's decode step through its compiled function, built on first use. ``key`` =
    (the first index of ``layer``'s module in the stack: a module held at several indices,
    as in ``qualify.deep_view``, shares one trace; whether ``x`` is a ``PendingNorm``),
    plus ``"attn"`` for a whole attention step (``_attn_step_fn``; the cache's buffers and
    offset are updated, and ``mx.compile`` retraces when the cache grows); otherwise a GDN
    layer's step or an attention layer's MLP half after its eager mixer. If building or
    tracing raises, the key is marked uncompiled (``steps[key] = False``, one warning) and
    this step runs uncompiled. Returns ``(h, m)``."""
    fn = steps.get(key)
    first = fn is None
    pending = isinstance(x, PendingNorm)
    whole_attn = len(key) > 2
    if first:
        if whole_attn:
            fn = _compile(_attn_step_fn(layer, pending))
        else:
            fn = _gdn_step(layer, pending) if layer.is_linear else _mlp_tail(layer)
    if whole_attn:
        args = (h, x.res if pending else x, c.keys, c.values,
                mx.array([kv_rows(c)], dtype=mx.int32))
    elif layer.is_linear:
        args = (h, x.res if pending else x, c[0], c[1], counters_for(layer, c, h),
                moe_after(c, h))
    else:
        h, r = layer_mixer(layer, x, fa_mask, c, h)
        args = (h, r)
    if not first:
        out = fn(*args)
    else:
        try:
            out = fn(*args)
            steps[key] = fn
        except Exception as e:  # noqa: BLE001  (any tracing failure: run uncompiled)
            config.warn_user(f"mlx-lily: compiling decode layer {key[0]} failed ({e!r}); it "
                             "runs uncompiled", stacklevel=3)
            steps[key] = False
            if layer.is_linear or whole_attn:
                h, r = layer_mixer(layer, x, None if layer.is_linear else fa_mask, c, h)
                return layer_tail(layer, h, r)
            return layer_tail(layer, *args)
    if whole_attn:
        h, m, c.keys, c.values = out
        advance_kv(c)
        return h, m
    if layer.is_linear:
        h, m, c[0], c[1] = out
        setattr(c, MOE_AFTER_ATTR, m)
        return h, m
    return out
