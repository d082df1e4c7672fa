// mlx-lily Metal emulator: the fiber runtime.
//
// One cooperative fiber (ucontext) per emulated GPU thread. A threadgroup runs
// wholly on one OS worker thread, so its threadgroup memory (an arena owned by
// the worker) is shared by its fibers. A fiber runs until it reaches a
// collective (threadgroup_barrier, a simd_* operation) or returns; the last
// participant to arrive completes the collective and releases the others.
// When no fiber can run and some have not returned, the threadgroup is stuck:
// that is a divergent collective or a deadlock, reported with source lines.
//
// Compiled once (position independent) and linked into every kernel library.

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include "emu_abi.h"

// Context switching. On x86-64 a small assembly routine swaps the callee-saved
// registers and the stack pointer (no signal-mask system call, ~20x cheaper
// than swapcontext); elsewhere, or with -DEMU_USE_UCONTEXT, ucontext is used.
#if defined(__x86_64__) && !defined(EMU_USE_UCONTEXT)
#define EMU_FAST_SWITCH 1
extern "C" void __emu_switch(void** save_sp, void* new_sp);
asm(R"(
    .text
    .globl __emu_switch
    .hidden __emu_switch
    .type __emu_switch,@function
__emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size __emu_switch, .-__emu_switch
)");
#else
#define EMU_FAST_SWITCH 0
#endif

