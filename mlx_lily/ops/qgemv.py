"""Quantized GEMV: ``y = x @ dequant(w)^T`` for a few activation rows (batch-1 decode).

Contract (``qgemv_reference``): exactly ``mx.quantized_matmul(x, w, scales, biases,
transpose=True, group_size, bits)`` for MLX affine quantization (``w [O, K*bits/32]``
uint32, value j of a word at bits ``[bits*j, bits*j+bits)``, ``w = scale*q + bias`` per
group of ``group_size`` along K). The kernel (``lily_qgemv``, ``shaders/*/qgemv.*``)
serves 4- and 8-bit, group 32/64/128, up to ``MAX_ROWS`` rows: each group of lanes reads
a weight row with 16-byte loads (Metal: 8-byte with ``MLX_LILY_QGEMV_BPL=8``, the
pattern of MLX's ``qmv_fast``) and accumulates ``scale*dot(q, x) + bias*sum(x)`` per
quantization group in fp32 (the MLX qmv formulation), one reduction per output row.
Source: MLX affine quantization (``mx.quantize``); row-parallel GEMV of Lily's decode.

On CUDA, ``lily_qgemv_mma`` (``shaders/cuda/qgemv_mma.cu``, ``MLX_LILY_QGEMV_MMA=1`` or
qualification's ``mma`` variant) serves the same contract for 4-bit weights on tensor
cores: 16 weight rows by all of the step's rows per ``mma.sync.m16n8k16`` (PTX ISA
fragment layout), the 4-bit values built exactly in bf16/f16 (as the grouped MoE GEMMs
do, ``moeg_common.cuh``), ``scale*dot + bias*sum(x)`` per 64-value chunk in fp32.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from .. import kernels
from ..backend import current_backend, op_enabled
from ..registry import switch_on

BATCH_OP = "batch_decode"

NAME = "qgemv"

SPEC = kernels.KernelSpec(
    name="lily_qgemv", stem="qgemv",
    inputs=("x", "w", "scales", "biases"), outputs=("y",))

#: The tensor-core form (CUDA, ``MLX_LILY_QGEMV_MMA=1``; the same contract, no Metal twin):
#: ``shaders/cuda/qgemv_mma.cu``. Each weight tile is read once for all rows.
MMA_SPEC = kernels.KernelSpec(
    name="lily_qgemv_mma", stem="qgemv_mma",
    inputs=("x", "w", "scales", "biases"), outputs=("y",))

#: Largest number of activation rows the kernel takes (it re-reads W once per row).
MAX_ROWS = 8
#: Warps an mma launch aims for in all (about 16 per SM on the H200's 132), and the most
#: warps (K splits) one of its blocks takes (``mma_warps``).
MMA_TARGET_WARPS = 2048
MMA_MAX_NW = 16
#: 16-row m-tiles one warp of the mma kernel computes per chunk (1, 2 or 4: the rows'
#: x fragments and chunk sums are shared by them).
MMA_RT = 1
#: Launch shape: warps per threadgroup and output rows per lane group (``launch_shape``;
#: on Metal ``MLX_LILY_QGEMV_SHAPE`` replaces it).
NW = 4
RPW = 4
#: Weight bytes a lane loads per step, per backend (the Metal kernels' ``BPL`` template:
#: 16 = uint4, 8 = uint2 as MLX's ``qmv_fast``; ``MLX_LILY_QGEMV_BPL``). The CUDA twin
#: takes no BPL (always 16).
BYTES_PER_LANE: dict = {"metal": 16}
#: Fewest threadgroups ``launch_shape`` spreads a small-O GEMV over, per backend (none
#: set). Measured against: ncu on the H200 read 17.1 us per call for the
#: 8-bit router + shared gate (2048 -> 257, ``norm_qgemv``) on 17 threadgroups (NW 4,
#: RPW 4) and 23.3 us on 129 (NW 2, RPW 1, from MIN_BLOCKS 128): every threadgroup pays
#: the norm prologue.
MIN_BLOCKS: dict = {}
#: Most 16-byte weight words a lane holds at once (the CUDA body loads all of a lane's
#: words before its math): ``launch_shape`` lowers RPW to ``cap // steps`` per backend.
#: H200 (``moe_decode_bench.py``, device-side us per call, dependent chains):
#: out_proj 4096 -> 2048 (4 steps) NW 4 RPW 2 6.3 vs RPW 4 8.5; 8-bit router 2048 -> 257
#: (4 steps) 6.2 vs 6.9; 2-step shapes (q|k|v, in_proj) best at RPW 4 (7.4, 8.4).
MAX_WORDS_PER_LANE: dict = {"cuda": 8}
#: Whether ``QProj.__call__`` routes one-row inputs to this kernel, per backend. The
#: GPU bench (``benchmarks/gpu/moe_decode_bench.py``) prints kernel vs MLX qmv times;
#: flip an entry to False where MLX's own qmv is faster.
USE_FOR_QPROJ = {"metal": True, "cuda": True}

_FLOATS = (mx.bfloat16, mx.float16, mx.float32)


def qgemv_reference(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array,
                    group_size: int, bits: int) -> mx.array:
    """``x [..., K]`` times the affine-quantized ``w [O, K*bits/32]`` transposed.

    Args:
        x: activations (any float dtype); ``scales``/``biases``: ``[O, K/group_size]``.
    Returns:
        ``[..., O]`` in x's dtype (MLX's rule for ``quantized_matmul``).
    """
    return mx.quantized_matmul(x, w, scales=scales, biases=biases, transpose=True,
                               group_size=group_size, bits=bits)


def lanes_per_row(k: int, bits: int, bpl: int = 16) -> int | None:
    """Lanes that share one weight row of ``k`` inputs (``bpl``-byte words per row,
    capped at 32), or None when the row does not map onto whole aligned lane groups."""
    if bits not in (4, 8) or bpl not in (8, 16):
        return None
    vpl = 8 * bpl // bits
    if k % vpl:
        return None
    kw = k // vpl
    lpr = min(kw, 32)
    if lpr & (lpr - 1) or kw % lpr:
        return None
    return lpr


def rows_per_block(k: int, bits: int, nw: int = NW, rpw: int = RPW, bpl: int = 16) -> int:
    """Output rows one threadgroup computes: warps x lane groups per warp x rows each."""
    return nw * (32 // lanes_per_row(k, bits, bpl)) * rpw


def words_per_lane(k: int, bits: int) -> int | None:
    """16-byte weight words one lane reads per weight row of ``k`` inputs at ``bits``
    (the kernels' STEPS: the row's words over ``lanes_per_row`` lanes), or None when the
    row does not map onto lane groups."""
    lpr = lanes_per_row(k, bits)
    return None if lpr is None else k * bits // 128 // lpr


def launch_shape(k: int, o: int, bits: int, backend: str) -> tuple[int, int]:
    """``(NW, RPW)`` for an ``o``-row GEMV over ``k`` inputs on ``backend``: on Metal
    ``MLX_LILY_QGEMV_SHAPE`` when set; else ``(NW, RPW)`` with RPW capped by
    ``MAX_WORDS_PER_LANE[backend]``, then RPW and after it NW halved while the grid has
    fewer than ``MIN_BLOCKS[backend]`` threadgroups (small ``o``: the router). Raises
    ValueError when ``k``/``bits`` do not map onto lane groups (``lanes_per_row``)."""
    steps = words_per_lane(k, bits)
    if steps is None:
        raise ValueError(f"qgemv: K={k} at {bits} bits does not map onto lane groups")
    if backend == "metal":
        from .. import tuning

        if tuning.qgemv_shape is not None:
            return tuning.qgemv_shape
    nw, rpw = NW, RPW
    cap = MAX_WORDS_PER_LANE.get(backend)
    if cap:
        rpw = max(1, min(rpw, cap // steps))
    want = MIN_BLOCKS.get(backend, 0)
    while -(-o // rows_per_block(k, bits, nw, rpw)) < want and rpw > 1:
        rpw //= 2
    while -(-o // rows_per_block(k, bits, nw, rpw)) < want and nw > 1:
        nw //= 2
    return nw, rpw


def bytes_per_lane(backend: str) -> int:
    """The Metal kernels' ``BPL`` on ``backend``: ``MLX_LILY_QGEMV_BPL`` on Metal when
    set, else ``BYTES_PER_LANE[backend]`` (16 where unset)."""
    if backend == "metal":
        from .. import tuning

        if tuning.qgemv_bpl is not None:
            return tuning.qgemv_bpl
    return BYTES_PER_LANE.get(backend, 16)


def launch_knobs(backend: str) -> tuple | bool | None:
    """What the launch knobs give on ``backend``, for launch-plan cache keys: on Metal
    ``(MLX_LILY_QGEMV_SHAPE, MLX_LILY_QGEMV_BPL)`` parsed (None where unset), on CUDA
    ``MLX_LILY_QGEMV_MMA``'s value; None on other backends (no knob acts there)."""
    from .. import tuning

    if backend == "cuda":
        return use_mma(backend)
    if backend != "metal":
        return None
    return tuning.qgemv_shape, tuning.qgemv_bpl


