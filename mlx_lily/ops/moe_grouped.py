"""MoE prefill: routed experts as a grouped GEMM with in-tile 4-bit dequantization.

Computes ``moe_experts_reference`` (mlx-lily's ``moe_experts`` contract: SwitchGLU
experts, score-weighted combine, plus the gated shared expert) for many rows at once:

1. GPU-resident routing (``moe_route.moe_route_kernels``): (token, expert) pairs grouped
   by expert, stable, with a tile map of fixed-height row tiles and the inverse
   permutation; no host synchronisation.
2. ``moeg_gate_up``: per tile, the token rows of ``x`` gathered, times the expert's gate
   and up weights dequantized one 64-wide k step at a time in threadgroup / shared memory
   (the bf16 weights never exist in device memory), fp32 accumulation, epilogue
   ``silu(gate) * up`` -> ``h [P, I]`` bf16 in sorted-pair order.
3. ``moeg_down``: per tile, ``h`` times the expert's dequantized down weights ->
   ``y_pairs [P, D]`` bf16 (sorted order).
4. ``moeg_combine``: per token, ``sum_j scores[j] * y_pairs[pair_pos[j]]`` in fp32 in j
   order, plus ``shared * shared_expert(x)`` (the shared expert runs as MLX's own
   quantized matmuls: a dense GEMM), one rounding. Deterministic; no float atomics.

Intermediates are rounded to bf16 where the reference rounds (h, the per-pair expert
outputs); sums are fp32. Results match ``moe_experts_reference`` within bf16 tolerance.
CUDA kernels use ``mma.sync.m16n8k16`` bf16 tensor-core tiles; Metal kernels
``simdgroup_matrix<float,8,8>``. Tile height (rows per tile) is 16 or 32 (and 64 on CUDA),
chosen from the mean rows per expert (``choose_tile_rows``).
Source: Lily's prefill design (``lily-design.md``: dequantize inside the grouped GEMM,
GPU-resident routing, tile height by expert load); grouped-GEMM MoE scheduling as in
common MoE kernels.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import mlx.core as mx

from .. import kernels
from ..backend import current_backend, op_enabled
from ..kernels import KernelSpec
from . import moe_route as _route

NAME = "moe_grouped"

THREADS = 128  # 4 warps / simdgroups per GEMM threadgroup (fixed in the shaders)
TILE_ROWS = (16, 32, 64)  # tile heights (BM template) both twins take
#: Tile heights ``choose_tile_rows`` picks from per backend: 64-row tiles only where they
#: were measured (the H200); on Metal they pass the emulator but no Apple GPU timed them.
AUTO_TILE_ROWS = {"metal": (16, 32), "cuda": (16, 32, 64)}
MIN_PAIRS = 64  # below this many (token, expert) pairs, try_grouped declines
TALL_TILE_MIN_MEAN_ROWS = 32  # mean rows per expert from which 32-row tiles are used
#: Mean rows per expert from which 64-row tiles are used where the backend has them. H200,
#: ``benchmarks/gpu/moe_prefill_bench.py``, routed experts per layer with 32 /
#: 64-row tiles: 2048 tokens (64 rows per expert) 1.477 / 1.458 ms, 4096 tokens 2.170 /
#: 2.000 ms, 8192 tokens 3.865 / 2.971 ms.
TALLER_TILE_MIN_MEAN_ROWS = 64
#: Benchmark sweeps: ``MLX_LILY_MOE_TILE_ROWS=16|32|64`` replaces ``choose_tile_rows``
#: (another value: one warning, then the automatic choice).
TILE_ROWS_ENV = "MLX_LILY_MOE_TILE_ROWS"
#: CUDA dynamic shared memory of both GEMMs (``MOEG_SMEM_BYTES`` in moeg_common.cuh): the
#: activation tile of up to 64 rows and 128 dequantized weight rows, bf16, stride 136. One
#: size for every tile height (one kernel name): 16-row tiles (96 registers) fit 4 blocks
#: per H200 SM instead of the 5 their 39 KB allowed; 32-row tiles (125 registers) were
#: limited to 4 by registers already. Not timed before / after.
CUDA_SHARED_MEMORY = (max(TILE_ROWS) + 128) * 136 * 2

# Kernel launch contracts (Metal and CUDA twins in shaders/*/moeg_*.*):
#   gate_up: grid (128*Tm, I/64, 1), threadgroup (128, 1, 1);
#            template T (activation dtype, bf16), DM (=D), DI (=I), TOPK (=k), BM (tile rows).
#   down:    grid (128*Tm, D/128, 1), threadgroup (128, 1, 1); template T, DM, DI, BM.
#   combine: grid (D/8, N, 1), threadgroup (min(256, D/8), 1, 1);
#            template T, ST (scores dtype), GT (shared-gate dtype), DM, TOPK,
#            HAS_SHARED (0/1), HAS_GATE (0/1).
# Tm = moe_route.max_tiles(P, E, BM); tiles past the used ones have row_count 0 and exit.
GATE_UP = KernelSpec("moeg_gate_up", "moeg_gate_up",
                     ("x", "sorted_pairs", "tiles", "w_gate", "s_gate", "b_gate",
                      "w_up", "s_up", "b_up"), ("h",),
                     shared_memory=CUDA_SHARED_MEMORY)
DOWN = KernelSpec("moeg_down", "moeg_down", ("h", "tiles", "w_down", "s_down", "b_down"),
                  ("y",), shared_memory=CUDA_SHARED_MEMORY)
COMBINE = KernelSpec("moeg_combine", "moeg_combine",
                     ("y_pairs", "pair_pos", "scores", "shared_out", "shared_gate"), ("out",))
SPECS = (GATE_UP, DOWN, COMBINE)
#: Metal variants of the two GEMMs with the weight tile read cooperatively (16-byte words,
#: two neighbouring threads per row) instead of one thread per row in 4-byte words: same
#: launch contract and result (``WEIGHT_LOAD``, ``MLX_LILY_MOEG_LOAD``).
GATE_UP_COOP = KernelSpec("moeg_gate_up_coop", "moeg_gate_up_coop", GATE_UP.inputs,
                          GATE_UP.outputs)
DOWN_COOP = KernelSpec("moeg_down_coop", "moeg_down_coop", DOWN.inputs, DOWN.outputs)
#: Weight-tile load of the GEMMs per backend: "row" (``moeg_gate_up`` / ``moeg_down``) or
#: "coop" (Metal only: the ``*_COOP`` kernels).
WEIGHT_LOAD = {"cuda": "row", "metal": "row"}


def weight_load(backend: str) -> str:
    """``WEIGHT_LOAD``, or on Metal ``MLX_LILY_MOEG_LOAD`` (``tuning.moeg_load``)."""
    from .. import tuning

    v = tuning.moeg_load
    return v if backend == "metal" and v is not None else WEIGHT_LOAD.get(backend, "row")


def choose_tile_rows(num_pairs: int, num_experts: int, backend: str | None = None) -> int:
    """Tile height for ``num_pairs`` (token, expert) pairs over ``num_experts`` on
    ``backend`` (None: ``current_backend()``): 64 rows when the mean load is at least ``TALLER_TILE_MIN_MEAN_ROWS`` rows
    per expert and the backend picks 64 (``AUTO_TILE_ROWS``), else 32 rows from
    ``TALL_TILE_MIN_MEAN_ROWS``, else 16."""
    if backend is None:
        backend = current_backend()
    if (num_pairs >= TALLER_TILE_MIN_MEAN_ROWS * num_experts
            and 64 in AUTO_TILE_ROWS.get(backend, ())):
        return 64
    return 32 if num_pairs >= TALL_TILE_MIN_MEAN_ROWS * num_experts else 16


def has_kernel(backend: str) -> bool:
    """True on Metal / CUDA when the grouped-GEMM kernels can be built here (the routing
    takes its reference where ``moe_route``'s kernels cannot serve)."""
    if backend not in ("metal", "cuda"):
        return False
    return all(kernels.get(s, backend) is not None for s in SPECS)


class GroupedWeights(NamedTuple):
    """The stacked expert arrays the grouped GEMM reads (4-bit affine, group 64):
    ``(weight uint32 [E, rows, cols/8], scales [E, rows, cols/64], biases)`` per
    projection, gate and up ``[E, I, D/8]``, down ``[E, D, I/8]``
    (``mlx_lily.patches.layouts.grouped_weights`` builds it from mlx-lm's ``SwitchGLU``)."""

    gate: tuple
    up: tuple
    down: tuple


def why_unsupported(x, inds, scores, weights, shared_mlp, shared) -> str | None:
    """None when the grouped path serves this call, else the reason (a short string).

    ``weights``: a ``GroupedWeights``, or the reason the module layout is not one the
    path implements (a string, returned here after the activation checks). Checks shapes
    and dtypes only (no data is read).
    """
    if x.dtype != mx.bfloat16:
        return f"activation dtype {x.dtype} (bf16 only)"
    if x.ndim < 1 or inds.ndim != x.ndim or scores.shape != inds.shape:
        return "inds/scores shape does not match x"
    if tuple(inds.shape[:-1]) != tuple(x.shape[:-1]):
        return "inds leading dims differ from x"
    if not mx.issubdtype(inds.dtype, mx.integer):
        return f"inds dtype {inds.dtype} (integer ids only)"
    if scores.dtype != x.dtype:
        return f"scores dtype {scores.dtype} != {x.dtype}"
    if shared is not None and (shared.dtype != x.dtype or shared.shape[-1] != 1
                               or tuple(shared.shape[:-1]) != tuple(x.shape[:-1])):
        return "shared gate dtype/shape"
    if isinstance(weights, str):
        return weights
    D = x.shape[-1]
    for w, sc, b in weights:
        if w.dtype != mx.uint32 or sc.dtype != x.dtype or b.dtype != x.dtype:
            return "weight/scales/biases dtypes"
    g, u, d = weights
    E, I = g[0].shape[0], g[0].shape[1]
    if D % 128 or I % 64 or D < 128 or I < 64:
        return f"dims D={D}, I={I} (need D % 128 == 0, I % 64 == 0)"
    for (w, sc, b), (rows, cols) in ((g, (I, D)), (u, (I, D)), (d, (D, I))):
        if (tuple(w.shape) != (E, rows, cols // 8)
                or tuple(sc.shape) != (E, rows, cols // 64)
                or tuple(b.shape) != (E, rows, cols // 64)):
            return "expert weight shapes"
    if E > _route.MAX_KERNEL_EXPERTS:
        return f"{E} experts (at most {_route.MAX_KERNEL_EXPERTS})"
    N = x.size // D
    k = inds.shape[-1]
    if N > 65535:
        return f"{N} rows in one call (at most 65535)"
    if N * k * max(D, I) >= 2**31:
        return "too many pairs for 32-bit indexing"
    return None


def grouped_stages(x: mx.array, inds: mx.array, scores: mx.array, weights: GroupedWeights,
                   shared_mlp, shared, *, tile_rows: int,
                   get_kernel: Callable[[KernelSpec], object],
                   route_kernels: bool = True, load: str = "row") -> dict:
    """The grouped-GEMM pipeline as lazy arrays per stage (benchmarks evaluate a prefix).

    Same arguments as ``grouped_experts``; ``load`` "coop" takes the Metal ``*_COOP``
    GEMMs (where ``get_kernel`` gives none, the row kernels). Static cost of the two GEMMs
    at Qwen3.6-35B-A3B's 2048-token prefill chunk (16384 pairs over 256 experts: 32-row
    tiles, Tm <= 768): gate+up grid (128*Tm, 8): up to 6144 threadgroups x 128 threads,
    each reading its expert's 64 gate + 64 up rows (128 KB of weights + 16 KB of
    scales/biases) and its tile's x rows (32 x 4 KB); down (128*Tm, 16): up to 12288 x
    128, each 128 rows (32 KB + 4 KB) and 32 h rows (1 KB each). An expert's weights
    (1.57 MB; 403 MB for 256 experts) are read once per tile of it, about 2-3 times per
    chunk at 64 rows per expert (row and coop alike: coop changes the loads, not the
    bytes). Threadgroup memory (BM + 128) * 72 * 2 B: 23.0 KB at BM 32, 27.6 KB at 64.
    MLX competitor: ``gather_qmm`` with sorted indices (``gather_qmm_rhs``, MLX 0.32: BM
    32 or 64, BN 64, BK 64, 128 threads; its 64 x 64 weight tile dequantized into
    threadgroup memory by two threads per row, 16 bytes each: the coop pattern;
    ``simdgroup_matrix`` MMA), or ``gather_qmm_nax`` on M5: the same weight bytes per
    expert tile.
    Returns ``{"route": MoeRoute, "pair_pos":
    [P] int32, "h": [P, I], "y_pairs": [P, D] (sorted-pair order), "out": [N, D]}``
    with ``N`` the flattened rows of ``x`` and ``P = N * k``.
    """
    if tile_rows not in TILE_ROWS:
        raise ValueError(f"tile_rows must be one of {TILE_ROWS}, got {tile_rows}")
    D = x.shape[-1]
    k = inds.shape[-1]
    xf = x.reshape(-1, D)
    N = xf.shape[0]
    P = N * k
    g, u, d = weights
    E, I = g[0].shape[0], g[0].shape[1]
    T = _route.max_tiles(P, E, tile_rows)
    if route_kernels:
        route, pair_pos = _route.moe_route_kernels(inds, E, tile_rows, get_kernel)
    else:
        route = _route.moe_route_reference(inds, E, tile_rows)
        pair_pos = mx.argsort(route.sorted_pairs).astype(mx.int32)
    dt = x.dtype
    if load not in ("row", "coop"):
        raise ValueError(f"load must be 'row' or 'coop', got {load!r}")
    k_gu = k_dn = None
    if load == "coop":
        k_gu, k_dn = get_kernel(GATE_UP_COOP), get_kernel(DOWN_COOP)
    if k_gu is None or k_dn is None:
        k_gu, k_dn = get_kernel(GATE_UP), get_kernel(DOWN)
    (h,) = k_gu(
        inputs=[xf, route.sorted_pairs, route.tiles, *g, *u],
        output_shapes=[(P, I)], output_dtypes=[dt],
        grid=(THREADS * T, I // 64, 1), threadgroup=(THREADS, 1, 1),
        template=[("T", dt), ("DM", D), ("DI", I), ("TOPK", k), ("BM", tile_rows)])
    (y_pairs,) = k_dn(
        inputs=[h, route.tiles, *d],
        output_shapes=[(P, D)], output_dtypes=[dt],
        grid=(THREADS * T, D // 128, 1), threadgroup=(THREADS, 1, 1),
        template=[("T", dt), ("DM", D), ("DI", I), ("BM", tile_rows)])
    if shared_mlp is not None:
        s_out = shared_mlp(xf)
        if s_out.dtype != dt or tuple(s_out.shape) != (N, D):
            s_out = s_out.astype(dt).reshape(N, D)
        s_gate = shared.reshape(N) if shared is not None else mx.zeros((1,), dt)
    else:
        s_out = mx.zeros((1,), dt)
        s_gate = mx.zeros((1,), dt)
    sc = scores.reshape(N, k)
    (out,) = get_kernel(COMBINE)(
        inputs=[y_pairs, pair_pos, sc, s_out, s_gate],
        output_shapes=[(N, D)], output_dtypes=[dt],
        grid=(D // 8, N, 1), threadgroup=(min(256, D // 8), 1, 1),
        template=[("T", dt), ("ST", sc.dtype), ("GT", s_gate.dtype), ("DM", D),
                  ("TOPK", k), ("HAS_SHARED", int(shared_mlp is not None)),
                  ("HAS_GATE", int(shared_mlp is not None and shared is not None))])
    return {"route": route, "pair_pos": pair_pos, "h": h, "y_pairs": y_pairs, "out": out}


def grouped_experts(x: mx.array, inds: mx.array, scores: mx.array,
                    weights: GroupedWeights, shared_mlp, shared, *, tile_rows: int,
                    get_kernel: Callable[[KernelSpec], object],
                    route_kernels: bool = True, load: str = "row") -> mx.array:
    """The grouped-GEMM pipeline, unconditionally (callers check ``why_unsupported``).

    Args:
        x: ``[..., D]`` bf16; inds: ``[..., k]`` expert ids in ``[0, E)``; scores:
            ``[..., k]`` bf16; weights: ``GroupedWeights`` (4-bit affine group-64
            experts, bf16 scales/biases); shared_mlp: the shared expert, a callable
            ``[N, D] -> [N, D]``, or None; shared: ``[..., 1]`` gate (already sigmoid) or
            None.
        tile_rows: rows per grouped-GEMM tile, one of ``TILE_ROWS``.
        get_kernel: ``spec -> kernel object`` (``moe_route.kernel_getter(backend)``, or
            a builder around the Metal emulator in tests).
        route_kernels: False computes the routing with ``moe_route_reference``.
        load: "row" or "coop" (``grouped_stages``; the result does not depend on it).
    Returns:
        ``[..., D]`` in x's dtype.
    Raises:
        ValueError: ``tile_rows`` not in ``TILE_ROWS``; ``load`` neither "row" nor "coop".
    """
    out = grouped_stages(x, inds, scores, weights, shared_mlp, shared,
                         tile_rows=tile_rows, get_kernel=get_kernel,
                         route_kernels=route_kernels, load=load)["out"]
    return out.reshape(x.shape)


def _tile_rows_env() -> int | None:
    from .. import tuning

    return tuning.moe_tile_rows


def try_grouped(x, inds, scores, weights, shared_mlp, shared, *,
                tile_rows: int | None = None, min_pairs: int = MIN_PAIRS):
    """The grouped-GEMM MoE for a many-row call, or None when it cannot serve.

    Same arguments and result as ``moe_experts.moe_experts_reference`` (``x [..., D]``
    bf16, ``inds``/``scores`` ``[..., k]``, ``weights`` a ``GroupedWeights`` (4-bit affine
    group 64, bf16 scales/biases) or the reason the layout is not one (a string), optional
    shared expert callable and ``[..., 1]`` gate), equal within bf16
    tolerance. Returns None (the caller runs its own path) off Metal/CUDA, when the
    kernels are unavailable, for layouts or dtypes ``why_unsupported`` rejects, and for
    fewer than ``min_pairs`` (token, expert) pairs. ``tile_rows`` (one of ``TILE_ROWS``;
    others decline) overrides ``choose_tile_rows``, as does ``MLX_LILY_MOE_TILE_ROWS``.
    ``MLX_LILY_DISABLE=moe_grouped`` turns it off. The routing runs on the GPU where
    ``moe_route``'s kernels serve (not disabled, allowed by ``MLX_LILY_KERNELS``), else
    by its reference.
    """
    backend = current_backend()
    if backend not in ("metal", "cuda") or not op_enabled(NAME):
        return None
    if why_unsupported(x, inds, scores, weights, shared_mlp, shared) is not None:
        return None
    P = inds.size
    if P < max(1, min_pairs):
        return None
    if not has_kernel(backend):
        return None
    E = weights.gate[0].shape[0]
    if tile_rows is None:
        tile_rows = _tile_rows_env()
    tr = tile_rows if tile_rows is not None else choose_tile_rows(P, E, backend)
    if tr not in TILE_ROWS:
        return None
    return grouped_experts(x, inds, scores, weights, shared_mlp, shared,
                           tile_rows=tr, get_kernel=_route.kernel_getter(backend),
                           route_kernels=op_enabled(_route.NAME) and _route.has_kernel(backend),
                           load=weight_load(backend))
