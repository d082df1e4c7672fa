"""Kernel sources and one-time kernel construction.

Kernel bodies live under ``shaders/metal/*.metal`` and ``shaders/cuda/*.cu`` (shipped as
the package data ``mlx_lily.shaders``). A kernel object is built once per process and
per (name, backend) and reused for every call; MLX re-renders only the launch.
"""

from __future__ import annotations

import functools
import importlib.resources
import re
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx

from . import config, cuda_cache, registry

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
    """Text of a kernel source file, with its ``// @`` lines kept (they are comments).

    Each ``// @header <file>`` line (a helper file beside it, shared by several kernels)
    puts that file's text in front, in the order of the lines, so it lands in the
    kernel's ``header`` part; the Metal lint and emulator read the same directives.
    """
    text = shader_path(backend, filename).read_text()
    helpers = ""
    for name in re.findall(r"^\s*//\s*@header\s+(\S+)", text, flags=re.M):
        h = shader_path(backend, name).read_text()
        helpers += h + ("" if h.endswith("\n") else "\n")
    return helpers + text


def split_header(text: str, marker: str = "// ---- body ----") -> tuple[str, str]:
    """Split a shader file into (header helpers, kernel body) at ``marker``.

    A file without the marker is all body.
    """
    if marker in text:
        head, body = text.split(marker, 1)
        return head, body
    return "", text


def _literal_end(text: str, i: int) -> int:
    """Index just past the string or character literal opening at ``text[i]`` (a quote;
    backslash escapes skipped), or ``len(text)`` when it does not close."""
    q, j, n = text[i], i + 1, len(text)
    while j < n and text[j] != q:
        j += 2 if text[j] == "\\" else 1
    return min(j + 1, n)


def strip_source(text: str) -> str:
    """C/CUDA text without comments, indentation, trailing blanks or empty lines; string
    and character literals kept as they are, one output line per remaining source line
    (preprocessor lines such as ``#pragma unroll`` stay on their own).

    Raises:
        ValueError: a line ends with a ``\\`` continuation (not supported).

    Why: MLX's CUDA backend hashes a custom kernel's whole generated source at every
    launch (``std::hash`` over header + body, in ``CustomKernel::eval_gpu``) and copies it
    at every eager call; comments are most of these files' bytes.
    """
    out, line = [], []
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch in "\"'":
            j = _literal_end(text, i)
            line.append(text[i:j])
            i = j
        elif text.startswith("//", i):
            while i < n and text[i] != "\n":
                i += 1
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            if "\n" in text[i:j]:  # a comment across lines still ends the line
                kept = "".join(line).strip()
                if kept:
                    out.append(kept)
                line = []
            else:
                line.append(" ")
            i = j
        elif ch == "\n":
            kept = "".join(line).strip()
            if kept:
                out.append(kept)
            line = []
            i += 1
        else:
            line.append(ch)
            i += 1
    kept = "".join(line).strip()
    if kept:
        out.append(kept)
    if any(ln.endswith("\\") for ln in out):
        raise ValueError("strip_source: a line continuation ('\\' at a line end) is not "
                         "supported (dropping the lines around it could splice code)")
    return "\n".join(out) + "\n" if out else ""


_IDENT = re.compile(r"[A-Za-z_]\w*")
_TYPE_KEYS = ("struct", "class", "union", "enum")


def _top_level_items(text: str) -> list[str]:
    """``strip_source`` output split into top-level declarations (a function, a struct,
    a declaration ending in ``;``); a preprocessor conditional (``#if`` .. ``#endif``) is
    one item, as is any other preprocessor line at depth 0."""
    items, cur, depth, pp = [], [], 0, 0
    for line in text.splitlines(keepends=True):
        s = line.strip()
        if s.startswith("#") and depth == 0:
            if s.startswith("#if"):
                pp += 1
            elif s.startswith("#endif"):
                pp -= 1
            cur.append(line)
            if pp == 0 and not cur[0].lstrip().startswith(("template", "__", "struct")):
                items.append("".join(cur))
                cur = []
            continue
        cur.append(line)
        i = 0
        while i < len(s):
            if s[i] in "\"'":
                i = _literal_end(s, i)
                continue
            depth += {"{": 1, "}": -1}.get(s[i], 0)
            i += 1
        if depth == 0 and pp == 0 and s.endswith(("}", ";")):
            items.append("".join(cur))
            cur = []
    if cur:
        items.append("".join(cur))
    return items


