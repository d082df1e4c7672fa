"""qgemv: reference vs stock ``QuantizedLinear``, the ``lily_qgemv`` kernel vs an fp32
truth on every parity backend, QProj routing, and the CUDA twin's nvcc compile."""

from __future__ import annotations

import zlib

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlx_lily import kernels
from mlx_lily.ops import qgemv as Q
from mlx_lily.qproj import QProj
from mlx_lily.testing.dispatch import count_kernel_launches, emulated_metal_dispatch
from mlx_lily.testing.backends import parity_backends
from mlx_lily.testing.cuda_check import nvcc_path

from mlx_lily.testing.cuda_emu import (
    BACKENDS, KERNEL_BACKENDS, MISALIGN, aligned_emu_buffers, kernel_for)

from _close import assert_close


@pytest.fixture(autouse=True)
def _aligned_emu_buffers(monkeypatch):
    yield from aligned_emu_buffers(monkeypatch)


def make_weights(o, k, bits, gs, dtype=mx.bfloat16, sdtype=mx.bfloat16):
    w = (mx.random.normal((o, k)) * k ** -0.5).astype(sdtype)
    q, s, b = mx.quantize(w, gs, bits)
    return q, s, b


def truth(x, q, s, b, gs, bits):
    """fp32 dequantize-and-matmul (on the CPU: no TF32 or fast-math on a GPU)."""
    with mx.stream(mx.cpu):
        wf = mx.dequantize(q, s.astype(mx.float32), b.astype(mx.float32), gs, bits)
        return x.astype(mx.float32) @ wf.T  # ops keep the stream they were made on


def check_close(y, t, x, q, s, b, gs, bits, dtype):
    """``y`` within half an ulp of ``dtype`` (its output rounding) plus fp32
    summation-order error (``mag``: the sum of the terms' magnitudes) of the truth."""
    with mx.stream(mx.cpu):
        wf = mx.dequantize(q, s.astype(mx.float32), b.astype(mx.float32), gs, bits)
        mag = mx.abs(x.astype(mx.float32)) @ mx.abs(wf).T  # scale of fp32 rounding error
    assert_close(y, t, dtype=dtype, ulps=0.5, rtol=1e-5, scale=mag, atol=1e-6)


def test_reference_matches_quantized_linear():
    with mx.stream(mx.cpu):
        _reference_matches_quantized_linear()


def _reference_matches_quantized_linear():
    mx.random.seed(0)
    for bits in (4, 8):
        lin = nn.Linear(256, 40, bias=False)
        lin.weight = (mx.random.normal((40, 256)) * 0.06).astype(mx.bfloat16)
        ql = nn.QuantizedLinear.from_linear(lin, 64, bits)
        x = mx.random.normal((1, 1, 256)).astype(mx.bfloat16)
        y = Q.qgemv_reference(x, ql.weight, ql.scales, ql.biases, 64, bits)
        assert mx.array_equal(y, ql(x)).item()


def test_supports_rejects_unmappable_shapes():
    x = mx.zeros((1, 320), mx.bfloat16)  # 10 words per row: not whole lane groups
    q, s, b = make_weights(8, 320, 4, 64)
    assert not Q.supports(x, q, s, b, 64, 4)
    x = mx.zeros((9, 256), mx.bfloat16)  # too many rows
    q, s, b = make_weights(8, 256, 4, 64)
    assert not Q.supports(x, q, s, b, 64, 4)
    assert Q.supports(x[:2], q, s, b, 64, 4)
    assert not Q.supports(x[:1], q, s, None, 64, 4)
    assert not Q.supports(x[:1], q, s, b, 64, 4, mode="mxfp4")


