"""Compile Lily's CUDA kernels ahead of time, in parallel, into MLX's on-disk kernel cache.

MLX's CUDA backend compiles every ``mx.fast.cuda_kernel`` instantiation with NVRTC the
first time a process launches it, one at a time, and keeps the result in memory only; a
fresh process pays every compile again (seconds per kernel). It does, however, look each
module up on disk first: ``<MLX_PTX_CACHE_DIR>/<module>.ptx`` (the compiled image) and
``<module>.txt`` (``<name expression>\\t<lowered name>`` lines), where ``<module>`` is
``<kernel name>_<hex std::hash of the generated source>``. This module renders each
launch's source exactly as MLX 0.32 does, compiles the sources concurrently with NVRTC
(through ctypes, in worker processes), and writes those two files, so every
later launch in this and any later process loads the image instead of compiling.

Facts used (MLX 0.32 ``backend/cuda/custom_kernel.cpp`` and ``jit_module.cpp``, read, not
copied): the generated source layout; kernel names ``custom_kernel_<name><template
suffix>``; NVRTC options ``--device-as-default-execution-space
--gpu-architecture=sm_<cc>[a]`` plus the include paths of MLX's wheel; the cache file
format. The hash is libstdc++'s ``std::hash<std::string>`` (``_Hash_bytes``, 64-bit).

A rendering that does not match the running MLX's only costs the old compile time: MLX
finds no file under its own module name and compiles as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import struct
import threading
import time
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx

# ----------------------------------------------------------------------------- hashing
_M64 = (1 << 64) - 1
_MUL = (0xC6A4A793 << 32) + 0x5BD1E995
_SEED = 0xC70F6907


def _shift_mix(v: int) -> int:
    return v ^ (v >> 47)


def libstdcxx_hash(data: bytes | str) -> int:
    """``std::hash<std::string>{}(data)`` of 64-bit libstdc++ (``_Hash_bytes`` with seed
    ``0xc70f6907``), the hash MLX's CUDA backend names kernel modules with.

    Args:
        data: bytes, or a str (hashed as UTF-8).
    Returns:
        The 64-bit hash as a non-negative int.
    """
    if isinstance(data, str):
        data = data.encode()
    n = len(data)
    h = (_SEED ^ (n * _MUL)) & _M64
    aligned = n & ~7
    for (w,) in struct.iter_unpack("<Q", data[:aligned]):
        d = (_shift_mix((w * _MUL) & _M64) * _MUL) & _M64
        h = ((h ^ d) * _MUL) & _M64
    if n & 7:
        d = int.from_bytes(data[aligned:], "little")
        h = ((h ^ d) * _MUL) & _M64
    h = (_shift_mix(h) * _MUL) & _M64
    return _shift_mix(h)


# ----------------------------------------------------------------------------- rendering
CUDA_TYPES = {
    mx.bool_: "bool", mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t",
    mx.int64: "int64_t", mx.uint8: "uint8_t", mx.uint16: "uint16_t", mx.uint32: "uint32_t",
    mx.uint64: "uint64_t", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16",
    mx.float32: "float",
}
# Dtype spelling in template suffixes of kernel names (MLX's get_type_string).
TYPE_STRINGS = {
    mx.float32: "float", mx.float16: "float16_t", mx.bfloat16: "bfloat16_t", mx.bool_: "bool",
    mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t", mx.int64: "int64_t",
    mx.uint8: "uint8_t", mx.uint16: "uint16_t", mx.uint32: "uint32_t", mx.uint64: "uint64_t",
}
DEFAULT_HEADER = ('\n#include "mlx/backend/cuda/device/utils.cuh"\n\n'
                  "#include <cooperative_groups.h>\n\n")


class Launch(NamedTuple):
    """What decides a ``cuda_kernel`` instantiation's generated source.

    ``inputs``: ``((dtype, ndim), ...)``; ``template``: ``((name, int|bool|Dtype), ...)``.
    """

    name: str
    header: str
    source: str
    input_names: tuple
    inputs: tuple
    output_names: tuple
    output_dtypes: tuple
    template: tuple


def template_suffix(template) -> str:
    """The suffix MLX appends to ``custom_kernel_<name>`` for these template arguments."""
    out = []
    for _, v in template:
        if isinstance(v, bool):
            out.append("_t" if v else "_f")
        elif isinstance(v, int):
            out.append(f"_{v}")
        else:
            out.append("_" + TYPE_STRINGS[v])
    return "".join(out)


def kernel_name(launch: Launch) -> str:
    """``custom_kernel_<name><template suffix>``: the ``__global__`` function's name."""
    return "custom_kernel_" + launch.name + template_suffix(launch.template)


