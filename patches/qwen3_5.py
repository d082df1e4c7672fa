"""Lily forwards for mlx-lm's ``qwen3_5`` module (also serving ``qwen3_5_moe``, whose
``Model`` subclasses ``qwen3_5.Model``): its own GatedDeltaNet (separate
``in_proj_qkv``/``in_proj_z``/``in_proj_b``/``in_proj_a``, fused here into one projection)
and its decoder layer. Attention and MoE blocks are ``qwen3_next``'s classes and are
patched by ``mlx_lily.patches.qwen3_next``.
"""

from __future__ import annotations

from mlx_lm.models import qwen3_5

from . import qwen3_next as nxt

MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")


def gdn_call(self, inputs, mask=None, cache=None):
    """``qwen3_5.GatedDeltaNet.__call__`` with one fused input projection; a one-token step
    with a pending input norm runs it inside the decode kernel where ``gdn_proj`` serves."""
    if not nxt.gdn_supported(self):
        return nxt.original(qwen3_5.GatedDeltaNet)(self, nxt.resolve(inputs), mask, cache)
    B, S, _ = inputs.shape
    proj = nxt.projection(self, "in_proj",
                     (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a))
    if S == 1 and isinstance(proj, nxt.QProj) and nxt.op_enabled("gdn_packed"):
        if isinstance(inputs, nxt.PendingNorm):
            r = nxt.gdn_core_proj(self, proj, inputs, mask, cache)
            if r is not None:
                return r
        (y,) = nxt.run_projection(proj, inputs, split=False)
        return nxt.gdn_core(self, y, None, None, None, mask, cache, packed=True)
    qkv, z, b, a = nxt.run_projection(proj, inputs)
    z = z.reshape(B, S, self.num_v_heads, self.head_v_dim)
    return nxt.gdn_core(self, qkv, z, b, a, mask, cache)


decoder_call = nxt.make_decoder_call(lambda: qwen3_5.DecoderLayer)
model_call = nxt.make_text_model_call(qwen3_5, "Qwen3_5TextModel", "DecoderLayer", True)
lm_model_call = nxt.make_lm_call(lambda: qwen3_5.TextModel, True)


def targets():
    """``(owner, attribute, replacement)`` triples for ``mlx_lily.patch``."""
    return [
        (qwen3_5.GatedDeltaNet, "__call__", gdn_call),
        (qwen3_5.DecoderLayer, "__call__", decoder_call),
        (qwen3_5.Qwen3_5TextModel, "__call__", model_call),
        (qwen3_5.TextModel, "__call__", lm_model_call),
    ]


def prepare_gdn(g) -> None:
    """Fuse the four input projections of one GatedDeltaNet (once), and keep its
    ``out_proj`` as a row-contiguous ``QProj`` for ``gdn_out_proj`` (the decode kernel
    reads it without strides) when it is a bias-free affine ``nn.QuantizedLinear``."""
    if isinstance(g, qwen3_5.GatedDeltaNet) and getattr(g, "_lily", None) is None:
        g._lily = nxt.LilyState(g, prepare_gdn, in_proj=nxt.QProj.fuse(
            [g.in_proj_qkv, g.in_proj_z, g.in_proj_b, g.in_proj_a]),
            out_proj=nxt.contiguous_qproj(g.out_proj))


def prepare(model) -> None:
    """One-time re-layouts for a loaded qwen3_5 / qwen3_5_moe model."""
    for layer in model.layers:
        if layer.is_linear:
            prepare_gdn(layer.linear_attn)
        else:
            nxt.prepare_attention(layer.self_attn)
        nxt.prepare_moe(layer.mlp)