CASES = [  # (K, O, bits, gs, rows, dtype)
    (2048, 40, 4, 64, 1, mx.bfloat16),   # production input width, 4-bit
    (2048, 24, 8, 64, 2, mx.bfloat16),   # production input width, 8-bit (router)
    (4096, 37, 4, 64, 1, mx.bfloat16),   # output projections' input width (o_proj, out_proj)
    (512, 33, 4, 32, 3, mx.bfloat16),    # odd row count, group 32
    (128, 17, 8, 128, 1, mx.float16),    # 8 lanes per row
    (64, 7, 4, 64, 1, mx.float32),       # 2 lanes per row, 16 rows per warp
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"K{c[0]}-O{c[1]}-b{c[2]}-g{c[3]}-n{c[4]}")
def test_kernel_parity(backend, case):
    k, o, bits, gs, rows, dtype = case
    mx.random.seed(zlib.crc32(repr(case).encode()) % 1000)
    q, s, b = make_weights(o, k, bits, gs)
    x = mx.random.normal((rows, k)).astype(dtype)
    t = truth(x, q, s, b, gs, bits)
    if backend == "reference":
        with mx.stream(mx.cpu):
            y = Q.qgemv(x, q, s, b, gs, bits)  # CPU: the reference
        # (MLX's CPU quantized_matmul accumulates in the activation dtype: no truth check.)
        assert mx.array_equal(y, Q.qgemv_reference(x, q, s, b, gs, bits)).item()
        return
    kern, init = kernel_for(Q.SPEC, backend)
    assert Q.supports(x, q, s, b, gs, bits)
    y = Q.launch(kern, x, q, s, b, gs, bits, init_value=init)
    assert y.dtype == dtype
    check_close(y, t, x, q, s, b, gs, bits, dtype)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_kernel_detects_wrong_answer(backend):
    """The parity check fails for a corrupted weight (the test can fail)."""
    mx.random.seed(3)
    q, s, b = make_weights(16, 256, 4, 64)
    x = mx.random.normal((1, 256)).astype(mx.bfloat16)
    kern, init = kernel_for(Q.SPEC, backend)
    y = Q.launch(kern, x, q, s, b, 64, 4, init_value=init)
    s2 = s.at[3, 1].add(mx.array(0.5, mx.bfloat16))
    with pytest.raises(AssertionError):
        check_close(y, truth(x, q, s2, b, 64, 4), x, q, s2, b, 64, 4, mx.bfloat16)


@pytest.mark.parametrize("backend", [b for b in KERNEL_BACKENDS if isinstance(b, str) and b.endswith("-emu")])
def test_kernel_unaligned_activations(backend, monkeypatch):
    """bf16 activations 2 bytes off a 16-byte boundary (a row-contiguous view at an odd
    offset): the CUDA twin takes its element-load path; results unchanged."""
    monkeypatch.setitem(MISALIGN, "bf16", 2)
    mx.random.seed(8)
    q, s, b = make_weights(24, 2048, 4, 64)
    x = mx.random.normal((2, 2048)).astype(mx.bfloat16)
    kern, init = kernel_for(Q.SPEC, backend)
    y = Q.launch(kern, x, q, s, b, 64, 4, init_value=init)
    check_close(y, truth(x, q, s, b, 64, 4), x, q, s, b, 64, 4, mx.bfloat16)


@pytest.mark.skipif("metal-emu" not in parity_backends(), reason="Metal emulator unavailable")
def test_qproj_routes_one_row_to_kernel(monkeypatch):
    emulated_metal_dispatch(monkeypatch, Q)
    mx.random.seed(5)
    layers = []
    for o in (24, 8):
        lin = nn.Linear(256, o, bias=False)
        lin.weight = (mx.random.normal((o, 256)) * 0.06).astype(mx.bfloat16)
        layers.append(nn.QuantizedLinear.from_linear(lin, 64, 4))
    proj = QProj.fuse(layers)
    calls = count_kernel_launches(monkeypatch)
    x = mx.random.normal((1, 1, 256)).astype(mx.bfloat16)
    parts = proj(x)
    assert len(calls) == 1 and [p.shape for p in parts] == [(1, 1, 24), (1, 1, 8)]
    t = truth(x.reshape(1, 256), proj.weight, proj.scales, proj.biases, 64, 4)
    y = mx.concatenate(parts, axis=-1).reshape(1, 32)
    check_close(y, t, x.reshape(1, 256), proj.weight, proj.scales, proj.biases, 64, 4,
                mx.bfloat16)
    proj(mx.random.normal((1, 3, 256)).astype(mx.bfloat16))  # 3 rows: quantized_matmul
    assert len(calls) == 1
    monkeypatch.setitem(Q.USE_FOR_QPROJ, "metal", False)
    proj(x)
    assert len(calls) == 1
    monkeypatch.setenv("MLX_LILY_DISABLE", "qgemv")
    monkeypatch.setitem(Q.USE_FOR_QPROJ, "metal", True)
    proj(x)
    assert len(calls) == 1


