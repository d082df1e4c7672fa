// @kernel lily_attn_prefill
// @inputs q[B,HQ,L,D] k[B,HKV,T,D] v[B,HKV,T,D] gate[B,L,HQ,D] params[1]:float32 (all read through *_strides; gate is an 8-element stand-in when GATED=false)
// @outputs out[B,L,HQ,D]:T
// @template T=bfloat16 D=256 G=8 BR=64 CAUSAL=true GATED=true
// @grid (128*ceil(G*L/BR), HKV, B)
// @threadgroup (128, 1, 1)
// @ensure_row_contiguous false
// @shared_memory 98304
// Flash attention over the KV cache for a prefill chunk (queries are the last L of T
// positions; CAUSAL: query i sees keys <= T-L+i). GQA packing: the G query heads of a
// KV head are rows r = i*G + h of one matrix, so a block's BR = 64 rows (4 warps x 16)
// share every K/V tile. Tiles of 32 keys are double-buffered in dynamic shared memory
// with cp.async (16-byte chunks, XOR-swizzled by row so ldmatrix is conflict-free).
// S = Q K^T and O += P V on tensor cores (mma m16n8k16, fp32 accumulate), fp32 online
// softmax in log2 units (params[0] = scale*log2(e)), P rounded to T. Epilogue divides
// by the row sum, applies the optional sigmoid gate (rounded as mlx-lm does) and writes
// out in [B, L, HQ, D] order (the layout o_proj reads).
// Shared memory: Q [64][D] + 2 x (K [32][D] + V [32][D]) in T = 98304 bytes at D=256.

#ifndef LILY_CUDA_EMU
template <typename T>
struct LilyPfMma;

template <>
struct LilyPfMma<__nv_bfloat16> {
  static __device__ __forceinline__ void m16n8k16(float (&d)[4], const uint32_t (&a)[4],
                                                  uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
        "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};

template <>
struct LilyPfMma<__half> {
  static __device__ __forceinline__ void m16n8k16(float (&d)[4], const uint32_t (&a)[4],
                                                  uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
        "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};

// 16-byte global -> shared copy; zero-fills when !valid (src must still be a valid address).
__device__ __forceinline__ void lily_pf_cp16(void* dst, const void* src, bool valid) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(n));
}
__device__ __forceinline__ void lily_pf_cp_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}
__device__ __forceinline__ void lily_pf_cp_wait_all() {
  asm volatile("cp.async.wait_group 0;\n" ::);
}
__device__ __forceinline__ void lily_pf_ldsm_x4(uint32_t (&r)[4], const void* p) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}
__device__ __forceinline__ void lily_pf_ldsm_x4_t(uint32_t (&r)[4], const void* p) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}
#endif  // LILY_CUDA_EMU

// 8 elements (stride s) into a 16-byte shared chunk: cp.async when contiguous and
// aligned (or zero-fill when !valid), else 8 scalar copies.
template <typename T>
__device__ __forceinline__ void lily_pf_load8(T* dst, const T* src, int64_t s, bool valid) {
  if (!valid || (s == 1 && (reinterpret_cast<uintptr_t>(src) & 15) == 0)) {
    lily_pf_cp16(dst, src, valid);
  } else {
    const unsigned short* u = reinterpret_cast<const unsigned short*>(src);
    unsigned short* o = reinterpret_cast<unsigned short*>(dst);
#pragma unroll
    for (int i = 0; i < 8; ++i) o[i] = u[i * s];
  }
}

// Element offset of 16-byte chunk cc of row `row` in a swizzled [rows][DC*8] tile.
template <int DC>
__device__ __forceinline__ int lily_pf_sw(int row, int cc) {
  return row * (DC * 8) + ((cc ^ (row & 7)) << 3);
}

