// ---- lily qgemv helpers: shared by qgemv, moe_router_topk, moe_gate_up, moe_down ----
// (each kernel file pulls this in with its `// @header` line)
template <class A, class B> struct lily_same { static constexpr bool value = false; };
template <class A> struct lily_same<A, A> { static constexpr bool value = true; };

template <typename T>
__device__ __forceinline__ float lily_f(T v) { return static_cast<float>(v); }

// Round an fp32 value through T (the rounding a T-typed MLX result gets).
template <typename T>
__device__ __forceinline__ float lily_round(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// Load N activations to fp32 registers; return their sum. 16-byte loads for
// aligned bf16 rows, element loads otherwise.
template <int N, typename T>
__device__ __forceinline__ float lily_load_x(const T* p, float* v) {
  bool done = false;
  if constexpr (lily_same<T, __nv_bfloat16>::value && N % 8 == 0) {
    if ((reinterpret_cast<unsigned long long>(p) & 15ull) == 0ull) {
      const uint4* q = reinterpret_cast<const uint4*>(p);
#pragma unroll
      for (int i = 0; i < N / 8; ++i) {
        const uint4 u = q[i];
        v[8 * i + 0] = __uint_as_float(u.x << 16);
        v[8 * i + 1] = __uint_as_float(u.x & 0xffff0000u);
        v[8 * i + 2] = __uint_as_float(u.y << 16);
        v[8 * i + 3] = __uint_as_float(u.y & 0xffff0000u);
        v[8 * i + 4] = __uint_as_float(u.z << 16);
        v[8 * i + 5] = __uint_as_float(u.z & 0xffff0000u);
        v[8 * i + 6] = __uint_as_float(u.w << 16);
        v[8 * i + 7] = __uint_as_float(u.w & 0xffff0000u);
      }
      done = true;
    }
  }
  if (!done) {
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = static_cast<float>(p[i]);
  }
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < N; ++i) s += v[i];
  return s;
}

// dot(q, v) over the 128/BITS quantized values packed in one 16-byte word
// (value j of a uint32 at bits [BITS*j, BITS*j+BITS)). 2^23 + q is built in
// the mantissa (exact) instead of an int->float conversion.
template <int BITS>
__device__ __forceinline__ float lily_qdot(uint4 w, const float* v) {
  constexpr int PER = 32 / BITS;
  constexpr unsigned M = (1u << BITS) - 1u;
  const unsigned ws[4] = {w.x, w.y, w.z, w.w};
  float a[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      const float q = __uint_as_float(((ws[i] >> (BITS * j)) & M) | 0x4B000000u) - 8388608.0f;
      acc = fmaf(q, v[i * PER + j], acc);
    }
    a[i] = acc;
  }
  return (a[0] + a[1]) + (a[2] + a[3]);
}