_NOT_NAMES = frozenset({"operator", "decltype", "__attribute__", "alignas", "__align__",
                        "__declspec", "static_assert", "typedef", "using", "enum", "union",
                        "namespace", "extern", "asm", "friend"})


def _defined_name(item: str) -> str | None:
    """The name a top-level item defines, for three shapes only: a ``__device__`` function
    definition, a ``struct``/``class`` definition with nothing declared after its closing
    brace, and a ``constexpr``/``__constant__`` variable with an initialiser. Anything else
    (enums, typedefs, operators, attributes, macro invocations, ``static_assert``, an item
    with a preprocessor conditional inside) gives None, and such items are always kept."""
    s = item.strip()
    if s.startswith("#") or not s.endswith(("}", ";")):
        return None
    if any(ln.lstrip().startswith(("#if", "#el", "#endif", "#define", "#undef"))
           for ln in item.splitlines()):
        return None
    head = item.split("{", 1)[0]
    if head.lstrip().startswith("template"):  # drop the template parameter list
        depth, i = 0, head.index("template") + len("template")
        while i < len(head):
            depth += {"<": 1, ">": -1}.get(head[i], 0)
            i += 1
            if depth == 0 and head[i - 1] == ">":
                break
        head = head[i:]
    words = _IDENT.findall(head)
    if not words or any(w in _NOT_NAMES for w in words):
        return None
    par, eq = head.find("("), head.find("=")
    if "struct" in words or "class" in words:
        if par >= 0 or words[0] not in ("struct", "class") or len(words) < 2:
            return None
        return words[1] if re.search(r"}\s*;\s*$", item) else None
    if par >= 0 and "__device__" in words and s.endswith("}") and (eq < 0 or par < eq):
        m = re.search(r"([A-Za-z_]\w*)\s*$", head[:par])
        return m.group(1) if m else None
    if par < 0 and eq >= 0 and words[0] in ("constexpr", "__constant__", "__device__",
                                             "static"):
        m = re.search(r"([A-Za-z_]\w*)\s*(\[[^\]]*\]\s*)*$", head[:eq])
        return m.group(1) if m else None
    return None


def prune_header(head: str, body: str) -> str:
    """``head`` (``strip_source`` output) without the top-level declarations that neither
    ``body`` nor a kept declaration names, in the original order. Items whose name is not
    recognised (preprocessor blocks included) are kept.

    Why: MLX hashes a custom kernel's whole source at every launch (~0.3 us per KiB on the
    H200's host, ``benchmarks/gpu/dispatch_bench.py``), and the shared helper headers
    carry every kernel's helpers."""
    items = _top_level_items(head)
    names = [_defined_name(it) for it in items]
    keep = [n is None for n in names]
    refs = set(_IDENT.findall(body))
    for it, k in zip(items, keep):
        if k:
            refs.update(_IDENT.findall(it))
    changed = True
    while changed:
        changed = False
        for i, (it, n) in enumerate(zip(items, names)):
            if not keep[i] and n in refs:
                keep[i] = changed = True
                refs.update(_IDENT.findall(it))
    return "".join(it for it, k in zip(items, keep) if k)


_KEEP_APART = frozenset("+-*/%&|^<>=!.:")  # pairs of these may form one token ("- -")


