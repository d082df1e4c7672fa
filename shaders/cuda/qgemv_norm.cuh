// ---- lily qgemv helpers, norm part (after qgemv_common): norm_qgemv, moe_router_topk,
// moe_gate_up, gdn_decode pull it in with a second `// @header` line ----
// rsqrt(mean of squares + eps) of a D-wide row from each thread's partial sum of
// squares ss: warp sums, then the NW warp sums through red (a barrier inside).
template <int D, int NW>
__device__ __forceinline__ float lily_block_rinv(float ss, float* red, float eps, int lane,
                                                 int warp) {
  ss = lily_group_sum<32>(ss);
  if (lane == 0) red[warp] = ss;
  __syncthreads();
  float tot = 0.f;
#pragma unroll
  for (int i = 0; i < NW; ++i) tot += red[i];
  return rsqrtf(tot / float(D) + eps);
}
// The residual add + RMSNorm of one row into shared memory, rounded as lily_add_rms_norm:
// h = T(hin + res), xs = T(nw * T(h * rsqrt(mean(h^2) + eps))); h_out / xn_out (either
// may be null) receive h and xs. Every thread of the block calls it; ends with a barrier.
template <typename T, int D, int NW>
__device__ __forceinline__ void lily_add_rms_norm_row(const T* hin, const T* res,
                                                      const T* nw, float eps, T* xs,
                                                      float* red, T* h_out, T* xn_out,
                                                      int tid, int lane, int warp) {
  constexpr int TPB = 32 * NW;
  if constexpr (sizeof(T) == 2 && D % (8 * TPB) == 0) {
    // 16-byte words, all loads issued before any store (the element loop below waits on
    // each load: its stores may alias hin/res); same rounding, fp32 sum in another order
    constexpr int PW = D / (8 * TPB);
    const unsigned long long al =
        reinterpret_cast<unsigned long long>(hin) | reinterpret_cast<unsigned long long>(res) |
        reinterpret_cast<unsigned long long>(nw) | reinterpret_cast<unsigned long long>(xs) |
        reinterpret_cast<unsigned long long>(h_out) | reinterpret_cast<unsigned long long>(xn_out);
    if ((al & 15ull) == 0ull) {
      uint4 hv[PW], rv[PW], nv[PW];
#pragma unroll
      for (int i = 0; i < PW; ++i) {
        hv[i] = reinterpret_cast<const uint4*>(hin)[tid + i * TPB];
        rv[i] = reinterpret_cast<const uint4*>(res)[tid + i * TPB];
        nv[i] = reinterpret_cast<const uint4*>(nw)[tid + i * TPB];
      }
      float ss = 0.f;
#pragma unroll
      for (int i = 0; i < PW; ++i) {
        T* he = reinterpret_cast<T*>(&hv[i]);
        const T* re = reinterpret_cast<const T*>(&rv[i]);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const T hh = static_cast<T>(lily_f(he[j]) + lily_f(re[j]));
          he[j] = hh;
          ss += lily_f(hh) * lily_f(hh);
        }
      }
      if (h_out) {
#pragma unroll
        for (int i = 0; i < PW; ++i) reinterpret_cast<uint4*>(h_out)[tid + i * TPB] = hv[i];
      }
      const float rinv = lily_block_rinv<D, NW>(ss, red, eps, lane, warp);
#pragma unroll
      for (int i = 0; i < PW; ++i) {
        T* he = reinterpret_cast<T*>(&hv[i]);
        const T* ne = reinterpret_cast<const T*>(&nv[i]);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          he[j] = static_cast<T>(lily_f(ne[j]) * lily_round<T>(lily_f(he[j]) * rinv));
        }
        reinterpret_cast<uint4*>(xs)[tid + i * TPB] = hv[i];
        if (xn_out) reinterpret_cast<uint4*>(xn_out)[tid + i * TPB] = hv[i];
      }
      __syncthreads();
      return;
    }
  }
  float ss = 0.f;
  for (int k = tid; k < D; k += TPB) {
    const T hh = static_cast<T>(lily_f(hin[k]) + lily_f(res[k]));
    if (h_out) h_out[k] = hh;
    xs[k] = hh;
    ss += lily_f(hh) * lily_f(hh);
  }
  const float rinv = lily_block_rinv<D, NW>(ss, red, eps, lane, warp);
  for (int k = tid; k < D; k += TPB) {
    const T v = static_cast<T>(lily_f(nw[k]) * lily_round<T>(lily_f(xs[k]) * rinv));
    xs[k] = v;
    if (xn_out) xn_out[k] = v;
  }
  __syncthreads();
}
