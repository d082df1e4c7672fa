"""The emulated ``mx.fast.metal_kernel``: render, compile, run on numpy buffers."""

from __future__ import annotations

import ctypes
import os
import re
from typing import Sequence

import mlx.core as mx
import numpy as np

from . import _build, _render, _rewrite

DEFAULT_MAX_THREADS = 1024
DEFAULT_TG_MEM = 32768
DEFAULT_STACK_KB = 64


class MetalEmuError(RuntimeError):
    """A kernel failed under the emulator (divergence, deadlock, limits, bad access...)."""


class MetalEmuCompileError(MetalEmuError):
    """clang rejected the kernel; the message maps errors to body/header lines."""


_NP_DTYPES = {
    mx.bool_: np.bool_,
    mx.uint8: np.uint8,
    mx.uint16: np.uint16,
    mx.uint32: np.uint32,
    mx.uint64: np.uint64,
    mx.int8: np.int8,
    mx.int16: np.int16,
    mx.int32: np.int32,
    mx.int64: np.int64,
    mx.float16: np.float16,
    mx.bfloat16: np.uint16,  # raw bits
    mx.float32: np.float32,
}


class _Launch(ctypes.Structure):
    _fields_ = [
        ("bufs", ctypes.c_void_p),
        ("grid", ctypes.c_uint * 3),
        ("tg", ctypes.c_uint * 3),
        ("nworkers", ctypes.c_int),
        ("order", ctypes.c_int),
        ("seed", ctypes.c_ulonglong),
        ("stack_size", ctypes.c_ulong),
        ("tg_mem_limit", ctypes.c_ulong),
        ("poison_tg", ctypes.c_int),
        ("catch_signals", ctypes.c_int),
        ("err", ctypes.c_char_p),
        ("errlen", ctypes.c_int),
        ("failed", ctypes.c_int),
    ]


def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    return int(v) if v else default


_ORDERS = {"forward": 0, "reverse": 1, "random": 2}


def _np_dtype(dtype: mx.Dtype):
    try:
        return _NP_DTYPES[dtype]
    except KeyError:
        raise ValueError(f"[metal_kernel] the emulator does not support dtype {dtype}") from None


def _to_numpy(x: mx.array) -> np.ndarray:
    """A numpy view of an mx array's memory (bfloat16 as uint16 bits), strides kept."""
    if x.dtype == mx.bfloat16:
        return np.asarray(x.view(mx.uint16))
    _np_dtype(x.dtype)
    return np.asarray(x)


BUFFER_ALIGN = 64  # Metal buffers are at least 16-byte aligned; vector loads rely on it


def _aligned_bytes(nbytes: int, align: int = BUFFER_ALIGN) -> np.ndarray:
    """A zeroed uint8 array of ``nbytes`` whose data pointer is ``align``-aligned."""
    raw = np.zeros(nbytes + align, np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off : off + nbytes]


def _aligned_empty(shape, dtype) -> np.ndarray:
    dt = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
    return _aligned_bytes(n * dt.itemsize).view(dt).reshape(shape)


#: Bytes of canary on each side of every output buffer; a kernel that writes into them
#: (past either end of an output) fails its launch (``_guarded_empty``, ``_check_guards``).
GUARD_BYTES = 4096
GUARD_FILL = 0xA5


def _guarded_empty(shape, dtype) -> tuple:
    """(array of ``shape``/``dtype``, 64-byte aligned, the buffer holding it with
    ``GUARD_BYTES`` of ``GUARD_FILL`` on each side)."""
    dt = np.dtype(dtype)
    n = (int(np.prod(shape, dtype=np.int64)) if len(shape) else 1) * dt.itemsize
    buf = _aligned_bytes(n + 2 * GUARD_BYTES)
    buf[:GUARD_BYTES] = GUARD_FILL
    buf[GUARD_BYTES + n:] = GUARD_FILL
    return buf[GUARD_BYTES:GUARD_BYTES + n].view(dt).reshape(shape), buf


