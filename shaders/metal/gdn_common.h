// Shared helpers of the Gated DeltaNet kernels (gdn_decode, gdn_prep, gdn_norm): pulled
// into each kernel's header by its `// @header gdn_common.h` line.

template <typename T>
inline float lily_rnd(float x) {
  return static_cast<float>(static_cast<T>(x));
}

inline float lily_sigmoid(float x) {
  return 1.0f / (1.0f + metal::exp(-x));
}

inline float lily_softplus(float x) {
  // logaddexp(x, 0)
  float m = metal::max(x, 0.0f);
  return m + metal::log(1.0f + metal::exp(-metal::abs(x)));
}

inline float lily_warp_sum(float v) {
  v += simd_shuffle_xor(v, 1);
  v += simd_shuffle_xor(v, 2);
  v += simd_shuffle_xor(v, 4);
  v += simd_shuffle_xor(v, 8);
  v += simd_shuffle_xor(v, 16);
  return v;
}
