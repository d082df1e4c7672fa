// @kernel moeg_gate_up_coop
// @inputs x[N,DM] T, sorted_pairs[P] int32, tiles[Tm,3] int32, w_gate[NE,DI,DM/8] uint32, s_gate[NE,DI,DM/64] T, b_gate[NE,DI,DM/64] T, w_up[NE,DI,DM/8] uint32, s_up[NE,DI,DM/64] T, b_up[NE,DI,DM/64] T
// @outputs h[P,DI] T
// @template T=bfloat16 DM=2048 DI=512 TOPK=8 BM=32
// @grid (128*Tm, DI/64, 1)
// @threadgroup (128, 1, 1)
// Grouped GEMM, gate and up projections with the SwiGLU epilogue. Threadgroup
// (tile, j): rows tiles[tile] of the expert-sorted pairs (token rows of x gathered),
// output columns [64j, 64j+64) of gate and up. Each k step of 64 (one quant group)
// dequantizes 64 gate rows + 64 up rows into threadgroup memory cooperatively: a row's
// 32 bytes are two 16-byte words read by neighbouring threads (thread t: word t & 1 of
// gate row t >> 1 and of up row t >> 1), instead of one thread reading its row as
// eight 4-byte words (moeg_gate_up; same launch contract, same result bit for bit);
// 4 simdgroups each own 16 gate + 16 up columns; simdgroup_matrix<float,8,8>
// multiply-accumulate; h = silu(gate) * up in fp32, stored in sorted-pair order.
// ---- body ----
  constexpr int LD = 72;
  constexpr int KC = DM / 64;
  constexpr int WPR = DM / 8;
  constexpr int GPR = DM / 64;
  constexpr int XR = BM / 16;
  constexpr int MF = BM / 8;
  threadgroup T sA[BM * LD];
  threadgroup T sB[128 * LD];

  const int tile = int(threadgroup_position_in_grid.x);
  const int ex = tiles[3 * tile];
  const int r0 = tiles[3 * tile + 1];
  const int cnt = tiles[3 * tile + 2];
  if (cnt <= 0) return;
  const int tid = int(thread_position_in_threadgroup.x);
  const int lane = int(thread_index_in_simdgroup);
  const int sgi = int(simdgroup_index_in_threadgroup);
  const int n0 = int(threadgroup_position_in_grid.y) * 64;

  const int wr = tid >> 1;
  const int wh = tid & 1;
  const int rowid = ex * DI + n0 + wr;
  const device uint4* wg = reinterpret_cast<const device uint4*>(w_gate + rowid * WPR);
  const device uint4* wu = reinterpret_cast<const device uint4*>(w_up + rowid * WPR);
  const device T* sgr = s_gate + rowid * GPR;
  const device T* bgr = b_gate + rowid * GPR;
  const device T* sur = s_up + rowid * GPR;
  const device T* bur = b_up + rowid * GPR;

  const int xseg = (tid & 7) * 8;
  int tok[XR];
  for (int i = 0; i < XR; ++i) {
    const int row = (tid >> 3) + 16 * i;
    tok[i] = row < cnt ? sorted_pairs[r0 + row] / TOPK : -1;
  }

  const int qid = lane >> 2;
  const int fm = (qid & 4) + ((lane >> 1) & 3);
  const int fn = (qid & 2) * 2 + (lane & 1) * 2;
  simdgroup_matrix<float, 8, 8> accg[MF][2];
  simdgroup_matrix<float, 8, 8> accu[MF][2];
  for (int mi = 0; mi < MF; ++mi) {
    for (int nt = 0; nt < 2; ++nt) {
      accg[mi][nt] = make_filled_simdgroup_matrix<float, 8, 8>(0.f);
      accu[mi][nt] = make_filled_simdgroup_matrix<float, 8, 8>(0.f);
    }
  }

  for (int kc = 0; kc < KC; ++kc) {
    {
      const uint4 qg = wg[kc * 2 + wh];
      const uint4 qu = wu[kc * 2 + wh];
      const float s0 = float(sgr[kc]);
      const float b0 = float(bgr[kc]);
      const float s1 = float(sur[kc]);
      const float b1 = float(bur[kc]);
      threadgroup T* dg = sB + wr * LD + wh * 32;
      threadgroup T* du = sB + (64 + wr) * LD + wh * 32;
      for (int c = 0; c < 4; ++c) {
        for (int j = 0; j < 8; ++j) {
          dg[c * 8 + j] = static_cast<T>(fma(s0, float((qg[c] >> (4 * j)) & 0xFu), b0));
          du[c * 8 + j] = static_cast<T>(fma(s1, float((qu[c] >> (4 * j)) & 0xFu), b1));
        }
      }
    }
    for (int i = 0; i < XR; ++i) {
      const int row = (tid >> 3) + 16 * i;
      threadgroup T* dst = sA + row * LD + xseg;
      if (tok[i] >= 0) {
        const device T* src = x + tok[i] * DM + kc * 64 + xseg;
        for (int j = 0; j < 8; ++j) dst[j] = src[j];
      } else {
        for (int j = 0; j < 8; ++j) dst[j] = T(0);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int kk = 0; kk < 64; kk += 8) {
      simdgroup_matrix<float, 8, 8> a[MF];
      for (int mi = 0; mi < MF; ++mi) {
        a[mi].thread_elements()[0] = float(sA[(mi * 8 + fm) * LD + kk + fn]);
        a[mi].thread_elements()[1] = float(sA[(mi * 8 + fm) * LD + kk + fn + 1]);
      }
      for (int nt = 0; nt < 2; ++nt) {
        const int n = sgi * 16 + nt * 8 + fn;
        simdgroup_matrix<float, 8, 8> bg, bu;
        bg.thread_elements()[0] = float(sB[n * LD + kk + fm]);
        bg.thread_elements()[1] = float(sB[(n + 1) * LD + kk + fm]);
        bu.thread_elements()[0] = float(sB[(64 + n) * LD + kk + fm]);
        bu.thread_elements()[1] = float(sB[(65 + n) * LD + kk + fm]);
        for (int mi = 0; mi < MF; ++mi) {
          simdgroup_multiply_accumulate(accg[mi][nt], a[mi], bg, accg[mi][nt]);
          simdgroup_multiply_accumulate(accu[mi][nt], a[mi], bu, accu[mi][nt]);
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  for (int mi = 0; mi < MF; ++mi) {
    const int r = mi * 8 + fm;
    if (r < cnt) {
      for (int nt = 0; nt < 2; ++nt) {
        const int col = n0 + sgi * 16 + nt * 8 + fn;
        for (int j = 0; j < 2; ++j) {
          const float g = accg[mi][nt].thread_elements()[j];
          const float u = accu[mi][nt].thread_elements()[j];
          h[(r0 + r) * DI + col + j] = static_cast<T>(g / (1.0f + metal::exp(-g)) * u);
        }
      }
    }
  }
