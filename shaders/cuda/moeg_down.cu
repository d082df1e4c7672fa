// @kernel moeg_down
// @inputs h[P,DI] T, tiles[Tm,3] int32, w_down[NE,DM,DI/8] uint32, s_down[NE,DM,DI/64] T, b_down[NE,DM,DI/64] T
// @outputs y[P,DM] T
// @template T=bfloat16 DM=2048 DI=512 BM=32
// @grid (128*Tm, DM/128, 1)
// @threadgroup (128, 1, 1)
// @shared_memory 52224
// Grouped GEMM, down projection. Block (tile, j): rows tiles[tile] of h (already in
// expert-sorted order), output columns [128j, 128j+128) of expert tiles[tile].expert.
// Each stage of MOEG_KS k (two quant groups; the last stage may hold one when DI is an
// odd multiple of 64) loads the 128 weight rows' packed words with 64 contiguous bytes
// per row and warp load (the next stage's words held in registers while this one
// multiplies), dequantizes them into shared memory as bf16; mma.sync m16n8k16 bf16, fp32
// accumulators; y stored bf16 in sorted-pair order (the combine kernel reorders and
// weights it). Shared tiles hold k in the order (0,4,1,5,2,6,3,7) within each 8; h rows
// are permuted the same way.
// @header moeg_common.cuh
// ---- body ----
  constexpr int LD = MOEG_LD;
  constexpr int KS = MOEG_KS;
  constexpr int NS = (DI + KS - 1) / KS;
  constexpr bool TAIL = DI % KS != 0;
  constexpr int WPR = DI / 8;
  constexpr int GPR = DI / 64;
  constexpr int MT = BM / 16;
  constexpr int XR = BM / 8;
  static_assert(DI % 64 == 0, "moeg_down: DI must be a multiple of 64");
  __nv_bfloat16* sA;
  __nv_bfloat16* sB;
  moeg_shared_tiles<BM>(sA, sB);

  const int tile = blockIdx.x;
  const int ex = tiles[3 * tile];
  const int r0 = tiles[3 * tile + 1];
  const int cnt = tiles[3 * tile + 2];
  if (cnt <= 0) return;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int n0 = blockIdx.y * 128;
  const int wc = lane >> 3;

  const uint4* wp[4];
  const T* sp[4];
  const T* bp[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const size_t row = (size_t)ex * DM + n0 + moeg_wrow(i, warp, lane);
    wp[i] = reinterpret_cast<const uint4*>(w_down + row * WPR) + wc;
    sp[i] = s_down + row * GPR + (wc >> 1);
    bp[i] = b_down + row * GPR + (wc >> 1);
  }
  const int xseg = tid & 15;
  const uint4* xp[XR];
#pragma unroll
  for (int i = 0; i < XR; ++i) {
    const int row = (tid >> 4) + 8 * i;
    xp[i] = row < cnt ? reinterpret_cast<const uint4*>(h + (size_t)(r0 + row) * DI) + xseg
                      : nullptr;
  }

  const uint4 zero4 = make_uint4(0u, 0u, 0u, 0u);
  const T zero = T(0.f);
  uint4 rq[4], rx[XR];
  T rs[4], rb[4];
  // stage 0 (a stage's chunks past DI, in a last half stage, load zeros)
  {
    const bool wok = !TAIL || NS > 1 || wc * 32 < DI;
    const bool xok = !TAIL || NS > 1 || xseg * 8 < DI;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      rq[i] = wok ? wp[i][0] : zero4;
      rs[i] = wok ? sp[i][0] : zero;
      rb[i] = wok ? bp[i][0] : zero;
    }
#pragma unroll
    for (int i = 0; i < XR; ++i) rx[i] = (xp[i] && xok) ? xp[i][0] : zero4;
  }

  float acc[MT][4][4];
#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[mi][nt][q] = 0.f;

  const int brow = warp * 32 + (lane & 7) + ((lane >> 4) << 3);
  const int bsub = ((lane >> 3) & 1) * 8;
  for (int s = 0; s < NS; ++s) {
    moeg_stage_to_shared<XR>(sA, sB, rq, rs, rb, rx, tid);
    __syncthreads();
    if (s + 1 < NS) {
      const int k1 = (s + 1) * KS;
      const bool wok = !TAIL || k1 + wc * 32 < DI;
      const bool xok = !TAIL || k1 + xseg * 8 < DI;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        rq[i] = wok ? wp[i][(s + 1) * (KS / 32)] : zero4;
        rs[i] = wok ? sp[i][(s + 1) * (KS / 64)] : zero;
        rb[i] = wok ? bp[i][(s + 1) * (KS / 64)] : zero;
      }
#pragma unroll
      for (int i = 0; i < XR; ++i) rx[i] = (xp[i] && xok) ? xp[i][(s + 1) * (KS / 8)] : zero4;
    }
#pragma unroll
    for (int kk = 0; kk < KS / 16; ++kk) {
      if (TAIL && s * KS + kk * 16 >= DI) break;
      unsigned int a[MT][4];
#pragma unroll
      for (int mi = 0; mi < MT; ++mi)
        moeg_ldsm_x4(a[mi], sA + (mi * 16 + (lane & 15)) * LD + kk * 16 + (lane >> 4) * 8);
      unsigned int b0[4], b1[4];
      moeg_ldsm_x4(b0, sB + brow * LD + kk * 16 + bsub);
      moeg_ldsm_x4(b1, sB + (16 + brow) * LD + kk * 16 + bsub);
#pragma unroll
      for (int mi = 0; mi < MT; ++mi) {
        moeg_mma(acc[mi][0], a[mi], b0[0], b0[1]);
        moeg_mma(acc[mi][1], a[mi], b0[2], b0[3]);
        moeg_mma(acc[mi][2], a[mi], b1[0], b1[1]);
        moeg_mma(acc[mi][3], a[mi], b1[2], b1[3]);
      }
    }
    __syncthreads();
  }

#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const int col = n0 + warp * 32 + nt * 8 + (lane & 3) * 2;
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int r = mi * 16 + (lane >> 2) + hh * 8;
        if (r < cnt) {
          *reinterpret_cast<__nv_bfloat162*>(y + (size_t)(r0 + r) * DM + col) =
              __floats2bfloat162_rn(acc[mi][nt][2 * hh], acc[mi][nt][2 * hh + 1]);
        }
      }
    }
