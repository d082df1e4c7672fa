// @kernel lily_gdn_scan
// @inputs qn[B,T,Hk,Dk]:float32 kn[B,T,Hk,Dk]:float32 vv[B,T,Hv,Dv] g[B,T,Hv]:float32 beta[B,T,Hv]:float32 (contiguous, from lily_gdn_prep) state[B,Hv,Dv,Dk]:float32 (read through state_strides; T = qn_shape[1])
// @outputs y[B,T,Hv,Dv]:T state_out[B,Hv,Dv,Dk]:float32
// @template T=bfloat16 Hk=16 Hv=32 Dk=128 Dv=128 LPR=8 RPL=2 WPB=4
// @template T=float16 Hk=2 Hv=4 Dk=128 Dv=128 LPR=16 RPL=1 WPB=4
// @grid (32*WPB, Dv / (WPB*(32/LPR)*RPL), B*Hv)
// @threadgroup (32*WPB, 1, 1)
// @ensure_row_contiguous false
// CUDA twin of shaders/metal/gdn_scan.metal (register-resident sequential scan, one
// warp-shuffle reduction round per step; the raw inputs of the next PF steps are held in a
// register ring, PF from the registers a step takes, where the Metal twin loads one step
// ahead). q/k arrive as fp32 (bf16-rounded values; no conversions in the loop), read
// with 16-byte loads (qn/kn are MLX allocations, lane chunks of Dk/LPR floats).

template <int E>
__device__ __forceinline__ void lily_ld4(const float* p, float (&o)[E]) {
  if constexpr ((E % 4) == 0) {
#pragma unroll
    for (int v = 0; v < E / 4; ++v) {
      const float4 x = reinterpret_cast<const float4*>(p)[v];
      o[4 * v] = x.x;
      o[4 * v + 1] = x.y;
      o[4 * v + 2] = x.z;
      o[4 * v + 3] = x.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < E; ++i) {
      o[i] = p[i];
    }
  }
}

// The raw inputs of step o into one slot of the scan's register ring: q/k (E floats per
// lane), v (RPL values), the gate and beta.
template <int E, int RPL, typename T>
__device__ __forceinline__ void lily_scan_load(const float* kp, const float* qp, const T* vp,
                                               const float* gp, const float* bp, int64_t o,
                                               int64_t qk_step, int64_t v_step, int hv,
                                               float (&kr)[E], float (&qr)[E], T (&vr)[RPL],
                                               float* gr, float* br) {
  lily_ld4<E>(kp + o * qk_step, kr);
  lily_ld4<E>(qp + o * qk_step, qr);
#pragma unroll
  for (int i = 0; i < RPL; ++i) {
    vr[i] = vp[o * v_step + i];
  }
  *gr = gp[o * hv];
  *br = bp[o * hv];
}

// ---- body ----
  constexpr int E = Dk / LPR;
  constexpr int GPW = 32 / LPR;
  constexpr int RB = WPB * GPW * RPL;
  constexpr int G = Hv / Hk;

  const int T_ = qn_shape[1];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
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
      s[i][j] = state[sb + (r0 + i) * state_strides[2] + (li * E + j) * state_strides[3]];
    }
  }

  constexpr int QK_STEP = Hk * Dk;
  constexpr int V_STEP = Hv * Dv;
  const float* qp = qn + (int64_t(bi) * T_ * Hk + hk) * Dk + li * E;
  const float* kp = kn + (int64_t(bi) * T_ * Hk + hk) * Dk + li * E;
  const T* vp = vv + (int64_t(bi) * T_ * Hv + h) * Dv + r0;
  const float* gp = g + int64_t(bi) * T_ * Hv + h;
  const float* bp = beta + int64_t(bi) * T_ * Hv + h;
  T* yp = y + (int64_t(bi) * T_ * Hv + h) * Dv + r0;

  // raw inputs of the next PF steps in a register ring (slot u holds step t0 + u): a step
  // is a short dependent chain, one step of lead does not cover an L2/DRAM round trip
  constexpr int SLOT = 2 * E + RPL + 2;  // registers per buffered step
  constexpr int PF = SLOT * 8 <= 112 ? 8 : (112 / SLOT < 1 ? 1 : 112 / SLOT);
  float kr[PF][E], qr[PF][E], gr[PF], br[PF];
  T vr[PF][RPL];
#pragma unroll
  for (int u = 0; u < PF; ++u) {
    if (u < T_) {
      lily_scan_load<E, RPL>(kp, qp, vp, gp, bp, int64_t(u), QK_STEP, V_STEP, Hv, kr[u], qr[u],
                             vr[u], gr + u, br + u);
    }
  }

  for (int t0 = 0; t0 < T_; t0 += PF) {
#pragma unroll
    for (int u = 0; u < PF; ++u) {
      const int t = t0 + u;
      if (t >= T_) break;  // T_ is the same for every lane
      // slot u is refilled at the end of the step, after its last read (refilled here,
      // ptxas copied the slot to other registers first: ~40 MOVs per step)
      const float* kc = kr[u];
      const float* qc = qr[u];
      float vc[RPL];
#pragma unroll
      for (int i = 0; i < RPL; ++i) {
        vc[i] = static_cast<float>(vr[u][i]);
      }
      const float gc = gr[u], bc = br[u];

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
      if (t + PF < T_) {
        lily_scan_load<E, RPL>(kp, qp, vp, gp, bp, int64_t(t + PF), QK_STEP, V_STEP, Hv,
                               kr[u], qr[u], vr[u], gr + u, br + u);
      }
    }
  }

  const int64_t ob = (int64_t(n) * Dv + r0) * Dk + li * E;
#pragma unroll
  for (int i = 0; i < RPL; ++i) {
#pragma unroll
    for (int j = 0; j < E; ++j) {
      state_out[ob + i * Dk + j] = s[i][j];
    }
  }
