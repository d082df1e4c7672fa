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
// @header qgemv_common.h
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

  const int lane = int(thread_index_in_simdgroup);
  const int warp = int(simdgroup_index_in_threadgroup) % NW;
  const int sgp = int(simdgroup_index_in_threadgroup) / NW;
  threadgroup float part[SL > 1 ? SL * RPB : 1];
  const int sub = lane / LPR;
  const int sl = lane % LPR;
  const int bx = int(threadgroup_position_in_grid.x);
  const int n = int(threadgroup_position_in_grid.y);
  const int row0 = bx * RPB + (warp * SG + sub) * RPW;
  if (bx * RPB >= D) {
    return;
  }

  float acc[RPW];
  for (int r = 0; r < RPW; ++r) {
    acc[r] = 0.0f;
  }
  for (int slot = sgp; slot <= K; slot += SL) {
    const device uint4* w4;
    const device S* sp;
    const device S* bp;
    float cf;
    if (slot < K) {
      const ulong e = min(uint(inds[n * K + slot]), uint(E - 1));
      cf = static_cast<float>(scores[n * K + slot]);
      w4 = reinterpret_cast<const device uint4*>(down_w) + e * (D * KW);
      sp = down_s + e * (D * NG);
      bp = down_b + e * (D * NG);
    } else {
      cf = static_cast<float>(shared[n]);
      w4 = reinterpret_cast<const device uint4*>(sdown_w);
      sp = sdown_s;
      bp = sdown_b;
    }
    const int ho = (n * (K + 1) + slot) * I;
    for (int st = 0; st < STEPS; ++st) {
      const int c = st * LPR + sl;
      float hv[VPL];
      const float hs = lily_load_x<VPL>(h + (ho + c * VPL), hv);
      const int g = (c * VPL) / GS;
      for (int r = 0; r < RPW; ++r) {
        const int row = min(row0 + r, D - 1);
        const int so = row * NG + g;
        const uint4 q = w4[row * KW + c];
        acc[r] += cf * (static_cast<float>(sp[so]) * lily_qdot<BITS>(q, hv) +
                        static_cast<float>(bp[so]) * hs);
      }
    }
  }
  const int prow = (warp * SG + sub) * RPW;
  for (int r = 0; r < RPW; ++r) {
    acc[r] = lily_group_sum<LPR>(acc[r]);
    if (SL > 1 && sl == 0) {
      part[sgp * RPB + prow + r] = acc[r];
    }
  }
  if (SL > 1) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (sgp != 0) {
      return;
    }
    for (int r = 0; r < RPW; ++r) {
      float v = 0.0f;
      for (int q = 0; q < SL; ++q) {
        v += part[q * RPB + prow + r];
      }
      acc[r] = v;
    }
  }
  for (int r = 0; r < RPW; ++r) {
    const float v = acc[r];
    const int row = row0 + r;
    if (sl == 0 && row < D) {
      float o = v;
      if (RES) {
        o = static_cast<float>(res[n * D + row]) + lily_round<T>(v);
      }
      y[n * D + row] = static_cast<T>(o);
    }
  }