def test_lm_head_routes_one_row_to_kernel(monkeypatch):
    """The patched top models' LM head (``patches.qwen3_next.lm_head``): a one-row input
    of a quantized head runs ``lily_qgemv`` (view cached per weight array), several rows
    and unquantized heads run the layer itself."""
    from mlx_lily.patches.qwen3_next import lm_head

    emulated_metal_dispatch(monkeypatch, Q)
    mx.random.seed(6)
    lin = nn.Linear(256, 40, bias=False)
    lin.weight = (mx.random.normal((40, 256)) * 0.06).astype(mx.bfloat16)
    owner = nn.Module()
    owner.lm_head = nn.QuantizedLinear.from_linear(lin, 64, 4)
    calls = count_kernel_launches(monkeypatch)
    x = mx.random.normal((1, 1, 256)).astype(mx.bfloat16)
    y = lm_head(owner, x)
    assert calls == ["lily_qgemv"] and y.shape == (1, 1, 40)
    h = owner.lm_head
    t = truth(x.reshape(1, 256), h.weight, h.scales, h.biases, 64, 4)
    check_close(y.reshape(1, 40), t, x.reshape(1, 256), h.weight, h.scales, h.biases, 64,
                4, mx.bfloat16)
    view = owner.__dict__["_lily_head"][3]
    lm_head(owner, x)
    assert owner.__dict__["_lily_head"][3] is view and len(calls) == 2
    # new weight arrays: a new view over them, and the result follows the new weights
    owner.lm_head.update({"scales": owner.lm_head.scales * 2})
    y2 = lm_head(owner, x)
    assert owner.__dict__["_lily_head"][3] is not view and len(calls) == 3
    assert_close(y2, owner.lm_head(x), rtol=0.05, atol=0.05)
    xs = mx.random.normal((1, 3, 256)).astype(mx.bfloat16)
    assert mx.array_equal(lm_head(owner, xs), owner.lm_head(xs)).item()
    assert len(calls) == 3
    owner.lm_head = lin  # unquantized: the layer itself
    assert mx.array_equal(lm_head(owner, x), lin(x)).item() and len(calls) == 3


def test_qproj_keeps_stock_result_dtype(monkeypatch):
    """A one-row ``QProj`` call whose stock ``quantized_matmul`` would return another dtype
    than the input's (fp32 scales, bf16 input: fp32) leaves the kernel out, so the result
    has stock's dtype; matching scales run the kernel."""
    from mlx_lily.qproj import QProj

    emulated_metal_dispatch(monkeypatch, Q)
    mx.random.seed(9)
    lin = nn.Linear(256, 24, bias=False)
    lin.weight = (mx.random.normal((24, 256)) * 0.06).astype(mx.bfloat16)
    ql = nn.QuantizedLinear.from_linear(lin, 64, 4)
    x = mx.random.normal((1, 256)).astype(mx.bfloat16)
    calls = count_kernel_launches(monkeypatch)
    assert QProj.view([ql])(x)[0].dtype == mx.bfloat16 and calls == ["lily_qgemv"]
    ql.update({"scales": ql.scales.astype(mx.float32), "biases": ql.biases.astype(mx.float32)})
    y = QProj.view([ql])(x)[0]
    assert y.dtype == ql(x).dtype == mx.float32 and calls == ["lily_qgemv"]


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc not installed")
def test_cuda_twin_compiles():
    from mlx_lily.testing import cuda_check

    head, body = kernels.cuda_parts("qgemv")
    bf = mx.bfloat16
    cuda_check.check(
        "lily_qgemv", [("x", bf, 2), ("w", mx.uint32, 2), ("scales", bf, 2), ("biases", bf, 2)],
        [("y", bf)], body, head,
        template=[("T", bf), ("S", bf), ("K", 2048), ("O", 8192), ("BITS", 4), ("GS", 64),
                  ("NW", Q.NW), ("RPW", Q.RPW)])


