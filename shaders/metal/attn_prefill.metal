// @kernel lily_attn_prefill
// @inputs q[B,HQ,L,D] k[B,HKV,T,D] v[B,HKV,T,D] gate[B,L,HQ,D] params[1]:float32 (all read through *_strides; gate is an 8-element stand-in when GATED=false)
// @outputs out[B,L,HQ,D]:T
// @template T=bfloat16 D=256 G=8 BR=32 CAUSAL=true GATED=true
// @template T=float16 D=128 G=2 BR=32 CAUSAL=false GATED=false
// @grid (128*ceil(G*L/BR), HKV, B)
// @threadgroup (128, 1, 1)
// @ensure_row_contiguous false
// Flash attention over the KV cache for a prefill chunk (queries are the last L of T
// positions; CAUSAL: query i sees keys <= T-L+i). GQA packing: the G query heads of a
// KV head are rows r = i*G + h of one matrix; a threadgroup's BR = 32 rows (4
// simdgroups x 8) share every K/V tile. simdgroup_matrix<float, 8, 8> products over
// 16-key tiles; Q [32][D+8] and one K-or-V tile [16][D+8] in threadgroup memory
// (25,344 bytes at D=256, T=bfloat16). fp32 online softmax in log2 units (params[0] =
// scale*log2(e)). Lane (fm, fn) coordinates follow MLX's steel fragment layout.
// Epilogue: divide by the row sum, optional sigmoid gate (rounded as mlx-lm does),
// write in [B, L, HQ, D] order.

