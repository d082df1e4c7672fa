// @kernel moeg_route_rank
// @inputs inds[P] IT, n_pairs[1] int32
// @outputs chunk_counts[C,NE] int32, rank[P] int32
// @template IT=uint32 NE=256
// @grid (256*C, 1, 1) with C = ceil(P/256)
// @threadgroup (256, 1, 1)
// Pass 1 of the MoE routing: per 256-pair chunk, each pair's rank among the earlier
// pairs of its chunk routed to the same expert, and the chunk's histogram over experts.
// Ids outside [0, NE) are skipped (precondition: ids are valid).
// ---- body ----
  __shared__ int s_e[256];
  const int P = n_pairs[0];
  const int tid = threadIdx.x;
  const int c = blockIdx.x;
  const int p = c * 256 + tid;
  int e = -1;
  if (p < P) {
    const unsigned int v = (unsigned int)inds[p];
    e = v < (unsigned int)NE ? (int)v : -1;
  }
  s_e[tid] = e;
  __syncthreads();
  if (e >= 0) {
    int r = 0;
    for (int j = 0; j < tid; ++j) r += (s_e[j] == e) ? 1 : 0;
    rank[p] = r;
  }
  for (int ee = tid; ee < NE; ee += 256) {
    int n = 0;
    for (int j = 0; j < 256; ++j) n += (s_e[j] == ee) ? 1 : 0;
    chunk_counts[(size_t)c * NE + ee] = n;
  }
