// L2 prefetch hints, an experiment of benchmarks/gpu/phase_trace.py (--variants l2pf,
// l2pf_proj): built with LILY_L2_PREFETCH or LILY_L2_PREFETCH_PROJ defined (where the
// kernels place hints: see each), LILY_PREFETCH_L2(p) asks the L2 to fetch the line
// holding address p (PTX prefetch.global.L2: no result, no ordering, no effect on any
// value). Without the define, and in the emulator (LILY_EMU), it expands to nothing.
#if (defined(LILY_L2_PREFETCH) || defined(LILY_L2_PREFETCH_PROJ)) && !defined(LILY_EMU)
#define LILY_PREFETCH_L2(p) asm volatile("prefetch.global.L2 [%0];" ::"l"(p))
#else
#define LILY_PREFETCH_L2(p) do { } while (0)
#endif