// ---- body ----
  using Mma = LilyPfMma<T>;
  constexpr int NW = 4;
  constexpr int BC = 32;
  constexpr int DC = D / 8;       // 16-byte chunks per row
  constexpr int NT = 32 * NW;
  constexpr int NDT = D / 8;      // 8-dim output tiles per row
  static_assert(BR == 16 * NW, "CUDA prefill tile is 16 rows per warp");
  static_assert(D % 64 == 0 && D <= 256, "head_dim must be 64, 128, 192 or 256");
  static_assert(2 * (BR * D + 4 * BC * D) <= 98304, "shared memory budget");
  const float NEG_INF = __int_as_float(0xff800000);

  extern __shared__ uint4 lily_smem[];
  T* Qs = reinterpret_cast<T*>(lily_smem);
  T* Ks = Qs + BR * D;            // [2][BC][D]
  T* Vs = Ks + 2 * BC * D;        // [2][BC][D]

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int g = lane >> 2;
  const int c = lane & 3;
  const int kvh = blockIdx.y;
  const int b = blockIdx.z;
  const int HQ = q_shape[1];
  const int L = q_shape[2];
  const int Tn = k_shape[2];
  const int R = G * L;
  const int r0 = blockIdx.x * BR;
  if (r0 >= R) {
    return;
  }
  const int past = Tn - L;
  int kend = Tn;
  if (CAUSAL) {
    const int imax = min(L - 1, (r0 + BR - 1) / G);
    kend = min(Tn, past + imax + 1);
  }
  const int ntiles = (kend + BC - 1) / BC;
  const float sl = params[0];

  const T* kbase = k + int64_t(b) * k_strides[0] + int64_t(kvh) * k_strides[1];
  const T* vbase = v + int64_t(b) * v_strides[0] + int64_t(kvh) * v_strides[1];

  // Q tile: packed rows r0 .. r0+BR-1 (zero beyond R).
  for (int id = tid; id < BR * DC; id += NT) {
    const int rr = id / DC;
    const int cc = id % DC;
    const int r = r0 + rr;
    const bool ok = r < R;
    const int rv = ok ? r : 0;
    const T* src = q + int64_t(b) * q_strides[0] + int64_t(kvh * G + rv % G) * q_strides[1] +
                   int64_t(rv / G) * q_strides[2] + int64_t(cc * 8) * q_strides[3];
    lily_pf_load8(Qs + lily_pf_sw<DC>(rr, cc), src, q_strides[3], ok);
  }
  auto load_kv = [&](int tile, int buf) {
    T* kd = Ks + buf * BC * D;
    T* vd = Vs + buf * BC * D;
    for (int id = tid; id < BC * DC; id += NT) {
      const int kk = id / DC;
      const int cc = id % DC;
      const int t = tile * BC + kk;
      const bool ok = t < Tn;
      const int tv = ok ? t : 0;
      lily_pf_load8(kd + lily_pf_sw<DC>(kk, cc),
                    kbase + int64_t(tv) * k_strides[2] + int64_t(cc * 8) * k_strides[3], k_strides[3], ok);
      lily_pf_load8(vd + lily_pf_sw<DC>(kk, cc),
                    vbase + int64_t(tv) * v_strides[2] + int64_t(cc * 8) * v_strides[3], v_strides[3], ok);
    }
  };
  load_kv(0, 0);
  lily_pf_cp_commit();

  float o[NDT][4];
