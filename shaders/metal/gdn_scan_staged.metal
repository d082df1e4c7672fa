// @kernel lily_gdn_scan_staged
// @inputs qn[B,T,Hk,Dk]:float32 kn[B,T,Hk,Dk]:float32 vv[B,T,Hv,Dv] g[B,T,Hv]:float32 beta[B,T,Hv]:float32 (contiguous, from lily_gdn_prep) state[B,Hv,Dv,Dk]:float32 (read through state_strides; T = qn_shape[1])
// @outputs y[B,T,Hv,Dv]:T state_out[B,Hv,Dv,Dk]:float32
// @template T=bfloat16 Hk=16 Hv=32 Dk=128 Dv=128 LPR=8 RPL=1 WPB=4
// @template T=float16 Hk=2 Hv=4 Dk=128 Dv=128 LPR=16 RPL=1 WPB=4
// @grid (32*WPB, Dv / (WPB*(32/LPR)*RPL), B*Hv)
// @threadgroup (32*WPB, 1, 1)
// @ensure_row_contiguous false
// lily_gdn_scan with q/k staged in threadgroup memory (the CUDA twin's pattern,
// shaders/cuda/gdn_scan.cu): the threadgroup's simdgroups all serve one head, so q/k of TS
// steps at a time are read once by the whole threadgroup in 16-byte words (double-buffered:
// the next stage's loads are issued before the current stage's steps and stored after
// them, one threadgroup barrier per stage), instead of by every lane group from device
// memory. Lane li of a group reads the 16-byte chunks li, li + LPR, ... of the Dk columns,
// so its state columns are those chunks' too. v, the gate and beta are loaded one step
// ahead, as in lily_gdn_scan. Same launch contract and recurrence; only the order of each
// lane's partial sums differs.
// Static cost (Qwen3.6-35B-A3B, a 2048-token prefill chunk, B 1, LPR 8 RPL 1 WPB 4):
// 8 x 32 = 256 threadgroups of 128 threads; each reads its key head's q/k (2 MB) once into
// threadgroup memory, 512 MB over the grid mostly from cache (lily_gdn_scan: each of a
// threadgroup's 16 lane groups reads them, 8 GB); unique bytes q/k 32 MB, v 16 MB, gates
// 0.5 MB, state 2 MB read + 2 MB written, y 16 MB written; threadgroup memory 2 stages x
// 8 steps x 2 x 128 fp32 = 16 KiB.

// Column of element j of a lane's state columns: 16-byte chunks strided by LPR lanes.
template <int LPR>
inline int lily_scan_col(int li, int j) {
  return ((j / 4) * LPR + li) * 4 + (j % 4);
}

