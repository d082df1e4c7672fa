// @kernel lily_gdn_scan
// @inputs qn[B,T,Hk,Dk]:float32 kn[B,T,Hk,Dk]:float32 vv[B,T,Hv,Dv] g[B,T,Hv]:float32 beta[B,T,Hv]:float32 (contiguous, from lily_gdn_prep) state[B,Hv,Dv,Dk]:float32 (read through state_strides; T = qn_shape[1])
// @outputs y[B,T,Hv,Dv]:T state_out[B,Hv,Dv,Dk]:float32
// @template T=bfloat16 Hk=16 Hv=32 Dk=128 Dv=128 LPR=8 RPL=2 WPB=4
// @template T=float16 Hk=2 Hv=4 Dk=128 Dv=128 LPR=16 RPL=1 WPB=4
// @grid (32*WPB, Dv / (WPB*(32/LPR)*RPL), B*Hv)
// @threadgroup (32*WPB, 1, 1)
// @ensure_row_contiguous false
// CUDA twin of shaders/metal/gdn_scan.metal (register-resident sequential scan, one
// warp-shuffle reduction round per step). q/k arrive as fp32 (bf16-rounded values; no
// conversions in the loop). The block's warps all serve one head, so q/k of TS steps at a
// time are staged in shared memory by the whole block (double-buffered: the next stage's
// 16-byte loads are issued before the current stage's steps and stored after them, one
// barrier per stage); lane li of a group reads the 16-byte chunks li, li + LPR, ... of
// the Dk columns (conflict-free), so its state columns are those chunks' too. v, the gate
// and beta of the next PF steps are held in a register ring, PF from the registers a
// step takes (the Metal twin loads one step ahead).

// Column of element j of a lane's E state columns: 16-byte chunks strided by LPR lanes
// when E is a multiple of 4, else a contiguous run.
template <int E, int LPR>
__device__ __forceinline__ int lily_scan_col(int li, int j) {
  if constexpr ((E % 4) == 0) {
    return ((j / 4) * LPR + li) * 4 + (j % 4);
  } else {
    return li * E + j;
  }
}

// ---- body ----
  constexpr int E = Dk / LPR;
  constexpr int GPW = 32 / LPR;
  constexpr int RB = WPB * GPW * RPL;
  constexpr int G = Hv / Hk;
  constexpr int NT = 32 * WPB;
  // steps per stage: ~32 staged floats per thread, at most 32 KiB of shared memory
  constexpr int TS0 = (16 * NT) / Dk;
  constexpr int TS1 = TS0 > 2048 / Dk ? 2048 / Dk : TS0;
  constexpr int TS = TS1 < 1 ? 1 : (TS1 > 32 ? 32 : TS1);
  constexpr int SV4 = TS * 2 * Dk / 4;  // float4s per stage (k then q per step)
  constexpr int PT = (SV4 + NT - 1) / NT;
  static_assert(Dk % 4 == 0, "gdn_scan: Dk must be a multiple of 4");
  __shared__ float4 kq_s[2 * SV4];

  const int T_ = qn_shape[1];
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int gi = lane / LPR;
  const int li = lane % LPR;
  const int n = blockIdx.z;
  const int bi = n / Hv;
  const int h = n % Hv;
  const int hk = h / G;
  const int r0 = blockIdx.y * RB + (warp * GPW + gi) * RPL;

  float s[RPL][E];
  const int64_t sb = int64_t(bi) * state_strides[0] + int64_t(h) * state_strides[1];
#pragma unroll
  for (int i = 0; i < RPL; ++i) {
#pragma unroll
    for (int j = 0; j < E; ++j) {
      s[i][j] = state[sb + (r0 + i) * state_strides[2] +
                      lily_scan_col<E, LPR>(li, j) * state_strides[3]];
    }
  }

  constexpr int QK_STEP = Hk * Dk;
  constexpr int V_STEP = Hv * Dv;
  const float* qbase = qn + (int64_t(bi) * T_ * Hk + hk) * Dk;
  const float* kbase = kn + (int64_t(bi) * T_ * Hk + hk) * Dk;
  const T* vp = vv + (int64_t(bi) * T_ * Hv + h) * Dv + r0;
  const float* gp = g + int64_t(bi) * T_ * Hv + h;
  const float* bp = beta + int64_t(bi) * T_ * Hv + h;
  T* yp = y + (int64_t(bi) * T_ * Hv + h) * Dv + r0;

  // stage loads: float4 f of a stage is step f / (Dk/2), k (first Dk/4) or q, chunk
  float4 st[PT];
  auto stage_load = [&](int t0) {
#pragma unroll
    for (int p = 0; p < PT; ++p) {
      const int f = tid + p * NT;
      const int u = f / (Dk / 2);
      const int c = f % (Dk / 2);
      const int t = t0 + u;
      if (f < SV4 && t < T_) {
        const float* src = (c < Dk / 4 ? kbase : qbase) + int64_t(t) * QK_STEP;
        st[p] = reinterpret_cast<const float4*>(src)[c % (Dk / 4)];
      }
    }
  };
  auto stage_store = [&](int buf) {
#pragma unroll
    for (int p = 0; p < PT; ++p) {
      const int f = tid + p * NT;
      if (f < SV4) kq_s[buf * SV4 + f] = st[p];
    }
  };

  // v, gate and beta of the next PF steps in a register ring (step t in slot t % PF; PF
  // divides TS, so the slot is known at compile time in the unrolled stage loop)
  constexpr int PF = TS % 8 == 0 ? 8 : (TS % 4 == 0 ? 4 : (TS % 2 == 0 ? 2 : 1));
  float gr[PF], br[PF];
  T vr[PF][RPL];
