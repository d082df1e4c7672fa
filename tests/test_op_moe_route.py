"""moe_route: the reference against a numpy model, and the routing kernels (Metal twin
under the emulator, real Metal / CUDA on hardware) against the reference, exactly."""

from __future__ import annotations

import numpy as np
import pytest

import mlx.core as mx

from mlx_lily import kernels
from mlx_lily.ops import moe_route as mr
from mlx_lily.testing import cuda_check
from mlx_lily.testing.backends import metal_kernel_factory, parity_backends

HW = ("metal", "cuda")
BACKENDS = [pytest.param(b, marks=pytest.mark.gpu) if b in HW else b for b in parity_backends()]


# ---------------------------------------------------------------- numpy model
def np_route(flat: np.ndarray, E: int, TR: int):
    """Straightforward numpy statement of the contract (module docstring)."""
    P = flat.size
    counts = np.bincount(flat, minlength=E).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    sorted_pairs = np.argsort(flat, kind="stable").astype(np.int32)
    T = mr.max_tiles(P, E, TR)
    tiles = np.tile(np.array([E, P, 0], np.int32), (T, 1))
    t = 0
    for e in range(E):
        for s in range(0, counts[e], TR):
            tiles[t] = (e, offsets[e] + s, min(TR, counts[e] - s))
            t += 1
    return counts, offsets, sorted_pairs, tiles, np.array([t], np.int32)


def make_inds(kind: str, N: int, k: int, E: int, rng) -> np.ndarray:
    """Routings: distinct top-k per token ("topk"), skewed ("skew"), every pair to expert
    E-1 ("one"), only even experts ("gaps"), and repeats allowed ("any")."""
    if kind == "topk":
        return np.stack([rng.permutation(E)[:k] for _ in range(N)]).astype(np.uint32)
    if kind == "skew":
        p = rng.dirichlet(np.full(E, 0.2))
        picks = [rng.choice(E, size=k, replace=False, p=p) for _ in range(N)]
        return np.stack(picks).astype(np.uint32)
    if kind == "one":
        return np.full((N, k), E - 1, np.uint32)
    if kind == "gaps":
        return (2 * rng.integers(0, (E + 1) // 2, size=(N, k))).astype(np.uint32)
    if kind == "any":
        return rng.integers(0, E, size=(N, k)).astype(np.uint32)
    raise ValueError(kind)


# (N, k, E, tile_rows, kind)
SMALL_CASES = [
    (5, 2, 8, 16, "topk"),
    (1, 1, 1, 1, "one"),
    (3, 2, 8, 16, "topk"),      # fewer pairs than experts
    (40, 2, 8, 16, "topk"),
    (37, 3, 5, 7, "any"),       # odd sizes, repeats within a token
    (64, 2, 8, 16, "one"),      # all to one expert: 8 full tiles
    (48, 1, 3, 16, "gaps"),     # empty experts in between
    (129, 2, 4, 32, "skew"),    # chunk boundary (256 pairs + 2)
    (300, 8, 256, 32, "topk"),  # production E and k, tiny N
    (200, 4, 16, 1, "any"),     # one row per tile
]


@pytest.mark.parametrize("case", SMALL_CASES, ids=lambda c: "-".join(map(str, c)))
def test_reference_matches_numpy_model(case):
    N, k, E, TR, kind = case
    inds = make_inds(kind, N, k, E, np.random.default_rng(hash(case) % 2**32))
    got = mr.moe_route_reference(mx.array(inds), E, TR)
    want = np_route(inds.reshape(-1).astype(np.int64), E, TR)
    for name, g, w in zip(got._fields, got, want):
        assert g.dtype == mx.int32, name
        np.testing.assert_array_equal(np.array(g), w, err_msg=name)


@pytest.mark.parametrize("case", SMALL_CASES, ids=lambda c: "-".join(map(str, c)))
def test_reference_properties(case):
    N, k, E, TR, kind = case
    inds = make_inds(kind, N, k, E, np.random.default_rng(7))
    flat = inds.reshape(-1)
    P = flat.size
    r = mr.moe_route_reference(mx.array(inds), E, TR)
    counts, offsets, sp, tiles, nt = (np.array(a) for a in r)
    assert counts.sum() == P and (counts >= 0).all()
    assert offsets[0] == 0 and offsets[-1] == P and (np.diff(offsets) == counts).all()
    assert sorted(sp.tolist()) == list(range(P))
    for e in range(E):
        grp = sp[offsets[e]:offsets[e + 1]]
        assert (flat[grp] == e).all()
        assert (np.diff(grp) > 0).all()  # stable: ascending pair id
    T = mr.max_tiles(P, E, TR)
    assert tiles.shape == (T, 3) and 0 < nt[0] <= T
    seen = np.zeros(P, np.int32)
    for t, (e, s, c) in enumerate(tiles):
        if t < nt[0]:
            assert 1 <= c <= TR and offsets[e] <= s and s + c <= offsets[e + 1]
            seen[s:s + c] += 1
        else:
            assert (e, s, c) == (E, P, 0)
    assert (seen == 1).all()
    assert [e for e, _, _ in tiles[:nt[0]]] == sorted(e for e, _, _ in tiles[:nt[0]])


def test_max_tiles_bound_is_tight():
    # every expert with exactly one pair past a multiple of TR hits the bound
    E, TR = 4, 4
    flat = np.repeat(np.arange(E), TR + 1)
    r = mr.moe_route_reference(mx.array(flat.astype(np.uint32)), E, TR)
    assert int(r.num_tiles[0]) == 2 * E
    assert mr.max_tiles(flat.size, E, TR) >= 2 * E


def test_reference_rejects_bad_tile_rows():
    with pytest.raises(ValueError):
        mr.moe_route_reference(mx.zeros((2, 2), mx.uint32), 4, 0)


# ---------------------------------------------------------------- kernels
_EMU_CACHE: dict = {}


def getter(backend: str, **emu):
    """``spec -> kernel`` for a parity backend."""
    if backend == "metal-emu":
        factory = metal_kernel_factory("metal-emu", **emu)
        key = tuple(sorted(emu.items()))

        def get(spec):
            k = _EMU_CACHE.get((spec, key))
            if k is None:
                k = _EMU_CACHE[(spec, key)] = kernels.build(spec, "metal", factory=factory)
            return k

        return get
    return mr.kernel_getter(backend)


def run_route(backend, inds, E, TR, **emu):
    if backend == "reference":
        r = mr.moe_route_reference(inds, E, TR)
        return r, mx.argsort(r.sorted_pairs).astype(mx.int32)
    if backend in HW:
        assert mr.has_kernel(backend)
    return mr.moe_route_kernels(inds, E, TR, getter(backend, **emu))


def check_route(got, pair_pos, inds, E, TR):
    want = mr.moe_route_reference(inds, E, TR)
    for name, g, w in zip(want._fields, got, want):
        assert g.dtype == mx.int32 and g.shape == w.shape, name
        assert mx.array_equal(g, w).item(), f"{name}: {np.array(g)[:40]} != {np.array(w)[:40]}"
    P = inds.size
    assert pair_pos.shape == (P,) and pair_pos.dtype == mx.int32
    assert mx.array_equal(got.sorted_pairs[pair_pos], mx.arange(P, dtype=mx.int32)).item()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", SMALL_CASES, ids=lambda c: "-".join(map(str, c)))
def test_kernels_match_reference_small(backend, case):
    N, k, E, TR, kind = case
    inds = mx.array(make_inds(kind, N, k, E, np.random.default_rng()))
    got, pos = run_route(backend, inds, E, TR)
    check_route(got, pos, inds, E, TR)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "reference"])
