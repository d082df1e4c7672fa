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
// ---- end lily qgemv helpers ----