namespace {

enum { F_RUNNABLE = 0, F_BLOCKED = 1, F_DONE = 2 };
enum { W_NONE = 0, W_BARRIER = 1, W_SIMD = 2 };

struct Site {
  const char* op;
  const char* file;
  int line;
  unsigned seq;
};

struct Fiber {
#if EMU_FAST_SWITCH
  void* sp;
#else
  ucontext_t ctx;
#endif
  __emu_attrs a;
  int state;
  int wait;
  Site site;
  unsigned bar_seq;
  unsigned simd_seq;
  char* stack;
};

struct SimdGroup {
  __emu_simd_xchg x;
  int arrived;
  Site site;
  __emu_compute_fn fn;
};

struct Worker {
  __emu_launch* L;
#if EMU_FAST_SWITCH
  void* sched_sp;
#else
  ucontext_t sched;
#endif
  Fiber* fibers;
  SimdGroup* sgs;
  unsigned* order;
  char* stack_base;
  size_t stack_map_len;
  size_t stack_stride;
  size_t page;
  unsigned cap;
  unsigned n;
  unsigned live;
  unsigned cur;
  int in_fiber;
  int bar_arrived;
  Site bar_site;
  unsigned char* arena;
  size_t arena_cap;
  size_t arena_used;
  int nkeys;
  const void* keys[256];
  size_t offs[256];
  unsigned long long rng;
  unsigned tgpos[3];
  char* altstack;
};

__thread Worker* tl_w = nullptr;

// Leave the running fiber for the scheduler (the fiber is resumed by to_fiber).
inline void to_scheduler(Worker* w, Fiber* f) {
#if EMU_FAST_SWITCH
  __emu_switch(&f->sp, w->sched_sp);
#else
  swapcontext(&f->ctx, &w->sched);
#endif
}
inline void to_fiber(Worker* w, Fiber* f) {
#if EMU_FAST_SWITCH
  __emu_switch(&w->sched_sp, f->sp);
#else
  swapcontext(&w->sched, &f->ctx);
#endif
}

void set_error(__emu_launch* L, const char* fmt, ...) {
  if (__atomic_exchange_n(&L->failed, 1, __ATOMIC_SEQ_CST) != 0) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(L->err, (size_t)L->errlen, fmt, ap);
  va_end(ap);
}

bool failed(__emu_launch* L) { return __atomic_load_n(&L->failed, __ATOMIC_RELAXED) != 0; }

// Leave the current fiber for good (after an error): it is never resumed.
[[noreturn]] void abandon_fiber(Worker* w) {
  Fiber* f = &w->fibers[w->cur];
  f->state = F_DONE;
  to_scheduler(w, f);
  __builtin_trap();
}

void describe_thread(Worker* w, unsigned tid, char* buf, size_t n) {
  const __emu_attrs& a = w->fibers[tid].a;
  snprintf(buf, n,
           "thread_position_in_grid=(%u,%u,%u) thread_position_in_threadgroup=(%u,%u,%u) "
           "threadgroup_position_in_grid=(%u,%u,%u) simdgroup %u lane %u",
           a.thread_position_in_grid.x, a.thread_position_in_grid.y, a.thread_position_in_grid.z,
           a.thread_position_in_threadgroup.x, a.thread_position_in_threadgroup.y,
           a.thread_position_in_threadgroup.z, a.threadgroup_position_in_grid.x,
           a.threadgroup_position_in_grid.y, a.threadgroup_position_in_grid.z,
           a.simdgroup_index_in_threadgroup, a.thread_index_in_simdgroup);
}

[[noreturn]] void fail_here(Worker* w, const char* fmt, ...) {
  char msg[1536];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  char who[320];
  describe_thread(w, w->cur, who, sizeof who);
  set_error(w->L, "%s\n  in %s", msg, who);
  abandon_fiber(w);
}

bool same_site(const Site& a, const Site& b) {
  return a.line == b.line && a.seq == b.seq && strcmp(a.op, b.op) == 0 &&
         strcmp(a.file, b.file) == 0;
}

// ---------------------------------------------------------------- signals
struct sigaction g_old_segv, g_old_bus, g_old_fpe;
pthread_mutex_t g_sig_mu = PTHREAD_MUTEX_INITIALIZER;
int g_sig_users = 0;

void on_fault(int sig, siginfo_t* si, void* uctx) {
  Worker* w = tl_w;
  if (w != nullptr && w->in_fiber) {
    Fiber* f = &w->fibers[w->cur];
    char* addr = (char*)si->si_addr;
    char who[320];
    describe_thread(w, w->cur, who, sizeof who);
    if (sig == SIGSEGV && addr >= f->stack - w->page && addr < f->stack) {
      set_error(w->L,
                "stack overflow of an emulated GPU thread (stack %lu KiB; set "
                "MLX_LILY_EMU_STACK_KB to raise it)\n  in %s",
                (unsigned long)(w->stack_stride - w->page) / 1024, who);
    } else if (sig == SIGFPE) {
      set_error(w->L, "arithmetic trap (integer division by zero?) in the kernel\n  in %s", who);
    } else {
      set_error(w->L, "invalid memory access at address %p (out-of-bounds index or bad pointer)\n  in %s",
                (void*)addr, who);
    }
    f->state = F_DONE;
    w->in_fiber = 0;
#if EMU_FAST_SWITCH
    void* dead_sp;
    __emu_switch(&dead_sp, w->sched_sp);
#else
    setcontext(&w->sched);
#endif
  }
  // Not ours: hand the signal to whoever had it before.
  struct sigaction* old = sig == SIGSEGV ? &g_old_segv : sig == SIGBUS ? &g_old_bus : &g_old_fpe;
  if (old->sa_flags & SA_SIGINFO) {
    if (old->sa_sigaction != nullptr) {
      old->sa_sigaction(sig, si, uctx);
      return;
    }
  } else if (old->sa_handler != SIG_IGN && old->sa_handler != SIG_DFL && old->sa_handler != nullptr) {
    old->sa_handler(sig);
    return;
  }
  signal(sig, SIG_DFL);
  raise(sig);
}

void install_signals() {
  pthread_mutex_lock(&g_sig_mu);
  if (g_sig_users++ == 0) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &g_old_segv);
    sigaction(SIGBUS, &sa, &g_old_bus);
    sigaction(SIGFPE, &sa, &g_old_fpe);
  }
  pthread_mutex_unlock(&g_sig_mu);
}

