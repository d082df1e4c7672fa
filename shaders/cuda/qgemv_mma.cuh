// ---- lily qgemv_mma helpers (qgemv_mma, norm_qgemv_mma pull it in with `// @header`) ----
// The tensor-core GEMV's fragment helpers, and lily_qgemv_mma's loop (qgemv_mma.cu, which
// keeps its own copy in its body: moved into a function its registers changed) as a
// device function for the norm-folded kernel.
#ifdef LILY_EMU
// a 16-bit value (bf16, or f16 when F16) as fp32: the emulated mma's operands
template <bool F16>
inline float lily_h2f(uint32_t h) {
  if (F16) return float(as_type<half>(ushort(h)));
  return __uint_as_float(h << 16);
}
#endif

// mma.sync.aligned.m16n8k16 (A 16x16 row-major, B 16x8 column-major, fp32 C/D) on
// fragments in registers: a[4], b[2] pairs of 16-bit values (bf16, or f16 when F16), d[4]
// accumulated in place; lane: this thread's lane. The emulator runs it with lane shuffles,
// k in order.
template <bool F16>
__device__ __forceinline__ void lily_mma16816(float* d, const uint32_t* a, const uint32_t* b,
                                              int lane) {
#ifndef LILY_EMU
  if constexpr (F16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
#else
  const int g = lane >> 2, t = lane & 3;
  for (int k = 0; k < 16; ++k) {
    const int src = (k & 7) >> 1, hi = k & 1, sec = k >> 3;  // holder's lane in quad, half
    const uint32_t ag = __shfl_sync(0xffffffffu, a[2 * sec], 4 * g + src);
    const uint32_t ag8 = __shfl_sync(0xffffffffu, a[2 * sec + 1], 4 * g + src);
    const uint32_t b0 = __shfl_sync(0xffffffffu, b[sec], 4 * (2 * t) + src);
    const uint32_t b1 = __shfl_sync(0xffffffffu, b[sec], 4 * (2 * t + 1) + src);
    const float fa = lily_h2f<F16>(hi ? ag >> 16 : ag & 0xffffu);
    const float fa8 = lily_h2f<F16>(hi ? ag8 >> 16 : ag8 & 0xffffu);
    const float fb0 = lily_h2f<F16>(hi ? b0 >> 16 : b0 & 0xffffu);
    const float fb1 = lily_h2f<F16>(hi ? b1 >> 16 : b1 & 0xffffu);
    d[0] = fmaf(fa, fb0, d[0]);
    d[1] = fmaf(fa, fb1, d[1]);
    d[2] = fmaf(fa8, fb0, d[2]);
    d[3] = fmaf(fa8, fb1, d[3]);
  }
#endif
}

// The 16-bit values of nibbles i and i+4 of w (i = shift/4) as a pair (nibble i low):
// 2^7 + q (bf16) or 2^10 + q (f16) built in the mantissa, then the constant subtracted
// by one packed fma (exact).
template <bool F16>
__device__ __forceinline__ uint32_t lily_nibble_pair(uint32_t w, int shift) {
  const uint32_t q = (w >> shift) & 0x000F000Fu;
#ifndef LILY_EMU
  uint32_t r;
  if constexpr (F16) {
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(q | 0x64006400u), "r"(0x3C003C00u),
        "r"(0xE400E400u));
  } else {
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(q | 0x43004300u), "r"(0x3F803F80u),
        "r"(0xC300C300u));
  }
  return r;
#else
  const uint32_t lo = q & 0xffffu, hi = q >> 16;
  if (F16) return uint32_t(as_type<ushort>(half(float(lo)))) |
                  (uint32_t(as_type<ushort>(half(float(hi)))) << 16);
  return (__float_as_uint(float(lo)) >> 16) | (__float_as_uint(float(hi)) & 0xffff0000u);
#endif
}

