"""MoE router: logits, fp32 softmax over all experts, top-k, renormalisation, and the
shared-expert sigmoid gate.

Contract (``moe_router_topk_reference``), matching mlx-lm's ``Qwen3NextSparseMoeBlock``:
``probs = softmax(gate(x))`` computed in fp32 and rounded to the activation dtype;
the k largest probabilities are chosen; when ``norm_topk_prob`` the k scores are
divided by their sum (in the activation dtype); ``shared = sigmoid(shared_expert_gate(x))``.

Ties. mlx-lm selects with ``argpartition``, which leaves the choice between equal
probabilities at the k-th place unspecified (and it differs between backends); with
bf16 probabilities such ties are common. ``tie_break="lowest_id"`` (the kernels'
contract) breaks them towards the LOWEST expert id and orders the k picks by decreasing
probability (a stable descending sort). ``tie_break="stock"`` selects exactly as mlx-lm
does, so the reference path reproduces stock mlx-lm bit for bit; the two agree on every
row without an exact tie at the k-th place.
Source: Qwen3-Next / Qwen3.5 MoE routing (softmax top-k with renormalisation).
"""

from __future__ import annotations

import mlx.core as mx



NAME = "moe_router_topk"


def topk_lowest_id(probs: mx.array, k: int) -> mx.array:
    """Indices ``[..., k]`` (uint32) of the k largest entries along the last axis, ties to
    the lowest index, ordered by decreasing value."""
    order = mx.argsort(-probs.astype(mx.float32), axis=-1)
    return order[..., :k]


def moe_router_topk_reference(x: mx.array, router, k: int, norm_topk_prob: bool, *,
                              tie_break: str = "lowest_id"):
    """Route each row of ``x`` to ``k`` experts.

    Args:
        x: ``[..., D]`` activations (bf16 in the real model).
        router: callable ``x -> [logits [..., E]]`` or ``[logits, shared_logit [..., 1]]``
            (an ``mlx_lily.qproj.QProj`` over the router, 8-bit in MLX checkpoints, fused
            with the shared-expert gate when both exist).
        k: experts per token; norm_topk_prob: renormalise the k scores.
        tie_break: ``"lowest_id"`` or ``"stock"`` (see the module docstring).
    Returns:
        ``(inds, scores, shared)``: ``inds`` uint32 ``[..., k]``, ``scores`` ``[..., k]`` in
        the router output dtype, ``shared`` ``[..., 1]`` (sigmoid applied) or None.
    """
    parts = router(x)
    probs = mx.softmax(parts[0], axis=-1, precise=True)
    if tie_break == "lowest_id":
        inds = topk_lowest_id(probs, k)
    elif tie_break == "stock":
        inds = mx.argpartition(probs, kth=-k, axis=-1)[..., -k:]
    else:
        raise ValueError(f"tie_break must be 'lowest_id' or 'stock', got {tie_break!r}")
    scores = mx.take_along_axis(probs, inds, axis=-1)
    if norm_topk_prob:
        scores = scores / scores.sum(axis=-1, keepdims=True)
    shared = mx.sigmoid(parts[1]) if len(parts) > 1 else None
    return inds, scores, shared


def has_kernel(backend: str) -> bool:
    return False


def moe_router_topk(x, router, k, norm_topk_prob):
    """Dispatcher: the kernel when one serves (lowest-id ties), else the reference with
    mlx-lm's own selection (``tie_break="stock"``), bit-identical to stock."""
    return moe_router_topk_reference(x, router, k, norm_topk_prob, tie_break="stock")