def _ends_in_number(chunks: list) -> bool:
    """Whether the text so far ends in a preprocessing number (``0xE``, ``1e``, ``.5e``),
    which a following sign would extend."""
    m = re.search(r"\.?\d[\w.]*$", "".join(chunks[-32:]))
    return m is not None and (m.start() == 0 or not re.match(r"[\w.]", "".join(chunks[-32:])[m.start() - 1]))


def squeeze_spaces(text: str) -> str:
    """``strip_source`` output without the blanks that separate no tokens: a run of
    blanks inside a line goes unless both neighbours are word characters, or both are
    operator characters that could join into another token (``a - -b``, ``x / *p``,
    ``> >``), or it follows an ``e``/``p`` before a sign (``0xE - 1``), or it separates a
    literal from a word (``"a" SFX``, ``L "x"``); string and character literals and
    preprocessor lines are left as they are.
    The compiler sees the same tokens (checked: identical SASS for every kernel)."""
    out = []
    for line in text.splitlines(keepends=True):
        if line.lstrip().startswith("#"):
            out.append(line)
            continue
        res, i, n = [], 0, len(line)
        while i < n:
            ch = line[i]
            if ch in "\"'":
                j = _literal_end(line, i)
                res.append(line[i:j])
                i = j
            elif ch == " ":
                j = i
                while j < n and line[j] == " ":
                    j += 1
                a = res[-1][-1] if res else ""
                b = line[j] if j < n else ""
                aw, bw = a.isalnum() or a == "_", b.isalnum() or b == "_"
                keep = ((aw and bw) or (a in _KEEP_APART and b in _KEEP_APART)
                        or (a in "eEpP" and b in "+-" and _ends_in_number(res))  # 0xE - 1
                        or (a in "\"'" and bw) or (aw and b in "\"'"))  # "a" SFX, L "x"
                if a and b and b != "\n" and keep:
                    res.append(" ")
                i = j
            else:
                res.append(ch)
                i += 1
        out.append("".join(res))
    return "".join(out)


@functools.lru_cache(maxsize=None)
def cuda_parts(stem: str) -> tuple[str, str]:
    """``(header, body)`` of ``shaders/cuda/<stem>.cu`` as handed to
    ``mx.fast.cuda_kernel`` (``split_header``, then ``strip_source`` on each part, then
    ``prune_header``: helpers the kernel does not use are left out, and
    ``squeeze_spaces``)."""
    head, body = split_header(shader_source("cuda", stem + ".cu"))
    body = strip_source(body)
    return squeeze_spaces(prune_header(strip_source(head), body)), squeeze_spaces(body)


_F32_SCALARS: dict = {}

#: Elements of the small constant arrays kernels read (epsilons, scales, lengths): MLX's
#: CUDA allocator (0.32, ``allocator.cpp``) serves arrays of at most 8 bytes from a pool
#: of managed host memory advised as accessed-by the GPU (read across the bus, not
#: migrated), and every threadgroup of a kernel reads them. On the H200 (session 9) the
#: add+RMSNorm-fused GEMVs, which read a 4-byte eps, took ~22 us per call however small
#: the matrix once they had >= 128 threadgroups, vs 8 us for the same GEMV without it.
#: Four 4-byte elements (16 bytes) are allocated like any other array.
SCALAR_ELEMS = 4
#: Elements allocated per row for a kernel output of one value per row that other
#: kernels read in every threadgroup (the shared-expert gate): the kernel writes value n
#: at index n of an (n * ROW_PAD,) buffer, so n values are never an array of <= 8 bytes.
ROW_PAD = 8


def const_array(values, dtype) -> mx.array:
    """``values`` (a list) as a new evaluated ``dtype`` array padded with copies of its
    last element to at least ``SCALAR_ELEMS`` elements and 16 bytes (kernels read the
    leading elements only), computed by one op on the default device so that its
    buffer is device memory (an array made from host data lives in managed or pinned
    host memory first). Safe inside ``mx.compile`` (a constant, not a graph node).
    Raises ValueError for an empty list."""
    if not values:
        raise ValueError("const_array: no values")
    values = list(values)
    while len(values) < SCALAR_ELEMS or len(values) * dtype.size < 16:
        values.append(values[-1])
    host = mx.array(values, dtype=dtype)
    zero = mx.zeros_like(host)
    dev = mx.logical_or(host, zero) if dtype == mx.bool_ else host + zero
    mx.eval(dev)
    return dev


