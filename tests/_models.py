"""Tiny random Qwen3.5 / Qwen3.5-MoE / Qwen3-Next models built in memory for tests.

They keep the real structure (3:1 GDN:attention, GQA 8:1, head_dim 256 with partial
rotary 0.25, GDN heads of 128, MoE with a shared expert, 8-bit router) at small width,
quantized like ``mlx_lm.convert -q`` (4-bit affine, group 64).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlx_lily.testing.models import moe_block  # noqa: F401  (shared with benchmarks)

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
#: Expert widths on MLX's CUDA backend: there MLX 0.32.4's ``quantized_matmul`` with
#: K = 64 (one quantization group per row) gave wrong or non-finite rows for 5 and more
#: rows (benchmarks/results/2026-12-03-cuda-h200-router-fault), stock and Lily alike.
CUDA_MOE_WIDTHS = dict(moe_intermediate_size=128, shared_expert_intermediate_size=128)


def _on_cuda() -> bool:
    from mlx_lily.backend import current_backend

    return current_backend() == "cuda"


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

        cfg = dict(TEXT, **MOE, **(CUDA_MOE_WIDTHS if _on_cuda() else {}),
                   model_type="qwen3_next", intermediate_size=256,
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
            if _on_cuda():
                text.update(CUDA_MOE_WIDTHS)
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


def shared_expert(d, i, seed=5):
    """A 4-bit (group 64) mlx-lm ``Qwen3NextMLP`` of hidden ``d`` and width ``i``, bf16
    weights ~ N(0, 1/d) seeded by ``seed``."""
    from mlx_lm.models import qwen3_next

    mlp = qwen3_next.Qwen3NextMLP(d, i)
    mx.random.seed(seed)
    mlp.update({n: {"weight": (mx.random.normal(getattr(mlp, n).weight.shape) * d ** -0.5)
                    .astype(mx.bfloat16)} for n in ("gate_proj", "up_proj", "down_proj")})
    nn.quantize(mlp, 64, 4)
    return mlp


def gated_delta_net(Hk=2, Hv=4, D=128, hidden=64, seed=0):
    """An unquantized mlx-lm Qwen3.5 ``GatedDeltaNet`` mixer with ``Hk`` key and ``Hv``
    value heads of dim ``D``: bf16 weights (norms near 1, conv ~0.3), fp32 ``A_log`` =
    log U(1, 16), from numpy's generator seeded by ``seed``."""
    import numpy as np
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.models import qwen3_5

    args = qwen3_5.TextModelArgs(
        model_type="qwen3_5_text", hidden_size=hidden, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-6, vocab_size=32,
        linear_num_value_heads=Hv, linear_num_key_heads=Hk, linear_key_head_dim=D,
        linear_value_head_dim=D, linear_conv_kernel_dim=4, intermediate_size=32)
    mx.random.seed(seed)
    m = qwen3_5.GatedDeltaNet(args)
    rng = np.random.default_rng(seed)
    params = []
    for name, p in tree_flatten(m.parameters()):
        if name.endswith("A_log"):
            v = mx.array(np.log(rng.uniform(1, 16, p.shape)).astype(np.float32))
        else:
            scale = 0.3 if "conv" in name else (p.shape[-1] ** -0.5 if p.ndim > 1 else 0.1)
            off = 1.0 if p.ndim == 1 else 0.0
            v = mx.array((off + scale * rng.standard_normal(p.shape)).astype(np.float32))
            v = v.astype(mx.bfloat16)
        params.append((name, v))
    m.update(tree_unflatten(params))
    return m
