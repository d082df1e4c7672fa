"""Parity tests for the attention op: q/k norm + RoPE, split-K decode SDPA, flash prefill,
fused output gate.

Backends: "reference" (the pure-MLX references against stock mlx-lm and fp32 math),
"metal-emu" (Metal twins under the CPU Metal emulator), "cuda-emu" (the CUDA twins'
bodies run under the same emulator's fiber runtime with warp-level mma/ldmatrix/cp.async
emulated from the PTX ISA fragment layouts, see ``_CUDA_EMU_PRELUDE``), and "metal" /
"cuda" (real hardware, marked ``gpu``). Every kernel output is NaN-poisoned by the
emulator, so an unwritten element fails the comparison.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlx_lily.ops.attention as A
from mlx_lily import config, kernels
from mlx_lily.kernels import cuda_parts
from mlx_lily.testing.backends import metal_emu_available, parity_backends

from _close import assert_close

sys.path.insert(0, str(Path(__file__).resolve().parent))

gpu = pytest.mark.gpu
BACKENDS = [
    "reference",
    "metal-emu",
    "cuda-emu",
    pytest.param("metal", marks=gpu),
    pytest.param("cuda", marks=gpu),
]
EMU_BACKENDS = ["metal-emu", "cuda-emu"]
# Small-shape cases: real CUDA is left to the production-dim tests below (each CUDA template
# instantiation costs an NVRTC compile on the GPU machine; the emulator covers these shapes).
SMALL_BACKENDS = ["reference", "metal-emu", "cuda-emu", pytest.param("metal", marks=gpu)]

# --------------------------------------------------------------------------- CUDA on the emulator
_CUDA_EMU_PRELUDE = r"""
#define LILY_CUDA_EMU 1
#define __device__
#define __forceinline__ inline
#define __global__
#define __restrict__
typedef bfloat16_t __nv_bfloat16;
typedef half __half;
struct __lily_dim3 { unsigned x, y, z; };
inline float __int_as_float(int x) { return __builtin_bit_cast(float, x); }
inline float __int_as_float(unsigned x) { return __builtin_bit_cast(float, x); }
inline float exp2f(float x) { return metal::precise::exp2(x); }
inline float expf(float x) { return metal::precise::exp(x); }
inline float fmaxf(float a, float b) { return metal::fmax(a, b); }
inline float rsqrtf(float x) { return metal::precise::rsqrt(x); }
inline float cosf(float x) { return metal::precise::cos(x); }
inline float sinf(float x) { return metal::precise::sin(x); }
inline uint4 make_uint4(uint a, uint b, uint c, uint d) { uint4 r; r.x = a; r.y = b; r.z = c; r.w = d; return r; }
inline float4 make_float4(float a, float b, float c, float d) { float4 r; r.x = a; r.y = b; r.z = c; r.w = d; return r; }
inline uint32_t __byte_perm(uint32_t x, uint32_t y, uint32_t s) {
  unsigned long long v = ((unsigned long long)y << 32) | x;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= (uint32_t)((v >> (8 * ((s >> (4 * i)) & 7))) & 0xffu) << (8 * i);
  return r;
}
#define __shfl_xor_sync(m, v, o) simd_shuffle_xor((v), (ushort)(o))
#define __shfl_sync(m, v, s) simd_shuffle((v), (ushort)(s))
#define __syncthreads() threadgroup_barrier(mem_flags::mem_threadgroup)

