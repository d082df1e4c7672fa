"""norm_qgemv: reference vs stock (add, ``mx.fast.rms_norm``, ``QuantizedLinear``), the
``lily_norm_qgemv`` kernel vs an fp32 truth on every parity backend (NaN-poisoned outputs
on GPUs), QProj routing of a pending norm, and the CUDA twin's nvcc compile."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlx_lily import config, kernels
from mlx_lily.ops import norm_qgemv as NQ
from mlx_lily.testing.backends import parity_backends
from mlx_lily.testing.cuda_check import nvcc_path
from mlx_lily.testing.cuda_emu import (
    BACKENDS, KERNEL_BACKENDS, aligned_emu_buffers, kernel_for)

from _close import EPS, assert_close, f64


@pytest.fixture(autouse=True)
def _aligned_emu_buffers(monkeypatch):
    yield from aligned_emu_buffers(monkeypatch)


def make_weights(o, k, bits, gs, sdtype=mx.bfloat16):
    w = (mx.random.normal((o, k)) * k ** -0.5).astype(sdtype)
    return mx.quantize(w, gs, bits)


def make_inputs(rows, k, dtype, seed):
    mx.random.seed(seed)
    h0 = (mx.random.normal((rows, k)) * 3).astype(dtype)
    res = mx.random.normal((rows, k)).astype(dtype)
    nw = (1 + 0.2 * mx.random.normal((k,))).astype(dtype)
    return h0, res, nw


def check(y, h, h0, res, nw, eps, q, s, b, gs, bits, dtype):
    """``h`` exact; ``y`` within fp32-accumulation rounding of the truth computed from the
    reference's normalised row, plus one bf16 ulp of one term (the kernel's sum of
    squares runs in another order, which can flip one rounding of x)."""
    with mx.stream(mx.cpu):
        h_ref, x = NQ.add_rms_norm_reference(h0, res, nw, eps)
        assert mx.array_equal(h, h_ref).item(), "residual h differs"
        wf = mx.dequantize(q, s.astype(mx.float32), b.astype(mx.float32), gs, bits)
        xf = x.astype(mx.float32)
        t = xf @ wf.T
        mag = mx.abs(xf) @ mx.abs(wf).T
        flip = EPS[mx.bfloat16] * mx.abs(xf).max(axis=-1, keepdims=True) * mx.abs(wf).max(axis=1)
    assert y.dtype == dtype
    assert_close(y, t, dtype=dtype, ulps=0.5, rtol=1e-5, scale=mag, atol=f64(flip) + 1e-6)


def test_reference_matches_stock_layers():
    with mx.stream(mx.cpu):
        mx.random.seed(0)
        for bits in (4, 8):
            lin = nn.Linear(256, 40, bias=False)
            lin.weight = (mx.random.normal((40, 256)) * 0.06).astype(mx.bfloat16)
            ql = nn.QuantizedLinear.from_linear(lin, 64, bits)
            norm = nn.RMSNorm(256, eps=1e-6)
            norm.weight = (1 + 0.1 * mx.random.normal((256,))).astype(mx.bfloat16)
            h0, res, _ = make_inputs(1, 256, mx.bfloat16, 1)
            y, h = NQ.norm_qgemv_reference(h0, res, norm.weight, 1e-6, ql.weight, ql.scales,
                                           ql.biases, 64, bits)
            assert mx.array_equal(h, h0 + res).item()
            assert mx.array_equal(y, ql(norm(h0 + res))).item()


def test_supports():
    q, s, b = make_weights(8, 256, 4, 64)
    h0, res, nw = make_inputs(1, 256, mx.bfloat16, 2)
    assert NQ.supports(h0, res, nw, q, s, b, 64, 4)
    assert not NQ.supports(h0, res.astype(mx.float16), nw, q, s, b, 64, 4)
    assert not NQ.supports(h0, res, nw[:128], q, s, b, 64, 4)
    assert not NQ.supports(h0, res, nw.astype(mx.float32), q, s, b, 64, 4)
    assert not NQ.supports(h0, res, nw, q, s, b, 64, 4, mode="mxfp4")
    big = mx.zeros((1, 2 * NQ.MAX_K), mx.bfloat16)
    qb, sb, bb = make_weights(8, 2 * NQ.MAX_K, 4, 64)
    assert not NQ.supports(big, big, big[0], qb, sb, bb, 64, 4)


CASES = [  # (K, O, bits, gs, rows, dtype)
    (2048, 40, 4, 64, 1, mx.bfloat16),   # production width, 4-bit, one row
    (2048, 24, 8, 64, 2, mx.bfloat16),   # 8-bit, two rows
    (512, 33, 4, 32, 3, mx.bfloat16),    # odd output count, group 32
    (128, 17, 8, 128, 1, mx.float16),    # 8 lanes per row
    (64, 7, 4, 64, 1, mx.float32),       # K smaller than the threadgroup
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"K{c[0]}-O{c[1]}-b{c[2]}-g{c[3]}-n{c[4]}")
def test_kernel_parity(backend, case):
    k, o, bits, gs, rows, dtype = case
    mx.random.seed(hash(case) % 1000)
    q, s, b = make_weights(o, k, bits, gs)
    h0, res, nw = make_inputs(rows, k, dtype, hash(case) % 997)
    eps = 1e-6
    if backend == "reference":
        with mx.stream(mx.cpu):
            y, h = NQ.norm_qgemv(h0, res, nw, eps, q, s, b, gs, bits)
            y2, h2 = NQ.norm_qgemv_reference(h0, res, nw, eps, q, s, b, gs, bits)
        assert mx.array_equal(y, y2).item() and mx.array_equal(h, h2).item()
        return
    kern, init = kernel_for(NQ.SPEC, backend)
    assert NQ.supports(h0, res, nw, q, s, b, gs, bits)
    y, h = NQ.launch(kern, h0, res, nw, eps, q, s, b, gs, bits, init_value=init)
    check(y, h, h0, res, nw, eps, q, s, b, gs, bits, dtype)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_kernel_detects_wrong_answer(backend):
    """The check fails for a corrupted scale and for a wrong norm weight."""
    mx.random.seed(3)
    q, s, b = make_weights(16, 256, 4, 64)
    h0, res, nw = make_inputs(1, 256, mx.bfloat16, 4)
    kern, init = kernel_for(NQ.SPEC, backend)
    y, h = NQ.launch(kern, h0, res, nw, 1e-6, q, s, b, 64, 4, init_value=init)
    check(y, h, h0, res, nw, 1e-6, q, s, b, 64, 4, mx.bfloat16)
    s2 = s.at[3, 1].add(mx.array(0.5, mx.bfloat16))
    with pytest.raises(AssertionError):
        check(y, h, h0, res, nw, 1e-6, q, s2, b, 64, 4, mx.bfloat16)
    with pytest.raises(AssertionError):
        check(y, h, h0, res, nw * 1.5, 1e-6, q, s, b, 64, 4, mx.bfloat16)


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc not installed")
def test_cuda_twin_compiles():
    from mlx_lily.testing import cuda_check

    head, body = kernels.cuda_parts("norm_qgemv")
    bf = mx.bfloat16
    cuda_check.check(
        "lily_norm_qgemv",
        [("hin", bf, 2), ("res", bf, 2), ("nw", bf, 1), ("eps", mx.float32, 1),
         ("w", mx.uint32, 2), ("scales", bf, 2), ("biases", bf, 2)],
        [("y", bf), ("h", bf)], body, head,
        template=[("T", bf), ("S", bf), ("K", 2048), ("O", 12352), ("BITS", 4), ("GS", 64),
                  ("NW", NQ.NW), ("RPW", NQ.RPW)])


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("case", [(2048, 40, 4, 64, 8, mx.bfloat16),
                                  (256, 24, 8, 32, 3, mx.bfloat16),
                                  (128, 9, 4, 64, 5, mx.float16)],
                         ids=lambda c: f"K{c[0]}-O{c[1]}-b{c[2]}-n{c[4]}")
def test_rows_equal_each_row_alone(backend, case):
    """Every row of a multi-row launch (a decode step of several sequences) equals that
    row launched alone, bit for bit, in ``y`` and ``h``; and the results pass the fp32
    check."""
    k, o, bits, gs, rows, dtype = case
    mx.random.seed(o + rows)
    q, s, b = make_weights(o, k, bits, gs)
    h0, res, nw = make_inputs(rows, k, dtype, o + rows)
    kern, init = kernel_for(NQ.SPEC, backend)
    y, h = NQ.launch(kern, h0, res, nw, 1e-6, q, s, b, gs, bits, init_value=init)
    check(y, h, h0, res, nw, 1e-6, q, s, b, gs, bits, dtype)
    for i in range(rows):
        yi, hi = NQ.launch(kern, h0[i:i + 1], res[i:i + 1], nw, 1e-6, q, s, b, gs, bits,
                           init_value=init)
        assert mx.array_equal(y[i:i + 1], yi).item() and mx.array_equal(h[i:i + 1], hi).item()


MMA_BACKENDS = [b for b in KERNEL_BACKENDS
                if (b.values[0] if hasattr(b, "values") else b) in ("cuda", "cuda-emu")]


@pytest.mark.parametrize("backend", MMA_BACKENDS)
@pytest.mark.parametrize("case", [(2048, 40, 64, 8, mx.bfloat16, None),  # production width
                                  (256, 37, 64, 3, mx.float16, None),   # f16, partial m-tile
                                  (512, 21, 128, 4, mx.bfloat16, None),  # group 128
                                  (128, 7, 64, 1, mx.bfloat16, None),   # two chunks, one row
                                  (512, 24, 64, 5, mx.bfloat16, 2),     # 16-byte norm loads
                                  (1024, 17, 64, 2, mx.bfloat16, 4)],   # 16-byte, as the model
                         ids=lambda c: f"K{c[0]}-O{c[1]}-g{c[2]}-n{c[3]}-w{c[5]}")
def test_mma_kernel_parity_and_rows_equal_alone(backend, case):
    """``lily_norm_qgemv_mma``: ``h`` exact, ``y`` within the fp32 bound of the truth from
    the reference's normalised rows (the real kernel's outputs NaN-poisoned first), and
    every row of an n-row launch bit-identical to that row launched alone. The last two
    cases' warps make ``K`` a multiple of 256 per warp, so the norm takes its 16-byte
    path (the model's 2048 at 4 warps does)."""
    k, o, gs, rows, dtype, nwarps = case
    q, s, b = make_weights(o, k, 4, gs, sdtype=dtype)
    h0, res, nw = make_inputs(rows, k, dtype, o + rows)
    kern, init = kernel_for(NQ.MMA_SPEC, backend)
    assert NQ.mma_supports(h0, res, nw, q, s, b, gs, 4)
    y, h = NQ.mma_plan(kern, h0.shape, dtype, q, s, b, gs, 4, nw=nwarps, init_value=init)(
        h0, res, nw, 1e-6)
    check(y, h, h0, res, nw, 1e-6, q, s, b, gs, 4, dtype)
    for i in range(rows):
        yi, hi = NQ.mma_plan(kern, (1, k), dtype, q, s, b, gs, 4, nw=nwarps,
                             init_value=init)(h0[i:i + 1], res[i:i + 1], nw, 1e-6)
        assert mx.array_equal(y[i:i + 1], yi).item() and mx.array_equal(h[i:i + 1], hi).item()


def test_mma_supports_does_not_depend_on_rows():
    """The folded tensor-core form takes a width whose block holds ``qgemv.MAX_ROWS`` rows
    in 48 KiB (the model's 2048), at one row as at eight, and no wider one (4096), so the
    rows of a step never change which kernel a projection runs."""
    q, s, b = make_weights(40, 2048, 4, 64)
    q4, s4, b4 = make_weights(40, 4096, 4, 64)
    for rows in (1, 8):
        h0, res, nw = make_inputs(rows, 2048, mx.bfloat16, rows)
        assert NQ.mma_supports(h0, res, nw, q, s, b, 64, 4)
        assert not NQ.mma_supports(h0, res, nw, q, s, b, 64, 8)
        h0, res, nw = make_inputs(rows, 4096, mx.bfloat16, rows)
        assert not NQ.mma_supports(h0, res, nw, q4, s4, b4, 64, 4)
    assert NQ.mma_shared_bytes(2048, 12352, 2) <= NQ.MMA_SHARED_BYTES


def test_mma_loop_copy_matches_qgemv_mma_body():
    """``qgemv_mma.cuh``'s ``lily_qgemv_mma_block`` is ``qgemv_mma.cu``'s body (kept as a
    copy so that kernel's registers stay as measured): line for line the same but for
    the partials' flat indexing, ``tid`` / ``bx`` for ``threadIdx.x`` / ``blockIdx.x``
    and the index-range assumptions."""
    import re

    from mlx_lily.kernels import shader_path

    body = shader_path("cuda", "qgemv_mma.cu").read_text().split("// ---- body ----\n", 1)[1]
    head = shader_path("cuda", "qgemv_mma.cuh").read_text()
    fn = head.split("int bx) {\n", 1)[1].split("\n}\n// ---- end lily qgemv_mma helpers", 1)[0]
    fn = re.sub(r"#ifndef LILY_EMU\n.*?#endif\n", "", fn, count=1, flags=re.S)
    body = body.replace("threadIdx.x", "tid").replace("blockIdx.x", "bx")
    body = re.sub(r"\n *__shared__ float part\[NW\]\[RT \* 4\]\[32\];[^\n]*", "", body)
    body = re.sub(r"part\[(\w+)\]\[(4 \* r \+ i)\]\[lane\]",
                  lambda m: (f"part[({m.group(1)} * RT * 4 + {m.group(2)}) * 32 + lane]"
                             if m.group(1) != "0" else f"part[({m.group(2)}) * 32 + lane]"),
                  body)
    assert [l.rstrip() for l in fn.strip("\n").splitlines()] == \
        [l.rstrip() for l in body.strip("\n").splitlines()]


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc not installed")
def test_mma_cuda_body_compiles_within_budget():
    """nvcc builds ``lily_norm_qgemv_mma`` for sm_90a at the model's GDN input projection
    (2048 -> 12352, 8 rows, its warps) and a small f16 shape, without spills, within 128
    registers and the 48 KiB of static shared memory."""
    from mlx_lily.ops import qgemv as Q
    from mlx_lily.testing import cuda_check

    head, body = kernels.cuda_parts("norm_qgemv_mma")
    for T, k, o, n in ((mx.bfloat16, 2048, 12352, 8), (mx.bfloat16, 2048, 12352, 1),
                       (mx.float16, 256, 37, 3)):
        r = cuda_check.resources(
            "lily_norm_qgemv_mma", [("hin", T, 2), ("res", T, 2), ("nw", T, 1),
                                    ("eps", mx.float32, 1), ("w", mx.uint32, 2),
                                    ("scales", T, 2), ("biases", T, 2)],
            [("y", T), ("h", T)], body, head,
            template=[("T", T), ("S", T), ("K", k), ("O", o), ("BITS", 4), ("GS", 64),
                      ("N", n), ("NW", Q.mma_warps(k, o)), ("RT", 1)])
        assert 0 < r["registers"] <= 128 and r["spill_stores"] == r["spill_loads"] == 0, r


@pytest.mark.gpu
@pytest.mark.skipif(not any(b in parity_backends() for b in ("cuda", "metal")),
                    reason="no GPU backend")
def test_gpu_production_shapes():
    """Qwen3.6-35B-A3B's fused projections: GDN in_proj (2048 -> 12352), attention
    q|k|v (2048 -> 9216), at one, two and eight rows."""
    backend = "cuda" if "cuda" in parity_backends() else "metal"
    for k, o, rows in ((2048, 12352, 1), (2048, 9216, 1), (2048, 12352, 2), (2048, 9216, 8)):
        mx.random.seed(o + rows)
        q, s, b = make_weights(o, k, 4, 64)
        h0, res, nw = make_inputs(rows, k, mx.bfloat16, o)
        kern, init = kernel_for(NQ.SPEC, backend)
        y, h = NQ.launch(kern, h0, res, nw, 1e-6, q, s, b, 64, 4, init_value=init)
        check(y, h, h0, res, nw, 1e-6, q, s, b, 64, 4, mx.bfloat16)


def test_supports_bounds_the_staged_row_bytes():
    """The normalised row lives in threadgroup memory: fp32 rows of 8192 would pass Apple's
    32 KiB with the rest of the kernel, so the row is capped at ``MAX_ROW_BYTES``."""
    for k, dt, ok in ((8192, mx.bfloat16, True), (8192, mx.float32, False),
                      (4096, mx.float32, True)):
        q, s, b = make_weights(8, k, 4, 64)
        h0 = mx.zeros((1, k), dt)
        assert NQ.supports(h0, h0, h0[0], q, s, b, 64, 4) is ok, (k, dt)


@pytest.mark.skipif("metal-emu" not in parity_backends(), reason="Metal emulator unavailable")
def test_for_qproj_follows_switches(monkeypatch):
    """The fused GEMV is qgemv's loop: ``MLX_LILY_DISABLE=qgemv`` or ``=norm_qgemv``, and an
    ``MLX_LILY_KERNELS`` list without norm_qgemv, stop it even after a plan was cached."""
    from mlx_lily.ops import qgemv as Q
    from mlx_lily.qproj import QProj
    from mlx_lily.testing.dispatch import emulated_metal_dispatch

    emulated_metal_dispatch(monkeypatch, NQ, Q)
    monkeypatch.setenv("MLX_LILY_KERNELS", "all")
    lin = nn.Linear(256, 24, bias=False)
    lin.weight = (mx.random.normal((24, 256)) * 0.06).astype(mx.bfloat16)
    proj = QProj.view([nn.QuantizedLinear.from_linear(lin, 64, 4)])
    h0, res, nw = make_inputs(1, 256, mx.bfloat16, 9)
    assert NQ.for_qproj(h0, res, nw, 1e-6, proj) is not None  # plan cached now
    for var, val in (("MLX_LILY_DISABLE", "qgemv"), ("MLX_LILY_DISABLE", "norm_qgemv"),
                     ("MLX_LILY_KERNELS", "qgemv,attention")):
        with monkeypatch.context() as m:
            m.setenv(var, val)
            assert NQ.for_qproj(h0, res, nw, 1e-6, proj) is None, (var, val)
    with monkeypatch.context() as m:
        m.setenv(NQ.SPLIT_ENV, "split")  # add_rms_norm + qgemv instead (benchmarking)
        assert NQ.for_qproj(h0, res, nw, 1e-6, proj) is None
        m.setenv(NQ.SPLIT_ENV, "fused")
        assert NQ.for_qproj(h0, res, nw, 1e-6, proj) is not None
        m.setenv(NQ.SPLIT_ENV, "maybe")  # a bad value: one warning, then "fused"
        config.WARNED.discard((NQ.SPLIT_ENV, "maybe"))
        with pytest.warns(UserWarning, match="MLX_LILY_NORM_GEMV"):
            assert NQ.for_qproj(h0, res, nw, 1e-6, proj) is not None
    monkeypatch.setitem(Q.USE_FOR_QPROJ, "metal", False)
    assert NQ.for_qproj(h0, res, nw, 1e-6, proj) is None


def test_launch_shape_spreads_small_outputs(monkeypatch):
    """With a MIN_BLOCKS entry, small O (the 8-bit router + shared gate, 2048 -> 257) is
    spread over at least that many threadgroups; large O keeps (NW, RPW); backends
    without an entry keep it."""
    from mlx_lily.ops import qgemv as Q

    # none set (measured); 8-bit K 2048 is 4 words per lane per row: RPW capped to 2
    assert Q.launch_shape(2048, 257, 8, "cuda") == (Q.NW, 2)
    assert Q.launch_shape(4096, 2048, 4, "cuda") == (Q.NW, 2)
    assert Q.launch_shape(2048, 9216, 4, "cuda") == (Q.NW, Q.RPW)
    assert Q.launch_shape(512, 2048, 4, "cuda") == (Q.NW, Q.RPW)  # 1 word: RPW stays
    assert Q.launch_shape(8192, 2048, 4, "cuda") == (Q.NW, 1)
    monkeypatch.setattr(Q, "MIN_BLOCKS", {"cuda": 128})
    assert Q.launch_shape(2048, 257, 8, "cuda") == (2, 1)
    assert -(-257 // Q.rows_per_block(2048, 8, 2, 1)) >= Q.MIN_BLOCKS["cuda"]
    assert Q.launch_shape(2048, 12352, 4, "cuda") == (Q.NW, Q.RPW)
    assert Q.launch_shape(2048, 257, 8, "metal") == (Q.NW, Q.RPW)
    assert Q.launch_shape(2048, 3, 4, "cuda") == (1, 1)
    with pytest.raises(ValueError):
        Q.launch_shape(100, 8, 4, "cuda")


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("nw,rpw", [(2, 1), (1, 1), (1, 4)])
def test_kernel_parity_small_launch_shapes(backend, nw, rpw):
    """The router's shape (2048 -> 257, 8-bit) at the launch shapes ``launch_shape``
    picks for small O: one- and two-warp threadgroups (the norm prologue's word loop
    then covers the row in 8 words per thread)."""
    k, o, bits, gs, rows, dtype = 2048, 257, 8, 64, 1, mx.bfloat16
    mx.random.seed(11)
    q, s, b = make_weights(o, k, bits, gs)
    h0, res, nw_ = make_inputs(rows, k, dtype, 12)
    kern, init = kernel_for(NQ.SPEC, backend)
    y, h = NQ.launch(kern, h0, res, nw_, 1e-6, q, s, b, gs, bits, nw=nw, rpw=rpw,
                     init_value=init)
    check(y, h, h0, res, nw_, 1e-6, q, s, b, gs, bits, dtype)