def f32_scalar(value: float) -> mx.array:
    """A cached fp32 array holding ``value`` at index 0 (``SCALAR_ELEMS`` copies: see
    there). Kernels take epsilons and similar constants as inputs: one array per value
    per process, not one per call."""
    value = float(value)
    a = _F32_SCALARS.get(value)
    if a is None:
        a = _F32_SCALARS[value] = const_array([value], mx.float32)
    return a


def device_scalars(x: mx.array) -> mx.array:
    """A one-element array ``x`` (any shape of size 1) copied to a new
    ``[SCALAR_ELEMS]`` array computed on the device, so it does not live in MLX's small
    host-memory pool (see ``SCALAR_ELEMS``). Take ``[:1]`` views of it (or of
    arithmetic on it) for kernels that read element 0; an op on the ``[1]`` view would
    land in the pool again. One primitive; works inside ``mx.compile``."""
    return mx.contiguous(mx.broadcast_to(x.reshape(1), (SCALAR_ELEMS,)))


class KernelSpec(NamedTuple):
    """One kernel's launch contract, shared by its Metal and CUDA twins.

    ``name`` is the kernel name on both backends; the body lives in
    ``shaders/metal/<stem>.metal`` and ``shaders/cuda/<stem>.cu`` (helpers before the
    ``// ---- body ----`` marker become the ``header``); inputs/outputs are the buffer
    names in order. Template arguments and the grid formula are documented in the op
    module that launches it and passed identically to both twins.
    """

    name: str
    stem: str
    inputs: tuple
    outputs: tuple
    atomic_outputs: bool = False
    ensure_row_contiguous: bool = True
    shared_memory: int = 0


def build(spec: KernelSpec, backend: str, factory=None):
    """Construct the kernel object for ``backend`` (``"metal"`` or ``"cuda"``), uncached.

    ``factory`` overrides ``mx.fast.metal_kernel`` / ``mx.fast.cuda_kernel`` (tests pass
    the Metal emulator's ``metal_kernel``).
    """
    if backend == "metal":
        head, body = split_header(shader_source("metal", spec.stem + ".metal"))
        factory = factory or mx.fast.metal_kernel
        return factory(name=spec.name, input_names=list(spec.inputs),
                       output_names=list(spec.outputs), source=body, header=head,
                       ensure_row_contiguous=spec.ensure_row_contiguous,
                       atomic_outputs=spec.atomic_outputs)
    if backend == "cuda":
        head, body = cuda_parts(spec.stem)
        factory = factory or mx.fast.cuda_kernel
        kwargs = dict(name=spec.name, input_names=list(spec.inputs),
                      output_names=list(spec.outputs), source=body, header=head,
                      ensure_row_contiguous=spec.ensure_row_contiguous)
        if spec.shared_memory:
            kwargs["shared_memory"] = spec.shared_memory
        return factory(**kwargs)
    raise ValueError(f"no kernels for backend {backend!r}")


_CACHE: dict = {}

# Which op a kernel serves, by shader stem prefix (longest first: first match wins).
_STEM_OPS = registry.stem_ops()

