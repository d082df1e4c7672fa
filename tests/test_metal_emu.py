"""Self-validation of the Metal emulator (mlx_lily.testing.metal_emu).

Runs mlx-lm's own Metal gated-delta kernels under the emulator against the
ops reference, small kernels with known answers, and the safety nets.
"""

from __future__ import annotations

import numpy as np
import pytest

import mlx.core as mx

from mlx_lily.testing import metal_emu
from mlx_lily.testing.metal_emu import MetalEmuCompileError, MetalEmuError, metal_kernel

from _close import assert_close

pytestmark = pytest.mark.skipif(not metal_emu.available(), reason="no clang >= 15 (ziglang) for the Metal emulator")


def run1(kernel, inputs, shape, dtype, grid, tg, **kw):
    return kernel(
        inputs=inputs, output_shapes=[shape], output_dtypes=[dtype], grid=grid, threadgroup=tg, **kw
    )[0]


def f32(x) -> np.ndarray:
    return np.array(x.astype(mx.float32))


# --------------------------------------------------------------------------- rendering
def test_render_matches_mlx_signature_rules():
    k = metal_kernel(
        "sig",
        ["a", "b", "c"],
        ["out"],
        "uint i = thread_position_in_grid.x; out[i] = a[i] + b + c[0] + a_shape[0] + a_strides[0];",
        ensure_row_contiguous=False,
    )
    out = k(
        inputs=[mx.arange(16, dtype=mx.float32), mx.array(2.0), mx.ones((4,), dtype=mx.float16)],
        output_shapes=[(16,)],
        output_dtypes=[mx.float32],
        grid=(16, 1, 1),
        threadgroup=(8, 1, 1),
        template=[("T", mx.bfloat16), ("N", 3), ("B", True)],
    )[0]
    msl = k.last_msl
    assert "template <typename T, int N, bool B>" in msl
    assert "custom_kernel_sig__bfloat16_t_3_1_float_floats_float16_tc_float(" in msl
    assert "  const device float* a [[buffer(0)]],\n  const constant int* a_shape [[buffer(1)]],\n" in msl
    assert "  const constant int64_t* a_strides [[buffer(2)]],\n" in msl
    assert "  const constant float& b [[buffer(3)]],\n  const constant float16_t* c [[buffer(4)]],\n" in msl
    assert "  device float* out [[buffer(5)]],\n  uint3 thread_position_in_grid [[thread_position_in_grid]]) {" in msl
    assert "decltype(custom_kernel_sig__bfloat16_t_3_1_float_floats_float16_tc_float<bfloat16_t, 3, 1>)" in msl
    np.testing.assert_array_equal(np.array(out), np.arange(16) + 2 + 1 + 16 + 1)


def test_verbose_prints_msl(capsys):
    k = metal_kernel("verb", ["a"], ["out"], "out[thread_position_in_grid.x] = a[thread_position_in_grid.x];")
    run1(k, [mx.ones((8,))], (8,), mx.float32, (8, 1, 1), (8, 1, 1), verbose=True)
    printed = capsys.readouterr().out
    assert printed.startswith("Generated source code for `verb`:\n```\n[[kernel]] void custom_kernel_verb_float_float(")


# --------------------------------------------------------------------------- mlx-lm gated delta
B, T, HK, HV, DK, DV = 1, 8, 2, 4, 128, 128


@pytest.fixture
def gd():
    # Function scope: install() stays active only while a gated-delta test runs.
    with metal_emu.emulated_module("mlx_lm.models.gated_delta") as mod:
        yield mod
    import mlx_lm.models.gated_delta as stock

    assert stock._gated_delta_kernel is None  # restored: no Metal on this machine


@pytest.fixture(scope="module")
def gd_inputs():
    mx.random.seed(0)
    q = mx.random.normal((B, T, HK, DK)) * 0.1
    k = mx.random.normal((B, T, HK, DK)) * 0.1
    v = mx.random.normal((B, T, HV, DV))
    g = mx.random.uniform(0.5, 1.0, (B, T, HV))
    beta = mx.random.uniform(0.0, 1.0, (B, T, HV))
    state = mx.random.normal((B, HV, DV, DK)) * 0.1
    return q, k, v, g, beta, state


def _close(a, b, tol):
    assert_close(a, b, rtol=tol, atol=tol)


def test_gated_delta_plain_matches_ops(gd, gd_inputs):
    q, k, v, g, beta, state = gd_inputs
    yr, sr = gd.gated_delta_ops(q, k, v, g, beta, state)
    y, s = gd.gated_delta_kernel_unpacked(q, k, v, g, beta, state)
    assert y.shape == (B, T, HV, DV) and s.shape == (B, HV, DV, DK)
    _close(y, yr, 2e-5)
    _close(s, sr, 2e-5)


