"""Lint Metal kernel bodies (as passed to ``mx.fast.metal_kernel(source=...)``) with clang.

The body is rendered with MLX's exact signature (see
:mod:`mlx_lily.testing.metal_emu`), then checked by ``clang -fsyntax-only``
against the emulator's shim header in *lint mode*, where Metal's address
spaces are distinct clang address spaces::

    device      -> __attribute__((address_space(1)))
    constant    -> __attribute__((address_space(2)))
    threadgroup -> __attribute__((address_space(3)))
    thread      -> the default address space

so passing a ``threadgroup float*`` (or a pointer to a local) where a
``device float*`` is expected is an error, as it is for Apple's compiler.
Template kernels are explicitly instantiated with the given template
arguments, so template bodies are checked too. On top of clang, a textual
pass rejects C++ features MSL lacks: ``double``/``long long``/``long double``,
exceptions (``throw``/``try``/``catch``), ``new``/``delete`` expressions,
``virtual``, RTTI (``typeid``/``dynamic_cast``), ``goto``, ``thread_local``,
``register``, the ``noexcept`` operator, function pointers, inline ``asm``,
anything from ``std::`` and ``#include`` of anything but ``<metal_*>``
headers (MLX's headers cannot be included: put helpers in the header).
Threadgroup arrays declared at the top level of the body are summed and
checked against the 32 KiB limit. Recursion is not detected. Issues of a body
file name the file line as well as the ``source``/``header`` line.

Body file convention (``shaders/metal/*.metal``)
------------------------------------------------
A ``.metal`` file holds one kernel: helper code (the ``header`` argument)
before a ``// ---- body ----`` line and the kernel BODY (the ``source``
argument, not a full Metal function) after it, as ``mlx_lily.kernels``
splits them; without the marker the whole file is the body. A leading
comment block of directives describes the kernel::

    // @kernel lily_gdn_scan                  (default: the file stem)
    // @inputs q[B,T,Hk,Dk]:T k[B,T,Hk,Dk] g[B,T,Hv]:float32 eps[1]:float32 (remarks in parentheses)
    // @outputs y[B,T,Hv,Dv]:T state_out[B,Hv,Dv,Dk]:float32
    // @template T=bfloat16 Hk=16 Hv=32 Dk=128 Dv=128
    // @template T=float16 Hk=16 Hv=32 Dk=128 Dv=128
    // @grid (32*NW, B*Hv, 1)                 (documentation only)
    // @threadgroup (32*NW, 1, 1)             (documentation only)
    // @header common.h                       (optional extra header file, prepended)
    // @atomic_outputs                        (optional)
    // @ensure_row_contiguous false           (optional)
    ... helpers ...
    // ---- body ----
    ... kernel body ...

* ``@inputs``: input names in call order, separated by spaces or commas, each
  ``name[shape][:dtype][:scalar|:small]`` or ``name[shape] dtype``. ``dtype``
  is an MLX dtype name (float32, float16, bfloat16, int32, uint32, bool, ...)
  or a template type parameter from ``@template``; when omitted it is ``T`` if
  the kernel has a template type ``T``, else float32. The shape is
  documentation except that a shape whose size is known and below 8 (``[1]``,
  ``[3]``) or ``:small`` makes a ``const constant T*`` input, and ``[]`` or
  ``:scalar`` a 0-d ``const constant T&`` one; others are ``const device T*``.
  Parenthesised remarks are ignored.
* ``@outputs``: output names, same syntax.
* ``@template``: ``NAME=value`` pairs in template order; values are ints,
  ``true``/``false``, or dtype names. Repeat the line to lint (and test)
  several instantiations.
* ``@header``: an extra helper header file (relative to the body file),
  prepended to the in-file helpers; several lines prepend several files in order.
* ``@atomic_outputs``: the kernel is built with ``atomic_outputs=True``.
* ``@ensure_row_contiguous false``: the kernel is built with that flag.

:func:`lint_call` lints one instantiation from the arrays a real call passes (their
dtype, ndim and size decide each input's address space, as in MLX):
:mod:`mlx_lily.testing.msl_frontend` uses it for every call a model's forward makes.

:func:`parse_body_file` returns a :class:`MetalBodySpec` that both the lint
and op tests use (``spec.kernel(factory)`` builds the kernel with
``mx.fast.metal_kernel`` or the emulator's).
"""