// ---- body ----
  constexpr int NSG = 4;
  constexpr int BC = 16;
  constexpr int LD = D + 8;
  constexpr int NDT = D / 8;
  constexpr int NT = 32 * NSG;
  threadgroup T Qs[BR * LD];
  threadgroup T KVs[BC * LD];

  const uint lane = thread_index_in_simdgroup;
  const uint sg = simdgroup_index_in_threadgroup;
  const int tid = int(thread_position_in_threadgroup.x);
  const int kvh = int(threadgroup_position_in_grid.y);
  const int b = int(threadgroup_position_in_grid.z);
  const int HQ = q_shape[1];
  const int L = q_shape[2];
  const int Tn = k_shape[2];
  const int R = G * L;
  const int r0 = int(threadgroup_position_in_grid.x) * BR;
  const int past = Tn - L;
  int kend = Tn;
  if (CAUSAL) {
    const int imax = metal::min(L - 1, (r0 + BR - 1) / G);
    kend = metal::min(Tn, past + imax + 1);
  }
  const int ntiles = (kend + BC - 1) / BC;
  const float sl = params[0];

  const device T* kbase = k + int64_t(b) * k_strides[0] + int64_t(kvh) * k_strides[1];
  const device T* vbase = v + int64_t(b) * v_strides[0] + int64_t(kvh) * v_strides[1];

  for (int id = tid; id < BR * D; id += NT) {
    const int rr = id / D;
    const int d = id % D;
    const int r = r0 + rr;
    T val = T(0);
    if (r < R) {
      val = q[int64_t(b) * q_strides[0] + int64_t(kvh * G + r % G) * q_strides[1] +
              int64_t(r / G) * q_strides[2] + int64_t(d) * q_strides[3]];
    }
    Qs[rr * LD + d] = val;
  }

  const short qid = short(lane / 4);
  const short fm = (qid & 4) + short((lane / 2) % 4);
  const short fn = (qid & 2) * 2 + short(lane % 2) * 2;
  const int srow = int(sg) * 8 + fm;
  const int row = r0 + srow;
  const int pos = past + row / G;

  simdgroup_matrix<float, 8, 8> O[NDT];
  for (int n = 0; n < NDT; ++n) {
    O[n] = simdgroup_matrix<float, 8, 8>(0.0f);
  }
  float m_i = -FLT_MAX;
  float l_i = 0.0f;

  for (int j = 0; j < ntiles; ++j) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int id = tid; id < BC * D; id += NT) {
      const int kk = id / D;
      const int d = id % D;
      const int t = j * BC + kk;
      KVs[kk * LD + d] = t < Tn ? kbase[int64_t(t) * k_strides[2] + int64_t(d) * k_strides[3]] : T(0);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    simdgroup_matrix<float, 8, 8> S[2];
    S[0] = simdgroup_matrix<float, 8, 8>(0.0f);
    S[1] = simdgroup_matrix<float, 8, 8>(0.0f);
    for (int ds = 0; ds < NDT; ++ds) {
      simdgroup_matrix<float, 8, 8> Qf;
      Qf.thread_elements()[0] = static_cast<float>(Qs[srow * LD + 8 * ds + fn]);
      Qf.thread_elements()[1] = static_cast<float>(Qs[srow * LD + 8 * ds + fn + 1]);
      for (int n = 0; n < 2; ++n) {
        // B = K^T: B[dim fm][key fn], B[dim fm][key fn+1].
        simdgroup_matrix<float, 8, 8> Kf;
        Kf.thread_elements()[0] = static_cast<float>(KVs[(8 * n + fn) * LD + 8 * ds + fm]);
        Kf.thread_elements()[1] = static_cast<float>(KVs[(8 * n + fn + 1) * LD + 8 * ds + fm]);
        simdgroup_multiply_accumulate(S[n], Qf, Kf, S[n]);
      }
    }

    // Online softmax on row fm (held by the 4 lanes differing in lane bits 0 and 3).
    float sv[2][2];
    bool ok[2][2];
    float mx = -FLT_MAX;
    for (int n = 0; n < 2; ++n) {
      for (int e = 0; e < 2; ++e) {
        const int t = j * BC + 8 * n + fn + e;
        ok[n][e] = t < Tn && (!CAUSAL || t <= pos);
        sv[n][e] = S[n].thread_elements()[e] * sl;
        if (ok[n][e]) {
          mx = metal::max(mx, sv[n][e]);
        }
      }
    }
    mx = metal::max(mx, simd_shuffle_xor(mx, ushort(1)));
    mx = metal::max(mx, simd_shuffle_xor(mx, ushort(8)));
    const float m_new = metal::max(m_i, mx);
    const float alpha = metal::exp2(m_i - m_new);
    m_i = m_new;
    l_i *= alpha;
    simdgroup_matrix<float, 8, 8> P[2];
    for (int n = 0; n < 2; ++n) {
      for (int e = 0; e < 2; ++e) {
        const float p = ok[n][e] ? metal::exp2(sv[n][e] - m_new) : 0.0f;
        l_i += p;
        P[n].thread_elements()[e] = p;
      }
    }
    for (int n = 0; n < NDT; ++n) {
      O[n].thread_elements()[0] *= alpha;
      O[n].thread_elements()[1] *= alpha;
    }

    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int id = tid; id < BC * D; id += NT) {
      const int kk = id / D;
      const int d = id % D;
      const int t = j * BC + kk;
      KVs[kk * LD + d] = t < Tn ? vbase[int64_t(t) * v_strides[2] + int64_t(d) * v_strides[3]] : T(0);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    for (int dt = 0; dt < NDT; ++dt) {
      for (int n = 0; n < 2; ++n) {
        // B = V: B[key fm][dim fn], B[key fm][dim fn+1].
        simdgroup_matrix<float, 8, 8> Vf;
        Vf.thread_elements()[0] = static_cast<float>(KVs[(8 * n + fm) * LD + 8 * dt + fn]);
        Vf.thread_elements()[1] = static_cast<float>(KVs[(8 * n + fm) * LD + 8 * dt + fn + 1]);
        simdgroup_multiply_accumulate(O[dt], P[n], Vf, O[dt]);
      }
    }
  }

  l_i += simd_shuffle_xor(l_i, ushort(1));
  l_i += simd_shuffle_xor(l_i, ushort(8));
  if (row < R) {
    const int i = row / G;
    const int hq = kvh * G + row % G;
    const float inv = 1.0f / l_i;
    device T* dst = out + ((int64_t(b) * L + i) * HQ + hq) * D;
    auto gp = gate + int64_t(b) * gate_strides[0] + int64_t(i) * gate_strides[1] +
                         int64_t(hq) * gate_strides[2];
    for (int n = 0; n < NDT; ++n) {
      for (int e = 0; e < 2; ++e) {
        const int d = 8 * n + fn + e;
        T res = static_cast<T>(O[n].thread_elements()[e] * inv);
        if (GATED) {
          const float gv = static_cast<float>(gp[int64_t(d) * gate_strides[3]]);
          const T sgt = static_cast<T>(1.0f / (1.0f + metal::exp(-gv)));
          res = static_cast<T>(static_cast<float>(res) * static_cast<float>(sgt));
        }
        dst[d] = res;
      }
    }
  }
