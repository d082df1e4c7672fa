"""GPU-resident grouping of (token, expert) pairs for the prefill grouped GEMM.

Contract (``moe_route_reference``), all arrays int32, no host synchronisation:
pair ``p`` in ``[0, N*k)`` is token ``p // k`` routed to expert ``inds.flat[p]``.
``counts[e]`` = pairs routed to expert e (histogram); ``offsets`` = exclusive prefix scan
of counts, length E+1; ``sorted_pairs`` = pair ids grouped by expert, ascending pair id
inside each group (stable); ``tiles`` = ``[max_tiles, 3]`` rows ``(expert, row_start,
row_count)`` covering each group with tiles of at most ``tile_rows`` rows in expert
order, where ``row_start`` indexes ``sorted_pairs``; unused tiles are ``(E, N*k, 0)``.
``max_tiles = ceil(N*k / tile_rows) + min(E, N*k)`` bounds the tile count for any routing.
Source: the histogram / scan / scatter / block-map pipeline of Lily's prefill
(``lily-design.md``), the standard grouped-GEMM scheduling used by MoE kernels.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx



NAME = "moe_route"


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


def has_kernel(backend: str) -> bool:
    return False


def moe_route(inds, num_experts, tile_rows):
    """Dispatcher: the kernel when one serves, else the reference."""
    return moe_route_reference(inds, num_experts, tile_rows)
