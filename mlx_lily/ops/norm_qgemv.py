"""Residual add + RMSNorm + quantized GEMV: the input norm of a decoder layer folded into
the projection that reads it (one launch instead of ``add_rms_norm`` + ``qgemv``).

Contract (``norm_qgemv_reference``): ``h, x = add_rms_norm_reference(h0, res, norm_w,
eps)`` then ``y = qgemv_reference(x, w, scales, biases, group_size, bits)``; returns
``(y, h)``. The kernel (``lily_norm_qgemv``, ``shaders/*/norm_qgemv.*``) serves what
``lily_qgemv`` serves (4/8-bit affine, group 32/64/128, up to ``qgemv.MAX_ROWS`` rows)
with ``K <= MAX_K``: every threadgroup recomputes the row's norm into threadgroup memory
(``K`` values of ``T``, rounded as ``lily_add_rms_norm`` rounds, so ``x`` equals that
kernel's ``normed`` but for the fp32 sum-of-squares order) and runs the ``lily_qgemv``
loop on it; the first threadgroup of each row writes ``h``.
Source: RMSNorm (Zhang & Sennrich 2019); norm-as-GEMV-prologue as in Lily's decode path.
"""

from __future__ import annotations


from .. import kernels
from ..backend import current_backend, op_enabled
from ..registry import switch_on
from . import qgemv as _qgemv
from .add_rms_norm import add_rms_norm, add_rms_norm_reference

NAME = "norm_qgemv"

# lily_norm_qgemv: template T, S, K, O, BITS, GS, NW, RPW, BPL (as lily_qgemv);
# grid (ceil(O/RPB)*32*NW, N, 1), threadgroup (32*NW, 1, 1), RPB = qgemv.rows_per_block.
SPEC = kernels.KernelSpec(
    name="lily_norm_qgemv", stem="norm_qgemv",
    inputs=("hin", "res", "nw", "eps", "w", "scales", "biases"), outputs=("y", "h"))

#: The tensor-core form (CUDA, where ``qgemv.mma_serves``):
#: ``shaders/cuda/norm_qgemv_mma.cu``, the same contract for up to ``qgemv.MAX_ROWS``
#: rows; template and grid as ``qgemv.mma_launch_args``.
MMA_SPEC = kernels.KernelSpec(
    name="lily_norm_qgemv_mma", stem="norm_qgemv_mma",
    inputs=("hin", "res", "nw", "eps", "w", "scales", "biases"), outputs=("y", "h"))
#: Static shared memory a CUDA block may hold (the mma form keeps its rows there).
MMA_SHARED_BYTES = 49152

#: Largest input width: the normalised row lives in threadgroup memory.
MAX_K = 8192
#: Threadgroup bytes the row may take (Apple's limit is 32 KiB per threadgroup).
MAX_ROW_BYTES = 16384
NW = _qgemv.NW
RPW = _qgemv.RPW


def norm_qgemv_reference(h0, res, norm_w, eps, w, scales, biases, group_size, bits):
    """``(x @ dequant(w)^T, h)`` with ``h = h0 + res`` and ``x = rms_norm(h) * norm_w``.

    Args:
        h0, res: ``[..., K]`` residual stream and the delta added to it (one float dtype).
        norm_w: ``[K]`` RMSNorm weight; eps: added to the mean of squares.
        w, scales, biases: MLX affine-quantized ``[O, K*bits/32]`` uint32 and
            ``[O, K/group_size]`` (as ``nn.QuantizedLinear`` holds them).
    Returns:
        ``(y [..., O], h [..., K])`` in the activation dtype.
    """
    h, x = add_rms_norm_reference(h0, res, norm_w, eps)
    return _qgemv.qgemv_reference(x, w, scales, biases, group_size, bits), h


def supports(h0, res, norm_w, w, scales, biases, group_size, bits, mode="affine") -> bool:
    """True when the kernel computes this call: what ``qgemv.supports`` accepts for
    ``h0`` as the activation, ``res`` of h0's shape and dtype, ``norm_w [K]`` of that
    dtype, ``K <= MAX_K`` and the row at most ``MAX_ROW_BYTES``."""
    k = h0.shape[-1]
    return (k <= MAX_K and k * h0.dtype.size <= MAX_ROW_BYTES and res.shape == h0.shape and res.dtype == h0.dtype
            and norm_w.shape == (k,) and norm_w.dtype == h0.dtype
            and _qgemv.supports(h0, w, scales, biases, group_size, bits, mode))


