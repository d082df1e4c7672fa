"""Offline compile check of ``mx.fast.cuda_kernel`` bodies with nvcc (no GPU needed).

Renders a body the way MLX 0.32's CUDA backend does (default includes, the ``header``,
``namespace mlx::core::cu``, ``__global__ void <name>(const T* in..., [Shape x_shape,
Strides x_strides, int x_ndim when mentioned], T* out...)`` with template arguments as
``constexpr int`` / ``using`` lines at the top of the body), then runs
``nvcc -arch=sm_90a -c`` against a small stand-in for MLX's JIT header. It catches syntax
and type errors before a GPU call; NVRTC on the device remains the final word.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import mlx.core as mx

_STUB = Path(__file__).resolve().parent / "cuda_stub"

CUDA_TYPES = {
    mx.float32: "float", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16",
    mx.int32: "int32_t", mx.uint32: "uint32_t", mx.int64: "int64_t",
    mx.uint64: "uint64_t", mx.int8: "int8_t", mx.uint8: "uint8_t", mx.bool_: "bool",
    mx.int16: "int16_t", mx.uint16: "uint16_t",
}


def nvcc_path() -> str | None:
    """Path of nvcc, or None."""
    return shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)


def render(name: str, inputs, outputs, source: str, header: str = "", template=()) -> str:
    """Render a kernel as MLX does.

    Args:
        inputs: ``[(name, mx.Dtype, ndim)]``; outputs: ``[(name, mx.Dtype)]``;
        template: ``[(name, int | bool | mx.Dtype)]``.
    """
    s = ['#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n',
         header, "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n",
         f"__global__ void custom_kernel_{name}(\n"]
    for n, dt, ndim in inputs:
        s.append(f"    const {CUDA_TYPES[dt]}* {n},\n")
        if ndim > 0:
            if n + "_shape" in source:
                s.append(f"    const __grid_constant__ Shape {n}_shape,\n")
            if n + "_strides" in source:
                s.append(f"    const __grid_constant__ Strides {n}_strides,\n")
            if n + "_ndim" in source:
                s.append(f"    const __grid_constant__ int {n}_ndim,\n")
    outs = [f"    {CUDA_TYPES[dt]}* {n}" for n, dt in outputs]
    s.append(",\n".join(outs) + ") {\n")
    for n, v in template:
        if isinstance(v, bool):
            s.append(f"  constexpr bool {n} = {'true' if v else 'false'};\n")
        elif isinstance(v, int):
            s.append(f"  constexpr int {n} = {v};\n")
        else:
            s.append(f"  using {n} = {CUDA_TYPES[v]};\n")
    s.append(source)
    s.append("\n}\n\n} // namespace mlx::core::cu\n")
    return "".join(s)


def check(name, inputs, outputs, source, header="", template=(), arch="sm_90a") -> str:
    """Compile the rendered kernel with nvcc; return nvcc's warnings text.

    Raises:
        RuntimeError: nvcc is missing or the kernel does not compile (message holds the
            rendered source's numbered lines around each error).
    """
    nvcc = nvcc_path()
    if nvcc is None:
        raise RuntimeError("nvcc not found")
    text = render(name, inputs, outputs, source, header, template)
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / f"{name}.cu"
        src.write_text(text)
        r = subprocess.run([nvcc, f"-arch={arch}", "-std=c++17", "-I", str(_STUB), "-c",
                            str(src), "-o", str(Path(d) / "k.o")],
                           capture_output=True, text=True)
    if r.returncode != 0:
        lines = text.splitlines()
        numbered = "\n".join(f"{i + 1:4d}: {l}" for i, l in enumerate(lines))
        raise RuntimeError(f"nvcc failed for {name}:\n{r.stderr}\n--- rendered ---\n{numbered}")
    return r.stderr
