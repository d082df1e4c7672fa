"""moe_grouped: the prefill grouped-GEMM MoE (routing kernels + dequantizing gate/up and
down GEMMs + combine) against ``moe_experts_reference``.

Tolerances. The kernels keep fp32 sums and round to bf16 where they store (h, the
per-pair expert outputs, the result); the stock reference also rounds gate, up, silu and
each product to bf16 and is itself ~2-3% (Frobenius) away from an fp32 evaluation. So
each case checks (1) against ``mimic``, an MLX model of the kernels' rounding points
(per-row relative error <= 2%, max error <= 2% of the largest output; measured up to
1.3% and 1.1% over 50 random runs, while one pair routed to a wrong expert at k=8 gives
~3% per-row), and (2) against
``moe_experts_reference`` at bf16-pipeline tolerance (max error <= 6% of the largest
output, measured 2-3% at these small dims; widened to 1.5x the reference's own distance
from ``mimic`` + 1% where the reference is less precise, e.g. MLX's CPU quantized matmul
accumulates bf16 and is ~5% off at K=2048).
"""

from __future__ import annotations

import numpy as np
import pytest

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.qwen3_next import Qwen3NextMLP
from mlx_lm.models.switch_layers import SwitchGLU

from mlx_lily import kernels
from mlx_lily.ops import moe_grouped as mg
from mlx_lily.ops import moe_route as mr
from mlx_lily.ops.moe_experts import moe_experts_reference
from mlx_lily.patches import layouts as L
from mlx_lily.testing import cuda_check
from mlx_lily.testing.backends import metal_kernel_factory, parity_backends

from _close import assert_close, rel_err, rel_l2

HW = ("metal", "cuda")
BACKENDS = [pytest.param(b, marks=pytest.mark.gpu) if b in HW else b for b in parity_backends()]


# ---------------------------------------------------------------- fixtures
def make_layer(D, I, E, *, shared=True, bits=4, group=64, dtype=mx.bfloat16):
    """A random SwitchGLU (+ shared expert) quantized like ``mlx_lm.convert -q``."""
    sw = SwitchGLU(D, I, E)
    # at least 128 wide: MLX's CUDA quantized_matmul with K = 64 is wrong (_models.py)
    sh = Qwen3NextMLP(D, max(I, 128)) if shared else None
    nn.quantize(sw, group_size=group, bits=bits)
    if sh is not None:
        nn.quantize(sh, group_size=64, bits=4)
        sh.set_dtype(dtype)
    sw.set_dtype(dtype)
    return sw, sh


def lay(sw, sh):
    """What the grouped op takes for ``sw``/``sh``: ``(GroupedWeights or the reason,
    the shared expert for many rows)``, as the patch passes them."""
    ex = L.experts(sw, sh)
    return ex.grouped, ex.shared_rows


def route_pairs(kind, N, k, E, rng):
    if kind == "topk":
        return np.stack([rng.permutation(E)[:k] for _ in range(N)]).astype(np.uint32)
    if kind == "skew":
        p = rng.dirichlet(np.full(E, 0.3))
        picks = [rng.choice(E, size=k, replace=False, p=p) for _ in range(N)]
        return np.stack(picks).astype(np.uint32)
    if kind == "one":
        return np.full((N, k), E - 1, np.uint32)
    if kind == "bounds":
        # expert loads straddling 16/32-row tile edges, empty experts, single rows
        loads = [16, 17, 32, 33, 0, 15, 1, 0]
        flat = np.concatenate([np.full(c, e) for e, c in enumerate(loads[:E])])
        flat = np.concatenate([flat, rng.integers(0, E, N * k - flat.size)]) if flat.size < N * k \
            else flat[:N * k]
        return rng.permutation(flat).reshape(N, k).astype(np.uint32)
    raise ValueError(kind)


def make_inputs(N, k, E, D, kind, *, lead=None, gate=True, rng=None):
    rng = rng or np.random.default_rng()
    shape = lead if lead is not None else (N,)
    x = mx.random.normal((*shape, D)).astype(mx.bfloat16)
    inds = mx.array(route_pairs(kind, N, k, E, rng).reshape(*shape, k))
    scores = mx.softmax(mx.random.normal((*shape, k)), axis=-1).astype(mx.bfloat16)
    sgate = mx.sigmoid(mx.random.normal((*shape, 1))).astype(mx.bfloat16) if gate else None
    return x, inds, scores, sgate


