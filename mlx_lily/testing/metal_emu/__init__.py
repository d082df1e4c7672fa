"""Run MLX custom Metal kernels on a CPU: an emulator of ``mx.fast.metal_kernel``.

No Linux machine has an Apple GPU, so this package lets CI execute every
Metal kernel body we (and mlx-lm) write. :func:`metal_kernel` has the same
constructor and call signature as ``mx.fast.metal_kernel`` and returns
``mx.array`` outputs. :func:`install` swaps it in for ``mx.fast.metal_kernel``
(and makes ``mx.metal.is_available()`` return True) so code that builds its
kernels at import or call time picks the emulator up.

How it works
------------
* The kernel is rendered exactly as MLX renders it (same signature text:
  parameter order, ``constant`` for inputs under 8 elements, ``const constant
  T&`` for 0-d inputs, ``x_shape``/``x_strides``/``x_ndim`` and attributes
  added only when their names occur in the source, template parameters, the
  mangled ``custom_kernel_...`` name). ``verbose=True`` prints that MSL.
* The same text is compiled as C++17 by clang >= 15 (``python -m ziglang
  c++``, or ``$MLX_LILY_EMU_CXX``) against a shim header (``metal_emu.h`` in this package):
  ``half`` is ``_Float16`` and ``bfloat16_t`` is ``__bf16`` (round to nearest
  even, arithmetic in float rounded after each operation), vectors are clang
  ``ext_vector_type`` (swizzles work; ``float4(a.xy, b)``-style constructors
  and vector ``static_cast`` are provided by the shim), ``metal::``/``fast::``/
  ``precise::`` math, ``as_type``, atomics, ``simdgroup_matrix<T, 8, 8>`` with
  MLX's steel lane layout, and the parts of MLX's ``utils.h`` preamble kernels
  use (``Limits<T>``, ``elem_to_loc``, ``ceildiv``...). Unsuffixed floating
  literals are float (MSL has no double); FP contraction is off.
* Metal's address spaces stay in the types: ``device``, ``constant`` and
  ``threadgroup`` are distinct clang address spaces (``thread`` is the default one), each
  buffer is cast into the space MLX's signature gives it, and ``threadgroup`` variables
  live in the threadgroup space, so code that mixes them (a ``constant`` stand-in passed
  to a ``const device T*`` helper) fails to compile here as it does on a Mac.
* ``threadgroup T x[N];`` declarations are rewritten (keeping line numbers)
  into references to a per-threadgroup arena slot, poisoned with 0xFF bytes
  (NaN for floats) when first reached in each threadgroup.
* Every GPU thread is a cooperative fiber (``MLX_LILY_EMU_STACK_KB`` KiB stacks
  with a guard page, default 64; on x86-64 a small assembly register/stack swap,
  elsewhere or with ``MLX_LILY_EMU_UCONTEXT=1`` ucontext's makecontext/
  swapcontext, ~10x slower: about 0.1 vs 1 us per thread per collective). A threadgroup runs wholly on one
  worker thread; threadgroups are spread over ``os.cpu_count()`` workers
  (``workers=`` / ``MLX_LILY_EMU_WORKERS``). ``threadgroup_barrier``,
  ``simdgroup_barrier`` and every ``simd_*``/``quad_*`` collective is a
  rendezvous: the last of the 32 lanes (or of all threads, for a barrier) to
  arrive completes it. ``simd_sum`` is the ascending xor butterfly
  (1, 2, 4, 8, 16); prefix sums run in lane order.
* Dispatch follows MLX: ``grid`` counts threads, the threadgroup is clamped to
  ``min(threadgroup, grid)`` per dimension, exactly prod(grid) threads run and
  edge threadgroups are partial. ``threads_per_threadgroup`` is the size of the
  thread's own (possibly partial) threadgroup, ``dispatch_threads_per_threadgroup``
  the size given at dispatch (Metal's non-uniform dispatch semantics).
  Threads are linearised x-fastest within the actual threadgroup and grouped
  into simdgroups of 32; the last simdgroup of a partial threadgroup may be
  short (its missing lanes are never shuffled from: such reads are poison).
* Buffers handed to the kernel are 64-byte aligned (inputs are copied when
  MLX's CPU memory is not), as Metal buffers are, so 16-byte vector loads work.
* ``init_value`` fills outputs; otherwise outputs are poisoned (NaN / 0xFF..)
  so an element the kernel never writes shows up. ``ensure_row_contiguous=False``
  passes the array's real memory and strides (in elements), as MLX does.
* Built libraries are cached on disk by a hash of the translation unit, shim and
  compiler (``$MLX_LILY_EMU_CACHE``, default ``~/.cache/mlx-lily/metal-emu``).

Safety nets (on by default)
---------------------------
* Divergent collectives: lanes of one simdgroup reaching different simd
  operations (or the same one a different number of times), a lane returning
  while others wait, threads of a threadgroup at different barriers or a
  barrier some threads never reach, and deadlocks, raise :class:`MetalEmuError`
  naming the kernel, the thread, and the ``source:N`` body lines involved.
* Threadgroup memory beyond 32 KiB (``threadgroup_memory_limit=`` /
  ``MLX_LILY_EMU_TG_MEM``), more threads per threadgroup than the pipeline
  maximum (default 1024; ``max_threads_per_threadgroup=`` /
  ``MLX_LILY_EMU_MAX_THREADS``, e.g. 896 as seen for a head-dim-256 kernel).
* Out-of-bounds accesses that fault, integer division by zero and fiber stack
  overflow become a :class:`MetalEmuError` instead of killing the process.
* ``order="reverse"``/``"random"`` (``MLX_LILY_EMU_ORDER``) changes the order
  in which fibers run between collectives, to shake out missing barriers.
* Compile errors raise :class:`MetalEmuCompileError` with clang's message, lines
  given as ``source:N`` (kernel body) / ``header:N``.

What the emulator cannot show
-----------------------------
* That Apple's Metal compiler accepts the code: clang compiles it as C++17 with
  a permissive shim (e.g. ``std::``-free but C++17 features, implicit
  conversions MSL rejects, ``double``). Use :mod:`mlx_lily.testing.msl_lint`
  for MSL language restrictions, :mod:`mlx_lily.testing.msl_frontend` for every
  instantiation a model's forward makes, and a real Mac.
* Speed, occupancy, register pressure, or the real pipeline thread maximum.
* Memory-ordering races: fibers of a threadgroup interleave only at
  collectives, threadgroups on different workers do run in parallel, but a
  race that needs GPU timing (or lockstep-simdgroup assumptions without a
  barrier) may pass or fail differently than on hardware.
* Exact transcendental results: ``exp``, ``tanh``, ``rsqrt``... come from the
  host libm (correctly rounded or close), not Apple's GPU implementations (a
  few ulp apart, more in ``fast::`` mode). Reduction orders other than the
  documented ``simd_sum`` butterfly (``simd_prefix_*``, ``simdgroup_multiply_
  accumulate``, which accumulates in float in k order) are the emulator's
  choice.
* Simd collectives in divergent control flow that Metal allows (a subset of
  lanes, e.g. ``if (lane < 16) simd_sum(x)``) are reported as divergence.
* It is eager: it cannot run under ``mx.compile`` / ``mx.export_function`` /
  transforms, and ``stream`` is ignored. Textures, imageblocks, raytracing,
  function constants, ``simd_shuffle_and_fill_*`` and complex64 are not supported.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys

import mlx.core as mx

from ._build import CompilerUnavailable, cache_dir, compiler_version
from ._kernel import EmulatedMetalKernel, MetalEmuCompileError, MetalEmuError

__all__ = [
    "EmulatedMetalKernel",
    "MetalEmuCompileError",
    "MetalEmuError",
    "CompilerUnavailable",
    "available",
    "cache_dir",
    "compiler_version",
    "emulated_module",
    "install",
    "metal_kernel",
]


def metal_kernel(
    name,
    input_names,
    output_names,
    source,
    header="",
    ensure_row_contiguous=True,
    atomic_outputs=False,
    compile_options=None,
    **emulator_options,
) -> EmulatedMetalKernel:
    """Drop-in for ``mx.fast.metal_kernel`` that runs the kernel on the CPU.

    Same positional/keyword arguments as MLX; the returned object is called
    like MLX's (``inputs, output_shapes, output_dtypes, grid, threadgroup,
    template=None, init_value=None, verbose=False, stream=None``) and returns
    a list of ``mx.array``. Emulator-only keyword options:
    ``max_threads_per_threadgroup``, ``threadgroup_memory_limit``,
    ``workers``, ``order`` ("forward", "reverse", "random"), ``seed``,
    ``poison``, ``stack_kb``, ``catch_signals``, ``address_spaces`` (default True:
    ``device``/``constant``/``threadgroup`` are distinct clang address spaces, so a
    ``constant`` input (fewer than 8 elements) handed to a ``const device T*`` parameter
    fails to compile as on a Mac; False only for non-MSL bodies).
    """
    return EmulatedMetalKernel(
        name,
        input_names,
        output_names,
        source,
        header=header,
        ensure_row_contiguous=ensure_row_contiguous,
        atomic_outputs=atomic_outputs,
        compile_options=compile_options,
        **emulator_options,
    )


@functools.lru_cache(maxsize=None)
def _probe() -> bool:
    try:
        k = metal_kernel(
            "mlx_lily_emu_probe",
            ["a"],
            ["out"],
            "uint i = thread_position_in_grid.x; out[i] = simd_sum(a[i]);",
        )
        out = k(
            inputs=[mx.ones((32,))],
            output_shapes=[(32,)],
            output_dtypes=[mx.float32],
            grid=(32, 1, 1),
            threadgroup=(32, 1, 1),
        )[0]
        return bool(mx.all(out == 32).item())
    except Exception:
        return False


def available() -> bool:
    """True when a suitable clang works here and a tiny kernel runs correctly (cached)."""
    return _probe()


@contextlib.contextmanager
def install(**emulator_options):
    """Patch ``mx.fast.metal_kernel`` with the emulator and ``mx.metal.is_available`` to True.

    Use as ``with install(): ...`` or from a pytest fixture (``with install():
    yield``). Keyword options are passed to every emulated kernel. The
    previous functions are restored on exit; nesting is fine.
    """
    orig_kernel = mx.fast.metal_kernel
    orig_available = mx.metal.is_available
    factory = functools.partial(metal_kernel, **emulator_options) if emulator_options else metal_kernel
    mx.fast.metal_kernel = factory
    mx.metal.is_available = lambda: True
    try:
        yield factory
    finally:
        mx.fast.metal_kernel = orig_kernel
        mx.metal.is_available = orig_available


@contextlib.contextmanager
def emulated_module(module_name: str, **emulator_options):
    """Reload ``module_name`` under :func:`install` and yield it; restore it afterwards.

    Module-level kernel factories (e.g. ``mlx_lm.models.gated_delta``'s
    ``_make_*`` calls) then build emulated kernels. On exit the module's
    namespace is put back exactly as it was (same objects), so other code and
    tests see the stock module again.
    """
    mod = importlib.import_module(module_name)
    saved = dict(mod.__dict__)
    try:
        with install(**emulator_options):
            mod = importlib.reload(mod)
            yield mod
    finally:
        mod.__dict__.clear()
        mod.__dict__.update(saved)
        sys.modules[module_name] = mod
