"""Device-side timing on MLX's CUDA backend: how long the GPU itself takes for a chain of
work, apart from the host's graph building and per-primitive dispatch.

``time_chain(fn, x)`` puts a one-block kernel in front of the chain that spins on the
GPU's global nanosecond timer (PTX ``%globaltimer``) for ``spin_ms`` and then passes ``x``
through; ``fn`` gets that copy, so everything it builds waits for the spin. While the GPU
spins, the host dispatches the whole chain; when the spin ends the GPU finds the chain
queued and runs it back to back. A second kernel that takes ``fn``'s outputs as inputs
reads the timer again: the difference is the GPU's time for the chain, without host
stalls (``host_covered`` says whether the dispatch indeed finished inside the spin).

MLX's CUDA graphs order nodes by data dependencies only, so the chain must hang off the
spun copy of ``x`` and the stamp must take every output whose work should be counted.
Caveat (measured on an H200): MLX's dispatch can wait for the spinning
GPU (it blocks once more than 10 committed graphs are in flight, and it waited even for a
short chain), so ``host_covered`` came out False and ``gpu_s`` then includes GPU time
spent waiting for the host: an upper bound on the GPU's own time.
Other backends: ``available()`` is False and ``time_chain`` raises.
Source of the method: CUDA's PTX ISA, special register ``%globaltimer`` (ns).
"""
from __future__ import annotations

import time

import mlx.core as mx

_CLOCK = """
__device__ __forceinline__ unsigned long long lily_clock_now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
"""

_SPIN = """
  if (threadIdx.x == 0) {
    const unsigned long long t0 = lily_clock_now();
    const unsigned long long wait = 1000ull * (unsigned long long)us[0];
    unsigned long long now = t0;
    while (now - t0 < wait) now = lily_clock_now();
    t[0] = (uint32_t)(now & 0xffffffffull);
    t[1] = (uint32_t)(now >> 32);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < N; i += blockDim.x) y[i] = x[i];
"""

_STAMP = """
  if (threadIdx.x == 0) {
    const unsigned long long now = lily_clock_now();
    t[0] = (uint32_t)(now & 0xffffffffull);
    t[1] = (uint32_t)(now >> 32);
  }
"""

_KERNELS: dict = {}


def available() -> bool:
    """True on MLX's CUDA backend (the only one with a device timer these kernels read)."""
    from mlx_lily.backend import current_backend

    return current_backend() == "cuda"


def _kernel(kind: str, n_inputs: int = 1):
    key = (kind, n_inputs)
    k = _KERNELS.get(key)
    if k is None:
        if kind == "spin":
            k = mx.fast.cuda_kernel(name="lily_clock_spin", input_names=["x", "us"],
                                    output_names=["y", "t"], source=_SPIN, header=_CLOCK)
        else:
            k = mx.fast.cuda_kernel(name=f"lily_clock_stamp{n_inputs}",
                                    input_names=[f"d{i}" for i in range(n_inputs)],
                                    output_names=["t"], source=_STAMP, header=_CLOCK,
                                    ensure_row_contiguous=False)
        _KERNELS[key] = k
    return k


def spin(x: mx.array, spin_ms: float) -> tuple[mx.array, mx.array]:
    """``(copy of x, t)``: the copy is written after the GPU spent ``spin_ms`` ms in a
    one-block spin; ``t`` (uint32 ``[2]``, low/high word) is the timer in ns at its end.

    Raises:
        RuntimeError: not on MLX's CUDA backend.
    """
    if not available():
        raise RuntimeError("mlx_lily.bench.gpu_clock needs MLX's CUDA backend")
    return spin_us(x, mx.array([int(spin_ms * 1000)], dtype=mx.uint32))


def spin_us(x: mx.array, us: mx.array) -> tuple[mx.array, mx.array]:
    """``spin`` with the wait given as a uint32 array whose first element is microseconds
    (reuse one evaluated array of >= 16 bytes, e.g. zeros, to stamp a chain's start
    without a host-memory read or a new array per call)."""
    if not available():
        raise RuntimeError("mlx_lily.bench.gpu_clock needs MLX's CUDA backend")
    y, t = _kernel("spin")(inputs=[x, us], template=[("N", x.size)],
                          output_shapes=[x.shape, (2,)], output_dtypes=[x.dtype, mx.uint32],
                          grid=(256, 1, 1), threadgroup=(256, 1, 1))
    return y, t


def stamp(*deps: mx.array) -> mx.array:
    """The GPU timer (ns, uint32 ``[2]`` low/high) read once every array in ``deps`` is
    computed (they are inputs of the kernel; it reads none of them)."""
    if not available():
        raise RuntimeError("mlx_lily.bench.gpu_clock needs MLX's CUDA backend")
    (t,) = _kernel("stamp", len(deps))(inputs=list(deps), output_shapes=[(2,)],
                                        output_dtypes=[mx.uint32], grid=(32, 1, 1),
                                        threadgroup=(32, 1, 1))
    return t


def ns(t: mx.array) -> int:
    """The 64-bit timer value of a ``spin``/``stamp`` output."""
    lo, hi = (int(v) for v in t.tolist())
    return (hi << 32) | lo


def time_chain(fn, x: mx.array, spin_ms: float = 100.0) -> dict:
    """GPU time of the work ``fn`` builds from ``x``.

    Args:
        fn: ``x -> array or list of arrays``; everything to be timed must feed them.
        x: the chain's input (its copy, made after the spin, is what ``fn`` receives).
        spin_ms: how long the GPU waits first; must exceed the host's dispatch of the chain.
    Returns:
        ``{"gpu_s", "host_dispatch_s", "spin_s", "host_covered", "outputs"}``: GPU seconds
        from the end of the spin to the stamp; host seconds inside ``mx.async_eval``;
        ``host_covered`` False when the dispatch took longer than the spin (``gpu_s``
        then includes the GPU waiting for the host: raise ``spin_ms``).
    Raises:
        RuntimeError: not on MLX's CUDA backend.
    """
    mx.synchronize()
    x1, t0 = spin(x, spin_ms)
    outs = fn(x1)
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    t1 = stamp(*outs)
    h0 = time.perf_counter()
    mx.async_eval(t0, t1, *outs)
    host = time.perf_counter() - h0
    mx.eval(t0, t1)
    mx.synchronize()
    gpu = (ns(t1) - ns(t0)) / 1e9
    return {"gpu_s": gpu, "host_dispatch_s": host, "spin_s": spin_ms / 1e3,
            "host_covered": host < 0.9 * spin_ms / 1e3, "outputs": outs}
