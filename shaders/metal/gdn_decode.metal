// @kernel lily_gdn_decode
// @inputs qkv[B,1,C] z[B,1,Hv,Dv] b[B,1,Hv] a[B,1,Hv] conv_w[C,KS,1] conv_state[B,KS-1,C] A_log[Hv] dt_bias[Hv] state[B,Hv,Dv,Dk]:float32 norm_w[Dv] eps[1]:float32 mask[B,1]:bool lengths[B]:int32 hin[B,1,K] res[B,1,K] in_nw[K] in_eps[1]:float32 w[P,K*BITS/32]:uint32 scales[P,K/GS]:S biases[P,K/GS]:S counters[N]:int32 ow[K,Hv*Dv*BITS/32]:uint32 oscales[K,Hv*Dv/GS]:S obiases[K,Hv*Dv/GS]:S (all but w..obiases read through *_strides; mask/lengths read only when HAS_MASK/HAS_LEN; hin..counters only when PROJ, counters only when SPLIT > 1 or OUTP, ow..obiases only when OUTP)
// @outputs out[B,1,Hv*Dv]:T conv_out[B,KS-1,C]:T state_out[B,Hv,Dv,Dk]:float32 h_out[B,1,K]:T proj[B,Hv,2*Dk+2*Dv+2]:float32 r_out[B,1,K]:T r_parts[B,Hv,K]:float32
// @template T=bfloat16 Hk=16 Hv=32 Dk=128 Dv=128 KS=4 NW=16 HAS_MASK=false HAS_LEN=false PACKED=true PROJ=false S=bfloat16 K=32 BITS=4 GS=32 RPW=1 SPLIT=1 OUTP=false ORPW=1 BN=1
// @template T=float16 Hk=2 Hv=6 Dk=64 Dv=64 KS=3 NW=8 HAS_MASK=true HAS_LEN=true PACKED=false PROJ=false S=float16 K=32 BITS=4 GS=32 RPW=1 SPLIT=1 OUTP=false ORPW=1 BN=1
// @template T=bfloat16 Hk=16 Hv=32 Dk=128 Dv=128 KS=4 NW=16 HAS_MASK=false HAS_LEN=false PACKED=true PROJ=true S=bfloat16 K=2048 BITS=4 GS=64 RPW=4 SPLIT=1 OUTP=false ORPW=1 BN=1
// @template T=float16 Hk=2 Hv=6 Dk=64 Dv=64 KS=3 NW=8 HAS_MASK=true HAS_LEN=true PACKED=true PROJ=true S=float16 K=128 BITS=8 GS=32 RPW=2 SPLIT=1 OUTP=false ORPW=1 BN=1
// @grid (32*NW*SPLIT, ceil(B/BN)*Hv, 1)
// @threadgroup (32*NW, 1, 1)
// @ensure_row_contiguous false
// PACKED: qkv is the whole fused input projection row [B,1,C+Hv*Dv+2*Hv] = q|k|v|z|b|a
// and z, b, a are read from its columns (the z/b/a inputs are then not read).
// PROJ (with PACKED): that row is not an input: each threadgroup computes the
// P = 2*Dk+2*Dv+2 projection rows its v-head reads (q, k of its q/k head; v, z, b, a of
// its own) from x = T(in_nw * T(hh * rsqrt(mean(hh^2) + in_eps))), hh = T(hin + res), as
// lily_norm_qgemv does (w: the fused q|k|v|z|b|a weight, rows in that order), each value
// rounded to T as that kernel's output is; threadgroup (bi, 0) writes hh to h_out.
// qkv/z/b/a are then not read; the projection rows are also written to proj. The state
// is loaded after the GEMV. SPLIT (threadgroups per (batch, v-head) sharing the rows;
// counters: their arrival counts) must be 1 here: the CUDA twin's SPLIT > 1 needs a
// device-scope fence between threadgroups; so does OUTP (out_proj summed over the heads'
// threadgroups, see the CUDA twin): false here. counters, ow, oscales, obiases, r_out and
// r_parts are then unused. BN (batch rows per threadgroup, the CUDA twin's) must be 1.
// One threadgroup per (batch, v-head): conv step + SiLU + l2norm of the head's q/k/v
// channels into threadgroup memory, gates, then NW simdgroups own Dv/NW state rows each
// (lane owns columns lane + 32*j), delta-rule update in registers, gated RMSNorm.
// Activations are rounded to T where mlx-lm materialises T arrays (conv out, sigmoid
// inside SiLU, normalised q/k, y, normalised y); gates (beta, g) stay fp32 throughout.
// Batched calls: a masked row (HAS_MASK, mask false) enters the conv as zeros and leaves
// the state unchanged (g = 1, beta = 0; its output is padding); HAS_LEN takes the new
// conv state at min(lengths, 1) as mlx-lm does.

