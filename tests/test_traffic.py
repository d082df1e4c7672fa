"""Decode-step byte counts (mlx_lily.bench.traffic) on the tiny models."""

import pytest
from mlx.utils import tree_flatten

import _models
from mlx_lily.bench.traffic import copy_bandwidth_gbps, decode_step_bytes


def _bytes(module):
    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


@pytest.mark.parametrize("kind", ["qwen3_5_moe", "qwen3_5"])
def test_decode_step_bytes_parts(kind):
    model = _models.build(kind)
    text = model.language_model.model
    b1, b2 = decode_step_bytes(model, 100), decode_step_bytes(model, 300)
    attn = [l.self_attn for l in text.layers if not l.is_linear]
    per_tok = sum(2 * a.num_key_value_heads * a.k_proj.weight.shape[0] // a.num_key_value_heads
                  * 2 for a in attn)
    assert b2["kv_cache"] - b1["kv_cache"] == 200 * per_tok
    assert b1["weights"] == b2["weights"] and b1["total"] == sum(
        v for k, v in b1.items() if k != "total")
    everything = _bytes(model)
    emb = _bytes(text.embed_tokens)
    if kind == "qwen3_5_moe":
        stacks = sum(_bytes(l.mlp.switch_mlp) for l in text.layers)
        k, E = text.layers[0].mlp.top_k, text.layers[0].mlp.num_experts
        assert b1["experts"] == sum(_bytes(l.mlp.switch_mlp) * k // E for l in text.layers)
        assert b1["weights"] == everything - stacks - emb
    else:
        assert b1["experts"] == 0 and b1["weights"] == everything - emb
    g = next(l.linear_attn for l in text.layers if l.is_linear)
    n_gdn = sum(l.is_linear for l in text.layers)
    rec = g.num_v_heads * g.head_v_dim * g.head_k_dim * 4
    assert b1["recurrent_state"] == n_gdn * 2 * (rec + (g.conv_kernel_size - 1) * g.conv_dim * 2)


def test_copy_bandwidth_is_positive():
    assert copy_bandwidth_gbps(1 << 20, reps=2) > 0
