// @kernel lily_add_rms_norm
// @inputs x[N,D] r[N,D] w[D] eps[1]:float32 (row-contiguous)
// @outputs h[N,D]:T normed[N,D]:T
// @template T=bfloat16 D=2048 E=8
// @grid (D/E * N, 1, 1)
// @threadgroup (D/E, 1, 1)
// CUDA twin of shaders/metal/add_rms_norm.metal: one block per row, E contiguous
// elements per thread (16-byte vector loads/stores when E * sizeof(T) == 16 and the
// pointers are aligned). Grid = whole blocks: no tail threads.

template <typename T, int E>
__device__ __forceinline__ void lily_ld(const T* p, T (&o)[E]) {
  if constexpr (E * sizeof(T) == 16) {
    if ((reinterpret_cast<unsigned long long>(p) & 15ull) == 0) {
      *reinterpret_cast<uint4*>(o) = *reinterpret_cast<const uint4*>(p);
      return;
    }
  }
#pragma unroll
  for (int j = 0; j < E; ++j) {
    o[j] = p[j];
  }
}

template <typename T, int E>
__device__ __forceinline__ void lily_st(T* p, const T (&o)[E]) {
  if constexpr (E * sizeof(T) == 16) {
    if ((reinterpret_cast<unsigned long long>(p) & 15ull) == 0) {
      *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(o);
      return;
    }
  }
#pragma unroll
  for (int j = 0; j < E; ++j) {
    p[j] = o[j];
  }
}

__device__ __forceinline__ float lily_warp_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  v += __shfl_xor_sync(0xffffffffu, v, 2);
  v += __shfl_xor_sync(0xffffffffu, v, 4);
  v += __shfl_xor_sync(0xffffffffu, v, 8);
  v += __shfl_xor_sync(0xffffffffu, v, 16);
  return v;
}

// ---- body ----
  constexpr int TPB = D / E;
  constexpr int NWP = TPB / 32;
  __shared__ float red[NWP];
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int64_t base = int64_t(blockIdx.x) * D + tid * E;

  alignas(16) T xv[E];
  alignas(16) T rv[E];
  alignas(16) T hb[E];
  lily_ld<T, E>(x + base, xv);
  lily_ld<T, E>(r + base, rv);
  float hv[E];
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < E; ++j) {
    hb[j] = static_cast<T>(static_cast<float>(xv[j]) + static_cast<float>(rv[j]));
    hv[j] = static_cast<float>(hb[j]);
    ss += hv[j] * hv[j];
  }
  lily_st<T, E>(h + base, hb);
  ss = lily_warp_sum(ss);
  if (lane == 0) {
    red[warp] = ss;
  }
  __syncthreads();
  float tot = 0.0f;
#pragma unroll
  for (int i = 0; i < NWP; ++i) {
    tot += red[i];
  }
  const float rinv = rsqrtf(tot / float(D) + eps[0]);
  alignas(16) T wv[E];
  lily_ld<T, E>(w + tid * E, wv);
#pragma unroll
  for (int j = 0; j < E; ++j) {
    const float nv = static_cast<float>(static_cast<T>(hv[j] * rinv));
    hb[j] = static_cast<T>(static_cast<float>(wv[j]) * nv);
  }
  lily_st<T, E>(normed + base, hb);