// ---- body ----
  constexpr int E = Dk / LPR;            // columns per lane
  constexpr int GPW = 32 / LPR;          // row groups per simdgroup
  constexpr int RB = WPB * GPW * RPL;    // rows per threadgroup
  constexpr int G = Hv / Hk;
  constexpr int NT = 32 * WPB;
  // steps per stage: ~16 staged floats per thread, at most 8 steps (16 KiB at Dk 128)
  constexpr int TS0 = (16 * NT) / (2 * Dk);
  constexpr int TS1 = TS0 > 8 ? 8 : TS0;
  constexpr int TS = TS1 < 1 ? 1 : TS1;
  constexpr int SV4 = TS * 2 * Dk / 4;   // float4s per stage (k then q per step)
  constexpr int PT = (SV4 + NT - 1) / NT;
  static_assert(E % 4 == 0, "gdn_scan_staged: Dk / LPR must be a multiple of 4");
  static_assert(2 * SV4 * 16 <= 32768, "gdn_scan_staged: threadgroup memory over 32 KiB");
  threadgroup float4 kq_s[2 * SV4];

  const int T_ = qn_shape[1];
  const int tid = int(thread_position_in_threadgroup.x);
  const int lane = int(thread_index_in_simdgroup);
  const int warp = int(simdgroup_index_in_threadgroup);
  const int gi = lane / LPR;
  const int li = lane % LPR;
  const int n = int(threadgroup_position_in_grid.z);
  const int bi = n / Hv;
  const int h = n % Hv;
  const int hk = h / G;
  const int r0 = int(threadgroup_position_in_grid.y) * RB + (warp * GPW + gi) * RPL;

  float s[RPL][E];
  const int64_t sb = int64_t(bi) * state_strides[0] + int64_t(h) * state_strides[1];
  for (int i = 0; i < RPL; ++i) {
    for (int j = 0; j < E; ++j) {
      s[i][j] = state[sb + (r0 + i) * state_strides[2] +
                      lily_scan_col<LPR>(li, j) * state_strides[3]];
    }
  }

  constexpr int QK_STEP = Hk * Dk;
  constexpr int V_STEP = Hv * Dv;
  // qn / kn are device buffers: S > 1 rows of Hk * Dk floats (never MLX's constant inputs)
  const device float* qbase = qn + (int64_t(bi) * T_ * Hk + hk) * Dk;
  const device float* kbase = kn + (int64_t(bi) * T_ * Hk + hk) * Dk;
  auto vp = vv + (int64_t(bi) * T_ * Hv + h) * Dv + r0;
  auto gp = g + int64_t(bi) * T_ * Hv + h;
  auto bp = beta + int64_t(bi) * T_ * Hv + h;
  auto yp = y + (int64_t(bi) * T_ * Hv + h) * Dv + r0;

  // stage loads: float4 f of a stage is step f / (Dk/2), chunk f % (Dk/2) (k, then q)
  float4 st[PT];
  for (int p = 0; p < PT; ++p) {
    const int f = tid + p * NT;
    const int u = f / (Dk / 2);
    const int c = f % (Dk / 2);
    if (f < SV4 && u < T_) {
      const device float* src = (c < Dk / 4 ? kbase : qbase) + int64_t(u) * QK_STEP;
      st[p] = reinterpret_cast<const device float4*>(src)[c % (Dk / 4)];
    }
  }
  for (int p = 0; p < PT; ++p) {
    const int f = tid + p * NT;
    if (f < SV4 && f / (Dk / 2) < T_) {
      kq_s[f] = st[p];
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  T vr[RPL];
  float gr = 0.0f, br = 0.0f;
  if (T_ > 0) {
    for (int i = 0; i < RPL; ++i) {
      vr[i] = vp[i];
    }
    gr = gp[0];
    br = bp[0];
  }

  for (int t0 = 0; t0 < T_; t0 += TS) {
    const int buf = (t0 / TS) & 1;
    if (t0 + TS < T_) {
      for (int p = 0; p < PT; ++p) {
        const int f = tid + p * NT;
        const int u = f / (Dk / 2);
        const int c = f % (Dk / 2);
        const int t = t0 + TS + u;
        if (f < SV4 && t < T_) {
          const device float* src = (c < Dk / 4 ? kbase : qbase) + int64_t(t) * QK_STEP;
          st[p] = reinterpret_cast<const device float4*>(src)[c % (Dk / 4)];
        }
      }
    }
    for (int u = 0; u < TS; ++u) {
      const int t = t0 + u;
      if (t >= T_) {
        break;  // T_ is the same for every thread
      }
      float kc[E], qc[E];
      for (int j = 0; j < E; j += 4) {
        const int c4 = (u * 2 * Dk + lily_scan_col<LPR>(li, j)) / 4;
        const float4 kv = kq_s[buf * SV4 + c4];
        const float4 qv = kq_s[buf * SV4 + c4 + Dk / 4];
        kc[j] = kv.x;
        kc[j + 1] = kv.y;
        kc[j + 2] = kv.z;
        kc[j + 3] = kv.w;
        qc[j] = qv.x;
        qc[j + 1] = qv.y;
        qc[j + 2] = qv.z;
        qc[j + 3] = qv.w;
      }
      float vc[RPL];
      for (int i = 0; i < RPL; ++i) {
        vc[i] = static_cast<float>(vr[i]);
      }
      const float gc = gr, bc = br;
      if (t + 1 < T_) {
        const int64_t o = int64_t(t + 1);
        for (int i = 0; i < RPL; ++i) {
          vr[i] = vp[o * V_STEP + i];
        }
        gr = gp[o * Hv];
        br = bp[o * Hv];
      }

      float pkq = 0.0f;
      float pk[RPL], py[RPL];
      for (int j = 0; j < E; ++j) {
        pkq += kc[j] * qc[j];
      }
      for (int i = 0; i < RPL; ++i) {
        float ak = 0.0f, ay = 0.0f;
        for (int j = 0; j < E; ++j) {
          ak += s[i][j] * kc[j];
          ay += s[i][j] * qc[j];
        }
        pk[i] = ak;
        py[i] = ay;
      }
      for (int m = 1; m < LPR; m <<= 1) {
        pkq += simd_shuffle_xor(pkq, ushort(m));
        for (int i = 0; i < RPL; ++i) {
          pk[i] += simd_shuffle_xor(pk[i], ushort(m));
          py[i] += simd_shuffle_xor(py[i], ushort(m));
        }
      }
      for (int i = 0; i < RPL; ++i) {
        const float delta = (vc[i] - gc * pk[i]) * bc;
        const float yy = gc * py[i] + delta * pkq;
        for (int j = 0; j < E; ++j) {
          s[i][j] = metal::fma(gc, s[i][j], delta * kc[j]);
        }
        if (li == i % LPR) {
          yp[int64_t(t) * V_STEP + i] = static_cast<T>(yy);
        }
      }
    }
    if (t0 + TS < T_) {
      for (int p = 0; p < PT; ++p) {
        const int f = tid + p * NT;
        if (f < SV4 && t0 + TS + f / (Dk / 2) < T_) {
          kq_s[(buf ^ 1) * SV4 + f] = st[p];
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  const int64_t ob = (int64_t(n) * Dv + r0) * Dk;
  for (int i = 0; i < RPL; ++i) {
    for (int j = 0; j < E; ++j) {
      state_out[ob + i * Dk + lily_scan_col<LPR>(li, j)] = s[i][j];
    }
  }