ROW_CASES = [  # (K, O, bits, gs, rows, dtype): multi-row launches against one-row ones
    (2048, 40, 4, 64, 8, mx.bfloat16),   # production input width, a batch of 8
    (4096, 37, 4, 64, 2, mx.bfloat16),   # output projections' width, a batch of 2
    (2048, 24, 8, 64, 3, mx.bfloat16),   # 8-bit (router), odd batch
    (128, 17, 8, 128, 5, mx.float16),    # 8 lanes per row, prime batch
    (64, 7, 4, 64, 4, mx.float32),       # 2 lanes per row, fp32 activations
]


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("case", ROW_CASES, ids=lambda c: f"K{c[0]}-O{c[1]}-b{c[2]}-n{c[4]}")
def test_rows_equal_each_row_alone(backend, case):
    """Batch invariance of the GEMV: every row of an n-row launch (a decode step of n
    sequences) equals that row launched alone, bit for bit; the results are also near
    the fp32 truth (a wrong row mapping cannot pass by matching itself)."""
    k, o, bits, gs, rows, dtype = case
    mx.random.seed(zlib.crc32(repr(case).encode()) % 1000)
    q, s, b = make_weights(o, k, bits, gs)
    x = mx.random.normal((rows, k)).astype(dtype)
    kern, init = kernel_for(Q.SPEC, backend)
    y = Q.launch(kern, x, q, s, b, gs, bits, init_value=init)
    check_close(y, truth(x, q, s, b, gs, bits), x, q, s, b, gs, bits, dtype)
    for i in range(rows):
        alone = Q.launch(kern, x[i:i + 1], q, s, b, gs, bits, init_value=init)
        assert mx.array_equal(y[i:i + 1], alone).item(), i


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc not installed")
def test_cuda_twin_resources():
    """ptxas's report parses, and the production LM-head GEMV stays within the register
    budget that keeps four 128-thread blocks per SM (<= 128) without spilling."""
    from mlx_lily.testing import cuda_check

    head, body = kernels.cuda_parts("qgemv")
    bf = mx.bfloat16
    r = cuda_check.resources(
        "lily_qgemv", [("x", bf, 2), ("w", mx.uint32, 2), ("scales", bf, 2), ("biases", bf, 2)],
        [("y", bf)], body, head,
        template=[("T", bf), ("S", bf), ("K", 2048), ("O", 248320), ("BITS", 4), ("GS", 64),
                  ("NW", Q.NW), ("RPW", Q.RPW)])
    assert set(r) == {"registers", "stack", "spill_stores", "spill_loads"}
    assert 0 < r["registers"] <= 128 and r["spill_stores"] == r["spill_loads"] == 0, r


def test_helper_blocks_identical_across_shaders():
    """Every GEMV-family kernel gets the one shared helper file (``// @header``)."""
    import re

    for backend, ext in (("cuda", "cu"), ("metal", "metal")):
        blocks = set()
        for stem in ("qgemv", "moe_router_topk", "moe_gate_up", "moe_down"):
            text = kernels.shader_source(backend, f"{stem}.{ext}")
            m = re.search(r"// ---- lily qgemv helpers.*?// ---- end lily qgemv helpers ----",
                          text, re.S)
            assert m, (backend, stem)
            blocks.add(m.group(0))
        assert len(blocks) == 1, backend


@pytest.mark.gpu
@pytest.mark.skipif(not any(b in parity_backends() for b in ("cuda", "metal")),
                    reason="no GPU backend")
def test_gpu_production_shapes():
    backend = "cuda" if "cuda" in parity_backends() else "metal"
    mx.random.seed(11)
    for k, o, bits in ((2048, 8192 + 1024, 4), (4096, 2048, 4), (2048, 257, 8)):
        q, s, b = make_weights(o, k, bits, 64)
        x = mx.random.normal((1, k)).astype(mx.bfloat16)
        kern, init = kernel_for(Q.SPEC, backend)
        y = Q.launch(kern, x, q, s, b, 64, bits, init_value=init)
        check_close(y, truth(x, q, s, b, 64, bits), x, q, s, b, 64, bits, mx.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not any(b in parity_backends() for b in ("cuda", "metal")),
                    reason="no GPU backend")