#pragma unroll
  for (int u = 0; u < PF; ++u) {
    if (u < T_) {
#pragma unroll
      for (int i = 0; i < RPL; ++i) vr[u][i] = vp[int64_t(u) * V_STEP + i];
      gr[u] = gp[int64_t(u) * Hv];
      br[u] = bp[int64_t(u) * Hv];
    }
  }

  stage_load(0);
  stage_store(0);
  __syncthreads();
  for (int t0 = 0; t0 < T_; t0 += TS) {
    const int buf = (t0 / TS) & 1;
    if (t0 + TS < T_) stage_load(t0 + TS);
    const float* ks = reinterpret_cast<const float*>(kq_s + buf * SV4);
#pragma unroll
    for (int u = 0; u < TS; ++u) {
      const int t = t0 + u;
      if (t >= T_) break;  // T_ is the same for every lane
      const int slot = u % PF;
      float kc[E], qc[E];
#pragma unroll
      for (int j = 0; j < E; j += 4) {
        const int c = lily_scan_col<E, LPR>(li, j);
        if constexpr ((E % 4) == 0) {
          const float4 kv = *reinterpret_cast<const float4*>(ks + u * 2 * Dk + c);
          const float4 qv = *reinterpret_cast<const float4*>(ks + u * 2 * Dk + Dk + c);
          kc[j] = kv.x; kc[j + 1] = kv.y; kc[j + 2] = kv.z; kc[j + 3] = kv.w;
          qc[j] = qv.x; qc[j + 1] = qv.y; qc[j + 2] = qv.z; qc[j + 3] = qv.w;
        } else {
#pragma unroll
          for (int e = j; e < E && e < j + 4; ++e) {
            kc[e] = ks[u * 2 * Dk + lily_scan_col<E, LPR>(li, e)];
            qc[e] = ks[u * 2 * Dk + Dk + lily_scan_col<E, LPR>(li, e)];
          }
        }
      }
      float vc[RPL];
#pragma unroll
      for (int i = 0; i < RPL; ++i) vc[i] = static_cast<float>(vr[slot][i]);
      const float gc = gr[slot], bc = br[slot];

      float pkq = 0.0f;
      float pk[RPL], py[RPL];
#pragma unroll
      for (int j = 0; j < E; ++j) {
        pkq += kc[j] * qc[j];
      }
#pragma unroll
      for (int i = 0; i < RPL; ++i) {
        float ak = 0.0f, ay = 0.0f;
#pragma unroll
        for (int j = 0; j < E; ++j) {
          ak += s[i][j] * kc[j];
          ay += s[i][j] * qc[j];
        }
        pk[i] = ak;
        py[i] = ay;
      }
#pragma unroll
      for (int m = 1; m < LPR; m <<= 1) {
        pkq += __shfl_xor_sync(0xffffffffu, pkq, m);
#pragma unroll
        for (int i = 0; i < RPL; ++i) {
          pk[i] += __shfl_xor_sync(0xffffffffu, pk[i], m);
          py[i] += __shfl_xor_sync(0xffffffffu, py[i], m);
        }
      }
#pragma unroll
      for (int i = 0; i < RPL; ++i) {
        const float delta = (vc[i] - gc * pk[i]) * bc;
        const float yy = gc * py[i] + delta * pkq;
#pragma unroll
        for (int j = 0; j < E; ++j) {
          s[i][j] = fmaf(gc, s[i][j], delta * kc[j]);
        }
        if (li == i % LPR) {
          yp[int64_t(t) * V_STEP + i] = static_cast<T>(yy);
        }
      }
      if (t + PF < T_) {  // refill the slot just read, after its last read
#pragma unroll
        for (int i = 0; i < RPL; ++i) vr[slot][i] = vp[int64_t(t + PF) * V_STEP + i];
        gr[slot] = gp[int64_t(t + PF) * Hv];
        br[slot] = bp[int64_t(t + PF) * Hv];
      }
    }
    if (t0 + TS < T_) {
      stage_store(buf ^ 1);
    }
    __syncthreads();
  }

  const int64_t ob = (int64_t(n) * Dv + r0) * Dk;
#pragma unroll
  for (int i = 0; i < RPL; ++i) {
#pragma unroll
    for (int j = 0; j < E; ++j) {
      state_out[ob + i * Dk + lily_scan_col<E, LPR>(li, j)] = s[i][j];
    }
  }
