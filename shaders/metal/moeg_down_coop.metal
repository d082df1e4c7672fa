// @kernel moeg_down_coop
// @inputs h[P,DI] T, tiles[Tm,3] int32, w_down[NE,DM,DI/8] uint32, s_down[NE,DM,DI/64] T, b_down[NE,DM,DI/64] T
// @outputs y[P,DM] T
// @template T=bfloat16 DM=2048 DI=512 BM=32
// @grid (128*Tm, DM/128, 1)
// @threadgroup (128, 1, 1)
// Grouped GEMM, down projection. Threadgroup (tile, j): rows tiles[tile] of h (already
// in expert-sorted order), output columns [128j, 128j+128). Each k step of 64 (one
// quant group) dequantizes 128 weight rows into threadgroup memory cooperatively: a
// row's 32 bytes are two 16-byte words read by neighbouring threads (thread t: word
// t & 1 of rows t >> 1 and 64 + (t >> 1)), instead of one thread reading its row as
// eight 4-byte words (moeg_down; same launch contract, same result bit for bit);
// 4 simdgroups each own 32 columns; simdgroup_matrix<float,8,8> multiply-accumulate;
// y stored in sorted-pair order (the combine kernel reorders and weights it).
// ---- body ----
  constexpr int LD = 72;
  constexpr int KC = DI / 64;
  constexpr int WPR = DI / 8;
  constexpr int GPR = DI / 64;
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
  const int n0 = int(threadgroup_position_in_grid.y) * 128;

  const int wr = tid >> 1;
  const int wh = tid & 1;
  const int rowid = ex * DM + n0 + wr;
  const device uint4* wa = reinterpret_cast<const device uint4*>(w_down + rowid * WPR);
  const device uint4* wb = reinterpret_cast<const device uint4*>(w_down + (rowid + 64) * WPR);
  const device T* sar = s_down + rowid * GPR;
  const device T* bar = b_down + rowid * GPR;
  const device T* sbr = s_down + (rowid + 64) * GPR;
  const device T* bbr = b_down + (rowid + 64) * GPR;

  const int xseg = (tid & 7) * 8;
  const int qid = lane >> 2;
  const int fm = (qid & 4) + ((lane >> 1) & 3);
  const int fn = (qid & 2) * 2 + (lane & 1) * 2;
  simdgroup_matrix<float, 8, 8> acc[MF][4];
  for (int mi = 0; mi < MF; ++mi) {
    for (int nt = 0; nt < 4; ++nt) acc[mi][nt] = make_filled_simdgroup_matrix<float, 8, 8>(0.f);
  }

  for (int kc = 0; kc < KC; ++kc) {
    {
      const uint4 qa = wa[kc * 2 + wh];
      const uint4 qb = wb[kc * 2 + wh];
      const float s0 = float(sar[kc]);
      const float b0 = float(bar[kc]);
      const float s1 = float(sbr[kc]);
      const float b1 = float(bbr[kc]);
      threadgroup T* da = sB + wr * LD + wh * 32;
      threadgroup T* db = sB + (64 + wr) * LD + wh * 32;
      for (int c = 0; c < 4; ++c) {
        for (int j = 0; j < 8; ++j) {
          da[c * 8 + j] = static_cast<T>(fma(s0, float((qa[c] >> (4 * j)) & 0xFu), b0));
          db[c * 8 + j] = static_cast<T>(fma(s1, float((qb[c] >> (4 * j)) & 0xFu), b1));
        }
      }
    }
    for (int i = 0; i < XR; ++i) {
      const int row = (tid >> 3) + 16 * i;
      threadgroup T* dst = sA + row * LD + xseg;
      if (row < cnt) {
        const device T* src = h + (r0 + row) * DI + kc * 64 + xseg;
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
      for (int nt = 0; nt < 4; ++nt) {
        const int n = sgi * 32 + nt * 8 + fn;
        simdgroup_matrix<float, 8, 8> bm;
        bm.thread_elements()[0] = float(sB[n * LD + kk + fm]);
        bm.thread_elements()[1] = float(sB[(n + 1) * LD + kk + fm]);
        for (int mi = 0; mi < MF; ++mi) {
          simdgroup_multiply_accumulate(acc[mi][nt], a[mi], bm, acc[mi][nt]);
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  for (int mi = 0; mi < MF; ++mi) {
    const int r = mi * 8 + fm;
    if (r < cnt) {
      for (int nt = 0; nt < 4; ++nt) {
        const int col = n0 + sgi * 32 + nt * 8 + fn;
        const float v0 = acc[mi][nt].thread_elements()[0];
        const float v1 = acc[mi][nt].thread_elements()[1];
        y[(r0 + r) * DM + col] = static_cast<T>(v0);
        y[(r0 + r) * DM + col + 1] = static_cast<T>(v1);
      }
    }
  }
