// @kernel lily_attn_decode_partial
// @inputs q[B,HQ,1,D] k[B,HKV,T,D] v[B,HKV,T,D] params[1]:float32 tlen[1]:int32 (q/k/v read through *_strides; k/v may be KV-cache views)
// @outputs part_o[B,HQ,NS,D]:float32 part_ml[B,HQ,NS,2]:float32
// @template T=bfloat16 D=256 G=8 CH=64 NSG=4 DYN_T=true PF=2
// @grid (32*NSG*ceil(NS/NSG), HKV, B) with NS = ceil(T/CH)
// @threadgroup (32*NSG, 1, 1)
// @ensure_row_contiguous false
// DYN_T: k/v are whole cache buffers and only keys < tlen[0] are valid (the grid still
// covers every CH-block of the buffer; a block past tlen writes a neutral partial:
// l = 0, acc = 0), so a compiled decode step keeps static shapes as the cache fills.
// CUDA twin of shaders/metal/attn_decode_partial.metal (same contract and partials),
// on tensor cores: warp w of block x owns cache block split = x*NSG + w of one KV head
// and its G (<= 8) query heads. Per 8-key tile, straight from global memory into
// registers (16-byte loads, 4 lanes cover 64 contiguous bytes of a row):
//   S[head][key] = Q K^T with mma m16n8k16 (A = Q, rows = heads, rows 8..15 zero;
//     B = K^T; the k index is permuted identically in A and B so each lane's 16 bytes
//     feed two k-steps),
//   O^T[dim][head] += V^T P^T with mma m16n8k8 (A = V^T: two keys of one dim packed
//     per register by byte permutes; B = P^T, which is exactly S's accumulator layout).
// Lane (g = lane/4, c = lane%4) holds S for head g and keys 2c, 2c+1, and O for heads
// 2c, 2c+1 and dims 64r + 8g + 0..7 (r < D/64). fp32 softmax in log2 units, P in T.
// PF (1 or 2): tiles whose K/V loads are issued before the first of them is used (more
// bytes in flight per warp; results do not depend on PF).

#ifndef LILY_CUDA_EMU
template <typename T>
struct LilyDecMma;

template <>
struct LilyDecMma<__nv_bfloat16> {
  static __device__ __forceinline__ void m16n8k16(float (&d)[4], uint32_t a0, uint32_t a1,
                                                  uint32_t a2, uint32_t a3, uint32_t b0,
                                                  uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
        "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ void m16n8k8(float (&d)[4], uint32_t a0, uint32_t a1,
                                                 uint32_t b0) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(b0));
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};

template <>
struct LilyDecMma<__half> {
  static __device__ __forceinline__ void m16n8k16(float (&d)[4], uint32_t a0, uint32_t a1,
                                                  uint32_t a2, uint32_t a3, uint32_t b0,
                                                  uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
        "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ void m16n8k8(float (&d)[4], uint32_t a0, uint32_t a1,
                                                 uint32_t b0) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(b0));
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};
#endif  // LILY_CUDA_EMU

// 8 consecutive (stride s) 16-bit elements as a uint4: one 16-byte load when the row is
// contiguous and aligned, else 8 scalar loads.
template <typename T>
__device__ __forceinline__ uint4 lily_dec_ld8(const T* p, int64_t s) {
  if (s == 1 && (reinterpret_cast<uintptr_t>(p) & 15) == 0) {
    return *reinterpret_cast<const uint4*>(p);
  }
  const unsigned short* u = reinterpret_cast<const unsigned short*>(p);
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    w[i] = uint32_t(u[(2 * i) * s]) | (uint32_t(u[(2 * i + 1) * s]) << 16);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ uint32_t lily_dec_u4(const uint4& v, int i) {
  return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
}

// ---- body ----
  using Mma = LilyDecMma<T>;
  static_assert(G >= 1 && G <= 8, "decode kernel packs at most 8 query heads per KV head");
  static_assert(D % 64 == 0, "head_dim must be a multiple of 64");
  static_assert(CH % 8 == 0, "CH must be a multiple of 8");
  static_assert(PF == 1 || PF == 2, "PF: 1 or 2 tiles in flight");
  constexpr int NJ = D / 32;   // 16-byte K/Q chunks per lane (two k-steps each)
  constexpr int NR = D / 64;   // V rounds of 64 dims
  const float NEG_INF = __int_as_float(0xff800000);

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2;
  const int c = lane & 3;
  const int kvh = blockIdx.y;
  const int b = blockIdx.z;
  const int NS = (k_shape[2] + CH - 1) / CH;
  const int Tn = DYN_T ? min(int(tlen[0]), int(k_shape[2])) : int(k_shape[2]);
  const int split = blockIdx.x * NSG + warp;
  if (split >= NS) {
    return;
  }
  const int HQ = q_shape[1];
  const float sl = params[0];

  // Q fragments: head g, dims 32j + 8c .. +7 (zero rows for heads >= G).
  uint4 qa[NJ];
  {
    const int64_t qd = q_strides[3];
    const T* qp = q + int64_t(b) * q_strides[0] + int64_t(kvh * G + (g < G ? g : 0)) * q_strides[1] +
                  int64_t(8 * c) * qd;
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      qa[j] = g < G ? lily_dec_ld8(qp + int64_t(32 * j) * qd, qd) : make_uint4(0u, 0u, 0u, 0u);
    }
  }

  float acc[NR][4][4];