def _check_guards(buf: np.ndarray, nbytes: int) -> str | None:
    """Where a kernel wrote outside its output (``_guarded_empty``'s buffer holding
    ``nbytes``), as text, or None."""
    lo = np.flatnonzero(buf[:GUARD_BYTES] != GUARD_FILL)
    hi = np.flatnonzero(buf[GUARD_BYTES + nbytes:] != GUARD_FILL)
    parts = []
    if lo.size:
        parts.append(f"bytes {int(lo[0]) - GUARD_BYTES}..{int(lo[-1]) - GUARD_BYTES} "
                     "before its start")
    if hi.size:
        parts.append(f"bytes {int(hi[0])}..{int(hi[-1])} past its end")
    return " and ".join(parts) or None


def _aligned_input(a: np.ndarray) -> np.ndarray:
    """``a`` (any strides) copied so its data pointer is 64-byte aligned, unless it already is.

    Metal hands kernels buffers whose base is aligned; MLX CPU memory seen through
    numpy may be only 8-byte aligned, which breaks 16-byte vector loads. Strided
    views keep their strides: the byte span they reach is copied as is.
    """
    if a.size == 0 or a.ctypes.data % BUFFER_ALIGN == 0:
        return a
    if a.flags["C_CONTIGUOUS"]:
        out = _aligned_empty(a.shape, a.dtype)
        out[...] = a
        return out
    lo = sum(min(0, (n - 1) * st) for n, st in zip(a.shape, a.strides))
    hi = sum(max(0, (n - 1) * st) for n, st in zip(a.shape, a.strides)) + a.itemsize
    x = -(lo // BUFFER_ALIGN) * BUFFER_ALIGN  # first aligned offset >= -lo
    buf = _aligned_bytes(x + hi)
    buf[x + lo : x + hi] = np.frombuffer(ctypes.string_at(a.ctypes.data + lo, hi - lo), np.uint8)
    return np.ndarray(a.shape, a.dtype, buffer=buf, offset=x, strides=a.strides)


def _from_numpy(a: np.ndarray, dtype: mx.Dtype) -> mx.array:
    out = mx.array(a)
    if dtype == mx.bfloat16:
        out = out.view(mx.bfloat16)
    return out


def _line_of(text: str, line: int) -> str | None:
    lines = text.split("\n")
    if 1 <= line <= len(lines):
        return lines[line - 1].strip()
    return None


def annotate(msg: str, source: str, header: str) -> str:
    """Append the text of each ``source:N`` / ``header:N`` line a message cites."""
    seen, notes = set(), []
    for m in re.finditer(r"\b(source|header):(\d+)", msg):
        key = (m.group(1), int(m.group(2)))
        if key in seen:
            continue
        seen.add(key)
        text = _line_of(source if key[0] == "source" else header, key[1])
        if text is not None:
            where = "body" if key[0] == "source" else "header"
            notes.append(f"  {where} line {key[1]}: {text}")
    if notes:
        msg += "\n" + "\n".join(notes)
    return msg


class EmulatedMetalKernel:
    """Callable returned by :func:`metal_kernel`; mirrors MLX's kernel object."""

    def __init__(
        self,
        name: str,
        input_names: Sequence[str],
        output_names: Sequence[str],
        source: str,
        header: str = "",
        ensure_row_contiguous: bool = True,
        atomic_outputs: bool = False,
        compile_options=None,
        *,
        max_threads_per_threadgroup: int | None = None,
        threadgroup_memory_limit: int | None = None,
        workers: int | None = None,
        order: str | None = None,
        seed: int = 0,
        poison: bool = True,
        stack_kb: int | None = None,
        catch_signals: bool = True,
        address_spaces: bool = True,
    ):
        if not output_names:
            raise ValueError("[metal_kernel] Must specify at least one output.")
        if compile_options is not None:
            if not isinstance(compile_options, dict):
                raise TypeError("[metal_kernel] compile_options must be a dict")
            mm = compile_options.get("math_mode", "safe")
            if mm not in ("safe", "relaxed", "fast"):
                raise ValueError("[metal_kernel] Invalid Metal math mode.")
        self.name = name
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        self.source = source
        self.header = header
        self.ensure_row_contiguous = ensure_row_contiguous
        self.atomic_outputs = atomic_outputs
        self.compile_options = compile_options
        self.max_threads = max_threads_per_threadgroup or _env_int(
            "MLX_LILY_EMU_MAX_THREADS", DEFAULT_MAX_THREADS
        )
        self.tg_mem_limit = threadgroup_memory_limit or _env_int("MLX_LILY_EMU_TG_MEM", DEFAULT_TG_MEM)
        self.workers = workers or _env_int("MLX_LILY_EMU_WORKERS", os.cpu_count() or 1)
        order = order or os.environ.get("MLX_LILY_EMU_ORDER", "forward")
        if order not in _ORDERS:
            raise ValueError(f"order must be one of {sorted(_ORDERS)}")
        self.order = order
        self.seed = seed
        self.poison = poison
        self.stack_kb = stack_kb or _env_int("MLX_LILY_EMU_STACK_KB", DEFAULT_STACK_KB)
        self.catch_signals = catch_signals
        self.address_spaces = address_spaces
        self._cpp_header = _rewrite.to_cpp(header)
        self._cpp_source = _rewrite.to_cpp(source)
        self.last_msl: str | None = None

    # ---------------------------------------------------------------- rendering
    def render(self, inputs: Sequence[_render.InputInfo], output_dtypes, template) -> tuple[str, str]:
        """(kernel name, MSL source exactly as MLX renders it)."""
        return _render.render_msl(
            self.name, self.header, self.source, self.input_names, inputs, self.output_names,
            output_dtypes, template, self.atomic_outputs,
        )

    def translation_unit(self, inputs, output_dtypes, template) -> tuple[str, list[_render.Param]]:
        """The C++ translation unit the emulator compiles for one instantiation."""
        kname = _render.kernel_name(self.name, template, inputs, output_dtypes)
        params = _render.parameters(
            self.source, self.input_names, inputs, self.output_names, output_dtypes
        )
        marks: dict = {}
        text = _render.write_signature(
            kname, self._cpp_header, self.source, self.input_names, inputs, self.output_names,
            output_dtypes, template, self.atomic_outputs, body=self._cpp_source, marks=marks,
        )
        hdr, sig, body = text[: marks["signature"]], text[marks["signature"] : marks["body"]], text[marks["body"] :]
        # address_spaces: device / constant / threadgroup are distinct clang address spaces
        # (a constant pointer passed where a device one is expected does not compile, as
        # on a Mac); off only for bodies that are not MSL (the CUDA twins on the emulator)
        prefix = "#define __EMU_ADDRSPACE 1\n" if self.address_spaces else ""
        parts = [prefix + '#include "metal_emu.h"\n', '#line 1 "header"\n', hdr]
        if hdr and not hdr.endswith("\n"):
            parts.append("\n")
        parts += ['#line 1 "<signature>"\n', sig, '#line 1 "source"\n', body]
        parts.append('#line 1 "<entry>"\n')
        args = []
        # buffers are cast into the address space MLX gives each parameter
        for k, p in enumerate(params):
            if p.kind == "input":
                space = ("constant" if inputs[p.index].size < _render.MAX_CONSTANT_ARRAY_SIZE
                         else "device")
                args.append(f"(const {space} {p.ctype}*)__b[{k}]")
            elif p.kind == "scalar":
                args.append(f"*(const constant {p.ctype}*)__b[{k}]")
            elif p.kind == "shape":
                args.append(f"(const constant int*)__b[{k}]")
            elif p.kind == "strides":
                args.append(f"(const constant int64_t*)__b[{k}]")
            elif p.kind == "ndim":
                args.append(f"*(const constant int*)__b[{k}]")
            elif p.kind == "output":
                t = f"atomic<{p.ctype}>" if self.atomic_outputs else p.ctype
                args.append(f"(device {t}*)__b[{k}]")
            else:
                args.append(f"__a->{_render.ATTRIBUTE_FIELDS[p.name]}")
        targs = _render.write_template(template) if template else ""
        parts.append(
            'extern "C" void __emu_kernel_entry(void* const* __b, const __emu_attrs* __a) {\n'
            f"  (void)__b; (void)__a;\n  {kname}{targs}(\n    "
            + ",\n    ".join(args)
            + ");\n}\n"
        )
        return "".join(parts), params

    def build(self, inputs: Sequence[_render.InputInfo], output_dtypes, template=()) -> None:
        """Compile (or fetch from the cache) one instantiation without running it.

        ``inputs`` describe the arrays (dtype, ndim, size) as they will be passed.
        Raises :class:`MetalEmuCompileError` when clang rejects the kernel.
        """
        tu, _ = self.translation_unit(list(inputs), list(output_dtypes), list(template))
        self._compile(tu)

    def _compile(self, tu: str):
        try:
            return _build.build_kernel(tu)
        except _build.CompileError as e:
            lines = [ln for ln in e.stderr.splitlines()]
            msg = (
                f"[metal_emu] kernel '{self.name}' does not compile (clang; 'source:N' is line N of "
                f"the kernel body, 'header:N' of the header):\n" + "\n".join(lines[:80])
            )
            raise MetalEmuCompileError(annotate(msg, self.source, self.header)) from None

    # ---------------------------------------------------------------- call
    def __call__(
        self,
        inputs,
        output_shapes,
        output_dtypes,
        grid,
        threadgroup,
        template=None,
        init_value=None,
        verbose=False,
        stream=None,
    ):
        if isinstance(inputs, dict) or isinstance(output_shapes, dict):
            raise TypeError("[metal_kernel] inputs and output_shapes are sequences (MLX >= 0.21 API)")
        inputs = [x if isinstance(x, mx.array) else mx.array(x) for x in inputs]
        output_shapes = [tuple(int(d) for d in s) for s in output_shapes]
        output_dtypes = list(output_dtypes)
        template = list(template or [])
        if len(inputs) != len(self.input_names):
            raise ValueError(
                f"[metal_kernel] Expected `inputs` to have size {len(self.input_names)} "
                f"but got size {len(inputs)}."
            )
        if len(output_shapes) != len(self.output_names):
            raise ValueError(
                f"[metal_kernel] Expected `output_shapes` to have size {len(self.output_names)} "
                f"but got size {len(output_shapes)}."
            )
        if len(output_dtypes) != len(self.output_names):
            raise ValueError(
                f"[metal_kernel] Expected `output_dtypes` to have size {len(self.output_names)} "
                f"but got size {len(output_dtypes)}."
            )
        grid = tuple(int(g) for g in grid)
        threadgroup = tuple(int(t) for t in threadgroup)
        if len(grid) != 3 or len(threadgroup) != 3:
            raise ValueError("[metal_kernel] grid and threadgroup must have 3 dimensions")
        infos = [_render.InputInfo(x.dtype, x.ndim, x.size) for x in inputs]
        for x in inputs:
            _np_dtype(x.dtype)
        for dt in output_dtypes:
            _np_dtype(dt)

        kname, msl = self.render(infos, output_dtypes, template)
        self.last_msl = msl
        if verbose:
            print(f"Generated source code for `{self.name}`:\n```\n{msl}\n```", flush=True)

        tg_size = threadgroup[0] * threadgroup[1] * threadgroup[2]
        if tg_size > self.max_threads:
            raise ValueError(
                f"[metal_emu] Thread group size ({tg_size}) is greater than  the maximum allowed "
                f"threads per threadgroup ({self.max_threads}). (kernel '{self.name}'; the limit is "
                "the pipeline's maxTotalThreadsPerThreadgroup, set with max_threads_per_threadgroup= "
                "or MLX_LILY_EMU_MAX_THREADS)"
            )
        if any(t <= 0 for t in threadgroup) or any(g < 0 for g in grid):
            raise ValueError(f"[metal_emu] invalid grid {grid} / threadgroup {threadgroup}")

        tu, params = self.translation_unit(infos, output_dtypes, template)
        lib, _ = self._compile(tu)

        # ---- buffers in parameter order
        keep: list[np.ndarray] = []
        in_arrays: list[np.ndarray] = []
        for x in inputs:
            a = _to_numpy(x)
            if self.ensure_row_contiguous and not a.flags["C_CONTIGUOUS"]:
                a = np.ascontiguousarray(a)
            in_arrays.append(_aligned_input(a))
        outs: list[np.ndarray] = []
        guarded: list[np.ndarray] = []
        for shape, dt in zip(output_shapes, output_dtypes):
            npdt = _np_dtype(dt)
            o, g = _guarded_empty(shape, npdt)
            guarded.append(g)
            if init_value is not None:
                if dt == mx.bfloat16:
                    o[...] = np.asarray(mx.full(shape, init_value, dtype=mx.bfloat16).view(mx.uint16))
                else:
                    o[...] = np.array(init_value).astype(npdt)
            elif self.poison and o.size:
                o.reshape(-1).view(np.uint8).fill(0xFF)
            outs.append(o)
        ptrs = []
        for p in params:
            if p.kind in ("input", "scalar"):
                a = in_arrays[p.index]
                if a.size == 0:
                    a = np.zeros(1, dtype=a.dtype)
                    keep.append(a)
                ptrs.append(a.ctypes.data)
            elif p.kind == "shape":
                a = _aligned_input(np.array(in_arrays[p.index].shape, dtype=np.int32))
                keep.append(a)
                ptrs.append(a.ctypes.data)
            elif p.kind == "strides":
                src = in_arrays[p.index]
                a = _aligned_input(np.array([s // src.itemsize for s in src.strides], dtype=np.int64))
                keep.append(a)
                ptrs.append(a.ctypes.data)
            elif p.kind == "ndim":
                a = _aligned_input(np.array(in_arrays[p.index].ndim, dtype=np.int32))
                keep.append(a)
                ptrs.append(a.ctypes.data)
            elif p.kind == "output":
                ptrs.append(outs[p.index].ctypes.data)
        bufs = (ctypes.c_void_p * max(1, len(ptrs)))(*ptrs)
        err = ctypes.create_string_buffer(8192)
        L = _Launch()
        L.bufs = ctypes.cast(bufs, ctypes.c_void_p)
        clamped = [min(t, g) if g > 0 else t for t, g in zip(threadgroup, grid)]
        for d in range(3):
            L.grid[d] = grid[d]
            L.tg[d] = clamped[d]
        L.nworkers = max(1, int(self.workers))
        L.order = _ORDERS[self.order]
        L.seed = int(self.seed) & ((1 << 64) - 1)
        L.stack_size = int(self.stack_kb) * 1024
        L.tg_mem_limit = int(self.tg_mem_limit)
        L.poison_tg = 1 if self.poison else 0
        L.catch_signals = 1 if self.catch_signals else 0
        L.err = ctypes.cast(err, ctypes.c_char_p)
        L.errlen = len(err)
        launch = getattr(lib, "__emu_launch_kernel")
        rc = launch(ctypes.byref(L))
        if rc != 0:
            msg = err.value.decode(errors="replace")
            raise MetalEmuError(
                annotate(f"[metal_emu] kernel '{self.name}' ({kname}): {msg}", self.source, self.header)
            )
        for name, o, g in zip(self.output_names, outs, guarded):
            where = _check_guards(g, o.nbytes)
            if where:
                raise MetalEmuError(f"[metal_emu] kernel '{self.name}' ({kname}) wrote outside "
                                    f"output '{name}' {tuple(o.shape)}: {where}")
        return [_from_numpy(o, dt) for o, dt in zip(outs, output_dtypes)]