def mimic(x, inds, scores, sw, sh, sgate):
    """MLX model of the kernels' numerics: fp32 sums over bf16-exact dequantized weights,
    h and per-pair outputs rounded to bf16, fp32 combine, unrounded result. Loops over
    experts (memory stays O(N*k*D) at production sizes)."""
    D = x.shape[-1]
    k = inds.shape[-1]
    xf = x.reshape(-1, D).astype(mx.float32)
    N = xf.shape[0]
    flat = np.array(inds).reshape(-1)
    deq = lambda l, e: mx.dequantize(l["weight"][e], l["scales"][e], l["biases"][e],  # noqa: E731
                                      64, 4).astype(mx.float32)
    rnd = lambda a: a.astype(mx.bfloat16).astype(mx.float32)  # noqa: E731
    parts, order = [], []
    for e in np.unique(flat):
        p = np.nonzero(flat == e)[0]
        xe = xf[mx.array(p // k)]
        g = xe @ deq(sw.gate_proj, int(e)).T
        u = xe @ deq(sw.up_proj, int(e)).T
        h = rnd(g * mx.sigmoid(g) * u)
        parts.append(rnd(h @ deq(sw.down_proj, int(e)).T))
        order.append(p)
    y = mx.concatenate(parts)[mx.array(np.argsort(np.concatenate(order)))]
    out = (y.reshape(N, k, D) * scores.reshape(N, k, 1).astype(mx.float32)).sum(1)
    if sh is not None:
        s = sh(x).reshape(-1, D).astype(mx.float32)
        out = out + (sgate.reshape(-1, 1).astype(mx.float32) * s if sgate is not None else s)
    return out.reshape(x.shape)


def check(out, x, inds, scores, sw, sh, sgate, *, mimic_tol=(0.02, 0.02)):
    """``out`` against the reference, no further than the stock path's own distance from
    the kernels' numerics (``mimic``; large where its matmuls accumulate in bf16, e.g.
    MLX's CPU quantized matmul at K=2048: ~5%) allows; and, with ``mimic_tol`` = (per-row
    L2, max) relative tolerances, against ``mimic`` itself."""
    assert out.shape == x.shape and out.dtype == x.dtype
    ref = moe_experts_reference(x, inds, scores, sw, sh, sgate)
    m = mimic(x, inds, scores, sw, sh, sgate)
    ref_own = rel_err(m, ref)
    assert_close(out, ref, rtol=max(0.06, 1.5 * ref_own + 0.01), scale="max",
                 what=f"vs reference (reference vs mimic {ref_own:.4g})")
    if mimic_tol:
        D = x.shape[-1]
        row = rel_l2(out.reshape(-1, D), m.reshape(-1, D), axis=-1)
        assert row <= mimic_tol[0], f"vs mimic: row rel {row:.4g}"
        assert_close(out, m, rtol=mimic_tol[1], scale="max", what="vs mimic")


# ---------------------------------------------------------------- kernel getters
_EMU: dict = {}


def getter(backend, **emu):
    if backend == "metal-emu":
        factory = metal_kernel_factory("metal-emu", **emu)
        key = tuple(sorted(emu.items()))

        def get(spec):
            k = _EMU.get((spec, key))
            if k is None:
                k = _EMU[(spec, key)] = kernels.build(spec, "metal", factory=factory)
            return k

        return get
    return mr.kernel_getter(backend)


def run(backend, x, inds, scores, sw, sh, sgate, TR, **emu):
    if backend == "reference":
        return moe_experts_reference(x, inds, scores, sw, sh, sgate)
    if backend in HW:
        out = mg.try_grouped(x, inds, scores, *lay(sw, sh), sgate, tile_rows=TR, min_pairs=1)
        assert out is not None, mg.why_unsupported(x, inds, scores, *lay(sw, sh), sgate)
        return out
    assert mg.why_unsupported(x, inds, scores, *lay(sw, sh), sgate) is None
    return mg.grouped_experts(x, inds, scores, *lay(sw, sh), sgate, tile_rows=TR,
                              get_kernel=getter(backend, **emu))


# (N, k, E, D, I, tile_rows, shared: "gated"|"plain"|"none", routing, leading shape)
SMALL = [
    (5, 2, 8, 128, 64, 16, "gated", "topk", None),
    (17, 2, 8, 128, 64, 32, "gated", "topk", (1, 17)),
    (40, 2, 8, 128, 64, 16, "none", "topk", None),
    (33, 2, 8, 128, 64, 16, "plain", "one", None),       # one expert: 5 tiles, last of 2 rows
    (57, 2, 8, 128, 64, 16, "gated", "bounds", None),    # loads 16/17/32/33/0/15/1/0
    (57, 2, 8, 128, 64, 32, "gated", "bounds", None),
    (24, 4, 8, 256, 128, 32, "gated", "skew", None),     # 2 gate/up and 2 down column blocks
    (14, 8, 16, 128, 64, 16, "gated", "topk", (2, 7)),   # k=8, batch 2
    (24, 4, 8, 256, 192, 16, "gated", "topk", None),     # CUDA down: a stage and a half
    (57, 2, 8, 128, 64, 64, "gated", "bounds", None),    # 64-row tiles: loads 16..33, 0, 1
    (90, 4, 8, 256, 192, 64, "gated", "skew", None),     # 64-row tiles, some full, half stage
    (37, 4, 16, 128, 64, 16, "gated", "topk", (1, 37)),  # the test model's layer at 37 / 48
    (48, 4, 16, 128, 64, 16, "gated", "topk", (1, 48)),  # tokens (148 / 192 pairs)
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", SMALL, ids=lambda c: "-".join(str(v) for v in c[:8]))
def test_grouped_matches_reference_small(backend, case):
    N, k, E, D, I, TR, shared, kind, lead = case
    sw, sh = make_layer(D, I, E, shared=shared != "none")
    x, inds, scores, sgate = make_inputs(N, k, E, D, kind, lead=lead, gate=shared == "gated")
    out = run(backend, x, inds, scores, sw, sh, sgate, TR)
    # the stock reference rounds at more points: it only sanity-checks the mimic
    check(out, x, inds, scores, sw, sh, sgate,
          mimic_tol=(0.08, 0.06) if backend == "reference" else (0.02, 0.02))


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "reference"])
def test_grouped_random_fiber_order(backend):
    emu = {"order": "random", "seed": 3} if backend == "metal-emu" else {}
    sw, sh = make_layer(128, 64, 8)
    x, inds, scores, sgate = make_inputs(29, 2, 8, 128, "skew")
    out = run(backend, x, inds, scores, sw, sh, sgate, 16, **emu)
    check(out, x, inds, scores, sw, sh, sgate)


def test_grouped_with_reference_routing_matches_kernel_routing():
    if "metal-emu" not in parity_backends():
        pytest.skip("Metal emulator unavailable")
    sw, sh = make_layer(128, 64, 8)
    x, inds, scores, sgate = make_inputs(21, 2, 8, 128, "topk")
    get = getter("metal-emu")
    a = mg.grouped_experts(x, inds, scores, *lay(sw, sh), sgate, tile_rows=16, get_kernel=get)
    b = mg.grouped_experts(x, inds, scores, *lay(sw, sh), sgate, tile_rows=16, get_kernel=get,
                           route_kernels=False)
    assert mx.array_equal(a, b).item()  # deterministic: same bits either way


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [b for b in parity_backends() if b in HW] or ["cuda"])
@pytest.mark.parametrize("N", [512, 2048])
@pytest.mark.parametrize("TR", [None, 16, 32, 64])
def test_grouped_production_dims(backend, N, TR):
    if backend not in parity_backends():
        pytest.skip(f"{backend} not available")
    sw, sh = make_layer(2048, 512, 256)
    x, inds, scores, sgate = make_inputs(N, 8, 256, 2048, "skew")
    out = mg.try_grouped(x, inds, scores, *lay(sw, sh), sgate, tile_rows=TR)
    assert out is not None
    check(out, x, inds, scores, sw, sh, sgate)
    again = mg.try_grouped(x, inds, scores, *lay(sw, sh), sgate, tile_rows=TR)
    assert mx.array_equal(out, again).item()  # deterministic


