"""Qwen3.5 gated GQA attention pieces: q/k RMSNorm + partial RoPE, scaled dot-product
attention over the KV cache, and the sigmoid output gate.

Contract:
- ``qk_norm_rope_reference``: ``q = rope(rmsnorm(q) * wq)``, ``k = rope(rmsnorm(k) * wk)``
  with rotate-half RoPE on the first ``rope_dims`` of each head (pairs ``(j, j+rope_dims/2)``),
  ``theta_j = base ** (-2j / rope_dims)``, positions ``offset + t``; heads moved to axis 1.
- ``sdpa_reference``: ``softmax(q k^T * scale + mask) v`` with GQA (query head h reads KV
  head ``h // (Hq/Hkv)``), fp32 softmax, as ``mx.fast.scaled_dot_product_attention``.
  Decode kernels use a general path below ``SPLIT_K_MIN_CONTEXT`` cached tokens and a
  fixed-block split-K path with a two-pass combine at or above it.
- ``output_gate_reference``: ``out * sigmoid(gate)``.
Source: Qwen3-Next / Qwen3.5 gated attention; RoPE (Su et al. 2021); GQA (Ainslie et al. 2023).
"""

from __future__ import annotations

import mlx.core as mx



NAME = "attention"
SPLIT_K_MIN_CONTEXT = 32768


def qk_norm_rope_reference(queries, keys, q_norm_weight, k_norm_weight, eps, *,
                           rope_dims, base, scale=1.0, traditional=False, offset=0):
    """Normalise and rotate q and k.

    Args:
        queries: ``[B, L, Hq, D]``; keys: ``[B, L, Hkv, D]`` (bf16); ``*_norm_weight``:
        ``[D]``; eps: RMSNorm epsilon; rope_dims: rotated leading dims (64 of 256 in
        Qwen3.5/3.6); base: theta; offset: position of the first row (int or ``[B]`` array).
    Returns:
        ``(q [B, Hq, L, D], k [B, Hkv, L, D])``.
    """
    q = mx.fast.rms_norm(queries, q_norm_weight, eps).transpose(0, 2, 1, 3)
    k = mx.fast.rms_norm(keys, k_norm_weight, eps).transpose(0, 2, 1, 3)
    q = mx.fast.rope(q, rope_dims, traditional=traditional, base=base, scale=scale,
                     offset=offset)
    k = mx.fast.rope(k, rope_dims, traditional=traditional, base=base, scale=scale,
                     offset=offset)
    return q, k


def sdpa_reference(q, k, v, scale, mask=None):
    """Attention ``[B, Hq, L, D]`` from q ``[B, Hq, L, D]``, k/v ``[B, Hkv, T, D]`` (views of
    the KV cache are fine), mask None, ``"causal"`` or a boolean/additive array."""
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def output_gate_reference(out, gate):
    """``out * sigmoid(gate)``; both ``[B, L, Hq*D]``."""
    return out * mx.sigmoid(gate)


def has_kernel(backend: str) -> bool:
    return False


def qk_norm_rope(queries, keys, q_norm_weight, k_norm_weight, eps, **rope):
    """Dispatcher for ``qk_norm_rope_reference``."""
    return qk_norm_rope_reference(queries, keys, q_norm_weight, k_norm_weight, eps, **rope)


def sdpa(q, k, v, scale, mask=None):
    """Dispatcher for ``sdpa_reference`` (decode kernels take L == 1, no array mask)."""
    return sdpa_reference(q, k, v, scale, mask)


def output_gate(out, gate):
    """Dispatcher for ``output_gate_reference``."""
    return output_gate_reference(out, gate)
