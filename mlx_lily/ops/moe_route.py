"""GPU-resident grouping of (token, expert) pairs for the prefill grouped GEMM.

Contract (``moe_route_reference``), all arrays int32, no host synchronisation:
pair ``p`` in ``[0, N*k)`` is token ``p // k`` routed to expert ``inds.flat[p]``.
``counts[e]`` = pairs routed to expert e (histogram); ``offsets`` = exclusive prefix scan
of counts, length E+1; ``sorted_pairs`` = pair ids grouped by expert, ascending pair id
inside each group (stable); ``tiles`` = ``[max_tiles, 3]`` rows ``(expert, row_start,
row_count)`` covering each group with tiles of at most ``tile_rows`` rows in expert
order, where ``row_start`` indexes ``sorted_pairs``; unused tiles are ``(E, N*k, 0)``.
``max_tiles = ceil(N*k / tile_rows) + min(E, N*k)`` bounds the tile count for any routing.
Kernels (``moe_route_kernels``, Metal and CUDA twins ``shaders/*/moeg_route_*``): a
per-chunk rank/histogram pass, a one-threadgroup scan that also writes the tile map, and
a scatter; exact and deterministic, ints identical to the reference.
Source: the histogram / scan / scatter / block-map pipeline of Lily's prefill
(``lily-design.md``), the standard grouped-GEMM scheduling used by MoE kernels.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import mlx.core as mx

from .. import kernels
from ..backend import current_backend, op_enabled
from ..kernels import KernelSpec

NAME = "moe_route"

CHUNK = 256  # pairs per threadgroup in the rank / scatter kernels (fixed in the shaders)
MAX_KERNEL_EXPERTS = 1024  # static threadgroup arrays of the scan kernel scale with E

# Kernel launch contracts (Metal and CUDA twins in shaders/*/moeg_route_*.*):
#   rank:    grid (256*C, 1, 1), threadgroup (256, 1, 1), C = ceil(P/256);
#            template IT (inds dtype), NE (experts).
#   scan:    grid (256, 1, 1), threadgroup (256, 1, 1); template NE, TR (tile rows).
#   scatter: grid (256*C, 1, 1), threadgroup (256, 1, 1); template IT, NE.
# ``n_pairs`` is an int32 array holding P at index 0 (``kernels.device_scalars``), read
# as ``n_pairs[0]``.
RANK = KernelSpec("moeg_route_rank", "moeg_route_rank", ("inds", "n_pairs"),
                  ("chunk_counts", "rank"))
SCAN = KernelSpec("moeg_route_scan", "moeg_route_scan", ("chunk_counts", "n_pairs"),
                  ("counts", "offsets", "chunk_base", "tiles", "num_tiles"))
SCATTER = KernelSpec("moeg_route_scatter", "moeg_route_scatter",
                     ("inds", "rank", "chunk_base", "n_pairs"), ("sorted_pairs", "pair_pos"))
SPECS = (RANK, SCAN, SCATTER)


class MoeRoute(NamedTuple):
    """Result of ``moe_route``; see the module docstring for each field's contract."""

    counts: mx.array  # [E] int32
    offsets: mx.array  # [E+1] int32
    sorted_pairs: mx.array  # [N*k] int32
    tiles: mx.array  # [max_tiles, 3] int32
    num_tiles: mx.array  # [1] int32