from __future__ import annotations

import functools
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import mlx.core as mx

from .metal_emu import _build, _render, _rewrite

__all__ = [
    "LintIssue",
    "LintResult",
    "MetalBodySpec",
    "lint_call",
    "lint_file",
    "lint_metal_source",
    "parse_body_file",
]

THREADGROUP_MEMORY_LIMIT = 32768

_DTYPES = {
    "float32": mx.float32,
    "float": mx.float32,
    "float16": mx.float16,
    "half": mx.float16,
    "bfloat16": mx.bfloat16,
    "bfloat": mx.bfloat16,
    "int8": mx.int8,
    "int16": mx.int16,
    "int32": mx.int32,
    "int": mx.int32,
    "int64": mx.int64,
    "uint8": mx.uint8,
    "uint16": mx.uint16,
    "uint32": mx.uint32,
    "uint": mx.uint32,
    "uint64": mx.uint64,
    "bool": mx.bool_,
}


@dataclass(frozen=True)
class LintIssue:
    """One problem: ``where`` is "source" (the body), "header" or "generated"."""

    where: str
    line: int
    column: int
    message: str
    code: str  # "clang", "msl-restriction", "threadgroup-memory"
    severity: str = "error"
    file: str | None = None  # for body files: the file and line the issue is in
    file_line: int | None = None

    def __str__(self) -> str:
        loc = f"{self.where}:{self.line}:{self.column}"
        if self.file is not None:
            loc = f"{self.file}:{self.file_line}:{self.column} ({loc})"
        return f"{loc}: {self.severity}: {self.message} [{self.code}]"


@dataclass
class LintResult:
    """The outcome of linting one kernel (all its instantiations)."""

    name: str
    issues: list[LintIssue] = field(default_factory=list)
    msl: list[str] = field(default_factory=list)
    clang_output: str = ""

    @property
    def ok(self) -> bool:
        """True when there is no error."""
        return not any(i.severity == "error" for i in self.issues)

    def format(self) -> str:
        """A readable report."""
        if not self.issues:
            return f"{self.name}: clean"
        return f"{self.name}:\n" + "\n".join("  " + str(i) for i in self.issues)

    def raise_for_issues(self) -> None:
        """Raise AssertionError with the report when there are errors."""
        if not self.ok:
            raise AssertionError(self.format())


def _dtype(name: str) -> mx.Dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}") from None


def _template_value(text: str):
    t = text.strip()
    if t in ("true", "True"):
        return True
    if t in ("false", "False"):
        return False
    if re.fullmatch(r"[+-]?\d+", t):
        return int(t)
    return _dtype(t)


