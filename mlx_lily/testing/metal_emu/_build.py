"""Compile emulated kernels with clang (from the ``ziglang`` package) and cache them.

Built shared objects live under ``$MLX_LILY_EMU_CACHE`` (default
``~/.cache/mlx-lily/metal-emu``), named by a hash of the translation unit,
the shim sources, the flags and the compiler version; they are written to a
temporary name and renamed into place, so concurrent builders are safe.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import shlex
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

SHIM_DIR = Path(__file__).resolve().parent

CXX_FLAGS = (
    "-std=c++17",
    "-O2",
    "-fPIC",
    "-fno-exceptions",
    "-fno-rtti",
    "-fno-math-errno",
    "-ffp-contract=off",
    "-fno-strict-aliasing",
    # MSL has no double: unsuffixed floating literals are float.
    "-cl-single-precision-constant",
    # half and bfloat arithmetic rounds after every operation, as on the GPU.
    "-Xclang",
    "-ffloat16-excess-precision=none",
    "-Xclang",
    "-fbfloat16-excess-precision=none",
    "-w",
)

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL] = {}


class CompilerUnavailable(RuntimeError):
    """No usable clang (>= 15) for the emulator."""


def cache_dir() -> Path:
    """Where built kernels are cached."""
    d = os.environ.get("MLX_LILY_EMU_CACHE")
    p = Path(d) if d else Path.home() / ".cache" / "mlx-lily" / "metal-emu"
    p.mkdir(parents=True, exist_ok=True)
    return p


def compiler_command() -> list[str]:
    """The C++ compiler driver: ``$MLX_LILY_EMU_CXX`` or ``python -m ziglang c++``."""
    env = os.environ.get("MLX_LILY_EMU_CXX")
    if env:
        return shlex.split(env)
    return [sys.executable, "-m", "ziglang", "c++"]


@functools.lru_cache(maxsize=None)
def compiler_version() -> str:
    """``clang version X.Y.Z`` of the compiler; raises CompilerUnavailable if unusable."""
    cmd = compiler_command() + ["--version"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise CompilerUnavailable(f"cannot run {cmd}: {e}") from e
    m = re.search(r"clang version (\d+)\.(\d+)\.(\d+)", r.stdout + r.stderr)
    if r.returncode != 0 or not m:
        raise CompilerUnavailable(
            f"{' '.join(cmd)} did not report a clang version (install the 'ziglang' package):\n"
            + (r.stdout + r.stderr)[-2000:]
        )
    if int(m.group(1)) < 15:
        raise CompilerUnavailable(f"clang {m.group(0)} is too old: the emulator needs clang >= 15")
    return m.group(0)


def _shim_digest() -> str:
    h = hashlib.sha256()
    for p in sorted(SHIM_DIR.iterdir()):
        if p.suffix in (".h", ".cpp"):
            h.update(p.name.encode())
            h.update(p.read_bytes())
    return h.hexdigest()


class CompileError(RuntimeError):
    """clang rejected the generated translation unit."""

    def __init__(self, message: str, stderr: str):
        super().__init__(message)
        self.stderr = stderr


def _run_compiler(args: list[str], what: str) -> None:
    cmd = compiler_command() + args
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise CompileError(f"{what} failed", r.stderr + r.stdout)


def _atomic_build(final: Path, build) -> None:
    fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=final.name + ".", suffix=".tmp")
    os.close(fd)
    try:
        build(tmp)
        os.replace(tmp, final)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _runtime_flags() -> list[str]:
    # MLX_LILY_EMU_UCONTEXT=1 forces the portable ucontext fiber switch.
    return ["-DEMU_USE_UCONTEXT"] if os.environ.get("MLX_LILY_EMU_UCONTEXT") == "1" else []


@functools.lru_cache(maxsize=None)
def runtime_object() -> Path:
    """The compiled fiber runtime (built once per shim version, compiler and flags)."""
    flags = [*CXX_FLAGS, *_runtime_flags()]
    key = hashlib.sha256(
        (compiler_version() + "|" + " ".join(flags) + "|" + _shim_digest()).encode()
    ).hexdigest()[:24]
    final = cache_dir() / f"runtime-{key}.o"
    if not final.exists():
        src = SHIM_DIR / "runtime.cpp"

        def build(tmp):
            _run_compiler(
                [*flags, "-I", str(SHIM_DIR), "-c", str(src), "-o", tmp],
                "compiling the emulator runtime",
            )

        _atomic_build(final, build)
    return final


def build_kernel(tu_text: str) -> tuple[ctypes.CDLL, Path]:
    """Compile (or fetch from the cache) the kernel translation unit and load it."""
    rt = runtime_object()
    key = hashlib.sha256(
        (compiler_version() + "|" + " ".join(CXX_FLAGS) + "|" + rt.name + "|" + tu_text).encode()
    ).hexdigest()[:32]
    with _lock:
        lib = _loaded.get(key)
        if lib is not None:
            return lib, cache_dir() / f"kernel-{key}.so"
    final = cache_dir() / f"kernel-{key}.so"
    if not final.exists():
        src_path = cache_dir() / f"kernel-{key}.cpp"
        tmp_src = src_path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.cpp")
        tmp_src.write_text(tu_text)
        os.replace(tmp_src, src_path)

        def build(tmp):
            _run_compiler(
                [
                    *CXX_FLAGS,
                    "-shared",
                    "-nostdlib++",
                    "-I",
                    str(SHIM_DIR),
                    str(src_path),
                    str(rt),
                    "-o",
                    tmp,
                    "-lm",
                    "-lpthread",
                ],
                "compiling the kernel",
            )

        _atomic_build(final, build)
    with _lock:
        lib = _loaded.get(key)
        if lib is None:
            lib = ctypes.CDLL(str(final))
            lib.__emu_launch_kernel.restype = ctypes.c_int
            lib.__emu_launch_kernel.argtypes = [ctypes.c_void_p]
            _loaded[key] = lib
    return lib, final
