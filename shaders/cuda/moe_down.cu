// @kernel lily_moe_down
// @inputs h[N,K+1,I]:T inds[N,K]:uint32 scores[N,K]:T shared[N]:T (value n at index n of a buffer of >= N) down_w[E,D,I*BITS/32]:uint32 down_s[E,D,I/GS]:S down_b[E,D,I/GS]:S sdown_w[D,I*BITS/32]:uint32 sdown_s[D,I/GS]:S sdown_b[D,I/GS]:S res[N,D]:T
// @outputs y[N,D]:T
// @template T=bfloat16 S=bfloat16 D=2048 I=512 K=8 E=256 BITS=4 GS=64 NW=4 RPW=2 SL=3 RES=false
// @template T=float32 S=float16 D=128 I=64 K=3 E=5 BITS=8 GS=64 NW=4 RPW=2 SL=1 RES=true
// @grid (ceil(D/RPB)*32*NW*SL, N, 1)   RPB = NW*(32/LPR)*RPW, LPR = min(32, I*BITS/128)
// @threadgroup (32*NW*SL, 1, 1)
// y[n,d] = sum_j scores[n,j] * down_{inds[n,j]}(h[n,j])[d] + shared[n] * sdown(h[n,K])[d],
// accumulated per lane in fp32 over the K+1 slots and reduced once; with RES,
// y = res + round_T(that) (the decoder layer's residual add). res is unread otherwise.
// SL slot groups: warp w serves row group w % NW and slots w/NW, w/NW + SL, ...; the SL
// partial sums of a row meet in shared memory, added in slot-group order.
// @header qgemv_common.cuh
// ---- body ----
  constexpr int VPL = 128 / BITS;
  constexpr int KW = I / VPL;
  constexpr int LPR = KW < 32 ? KW : 32;
  constexpr int SG = 32 / LPR;
  constexpr int STEPS = KW / LPR;
  constexpr int NG = I / GS;
  constexpr int RPB = NW * SG * RPW;
  static_assert(KW * VPL == I && STEPS * LPR == KW && SG * LPR == 32, "down: bad I");
  static_assert(GS % VPL == 0, "down: bad GS");

  const int lane = threadIdx.x & 31;
  const int warp = (threadIdx.x >> 5) % NW;
  const int sgp = (threadIdx.x >> 5) / NW;
  __shared__ float part[SL > 1 ? SL * RPB : 1];
  const int sub = lane / LPR;
  const int sl = lane % LPR;
  const int n = blockIdx.y;
  const int row0 = blockIdx.x * RPB + (warp * SG + sub) * RPW;
  if (blockIdx.x * RPB >= D) return;

  // this warp's slots sgp, sgp + SL, ...: expert ids and scores first, then every weight
  // load of every slot (LilyRowTile), then the math
  constexpr int NS = (K + SL) / SL;
  LilyRowTile<S, I, BITS, GS, RPW, LPR> tile[NS];
  float cf[NS];
#pragma unroll
  for (int i = 0; i < NS; ++i) {
    const int slot = sgp + i * SL;
    cf[i] = 0.f;
    if (slot > K) continue;
    const uint4* w4;
    const S* sp;
    const S* bp;
    if (slot < K) {
      const size_t e = min(inds[(size_t)n * K + slot], (unsigned)(E - 1));
      cf[i] = lily_f(scores[(size_t)n * K + slot]);
      w4 = reinterpret_cast<const uint4*>(down_w) + e * D * KW;
      sp = down_s + e * D * NG;
      bp = down_b + e * D * NG;
    } else {
      cf[i] = lily_f(shared[n]);
      w4 = reinterpret_cast<const uint4*>(sdown_w);
      sp = sdown_s;
      bp = sdown_b;
    }
    tile[i].load(w4, sp, bp, row0, D - 1, sl);
  }
  float acc[RPW];
#pragma unroll
  for (int r = 0; r < RPW; ++r) acc[r] = 0.f;
#pragma unroll
  for (int i = 0; i < NS; ++i) {
    const int slot = sgp + i * SL;
    if (slot > K) continue;
    tile[i].fma(h + ((size_t)n * (K + 1) + slot) * I, sl, cf[i], acc);
  }
  const int prow = (warp * SG + sub) * RPW;
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    acc[r] = lily_group_sum<LPR>(acc[r]);
    if (SL > 1 && sl == 0) part[sgp * RPB + prow + r] = acc[r];
  }
  if (SL > 1) {
    __syncthreads();
    if (sgp != 0) return;
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      float v = 0.f;
#pragma unroll
      for (int q = 0; q < SL; ++q) v += part[q * RPB + prow + r];
      acc[r] = v;
    }
  }
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    const float v = acc[r];
    const int row = row0 + r;
    if (sl == 0 && row < D) {
      float o = v;
      if constexpr (RES) o = lily_f(res[(size_t)n * D + row]) + lily_round<T>(v);
      y[(size_t)n * D + row] = static_cast<T>(o);
    }
  }
