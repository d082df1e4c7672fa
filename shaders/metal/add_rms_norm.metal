// @kernel lily_add_rms_norm
// @inputs x[N,D] r[N,D] w[D] eps[1]:float32 (row-contiguous)
// @outputs h[N,D]:T normed[N,D]:T
// @template T=bfloat16 D=2048 E=8
// @grid (D/E * N, 1, 1)
// @threadgroup (D/E, 1, 1)
// One threadgroup per row, E contiguous elements per thread:
// h = T(x + r); normed = T(w * T(h * rsqrt(mean(h^2) + eps))) (statistics fp32, as
// mx.fast.rms_norm rounds).

inline float lily_warp_sum(float v) {
  v += simd_shuffle_xor(v, 1);
  v += simd_shuffle_xor(v, 2);
  v += simd_shuffle_xor(v, 4);
  v += simd_shuffle_xor(v, 8);
  v += simd_shuffle_xor(v, 16);
  return v;
}

// ---- body ----
  constexpr int TPB = D / E;
  constexpr int NWP = TPB / 32;
  threadgroup float red[NWP];
  const int tid = int(thread_position_in_threadgroup.x);
  const int lane = int(thread_index_in_simdgroup);
  const int warp = int(simdgroup_index_in_threadgroup);
  const int64_t base = int64_t(threadgroup_position_in_grid.x) * D + tid * E;

  float hv[E];
  float ss = 0.0f;
  for (int j = 0; j < E; ++j) {
    const T hh = static_cast<T>(static_cast<float>(x[base + j]) + static_cast<float>(r[base + j]));
    h[base + j] = hh;
    hv[j] = static_cast<float>(hh);
    ss += hv[j] * hv[j];
  }
  ss = lily_warp_sum(ss);
  if (lane == 0) {
    red[warp] = ss;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float tot = 0.0f;
  for (int i = 0; i < NWP; ++i) {
    tot += red[i];
  }
  const float rinv = metal::precise::rsqrt(tot / float(D) + eps[0]);
  for (int j = 0; j < E; ++j) {
    const float nv = static_cast<float>(static_cast<T>(hv[j] * rinv));
    normed[base + j] = static_cast<T>(static_cast<float>(w[tid * E + j]) * nv);
  }
