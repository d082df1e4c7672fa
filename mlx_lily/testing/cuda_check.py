"""Offline compile check of ``mx.fast.cuda_kernel`` bodies with nvcc (no GPU needed).

Renders a body the way MLX 0.32's CUDA backend does (default includes, the ``header``,
``namespace mlx::core::cu``, ``__global__ void <name>(const T* in..., [Shape x_shape,
Strides x_strides, int x_ndim when mentioned], T* out...)`` with template arguments as
``constexpr int`` / ``using`` lines at the top of the body), then runs
``nvcc -arch=sm_90a -c`` against a small stand-in for MLX's JIT header. It catches syntax
and type errors before a GPU call; NVRTC on the device remains the final word.
``resources`` reports what ptxas allocates (registers, spills) for one instantiation.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from ..cuda_cache import Launch
from ..cuda_cache import render as _render

_STUB = Path(__file__).resolve().parent / "cuda_stub"

def nvcc_path() -> str | None:
    """Path of nvcc, or None."""
    return shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)


def render(name: str, inputs, outputs, source: str, header: str = "", template=()) -> str:
    """Render a kernel as MLX does (``mlx_lily.cuda_cache.render``).

    Args:
        inputs: ``[(name, mx.Dtype, ndim)]``; outputs: ``[(name, mx.Dtype)]``;
        template: ``[(name, int | bool | mx.Dtype)]``.
    """
    return _render(Launch(name, header, source, tuple(n for n, _, _ in inputs),
                          tuple((dt, nd) for _, dt, nd in inputs),
                          tuple(n for n, _ in outputs), tuple(dt for _, dt in outputs),
                          tuple(template)))


def check(name, inputs, outputs, source, header="", template=(), arch="sm_90a",
          extra_flags=()) -> str:
    """Compile the rendered kernel with nvcc (plus ``extra_flags``); return nvcc's
    warnings text.

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
                            *extra_flags, str(src), "-o", str(Path(d) / "k.o")],
                           capture_output=True, text=True)
    if r.returncode != 0:
        lines = text.splitlines()
        numbered = "\n".join(f"{i + 1:4d}: {l}" for i, l in enumerate(lines))
        raise RuntimeError(f"nvcc failed for {name}:\n{r.stderr}\n--- rendered ---\n{numbered}")
    return r.stderr


def resources(name, inputs, outputs, source, header="", template=(), arch="sm_90a") -> dict:
    """What ptxas allocates per thread for one instantiation (``nvcc -Xptxas -v``):
    ``{"registers", "spill_stores", "spill_loads", "stack"}`` (registers: a count; the
    rest: bytes). nvcc's ptxas, not the device's NVRTC: the figures can differ by driver
    version, so they explain a measurement rather than replace one.

    Raises:
        RuntimeError: as ``check``, or ptxas printed no resource line for the kernel.
    """
    text = check(name, inputs, outputs, source, header, template, arch,
                 extra_flags=("-Xptxas", "-v"))
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                       r"(\d+) bytes spill loads", text)
    if regs is None or spills is None:
        raise RuntimeError(f"ptxas reported no resources for {name}:\n{text}")
    return {"registers": int(regs.group(1)), "stack": int(spills.group(1)),
            "spill_stores": int(spills.group(2)), "spill_loads": int(spills.group(3))}
