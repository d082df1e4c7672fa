// Shared helpers of the grouped-GEMM kernels (moeg_gate_up, moeg_down): pulled into each
// kernel's header by its `// @header moeg_common.cuh` line.
// k per stage of the grouped GEMMs and the shared tiles' row stride in bf16 (68 words, 4
// mod 32: the 8 rows an ldmatrix phase or a dequantizing store phase touches fall in 8
// different 4-bank groups).
#define MOEG_KS 128
#define MOEG_LD (MOEG_KS + 8)
// Dynamic shared memory of both grouped GEMMs (one size per kernel name): the x/h tile of
// up to MOEG_MAX_BM rows and the 128 dequantized weight rows, bf16, row stride MOEG_LD.
// Must equal moe_grouped.CUDA_SHARED_MEMORY.
#define MOEG_MAX_BM 64
#define MOEG_SMEM_BYTES ((MOEG_MAX_BM + 128) * MOEG_LD * 2)

// Weight row (0..127 in the block) of load slot i for this lane: 8 lanes per row-octet,
// lane >> 3 picks the 16-byte chunk of the row's 64 stage bytes, so one warp load reads
// 64 contiguous bytes on each of 8 rows.
__device__ __forceinline__ int moeg_wrow(int i, int warp, int lane) {
  return ((i << 2) + warp) * 8 + (lane & 7);
}

// The dynamic shared memory as the BM x-or-h rows (sA) then the 128 weight rows (sB).
template <int BM>
__device__ __forceinline__ void moeg_shared_tiles(__nv_bfloat16*& sA, __nv_bfloat16*& sB) {
  static_assert(BM == 16 || BM == 32 || BM == 64, "BM must be 16, 32 or 64");
  static_assert((BM + 128) * MOEG_LD * 2 <= MOEG_SMEM_BYTES, "shared memory budget");
  extern __shared__ uint4 lily_smem[];
  sA = reinterpret_cast<__nv_bfloat16*>(lily_smem);
  sB = sA + BM * MOEG_LD;
}

__device__ __forceinline__ void moeg_ldsm_x4(unsigned int (&r)[4], const void* p) {
  const unsigned int a = static_cast<unsigned int>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

__device__ __forceinline__ void moeg_mma(float (&c)[4], const unsigned int (&a)[4],
                                         unsigned int b0, unsigned int b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 8 nibbles of one word -> bf16 pairs (q0,q4),(q1,q5),(q2,q6),(q3,q7), each s*q+b with
// one rounding (128+q built exactly in bf16 bits, minus 128 exactly, then fma).
__device__ __forceinline__ unsigned int moeg_dq_pair(unsigned int w, int j,
                                                     __nv_bfloat162 s2, __nv_bfloat162 b2) {
  unsigned int t = ((w >> (4 * j)) & 0x000F000Fu) | 0x43004300u;
  const unsigned int k128u = 0x43004300u;
  __nv_bfloat162 q = __hsub2(*reinterpret_cast<__nv_bfloat162*>(&t),
                             *reinterpret_cast<const __nv_bfloat162*>(&k128u));
  __nv_bfloat162 v = __hfma2(q, s2, b2);
  return *reinterpret_cast<unsigned int*>(&v);
}

__device__ __forceinline__ uint4 moeg_dq8(unsigned int w, __nv_bfloat162 s2, __nv_bfloat162 b2) {
  uint4 o;
  o.x = moeg_dq_pair(w, 0, s2, b2);
  o.y = moeg_dq_pair(w, 1, s2, b2);
  o.z = moeg_dq_pair(w, 2, s2, b2);
  o.w = moeg_dq_pair(w, 3, s2, b2);
  return o;
}

// 8 bf16 (e0..e7) -> (e0,e4,e1,e5,e2,e6,e3,e7)
__device__ __forceinline__ uint4 moeg_perm8(uint4 v) {
  uint4 o;
  o.x = __byte_perm(v.x, v.z, 0x5410);
  o.y = __byte_perm(v.x, v.z, 0x7632);
  o.z = __byte_perm(v.y, v.w, 0x5410);
  o.w = __byte_perm(v.y, v.w, 0x7632);
  return o;
}

// One stage into the shared tiles: this thread's 4 packed weight chunks (load slot i: row
// moeg_wrow(i, warp, lane), chunk lane >> 3, with its group's scale and bias) dequantized
// into sB, and its XR activation chunks (row (tid >> 4) + 8 i, chunk tid & 15) permuted
// into sA. Row stride MOEG_LD.
template <int XR, typename T>
__device__ __forceinline__ void moeg_stage_to_shared(__nv_bfloat16* sA, __nv_bfloat16* sB,
                                                     const uint4 (&rq)[4], const T (&rs)[4],
                                                     const T (&rb)[4], const uint4 (&rx)[XR],
                                                     int tid) {
  const int lane = tid & 31;
  const int warp = tid >> 5;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_bfloat162 s2 = __bfloat162bfloat162(rs[i]);
    const __nv_bfloat162 b2 = __bfloat162bfloat162(rb[i]);
    uint4* dst = reinterpret_cast<uint4*>(&sB[moeg_wrow(i, warp, lane) * MOEG_LD + (lane >> 3) * 32]);
    dst[0] = moeg_dq8(rq[i].x, s2, b2);
    dst[1] = moeg_dq8(rq[i].y, s2, b2);
    dst[2] = moeg_dq8(rq[i].z, s2, b2);
    dst[3] = moeg_dq8(rq[i].w, s2, b2);
  }
#pragma unroll
  for (int i = 0; i < XR; ++i)
    reinterpret_cast<uint4*>(&sA[((tid >> 4) + 8 * i) * MOEG_LD])[tid & 15] = moeg_perm8(rx[i]);
}