void remove_signals() {
  pthread_mutex_lock(&g_sig_mu);
  if (--g_sig_users == 0) {
    sigaction(SIGSEGV, &g_old_segv, nullptr);
    sigaction(SIGBUS, &g_old_bus, nullptr);
    sigaction(SIGFPE, &g_old_fpe, nullptr);
  }
  pthread_mutex_unlock(&g_sig_mu);
}

// ---------------------------------------------------------------- fibers
void fiber_main() {
  Worker* w = tl_w;
  Fiber* f = &w->fibers[w->cur];
  __emu_kernel_entry(w->L->bufs, &f->a);
  w = tl_w;
  f->state = F_DONE;
  w->live--;
#if EMU_FAST_SWITCH
  to_scheduler(w, f);  // never resumed
  __builtin_trap();
#endif
  // with ucontext, uc_link returns to the scheduler.
}

// Prepare fiber f to start at fiber_main on its own stack.
void make_fiber(Worker* w, Fiber* f) {
#if EMU_FAST_SWITCH
  char* top = f->stack + (w->stack_stride - w->page);
  top = (char*)((uintptr_t)top & ~(uintptr_t)15);
  void** frame = (void**)(top - 72);
  unsigned* ctl = (unsigned*)frame;
  ctl[0] = 0x1F80;                // mxcsr
  ctl[1] = 0x037F;                // x87 control word
  for (int k = 1; k <= 6; ++k) frame[k] = nullptr;  // r15 r14 r13 r12 rbx rbp
  frame[7] = (void*)&fiber_main;  // return address, at top - 16
  f->sp = frame;
#else
  f->ctx.uc_stack.ss_sp = f->stack;
  f->ctx.uc_stack.ss_size = w->stack_stride - w->page;
  f->ctx.uc_link = &w->sched;
  makecontext(&f->ctx, (void (*)())fiber_main, 0);
#endif
}

unsigned long long next_rand(unsigned long long* s) {
  unsigned long long x = *s;
  x ^= x << 13;
  x ^= x >> 7;
  x ^= x << 17;
  *s = x;
  return x;
}

bool worker_init(Worker* w, __emu_launch* L) {
  memset(w, 0, sizeof *w);
  w->L = L;
  w->page = (size_t)sysconf(_SC_PAGESIZE);
  w->cap = L->tg[0] * L->tg[1] * L->tg[2];
  size_t ss = (L->stack_size + w->page - 1) / w->page * w->page;
  w->stack_stride = ss + w->page;
  w->stack_map_len = w->stack_stride * w->cap;
  void* m = mmap(nullptr, w->stack_map_len, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) {
    set_error(L, "could not map %zu bytes of fiber stacks", w->stack_map_len);
    return false;
  }
  w->stack_base = (char*)m;
  w->fibers = (Fiber*)calloc(w->cap, sizeof(Fiber));
  w->order = (unsigned*)calloc(w->cap, sizeof(unsigned));
  w->sgs = (SimdGroup*)aligned_alloc(64, ((w->cap + 31) / 32) * sizeof(SimdGroup) + 64);
  w->arena_cap = L->tg_mem_limit + 64;
  w->arena = (unsigned char*)aligned_alloc(64, (w->arena_cap + 63) / 64 * 64);
  w->altstack = (char*)malloc(1 << 16);
  if (!w->fibers || !w->order || !w->sgs || !w->arena || !w->altstack) {
    set_error(L, "out of memory setting up a worker");
    return false;
  }
  for (unsigned i = 0; i < w->cap; ++i) {
    char* lo = w->stack_base + (size_t)i * w->stack_stride;
    mprotect(lo, w->page, PROT_NONE);  // guard page below the stack
    w->fibers[i].stack = lo + w->page;
#if !EMU_FAST_SWITCH
    getcontext(&w->fibers[i].ctx);
#endif
  }
  return true;
}

void worker_free(Worker* w) {
  if (w->stack_base) munmap(w->stack_base, w->stack_map_len);
  free(w->fibers);
  free(w->order);
  free(w->sgs);
  free(w->arena);
  free(w->altstack);
}

