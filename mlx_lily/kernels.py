"""Kernel sources and one-time kernel construction.

Kernel bodies live under ``shaders/metal/*.metal`` and ``shaders/cuda/*.cu`` (shipped as
the package data ``mlx_lily.shaders``). A kernel object is built once per process and
per (name, backend) and reused for every call; MLX re-renders only the launch.
"""

from __future__ import annotations

import functools
import importlib.resources
from pathlib import Path

import mlx.core as mx

_REPO_SHADERS = Path(__file__).resolve().parent.parent / "shaders"


def shader_path(backend: str, filename: str) -> Path:
    """Path of a kernel source file: ``backend`` is ``"metal"`` or ``"cuda"``.

    Raises:
        FileNotFoundError: the file is in neither the installed package data nor the
            source tree.
    """
    try:
        root = importlib.resources.files("mlx_lily.shaders")
        p = Path(str(root.joinpath(backend, filename)))
        if p.is_file():
            return p
    except ModuleNotFoundError:
        pass
    p = _REPO_SHADERS / backend / filename
    if p.is_file():
        return p
    raise FileNotFoundError(f"mlx-lily kernel source {backend}/{filename} not found")


@functools.lru_cache(maxsize=None)
def shader_source(backend: str, filename: str) -> str:
    """Text of a kernel source file, with its ``// @`` header lines kept (they are comments)."""
    return shader_path(backend, filename).read_text()


def split_header(text: str, marker: str = "// ---- body ----") -> tuple[str, str]:
    """Split a shader file into (header helpers, kernel body) at ``marker``.

    A file without the marker is all body.
    """
    if marker in text:
        head, body = text.split(marker, 1)
        return head, body
    return "", text


@functools.lru_cache(maxsize=None)
def metal_kernel(name: str, filename: str, inputs: tuple, outputs: tuple, *,
                 atomic_outputs: bool = False, ensure_row_contiguous: bool = True):
    """Build (once) an ``mx.fast.metal_kernel`` from ``shaders/metal/<filename>``.

    Returns None when Metal is not available, so callers fall back to the reference.
    """
    if not _metal_ok():
        return None
    head, body = split_header(shader_source("metal", filename))
    return mx.fast.metal_kernel(
        name=name, input_names=list(inputs), output_names=list(outputs),
        source=body, header=head, ensure_row_contiguous=ensure_row_contiguous,
        atomic_outputs=atomic_outputs,
    )


@functools.lru_cache(maxsize=None)
def cuda_kernel(name: str, filename: str, inputs: tuple, outputs: tuple, *,
                shared_memory: int = 0, ensure_row_contiguous: bool = True):
    """Build (once) an ``mx.fast.cuda_kernel`` from ``shaders/cuda/<filename>``.

    Returns None when MLX's CUDA backend is not available.
    """
    if not _cuda_ok():
        return None
    head, body = split_header(shader_source("cuda", filename))
    kwargs = dict(
        name=name, input_names=list(inputs), output_names=list(outputs),
        source=body, header=head, ensure_row_contiguous=ensure_row_contiguous,
    )
    if shared_memory:
        kwargs["shared_memory"] = shared_memory
    return mx.fast.cuda_kernel(**kwargs)


def _metal_ok() -> bool:
    from .backend import _metal_available

    return _metal_available()


def _cuda_ok() -> bool:
    from .backend import _cuda_available

    return _cuda_available() and hasattr(mx.fast, "cuda_kernel")