# Ops whose kernels were verified on that backend's hardware (their per-op parity tests
# passed on the device AND the A/B correctness gate on the full-size model passed with them
# running): on by default there.
# CUDA, H200: the seven ops of session 3 (benchmarks/results/2026-11-30-cuda-h200-session3/),
# and gated_delta in session 4 (benchmarks/results/2026-11-30-cuda-h200-session4/: its 28
# GPU tests passed against the CPU-evaluated reference, and the A/B gate passed with every
# kernel on, compiled decode steps included); session 5's decode fusions norm_qgemv,
# gdn_packed, attn_packed, moe_router_norm (GPU tests: session 5 calls 5 and 7; the A/B
# gate with them on passed in session 6, benchmarks/results/2026-11-30-cuda-h200-session6/,
# ab/). Metal: no kernel has run on Apple hardware (the emulator proves semantics only).
# moe_topk_in_experts (routing inside the gate+up kernel): GPU tests (moe_experts 14 passed,
# decode_step 1 passed: session 7 call 2) and two gates with it on passed (session 7 calls
# 3 and 9, benchmarks/results/2026-11-30-cuda-h200-session7/). qgemv_out and
# prefill_dequant: GPU tests (qgemv, qmm_dequant: sessions 8-10) and the ten-length A/B
# gate with both on (session 10 lease 2, benchmarks/results/2026-11-30-cuda-h200-session10/).
# gdn_proj and gdn_out_proj: GPU tests (gated_delta 51 / 53 / 55 / 55 passed at trees
# 4c7ce95, bad0961, 46079bd, 070a68c; decode_step passed at the first three) and the A/B gate
# with them on (gdn_proj at bad0961, both at 46079bd: session 11 leases 2 and 3,
# benchmarks/results/2026-11-30-cuda-h200-session11/); 070a68c changed only the width of
# OUTP's loads in its head sum (same summation order); the cleanup after it (a shared
# last-to-arrive helper, LilyRowTile taking a column slice) left every CUDA kernel's SASS
# as nvcc 13 -arch=sm_90a built it before, but for the order of one address computation.
# Session 12's helper cleanup (LilyRowTile::dot_each, lily_swiglu_rows) left the SASS of
# qgemv, norm_qgemv, moe_router_topk and every gdn kernel identical (nvcc 13, sm_90a, the
# compile tests' instantiations) and moe_gate_up's floating-point instructions identical
# (same count; a few integer address instructions differ).
# moe_fused (the MoE block in one launch): GPU tests passed at 573e475, a6d633e and a660dda
# and the A/B gate at a6d633e (session 12); a review then found two steps built before one
# evaluation could run a layer's launches concurrently on the same counters, fixed by
# `after` (each launch takes the previous one's output as an unread input); at a97b3d2
# (session 13, benchmarks/results/2026-11-30-cuda-h200-session13/) moe_experts 30 passed
# (fused tests included), decode_step 3 passed and the four-length A/B gate passed with it;
# at 66bb231 (one scratch output, gate+up tiles copying the row the first router tile
# normalised) the fused and decode_step GPU tests (8 passed) and the gate passed again.
# Since 66bb231 every CUDA source reaches MLX pruned of unused helpers and of blanks
# (prune_header, squeeze_spaces): nvcc 13 gives identical SASS for every kernel at the
# compile tests' instantiations, and the lease-3 GPU tests and gate ran on it.
# gated_delta's CUDA scan stages q/k in shared memory since e2c4016: its GPU tests at every
# test case's shape and the production-dims tests passed on the H200 (17, session 13 lease
# 4; 18 at 6d919d7, session 14), nine shapes matched the reference at production dims
# over 2048 tokens; the A/B gate passed with it at its default (8,1,4) (session 14, 1180ee7:
# 0.225 / 0.594 from fp32 vs stock's 0.213 / 0.672) and failed at (16,2,4) (0.246 / 0.531).
# moe_grouped's CUDA GEMMs load 128-k stages with 64 contiguous bytes per weight row since
# c703299: its GPU tests (37 passed with moe_route) and the gate (1180ee7) passed with them.
# shared_dequant (session 16): GPU test and bit-identical output at 4096 rows, no gate yet.
VERIFIED: dict = registry.verified_by_backend()


