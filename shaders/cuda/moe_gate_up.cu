// @kernel lily_moe_gate_up
// @inputs x[N,D]:T inds[N,K]:uint32 gate_w[E,I,D*BITS/32]:uint32 gate_s[E,I,D/GS]:S gate_b[E,I,D/GS]:S up_w[E,I,D*BITS/32]:uint32 up_s[E,I,D/GS]:S up_b[E,I,D/GS]:S sgate_w[I,D*BITS/32]:uint32 sgate_s[I,D/GS]:S sgate_b[I,D/GS]:S sup_w[I,D*BITS/32]:uint32 sup_s[I,D/GS]:S sup_b[I,D/GS]:S
// @outputs h[N,K+1,I]:T
// @template T=bfloat16 S=bfloat16 D=2048 I=512 K=8 E=256 BITS=4 GS=64 NW=4 RPW=4
// @template T=float32 S=float16 D=128 I=64 K=3 E=5 BITS=4 GS=32 NW=4 RPW=4
// @grid (ceil(I/RPB)*32*NW, K+1, N)   RPB = NW*(32/LPR)*RPW, LPR = min(32, D*BITS/128)
// @threadgroup (32*NW, 1, 1)
// Slot j < K is routed expert inds[n,j], slot K the shared expert. Each group of LPR
// lanes computes RPW rows of gate and up (16-byte weight loads, scale*dot(q,x) +
// bias*sum(x) per group, fp32), rounds both to T and writes silu(gate)*up.
// @header qgemv_common.cuh
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

  const uint4* gw4;
  const uint4* uw4;
  const S* gsp;
  const S* gbp;
  const S* usp;
  const S* ubp;
  if (slot < K) {
    const size_t e = min(inds[(size_t)n * K + slot], (unsigned)(E - 1));
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
  const T* xr = x + (size_t)n * D;

  float ag[RPW];
  float au[RPW];
#pragma unroll
  for (int r = 0; r < RPW; ++r) { ag[r] = 0.f; au[r] = 0.f; }
#pragma unroll
  for (int st = 0; st < STEPS; ++st) {
    const int c = st * LPR + sl;
    float xv[VPL];
    const float xs = lily_load_x<VPL>(xr + c * VPL, xv);
    const int g = (c * VPL) / GS;
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      const int row = min(row0 + r, I - 1);
      const size_t wo = (size_t)row * KW + c;
      const size_t so = (size_t)row * NG + g;
      const uint4 qg = gw4[wo];
      const uint4 qu = uw4[wo];
      ag[r] += lily_f(gsp[so]) * lily_qdot<BITS>(qg, xv) + lily_f(gbp[so]) * xs;
      au[r] += lily_f(usp[so]) * lily_qdot<BITS>(qu, xv) + lily_f(ubp[so]) * xs;
    }
  }
  T* hr = h + ((size_t)n * (K + 1) + slot) * I;
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    const float gv = lily_round<T>(lily_group_sum<LPR>(ag[r]));
    const float uv = lily_round<T>(lily_group_sum<LPR>(au[r]));
    const int row = row0 + r;
    if (sl == 0 && row < I) hr[row] = static_cast<T>(gv / (1.f + expf(-gv)) * uv);
  }
