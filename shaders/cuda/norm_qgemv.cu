// @kernel lily_norm_qgemv
// @inputs hin[N,K]:T res[N,K]:T nw[K]:T eps[1]:float32 w[O,K*BITS/32]:uint32 scales[O,K/GS]:S biases[O,K/GS]:S
// @outputs y[N,O]:T h[N,K]:T
// @template T=bfloat16 S=bfloat16 K=2048 O=12352 BITS=4 GS=64 NW=4 RPW=4
// @template T=float16 S=float16 K=256 O=7 BITS=4 GS=64 NW=4 RPW=4
// @grid (ceil(O/RPB)*32*NW, N, 1)   RPB = NW*(32/LPR)*RPW, LPR = min(32, K*BITS/128)
// @threadgroup (32*NW, 1, 1)
// The residual add and RMSNorm in front of a quantized GEMV, one launch:
// h = T(hin + res) (written by the first block of each row), x = T(nw * T(h * rsqrt(mean(h^2)
// + eps))) kept in shared memory (as lily_add_rms_norm rounds), then y = x @ dequant(w)^T
// exactly as lily_qgemv (LPR lanes per weight row, RPW rows each, fp32 accumulation).
// @header qgemv_common.cuh
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

  __shared__ T xs[K];  // first shared array: 16-byte aligned in practice (lily_load_x checks)
  __shared__ float red[NW];
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int sub = lane / LPR;
  const int sl = lane % LPR;
  const int n = blockIdx.y;
  const int row0 = blockIdx.x * RPB + (warp * SG + sub) * RPW;
  if (blockIdx.x * RPB >= O) return;
  const size_t ro = (size_t)n * K;
  const bool writer = blockIdx.x == 0;

  float ss = 0.f;
  for (int k = tid; k < K; k += TPB) {
    const T hh = static_cast<T>(lily_f(hin[ro + k]) + lily_f(res[ro + k]));
    if (writer) h[ro + k] = hh;
    const float hv = lily_f(hh);
    xs[k] = hh;
    ss += hv * hv;
  }
  ss = lily_group_sum<32>(ss);
  if (lane == 0) red[warp] = ss;
  __syncthreads();
  float tot = 0.f;
#pragma unroll
  for (int i = 0; i < NW; ++i) tot += red[i];
  const float rinv = rsqrtf(tot / float(K) + eps[0]);
  for (int k = tid; k < K; k += TPB) {
    const float nv = lily_round<T>(lily_f(xs[k]) * rinv);
    xs[k] = static_cast<T>(lily_f(nw[k]) * nv);
  }
  __syncthreads();

  const uint4* w4 = reinterpret_cast<const uint4*>(w);
  float acc[RPW];
#pragma unroll
  for (int r = 0; r < RPW; ++r) acc[r] = 0.f;
#pragma unroll
  for (int st = 0; st < STEPS; ++st) {
    const int c = st * LPR + sl;
    float xv[VPL];
    const float xsum = lily_load_x<VPL>(xs + c * VPL, xv);
    const int g = (c * VPL) / GS;
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      const int row = min(row0 + r, O - 1);
      const size_t so = (size_t)row * NG + g;
      const uint4 q = w4[(size_t)row * KW + c];
      acc[r] += lily_f(scales[so]) * lily_qdot<BITS>(q, xv) + lily_f(biases[so]) * xsum;
    }
  }
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    const float v = lily_group_sum<LPR>(acc[r]);
    const int row = row0 + r;
    if (sl == 0 && row < O) y[(size_t)n * O + row] = static_cast<T>(v);
  }