// @header gdn_common.h
// @header qgemv_common.h
// @header qgemv_norm.h

// Row of the fused q|k|v|z|b|a weight holding projection row p of v-head h (q/k head hk):
// p in [0, Dk) q, [Dk, 2Dk) k, then Dv of v, Dv of z, then b, a.
template <int Hk, int Hv, int Dk, int Dv>
inline int lily_gdn_proj_row(int p, int h, int hk) {
  constexpr int C = 2 * Hk * Dk + Hv * Dv;
  if (p < Dk) {
    return hk * Dk + p;
  }
  if (p < 2 * Dk) {
    return Hk * Dk + hk * Dk + (p - Dk);
  }
  if (p < 2 * Dk + Dv) {
    return 2 * Hk * Dk + h * Dv + (p - 2 * Dk);
  }
  if (p < 2 * Dk + 2 * Dv) {
    return C + h * Dv + (p - 2 * Dk - Dv);
  }
  return C + Hv * Dv + (p - 2 * Dk - 2 * Dv) * Hv + h;
}

// lily_add_rms_norm_row for row bi of hin/res read through their strides: xs = the
// normalised row, h_out (may be null) = T(hin + res). Every thread calls it; ends with a
// barrier.
template <typename T, int K, int NW, typename SP>
inline void lily_gdn_pending_norm(const device T* hin, const device T* res,
                                  const device T* nw, float eps, SP hs, SP rs, SP ns, int bi,
                                  device T* h_out, threadgroup T* xs, threadgroup float* red,
                                  int tid, int lane, int warp) {
  const device T* hr = hin + int64_t(bi) * hs[0];
  const device T* rr = res + int64_t(bi) * rs[0];
  if (hs[2] == 1 && rs[2] == 1 && ns[0] == 1) {
    lily_add_rms_norm_row<T, K, NW>(hr, rr, nw, eps, xs, red, h_out, (device T*)nullptr,
                                    tid, lane, warp);
    return;
  }
  float ss = 0.0f;
  for (int k = tid; k < K; k += 32 * NW) {
    const T hh = static_cast<T>(static_cast<float>(hr[k * hs[2]]) +
                                static_cast<float>(rr[k * rs[2]]));
    if (h_out) {
      h_out[k] = hh;
    }
    xs[k] = hh;
    ss += static_cast<float>(hh) * static_cast<float>(hh);
  }
  ss = lily_group_sum<32>(ss);
  if (lane == 0) {
    red[warp] = ss;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float tot = 0.0f;
  for (int i = 0; i < NW; ++i) {
    tot += red[i];
  }
  const float rinv = metal::precise::rsqrt(tot / float(K) + eps);
  for (int k = tid; k < K; k += 32 * NW) {
    xs[k] = static_cast<T>(static_cast<float>(nw[k * ns[0]]) *
                           lily_round<T>(static_cast<float>(xs[k]) * rinv));
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
// ---- body ----
  constexpr int NC = Dk / 32;          // state columns per lane
  constexpr int RW = Dv / NW;          // state rows per simdgroup
  constexpr int G = Hv / Hk;           // v-heads per q/k head
  constexpr int NCH = 2 * Dk + Dv;     // channels this head reads
  constexpr int NT = 32 * NW;
  constexpr int C = 2 * Hk * Dk + Hv * Dv;

  const uint tid = thread_position_in_threadgroup.x;
  const uint lane = thread_index_in_simdgroup;
  const uint warp = simdgroup_index_in_threadgroup;
  const uint n = threadgroup_position_in_grid.y;
  const uint bi = n / Hv;
  const uint h = n % Hv;
  const uint hk = h / G;

  threadgroup float qs[Dk];
  threadgroup float ks[Dk];
  threadgroup float vs[Dv];
  threadgroup float red[NW];
  // PROJ: the normalised input row and this head's projection rows (q|k|v|z|b|a)
  constexpr int NP = 2 * Dk + 2 * Dv + 2;
  threadgroup T xs[PROJ ? K : 1];
  threadgroup float ps[PROJ ? NP : 1];

  // 0. PROJ: residual add + RMSNorm, then the head's projection rows (GEMV)
  if (PROJ) {
    constexpr int VPL = 128 / BITS;
    constexpr int KW = K / VPL;
    constexpr int LPR = KW < 32 ? KW : 32;
    constexpr int SG = 32 / LPR;
    constexpr int RPP = NW * SG * RPW;
    static_assert(KW * VPL == K && SG * LPR == 32 && (KW / LPR) * LPR == KW,
                  "gdn_decode: bad K");
    static_assert(GS % VPL == 0 && K % GS == 0, "gdn_decode: bad GS");
    static_assert(SPLIT == 1 && !OUTP && BN == 1,
                  "gdn_decode (Metal): one threadgroup per (batch, v-head), no OUTP");
    const int sl = int(lane) % LPR;
    const int slot = (int(warp) * SG + int(lane) / LPR) * RPW;
    lily_gdn_pending_norm<T, K, NW>(hin, res, in_nw, in_eps[0], hin_strides, res_strides,
                                    in_nw_strides, int(bi),
                                    h == 0 ? h_out + int64_t(bi) * K : (device T*)nullptr,
                                    xs, red, int(tid), int(lane), int(warp));
    for (int p0 = 0; p0 < NP; p0 += RPP) {
      int rows[RPW];
      for (int r = 0; r < RPW; ++r) {
        rows[r] = lily_gdn_proj_row<Hk, Hv, Dk, Dv>(min(p0 + slot + r, NP - 1), int(h),
                                                    int(hk));
      }
      float acc[RPW];
      lily_qgemv_gather<S, K, BITS, GS, RPW, LPR>(xs, w, scales, biases, rows, sl, acc);
      for (int r = 0; r < RPW; ++r) {
        if (sl == 0 && p0 + slot + r < NP) {
          const float v = lily_rnd<T>(acc[r]);
          ps[p0 + slot + r] = v;
          proj[int64_t(n) * NP + p0 + slot + r] = v;
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  // 1. state rows into registers (latency overlaps the conv phase)
  float s[RW][NC];
  const int64_t sbase = int64_t(bi) * state_strides[0] + int64_t(h) * state_strides[1];
  for (int i = 0; i < RW; ++i) {
    const int r = int(warp) * RW + i;
    for (int j = 0; j < NC; ++j) {
      const int c = int(lane) + 32 * j;
      s[i][j] = state[sbase + r * state_strides[2] + c * state_strides[3]];
    }
  }

  const bool live = !HAS_MASK || bool(mask[int64_t(bi) * mask_strides[0]]);
  // new conv state = rows end .. end+KS-2 of concat(conv_state, x)
  int end = 1;
  if (HAS_LEN) {
    const int len = int(lengths[int64_t(bi) * lengths_strides[0]]);
    end = len < 0 ? 0 : (len > 1 ? 1 : len);
  }
  // 2. conv step + SiLU for the head's q, k, v channels; new conv state
  for (int e = int(tid); e < NCH; e += NT) {
    int c;
    if (e < Dk) {
      c = int(hk) * Dk + e;
    } else if (e < 2 * Dk) {
      c = Hk * Dk + int(hk) * Dk + (e - Dk);
    } else {
      c = 2 * Hk * Dk + int(h) * Dv + (e - 2 * Dk);
    }
    const int64_t cs0 = int64_t(bi) * conv_state_strides[0] + c * conv_state_strides[2];
    const int64_t w0 = int64_t(c) * conv_w_strides[0];
    T xraw = static_cast<T>(0.0f);
    if (live) {
      xraw = PROJ ? static_cast<T>(ps[e]) : qkv[int64_t(bi) * qkv_strides[0] + c * qkv_strides[2]];
    }
    const float xin = static_cast<float>(xraw);
    float acc = 0.0f;
    for (int j = 0; j < KS - 1; ++j) {
      acc += static_cast<float>(conv_w[w0 + j * conv_w_strides[1]]) *
             static_cast<float>(conv_state[cs0 + j * conv_state_strides[1]]);
    }
    acc += static_cast<float>(conv_w[w0 + (KS - 1) * conv_w_strides[1]]) * xin;
    const float xb = lily_rnd<T>(acc);
    const float y = lily_rnd<T>(xb * lily_rnd<T>(lily_sigmoid(xb)));
    if (e < Dk) {
      qs[e] = y;
    } else if (e < 2 * Dk) {
      ks[e - Dk] = y;
    } else {
      vs[e - 2 * Dk] = y;
    }
    // q/k channels are shared by G v-heads: the first of them writes
    if (e >= 2 * Dk || (h % G) == 0) {
      const int64_t o0 = int64_t(bi) * (KS - 1) * C + c;
      for (int j = 0; j < KS - 1; ++j) {
        const int p = end + j;
        conv_out[o0 + j * C] = p < KS - 1 ? conv_state[cs0 + p * conv_state_strides[1]] : xraw;
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // 3. l2norm of q and k (each simdgroup redundantly; lanes hold their columns)
  float kf[NC], qf[NC];
  float ssq = 0.0f, ssk = 0.0f;
  for (int j = 0; j < NC; ++j) {
    const int c = int(lane) + 32 * j;
    qf[j] = qs[c];
    kf[j] = ks[c];
    ssq += qf[j] * qf[j];
    ssk += kf[j] * kf[j];
  }
  ssq = lily_warp_sum(ssq);
  ssk = lily_warp_sum(ssk);
  const float qk_eps = 1e-6f / float(Dk);
  const float rq = metal::precise::rsqrt(ssq / float(Dk) + qk_eps);
  const float rk = metal::precise::rsqrt(ssk / float(Dk) + qk_eps);
  const float qscale = lily_rnd<T>(1.0f / float(Dk));
  const float kscale = lily_rnd<T>(metal::precise::rsqrt(float(Dk)));
  for (int j = 0; j < NC; ++j) {
    qf[j] = lily_rnd<T>(lily_rnd<T>(qf[j] * rq) * qscale);
    kf[j] = lily_rnd<T>(lily_rnd<T>(kf[j] * rk) * kscale);
  }

  // 4. gates, all fp32
  const int64_t pk0 = int64_t(bi) * qkv_strides[0];
  // constant indices into ps are NP-2 / NP-1 only where ps has NP elements (PROJ)
  constexpr int PB = PROJ ? NP - 2 : 0;
  constexpr int PA = PROJ ? NP - 1 : 0;
  const float b_in = PROJ ? ps[PB] : PACKED
      ? static_cast<float>(qkv[pk0 + int64_t(C + Hv * Dv + h) * qkv_strides[2]])
      : static_cast<float>(b[int64_t(bi) * b_strides[0] + int64_t(h) * b_strides[2]]);
  const float a_in = PROJ ? ps[PA] : PACKED
      ? static_cast<float>(qkv[pk0 + int64_t(C + Hv * Dv + Hv + h) * qkv_strides[2]])
      : static_cast<float>(a[int64_t(bi) * a_strides[0] + int64_t(h) * a_strides[2]]);
  const float beta = live ? lily_sigmoid(b_in) : 0.0f;
  const float sp = lily_softplus(a_in +
                                 static_cast<float>(dt_bias[h * dt_bias_strides[0]]));
  const float g = live ? metal::exp(-metal::exp(static_cast<float>(A_log[h * A_log_strides[0]])) * sp) : 1.0f;

  // 5. delta rule: S *= g; kv = S k; delta = (v - kv) beta; S += delta k^T; y = S q
  float kv[RW];
  for (int i = 0; i < RW; ++i) {
    float acc = 0.0f;
    for (int j = 0; j < NC; ++j) {
      s[i][j] *= g;
      acc += s[i][j] * kf[j];
    }
    kv[i] = acc;
  }
  for (int i = 0; i < RW; ++i) {
    kv[i] = lily_warp_sum(kv[i]);
  }
  float yv[RW];
  for (int i = 0; i < RW; ++i) {
    const float delta = (vs[int(warp) * RW + i] - kv[i]) * beta;
    float acc = 0.0f;
    for (int j = 0; j < NC; ++j) {
      s[i][j] += kf[j] * delta;
      acc += s[i][j] * qf[j];
    }
    yv[i] = acc;
  }
  for (int i = 0; i < RW; ++i) {
    yv[i] = lily_rnd<T>(lily_warp_sum(yv[i]));
  }

  // 6. new state
  const int64_t obase = (int64_t(n) * Dv + int64_t(warp) * RW) * Dk;
  for (int i = 0; i < RW; ++i) {
    for (int j = 0; j < NC; ++j) {
      state_out[obase + i * Dk + int(lane) + 32 * j] = s[i][j];
    }
  }

  // 7. gated RMSNorm over the Dv outputs of this head
  float sq = 0.0f;
  for (int i = 0; i < RW; ++i) {
    sq += yv[i] * yv[i];
  }
  if (lane == 0) {
    red[warp] = sq;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float tot = 0.0f;
  for (int w = 0; w < NW; ++w) {
    tot += red[w];
  }
  const float rstd = metal::precise::rsqrt(tot / float(Dv) + eps[0]);
  for (int i = 0; i < RW; ++i) {
    if (int(lane) == i % 32) {
      const int r = int(warp) * RW + i;
      const float nw = lily_rnd<T>(lily_rnd<T>(yv[i] * rstd) *
                                   static_cast<float>(norm_w[r * norm_w_strides[0]]));
      const float zf = PROJ ? ps[2 * Dk + Dv + r] : PACKED
          ? static_cast<float>(qkv[pk0 + int64_t(C + h * Dv + r) * qkv_strides[2]])
          : static_cast<float>(
                z[int64_t(bi) * z_strides[0] + int64_t(h) * z_strides[2] + r * z_strides[3]]);
      out[int64_t(n) * Dv + r] = static_cast<T>(zf * lily_sigmoid(zf) * nw);
    }
  }
