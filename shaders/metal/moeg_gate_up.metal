// @kernel moeg_gate_up
// @inputs x[N,DM] T, sorted_pairs[P] int32, tiles[Tm,3] int32, w_gate[NE,DI,DM/8] uint32, s_gate[NE,DI,DM/64] T, b_gate[NE,DI,DM/64] T, w_up[NE,DI,DM/8] uint32, s_up[NE,DI,DM/64] T, b_up[NE,DI,DM/64] T
// @outputs h[P,DI] T
// @template T=bfloat16 DM=2048 DI=512 TOPK=8 BM=32
// @grid (128*Tm, DI/64, 1)
// @threadgroup (128, 1, 1)
// Grouped GEMM, gate and up projections with the SwiGLU epilogue. Threadgroup
// (tile, j): rows tiles[tile] of the expert-sorted pairs (token rows of x gathered),
// output columns [64j, 64j+64) of gate and up. Each k step of 64 (one quant group)
// dequantizes 64 gate rows + 64 up rows (one per thread) into threadgroup memory;
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

  const bool is_up = tid >= 64;
  const int rowid = ex * DI + n0 + (tid & 63);
  const device uint32_t* wrow = (is_up ? w_up : w_gate) + rowid * WPR;
  const device T* srow = (is_up ? s_up : s_gate) + rowid * GPR;
  const device T* brow = (is_up ? b_up : b_gate) + rowid * GPR;

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
      const float s = float(srow[kc]);
      const float b = float(brow[kc]);
      threadgroup T* dst = sB + tid * LD;
      for (int w = 0; w < 8; ++w) {
        const uint32_t q = wrow[kc * 8 + w];
        for (int j = 0; j < 8; ++j) {
          dst[w * 8 + j] = static_cast<T>(fma(s, float((q >> (4 * j)) & 0xFu), b));
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
