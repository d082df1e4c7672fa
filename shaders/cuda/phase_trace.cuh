// Phase stamps for benchmarks/gpu/phase_trace.py. Built with LILY_PHASE_TRACE defined and
// one more output, `trace` (uint64, LILY_TRACE_SLOTS words per block), a block's thread 0
// writes the GPU's global timer (ns) to its slot k at LILY_TRACE(k) and a value to slot k
// at LILY_TRACE_VAL(k, v) (LILY_TRACE_SMID(k): the SM's id); LILY_TRACE_CLEAR() zeroes
// the block's slots. Without LILY_PHASE_TRACE every macro expands to nothing.
#ifdef LILY_PHASE_TRACE
#define LILY_TRACE_SLOTS 8
#define LILY_TRACE_AT(k) trace[(size_t(blockIdx.y) * gridDim.x + blockIdx.x) * LILY_TRACE_SLOTS + (k)]
#define LILY_TRACE(k) do { if (threadIdx.x == 0) { unsigned long long t_; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_)); LILY_TRACE_AT(k) = t_; } } while (0)
#define LILY_TRACE_CLEAR() do { if (threadIdx.x == 0) { for (int k_ = 0; k_ < LILY_TRACE_SLOTS; ++k_) LILY_TRACE_AT(k_) = 0ull; } } while (0)
#define LILY_TRACE_VAL(k, v) do { if (threadIdx.x == 0) LILY_TRACE_AT(k) = (unsigned long long)(v); } while (0)
#define LILY_TRACE_SMID(k) do { if (threadIdx.x == 0) { unsigned s_; asm volatile("mov.u32 %0, %%smid;" : "=r"(s_)); LILY_TRACE_AT(k) = s_; } } while (0)
#else
#define LILY_TRACE(k)
#define LILY_TRACE_CLEAR()
#define LILY_TRACE_VAL(k, v)
#define LILY_TRACE_SMID(k)
#endif