// Warp-level mma.sync (m16n8k16 / m16n8k8, f32 accumulate), fragment layouts from the
// PTX ISA: groupID = lane>>2, tig = lane%4; A rows gid (+8), cols 2*tig+{0,1} (+8 for
// a4..a7); B rows 2*tig+{0,1} (+8 for b2,b3), col gid; C rows gid (+8), cols 2*tig+{0,1}.
struct __lily_mma_in { uint32_t a[4]; uint32_t b[2]; float c[4]; int k; };
template <typename T> inline float __lily_unpack(uint32_t w, int hi) {
  unsigned short bits = hi ? (unsigned short)(w >> 16) : (unsigned short)(w & 0xffffu);
  return (float)__builtin_bit_cast(T, bits);
}
template <typename T> void __lily_mma_fn(__emu_simd_xchg* g) {
  float A[16][16], B[16][8], C[16][8];
  const int K = __emu::ld<__lily_mma_in>(g->in[0]).k;
  for (int l = 0; l < 32; ++l) {
    __lily_mma_in f = __emu::ld<__lily_mma_in>(g->in[l]);
    const int gid = l >> 2, tig = l & 3;
    for (int e = 0; e < 2; ++e) {
      A[gid][2 * tig + e] = __lily_unpack<T>(f.a[0], e);
      A[gid + 8][2 * tig + e] = __lily_unpack<T>(f.a[1], e);
      B[2 * tig + e][gid] = __lily_unpack<T>(f.b[0], e);
      if (K == 16) {
        A[gid][2 * tig + 8 + e] = __lily_unpack<T>(f.a[2], e);
        A[gid + 8][2 * tig + 8 + e] = __lily_unpack<T>(f.a[3], e);
        B[2 * tig + 8 + e][gid] = __lily_unpack<T>(f.b[1], e);
      }
      C[gid][2 * tig + e] = f.c[e];
      C[gid + 8][2 * tig + e] = f.c[2 + e];
    }
  }
  for (int l = 0; l < 32; ++l) {
    const int gid = l >> 2, tig = l & 3;
    float d[4];
    for (int h = 0; h < 2; ++h)
      for (int e = 0; e < 2; ++e) {
        float acc = 0.0f;
        for (int kk = 0; kk < K; ++kk) acc += A[gid + 8 * h][kk] * B[kk][2 * tig + e];
        d[2 * h + e] = acc + C[gid + 8 * h][2 * tig + e];
      }
    __emu::st(g->out[l], d);
  }
}
template <typename T>
inline void __lily_mma(float (&d)[4], const uint32_t* a, const uint32_t* b, int K,
                       int line = __builtin_LINE(), const char* file = __builtin_FILE()) {
  __emu_u32 lane;
  __emu_simd_xchg* g = __emu_simd_enter(&lane);
  if (g->nlanes != 32) __emu_fail("mma.sync needs a full warp", line, file);
  __lily_mma_in f;
  for (int i = 0; i < 4; ++i) { f.a[i] = (K == 16 || i < 2) ? a[i] : 0u; f.c[i] = d[i]; }
  f.b[0] = b[0]; f.b[1] = K == 16 ? b[1] : 0u; f.k = K;
  __emu::st(g->in[lane], f);
  __emu_simd_sync(__lily_mma_fn<T>, "mma.sync", line, file);
  float r[4];
  __builtin_memcpy(r, g->out[lane], sizeof r);
  for (int i = 0; i < 4; ++i) d[i] = r[i];
}
template <typename T> inline uint32_t __lily_pack(float lo, float hi) {
  T l = (T)lo, h = (T)hi;
  return (uint32_t)__builtin_bit_cast(unsigned short, l) | ((uint32_t)__builtin_bit_cast(unsigned short, h) << 16);
}
template <typename T> struct LilyDecMma {
  static void m16n8k16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
    uint32_t a[4] = {a0, a1, a2, a3}, b[2] = {b0, b1};
    __lily_mma<T>(d, a, b, 16);
  }
  static void m16n8k8(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t b0) {
    uint32_t a[4] = {a0, a1, 0u, 0u}, b[2] = {b0, 0u};
    __lily_mma<T>(d, a, b, 8);
  }
  static uint32_t pack(float lo, float hi) { return __lily_pack<T>(lo, hi); }
};
template <typename T> struct LilyPfMma {
  static void m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    uint32_t b[2] = {b0, b1};
    __lily_mma<T>(d, a, b, 16);
  }
  static uint32_t pack(float lo, float hi) { return __lily_pack<T>(lo, hi); }
};
// cp.async as a synchronous copy (zero-fill when !valid); ldmatrix from the lanes' row
// addresses: matrix i's rows come from lanes 8i..8i+7; lane l gets row l/4, cols
// 2(l%4), 2(l%4)+1 (.trans: rows 2(l%4), 2(l%4)+1 of col l/4).
inline void lily_pf_cp16(void* dst, const void* src, bool valid) {
  if (valid) __builtin_memcpy(dst, src, 16); else __builtin_memset(dst, 0, 16);
}
inline void lily_pf_cp_commit() {}
inline void lily_pf_cp_wait_all() {}
inline void lily_pf_ldsm_x4(uint32_t (&r)[4], const void* p) {
  const uint lane = __emu_lane();
  const unsigned long mine = (unsigned long)p;
  for (int i = 0; i < 4; ++i) {
    const unsigned long row = simd_shuffle(mine, (ushort)(8 * i + lane / 4));
    __builtin_memcpy(&r[i], (const void*)(row + 4 * (lane % 4)), 4);
  }
}
inline void lily_pf_ldsm_x4_t(uint32_t (&r)[4], const void* p) {
  const uint lane = __emu_lane();
  const unsigned long mine = (unsigned long)p;
  for (int i = 0; i < 4; ++i) {
    const unsigned long r0 = simd_shuffle(mine, (ushort)(8 * i + 2 * (lane % 4)));
    const unsigned long r1 = simd_shuffle(mine, (ushort)(8 * i + 2 * (lane % 4) + 1));
    unsigned short e0, e1;
    __builtin_memcpy(&e0, (const void*)(r0 + 2 * (lane / 4)), 2);
    __builtin_memcpy(&e1, (const void*)(r1 + 2 * (lane / 4)), 2);
    r[i] = (uint32_t)e0 | ((uint32_t)e1 << 16);
  }
}
"""

_CUDA_BODY_PROLOGUE = (
    "const __lily_dim3 threadIdx = {thread_position_in_threadgroup.x, "
    "thread_position_in_threadgroup.y, thread_position_in_threadgroup.z}; "
    "const __lily_dim3 blockIdx = {threadgroup_position_in_grid.x, "
    "threadgroup_position_in_grid.y, threadgroup_position_in_grid.z};\n"
)


def cuda_emu_kernel(spec, **emu_options):
    """An emulated kernel object that runs ``spec``'s CUDA twin (MLX call signature)."""
    from mlx_lily.testing import metal_emu

    head, body = cuda_parts(spec.stem)
    smem = max(spec.shared_memory, 16)
    body = re.sub(r"extern\s+__shared__\s+(\w+)\s+(\w+)\s*\[\s*\]\s*;",
                  lambda m: f"threadgroup {m.group(1)} {m.group(2)}[{smem} / sizeof({m.group(1)})];",
                  body)
    body = body.replace("__shared__", "threadgroup")
    opts = dict(emu_options)
    opts.setdefault("address_spaces", False)  # a CUDA body: no Metal address spaces
    if spec.shared_memory:
        opts.setdefault("threadgroup_memory_limit", spec.shared_memory + 8192)
    return metal_emu.metal_kernel(
        name=spec.name + "_cudaemu", input_names=list(spec.inputs),
        output_names=list(spec.outputs), source=_CUDA_BODY_PROLOGUE + body,
        header=_CUDA_EMU_PRELUDE + head, ensure_row_contiguous=spec.ensure_row_contiguous,
        **opts)


# --------------------------------------------------------------------------- backend plumbing
_EMU_CACHE: dict = {}


def _emu_kernel(backend, spec, **opts):
    key = (backend, spec, tuple(sorted(opts.items())))
    k = _EMU_CACHE.get(key)
    if k is None:
        if backend == "metal-emu":
            from mlx_lily.testing import metal_emu

            factory = metal_emu.metal_kernel
            if opts:
                import functools

                factory = functools.partial(metal_emu.metal_kernel, **opts)
            k = kernels.build(spec, "metal", factory=factory)
        else:
            k = cuda_emu_kernel(spec, **opts)
        _EMU_CACHE[key] = k
    return k


@contextlib.contextmanager
def use_backend(backend, monkeypatch, **emu_opts):
    """Route the attention dispatchers to ``backend``'s kernels (emulated or real)."""
    if backend in EMU_BACKENDS:
        if not metal_emu_available():
            pytest.skip("Metal emulator unavailable (needs clang >= 15 / ziglang)")
        kind = "metal" if backend == "metal-emu" else "cuda"
        monkeypatch.setattr(A, "current_backend", lambda: kind)
        monkeypatch.setattr(
            A, "_kernel",
            lambda spec, be: _emu_kernel(backend, spec, **emu_opts) if be == kind else None)
        yield
    elif backend in ("metal", "cuda"):
        if backend not in parity_backends():
            pytest.skip(f"no {backend} device")
        old = mx.default_device()
        mx.set_default_device(mx.gpu)
        try:
            yield
        finally:
            mx.set_default_device(old)
    else:
        yield


