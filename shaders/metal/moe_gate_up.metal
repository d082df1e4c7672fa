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
// With TOPK the routing is done here instead of read from inds: warp 0 of every block
// routes the row from the router's logits (E experts + the shared-expert gate, from a
// multi-block GEMV) exactly as lily_moe_router_topk does (lily_route_topk); block
// (0, 0) writes inds_o, scores_o and the sigmoid shared gate shared_o for the down
// kernel. With PRE_NORM the row is rms_norm(hin + res) * nw, computed by every block
// (rounded as add_rms_norm; x, and with TOPK inds, unread).
// @header qgemv_common.h
// @header qgemv_norm.h
// @header qgemv_route.h

// gate and up of rows row0 .. row0+RPW-1 of one expert for the row xr (device or
// threadgroup memory): fp32 accumulators, one per row.
template <typename S, int D, int I, int BITS, int GS, int RPW, int LPR, typename XP>
inline void lily_gate_up_acc(XP xr, const device uint4* gw4, const device uint4* uw4,
                             const device S* gsp, const device S* gbp,
                             const device S* usp, const device S* ubp, int row0, int sl,
                             thread float* ag, thread float* au) {
  constexpr int VPL = 128 / BITS;
  constexpr int KW = D / VPL;
  constexpr int STEPS = KW / LPR;
  constexpr int NG = D / GS;
  for (int r = 0; r < RPW; ++r) {
    ag[r] = 0.0f;
    au[r] = 0.0f;
  }
  for (int st = 0; st < STEPS; ++st) {
    const int c = st * LPR + sl;
    float xv[VPL];
    const float xs = lily_load_x<VPL>(xr + c * VPL, xv);
    const int g = (c * VPL) / GS;
    for (int r = 0; r < RPW; ++r) {
      const int row = min(row0 + r, I - 1);
      const int wo = row * KW + c;
      const int so = row * NG + g;
      const uint4 qg = gw4[wo];
      const uint4 qu = uw4[wo];
      ag[r] += static_cast<float>(gsp[so]) * lily_qdot<BITS>(qg, xv) +
               static_cast<float>(gbp[so]) * xs;
      au[r] += static_cast<float>(usp[so]) * lily_qdot<BITS>(qu, xv) +
               static_cast<float>(ubp[so]) * xs;
    }
  }
}
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

  const int lane = int(thread_index_in_simdgroup);
  const int warp = int(simdgroup_index_in_threadgroup);
  const int sub = lane / LPR;
  const int sl = lane % LPR;
  const int bx = int(threadgroup_position_in_grid.x);
  const int slot = int(threadgroup_position_in_grid.y);
  const int n = int(threadgroup_position_in_grid.z);
  const int row0 = bx * RPB + (warp * SG + sub) * RPW;
  if (bx * RPB >= I) {
    return;
  }

  threadgroup uint s_inds[TOPK ? K : 1];
  threadgroup T xs_row[PRE_NORM ? D : 1];
  threadgroup float nred[NW];
  const int tid = int(thread_position_in_threadgroup.x);
  if (PRE_NORM) {
    const int ro = n * D;
    lily_add_rms_norm_row<T, D, NW>(hin + ro, res + ro, nw, eps[0], xs_row, nred,
                                    (device T*)nullptr, (device T*)nullptr, tid, lane,
                                    warp);
  }
  if (TOPK) {
    if (warp == 0) {
      const device T* lg = logits + n * (E + 1);
      uint my_i = 0u;
      float my_sc = 0.0f;
      lily_route_topk<T, E, K, NORM>(lg, lane, my_i, my_sc);
      if (lane < K) {
        s_inds[lane] = my_i;
      }
      if (bx == 0 && slot == 0) {
        if (lane < K) {
          inds_o[n * K + lane] = my_i;
          scores_o[n * K + lane] = static_cast<T>(my_sc);
        }
        if (lane == 0) {
          shared_o[n] =
              static_cast<T>(1.0f / (1.0f + metal::exp(-static_cast<float>(lg[E]))));
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  const device uint4* gw4;
  const device uint4* uw4;
  const device S* gsp;
  const device S* gbp;
  const device S* usp;
  const device S* ubp;
  if (slot < K) {
    const uint pick = TOPK ? s_inds[slot] : uint(inds[n * K + slot]);
    const ulong e = min(pick, uint(E - 1));
    gw4 = reinterpret_cast<const device uint4*>(gate_w) + e * (I * KW);
    uw4 = reinterpret_cast<const device uint4*>(up_w) + e * (I * KW);
    gsp = gate_s + e * (I * NG);
    gbp = gate_b + e * (I * NG);
    usp = up_s + e * (I * NG);
    ubp = up_b + e * (I * NG);
  } else {
    gw4 = reinterpret_cast<const device uint4*>(sgate_w);
    uw4 = reinterpret_cast<const device uint4*>(sup_w);
    gsp = sgate_s;
    gbp = sgate_b;
    usp = sup_s;
    ubp = sup_b;
  }

  float ag[RPW];
  float au[RPW];
  if (PRE_NORM) {
    lily_gate_up_acc<S, D, I, BITS, GS, RPW, LPR>(xs_row, gw4, uw4, gsp, gbp, usp, ubp,
                                                   row0, sl, ag, au);
  } else {
    lily_gate_up_acc<S, D, I, BITS, GS, RPW, LPR>(x + n * D, gw4, uw4, gsp, gbp, usp, ubp,
                                                   row0, sl, ag, au);
  }
  const ulong ho = (ulong(n) * (K + 1) + slot) * I;
  for (int r = 0; r < RPW; ++r) {
    const float gv = lily_round<T>(lily_group_sum<LPR>(ag[r]));
    const float uv = lily_round<T>(lily_group_sum<LPR>(au[r]));
    const int row = row0 + r;
    if (sl == 0 && row < I) {
      h[ho + row] = static_cast<T>(gv / (1.0f + metal::exp(-gv)) * uv);
    }
  }
