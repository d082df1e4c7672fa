// ---- lily qgemv helpers, routing part (after qgemv_common): moe_router_topk,
// moe_gate_up and moe_decode pull it in with a `// @header` line ----
// h[row] = T(silu(g) * u) for the rows row0 .. row0+RPW-1 (< n) of the gate and up tiles
// tg / tu over x, g and u rounded to T first (as mlx-lm's gather_qmm outputs are).
template <typename T, typename S, int D, int BITS, int GS, int RPW, int LPR, typename X>
__device__ __forceinline__ void lily_swiglu_rows(const LilyRowTile<S, D, BITS, GS, RPW, LPR>& tg,
                                                 const LilyRowTile<S, D, BITS, GS, RPW, LPR>& tu,
                                                 const X* xr, int sl, T* h, int row0, int n) {
  float ag[RPW];
  float au[RPW];
#pragma unroll
  for (int r = 0; r < RPW; ++r) { ag[r] = 0.f; au[r] = 0.f; }
  tg.fma(xr, sl, 1.f, ag);
  tu.fma(xr, sl, 1.f, au);
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    const float gv = lily_round<T>(lily_group_sum<LPR>(ag[r]));
    const float uv = lily_round<T>(lily_group_sum<LPR>(au[r]));
    if (sl == 0 && row0 + r < n) h[row0 + r] = static_cast<T>(gv / (1.f + expf(-gv)) * uv);
  }
}
// Routing of one row by one warp (all 32 lanes call it): fp32 softmax over the E
// logits lg[0..E) (already rounded to T), probabilities rounded to T, K rounds of a
// lane-parallel argmax with ties to the lowest expert id (picks in decreasing order),
// and with NORM the picks divided by their sum rounded to T. Lane j < K gets pick j in
// (idx, score); other lanes get (0, 0). Ids are always in [0, E): a NaN probability
// ranks below every number and its pick scores NaN.
template <typename T, int E, int K, bool NORM, typename LP>
__device__ __forceinline__ void lily_route_topk(LP lg, int lane, unsigned& idx,
                                                float& score) {
  constexpr int EPL = (E + 31) / 32;
  float p[EPL];
  float m = __int_as_float(0xff800000);
#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    const int e = lane + 32 * i;
    p[i] = e < E ? lily_f(lg[e]) : __int_as_float(0xff800000);
    m = fmaxf(m, p[i]);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  float den = 0.f;
#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    const int e = lane + 32 * i;
    p[i] = e < E ? expf(p[i] - m) : 0.f;
    den += p[i];
  }
  den = lily_group_sum<32>(den);
  const float inv = 1.f / den;
#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    const int e = lane + 32 * i;
    p[i] = e < E ? lily_round<T>(p[i] * inv) : -1.f;
    // NaN (tested on the bits, which fast math cannot fold): picked after every number,
    // scored NaN
    if (e < E && (__float_as_uint(p[i]) & 0x7fffffffu) > 0x7f800000u) p[i] = -0.5f;
  }
  unsigned my_i = 0u;
  float my_v = 0.f;
  for (int j = 0; j < K; ++j) {
    float bv = -2.f;
    int bi = 0x7fffffff;
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      if (p[i] > bv) { bv = p[i]; bi = lane + 32 * i; }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
    }
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      if (lane + 32 * i == bi) p[i] = -3.f;
    }
    if (lane == j) { my_i = (unsigned)bi; my_v = bv < 0.f ? __int_as_float(0x7fc00000) : bv; }
  }
  const float tot = lily_group_sum<32>(lane < K ? my_v : 0.f);
  idx = my_i;
  score = lane < K ? (NORM ? my_v / lily_round<T>(tot) : my_v) : 0.f;
}
