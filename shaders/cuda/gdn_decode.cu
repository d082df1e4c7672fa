// @kernel lily_gdn_decode
// @inputs qkv[B,1,C] z[B,1,Hv,Dv] b[B,1,Hv] a[B,1,Hv] conv_w[C,KS,1] conv_state[B,KS-1,C] A_log[Hv] dt_bias[Hv] state[B,Hv,Dv,Dk]:float32 norm_w[Dv] eps[1]:float32 mask[B,1]:bool lengths[B]:int32 hin[B,1,K] res[B,1,K] in_nw[K] in_eps[1]:float32 w[P,K*BITS/32]:uint32 scales[P,K/GS]:S biases[P,K/GS]:S counters[N]:int32 ow[K,Hv*Dv*BITS/32]:uint32 oscales[K,Hv*Dv/GS]:S obiases[K,Hv*Dv/GS]:S (all but w..obiases read through *_strides; mask/lengths read only when HAS_MASK/HAS_LEN; hin..counters only when PROJ, counters only when SPLIT > 1 or OUTP, ow..obiases only when OUTP)
// @outputs out[B,1,Hv*Dv]:T conv_out[B,KS-1,C]:T state_out[B,Hv,Dv,Dk]:float32 h_out[B,1,K]:T proj[B,Hv,2*Dk+2*Dv+2]:float32 r_out[B,1,K]:T r_parts[B,Hv,K]:float32
// @template T=bfloat16 Hk=16 Hv=32 Dk=128 Dv=128 KS=4 NW=16 HAS_MASK=false HAS_LEN=false PACKED=true PROJ=false S=bfloat16 K=32 BITS=4 GS=32 RPW=1 SPLIT=1 OUTP=false ORPW=1 BN=1
// @template T=float16 Hk=2 Hv=6 Dk=64 Dv=64 KS=3 NW=8 HAS_MASK=true HAS_LEN=true PACKED=false PROJ=false S=float16 K=32 BITS=4 GS=32 RPW=1 SPLIT=1 OUTP=false ORPW=1 BN=1
// @template T=bfloat16 Hk=16 Hv=32 Dk=128 Dv=128 KS=4 NW=16 HAS_MASK=false HAS_LEN=false PACKED=true PROJ=true S=bfloat16 K=2048 BITS=4 GS=64 RPW=4 SPLIT=4 OUTP=true ORPW=4 BN=1
// @template T=float16 Hk=2 Hv=6 Dk=64 Dv=64 KS=3 NW=8 HAS_MASK=true HAS_LEN=true PACKED=true PROJ=true S=float16 K=128 BITS=8 GS=32 RPW=2 SPLIT=1 OUTP=false ORPW=1 BN=1
// @grid (32*NW*SPLIT, ceil(B/BN)*Hv, 1)
// @threadgroup (32*NW, 1, 1)
// @ensure_row_contiguous false
// PACKED: qkv is the whole fused input projection row [B,1,C+Hv*Dv+2*Hv] = q|k|v|z|b|a
// and z, b, a are read from its columns (the z/b/a inputs are then not read).
// PROJ (with PACKED): that row is not an input: the P = 2*Dk+2*Dv+2 projection rows a
// v-head reads (q, k of its q/k head; v, z, b, a of its own) are computed from
// x = T(in_nw * T(hh * rsqrt(mean(hh^2) + in_eps))), hh = T(hin + res), as
// lily_norm_qgemv does (w: the fused q|k|v|z|b|a weight, rows in that order), each value
// rounded to T as that kernel's output is, and written to proj; block (bi, 0, part 0)
// writes hh to h_out. qkv/z/b/a are then not read. SPLIT blocks per (batch, v-head) share
// the rows (passes of NW*RPW rows, dealt round-robin); the last of them to finish (an
// atomic count in counters[n], reset to 0 by that block: the buffer must hold zeros at
// launch and holds zeros after; launches sharing it must not run concurrently) reads them
// back and runs the step; the others exit.
// OUTP (with PROJ): out_proj too (ow: [K, Hv*Dv] quantized as w, no bias): the block
// that ran head h's step writes out_h . dequant(ow[:, h*Dv:(h+1)*Dv])^T (fp32, rows
// of ORPW per lane group) to r_parts; the last of the batch row's Hv heads to arrive
// (counter counters[B*Hv + bi], reset by it) sums the Hv partials in head order (fixed:
// the result does not depend on arrival order) and writes r_out = T(sum). counters then
// needs B*Hv + B zeros. OUTP with PACKED and without PROJ (the packed row an input; K, S,
// BITS, GS describe ow): the same, its counters counters[bi] (B zeros).
// BN (with PROJ): batch rows per block; block y = g*Hv + h serves head h of rows
// g*BN .. g*BN+BN-1 (those < B). Each weight tile of the GEMVs (the projection, and
// out_proj under OUTP) is loaded once and dotted with each row's input in turn, so a row
// gets exactly the arithmetic it gets at BN = 1 (hence alone); the rows' steps run one
// after another in the block. SPLIT's counters are then counters[g*Hv + h], OUTP's
// counters[B*Hv + g] (its last head sums each row of the group). BN = 1: one row per
// block, as before.
// CUDA twin of shaders/metal/gdn_decode.metal (whose contract allows SPLIT = 1, no OUTP and
// BN = 1): one
// block per (batch, v-head) for the step, NW warps owning Dv/NW state rows each (lane owns
// columns lane + 32*j).