def _np(x):
    return np.array(x.astype(mx.float32))


#: Attention outputs against the fp32 reference: |out - ref| <= TOL * (1 + |ref|).
TOL = {mx.bfloat16: 1e-2, mx.float16: 2e-3, mx.float32: 1e-4}


def _assert_close(out, ref32, dtype, what=""):
    assert_close(out, ref32, rtol=TOL[dtype], atol=TOL[dtype], what=what)


def _assert_close_to_stock(y, y_stock, what=""):
    """Within 3% of max(1, max |stock|): o_proj sums thousands of bf16 products."""
    assert_close(y, y_stock, rtol=3e-2, scale=max(1.0, float(np.abs(_np(y_stock)).max())),
                 what=what)


def _rand(shape, dtype, scale=1.0):
    return (scale * mx.random.normal(shape)).astype(dtype)


def _kv(B, Hkv, T, D, dtype, layout):
    """K/V as the cache hands them out: views into a longer buffer, or with a non-unit
    last-axis stride (transposed storage) to exercise the kernels' strided fallback."""
    if layout == "strided":
        k = _rand((B, Hkv, D, T), dtype).swapaxes(-1, -2)
        v = _rand((B, Hkv, D, T), dtype).swapaxes(-1, -2)
        return k, v
    cap = ((T + 255) // 256) * 256 + (256 if layout == "view" else 0)
    kb = _rand((B, Hkv, cap, D), dtype)
    vb = _rand((B, Hkv, cap, D), dtype)
    return kb[..., :T, :], vb[..., :T, :]


def _f32(*xs):
    return [x.astype(mx.float32) for x in xs]


# --------------------------------------------------------------------------- reference vs stock
def _stock_attention(kind="qwen3_next", **overrides):
    import _models

    model = _models.build(kind, quantize=False, **overrides)
    layers = model.model.layers if kind == "qwen3_next" else model.language_model.model.layers
    for layer in layers:
        if not layer.is_linear:
            return layer.self_attn
    raise AssertionError("no attention layer")


def _reference_forward(attn, x, mask, cache, gated_api=False):
    """attention_call written with the op references (or the Lily dispatchers)."""
    B, L, _ = x.shape
    Hq, Hkv = attn.num_attention_heads, attn.num_key_value_heads
    queries, gate = mx.split(attn.q_proj(x).reshape(B, L, Hq, -1), 2, axis=-1)
    keys, values = attn.k_proj(x), attn.v_proj(x)
    rope = attn.rope
    q, k = A.qk_norm_rope(
        queries, keys.reshape(B, L, Hkv, -1), attn.q_norm.weight, attn.k_norm.weight,
        attn.q_norm.eps, rope_dims=rope.dims, base=rope.base, scale=rope.scale,
        traditional=rope.traditional, offset=cache.offset)
    v = values.reshape(B, L, Hkv, -1).transpose(0, 2, 1, 3)
    k, v = cache.update_and_fetch(k, v)
    if gated_api:
        out = A.sdpa_gated(q, k, v, attn.scale, mask, gate)
    else:
        out = A.sdpa(q, k, v, attn.scale, mask).transpose(0, 2, 1, 3).reshape(B, L, -1)
        out = A.output_gate(out, gate.reshape(B, L, -1))
    return attn.o_proj(out)


def _steps():
    # (tokens, mask): a prefill chunk, a second chunk over the cache, then decode steps.
    return [(6, "causal"), (5, "causal"), (1, None), (1, None), (1, None)]


@pytest.mark.parametrize("gated_api", [False, True])
@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5_moe"])
def test_reference_matches_stock_bit_exact(kind, gated_api):
    """Reference composition == stock Qwen3NextAttention with a KVCache, bit for bit (CPU)."""
    from mlx_lm.models.cache import KVCache
    from mlx_lm.models.qwen3_next import Qwen3NextAttention

    mx.random.seed(11)
    attn = _stock_attention(kind)
    assert attn.head_dim == 256 and attn.rope.dims == 64
    c_stock, c_ref = KVCache(), KVCache()
    for L, mask in _steps():
        x = _rand((1, L, attn.q_proj.weight.shape[1]), mx.bfloat16)
        y_stock = Qwen3NextAttention.__call__(attn, x, mask, c_stock)
        y_ref = _reference_forward(attn, x, mask, c_ref, gated_api)
        assert y_ref.dtype == y_stock.dtype
        assert mx.array_equal(y_ref, y_stock).item(), (L, mask)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("gated_api", [False, True])
def test_attention_layer_matches_stock(backend, gated_api, monkeypatch):
    """Whole attention layer (2 prefill chunks + 3 decode steps, head_dim 256, GQA 8:1)
    through the dispatchers on each backend vs stock mlx-lm."""
    from mlx_lm.models.cache import KVCache
    from mlx_lm.models.qwen3_next import Qwen3NextAttention

    mx.random.seed(12)
    attn = _stock_attention("qwen3_next", num_attention_heads=16, num_key_value_heads=2)
    c_stock, c_lily = KVCache(), KVCache()
    with use_backend(backend, monkeypatch):
        for L, mask in _steps():
            x = _rand((1, L, attn.q_proj.weight.shape[1]), mx.bfloat16)
            y_stock = Qwen3NextAttention.__call__(attn, x, mask, c_stock)
            y = _reference_forward(attn, x, mask, c_lily, gated_api)
            mx.eval(y, y_stock)
            _assert_close_to_stock(y, y_stock, f"{backend} L={L}")


def test_patched_attention_call_uses_kernels(monkeypatch):
    """The lead's current ``attention_call`` (sdpa + output_gate) runs on the emulated
    Metal kernels and matches stock."""
    if not metal_emu_available():
        pytest.skip("Metal emulator unavailable")
    from mlx_lm.models.cache import KVCache
    from mlx_lm.models.qwen3_next import Qwen3NextAttention

    from mlx_lily.patches.qwen3_next import attention_call

    mx.random.seed(13)
    attn = _stock_attention("qwen3_next")
    c_stock, c_lily = KVCache(), KVCache()
    calls = []
    with use_backend("metal-emu", monkeypatch):
        inner = A._kernel
        monkeypatch.setattr(A, "_kernel", lambda spec, be: calls.append(spec.name) or inner(spec, be))
        for L, mask in _steps():
            x = _rand((1, L, attn.q_proj.weight.shape[1]), mx.bfloat16)
            y_stock = Qwen3NextAttention.__call__(attn, x, mask, c_stock)
            y = attention_call(attn, x, mask, c_lily)
            _assert_close_to_stock(y, y_stock, f"L={L}")
    assert {A.PREFILL.name, A.DECODE_PARTIAL.name, A.QK_NORM_ROPE.name} <= set(calls)


# --------------------------------------------------------------------------- q/k norm + RoPE
QK_CASES = [
    # B, L, Hq, Hkv, D, rope_dims, offset, dtype
    (1, 1, 16, 2, 256, 64, 4095, mx.bfloat16),
    (2, 5, 8, 1, 256, 64, 100000, mx.bfloat16),
    (1, 3, 4, 2, 128, 32, 7, mx.float16),
]


@pytest.mark.parametrize("backend", SMALL_BACKENDS)
@pytest.mark.parametrize("case", QK_CASES, ids=lambda c: f"B{c[0]}L{c[1]}H{c[2]}-{c[3]}D{c[4]}")
def test_qk_norm_rope(backend, case, monkeypatch):
    B, L, Hq, Hkv, D, R, offset, dt = case
    mx.random.seed(hash(case) % 1000)
    q_proj = _rand((B, L, Hq, 2 * D), dt)
    queries = mx.split(q_proj, 2, axis=-1)[0]           # strided view, as in the model
    keys = _rand((B, L, Hkv, D), dt)
    wq = (1.0 + 0.1 * mx.random.normal((D,))).astype(dt)
    wk = (1.0 + 0.1 * mx.random.normal((D,))).astype(dt)
    kw = dict(rope_dims=R, base=1e7, scale=1.0, traditional=False)
    rq, rk = A.qk_norm_rope_reference(queries, keys, wq, wk, 1e-6, offset=offset, **kw)
    with use_backend(backend, monkeypatch):
        q, k = A.qk_norm_rope(queries, keys, wq, wk, 1e-6, offset=offset, **kw)
        mx.eval(q, k)
    assert q.shape == (B, Hq, L, D) and k.shape == (B, Hkv, L, D)
    assert q.dtype == dt and k.dtype == dt
    _assert_qk_close(q, rq, queries, wq, R, dt)
    _assert_qk_close(k, rk, keys, wk, R, dt)


def _assert_qk_close(out, ref, x, w, R, dt):
    """Kernel (MLX GPU rope math: fp32, one rounding) vs the CPU reference (mx.fast.rope's
    fallback rounds cos/sin and each product to T): a few ulps of the pre-rotation
    magnitude max(|y_j|, |y_j+R/2|) on rotated dims, 1 ulp elsewhere."""
    y = _np(mx.fast.rms_norm(x, w, 1e-6).transpose(0, 2, 1, 3))
    mag = np.abs(y).copy()
    h = R // 2
    pair = np.maximum(np.abs(y[..., :h]), np.abs(y[..., h:R]))
    mag[..., :h] = pair
    mag[..., h:R] = pair
    assert_close(out, ref, dtype=dt, ulps=3, ulp_of=mag, atol=1e-6, max_diff_frac=0.1)


# --------------------------------------------------------------------------- packed decode forms
PACKED_CASES = [
    # B, L, Hq, Hkv, D, rope_dims, offset, dtype
    (1, 1, 16, 2, 256, 64, 4095, mx.bfloat16),
    (2, 1, 8, 1, 128, 32, 7, mx.float16),
    (1, 3, 4, 2, 256, 64, 100000, mx.bfloat16),
]


def _packed_row(B, L, Hq, Hkv, D, dt):
    return _rand((B, L, Hq * 2 * D + 2 * Hkv * D), dt)


@pytest.mark.parametrize("backend", BACKENDS)  # real CUDA too: the packed forms are new
@pytest.mark.parametrize("case", PACKED_CASES, ids=lambda c: f"B{c[0]}L{c[1]}H{c[2]}-{c[3]}D{c[4]}")
def test_qkv_norm_rope_packed(backend, case, monkeypatch):
    """q/k norm + RoPE and the v copy read straight from the fused q|k|v row (one
    launch) match the reference on the split views; v is copied exactly."""
    B, L, Hq, Hkv, D, R, offset, dt = case
    monkeypatch.setenv(kernels.KERNELS_ENV, "all")
    mx.random.seed(hash(case) % 1000)
    y = _packed_row(B, L, Hq, Hkv, D, dt)
    wq = (1.0 + 0.1 * mx.random.normal((D,))).astype(dt)
    wk = (1.0 + 0.1 * mx.random.normal((D,))).astype(dt)
    kw = dict(n_heads=Hq, n_kv_heads=Hkv, head_dim=D, rope_dims=R, base=1e7, offset=offset)
    rq, rk, rv = A.qkv_norm_rope_packed_reference(y, wq, wk, 1e-6, **kw)
    queries, _, keys, _ = A.split_packed(y, Hq, Hkv, D)
    with use_backend(backend, monkeypatch):
        init = float("nan") if backend in ("metal", "cuda") else None  # unwritten -> NaN
        out = A.qkv_norm_rope_packed(y, wq, wk, 1e-6, **kw, init_value=init)
        if backend == "reference":
            assert out is None  # no kernel on the CPU: the caller takes the general path
            return
        q, k, v = out
        mx.eval(q, k, v)
    assert q.shape == (B, Hq, L, D) and k.shape == v.shape == (B, Hkv, L, D)
    _assert_qk_close(q, rq, queries, wq, R, dt)
    _assert_qk_close(k, rk, keys, wk, R, dt)
    assert mx.array_equal(v, rv).item()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("T", [1, 300])
def test_decode_gate_packed(backend, T, monkeypatch):
    """The split-K decode with each head's gate read from the fused row's columns equals
    the gated reference on the gate view, and comes out as ``[B, 1, Hq*D]``."""
    monkeypatch.setenv(kernels.KERNELS_ENV, "all")
    B, Hq, Hkv, D, dt = 2, 16, 2, 256, mx.bfloat16
    mx.random.seed(T)
    q = _rand((B, Hq, 1, D), dt)
    k, v = _kv(B, Hkv, T, D, dt, "view")
    y = _packed_row(B, 1, Hq, Hkv, D, dt)
    _, gate, _, _ = A.split_packed(y, Hq, Hkv, D)
    ref = A.sdpa_gated_reference(*_f32(q, k, v), D ** -0.5, None, gate.astype(mx.float32))
    with use_backend(backend, monkeypatch):
        out = A.sdpa_gated_packed(q, k, v, D ** -0.5, y, Hq, Hkv, D)
        mx.eval(out)
    assert out.shape == (B, 1, Hq * D) and out.dtype == dt
    _assert_close(out, ref, dt, f"packed gate T={T}")


def test_patched_decode_takes_packed_path(monkeypatch):
    """With fused q|k|v projections prepared, the patched layer's decode steps run
    ``qkv_norm_rope_packed`` + the packed-gate decode (emulated Metal) and match stock;
    with ``attn_packed`` switched off they take the general path."""
    if not metal_emu_available():
        pytest.skip("Metal emulator unavailable")
    from mlx_lm.models.cache import KVCache
    from mlx_lm.models.qwen3_next import Qwen3NextAttention

    from mlx_lily.patches.qwen3_next import attention_call, prepare_attention

    monkeypatch.setenv(kernels.KERNELS_ENV, "all")
    for packed_on in (True, False):
        if not packed_on:
            monkeypatch.setenv("MLX_LILY_DISABLE", A.PACKED_OP)
        mx.random.seed(14)
        attn = _stock_attention("qwen3_next", num_attention_heads=16, num_key_value_heads=2)
        c_stock, c_lily = KVCache(), KVCache()
        seen = []
        with use_backend("metal-emu", monkeypatch):
            prepare_attention(attn)
            orig = A.qkv_norm_rope_packed
            monkeypatch.setattr(A, "qkv_norm_rope_packed",
                                lambda *a, **k: seen.append(1) or orig(*a, **k))
            for L, mask in _steps():
                x = _rand((1, L, attn.q_proj.weight.shape[1]), mx.bfloat16)
                y_stock = Qwen3NextAttention.__call__(attn, x, mask, c_stock)
                y = attention_call(attn, x, mask, c_lily)
                _assert_close_to_stock(y, y_stock, f"packed={packed_on} L={L}")
        n_decode = sum(1 for L, _ in _steps() if L == 1)
        assert len(seen) == (n_decode if packed_on else 0), (packed_on, seen)


# --------------------------------------------------------------------------- decode
DECODE_CASES = [
    # B, Hq, Hkv, D, T, dtype, gated, block, layout
    (1, 16, 2, 256, 300, mx.bfloat16, True, None, "view"),
    (1, 16, 2, 256, 1, mx.bfloat16, False, None, "view"),
    (1, 8, 1, 256, 7, mx.float16, True, 32, "view"),
    (2, 8, 2, 128, 300, mx.bfloat16, True, 32, "strided"),
    (1, 4, 2, 256, 77, mx.bfloat16, False, 8, "exact"),
]


@pytest.mark.parametrize("backend", SMALL_BACKENDS)
@pytest.mark.parametrize("case", DECODE_CASES,
                         ids=lambda c: f"B{c[0]}H{c[1]}-{c[2]}D{c[3]}T{c[4]}{'g' if c[6] else ''}b{c[7]}{c[8]}")
def test_decode(backend, case, monkeypatch):
    B, Hq, Hkv, D, T, dt, gated, block, layout = case
    mx.random.seed(T + Hq)
    q = _rand((B, Hq, 1, D), dt)
    k, v = _kv(B, Hkv, T, D, dt, layout)
    gate = _rand((B, 1, Hq, 2 * D), dt)[..., D:] if gated else None
    scale = D ** -0.5
    if gated:
        ref = A.sdpa_gated_reference(*_f32(q, k, v), scale, None, gate.astype(mx.float32))
    else:
        ref = A.sdpa_reference(*_f32(q, k, v), scale)
    with use_backend(backend, monkeypatch):
        if block is not None and backend != "reference":
            monkeypatch.setattr(A, "decode_block", lambda *a: block)
        out = A.sdpa_gated(q, k, v, scale, None, gate) if gated else A.sdpa(q, k, v, scale)
        mx.eval(out)
    assert out.dtype == dt
    _assert_close(out, ref, dt, f"decode {case}")


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "reference"])
@pytest.mark.parametrize("T,cap", [(1, 256), (300, 512), (512, 512)])
def test_decode_valid_length_from_array(backend, T, cap, monkeypatch):
    """DYN_T: the kernels read whole cache buffers (capacity ``cap``) and only the first
    ``tlen`` keys; the result equals the call on the ``[..., :T, :]`` views at the same
    block size, bit for bit (splits past T add neutral partials), and the keys past T
    (filled with garbage here) never matter."""
    B, Hq, Hkv, D, dt = 1, 16, 2, 256, mx.bfloat16
    mx.random.seed(T + cap)
    q = _rand((B, Hq, 1, D), dt)
    kb = _rand((B, Hkv, cap, D), dt) * 50
    vb = _rand((B, Hkv, cap, D), dt) * 50
    y = _packed_row(B, 1, Hq, Hkv, D, dt)
    monkeypatch.setenv(kernels.KERNELS_ENV, "all")
    with use_backend(backend, monkeypatch):
        be = A.current_backend()
        blk = A.decode_block(cap, B, Hkv, be)
        want = A.decode_attention(q, kb[:, :, :T], vb[:, :, :T], D ** -0.5, y, block=blk,
                                  backend=be, gate_packed=True)
        got = A.decode_attention(q, kb, vb, D ** -0.5, y, block=blk, backend=be,
                                 gate_packed=True, tlen=mx.array([T], dtype=mx.int32))
        mx.eval(want, got)
    assert got.shape == want.shape and mx.array_equal(got, want).item()


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "reference"])
@pytest.mark.parametrize("T,block,extra,heads", [
    (300, 32, None, (16, 2, 256, "bf16")), (77, 8, None, (16, 2, 256, "bf16")),
    (300, 64, 13, (16, 2, 256, "bf16")), (1, 32, 13, (16, 2, 256, "bf16")),
    (45, 16, None, (16, 2, 256, "bf16")),
    (40, 16, 200, (16, 2, 256, "bf16")),   # DYN_T: whole splits past tlen
    (90, 16, 30, (8, 2, 128, "f16")),       # G=4, D=128, fp16
])
def test_decode_prefetch_does_not_change_results(backend, T, block, extra, heads,
                                                 monkeypatch):
    """``PF`` (load groups in flight per warp) is a speed knob only: PF=2 gives the PF=1
    result bit for bit, with tails (T not a multiple of the block or of 2 tiles), blocks
    of one tile, DYN_T (``extra`` cache rows past tlen, filled with NaN: never read) and
    a one-key cache; and the partials are all written (outputs pre-filled with NaN)."""
    Hq, Hkv, D, dname = heads
    B, dt = 1, {"bf16": mx.bfloat16, "f16": mx.float16}[dname]
    dyn = extra is not None
    mx.random.seed(T * 3 + block)
    q = _rand((B, Hq, 1, D), dt)
    cap = T + extra if dyn else T
    nan_tail = mx.arange(cap)[None, None, :, None] >= T
    kb = mx.where(nan_tail, float("nan"), _rand((B, Hkv, cap, D), dt)).astype(dt)
    vb = mx.where(nan_tail, float("nan"), _rand((B, Hkv, cap, D), dt)).astype(dt)
    gate = _rand((B, 1, Hq, D), dt)
    tlen = mx.array([T], dtype=mx.int32) if dyn else None
    monkeypatch.setenv(kernels.KERNELS_ENV, "all")
    outs = []
    with use_backend(backend, monkeypatch):
        be = A.current_backend()
        for pf in (1, 2):
            o = A.decode_attention(q, kb, vb, D ** -0.5, gate, block=block, backend=be,
                                   tlen=tlen, prefetch=pf, init_value=float("nan"))
            mx.eval(o)
            outs.append(o)
    assert not mx.isnan(outs[1]).any().item()
    assert mx.array_equal(outs[0], outs[1]).item()
    k, v = (kb, vb) if not dyn else (kb[:, :, :T], vb[:, :, :T])
    ref = A.sdpa_gated_reference(*_f32(q, k, v), D ** -0.5, None, gate.astype(mx.float32))
    _assert_close(outs[1].reshape(ref.shape), ref, dt, f"prefetch T={T} block={block}")


