"""Kernel sources and one-time kernel construction.

Kernel bodies live under ``shaders/metal/*.metal`` and ``shaders/cuda/*.cu`` (shipped as
the package data ``mlx_lily.shaders``). A kernel object is built once per process and
per (name, backend) and reused for every call; MLX re-renders only the launch.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.resources
import os
import re
import threading
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


@functools.lru_cache(maxsize=None)
def metal_parts(stem: str) -> tuple[str, str]:
    """``(header, body)`` of ``shaders/metal/<stem>.metal`` as handed to
    ``mx.fast.metal_kernel``: ``split_header``, then ``strip_source`` and
    ``squeeze_spaces`` on each part (comments and blanks go, tokens stay), because MLX's
    Metal backend hashes each kernel's whole source at every launch as its CUDA backend
    does (``CustomKernel::eval_gpu``, MLX 0.32). A text ``strip_source`` refuses (a line
    continuation) is handed over as it is."""
    head, body = split_header(shader_source("metal", stem + ".metal"))
    try:
        return squeeze_spaces(strip_source(head)), squeeze_spaces(strip_source(body))
    except ValueError:
        return head, body


_SHAPE_SUFFIXES = ("_shape", "_strides", "_ndim")
#: Characters an include path may hold: printable ASCII but the quote and the backslash.
_INCLUDE_SAFE = re.compile(r'[ !#-\[\]-~]+')
_LAUNCH_PARTS: dict = {}  # spec -> (header, body) handed to MLX
_INCLUDE_FILES: dict = {}  # spec -> ((path, text), ...) its include lines name


def _write_once(path: Path, text: str) -> None:
    """``text`` at ``path``, written through a temporary file and renamed into place
    unless the file already holds exactly that text."""
    try:
        if path.read_text() == text:
            return
    except (OSError, UnicodeDecodeError):
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _include_files(spec: KernelSpec, folder: Path) -> tuple:
    """``((path, text), ...)``: where ``cuda_include_parts`` keeps ``spec``'s header (when
    it has one) and body under ``folder``.

    Raises:
        OSError: the path holds a character an include line cannot (a double quote,
            a backslash, non-ASCII, control), or text MLX would take for an ``<input>_shape`` /
            ``_strides`` / ``_ndim`` mention.
    """
    head, body = cuda_parts(spec.stem)
    digest = hashlib.sha256(f"{head}\0{body}".encode()).hexdigest()[:20]
    where = Path(folder).expanduser().resolve() / f"{spec.stem}-{digest}"
    if not _INCLUDE_SAFE.fullmatch(str(where)):
        raise OSError(f"kernel source folder {where} holds characters not put in #include")
    clash = [n + s for n in spec.inputs for s in _SHAPE_SUFFIXES if n + s in str(where)]
    if clash:  # MLX would pass that argument: another signature than the texts give
        raise OSError(f"kernel source folder {where} names {clash[0]}, an argument of "
                      f"{spec.name}")
    files = ((where / "head.cuh", head),) if head else ()
    return files + ((where / "body.cuh", body),)


def cuda_include_parts(spec: KernelSpec, folder: Path) -> tuple[str, str]:
    """``cuda_parts(spec.stem)`` as ``#include`` lines: the header (when there is one) and
    body texts are written to ``folder/<stem>-<hash>/head.cuh`` and ``body.cuh``, named by
    a SHA-256 of both texts, and the returned header / body include them by absolute
    path. NVRTC reads the files when it compiles, so it sees the same tokens as with the
    texts inline (``benchmarks/source_forms.py`` compares the images). The body keeps a
    comment line naming each ``<input>_shape`` / ``_strides`` / ``_ndim`` its text uses,
    because MLX decides from the body string which of those arguments to pass.

    Why: MLX (0.32, ``CustomKernel::eval_gpu``, CUDA and Metal backends) hashes a
    kernel's whole generated source at every launch, ~0.3 us per KiB on an H200's host
    in eager calls (``benchmarks/gpu/dispatch_bench.py``); a B = 1 decode step hands MLX
    ~1.4 MB of source inline, ~0.2 MB this way (MLX's generated signatures). The module
    name MLX caches a compiled kernel under changes whenever the text does (the hash is
    in the path), and also with the folder: images compiled under one cache folder are
    not found under another.

    Raises:
        OSError: the files cannot be written, or the folder's path cannot be put in an
            include line (``_include_files``).
    """
    return _write_includes(spec, _include_files(spec, folder))


def _write_includes(spec: KernelSpec, files: tuple) -> tuple[str, str]:
    """``cuda_include_parts`` for the ``_include_files`` result ``files``: writes them,
    returns the header / body lines."""
    for path, text in files:
        _write_once(path, text)
    lines = [f'#include "{path}"\n' for path, _ in files]
    inc_head = lines[0] if len(files) == 2 else ""
    inc_body = lines[-1]
    body = files[-1][1]
    uses = [n + s for n in spec.inputs for s in _SHAPE_SUFFIXES if n + s in body]
    if uses:
        inc_body += "// " + " ".join(uses) + "\n"
    return inc_head, inc_body


def cuda_launch_parts(spec: KernelSpec) -> tuple[str, str]:
    """``(header, body)`` handed to ``mx.fast.cuda_kernel`` for ``spec`` (cached per
    process): ``cuda_include_parts`` under ``<cache_dir>/cuda-src`` (the user setting
    ``MLX_LILY_CACHE_DIR``), or the texts themselves (``cuda_parts``) when the knob
    ``MLX_LILY_CUDA_SOURCE=inline`` says so or the files cannot be written (one warning
    naming the folder; the kernels work the same, each launch costs more host time).

    Raises:
        FileNotFoundError: the kernel's source file is missing (``shader_path``).
    """
    parts = _LAUNCH_PARTS.get(spec)
    if parts is None:
        from . import tuning

        texts = cuda_parts(spec.stem)  # a missing shader raises here, not below
        if tuning.cuda_source == "include":
            folder = Path(config.cache_dir) / "cuda-src"
            try:
                files = _include_files(spec, folder)
                parts = _write_includes(spec, files)
                _INCLUDE_FILES[spec] = files
            except OSError as e:
                parts = None
                if not _INCLUDE_WARNED:
                    _INCLUDE_WARNED.append(True)
                    config.warn_user(f"mlx-lily: cannot keep CUDA kernel sources in {folder} "
                                     f"({e}); handing MLX the full texts instead (slower "
                                     "launches, same results)", stacklevel=2,
                                     category=RuntimeWarning)
        parts = parts or texts
        _LAUNCH_PARTS[spec] = parts
    return parts


def restore_include_files(spec: KernelSpec) -> None:
    """Write ``spec``'s include files again where they are missing or differ (a cache
    folder cleaned while the process runs): called before a launch that may make MLX
    compile a new instantiation. Never raises (NVRTC then reports the missing file)."""
    for path, text in _INCLUDE_FILES.get(spec, ()):
        try:
            _write_once(path, text)
        except OSError:
            pass


_INCLUDE_WARNED: list = []
_F32_SCALARS: dict = {}

#: Elements of the small constant arrays kernels read (epsilons, scales, lengths): MLX's
#: CUDA allocator (0.32, ``allocator.cpp``) serves arrays of at most 8 bytes from a pool
#: of managed host memory advised as accessed-by the GPU (read across the bus, not
#: migrated), and every threadgroup of a kernel reads them. On the H200 the
#: add+RMSNorm-fused GEMVs, which read a 4-byte eps, took ~22 us per call however small
#: the matrix once they had >= 128 threadgroups, vs 8 us for the same GEMV without it.
#: Four 4-byte elements (16 bytes) are allocated like any other array.
SCALAR_ELEMS = 4
#: Elements allocated per row for a kernel output of one value per row that other
#: kernels read in every threadgroup (the shared-expert gate): the kernel writes value n
#: at index n of an (n * ROW_PAD,) buffer, so n values are never an array of <= 8 bytes.
ROW_PAD = 8


#: Fewest elements of an input that MLX's Metal ``write_signature`` passes as
#: ``const device T*`` (fewer: ``const constant T*``; MLX 0.32 ``max_constant_array_size``).
#: Stand-ins for absent buffers have this many, so they take the real buffer's address space.
DEVICE_MIN_ELEMS = 8


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
        head, body = metal_parts(spec.stem)
        factory = factory or mx.fast.metal_kernel
        return factory(name=spec.name, input_names=list(spec.inputs),
                       output_names=list(spec.outputs), source=body, header=head,
                       ensure_row_contiguous=spec.ensure_row_contiguous,
                       atomic_outputs=spec.atomic_outputs)
    if backend == "cuda":
        head, body = cuda_launch_parts(spec)
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

# Ops whose kernels are on by default on a backend (``MLX_LILY_KERNELS=verified``): their
# per-op parity tests passed on that backend's hardware AND the A/B correctness gate on
# the full-size model passed with them running. CUDA: verified on an NVIDIA H200.
# Metal: no kernel has run on Apple hardware yet (the emulator proves semantics only).
# shared_dequant is not in the CUDA set: its GPU test passed, the A/B gate has not run
# with it. The record of each verification (commands, commits): docs/results.md.
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
    ``verified`` (default: only the ops ``verified_ops(backend)`` names: those this
    device's qualification record passed, else the shipped ``VERIFIED[backend]`` where
    the device matches ``SHIPPED_DEVICES``), ``all`` (every kernel, including those
    verified only by per-op parity tests or the Metal emulator), or a comma list of op
    names (``verified`` may be one of them). An op that failed its first contact in this
    process (``runtime_disabled()``) never runs its kernels, whatever the setting. Ops
    not allowed run their pure-MLX reference.
    """
    if _OVERRIDE[0] is not None:
        return op in _OVERRIDE[0] and op not in _RUNTIME_OFF
    return _allowed(op, config.value("kernels"), verified_ops(backend), _RUNTIME_OFF_SET[0])