// @header gdn_common.cuh
// @header qgemv_common.cuh
// @header qgemv_norm.cuh
// @header phase_trace.cuh
// @header l2_prefetch.cuh

// Row of the fused q|k|v|z|b|a weight holding projection row p of v-head h (q/k head hk):
// p in [0, Dk) q, [Dk, 2Dk) k, then Dv of v, Dv of z, then b, a.
template <int Hk, int Hv, int Dk, int Dv>
__device__ __forceinline__ int lily_gdn_proj_row(int p, int h, int hk) {
  constexpr int C = 2 * Hk * Dk + Hv * Dv;
  if (p < Dk) return hk * Dk + p;
  if (p < 2 * Dk) return Hk * Dk + hk * Dk + (p - Dk);
  if (p < 2 * Dk + Dv) return 2 * Hk * Dk + h * Dv + (p - 2 * Dk);
  if (p < 2 * Dk + 2 * Dv) return C + h * Dv + (p - 2 * Dk - Dv);
  return C + Hv * Dv + (p - 2 * Dk - 2 * Dv) * Hv + h;
}

// An empty asm that claims to change a tile's weight words: called before each batch
// row's dot with the tile, it keeps nvcc from hoisting the words' unpacking out of the
// loop over rows (which held the dequantized values in registers: 166 per thread at
// BN 2, past the 128 a block of 512 threads may have). No instruction is emitted.
template <typename S, int K, int BITS, int GS, int RPW, int LPR, int KF>
__device__ __forceinline__ void lily_gdn_opaque(LilyRowTile<S, K, BITS, GS, RPW, LPR, KF>& t) {
#ifndef LILY_EMU
#pragma unroll
  for (int st = 0; st < LilyRowTile<S, K, BITS, GS, RPW, LPR, KF>::STEPS; ++st) {
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      asm volatile("" : "+r"(t.q[st][r].x), "+r"(t.q[st][r].y), "+r"(t.q[st][r].z),
                   "+r"(t.q[st][r].w));
    }
  }
#endif
}

// After every thread of the block has written what other blocks will read: true in the
// block that arrives last of `count` sharing the counter *ctr (which it resets to 0; its
// loads after this see the others' writes through L2: read them with __ldcg), false in
// the others. flag: one shared int. Every thread calls it (barriers inside).
__device__ __forceinline__ bool lily_last_to_arrive(int* ctr, int count, int* flag, int tid) {
  __threadfence();
  __syncthreads();
  if (tid == 0) {
    const int done = atomicAdd(ctr, 1);
    flag[0] = done == count - 1;
    if (done == count - 1) *ctr = 0;
  }
  __syncthreads();
  const bool last = flag[0];
  if (last) __threadfence();
  return last;
}

