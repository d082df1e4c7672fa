// @kernel lily_qgemv
// @inputs x[N,K]:T w[O,K*BITS/32]:uint32 scales[O,K/GS]:S biases[O,K/GS]:S
// @outputs y[N,O]:T
// @template T=bfloat16 S=bfloat16 K=2048 O=8192 BITS=4 GS=64 NW=4 RPW=4 BPL=16
// @template T=float16 S=float16 K=64 O=7 BITS=4 GS=64 NW=4 RPW=4 BPL=16
// @template T=bfloat16 S=bfloat16 K=2048 O=1000 BITS=4 GS=64 NW=2 RPW=4 BPL=8
// @grid (ceil(O/RPB)*32*NW, N, 1)   RPB = NW*(32/LPR)*RPW, LPR = min(32, K*BITS/(8*BPL))
// @threadgroup (32*NW, 1, 1)
// y = x @ dequant(w)^T for a few rows (MLX affine quantization, transpose=True):
// each group of LPR lanes owns RPW output rows, BPL-byte weight loads (16: uint4; 8:
// uint2, MLX qmv_fast's pattern), scale*dot(q,x) + bias*sum(x) per quantization group,
// fp32 accumulation.
// Cost, o_proj 4096 -> 2048, 4-bit g64, one row: reads 4.19 MB weights + 0.52 MB
// scales/biases once, x 8 KB per threadgroup; writes 4 KB; NW 4 RPW 4: 128 threadgroups
// x 128 threads, no threadgroup memory (Metal: MLX_LILY_QGEMV_SHAPE / _BPL override).
// @header qgemv_common.h
// ---- body ----
  static_assert(BPL == 16 || BPL == 8, "qgemv: BPL is 16 or 8");
  constexpr int VPL = 8 * BPL / BITS;
  constexpr int KW = K / VPL;
  constexpr int LPR = KW < 32 ? KW : 32;
  constexpr int SG = 32 / LPR;
  constexpr int STEPS = KW / LPR;
  constexpr int RPB = NW * SG * RPW;
  static_assert(KW * VPL == K && STEPS * LPR == KW && SG * LPR == 32, "qgemv: bad K");
  static_assert(GS % VPL == 0, "qgemv: bad GS");

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
  lily_qgemv_rows<T, S, K, O, BITS, GS, RPW, LPR, BPL>(x + ulong(n) * K, w, scales, biases,
                                                  y + ulong(n) * O, row0, sl);