const char* site_file(const Site& s) { return s.file ? s.file : "?"; }

void report_stall(Worker* w) {
  char msg[3072];
  size_t k = 0;
  auto put = [&](const char* fmt, ...) {
    if (k >= sizeof msg) return;
    va_list ap;
    va_start(ap, fmt);
    int r = vsnprintf(msg + k, sizeof msg - k, fmt, ap);
    va_end(ap);
    if (r > 0) k += (size_t)r;
  };
  unsigned done = 0, at_bar = 0, at_simd = 0, first_done = ~0u;
  for (unsigned i = 0; i < w->n; ++i) {
    Fiber* f = &w->fibers[i];
    if (f->state == F_DONE) {
      done++;
      if (first_done == ~0u) first_done = i;
    } else if (f->wait == W_BARRIER) {
      at_bar++;
    } else if (f->wait == W_SIMD) {
      at_simd++;
    }
  }
  put("divergent collective or deadlock in threadgroup (%u,%u,%u) of %u threads:", w->tgpos[0],
      w->tgpos[1], w->tgpos[2], w->n);
  if (at_bar) {
    put("\n  %u thread(s) wait at %s at %s:%d (barrier #%u)", at_bar, w->bar_site.op,
        site_file(w->bar_site), w->bar_site.line, w->bar_site.seq + 1);
  }
  if (done) {
    const __emu_attrs& a = w->fibers[first_done].a;
    put("\n  %u thread(s) already returned (first: thread_position_in_threadgroup=(%u,%u,%u))", done,
        a.thread_position_in_threadgroup.x, a.thread_position_in_threadgroup.y,
        a.thread_position_in_threadgroup.z);
  }
  unsigned shown = 0;
  unsigned nsg = (w->n + 31) / 32;
  for (unsigned s = 0; s < nsg && shown < 4; ++s) {
    SimdGroup* g = &w->sgs[s];
    if (g->arrived == 0) continue;
    shown++;
    unsigned sd = 0, sb = 0;
    for (int l = 0; l < g->x.nlanes; ++l) {
      Fiber* f = &w->fibers[s * 32 + l];
      if (f->state == F_DONE) sd++;
      else if (f->wait == W_BARRIER) sb++;
    }
    put("\n  simdgroup %u: %d of %d lane(s) wait at %s at %s:%d (simd collective #%u)", s, g->arrived,
        g->x.nlanes, g->site.op, site_file(g->site), g->site.line, g->site.seq + 1);
    if (sd) put("; %u lane(s) returned", sd);
    if (sb) put("; %u lane(s) wait at a threadgroup barrier", sb);
  }
  set_error(w->L, "%s", msg);
}

