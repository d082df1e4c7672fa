// @kernel lily_moe_decode
// @inputs hin[N,D]:T res[N,D]:T nw[D]:T eps[1]:float32 rw[E+1,D*RBITS/32]:uint32 rs[E+1,D/RGS]:T rb[E+1,D/RGS]:T gate_w[E,I,D*BITS/32]:uint32 gate_s[E,I,D/GS]:S gate_b[E,I,D/GS]:S up_w[E,I,D*BITS/32]:uint32 up_s[E,I,D/GS]:S up_b[E,I,D/GS]:S sgate_w[I,D*BITS/32]:uint32 sgate_s[I,D/GS]:S sgate_b[I,D/GS]:S sup_w[I,D*BITS/32]:uint32 sup_s[I,D/GS]:S sup_b[I,D/GS]:S down_w[E,D,I*BITS/32]:uint32 down_s[E,D,I/GS]:S down_b[E,D,I/GS]:S sdown_w[D,I*BITS/32]:uint32 sdown_s[D,I/GS]:S sdown_b[D,I/GS]:S counters[CO+4]:int32 after[*]:T (unread)
// @outputs y[N,D]:T h[N,D]:T work[N*WPR]:uint32   (work: the launch's scratch, per row WPR words: act[K+1,I], xn[D], logits[E+1], scores[K], the shared gate, inds[K], each at a 16-byte offset)
// @template T=bfloat16 S=bfloat16 N=1 D=2048 I=512 K=8 E=256 BITS=4 GS=64 RBITS=8 RGS=64 RRPW=2 GRPW=4 DRPW=2 NORM=true CO=0 WPR=3476
// @template T=float32 S=float16 N=2 D=128 I=64 K=3 E=5 BITS=4 GS=32 RBITS=8 RGS=64 RRPW=2 GRPW=4 DRPW=1 NORM=false CO=3 WPR=404
// @grid (TILES*128, 1, 1)   TILES = N*(ceil((E+1)/RPB_R) + (K+1)*ceil(I/RPB_G) + ceil(D/RPB_D)), RPB_X = 4*(32/LPR_X)*XRPW, LPR_R = min(32, D*RBITS/128), LPR_G = min(32, D*BITS/128), LPR_D = min(32, I*BITS/128)
// @threadgroup (128, 1, 1)
// A decode MoE block in one launch (CUDA only): the three launches moe_experts_routed
// makes (lily_norm_qgemv of the router, lily_moe_gate_up with TOPK and PRE_NORM,
// lily_moe_down) as three phases of one grid, rounded exactly as those kernels round.
// Counters are counters[CO .. CO+4). Each block takes a ticket (atomicAdd on counters[0]) and serves tile number ticket:
// router tiles first (h = T(hin + res), x = rms_norm(h) * nw, logits = x @ router^T; a
// row's first router tile also writes x to xn; then counters[1] += 1), then gate+up tiles
// (wait for counters[1] to count every router tile, route the row from the logits, copy
// x from xn, silu(gate) * up of one expert slot's rows into act; counters[2] += 1),
// then down tiles (wait for counters[2], the score-weighted down
// GEMVs of the K+1 slots, y = their sum). A block only waits for tiles whose tickets
// were taken before its own, by blocks already running, so the launch cannot deadlock
// whatever the number of resident blocks. `after` is never read: the launch takes the
// previous launch's output on the same counters as an input, so MLX's CUDA graph orders the
// two (it adds edges only from a buffer's writer). The last block to leave (counters[3]) resets
// the four counters to zero. Writes of another block are read through L2 (__ldcg).
// Apple GPUs give no such forward-progress guarantee between threadgroups in MSL, so
// Metal runs the three launches (moe_experts.moe_experts_routed).
// @header qgemv_common.cuh
// @header qgemv_norm.cuh
// @header qgemv_route.cuh
// @header phase_trace.cuh
// @header l2_prefetch.cuh
// An L2 (L1-bypassing) view of a buffer other blocks of the launch wrote.
template <typename T>
struct LilyL2 {
  const T* p;
  __device__ __forceinline__ T operator[](int i) const { return __ldcg(p + i); }
};
// Release / acquire at device scope (PTX memory model) instead of __threadfence()'s
// fence.sc.gpu (MEMBAR.SC, which every block of the launch would pass 2-3 times). The
// emulator (LILY_EMU) runs the same steps with C++ atomics.
#ifdef LILY_EMU
__device__ __forceinline__ int lily_ld_acquire(const int* p) {
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
__device__ __forceinline__ void lily_add_release(int* p, int v) {
  __atomic_fetch_add(p, v, __ATOMIC_RELEASE);
}
__device__ __forceinline__ int lily_add_acq_rel(int* p, int v) {
  return __atomic_fetch_add(p, v, __ATOMIC_ACQ_REL);
}
#else
__device__ __forceinline__ int lily_ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void lily_add_release(int* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ int lily_add_acq_rel(int* p, int v) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;"
               : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
#endif
// *ctr += 1 once the whole block's writes are visible device-wide: the barrier, then one
// thread's release (cumulative over the writes the barrier ordered before it, the
// pattern of cooperative groups' grid sync).
__device__ __forceinline__ void lily_arrive(int* ctr, int tid) {
  __syncthreads();
  if (tid == 0) lily_add_release(ctr, 1);
}
// Wait until *ctr >= target (thread 0 acquires), then the barrier orders this block's
// later loads after it. A wait past ~4 s (2^33 SM clocks: counters that were not zero at
// launch, or shared by two launches running at once) traps, so the launch fails instead
// of hanging the GPU.
__device__ __forceinline__ void lily_wait_count(int* ctr, int target, int tid) {
  if (tid == 0) {
    const long long t0 = clock64();
    while (lily_ld_acquire(ctr) < target) {
      __nanosleep(32);
      if (clock64() - t0 > (1ll << 33)) __trap();
    }
  }
  __syncthreads();
}
// n values of T at src (written by other blocks of the launch) into shared dst through
// L2: 16-byte loads, all issued before any store, when both are 16-byte aligned.
template <typename T, int N, int NT>
__device__ __forceinline__ void lily_copy_l2(T* dst, const T* src, int tid) {
  constexpr int NV = N * int(sizeof(T)) / 16;
  if (N * int(sizeof(T)) % 16 == 0 &&
      ((reinterpret_cast<unsigned long long>(src) | reinterpret_cast<unsigned long long>(dst)) & 15ull) == 0ull) {
    constexpr int PT = (NV + NT - 1) / NT;
    uint4 v[PT];
#pragma unroll
    for (int j = 0; j < PT; ++j) {
      const int i = tid + j * NT;
      if (i < NV) v[j] = __ldcg(reinterpret_cast<const uint4*>(src) + i);
    }
#pragma unroll
    for (int j = 0; j < PT; ++j) {
      const int i = tid + j * NT;
      if (i < NV) reinterpret_cast<uint4*>(dst)[i] = v[j];
    }
  } else {
    constexpr int PT = (N + NT - 1) / NT;
#pragma unroll 8
    for (int j = 0; j < PT; ++j) {
      const int i = tid + j * NT;
      if (i < N) dst[i] = __ldcg(src + i);
    }
  }
}
// ---- body ----
  constexpr int NWK = 4;
  constexpr int RVPL = 128 / RBITS;
  constexpr int RKW = D / RVPL;
  constexpr int RLPR = RKW < 32 ? RKW : 32;
  constexpr int RRPB = NWK * (32 / RLPR) * RRPW;
  constexpr int RT = (E + 1 + RRPB - 1) / RRPB;
  constexpr int VPL = 128 / BITS;
  constexpr int GKW = D / VPL;
  constexpr int GLPR = GKW < 32 ? GKW : 32;
  constexpr int GRPB = NWK * (32 / GLPR) * GRPW;
  constexpr int GX = (I + GRPB - 1) / GRPB;
  constexpr int GT = GX * (K + 1);
  constexpr int DKW = I / VPL;
  constexpr int DLPR = DKW < 32 ? DKW : 32;
  constexpr int DRPB = NWK * (32 / DLPR) * DRPW;
  constexpr int DT = (D + DRPB - 1) / DRPB;
  constexpr int TOTAL = N * (RT + GT + DT);
  constexpr int XS = D > (K + 1) * I ? D : (K + 1) * I;
  static_assert(RKW * RVPL == D && RKW % RLPR == 0 && GKW * VPL == D && GKW % GLPR == 0,
                "moe_decode: bad D");
  static_assert(DKW * VPL == I && DKW % DLPR == 0, "moe_decode: bad I");
  static_assert(GS % VPL == 0 && RGS % RVPL == 0, "moe_decode: bad group size");
  static_assert(K <= 32 && K <= E, "moe_decode: bad K");
  // scratch of row n: work + n * WPR words, sections at 16-byte offsets (fused_work_words)
  constexpr int SZ = int(sizeof(T));
  constexpr int O_XN = ((K + 1) * I * SZ + 15) / 16 * 16;
  constexpr int O_LG = O_XN + (D * SZ + 15) / 16 * 16;
  constexpr int O_SC = O_LG + ((E + 1) * SZ + 15) / 16 * 16;
  constexpr int O_SH = O_SC + (K * SZ + 15) / 16 * 16;
  constexpr int O_IN = O_SH + 16;
  static_assert(O_IN + (K * 4 + 15) / 16 * 16 == WPR * 4, "moe_decode: WPR does not match");

  __shared__ T xs[XS];  // first shared array: 16-byte aligned in practice
  __shared__ float red[NWK];
  __shared__ unsigned s_inds[K];
  __shared__ float s_cf[K + 1];
  __shared__ int s_ticket;
  int* ctr = const_cast<int*>(counters) + CO;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  LILY_TRACE_CLEAR();
  LILY_TRACE(0);
  if (tid == 0) s_ticket = atomicAdd(ctr, 1);
  __syncthreads();
  const int t = s_ticket;
  LILY_TRACE_VAL(6, t);
  LILY_TRACE_SMID(7);
  LILY_TRACE(1);

  if (t < N * RT) {
    // ---- router tile: lily_norm_qgemv's rows of the E+1 router outputs
    const int n = t / RT;
    char* wn = reinterpret_cast<char*>(work) + (size_t)n * WPR * 4;
    const int sub = lane / RLPR;
    const int sl = lane % RLPR;
    const int row0 = (t % RT) * RRPB + (warp * (32 / RLPR) + sub) * RRPW;
    LilyRowTile<T, D, RBITS, RGS, RRPW, RLPR> tile;
    tile.load(reinterpret_cast<const uint4*>(rw), rs, rb, row0, E, sl);
    const size_t ro = (size_t)n * D;
    const bool first = t % RT == 0;
    lily_add_rms_norm_row<T, D, NWK>(hin + ro, res + ro, nw, eps[0], xs, red,
                                     first ? h + ro : nullptr,
                                     first ? reinterpret_cast<T*>(wn + O_XN) : nullptr, tid,
                                     lane, warp);
    LILY_TRACE(2);
    T* lg = reinterpret_cast<T*>(wn + O_LG);
    tile.dot_each(xs, sl, [&](int r, float v) {
      if (sl == 0 && row0 + r <= E) lg[row0 + r] = static_cast<T>(v);
    });
    LILY_TRACE(4);
    lily_arrive(ctr + 1, tid);
  } else if (t < N * (RT + GT)) {
    // ---- gate+up tile: lily_moe_gate_up (TOPK, PRE_NORM) for one slot's rows
    const int u = t - N * RT;
    const int n = u / GT;
    char* wn = reinterpret_cast<char*>(work) + (size_t)n * WPR * 4;
    const int slot = (u % GT) / GX;
    const int gx = (u % GT) % GX;
    const int sub = lane / GLPR;
    const int sl = lane % GLPR;
    const int row0 = gx * GRPB + (warp * (32 / GLPR) + sub) * GRPW;
    LilyRowTile<S, D, BITS, GS, GRPW, GLPR> tg;
    LilyRowTile<S, D, BITS, GS, GRPW, GLPR> tu;
    if (slot == K) {  // the shared expert's weights do not depend on the routing
      tg.load(reinterpret_cast<const uint4*>(sgate_w), sgate_s, sgate_b, row0, I - 1, sl);
      tu.load(reinterpret_cast<const uint4*>(sup_w), sup_s, sup_b, row0, I - 1, sl);
    }
    lily_wait_count(ctr + 1, N * RT, tid);
    LILY_TRACE(2);
    if (slot < K) {
      if (warp == 0) {
        LilyL2<T> lg{reinterpret_cast<const T*>(wn + O_LG)};
        unsigned my_i = 0u;
        float my_sc = 0.f;
        lily_route_topk<T, E, K, NORM>(lg, lane, my_i, my_sc);
        if (lane < K) s_inds[lane] = my_i;
        if (gx == 0 && slot == 0) {
          if (lane < K) {
            reinterpret_cast<unsigned*>(wn + O_IN)[lane] = my_i;
            reinterpret_cast<T*>(wn + O_SC)[lane] = static_cast<T>(my_sc);
          }
          if (lane == 0) {
            *reinterpret_cast<T*>(wn + O_SH) = static_cast<T>(1.f / (1.f + expf(-lily_f(lg[E]))));
          }
        }
      }
      __syncthreads();
      const size_t e = min(s_inds[slot], (unsigned)(E - 1));
      tg.load(reinterpret_cast<const uint4*>(gate_w) + e * I * GKW, gate_s + e * I * (D / GS),
              gate_b + e * I * (D / GS), row0, I - 1, sl);
      tu.load(reinterpret_cast<const uint4*>(up_w) + e * I * GKW, up_s + e * I * (D / GS),
              up_b + e * I * (D / GS), row0, I - 1, sl);
    }
#ifdef LILY_L2_PREFETCH
    {
      // this tile's share (rows of gx) of the down rows its slot's expert will need
      constexpr int DWR = I * BITS / 32;  // words per down row
      constexpr int PR = (D + GX - 1) / GX;
      const size_t pe = slot < K ? min(s_inds[slot], (unsigned)(E - 1)) : 0;
      const int r0 = gx * PR;
      const int nr = min(D, r0 + PR) - r0;
      const char* pw = reinterpret_cast<const char*>(
          (slot < K ? down_w + pe * D * DWR : sdown_w) + size_t(r0) * DWR);
      const char* ps_ = reinterpret_cast<const char*>(
          (slot < K ? down_s + pe * D * (I / GS) : sdown_s) + size_t(r0) * (I / GS));
      const char* pb = reinterpret_cast<const char*>(
          (slot < K ? down_b + pe * D * (I / GS) : sdown_b) + size_t(r0) * (I / GS));
      for (int l = tid * 128; l < nr * DWR * 4; l += 128 * 32 * NWK) LILY_PREFETCH_L2(pw + l);
      for (int l = tid * 128; l < nr * (I / GS) * int(sizeof(S)); l += 128 * 32 * NWK) {
        LILY_PREFETCH_L2(ps_ + l);
        LILY_PREFETCH_L2(pb + l);
      }
    }
#endif
    // x as the row's first router tile normalised it (the add + RMSNorm once per row)
    lily_copy_l2<T, D, 32 * NWK>(xs, reinterpret_cast<const T*>(wn + O_XN), tid);
    __syncthreads();
    LILY_TRACE(3);
    lily_swiglu_rows<T>(tg, tu, xs, sl, reinterpret_cast<T*>(wn) + slot * I, row0, I);
    LILY_TRACE(4);
    lily_arrive(ctr + 2, tid);
  } else if (t < TOTAL) {
    // ---- down tile: lily_moe_down (SL = 1) for DRPB output rows
    const int u = t - N * (RT + GT);
    const int n = u / DT;
    const char* wn = reinterpret_cast<const char*>(work) + (size_t)n * WPR * 4;
    const int sub = lane / DLPR;
    const int sl = lane % DLPR;
    const int row0 = (u % DT) * DRPB + (warp * (32 / DLPR) + sub) * DRPW;
    LilyRowTile<S, I, BITS, GS, DRPW, DLPR> tile[K + 1];
    tile[K].load(reinterpret_cast<const uint4*>(sdown_w), sdown_s, sdown_b, row0, D - 1, sl);
    lily_wait_count(ctr + 2, N * GT, tid);
    LILY_TRACE(2);
    if (tid < K) {
      s_inds[tid] = __ldcg(reinterpret_cast<const unsigned*>(wn + O_IN) + tid);
      s_cf[tid] = lily_f(__ldcg(reinterpret_cast<const T*>(wn + O_SC) + tid));
    }
    if (tid == K) s_cf[K] = lily_f(__ldcg(reinterpret_cast<const T*>(wn + O_SH)));
    lily_copy_l2<T, (K + 1) * I, 32 * NWK>(xs, reinterpret_cast<const T*>(wn), tid);
    __syncthreads();
    LILY_TRACE(3);
#pragma unroll
    for (int j = 0; j < K; ++j) {
      const size_t e = min(s_inds[j], (unsigned)(E - 1));
      tile[j].load(reinterpret_cast<const uint4*>(down_w) + e * D * DKW,
                   down_s + e * D * (I / GS), down_b + e * D * (I / GS), row0, D - 1, sl);
    }
    float acc[DRPW];
#pragma unroll
    for (int r = 0; r < DRPW; ++r) acc[r] = 0.f;
#pragma unroll
    for (int j = 0; j <= K; ++j) tile[j].fma(xs + j * I, sl, s_cf[j], acc);
#pragma unroll
    for (int r = 0; r < DRPW; ++r) {
      const float v = lily_group_sum<DLPR>(acc[r]);
      const int row = row0 + r;
      if (sl == 0 && row < D) y[(size_t)n * D + row] = static_cast<T>(v);
    }
    LILY_TRACE(4);
  }
  // the last block to leave resets the counters for the next launch
  __syncthreads();
  LILY_TRACE(5);
  if (tid == 0 && lily_add_acq_rel(ctr + 3, 1) == TOTAL - 1) {
    ctr[0] = 0;
    ctr[1] = 0;
    ctr[2] = 0;
    ctr[3] = 0;
  }
