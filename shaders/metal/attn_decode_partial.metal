// @kernel lily_attn_decode_partial
// @inputs q[B,HQ,1,D] k[B,HKV,T,D] v[B,HKV,T,D] params[1]:float32 tlen[1]:int32 (q/k/v read through *_strides; k/v may be KV-cache views)
// @outputs part_o[B,HQ,NS,D]:float32 part_ml[B,HQ,NS,2]:float32
// @template T=bfloat16 D=256 G=8 CH=64 NSG=4 DYN_T=true PF=2
// @template T=float16 D=128 G=4 CH=32 NSG=4 DYN_T=false PF=1
// @grid (32*NSG*ceil(NS/NSG), HKV, B) with NS = ceil(T/CH)
// @threadgroup (32*NSG, 1, 1)
// @ensure_row_contiguous false
// DYN_T: k/v are whole cache buffers and only keys < tlen[0] are valid (the grid still
// covers every CH-block of the buffer; a block past tlen writes a neutral partial:
// l = 0, acc = 0), so a compiled decode step keeps static shapes as the cache fills.
// Split-K decode attention, GQA-packed: simdgroup s of threadgroup x owns cache block
// split = x*NSG + s (keys [split*CH, split*CH+CH)) of one KV head and all G query heads
// sharing it, so each K/V row is read once for G heads. Lane owns dims lane*D/32..+D/32
// (a simdgroup reads a 2*D-byte row contiguously). fp32 online softmax in log2 units
// (params[0] = scale*log2(e)); writes the block's unnormalised acc, max m and sum l.
// PF (1 or 2): key rows whose loads are issued before the first of them is used
// (results do not depend on PF).

// ---- body ----
  constexpr int DPL = D / 32;
  const uint lane = thread_index_in_simdgroup;
  const uint sg = simdgroup_index_in_threadgroup;
  const int kvh = int(threadgroup_position_in_grid.y);
  const int b = int(threadgroup_position_in_grid.z);
  const int NS = (k_shape[2] + CH - 1) / CH;
  const int Tn = DYN_T ? min(int(tlen[0]), int(k_shape[2])) : int(k_shape[2]);
  const int split = int(threadgroup_position_in_grid.x) * NSG + int(sg);
  if (split >= NS) {
    return;
  }
  const int HQ = q_shape[1];
  const float sl = params[0];

  float qv[G][DPL];
  float acc[G][DPL];
  float m[G];
  float l[G];
  for (int h = 0; h < G; ++h) {
    const device T* qp = q + int64_t(b) * q_strides[0] + int64_t(kvh * G + h) * q_strides[1] +
                         int64_t(lane * DPL) * q_strides[3];
    for (int i = 0; i < DPL; ++i) {
      qv[h][i] = static_cast<float>(qp[int64_t(i) * q_strides[3]]);
      acc[h][i] = 0.0f;
    }
    m[h] = -FLT_MAX;
    l[h] = 0.0f;
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
  for (int tb = t0; tb < t1; tb += PF) {
    float kr[PF][DPL];
    float vr[PF][DPL];
    for (int u = 0; u < PF; ++u) {
      const int t = metal::min(tb + u, t1 - 1);  // past t1: row t1 - 1 again, unused
      if (unit) {
        for (int i = 0; i < DPL; ++i) {
          kr[u][i] = static_cast<float>(kp[t * ks + i]);
          vr[u][i] = static_cast<float>(vp[t * vs + i]);
        }
      } else {
        for (int i = 0; i < DPL; ++i) {
          kr[u][i] = static_cast<float>(kp[t * ks + i * kd]);
          vr[u][i] = static_cast<float>(vp[t * vs + i * vd]);
        }
      }
    }
    for (int u = 0; u < PF && tb + u < t1; ++u) {
      for (int h = 0; h < G; ++h) {
        float d = 0.0f;
        for (int i = 0; i < DPL; ++i) {
          d += qv[h][i] * kr[u][i];
        }
        const float s = simd_sum(d) * sl;
        if (s > m[h]) {
          const float f = metal::exp2(m[h] - s);
          l[h] *= f;
          for (int i = 0; i < DPL; ++i) {
            acc[h][i] *= f;
          }
          m[h] = s;
        }
        const float p = metal::exp2(s - m[h]);
        l[h] += p;
        for (int i = 0; i < DPL; ++i) {
          acc[h][i] += p * vr[u][i];
        }
      }
    }
  }

  for (int h = 0; h < G; ++h) {
    const int64_t row = (int64_t(b) * HQ + kvh * G + h) * NS + split;
    device float* po = part_o + row * D + lane * DPL;
    for (int i = 0; i < DPL; ++i) {
      po[i] = acc[h][i];
    }
    if (lane == 0) {
      part_ml[row * 2] = m[h];
      part_ml[row * 2 + 1] = l[h];
    }
  }
