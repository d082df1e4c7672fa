"""The decoder-stack forward of a patched model (``make_text_model_call``: residual adds
fused into the next norm, pending norms folded into input projections, compiled decode steps,
prefill evaluated in groups of layers) and the top model's forward with its one-row LM head
(``make_lm_call``)."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from mlx_lily.backend import op_enabled
from mlx_lily.ops.add_rms_norm import add_rms_norm
from mlx_lily.patching import prefill_eval_layers
from mlx_lily.qproj import PendingNorm
from .projections import CHECKED, original, lm_head
from .blocks import MAX_BATCH_ROWS, layer_input, layer_tail, layer_mixer, batch_rows_on
from .launch_order import MOE_AFTER_ATTR, counters_for, moe_after
from .kv_growth import kv_headroom, widen_kv_steps
from .decode_graph import (
    attn_step_ok,
    batch_unpadded,
    forget_padding,
    check_weights,
    compile_key,
    compiled_steps,
    gdn_step_ok,
    run_compiled,
    run_whole_step,
)


def make_text_model_call(module, cls_name, layer_cls_name, with_embeddings):
    """The decoder stack with each layer's closing residual add fused into the NEXT
    layer's input RMSNorm (and the last one into the final norm): no separate add or
    norm. With the ``norm_qgemv`` op on, that add and norm are handed to the next layer as
    a ``PendingNorm`` and run inside its input projection's GEMV when the kernel serves
    (one-row decode), else as ``add_rms_norm``. Pipeline-parallel models take the stock
    code.

    Decode steps (one token, no masks, plain caches) on a GPU backend run the whole stack
    as one ``mx.compile``d function where it traces (``run_whole_step``), else each layer
    as one (an attention layer whole while its KV cache has room, else its mixer eagerly
    and its MoE half compiled): Python builds the graph once, later steps replay it (``MLX_LILY_COMPILE=0`` turns this off,
    ``MLX_LILY_COMPILE_ATTN=0`` keeps attention mixers eager).

    Decode steps of 1..8 sequences in mlx-lm's batch caches (``BatchGenerator``), with
    ``batch_decode`` on, take the same compiled steps on B rows when no sequence is
    left-padded and every cache has room (``_unpadded_batch_step``), else run eagerly
    through the same kernels; either way each row gets the arithmetic of a one-sequence
    step (``_batch_decode_step``).

    Multi-token calls start evaluating every ``prefill_eval_layers`` layers
    (``mlx_lily.patching.PREFILL_EVAL_LAYERS``) so the GPU overlaps the rest of the build;
    the graph and its results are the same.
    """

    def text_model_call(self, inputs, cache=None, input_embeddings=None):
        from mlx_lily.backend import env_frozen

        with env_frozen():
            return _text_model_forward(self, inputs, cache, input_embeddings)

    def _text_model_forward(self, inputs, cache, input_embeddings):
        stock = original(getattr(module, cls_name))
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
        steps = cs = None
        # batch caches grow as plain ones where their rows take the one-sequence kernels
        grow_batch = batch_rows_on(h.shape[0]) and h.shape[0] <= MAX_BATCH_ROWS
        if h.shape[1] == 1 and ((fa_mask is None and ssm_mask is None)
                                or _unpadded_batch_step(h, cache)):
            key = compile_key()
            if key is not None:
                cs = compiled_steps(self, key)
                steps = cs.fns
        check_weights(self, layers)
        defer = op_enabled("norm_qgemv")
        batch_step = steps is None and _batch_decode_step(h, cache)
        every = prefill_eval_layers(h.shape[0] * h.shape[1]) if h.shape[1] > 1 else 0
        m = None
        outer, CHECKED.active = CHECKED.active, True
        try:
            if cs is not None and defer and cs.whole is not False:
                y = run_whole_step(self, cs, layers, cache, h)
                if y is not None:
                    return y
            first = layers[0].input_layernorm
            x = mx.fast.rms_norm(h, first.weight, first.eps)
            widen_kv_steps(cache, grow_batch)  # where caches grow: prefill, a step without room
            slots: dict = {}  # a layer module held at several places (deep_view): one trace
            for i, (layer, c) in enumerate(zip(layers, cache)):
                if m is not None:
                    h, x = layer_input(h, m, layer.input_layernorm, defer)
                if steps is not None and (not layer.is_linear or gdn_step_ok(layer, c)):
                    key_i = (slots.setdefault(id(layer), i), isinstance(x, PendingNorm))
                    if not layer.is_linear and attn_step_ok(layer, c, x):
                        key_a = key_i + ("attn",)
                        if steps.get(key_a) is not False:
                            h, m = run_compiled(steps, key_a, layer, h, x, c, fa_mask)
                            continue
                    if steps.get(key_i) is not False:
                        h, m = run_compiled(steps, key_i, layer, h, x, c, fa_mask)
                        continue
                if batch_step:  # the launches a compiled one-sequence step makes
                    ctr, after = counters_for(layer, c, h), moe_after(c, h)
                    h, r = layer_mixer(layer, x, ssm_mask if layer.is_linear else fa_mask, c, h)
                    h, m = layer_tail(layer, h, r, ctr, after)
                    setattr(c, MOE_AFTER_ATTR, m)
                    continue
                h, r = layer_mixer(layer, x, ssm_mask if layer.is_linear else fa_mask, c, h)
                h, m = layer_tail(layer, h, r)
                if every and (i + 1) % every == 0 and i + 1 < len(layers):
                    every = every if _eval_ahead(h, m) else 0
        finally:
            CHECKED.active = outer
        if h.shape[1] > 1:
            kv_headroom(cache, batch=grow_batch)
            forget_padding(cache)  # prepare / finalize change left_padding in place
        return add_rms_norm(h, m, self.norm.weight, self.norm.eps)[1]

    return text_model_call


def _batch_decode_step(h, cache) -> bool:
    """Whether this call is a decode step of up to ``MAX_BATCH_ROWS`` sequences in
    mlx-lm's batch caches (``BatchGenerator``, which ``mlx_lm.server`` uses for one
    request too: one token per row, ``BatchKVCache`` for the attention layers) whose
    rows take the one-sequence kernels (``batch_rows_on``: ``batch_decode`` on, or one
    sequence). Such a step runs eagerly, each layer with the launch-ordering inputs
    (``counters_for``, ``moe_after``) a compiled one-sequence step passes, so that a row
    takes the one-launch kernels that sequence takes decoding alone."""
    return batch_rows_on(h.shape[0]) and _batch_caches_step(h, cache)


def _batch_caches_step(h, cache) -> bool:
    """Whether this call is a one-token step of up to ``MAX_BATCH_ROWS`` sequences in
    mlx-lm's batch caches (a ``BatchKVCache`` among them, no layer without a cache)."""
    return (h.shape[1] == 1 and 1 <= h.shape[0] <= MAX_BATCH_ROWS
            and any(type(c) is BatchKVCache for c in cache)
            and all(c is not None for c in cache))


