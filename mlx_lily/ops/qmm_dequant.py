"""Many-row quantized projections (prefill) as a dequantize and a dense matmul.

Contract (``qmm_dequant_reference``): ``x @ dequantize(w)^T`` for MLX's affine-quantized
``w``, exactly what ``mx.quantized_matmul(..., transpose=True)`` computes. On CUDA, MLX
runs that as its own quantized GEMM (``qmm_sm80`` / ``qmm_naive``); Nsight Compute on the
H200 read those at 73-139 TFLOP/s over a 2048-token prefill chunk (59.6 ms of 157.9, 38%), where the GPU's
dense bf16 peak is ~790 TFLOP/s. This op instead dequantizes the weight once per call to
the activation dtype (``mx.dequantize``: a memory-bound pass, 2 bytes written per weight)
and hands the product to MLX's dense matmul (cuBLAS on CUDA). The dequantized weight is
scratch of one projection (at most 50.6 MB for Qwen3.6's fused GDN input projection) that
MLX frees or reuses after the call; nothing is kept.

Measured on the H200 (``benchmarks/gpu/qmm_dequant_bench.py``, 2048 rows, device-side
time per call): against
``quantized_matmul`` the path saved 547 us on the fused GDN input projection (2048 ->
12352), 433 us on attention q|k|v (2048 -> 9216), 232 us on ``out_proj``/``o_proj``
(4096 -> 2048), 48 us on the shared expert's fused gate|up (2048 -> 1024) and 23 us on its
down (512 -> 2048), with bit-identical outputs at 4 bits; on the 8-bit router (2048 -> 257)
it lost 354 us (the dense matmul with 257 outputs is slow), hence ``MIN_OUT``.

The shared expert (``mlx_lily.patches.layouts.mlp``, switch ``shared_dequant``): its gate
and up (512 outputs each in Qwen3.6-35B-A3B, under ``MIN_OUT`` alone) run as one stacked
projection (``stacked_linear``), then down through the same path. Without it the shared expert runs
as three ``qmm_sm80`` launches at production widths (Nsight Compute: 7.99 ms of a
4096-token chunk's 134.5 ms). On the H200 its output was bit-identical to the stock
module's at 4096 rows, and a 4096-token chunk's GPU time read 127.5 ms in
``prefill_bench`` with it (about 131 ms without it, in other processes). Not in
``kernels.VERIFIED`` until the A/B gate has run with it: on with ``MLX_LILY_KERNELS=all``
or ``=verified,shared_dequant`` (``prefill_dequant`` must be allowed too).

The switch ``prefill_dequant`` (kill switch ``MLX_LILY_DISABLE=prefill_dequant``) serves
only on CUDA, for at least ``MIN_ROWS`` activation rows and ``MIN_OUT`` outputs, affine
mode with biases, and activations of the scales' dtype (bf16 or fp16), so the result dtype
is stock's. In ``kernels.VERIFIED["cuda"]``: its GPU tests and the A/B gate on the H200
passed with it on.
"""

from __future__ import annotations

import mlx.core as mx

from .. import kernels
from ..backend import current_backend, op_enabled

NAME = "prefill_dequant"
#: The shared expert's stacked gate|up + down through this path
#: (``mlx_lily.patches.layouts.mlp``).
SHARED_NAME = "shared_dequant"

#: Fewest activation rows (tokens) for which the dequantize pass pays, per backend.
MIN_ROWS = {"cuda": 256}
#: Fewest weight rows (outputs): the 8-bit router (257) was slower this way.
MIN_OUT = 1024
#: Largest weight (output x input elements) dequantized as scratch: 128 MiB in bf16. The
#: LM head (248320 x 2048) stays on ``quantized_matmul``.
MAX_WEIGHT_ELEMENTS = 1 << 26

_DTYPES = (mx.bfloat16, mx.float16)


def qmm_dequant_reference(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array,
                          group_size: int, bits: int, mode: str = "affine") -> mx.array:
    """``x [..., K]`` times the affine-quantized ``w [O, K*bits/32]`` transposed
    (``scales``/``biases`` ``[O, K/group_size]``): MLX's ``quantized_matmul``.
    Returns ``[..., O]`` in MLX's result dtype."""
    return mx.quantized_matmul(x, w, scales=scales, biases=biases, transpose=True,
                               group_size=group_size, bits=bits, mode=mode)


def has_kernel(backend: str) -> bool:
    """True when the dequantize + matmul path may serve on ``backend``."""
    return backend in MIN_ROWS and kernels.kernels_allowed(NAME, backend)


def has_shared_kernel(backend: str) -> bool:
    """True when ``layouts.mlp`` may run the shared expert through this path on
    ``backend`` (both switches allowed)."""
    return has_kernel(backend) and kernels.kernels_allowed(SHARED_NAME, backend)


