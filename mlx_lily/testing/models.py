"""Small mlx-lm modules built in memory, for tests and benchmarks alike (``tests/_models``
re-exports them; benchmarks import them from here)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


def _moe_predicate(bits, gs):
    def pred(path, m):
        if not hasattr(m, "to_quantized"):
            return False
        if path.endswith("gate") or path.endswith("shared_expert_gate"):
            return {"group_size": 64, "bits": 8}
        return {"group_size": gs, "bits": bits}

    return pred


def _rand_u32(shape):
    hi = mx.random.randint(0, 1 << 16, shape, dtype=mx.uint32)
    lo = mx.random.randint(0, 1 << 16, shape, dtype=mx.uint32)
    return (hi << 16) | lo


def _random_codes(blk, dtype):
    """Replace every quantized weight of ``blk`` by uniform random codes, with scales
    U(0.5, 1.5) * 0.03 / 2^(bits-1) and biases -2^(bits-1) * scale (codes centred on 0)."""
    from mlx.utils import tree_flatten, tree_unflatten

    mods = dict(blk.named_modules())
    params = dict(tree_flatten(blk.parameters()))
    new = []
    for name, p in params.items():
        if name.endswith(".weight") and p.dtype == mx.uint32:
            new.append((name, _rand_u32(p.shape)))
        elif name.endswith(".scales"):
            bits = mods[name[:-len(".scales")]].bits
            s = mx.random.uniform(0.5, 1.5, p.shape) * (0.03 / (1 << (bits - 1)))
            new.append((name, s.astype(dtype)))
            new.append((name[:-len("scales")] + "biases",
                        (-(1 << (bits - 1)) * s).astype(dtype)))
    blk.update(tree_unflatten(new))


def moe_block(d=256, e=16, k=4, i=128, seed=0, bits=4, gs=64, dtype=mx.bfloat16, norm=True,
              random_codes=False):
    """A quantized mlx-lm ``Qwen3NextSparseMoeBlock``: hidden ``d``, ``e`` experts, top
    ``k``, expert and shared-expert width ``i``; router and shared gate 8-bit group 64,
    experts and shared expert at ``bits`` / ``gs``; ``norm``: ``norm_topk_prob``. Weights
    ~ N(0, 1/fan_in) in ``dtype`` quantized (seeded by ``seed``), or with
    ``random_codes`` uniform random codes and scales/biases in ``dtype`` written straight
    into the quantized layout (no float weights: fast at production sizes). Lazy: the
    caller evaluates the parameters."""
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.models import qwen3_next

    args = qwen3_next.ModelArgs(
        model_type="qwen3_next", hidden_size=d, num_hidden_layers=1, intermediate_size=256,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, rms_norm_eps=1e-6,
        vocab_size=32, linear_num_value_heads=1, linear_num_key_heads=1,
        linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
        num_experts=e, num_experts_per_tok=k, decoder_sparse_step=1,
        shared_expert_intermediate_size=i, moe_intermediate_size=i, mlp_only_layers=[],
        norm_topk_prob=norm, rope_theta=1e6, partial_rotary_factor=0.25,
        max_position_embeddings=128, tie_word_embeddings=False, full_attention_interval=4)
    if random_codes:
        blk = qwen3_next.Qwen3NextSparseMoeBlock(args)
        nn.quantize(blk, class_predicate=_moe_predicate(bits, gs))  # lazy: replaced next
        mx.random.seed(seed)
        _random_codes(blk, dtype)
        return blk
    mx.random.seed(seed)
    blk = qwen3_next.Qwen3NextSparseMoeBlock(args)
    blk.update(tree_unflatten([
        (n, (mx.random.normal(p.shape) * p.shape[-1] ** -0.5).astype(dtype))
        for n, p in tree_flatten(blk.parameters())]))
    nn.quantize(blk, class_predicate=_moe_predicate(bits, gs))
    return blk
