"""Routed-expert SwiGLU with score-weighted combine plus the sigmoid-gated shared expert.

Contract (``moe_experts_reference``), matching mlx-lm's ``Qwen3NextSparseMoeBlock`` after
routing: ``y = sum_j scores[..., j] * down_e(silu(gate_e(x)) * up_e(x))`` over the k
chosen experts ``e = inds[..., j]`` (4-bit affine, group 64, bf16 scales/biases in MLX
checkpoints), plus ``shared * shared_expert(x)`` when a shared expert exists. The decode
form is one row per call (a GEMV per expert); the prefill form groups rows by expert
(``moe_route``) for a grouped GEMM; both compute the same function.
Source: SwiGLU (Shazeer 2020); Qwen3.5 MoE block.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn



NAME = "moe_experts"


def moe_experts_reference(x: mx.array, inds: mx.array, scores: mx.array,
                          switch_mlp: nn.Module, shared_expert: nn.Module | None,
                          shared: mx.array | None) -> mx.array:
    """Experts' output for each row of ``x``.

    Args:
        x: ``[..., D]`` activations; ``inds``: ``[..., k]`` uint32 expert ids;
        scores: ``[..., k]`` routing weights; ``switch_mlp``: mlx-lm ``SwitchGLU`` holding
        the stacked expert weights ``[E, I, D]`` / ``[E, D, I]``; ``shared_expert``: MLP or
        None; ``shared``: ``[..., 1]`` sigmoid gate of the shared expert or None.
    Returns:
        ``[..., D]`` in the activation dtype.
    """
    y = switch_mlp(x, inds)
    y = (y * scores[..., None]).sum(axis=-2)
    if shared_expert is not None:
        s = shared_expert(x)
        y = y + (shared * s if shared is not None else s)
    return y


def has_kernel(backend: str) -> bool:
    return False


def moe_experts(x, inds, scores, switch_mlp, shared_expert, shared):
    """Dispatcher: the kernel when one serves, else the reference."""
    return moe_experts_reference(x, inds, scores, switch_mlp, shared_expert, shared)
