// Stand-in for MLX's JIT header, for offline nvcc syntax checks of cuda_kernel bodies.
// Provides the names a rendered mlx-lily kernel may use; it is not MLX's header.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
namespace mlx::core::cu {
struct Shape { int32_t d[10]; __device__ int32_t operator[](int i) const { return d[i]; } };
struct Strides { int64_t d[10]; __device__ int64_t operator[](int i) const { return d[i]; } };
}  // namespace mlx::core::cu