@functools.lru_cache(maxsize=1024)
def _allowed(op, names: frozenset, verified: frozenset, off: frozenset) -> bool:
    if op in off:
        return False
    if "all" in names:
        return True
    if "verified" in names and op in verified:
        return True
    return op in names


#: Device names (substrings of ``mx.device_info()["device_name"]``) on which the shipped
#: ``VERIFIED[backend]`` set was measured; on another device of that backend only a
#: qualification record (``mlx_lily.qualify``) or ``MLX_LILY_KERNELS`` turns kernels on.
SHIPPED_DEVICES: dict = {"cuda": ("H200",), "metal": ()}

#: op -> reason, for ops whose kernels failed at first contact in this process.
_RUNTIME_OFF: dict = {}
_RUNTIME_OFF_SET = [frozenset()]
#: When not None, the exact set of ops allowed (first contact's reference pass, and
#: qualification's one-op-at-a-time runs), ahead of ``MLX_LILY_KERNELS``.
_OVERRIDE: list = [None]
_RECORD_OPS: dict = {}  # backend -> frozenset | None, from the qualification record


def runtime_disabled() -> dict:
    """``{op: reason}`` for the ops turned off in this process by a failed first contact
    (``disable_for_process``)."""
    return dict(_RUNTIME_OFF)