def _unpadded_batch_step(h, cache) -> bool:
    """Whether a batch-cache decode step (``_batch_decode_step``) can run as the
    compiled one-sequence step on B rows, its masks dropped: no sequence left-padded
    (``batch_unpadded``; the attention mask then hides nothing), room for the token in
    every ``BatchKVCache`` (a step that must grow a cache runs eagerly, as before), and
    no ``ArraysCache`` with ``lengths``. Its SSM mask for one token, ``0 >= left_padding``,
    is then all true: at a decode step every row has consumed more tokens than its
    padding. (The compiled step leaves an ``ArraysCache``'s ``left_padding`` where the
    prefill left it: None, zero or below zero; mlx-lm reads it only through that mask,
    ``filter`` and ``extend``.) Rows stay bit-identical to the sequence alone while the
    batch cache has the capacity the sequence's own cache would have; after ``filter``
    or ``extend`` it may not, and the split-K block can then differ."""
    if not _batch_decode_step(h, cache):
        return False
    # lengths first: a one-token prompt chunk between prepare and finalize has them, and
    # must not leave a batch_unpadded answer that finalize's padding would make stale
    if any(getattr(c, "lengths", None) is not None for c in cache):
        return False
    return all(type(c) is not BatchKVCache
               or (c.keys is not None and c._idx + 1 <= c.keys.shape[2]
                   and getattr(c, "_right_padding", None) is None and batch_unpadded(c))
               for c in cache)


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


def make_lm_call(cls_getter, with_embeddings):
    """The top model's ``__call__`` (decoder stack, then the LM head) with the LM head of
    a one-token step through ``lm_head``; tied embeddings, sharded heads, training and
    the ``qgemv`` switch take the original."""

    def lm_call(self, inputs, cache=None, input_embeddings=None):
        if (self.args.tie_word_embeddings or getattr(self, "sharding_group", None) is not None
                or self.training or not op_enabled("qgemv")
                or (input_embeddings is not None and not with_embeddings)):
            if with_embeddings or input_embeddings is not None:  # the original decides
                return original(cls_getter())(self, inputs, cache,
                                              input_embeddings=input_embeddings)
            return original(cls_getter())(self, inputs, cache)
        if with_embeddings:
            out = self.model(inputs, cache, input_embeddings=input_embeddings)
        else:
            out = self.model(inputs, cache)
        return lm_head(self, out)

    return lm_call
