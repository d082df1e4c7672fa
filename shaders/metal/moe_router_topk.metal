// @kernel lily_moe_router_topk
// @inputs x[N,D]:T w[R,D*BITS/32]:uint32 scales[R,D/GS]:S biases[R,D/GS]:S hin[N,D]:T res[N,D]:T nw[D]:T eps[1]:float32   (R = E + HAS_SHARED; x unread when PRE_NORM, hin/res/nw/eps unread otherwise)
// @outputs inds[N,K]:uint32 scores[N,K]:T shared[N*8]:T (value n at index n) h[N,D]:T xn[N,D]:T   (h, xn: [1], unwritten, unless PRE_NORM)
// @template T=bfloat16 S=bfloat16 D=2048 E=256 K=8 BITS=8 GS=64 HAS_SHARED=true NORM=true NW=16 RPW=4 PRE_NORM=true
// @template T=float16 S=bfloat16 D=256 E=40 K=4 BITS=4 GS=64 HAS_SHARED=false NORM=false NW=16 RPW=1 PRE_NORM=false
// @grid (32*NW, N, 1)
// @threadgroup (32*NW, 1, 1)
// The row is staged in threadgroup memory first: x itself, or with PRE_NORM the residual
// add + RMSNorm in front of the router (h = T(hin + res), xn = T(nw * T(h * rsqrt(
// mean(h^2) + eps))), both written out: xn feeds the expert GEMVs).
// One threadgroup per token row: quantized GEMV of the E (+1 shared-gate) router rows
// into threadgroup memory (logits rounded to T), then simdgroup 0: fp32 softmax over E,
// probabilities rounded to T, top-K by value with ties to the lowest expert id (picks in
// decreasing order), renormalisation (sum rounded to T), sigmoid of the shared-gate logit.
// @header qgemv_common.h
// @header qgemv_norm.h
// @header qgemv_route.h
// ---- body ----
  constexpr int VPL = 128 / BITS;
  constexpr int KW = D / VPL;
  constexpr int LPR = KW < 32 ? KW : 32;
  constexpr int SG = 32 / LPR;
  constexpr int STEPS = KW / LPR;
  constexpr int NG = D / GS;
  constexpr int R = E + (HAS_SHARED ? 1 : 0);
  static_assert(KW * VPL == D && STEPS * LPR == KW && SG * LPR == 32, "router: bad D");
  static_assert(GS % VPL == 0 && K <= 32 && K <= E, "router: bad GS/K");

  threadgroup float lg[R];
  const int lane = int(thread_index_in_simdgroup);
  const int warp = int(simdgroup_index_in_threadgroup);
  const int sub = lane / LPR;
  const int sl = lane % LPR;
  const int n = int(threadgroup_position_in_grid.y);
  constexpr int TPB = 32 * NW;
  const int tid = int(thread_position_in_threadgroup.x);
  threadgroup T xs_row[D];
  threadgroup float nred[NW];
  const ulong ro = ulong(n) * D;
  if (PRE_NORM) {
    lily_add_rms_norm_row<T, D, NW>(hin + ro, res + ro, nw, eps[0], xs_row, nred, h + ro,
                                    xn + ro, tid, lane, warp);
  } else {
    for (int k = tid; k < D; k += TPB) {
      xs_row[k] = x[ro + k];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  const device uint4* w4 = reinterpret_cast<const device uint4*>(w);

  for (int wb = warp * SG * RPW; wb < R; wb += NW * SG * RPW) {
    float acc[RPW];
    for (int r = 0; r < RPW; ++r) {
      acc[r] = 0.0f;
    }
    for (int st = 0; st < STEPS; ++st) {
      const int c = st * LPR + sl;
      float xv[VPL];
      const float xs = lily_load_x<VPL>(xs_row + c * VPL, xv);
      const int g = (c * VPL) / GS;
      for (int r = 0; r < RPW; ++r) {
        const int row = min(wb + sub * RPW + r, R - 1);
        const uint4 q = w4[row * KW + c];
        const int so = row * NG + g;
        acc[r] += static_cast<float>(scales[so]) * lily_qdot<BITS>(q, xv) +
                  static_cast<float>(biases[so]) * xs;
      }
    }
    for (int r = 0; r < RPW; ++r) {
      const float s = lily_group_sum<LPR>(acc[r]);
      const int row = wb + sub * RPW + r;
      if (sl == 0 && row < R) {
        lg[row] = lily_round<T>(s);
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (warp != 0) {
    return;
  }

  uint my_i = 0u;
  float my_sc = 0.0f;
  lily_route_topk<T, E, K, NORM>(lg, lane, my_i, my_sc);
  if (lane < K) {
    inds[n * K + lane] = my_i;
    scores[n * K + lane] = static_cast<T>(my_sc);
  }
  if (lane == 0) {
    float sh = 0.0f;
    if (HAS_SHARED) {
      sh = 1.0f / (1.0f + metal::exp(-lg[E]));
    }
    shared[n] = static_cast<T>(sh);
  }
