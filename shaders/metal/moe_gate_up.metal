// @kernel lily_moe_gate_up
// @inputs x[N,D]:T inds[N,K]:uint32 gate_w[E,I,D*BITS/32]:uint32 gate_s[E,I,D/GS]:S gate_b[E,I,D/GS]:S up_w[E,I,D*BITS/32]:uint32 up_s[E,I,D/GS]:S up_b[E,I,D/GS]:S sgate_w[I,D*BITS/32]:uint32 sgate_s[I,D/GS]:S sgate_b[I,D/GS]:S sup_w[I,D*BITS/32]:uint32 sup_s[I,D/GS]:S sup_b[I,D/GS]:S
// @outputs h[N,K+1,I]:T
// @template T=bfloat16 S=bfloat16 D=2048 I=512 K=8 E=256 BITS=4 GS=64 NW=4 RPW=4
// @template T=float32 S=float16 D=128 I=64 K=3 E=5 BITS=4 GS=32 NW=4 RPW=4
// @grid (ceil(I/RPB)*32*NW, K+1, N)   RPB = NW*(32/LPR)*RPW, LPR = min(32, D*BITS/128)
// @threadgroup (32*NW, 1, 1)
// Slot j < K is routed expert inds[n,j], slot K the shared expert. Each group of LPR
// lanes computes RPW rows of gate and up (16-byte weight loads, scale*dot(q,x) +
// @header qgemv_common.h
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

  const device uint4* gw4;
  const device uint4* uw4;
  const device S* gsp;
  const device S* gbp;
  const device S* usp;
  const device S* ubp;
  if (slot < K) {
    const ulong e = min(uint(inds[n * K + slot]), uint(E - 1));
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
  const int xo = n * D;

  float ag[RPW];
  float au[RPW];
  for (int r = 0; r < RPW; ++r) {
    ag[r] = 0.0f;
    au[r] = 0.0f;
  }
  for (int st = 0; st < STEPS; ++st) {
    const int c = st * LPR + sl;
    float xv[VPL];
    const float xs = lily_load_x<VPL>(x + (xo + c * VPL), xv);
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
  const ulong ho = (ulong(n) * (K + 1) + slot) * I;
  for (int r = 0; r < RPW; ++r) {
    const float gv = lily_round<T>(lily_group_sum<LPR>(ag[r]));
    const float uv = lily_round<T>(lily_group_sum<LPR>(au[r]));
    const int row = row0 + r;
    if (sl == 0 && row < I) {
      h[ho + row] = static_cast<T>(gv / (1.0f + metal::exp(-gv)) * uv);
    }
  }
