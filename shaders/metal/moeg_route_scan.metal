// @kernel moeg_route_scan
// @inputs chunk_counts[C,NE] int32, n_pairs[1] int32
// @outputs counts[NE] int32, offsets[NE+1] int32, chunk_base[C,NE] int32, tiles[T,3] int32, num_tiles[1] int32
// @template NE=256 TR=32
// @grid (256, 1, 1)
// @threadgroup (256, 1, 1)
// Pass 2 (one threadgroup): per-expert totals, exclusive scans of counts and of tiles
// per expert, each chunk's first output slot per expert, and the tile map.
// C = ceil(P/256), T = ceil(P/TR) + min(NE, P); unused tiles are (NE, P, 0).
// ---- body ----
  constexpr int EPT = (NE + 255) / 256;
  threadgroup int s_cnt[NE];
  threadgroup int s_off[NE + 1];
  threadgroup int s_toff[NE + 1];
  threadgroup int s_sa[256];
  threadgroup int s_sb[256];
  const int P = n_pairs[0];
  const int C = (P + 255) / 256;
  const int T = (P + TR - 1) / TR + (NE < P ? NE : P);
  const int tid = int(thread_position_in_threadgroup.x);
  for (int e = tid; e < NE; e += 256) {
    int s = 0;
    for (int c = 0; c < C; ++c) s += chunk_counts[c * NE + e];
    s_cnt[e] = s;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  int a = 0, b = 0;
  for (int i = 0; i < EPT; ++i) {
    const int e = tid * EPT + i;
    if (e < NE) {
      a += s_cnt[e];
      b += (s_cnt[e] + TR - 1) / TR;
    }
  }
  s_sa[tid] = a;
  s_sb[tid] = b;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int off = 1; off < 256; off <<= 1) {
    const int va = tid >= off ? s_sa[tid - off] : 0;
    const int vb = tid >= off ? s_sb[tid - off] : 0;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    s_sa[tid] += va;
    s_sb[tid] += vb;
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  int ra = s_sa[tid] - a, rb = s_sb[tid] - b;
  for (int i = 0; i < EPT; ++i) {
    const int e = tid * EPT + i;
    if (e < NE) {
      s_off[e] = ra;
      s_toff[e] = rb;
      ra += s_cnt[e];
      rb += (s_cnt[e] + TR - 1) / TR;
    }
  }
  if (tid == 255) {
    s_off[NE] = s_sa[255];
    s_toff[NE] = s_sb[255];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int e = tid; e <= NE; e += 256) {
    offsets[e] = s_off[e];
    if (e < NE) counts[e] = s_cnt[e];
  }
  if (tid == 0) num_tiles[0] = s_toff[NE];
  for (int e = tid; e < NE; e += 256) {
    int run = s_off[e];
    for (int c = 0; c < C; ++c) {
      const int i = c * NE + e;
      const int n = chunk_counts[i];
      chunk_base[i] = run;
      run += n;
    }
  }
  const int used = s_toff[NE];
  for (int t = tid; t < T; t += 256) {
    int ex = NE, start = P, cnt = 0;
    if (t < used) {
      int lo = 0, hi = NE - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (s_toff[mid] <= t) lo = mid; else hi = mid - 1;
      }
      const int local = t - s_toff[lo];
      ex = lo;
      start = s_off[lo] + local * TR;
      const int left = s_cnt[lo] - local * TR;
      cnt = left < TR ? left : TR;
    }
    tiles[3 * t + 0] = ex;
    tiles[3 * t + 1] = start;
    tiles[3 * t + 2] = cnt;
  }
