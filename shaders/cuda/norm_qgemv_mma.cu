// @kernel lily_norm_qgemv_mma
// @inputs hin[N,K]:T res[N,K]:T nw[K]:T eps[1]:float32 w[O,K*BITS/32]:uint32 scales[O,K/GS]:S biases[O,K/GS]:S
// @outputs y[N,O]:T h[N,K]:T
// @template T=bfloat16 S=bfloat16 K=2048 O=12352 BITS=4 GS=64 N=8 NW=4 RT=1
// @template T=float16 S=float16 K=256 O=37 BITS=4 GS=64 N=3 NW=2 RT=1
// @grid (ceil(O/(16*RT))*32*NW, 1, 1)
// @threadgroup (32*NW, 1, 1)
// The residual add and RMSNorm in front of lily_qgemv_mma, one launch (lily_norm_qgemv's
// contract for N <= 8 rows on tensor cores): every block computes each row's
// h = T(hin + res) (block 0 writes it to h) and x = T(nw * T(h * rsqrt(mean(h^2) + eps)))
// into shared memory, rounded as lily_add_rms_norm rounds (lily_add_rms_norm_row), then runs
// lily_qgemv_mma's loop (lily_qgemv_mma_block) on those rows. A row's norm and its
// column of the mma depend on that row alone, so every row equals itself launched alone.
// Shared memory: N*K values of T plus NW*RT*512 bytes (the host keeps 8*K*2 + that within
// 48 KiB, so the choice of this kernel does not depend on N). No Metal twin: on Metal
// lily_norm_qgemv serves this contract.
// @header qgemv_common.cuh
// @header qgemv_norm.cuh
// @header qgemv_mma.cuh
// ---- body ----
  __shared__ uint4 xs4[(N * K * sizeof(T) + 15) / 16];  // the rows, 16-byte aligned
  T* xs = reinterpret_cast<T*>(xs4);
  __shared__ float red[NW];
  __shared__ float part[NW * RT * 4 * 32];
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  for (int n = 0; n < N; ++n) {
    const size_t ro = (size_t)n * K;
    lily_add_rms_norm_row<T, K, NW>(hin + ro, res + ro, nw, eps[0], xs + ro, red,
                                    blockIdx.x == 0 ? h + ro : nullptr, nullptr, tid, lane,
                                    warp);
  }
  lily_qgemv_mma_block<T, S, K, O, BITS, GS, N, NW, RT>(xs, w, scales, biases, y, part, tid,
                                                        blockIdx.x);
