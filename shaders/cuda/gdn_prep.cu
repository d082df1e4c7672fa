// @kernel lily_gdn_prep
// @inputs qkv[B,T,C] conv_w[C,KS,1] conv_state[B,KS-1,C] a[B,T,Hv] b[B,T,Hv] A_log[Hv] dt_bias[Hv] mask[B,T]:bool lengths[B]:int32 (all read through *_strides; T = qkv_shape[1]; mask/lengths read only when HAS_MASK/HAS_LEN)
// @outputs qn[B,T,Hk,D]:float32 kn[B,T,Hk,D]:float32 vv[B,T,Hv,D]:T g[B,T,Hv]:float32 beta[B,T,Hv]:float32 conv_out[B,KS-1,C]:T
// @template T=bfloat16 Hk=16 Hv=32 D=128 KS=4 TT=16 HAS_MASK=false HAS_LEN=false
// @template T=float32 Hk=2 Hv=4 D=128 KS=4 TT=16 HAS_MASK=true HAS_LEN=true
// @grid (D * (2*Hk+Hv) * ceil(T/TT), B, 1)
// @threadgroup (D, 1, 1)
// @ensure_row_contiguous false
// Prefill front end: one threadgroup per (head slot, tile of TT time steps, batch); a
// thread per channel runs the causal conv over the tile with a sliding window, SiLU,
// then l2norm (q, k slots; threadgroup reduction per step) or the gates (v slots).
// Masked rows (HAS_MASK) enter the conv as zeros and get g = 1, beta = 0 (the scan then
// leaves the state unchanged); HAS_LEN takes the new conv state at min(lengths, T).
// Rounding points as in mlx-lm (see gdn_decode). CUDA twin of shaders/metal/gdn_prep.metal.

// @header gdn_common.cuh
// ---- body ----
  constexpr int NS = 2 * Hk + Hv;     // head slots: q heads, k heads, v heads
  constexpr int C = NS * D;
  constexpr int NWP = D / 32;

  const int T_ = qkv_shape[1];
  const int tid = int(threadIdx.x);
  const int lane = int(threadIdx.x) & 31;
  const int warp = int(threadIdx.x) >> 5;
  const int slot = int(blockIdx.x) % NS;
  const int tile = int(blockIdx.x) / NS;
  const int bi = int(blockIdx.y);
  const int c = slot * D + tid;
  const int t0 = tile * TT;

  __shared__ float red[2][NWP];

#define lily_live(tt) (!HAS_MASK || bool(mask[int64_t(bi) * mask_strides[0] + int64_t(tt) * mask_strides[1]]))

  const int64_t xb0 = int64_t(bi) * qkv_strides[0] + int64_t(c) * qkv_strides[2];
  const int64_t cs0 = int64_t(bi) * conv_state_strides[0] + int64_t(c) * conv_state_strides[2];
  float w[KS];
  for (int j = 0; j < KS; ++j) {
    w[j] = static_cast<float>(conv_w[int64_t(c) * conv_w_strides[0] + j * conv_w_strides[1]]);
  }
  // window: raw inputs at times t0-KS+1 .. t0-1 (negative times from conv_state)
  float xw[KS];
  for (int j = 0; j < KS - 1; ++j) {
    const int tt = t0 - (KS - 1) + j;
    xw[j] = tt >= 0 ? (lily_live(tt) ? static_cast<float>(qkv[xb0 + int64_t(tt) * qkv_strides[1]]) : 0.0f)
                    : static_cast<float>(conv_state[cs0 + (KS - 1 + tt) * conv_state_strides[1]]);
  }

  // new conv state: rows end .. end+KS-2 of concat(conv_state, masked qkv)
  if (tile == 0) {
    int end = T_;
    if (HAS_LEN) {
      const int len = int(lengths[int64_t(bi) * lengths_strides[0]]);
      end = len < 0 ? 0 : (len > T_ ? T_ : len);
    }
    for (int j = 0; j < KS - 1; ++j) {
      const int pos = end + j;
      const int64_t o = (int64_t(bi) * (KS - 1) + j) * C + c;
      conv_out[o] = pos < KS - 1 ? conv_state[cs0 + pos * conv_state_strides[1]]
                  : (lily_live(pos - (KS - 1)) ? qkv[xb0 + int64_t(pos - (KS - 1)) * qkv_strides[1]]
                                               : static_cast<T>(0.0f));
    }
  }

  const float qk_eps = 1e-6f / float(D);
  const float scale = slot < Hk ? lily_rnd<T>(1.0f / float(D))
                                : lily_rnd<T>(rsqrtf(float(D)));
  const int h = slot - 2 * Hk;
  float A = 0.0f, dtb = 0.0f;
  if (slot >= 2 * Hk) {
    A = expf(static_cast<float>(A_log[h * A_log_strides[0]]));
    dtb = static_cast<float>(dt_bias[h * dt_bias_strides[0]]);
  }

  for (int k = 0; k < TT; ++k) {
    const int t = t0 + k;
    if (t >= T_) {
      break;
    }
    xw[KS - 1] = lily_live(t) ? static_cast<float>(qkv[xb0 + int64_t(t) * qkv_strides[1]]) : 0.0f;
    float acc = 0.0f;
    for (int j = 0; j < KS; ++j) {
      acc += w[j] * xw[j];
    }
    for (int j = 0; j < KS - 1; ++j) {
      xw[j] = xw[j + 1];
    }
    const float xb = lily_rnd<T>(acc);
    const float y = lily_rnd<T>(xb * lily_rnd<T>(lily_sigmoid(xb)));
    const int64_t row = int64_t(bi) * T_ + t;
    if (slot < 2 * Hk) {
      const float p = lily_warp_sum(y * y);
      if (lane == 0) {
        red[k & 1][warp] = p;
      }
      __syncthreads();
      float ss = 0.0f;
      for (int i = 0; i < NWP; ++i) {
        ss += red[k & 1][i];
      }
      const float r = rsqrtf(ss / float(D) + qk_eps);
      const float o = lily_rnd<T>(lily_rnd<T>(y * r) * scale);  // T values, stored as fp32
      if (slot < Hk) {
        qn[(row * Hk + slot) * D + tid] = o;
      } else {
        kn[(row * Hk + (slot - Hk)) * D + tid] = o;
      }
    } else {
      vv[(row * Hv + h) * D + tid] = static_cast<T>(y);
      if (tid == 0) {
        const float bb = static_cast<float>(b[int64_t(bi) * b_strides[0] + int64_t(t) * b_strides[1] + h * b_strides[2]]);
        const float aa = static_cast<float>(a[int64_t(bi) * a_strides[0] + int64_t(t) * a_strides[1] + h * a_strides[2]]);
        const bool live = lily_live(t);
        beta[row * Hv + h] = live ? lily_sigmoid(bb) : 0.0f;
        const float sp = lily_softplus(aa + dtb);
        g[row * Hv + h] = live ? expf(-A * sp) : 1.0f;
      }
    }
  }
#undef lily_live
