// @kernel lily_qgemv_mma
// @inputs x[N,K]:T w[O,K*BITS/32]:uint32 scales[O,K/GS]:S biases[O,K/GS]:S
// @outputs y[N,O]:T
// @template T=bfloat16 S=bfloat16 K=2048 O=8192 BITS=4 GS=64 N=8 NW=4 RT=1
// @template T=float16 S=float16 K=128 O=37 BITS=4 GS=64 N=3 NW=2 RT=2
// @grid (ceil(O/(16*RT))*32*NW, 1, 1)
// @threadgroup (32*NW, 1, 1)
// y = x @ dequant(w)^T for N <= 8 rows on tensor cores (lily_qgemv's contract; BITS 4,
// GS a multiple of 64, T bf16 or f16). A block owns 16*RT output rows (RT m-tiles sharing
// each chunk's x fragments); its NW warps split K into 64-wide chunks (warp w: chunks w,
// w+NW, ...). Per chunk, one mma.sync.m16n8k16
// chain of four steps multiplies the chunk's 16 x 64 quantized values q (exact in T)
// by the rows' x (the 8 columns; absent rows are zeros), fp32 accumulation; then
// acc += scale * dot + bias * sum(x over the chunk), the MLX qmv formulation per chunk.
// The warps' partials are summed in warp order. A row's result depends on that row's x
// alone (the mma's columns are independent), so every row equals itself launched alone.
// K is permuted inside each chunk so that a lane's values are whole nibble pairs: lane
// (g = lane/4, t = lane%4) holds physical k 16t .. 16t+15 of the chunk (two weight
// words per row), and mma step s reads pairs (s, s+4) of its first word and of its
// second for the fragment's k 2t,2t+1 and 2t+8,2t+9; x's fragment takes the same pairs.
// No Metal twin: on Metal, qgemv's lily_qgemv serves this contract.
// @header qgemv_common.cuh
// @header qgemv_mma.cuh

// ---- body ----
  constexpr bool F16 = !lily_same<T, __nv_bfloat16>::value;
  constexpr int KC = K / 64;      // 64-wide chunks per row
  constexpr int KW = K / 8;       // weight words per row
  constexpr int NG = K / GS;      // quantization groups per row
  constexpr int UNR = 4 / RT;     // chunks whose weights a warp loads before its math
  static_assert(BITS == 4 && GS % 64 == 0 && K % GS == 0, "qgemv_mma: BITS 4, GS % 64");
  static_assert(N >= 1 && N <= 8 && NW >= 1 && NW <= 16, "qgemv_mma: N 1..8, NW 1..16");
  static_assert(RT == 1 || RT == 2 || RT == 4, "qgemv_mma: RT 1, 2 or 4");
  static_assert(sizeof(T) == 2, "qgemv_mma: T bf16 or f16");

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int row0 = blockIdx.x * 16 * RT;
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

  __shared__ float part[NW][RT * 4][32];  // the warps' partials (read when NW > 1)
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
      for (int i = 0; i < 4; ++i) part[warp][4 * r + i][lane] = acc[r][i];
    __syncthreads();
    if (warp != 0) return;
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float v = part[0][4 * r + i][lane];
#pragma unroll
        for (int q = 1; q < NW; ++q) v += part[q][4 * r + i][lane];
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
