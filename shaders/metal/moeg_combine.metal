// @kernel moeg_combine
// @inputs y_pairs[P,DM] T, pair_pos[P] int32, scores[N,TOPK] ST, shared_out[N,DM] T, shared_gate[N] GT
// @outputs out[N,DM] T
// @template T=bfloat16 ST=bfloat16 GT=bfloat16 DM=2048 TOPK=8 HAS_SHARED=1 HAS_GATE=1
// @grid (DM/8, N, 1)
// @threadgroup (min(256, DM/8), 1, 1)
// Score-weighted combine back to token order (deterministic, no atomics):
// out[n] = sum_j scores[n,j] * y_pairs[pair_pos[n*TOPK+j]] (+ shared_gate[n] * shared_out[n]),
// fp32 sums in j order, one rounding. Each thread does 8 columns of one token. With
// HAS_SHARED=0 / HAS_GATE=0 the shared inputs are unread placeholders.
// ---- body ----
  const int c8 = int(thread_position_in_grid.x);
  const int n = int(thread_position_in_grid.y);
  if (c8 >= DM / 8) return;
  float acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
  for (int j = 0; j < TOPK; ++j) {
    const int pos = pair_pos[n * TOPK + j];
    const float s = float(scores[n * TOPK + j]);
    for (int i = 0; i < 8; ++i) acc[i] = fma(s, float(y_pairs[pos * DM + c8 * 8 + i]), acc[i]);
  }
  if (HAS_SHARED) {
    const float g = HAS_GATE ? float(shared_gate[n]) : 1.0f;
    for (int i = 0; i < 8; ++i) acc[i] = fma(g, float(shared_out[n * DM + c8 * 8 + i]), acc[i]);
  }
  for (int i = 0; i < 8; ++i) out[n * DM + c8 * 8 + i] = static_cast<T>(acc[i]);