// lily_add_rms_norm_row for row bi of hin/res read through their strides (the 16-byte
// path when the K axis is unit-stride, element loads otherwise): xs = the normalised
// row, h_out (may be null) = T(hin + res). Every thread calls it; ends with a barrier.
template <typename T, int K, int NW, class ST>
__device__ __forceinline__ void lily_gdn_pending_norm(const T* hin, const T* res,
                                                      const T* nw, float eps, const ST& hs,
                                                      const ST& rs, const ST& ns, int bi,
                                                      T* h_out, T* xs, float* red, int tid,
                                                      int lane, int warp) {
  const T* hr = hin + int64_t(bi) * hs[0];
  const T* rr = res + int64_t(bi) * rs[0];
  if (hs[2] == 1 && rs[2] == 1 && ns[0] == 1) {
    lily_add_rms_norm_row<T, K, NW>(hr, rr, nw, eps, xs, red, h_out, nullptr, tid, lane,
                                    warp);
    return;
  }
  float ss = 0.f;
  for (int k = tid; k < K; k += 32 * NW) {
    const T hh = static_cast<T>(lily_f(hr[k * hs[2]]) + lily_f(rr[k * rs[2]]));
    if (h_out) h_out[k] = hh;
    xs[k] = hh;
    ss += lily_f(hh) * lily_f(hh);
  }
  const float rinv = lily_block_rinv<K, NW>(ss, red, eps, lane, warp);
  for (int k = tid; k < K; k += 32 * NW) {
    xs[k] = static_cast<T>(lily_f(nw[k * ns[0]]) * lily_round<T>(lily_f(xs[k]) * rinv));
  }
  __syncthreads();
}
// ---- body ----
  constexpr int NC = Dk / 32;
  constexpr int RW = Dv / NW;
  constexpr int G = Hv / Hk;
  constexpr int NCH = 2 * Dk + Dv;
  constexpr int NT = 32 * NW;
  constexpr int C = 2 * Hk * Dk + Hv * Dv;

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  LILY_TRACE_CLEAR();
  LILY_TRACE(0);
  LILY_TRACE_SMID(7);
  static_assert(BN >= 1 && (BN == 1 || PROJ), "gdn_decode: BN > 1 needs PROJ");
  const int n = blockIdx.y;  // (row group, v-head) = (n / Hv, h)
  const int h = n % Hv;
  const int bg = n / Hv;
  const int hk = h / G;

  __shared__ float qs[Dk];
  __shared__ float ks[Dk];
  __shared__ float vs[Dv];
  __shared__ float red[NW];
  // PROJ: the normalised input row and this head's projection rows (q|k|v|z|b|a)
  constexpr int NP = 2 * Dk + 2 * Dv + 2;
  __shared__ uint4 xs4[PROJ ? BN * ((K * sizeof(T) + 15) / 16) : 1];  // 16-byte aligned rows
  T* xs = reinterpret_cast<T*>(xs4);
  __shared__ float ps[PROJ ? NP : 1];
  __shared__ int last_part[1];
  __shared__ uint4 os4[OUTP ? BN * ((Dv * sizeof(T) + 15) / 16) : 1];  // out_h rows for OUTP
  T* os_ = reinterpret_cast<T*>(os4);
  static_assert(!OUTP || PROJ || PACKED, "gdn_decode: OUTP needs PROJ or PACKED");
  constexpr int XST = PROJ ? (K * int(sizeof(T)) + 15) / 16 * 16 / int(sizeof(T)) : 0;
  constexpr int OST = (Dv * int(sizeof(T)) + 15) / 16 * 16 / int(sizeof(T));
  // rows of this block: bg*BN + j for j < nrows
  const int nrows = BN == 1 ? 1 : min(BN, int(hin_shape[0]) - bg * BN);

  if constexpr (PROJ) {
    constexpr int VPL = 128 / BITS;
    constexpr int KW = K / VPL;
    constexpr int LPR = KW < 32 ? KW : 32;
    constexpr int SG = 32 / LPR;
    constexpr int RPP = NW * SG * RPW;
    static_assert(KW * VPL == K && SG * LPR == 32 && (KW / LPR) * LPR == KW,
                  "gdn_decode: bad K");
    static_assert(GS % VPL == 0 && K % GS == 0, "gdn_decode: bad GS");
    const int sl = lane % LPR;
    const int slot = (warp * SG + lane / LPR) * RPW;
    const int part = blockIdx.x;
#ifdef LILY_L2_PREFETCH_PROJ
    // this part's projection rows (words, scales, biases), fetched while the row normalises
    for (int p0 = part * RPP; p0 < NP; p0 += SPLIT * RPP) {
      for (int i = tid / 8; i < RPP && p0 + i < NP; i += NT / 8) {
        const int row = lily_gdn_proj_row<Hk, Hv, Dk, Dv>(p0 + i, h, hk);
        const char* wr = reinterpret_cast<const char*>(w + size_t(row) * (K * BITS / 32));
        for (int l = tid % 8; l * 128 < K * BITS / 8; l += 8) LILY_PREFETCH_L2(wr + l * 128);
        if (tid % 8 == 0) {
          LILY_PREFETCH_L2(scales + size_t(row) * (K / GS));
          LILY_PREFETCH_L2(biases + size_t(row) * (K / GS));
        }
      }
    }
#endif
#ifdef LILY_L2_PREFETCH
    if constexpr (OUTP) {
      // this part's share of what the head's last part reads after the projection: the
      // state of its rows (when contiguous) and head h's out_proj columns
      for (int jr = 0; jr < nrows; ++jr) {
        const int bj = bg * BN + jr;
        if (state_strides[3] == 1 && state_strides[2] == Dk) {
          const char* sp = reinterpret_cast<const char*>(
              state + int64_t(bj) * state_strides[0] + int64_t(h) * state_strides[1]);
          for (int l = part * NT + tid; l < Dv * Dk * 4 / 128; l += SPLIT * NT) {
            LILY_PREFETCH_L2(sp + l * 128);
          }
        }
      }
      constexpr int OWR = Hv * Dv * BITS / 32;  // words per out_proj row
      constexpr int OGR = Hv * Dv / GS;         // scale groups per out_proj row
      for (int o = part * NT + tid; o < K; o += SPLIT * NT) {
        LILY_PREFETCH_L2(ow + size_t(o) * OWR + h * (Dv * BITS / 32));
        LILY_PREFETCH_L2(oscales + size_t(o) * OGR + h * (Dv / GS));
        LILY_PREFETCH_L2(obiases + size_t(o) * OGR + h * (Dv / GS));
      }
    }
#endif
#pragma unroll 1
    for (int jr = 0; jr < nrows; ++jr) {
      const int bj = bg * BN + jr;
      lily_gdn_pending_norm<T, K, NW>(hin, res, in_nw, in_eps[0], hin_strides, res_strides,
                                      in_nw_strides, bj,
                                      h == 0 && part == 0 ? h_out + int64_t(bj) * K : nullptr,
                                      xs + jr * XST, red, tid, lane, warp);
    }
    LILY_TRACE(1);
    for (int p0 = part * RPP; p0 < NP; p0 += SPLIT * RPP) {
      // the tile lily_qgemv_gather loads, then each row's dot with it
      LilyRowTile<S, K, BITS, GS, RPW, LPR> tile;
#pragma unroll
      for (int r = 0; r < RPW; ++r) {
        const int row = lily_gdn_proj_row<Hk, Hv, Dk, Dv>(min(p0 + slot + r, NP - 1), h, hk);
        tile.load_row(reinterpret_cast<const uint4*>(w), scales, biases, r, (size_t)row, sl);
      }
#pragma unroll 1
      for (int jr = 0; jr < nrows; ++jr) {
        float* pr = proj + (int64_t(bg * BN + jr) * Hv + h) * NP;
        if constexpr (BN > 1) lily_gdn_opaque(tile);
        tile.dot_each(xs + jr * XST, sl, [&](int r, float acc) {
          if (sl == 0 && p0 + slot + r < NP) {
            const float v = lily_rnd<T>(acc);
            pr[p0 + slot + r] = v;
            if constexpr (SPLIT == 1 && BN == 1) ps[p0 + slot + r] = v;
          }
        });
      }
    }
    LILY_TRACE(2);
    if constexpr (SPLIT > 1) {
      if (!lily_last_to_arrive(const_cast<int*>(counters) + n, SPLIT, last_part, tid)) return;
    }
    LILY_TRACE(3);
    __syncthreads();
  }

