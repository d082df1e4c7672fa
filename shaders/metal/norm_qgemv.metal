// @kernel lily_norm_qgemv
// @inputs hin[N,K]:T res[N,K]:T nw[K]:T eps[1]:float32 w[O,K*BITS/32]:uint32 scales[O,K/GS]:S biases[O,K/GS]:S
// @outputs y[N,O]:T h[N,K]:T
// @template T=bfloat16 S=bfloat16 K=2048 O=12352 BITS=4 GS=64 NW=4 RPW=4
// @template T=float16 S=float16 K=256 O=7 BITS=4 GS=64 NW=4 RPW=4
// @grid (ceil(O/RPB)*32*NW, N, 1)   RPB = NW*(32/LPR)*RPW, LPR = min(32, K*BITS/128)
// @threadgroup (32*NW, 1, 1)
// The residual add and RMSNorm in front of a quantized GEMV, one launch:
// h = T(hin + res) (written by the first threadgroup of each row), x = T(nw * T(h *
// rsqrt(mean(h^2) + eps))) kept in threadgroup memory (as lily_add_rms_norm rounds), then
// y = x @ dequant(w)^T exactly as lily_qgemv.
// @header qgemv_common.h
// ---- body ----
  constexpr int VPL = 128 / BITS;
  constexpr int KW = K / VPL;
  constexpr int LPR = KW < 32 ? KW : 32;
  constexpr int SG = 32 / LPR;
  constexpr int STEPS = KW / LPR;
  constexpr int NG = K / GS;
  constexpr int RPB = NW * SG * RPW;
  constexpr int TPB = 32 * NW;
  static_assert(KW * VPL == K && STEPS * LPR == KW && SG * LPR == 32, "norm_qgemv: bad K");
  static_assert(GS % VPL == 0, "norm_qgemv: bad GS");

  threadgroup T xs[K];
  threadgroup float red[NW];
  const int tid = int(thread_position_in_threadgroup.x);
  const int lane = int(thread_index_in_simdgroup);
  const int warp = int(simdgroup_index_in_threadgroup);
  const int sub = lane / LPR;
  const int sl = lane % LPR;
  const int bx = int(threadgroup_position_in_grid.x);
  const int n = int(threadgroup_position_in_grid.y);
  const int row0 = bx * RPB + (warp * SG + sub) * RPW;
  if (bx * RPB >= O) {
    return;
  }
  const ulong ro = ulong(n) * K;
  const bool writer = bx == 0;

  float ss = 0.0f;
  for (int k = tid; k < K; k += TPB) {
    const T hh = static_cast<T>(static_cast<float>(hin[ro + k]) + static_cast<float>(res[ro + k]));
    if (writer) {
      h[ro + k] = hh;
    }
    const float hv = static_cast<float>(hh);
    xs[k] = hh;
    ss += hv * hv;
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
  const float rinv = metal::precise::rsqrt(tot / float(K) + eps[0]);
  for (int k = tid; k < K; k += TPB) {
    const float nv = lily_round<T>(static_cast<float>(xs[k]) * rinv);
    xs[k] = static_cast<T>(static_cast<float>(nw[k]) * nv);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  const device uint4* w4 = reinterpret_cast<const device uint4*>(w);
  float acc[RPW];
  for (int r = 0; r < RPW; ++r) {
    acc[r] = 0.0f;
  }
  for (int st = 0; st < STEPS; ++st) {
    const int c = st * LPR + sl;
    float xv[VPL];
    const float xsum = lily_load_x<VPL>(xs + c * VPL, xv);
    const int g = (c * VPL) / GS;
    for (int r = 0; r < RPW; ++r) {
      const int row = min(row0 + r, O - 1);
      const ulong so = ulong(row) * NG + g;
      const uint4 q = w4[ulong(row) * KW + c];
      acc[r] += static_cast<float>(scales[so]) * lily_qdot<BITS>(q, xv) +
                static_cast<float>(biases[so]) * xsum;
    }
  }
  const ulong yo = ulong(n) * O;
  for (int r = 0; r < RPW; ++r) {
    const float v = lily_group_sum<LPR>(acc[r]);
    const int row = row0 + r;
    if (sl == 0 && row < O) {
      y[yo + row] = static_cast<T>(v);
    }
  }