def render(launch: Launch) -> str:
    """The full translation unit MLX generates for ``launch`` (byte for byte).

    Raises:
        KeyError: a dtype without a CUDA spelling.
    """
    src = launch.source
    s = [DEFAULT_HEADER, launch.header,
         "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n",
         "__global__ void ", kernel_name(launch), "(\n"]
    for n, (dt, ndim) in zip(launch.input_names, launch.inputs):
        s.append(f"    const {CUDA_TYPES[dt]}* {n},\n")
        if ndim > 0:
            if n + "_shape" in src:
                s.append(f"    const __grid_constant__ Shape {n}_shape,\n")
            if n + "_strides" in src:
                s.append(f"    const __grid_constant__ Strides {n}_strides,\n")
            if n + "_ndim" in src:
                s.append(f"    const __grid_constant__ int {n}_ndim,\n")
    outs = [f"    {CUDA_TYPES[dt]}* {n}" for n, dt in zip(launch.output_names,
                                                         launch.output_dtypes)]
    s.append(",\n".join(outs) + ") {\n")
    if launch.template:
        for n, v in launch.template:
            if isinstance(v, bool):
                s.append(f"  constexpr bool {n} = {'true' if v else 'false'};\n")
            elif isinstance(v, int):
                s.append(f"  constexpr int {n} = {v};\n")
            else:
                s.append(f"  using {n} = {CUDA_TYPES[v]};\n")
        s.append("\n")
    s.append(src)
    s.append("\n}\n\n} // namespace mlx::core::cu\n")
    return "".join(s)


def module_name(launch: Launch, source: str | None = None) -> str:
    """``<kernel name>_<hex hash of the generated source>``: MLX's cache key."""
    source = render(launch) if source is None else source
    return f"{kernel_name(launch)}_{libstdcxx_hash(source):x}"


def cache_paths(cache_dir: Path, module: str) -> tuple[Path, Path]:
    """``(image, names)`` file paths of ``module`` (long names split into folders of 245
    characters, as MLX does)."""
    limit = 245
    p = Path(cache_dir)
    rest = module
    while len(rest) > limit:
        p = p / rest[:limit]
        rest = rest[limit:]
    return p / (rest + ".ptx"), p / (rest + ".txt")


# ----------------------------------------------------------------------------- recording
_RECORDER: list | None = None
_REC_LOCK = threading.Lock()


def record(spec, header: str, body: str, kw: dict) -> None:
    """Note one launch of kernel ``spec`` (called by ``kernels``' CUDA wrappers while a
    ``recording()`` is open)."""
    rec = _RECORDER
    if rec is None:
        return
    ins = tuple((a.dtype, a.ndim) for a in kw["inputs"])
    tmpl = tuple((n, v) for n, v in (kw.get("template") or ()))
    rec.append(Launch(spec.name, header, body, tuple(spec.inputs), ins, tuple(spec.outputs),
                      tuple(kw["output_dtypes"]), tmpl))


def recording_active() -> bool:
    """Whether a ``recording()`` block is open (graphs are built to note launches; nothing
    should be evaluated)."""
    return _RECORDER is not None


@contextlib.contextmanager
def recording():
    """Collect the CUDA kernel launches built while open (graph construction is enough;
    nothing needs evaluating). Yields the list of ``Launch`` records."""
    global _RECORDER
    with _REC_LOCK:
        prev, _RECORDER = _RECORDER, []
        rec = _RECORDER
    try:
        yield rec
    finally:
        _RECORDER = prev


def record_forward(model, prompt_len: int = 8, record_lengths=(2048,)):
    """Build (not evaluate) a short prefill, one decode step and prefills of
    ``record_lengths`` tokens through ``model`` while recording kernel launches.

    Returns:
        ``(outputs, launches)``: the logits of the short prefill and the decode step (on one
        throw-away cache; evaluating them runs the warm-up) and the ``Launch`` records.
    """
    make_cache = getattr(model, "make_cache", None)
    cache = make_cache() if make_cache else None
    tokens = mx.zeros((1, prompt_len), dtype=mx.int32)
    with recording() as launches:
        outs = [model(tokens, cache=cache)]
        outs.append(model(tokens[:, :1], cache=cache))
        for n in record_lengths:
            model(mx.zeros((1, n), dtype=mx.int32), cache=make_cache() if make_cache else None)
    return outs, launches