void run_threadgroup(Worker* w, unsigned gx, unsigned gy, unsigned gz) {
  __emu_launch* L = w->L;
  const unsigned* full = L->tg;
  unsigned pos[3] = {gx, gy, gz};
  unsigned act[3], ngroups[3];
  for (int d = 0; d < 3; ++d) {
    ngroups[d] = (L->grid[d] + full[d] - 1) / full[d];
    unsigned rem = L->grid[d] - pos[d] * full[d];
    act[d] = rem < full[d] ? rem : full[d];
  }
  unsigned n = act[0] * act[1] * act[2];
  unsigned nfull = full[0] * full[1] * full[2];
  w->n = n;
  w->live = n;
  w->tgpos[0] = gx;
  w->tgpos[1] = gy;
  w->tgpos[2] = gz;
  unsigned nsg = (n + 31) / 32;
  for (unsigned tid = 0; tid < n; ++tid) {
    Fiber* f = &w->fibers[tid];
    __emu_attrs& a = f->a;
    unsigned px = tid % act[0], py = (tid / act[0]) % act[1], pz = tid / (act[0] * act[1]);
    a.thread_position_in_threadgroup = (__emu_uint3){px, py, pz};
    a.threadgroup_position_in_grid = (__emu_uint3){gx, gy, gz};
    a.thread_position_in_grid = (__emu_uint3){gx * full[0] + px, gy * full[1] + py, gz * full[2] + pz};
    a.threads_per_threadgroup = (__emu_uint3){act[0], act[1], act[2]};
    a.dispatch_threads_per_threadgroup = (__emu_uint3){full[0], full[1], full[2]};
    a.threadgroups_per_grid = (__emu_uint3){ngroups[0], ngroups[1], ngroups[2]};
    a.threads_per_grid = (__emu_uint3){L->grid[0], L->grid[1], L->grid[2]};
    a.grid_origin = (__emu_uint3){0, 0, 0};
    a.thread_index_in_threadgroup = tid;
    a.thread_index_in_simdgroup = tid % 32;
    a.simdgroup_index_in_threadgroup = tid / 32;
    a.simdgroups_per_threadgroup = nsg;
    a.dispatch_simdgroups_per_threadgroup = (nfull + 31) / 32;
    a.threads_per_simdgroup = 32;
    a.thread_execution_width = 32;
    a.thread_index_in_quadgroup = tid % 4;
    a.quadgroup_index_in_threadgroup = tid / 4;
    a.quadgroups_per_threadgroup = (n + 3) / 4;
    a.dispatch_quadgroups_per_threadgroup = (nfull + 3) / 4;
    f->state = F_RUNNABLE;
    f->wait = W_NONE;
    f->bar_seq = 0;
    f->simd_seq = 0;
    make_fiber(w, f);
  }
  for (unsigned s = 0; s < nsg; ++s) {
    w->sgs[s].arrived = 0;
    unsigned left = n - s * 32;
    w->sgs[s].x.nlanes = (int)(left < 32 ? left : 32);
  }
  w->bar_arrived = 0;
  w->nkeys = 0;
  w->arena_used = 0;
  for (unsigned i = 0; i < n; ++i) w->order[i] = L->order == 1 ? n - 1 - i : i;
  if (L->order == 2) {
    w->rng = L->seed * 0x9E3779B97F4A7C15ull + ((unsigned long long)gz << 42) +
             ((unsigned long long)gy << 21) + gx + 1;
    for (unsigned i = n; i > 1; --i) {
      unsigned j = (unsigned)(next_rand(&w->rng) % i);
      unsigned t = w->order[i - 1];
      w->order[i - 1] = w->order[j];
      w->order[j] = t;
    }
  }
  for (;;) {
    bool progress = false;
    for (unsigned k = 0; k < n; ++k) {
      unsigned i = w->order[k];
      Fiber* f = &w->fibers[i];
      if (f->state != F_RUNNABLE) continue;
      w->cur = i;
      w->in_fiber = 1;
      to_fiber(w, f);
      w->in_fiber = 0;
      progress = true;
      if (failed(L)) return;
    }
    if (w->live == 0) return;
    if (!progress) {
      report_stall(w);
      return;
    }
  }
}

struct WorkerArgs {
  __emu_launch* L;
  unsigned long long* next;
  unsigned long long total;
  unsigned ng[3];
};

void* worker_main(void* p) {
  WorkerArgs* args = (WorkerArgs*)p;
  __emu_launch* L = args->L;
  Worker* w = (Worker*)calloc(1, sizeof(Worker));
  if (!w) {
    set_error(L, "out of memory");
    return nullptr;
  }
  if (!worker_init(w, L)) {
    worker_free(w);
    free(w);
    return nullptr;
  }
  stack_t ss, old_ss;
  bool alt = false;
  if (L->catch_signals) {
    ss.ss_sp = w->altstack;
    ss.ss_size = 1 << 16;
    ss.ss_flags = 0;
    alt = sigaltstack(&ss, &old_ss) == 0;
  }
  tl_w = w;
  for (;;) {
    if (failed(L)) break;
    unsigned long long i = __atomic_fetch_add(args->next, 1ull, __ATOMIC_RELAXED);
    if (i >= args->total) break;
    unsigned gx = (unsigned)(i % args->ng[0]);
    unsigned gy = (unsigned)((i / args->ng[0]) % args->ng[1]);
    unsigned gz = (unsigned)(i / ((unsigned long long)args->ng[0] * args->ng[1]));
    run_threadgroup(w, gx, gy, gz);
  }
  tl_w = nullptr;
  if (alt) sigaltstack(&old_ss, nullptr);
  worker_free(w);
  free(w);
  return nullptr;
}

}  // namespace

