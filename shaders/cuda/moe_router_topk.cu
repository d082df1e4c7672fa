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
// One block per token row: quantized GEMV of the E (+1 shared-gate) router rows into
// shared memory (logits rounded to T), then warp 0: fp32 softmax over E, probabilities
// rounded to T, top-K by value with ties to the lowest expert id (picks in decreasing
// order), renormalisation (sum rounded to T), sigmoid of the shared-gate logit.
// @header qgemv_common.cuh
// @header qgemv_norm.cuh
// @header qgemv_route.cuh
// ---- body ----
  constexpr int VPL = 128 / BITS;            // quantized values per 16-byte word
  constexpr int KW = D / VPL;                // 16-byte words per weight row
  constexpr int LPR = KW < 32 ? KW : 32;     // lanes per row
  constexpr int SG = 32 / LPR;               // rows in flight per warp
  constexpr int STEPS = KW / LPR;
  constexpr int R = E + (HAS_SHARED ? 1 : 0);
  static_assert(KW * VPL == D && STEPS * LPR == KW && SG * LPR == 32, "router: bad D");
  static_assert(GS % VPL == 0 && K <= 32 && K <= E, "router: bad GS/K");

  __shared__ float lg[R];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int sub = lane / LPR;
  const int sl = lane % LPR;
  const int n = blockIdx.y;
  constexpr int TPB = 32 * NW;
  __shared__ T xs_row[D];
  __shared__ float nred[NW];
  const size_t ro = (size_t)n * D;
  if (PRE_NORM) {
    lily_add_rms_norm_row<T, D, NW>(hin + ro, res + ro, nw, eps[0], xs_row, nred, h + ro,
                                    xn + ro, threadIdx.x, lane, warp);
  } else {
    for (int k = threadIdx.x; k < D; k += TPB) xs_row[k] = x[ro + k];
    __syncthreads();
  }
  const uint4* w4 = reinterpret_cast<const uint4*>(w);

  for (int wb = warp * SG * RPW; wb < R; wb += NW * SG * RPW) {
    LilyRowTile<S, D, BITS, GS, RPW, LPR> tile;
    tile.load(w4, scales, biases, wb + sub * RPW, R - 1, sl);
    tile.dot_each(xs_row, sl, [&](int r, float s) {
      const int row = wb + sub * RPW + r;
      if (sl == 0 && row < R) lg[row] = lily_round<T>(s);
    });
  }
  __syncthreads();
  if (warp != 0) return;

  unsigned my_i = 0u;
  float my_sc = 0.f;
  lily_route_topk<T, E, K, NORM>(lg, lane, my_i, my_sc);
  if (lane < K) {
    inds[(size_t)n * K + lane] = my_i;
    scores[(size_t)n * K + lane] = static_cast<T>(my_sc);
  }
  if (lane == 0) {
    float sh = 0.f;
    if constexpr (HAS_SHARED) sh = 1.f / (1.f + expf(-lg[E]));
    shared[n] = static_cast<T>(sh);
  }