def test_gpu_rows_equal_each_row_alone():
    """Qwen3.6-35B-A3B's batched-decode GEMVs (LM head 2048 -> 248320, out_proj / o_proj
    4096 -> 2048, the 8-bit router 2048 -> 257) at 2 and 8 rows: each row equals that
    row alone, bit for bit, on the device's own compiler; NaN-poisoned outputs."""
    backend = "cuda" if "cuda" in parity_backends() else "metal"
    kern, init = kernel_for(Q.SPEC, backend)
    for k, o, bits in ((2048, 248320, 4), (4096, 2048, 4), (2048, 257, 8)):
        mx.random.seed(o)
        q, s, b = make_weights(o, k, bits, 64)
        for rows in (2, 8):
            x = mx.random.normal((rows, 1, k)).astype(mx.bfloat16)
            y = Q.launch(kern, x, q, s, b, 64, bits, init_value=init)
            xr = x.reshape(rows, k)
            check_close(y.reshape(rows, o), truth(xr, q, s, b, 64, bits), xr, q, s, b, 64,
                        bits, mx.bfloat16)
            for i in range(rows):
                alone = Q.launch(kern, x[i:i + 1], q, s, b, 64, bits, init_value=init)
                assert mx.array_equal(y[i:i + 1], alone).item(), (k, o, rows, i)


# ----------------------------------------------------------------- the tensor-core form
MMA_BACKENDS = [b for b in KERNEL_BACKENDS
                if (b.values[0] if hasattr(b, "values") else b) in ("cuda", "cuda-emu")]
MMA_CASES = [  # (K, O, rows, dtype, group, warps, m-tiles): vs the fp32 truth, rows alone
    (2048, 40, 8, mx.bfloat16, 64, None, 1),  # production input width, a batch of 8
    (4096, 37, 2, mx.bfloat16, 64, 16, 2),    # output projections' width, 16 K splits
    (192, 9, 3, mx.bfloat16, 64, 2, 1),       # 3 chunks over 2 warps, O < 16
    (256, 70, 5, mx.float16, 128, 1, 4),      # f16, group 128, 4 m-tiles, partial last
    (512, 21, 4, mx.bfloat16, 128, 2, 1),     # bf16, group 128
    (64, 7, 1, mx.bfloat16, 64, 1, 2),        # one chunk, one row
]


@pytest.mark.parametrize("backend", MMA_BACKENDS)
@pytest.mark.parametrize("case", MMA_CASES,
                         ids=lambda c: f"K{c[0]}-O{c[1]}-n{c[2]}-g{c[4]}-rt{c[6]}")
def test_mma_kernel_close_to_truth_and_rows_equal_alone(backend, case):
    """``lily_qgemv_mma`` within the GEMV's bound of the fp32 truth (the real kernel's
    outputs NaN-poisoned first), and every row of an n-row launch bit-identical to that
    row launched alone (batch invariance). On the emulator its mma runs as lane shuffles
    over the same fragments, so a wrong fragment or K permutation fails here."""
    k, o, rows, dtype, gs, nw, rt = case
    mx.random.seed(zlib.crc32(repr(case).encode()) % 1000)
    q, s, b = make_weights(o, k, 4, gs, sdtype=dtype)
    x = mx.random.normal((rows, k)).astype(dtype)
    kern, init = kernel_for(Q.MMA_SPEC, backend)
    y = Q.mma_plan(kern, x.shape, x.dtype, q, s, b, gs, 4, nw=nw, rt=rt,
                   init_value=init)(x)
    check_close(y, truth(x, q, s, b, gs, 4), x, q, s, b, gs, 4, dtype)
    for i in range(rows):
        alone = Q.mma_plan(kern, (1, k), x.dtype, q, s, b, gs, 4, nw=nw, rt=rt,
                           init_value=init)(x[i:i + 1])
        assert mx.array_equal(y[i:i + 1], alone).item(), i