# ---------------------------------------------------------------- declines
def test_try_grouped_declines_on_cpu_and_for_few_rows():
    sw, sh = make_layer(128, 64, 8)
    x, inds, scores, sgate = make_inputs(40, 2, 8, 128, "topk")
    prev = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        assert not mg.has_kernel("cpu")
        assert mg.try_grouped(x, inds, scores, *lay(sw, sh), sgate) is None
    finally:
        mx.set_default_device(prev)
    x, inds, scores, sgate = make_inputs(3, 2, 8, 128, "topk")  # 6 pairs < MIN_PAIRS
    assert mg.try_grouped(x, inds, scores, *lay(sw, sh), sgate) is None


@pytest.fixture
def emulated_metal(monkeypatch):
    """Make this CPU process look like a Metal machine whose kernels run on the emulator
    (fresh kernel cache; everything restored afterwards)."""
    if "metal-emu" not in parity_backends():
        pytest.skip("Metal emulator unavailable")
    from mlx_lily.testing import metal_emu

    monkeypatch.setattr(kernels, "_CACHE", {})
    monkeypatch.setattr(kernels, "_metal_ok", lambda: True)
    monkeypatch.setattr(mg, "current_backend", lambda: "metal")
    monkeypatch.setattr(mr, "current_backend", lambda: "metal")
    monkeypatch.setattr(mx.fast, "metal_kernel", metal_kernel_factory("metal-emu"))
    yield metal_emu