#pragma unroll
  for (int r = 0; r < NR; ++r)
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[r][i][e] = 0.0f;
  float m_run = NEG_INF;
  float l_run = 0.0f;

  const T* kbase = k + int64_t(b) * k_strides[0] + int64_t(kvh) * k_strides[1];
  const T* vbase = v + int64_t(b) * v_strides[0] + int64_t(kvh) * v_strides[1];
  const int64_t ks = k_strides[2];
  const int64_t vs = v_strides[2];
  const int64_t kd = k_strides[3];
  const int64_t vd = v_strides[3];
  const int t0 = split * CH;
  const int t1 = min(t0 + CH, Tn);
  const uint4 zero4 = make_uint4(0u, 0u, 0u, 0u);

  for (int tb = t0; tb < t1; tb += 8 * PF) {
    // PF tiles' loads issued before the first is used (tiles past t1 load zeros)
    uint4 kr[PF][NJ];
    uint4 va[PF][NR];
    uint4 vb[PF][NR];
#pragma unroll
    for (int u = 0; u < PF; ++u) {
      // K rows: key tu + g; V rows: keys tu + 2c, tu + 2c + 1 (zero beyond t1).
      const int tu = tb + 8 * u;
      const int kt = tu + g;
      const int vt0 = tu + 2 * c;
      const int vt1 = vt0 + 1;
      const T* kp = kbase + int64_t(kt < t1 ? kt : t0) * ks + int64_t(8 * c) * kd;
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        kr[u][j] = kt < t1 ? lily_dec_ld8(kp + int64_t(32 * j) * kd, kd) : zero4;
      }
      const T* vp0 = vbase + int64_t(vt0 < t1 ? vt0 : t0) * vs + int64_t(8 * g) * vd;
      const T* vp1 = vbase + int64_t(vt1 < t1 ? vt1 : t0) * vs + int64_t(8 * g) * vd;
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        va[u][r] = vt0 < t1 ? lily_dec_ld8(vp0 + int64_t(64 * r) * vd, vd) : zero4;
        vb[u][r] = vt1 < t1 ? lily_dec_ld8(vp1 + int64_t(64 * r) * vd, vd) : zero4;
      }
    }

#pragma unroll
    for (int u = 0; u < PF; ++u) {
      const int tu = tb + 8 * u;
      if (tu >= t1) break;  // warp-uniform
      const int vt0 = tu + 2 * c;
      const int vt1 = vt0 + 1;
      float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        Mma::m16n8k16(s, qa[j].x, 0u, qa[j].y, 0u, kr[u][j].x, kr[u][j].y);
        Mma::m16n8k16(s, qa[j].z, 0u, qa[j].w, 0u, kr[u][j].z, kr[u][j].w);
      }

      const float x0 = vt0 < t1 ? s[0] * sl : NEG_INF;
      const float x1 = vt1 < t1 ? s[1] * sl : NEG_INF;
      float mx = fmaxf(x0, x1);
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m_run, mx);
      const float alpha = exp2f(m_run - m_new);
      const float p0 = exp2f(x0 - m_new);
      const float p1 = exp2f(x1 - m_new);
      l_run = l_run * alpha + p0 + p1;
      m_run = m_new;
      const float a_lo = __shfl_sync(0xffffffffu, alpha, 8 * c);
      const float a_hi = __shfl_sync(0xffffffffu, alpha, 8 * c + 4);
      const uint32_t pb = Mma::pack(p0, p1);

#pragma unroll
      for (int r = 0; r < NR; ++r) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          acc[r][i][0] *= a_lo;
          acc[r][i][1] *= a_hi;
          acc[r][i][2] *= a_lo;
          acc[r][i][3] *= a_hi;
          const uint32_t wa = lily_dec_u4(va[u][r], i);
          const uint32_t wb = lily_dec_u4(vb[u][r], i);
          Mma::m16n8k8(acc[r][i], __byte_perm(wa, wb, 0x5410), __byte_perm(wa, wb, 0x7632), pb);
        }
      }
    }
  }

  float l_tot = l_run;
  l_tot += __shfl_xor_sync(0xffffffffu, l_tot, 1);
  l_tot += __shfl_xor_sync(0xffffffffu, l_tot, 2);

  if (g < G && c == 0) {
    const int64_t row = (int64_t(b) * HQ + kvh * G + g) * NS + split;
    part_ml[row * 2] = m_run;
    part_ml[row * 2 + 1] = l_tot;
  }
#pragma unroll
  for (int hsel = 0; hsel < 2; ++hsel) {
    const int h = 2 * c + hsel;
    if (h < G) {
      const int64_t row = (int64_t(b) * HQ + kvh * G + h) * NS + split;
      float* po = part_o + row * D + 8 * g;
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        float4 lo = make_float4(acc[r][0][hsel], acc[r][0][hsel + 2], acc[r][1][hsel], acc[r][1][hsel + 2]);
        float4 hi = make_float4(acc[r][2][hsel], acc[r][2][hsel + 2], acc[r][3][hsel], acc[r][3][hsel + 2]);
        *reinterpret_cast<float4*>(po + 64 * r) = lo;
        *reinterpret_cast<float4*>(po + 64 * r + 4) = hi;
      }
    }
  }