def test_decode_prefetch_setting(monkeypatch):
    monkeypatch.setenv(A.DECODE_PF_ENV, "2")
    assert A.decode_prefetch("cuda") == 2
    monkeypatch.setenv(A.DECODE_PF_ENV, "3")  # not 1 or 2: one warning, the table's value
    config.WARNED.discard((A.DECODE_PF_ENV, "3"))
    with pytest.warns(UserWarning, match=A.DECODE_PF_ENV):
        assert A.decode_prefetch("cuda") == A.DECODE_PREFETCH["cuda"]
    q = mx.zeros((1, 16, 1, 256), mx.bfloat16)
    kv = mx.zeros((1, 2, 8, 256), mx.bfloat16)
    with pytest.raises(ValueError, match="prefetch"):
        A.decode_attention(q, kv, kv, 1.0, prefetch=3, backend="cuda")


@pytest.mark.parametrize("backend", EMU_BACKENDS)
def test_decode_fixed_block_path(backend, monkeypatch):
    """T >= SPLIT_K_MIN_CONTEXT takes the fixed block (threshold lowered for the test)."""
    monkeypatch.setattr(A, "SPLIT_K_MIN_CONTEXT", 128)
    monkeypatch.setattr(A, "FIXED_BLOCK", {"metal": 16, "cuda": 16})
    assert A.decode_block(300, 1, 2, "cuda") == 16
    assert A.decode_block(100, 1, 2, "cuda") == 16  # general rule, capped at the fixed block
    mx.random.seed(5)
    B, Hq, Hkv, D, T, dt = 1, 16, 2, 256, 300, mx.bfloat16
    q = _rand((B, Hq, 1, D), dt)
    k, v = _kv(B, Hkv, T, D, dt, "view")
    ref = A.sdpa_reference(*_f32(q, k, v), D ** -0.5)
    with use_backend(backend, monkeypatch):
        out = A.sdpa(q, k, v, D ** -0.5)
        mx.eval(out)
    _assert_close(out, ref, dt, "fixed block")


