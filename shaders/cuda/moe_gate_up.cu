// @kernel lily_moe_gate_up
// @inputs x[N,D]:T inds[N,K]:uint32 gate_w[E,I,D*BITS/32]:uint32 gate_s[E,I,D/GS]:S gate_b[E,I,D/GS]:S up_w[E,I,D*BITS/32]:uint32 up_s[E,I,D/GS]:S up_b[E,I,D/GS]:S sgate_w[I,D*BITS/32]:uint32 sgate_s[I,D/GS]:S sgate_b[I,D/GS]:S sup_w[I,D*BITS/32]:uint32 sup_s[I,D/GS]:S sup_b[I,D/GS]:S logits[N,E+1]:T hin[N,D]:T res[N,D]:T nw[D]:T eps[1]:float32
// @outputs h[N,K+1,I]:T inds_o[N,K]:uint32 scores_o[N,K]:T shared_o[N*8]:T   (the last three: [1], unwritten, unless TOPK; shared_o: value n at index n, the rest padding)
// @template T=bfloat16 S=bfloat16 D=2048 I=512 K=8 E=256 BITS=4 GS=64 NW=4 RPW=4 TOPK=true NORM=true PRE_NORM=true
// @template T=float32 S=float16 D=128 I=64 K=3 E=5 BITS=4 GS=32 NW=4 RPW=4 TOPK=false NORM=false PRE_NORM=false
// @grid (ceil(I/RPB)*32*NW, K+1, N)   RPB = NW*(32/LPR)*RPW, LPR = min(32, D*BITS/128)
// @threadgroup (32*NW, 1, 1)
// Slot j < K is routed expert inds[n,j], slot K the shared expert. Each group of LPR
// lanes computes RPW rows of gate and up (16-byte weight loads, scale*dot(q,x) +
// bias*sum(x) per group, fp32), rounds both to T and writes silu(gate)*up.
// With TOPK the routing is done here instead of read from inds: warp 0 of every
// routed-slot block routes the row from the router's logits (E experts + the shared-expert gate, from a
// multi-block GEMV) exactly as lily_moe_router_topk does (lily_route_topk); block
// (0, 0) writes inds_o, scores_o and the sigmoid shared gate shared_o for the down
// kernel. With PRE_NORM the row is rms_norm(hin + res) * nw, computed by every block
// (rounded as add_rms_norm; x, and with TOPK inds, unread). Every weight load is issued
// before the prologue (LilyRowTile).
// @header qgemv_common.cuh
// @header qgemv_norm.cuh
// @header qgemv_route.cuh
// ---- body ----
  constexpr int VPL = 128 / BITS;
  constexpr int KW = D / VPL;
  constexpr int LPR = KW < 32 ? KW : 32;
  constexpr int SG = 32 / LPR;
  constexpr int STEPS = KW / LPR;
  constexpr int NG = D / GS;
  constexpr int RPB = NW * SG * RPW;
  static_assert(KW * VPL == D && STEPS * LPR == KW && SG * LPR == 32, "gate_up: bad D");
  static_assert(GS % VPL == 0, "gate_up: bad GS");

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int sub = lane / LPR;
  const int sl = lane % LPR;
  const int slot = blockIdx.y;
  const int n = blockIdx.z;
  const int row0 = blockIdx.x * RPB + (warp * SG + sub) * RPW;
  if (blockIdx.x * RPB >= I) return;

  __shared__ T xs_row[PRE_NORM ? D : 1];  // first: 16-byte aligned in practice
  __shared__ unsigned s_inds[TOPK ? K : 1];
  __shared__ float nred[NW];
  // order: routing (routed slots only), every weight load, then the add+norm prologue
  // under the loads' latency, then the math
  if (TOPK && slot < K) {
    if (warp == 0) {
      const T* lg = logits + (size_t)n * (E + 1);
      unsigned my_i = 0u;
      float my_sc = 0.f;
      lily_route_topk<T, E, K, NORM>(lg, lane, my_i, my_sc);
      if (lane < K) s_inds[lane] = my_i;
      if (blockIdx.x == 0 && slot == 0) {
        if (lane < K) {
          inds_o[(size_t)n * K + lane] = my_i;
          scores_o[(size_t)n * K + lane] = static_cast<T>(my_sc);
        }
        if (lane == 0) shared_o[n] = static_cast<T>(1.f / (1.f + expf(-lily_f(lg[E]))));
      }
    }
    __syncthreads();
  }

  const uint4* gw4;
  const uint4* uw4;
  const S* gsp;
  const S* gbp;
  const S* usp;
  const S* ubp;
  if (slot < K) {
    const unsigned pick = TOPK ? s_inds[slot] : inds[(size_t)n * K + slot];
    const size_t e = min(pick, (unsigned)(E - 1));
    gw4 = reinterpret_cast<const uint4*>(gate_w) + e * I * KW;
    uw4 = reinterpret_cast<const uint4*>(up_w) + e * I * KW;
    gsp = gate_s + e * I * NG;
    gbp = gate_b + e * I * NG;
    usp = up_s + e * I * NG;
    ubp = up_b + e * I * NG;
  } else {
    gw4 = reinterpret_cast<const uint4*>(sgate_w);
    uw4 = reinterpret_cast<const uint4*>(sup_w);
    gsp = sgate_s;
    gbp = sgate_b;
    usp = sup_s;
    ubp = sup_b;
  }
  LilyRowTile<S, D, BITS, GS, RPW, LPR> tg;
  LilyRowTile<S, D, BITS, GS, RPW, LPR> tu;
  tg.load(gw4, gsp, gbp, row0, I - 1, sl);
  tu.load(uw4, usp, ubp, row0, I - 1, sl);
  if constexpr (PRE_NORM) {
    const size_t ro = (size_t)n * D;
    lily_add_rms_norm_row<T, D, NW>(hin + ro, res + ro, nw, eps[0], xs_row, nred,
                                    (T*)nullptr, (T*)nullptr, threadIdx.x, lane, warp);
  }
  const T* xr = PRE_NORM ? xs_row : x + (size_t)n * D;

  lily_swiglu_rows<T>(tg, tu, xr, sl, h + ((size_t)n * (K + 1) + slot) * I, row0, I);