@pytest.mark.parametrize("disable_route", [False, True])
def test_try_grouped_end_to_end_emulated(emulated_metal, monkeypatch, disable_route):
    if disable_route:
        monkeypatch.setenv("MLX_LILY_DISABLE", "moe_route")
    sw, sh = make_layer(128, 64, 8)
    x, inds, scores, sgate = make_inputs(45, 2, 8, 128, "skew", lead=(3, 15))
    assert mg.has_kernel("metal")
    out = mg.try_grouped(x, inds, scores, *lay(sw, sh), sgate)
    assert out is not None
    check(out, x, inds, scores, sw, sh, sgate)
    r = mr.moe_route(inds, 8, mg.choose_tile_rows(inds.size, 8))
    want = mr.moe_route_reference(inds, 8, mg.choose_tile_rows(inds.size, 8))
    assert all(mx.array_equal(a, b).item() for a, b in zip(r, want))


def test_grouped_runs_without_the_routing_kernels_emulated(emulated_metal, monkeypatch):
    """``MLX_LILY_KERNELS=moe_grouped`` (``moe_route`` not listed): the grouped GEMMs serve
    and the routing takes its reference; no routing kernel runs."""
    monkeypatch.setenv("MLX_LILY_KERNELS", "moe_grouped")
    fetched = []
    real_get = kernels.get
    monkeypatch.setattr(kernels, "get", lambda spec, be: fetched.append(spec.stem) or
                        real_get(spec, be))
    monkeypatch.setattr(mr, "moe_route_kernels", lambda *a, **k: pytest.fail(
        "the routing kernels ran although moe_route is not allowed"))
    sw, sh = make_layer(128, 64, 8)
    x, inds, scores, sgate = make_inputs(45, 2, 8, 128, "skew")
    assert mg.has_kernel("metal") and not mr.has_kernel("metal")
    out = mg.try_grouped(x, inds, scores, *lay(sw, sh), sgate)
    assert out is not None
    check(out, x, inds, scores, sw, sh, sgate)
    assert any(s.startswith("moeg_gate_up") for s in fetched)