def test_decode_block_plan():
    # General rule: the smallest power of two >= 32 giving at most TARGET_SIMDGROUPS
    # warps (CUDA: 512, measured), capped at the fixed block (CUDA: 128).
    assert A.TARGET_SIMDGROUPS["cuda"] == 512 and A.FIXED_BLOCK["cuda"] == 128
    assert A.decode_block(4096, 1, 2, "cuda") == 32
    assert A.decode_block(8192, 1, 2, "cuda") == 32   # 512 warps of 32 keys
    assert A.decode_block(8193, 1, 2, "cuda") == 64
    assert A.decode_block(1024, 1, 2, "cuda") == 32
    assert A.decode_block(20000, 1, 2, "cuda") == 128  # ceil(40000 / 512) = 79 -> 128
    assert A.decode_block(20000, 8, 2, "cuda") == 128  # capped at the fixed block
    assert A.decode_block(4096, 1, 2, "metal") == 32
    assert A.decode_block(A.SPLIT_K_MIN_CONTEXT, 1, 2, "cuda") == A.FIXED_BLOCK["cuda"]
    assert A.decode_block(131072, 1, 2, "metal") == A.FIXED_BLOCK["metal"]
    for T in (1, 100, 5000, 31000, 40000, 131072):
        ch = A.decode_block(T, 1, 2, "cuda")
        assert ch % 8 == 0 and ch >= A.DECODE_BLOCK_MIN


