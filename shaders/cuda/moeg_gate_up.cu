// @kernel moeg_gate_up
// @inputs x[N,DM] T, sorted_pairs[P] int32, tiles[Tm,3] int32, w_gate[NE,DI,DM/8] uint32, s_gate[NE,DI,DM/64] T, b_gate[NE,DI,DM/64] T, w_up[NE,DI,DM/8] uint32, s_up[NE,DI,DM/64] T, b_up[NE,DI,DM/64] T
// @outputs h[P,DI] T
// @template T=bfloat16 DM=2048 DI=512 TOPK=8 BM=32
// @grid (128*Tm, DI/64, 1)
// @threadgroup (128, 1, 1)
// @shared_memory 52224
// Grouped GEMM, gate and up projections with the SwiGLU epilogue. Block (tile, j): rows
// tiles[tile] of the expert-sorted pairs (token rows of x gathered), output columns
// [64j, 64j+64) of gate and up. Each stage of MOEG_KS k (two quant groups) loads the 128
// weight rows' packed words with 64 contiguous bytes per row and warp load (the next
// stage's words held in registers while this one multiplies), dequantizes them into
// shared memory as bf16; mma.sync m16n8k16 bf16 with fp32 accumulators; h = silu(gate)
// * up in fp32, stored bf16 in sorted-pair order. Shared tiles hold k in the order
// (0,4,1,5,2,6,3,7) within each 8 (the nibble-pair order of the dequantizer); x rows are
// permuted the same way.
// @header moeg_common.cuh
// ---- body ----
  constexpr int LD = MOEG_LD;
  constexpr int KS = MOEG_KS;
  constexpr int NS = DM / KS;
  constexpr int WPR = DM / 8;
  constexpr int GPR = DM / 64;
  constexpr int MT = BM / 16;
  constexpr int XR = BM / 8;
  static_assert(DM % KS == 0, "moeg_gate_up: DM must be a multiple of MOEG_KS");
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
  const int n0 = blockIdx.y * 64;
  const int wc = lane >> 3;

  const uint4* wp[4];
  const T* sp[4];
  const T* bp[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const bool up = i >= 2;
    const size_t row = (size_t)ex * DI + n0 + (moeg_wrow(i, warp, lane) & 63);
    wp[i] = reinterpret_cast<const uint4*>((up ? w_up : w_gate) + row * WPR) + wc;
    sp[i] = (up ? s_up : s_gate) + row * GPR + (wc >> 1);
    bp[i] = (up ? b_up : b_gate) + row * GPR + (wc >> 1);
  }
  const int xseg = tid & 15;
  const uint4* xp[XR];
#pragma unroll
  for (int i = 0; i < XR; ++i) {
    const int row = (tid >> 4) + 8 * i;
    xp[i] = nullptr;
    if (row < cnt) {
      const int tok = sorted_pairs[r0 + row] / TOPK;
      xp[i] = reinterpret_cast<const uint4*>(x + (size_t)tok * DM) + xseg;
    }
  }

  const uint4 zero4 = make_uint4(0u, 0u, 0u, 0u);
  uint4 rq[4], rx[XR];
  T rs[4], rb[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    rq[i] = wp[i][0];
    rs[i] = sp[i][0];
    rb[i] = bp[i][0];
  }
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

  const int brow = warp * 16 + (lane & 7) + ((lane >> 4) << 3);
  const int bsub = ((lane >> 3) & 1) * 8;
  for (int s = 0; s < NS; ++s) {
    moeg_stage_to_shared<XR>(sA, sB, rq, rs, rb, rx, tid);
    __syncthreads();
    if (s + 1 < NS) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        rq[i] = wp[i][(s + 1) * (KS / 32)];
        rs[i] = sp[i][(s + 1) * (KS / 64)];
        rb[i] = bp[i][(s + 1) * (KS / 64)];
      }
#pragma unroll
      for (int i = 0; i < XR; ++i) rx[i] = xp[i] ? xp[i][(s + 1) * (KS / 8)] : zero4;
    }
#pragma unroll
    for (int kk = 0; kk < KS / 16; ++kk) {
      unsigned int a[MT][4];
#pragma unroll
      for (int mi = 0; mi < MT; ++mi)
        moeg_ldsm_x4(a[mi], sA + (mi * 16 + (lane & 15)) * LD + kk * 16 + (lane >> 4) * 8);
      unsigned int bgf[4], buf[4];
      moeg_ldsm_x4(bgf, sB + brow * LD + kk * 16 + bsub);
      moeg_ldsm_x4(buf, sB + (64 + brow) * LD + kk * 16 + bsub);
#pragma unroll
      for (int mi = 0; mi < MT; ++mi)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          moeg_mma(accg[mi][nt], a[mi], bgf[2 * nt], bgf[2 * nt + 1]);
          moeg_mma(accu[mi][nt], a[mi], buf[2 * nt], buf[2 * nt + 1]);
        }
    }
    __syncthreads();
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