def test_tile_rows_env_emulated(emulated_metal, monkeypatch):
    """``MLX_LILY_MOE_TILE_ROWS`` picks the tile height (the same bits at 16, 32 and 64: a
    row's k order does not depend on the tile); a height outside ``TILE_ROWS`` declines."""
    sw, sh = make_layer(128, 64, 8)
    x, inds, scores, sgate = make_inputs(45, 2, 8, 128, "skew")
    outs = []
    for tr in ("16", "32", "64"):
        monkeypatch.setenv(mg.TILE_ROWS_ENV, tr)
        outs.append(mg.try_grouped(x, inds, scores, *lay(sw, sh), sgate))
    assert all(o is not None for o in outs)
    check(outs[0], x, inds, scores, sw, sh, sgate)
    assert all(mx.array_equal(outs[0], o).item() for o in outs[1:])
    monkeypatch.setenv(mg.TILE_ROWS_ENV, "48")
    with pytest.warns(UserWarning, match="MLX_LILY_MOE_TILE_ROWS"):
        auto = mg.try_grouped(x, inds, scores, *lay(sw, sh), sgate)
    assert auto is not None and mx.array_equal(auto, outs[0]).item()


def test_cuda_shared_memory_matches_header():
    """The bytes the launch asks for equal the kernels' ``MOEG_SMEM_BYTES`` (the header's
    ``#define``s), which their ``static_assert``s check the tiles against."""
    import re

    text = kernels.shader_source("cuda", "moeg_common.cuh")
    d = dict(re.findall(r"#define (MOEG_\w+) (\d+)", text))
    ks, max_bm = int(d["MOEG_KS"]), int(d["MOEG_MAX_BM"])
    ld_pad = int(re.search(r"#define MOEG_LD \(MOEG_KS \+ (\d+)\)", text).group(1))
    assert "#define MOEG_SMEM_BYTES ((MOEG_MAX_BM + 128) * MOEG_LD * 2)" in text
    assert mg.CUDA_SHARED_MEMORY == (max_bm + 128) * (ks + ld_pad) * 2
    assert max(mg.TILE_ROWS) == max_bm
    assert mg.GATE_UP.shared_memory == mg.DOWN.shared_memory == mg.CUDA_SHARED_MEMORY


def test_why_unsupported():
    sw, sh = make_layer(128, 64, 8)
    x, inds, scores, sgate = make_inputs(40, 2, 8, 128, "topk")
    assert mg.why_unsupported(x, inds, scores, *lay(sw, sh), sgate) is None
    assert mg.why_unsupported(x, inds, scores, *lay(sw, None), None) is None
    assert "dtype" in mg.why_unsupported(x.astype(mx.float16), inds, scores, *lay(sw, sh), sgate)
    assert "scores" in mg.why_unsupported(x, inds, scores.astype(mx.float32), *lay(sw, sh), sgate)
    sw8, _ = make_layer(128, 64, 8, bits=8)
    assert "4-bit" in mg.why_unsupported(x, inds, scores, *lay(sw8, sh), sgate)
    sw32, _ = make_layer(128, 64, 8, group=32)
    assert "4-bit" in mg.why_unsupported(x, inds, scores, *lay(sw32, sh), sgate)
    swd, _ = make_layer(192, 64, 8)
    x192 = mx.zeros((40, 192), mx.bfloat16)
    assert "dims" in mg.why_unsupported(x192, inds, scores, *lay(swd, None), None)
    dense = SwitchGLU(128, 64, 8)
    dense.set_dtype(mx.bfloat16)
    assert "quantized" in mg.why_unsupported(x, inds, scores, *lay(dense, None), None)
    assert "differ" in mg.why_unsupported(x, inds[:5], scores[:5], *lay(sw, sh), sgate)
    assert "integer" in mg.why_unsupported(x, inds.astype(mx.float32), scores, *lay(sw, sh), sgate)


def test_warmup_records_every_cuda_tile_height():
    """The CUDA warm-up's recorded prefill lengths pick every tile height above 16 at
    Qwen3.6-35B-A3B's 256 experts, top-8 (16 comes with its short prompt)."""
    from mlx_lily import patching

    picked = {mg.choose_tile_rows(n * 8, 256, "cuda") for n in patching.WARMUP_RECORD_LENGTHS}
    assert picked == set(mg.AUTO_TILE_ROWS["cuda"]) - {16}
    assert mg.choose_tile_rows(8 * 8, 256, "cuda") == 16