def test_decode_block_knobs(monkeypatch):
    """``MLX_LILY_ATTN_DECODE_WARPS`` replaces the general rule's target and
    ``MLX_LILY_ATTN_FIXED_BLOCK`` the fixed block (32 and 64 included); a bad value warns
    and keeps the default."""
    from mlx_lily.patches import decode_graph

    assert "MLX_LILY_ATTN_DECODE_WARPS" in decode_graph._KEY_KNOBS  # traced steps bake CH in
    monkeypatch.setenv("MLX_LILY_ATTN_DECODE_WARPS", "128")
    assert A.decode_block(4096, 1, 2, "cuda") == 64   # ceil(8192 / 128) = 64
    assert A.decode_block(20000, 1, 2, "cuda") == 128  # capped at the fixed block
    monkeypatch.setenv("MLX_LILY_ATTN_FIXED_BLOCK", "512")
    assert A.decode_block(20000, 1, 2, "cuda") == 512  # ceil(40000 / 128) = 313 -> 512
    monkeypatch.setenv("MLX_LILY_ATTN_FIXED_BLOCK", "64")
    assert A.decode_block(A.SPLIT_K_MIN_CONTEXT, 1, 2, "cuda") == 64
    assert A.decode_block(20000, 1, 2, "cuda") == 64  # capped at the fixed block
    monkeypatch.setenv("MLX_LILY_ATTN_DECODE_WARPS", "lots")
    with pytest.warns(UserWarning, match="MLX_LILY_ATTN_DECODE_WARPS"):
        assert A.decode_block(8192, 1, 2, "cuda") == 32  # default target 512: 32 keys