#pragma unroll 1
  for (int jr = 0; jr < nrows; ++jr) {
    const int bi = bg * BN + jr;
    const int nr = bi * Hv + h;  // (row, v-head)
    if constexpr (PROJ && (SPLIT > 1 || BN > 1)) {
      if (jr > 0) __syncthreads();  // the previous row's readers of ps are done
      const float* pr = proj + int64_t(nr) * NP;
      for (int p = tid; p < NP; p += NT) ps[p] = __ldcg(pr + p);
      __syncthreads();
    }
    float s[RW][NC];
    const int64_t sbase = int64_t(bi) * state_strides[0] + int64_t(h) * state_strides[1];
#pragma unroll
    for (int i = 0; i < RW; ++i) {
      const int r = warp * RW + i;
#pragma unroll
      for (int j = 0; j < NC; ++j) {
        const int c = lane + 32 * j;
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

    for (int e = tid; e < NCH; e += NT) {
      int c;
      if (e < Dk) {
        c = hk * Dk + e;
      } else if (e < 2 * Dk) {
        c = Hk * Dk + hk * Dk + (e - Dk);
      } else {
        c = 2 * Hk * Dk + h * Dv + (e - 2 * Dk);
      }
      const int64_t cs0 = int64_t(bi) * conv_state_strides[0] + c * conv_state_strides[2];
      const int64_t w0 = int64_t(c) * conv_w_strides[0];
      T xraw = static_cast<T>(0.0f);
      if (live) {
        if constexpr (PROJ) {
          xraw = static_cast<T>(ps[e]);
        } else {
          xraw = qkv[int64_t(bi) * qkv_strides[0] + c * qkv_strides[2]];
        }
      }
      const float xin = static_cast<float>(xraw);
      float acc = 0.0f;
#pragma unroll
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
      if (e >= 2 * Dk || (h % G) == 0) {
        const int64_t o0 = int64_t(bi) * (KS - 1) * C + c;
        for (int j = 0; j < KS - 1; ++j) {
          const int p = end + j;
          conv_out[o0 + j * C] = p < KS - 1 ? conv_state[cs0 + p * conv_state_strides[1]] : xraw;
        }
      }
    }
    __syncthreads();

    float kf[NC], qf[NC];
    float ssq = 0.0f, ssk = 0.0f;
#pragma unroll
    for (int j = 0; j < NC; ++j) {
      const int c = lane + 32 * j;
      qf[j] = qs[c];
      kf[j] = ks[c];
      ssq += qf[j] * qf[j];
      ssk += kf[j] * kf[j];
    }
    ssq = lily_warp_sum(ssq);
    ssk = lily_warp_sum(ssk);
    const float qk_eps = 1e-6f / float(Dk);
    const float rq = rsqrtf(ssq / float(Dk) + qk_eps);
    const float rk = rsqrtf(ssk / float(Dk) + qk_eps);
    const float qscale = lily_rnd<T>(1.0f / float(Dk));
    const float kscale = lily_rnd<T>(rsqrtf(float(Dk)));
#pragma unroll
    for (int j = 0; j < NC; ++j) {
      qf[j] = lily_rnd<T>(lily_rnd<T>(qf[j] * rq) * qscale);
      kf[j] = lily_rnd<T>(lily_rnd<T>(kf[j] * rk) * kscale);
    }

    const int64_t pk0 = int64_t(bi) * qkv_strides[0];
    float b_in, a_in;
    if constexpr (PROJ) {
      b_in = ps[NP - 2];
      a_in = ps[NP - 1];
    } else {
      b_in = PACKED
          ? static_cast<float>(qkv[pk0 + int64_t(C + Hv * Dv + h) * qkv_strides[2]])
          : static_cast<float>(b[int64_t(bi) * b_strides[0] + int64_t(h) * b_strides[2]]);
      a_in = PACKED
          ? static_cast<float>(qkv[pk0 + int64_t(C + Hv * Dv + Hv + h) * qkv_strides[2]])
          : static_cast<float>(a[int64_t(bi) * a_strides[0] + int64_t(h) * a_strides[2]]);
    }
    const float beta = live ? lily_sigmoid(b_in) : 0.0f;
    const float sp = lily_softplus(a_in +
                                   static_cast<float>(dt_bias[h * dt_bias_strides[0]]));
    const float g = live ? expf(-expf(static_cast<float>(A_log[h * A_log_strides[0]])) * sp) : 1.0f;

    float kv[RW];
#pragma unroll
    for (int i = 0; i < RW; ++i) {
      float acc = 0.0f;
#pragma unroll
      for (int j = 0; j < NC; ++j) {
        s[i][j] *= g;
        acc += s[i][j] * kf[j];
      }
      kv[i] = acc;
    }
#pragma unroll
    for (int i = 0; i < RW; ++i) {
      kv[i] = lily_warp_sum(kv[i]);
    }
    float yv[RW];
#pragma unroll
    for (int i = 0; i < RW; ++i) {
      const float delta = (vs[warp * RW + i] - kv[i]) * beta;
      float acc = 0.0f;
#pragma unroll
      for (int j = 0; j < NC; ++j) {
        s[i][j] += kf[j] * delta;
        acc += s[i][j] * qf[j];
      }
      yv[i] = acc;
    }
#pragma unroll
    for (int i = 0; i < RW; ++i) {
      yv[i] = lily_rnd<T>(lily_warp_sum(yv[i]));
    }

    const int64_t obase = (int64_t(nr) * Dv + int64_t(warp) * RW) * Dk;
#pragma unroll
    for (int i = 0; i < RW; ++i) {
#pragma unroll
      for (int j = 0; j < NC; ++j) {
        state_out[obase + i * Dk + lane + 32 * j] = s[i][j];
      }
    }

    float sq = 0.0f;
#pragma unroll
    for (int i = 0; i < RW; ++i) {
      sq += yv[i] * yv[i];
    }
    if (lane == 0) {
      red[warp] = sq;
    }
    __syncthreads();
    float tot = 0.0f;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      tot += red[w];
    }
    const float rstd = rsqrtf(tot / float(Dv) + eps[0]);
#pragma unroll
    for (int i = 0; i < RW; ++i) {
      if (lane == (i & 31)) {
        const int r = warp * RW + i;
        const float nw = lily_rnd<T>(lily_rnd<T>(yv[i] * rstd) *
                                     static_cast<float>(norm_w[r * norm_w_strides[0]]));
        float zf;
        if constexpr (PROJ) {
          zf = ps[2 * Dk + Dv + r];
        } else {
          zf = PACKED
              ? static_cast<float>(qkv[pk0 + int64_t(C + h * Dv + r) * qkv_strides[2]])
              : static_cast<float>(
                    z[int64_t(bi) * z_strides[0] + int64_t(h) * z_strides[2] + r * z_strides[3]]);
        }
        const T ov = static_cast<T>(zf * lily_sigmoid(zf) * nw);
        out[int64_t(nr) * Dv + r] = ov;
        if constexpr (OUTP) os_[jr * OST + r] = ov;
      }
    }
  }  // rows of the group

  if constexpr (OUTP) {
    // this head's share of out_proj, then the batch row's last head sums the shares
    constexpr int VPL = 128 / BITS;
    constexpr int WPR = Dv / VPL;
    constexpr int LPRO = WPR < 32 ? WPR : 32;
    constexpr int SGO = 32 / LPRO;
    constexpr int RPPO = NW * SGO * ORPW;
    __syncthreads();
    LILY_TRACE(4);
    const int slo = lane % LPRO;
    const int o_slot = (warp * SGO + lane / LPRO) * ORPW;
    for (int o0 = 0; o0 < K; o0 += RPPO) {
      // the tile lily_qgemv_slice loads (head h's columns), then each row's dot with it
      using OTile = LilyRowTile<S, Dv, BITS, GS, ORPW, LPRO, Hv * Dv>;
      static_assert(OTile::STEPS * LPRO * OTile::VPL == Dv, "gdn_decode: bad out_proj tile");
      OTile tile;
#pragma unroll
      for (int r = 0; r < ORPW; ++r) {
        tile.load_row(reinterpret_cast<const uint4*>(ow), oscales, obiases, r,
                      (size_t)min(o0 + o_slot + r, K - 1), slo, h * Dv);
      }
#pragma unroll 1
      for (int jr = 0; jr < nrows; ++jr) {
        float* part = r_parts + (int64_t(bg * BN + jr) * Hv + h) * K;
        if constexpr (BN > 1) lily_gdn_opaque(tile);
        tile.dot_each(os_ + jr * OST, slo, [&](int r, float acc) {
          if (slo == 0 && o0 + o_slot + r < K) part[o0 + o_slot + r] = acc;
        });
      }
    }
    LILY_TRACE(5);
    if (!lily_last_to_arrive(const_cast<int*>(counters) + (PROJ ? hin_shape[0] * Hv : 0) + bg,
                             Hv, last_part, tid)) {
      return;
    }
    static_assert(K % 4 == 0, "gdn_decode: OUTP sums 4 outputs per 16-byte load");
#pragma unroll 1
    for (int jr = 0; jr < nrows; ++jr) {
      const int bi = bg * BN + jr;
      const float* parts = r_parts + int64_t(bi) * Hv * K;
      T* ro = r_out + int64_t(bi) * K;
      // 16-byte loads, up to 16 heads' in flight per thread
      for (int o = 4 * tid; o < K; o += 4 * NT) {
        float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma unroll 16
        for (int hh = 0; hh < Hv; ++hh) {
          const float4 v = __ldcg(reinterpret_cast<const float4*>(parts + int64_t(hh) * K + o));
          a0 += v.x;
          a1 += v.y;
          a2 += v.z;
          a3 += v.w;
        }
        ro[o] = static_cast<T>(a0);
        ro[o + 1] = static_cast<T>(a1);
        ro[o + 2] = static_cast<T>(a2);
        ro[o + 3] = static_cast<T>(a3);
      }
    }
    LILY_TRACE(6);
  }
