"""Shared parity-test plumbing for kernels tested on every backend, including the CUDA
twin's body run by the Metal emulator ("cuda-emu": CUDA built-ins mapped onto Metal's,
a 32-lane simdgroup standing for a warp; it checks the CUDA body's logic, not nvcc).

Used by ``tests/test_op_{qgemv,moe_router_topk,moe_experts}.py``.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_lily import kernels
from mlx_lily.testing.backends import metal_kernel_factory, parity_backends

BACKENDS = [pytest.param(b, marks=pytest.mark.gpu) if b in ("cuda", "metal") else b
            for b in parity_backends()]
for _b in ("cuda", "metal"):
    if _b not in parity_backends():
        BACKENDS.append(pytest.param(_b, marks=[pytest.mark.gpu, pytest.mark.skip(
            reason=f"no {_b} device here")]))
HAS_EMU = "metal-emu" in parity_backends()
if HAS_EMU:
    BACKENDS.append("cuda-emu")  # the CUDA twin's body run by the Metal emulator
KERNEL_BACKENDS = [b for b in BACKENDS if b != "reference"]
MISALIGN = {"bf16": 0}  # byte offset given to bfloat16 inputs under the emulator


def aligned_emu_buffers(monkeypatch):
    """The emulator hands kernels numpy views of MLX CPU memory, which is only 8-byte
    aligned; Metal buffers are 16-byte aligned and the kernels use 16-byte loads.
    Copy inputs to 64-byte aligned buffers (a no-op once the emulator aligns)."""
    try:
        from mlx_lily.testing.metal_emu import _kernel as ek
    except Exception:
        yield
        return
    orig = ek._to_numpy

    def aligned(x):
        a = np.ascontiguousarray(orig(x))
        off0 = MISALIGN["bf16"] if x.dtype == mx.bfloat16 else 0
        buf = np.empty(a.nbytes + 128, np.uint8)
        off = (-buf.ctypes.data) % 64 + off0
        out = buf[off:off + a.nbytes].view(a.dtype).reshape(a.shape)
        out[...] = a
        return out

    monkeypatch.setattr(ek, "_to_numpy", aligned)
    yield


# CUDA built-ins mapped onto the emulator's Metal ones, so the .cu bodies run on the CPU.
CUDA_ON_EMU_HEADER = r"""
#define LILY_EMU 1
#define __device__
#define __forceinline__ inline
typedef bfloat16_t __nv_bfloat16;
typedef half __half;
inline float __uint_as_float(uint u) { return as_type<float>(u); }
inline float __int_as_float(int u) { return as_type<float>(u); }
inline uint __float_as_uint(float f) { return as_type<uint>(f); }
template <typename V> inline V __shfl_xor_sync(uint, V v, int o) { return simd_shuffle_xor(v, ushort(o)); }
template <typename V> inline V __shfl_sync(uint, V v, int l) { return simd_shuffle(v, ushort(l)); }
inline float fmaf(float a, float b, float c) { return metal::fma(a, b, c); }
inline float expf(float a) { return metal::exp(a); }
inline float logf(float a) { return metal::log(a); }
inline float fabsf(float a) { return metal::abs(a); }
inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __nanosleep(uint) {}
inline long long clock64() { return 0; }
inline void __trap() { __builtin_trap(); }
template <typename V> inline V __ldcg(const V* p) { return *(const volatile V*)p; }
inline float fmaxf(float a, float b) { return metal::max(a, b); }
inline float rsqrtf(float a) { return metal::precise::rsqrt(a); }
#define __syncthreads() threadgroup_barrier(mem_flags::mem_threadgroup)
inline float exp2f(float a) { return metal::exp2(a); }
inline float log2f(float a) { return metal::log2(a); }
inline float cosf(float a) { return metal::cos(a); }
inline float sinf(float a) { return metal::sin(a); }
inline float sqrtf(float a) { return metal::sqrt(a); }
inline float tanhf(float a) { return metal::tanh(a); }
inline float fminf(float a, float b) { return metal::min(a, b); }
inline float powf(float a, float b) { return metal::pow(a, b); }
inline float __expf(float a) { return metal::exp(a); }
inline float __fdividef(float a, float b) { return a / b; }
"""


#: Static shared memory a CUDA block may declare (the emulator's limit for CUDA bodies;
#: Metal bodies keep Apple's 32 KiB).
CUDA_STATIC_SHARED = 49152


def cuda_on_emu(spec):
    """The CUDA twin of ``spec`` as an emulated kernel: same body, ``threadIdx`` /
    ``blockIdx`` / ``__shared__`` / ``__syncthreads`` / warp shuffles mapped onto Metal's
    (a 32-lane simdgroup is a warp). Checks the CUDA body's logic, not nvcc."""
    import re

    from mlx_lily.testing import metal_emu

    head, body = kernels.cuda_parts(spec.stem)
    body = re.sub(r"\bthreadIdx\b", "__tid3", body)
    body = re.sub(r"\bblockIdx\b", "__bid3", body)
    body = re.sub(r"\bblockDim\b", "__bdim3", body)
    body = body.replace("__shared__", "threadgroup").replace(
        "__syncthreads()", "threadgroup_barrier(mem_flags::mem_threadgroup)")
    body = ("const uint3 __tid3 = thread_position_in_threadgroup;\n"
            "const uint3 __bid3 = threadgroup_position_in_grid;\n"
            "const uint3 __bdim3 = dispatch_threads_per_threadgroup;\n" + body)
    return metal_emu.metal_kernel(name=spec.name + "_cu", input_names=list(spec.inputs),
                                  output_names=list(spec.outputs), source=body,
                                  header=CUDA_ON_EMU_HEADER + head,
                                  ensure_row_contiguous=spec.ensure_row_contiguous,
                                  address_spaces=False,  # CUDA bodies: no Metal spaces
                                  threadgroup_memory_limit=CUDA_STATIC_SHARED)


def kernel_for(spec, backend):
    """(kernel object, init_value) for a parity backend; NaN-poisoned outputs."""
    if backend == "metal-emu":
        return kernels.build(spec, "metal", factory=metal_kernel_factory("metal-emu")), None
    if backend == "cuda-emu":
        return cuda_on_emu(spec), None
    return kernels.build(spec, backend), float("nan")
