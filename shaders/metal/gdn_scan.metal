// @kernel lily_gdn_scan
// @inputs qn[B,T,Hk,Dk]:float32 kn[B,T,Hk,Dk]:float32 vv[B,T,Hv,Dv] g[B,T,Hv]:float32 beta[B,T,Hv]:float32 (contiguous, from lily_gdn_prep) state[B,Hv,Dv,Dk]:float32 (read through state_strides; T = qn_shape[1])
// @outputs y[B,T,Hv,Dv]:T state_out[B,Hv,Dv,Dk]:float32
// @template T=bfloat16 Hk=16 Hv=32 Dk=128 Dv=128 LPR=8 RPL=2 WPB=4
// @template T=float16 Hk=2 Hv=4 Dk=128 Dv=128 LPR=16 RPL=1 WPB=4
// @grid (32*WPB, Dv / (WPB*(32/LPR)*RPL), B*Hv)
// @threadgroup (32*WPB, 1, 1)
// @ensure_row_contiguous false
// Register-resident sequential scan. LPR lanes share RPL state rows; each lane keeps
// Dk/LPR contiguous columns of those rows in registers for the whole sequence (read
// once, written once). One reduction round per step: with the old state S,
//   kv = g (S k), y = g (S q) + delta (k . q), delta = (v - kv) beta, S' = g S + delta k^T
// (algebraically S' q with S' = g S + delta k^T). The next step's raw inputs are loaded
// one iteration ahead.

template <int E>
inline void lily_ld4(const device float* p, thread float (&o)[E]) {
  for (int i = 0; i < E; ++i) {
    o[i] = p[i];
  }
}

// ---- body ----
  constexpr int E = Dk / LPR;            // columns per lane
  constexpr int GPW = 32 / LPR;          // row groups per simdgroup
  constexpr int RB = WPB * GPW * RPL;    // rows per threadgroup
  constexpr int G = Hv / Hk;

  const int T_ = qn_shape[1];
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
      s[i][j] = state[sb + (r0 + i) * state_strides[2] + (li * E + j) * state_strides[3]];
    }
  }

  constexpr int QK_STEP = Hk * Dk;
  constexpr int V_STEP = Hv * Dv;
  auto qp = qn + (int64_t(bi) * T_ * Hk + hk) * Dk + li * E;
  auto kp = kn + (int64_t(bi) * T_ * Hk + hk) * Dk + li * E;
  auto vp = vv + (int64_t(bi) * T_ * Hv + h) * Dv + r0;
  auto gp = g + int64_t(bi) * T_ * Hv + h;
  auto bp = beta + int64_t(bi) * T_ * Hv + h;
  auto yp = y + (int64_t(bi) * T_ * Hv + h) * Dv + r0;

  // raw inputs of the next step, loaded one iteration ahead; converted at its start
  float kr[E], qr[E];
  T vr[RPL];
  float gr = 0.0f, br = 0.0f;
  if (T_ > 0) {
    lily_ld4<E>(kp, kr);
    lily_ld4<E>(qp, qr);
    for (int i = 0; i < RPL; ++i) {
      vr[i] = vp[i];
    }
    gr = gp[0];
    br = bp[0];
  }

  for (int t = 0; t < T_; ++t) {
    float kc[E], qc[E], vc[RPL];
    for (int j = 0; j < E; ++j) {
      kc[j] = kr[j];
      qc[j] = qr[j];
    }
    for (int i = 0; i < RPL; ++i) {
      vc[i] = static_cast<float>(vr[i]);
    }
    const float gc = gr, bc = br;
    if (t + 1 < T_) {
      const int64_t o = int64_t(t + 1);
      lily_ld4<E>(kp + o * QK_STEP, kr);
      lily_ld4<E>(qp + o * QK_STEP, qr);
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

  const int64_t ob = (int64_t(n) * Dv + r0) * Dk + li * E;
  for (int i = 0; i < RPL; ++i) {
    for (int j = 0; j < E; ++j) {
      state_out[ob + i * Dk + j] = s[i][j];
    }
  }
