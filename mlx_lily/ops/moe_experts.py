"""Routed-expert SwiGLU with score-weighted combine plus the sigmoid-gated shared expert.

Contract (``moe_experts_reference``), matching mlx-lm's ``Qwen3NextSparseMoeBlock`` after
routing: ``y = sum_j scores[..., j] * down_e(silu(gate_e(x)) * up_e(x))`` over the k
chosen experts ``e = inds[..., j]`` (4-bit affine, group 64, bf16 scales/biases in MLX
checkpoints), plus ``shared * shared_expert(x)`` when a shared expert exists. The decode
form is one row per call (a GEMV per expert); the prefill form groups rows by expert
(``moe_route``) for a grouped GEMM; both compute the same function.

Decode kernels (two launches; expert ids stay on the GPU):
``lily_moe_gate_up`` computes, for each row and each of the k routed experts plus the
shared expert (slot k), the 4/8-bit GEMVs gate and up (rounded to the activation dtype as
mlx-lm's ``gather_qmm`` outputs are) and ``h = silu(gate) * up`` -> ``h [N, k+1, I]``;
``lily_moe_down`` computes the k+1 down GEMVs of h weighted by the scores and the shared
gate, summed per lane in fp32 and reduced once -> ``y [N, D]`` (optionally
``residual + y``, the decoder layer's add). Both read weights with 16-byte loads and
accumulate ``scale*dot(q, x) + bias*sum(x)`` per quantization group in fp32.
Source: SwiGLU (Shazeer 2020); Qwen3.5 MoE block; Lily's fused expert chains.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import mlx.core as mx

from .. import kernels
from ..backend import current_backend
from . import qgemv

NAME = "moe_experts"


def moe_experts_reference(x: mx.array, inds: mx.array, scores: mx.array,
                          routed: Callable, shared_mlp: Callable | None,
                          shared: mx.array | None, residual: mx.array | None = None
                          ) -> mx.array:
    """Experts' output for each row of ``x``.

    Args:
        x: ``[..., D]`` activations; ``inds``: ``[..., k]`` uint32 expert ids;
        scores: ``[..., k]`` routing weights; ``routed``: the routed experts
        ``(x, inds) -> [..., k, D]`` (mlx-lm's ``SwitchGLU``); ``shared_mlp``: the shared
        expert ``[..., D] -> [..., D]`` or None; ``shared``: ``[..., 1]`` sigmoid gate of
        the shared expert or None; residual: ``[..., D]`` added to the result when given
        (the decoder layer's ``h + mlp(n)``).
    Returns:
        ``[..., D]`` in the activation dtype.
    """
    y = routed(x, inds)
    y = (y * scores[..., None]).sum(axis=-2)
    if shared_mlp is not None:
        s = shared_mlp(x)
        y = y + (shared * s if shared is not None else s)
    if residual is not None:
        y = residual + y
    return y


GATE_UP_SPEC = kernels.KernelSpec(
    name="lily_moe_gate_up", stem="moe_gate_up",
    inputs=("x", "inds", "gate_w", "gate_s", "gate_b", "up_w", "up_s", "up_b",
            "sgate_w", "sgate_s", "sgate_b", "sup_w", "sup_s", "sup_b",
            "logits", "hin", "res", "nw", "eps"),
    outputs=("h", "inds_o", "scores_o", "shared_o"))
#: The switch of routing inside the gate+up kernel (``moe_experts_routed``): router
#: logits from the multi-block GEMV (``qgemv`` / ``norm_qgemv``), softmax + top-k in
#: every gate+up threadgroup, instead of the one-threadgroup router kernel.
TOPK_OP = "moe_topk_in_experts"
DOWN_SPEC = kernels.KernelSpec(
    name="lily_moe_down", stem="moe_down",
    inputs=("h", "inds", "scores", "shared", "down_w", "down_s", "down_b",
            "sdown_w", "sdown_s", "sdown_b", "res"),
    outputs=("y",))

#: One launch for the whole decode MoE block (CUDA): router GEMV with the add+norm
#: prologue, gate+up with routing, down + combine, as three phases of one grid ordered by
#: tickets (``shaders/cuda/moe_decode.cu``). Template T, S, N, D, I, K, E, BITS, GS, RBITS,
#: RGS (router bits and group), RRPW, GRPW, DRPW (rows per lane group of each phase),
#: NORM; grid (fused_tiles(...) * 128, 1, 1), threadgroup (128, 1, 1).
FUSED_SPEC = kernels.KernelSpec(
    name="lily_moe_decode", stem="moe_decode",
    inputs=("hin", "res", "nw", "eps", "rw", "rs", "rb",
            "gate_w", "gate_s", "gate_b", "up_w", "up_s", "up_b",
            "sgate_w", "sgate_s", "sgate_b", "sup_w", "sup_s", "sup_b",
            "down_w", "down_s", "down_b", "sdown_w", "sdown_s", "sdown_b", "counters",
            "after"),
    outputs=("y", "h", "work"))
#: The switch of the one-launch MoE block (``moe_experts_routed`` with counters).
FUSED_OP = "moe_fused"
#: int32 counters one fused launch uses (tickets, router tiles done, gate+up tiles done,
#: blocks done); every launch leaves them zero.
FUSED_COUNTERS = 4
#: Rows per lane group of the fused kernel's phases (router, gate+up, down), CUDA;
#: ``MLX_LILY_MOE_FUSED_RPW=r,g,d`` overrides them (benchmarking).
FUSED_RPW = (2, 4, 1)
FUSED_RPW_ENV = "MLX_LILY_MOE_FUSED_RPW"


def fused_rpw() -> tuple:
    """``FUSED_RPW``, or ``MLX_LILY_MOE_FUSED_RPW`` (``tuning.moe_fused_rpw``: three
    integers 1..8, comma-separated; another value warns once and keeps ``FUSED_RPW``)."""
    from .. import tuning

    v = tuning.moe_fused_rpw
    return FUSED_RPW if v is None else v
#: Threads per block of the fused kernel (4 warps in every phase).
FUSED_THREADS = 128

#: Most token rows the decode kernels take per call; more go to the grouped GEMM
#: (``moe_grouped.try_grouped``) or the reference.
MAX_DECODE_ROWS = 8
#: Launch shapes per kernel and backend: gate+up (warps per threadgroup NW, rows per lane
#: group RPW), down (NW, RPW, slot groups SL: SL*NW warps per threadgroup, each serving
#: every SL-th of the K+1 expert slots). The CUDA bodies hold every weight word of a
#: lane's rows in registers before the math, so RPW sets registers: gate+up
#: at RPW 8 needs 255 per thread, at 4 166. CUDA, H200 (``moe_decode_bench.py``,
#: routed path, 40 chained layers, device-side us per layer for gate+up + down (4,2,3)):
#: gate+up (4,4) 30.9 and 25.0 in two runs, (4,2) 30.5, (8,2) 26.3, (8,1) 29.8, (4,1) 32.5,
#: (2,4) 29.9, (4,8) 36.1; down at gate+up (4,4): (4,2,1) 35.0, (4,1,3) 30.6, (4,4,3)
#: 29.9, (2,2,9) 30.6, (8,1,3) 31.7, (2,1,9) 31.2. Differences under the ~6 us spread of
#: the repeated default are not acted on; ncu read 13.8 us per gate+up call and 24.6 per
#: down call at these defaults (4K decode step).
GATE_UP_SHAPE = {"cuda": (4, 4), "metal": (4, 4)}
DOWN_SHAPE = {"cuda": (4, 2, 3), "metal": (4, 2, 1)}
#: Most threads per threadgroup a launch shape may ask for (CUDA's limit; Metal's shapes
#: stay at 128 threads).
MAX_THREADS = 1024
#: Warps per gate+up threadgroup on every backend (its threadgroup memory depends on it).
GATE_UP_NW = 4
assert all(nw == GATE_UP_NW for nw, _ in GATE_UP_SHAPE.values())


#: Down launch shapes by slot groups, for the qualifier's variants (``mlx_lily.variants``;
#: ``MLX_LILY_MOE_DOWN_SHAPE``): SL 1 (each simdgroup walks the 9 slots of Qwen3.6's top-8
#: + shared expert: Metal's default), 3 (CUDA's default), 9 (one slot per simdgroup; NW 2
#: keeps 576 threads).
DOWN_SLOT_SHAPES = {1: (4, 2, 1), 3: (4, 2, 3), 9: (2, 2, 9)}


def launch_shapes(backend: str) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """``((NW, RPW) of gate+up, (NW, RPW, SL) of down)`` for ``backend`` (Metal's off
    CUDA); ``MLX_LILY_MOE_DOWN_SHAPE`` (``tuning.moe_down_shape``) replaces the down
    shape on every backend."""
    from .. import tuning

    b = backend if backend in GATE_UP_SHAPE else "metal"
    dn = tuning.moe_down_shape
    return GATE_UP_SHAPE[b], DOWN_SHAPE[b] if dn is None else tuple(dn)


#: CUDA register estimate of the decode kernels, whose bodies hold every 16-byte weight
#: word of a lane's rows in registers (``LilyRowTile``): registers per thread = BASE +
#: PER_WORD * words, fitted to nvcc 13 (sm_90a) counts: gate+up 96 / 166 /
#: 255 at 8 / 16 / 32 words, down 63 / 94 / 128 at 3 / 6 / 12 words; a launch may use at
#: most min(255, 65536 / threads). Shapes over it lower RPW (``fit_launch_shapes``) or
#: take the reference path: "too many resources requested for launch" otherwise.
REG_MODEL = {"gate_up": (30, 9), "down": (40, 9)}


def _lane_words(k_in: int, bits: int, rpw: int, per_row: int = 1) -> int:
    """16-byte weight words one lane holds: ``per_row`` rows' worth of its ``rpw`` rows
    over ``k_in`` inputs."""
    return per_row * qgemv.words_per_lane(k_in, bits) * rpw


def _fits(kind: str, words: int, threads: int) -> bool:
    base, per = REG_MODEL[kind]
    return base + per * words <= min(255, 65536 // threads)


def fit_launch_shapes(d: int, i: int, k: int, bits: int, backend: str,
                      gate_up=None, down=None):
    """``(gate_up, down)`` launch shapes for hidden ``d``, intermediate ``i``, top-``k``:
    the backend's (or the given) shapes, on CUDA with RPW halved while ``REG_MODEL``
    says a thread needs more registers than the launch allows. None when even RPW 1 does
    not fit, or when ``d``/``i`` do not map onto lane groups (the caller takes the
    reference path)."""
    gu0, dn0 = launch_shapes(backend)
    nw, rpw = gate_up or gu0
    dn = tuple(down or dn0)
    nwd, rpwd, sl = dn if len(dn) == 3 else (*dn, 1)
    if qgemv.lanes_per_row(d, bits) is None or qgemv.lanes_per_row(i, bits) is None:
        return None
    if backend != "cuda":
        return (nw, rpw), (nwd, rpwd, sl)
    ns = -(-(k + 1) // sl)  # expert slots one down warp walks
    while rpw > 1 and not _fits("gate_up", _lane_words(d, bits, rpw, 2), 32 * nw):
        rpw //= 2
    while rpwd > 1 and not _fits("down", _lane_words(i, bits, rpwd, ns), 32 * nwd * sl):
        rpwd //= 2
    if not (_fits("gate_up", _lane_words(d, bits, rpw, 2), 32 * nw)
            and _fits("down", _lane_words(i, bits, rpwd, ns), 32 * nwd * sl)):
        return None
    return (nw, rpw), (nwd, rpwd, sl)

_FLOATS = (mx.bfloat16, mx.float16, mx.float32)


class DecodeWeights(NamedTuple):
    """The arrays and quantization parameters the decode kernels read
    (``mlx_lily.patches.layouts.decode_weights`` builds it from mlx-lm's modules)."""

    gate: tuple  # (w [E, I, D*bits/32], scales, biases)
    up: tuple
    down: tuple  # (w [E, D, I*bits/32], scales, biases)
    sgate: tuple  # shared expert (w [I, D*bits/32], scales, biases)
    sup: tuple
    sdown: tuple  # (w [D, I*bits/32], scales, biases)
    num_experts: int
    hidden: int  # D
    inter: int  # I
    bits: int
    group_size: int


class Experts(NamedTuple):
    """One MoE block's experts as the MoE ops take them (``mlx_lily.patches.layouts.experts``
    builds it from mlx-lm's modules): the stock computations as callables, the arrays
    each kernel path reads, and the launch plans built for them."""

    routed: Callable  # stock routed experts: (x [..., D], inds [..., k]) -> [..., k, D]
    shared_mlp: Callable | None  # stock shared expert: [..., D] -> [..., D], or None
    shared_rows: Callable | None  # the shared expert for many rows (same function)
    decode: DecodeWeights | None  # None: the decode kernels do not implement the layout
    grouped: object  # moe_grouped.GroupedWeights, or why the grouped GEMM does not (str)
    plans: dict  # launch-plan caches by kind, for these arrays


def supports_decode(x: mx.array, inds: mx.array, scores: mx.array, shared,
                    wts: DecodeWeights | None, residual=None) -> bool:
    """True when the decode kernels compute this call (``wts``: ``Experts.decode``)."""
    if wts is None or shared is None or x.dtype not in _FLOATS:
        return False
    d = x.shape[-1]
    if d != wts.hidden or inds.shape[:-1] != x.shape[:-1]:
        return False
    k = inds.shape[-1]
    rows = x.size // d
    if not (1 <= rows <= MAX_DECODE_ROWS) or not (1 <= k <= wts.num_experts):
        return False
    if scores.shape != inds.shape or shared.size != rows:
        return False
    if residual is not None and residual.shape != x.shape:
        return False
    return fit_launch_shapes(d, wts.inter, k, wts.bits, current_backend()) is not None


def decode_plan(k_gate_up, k_down, wts: DecodeWeights, x_shape, x_dtype, k: int,
                with_residual: bool, *, gate_up=None, down=None,
                init_value: float | None = None,
                topk: bool = False, norm_topk_prob: bool = True, pre_norm: bool = False):
    """A callable launching the two decode kernels for inputs of one shape and dtype
    (templates, grids and output shapes worked out once). The kernels index flat
    row-major memory, so no reshapes (each would be a graph node); ids that are not
    uint32 and scores/gates/residual in another dtype are cast.

    Routing given: ``run(x, inds, scores, shared, residual=None) -> y``. With ``topk``
    the gate+up kernel routes each row itself from the router's logits ``[..., E+1]``
    (E experts, then the shared-expert gate; ``norm_topk_prob`` renormalises):
    ``run(x, logits) -> (y, inds, scores, shared)``, or with ``pre_norm`` (the row is
    ``rms_norm(hin + res) * nw``, computed in the kernel) ``run(hin, res, nw, eps,
    logits) -> (y, inds, scores, shared)``.
    """
    d, i = wts.hidden, wts.inter
    lead = tuple(x_shape[:-1])
    n = 1
    for s_ in lead:
        n *= s_
    dt = x_dtype
    common = [("T", dt), ("S", wts.gate[1].dtype), ("D", d), ("I", i), ("K", k),
              ("E", wts.num_experts), ("BITS", wts.bits), ("GS", wts.group_size)]
    extra = {} if init_value is None else {"init_value": init_value}

    if gate_up is None or down is None:
        fit = fit_launch_shapes(d, i, k, wts.bits, current_backend(), gate_up, down)
        if fit is None:
            raise ValueError(f"moe_experts: no launch shape fits the registers at D={d} "
                             f"I={i} k={k} ({wts.bits}-bit): the reference serves it")
        gate_up, down = fit
    nw, rpw = gate_up
    dn = tuple(down) if len(down) == 3 else (*down, 1)
    if (min(nw, rpw, *dn) < 1 or 32 * nw > MAX_THREADS
            or 32 * dn[0] * dn[2] > MAX_THREADS):
        raise ValueError(f"moe_experts: bad launch shape gate_up={tuple(gate_up)} "
                         f"down={tuple(down)} (each >= 1, at most {MAX_THREADS} threads)")
    tg = 32 * nw
    rpb = nw * (32 // qgemv.lanes_per_row(d, wts.bits)) * rpw
    # the shared gate: n values at the front of an (n * ROW_PAD,) buffer (kernels.ROW_PAD)
    route_shapes = ([lead + (k,), lead + (k,), (n * kernels.ROW_PAD,)] if topk
                    else [(1,), (1,), (1,)])
    kw1 = dict(template=common + [("NW", nw), ("RPW", rpw), ("TOPK", bool(topk)),
                                  ("NORM", bool(norm_topk_prob)),
                                  ("PRE_NORM", bool(pre_norm))],
               grid=(-(-i // rpb) * tg, k + 1, n), threadgroup=(tg, 1, 1),
               output_shapes=[(n, k + 1, i)] + route_shapes,
               output_dtypes=[dt, mx.uint32, dt, dt], **extra)
    nw, rpw, sl = dn
    tg = 32 * nw * sl
    rpb = nw * (32 // qgemv.lanes_per_row(i, wts.bits)) * rpw
    kw2 = dict(template=common + [("NW", nw), ("RPW", rpw), ("SL", sl),
                                  ("RES", bool(with_residual))],
               grid=(-(-d // rpb) * tg, n, 1), threadgroup=(tg, 1, 1),
               output_shapes=[lead + (d,)], output_dtypes=[dt], **extra)
    w1 = [*wts.gate, *wts.up, *wts.sgate, *wts.sup]
    w2 = [*wts.down, *wts.sdown]
    no_eps = kernels.f32_scalar(0.0)

    if topk:
        no_inds = mx.zeros((1,), dtype=mx.uint32)  # the unread inds input (uint32, its type)

        def run_routed(*args):
            if pre_norm:
                hin, res, nw_, eps, logits = args
                x = hin
                tail = [logits, hin, res, nw_, kernels.f32_scalar(eps)]
            else:
                x, logits = args
                tail = [logits, x, x, x, no_eps]
            h, inds, scores, shared = k_gate_up(inputs=[x, no_inds, *w1, *tail], **kw1)
            y = k_down(inputs=[h, inds, scores, shared, *w2, scores], **kw2)[0]
            return y, inds, scores, shared[:n].reshape(lead + (1,))

        return run_routed

    def run(x, inds, scores, shared, residual=None):
        ind = inds if inds.dtype == mx.uint32 else inds.astype(mx.uint32)
        sc = scores if scores.dtype == dt else scores.astype(dt)
        sh = shared if shared.dtype == dt else shared.astype(dt)
        if residual is None:
            res = sc  # placeholder, never read (RES=false)
        else:
            res = residual if residual.dtype == dt else residual.astype(dt)
        h = k_gate_up(inputs=[x, ind, *w1, x, x, x, x, no_eps], **kw1)[0]
        return k_down(inputs=[h, ind, sc, sh, *w2, res], **kw2)[0]

    return run


def launch_decode(k_gate_up, k_down, x, inds, scores, shared, wts: DecodeWeights,
                  residual=None, *, gate_up=None, down=None,
                  init_value: float | None = None):
    """Run the gate+up and down+combine kernel objects (either backend, or the Metal
    emulator's) on a call ``supports_decode`` accepted. Returns ``[..., D]`` in x's
    dtype (``residual + y`` when ``residual`` is given).

    Static cost of ``lily_moe_down`` at Qwen3.6-35B-A3B's decode shape (one row, D 2048,
    I 512, top-8 + shared = 9 slots, 4-bit group 64, bf16 scales): reads 4.72 MB of
    weights + 0.59 MB of scales/biases (each once) and h (9 KB, re-read by every
    threadgroup from cache), writes y (4 KB). Launch by down shape (NW, RPW, SL):
    (4, 2, 1) 128 threadgroups x 128 threads, 4 B threadgroup memory; (4, 2, 3) 128 x
    384, 192 B; (2, 2, 9) 256 x 576, 288 B (``DOWN_SLOT_SHAPES``). MLX competitor: the
    stock block's ``gather_qmm`` down (``gather_qmv_fast``: 8 rows per 64-thread
    threadgroup, 8 B of weights per lane per step, 2048 threadgroups for 8 experts) plus
    the shared expert's ``qmv_fast`` (256 threadgroups): the same 5.31 MB of weights,
    scales and biases, plus the ``[8, 2048]`` per-expert outputs written and re-read by
    the score-weighted sum (2 x 32 KB).
    """
    run = decode_plan(k_gate_up, k_down, wts, x.shape, x.dtype, inds.shape[-1],
                      residual is not None, gate_up=gate_up, down=down,
                      init_value=init_value)
    return run(x, inds, scores, shared, residual)


def has_kernel(backend: str) -> bool:
    """True when the decode kernels can run on ``backend`` here."""
    return (backend in ("metal", "cuda") and kernels.get(GATE_UP_SPEC, backend) is not None
            and kernels.get(DOWN_SPEC, backend) is not None)


def has_routed_kernel(backend: str) -> bool:
    """True when ``moe_experts_routed`` (routing inside the gate+up kernel) can run on
    ``backend`` here."""
    return has_kernel(backend) and kernels.kernels_allowed(TOPK_OP, backend)


_MAX_PLANS = 64


def _cached_plan(experts: Experts, attr: str, key: tuple, build):
    """The launch plan of kind ``attr`` cached in ``experts.plans`` for ``key``; on a miss
    ``build(experts.decode)`` makes it (None, cached too, when the kernels do not serve
    these shapes). A cache past ``_MAX_PLANS`` entries (many shapes) is emptied first."""
    plans = experts.plans.get(attr)
    if plans is None or len(plans) > _MAX_PLANS:
        plans = experts.plans[attr] = kernels.PlanCache()
    run = plans.get(key, False)
    if run is False:
        run = plans[key] = build(experts.decode)
    return run


def _decode_run(experts: Experts, x, inds, scores, shared, residual, backend):
    """The cached decode plan for this call, or None when the kernels do not serve it.

    Cached in ``experts`` per (backend, shapes, dtypes)."""
    def build(wts):
        if not supports_decode(x, inds, scores, shared, wts, residual):
            return None
        kg = kernels.get(GATE_UP_SPEC, backend)
        kd = kernels.get(DOWN_SPEC, backend)
        if kg is None or kd is None:
            return None
        return decode_plan(kg, kd, wts, x.shape, x.dtype, inds.shape[-1], residual is not None)

    key = (backend, x.shape, x.dtype, inds.shape, scores.shape,
           None if shared is None else shared.shape, None if residual is None else residual.shape,
           launch_shapes(backend))
    return _cached_plan(experts, "decode", key, build)


def prefill_chunk(x_shape) -> bool:
    """Whether activations of ``x_shape`` (``[B, L, D]``) are a prefill chunk (L > 1
    tokens per sequence). The decode kernels serve one token per sequence only, so a
    prompt's MoE rows take one path (the grouped GEMM) at every length and batch size.
    A speculative-decoding verify step (drafts + 1 tokens) counts as a chunk too."""
    return len(x_shape) >= 3 and x_shape[-2] > 1


def moe_experts(x, inds, scores, experts: Experts, shared, residual=None):
    """Dispatcher. Few rows (<= ``MAX_DECODE_ROWS``) that are not a prefill chunk: the two
    decode kernels (gate+up with SwiGLU, then down + weighted combine + shared expert,
    optionally + residual) when they serve this backend and ``experts.decode``; more
    rows: the prefill grouped GEMM (``moe_grouped.try_grouped``) when it serves;
    otherwise ``moe_experts_reference``. A prefill chunk (``x [B, L, D]`` with L > 1)
    takes the grouped GEMM at any row count, so a prompt's MoE rows get the same kernels
    alone and inside a batch (a 5-token prompt alone would otherwise take the decode
    kernels, in a batch the GEMM). Arguments as the reference's, with ``experts`` an
    ``Experts`` (``mlx_lily.patches.layouts.experts``)."""
    backend = current_backend()
    if backend in ("metal", "cuda"):
        d = x.shape[-1]
        rows = x.size // d if d else 0
        prefill = prefill_chunk(x.shape)
        if (rows <= MAX_DECODE_ROWS and not prefill
                and kernels.kernels_allowed(NAME, backend)):
            run = _decode_run(experts, x, inds, scores, shared, residual, backend)
            if run is not None:
                return run(x, inds, scores, shared, residual)
        else:
            try:
                from .moe_grouped import try_grouped
            except ImportError:
                try_grouped = None
            if try_grouped is not None:
                y = try_grouped(x, inds, scores, experts.grouped, experts.shared_rows, shared,
                                **({"min_pairs": 1} if prefill else {}))
                if y is not None:
                    return y if residual is None else residual + y
    return moe_experts_reference(x, inds, scores, experts.routed, experts.shared_mlp, shared,
                                 residual)


def routed_supported(router, k: int, wts: DecodeWeights | None, x_shape, x_dtype) -> bool:
    """True when ``moe_experts_routed`` can route inside the gate+up kernel: decode rows
    the kernels take, a ``QProj`` router whose parts are ``(E, 1)`` (the experts' logits
    and the shared-expert gate, E = the experts' count), ``k <= min(32, E)``, and a row
    that fits in threadgroup memory (the in-kernel norm stages it), at most
    ``MAX_ROUTED_EXPERTS`` experts, and a quantized router whose scales have x's dtype
    (so its logits come out in that dtype from ``qgemv`` and ``quantized_matmul`` alike)."""
    from .proj import Proj

    if wts is None or not isinstance(router, Proj) or x_dtype not in _FLOATS:
        return False
    if not router.quantized or router.scales.dtype != x_dtype:
        return False  # logits must come out in x's dtype (the kernel reads them as T)
    if tuple(router.sizes) != (wts.num_experts, 1) or not 1 <= k <= min(32, wts.num_experts):
        return False
    if wts.num_experts > MAX_ROUTED_EXPERTS:
        return False
    d = x_shape[-1]
    rows = 1
    for s_ in x_shape[:-1]:
        rows *= s_
    return (d == wts.hidden and 1 <= rows <= MAX_DECODE_ROWS and not prefill_chunk(x_shape)
            and d * x_dtype.size + 4 * (k + 4 + GATE_UP_NW) <= MAX_THREADGROUP_BYTES
            and fit_launch_shapes(d, wts.inter, k, wts.bits, current_backend()) is not None)


#: Threadgroup memory the gate+up kernel may take (Apple's per-threadgroup limit), and the
#: most experts its one-warp routing holds in registers (32 per lane).
MAX_THREADGROUP_BYTES = 32768
MAX_ROUTED_EXPERTS = 1024


def moe_experts_routed(x, router, k: int, norm_topk_prob: bool, experts: Experts):
    """A decode MoE block with the routing done inside the gate+up kernel: the router
    logits ``[..., E+1]`` come from the fused router ``QProj`` (a multi-block GEMV:
    ``qgemv``, or ``norm_qgemv`` when ``x`` is a ``mlx_lily.qproj.PendingNorm``), then
    gate+up (softmax, top-k, renormalisation and the shared gate in every threadgroup,
    ids never leave the GPU; with a pending norm the row is normalised there too) and
    down + combine: three launches, as with the one-threadgroup router kernel, whose GEMV
    runs on one SM. Same contract as ``moe_router_topk`` (ties to the lowest id) followed
    by ``moe_experts``.

    Args:
        x: ``[..., D]`` array or ``PendingNorm`` (``x.h`` set afterwards).
    Returns:
        ``[..., D]`` in x's dtype, or None when this path does not serve the call (the
        switch ``moe_topk_in_experts`` is off, kernels not allowed or unavailable, or
        ``routed_supported`` says no, or ``x`` is a ``PendingNorm`` that ``norm_qgemv``
        cannot fold into the router GEMV); nothing was launched then.
    """
    from ..registry import switch_on
    from .proj import PendingNorm

    backend = current_backend()
    if (backend not in ("metal", "cuda") or not switch_on(TOPK_OP, backend)
            or not kernels.kernels_allowed(NAME, backend)):
        return None
    pending = isinstance(x, PendingNorm)
    row = x.h0 if pending else x
    def build(wts):
        if not routed_supported(router, k, wts, row.shape, row.dtype):
            return None
        kg = kernels.get(GATE_UP_SPEC, backend)
        kd = kernels.get(DOWN_SPEC, backend)
        if kg is None or kd is None:
            return None
        mk = lambda pre: decode_plan(kg, kd, wts, row.shape, row.dtype, k,  # noqa: E731
                                     False, topk=True, norm_topk_prob=norm_topk_prob,
                                     pre_norm=pre)
        return mk(False), mk(True)

    entry = _cached_plan(experts, "routed",
                         (backend, id(router), row.shape, row.dtype, k, bool(norm_topk_prob),
                          launch_shapes(backend)),
                         build)
    if entry is None:
        return None
    plain, pre = entry
    from . import norm_qgemv

    if pending and norm_qgemv.split_requested():  # add_rms_norm, then the plain path
        x.resolve()
    if pending and x.resolved is None:
        if (x.res.shape != row.shape or x.res.dtype != row.dtype
                or x.weight.shape != (row.shape[-1],) or x.weight.dtype != row.dtype):
            return None
        if x.counters is not None:
            y = _fused_call(x, router, k, norm_topk_prob, experts, backend)
            if y is not None:
                return y
        r = norm_qgemv.for_qproj(x.h0, x.res, x.weight, x.eps, router)
        if r is None:  # the router kernel's own add+norm prologue serves instead
            return None
        logits, x.h = r  # the norm ran inside the router GEMV: again in gate+up
        return pre(x.h0, x.res, x.weight, x.eps, logits)[0]
    if pending:
        x = x.resolved
    (logits,) = router(x, split=False)
    return plain(x, logits)[0]


def fused_phase_tiles(d: int, i: int, k: int, e: int, bits: int, router_bits: int,
                      rows: int, rpw=None) -> tuple | None:
    """Blocks of each phase of one ``lily_moe_decode`` launch, ``(router, gate+up,
    down)``: per row ``ceil((e+1)/RPB_R)``, ``(k+1) * ceil(i/RPB_G)`` and
    ``ceil(d/RPB_D)``, with ``RPB = 4 * (32 / LPR) * RPW`` per phase (the kernel serves
    the tickets in that order). None when a width does not map onto lane groups."""
    lr = qgemv.lanes_per_row(d, router_bits)
    lg = qgemv.lanes_per_row(d, bits)
    ld = qgemv.lanes_per_row(i, bits)
    if None in (lr, lg, ld):
        return None
    rpb = lambda lpr, r: 4 * (32 // lpr) * r  # noqa: E731
    rr, rg, rd = rpw or fused_rpw()
    return (rows * -(-(e + 1) // rpb(lr, rr)), rows * (k + 1) * -(-i // rpb(lg, rg)),
            rows * -(-d // rpb(ld, rd)))


def fused_tiles(d: int, i: int, k: int, e: int, bits: int, router_bits: int, rows: int,
                rpw=None) -> int | None:
    """Blocks of one ``lily_moe_decode`` launch: the sum of ``fused_phase_tiles``. None
    when a width does not map onto lane groups."""
    t = fused_phase_tiles(d, i, k, e, bits, router_bits, rows, rpw)
    return None if t is None else sum(t)


def fused_supported(router, k: int, wts: DecodeWeights | None, x_shape, x_dtype) -> bool:
    """True when ``lily_moe_decode`` computes this MoE block: what ``routed_supported``
    accepts, a router whose group size is a multiple of its 16-byte word's values, the
    row and the K+1 gate+up outputs within the 48 KiB of static shared memory, and every
    phase's registers within what a 128-thread block may use (``REG_MODEL``)."""
    if not routed_supported(router, k, wts, x_shape, x_dtype):
        return False
    d, i, bits = wts.hidden, wts.inter, wts.bits
    rbits, rgs = router.bits, router.group_size
    if rbits not in (4, 8) or d % rgs or rgs % (128 // rbits):
        return False
    rows = 1
    for s_ in x_shape[:-1]:
        rows *= s_
    if prefill_chunk(x_shape) or fused_tiles(d, i, k, wts.num_experts, bits, rbits,
                                              rows) is None:
        return False
    if max(d, (k + 1) * i) * x_dtype.size + 4 * (2 * k + 6) > 48 * 1024:
        return False
    rr, rg, rd = fused_rpw()
    return (_fits("gate_up", _lane_words(d, rbits, rr), FUSED_THREADS)
            and _fits("gate_up", _lane_words(d, bits, rg, 2), FUSED_THREADS)
            and _fits("down", _lane_words(i, bits, rd, k + 1), FUSED_THREADS))


def fused_work_words(d: int, i: int, k: int, e: int, itemsize: int) -> int:
    """uint32 words of ``lily_moe_decode``'s scratch per row: the K+1 SwiGLU outputs
    (``(k+1)*i``), the normalised row (``d``), the router's ``e+1`` logits, the ``k``
    scores (all of ``itemsize`` bytes), the shared expert's gate and the ``k`` expert ids
    (4 bytes each), every section starting at a 16-byte offset (the kernel's
    ``static_assert`` checks the same sum)."""
    r16 = lambda b: -(-b // 16) * 16  # noqa: E731
    total = (r16((k + 1) * i * itemsize) + r16(d * itemsize) + r16((e + 1) * itemsize)
             + r16(k * itemsize) + 16 + r16(k * 4))
    return total // 4


def fused_plan(kernel, wts: DecodeWeights, router, x_shape, x_dtype, k: int,
               norm_topk_prob: bool, offset: int, *, init_value: float | None = None):
    """A callable ``run(hin, res, nw, eps, counters, after) -> (y, h)`` launching
    ``lily_moe_decode`` for one row shape and dtype: ``h = hin + res``, the router's
    logits of ``rms_norm(h) * nw``, top-``k`` routing, and ``y`` = the routed experts'
    and the gated shared expert's SwiGLU output (``moe_experts_routed``'s result), in
    one launch; ``counters`` an int32 array whose elements ``offset .. offset + 4`` are
    zero (left zero); ``after`` (never read) the output of the previous launch on these
    counters, or any array when there was none: launches sharing counters must not run
    concurrently, and MLX orders two launches only when one reads what the other wrote. ``init_value`` fills every output first (tests poison them: NaN in y and h; the
    uint32 scratch ``work`` gets 0, so an unwritten scratch read shows only as a wrong
    value, which the tests compare against the three launches and the fp32 truth)."""
    d, i, e = wts.hidden, wts.inter, wts.num_experts
    lead = tuple(x_shape[:-1])
    n = 1
    for s_ in lead:
        n *= s_
    rr, rg, rd = fused_rpw()
    tiles = fused_tiles(d, i, k, e, wts.bits, router.bits, n, (rr, rg, rd))
    dt = x_dtype
    wpr = fused_work_words(d, i, k, e, dt.size)
    kw = dict(template=[("T", dt), ("S", wts.gate[1].dtype), ("N", n), ("D", d), ("I", i),
                        ("K", k), ("E", e), ("BITS", wts.bits), ("GS", wts.group_size),
                        ("RBITS", router.bits), ("RGS", router.group_size), ("RRPW", rr),
                        ("GRPW", rg), ("DRPW", rd), ("NORM", bool(norm_topk_prob)),
                        ("CO", int(offset)), ("WPR", wpr)],
              grid=(tiles * FUSED_THREADS, 1, 1), threadgroup=(FUSED_THREADS, 1, 1),
              output_shapes=[lead + (d,), lead + (d,), (n * wpr,)],
              output_dtypes=[dt, dt, mx.uint32])
    if init_value is not None:
        kw["init_value"] = init_value
    w = [router.weight, router.scales, router.biases, *wts.gate, *wts.up, *wts.sgate,
         *wts.sup, *wts.down, *wts.sdown]

    def run(hin, res, nw, eps, counters, after):
        out = kernel(inputs=[hin, res, nw, kernels.f32_scalar(eps), *w, counters, after],
                     **kw)
        return out[0], out[1]

    return run


def has_fused_kernel(backend: str) -> bool:
    """True when the one-launch MoE block (``lily_moe_decode``, CUDA only) can run on
    ``backend`` here."""
    return (backend == "cuda" and has_routed_kernel(backend)
            and kernels.get(FUSED_SPEC, backend) is not None)


def _fused_call(x, router, k, norm_topk_prob, experts: Experts, backend):
    """``lily_moe_decode`` for the pending row ``x`` (sets ``x.h``) when switch
    ``moe_fused`` (and the router GEMV's ``norm_qgemv`` / ``qgemv``) are on, the backend
    is CUDA and ``fused_supported`` holds; None otherwise (nothing launched)."""
    from ..backend import op_enabled

    ctr, off, after = x.counters
    from ..registry import switch_on

    if (backend != "cuda" or not switch_on(FUSED_OP, backend) or not op_enabled("norm_qgemv")
            or not op_enabled("qgemv") or ctr.dtype != mx.int32 or ctr.ndim != 1
            or ctr.size < off + FUSED_COUNTERS):
        return None
    row = x.h0

    def build(wts):
        if not fused_supported(router, k, wts, row.shape, row.dtype):
            return None
        kern = kernels.get(FUSED_SPEC, backend)
        if kern is None:
            return None
        return fused_plan(kern, wts, router, row.shape, row.dtype, k, norm_topk_prob, off)

    run = _cached_plan(experts, "fused",
                       (backend, id(router), row.shape, row.dtype, k, bool(norm_topk_prob),
                        int(off), fused_rpw()), build)
    if run is None:
        return None
    y, x.h = run(x.h0, x.res, x.weight, x.eps, ctr, after)
    return y
