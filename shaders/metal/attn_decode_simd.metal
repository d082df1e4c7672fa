// @kernel lily_attn_decode_simd
// @inputs q[B,HQ,1,D] k[B,HKV,T,D] v[B,HKV,T,D] params[1]:float32 tlen[1]:int32 (q/k/v read through *_strides; k/v may be KV-cache views)
// @outputs part_o[B,HQ,NS,D]:float32 part_ml[B,HQ,NS,2]:float32
// @template T=bfloat16 D=256 G=8 CH=64 HPS=1 DYN_T=true
// @template T=bfloat16 D=256 G=8 CH=32 HPS=2 DYN_T=false
// @template T=float16 D=128 G=3 CH=32 HPS=2 DYN_T=false
// @grid (32*ceil(G/HPS)*NS, HKV, B) with NS = ceil(T/CH)
// @threadgroup (32*ceil(G/HPS), 1, 1)
// @ensure_row_contiguous false
// Split-K decode attention, one simdgroup per query head (HPS=1) or per pair of heads
// (HPS=2), the layout of MLX's sdpa_vector_2pass: threadgroup (split, kvh, b) holds the
// G query heads of KV head kvh (simdgroup s: heads s*HPS .. s*HPS+HPS-1) over the cache
// block [split*CH, split*CH+CH); its simdgroups read the same K/V rows, so a row comes
// from DRAM once per threadgroup. Lane owns dims lane*D/32..+D/32 (a simdgroup reads a
// 2*D-byte row contiguously). Per lane: HPS*(2*D/32 + 2) + 2*D/32 fp32 values live
// (34 at D=256, HPS=1). No threadgroup memory, no barriers.
// Same contract and arithmetic as lily_attn_decode_partial (fp32 online softmax in log2
// units, params[0] = scale*log2(e); the block's unnormalised acc, max m and sum l), so
// lily_attn_decode_combine merges its partials. DYN_T: only keys < tlen[0] count; a
// block past tlen writes a neutral partial (l = 0, acc = 0).

// ---- body ----
  constexpr int DPL = D / 32;
  const uint lane = thread_index_in_simdgroup;
  const int h0 = int(simdgroup_index_in_threadgroup) * HPS;
  const int split = int(threadgroup_position_in_grid.x);
  const int kvh = int(threadgroup_position_in_grid.y);
  const int b = int(threadgroup_position_in_grid.z);
  const int NS = (k_shape[2] + CH - 1) / CH;
  const int Tn = DYN_T ? min(int(tlen[0]), int(k_shape[2])) : int(k_shape[2]);
  const int HQ = q_shape[1];
  const float sl = params[0];

  float qv[HPS][DPL];
  float acc[HPS][DPL];
  float m[HPS];
  float l[HPS];
  for (int j = 0; j < HPS; ++j) {
    const int h = metal::min(h0 + j, G - 1);  // past G (odd G, HPS 2): a copy, not written
    const device T* qp = q + int64_t(b) * q_strides[0] + int64_t(kvh * G + h) * q_strides[1] +
                         int64_t(lane * DPL) * q_strides[3];
    for (int i = 0; i < DPL; ++i) {
      qv[j][i] = static_cast<float>(qp[int64_t(i) * q_strides[3]]);
      acc[j][i] = 0.0f;
    }
    m[j] = -FLT_MAX;
    l[j] = 0.0f;
  }

  const int64_t kd = k_strides[3];
  const int64_t vd = v_strides[3];
  const bool unit = kd == 1 && vd == 1;
  const device T* kp = k + int64_t(b) * k_strides[0] + int64_t(kvh) * k_strides[1] + int64_t(lane * DPL) * kd;
  const device T* vp = v + int64_t(b) * v_strides[0] + int64_t(kvh) * v_strides[1] + int64_t(lane * DPL) * vd;
  const int64_t ks = k_strides[2];
  const int64_t vs = v_strides[2];
  const int t0 = split * CH;
  const int t1 = metal::min(t0 + CH, Tn);
  for (int t = t0; t < t1; ++t) {
    float kr[DPL];
    float vr[DPL];
    if (unit) {
      for (int i = 0; i < DPL; ++i) {
        kr[i] = static_cast<float>(kp[t * ks + i]);
        vr[i] = static_cast<float>(vp[t * vs + i]);
      }
    } else {
      for (int i = 0; i < DPL; ++i) {
        kr[i] = static_cast<float>(kp[t * ks + i * kd]);
        vr[i] = static_cast<float>(vp[t * vs + i * vd]);
      }
    }
    for (int j = 0; j < HPS; ++j) {
      float d = 0.0f;
      for (int i = 0; i < DPL; ++i) {
        d += qv[j][i] * kr[i];
      }
      const float s = simd_sum(d) * sl;
      if (s > m[j]) {
        const float f = metal::exp2(m[j] - s);
        l[j] *= f;
        for (int i = 0; i < DPL; ++i) {
          acc[j][i] *= f;
        }
        m[j] = s;
      }
      const float p = metal::exp2(s - m[j]);
      l[j] += p;
      for (int i = 0; i < DPL; ++i) {
        acc[j][i] += p * vr[i];
      }
    }
  }

  for (int j = 0; j < HPS; ++j) {
    if (h0 + j >= G) {
      break;
    }
    const int64_t row = (int64_t(b) * HQ + kvh * G + h0 + j) * NS + split;
    device float* po = part_o + row * D + lane * DPL;
    for (int i = 0; i < DPL; ++i) {
      po[i] = acc[j][i];
    }
    if (lane == 0) {
      part_ml[row * 2] = m[j];
      part_ml[row * 2 + 1] = l[j];
    }
  }