@pytest.mark.parametrize("backend", [b for b in MMA_BACKENDS if isinstance(b, str)])
def test_mma_kernel_unaligned_activations(backend, monkeypatch):
    """bf16 activations 2 bytes off a 16-byte boundary: the mma kernel's element-load
    path for x; results within the bound of the truth."""
    monkeypatch.setitem(MISALIGN, "bf16", 2)
    mx.random.seed(8)
    q, s, b = make_weights(24, 1024, 4, 64)
    x = mx.random.normal((3, 1024)).astype(mx.bfloat16)
    kern, init = kernel_for(Q.MMA_SPEC, backend)
    y = Q.mma_plan(kern, x.shape, x.dtype, q, s, b, 64, 4, init_value=init)(x)
    check_close(y, truth(x, q, s, b, 64, 4), x, q, s, b, 64, 4, mx.bfloat16)


def test_mma_warps_and_support():
    """The K split fills the target warps without exceeding half a row's chunks; the mma
    form takes only 4-bit, 64-multiple groups, bf16/f16 activations."""
    assert Q.mma_warps(2048, 248320) == 1          # the LM head: blocks enough
    assert Q.mma_warps(2048, 248320, rt=4) == 1 and Q.mma_warps(4096, 2048, rt=4) == 16
    assert Q.mma_warps(4096, 2048) == 16           # out_proj: 128 blocks, 16 K splits
    assert Q.mma_warps(64, 7) == 1 and Q.mma_warps(256, 40) == 2
    assert Q.mma_warps(384, 40) == 2 and Q.mma_warps(1536, 40) == 8  # cap 3 / 12: powers of 2
    q, s, b = make_weights(40, 256, 4, 64)
    x = mx.zeros((2, 256), mx.bfloat16)
    assert Q.mma_supports(x, q, s, b, 64, 4)
    assert not Q.mma_supports(x.astype(mx.float32), q, s, b, 64, 4)
    q8, s8, b8 = make_weights(40, 256, 8, 64)
    assert not Q.mma_supports(x, q8, s8, b8, 64, 4 * 2)
    q32, s32, b32 = make_weights(40, 256, 4, 32)
    assert not Q.mma_supports(x, q32, s32, b32, 32, 4)
    q3, s3, b3 = make_weights(40, 192, 4, 64)  # K = 192: no lane mapping for lily_qgemv
    x3 = mx.zeros((2, 192), mx.bfloat16)
    assert Q.mma_supports(x3, q3, s3, b3, 64, 4) and not Q.supports(x3, q3, s3, b3, 64, 4)
    assert not Q.mma_supports(mx.zeros((9, 256), mx.bfloat16), q, s, b, 64, 4)  # > 8 rows


def test_mma_routing_follows_the_knob(monkeypatch):
    """On CUDA (emulated) ``QProj`` decode calls take ``lily_qgemv_mma`` under
    ``MLX_LILY_QGEMV_MMA=1`` and ``lily_qgemv`` without it (the plan cache keys on the
    knob); on Metal the knob changes nothing."""
    from mlx_lily.testing.dispatch import emulated_cuda

    mx.random.seed(4)
    lin = nn.Linear(256, 24, bias=False)
    lin.weight = (mx.random.normal((24, 256)) * 0.06).astype(mx.bfloat16)
    ql = nn.QuantizedLinear.from_linear(lin, 64, 4)
    x = mx.random.normal((3, 1, 256)).astype(mx.bfloat16)
    view = QProj.view([ql])
    with emulated_cuda(), pytest.MonkeyPatch.context() as mp:
        calls = count_kernel_launches(mp)
        y0 = view(x)[0]
        mp.setenv("MLX_LILY_QGEMV_MMA", "1")
        y1 = view(x)[0]
        assert calls == ["lily_qgemv", "lily_qgemv_mma"], calls
    assert_close(y1, y0, rtol=0.02, atol=0.02)
    emulated_metal_dispatch(monkeypatch, Q)
    monkeypatch.setenv("MLX_LILY_QGEMV_MMA", "1")
    calls = count_kernel_launches(monkeypatch)
    view(x[:1])
    assert calls == ["lily_qgemv"]


