// @kernel lily_gdn_norm
// @inputs y[B,T,Hv,Dv] (contiguous) z[B,T,Hv,Dv] norm_w[Dv] eps[1]:float32 (z, norm_w read through *_strides)
// @outputs out[B,T,Hv*Dv]:T
// @template T=bfloat16 Hv=32 Dv=128 RPB=4
// @grid (32*RPB*ceil(B*T*Hv/RPB), 1, 1)
// @threadgroup (32*RPB, 1, 1)
// @ensure_row_contiguous false
// Gated RMSNorm of the scan output, one simdgroup per (b, t, v-head) row:
// out = silu(z) * T(T(y * rsqrt(mean(y^2) + eps)) * w), statistics in fp32.

// @header gdn_common.h
// ---- body ----
  constexpr int NC = Dv / 32;
  const int T_ = y_shape[1];
  const int64_t N = int64_t(y_shape[0]) * T_ * Hv;
  const int lane = int(thread_index_in_simdgroup);
  const int64_t row = int64_t(threadgroup_position_in_grid.x) * RPB + int(simdgroup_index_in_threadgroup);
  if (row < N) {
    const int h = int(row % Hv);
    const int64_t bt = row / Hv;
    const int64_t bi = bt / T_;
    const int64_t t = bt % T_;
    const int64_t zb = bi * z_strides[0] + t * z_strides[1] + h * z_strides[2];
    float yv[NC];
    float ss = 0.0f;
    for (int j = 0; j < NC; ++j) {
      yv[j] = static_cast<float>(y[row * Dv + lane + 32 * j]);
      ss += yv[j] * yv[j];
    }
    ss = lily_warp_sum(ss);
    const float rstd = metal::precise::rsqrt(ss / float(Dv) + eps[0]);
    for (int j = 0; j < NC; ++j) {
      const int c = lane + 32 * j;
      const float nw = lily_rnd<T>(lily_rnd<T>(yv[j] * rstd) *
                                   static_cast<float>(norm_w[c * norm_w_strides[0]]));
      const float zf = static_cast<float>(z[zb + c * z_strides[3]]);
      out[row * Dv + c] = static_cast<T>(zf * lily_sigmoid(zf) * nw);
    }
  }
