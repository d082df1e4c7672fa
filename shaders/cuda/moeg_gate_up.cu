// @kernel moeg_gate_up
// @inputs x[N,DM] T, sorted_pairs[P] int32, tiles[Tm,3] int32, w_gate[NE,DI,DM/8] uint32, s_gate[NE,DI,DM/64] T, b_gate[NE,DI,DM/64] T, w_up[NE,DI,DM/8] uint32, s_up[NE,DI,DM/64] T, b_up[NE,DI,DM/64] T
// @outputs h[P,DI] T
// @template T=bfloat16 DM=2048 DI=512 TOPK=8 BM=32
// @grid (128*Tm, DI/64, 1)
// @threadgroup (128, 1, 1)
// Grouped GEMM, gate and up projections with the SwiGLU epilogue. Block (tile, j): rows
// tiles[tile] of the expert-sorted pairs (token rows of x gathered), output columns
// [64j, 64j+64) of gate and up. Each k step of 64 (one quant group) dequantizes 64 gate
// rows + 64 up rows (one per thread) into shared memory as bf16; mma.sync m16n8k16 bf16
// with fp32 accumulators; h = silu(gate) * up in fp32, stored bf16 in sorted-pair order.
// Shared tiles hold k in the order (0,4,1,5,2,6,3,7) within each 8 (the nibble-pair
// order of the dequantizer); x rows are permuted the same way.
// @header moeg_common.cuh
// ---- body ----
  constexpr int LD = MOEG_LD;
  constexpr int KC = DM / 64;
  constexpr int WPR = DM / 8;
  constexpr int GPR = DM / 64;
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
  const int n0 = blockIdx.y * 64;

  const bool is_up = tid >= 64;
  const size_t rowid = (size_t)ex * DI + n0 + (tid & 63);
  const uint4* wp = reinterpret_cast<const uint4*>((is_up ? w_up : w_gate) + rowid * WPR);
  const T* sp = (is_up ? s_up : s_gate) + rowid * GPR;
  const T* bp = (is_up ? b_up : b_gate) + rowid * GPR;

  const int xseg = tid & 7;
  const uint4* xp[XR];
#pragma unroll
  for (int i = 0; i < XR; ++i) {
    const int row = (tid >> 3) + 16 * i;
    xp[i] = nullptr;
    if (row < cnt) {
      const int tok = sorted_pairs[r0 + row] / TOPK;
      xp[i] = reinterpret_cast<const uint4*>(x + (size_t)tok * DM) + xseg;
    }
  }

  const uint4 zero4 = make_uint4(0u, 0u, 0u, 0u);
  uint4 rw0 = wp[0], rw1 = wp[1];
  T rs = sp[0], rb = bp[0];
  uint4 rx[XR];
#pragma unroll
  for (int i = 0; i < XR; ++i) rx[i] = xp[i] ? xp[i][0] : zero4;

  float accg[MT][2][4], accu[MT][2][4];
#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        accg[mi][nt][q] = 0.f;
        accu[mi][nt][q] = 0.f;
      }

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
    const int brow = warp * 16 + (lane & 7) + ((lane >> 4) << 3);
    const int bsub = ((lane >> 3) & 1) * 8;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      unsigned int a[MT][4];
#pragma unroll
      for (int mi = 0; mi < MT; ++mi)
        moeg_ldsm_x4(a[mi], A + (mi * 16 + (lane & 15)) * LD + kk * 16 + (lane >> 4) * 8);
      unsigned int bgf[4], buf[4];
      moeg_ldsm_x4(bgf, B + brow * LD + kk * 16 + bsub);
      moeg_ldsm_x4(buf, B + (64 + brow) * LD + kk * 16 + bsub);
#pragma unroll
      for (int mi = 0; mi < MT; ++mi)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          moeg_mma(accg[mi][nt], a[mi], bgf[2 * nt], bgf[2 * nt + 1]);
          moeg_mma(accu[mi][nt], a[mi], buf[2 * nt], buf[2 * nt + 1]);
        }
    }
  }

#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const int col = n0 + warp * 16 + nt * 8 + (lane & 3) * 2;
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int r = mi * 16 + (lane >> 2) + hh * 8;
        if (r < cnt) {
          const float g0 = accg[mi][nt][2 * hh], g1 = accg[mi][nt][2 * hh + 1];
          const float u0 = accu[mi][nt][2 * hh], u1 = accu[mi][nt][2 * hh + 1];
          const float h0 = g0 / (1.f + expf(-g0)) * u0;
          const float h1 = g1 / (1.f + expf(-g1)) * u1;
          *reinterpret_cast<__nv_bfloat162*>(h + (size_t)(r0 + r) * DI + col) =
              __floats2bfloat162_rn(h0, h1);
        }
      }
    }