def test_gated_delta_packed_and_xtree_bitwise(gd, gd_inputs):
    q, k, v, g, beta, state = gd_inputs
    y1, s1 = gd.gated_delta_kernel_unpacked(q, k, v, g, beta, state)
    y2, s2 = gd.gated_delta_kernel(q, k, v, g, beta, state)  # packed path (Dk=128, scalar gate)
    y3, s3 = gd.gated_delta_kernel_xtree(q, k, v, g, beta, state)
    # mlx-lm's contract: packed == explicit tree == simd_sum kernel, bit for bit,
    # when simd_sum is the ascending xor butterfly.
    assert np.array_equal(np.array(y2), np.array(y3)) and np.array_equal(np.array(s2), np.array(s3))
    assert np.array_equal(np.array(y1), np.array(y3)) and np.array_equal(np.array(s1), np.array(s3))
    yr, sr = gd.gated_delta_ops(q, k, v, g, beta, state)
    _close(y2, yr, 2e-5)
    _close(s2, sr, 2e-5)


def test_gated_delta_masked_matches_ops(gd, gd_inputs):
    q, k, v, g, beta, state = gd_inputs
    mask = mx.array([[True] * 5 + [False, True, False]])
    yr, sr = gd.gated_delta_ops(q, k, v, g, beta, state, mask)
    y, s = gd.gated_delta_kernel(q, k, v, g, beta, state, mask)
    m = np.array(mask)[0]
    _close(y[:, mx.array(np.where(m)[0])], yr[:, mx.array(np.where(m)[0])], 2e-5)
    assert np.all(f32(y)[:, ~m] == 0.0)  # the kernel writes zeros where masked
    _close(s, sr, 2e-5)


def test_gated_delta_vectorized_gate_matches_ops(gd, gd_inputs):
    q, k, v, _, beta, state = gd_inputs
    gv = mx.random.uniform(0.5, 1.0, (B, T, HV, DK), key=mx.random.key(3))
    yr, sr = gd.gated_delta_ops(q, k, v, gv, beta, state)
    y, s = gd.gated_delta_kernel(q, k, v, gv, beta, state)
    _close(y, yr, 2e-5)
    _close(s, sr, 2e-5)
    mask = mx.array([[True, False] * 4])
    yr, sr = gd.gated_delta_ops(q, k, v, gv, beta, state, mask)
    y, s = gd.gated_delta_kernel(q, k, v, gv, beta, state, mask)
    _close(s, sr, 2e-5)


def test_gated_delta_bf16_inputs(gd, gd_inputs):
    q, k, v, g, beta, state = gd_inputs
    qb, kb, vb = (x.astype(mx.bfloat16) for x in (q, k, v))
    yr, sr = gd.gated_delta_ops(qb, kb, vb, g, beta, state)
    y, s = gd.gated_delta_kernel(qb, kb, vb, g, beta, state)
    assert y.dtype == mx.bfloat16 and s.dtype == mx.float32
    # one bf16 rounding of y apart at most
    assert_close(f32(y), f32(yr), rtol=1e-2, atol=2e-3)
    _close(s, sr, 1e-4)


# --------------------------------------------------------------------------- known answers
def test_simd_reductions_match_numpy():
    src = """
        uint i = thread_position_in_grid.x;
        float v = x[i];
        sum[i] = simd_sum(v);
        mx_[i] = simd_max(v);
        mn[i] = simd_min(v);
        int iv = int(v * 8.0f);
        isum[i] = simd_sum(iv);
        any_[i] = simd_any(v > 2.5f) ? 1 : 0;
        all_[i] = simd_all(v > -10.0f) ? 1 : 0;
        bal[i] = uint(static_cast<simd_vote::vote_t>(simd_ballot(v > 0.0f)));
    """
    k = metal_kernel("red", ["x"], ["sum", "mx_", "mn", "isum", "any_", "all_", "bal"], src)
    rng = np.random.default_rng(1)
    x = rng.standard_normal(128).astype(np.float32)
    outs = k(
        inputs=[mx.array(x)],
        output_shapes=[(128,)] * 7,
        output_dtypes=[mx.float32, mx.float32, mx.float32, mx.int32, mx.int32, mx.int32, mx.uint32],
        grid=(128, 1, 1),
        threadgroup=(64, 1, 1),
    )
    xs = x.reshape(4, 32)
    # ascending butterfly: pairwise tree over adjacent lanes
    v = xs.copy()
    for m in (1, 2, 4, 8, 16):
        v = v + v[:, np.arange(32) ^ m]
    np.testing.assert_array_equal(np.array(outs[0]).reshape(4, 32), v)
    assert_close(np.array(outs[0]).reshape(4, 32)[:, 0], xs.sum(1), rtol=1e-5)
    np.testing.assert_array_equal(np.array(outs[1]).reshape(4, 32), np.repeat(xs.max(1, keepdims=True), 32, 1))
    np.testing.assert_array_equal(np.array(outs[2]).reshape(4, 32), np.repeat(xs.min(1, keepdims=True), 32, 1))
    iv = (xs * 8).astype(np.int32)
    np.testing.assert_array_equal(np.array(outs[3]).reshape(4, 32)[:, 0], iv.sum(1))
    np.testing.assert_array_equal(np.array(outs[4]).reshape(4, 32)[:, 0], (xs > 2.5).any(1))
    np.testing.assert_array_equal(np.array(outs[5]).reshape(4, 32)[:, 0], np.ones(4))
    bits = ((xs > 0) * (1 << np.arange(32, dtype=np.uint64))).sum(1).astype(np.uint32)
    np.testing.assert_array_equal(np.array(outs[6]).reshape(4, 32)[:, 0], bits)