def shared_stack_open() -> bool:
    """True when the shared expert's gate and up may run as one stacked projection
    (``stacked_linear``) here: switch ``shared_dequant`` on and allowed, with
    ``prefill_dequant``, on the current backend."""
    return op_enabled(SHARED_NAME) and has_shared_kernel(current_backend())


def supports(x: mx.array, w: mx.array, scales, biases, group_size, bits, mode,
             backend: str) -> bool:
    """True when the path computes this call on ``backend``: enough rows, a weight of at
    least ``MIN_OUT`` rows and at most ``MAX_WEIGHT_ELEMENTS``, affine mode with biases, 4 or 8 bits, and ``x`` in the
    scales' dtype (bf16 or fp16)."""
    rows = x.size // x.shape[-1] if x.ndim and x.shape[-1] else 0
    return (rows >= MIN_ROWS.get(backend, 1 << 62) and (mode or "affine") == "affine"
            and w.ndim == 2 and w.shape[0] >= MIN_OUT
            and w.shape[0] * x.shape[-1] <= MAX_WEIGHT_ELEMENTS
            and biases is not None and scales is not None and bits in (4, 8)
            and x.dtype in _DTYPES and scales.dtype == x.dtype and biases.dtype == x.dtype
            and w.dtype == mx.uint32 and w.shape[1] * 32 == x.shape[-1] * bits)


def try_dequant(x, w, scales, biases, group_size, bits, mode="affine") -> mx.array | None:
    """``x @ dequantize(w)^T`` through ``mx.dequantize`` + ``mx.matmul`` when the switch
    is on and ``supports`` holds on the current backend, else None (the caller runs
    ``quantized_matmul``)."""
    backend = current_backend()
    if (not _path_open(x, backend)
            or not supports(x, w, scales, biases, group_size, bits, mode, backend)):
        return None
    wd = mx.dequantize(w, scales=scales, biases=biases, group_size=group_size, bits=bits)
    return mx.matmul(x, wd.T)


def _path_open(x: mx.array, backend: str) -> bool:
    """The switch is on for ``backend`` and ``x`` has ``MIN_ROWS`` rows (the checks that
    need no weight)."""
    rows = x.size // x.shape[-1] if x.ndim and x.shape[-1] else 0
    return (backend in MIN_ROWS and rows >= MIN_ROWS[backend] and op_enabled(NAME)
            and has_kernel(backend))


def linear(layer, x: mx.array) -> mx.array | None:
    """``try_dequant`` for a bias-free ``nn.QuantizedLinear`` ``layer``, else None."""
    import mlx.nn as nn

    if type(layer) is not nn.QuantizedLinear or "bias" in layer:
        return None
    return try_dequant(x, layer.weight, layer.scales, layer.get("biases"), layer.group_size,
                       layer.bits, getattr(layer, "mode", "affine"))


def stacked_linear(layers, x: mx.array) -> list | None:
    """``[layer(x) for layer in layers]`` as ONE ``try_dequant`` over the layers' stacked
    rows, for bias-free ``nn.QuantizedLinear`` layers of one quantization (group size,
    bits, mode, input width, dtypes) that read the same ``x [..., K]``: the packed
    weights, scales and biases are concatenated per call (the shared expert's gate and
    up: 1 MiB), so ``MIN_OUT`` applies to the stacked outputs and one dense matmul runs
    instead of one per layer. Returns the outputs ``[..., O_i]`` split per layer, in
    ``x``'s dtype (``try_dequant``'s), or None where the layers do not qualify or
    ``try_dequant`` does not serve (any concatenation built then is never evaluated).
    Raises nothing of its own."""
    import mlx.nn as nn

    if not layers or not _path_open(x, current_backend()):
        return None

    def quant(layer):
        return (layer.group_size, layer.bits, getattr(layer, "mode", "affine"),
                layer.weight.shape[1], layer.weight.dtype, layer.scales.dtype,
                layer.biases.dtype)

    if any(type(l) is not nn.QuantizedLinear or "bias" in l or l.get("biases") is None
           for l in layers) or len({quant(l) for l in layers}) != 1:
        return None
    first = layers[0]
    cat = (lambda name: getattr(first, name)) if len(layers) == 1 else \
        (lambda name: mx.concatenate([getattr(l, name) for l in layers], axis=0))
    y = try_dequant(x, cat("weight"), cat("scales"), cat("biases"), first.group_size,
                    first.bits, getattr(first, "mode", "affine"))
    if y is None:
        return None
    if len(layers) == 1:
        return [y]
    cuts = []
    for l in layers[:-1]:
        cuts.append((cuts[-1] if cuts else 0) + int(l.weight.shape[0]))
    return mx.split(y, cuts, axis=-1)


def qmm_dequant(x, w, scales, biases, group_size, bits, mode="affine") -> mx.array:
    """Dispatcher: the dequantize + matmul path where it serves, else the reference."""
    y = try_dequant(x, w, scales, biases, group_size, bits, mode)
    return y if y is not None else qmm_dequant_reference(x, w, scales, biases, group_size,
                                                         bits, mode)