class PlanCache(dict):
    """A dict of launch plans cached on a module or projection (keys hold ``mx.Dtype``,
    values closures over kernels and arrays). ``copy.deepcopy`` gives an empty one: plans
    are rebuilt on the copy's first call (``mx.Dtype`` cannot be deep-copied)."""

    def __deepcopy__(self, memo):
        return type(self)()


def plan_cache(obj, attr: str) -> PlanCache:
    """The ``PlanCache`` stored on ``obj`` under ``attr`` (a plain attribute, outside any
    parameter tree), created on first use."""
    c = obj.__dict__.get(attr)
    if c is None:
        c = PlanCache()
        object.__setattr__(obj, attr, c)
    return c


def stock_result_dtype(x_dtype, scales_dtype) -> bool:
    """Whether ``mx.quantized_matmul`` of an ``x_dtype`` input with ``scales_dtype`` scales
    returns ``x_dtype`` (same float type, or an fp32 input), as the kernels do: a GEMV
    kernel standing in for it must not change the result's dtype."""
    return scales_dtype == x_dtype or x_dtype == mx.float32


KERNELS_ENV = config.SETTINGS["kernels"].env


@functools.lru_cache(maxsize=None)
def op_of(spec: KernelSpec) -> str | None:
    """The op whose kernels include ``spec`` (by shader stem), or None (cached: a
    prefill chunk asks ~700 times)."""
    for prefix, op in _STEM_OPS:
        if spec.stem.startswith(prefix):
            return op
    return None


def kernels_allowed(op: str | None, backend: str) -> bool:
    """Whether op's custom kernels may run on ``backend``.

    ``MLX_LILY_KERNELS`` (read at call time, once per model forward: ``backend.env_value``):
    ``verified`` (default: only ops in
    ``VERIFIED[backend]``), ``all`` (every kernel, including those verified only by
    per-op parity tests or the Metal emulator), or a comma list of op names (``verified``
    may be one of them). Ops not allowed run their pure-MLX reference.
    """
    return _allowed(op, config.value("kernels"), VERIFIED.get(backend, frozenset()))


@functools.lru_cache(maxsize=1024)
def _allowed(op, names: frozenset, verified: frozenset) -> bool:
    if "all" in names:
        return True
    if "verified" in names and op in verified:
        return True
    return op in names


def get(spec: KernelSpec, backend: str):
    """The process-wide kernel object for ``spec`` on ``backend``, built on first use;
    None when that backend is not available here or ``kernels_allowed`` says no for the
    spec's op (callers then use the reference)."""
    if not kernels_allowed(op_of(spec), backend):
        return None
    key = (spec, backend)
    k = _CACHE.get(key)
    if k is None:
        if backend == "metal" and not _metal_ok():
            return None
        if backend == "cuda" and not _cuda_ok():
            return None
        if backend not in ("metal", "cuda"):
            return None
        k = build(spec, backend)
        if backend == "cuda":
            k = RecordedCudaKernel(k, spec)
        _CACHE[key] = k
    return k


class RecordedCudaKernel:
    """A ``mx.fast.cuda_kernel`` object that reports each launch to an open
    ``mlx_lily.cuda_cache.recording()`` (for compiling ahead of time), then launches."""

    __slots__ = ("kernel", "spec", "header", "body")

    def __init__(self, kernel, spec: KernelSpec):
        self.kernel = kernel
        self.spec = spec
        self.header, self.body = cuda_parts(spec.stem)

    def __call__(self, **kw):
        if cuda_cache._RECORDER is not None:
            cuda_cache.record(self.spec, self.header, self.body, kw)
        return self.kernel(**kw)


def _metal_ok() -> bool:
    from . import backend

    return backend._TRACE_BACKEND == "metal" or backend._metal_available()


def _cuda_ok() -> bool:
    from . import backend

    if backend._TRACE_BACKEND == "cuda":
        return hasattr(mx.fast, "cuda_kernel")
    return backend._cuda_available() and hasattr(mx.fast, "cuda_kernel")
