// mlx-lily Metal emulator: the ABI between the fiber runtime (runtime.cpp) and
// a generated kernel translation unit. Plain C types only; no Metal macros.
#pragma once

typedef unsigned int __emu_u32;
typedef __emu_u32 __emu_uint3 __attribute__((ext_vector_type(3)));

// Every Metal kernel attribute MLX can pass, filled per emulated GPU thread.
struct __emu_attrs {
  __emu_uint3 thread_position_in_grid;
  __emu_uint3 thread_position_in_threadgroup;
  __emu_uint3 threadgroup_position_in_grid;
  __emu_uint3 threads_per_threadgroup;           // this threadgroup's size (edge groups are smaller)
  __emu_uint3 dispatch_threads_per_threadgroup;  // the size given at dispatch
  __emu_uint3 threadgroups_per_grid;
  __emu_uint3 threads_per_grid;                  // == grid_size
  __emu_uint3 grid_origin;
  __emu_u32 thread_index_in_threadgroup;
  __emu_u32 thread_index_in_simdgroup;
  __emu_u32 simdgroup_index_in_threadgroup;
  __emu_u32 simdgroups_per_threadgroup;
  __emu_u32 dispatch_simdgroups_per_threadgroup;
  __emu_u32 threads_per_simdgroup;
  __emu_u32 thread_execution_width;
  __emu_u32 thread_index_in_quadgroup;
  __emu_u32 quadgroup_index_in_threadgroup;
  __emu_u32 quadgroups_per_threadgroup;
  __emu_u32 dispatch_quadgroups_per_threadgroup;
};

#define __EMU_SLOT 96

// Per-simdgroup exchange area for collectives: each lane writes its operand
// to in[lane] (and an integer parameter), the last lane to arrive runs the
// operation's compute function, which fills out[lane] for every lane.
struct __emu_simd_xchg {
  alignas(16) unsigned char in[32][__EMU_SLOT];
  alignas(16) unsigned char out[32][__EMU_SLOT];
  int param[32];
  int nlanes;  // lanes that exist in this simdgroup (the last one of a partial threadgroup may be short)
};

typedef void (*__emu_compute_fn)(struct __emu_simd_xchg*);

// Launch description, filled by Python (ctypes mirrors this layout).
struct __emu_launch {
  void* const* bufs;
  unsigned int grid[3];
  unsigned int tg[3];            // already clamped to min(threadgroup, grid) like MLX
  int nworkers;
  int order;                     // 0 ascending, 1 descending, 2 random (per threadgroup)
  unsigned long long seed;
  unsigned long stack_size;
  unsigned long tg_mem_limit;
  int poison_tg;
  int catch_signals;
  char* err;
  int errlen;
  int failed;
};

#ifdef __cplusplus
extern "C" {
#endif
struct __emu_simd_xchg* __emu_simd_enter(__emu_u32* lane);
void __emu_simd_sync(__emu_compute_fn fn, const char* op, int line, const char* file);
void __emu_tg_barrier(const char* op, int line, const char* file);
void* __emu_tg_alloc(const void* key, unsigned long size, const char* name, int line, const char* file);
__emu_u32 __emu_lane(void);
void __emu_fail(const char* msg, int line, const char* file);
int __emu_launch_kernel(struct __emu_launch* L);
// Defined by the generated kernel translation unit.
void __emu_kernel_entry(void* const* bufs, const struct __emu_attrs* a);
#ifdef __cplusplus
}
#endif