# ----------------------------------------------------------------------------- NVRTC
_SHIM = """#pragma once
// mlx-lily's stand-in for MLX's embedded device header: the names a generated kernel
// signature needs. MAX_NDIM comes from the installed MLX's own config.h.
#include "mlx/backend/cuda/device/config.h"
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cuda/std/cstdint>
namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, MAX_NDIM>;
using Strides = cuda::std::array<int64_t, MAX_NDIM>;
}  // namespace mlx::core::cu
"""
SHIM_NAME = "mlx/backend/cuda/device/utils.cuh"


class CompileError(RuntimeError):
    """NVRTC rejected a source (the message holds its log)."""


class Nvrtc:
    """The NVRTC library through ctypes.

    Args:
        path: the shared library; None finds the one this process's MLX loaded (from
            ``/proc/self/maps``), else ``MLX_LILY_NVRTC``, else the system's.
    Raises:
        OSError: no NVRTC library found.
    """

    def __init__(self, path: str | None = None):
        path = path or find_nvrtc()
        if path is None:
            raise OSError("NVRTC not found: set MLX_LILY_NVRTC to libnvrtc.so's path")
        self.path = path
        self.lib = lib = ctypes.CDLL(path)
        P, C, I = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int
        PP = ctypes.POINTER(ctypes.c_char_p)
        lib.nvrtcCreateProgram.argtypes = [ctypes.POINTER(P), C, C, I, PP, PP]
        lib.nvrtcAddNameExpression.argtypes = [P, C]
        lib.nvrtcCompileProgram.argtypes = [P, I, PP]
        lib.nvrtcGetProgramLogSize.argtypes = [P, ctypes.POINTER(ctypes.c_size_t)]
        lib.nvrtcGetProgramLog.argtypes = [P, C]
        lib.nvrtcGetLoweredName.argtypes = [P, C, ctypes.POINTER(ctypes.c_char_p)]
        lib.nvrtcGetCUBINSize.argtypes = [P, ctypes.POINTER(ctypes.c_size_t)]
        lib.nvrtcGetCUBIN.argtypes = [P, C]
        lib.nvrtcGetPTXSize.argtypes = [P, ctypes.POINTER(ctypes.c_size_t)]
        lib.nvrtcGetPTX.argtypes = [P, C]
        lib.nvrtcDestroyProgram.argtypes = [ctypes.POINTER(P)]
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        maj, mnr = ctypes.c_int(), ctypes.c_int()
        lib.nvrtcVersion(ctypes.byref(maj), ctypes.byref(mnr))
        self.version = (maj.value, mnr.value)

    def _check(self, rc, what):
        if rc != 0:
            raise CompileError(f"{what}: {self.lib.nvrtcGetErrorString(rc).decode()}")

    def compile(self, source: str, name: str, expression: str, options: list[str],
                headers: dict[str, str] | None = None, sass: bool = True) -> tuple[bytes, str]:
        """Compile one translation unit; return ``(cubin or PTX bytes, lowered name of
        expression)``.

        Raises:
            CompileError: with NVRTC's log.
        """
        lib = self.lib
        headers = headers or {}
        prog = ctypes.c_void_p()
        hs = (ctypes.c_char_p * max(1, len(headers)))(*[v.encode() for v in headers.values()])
        hn = (ctypes.c_char_p * max(1, len(headers)))(*[k.encode() for k in headers])
        self._check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(),
                                           (name + ".cu").encode(), len(headers), hs, hn),
                    "nvrtcCreateProgram")
        try:
            self._check(lib.nvrtcAddNameExpression(prog, expression.encode()),
                        "nvrtcAddNameExpression")
            opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            rc = lib.nvrtcCompileProgram(prog, len(options), opts)
            if rc != 0:
                size = ctypes.c_size_t()
                lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
                log = ctypes.create_string_buffer(size.value + 1)
                lib.nvrtcGetProgramLog(prog, log)
                raise CompileError(f"{name}: {log.value.decode(errors='replace')}")
            lowered = ctypes.c_char_p()
            self._check(lib.nvrtcGetLoweredName(prog, expression.encode(),
                                                ctypes.byref(lowered)), "nvrtcGetLoweredName")
            mangled = lowered.value.decode()
            size = ctypes.c_size_t()
            get_size, get = ((lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN) if sass
                             else (lib.nvrtcGetPTXSize, lib.nvrtcGetPTX))
            self._check(get_size(prog, ctypes.byref(size)), "get size")
            buf = ctypes.create_string_buffer(size.value)
            self._check(get(prog, buf), "get image")
            return buf.raw, mangled
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))