def mma_shared_bytes(k: int, o: int, itemsize: int) -> int:
    """Shared memory of a ``lily_norm_qgemv_mma`` block for ``k``-wide inputs of
    ``itemsize`` bytes and ``o`` outputs, counted at ``qgemv.MAX_ROWS`` rows (so whether
    the kernel serves does not depend on the step's rows): the rows, the warps'
    partials, the norm's reduction slots."""
    nw = _qgemv.mma_warps(k, o)
    return _qgemv.MAX_ROWS * k * itemsize + nw * _qgemv.MMA_RT * 4 * 32 * 4 + 4 * nw


def mma_supports(h0, res, norm_w, w, scales, biases, group_size, bits, mode="affine") -> bool:
    """True when ``lily_norm_qgemv_mma`` computes this call: what ``qgemv.mma_supports``
    accepts for ``h0`` as the activation, ``res`` of h0's shape and dtype, ``norm_w [K]``
    of that dtype, and ``mma_shared_bytes`` within ``MMA_SHARED_BYTES``."""
    k = h0.shape[-1] if h0.ndim else 0
    return (k > 0 and res.shape == h0.shape and res.dtype == h0.dtype
            and norm_w.shape == (k,) and norm_w.dtype == h0.dtype
            and _qgemv.mma_supports(h0, w, scales, biases, group_size, bits, mode)
            and mma_shared_bytes(k, w.shape[0], h0.dtype.size) <= MMA_SHARED_BYTES)


def mma_plan(kernel, x_shape, x_dtype, w, scales, biases, group_size, bits, *, nw=None,
             init_value=None):
    """``plan`` for the ``lily_norm_qgemv_mma`` kernel object: ``run(h0, res, norm_w,
    eps) -> (y, h)`` for inputs ``x_shape`` of ``x_dtype``; ``nw`` (warps per block)
    defaults to ``qgemv.mma_warps``."""
    kw = _qgemv.mma_launch_args(x_shape, x_dtype, w, scales, group_size, bits, nw=nw,
                                init_value=init_value)
    kw["output_shapes"].append(tuple(x_shape))
    kw["output_dtypes"].append(x_dtype)
    return _runner(kernel, kw, w, scales, biases)


def _runner(kernel, kw: dict, w, scales, biases):
    """``run(h0, res, norm_w, eps) -> (y, h)``: one launch of ``kernel`` with the launch
    arguments ``kw`` (``plan``'s or ``mma_plan``'s)."""

    def run(h0, res, norm_w, eps):
        y, h = kernel(inputs=[h0, res, norm_w, kernels.f32_scalar(eps), w, scales, biases], **kw)
        return y, h

    return run


def plan(kernel, x_shape, x_dtype, w, scales, biases, group_size, bits, *, nw=None, rpw=None,
         bpl=None, init_value=None):
    """A callable ``run(h0, res, norm_w, eps) -> (y, h)`` launching ``kernel`` for inputs
    of one shape and dtype (template, grid and output shapes worked out once)."""
    kw = _qgemv.launch_args(x_shape, x_dtype, w, scales, group_size, bits, nw=nw, rpw=rpw,
                            bpl=bpl, init_value=init_value,
                            extra_outputs=[(tuple(x_shape), x_dtype)])
    return _runner(kernel, kw, w, scales, biases)


def launch(kernel, h0, res, norm_w, eps, w, scales, biases, group_size, bits, *, nw=None,
           rpw=None, bpl=None, init_value=None):
    """Run the ``lily_norm_qgemv`` kernel object on a call ``supports`` accepted;
    returns ``(y, h)``."""
    return plan(kernel, h0.shape, h0.dtype, w, scales, biases, group_size, bits, nw=nw,
                rpw=rpw, bpl=bpl, init_value=init_value)(h0, res, norm_w, eps)


def has_kernel(backend: str) -> bool:
    """True when the kernel can run on ``backend`` here."""
    return backend in ("metal", "cuda") and kernels.get(SPEC, backend) is not None


#: ``MLX_LILY_NORM_GEMV=split``: one-row projections behind a pending add + RMSNorm run
#: ``add_rms_norm`` and then ``qgemv`` (two launches) instead of this fused kernel; for
#: benchmarking (ncu on the H200: the fused 2048 -> 12352 GEMV 30.6 us, the
#: plain one 11.7 us, ``add_rms_norm`` 4.6 us).
SPLIT_ENV = "MLX_LILY_NORM_GEMV"


