// @kernel lily_attn_decode_combine
// @inputs part_o[B,HQ,NS,D]:float32 part_ml[B,HQ,NS,2]:float32 gate[B,1,HQ,D] (gate read through gate_strides; an 8-element stand-in when GATED=false)
// @outputs out[B,1,HQ*D]:T
// @template T=bfloat16 D=256 GATED=true GATE_PACKED=true
// @template T=float16 D=128 GATED=false GATE_PACKED=false
// @grid (256*D/64, HQ, B)
// @threadgroup (256, 1, 1)
// @ensure_row_contiguous false
// GATE_PACKED: gate is the fused q|k|v projection [B,1,HQ*2D+2*HKV*D]; head hq's gate is
// columns hq*2D+D .. hq*2D+2D-1 (q_proj's per-head q|gate layout).
// Second pass of split-K decode: threadgroup (x, hq, b) merges the NS partials of one
// query head for dims 64x..64x+63: M = max m_s; o = sum 2^(m_s-M) acc_s / sum 2^(m_s-M) l_s.
// Four groups of 64 threads take every 4th partial, then add up in threadgroup memory.
// With GATED the epilogue is the output gate, rounded as mlx-lm does:
// T(T(o) * T(sigmoid(gate))). out [B,1,HQ*D] has the memory layout of [B,HQ,1,D].

// ---- body ----
  constexpr int NT = 256;
  constexpr int NSUB = NT / 64;
  threadgroup float red[NT];
  threadgroup float racc[NSUB * 64];
  threadgroup float rl[NSUB];

  const int tid = int(thread_position_in_threadgroup.x);
  const int sub = tid / 64;
  const int t = tid % 64;
  const int hq = int(threadgroup_position_in_grid.y);
  const int b = int(threadgroup_position_in_grid.z);
  const int d = int(threadgroup_position_in_grid.x) * 64 + t;
  const int HQ = part_o_shape[1];
  const int NS = part_o_shape[2];
  const int64_t row = int64_t(b) * HQ + hq;
  const device float* ml = part_ml + row * NS * 2;
  const device float* po = part_o + row * NS * D + d;

  float mx = -FLT_MAX;
  for (int s = tid; s < NS; s += NT) {
    mx = metal::max(mx, ml[2 * s]);
  }
  red[tid] = mx;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int w = NT / 2; w > 0; w >>= 1) {
    if (tid < w) {
      red[tid] = metal::max(red[tid], red[tid + w]);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  const float M = red[0];

  float acc = 0.0f;
  float lsum = 0.0f;
  for (int s = sub; s < NS; s += NSUB) {
    const float wgt = metal::exp2(ml[2 * s] - M);
    acc += wgt * po[int64_t(s) * D];
    lsum += wgt * ml[2 * s + 1];
  }
  racc[sub * 64 + t] = acc;
  if (t == 0) {
    rl[sub] = lsum;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (sub == 0) {
    float o = 0.0f;
    float ls = 0.0f;
    for (int j = 0; j < NSUB; ++j) {
      o += racc[j * 64 + t];
      ls += rl[j];
    }
    o = o / ls;
    T res = static_cast<T>(o);
    if (GATED) {
      const float gv = static_cast<float>(
          GATE_PACKED
              ? gate[int64_t(b) * gate_strides[0] + (int64_t(hq) * 2 * D + D + d) * gate_strides[2]]
              : gate[int64_t(b) * gate_strides[0] + int64_t(hq) * gate_strides[2] + int64_t(d) * gate_strides[3]]);
      const T sg = static_cast<T>(1.0f / (1.0f + metal::exp(-gv)));
      res = static_cast<T>(static_cast<float>(res) * static_cast<float>(sg));
    }
    out[row * D + d] = res;
  }