def test_choose_tile_rows():
    assert mg.choose_tile_rows(512 * 8, 256, "metal") == 16
    assert mg.choose_tile_rows(2048 * 8, 256, "metal") == 32
    assert mg.choose_tile_rows(8192 * 8, 256, "cpu") == 32  # no 64-row tiles off CUDA
    assert mg.choose_tile_rows(8192 * 8, 256, "metal") == 32
    assert mg.choose_tile_rows(1024 * 8, 256, "cuda") == 32
    assert mg.choose_tile_rows(2048 * 8, 256, "cuda") == 64
    big = mg.TALLER_TILE_MIN_MEAN_ROWS * 256
    assert mg.choose_tile_rows(big - 1, 256, "cuda") == 32
    assert mg.choose_tile_rows(big, 256, "cuda") == 64
    assert mg.choose_tile_rows(8192 * 8, 256, "cuda") == 64
    for b, tiles in mg.AUTO_TILE_ROWS.items():
        assert set(tiles) <= set(mg.TILE_ROWS)
    with pytest.raises(ValueError):
        mg.grouped_experts(*make_inputs(4, 2, 8, 128, "topk")[:3], *lay(*make_layer(128, 64, 8)),
                           None, tile_rows=8, get_kernel=getter("reference"))


# ---------------------------------------------------------------- CUDA twins compile
BF = mx.bfloat16
GU_IN = [("x", BF, 2), ("sorted_pairs", mx.int32, 1), ("tiles", mx.int32, 2),
         ("w_gate", mx.uint32, 3), ("s_gate", BF, 3), ("b_gate", BF, 3),
         ("w_up", mx.uint32, 3), ("s_up", BF, 3), ("b_up", BF, 3)]
DN_IN = [("h", BF, 2), ("tiles", mx.int32, 2), ("w_down", mx.uint32, 3), ("s_down", BF, 3),
         ("b_down", BF, 3)]
CB_IN = [("y_pairs", BF, 2), ("pair_pos", mx.int32, 1), ("scores", mx.float32, 2),
         ("shared_out", BF, 2), ("shared_gate", BF, 1)]
CUDA_BUILDS = [
    (mg.GATE_UP, GU_IN, [("h", BF)],
     [("T", BF), ("DM", 2048), ("DI", 512), ("TOPK", 8), ("BM", 16)]),
    (mg.DOWN, DN_IN, [("y", BF)], [("T", BF), ("DM", 2048), ("DI", 512), ("BM", 32)]),
    (mg.DOWN, DN_IN, [("y", BF)], [("T", BF), ("DM", 256), ("DI", 192), ("BM", 16)]),  # half stage
    (mg.GATE_UP, GU_IN, [("h", BF)],
     [("T", BF), ("DM", 256), ("DI", 192), ("TOPK", 2), ("BM", 32)]),
    (mg.GATE_UP, GU_IN, [("h", BF)],
     [("T", BF), ("DM", 2048), ("DI", 512), ("TOPK", 8), ("BM", 64)]),
    (mg.DOWN, DN_IN, [("y", BF)], [("T", BF), ("DM", 2048), ("DI", 512), ("BM", 64)]),
    (mg.COMBINE, CB_IN, [("out", BF)],
     [("T", BF), ("ST", mx.float32), ("GT", BF), ("DM", 2048), ("TOPK", 8),
      ("HAS_SHARED", 1), ("HAS_GATE", 1)]),
]


@pytest.mark.skipif(cuda_check.nvcc_path() is None, reason="nvcc not installed")
@pytest.mark.parametrize("build", CUDA_BUILDS, ids=lambda b: b[0].name)
def test_cuda_body_compiles(build):
    spec, ins, outs, tmpl = build
    assert [n for n, _, _ in ins] == list(spec.inputs)
    assert [n for n, _ in outs] == list(spec.outputs)
    head, body = kernels.cuda_parts(spec.stem)
    cuda_check.check(spec.name, ins, outs, body, head, tmpl)