# --------------------------------------------------------------------------- prefill
PREFILL_CASES = [
    # B, Hq, Hkv, D, L, T, dtype, causal, gated, layout
    (1, 16, 2, 256, 17, 300, mx.bfloat16, True, True, "view"),
    (1, 8, 1, 256, 5, 5, mx.bfloat16, True, False, "exact"),
    (2, 4, 2, 128, 9, 20, mx.float16, True, True, "strided"),
    (1, 2, 1, 256, 40, 40, mx.bfloat16, False, False, "exact"),
    (1, 8, 1, 256, 70, 75, mx.bfloat16, True, True, "view"),
]


@pytest.mark.parametrize("backend", SMALL_BACKENDS)
@pytest.mark.parametrize("case", PREFILL_CASES,
                         ids=lambda c: f"B{c[0]}H{c[1]}-{c[2]}D{c[3]}L{c[4]}T{c[5]}{'c' if c[7] else 'n'}{'g' if c[8] else ''}{c[9]}")
def test_prefill(backend, case, monkeypatch):
    B, Hq, Hkv, D, L, T, dt, causal, gated, layout = case
    mx.random.seed(L * 7 + T)
    q = _rand((B, Hq, L, D), dt)
    k, v = _kv(B, Hkv, T, D, dt, layout)
    gate = _rand((B, L, Hq, 2 * D), dt)[..., D:] if gated else None
    mask = "causal" if causal else None
    scale = D ** -0.5
    if gated:
        ref = A.sdpa_gated_reference(*_f32(q, k, v), scale, mask, gate.astype(mx.float32))
    else:
        ref = A.sdpa_reference(*_f32(q, k, v), scale, mask)
    with use_backend(backend, monkeypatch):
        out = A.sdpa_gated(q, k, v, scale, mask, gate) if gated else A.sdpa(q, k, v, scale, mask)
        mx.eval(out)
    assert out.dtype == dt
    _assert_close(out, ref, dt, f"prefill {case}")


@pytest.mark.parametrize("backend", EMU_BACKENDS)
@pytest.mark.parametrize("order", ["reverse", "random"])
def test_barriers_under_reordered_threads(backend, order, monkeypatch):
    """Prefill and decode (combine) with emulated threads scheduled in another order."""
    mx.random.seed(3)
    B, Hq, Hkv, D, dt = 1, 8, 1, 256, mx.bfloat16
    with use_backend(backend, monkeypatch, order=order):
        for L, T in ((9, 40), (1, 90)):
            q = _rand((B, Hq, L, D), dt)
            k, v = _kv(B, Hkv, T, D, dt, "view")
            mask = "causal" if L > 1 else None
            ref = A.sdpa_reference(*_f32(q, k, v), D ** -0.5, mask)
            out = A.sdpa(q, k, v, D ** -0.5, mask)
            mx.eval(out)
            _assert_close(out, ref, dt, f"{order} L{L}")


# --------------------------------------------------------------------------- routing
def test_unsupported_calls_use_reference(monkeypatch):
    """Array masks, fp32, other head dims, T < L causal, per-batch offsets, G > 8 decode:
    the kernels are never asked for and the results equal the references."""
    def boom(spec, backend):
        raise AssertionError(f"kernel {spec.name} requested for an unsupported call")

    monkeypatch.setattr(A, "current_backend", lambda: "cuda")
    monkeypatch.setattr(A, "_kernel", boom)
    mx.random.seed(4)
    bf = mx.bfloat16
    q, k, v = _rand((1, 8, 4, 256), bf), _rand((1, 1, 6, 256), bf), _rand((1, 1, 6, 256), bf)
    mask = mx.ones((4, 6), dtype=mx.bool_)
    cases = [
        (q, k, v, mask),                                                     # array mask
        tuple(x.astype(mx.float32) for x in (q, k, v)) + ("causal",),        # fp32
        (q[..., :64], k[..., :64], v[..., :64], "causal"),                   # head_dim 64
        (q, k[:, :, :3], v[:, :, :3], "causal"),                             # causal T < L
        (_rand((1, 16, 1, 128), bf), _rand((1, 1, 6, 128), bf),
         _rand((1, 1, 6, 128), bf), None),                                   # decode G = 16
        (_rand((1, 16, 5, 128), bf), _rand((1, 2, 9000, 128), bf),
         _rand((1, 2, 9000, 128), bf), "causal"),                            # 2 blocks, long T
    ]
    for qq, kk, vv, m in cases:
        out = A.sdpa(qq, kk, vv, 0.1, m)
        assert mx.array_equal(out, A.sdpa_reference(qq, kk, vv, 0.1, m)).item()
    queries, keys = _rand((2, 3, 8, 256), bf), _rand((2, 3, 1, 256), bf)
    w = mx.ones((256,), bf)
    off = mx.array([3, 5])
    got = A.qk_norm_rope(queries, keys, w, w, 1e-6, rope_dims=64, base=1e7, offset=off)
    ref = A.qk_norm_rope_reference(queries, keys, w, w, 1e-6, rope_dims=64, base=1e7, offset=off)
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, ref))
    got = A.qk_norm_rope(queries, keys, w, w, 1e-6, rope_dims=64, base=1e7, offset=0,
                         traditional=True)
    assert mx.array_equal(got[0], A.qk_norm_rope_reference(
        queries, keys, w, w, 1e-6, rope_dims=64, base=1e7, offset=0, traditional=True)[0]).item()