// ---------------------------------------------------------------- API used by kernels
extern "C" __emu_simd_xchg* __emu_simd_enter(__emu_u32* lane) {
  Worker* w = tl_w;
  Fiber* f = &w->fibers[w->cur];
  *lane = f->a.thread_index_in_simdgroup;
  return &w->sgs[f->a.simdgroup_index_in_threadgroup].x;
}

extern "C" __emu_u32 __emu_lane(void) {
  Worker* w = tl_w;
  return w->fibers[w->cur].a.thread_index_in_simdgroup;
}

extern "C" void __emu_simd_sync(__emu_compute_fn fn, const char* op, int line, const char* file) {
  Worker* w = tl_w;
  Fiber* f = &w->fibers[w->cur];
  unsigned sgi = f->a.simdgroup_index_in_threadgroup;
  SimdGroup* g = &w->sgs[sgi];
  Site me = {op, file, line, f->simd_seq++};
  if (g->arrived == 0) {
    g->site = me;
    g->fn = fn;
  } else if (!same_site(g->site, me) || g->fn != fn) {
    fail_here(w,
              "divergent simd collective: this lane reached %s at %s:%d (simd collective #%u) while "
              "other lanes of simdgroup %u wait at %s at %s:%d (simd collective #%u)",
              op, site_file(me), line, me.seq + 1, sgi, g->site.op, site_file(g->site),
              g->site.line, g->site.seq + 1);
  }
  g->arrived++;
  if (g->arrived == g->x.nlanes) {
    g->arrived = 0;
    fn(&g->x);
    unsigned base = sgi * 32;
    for (int l = 0; l < g->x.nlanes; ++l) {
      Fiber* o = &w->fibers[base + l];
      if (o->state == F_BLOCKED && o->wait == W_SIMD) {
        o->state = F_RUNNABLE;
        o->wait = W_NONE;
      }
    }
    return;
  }
  f->state = F_BLOCKED;
  f->wait = W_SIMD;
  f->site = me;
  to_scheduler(w, f);
}

extern "C" void __emu_tg_barrier(const char* op, int line, const char* file) {
  Worker* w = tl_w;
  Fiber* f = &w->fibers[w->cur];
  Site me = {op, file, line, f->bar_seq++};
  if (w->bar_arrived == 0) {
    w->bar_site = me;
  } else if (!same_site(w->bar_site, me)) {
    fail_here(w,
              "divergent barrier: this thread reached %s at %s:%d (barrier #%u) while other threads "
              "wait at %s at %s:%d (barrier #%u)",
              op, site_file(me), line, me.seq + 1, w->bar_site.op, site_file(w->bar_site),
              w->bar_site.line, w->bar_site.seq + 1);
  }
  w->bar_arrived++;
  if ((unsigned)w->bar_arrived == w->n) {
    w->bar_arrived = 0;
    for (unsigned i = 0; i < w->n; ++i) {
      Fiber* o = &w->fibers[i];
      if (o->state == F_BLOCKED && o->wait == W_BARRIER) {
        o->state = F_RUNNABLE;
        o->wait = W_NONE;
      }
    }
    return;
  }
  f->state = F_BLOCKED;
  f->wait = W_BARRIER;
  f->site = me;
  to_scheduler(w, f);
}