def find_nvrtc() -> str | None:
    """Path of the NVRTC library: the one mapped into this process (MLX's CUDA build loads
    it), else ``MLX_LILY_NVRTC``, else ``ctypes.util.find_library``."""
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            m = re.search(r"(/\S*libnvrtc\.so[.\d]*)$", line)
            if m and "builtins" not in m.group(1):
                return m.group(1)
    except OSError:
        pass
    from . import tuning

    env = tuning.nvrtc
    if env:
        return env
    import ctypes.util

    return ctypes.util.find_library("nvrtc")


def mlx_include_dirs() -> list[str]:
    """The include folders MLX hands NVRTC: the wheel's ``include`` and ``include/cccl``,
    then ``site-packages/nvidia/cu13/include`` or ``$CUDA_HOME``/``$CUDA_PATH``/
    ``/usr/local/cuda`` + ``/include``."""
    root = Path(mx.__file__).resolve().parent
    dirs = []
    inc = root / "include"
    if inc.exists():
        dirs.append(str(inc))
    if (inc / "cccl").exists():
        dirs.append(str(inc / "cccl"))
    cu = root.parent / "nvidia" / "cu13" / "include"
    if not cu.exists():
        home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
        cu = Path(home) / "include"
    if cu.exists():
        dirs.append(str(cu))
    return dirs


def device_index(device) -> int:
    """The ordinal of an ``mx.Device`` (0 for the CPU). MLX's Python ``Device`` exposes
    only ``type``; the index is read from its ``repr``, ``Device(gpu, 1)``."""
    if getattr(device, "type", device) != mx.gpu:
        return 0
    m = re.search(r"(\d+)\)\s*$", repr(device))
    return int(m.group(1)) if m else 0


def device_arch(index: int | None = None) -> tuple[int, int] | None:
    """Compute capability ``(major, minor)`` of CUDA device ``index`` (default: the one
    MLX's default device uses) from the driver, or None."""
    if index is None:
        index = device_index(mx.default_device())
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        if cuda.cuInit(0) != 0:
            return None
        dev = ctypes.c_int()
        if cuda.cuDeviceGet(ctypes.byref(dev), int(index)) != 0:
            return None
        maj, mnr = ctypes.c_int(), ctypes.c_int()
        cuda.cuDeviceGetAttribute(ctypes.byref(maj), 75, dev)
        cuda.cuDeviceGetAttribute(ctypes.byref(mnr), 76, dev)
        return maj.value, mnr.value
    except OSError:
        return None


def nvrtc_options(arch: tuple[int, int], include_dirs: list[str]) -> list[str]:
    """MLX's NVRTC options for a device of compute capability ``arch``."""
    tag = "a" if arch[0] >= 9 else ""
    return (["--device-as-default-execution-space",
             f"--gpu-architecture=sm_{arch[0]}{arch[1]}{tag}"]
            + [f"--include-path={d}" for d in include_dirs])


def mlx_default_cache_dir() -> Path:
    """MLX's kernel cache folder when ``MLX_PTX_CACHE_DIR`` is unset:
    ``<temp>/mlx/<version>/ptx``, ``<temp>`` as ``std::filesystem::temp_directory_path``
    picks it (``TMPDIR``, ``TMP``, ``TEMP``, ``TEMPDIR``, else ``/tmp``)."""
    tmp = next((os.environ[v] for v in ("TMPDIR", "TMP", "TEMP", "TEMPDIR")
                if os.environ.get(v)), "/tmp")
    return Path(tmp) / "mlx" / mx.__version__ / "ptx"


def cache_dir() -> Path:
    """MLX's kernel cache folder as the environment says now (``MLX_PTX_CACHE_DIR``, else
    ``mlx_default_cache_dir()``)."""
    env = os.environ.get("MLX_PTX_CACHE_DIR")
    return Path(env) if env else mlx_default_cache_dir()


