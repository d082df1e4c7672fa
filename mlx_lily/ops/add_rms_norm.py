"""Residual add fused with the next RMSNorm.

Contract (``add_rms_norm_reference``): ``h = x + residual`` and
``normed = rms_norm(h) * weight`` with the statistics in fp32 (as ``mx.fast.rms_norm``).
Kernel ``lily_add_rms_norm`` (Metal and CUDA): one launch instead of two, one threadgroup
per row; same rounding as the reference (``h`` rounded to the dtype, then
``w * T(h * rsqrt(mean(h^2) + eps))``), so ``h`` is exact and ``normed`` differs by at most
an ulp where the fp32 sum of squares is reduced in another order.
Source: RMSNorm, Zhang & Sennrich 2019; the fusion follows Lily's decode design.
"""

from __future__ import annotations

import mlx.core as mx

from .. import kernels as _k
from ..backend import current_backend

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


# lily_add_rms_norm (Metal and CUDA twins): inputs x, r, w, eps (fp32 [1]); outputs h,
# normed; template T, D, E (elements per thread); grid (D/E * rows, 1, 1), threadgroup
# (D/E, 1, 1). Inputs are made row-contiguous by MLX when they are not.
SPEC = _k.KernelSpec("lily_add_rms_norm", "add_rms_norm", ("x", "r", "w", "eps"),
                     ("h", "normed"))
_FLOATS = (mx.bfloat16, mx.float16, mx.float32)


def elements_per_thread(D: int):
    """E for ``lily_add_rms_norm`` (D/E threads per row, a multiple of 32, at most 1024),
    or None when no E fits."""
    for e in (8, 4, 16, 2, 1, 32):
        if D % (32 * e) == 0 and D // e <= 1024:
            return e
    return None


def kernel_unsupported(x, residual, weight, eps=1e-6):
    """Why ``lily_add_rms_norm`` cannot serve this call, or None: x and residual of one
    float dtype and shape ``[..., D]`` (D a multiple of 32 up to 32768), weight ``[D]`` of
    the same dtype, at least one row."""
    if x.ndim < 1 or x.shape != residual.shape:
        return "shapes"
    if x.dtype not in _FLOATS or residual.dtype != x.dtype or weight.dtype != x.dtype:
        return "dtypes"
    D = x.shape[-1]
    if weight.shape != (D,) or elements_per_thread(D) is None:
        return "width"
    if x.size == 0:
        return "empty"
    return None


def add_rms_norm_fused(x, residual, weight, eps, *, kernel, init_value=None):
    """One ``lily_add_rms_norm`` launch (``kernel`` = the kernel object); returns
    ``(h, normed)`` like ``add_rms_norm_reference``, same rounding (h rounded to the
    dtype, then ``w * T(h * rsqrt(mean(h^2) + eps))``). ``init_value`` (tests: NaN)
    pre-fills the outputs."""
    D = x.shape[-1]
    rows = x.size // D
    e = elements_per_thread(D)
    h, n = kernel(inputs=[x, residual, weight, _k.f32_scalar(eps)],
                  template=[("T", x.dtype), ("D", D), ("E", e)],
                  grid=(D // e * rows, 1, 1), threadgroup=(D // e, 1, 1),
                  output_shapes=[x.shape, x.shape], output_dtypes=[x.dtype, x.dtype],
                  **({} if init_value is None else {"init_value": init_value}))
    return h, n


def has_kernel(backend: str) -> bool:
    """True on ``"metal"`` / ``"cuda"`` when that backend is available here."""
    if backend not in ("metal", "cuda"):
        return False
    return _k.get(SPEC, backend) is not None


def add_rms_norm(x, residual, weight, eps):
    """Dispatcher: returns ``(h, normed)``. The fused kernel on Metal/CUDA for any number
    of rows (``kernel_unsupported`` is None), else the reference. Shapes and dtypes as in
    ``add_rms_norm_reference``."""
    backend = current_backend()
    if backend in ("metal", "cuda") and kernel_unsupported(x, residual, weight, eps) is None:
        k = _k.get(SPEC, backend)
        if k is not None:
            return add_rms_norm_fused(x, residual, weight, eps, kernel=k)
    return add_rms_norm_reference(x, residual, weight, eps)