@dataclass
class MetalBodySpec:
    """A kernel body file parsed by :func:`parse_body_file`."""

    path: Path | None
    name: str
    body: str
    header: str
    inputs: list[tuple[str, str | None, str]]  # (name, dtype or template param, "array"/"scalar"/"small")
    outputs: list[tuple[str, str | None]]
    templates: list[list[tuple[str, object]]]
    atomic_outputs: bool = False
    ensure_row_contiguous: bool = True
    body_first_line: int = 1  # line of the file holding body line 1
    header_files: tuple = ()  # (path, line count) of each @header file, prepended in order

    def locate(self, where: str, line: int) -> tuple[str | None, int | None]:
        """(file, line) of a ``source``/``header`` line of this kernel."""
        if self.path is None or line <= 0:
            return None, None
        if where == "source":
            return str(self.path), self.body_first_line + line - 1
        if where == "header":
            for hpath, hlines in self.header_files:
                if line <= hlines:
                    return str(hpath), line
                line -= hlines
            return str(self.path), line
        return None, None

    @property
    def input_names(self) -> list[str]:
        return [n for n, _, _ in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [n for n, _ in self.outputs]

    def kernel(self, factory: Callable | None = None, **kwargs):
        """Build the kernel with ``factory`` (default ``mx.fast.metal_kernel``)."""
        factory = factory or mx.fast.metal_kernel
        return factory(
            name=self.name,
            input_names=self.input_names,
            output_names=self.output_names,
            source=self.body,
            header=self.header,
            ensure_row_contiguous=self.ensure_row_contiguous,
            atomic_outputs=self.atomic_outputs,
            **kwargs,
        )


BODY_MARKER = "// ---- body ----"


def _strip_parens(text: str) -> str:
    prev = None
    while prev != text:
        prev = text
        text = re.sub(r"\([^()]*\)", " ", text)
    return text


def _tokens(text: str) -> list[str]:
    """Split a directive at whitespace and commas, keeping ``name[a, b]`` together."""
    out, cur, depth = [], "", 0
    for c in text:
        if c == "[":
            depth += 1
        elif c == "]":
            depth -= 1
        if depth == 0 and (c.isspace() or c == ","):
            if cur:
                out.append(cur)
            cur = ""
        else:
            cur += c
    if cur:
        out.append(cur)
    return out


def _eval_dims(dims: str, ints: dict) -> int | None:
    """Number of elements of a ``[a, b]`` shape, or None when symbolic."""
    total = 1
    for d in dims.split(","):
        expr = d.strip()
        if not expr:
            continue
        expr = re.sub(r"[A-Za-z_]\w*", lambda m: str(ints[m.group(0)]) if m.group(0) in ints else "?", expr)
        if "?" in expr or not re.fullmatch(r"[\d+\-*/() ]+", expr):
            return None
        try:
            total *= int(eval(expr, {"__builtins__": {}}, {}))  # digits and operators only
        except Exception:
            return None
    return total


def _parse_buffers(text: str, type_params: set, ints: dict, outputs: bool):
    """Entries of an @inputs/@outputs line: ``name[shape]:dtype``, ``name[shape] dtype``,
    ``name:dtype:scalar`` ... parenthesised remarks are ignored."""
    entries: list[list] = []  # [name, dtype, kind]
    for tok in _tokens(_strip_parens(text)):
        m = re.fullmatch(r"([A-Za-z_]\w*)(\[[^\]]*\])?((?::[\w]*)*)", tok)
        if not m:
            continue
        name, shape, extras = m.group(1), m.group(2), m.group(3)
        if (
            entries
            and shape is None
            and not extras
            and entries[-1][1] is None
            and (name in _DTYPES or name in type_params)
        ):
            entries[-1][1] = name  # "x[N] int32": the dtype of the previous entry
            continue
        dtype, kind = None, "array"
        for extra in extras.split(":")[1:]:
            if extra in ("scalar", "small"):
                kind = extra
            elif extra:
                dtype = extra
        if shape is not None and kind == "array":
            inner = shape[1:-1].strip()
            if not inner:
                kind = "scalar"
            else:
                n = _eval_dims(inner, ints)
                if n is not None and n < _render.MAX_CONSTANT_ARRAY_SIZE:
                    kind = "small"
        entries.append([name, dtype, kind])
    if outputs:
        return [(n, d) for n, d, _ in entries]
    return [(n, d, k) for n, d, k in entries]


def parse_body_file(path: str | Path) -> MetalBodySpec:
    """Parse a ``.metal`` body file and its directives (see the module docstring)."""
    path = Path(path)
    text = path.read_text()
    if BODY_MARKER in text:
        header, body = text.split(BODY_MARKER, 1)
        body_first_line = header.count("\n") + 1
    else:
        header, body = "", text
        body_first_line = 1
    name = path.stem
    directives: list[tuple[str, str]] = []
    for line in text.splitlines():
        m = re.match(r"\s*//\s*@(\w+)\s*(.*?)\s*$", line)
        if m:
            directives.append((m.group(1), m.group(2)))
    templates: list[list[tuple[str, object]]] = []
    for key, rest in directives:
        if key == "template":
            pairs = []
            for tok in rest.split():
                k, eq, v = tok.partition("=")
                if eq:
                    pairs.append((k, _template_value(v)))
            templates.append(pairs)
    type_params = {k for t in templates for k, v in t if isinstance(v, mx.Dtype)}
    ints = {k: int(v) for k, v in (templates[0] if templates else []) if isinstance(v, (int, bool))}
    inputs: list[tuple[str, str | None, str]] = []
    outputs: list[tuple[str, str | None]] = []
    header_names: list[str] = []
    atomic = False
    contiguous = True
    for key, rest in directives:
        if key == "kernel":
            name = rest.split()[0]
        elif key == "inputs":
            inputs += _parse_buffers(rest, type_params, ints, outputs=False)
        elif key == "outputs":
            outputs += _parse_buffers(rest, type_params, ints, outputs=True)
        elif key == "header":
            header_names.append(rest.split()[0])
        elif key == "atomic_outputs":
            atomic = rest.strip().lower() not in ("false", "0", "no")
        elif key == "ensure_row_contiguous":
            contiguous = rest.strip().lower() not in ("false", "0", "no")
    default_dt = "T" if "T" in type_params else None
    inputs = [(n, d if d is not None else default_dt, k) for n, d, k in inputs]
    outputs = [(n, d if d is not None else default_dt) for n, d in outputs]
    files, helpers = [], ""
    for header_name in header_names:
        hpath = path.with_name(header_name)
        if not hpath.exists():
            raise FileNotFoundError(f"{path}: @header {header_name} not found")
        htext = hpath.read_text()
        if not htext.endswith("\n"):
            htext += "\n"
        files.append((hpath, htext.count("\n")))
        helpers += htext
    return MetalBodySpec(
        path, name, body, helpers + header, inputs, outputs, templates or [[]], atomic,
        contiguous, body_first_line, tuple(files),
    )


# --------------------------------------------------------------------------- textual MSL checks
_RESTRICTIONS: list[tuple[str, str]] = [
    (r"\bdouble\b", "MSL has no double"),
    (r"\blong\s+long\b", "MSL has no long long"),
    (r"\blong\s+double\b", "MSL has no long double"),
    (r"\bthrow\b|\btry\s*\{|\bcatch\s*\(", "MSL has no exceptions"),
    (r"\bnew\b", "MSL has no new expressions"),
    (r"\bdelete\b", "MSL has no delete expressions"),
    (r"\bvirtual\b", "MSL has no virtual functions"),
    (r"\btypeid\b|\bdynamic_cast\b", "MSL has no RTTI"),
    (r"\bgoto\b", "MSL has no goto"),
    (r"\bthread_local\b", "MSL has no thread_local storage"),
    (r"\bregister\b", "MSL has no register storage class"),
    (r"\bnoexcept\s*\(", "MSL has no noexcept operator"),
    (r"\(\s*\*\s*[A-Za-z_]\w*\s*\)\s*\(", "MSL kernels cannot use function pointers"),
    (r"\b(asm|__asm__|__asm)\b", "MSL has no inline assembly"),
    (r"\bstd\s*::", "the C++ standard library is not available in MSL (use metal::)"),
]


def _textual_issues(text: str, where: str) -> list[LintIssue]:
    masked = _rewrite.mask_code(text)
    issues = []
    for pattern, message in _RESTRICTIONS:
        for m in re.finditer(pattern, masked):
            if "delete" in pattern and masked[: m.start()].rstrip().endswith("="):
                continue  # `= delete;` declarations are fine
            start = m.start() + (len(m.group(0)) - len(m.group(0).lstrip()))
            line = masked.count("\n", 0, start) + 1
            col = start - (masked.rfind("\n", 0, start) + 1) + 1
            issues.append(LintIssue(where, line, col, message, "msl-restriction"))
    for m in re.finditer(r"^\s*#\s*include\s*([<\"])([^>\"]*)", masked, re.M):
        # mask_code blanks the quoted name; read it from the original text
        orig = re.match(r"\s*#\s*include\s*[<\"]([^>\"]*)", text[m.start() :])
        inc = orig.group(1) if orig else ""
        if not inc.startswith("metal_"):
            line = masked.count("\n", 0, m.start()) + 1
            issues.append(
                LintIssue(where, line, 1, f"#include <{inc}>: MLX kernels can only include <metal_*> "
                          "headers (put helpers in the kernel header)", "msl-restriction")
            )
    return issues


# --------------------------------------------------------------------------- clang
@functools.lru_cache(maxsize=None)
def _stub_include_dir() -> Path:
    d = _build.cache_dir() / "lint-include"
    d.mkdir(parents=True, exist_ok=True)
    for h in (
        "metal_stdlib", "metal_math", "metal_simdgroup", "metal_simdgroup_matrix", "metal_atomic",
        "metal_compute", "metal_integer", "metal_common", "metal_relational", "metal_geometric",
        "metal_types", "metal_numeric", "metal_limits", "metal_type_traits", "metal_pack",
    ):
        p = d / h
        if not p.exists():
            p.write_text("#pragma once\n")
    return d


def _clang_command() -> list[str]:
    cmd = _build.compiler_command()
    # The ziglang driver's `c++` mode wraps compilation; its raw clang is `clang`.
    if cmd[-1] == "c++" and "ziglang" in cmd:
        cmd = cmd[:-1] + ["clang"]
    return cmd


_DIAG = re.compile(r"^(?P<file>[^:\n]+):(?P<line>\d+):(?P<col>\d+): (?P<sev>error|warning|note): (?P<msg>.*)$")


def _parse_clang(output: str) -> list[LintIssue]:
    issues: list[LintIssue] = []
    pending: tuple[str, str] | None = None  # (severity, message) of an error outside user code
    for raw in output.splitlines():
        m = _DIAG.match(raw)
        if not m:
            continue
        f = m.group("file")
        where = "source" if f == "source" else "header" if f == "header" else "generated"
        sev, msg = m.group("sev"), m.group("msg")
        line, col = int(m.group("line")), int(m.group("col"))
        if sev in ("error", "warning"):
            if where == "generated":
                pending = (sev, msg)
                continue
            pending = None
            issues.append(LintIssue(where, line, col, msg, "clang", sev))
        elif sev == "note" and pending and where != "generated":
            issues.append(LintIssue(where, line, col, f"{pending[1]} (in code it calls: {msg})", "clang", pending[0]))
            pending = None
    if pending:
        issues.append(LintIssue("generated", 0, 0, pending[1], "clang", pending[0]))
    return issues


def _resolve_dtype(dt: str | None, template: Sequence[tuple[str, object]]) -> mx.Dtype:
    if dt is None:
        return mx.float32
    for k, v in template:
        if k == dt:
            if not isinstance(v, mx.Dtype):
                raise ValueError(f"template parameter {dt} used as a dtype is not a dtype")
            return v
    return _dtype(dt)


def lint_metal_source(
    body: str,
    header: str = "",
    input_names: Sequence[str] = (),
    output_names: Sequence[str] = ("out",),
    template: Sequence[tuple[str, object]] = (),
    *,
    name: str = "kernel",
    input_dtypes: Sequence | None = None,
    input_kinds: Sequence[str] | None = None,
    output_dtypes: Sequence | None = None,
    atomic_outputs: bool = False,
    threadgroup_memory_limit: int = THREADGROUP_MEMORY_LIMIT,
) -> LintResult:
    """Lint one kernel body (one template instantiation).

    ``input_dtypes``/``output_dtypes`` hold mx dtypes or names (dtype names or
    template parameter names), default float32; ``input_kinds`` holds
    "array" (default), "scalar" (0-d) or "small" (< 8 elements) per input.
    Returns a :class:`LintResult` (``.ok``, ``.issues``, ``.format()``).
    """
    template = list(template)
    n_in = len(input_names)
    kinds = list(input_kinds or ["array"] * n_in)

    def res(dt):
        return dt if isinstance(dt, mx.Dtype) else _resolve_dtype(dt, template)

    in_dt = [res(d) for d in (input_dtypes or [None] * n_in)]
    out_dt = [res(d) for d in (output_dtypes or [None] * len(output_names))]
    infos = [
        _render.InputInfo(dt, 0 if k == "scalar" else 1, 1 if k in ("scalar", "small") else 1 << 20)
        for dt, k in zip(in_dt, kinds)
    ]
    return lint_call(body, header, input_names, infos, output_names, out_dt, template, name=name,
                     atomic_outputs=atomic_outputs,
                     threadgroup_memory_limit=threadgroup_memory_limit)


def lint_call(
    body: str,
    header: str,
    input_names: Sequence[str],
    inputs: Sequence[_render.InputInfo],
    output_names: Sequence[str],
    output_dtypes: Sequence[mx.Dtype],
    template: Sequence[tuple[str, object]] = (),
    *,
    name: str = "kernel",
    atomic_outputs: bool = False,
    threadgroup_memory_limit: int = THREADGROUP_MEMORY_LIMIT,
) -> LintResult:
    """Lint one instantiation as a real call renders it: ``inputs`` give each input's
    dtype, ndim and size (the arrays passed), which decide ``constant`` vs ``device`` and
    ``*`` vs ``&`` exactly as MLX's ``write_signature`` does."""
    template = list(template)
    infos = list(inputs)
    out_dt = list(output_dtypes)
    result = LintResult(name)
    result.issues += _textual_issues(body, "source")
    result.issues += _textual_issues(header, "header")

    kname, msl = _render.render_msl(
        name, header, body, input_names, infos, output_names, out_dt, template, atomic_outputs
    )
    result.msl.append(msl)

    found: list = []
    cpp_header = _rewrite.to_cpp(header, mode="lint")
    cpp_body = _rewrite.to_cpp(body, mode="lint", found=found)
    top = [ident for _, depth, ident in found if depth == 0]
    if top:
        total = " + ".join(f"__emu_tgsz_{i}" for i in top)
        cpp_body += (
            f'\n#line 1 "<tgmem>"\nstatic_assert({total} <= {threadgroup_memory_limit}ul, '
            f'"threadgroup memory declared by this kernel exceeds {threadgroup_memory_limit} bytes");'
        )
    marks: dict = {}
    text = _render.write_signature(
        kname, cpp_header, body, input_names, infos, output_names, out_dt, template, atomic_outputs,
        body=cpp_body, marks=marks,
    )
    hdr, sig, rest = text[: marks["signature"]], text[marks["signature"] : marks["body"]], text[marks["body"] :]
    tu = ["#define __EMU_LINT 1\n#include \"metal_emu.h\"\n", '#line 1 "header"\n', hdr]
    if hdr and not hdr.endswith("\n"):
        tu.append("\n")
    tu += ['#line 1 "<signature>"\n', sig, '#line 1 "source"\n', rest]
    if template:
        tdef = kname + _render.write_template(template)
        tu.append(f'#line 1 "<instantiation>"\ntemplate decltype({tdef}) {tdef};\n')
    cmd = _clang_command() + [
        "-x", "c++", "-std=c++17", "-fsyntax-only", "-nostdinc", "-fno-exceptions", "-fno-rtti",
        "-cl-single-precision-constant", "-Wno-unknown-attributes", "-Wno-ignored-attributes",
        "-ferror-limit=50", "-fno-color-diagnostics",
        "-I", str(_build.SHIM_DIR), "-isystem", str(_stub_include_dir()), "-",
    ]
    r = subprocess.run(cmd, input="".join(tu), capture_output=True, text=True)
    result.clang_output = r.stderr
    issues = _parse_clang(r.stderr)
    for i in issues:
        if i.where == "generated" and "threadgroup memory declared" in i.message:
            i = LintIssue("source", 0, 0, i.message, "threadgroup-memory")
        result.issues.append(i)
    if r.returncode != 0 and not any(i.severity == "error" for i in issues):
        result.issues.append(LintIssue("generated", 0, 0, r.stderr.strip()[-2000:] or "clang failed", "clang"))
    return result


def lint_spec(spec: MetalBodySpec) -> LintResult:
    """Lint every template instantiation a parsed body file declares."""
    result = LintResult(spec.name)
    seen = set()
    for template in spec.templates:
        r = lint_metal_source(
            spec.body,
            spec.header,
            spec.input_names,
            spec.output_names,
            template,
            name=spec.name,
            input_dtypes=[dt for _, dt, _ in spec.inputs],
            input_kinds=[k for _, _, k in spec.inputs],
            output_dtypes=[dt for _, dt in spec.outputs],
            atomic_outputs=spec.atomic_outputs,
        )
        for i in r.issues:
            f, fl = spec.locate(i.where, i.line)
            if f is not None:
                i = LintIssue(i.where, i.line, i.column, i.message, i.code, i.severity, f, fl)
            if i not in seen:
                seen.add(i)
                result.issues.append(i)
        result.msl += r.msl
        result.clang_output += r.clang_output
    return result


def lint_file(path: str | Path) -> LintResult:
    """Lint a ``.metal`` body file (every ``@template`` instantiation it declares)."""
    return lint_spec(parse_body_file(path))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m mlx_lily.testing.msl_lint FILE.metal...``: print reports, exit 1 on errors."""
    argv = list(sys.argv[1:] if argv is None else argv)
    bad = 0
    for p in argv:
        r = lint_file(p)
        print(r.format())
        bad += not r.ok
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
