"""Tiny random Qwen3.5 / Qwen3.5-MoE / Qwen3-Next models built in memory for tests.

They keep the real structure (3:1 GDN:attention, GQA 8:1, head_dim 256 with partial
rotary 0.25, GDN heads of 128, MoE with a shared expert, 8-bit router) at small width,
quantized like ``mlx_lm.convert -q`` (4-bit affine, group 64).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

TEXT = dict(
    hidden_size=128, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=1,
    head_dim=256, rms_norm_eps=1e-6, vocab_size=512, max_position_embeddings=4096,
    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000,
                     "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10]},
)
MOE = dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64,
           shared_expert_intermediate_size=64, norm_topk_prob=True)


def _router_predicate(path, module):
    if not hasattr(module, "to_quantized"):
        return False
    if path.endswith("mlp.gate") or path.endswith("shared_expert_gate"):
        return {"group_size": 64, "bits": 8}
    return True


def _randomize(model, seed):
    mx.random.seed(seed)
    params = []
    from mlx.utils import tree_flatten, tree_unflatten

    for name, p in tree_flatten(model.parameters()):
        if name.endswith("A_log"):
            v = mx.log(mx.random.uniform(1, 16, p.shape))
        elif name.endswith("dt_bias"):
            v = mx.ones(p.shape) + 0.1 * mx.random.normal(p.shape)
        elif "norm" in name and p.ndim == 1:
            v = 1.0 + 0.1 * mx.random.normal(p.shape)
        elif "conv1d" in name:
            v = 0.3 * mx.random.normal(p.shape)
        elif "embed_tokens" in name or "lm_head" in name:
            v = 0.5 * mx.random.normal(p.shape)
        else:
            v = mx.random.normal(p.shape) * (p.shape[-1] ** -0.5)
        params.append((name, v.astype(mx.float32 if name.endswith("A_log") else mx.bfloat16)))
    model.update(tree_unflatten(params))


def build(kind: str = "qwen3_5_moe", seed: int = 0, quantize: bool = True, **overrides):
    """Return a tiny random mlx-lm model of ``kind`` (qwen3_5_moe, qwen3_5, qwen3_next)."""
    if kind == "qwen3_next":
        from mlx_lm.models import qwen3_next as mod

        cfg = dict(TEXT, **MOE, model_type="qwen3_next", intermediate_size=256,
                   decoder_sparse_step=1, mlp_only_layers=[], rope_theta=10000000,
                   partial_rotary_factor=0.25)
        cfg.pop("rope_parameters")
        cfg.update(overrides)
        model = mod.Model(mod.ModelArgs.from_dict(cfg))
    else:
        from mlx_lm.models import qwen3_5, qwen3_5_moe

        text = dict(TEXT, model_type=kind + "_text")
        if kind == "qwen3_5_moe":
            text.update(MOE)
            mod = qwen3_5_moe
        else:
            text.update(intermediate_size=256)
            mod = qwen3_5
        text.update(overrides)
        model = mod.Model(mod.ModelArgs.from_dict({"model_type": kind, "text_config": text}))
    _randomize(model, seed)
    if quantize:
        nn.quantize(model, group_size=64, bits=4, class_predicate=_router_predicate)
    model.eval()
    mx.eval(model.parameters())
    return model
