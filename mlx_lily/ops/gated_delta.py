"""Gated DeltaNet mixer core: conv1d with its state, SiLU, l2-normalised q/k, gates,
the gated delta-rule recurrence with an fp32 state, and the gated RMSNorm.

Contract (``gated_delta_reference``), matching mlx-lm's ``qwen3_5.GatedDeltaNet`` between
its input projections and ``out_proj``:

1. ``x = concat(conv_state, qkv)`` over time (rows where ``mask`` is False zeroed first);
   the new conv state is the last ``K-1`` raw rows (per sequence at ``lengths`` when
   given); ``c = silu(depthwise_conv1d(x, conv_weight))`` over the ``C = 2*Hk*Dk + Hv*Dv``
   channels, split into q ``[B,S,Hk,Dk]``, k, v ``[B,S,Hv,Dv]``.
2. ``q = l2norm(q) * Dk**-0.5``, ``k = l2norm(k)`` (eps 1e-6 on the sum of squares).
3. ``beta = sigmoid(b)``, ``g = exp(-exp(A_log) * softplus(a + dt_bias))`` in fp32.
4. Per (batch, v-head h; q/k head ``h // (Hv/Hk)``), state ``S [Dv, Dk]`` fp32:
   ``S *= g; kv = S k; delta = (v - kv) * beta; S += delta k^T; y = S q``; a masked step
   leaves S unchanged.
5. ``out = (norm_weight * rmsnorm(y)) * silu(z)`` per v-head (fp32 math, cast to the
   input dtype), returned as ``[B, S, Hv*Dv]``.

Source: Yang et al., "Gated Delta Networks: Improving Mamba2 with Delta Rule" (2024);
Qwen3-Next / Qwen3.5 linear-attention layers.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn



NAME = "gated_delta"


def conv_step_reference(qkv, conv_weight, conv_state, mask=None, lengths=None):
    """Causal depthwise conv1d with carried state, then SiLU.

    Args:
        qkv: ``[B, S, C]``; conv_weight: ``[C, K, 1]`` (MLX layout); conv_state:
            ``[B, K-1, C]`` or None (zeros); mask: ``[B, S]`` bool or None;
            lengths: ``[B]`` int (valid rows per sequence in this call) or None.
    Returns:
        ``(conv_out [B, S, C], new_conv_state [B, K-1, C])`` in ``qkv``'s dtype.
    """
    B, S, C = qkv.shape
    K = conv_weight.shape[1]
    if conv_state is None:
        conv_state = mx.zeros((B, K - 1, C), dtype=qkv.dtype)
    if mask is not None:
        qkv = mx.where(mask[..., None], qkv, 0)
    conv_input = mx.concatenate([conv_state, qkv], axis=1)
    n_keep = K - 1
    if lengths is not None:
        ends = mx.clip(lengths, 0, S)
        positions = (ends[:, None] + mx.arange(n_keep))[..., None]
        new_state = mx.take_along_axis(conv_input, positions, axis=1)
    else:
        new_state = mx.contiguous(conv_input[:, -n_keep:, :])
    out = nn.silu(mx.conv1d(conv_input, conv_weight, groups=C))
    return out, new_state


def gated_rms_norm_reference(y, z, weight, eps):
    """``(weight * rmsnorm(y)) * silu(z)`` over the last axis, fp32 math, ``y``'s dtype."""
    x = mx.fast.rms_norm(y, weight, eps)
    return (nn.silu(z.astype(mx.float32)) * x.astype(mx.float32)).astype(y.dtype)


def gated_delta_reference(qkv, z, b, a, conv_weight, conv_state, A_log, dt_bias, state,
                          norm_weight, *, num_k_heads, head_k_dim, num_v_heads,
                          head_v_dim, eps, mask=None, lengths=None):
    """The GDN mixer between projections and ``out_proj`` (module docstring, steps 1-5).

    Args:
        qkv: ``[B, S, 2*Hk*Dk + Hv*Dv]`` projected q|k|v (bf16); z: ``[B, S, Hv, Dv]``;
        b, a: ``[B, S, Hv]``; conv_weight ``[C, K, 1]``; conv_state ``[B, K-1, C]`` or None;
        A_log, dt_bias: ``[Hv]`` (fp32 / bf16); state: ``[B, Hv, Dv, Dk]`` fp32 or None;
        norm_weight: ``[Dv]``; eps: gated-RMSNorm epsilon; mask ``[B, S]`` bool or None;
        lengths ``[B]`` or None (batched prefill, see ``conv_step_reference``).
    Returns:
        ``(out [B, S, Hv*Dv] in qkv's dtype, new_conv_state, new_state fp32)``.
    """
    from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk

    B, S, _ = qkv.shape
    Hk, Dk, Hv, Dv = num_k_heads, head_k_dim, num_v_heads, head_v_dim
    conv_out, new_conv = conv_step_reference(qkv, conv_weight, conv_state, mask, lengths)
    key_dim = Hk * Dk
    q, k, v = mx.split(conv_out, [key_dim, 2 * key_dim], -1)
    q = q.reshape(B, S, Hk, Dk)
    k = k.reshape(B, S, Hk, Dk)
    v = v.reshape(B, S, Hv, Dv)
    q, k = normalize_qk(q, k, inv_scale=Dk**-0.5, eps=1e-6)
    y, new_state = gated_delta_update(q, k, v, a, b, A_log, dt_bias, state, mask,
                                      use_kernel=True)
    out = gated_rms_norm_reference(y, z, norm_weight, eps)
    return out.reshape(B, S, -1), new_conv, new_state


def has_kernel(backend: str) -> bool:
    return False


def gated_delta(qkv, z, b, a, conv_weight, conv_state, A_log, dt_bias, state, norm_weight,
                **dims):
    """Dispatcher: a fused kernel when one serves this backend and shape, else the
    reference. Same arguments and results as ``gated_delta_reference``."""
    return gated_delta_reference(qkv, z, b, a, conv_weight, conv_state, A_log, dt_bias,
                                 state, norm_weight, **dims)
