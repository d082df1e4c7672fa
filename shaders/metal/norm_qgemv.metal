// @kernel lily_norm_qgemv
// @inputs hin[N,K]:T res[N,K]:T nw[K]:T eps[1]:float32 w[O,K*BITS/32]:uint32 scales[O,K/GS]:S biases[O,K/GS]:S
// @outputs y[N,O]:T h[N,K]:T
// @template T=bfloat16 S=bfloat16 K=2048 O=12352 BITS=4 GS=64 NW=4 RPW=4 BPL=16
// @template T=float16 S=float16 K=256 O=7 BITS=4 GS=64 NW=4 RPW=4 BPL=16
// @template T=bfloat16 S=bfloat16 K=2048 O=1000 BITS=4 GS=64 NW=8 RPW=4 BPL=8
// @grid (ceil(O/RPB)*32*NW, N, 1)   RPB = NW*(32/LPR)*RPW, LPR = min(32, K*BITS/(8*BPL))
// @threadgroup (32*NW, 1, 1)
// The residual add and RMSNorm in front of a quantized GEMV, one launch:
// h = T(hin + res) (written by the first threadgroup of each row), x = T(nw * T(h *
// rsqrt(mean(h^2) + eps))) kept in threadgroup memory (as lily_add_rms_norm rounds), then
// y = x @ dequant(w)^T exactly as lily_qgemv (BPL-byte weight loads).
// Cost, q|k|v 2048 -> 9216, 4-bit g64, one row, NW 4 RPW 4: 576 threadgroups x 128
// threads; reads 9.44 MB weights + 1.18 MB scales/biases once and hin/res/nw (12 KB) in
// every threadgroup (7.1 MB from cache); writes 18 KB + h 4 KB; 4 KB + 16 B threadgroup
// memory (K*sizeof(T) + 4*NW).
// @header qgemv_common.h
// @header qgemv_norm.h
// ---- body ----
  static_assert(BPL == 16 || BPL == 8, "norm_qgemv: BPL is 16 or 8");
  constexpr int VPL = 8 * BPL / BITS;
  constexpr int KW = K / VPL;
  constexpr int LPR = KW < 32 ? KW : 32;
  constexpr int SG = 32 / LPR;
  constexpr int STEPS = KW / LPR;
  constexpr int RPB = NW * SG * RPW;
  static_assert(KW * VPL == K && STEPS * LPR == KW && SG * LPR == 32, "norm_qgemv: bad K");
  static_assert(GS % VPL == 0, "norm_qgemv: bad GS");

  threadgroup T xs[K];
  threadgroup float red[NW];
  const int tid = int(thread_position_in_threadgroup.x);
  const int lane = int(thread_index_in_simdgroup);
  const int warp = int(simdgroup_index_in_threadgroup);
  const int sub = lane / LPR;
  const int sl = lane % LPR;
  const int bx = int(threadgroup_position_in_grid.x);
  const int n = int(threadgroup_position_in_grid.y);
  const int row0 = bx * RPB + (warp * SG + sub) * RPW;
  if (bx * RPB >= O) {
    return;
  }
  const ulong ro = ulong(n) * K;
  lily_add_rms_norm_row<T, K, NW>(hin + ro, res + ro, nw, eps[0], xs, red,
                                  bx == 0 ? h + ro : (device T*)nullptr, (device T*)nullptr,
                                  tid, lane, warp);
  lily_qgemv_rows<T, S, K, O, BITS, GS, RPW, LPR, BPL>(xs, w,
                                                  scales, biases, y + ulong(n) * O, row0, sl);
