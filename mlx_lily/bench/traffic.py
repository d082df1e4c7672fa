"""Bytes a batch-1 decode step must move, and the copy bandwidth to compare them with.

A decode step of a MoE model reads every non-expert weight once, ``top_k`` of the
``num_experts`` routed experts of each layer, the KV cache of each attention layer up to
the context, and reads and writes each Gated DeltaNet layer's recurrent (fp32) and conv
state; plus one embedding row and the LM head. ``achieved GB/s = bytes / step time``
against ``copy_bandwidth_gbps`` (one device-to-device copy) says how far a step is from
being bound by memory bandwidth.
"""

from __future__ import annotations

import statistics
import time


def _text_model(model):
    lm = getattr(model, "language_model", model)
    return lm, lm.model


def _leaf_bytes(module) -> int:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(module.parameters()) if isinstance(v, mx.array))


def decode_step_bytes(model, context: int, batch: int = 1) -> dict:
    """Bytes read or written by one decode step of an mlx-lm Qwen3.5/3.6 (or Qwen3-Next)
    model at ``context`` tokens of history.

    Args:
        model: a loaded mlx-lm model (quantized or not).
        context: tokens already in the caches (KV reads grow with it).
        batch: sequences decoded together (weights are read once for all of them).
    Returns:
        ``{"weights", "experts", "kv_cache", "recurrent_state", "embedding", "total"}`` in
        bytes: ``weights`` = non-expert weights of every layer + final norm + LM head;
        ``experts`` = the ``top_k / num_experts`` share of each layer's routed expert
        stacks; ``kv_cache`` = keys and values read (``2 * kv_heads * head_dim * context *
        2 bytes`` per attention layer and sequence); ``recurrent_state`` = GDN recurrent
        state read + written (fp32) and conv state read + written.
    """
    lm, text = _text_model(model)
    weights = experts = kv = state = 0
    for layer in text.layers:
        total = _leaf_bytes(layer)
        mlp = layer.mlp
        sw = getattr(mlp, "switch_mlp", None)
        if sw is not None:
            stack = _leaf_bytes(sw)
            n_exp = getattr(mlp, "num_experts", None) or sw.gate_proj.weight.shape[0]
            experts += stack * mlp.top_k // n_exp
            total -= stack
        weights += total
        if getattr(layer, "is_linear", False):
            g = layer.linear_attn
            rec = g.num_v_heads * g.head_v_dim * g.head_k_dim * 4
            conv = (g.conv_kernel_size - 1) * g.conv_dim * 2
            state += 2 * (rec + conv) * batch
        else:
            a = layer.self_attn
            d = a.k_proj.weight.shape[0] // a.num_key_value_heads  # rows = output features
            kv += 2 * a.num_key_value_heads * d * context * 2 * batch
    weights += _leaf_bytes(text.norm)
    head = getattr(lm, "lm_head", None)
    emb = text.embed_tokens
    weights += _leaf_bytes(head) if head is not None else _leaf_bytes(emb)
    vocab = emb.weight.shape[0]
    embedding = _leaf_bytes(emb) // vocab * batch
    out = {"weights": weights, "experts": experts, "kv_cache": kv, "recurrent_state": state,
           "embedding": embedding}
    out["total"] = sum(out.values())
    return out


def copy_bandwidth_gbps(nbytes: int = 1 << 30, reps: int = 5) -> float:
    """Device copy bandwidth: median over ``reps`` of ``2 * nbytes / t`` for ``y = x * 2``
    on an fp32 array of ``nbytes`` (read once, written once), after one warm-up, in GB/s
    (1e9 bytes)."""
    import mlx.core as mx

    x = mx.random.uniform(shape=(nbytes // 4,))
    mx.eval(x)
    mx.eval(x * 2)
    mx.synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        y = x * 2
        mx.eval(y)
        mx.synchronize()
        ts.append(time.perf_counter() - t0)
        del y
    return 2 * nbytes / statistics.median(ts) / 1e9