extern "C" void* __emu_tg_alloc(const void* key, unsigned long size, const char* name, int line,
                                const char* file) {
  Worker* w = tl_w;
  for (int i = 0; i < w->nkeys; ++i) {
    if (w->keys[i] == key) return w->arena + w->offs[i];
  }
  size_t off = (w->arena_used + 15) & ~(size_t)15;
  if (off + size > w->L->tg_mem_limit) {
    fail_here(w,
              "threadgroup memory limit exceeded: 'threadgroup %s' at %s:%d needs %lu bytes, "
              "%zu bytes are already declared, the limit is %lu bytes (32 KiB on Apple GPUs)",
              name, file ? file : "?", line, size, off, w->L->tg_mem_limit);
  }
  if (w->nkeys >= 256) fail_here(w, "too many threadgroup variables (256)");
  if (w->L->poison_tg) memset(w->arena + off, 0xFF, size);
  w->keys[w->nkeys] = key;
  w->offs[w->nkeys] = off;
  w->nkeys++;
  w->arena_used = off + size;
  return w->arena + off;
}

extern "C" void __emu_fail(const char* msg, int line, const char* file) {
  Worker* w = tl_w;
  fail_here(w, "%s at %s:%d", msg, file ? file : "?", line);
}

extern "C" int __emu_launch_kernel(__emu_launch* L) {
  L->failed = 0;
  if (L->errlen > 0) L->err[0] = 0;
  unsigned ng[3];
  unsigned long long total = 1;
  for (int d = 0; d < 3; ++d) {
    if (L->grid[d] == 0 || L->tg[d] == 0) return 0;
    ng[d] = (L->grid[d] + L->tg[d] - 1) / L->tg[d];
    total *= ng[d];
  }
  int nw = L->nworkers < 1 ? 1 : L->nworkers;
  if ((unsigned long long)nw > total) nw = (int)total;
  if (L->catch_signals) install_signals();
  unsigned long long next = 0;
  WorkerArgs args = {L, &next, total, {ng[0], ng[1], ng[2]}};
  pthread_t th[256];
  int started = 0;
  if (nw > 256) nw = 256;
  for (int i = 1; i < nw; ++i) {
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 1 << 20);
    if (pthread_create(&th[started], &attr, worker_main, &args) == 0) started++;
    pthread_attr_destroy(&attr);
  }
  worker_main(&args);
  for (int i = 0; i < started; ++i) pthread_join(th[i], nullptr);
  if (L->catch_signals) remove_signals();
  return L->failed ? 1 : 0;
}

// float -> bfloat conversion, round to nearest even, NaN kept quiet. Compilers lower a
// float-to-__bf16 conversion on x86 without AVX512-BF16 to this libcall; libgcc before
// GCC 13 and some compiler-rt builds do not provide it, so the runtime (linked into every
// kernel library) does.
extern "C" __bf16 __truncsfbf2(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  uint16_t h;
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    h = (uint16_t)((u >> 16) | 0x40u);
  } else {
    h = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  __bf16 r;
  memcpy(&r, &h, 2);
  return r;
}

// double -> bfloat through float would round twice: round the double to bfloat directly.
extern "C" __bf16 __truncdfbf2(double d) {
  uint64_t u;
  memcpy(&u, &d, 8);
  const uint64_t mag = u & 0x7fffffffffffffffull;
  uint16_t h;
  if (mag > 0x7ff0000000000000ull) {
    h = (uint16_t)(((u >> 48) & 0x8000u) | 0x7fc0u);
  } else {
    float f = (float)d;  // exact when the double has <= 24 significant bits
    uint32_t v;
    memcpy(&v, &f, 4);
    double back = (double)f;
    uint32_t lo = v & 0xffffu;
    // f is d rounded to float; if that rounding landed exactly on a bfloat tie, nudge
    // toward d so the second rounding goes the way a direct one would
    if (lo == 0x8000u && back != d) v += (back < d) == (d > 0) ? 1u : (uint32_t)-1;
    h = (uint16_t)((v + 0x7fffu + ((v >> 16) & 1u)) >> 16);
  }
  __bf16 r;
  memcpy(&r, &h, 2);
  return r;
}