// The pair (value j, value j+4) of 16 values held as 8 words u (value 2m low in u[m]).
__device__ __forceinline__ uint32_t lily_value_pair(const uint32_t* u, int j) {
  const uint32_t a = u[j >> 1], b = u[(j >> 1) + 2];
  return (j & 1) ? ((a >> 16) | (b & 0xffff0000u)) : ((a & 0xffffu) | (b << 16));
}

template <typename T>
__device__ __forceinline__ float lily_half_f(uint32_t h) {
  return lily_f(*reinterpret_cast<const T*>(&h));
}

// y[N, O] = x[N, K] @ dequant(w)^T for the block's 16*RT output rows (block bx); x may
// point to global or shared memory (rows K apart); part: NW*RT*4*32 floats of shared
// memory (the warps' partials, read when NW > 1); tid: the thread's index in the block.
// Every thread of the block calls it.
template <typename T, typename S, int K, int O, int BITS, int GS, int N, int NW, int RT>
__device__ __forceinline__ void lily_qgemv_mma_block(const T* x, const uint32_t* w,
                                                     const S* scales, const S* biases, T* y,
                                                     float* part, int tid, int bx) {
#ifndef LILY_EMU
  // the index ranges (without them nvcc's index math took up to twice the registers)
  __builtin_assume(tid >= 0 && tid < 32 * NW);
  __builtin_assume(bx >= 0 && bx < (O + 16 * RT - 1) / (16 * RT));
#endif
  constexpr bool F16 = !lily_same<T, __nv_bfloat16>::value;
  constexpr int KC = K / 64;      // 64-wide chunks per row
  constexpr int KW = K / 8;       // weight words per row
  constexpr int NG = K / GS;      // quantization groups per row
  constexpr int UNR = 4 / RT;     // chunks whose weights a warp loads before its math
  static_assert(BITS == 4 && GS % 64 == 0 && K % GS == 0, "qgemv_mma: BITS 4, GS % 64");
  static_assert(N >= 1 && N <= 8 && NW >= 1 && NW <= 16, "qgemv_mma: N 1..8, NW 1..16");
  static_assert(RT == 1 || RT == 2 || RT == 4, "qgemv_mma: RT 1, 2 or 4");
  static_assert(sizeof(T) == 2, "qgemv_mma: T bf16 or f16");

  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int row0 = bx * 16 * RT;
  int ra[RT], rb[RT];
#pragma unroll
  for (int r = 0; r < RT; ++r) {
    ra[r] = min(row0 + 16 * r + g, O - 1);
    rb[r] = min(row0 + 16 * r + g + 8, O - 1);
  }
  const uint2* w2 = reinterpret_cast<const uint2*>(w);
  const T* xg = x + (size_t)min(g, N - 1) * K + 16 * t;
  const bool xrow = g < N;
  const bool xal = (reinterpret_cast<unsigned long long>(x) & 15ull) == 0ull;

  float acc[RT][4];
#pragma unroll
  for (int r = 0; r < RT; ++r) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = 0.f;
  for (int c0 = warp; c0 < KC; c0 += NW * UNR) {
    uint2 wa[UNR][RT], wb[UNR][RT];
    float sa[UNR][RT], ba[UNR][RT], sb[UNR][RT], bb[UNR][RT];
#pragma unroll
    for (int u = 0; u < UNR; ++u) {
      const int c = min(c0 + NW * u, KC - 1);
      const int gi = (c * 64) / GS;
#pragma unroll
      for (int r = 0; r < RT; ++r) {
        wa[u][r] = w2[((size_t)ra[r] * KW + c * 8 + 2 * t) >> 1];
        wb[u][r] = w2[((size_t)rb[r] * KW + c * 8 + 2 * t) >> 1];
        sa[u][r] = lily_f(scales[(size_t)ra[r] * NG + gi]);
        ba[u][r] = lily_f(biases[(size_t)ra[r] * NG + gi]);
        sb[u][r] = lily_f(scales[(size_t)rb[r] * NG + gi]);
        bb[u][r] = lily_f(biases[(size_t)rb[r] * NG + gi]);
      }
    }
#pragma unroll
    for (int u = 0; u < UNR; ++u) {
      const int c = c0 + NW * u;
      if (c >= KC) break;  // uniform across the warp
      uint32_t xu[8];
      if (xrow && xal) {
        const uint4* p = reinterpret_cast<const uint4*>(xg + c * 64);
        const uint4 v0 = p[0], v1 = p[1];
        xu[0] = v0.x; xu[1] = v0.y; xu[2] = v0.z; xu[3] = v0.w;
        xu[4] = v1.x; xu[5] = v1.y; xu[6] = v1.z; xu[7] = v1.w;
      } else if (xrow) {
        const unsigned short* p = reinterpret_cast<const unsigned short*>(xg + c * 64);
#pragma unroll
        for (int m = 0; m < 8; ++m) xu[m] = uint32_t(p[2 * m]) | (uint32_t(p[2 * m + 1]) << 16);
      } else {
#pragma unroll
        for (int m = 0; m < 8; ++m) xu[m] = 0u;
      }
      // sum of this lane's 16 x values, then over the quad: row g's chunk sum
      float xs = 0.f;
#pragma unroll
      for (int m = 0; m < 8; ++m) {
        xs += lily_half_f<T>(xu[m] & 0xffffu);
        xs += lily_half_f<T>(xu[m] >> 16);
      }
      xs += __shfl_xor_sync(0xffffffffu, xs, 1);
      xs += __shfl_xor_sync(0xffffffffu, xs, 2);
      const float xs0 = __shfl_sync(0xffffffffu, xs, 8 * t);      // column 2t
      const float xs1 = __shfl_sync(0xffffffffu, xs, 8 * t + 4);  // column 2t+1
      float d[RT][4];
#pragma unroll
      for (int r = 0; r < RT; ++r) d[r][0] = d[r][1] = d[r][2] = d[r][3] = 0.f;
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        uint32_t b[2];
        b[0] = lily_value_pair(xu, s);
        b[1] = lily_value_pair(xu, 8 + s);
#pragma unroll
        for (int r = 0; r < RT; ++r) {
          uint32_t a[4];
          a[0] = lily_nibble_pair<F16>(wa[u][r].x, 4 * s);
          a[1] = lily_nibble_pair<F16>(wb[u][r].x, 4 * s);
          a[2] = lily_nibble_pair<F16>(wa[u][r].y, 4 * s);
          a[3] = lily_nibble_pair<F16>(wb[u][r].y, 4 * s);
          lily_mma16816<F16>(d[r], a, b, lane);
        }
      }
#pragma unroll
      for (int r = 0; r < RT; ++r) {
        acc[r][0] += sa[u][r] * d[r][0] + ba[u][r] * xs0;
        acc[r][1] += sa[u][r] * d[r][1] + ba[u][r] * xs1;
        acc[r][2] += sb[u][r] * d[r][2] + bb[u][r] * xs0;
        acc[r][3] += sb[u][r] * d[r][3] + bb[u][r] * xs1;
      }
    }
  }
  if constexpr (NW > 1) {
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
      for (int i = 0; i < 4; ++i) part[(warp * RT * 4 + 4 * r + i) * 32 + lane] = acc[r][i];
    __syncthreads();
    if (warp != 0) return;
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float v = part[(4 * r + i) * 32 + lane];
#pragma unroll
        for (int q = 1; q < NW; ++q) v += part[(q * RT * 4 + 4 * r + i) * 32 + lane];
        acc[r][i] = v;
      }
  }
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = row0 + 16 * r + g + 8 * (i >> 1);
      const int n = 2 * t + (i & 1);
      if (row < O && n < N) y[(size_t)n * O + row] = static_cast<T>(acc[r][i]);
    }
}
// ---- end lily qgemv_mma helpers ----