def test_prefix_sums_and_shuffles():
    src = """
        uint i = thread_position_in_grid.x;
        uint lane = thread_index_in_simdgroup;
        int v = x[i];
        inc[i] = simd_prefix_inclusive_sum(v);
        exc[i] = simd_prefix_exclusive_sum(v);
        dn[i] = simd_shuffle_down(v, 3);
        up[i] = simd_shuffle_up(v, 5);
        xr[i] = simd_shuffle_xor(v, 6);
        sh[i] = simd_shuffle(v, (lane * 7) % 32);
        bc[i] = simd_broadcast(v, 9);
    """
    names = ["inc", "exc", "dn", "up", "xr", "sh", "bc"]
    k = metal_kernel("scan", ["x"], names, src)
    x = np.random.default_rng(2).integers(-50, 50, 64).astype(np.int32)
    outs = [np.array(o).reshape(2, 32) for o in k(
        inputs=[mx.array(x)], output_shapes=[(64,)] * 7, output_dtypes=[mx.int32] * 7,
        grid=(64, 1, 1), threadgroup=(64, 1, 1),
    )]
    xs = x.reshape(2, 32)
    lane = np.arange(32)
    np.testing.assert_array_equal(outs[0], np.cumsum(xs, 1))
    np.testing.assert_array_equal(outs[1], np.cumsum(xs, 1) - xs)
    np.testing.assert_array_equal(outs[2], np.where(lane + 3 < 32, xs[:, np.minimum(lane + 3, 31)], xs))
    np.testing.assert_array_equal(outs[3], np.where(lane >= 5, xs[:, np.maximum(lane - 5, 0)], xs))
    np.testing.assert_array_equal(outs[4], xs[:, lane ^ 6])
    np.testing.assert_array_equal(outs[5], xs[:, (lane * 7) % 32])
    np.testing.assert_array_equal(outs[6], np.repeat(xs[:, 9:10], 32, 1))


def test_atomic_histogram():
    src = """
        uint i = thread_position_in_grid.x;
        atomic_fetch_add_explicit(&hist[x[i]], 1u, memory_order_relaxed);
        atomic_fetch_add_explicit(&total[0], w[i], memory_order_relaxed);
    """
    k = metal_kernel("hist", ["x", "w"], ["hist", "total"], src, atomic_outputs=True, workers=2)
    rng = np.random.default_rng(3)
    x = rng.integers(0, 16, 5000).astype(np.uint32)
    w = np.full(5000, 0.5, np.float32)
    hist, total = k(
        inputs=[mx.array(x), mx.array(w)],
        output_shapes=[(16,), (1,)],
        output_dtypes=[mx.uint32, mx.float32],
        grid=(5000, 1, 1),
        threadgroup=(256, 1, 1),
        init_value=0,
    )
    assert "device atomic<uint32_t>* hist" in k.last_msl
    np.testing.assert_array_equal(np.array(hist), np.bincount(x, minlength=16))
    assert float(total[0]) == 2500.0


def test_threadgroup_atomics_and_cas():
    src = """
        threadgroup atomic_uint counter;
        threadgroup atomic_int best;
        uint t = thread_index_in_threadgroup;
        if (t == 0) {
            atomic_store_explicit(&counter, 0u, memory_order_relaxed);
            atomic_store_explicit(&best, -1000, memory_order_relaxed);
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        atomic_fetch_add_explicit(&counter, 2u, memory_order_relaxed);
        int mine = x[thread_position_in_grid.x];
        int cur = atomic_load_explicit(&best, memory_order_relaxed);
        while (mine > cur && !atomic_compare_exchange_weak_explicit(&best, &cur, mine, memory_order_relaxed, memory_order_relaxed)) {}
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (t == 0) {
            out[threadgroup_position_in_grid.x * 2] = int(atomic_load_explicit(&counter, memory_order_relaxed));
            out[threadgroup_position_in_grid.x * 2 + 1] = atomic_load_explicit(&best, memory_order_relaxed);
        }
    """
    k = metal_kernel("tgatomic", ["x"], ["out"], src)
    x = np.random.default_rng(4).integers(-500, 500, 256).astype(np.int32)
    out = np.array(run1(k, [mx.array(x)], (8,), mx.int32, (256, 1, 1), (64, 1, 1))).reshape(4, 2)
    np.testing.assert_array_equal(out[:, 0], [128] * 4)
    np.testing.assert_array_equal(out[:, 1], x.reshape(4, 64).max(1))