def cache_dirs() -> list[Path]:
    """Every folder this process's MLX may read its kernel cache from: MLX reads
    ``MLX_PTX_CACHE_DIR`` once, at its first compile, which may have come before the
    variable was set (``mlx_lily.patch`` sets it), so both candidates are written."""
    out = [cache_dir()]
    if mlx_default_cache_dir() != out[0]:
        out.append(mlx_default_cache_dir())
    return out


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _compile_to_cache(nvrtc: Nvrtc, directory: Path, opts: list[str], sass: bool,
                      module: str, source: str, expression: str) -> None:
    """Compile one module and write its ``.txt`` then (atomically) its image file."""
    image, mangled = nvrtc.compile(source, module, expression, opts, {SHIM_NAME: _SHIM},
                                   sass=sass)
    img_path, txt_path = cache_paths(directory, module)
    img_path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(txt_path, f"{expression}\t{mangled}\n".encode())
    _write_atomic(img_path, image)


def _split_jobs(jobs: list, n: int) -> list[list]:
    """``n`` buckets of about equal total source length (largest first, greedy)."""
    buckets = [[] for _ in range(n)]
    sizes = [0] * n
    for job in sorted(jobs, key=lambda j: -len(j[1])):
        i = sizes.index(min(sizes))
        buckets[i].append(job)
        sizes[i] += len(job[1])
    return [b for b in buckets if b]


