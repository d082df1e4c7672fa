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
// exactly as lily_qgemv (LPR lanes per weight row, RPW rows each, fp32 accumulation;
// the weight loads are issued before the prologue).
// @header qgemv_common.cuh
// @header qgemv_norm.cuh
// ---- body ----
  constexpr int VPL = 128 / BITS;
  constexpr int KW = K / VPL;
  constexpr int LPR = KW < 32 ? KW : 32;
  constexpr int SG = 32 / LPR;
  constexpr int STEPS = KW / LPR;
  constexpr int RPB = NW * SG * RPW;
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
  // the weights do not depend on the norm: their loads go out first and the prologue's
  // latency hides under them
  LilyRowTile<S, K, BITS, GS, RPW, LPR> tile;
  tile.load(reinterpret_cast<const uint4*>(w), scales, biases, row0, O - 1, sl);
  const size_t ro = (size_t)n * K;
  lily_add_rms_norm_row<T, K, NW>(hin + ro, res + ro, nw, eps[0], xs, red,
                                  blockIdx.x == 0 ? h + ro : nullptr, nullptr, tid, lane,
                                  warp);
  T* yr = y + (size_t)n * O;
  tile.dot_each(xs, sl, [&](int r, float v) {
    if (sl == 0 && row0 + r < O) yr[row0 + r] = static_cast<T>(v);
  });
