// @kernel lily_qgemv
// @inputs x[N,K]:T w[O,K*BITS/32]:uint32 scales[O,K/GS]:S biases[O,K/GS]:S
// @outputs y[N,O]:T
// @template T=bfloat16 S=bfloat16 K=2048 O=8192 BITS=4 GS=64 NW=4 RPW=4
// @template T=float16 S=float16 K=64 O=7 BITS=4 GS=64 NW=4 RPW=4
// @grid (ceil(O/RPB)*32*NW, N, 1)   RPB = NW*(32/LPR)*RPW, LPR = min(32, K*BITS/128)
// @threadgroup (32*NW, 1, 1)
// y = x @ dequant(w)^T for a few rows (MLX affine quantization, transpose=True):
// each group of LPR lanes owns RPW output rows, 16-byte weight loads,
// scale*dot(q,x) + bias*sum(x) per quantization group, fp32 accumulation.
// @header qgemv_common.cuh
// ---- body ----
  constexpr int VPL = 128 / BITS;
  constexpr int KW = K / VPL;
  constexpr int LPR = KW < 32 ? KW : 32;
  constexpr int SG = 32 / LPR;
  constexpr int STEPS = KW / LPR;
  constexpr int RPB = NW * SG * RPW;
  static_assert(KW * VPL == K && STEPS * LPR == KW && SG * LPR == 32, "qgemv: bad K");
  static_assert(GS % VPL == 0, "qgemv: bad GS");

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int sub = lane / LPR;
  const int sl = lane % LPR;
  const int n = blockIdx.y;
  const int row0 = blockIdx.x * RPB + (warp * SG + sub) * RPW;
  if (blockIdx.x * RPB >= O) return;
  lily_qgemv_rows<T, S, K, O, BITS, GS, RPW, LPR>(x + (size_t)n * K, w, scales, biases,
                                                  y + (size_t)n * O, row0, sl);