#pragma unroll
  for (int n = 0; n < NDT; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[n][e] = 0.0f;
  float m_lo = NEG_INF, m_hi = NEG_INF;   // rows g and g+8 of this warp
  float l_lo = 0.0f, l_hi = 0.0f;         // this lane's partial row sums
  const int row_lo = r0 + warp * 16 + g;
  const int pos_lo = past + row_lo / G;
  const int pos_hi = past + (row_lo + 8) / G;

  // ldmatrix lane roles: matrix mi = lane/8, row-in-matrix r8 = lane%8.
  const int mi = lane >> 3;
  const int r8 = lane & 7;

  for (int j = 0; j < ntiles; ++j) {
    lily_pf_cp_wait_all();
    __syncthreads();
    if (j + 1 < ntiles) {
      load_kv(j + 1, (j + 1) & 1);
    }
    lily_pf_cp_commit();
    const T* Kt = Ks + (j & 1) * BC * D;
    const T* Vt = Vs + (j & 1) * BC * D;

    // S = Q K^T for 16 rows x 32 keys (4 n-tiles of 8 keys).
    float s[4][4];
#pragma unroll
    for (int n = 0; n < 4; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = 0.0f;
#pragma unroll
    for (int kstep = 0; kstep < D / 16; ++kstep) {
      uint32_t a[4];
      lily_pf_ldsm_x4(a, Qs + lily_pf_sw<DC>(warp * 16 + (mi & 1) * 8 + r8, 2 * kstep + (mi >> 1)));
#pragma unroll
      for (int np = 0; np < 2; ++np) {
        uint32_t bk[4];
        lily_pf_ldsm_x4(bk, Kt + lily_pf_sw<DC>(np * 16 + (mi >> 1) * 8 + r8, 2 * kstep + (mi & 1)));
        Mma::m16n8k16(s[2 * np], a, bk[0], bk[1]);
        Mma::m16n8k16(s[2 * np + 1], a, bk[2], bk[3]);
      }
    }

    // Mask, online softmax (rows g and g+8; a row's 32 keys live in the 4 lanes of a quad).
    float mx_lo = NEG_INF, mx_hi = NEG_INF;
#pragma unroll
    for (int n = 0; n < 4; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int t = j * BC + 8 * n + 2 * c + e;
        const bool ok_lo = t < Tn && (!CAUSAL || t <= pos_lo);
        const bool ok_hi = t < Tn && (!CAUSAL || t <= pos_hi);
        s[n][e] = ok_lo ? s[n][e] * sl : NEG_INF;
        s[n][e + 2] = ok_hi ? s[n][e + 2] * sl : NEG_INF;
        mx_lo = fmaxf(mx_lo, s[n][e]);
        mx_hi = fmaxf(mx_hi, s[n][e + 2]);
      }
    }
    mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 1));
    mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 2));
    mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 1));
    mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 2));
    const float mn_lo = fmaxf(m_lo, mx_lo);
    const float mn_hi = fmaxf(m_hi, mx_hi);
    // A row with every key so far masked keeps m = -inf: use 0 as the reference then.
    const float ref_lo = mn_lo == NEG_INF ? 0.0f : mn_lo;
    const float ref_hi = mn_hi == NEG_INF ? 0.0f : mn_hi;
    const float al_lo = exp2f(m_lo - ref_lo);
    const float al_hi = exp2f(m_hi - ref_hi);
    m_lo = mn_lo;
    m_hi = mn_hi;
    l_lo *= al_lo;
    l_hi *= al_hi;
    uint32_t pa[2][4];
#pragma unroll
    for (int n = 0; n < 4; ++n) {
      const float p0 = exp2f(s[n][0] - ref_lo);
      const float p1 = exp2f(s[n][1] - ref_lo);
      const float p2 = exp2f(s[n][2] - ref_hi);
      const float p3 = exp2f(s[n][3] - ref_hi);
      l_lo += p0 + p1;
      l_hi += p2 + p3;
      // A fragment of P for key k-step n/2: n even -> a0a1 (row g), a2a3 (row g+8);
      // n odd -> a4a5, a6a7.
      pa[n >> 1][(n & 1) * 2] = Mma::pack(p0, p1);
      pa[n >> 1][(n & 1) * 2 + 1] = Mma::pack(p2, p3);
    }
#pragma unroll
    for (int n = 0; n < NDT; ++n) {
      o[n][0] *= al_lo;
      o[n][1] *= al_lo;
      o[n][2] *= al_hi;
      o[n][3] *= al_hi;
    }

    // O += P V: V^T fragments by ldmatrix.trans (rows = keys).
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t bv[4];
        lily_pf_ldsm_x4_t(bv, Vt + lily_pf_sw<DC>(kk * 16 + (mi & 1) * 8 + r8, 2 * dp + (mi >> 1)));
        Mma::m16n8k16(o[2 * dp], pa[kk], bv[0], bv[1]);
        Mma::m16n8k16(o[2 * dp + 1], pa[kk], bv[2], bv[3]);
      }
    }
  }
  lily_pf_cp_wait_all();

  l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 1);
  l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 2);
  l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 1);
  l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 2);

#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = row_lo + 8 * half;
    if (r < R) {
      const int i = r / G;
      const int hq = kvh * G + r % G;
      const float inv = 1.0f / (half ? l_hi : l_lo);
      T* dst = out + ((int64_t(b) * L + i) * HQ + hq) * D;
      const T* gp = gate + int64_t(b) * gate_strides[0] + int64_t(i) * gate_strides[1] +
                    int64_t(hq) * gate_strides[2];
#pragma unroll
      for (int n = 0; n < NDT; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int d = 8 * n + 2 * c + e;
          T res = static_cast<T>(o[n][2 * half + e] * inv);
          if (GATED) {
            const float gv = static_cast<float>(gp[int64_t(d) * gate_strides[3]]);
            const T sg = static_cast<T>(1.0f / (1.0f + expf(-gv)));
            res = static_cast<T>(static_cast<float>(res) * static_cast<float>(sg));
          }
          dst[d] = res;
        }
      }
    }
  }
