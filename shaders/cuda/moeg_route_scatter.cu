// @kernel moeg_route_scatter
// @inputs inds[P] IT, rank[P] int32, chunk_base[C,NE] int32, n_pairs[1] int32
// @outputs sorted_pairs[P] int32, pair_pos[P] int32
// @template IT=uint32 NE=256
// @grid (256*C, 1, 1) with C = ceil(P/256)
// @threadgroup (256, 1, 1)
// Pass 3: stable scatter of pair ids into expert groups; pair_pos is the inverse
// permutation (sorted slot of each pair).
// ---- body ----
  const int P = n_pairs[0];
  const int p = blockIdx.x * blockDim.x + threadIdx.x;
  if (p >= P) return;
  const unsigned int v = (unsigned int)inds[p];
  if (v >= (unsigned int)NE) return;
  const int pos = chunk_base[(size_t)(p >> 8) * NE + (int)v] + rank[p];
  sorted_pairs[pos] = p;
  pair_pos[p] = pos;