// Sum over aligned groups of L lanes (L a power of two <= 32); all lanes call it.
template <int L>
__device__ __forceinline__ float lily_group_sum(float v) {
#pragma unroll
  for (int o = L / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
// One lane's share of RPW quantized weight rows (STEPS 16-byte words each, with the
// scale and bias of each word's group), held in registers. load() issues every load
// before any math: ptxas otherwise waits on each word before requesting the next
// (SASS of the interleaved loop: one LDG.128 in flight per lane), and a decode GEMV is
// bound by the bytes in flight.
// K: the values each row contributes (x's length); KF: the matrix's row width (K unless
// the tile covers a column slice, load_row's col0).
template <typename S, int K, int BITS, int GS, int RPW, int LPR, int KF = K>
struct LilyRowTile {
  static constexpr int VPL = 128 / BITS;
  static constexpr int KW = K / VPL;
  static constexpr int STEPS = KW / LPR;
  static constexpr int KWF = KF / VPL;
  static constexpr int NGF = KF / GS;
  uint4 q[STEPS][RPW];
  S sc[STEPS][RPW];
  S bi[STEPS][RPW];
  // columns col0 .. col0+K of weight row `row` into slot r, lane sl of LPR
  __device__ __forceinline__ void load_row(const uint4* w4, const S* scales, const S* biases,
                                           int r, size_t row, int sl, int col0 = 0) {
#pragma unroll
    for (int st = 0; st < STEPS; ++st) {
      const int c = col0 / VPL + st * LPR + sl;
      const int g = (c * VPL) / GS;
      q[st][r] = w4[row * KWF + c];
      sc[st][r] = scales[row * NGF + g];
      bi[st][r] = biases[row * NGF + g];
    }
  }
  // rows row0 .. row0+RPW-1 (each clamped to last) of w4/scales/biases, lane sl of LPR
  __device__ __forceinline__ void load(const uint4* w4, const S* scales, const S* biases,
                                       int row0, int last, int sl) {
#pragma unroll
    for (int r = 0; r < RPW; ++r) load_row(w4, scales, biases, r, (size_t)min(row0 + r, last), sl);
  }
  // acc[r] += cf * (x . dequant(row r)) over this lane's words; x in global or shared
  template <typename T>
  __device__ __forceinline__ void fma(const T* xr, int sl, float cf, float* acc) const {
#pragma unroll
    for (int st = 0; st < STEPS; ++st) {
      float xv[VPL];
      const float xs = lily_load_x<VPL>(xr + (st * LPR + sl) * VPL, xv);
#pragma unroll
      for (int r = 0; r < RPW; ++r) {
        acc[r] += cf * (lily_f(sc[st][r]) * lily_qdot<BITS>(q[st][r], xv) + lily_f(bi[st][r]) * xs);
      }
    }
  }
  // out(r, x . dequant(row r)) for each row, the dot summed over the group's LPR lanes
  // (every lane of the group gets it)
  template <typename T, class F>
  __device__ __forceinline__ void dot_each(const T* xr, int sl, F out) const {
    float acc[RPW];
#pragma unroll
    for (int r = 0; r < RPW; ++r) acc[r] = 0.f;
    fma(xr, sl, 1.f, acc);
#pragma unroll
    for (int r = 0; r < RPW; ++r) out(r, lily_group_sum<LPR>(acc[r]));
  }
};

// The GEMV of lily_qgemv / lily_norm_qgemv for one lane group: output rows
// row0 .. row0+RPW-1 of y = x @ dequant(w)^T, LPR lanes per weight row (lane sl of the
// group), 16-byte weight loads all issued first (LilyRowTile), scale*dot(q,x) +
// bias*sum(x) per quantization group in fp32; x may live in global or shared memory.
template <typename T, typename S, int K, int O, int BITS, int GS, int RPW, int LPR>
__device__ __forceinline__ void lily_qgemv_rows(const T* xr, const uint32_t* w,
                                                const S* scales, const S* biases, T* yr,
                                                int row0, int sl) {
  LilyRowTile<S, K, BITS, GS, RPW, LPR> tile;
  tile.load(reinterpret_cast<const uint4*>(w), scales, biases, row0, O - 1, sl);
  tile.dot_each(xr, sl, [&](int r, float v) {
    if (sl == 0 && row0 + r < O) yr[row0 + r] = static_cast<T>(v);
  });
}
// acc[r] = x . dequant(columns col0 .. col0+N of weight row rows[r]) for RPW rows of a
// quantized matrix KF values wide (x: N values; LPR lanes per row, lane sl of the group;
// every lane of the group gets the sum); all loads issued before any math, as in
// LilyRowTile (whose tile it is). col0 a multiple of 128/BITS.
template <typename S, int N, int KF, int BITS, int GS, int RPW, int LPR, typename T>
__device__ __forceinline__ void lily_qgemv_slice(const T* xr, const uint32_t* w,
                                                 const S* scales, const S* biases,
                                                 const int* rows, int col0, int sl,
                                                 float* acc) {
  using Tile = LilyRowTile<S, N, BITS, GS, RPW, LPR, KF>;
  static_assert(Tile::STEPS * LPR * Tile::VPL == N, "lily_qgemv_slice: bad N / LPR");
  Tile tile;
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    tile.load_row(reinterpret_cast<const uint4*>(w), scales, biases, r, (size_t)rows[r], sl,
                  col0);
  }
  tile.dot_each(xr, sl, [&](int r, float v) { acc[r] = v; });
}
// acc[r] = x . dequant(weight row rows[r]) for RPW rows anywhere in w (K values each):
// lily_qgemv_rows for gathered rows.
template <typename S, int K, int BITS, int GS, int RPW, int LPR, typename T>
__device__ __forceinline__ void lily_qgemv_gather(const T* xr, const uint32_t* w,
                                                  const S* scales, const S* biases,
                                                  const int* rows, int sl, float* acc) {
  lily_qgemv_slice<S, K, K, BITS, GS, RPW, LPR>(xr, w, scales, biases, rows, 0, sl, acc);
}
// ---- end lily qgemv helpers ----
