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

// Sum over aligned groups of L lanes (L a power of two <= 32); all lanes call it.
template <int L>
inline float lily_group_sum(float v) {
  for (ushort o = L / 2; o > 0; o >>= 1) {
    v += simd_shuffle_xor(v, o);
  }
  return v;
}
// acc[r] = x . dequant(weight row rows[r]) for RPW rows anywhere in w, LPR lanes per
// row (lane sl of the group; every lane of the group gets the sum), 16-byte weight
// loads, scale*dot(q,x) + bias*sum(x) per quantization group in fp32; x may live in
// device or threadgroup memory (XP).
template <typename S, int K, int BITS, int GS, int RPW, int LPR, typename XP>
inline void lily_qgemv_gather(XP xr, const device uint32_t* w, const device S* scales,
                              const device S* biases, thread const int* rows, int sl,
                              thread float* acc) {
  constexpr int VPL = 128 / BITS;
  constexpr int KW = K / VPL;
  constexpr int STEPS = KW / LPR;
  constexpr int NG = K / GS;
  const device uint4* w4 = reinterpret_cast<const device uint4*>(w);
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
      const uint4 q = w4[ulong(rows[r]) * KW + c];
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
          typename XP>
inline void lily_qgemv_rows(XP xr, const device uint32_t* w, const device S* scales,
                            const device S* biases, device T* yr, int row0, int sl) {
  int rows[RPW];
  for (int r = 0; r < RPW; ++r) {
    rows[r] = min(row0 + r, O - 1);
  }
  float acc[RPW];
  lily_qgemv_gather<S, K, BITS, GS, RPW, LPR>(xr, w, scales, biases, rows, sl, acc);
  for (int r = 0; r < RPW; ++r) {
    if (sl == 0 && row0 + r < O) {
      yr[row0 + r] = static_cast<T>(acc[r]);
    }
  }
}
// The residual add + RMSNorm of one row into threadgroup memory, rounded as
// lily_add_rms_norm: h = T(hin + res), xs = T(nw * T(h * rsqrt(mean(h^2) + eps)));
// h_out / xn_out (either may be null) receive h and xs. Every thread of the threadgroup
// calls it; ends with a barrier.
template <typename T, int D, int NW>
inline void lily_add_rms_norm_row(const device T* hin, const device T* res,
                                  const device T* nw, float eps, threadgroup T* xs,
                                  threadgroup float* red, device T* h_out, device T* xn_out,
                                  int tid, int lane, int warp) {
  constexpr int TPB = 32 * NW;
  float ss = 0.0f;
  for (int k = tid; k < D; k += TPB) {
    const T hh = static_cast<T>(static_cast<float>(hin[k]) + static_cast<float>(res[k]));
    if (h_out) {
      h_out[k] = hh;
    }
    xs[k] = hh;
    ss += static_cast<float>(hh) * static_cast<float>(hh);
  }
  ss = lily_group_sum<32>(ss);
  if (lane == 0) {
    red[warp] = ss;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float tot = 0.0f;
  for (int i = 0; i < NW; ++i) {
    tot += red[i];
  }
  const float rinv = metal::precise::rsqrt(tot / float(D) + eps);
  for (int k = tid; k < D; k += TPB) {
    const T v = static_cast<T>(static_cast<float>(nw[k]) *
                               lily_round<T>(static_cast<float>(xs[k]) * rinv));
    xs[k] = v;
    if (xn_out) {
      xn_out[k] = v;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
// Routing of one row by one simdgroup (all 32 lanes call it): fp32 softmax over the E
// logits lg[0..E) (already rounded to T), probabilities rounded to T, K rounds of a
// lane-parallel argmax with ties to the lowest expert id (picks in decreasing order),
// and with NORM the picks divided by their sum rounded to T. Lane j < K gets pick j in
// (idx, score); other lanes get (0, 0).
template <typename T, int E, int K, bool NORM, typename LP>
inline void lily_route_topk(LP lg, int lane, thread uint& idx, thread float& score) {
  constexpr int EPL = (E + 31) / 32;
  float p[EPL];
  float m = -INFINITY;
  for (int i = 0; i < EPL; ++i) {
    const int e = lane + 32 * i;
    p[i] = e < E ? static_cast<float>(lg[e]) : -INFINITY;
    m = max(m, p[i]);
  }
  for (ushort o = 16; o > 0; o >>= 1) {
    m = max(m, simd_shuffle_xor(m, o));
  }
  float den = 0.0f;
  for (int i = 0; i < EPL; ++i) {
    const int e = lane + 32 * i;
    p[i] = e < E ? metal::exp(p[i] - m) : 0.0f;
    den += p[i];
  }
  den = lily_group_sum<32>(den);
  const float inv = 1.0f / den;
  for (int i = 0; i < EPL; ++i) {
    const int e = lane + 32 * i;
    p[i] = e < E ? lily_round<T>(p[i] * inv) : -1.0f;
  }
  uint my_i = 0u;
  float my_v = 0.0f;
  for (int j = 0; j < K; ++j) {
    float bv = -2.0f;
    int bi = 0x7fffffff;
    for (int i = 0; i < EPL; ++i) {
      if (p[i] > bv) {
        bv = p[i];
        bi = lane + 32 * i;
      }
    }
    for (ushort o = 16; o > 0; o >>= 1) {
      const float ov = simd_shuffle_xor(bv, o);
      const int oi = simd_shuffle_xor(bi, o);
      if (ov > bv || (ov == bv && oi < bi)) {
        bv = ov;
        bi = oi;
      }
    }
    for (int i = 0; i < EPL; ++i) {
      if (lane + 32 * i == bi) {
        p[i] = -3.0f;
      }
    }
    if (lane == j) {
      my_i = uint(bi);
      my_v = bv;
    }
  }
  const float tot = lily_group_sum<32>(lane < K ? my_v : 0.0f);
  idx = my_i;
  score = lane < K ? (NORM ? my_v / lily_round<T>(tot) : my_v) : 0.0f;
}
// ---- end lily qgemv helpers ----
