// @kernel lily_attn_decode_combine
// @inputs part_o[B,HQ,NS,D]:float32 part_ml[B,HQ,NS,2]:float32 gate[B,1,HQ,D] (gate read through gate_strides; an 8-element stand-in when GATED=false)
// @outputs out[B,1,HQ*D]:T
// @template T=bfloat16 D=256 GATED=true GATE_PACKED=true
// @grid (256*D/64, HQ, B)
// @threadgroup (256, 1, 1)
// @ensure_row_contiguous false
// GATE_PACKED: gate is the fused q|k|v projection [B,1,HQ*2D+2*HKV*D]; head hq's gate is
// columns hq*2D+D .. hq*2D+2D-1 (q_proj's per-head q|gate layout).
// CUDA twin of shaders/metal/attn_decode_combine.metal: block (x, hq, b) merges the NS
// split-K partials of one query head for dims 64x..64x+63, optional sigmoid output gate.

// ---- body ----
  constexpr int NT = 256;
  constexpr int NSUB = NT / 64;
  __shared__ float red[NT];
  __shared__ float racc[NSUB * 64];
  __shared__ float rl[NSUB];

  const int tid = threadIdx.x;
  const int sub = tid / 64;
  const int t = tid % 64;
  const int hq = blockIdx.y;
  const int b = blockIdx.z;
  const int d = blockIdx.x * 64 + t;
  const int HQ = part_o_shape[1];
  const int NS = part_o_shape[2];
  const int64_t row = int64_t(b) * HQ + hq;
  const float* ml = part_ml + row * NS * 2;
  const float* po = part_o + row * NS * D + d;

  float mx = -3.402823466e+38f;
  for (int s = tid; s < NS; s += NT) {
    mx = fmaxf(mx, ml[2 * s]);
  }
  red[tid] = mx;
  __syncthreads();
  for (int w = NT / 2; w > 0; w >>= 1) {
    if (tid < w) {
      red[tid] = fmaxf(red[tid], red[tid + w]);
    }
    __syncthreads();
  }
  const float M = red[0];

  float acc = 0.0f;
  float lsum = 0.0f;
  for (int s = sub; s < NS; s += NSUB) {
    const float wgt = exp2f(ml[2 * s] - M);
    acc += wgt * po[int64_t(s) * D];
    lsum += wgt * ml[2 * s + 1];
  }
  racc[sub * 64 + t] = acc;
  if (t == 0) {
    rl[sub] = lsum;
  }
  __syncthreads();
  if (sub == 0) {
    float o = 0.0f;
    float ls = 0.0f;
#pragma unroll
    for (int j = 0; j < NSUB; ++j) {
      o += racc[j * 64 + t];
      ls += rl[j];
    }
    o = o / ls;
    T res = static_cast<T>(o);
    if (GATED) {
      const float gv = static_cast<float>(
          GATE_PACKED
              ? gate[int64_t(b) * gate_strides[0] + (int64_t(hq) * 2 * D + D + d) * gate_strides[2]]
              : gate[int64_t(b) * gate_strides[0] + int64_t(hq) * gate_strides[2] + int64_t(d) * gate_strides[3]]);
      const T sg = static_cast<T>(1.0f / (1.0f + expf(-gv)));
      res = static_cast<T>(static_cast<float>(res) * static_cast<float>(sg));
    }
    out[row * D + d] = res;
  }