def disable_for_process(op: str, reason: str) -> bool:
    """Turn ``op``'s kernels off for the rest of this process (its reference runs), with
    one warning naming the op and ``reason``. Returns False when it was already off."""
    if op in _RUNTIME_OFF:
        return False
    _RUNTIME_OFF[op] = reason
    _RUNTIME_OFF_SET[0] = frozenset(_RUNTIME_OFF)
    config.warn_user(f"mlx-lily: {op} kernels turned off for this process (its reference "
                     f"runs): {reason}", stacklevel=2)
    return True


def clear_runtime_disabled() -> None:
    """Forget every first-contact failure of this process (tests, re-qualification)."""
    _RUNTIME_OFF.clear()
    _RUNTIME_OFF_SET[0] = frozenset()


@contextlib.contextmanager
def only_ops(ops):
    """Within this block exactly ``ops`` (an iterable of op names) may run kernels (minus
    ``runtime_disabled``), whatever ``MLX_LILY_KERNELS`` says; kernel objects are built
    as usual."""
    prev, _OVERRIDE[0] = _OVERRIDE[0], frozenset(ops)
    try:
        yield
    finally:
        _OVERRIDE[0] = prev


@functools.lru_cache(maxsize=None)
def device_name() -> str:
    """``mx.device_info()["device_name"]`` of this machine's default GPU ("" when MLX
    reports none)."""
    try:
        return str(mx.device_info().get("device_name", ""))
    except Exception:  # noqa: BLE001  (older MLX / no device)
        return ""


def _real_backend() -> str:
    from . import backend

    if backend._metal_available():
        return "metal"
    if backend._cuda_available():
        return "cuda"
    return "cpu"


def shipped_matches(backend: str) -> bool:
    """Whether the shipped ``VERIFIED[backend]`` applies here: this machine's device
    name contains one of ``SHIPPED_DEVICES[backend]``, or this machine has no
    ``backend`` device at all (graph tracing for another backend)."""
    if _real_backend() != backend:
        return True
    name = device_name()
    return any(d in name for d in SHIPPED_DEVICES.get(backend, ()))


