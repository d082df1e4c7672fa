// ---- lily qgemv helpers: shared by qgemv, moe_router_topk, moe_gate_up, moe_down ----
// (each kernel file pulls this in with its `// @header` line)
// Pointer-typed helpers are templates over the pointer type, so they accept
// both device and constant buffers.
template <typename T>
inline float lily_round(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// Load N activations to fp32 registers; return their sum.
template <int N, typename P>
inline float lily_load_x(P p, thread float* v) {
  float s = 0.0f;
  for (int i = 0; i < N; ++i) {
    v[i] = static_cast<float>(p[i]);
  }
  for (int i = 0; i < N; ++i) {
    s += v[i];
  }
  return s;
}

// dot(q, v) over the 128/BITS quantized values packed in one 16-byte word
// (value j of a uint32 at bits [BITS*j, BITS*j+BITS)).
template <int BITS>
inline float lily_qdot(uint4 w, thread const float* v) {
  constexpr int PER = 32 / BITS;
  constexpr uint M = (1u << BITS) - 1u;
  float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
  for (int j = 0; j < PER; ++j) {
    a0 = fma(float((w.x >> (BITS * j)) & M), v[j], a0);
    a1 = fma(float((w.y >> (BITS * j)) & M), v[PER + j], a1);
    a2 = fma(float((w.z >> (BITS * j)) & M), v[2 * PER + j], a2);
    a3 = fma(float((w.w >> (BITS * j)) & M), v[3 * PER + j], a3);
  }
  return (a0 + a1) + (a2 + a3);
}

// The 16-byte word pointer type in the address space of the uint32 pointer WP (MLX
// passes a weight of fewer than 8 words as `constant`, others as `device`).
template <typename WP> struct lily_word4_ptr;
template <> struct lily_word4_ptr<const device uint32_t*> { typedef const device uint4* type; };
template <> struct lily_word4_ptr<const constant uint32_t*> {
  typedef const constant uint4* type;
};

// dot(q, v) over the 64/BITS quantized values packed in one 8-byte word.
template <int BITS>
inline float lily_qdot(uint2 w, thread const float* v) {
  constexpr int PER = 32 / BITS;
  constexpr uint M = (1u << BITS) - 1u;
  float a0 = 0.0f, a1 = 0.0f;
  for (int j = 0; j < PER; ++j) {
    a0 = fma(float((w.x >> (BITS * j)) & M), v[j], a0);
    a1 = fma(float((w.y >> (BITS * j)) & M), v[PER + j], a1);
  }
  return a0 + a1;
}

// The weight word type for BPL bytes per lane (16: uint4, 8: uint2) and its pointer
// type in the address space of the uint32 pointer WP.
template <int BPL> struct lily_word { typedef uint4 type; };
template <> struct lily_word<8> { typedef uint2 type; };
template <typename WP, int BPL> struct lily_word_ptr {
  typedef typename lily_word4_ptr<WP>::type type;
};
template <> struct lily_word_ptr<const device uint32_t*, 8> { typedef const device uint2* type; };
template <> struct lily_word_ptr<const constant uint32_t*, 8> {
  typedef const constant uint2* type;
};

// Sum over aligned groups of L lanes (L a power of two <= 32); all lanes call it.
template <int L>
inline float lily_group_sum(float v) {
  for (ushort o = L / 2; o > 0; o >>= 1) {
    v += simd_shuffle_xor(v, o);
  }
  return v;
}
// acc[r] = x . dequant(weight row rows[r]) for RPW rows anywhere in w, LPR lanes per
// row (lane sl of the group; every lane of the group gets the sum), BPL-byte weight
// loads (16 or 8), scale*dot(q,x) + bias*sum(x) per quantization group in fp32; x may
// live in device or threadgroup memory (XP), w / scales / biases in device or constant
// memory (WP, SP: MLX passes arrays of fewer than 8 elements as constant).
template <typename S, int K, int BITS, int GS, int RPW, int LPR, int BPL = 16, typename XP,
          typename WP, typename SP>
inline void lily_qgemv_gather(XP xr, WP w, SP scales, SP biases, thread const int* rows,
                              int sl, thread float* acc) {
  static_assert(BPL == 16 || BPL == 8, "lily_qgemv_gather: BPL is 16 or 8");
  constexpr int VPL = 8 * BPL / BITS;
  constexpr int KW = K / VPL;
  constexpr int STEPS = KW / LPR;
  constexpr int NG = K / GS;
  typedef typename lily_word_ptr<WP, BPL>::type W4P;
  W4P w4 = reinterpret_cast<W4P>(w);
  for (int r = 0; r < RPW; ++r) {
    acc[r] = 0.0f;
  }
  for (int st = 0; st < STEPS; ++st) {
    const int c = st * LPR + sl;
    float xv[VPL];
    const float xs = lily_load_x<VPL>(xr + c * VPL, xv);
    const int g = (c * VPL) / GS;
    for (int r = 0; r < RPW; ++r) {
      const ulong so = ulong(rows[r]) * NG + g;
      const typename lily_word<BPL>::type q = w4[ulong(rows[r]) * KW + c];
      acc[r] += static_cast<float>(scales[so]) * lily_qdot<BITS>(q, xv) +
                static_cast<float>(biases[so]) * xs;
    }
  }
  for (int r = 0; r < RPW; ++r) {
    acc[r] = lily_group_sum<LPR>(acc[r]);
  }
}
// The GEMV loop of lily_qgemv / lily_norm_qgemv for one lane group: output rows
// row0 .. row0+RPW-1 of y = x @ dequant(w)^T (lily_qgemv_gather on consecutive rows,
// clamped to the last).
template <typename T, typename S, int K, int O, int BITS, int GS, int RPW, int LPR,
          int BPL = 16, typename XP, typename WP, typename SP>
inline void lily_qgemv_rows(XP xr, WP w, SP scales, SP biases, device T* yr, int row0,
                            int sl) {
  int rows[RPW];
  for (int r = 0; r < RPW; ++r) {
    rows[r] = min(row0 + r, O - 1);
  }
  float acc[RPW];
  lily_qgemv_gather<S, K, BITS, GS, RPW, LPR, BPL>(xr, w, scales, biases, rows, sl, acc);
  for (int r = 0; r < RPW; ++r) {
    if (sl == 0 && row0 + r < O) {
      yr[row0 + r] = static_cast<T>(acc[r]);
    }
  }
}
// ---- end lily qgemv helpers ----
