// @kernel moeg_down
// @inputs h[P,DI] T, tiles[Tm,3] int32, w_down[NE,DM,DI/8] uint32, s_down[NE,DM,DI/64] T, b_down[NE,DM,DI/64] T
// @outputs y[P,DM] T
// @template T=bfloat16 DM=2048 DI=512 BM=32
// @grid (128*Tm, DM/128, 1)
// @threadgroup (128, 1, 1)
// Grouped GEMM, down projection. Block (tile, j): rows tiles[tile] of h (already in
// expert-sorted order), output columns [128j, 128j+128) of expert tiles[tile].expert.
// Each k step of 64 (one quant group) dequantizes 128 weight rows (one per thread) into
// shared memory as bf16; mma.sync m16n8k16 bf16, fp32 accumulators; y stored bf16 in
// sorted-pair order (the combine kernel reorders and weights it). Shared tiles hold k
// in the order (0,4,1,5,2,6,3,7) within each 8; h rows are permuted the same way.
// @header moeg_common.cuh
// ---- body ----
  constexpr int LD = MOEG_LD;
  constexpr int KC = DI / 64;
  constexpr int WPR = DI / 8;
  constexpr int GPR = DI / 64;
  constexpr int MT = BM / 16;
  constexpr int XR = BM / 16;
  __shared__ __align__(16) __nv_bfloat16 sA[2][BM * LD];
  __shared__ __align__(16) __nv_bfloat16 sB[2][128 * LD];

  const int tile = blockIdx.x;
  const int ex = tiles[3 * tile];
  const int r0 = tiles[3 * tile + 1];
  const int cnt = tiles[3 * tile + 2];
  if (cnt <= 0) return;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int n0 = blockIdx.y * 128;

  const size_t rowid = (size_t)ex * DM + n0 + tid;
  const uint4* wp = reinterpret_cast<const uint4*>(w_down + rowid * WPR);
  const T* sp = s_down + rowid * GPR;
  const T* bp = b_down + rowid * GPR;

  const int xseg = tid & 7;
  const uint4* xp[XR];
#pragma unroll
  for (int i = 0; i < XR; ++i) {
    const int row = (tid >> 3) + 16 * i;
    xp[i] = row < cnt ? reinterpret_cast<const uint4*>(h + (size_t)(r0 + row) * DI) + xseg
                      : nullptr;
  }

  const uint4 zero4 = make_uint4(0u, 0u, 0u, 0u);
  uint4 rw0 = wp[0], rw1 = wp[1];
  T rs = sp[0], rb = bp[0];
  uint4 rx[XR];
#pragma unroll
  for (int i = 0; i < XR; ++i) rx[i] = xp[i] ? xp[i][0] : zero4;

  float acc[MT][4][4];
#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[mi][nt][q] = 0.f;

  for (int kc = 0; kc < KC; ++kc) {
    const int st = kc & 1;
    {
      const __nv_bfloat162 s2 = __bfloat162bfloat162(rs);
      const __nv_bfloat162 b2 = __bfloat162bfloat162(rb);
      uint4* dst = reinterpret_cast<uint4*>(&sB[st][tid * LD]);
      dst[0] = moeg_dq8(rw0.x, s2, b2);
      dst[1] = moeg_dq8(rw0.y, s2, b2);
      dst[2] = moeg_dq8(rw0.z, s2, b2);
      dst[3] = moeg_dq8(rw0.w, s2, b2);
      dst[4] = moeg_dq8(rw1.x, s2, b2);
      dst[5] = moeg_dq8(rw1.y, s2, b2);
      dst[6] = moeg_dq8(rw1.z, s2, b2);
      dst[7] = moeg_dq8(rw1.w, s2, b2);
#pragma unroll
      for (int i = 0; i < XR; ++i) {
        const int row = (tid >> 3) + 16 * i;
        reinterpret_cast<uint4*>(&sA[st][row * LD])[xseg] = moeg_perm8(rx[i]);
      }
    }
    __syncthreads();
    if (kc + 1 < KC) {
      rw0 = wp[(kc + 1) * 2];
      rw1 = wp[(kc + 1) * 2 + 1];
      rs = sp[kc + 1];
      rb = bp[kc + 1];
#pragma unroll
      for (int i = 0; i < XR; ++i) rx[i] = xp[i] ? xp[i][(kc + 1) * 8] : zero4;
    }
    const __nv_bfloat16* A = sA[st];
    const __nv_bfloat16* B = sB[st];
    const int brow = warp * 32 + (lane & 7) + ((lane >> 4) << 3);
    const int bsub = ((lane >> 3) & 1) * 8;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      unsigned int a[MT][4];
#pragma unroll
      for (int mi = 0; mi < MT; ++mi)
        moeg_ldsm_x4(a[mi], A + (mi * 16 + (lane & 15)) * LD + kk * 16 + (lane >> 4) * 8);
      unsigned int b0[4], b1[4];
      moeg_ldsm_x4(b0, B + brow * LD + kk * 16 + bsub);
      moeg_ldsm_x4(b1, B + (16 + brow) * LD + kk * 16 + bsub);
#pragma unroll
      for (int mi = 0; mi < MT; ++mi) {
        moeg_mma(acc[mi][0], a[mi], b0[0], b0[1]);
        moeg_mma(acc[mi][1], a[mi], b0[2], b0[3]);
        moeg_mma(acc[mi][2], a[mi], b1[0], b1[1]);
        moeg_mma(acc[mi][3], a[mi], b1[2], b1[3]);
      }
    }
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