GEMM_SRC = """
    // C[M, N] = A[M, K] @ B[K, N]; one simdgroup per 8x8 tile of C.
    uint tm = threadgroup_position_in_grid.y * 8;
    uint tn = threadgroup_position_in_grid.x * 8;
    simdgroup_matrix<float, 8, 8> acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    for (int k = 0; k < K; k += 8) {
        simdgroup_matrix<T, 8, 8> a;
        simdgroup_matrix<T, 8, 8> b;
        simdgroup_load(a, A + tm * K + k, K);
        simdgroup_load(b, Bm + k * N + tn, N);
        simdgroup_multiply_accumulate(acc, a, b, acc);
    }
    simdgroup_store(acc, C + tm * N + tn, N);
    // the lane layout MLX's steel mma.h relies on
    uint l = thread_index_in_simdgroup;
    uint q = l / 4;
    uint r = (q & 4) + ((l / 2) % 4);
    uint c = (q & 2) * 2 + (l % 2) * 2;
    auto e = acc.thread_elements();
    if (tm == 0 && tn == 0) {
        lay[l * 2] = (e[0] == C[r * N + c]) ? 1 : 0;
        lay[l * 2 + 1] = (e[1] == C[r * N + c + 1]) ? 1 : 0;
    }
"""


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_simdgroup_matrix_gemm(dtype):
    M, N, K = 16, 24, 32
    rng = np.random.default_rng(5)
    a = rng.standard_normal((M, K)).astype(np.float32)
    b = rng.standard_normal((K, N)).astype(np.float32)
    k = metal_kernel("gemm", ["A", "Bm"], ["C", "lay"], GEMM_SRC)
    c, lay = k(
        inputs=[mx.array(a).astype(dtype), mx.array(b).astype(dtype)],
        output_shapes=[(M, N), (64,)],
        output_dtypes=[mx.float32, mx.int32],
        grid=(N // 8 * 32, M // 8, 1),
        threadgroup=(32, 1, 1),
        template=[("T", dtype), ("K", K), ("N", N)],
    )
    ref = np.array(mx.array(a).astype(dtype)).astype(np.float32) @ np.array(mx.array(b).astype(dtype)).astype(np.float32)
    assert_close(np.array(c), ref, rtol=1e-4, atol=1e-4)
    assert np.all(np.array(lay) == 1)


def test_simdgroup_load_transpose():
    src = """
        simdgroup_matrix<float, 8, 8> m;
        simdgroup_load(m, A, 8, ulong2(0, 0), true);
        simdgroup_store(m, out, 8);
    """
    k = metal_kernel("sgT", ["A"], ["out"], src)
    a = np.arange(64, dtype=np.float32).reshape(8, 8)
    out = run1(k, [mx.array(a)], (8, 8), mx.float32, (32, 1, 1), (32, 1, 1))
    np.testing.assert_array_equal(np.array(out), a.T)


def test_threadgroup_transpose_with_barriers():
    src = """
        threadgroup float tile[16][17];
        uint2 t = thread_position_in_threadgroup.xy;
        uint2 g = threadgroup_position_in_grid.xy;
        uint x0 = g.x * 16, y0 = g.y * 16;
        tile[t.y][t.x] = inp[(y0 + t.y) * W + x0 + t.x];
        threadgroup_barrier(mem_flags::mem_threadgroup);
        out[(x0 + t.y) * H + y0 + t.x] = tile[t.x][t.y];
    """
    H, W = 32, 48
    a = np.random.default_rng(6).standard_normal((H, W)).astype(np.float32)
    k = metal_kernel("transpose", ["inp"], ["out"], src)
    for order in ("forward", "reverse", "random"):
        out = run1(k, [mx.array(a)], (W, H), mx.float32, (W, H, 1), (16, 16, 1),
                   template=[("H", H), ("W", W)])
        np.testing.assert_array_equal(np.array(out), a.T)
    # with the barrier removed, running the fibers in reverse order exposes the race
    racy = metal_kernel("transpose_racy", ["inp"], ["out"], src.replace("threadgroup_barrier(mem_flags::mem_threadgroup);", ""),
                        order="reverse")
    out = run1(racy, [mx.array(a)], (W, H), mx.float32, (W, H, 1), (16, 16, 1), template=[("H", H), ("W", W)])
    assert np.isnan(np.array(out)).any()


def test_partial_edge_threadgroups():
    src = """
        uint3 p = thread_position_in_grid;
        uint idx = (p.z * 5 + p.y) * 37 + p.x;
        out[idx * 4 + 0] = threads_per_threadgroup.x;
        out[idx * 4 + 1] = dispatch_threads_per_threadgroup.x;
        out[idx * 4 + 2] = simdgroups_per_threadgroup * 100 + thread_index_in_simdgroup;
        out[idx * 4 + 3] = simd_sum(1u);
    """
    k = metal_kernel("edge", ["dummy"], ["out"], src)
    out = np.array(run1(k, [mx.zeros((1,))], (2 * 5 * 37 * 4,), mx.uint32, (37, 5, 2), (16, 4, 1)))
    out = out.reshape(2, 5, 37, 4)
    assert not (out == 0xFFFFFFFF).any()  # exactly prod(grid) threads ran, each wrote its slot
    assert set(out[..., 0].ravel()) == {16, 5}  # x extent 37 = 16 + 16 + 5
    assert set(out[..., 1].ravel()) == {16}
    # the last x-threadgroup has 5 x 4 = 20 threads (rows y=0..3) -> one short simdgroup of 20 lanes
    np.testing.assert_array_equal(out[0, 0, 32:, 3], [20] * 5)
    np.testing.assert_array_equal(out[0, 0, :16, 3], [32] * 16)
    np.testing.assert_array_equal(out[0, 4, :16, 3], [16] * 16)  # y edge: 16 x 1 threads


def test_grid_smaller_than_threadgroup_is_clamped():
    src = "out[thread_position_in_grid.x] = threads_per_threadgroup.x * 1000 + threadgroups_per_grid.x;"
    k = metal_kernel("clamp", ["d"], ["out"], src)
    out = np.array(run1(k, [mx.zeros((1,))], (10,), mx.uint32, (10, 1, 1), (256, 1, 1)))
    np.testing.assert_array_equal(out, [10 * 1000 + 1] * 10)


def test_bfloat16_round_to_nearest_even_and_half():
    src = """
        uint i = thread_position_in_grid.x;
        bf[i] = static_cast<bfloat16_t>(x[i]);
        hf[i] = static_cast<half>(x[i]);
        bfloat16_t a = static_cast<bfloat16_t>(x[i]);
        prod[i] = a * a;               // bf16 * bf16 -> bf16 (rounded once)
        half h = static_cast<half>(x[i]);
        hsum[i] = h + h * h;           // rounded after each operation
        bits[i] = as_type<ushort>(bf[i]);
    """
    k = metal_kernel("types", ["x"], ["bf", "hf", "prod", "hsum", "bits"], src)
    ties = np.array([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 + 2**-8 + 2**-20], np.float32)
    rng = np.random.default_rng(7)
    x = np.concatenate([ties, rng.standard_normal(252).astype(np.float32) * 100]).astype(np.float32)
    bf, hf, prod, hsum, bits = k(
        inputs=[mx.array(x)],
        output_shapes=[(256,)] * 5,
        output_dtypes=[mx.bfloat16, mx.float16, mx.bfloat16, mx.float16, mx.uint16],
        grid=(256, 1, 1),
        threadgroup=(128, 1, 1),
    )
    u = x.view(np.uint32).astype(np.uint64)
    rne = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    np.testing.assert_array_equal(np.array(bits), rne)
    np.testing.assert_array_equal(np.array(bits)[:4], [0x3F80, 0x3F82, 0xBF80, 0x3F81])
    np.testing.assert_array_equal(np.array(bf.view(mx.uint16)), rne)
    np.testing.assert_array_equal(np.array(hf), x.astype(np.float16))
    bfv = (rne.astype(np.uint32) << 16).view(np.float32)
    p = (bfv * bfv).astype(np.float32)
    pu = p.view(np.uint32).astype(np.uint64)
    np.testing.assert_array_equal(np.array(prod.view(mx.uint16)), ((pu + 0x7FFF + ((pu >> 16) & 1)) >> 16).astype(np.uint16))
    h = x.astype(np.float16)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(np.array(hsum), (h + (h * h).astype(np.float16)).astype(np.float16))


def test_vectors_swizzles_math_and_strides():
    src = """
        uint i = thread_position_in_grid.x;
        float4 v = float4(x[i * x_strides[0]], 2.0f, float2(3.0f, 4.0));
        half4 h = half4(v.wzyx);
        float4 back = static_cast<float4>(h);
        uint2 u = uint2(i, i + 1);
        out[i] = dot(back, float4(1.0f)) + float(u.y - u.x) + metal::precise::sqrt(16.0f)
               + fast::max(v.x, 0.0f) + clamp(-3.0f, 0.0f, 1.0f) + select(0.0f, 100.0f, v.x > 1000.0f)
               + metal::exp(0.0f) + tanh(0.0f) + rsqrt(4.0f) + 0.5h;
    """
    k = metal_kernel("vec", ["x"], ["out"], src, ensure_row_contiguous=False)
    base = mx.arange(32, dtype=mx.float32)
    x = base[::2]  # strided view, passed as is (ensure_row_contiguous=False)
    out = np.array(run1(k, [x], (16,), mx.float32, (16, 1, 1), (16, 1, 1)))
    xv = np.arange(0, 32, 2, dtype=np.float32)
    expect = (xv + 2 + 3 + 4) + 1 + 4 + xv + 0 + 0 + 1 + 0 + 0.5 + 0.5
    assert_close(out, expect, rtol=1e-6)


def test_mlx_lm_block_sum_header_kernel():
    from mlx_lm.kernels._common import BLOCK_SUM_HEADER

    src = """
        uint t = thread_position_in_threadgroup.x;
        threadgroup float buf[32];
        float v = x[threadgroup_position_in_grid.x * TG + t];
        float s = block_sum<TG>(v, buf, thread_index_in_simdgroup, simdgroup_index_in_threadgroup);
        if (t == 0) out[threadgroup_position_in_grid.x] = s;
    """
    k = metal_kernel("blocksum", ["x"], ["out"], src, header=BLOCK_SUM_HEADER)
    x = np.random.default_rng(8).standard_normal((3, 256)).astype(np.float32)
    out = run1(k, [mx.array(x)], (3,), mx.float32, (3 * 256, 1, 1), (256, 1, 1), template=[("TG", 256)])
    assert_close(np.array(out), x.sum(1), rtol=1e-5, atol=1e-5)


def test_limits_and_elem_to_loc_preamble():
    src = """
        uint i = thread_position_in_grid.x;
        auto loc = elem_to_loc(i, x_shape, x_strides, x_ndim);
        out[i] = x[loc] + (Limits<float>::max == INFINITY ? 0.0f : 1000.0f)
                        + (Limits<int>::max == 2147483647 ? 0.0f : 1000.0f);
    """
    k = metal_kernel("e2l", ["x"], ["out"], src, ensure_row_contiguous=False)
    a = mx.arange(24, dtype=mx.float32).reshape(4, 6).T  # (6, 4), strides (1, 6)
    out = run1(k, [a], (24,), mx.float32, (24, 1, 1), (32, 1, 1))
    np.testing.assert_array_equal(np.array(out), np.array(a).ravel())


# --------------------------------------------------------------------------- safety nets
def test_unwritten_output_is_nan():
    k = metal_kernel("holes", ["x"], ["out"], "uint i = thread_position_in_grid.x; if (i % 2 == 0) out[i] = x[i];")
    out = np.array(run1(k, [mx.ones((8,))], (8,), mx.float32, (8, 1, 1), (8, 1, 1)))
    assert np.isnan(out[1::2]).all() and (out[0::2] == 1).all()
    out = np.array(run1(k, [mx.ones((8,))], (8,), mx.float32, (8, 1, 1), (8, 1, 1), init_value=7.0))
    assert (out[1::2] == 7).all()
    ki = metal_kernel("holes_i", ["x"], ["out"], "uint i = thread_position_in_grid.x; if (i == 0) out[i] = 1;")
    out = np.array(run1(ki, [mx.ones((4,))], (4,), mx.int32, (4, 1, 1), (4, 1, 1)))
    np.testing.assert_array_equal(out, [1, -1, -1, -1])


def test_uninitialised_threadgroup_memory_is_nan():
    src = """
        threadgroup float buf[64];
        uint t = thread_index_in_threadgroup;
        if (t < 32) buf[t] = 1.0f;
        threadgroup_barrier(mem_flags::mem_threadgroup);
        out[thread_position_in_grid.x] = buf[t];
    """
    k = metal_kernel("tgpoison", ["x"], ["out"], src)
    out = np.array(run1(k, [mx.ones((1,))], (128,), mx.float32, (128, 1, 1), (64, 1, 1))).reshape(2, 64)
    assert (out[:, :32] == 1).all() and np.isnan(out[:, 32:]).all()


def test_barrier_in_divergent_branch_raises():
    src = """
        uint t = thread_index_in_threadgroup;
        threadgroup float buf[64];
        if (t < 32) {
            buf[t] = 1.0f;
            threadgroup_barrier(mem_flags::mem_threadgroup);
        }
        out[thread_position_in_grid.x] = buf[t];
    """
    k = metal_kernel("divbar", ["x"], ["out"], src)
    with pytest.raises(MetalEmuError) as e:
        run1(k, [mx.ones((1,))], (64,), mx.float32, (64, 1, 1), (64, 1, 1))
    msg = str(e.value)
    assert "divbar" in msg and "threadgroup_barrier" in msg and "source:6" in msg
    assert "body line 6: threadgroup_barrier(mem_flags::mem_threadgroup);" in msg


def test_divergent_simd_collectives_raise():
    src = """
        uint lane = thread_index_in_simdgroup;
        float v = x[lane];
        if (lane < 16) {
            v = simd_sum(v);
        } else {
            v = simd_max(v);
        }
        out[lane] = v;
    """
    k = metal_kernel("divsimd", ["x"], ["out"], src)
    with pytest.raises(MetalEmuError, match=r"divergent simd collective.*source:5|source:7"):
        run1(k, [mx.ones((32,))], (32,), mx.float32, (32, 1, 1), (32, 1, 1))
    early = metal_kernel(
        "earlyret",
        ["x"],
        ["out"],
        "uint lane = thread_index_in_simdgroup;\nif (lane == 3) return;\nout[lane] = simd_sum(x[lane]);",
    )
    with pytest.raises(MetalEmuError, match=r"31 of 32 lane\(s\) wait at simd_sum at source:3 \(simd collective #1\); 1 lane\(s\) returned"):
        run1(early, [mx.ones((32,))], (32,), mx.float32, (32, 1, 1), (32, 1, 1))


def test_barrier_count_mismatch_raises():
    src = """
        uint t = thread_index_in_threadgroup;
        for (uint k = 0; k < (t < 8 ? 2u : 1u); ++k) {
            threadgroup_barrier(mem_flags::mem_none);
        }
        out[t] = 1.0f;
    """
    k = metal_kernel("barcount", ["x"], ["out"], src)
    with pytest.raises(MetalEmuError, match="barrier"):
        run1(k, [mx.ones((1,))], (32,), mx.float32, (32, 1, 1), (32, 1, 1))


def test_threadgroup_memory_limit_raises():
    src = """
        threadgroup float a[4096];
        threadgroup float b[4100];
        uint t = thread_index_in_threadgroup;
        a[t] = 1.0f; b[t] = 2.0f;
        out[t] = a[t] + b[t];
    """
    k = metal_kernel("bigtg", ["x"], ["out"], src)
    with pytest.raises(MetalEmuError, match=r"threadgroup memory limit exceeded: 'threadgroup b'.*32768"):
        run1(k, [mx.ones((1,))], (32,), mx.float32, (32, 1, 1), (32, 1, 1))
    ok = metal_kernel("bigtg_ok", ["x"], ["out"], src.replace("4100]", "4096]"))
    out = run1(ok, [mx.ones((1,))], (32,), mx.float32, (32, 1, 1), (32, 1, 1))
    assert np.all(np.array(out) == 3)


def test_too_many_threads_per_threadgroup_raises(monkeypatch):
    k = metal_kernel("tgmax", ["x"], ["out"], "out[thread_position_in_grid.x] = 1.0f;")
    with pytest.raises(ValueError, match=r"Thread group size \(2048\)"):
        run1(k, [mx.ones((1,))], (2048,), mx.float32, (2048, 1, 1), (2048, 1, 1))
    k896 = metal_kernel("tgmax896", ["x"], ["out"], "out[thread_position_in_grid.x] = 1.0f;",
                        max_threads_per_threadgroup=896)
    with pytest.raises(ValueError, match=r"Thread group size \(1024\).*\(896\)"):
        run1(k896, [mx.ones((1,))], (1024,), mx.float32, (1024, 1, 1), (1024, 1, 1))
    monkeypatch.setenv("MLX_LILY_EMU_MAX_THREADS", "512")
    kenv = metal_kernel("tgmaxenv", ["x"], ["out"], "out[thread_position_in_grid.x] = 1.0f;")
    with pytest.raises(ValueError, match=r"\(512\)"):
        run1(kenv, [mx.ones((1,))], (1024,), mx.float32, (1024, 1, 1), (1024, 1, 1))


def test_compile_error_maps_to_body_line():
    k = metal_kernel("bad", ["x"], ["out"], "uint i = thread_position_in_grid.x;\nout[i] = x[i] + undefined_thing;\n")
    with pytest.raises(MetalEmuCompileError) as e:
        run1(k, [mx.ones((4,))], (4,), mx.float32, (4, 1, 1), (4, 1, 1))
    assert "source:2" in str(e.value) and "undefined_thing" in str(e.value)
    assert "body line 2: out[i] = x[i] + undefined_thing;" in str(e.value)


def test_out_of_bounds_fault_is_reported():
    src = "uint i = thread_position_in_grid.x;\nout[i] = x[i + (1u << 31)];"
    k = metal_kernel("oob", ["x"], ["out"], src)
    with pytest.raises(MetalEmuError, match="invalid memory access"):
        run1(k, [mx.ones((4,))], (4,), mx.float32, (4, 1, 1), (4, 1, 1))
    # the process survives and the emulator keeps working
    ok = metal_kernel("after_oob", ["x"], ["out"], "out[thread_position_in_grid.x] = 2.0f;")
    assert np.all(np.array(run1(ok, [mx.ones((4,))], (4,), mx.float32, (4, 1, 1), (4, 1, 1))) == 2)


def test_write_past_an_output_is_reported():
    """A kernel that writes one element past its output's end (or before its start) fails
    its launch naming the output: on a GPU that write lands in a neighbour's memory."""
    for name, idx in (("past", "4u"), ("before", "-1")):
        src = f"uint i = thread_position_in_grid.x;\nout[i] = 1.0f;\nif (i == 0) out[{idx}] = 2.0f;"
        k = metal_kernel(f"write_{name}", ["x"], ["out"], src)
        with pytest.raises(MetalEmuError, match="wrote outside output 'out'"):
            run1(k, [mx.ones((4,))], (4,), mx.float32, (4, 1, 1), (4, 1, 1))
    inside = metal_kernel("write_inside", ["x"], ["out"], "out[thread_position_in_grid.x] = 3.0f;")
    assert np.all(np.array(run1(inside, [mx.ones((4,))], (4,), mx.float32, (4, 1, 1), (4, 1, 1))) == 3)


def test_install_patches_and_restores():
    orig_kernel, orig_avail = mx.fast.metal_kernel, mx.metal.is_available
    with metal_emu.install():
        assert mx.metal.is_available()
        k = mx.fast.metal_kernel("inst", ["x"], ["out"], "out[thread_position_in_grid.x] = 2 * x[thread_position_in_grid.x];")
        assert isinstance(k, metal_emu.EmulatedMetalKernel)
        out = run1(k, [mx.arange(4, dtype=mx.float32)], (4,), mx.float32, (4, 1, 1), (4, 1, 1))
        np.testing.assert_array_equal(np.array(out), [0, 2, 4, 6])
    assert mx.fast.metal_kernel is orig_kernel and mx.metal.is_available is orig_avail


def test_threadgroup_arrays_with_expression_sizes_are_shared():
    src = """
        constexpr int NS = 2;
        threadgroup float a[NS * 32], b[(NS + 1) * 8];
        uint t = thread_index_in_threadgroup;
        a[t] = float(t);
        if (t < 24) b[t] = 100.0f + t;
        threadgroup_barrier(mem_flags::mem_threadgroup);
        out[t] = a[63 - t] + (t < 24 ? b[23 - t] : 0.0f);
    """
    k = metal_kernel("tgexpr", ["x"], ["out"], src)
    out = np.array(run1(k, [mx.ones((1,))], (64,), mx.float32, (64, 1, 1), (64, 1, 1)))
    t = np.arange(64)
    np.testing.assert_array_equal(out, (63 - t) + np.where(t < 24, 100 + 23 - t, 0))


def test_parity_backends_and_factory():
    from mlx_lily.testing.backends import metal_kernel_factory, parity_backends

    backends = parity_backends()
    assert backends[0] == "reference" and "metal-emu" in backends
    assert ("metal" in backends) == bool(mx.metal.is_available())
    with metal_emu.install():
        assert parity_backends() == backends  # cached, and the emulator is not "metal"
    factory = metal_kernel_factory("metal-emu", max_threads_per_threadgroup=64)
    k = factory("fac", ["x"], ["out"], "out[thread_position_in_grid.x] = x[0];")
    with pytest.raises(ValueError, match=r"\(64\)"):
        run1(k, [mx.ones((1,))], (128,), mx.float32, (128, 1, 1), (128, 1, 1))
    assert metal_kernel_factory("metal") is mx.fast.metal_kernel


SHADER_BODIES = sorted((__import__("pathlib").Path(__file__).resolve().parents[1] / "shaders" / "metal").glob("*.metal"))


@pytest.mark.skipif(not SHADER_BODIES, reason="no shaders/metal/*.metal kernel bodies yet")
@pytest.mark.parametrize("path", SHADER_BODIES, ids=[p.name for p in SHADER_BODIES])
def test_shader_bodies_compile_under_emulator(path):
    """Every kernel body compiles under the emulator for each declared instantiation
    (op tests then run them against their references)."""
    from mlx_lily.testing import msl_lint

    spec = msl_lint.parse_body_file(path)
    k = spec.kernel(metal_emu.metal_kernel)
    for template in spec.templates:
        def dt(name):
            return msl_lint._resolve_dtype(name, template)

        infos = [
            metal_emu._render.InputInfo(dt(d), 0 if kind == "scalar" else 1, 1 if kind != "array" else 1 << 20)
            for _, d, kind in spec.inputs
        ]
        k.build(infos, [dt(d) for _, d in spec.outputs], template)


def test_buffers_are_aligned_for_vector_loads():
    src = """
        uint i = thread_position_in_grid.x;
        float4 v = *((const device float4*)(x + i * x_strides[0] * 4));
        out[i] = v.x + v.y + v.z + v.w + float((uint64_t(x) % 64) == 0) * 1000.0f
               + float((uint64_t(out) % 64) == 0) * 10000.0f;
    """
    k = metal_kernel("aligned", ["x"], ["out"], src, ensure_row_contiguous=False)
    base = mx.arange(40, dtype=mx.float32)
    for x in (base[2:34], base[4:36]):  # views starting 8 and 16 bytes into the buffer
        out = np.array(run1(k, [x], (8,), mx.float32, (8, 1, 1), (8, 1, 1)))
        xs = np.array(x).reshape(8, 4)
        np.testing.assert_array_equal(out, xs.sum(1) + 11000)


# --------------------------------------------------------------------------- address spaces
_AS_HELPER = "inline float first_of(const device float* p) { return p[0]; }\n"
_AS_BODY = """uint i = thread_position_in_grid.x;
if (USE) {
  out[i] = first_of(x);
} else {
  out[i] = x[i];
}
"""


def test_constant_input_to_device_helper_does_not_compile():
    """Address spaces are kept in the emulator's types: a 4-element input (MLX passes it
    as `const constant float*`) handed to a `const device float*` helper fails to compile,
    even in a branch the template switches off, as on a Mac; with 8 elements (`device`)
    the same kernel runs."""
    k = metal_kernel("as_planted", ["x"], ["out"], _AS_BODY, header=_AS_HELPER)
    with pytest.raises(MetalEmuCompileError, match="no matching function for call to 'first_of'"):
        run1(k, [mx.arange(4, dtype=mx.float32)], (4,), mx.float32, (4, 1, 1), (4, 1, 1),
             template=[("USE", False)])
    out = run1(k, [mx.arange(8, dtype=mx.float32)], (8,), mx.float32, (8, 1, 1), (8, 1, 1),
               template=[("USE", False)])
    np.testing.assert_array_equal(f32(out), np.arange(8, dtype=np.float32))


def test_threadgroup_and_device_pointers_do_not_mix():
    """A threadgroup array's address is a `threadgroup` pointer: storing it in a
    `device` one is an error, as in Metal."""
    body = """threadgroup float buf[32];
buf[thread_position_in_threadgroup.x] = x[thread_position_in_grid.x];
threadgroup_barrier(mem_flags::mem_threadgroup);
device float* p = buf;
out[thread_position_in_grid.x] = p[0];
"""
    k = metal_kernel("as_tg", ["x"], ["out"], body)
    with pytest.raises(MetalEmuCompileError, match=r"cannot initialize a variable of type 'device float \*'"):
        run1(k, [mx.zeros((32,))], (32,), mx.float32, (32, 1, 1), (32, 1, 1))
    ok = metal_kernel("as_tg_ok", ["x"], ["out"], body.replace("device float* p", "threadgroup float* p"))
    out = run1(ok, [mx.arange(32, dtype=mx.float32)], (32,), mx.float32, (32, 1, 1), (32, 1, 1))
    np.testing.assert_array_equal(f32(out), np.zeros(32, np.float32))
