"""Residual add fused with the next RMSNorm.

Contract (``add_rms_norm_reference``): ``h = x + residual`` and
``normed = rms_norm(h) * weight`` with the statistics in fp32 (as ``mx.fast.rms_norm``).
Source: RMSNorm, Zhang & Sennrich 2019; the fusion follows Lily's decode design.
"""

from __future__ import annotations

import mlx.core as mx



NAME = "add_rms_norm"


def add_rms_norm_reference(x: mx.array, residual: mx.array, weight: mx.array,
                           eps: float) -> tuple[mx.array, mx.array]:
    """Return ``(h, normed)`` with ``h = x + residual`` and ``normed = RMSNorm(h) * weight``.

    Args:
        x, residual: ``[..., D]`` of one float dtype (bf16 in Qwen3.5/3.6 checkpoints).
        weight: ``[D]`` RMSNorm weight (already shifted, as MLX checkpoints store it).
        eps: added to the mean of squares.
    Returns:
        ``h`` and ``normed``, both ``[..., D]`` in the dtype of ``x + residual``.
    """
    h = x + residual
    return h, mx.fast.rms_norm(h, weight, eps)


def has_kernel(backend: str) -> bool:
    """No dedicated kernel: ``mx.fast.rms_norm`` is already one launch on every backend;
    on the decode path the add is fused into the projection kernels' prologue instead."""
    return False


def add_rms_norm(x, residual, weight, eps):
    """Dispatcher: returns ``(h, normed)``. Shapes and dtypes as in ``add_rms_norm_reference``."""
    return add_rms_norm_reference(x, residual, weight, eps)