def verified_ops(backend: str) -> frozenset:
    """The ops ``MLX_LILY_KERNELS=verified`` (the default) runs on ``backend`` here: the
    qualified ops of this device's valid qualification record when there is one
    (``mlx_lily.qualify.record_ops``; ignored with ``MLX_LILY_QUALIFY=0``), else
    ``VERIFIED[backend]`` when ``shipped_matches(backend)``, else none. Cached per
    backend until ``forget_record`` (or ``VERIFIED[backend]`` is replaced). Reading a
    record also applies the settings of the variants it chose (``tuning.QUALIFIED``)."""
    shipped = VERIFIED.get(backend, frozenset())
    hit = _VERIFIED_NOW.get(backend)
    if hit is not None and hit[0] is shipped:
        return hit[1]
    if backend not in _RECORD_OPS:
        _RECORD_OPS[backend] = None
        if backend in ("metal", "cuda") and _real_backend() == backend:
            try:
                from . import qualify

                _RECORD_OPS[backend] = qualify.record_ops(backend)
                from . import tuning

                tuning.set_qualified(qualify.record_variant_settings(backend)
                                     if _RECORD_OPS[backend] is not None else {})
            except Exception as e:  # noqa: BLE001  (an unreadable record is no record)
                config.warn_user(f"mlx-lily: qualification record unreadable ({e!r}); ignored",
                                 stacklevel=2)
    rec = _RECORD_OPS[backend]
    out = rec if rec is not None else (shipped if shipped_matches(backend) else frozenset())
    _VERIFIED_NOW[backend] = (shipped, out)
    return out


_VERIFIED_NOW: dict = {}  # backend -> (the VERIFIED value it was computed with, result)


def allowed_key() -> tuple:
    """What ``kernels_allowed`` depends on beyond ``MLX_LILY_KERNELS``, the backend and
    the qualification record (read once per process) (compiled decode steps are keyed by
    it)."""
    return (_RUNTIME_OFF_SET[0], _OVERRIDE[0])


def forget_record() -> None:
    """Read the qualification record (and the device) again at the next
    ``verified_ops`` call."""
    _RECORD_OPS.clear()
    _VERIFIED_NOW.clear()
    from . import tuning

    tuning.QUALIFIED.clear()


def get(spec: KernelSpec, backend: str):
    """The process-wide kernel object for ``spec`` on ``backend``, built on first use;
    None when that backend is not available here or ``kernels_allowed`` says no for the
    spec's op (callers then use the reference). The object is a ``GuardedKernel``:
    inside ``mlx_lily.first_contact.probing()`` each launch is built, run and checked
    at once."""
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
        from . import first_contact

        fault = first_contact.injected_fault(op_of(spec))
        k = (first_contact.build_broken(spec, backend) if fault == "build"
             else build(spec, backend))
        if backend == "cuda":
            k = RecordedCudaKernel(k, spec)
        k = GuardedKernel(k, spec, backend, fault)
        _CACHE[key] = k
    return k


class GuardedKernel:
    """A kernel object that launches as it is, except while first contact or
    qualification probes (``first_contact._PROBE``): then the launch's inputs are
    evaluated, the kernel runs and its outputs are evaluated at once, and an exception
    becomes ``first_contact.KernelFault`` naming the op. ``fault`` is a test-only
    injected failure (``first_contact.INJECT_ENV``), None in production."""

    __slots__ = ("kernel", "spec", "backend", "op", "fault", "_fc")

    def __init__(self, kernel, spec: KernelSpec, backend: str, fault=None):
        from . import first_contact

        self.kernel = kernel
        self.spec = spec
        self.backend = backend
        self.op = op_of(spec)
        self.fault = fault
        self._fc = first_contact

    def __call__(self, **kw):
        if self.fault is None and self._fc._PROBE[0] is None:
            return self.kernel(**kw)
        return self._fc.launch(self, kw)


class RecordedCudaKernel:
    """A ``mx.fast.cuda_kernel`` object that reports each launch to an open
    ``mlx_lily.cuda_cache.recording()`` (for compiling ahead of time), and, at the first
    launch of each template and output dtypes (a new instantiation MLX may compile),
    restores the include files its source names (``restore_include_files``), then
    launches."""

    __slots__ = ("kernel", "spec", "header", "body", "seen")

    def __init__(self, kernel, spec: KernelSpec):
        self.kernel = kernel
        self.spec = spec
        self.header, self.body = cuda_launch_parts(spec)
        self.seen = set()

    def __call__(self, **kw):
        if cuda_cache._RECORDER is not None:
            cuda_cache.record(self.spec, self.header, self.body, kw)
        key = (tuple(kw.get("template") or ()), tuple(kw.get("output_dtypes") or ()))
        if key not in self.seen:
            restore_include_files(self.spec)
            self.seen.add(key)
        return self.kernel(**kw)


def _metal_ok() -> bool:
    from . import backend

    return backend._TRACE_BACKEND == "metal" or backend._metal_available()


def _cuda_ok() -> bool:
    from . import backend

    if backend._TRACE_BACKEND == "cuda":
        return hasattr(mx.fast, "cuda_kernel")
    return backend._cuda_available() and hasattr(mx.fast, "cuda_kernel")