def max_tiles(num_pairs: int, num_experts: int, tile_rows: int) -> int:
    """Upper bound on the number of tiles for any routing of ``num_pairs`` pairs."""
    return -(-num_pairs // tile_rows) + min(num_experts, num_pairs)


def moe_route_reference(inds: mx.array, num_experts: int, tile_rows: int) -> MoeRoute:
    """Group (token, expert) pairs by expert and lay out fixed-size row tiles.

    Args:
        inds: ``[N, k]`` (or any shape; flattened row-major) integer expert ids in
            ``[0, num_experts)``.
        num_experts: E; ``tile_rows``: rows per grouped-GEMM tile (e.g. 16 or 32).
    Returns:
        ``MoeRoute`` (all int32). Raises ValueError for ``tile_rows < 1``.
    """
    if tile_rows < 1:
        raise ValueError(f"tile_rows must be >= 1, got {tile_rows}")
    flat = inds.reshape(-1).astype(mx.int32)
    P = flat.size
    E = num_experts
    counts = mx.zeros((E,), dtype=mx.int32).at[flat].add(mx.ones((P,), dtype=mx.int32))
    offsets = mx.concatenate([mx.zeros((1,), mx.int32), mx.cumsum(counts)])
    key = flat * P + mx.arange(P, dtype=mx.int32)
    sorted_pairs = mx.argsort(key).astype(mx.int32)
    T = max_tiles(P, E, tile_rows)
    tiles_per = (counts + (tile_rows - 1)) // tile_rows
    tile_off = mx.concatenate([mx.zeros((1,), mx.int32), mx.cumsum(tiles_per)])
    t = mx.arange(T, dtype=mx.int32)
    expert = (tile_off[1:][None, :] <= t[:, None]).astype(mx.int32).sum(axis=1)
    valid = t < tile_off[E]
    e_safe = mx.minimum(expert, E - 1)
    local = t - tile_off[e_safe]
    start = offsets[e_safe] + local * tile_rows
    count = mx.minimum(tile_rows, counts[e_safe] - local * tile_rows)
    tiles = mx.stack([
        mx.where(valid, expert, E),
        mx.where(valid, start, P),
        mx.where(valid, count, 0),
    ], axis=1).astype(mx.int32)
    return MoeRoute(counts, offsets, sorted_pairs, tiles, tile_off[E:E + 1])


def kernel_getter(backend: str) -> Callable[[KernelSpec], object]:
    """``spec -> kernel object`` (or None) for ``backend``, through the process cache."""
    return lambda spec: kernels.get(spec, backend)


def has_kernel(backend: str) -> bool:
    """True on Metal / CUDA when the routing kernels can be built here."""
    if backend not in ("metal", "cuda"):
        return False
    return all(kernels.get(s, backend) is not None for s in SPECS)


def kernel_serves(inds: mx.array, num_experts: int, tile_rows: int) -> bool:
    """True when the routing kernels accept these arguments (shapes and dtypes only;
    expert ids are assumed to lie in ``[0, num_experts)``, as top-k guarantees)."""
    return (inds.size >= 1 and 1 <= num_experts <= MAX_KERNEL_EXPERTS and tile_rows >= 1
            and inds.size < 2**31 // max(num_experts, 1)
            and inds.dtype in (mx.uint32, mx.int32, mx.uint16, mx.int16, mx.uint8,
                               mx.int8, mx.int64, mx.uint64))


def moe_route_kernels(inds: mx.array, num_experts: int, tile_rows: int,
                      get_kernel: Callable[[KernelSpec], object]):
    """``moe_route_reference`` computed by three GPU kernels, plus the inverse permutation.

    Pass 1 (``moeg_route_rank``): per chunk of 256 pairs, each pair's rank among the
    earlier pairs of the chunk with the same expert, and the chunk's histogram. Pass 2
    (``moeg_route_scan``, one threadgroup): expert totals, exclusive scans of counts and
    of tiles per expert, every chunk's first slot per expert, the tile map. Pass 3
    (``moeg_route_scatter``): ``slot = chunk_base[chunk, e] + rank``. Stable and
    deterministic (no atomics); no host synchronisation (P comes from the array shape and
    travels as a 1-element array).

    Args:
        inds: integer expert ids, any shape (flattened row-major), values in
            ``[0, num_experts)`` (ids outside are skipped, leaving holes).
        get_kernel: ``spec -> kernel`` (e.g. ``kernel_getter("cuda")``, or a builder
            around the Metal emulator in tests).
    Returns:
        ``(MoeRoute, pair_pos)``; ``pair_pos [P]`` int32 is the sorted slot of each pair
        (``sorted_pairs[pair_pos[p]] == p``).
    """
    flat = inds.reshape(-1)
    if flat.dtype not in (mx.uint32, mx.int32):
        flat = flat.astype(mx.int32)
    P = flat.size
    E = num_experts
    C = -(-P // CHUNK)
    T = max_tiles(P, E, tile_rows)
    n = kernels.device_scalars(mx.array([P], dtype=mx.int32))
    i32 = mx.int32
    chunk_counts, rank = get_kernel(RANK)(
        inputs=[flat, n], output_shapes=[(C, E), (P,)], output_dtypes=[i32, i32],
        grid=(CHUNK * C, 1, 1), threadgroup=(CHUNK, 1, 1),
        template=[("IT", flat.dtype), ("NE", E)])
    counts, offsets, chunk_base, tiles, num_tiles = get_kernel(SCAN)(
        inputs=[chunk_counts, n],
        output_shapes=[(E,), (E + 1,), (C, E), (T, 3), (1,)], output_dtypes=[i32] * 5,
        grid=(256, 1, 1), threadgroup=(256, 1, 1),
        template=[("NE", E), ("TR", tile_rows)])
    sorted_pairs, pair_pos = get_kernel(SCATTER)(
        inputs=[flat, rank, chunk_base, n], output_shapes=[(P,), (P,)],
        output_dtypes=[i32, i32], grid=(CHUNK * C, 1, 1), threadgroup=(CHUNK, 1, 1),
        template=[("IT", flat.dtype), ("NE", E)])
    return MoeRoute(counts, offsets, sorted_pairs, tiles, num_tiles), pair_pos


def moe_route(inds, num_experts, tile_rows):
    """Dispatcher: the routing kernels on Metal / CUDA when they serve these arguments
    (``kernel_serves``) and the op is enabled, else ``moe_route_reference``. Same
    ``MoeRoute`` either way (bit-identical ints)."""
    backend = current_backend()
    if (op_enabled(NAME) and tile_rows >= 1 and kernel_serves(inds, num_experts, tile_rows)
            and has_kernel(backend)):
        return moe_route_kernels(inds, num_experts, tile_rows, kernel_getter(backend))[0]
    return moe_route_reference(inds, num_experts, tile_rows)