# ---------------------------------------------------------------- CUDA index-math model
# The CUDA GEMMs cannot run here. This lane-level numpy model follows their index math
# step by step (nibble-pair dequantization from bf16 bit patterns, the (0,4,1,5,...) k
# order in shared memory, ldmatrix.x4 and mma.m16n8k16 fragment layouts as the PTX ISA
# defines them, the epilogue's row/column mapping) and checks it computes the GEMMs.
def _bf16(a):
    b = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    return (((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)


def _dq_pair(w, j, s, b):
    t = ((int(w) >> (4 * j)) & 0x000F000F) | 0x43004300
    lo = np.array([(t & 0xFFFF) << 16], np.uint32).view(np.float32)[0] - np.float32(128)
    hi = np.array([(t >> 16) << 16], np.uint32).view(np.float32)[0] - np.float32(128)
    return _bf16(np.float64(lo) * s + b), _bf16(np.float64(hi) * s + b)


def _ldsm_x4(smem, addr):
    regs = [[None] * 4 for _ in range(32)]
    for m in range(4):
        rows = [addr(8 * m + r) for r in range(8)]
        for lane in range(32):
            a = rows[lane // 4] + 2 * (lane % 4)
            regs[lane][m] = (smem[a], smem[a + 1])
    return regs


def _mma(acc, a, b):
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        quads = [(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]
        for r, (row, col) in enumerate(quads):
            A[row, col], A[row, col + 1] = a[lane][r]
        for r, k0 in enumerate([2 * t, 2 * t + 8]):
            B[k0, g], B[k0 + 1, g] = b[lane][r]
    C = A @ B
    for lane in range(32):
        g, t = lane // 4, lane % 4
        acc[lane] += (C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1])


def _cuda_block(glu, BM, r0, cnt, by, arow, mats, K, LD=136, KS=128):
    """One threadgroup of moeg_gate_up (glu) or moeg_down; mats = [(Wq, S, B)] of the
    expert (1 or 2 matrices, rows = output features). Returns {(row, col): value}."""
    MT, ncol = BM // 16, (64 if glu else 128)
    n0 = by * ncol
    NT = 2 if glu else 4
    acc = np.zeros((len(mats), 4, MT, NT, 32, 4))
    for s in range(-(-K // KS)):
        sA = np.full(BM * LD, np.nan)
        sB = np.full(128 * LD, np.nan)
        for tid in range(128):
            warp, lane = tid >> 5, tid & 31
            wc = lane >> 3
            for i in range(4):  # load slot i: weight row moeg_wrow(i, warp, lane)
                rr = ((i << 2) + warp) * 8 + (lane & 7)
                W, S, Bi = mats[int(i >= 2)] if glu else mats[0]
                row = n0 + ((rr & 63) if glu else rr)
                ok = s * KS + wc * 32 < K
                g = 2 * s + (wc >> 1)
                sc, bi = (S[row, g], Bi[row, g]) if ok else (0.0, 0.0)
                for j in range(4):
                    w = W[row, s * 16 + wc * 4 + j] if ok else 0
                    for jj in range(4):
                        lo, hi = _dq_pair(w, jj, sc, bi)
                        o = rr * LD + wc * 32 + 8 * j + 2 * jj
                        sB[o], sB[o + 1] = lo, hi
            xs = tid & 15
            for i in range(BM // 8):
                r = (tid >> 4) + 8 * i
                k0 = s * KS + xs * 8
                e = arow(r)[k0:k0 + 8] if (r < cnt and k0 < K) else np.zeros(8)
                sA[r * LD + xs * 8: r * LD + xs * 8 + 8] = [e[i] for i in (0, 4, 1, 5, 2, 6, 3, 7)]
        for warp in range(4):
            for kk in range(KS // 16):
                if s * KS + kk * 16 >= K:
                    break
                a = [_ldsm_x4(sA, lambda ln, mi=mi: (mi * 16 + (ln & 15)) * LD + kk * 16
                              + (ln >> 4) * 8) for mi in range(MT)]
                bsub = lambda ln: ((ln >> 3) & 1) * 8  # noqa: E731
                if glu:
                    brow = lambda ln: warp * 16 + (ln & 7) + ((ln >> 4) << 3)  # noqa: E731
                    bl = [_ldsm_x4(sB, lambda ln, o=o: (o + brow(ln)) * LD + kk * 16 + bsub(ln))
                          for o in (0, 64)]
                    for m in range(2):
                        for mi in range(MT):
                            for nt in range(2):
                                _mma(acc[m, warp, mi, nt], a[mi],
                                     [bl[m][ln][2 * nt:2 * nt + 2] for ln in range(32)])
                else:
                    brow = lambda ln: warp * 32 + (ln & 7) + ((ln >> 4) << 3)  # noqa: E731
                    bl = [_ldsm_x4(sB, lambda ln, o=o: (o + brow(ln)) * LD + kk * 16 + bsub(ln))
                          for o in (0, 16)]
                    for mi in range(MT):
                        for nt in range(4):
                            _mma(acc[0, warp, mi, nt], a[mi],
                                 [bl[nt // 2][ln][2 * (nt % 2):2 * (nt % 2) + 2] for ln in range(32)])
    out = {}
    for warp in range(4):
        for ln in range(32):
            for mi in range(MT):
                for nt in range(NT):
                    col = n0 + warp * (16 if glu else 32) + nt * 8 + (ln & 3) * 2
                    for hh in range(2):
                        r = mi * 16 + (ln >> 2) + hh * 8
                        for q in range(2):
                            if r >= cnt:
                                continue
                            v = acc[0, warp, mi, nt, ln, 2 * hh + q]
                            if glu:
                                v = v / (1 + np.exp(-v)) * acc[1, warp, mi, nt, ln, 2 * hh + q]
                            assert (r0 + r, col + q) not in out
                            out[(r0 + r, col + q)] = v
    return out


@pytest.mark.parametrize("BM,D,I,N", [(16, 128, 128, 11), (32, 128, 128, 11),
                                      (16, 256, 192, 11), (64, 128, 192, 80)])
def test_cuda_gemm_index_math_model(BM, D, I, N):
    E, k = 3, 2
    sw, _ = make_layer(D, I, E, shared=False)
    x, inds, _, _ = make_inputs(N, k, E, D, "topk")
    f = lambda a: np.array(a.astype(mx.float32))  # noqa: E731
    xn = f(x)
    r = mr.moe_route_reference(inds, E, BM)
    sp, tiles, flat = np.array(r.sorted_pairs), np.array(r.tiles), np.array(inds).reshape(-1)
    def lay(l, e):
        return np.array(l["weight"][e]), f(l["scales"][e]), f(l["biases"][e])
    g, u, d = sw.gate_proj, sw.up_proj, sw.down_proj
    h = np.full((N * k, I), np.nan)
    y = np.full((N * k, D), np.nan)
    for e, r0, cnt in tiles:
        if cnt:
            for by in range(I // 64):
                for (rr, c), v in _cuda_block(True, BM, r0, cnt, by, lambda i: xn[sp[r0 + i] // k],
                                              [lay(g, e), lay(u, e)], D).items():
                    h[rr, c] = v
    h = _bf16(h)
    for e, r0, cnt in tiles:
        if cnt:
            for by in range(D // 128):
                for (rr, c), v in _cuda_block(False, BM, r0, cnt, by, lambda i: h[r0 + i],
                                              [lay(d, e)], I).items():
                    y[rr, c] = v
    def deq(l):  # single-rounding dequantization, as the kernel's bf16 fma
        w = np.array(l["weight"]).astype(np.int64)
        q = ((w[..., None] >> (4 * np.arange(8))) & 0xF).reshape(*w.shape[:-1], -1)
        rep = lambda a: np.repeat(f(a).astype(np.float64), 64, axis=-1)  # noqa: E731
        return _bf16(q * rep(l["scales"]) + rep(l["biases"]))

    es, xs = flat[sp], xn[sp // k]
    gg = np.einsum("pd,pid->pi", xs, deq(g)[es])
    uu = np.einsum("pd,pid->pi", xs, deq(u)[es])
    href = gg / (1 + np.exp(-gg)) * uu
    assert_close(h, _bf16(href), dtype=mx.bfloat16, ulps=1, ulp_of=np.abs(href).max())
    yref = np.einsum("pi,pdi->pd", h, deq(d)[es])
    assert_close(y, yref, rtol=1e-5, scale="max")