def test_kernels_int32_ids_and_reverse_order(backend):
    # int32 ids, and (emulator) fibers run in reverse order between barriers
    inds = mx.array(make_inds("skew", 300, 3, 11, np.random.default_rng()).astype(np.int32))
    emu = {"order": "reverse"} if backend == "metal-emu" else {}
    got, pos = run_route(backend, inds, 11, 16, **emu)
    check_route(got, pos, inds, 11, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [b for b in parity_backends() if b in HW] or ["cuda"])
@pytest.mark.parametrize("N", [512, 2048, 8192])
@pytest.mark.parametrize("TR", [16, 32])
@pytest.mark.parametrize("kind", ["topk", "skew", "one"])
def test_kernels_match_reference_production(backend, N, TR, kind):
    if backend not in parity_backends():
        pytest.skip(f"{backend} not available")
    inds = mx.array(make_inds(kind, N, 8, 256, np.random.default_rng()))
    got, pos = run_route(backend, inds, 256, TR)
    check_route(got, pos, inds, 256, TR)


def test_dispatcher_uses_reference_on_cpu():
    inds = mx.array(make_inds("topk", 9, 2, 8, np.random.default_rng(1)))
    with mx.stream(mx.cpu):
        prev = mx.default_device()
        mx.set_default_device(mx.cpu)
        try:
            assert not mr.has_kernel("cpu")
            got = mr.moe_route(inds, 8, 16)
        finally:
            mx.set_default_device(prev)
    want = mr.moe_route_reference(inds, 8, 16)
    for g, w in zip(got, want):
        assert mx.array_equal(g, w).item()


def test_kernel_serves_limits():
    ok = mx.zeros((4, 2), mx.uint32)
    assert mr.kernel_serves(ok, 8, 16)
    assert not mr.kernel_serves(mx.zeros((0, 2), mx.uint32), 8, 16)
    assert not mr.kernel_serves(ok, mr.MAX_KERNEL_EXPERTS + 1, 16)
    assert not mr.kernel_serves(ok.astype(mx.float32), 8, 16)


# ---------------------------------------------------------------- CUDA twins compile
CUDA_BUILDS = [
    (mr.RANK, [("inds", mx.uint32, 1), ("n_pairs", mx.int32, 1)],
     [("chunk_counts", mx.int32), ("rank", mx.int32)], [("IT", mx.uint32), ("NE", 256)]),
    (mr.SCAN, [("chunk_counts", mx.int32, 2), ("n_pairs", mx.int32, 1)],
     [("counts", mx.int32), ("offsets", mx.int32), ("chunk_base", mx.int32),
      ("tiles", mx.int32), ("num_tiles", mx.int32)], [("NE", 256), ("TR", 32)]),
    (mr.SCATTER, [("inds", mx.uint32, 1), ("rank", mx.int32, 1), ("chunk_base", mx.int32, 2),
                  ("n_pairs", mx.int32, 1)],
     [("sorted_pairs", mx.int32), ("pair_pos", mx.int32)], [("IT", mx.uint32), ("NE", 256)]),
]


@pytest.mark.skipif(cuda_check.nvcc_path() is None, reason="nvcc not installed")
@pytest.mark.parametrize("build", CUDA_BUILDS, ids=lambda b: f"{b[0].name}-{b[3][-1][1]}")
def test_cuda_body_compiles(build):
    spec, ins, outs, tmpl = build
    assert [n for n, _, _ in ins] == list(spec.inputs)
    assert [n for n, _ in outs] == list(spec.outputs)
    head, body = kernels.cuda_parts(spec.stem)
    cuda_check.check(spec.name, ins, outs, body, head, tmpl)
