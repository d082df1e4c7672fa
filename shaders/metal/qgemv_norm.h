// ---- lily qgemv helpers, norm part (after qgemv_common): norm_qgemv, moe_router_topk,
// moe_gate_up, gdn_decode pull it in with a second `// @header` line ----
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
