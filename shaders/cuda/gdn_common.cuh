// Shared helpers of the Gated DeltaNet kernels (gdn_decode, gdn_prep, gdn_norm): pulled
// into each kernel's header by its `// @header gdn_common.cuh` line.

template <typename T>
__device__ __forceinline__ float lily_rnd(float x) {
  return static_cast<float>(static_cast<T>(x));
}

__device__ __forceinline__ float lily_sigmoid(float x) {
  return 1.0f / (1.0f + expf(-x));
}

__device__ __forceinline__ float lily_softplus(float x) {
  float m = fmaxf(x, 0.0f);
  return m + logf(1.0f + expf(-fabsf(x)));
}

__device__ __forceinline__ float lily_warp_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  v += __shfl_xor_sync(0xffffffffu, v, 2);
  v += __shfl_xor_sync(0xffffffffu, v, 4);
  v += __shfl_xor_sync(0xffffffffu, v, 8);
  v += __shfl_xor_sync(0xffffffffu, v, 16);
  return v;
}