def _run_workers(buckets, nvrtc_path, directory, opts, sass,
                 timeout_s: float = 600.0) -> tuple[list, dict]:
    """Compile each bucket in its own ``python -m mlx_lily.cuda_cache`` process (NVRTC
    serialises compiles within one process). Returns ``(compiled modules, failures)``."""
    import json
    import subprocess
    import sys

    env = dict(os.environ)
    libdir = str(Path(nvrtc_path).parent)
    env["LD_LIBRARY_PATH"] = libdir + (":" + env["LD_LIBRARY_PATH"]
                                       if env.get("LD_LIBRARY_PATH") else "")
    import tempfile

    procs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, b in enumerate(buckets):  # start every worker before waiting on any
            job_file = Path(tmp) / f"jobs{i}.json"
            job_file.write_text(json.dumps({"nvrtc": nvrtc_path, "dir": str(directory),
                                            "opts": opts, "sass": sass, "jobs": b}))
            p = subprocess.Popen([sys.executable, "-m", "mlx_lily.cuda_cache", str(job_file)],
                                 env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
            procs.append((p, b))
        compiled, failed = [], {}
        deadline = time.monotonic() + timeout_s
        for p, b in procs:
            try:
                out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate()
                err = f"killed after {timeout_s:g} s. {err}"
            try:
                res = json.loads(out.strip().splitlines()[-1])
            except (ValueError, IndexError):
                for mod, _, _ in b:
                    failed[mod] = f"compile worker exited {p.returncode}: {err[-1500:]}"
                continue
            compiled += res["compiled"]
            failed.update(res["failed"])
    return compiled, failed


def _worker_main() -> int:
    """``python -m mlx_lily.cuda_cache JOBS.json``: compile each job of the file into the
    cache, print ``{"compiled": [...], "failed": {module: error}}``."""
    import json
    import sys

    req = json.loads(Path(sys.argv[1]).read_text())
    nvrtc = Nvrtc(req["nvrtc"])
    compiled, failed = [], {}
    for mod, src, expr in req["jobs"]:
        try:
            _compile_to_cache(nvrtc, Path(req["dir"]), req["opts"], req["sass"], mod, src, expr)
            compiled.append(mod)
        except (CompileError, OSError) as e:
            failed[mod] = str(e)[:2000]
    print(json.dumps({"compiled": compiled, "failed": failed}))
    return 0


def _copy_entry(module: str, src: Path, dst: Path) -> None:
    """Copy one module's two cache files from folder ``src`` to ``dst`` (names first)."""
    s_img, s_txt = cache_paths(src, module)
    d_img, d_txt = cache_paths(dst, module)
    d_img.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(d_txt, s_txt.read_bytes())
    _write_atomic(d_img, s_img.read_bytes())


def precompile(launches, *, directory: Path | None = None, arch: tuple[int, int] | None = None,
               include_dirs: list[str] | None = None, nvrtc: Nvrtc | None = None,
               workers: int | None = None, timeout_s: float = 600.0) -> dict:
    """Compile the distinct sources among ``launches`` that the cache lacks, concurrently,
    and write them where MLX looks them up. Never raises for a compile or file problem:
    what fails is reported and left to MLX's own compile at launch.

    NVRTC runs its compiles one at a time within a process (measured on the H200 host: 20
    kernels took 29.9 s in 16 threads, 26.3 s through MLX's serial JIT; 23 took 6.0 s in
    16 processes), so the work is split over ``workers`` child processes
    (``python -m mlx_lily.cuda_cache``); with one worker, or an ``nvrtc`` object given, it
    runs in this process.

    Args:
        launches: ``Launch`` records (``recording()`` collects them).
        directory: cache folder (default: every folder of ``cache_dirs()``).
        arch: compute capability (default: the default device's).
        include_dirs: NVRTC include folders (default ``mlx_include_dirs()``).
        nvrtc: an ``Nvrtc`` to compile with in this process (tests).
        workers: compile processes (default: CPU count).
        timeout_s: a worker still running after this is killed (its kernels: failed).
    Returns:
        ``{"kernels", "cached", "compiled", "failed": {module: error}, "seconds",
        "workers", "directories"}``; ``"skipped"`` holds the reason when nothing could be
        compiled (no NVRTC, no device, no writable cache folder).
    """
    t0 = time.perf_counter()
    dirs = [Path(directory)] if directory is not None else cache_dirs()
    todo: dict[str, tuple[Launch, str]] = {}
    for ln in launches:
        try:
            src = render(ln)
        except KeyError:
            continue
        todo.setdefault(module_name(ln, src), (ln, src))
    report = {"kernels": len(todo), "cached": 0, "compiled": 0, "failed": {}, "seconds": 0.0,
              "workers": 0, "directories": [str(d) for d in dirs]}
    usable = []
    for d in dirs:
        try:
            d.mkdir(parents=True, exist_ok=True)
            usable.append(d)
        except OSError as e:
            report.setdefault("unwritable", {})[str(d)] = str(e)
    if not usable:
        report["skipped"] = "no writable kernel cache folder"
        report["seconds"] = time.perf_counter() - t0
        return report
    dirs = usable
    home = dirs[0]

    def present(m, d):
        return cache_paths(d, m)[0].exists() and cache_paths(d, m)[1].exists()

    missing = {}
    for m, v in todo.items():
        have = [d for d in dirs if present(m, d)]
        if have:
            report["cached"] += 1
            for d in dirs:
                if d not in have:
                    try:
                        _copy_entry(m, have[0], d)
                    except OSError:
                        pass
        else:
            missing[m] = v
    if not missing:
        report["seconds"] = time.perf_counter() - t0
        return report
    in_process = nvrtc is not None
    try:
        nvrtc = nvrtc or Nvrtc()
    except OSError as e:
        report["skipped"] = str(e)
        return report
    arch = arch or device_arch()
    if arch is None:
        report["skipped"] = "no CUDA device"
        return report
    sass = nvrtc.version >= (11, 8) or arch <= (8, 0)
    opts = nvrtc_options(arch, mlx_include_dirs() if include_dirs is None else include_dirs)
    if not sass:
        opts[1] = opts[1].replace("sm_", "compute_")
    jobs = [(m, src, "mlx::core::cu::" + kernel_name(ln)) for m, (ln, src) in missing.items()]
    n = min(workers or os.cpu_count() or 1, len(jobs))
    if in_process or n <= 1:
        report["workers"] = 1
        compiled = []
        for mod, src, expr in jobs:
            try:
                _compile_to_cache(nvrtc, home, opts, sass, mod, src, expr)
                compiled.append(mod)
            except (CompileError, OSError) as e:
                report["failed"][mod] = str(e)[:2000]
    else:
        buckets = _split_jobs(jobs, n)
        report["workers"] = len(buckets)
        compiled, failed = _run_workers(buckets, nvrtc.path, home, opts, sass, timeout_s)
        report["failed"] = failed
    report["compiled"] = len(compiled)
    for m in compiled:
        for d in dirs[1:]:
            try:
                _copy_entry(m, home, d)
            except OSError:
                pass
    report["seconds"] = time.perf_counter() - t0
    return report


if __name__ == "__main__":
    raise SystemExit(_worker_main())