def test_mma_takes_pending_norm_projections_and_gdn_projection(monkeypatch):
    """Under ``MLX_LILY_QGEMV_MMA=1`` on CUDA (emulated) a projection behind a pending
    add + RMSNorm runs ``lily_norm_qgemv_mma`` instead of ``lily_norm_qgemv``, with the
    same residual sum and outputs close to it (and, where that kernel's rows do not fit
    its shared memory, ``lily_add_rms_norm`` then ``lily_qgemv_mma``); the GDN
    decode kernel's fused projection steps aside for such a weight
    (``proj_unsupported``) and not for one the mma kernel does not serve (8-bit)."""
    from mlx_lily.ops import gated_delta as G
    from mlx_lily.ops.proj import PendingNorm
    from mlx_lily.testing.dispatch import emulated_cuda

    mx.random.seed(5)
    lin = nn.Linear(256, 34, bias=False)  # P = 2*Dk + 2*Dv + 2 rows of one 8-wide head
    lin.weight = (mx.random.normal((34, 256)) * 0.06).astype(mx.bfloat16)
    view = QProj.view([nn.QuantizedLinear.from_linear(lin, 64, 4)])
    dims = dict(num_k_heads=1, head_k_dim=8, num_v_heads=1, head_v_dim=8)
    h0, res = (mx.random.normal((2, 1, 256)).astype(mx.bfloat16) for _ in range(2))
    nw = (1 + 0.1 * mx.random.normal((256,))).astype(mx.bfloat16)
    p = G.DecodeProj(h0, res, nw, 1e-6, view.weight, view.scales, view.biases, 64, 4, None)
    with emulated_cuda(), pytest.MonkeyPatch.context() as mp:
        calls = count_kernel_launches(mp)
        pend = PendingNorm(h0, res, nw, 1e-6)
        y0 = view.call_pending(pend)[0]
        h_fused = pend.h
        assert calls == ["lily_norm_qgemv"], calls
        assert not Q.mma_serves("cuda", h0, p.w, p.scales, p.biases, 64, 4)
        mp.setenv("MLX_LILY_QGEMV_MMA", "1")
        del calls[:]
        pend = PendingNorm(h0, res, nw, 1e-6)
        y1 = view.call_pending(pend)[0]
        assert calls == ["lily_norm_qgemv_mma"], calls
        assert mx.array_equal(pend.h, h_fused).item()
        assert G.proj_unsupported(p, *([None] * 6), **dims) == "tensor-core projection"
        wide = nn.Linear(4096, 16, bias=False)
        wide.weight = (mx.random.normal((16, 4096)) * 0.02).astype(mx.bfloat16)
        wview = QProj.view([nn.QuantizedLinear.from_linear(wide, 64, 4)])
        h4, r4 = (mx.random.normal((2, 1, 4096)).astype(mx.bfloat16) for _ in range(2))
        del calls[:]
        wview.call_pending(PendingNorm(h4, r4, mx.ones((4096,), mx.bfloat16), 1e-6))
        assert calls == ["lily_add_rms_norm", "lily_qgemv_mma"], calls
        q8 = nn.QuantizedLinear.from_linear(lin, 64, 8)
        assert not Q.mma_serves("cuda", h0, q8.weight, q8.scales, q8.biases, 64, 8)
    assert_close(y1, y0, rtol=0.02, atol=0.02)


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc not installed")
def test_mma_cuda_body_compiles_within_budget():
    """nvcc builds the tensor-core body for sm_90a at the LM head's and out_proj's shapes
    (bf16) and a small f16 one, without spills and within 128 registers."""
    from mlx_lily.testing import cuda_check

    head, body = kernels.cuda_parts("qgemv_mma")
    for T, k, o, n, nw, rt in ((mx.bfloat16, 2048, 248320, 8, 1, 1),
                               (mx.bfloat16, 2048, 248320, 8, 1, 4),
                               (mx.bfloat16, 4096, 2048, 1, 16, 2),
                               (mx.float16, 128, 37, 3, 2, 1)):
        r = cuda_check.resources(
            "lily_qgemv_mma", [("x", T, 2), ("w", mx.uint32, 2), ("scales", T, 2),
                               ("biases", T, 2)], [("y", T)], body, head,
            template=[("T", T), ("S", T), ("K", k), ("O", o), ("BITS", 4), ("GS", 64),
                      ("N", n), ("NW", nw), ("RT", rt)])
        assert 0 < r["registers"] <= 128 and r["spill_stores"] == r["spill_loads"] == 0, r