def test_cpu_backend_has_no_kernel():
    assert not A.has_kernel("cpu")


# --------------------------------------------------------------------------- nvcc
_NVCC_CASES = {
    "attn_qk_norm_rope": (
        [("queries", "T", 4), ("keys", "T", 4), ("q_weight", "T", 1), ("k_weight", "T", 1),
         ("rope", mx.float32, 1), ("offset", mx.int32, 1)],
        [("q_out", "T"), ("k_out", "T"), ("v_out", "T")],
        [("D", 256), ("HQ", 16), ("HKV", 2), ("R", 64), ("PACKED", True)]),
    "attn_decode_partial": (
        [("q", "T", 4), ("k", "T", 4), ("v", "T", 4), ("params", mx.float32, 1),
         ("tlen", mx.int32, 1)],
        [("part_o", mx.float32), ("part_ml", mx.float32)],
        [("D", 256), ("G", 8), ("CH", 64), ("NSG", 4), ("DYN_T", True), ("PF", 2)]),
    "attn_decode_combine": (
        [("part_o", mx.float32, 4), ("part_ml", mx.float32, 4), ("gate", "T", 4)],
        [("out", "T")],
        [("D", 256), ("GATED", True), ("GATE_PACKED", True)]),
    "attn_prefill": (
        [("q", "T", 4), ("k", "T", 4), ("v", "T", 4), ("gate", "T", 4), ("params", mx.float32, 1)],
        [("out", "T")],
        [("D", 256), ("G", 8), ("BR", 64), ("CAUSAL", True), ("GATED", True)]),
}


def _nvcc_check_cached(stem, dtype):
    """cuda_check.check on one CUDA twin; a pass is remembered on disk by the hash of the
    rendered source and nvcc's version (the compile takes ~20 s)."""
    from mlx_lily.testing import cuda_check

    ins, outs, tmpl = _NVCC_CASES[stem]
    res = lambda d: dtype if d == "T" else d  # noqa: E731
    inputs = [(n, res(d), nd) for n, d, nd in ins]
    outputs = [(n, res(d)) for n, d in outs]
    template = [("T", dtype)] + tmpl
    head, body = cuda_parts(stem)
    name = "lily_" + stem
    text = cuda_check.render(name, inputs, outputs, body, head, template)
    ver = subprocess.run([cuda_check.nvcc_path(), "--version"], capture_output=True,
                         text=True).stdout
    key = hashlib.sha256((text + ver).encode()).hexdigest()[:24]
    marker = Path.home() / ".cache" / "mlx-lily" / "nvcc-check" / f"{name}-{key}.ok"
    if marker.exists():
        return
    cuda_check.check(name, inputs, outputs, body, head, template)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text("ok\n")


@pytest.mark.parametrize("dtype", [mx.bfloat16, pytest.param(mx.float16, marks=pytest.mark.slow)])
def test_cuda_twins_compile_with_nvcc(dtype):
    from mlx_lily.testing import cuda_check

    if cuda_check.nvcc_path() is None:
        pytest.skip("nvcc not installed")
    with ThreadPoolExecutor(2) as ex:
        list(ex.map(lambda s: _nvcc_check_cached(s, dtype), list(_NVCC_CASES)))


# --------------------------------------------------------------------------- real GPU, production dims
@gpu
@pytest.mark.parametrize("backend", ["metal", "cuda"])
@pytest.mark.parametrize("T", [4093, 40965])
def test_gpu_decode_production(backend, T, monkeypatch):
    B, Hq, Hkv, D, dt = 1, 16, 2, 256, mx.bfloat16
    with use_backend(backend, monkeypatch):
        mx.random.seed(T)
        q = _rand((B, Hq, 1, D), dt)
        k, v = _kv(B, Hkv, T, D, dt, "view")
        gate = _rand((B, 1, Hq, 2 * D), dt)[..., D:]
        ref = A.sdpa_gated_reference(*_f32(q, k, v), D ** -0.5, None, gate.astype(mx.float32))
        out = A.sdpa_gated(q, k, v, D ** -0.5, None, gate)
        mx.eval(out, ref)
        _assert_close(out, ref, dt, f"gpu decode T={T}")
        assert A.has_kernel(backend)


@gpu
@pytest.mark.parametrize("backend", ["metal", "cuda"])
@pytest.mark.parametrize("L,T", [(2048, 2048), (512, 4608), (300, 1333)])
def test_gpu_prefill_production(backend, L, T, monkeypatch):
    B, Hq, Hkv, D, dt = 1, 16, 2, 256, mx.bfloat16
    with use_backend(backend, monkeypatch):
        mx.random.seed(L + T)
        q = _rand((B, Hq, L, D), dt)
        k, v = _kv(B, Hkv, T, D, dt, "view")
        gate = _rand((B, L, Hq, 2 * D), dt)[..., D:]
        ref = A.sdpa_gated_reference(*_f32(q, k, v), D ** -0.5, "causal", gate.astype(mx.float32))
        out = A.sdpa_gated(q, k, v, D ** -0.5, "causal", gate)
        mx.eval(out, ref)
        _assert_close(out, ref, dt, f"gpu prefill L={L} T={T}")


@gpu
@pytest.mark.parametrize("backend", ["metal", "cuda"])
def test_gpu_qk_norm_rope_production(backend, monkeypatch):
    with use_backend(backend, monkeypatch):
        mx.random.seed(1)
        B, L, Hq, Hkv, D = 1, 2048, 16, 2, 256
        qp = _rand((B, L, Hq, 2 * D), mx.bfloat16)
        queries = mx.split(qp, 2, axis=-1)[0]
        keys = _rand((B, L, Hkv, D), mx.bfloat16)
        w = (1.0 + 0.1 * mx.random.normal((D,))).astype(mx.bfloat16)
        kw = dict(rope_dims=64, base=1e7, offset=30000)
        q, k = A.qk_norm_rope(queries, keys, w, w, 1e-6, **kw)
        rq, rk = A.qk_norm_rope_reference(queries, keys, w, w, 1e-6, **kw)
        _assert_qk_close(q, rq, queries, w, 64, mx.bfloat16)
        _assert_qk_close(k, rk, keys, w, 64, mx.bfloat16)


def test_math_constants():
    assert abs(A._LOG2E - 1.0 / math.log(2.0)) < 1e-15