def split_requested() -> bool:
    """True when ``MLX_LILY_NORM_GEMV=split`` (``tuning.norm_gemv``; a value other than
    ``fused`` / ``split`` warns once and reads as ``fused``)."""
    from .. import tuning

    return tuning.norm_gemv == "split"


def for_qproj(h0, res, norm_w, eps, proj):
    """The kernel's ``(y [..., out], h)`` for a one-row input of the quantized ``QProj``
    ``proj`` when it serves on this backend, else None (the caller materialises the norm
    and projects; always under ``MLX_LILY_NORM_GEMV=split``). Where the tensor-core GEMV
    serves the projection (``qgemv.mma_serves``) the kernel is ``lily_norm_qgemv_mma``,
    or None when ``mma_supports`` refuses (``QProj.call_pending`` then runs
    ``add_rms_norm`` and ``lily_qgemv_mma``; the MoE router's caller its own router
    kernel, ``moe_experts``). The launch plan is cached
    on the projection per (backend, shape, dtype, ``qgemv.launch_knobs``)."""
    if _qgemv.decode_rows(h0) is None or not proj.quantized or split_requested():
        return None
    backend = current_backend()
    # the GEMV half is qgemv's: its switches apply too
    if (backend not in ("metal", "cuda") or not switch_on(NAME, backend)
            or not op_enabled(_qgemv.NAME) or not _qgemv.USE_FOR_QPROJ.get(backend, False)
            or not kernels.stock_result_dtype(h0.dtype, proj.scales.dtype)):
        return None
    plans = kernels.plan_cache(proj, "_lily_norm_qgemv_plans")
    key = (backend, h0.shape, h0.dtype, res.dtype, norm_w.dtype, norm_w.shape,
           _qgemv.launch_knobs(backend))
    run = plans.get(key, False)
    if run is False:
        run = None
        mode = proj.mode or "affine"
        if _qgemv.mma_serves(backend, h0, proj.weight, proj.scales, proj.biases,
                             proj.group_size, proj.bits, mode):
            # tensor cores: the folded form where it fits, else None (the caller runs
            # add_rms_norm, then qgemv's mma kernel), for every number of rows alike
            kern = kernels.get(MMA_SPEC, backend)
            if kern is not None and mma_supports(h0, res, norm_w, proj.weight, proj.scales,
                                                 proj.biases, proj.group_size, proj.bits,
                                                 mode):
                run = mma_plan(kern, h0.shape, h0.dtype, proj.weight, proj.scales,
                               proj.biases, proj.group_size, proj.bits)
        elif supports(h0, res, norm_w, proj.weight, proj.scales, proj.biases, proj.group_size,
                      proj.bits, mode):
            kern = kernels.get(SPEC, backend)
            if kern is not None:
                run = plan(kern, h0.shape, h0.dtype, proj.weight, proj.scales, proj.biases,
                           proj.group_size, proj.bits)
        plans[key] = run
    return run(h0, res, norm_w, eps) if run is not None else None


def norm_qgemv(h0, res, norm_w, eps, w, scales, biases, group_size, bits):
    """Dispatcher: where the tensor-core GEMV serves (``qgemv.mma_serves``), its folded
    form (``lily_norm_qgemv_mma``) when ``mma_supports`` and the ``norm_qgemv`` op is on,
    else ``add_rms_norm`` and that GEMV; otherwise the fused kernel when it serves this
    backend and call, else the reference. Same arguments and results as
    ``norm_qgemv_reference``."""
    backend = current_backend()
    if _qgemv.mma_serves(backend, h0, w, scales, biases, group_size, bits) and op_enabled(
            _qgemv.NAME):
        kern = kernels.get(MMA_SPEC, backend) if op_enabled(NAME) else None
        if kern is not None and mma_supports(h0, res, norm_w, w, scales, biases, group_size,
                                             bits):
            return mma_plan(kern, h0.shape, h0.dtype, w, scales, biases, group_size,
                            bits)(h0, res, norm_w, eps)
        h, x = add_rms_norm(h0, res, norm_w, eps)
        return _qgemv.qgemv(x, w, scales, biases, group_size, bits), h
    if backend in ("metal", "cuda") and op_enabled(NAME) and supports(
            h0, res, norm_w, w, scales, biases, group_size, bits):
        kern = kernels.get(SPEC, backend)
        if kern is not None:
            return launch(kern, h0, res, norm_w, eps, w, scales, biases, group_size, bits)
    return norm_qgemv_reference(h0, res, norm_w, eps, w, scales, biases, group_size, bits)