def decode_rows(x: mx.array) -> int | None:
    """Rows of ``x [..., K]`` when it is one token per sequence (``[K]``, ``[B, K]`` with
    B == 1, or ``[..., 1, K]``: a decode step of B <= ``MAX_ROWS`` sequences), else None
    (prefill chunks of any length, and more rows than the kernel takes). Routing by this
    instead of by the row count alone keeps a sequence's projections on the same path at
    every batch size: a decode row always takes the GEMV, a prefill row never does. More
    than one row only while the ``batch_decode`` switch is on and allowed."""
    k = x.shape[-1] if x.ndim else 0
    if not k:
        return None
    rows = x.size // k
    if rows == 1:
        return 1
    if (x.ndim >= 3 and x.shape[-2] == 1 and rows <= MAX_ROWS
            and switch_on(BATCH_OP, current_backend())):
        return rows
    return None


def supports(x: mx.array, w: mx.array, scales: mx.array, biases, group_size: int,
             bits: int, mode: str = "affine") -> bool:
    """True when the kernel computes this call (shapes, dtypes, quantization mode)."""
    if mode != "affine" or biases is None or bits not in (4, 8):
        return False
    if group_size not in (32, 64, 128) or x.dtype not in _FLOATS:
        return False
    if scales.dtype not in _FLOATS or biases.dtype != scales.dtype:
        return False
    if w.dtype != mx.uint32 or w.ndim != 2 or scales.ndim != 2:
        return False
    k = x.shape[-1]
    o = w.shape[0]
    if w.shape[1] * 32 != k * bits or scales.shape != (o, k // group_size):
        return False
    if biases.shape != scales.shape or k % group_size or lanes_per_row(k, bits) is None:
        return False
    rows = x.size // k if k else 0
    return 1 <= rows <= MAX_ROWS and w.size >= 8


def launch_args(x_shape, x_dtype, w, scales, group_size: int, bits: int, *,
                nw: int | None = None, rpw: int | None = None, bpl: int | None = None,
                init_value: float | None = None, extra_outputs=()) -> dict:
    """Template, grid, threadgroup and output shapes/dtypes of a ``lily_qgemv``-family
    launch (``lily_norm_qgemv`` shares them) for activations ``x_shape`` of ``x_dtype``;
    ``nw``/``rpw`` default to ``launch_shape``, ``bpl`` (16 or 8) to ``bytes_per_lane`` on
    the current backend; ``extra_outputs``: ``(shape, dtype)`` pairs after ``y``. The
    template has ``BPL`` except on CUDA (its twin has none: a ``bpl`` other than 16 is
    a ValueError there); "cpu" is the emulators'."""
    k = x_shape[-1]
    o = w.shape[0]
    backend = current_backend()
    if nw is None or rpw is None:
        nw0, rpw0 = launch_shape(k, o, bits, backend)
        nw, rpw = nw or nw0, rpw or rpw0
    bpl = bytes_per_lane(backend) if bpl is None else bpl
    if bpl not in (8, 16) or (backend == "cuda" and bpl != 16):
        raise ValueError(f"qgemv: no {bpl}-byte weight loads on {backend}")
    lead = tuple(x_shape[:-1])
    n = 1
    for s_ in lead:
        n *= s_
    tg = 32 * nw
    nb = -(-o // rows_per_block(k, bits, nw, rpw, bpl))
    template = [("T", x_dtype), ("S", scales.dtype), ("K", k), ("O", o), ("BITS", bits),
                ("GS", group_size), ("NW", nw), ("RPW", rpw)]
    if backend != "cuda":
        template.append(("BPL", bpl))
    kw = dict(template=template,
              grid=(nb * tg, n, 1), threadgroup=(tg, 1, 1),
              output_shapes=[lead + (o,)] + [sh for sh, _ in extra_outputs],
              output_dtypes=[x_dtype] + [dt for _, dt in extra_outputs])
    if init_value is not None:
        kw["init_value"] = init_value
    return kw


def plan(kernel, x_shape, x_dtype, w: mx.array, scales: mx.array, biases: mx.array,
         group_size: int, bits: int, *, nw: int | None = None, rpw: int | None = None,
         bpl: int | None = None, init_value: float | None = None):
    """A callable ``run(x) -> y`` launching the kernel object for inputs of one shape
    and dtype (template, grid and output shape worked out once)."""
    kw = launch_args(x_shape, x_dtype, w, scales, group_size, bits, nw=nw, rpw=rpw,
                     bpl=bpl, init_value=init_value)
    return _runner(kernel, kw, w, scales, biases)


def _runner(kernel, kw: dict, w, scales, biases):
    """``run(x) -> y``: one launch of ``kernel`` on ``[x, w, scales, biases]`` with the
    launch arguments ``kw`` (``launch_args`` or ``mma_launch_args``)."""

    def run(x):
        return kernel(inputs=[x, w, scales, biases], **kw)[0]

    return run


def launch(kernel, x: mx.array, w: mx.array, scales: mx.array, biases: mx.array,
           group_size: int, bits: int, *, nw: int | None = None, rpw: int | None = None,
           bpl: int | None = None, init_value: float | None = None) -> mx.array:
    """Run the ``lily_qgemv`` kernel object ``kernel`` (either backend, or the Metal
    emulator's) on a call ``supports`` accepted; returns ``[..., O]`` in x's dtype."""
    return plan(kernel, x.shape, x.dtype, w, scales, biases, group_size, bits, nw=nw,
                rpw=rpw, bpl=bpl, init_value=init_value)(x)


def use_mma(backend: str) -> bool:
    """Whether decode GEMVs take the tensor-core kernel on ``backend``: CUDA only, under
    the benchmarking knob ``MLX_LILY_QGEMV_MMA=1`` (``tuning.qgemv_mma``, also set by a
    qualification record's ``mma`` variant), on a GPU of compute capability 8.0 or
    later (``mma.sync`` on bf16) or one whose capability is unknown."""
    if backend != "cuda":
        return False
    from .. import tuning

    return bool(tuning.qgemv_mma) and _mma_capable()


def mma_serves(backend: str, x: mx.array, w, scales, biases, group_size: int, bits: int,
               mode: str = "affine") -> bool:
    """True when a decode GEMV of ``x`` on this weight takes ``lily_qgemv_mma`` on
    ``backend`` (``use_mma`` and ``mma_supports``). Projections with a pending residual
    add + RMSNorm then run ``add_rms_norm`` and this kernel (``norm_qgemv.for_qproj``),
    and the GDN decode kernel leaves its input projection to them (``gdn_proj`` steps
    aside): the fused forms read a weight row once per activation row."""
    return use_mma(backend) and mma_supports(x, w, scales, biases, group_size, bits, mode)


@functools.lru_cache(maxsize=1)
def _mma_capable() -> bool:
    from .. import cuda_cache

    arch = cuda_cache.device_arch()
    return arch is None or tuple(arch) >= (8, 0)


def mma_supports(x: mx.array, w: mx.array, scales: mx.array, biases, group_size: int,
                 bits: int, mode: str = "affine") -> bool:
    """True when ``lily_qgemv_mma`` computes this call: affine 4-bit weights ``w [O, K/8]``
    uint32 with bias, groups of 64 or 128 along K (K a multiple of the group), scales
    and biases ``[O, K/group]`` of one float dtype, bf16 or f16 activations, 1 to
    ``MAX_ROWS`` rows."""
    if mode != "affine" or biases is None or bits != 4 or group_size not in (64, 128):
        return False
    if x.dtype not in (mx.bfloat16, mx.float16) or w.dtype != mx.uint32 or w.ndim != 2:
        return False
    if scales.dtype not in _FLOATS or biases.dtype != scales.dtype or scales.ndim != 2:
        return False
    k = x.shape[-1] if x.ndim else 0
    o = w.shape[0]
    if not k or k % group_size or w.shape[1] * 8 != k:
        return False
    if scales.shape != (o, k // group_size) or biases.shape != scales.shape:
        return False
    return 1 <= x.size // k <= MAX_ROWS


def mma_warps(k: int, o: int, rt: int = MMA_RT) -> int:
    """Warps per block of an ``o``-row, ``k``-input mma launch (K split over them): the
    smallest power of two giving ``MMA_TARGET_WARPS`` warps over the ``ceil(o/(16*rt))``
    blocks, at most ``MMA_MAX_NW`` and at most half the row's 64-wide chunks (one when a
    row has one chunk). It does not depend on the number of activation rows, so a row
    gets the same arithmetic at every batch size."""
    blocks = -(-o // (16 * rt))
    cap = max(1, min(MMA_MAX_NW, (k // 64) // 2))
    nw = 1
    while nw * 2 <= cap and blocks * nw < MMA_TARGET_WARPS:
        nw *= 2
    return nw


def mma_launch_args(x_shape, x_dtype, w, scales, group_size: int, bits: int, *,
                    nw: int | None = None, rt: int | None = None,
                    init_value: float | None = None) -> dict:
    """Template, grid, threadgroup and output shape/dtype of a ``lily_qgemv_mma`` launch
    for activations ``x_shape`` (``[..., K]``, N <= ``MAX_ROWS`` rows in all) of
    ``x_dtype``; ``rt`` (m-tiles per warp) defaults to ``MMA_RT``, ``nw`` to
    ``mma_warps``."""
    k = x_shape[-1]
    o = w.shape[0]
    lead = tuple(x_shape[:-1])
    n = 1
    for s_ in lead:
        n *= s_
    rt = rt or MMA_RT
    nw = nw or mma_warps(k, o, rt)
    kw = dict(template=[("T", x_dtype), ("S", scales.dtype), ("K", k), ("O", o),
                        ("BITS", bits), ("GS", group_size), ("N", n), ("NW", nw),
                        ("RT", rt)],
              grid=(-(-o // (16 * rt)) * 32 * nw, 1, 1), threadgroup=(32 * nw, 1, 1),
              output_shapes=[lead + (o,)], output_dtypes=[x_dtype])
    if init_value is not None:
        kw["init_value"] = init_value
    return kw


def mma_plan(kernel, x_shape, x_dtype, w, scales, biases, group_size: int, bits: int, *,
             nw: int | None = None, rt: int | None = None, init_value: float | None = None):
    """``plan`` for the ``lily_qgemv_mma`` kernel object: a callable ``run(x) -> y``."""
    kw = mma_launch_args(x_shape, x_dtype, w, scales, group_size, bits, nw=nw, rt=rt,
                         init_value=init_value)
    return _runner(kernel, kw, w, scales, biases)


def plan_for(backend: str, x: mx.array, w, scales, biases, group_size: int, bits: int,
             mode: str = "affine"):
    """The launch plan (``run(x) -> y``) serving inputs shaped as ``x`` on ``backend``:
    the tensor-core kernel where ``use_mma`` and ``mma_supports`` allow and its kernel
    object is allowed (``kernels.get``; it compiles at its first launch), else
    ``lily_qgemv`` where ``supports`` allows; None when neither serves."""
    if use_mma(backend) and mma_supports(x, w, scales, biases, group_size, bits, mode):
        kern = kernels.get(MMA_SPEC, backend)
        if kern is not None:
            return mma_plan(kern, x.shape, x.dtype, w, scales, biases, group_size, bits)
    if supports(x, w, scales, biases, group_size, bits, mode):
        kern = kernels.get(SPEC, backend)
        if kern is not None:
            return plan(kern, x.shape, x.dtype, w, scales, biases, group_size, bits)
    return None


def has_kernel(backend: str) -> bool:
    """True when the GEMV kernel can run on ``backend`` here."""
    return backend in ("metal", "cuda") and kernels.get(SPEC, backend) is not None


#: The switch of routing a one-token step's output projections (GDN ``out_proj``,
#: attention ``o_proj``) through this kernel (``patches.qwen3_next.one_row_linear``).
OUT_PROJ_OP = "qgemv_out"


def has_out_proj_kernel(backend: str) -> bool:
    """True when the output projections' switch ``qgemv_out`` can run the kernel on
    ``backend`` here."""
    return has_kernel(backend) and kernels.kernels_allowed(OUT_PROJ_OP, backend)


def try_kernel(x, w, scales, biases, group_size, bits, mode="affine") -> mx.array | None:
    """The kernel's result when it serves this call on the current backend, else None."""
    backend = current_backend()
    if backend not in ("metal", "cuda") or not op_enabled(NAME):
        return None
    run = plan_for(backend, x, w, scales, biases, group_size, bits, mode)
    return None if run is None else run(x)


def qgemv(x, w, scales, biases, group_size, bits):
    """Dispatcher: the GEMV kernel for few-row inputs it supports, else the reference."""
    y = try_kernel(x, w, scales, biases, group_size, bits)
    return y if y is not None else qgemv_reference(x, w, scales, biases, group_size, bits)


def for_qproj(x: mx.array, proj) -> mx.array | None:
    """``QProj.__call__``'s fast path: the kernel's ``[..., out]`` for a one-row input of
    a quantized projection when it serves on this backend and ``USE_FOR_QPROJ`` allows,
    else None (the caller runs ``mx.quantized_matmul``). The decision and launch
    parameters are cached on the projection per (backend, shape, dtype, launch knobs:
    ``launch_knobs``; a qualification's variants run in one process). A decode step
    of B sequences (``x [B, 1, in]``, ``decode_rows``) runs the same kernel with B rows:
    each row's arithmetic is the one-row GEMV's (``lily_qgemv``, or ``lily_qgemv_mma``
    under ``MLX_LILY_QGEMV_MMA=1`` on CUDA: ``plan_for``)."""
    if decode_rows(x) is None:
        return None
    backend = current_backend()
    if (not USE_FOR_QPROJ.get(backend, False) or not switch_on(NAME, backend)
            or not kernels.stock_result_dtype(x.dtype, proj.scales.dtype)):
        return None
    plans = kernels.plan_cache(proj, "_lily_qgemv_plans")
    key = (backend, x.shape, x.dtype, launch_knobs(backend))
    run = plans.get(key, False)
    if run is False:
        run = plans[key] = plan_for(backend, x, proj.weight, proj.scales, proj.biases,
                                    proj.group_size, proj.bits, proj.mode or "affine")
    return run(x) if run is not None else None
