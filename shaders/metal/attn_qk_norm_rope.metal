// @kernel lily_attn_qk_norm_rope
// @inputs queries[B,L,HQ,D] keys[B,L,HKV,D] q_weight[D] k_weight[D] rope[3]:float32 offset[1]:int32 (all read through *_strides; offset may also hold one position per batch row)
// @outputs q_out[B,HQ,L,D]:T k_out[B,HKV,L,D]:T v_out[B,HKV,L,D]:T (v_out: [1], unwritten, unless PACKED)
// @template T=bfloat16 D=256 HQ=16 HKV=2 R=64 PACKED=true
// @template T=float16 D=128 HQ=8 HKV=2 R=32 PACKED=false
// @grid (32*B*L*NR, 1, 1)   NR = HQ + HKV (+ HKV when PACKED)
// @threadgroup (32, 1, 1)
// offset: one position for every row, or one per batch row b (a left-padded batch).
// @ensure_row_contiguous false
// PACKED: queries and keys are both the fused q|k|v projection [B,L,HQ*2D+2*HKV*D]
// (per query head q then gate, then k, then v); the extra HKV rows copy v into v_out.
// One simdgroup per (batch, position, head) row: RMSNorm over D (fp32 sum of squares,
// rounded to T like mx.fast.rms_norm), then rotate-half RoPE on the first R dims at
// position offset + t (theta_j = base^(-j/(R/2)), as mx.fast.rope). rope = (eps,
// log2(base), scale). Lane owns elements lane + 32*i.

// ---- body ----
  constexpr int EPL = D / 32;
  constexpr int HALF = R / 2;
  threadgroup float y[D];

  const uint lane = thread_index_in_simdgroup;
  const int row = int(threadgroup_position_in_grid.x);
  const int L = queries_shape[1];
  constexpr int NR = HQ + HKV + (PACKED ? HKV : 0);
  const int hh = row % NR;
  const int bt = row / NR;
  const int t = bt % L;
  const int b = bt / L;
  const bool isq = hh < HQ;
  const int h = isq ? hh : (hh < HQ + HKV ? hh - HQ : hh - HQ - HKV);
  // PACKED: column offsets of head h's q, k, v in the fused row
  const int64_t pq = int64_t(h) * 2 * D;
  const int64_t pk = int64_t(HQ) * 2 * D + int64_t(h) * D;
  if (PACKED && hh >= HQ + HKV) {
    const device T* vs = queries + int64_t(b) * queries_strides[0] + int64_t(t) * queries_strides[1] +
                   (pk + int64_t(HKV) * D) * queries_strides[2];
    device T* vd = v_out + ((int64_t(b) * HKV + h) * L + t) * D;
    for (int e = lane; e < D; e += 32) {
      vd[e] = vs[int64_t(e) * queries_strides[2]];
    }
    return;
  }

  const device T* src;
  const device T* w;
  int64_t ws;
  device T* dst;
  if (isq) {
    src = queries + int64_t(b) * queries_strides[0] + int64_t(t) * queries_strides[1] +
          (PACKED ? pq * queries_strides[2] : int64_t(h) * queries_strides[2]);
    w = q_weight;
    ws = q_weight_strides[0];
    dst = q_out + ((int64_t(b) * HQ + h) * L + t) * D;
  } else {
    src = keys + int64_t(b) * keys_strides[0] + int64_t(t) * keys_strides[1] +
          (PACKED ? pk * keys_strides[2] : int64_t(h) * keys_strides[2]);
    w = k_weight;
    ws = k_weight_strides[0];
    dst = k_out + ((int64_t(b) * HKV + h) * L + t) * D;
  }

  const int64_t es = PACKED ? queries_strides[2] : (isq ? queries_strides[3] : keys_strides[3]);
  float x[EPL];
  float ss = 0.0f;
  for (int i = 0; i < EPL; ++i) {
    x[i] = static_cast<float>(src[int64_t(lane + 32 * i) * es]);
    ss += x[i] * x[i];
  }
  ss = simd_sum(ss);
  const float inv = metal::precise::rsqrt(ss / float(D) + rope[0]);
  for (int i = 0; i < EPL; ++i) {
    const int e = lane + 32 * i;
    const T yn = static_cast<T>(x[i] * inv);
    y[e] = static_cast<float>(static_cast<T>(static_cast<float>(w[int64_t(e) * ws]) * static_cast<float>(yn)));
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  const float pos = rope[2] * float(offset[offset_shape[0] == 1 ? 0 : b] + t);
  for (int i = 0; i < EPL; ++i) {
    const int e = lane + 32 * i;
    float o = y[e];
    if (e < R) {
      const int j = e < HALF ? e : e - HALF;
      const float inv_freq = metal::exp2(-(float(j) / float(HALF)) * rope[1]);
      const float theta = pos * inv_freq;
      const float cs = metal::fast::cos(theta);
      const float sn = metal::fast::sin(theta);
      if (e < HALF) {
        o = y[e] * cs - y[e + HALF] * sn;
      } else {
        o = y[e - HALF] * sn + y[e] * cs;
      }
    }
    dst[e] = static_cast<T>(o);
  }
