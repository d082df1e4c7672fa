"""A faithful front-end check of every Metal kernel instantiation a model's forward makes.

Why: MLX writes each custom kernel's signature from the arrays of the call
(``write_signature`` in MLX 0.32 ``mlx/backend/common/metal_kernel.cpp``): an input of
fewer than 8 elements is ``const constant T*`` (0-d: ``const constant T&``), others
``const device T*``. A stand-in array of 4 elements handed to a helper that takes
``const device T*`` is a compile error on a Mac, even in a branch that never runs. A
check that types inputs from a file's declared shapes cannot see that; this one records
the real calls.

How:

1. :func:`record_forward` runs a model's forward with every Lily switch on
   (``MLX_LILY_KERNELS=all``) on the Metal kernel path (``backend.tracing_backend``)
   with ``mx.fast.metal_kernel`` replaced by :class:`RecordingKernel`, which stores each
   call (name, source, header, the arrays passed: shape, dtype, size; outputs, template,
   grid, threadgroup, flags) and returns lazy zeros: nothing runs on any GPU. It
   records the warm-up's short prefill, decode steps (compiled whole-stack, per-layer and
   eager), and 2048-token prefill chunks (a first one and one after it).
   :func:`record_model` builds the model (mlx-lm's own classes at production per-layer
   widths, few layers, lazy random weights: :data:`FAMILIES`) and records it.
2. :func:`instantiations` deduplicates the calls by the source MLX would generate.
3. :func:`check_instantiation` renders the source exactly as MLX does (signature,
   template instantiation line) and compiles it with clang ``-fsyntax-only`` against the
   emulator's shim in lint mode: Metal's ``device`` / ``constant`` / ``threadgroup``
   address spaces are distinct clang address spaces (no implicit conversion between them)
   and the shim's ``metal_stdlib`` functions take pointers only in the address spaces
   Metal's do. Results are cached on disk by a hash of the rendered translation unit,
   shim and compiler (as the emulator caches its builds). Launch limits MLX checks only
   on a Mac (threads per threadgroup <= 1024, 32 KiB of threadgroup memory) are checked
   too.

``python -m mlx_lily.testing.msl_frontend --report`` records every family, checks every
instantiation and prints: instantiations recorded, passed, failed with the first
compiler error of each (exit status 1 when any failed); ``--json PATH`` also writes every
instantiation with its calls (arrays passed, grid, threadgroup, template) and verdict.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Sequence

import mlx.core as mx

from . import msl_lint
from .metal_emu import _build, _render

__all__ = [
    "ArrayInfo", "Call", "CheckResult", "FAMILIES", "Instantiation", "RecordingKernel",
    "check_all", "check_instantiation", "instantiations", "record_forward", "record_model",
    "recording", "main",
]

MAX_THREADS_PER_THREADGROUP = 1024  # Apple GPUs' ceiling; a pipeline's own can be lower


@dataclass(frozen=True)
class ArrayInfo:
    """What MLX's signature and launch read from one array of a call."""

    shape: tuple
    dtype: mx.Dtype
    size: int

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def space(self) -> str:
        """The address space MLX renders this input in: ``"constant"`` or ``"device"``."""
        return "constant" if self.size < _render.MAX_CONSTANT_ARRAY_SIZE else "device"

    def render_info(self) -> _render.InputInfo:
        return _render.InputInfo(self.dtype, self.ndim, self.size)

    def __str__(self) -> str:
        dt = str(self.dtype).replace("mlx.core.", "")
        return f"{dt}{list(self.shape)}({self.space}{'&' if self.ndim == 0 else '*'})"


@dataclass(frozen=True)
class Call:
    """One recorded ``metal_kernel`` call: the kernel object's construction arguments
    and the call's arguments."""

    name: str
    source: str
    header: str
    input_names: tuple
    inputs: tuple  # ArrayInfo per input
    output_names: tuple
    output_shapes: tuple
    output_dtypes: tuple
    template: tuple  # (name, value) pairs
    grid: tuple
    threadgroup: tuple
    atomic_outputs: bool
    ensure_row_contiguous: bool
    init_value: float | None
    context: str = ""  # which recorded forward made the call

    def render(self) -> tuple[str, str]:
        """(mangled kernel name, the full MSL MLX would generate, template line included)."""
        return _render.render_msl(
            self.name, self.header, self.source, self.input_names,
            [a.render_info() for a in self.inputs], self.output_names, self.output_dtypes,
            self.template, self.atomic_outputs)


class RecordingKernel:
    """Stands in for a ``mx.fast.metal_kernel`` object: each call is appended to the open
    :func:`recording` and returns lazy zeros of the requested outputs."""

    def __init__(self, name, input_names, output_names, source, header="",
                 ensure_row_contiguous=True, atomic_outputs=False, compile_options=None):
        self.name = name
        self.input_names = tuple(input_names)
        self.output_names = tuple(output_names)
        self.source = source
        self.header = header
        self.ensure_row_contiguous = bool(ensure_row_contiguous)
        self.atomic_outputs = bool(atomic_outputs)

    def __call__(self, inputs, output_shapes, output_dtypes, grid, threadgroup,
                 template=None, init_value=None, verbose=False, stream=None):
        arrs = [x if isinstance(x, mx.array) else mx.array(x) for x in inputs]
        if len(arrs) != len(self.input_names):
            raise ValueError(f"[metal_kernel] {self.name}: {len(arrs)} inputs for "
                             f"{len(self.input_names)} names")
        shapes = tuple(tuple(int(d) for d in s) for s in output_shapes)
        call = Call(
            self.name, self.source, self.header, self.input_names,
            tuple(ArrayInfo(tuple(a.shape), a.dtype, int(a.size)) for a in arrs),
            self.output_names, shapes, tuple(output_dtypes),
            tuple((str(k), v) for k, v in (template or [])),
            tuple(int(g) for g in grid), tuple(int(t) for t in threadgroup),
            self.atomic_outputs, self.ensure_row_contiguous,
            None if init_value is None else float(init_value), _CONTEXT[0])
        if _RECORD is not None:
            _RECORD.append(call)
        return [mx.zeros(s, dtype=d) for s, d in zip(shapes, output_dtypes)]


_RECORD: list | None = None
_CONTEXT = [""]


@contextlib.contextmanager
def recording():
    """Within the block, ``mx.fast.metal_kernel`` is :class:`RecordingKernel`, Lily's
    kernel objects are built afresh (``mlx_lily.kernels`` cache emptied, restored after)
    and the dispatchers take the Metal kernel path; yields the list of :class:`Call`."""
    global _RECORD
    from .. import backend, kernels

    saved_cache = dict(kernels._CACHE)
    orig = mx.fast.metal_kernel
    prev, _RECORD = _RECORD, []
    rec = _RECORD
    kernels._CACHE.clear()
    mx.fast.metal_kernel = RecordingKernel
    try:
        with backend.tracing_backend("metal"):
            yield rec
    finally:
        mx.fast.metal_kernel = orig
        kernels._CACHE.clear()
        kernels._CACHE.update(saved_cache)
        _RECORD = prev


@contextlib.contextmanager
def _env(**values):
    old = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _context(label: str):
    prev, _CONTEXT[0] = _CONTEXT[0], label
    try:
        yield
    finally:
        _CONTEXT[0] = prev


#: Decode-step compile modes recorded: (label, MLX_LILY_COMPILE, MLX_LILY_COMPILE_WHOLE).
DECODE_MODES = (("decode-whole", None, None), ("decode-per-layer", None, "0"),
                ("decode-eager", "0", None))


def record_forward(model, prompt_len: int = 8, chunk: int = 2048, batches=(2, 8)) -> list:
    """Record the ``metal_kernel`` calls of ``model``'s forward, patched by Lily with every
    kernel allowed, without running anything: the warm-up's ``prompt_len``-token prefill
    and a decode step in each of :data:`DECODE_MODES` after it; then a ``chunk``-token
    prefill (mlx-lm's prefill step on Metal), a second chunk after it and decode steps at
    that context; then for each ``batch`` in ``batches`` a ``batch``-row prefill and decode
    steps (inputs of fewer than 8 elements per row change address space at 8 rows), and the same
    as ``mlx_lm.server`` batches requests (merged per-request caches, right-padded prompts
    of different lengths). The model
    must be an mlx-lm ``qwen3_5``/``qwen3_5_moe``/``qwen3_next`` model (its weights may
    be lazy). Returns the :class:`Call` list in call order."""
    from mlx_lm.generate import _merge_caches

    import mlx_lily
    from .. import patching

    with recording() as rec, _env(MLX_LILY_KERNELS="all", MLX_LILY_DISABLE=None,
                                  MLX_LILY_COMPILE=None, MLX_LILY_COMPILE_WHOLE=None):
        orig_warmup = patching.warmup
        patching.warmup = lambda *a, **k: 0.0  # the calls below are the warm-up's and more
        was_patched = mlx_lily.is_patched()
        try:
            if not was_patched:
                mlx_lily.patch()
            patching.prepare_model(model)

            def decode_steps(cache, tag):
                for label, comp, whole in DECODE_MODES:
                    with _env(MLX_LILY_COMPILE=comp, MLX_LILY_COMPILE_WHOLE=whole), \
                            _context(f"{label}@{tag}"):
                        model(mx.zeros((1, 1), dtype=mx.int32), cache=cache)

            cache = model.make_cache()
            with _context(f"prefill-{prompt_len}"):
                model(mx.zeros((1, prompt_len), dtype=mx.int32), cache=cache)
            decode_steps(cache, f"ctx{prompt_len}")
            cache = model.make_cache()
            with _context(f"prefill-{chunk}"):
                model(mx.zeros((1, chunk), dtype=mx.int32), cache=cache)
            with _context(f"prefill-{chunk}@ctx{chunk}"):
                model(mx.zeros((1, chunk), dtype=mx.int32), cache=cache)
            decode_steps(cache, f"ctx{2 * chunk}")
            for batch in batches:
                cache = model.make_cache()
                with _context(f"prefill-{batch}x{prompt_len}"):
                    model(mx.zeros((batch, prompt_len), dtype=mx.int32), cache=cache)
                for label, comp, whole in DECODE_MODES:
                    with _env(MLX_LILY_COMPILE=comp, MLX_LILY_COMPILE_WHOLE=whole), \
                            _context(f"{label}-{batch}x@ctx{prompt_len}"):
                        model(mx.zeros((batch, 1), dtype=mx.int32), cache=cache)
                # mlx_lm.server's batches: per-request caches merged, right-padded prompts
                # of different lengths (ArraysCache lengths, BatchKVCache padding)
                cache = _merge_caches([model.make_cache() for _ in range(batch)])
                lengths = [prompt_len - i for i in range(batch)]
                for c in cache:
                    c.prepare(lengths=lengths, right_padding=[prompt_len - n for n in lengths])
                with _context(f"server-prefill-{batch}x{prompt_len}"):
                    model(mx.zeros((batch, prompt_len), dtype=mx.int32), cache=cache)
                for c in cache:
                    c.finalize()
                for label, comp, whole in DECODE_MODES:
                    with _env(MLX_LILY_COMPILE=comp, MLX_LILY_COMPILE_WHOLE=whole), \
                            _context(f"server-{label}-{batch}x@ctx{prompt_len}"):
                        model(mx.zeros((batch, 1), dtype=mx.int32), cache=cache)
        finally:
            if not was_patched:
                mlx_lily.unpatch()
            patching.warmup = orig_warmup
    return list(rec)


# Production per-layer widths. qwen3_5_moe: Qwen3.6-35B-A3B (its config.json). qwen3_5: a
# dense model of Qwen3.5-27B's model-card widths (hidden 5120, 24 q / 4 kv heads of 256,
# MLP 17408; its 16 k / 48 v GDN heads are assumed). qwen3_next: Qwen3-Next-80B-A3B's
# (hidden 2048, 16 / 2 heads, GDN 16 / 32, 512 experts top-10 of 512). Layers are cut to
# ``layers`` (3 GDN + 1 attention at 4); expert counts are the real ones.
_QWEN36 = dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
               linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
               linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
               rms_norm_eps=1e-6, vocab_size=248320, max_position_embeddings=262144,
               tie_word_embeddings=False, attn_output_gate=True)
FAMILIES: dict = {
    "qwen3_5_moe": dict(_QWEN36, num_experts=256, num_experts_per_tok=8,
                        moe_intermediate_size=512, shared_expert_intermediate_size=512),
    "qwen3_5": dict(_QWEN36, hidden_size=5120, num_attention_heads=24, num_key_value_heads=4,
                    linear_num_key_heads=16, linear_num_value_heads=48,
                    intermediate_size=17408),
    "qwen3_next": dict(_QWEN36, vocab_size=151936, num_experts=512, num_experts_per_tok=10,
                       moe_intermediate_size=512, shared_expert_intermediate_size=512,
                       intermediate_size=5120, decoder_sparse_step=1, mlp_only_layers=[]),
}


def build_model(family: str, layers: int = 4):
    """A lazy, 4-bit quantized (``convert -q``: group 64, routers 8-bit) mlx-lm model of
    ``family`` (a :data:`FAMILIES` key) with production widths and ``layers`` layers.

    Raises:
        ValueError: an unknown family.
    """
    from mlx_lm.utils import quantize_model

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; known: {sorted(FAMILIES)}")
    dims = dict(FAMILIES[family], num_hidden_layers=layers)
    rope = {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10], "mrope_interleaved": True}
    if family == "qwen3_next":
        from mlx_lm.models import qwen3_next as mod

        dims.pop("attn_output_gate")
        cfg = dict(dims, model_type="qwen3_next", rope_theta=10000000,
                   partial_rotary_factor=0.25)
        args = mod.ModelArgs.from_dict(cfg)
    else:
        from mlx_lm.models import qwen3_5 as mod

        if family == "qwen3_5_moe":
            from mlx_lm.models import qwen3_5_moe as mod
        text = dict(dims, model_type=family + "_text", rope_parameters=rope)
        cfg = {"model_type": family, "text_config": text}
        args = mod.ModelArgs.from_dict(cfg)
    model = mod.Model(args)
    model.set_dtype(mx.bfloat16)
    model.eval()

    def router_bits(path, module):
        if not hasattr(module, "to_quantized"):
            return False
        if path.endswith("mlp.gate") or path.endswith("shared_expert_gate"):
            return {"group_size": 64, "bits": 8}
        return True

    import io

    with contextlib.redirect_stdout(io.StringIO()):  # quantize_model prints bits per weight
        model, _ = quantize_model(model, dict(cfg), group_size=64, bits=4, mode="affine",
                                  quant_predicate=router_bits)
    return model


def record_model(family: str, layers: int = 4, **kw) -> list:
    """:func:`record_forward` on :func:`build_model` ``(family, layers)``."""
    model = build_model(family, layers)
    calls = record_forward(model, **kw)
    del model
    return calls


# --------------------------------------------------------------------------- instantiations
@dataclass
class Instantiation:
    """One kernel source as MLX generates it, and every recorded call that uses it."""

    kernel_name: str  # the mangled custom_kernel_... name
    msl: str
    calls: list = field(default_factory=list)

    @property
    def first(self) -> Call:
        return self.calls[0]

    def describe(self) -> str:
        c = self.first
        ins = ", ".join(f"{n}={a}" for n, a in zip(c.input_names, c.inputs))
        tpl = ", ".join(f"{k}={_render.template_value(v)}" for k, v in c.template)
        return f"{c.name}<{tpl}>({ins}) [{c.context}]"


def instantiations(calls: Sequence[Call]) -> list[Instantiation]:
    """``calls`` grouped by the MSL MLX would generate for them, in first-call order."""
    out: dict = {}
    for c in calls:
        kname, msl = c.render()
        key = (kname, hashlib.sha256(msl.encode()).hexdigest())
        inst = out.get(key)
        if inst is None:
            inst = out[key] = Instantiation(kname, msl)
        inst.calls.append(c)
    return list(out.values())


@dataclass
class CheckResult:
    """The outcome of checking one instantiation."""

    instantiation: Instantiation
    errors: list  # strings, first compiler error first
    warnings: list

    @property
    def ok(self) -> bool:
        return not self.errors


def _launch_errors(inst: Instantiation) -> list[str]:
    errs = []
    for c in inst.calls:
        n = c.threadgroup[0] * c.threadgroup[1] * c.threadgroup[2]
        if n > MAX_THREADS_PER_THREADGROUP or n <= 0:
            errs.append(f"threadgroup {c.threadgroup} has {n} threads (Apple GPUs: at most "
                        f"{MAX_THREADS_PER_THREADGROUP}) [{c.context}]")
            break
        if any(g < 0 for g in c.grid) or any(t <= 0 for t in c.threadgroup):
            errs.append(f"invalid grid {c.grid} / threadgroup {c.threadgroup} [{c.context}]")
            break
    return errs


# --------------------------------------------------------------------------- MLX's preamble
_PREAMBLE_FILES = ("utils.h", "bf16.h", "bf16_math.h", "complex.h", "defines.h", "logging.h")
_KEYWORDS = frozenset("""if for while switch return sizeof static_assert operator template
    typename struct class union enum using typedef namespace inline static constexpr const
    constant device thread threadgroup METAL_FUNC decltype alignas""".split())


def preamble_dir():
    """The installed MLX's Metal kernel headers (``mlx/include/.../metal/kernels``), or
    None when this MLX build does not ship them."""
    import mlx

    for root in getattr(mlx, "__path__", []):
        d = os.path.join(root, "include", "mlx", "backend", "metal", "kernels")
        if os.path.isfile(os.path.join(d, "utils.h")):
            return d
    return None


def top_level_names(text: str) -> set:
    """Names a C++/MSL text defines at global scope: macros, structs/classes, typedefs,
    ``using`` aliases, functions and variables outside any namespace or brace (a text
    scan on comment-free code; enough for kernel headers, not a C++ parser)."""
    import re

    from .metal_emu import _rewrite

    masked = _rewrite.mask_code(text).replace("\\\n", " ")  # join macro continuations
    names = set(re.findall(r"^\s*#\s*define\s+([A-Za-z_]\w*)", masked, re.M))
    flat, depth, buf = [], 0, []
    for line in masked.splitlines():
        if line.lstrip().startswith("#"):
            continue
        for ch in line + "\n":
            if ch == "{":
                if depth == 0:
                    flat.append("".join(buf) + "{")
                    buf = []
                depth += 1
            elif ch == "}":
                depth -= 1
            elif depth == 0:
                buf.append(ch)
    flat.append("".join(buf))
    for chunk in flat:
        for stmt in re.split(r"[;]", chunk):
            st = " ".join(stmt.split())
            if not st or st.startswith("namespace"):
                continue
            st = re.sub(r"^template\s*<[^{]*?>\s*", "", st)
            m = re.match(r"(?:struct|class|union|enum(?:\s+class)?)\s+([A-Za-z_]\w*)", st)
            if m:
                names.add(m.group(1))
                continue
            m = re.match(r"typedef\b.*?\b([A-Za-z_]\w*)\s*$", st)
            if m:
                names.add(m.group(1))
                continue
            m = re.match(r"using\s+([A-Za-z_]\w*)\s*=", st)
            if m:
                names.add(m.group(1))
                continue
            if st.startswith(("using", "static_assert")):
                continue
            m = re.search(r"\b([A-Za-z_]\w*)\s*\(", st)  # function declaration/definition
            if m and m.group(1) not in _KEYWORDS and "=" not in st[: m.start()]:
                names.add(m.group(1))
                continue
            m = re.search(r"\b([A-Za-z_]\w*)\s*(?:\[[^\]]*\]\s*)*=", st)  # variable
            if m and m.group(1) not in _KEYWORDS:
                names.add(m.group(1))
    return names


_PREAMBLE_NAMES: list = []


def preamble_names() -> frozenset:
    """Global names MLX's Metal preamble (``utils.h`` and what it includes, as installed)
    defines in front of every custom kernel; empty when the headers are not installed."""
    if not _PREAMBLE_NAMES:
        d = preamble_dir()
        names = set()
        if d is not None:
            for f in _PREAMBLE_FILES:
                p = os.path.join(d, f)
                if os.path.isfile(p):
                    names |= top_level_names(open(p).read())
        names.discard("mlx")
        _PREAMBLE_NAMES.append(frozenset(names))
    return _PREAMBLE_NAMES[0]


def preamble_collisions(header: str) -> list[str]:
    """Errors for names ``header`` defines at global scope that MLX's preamble defines too
    (a redefinition, or an overload set other than the one the shim gives, on a Mac)."""
    clash = sorted(top_level_names(header) & preamble_names())
    return [f"header: error: defines '{n}', which MLX's Metal preamble (kernels/utils.h and "
            "its includes) already defines in front of every custom kernel" for n in clash]


def _cache_key(c: Call) -> str:
    h = hashlib.sha256()
    h.update(_build.compiler_version().encode())
    h.update(_build._shim_digest().encode())
    h.update(open(msl_lint.__file__, "rb").read())
    h.update(open(__file__, "rb").read())
    h.update(c.render()[1].encode())
    return h.hexdigest()[:32]


def check_instantiation(inst: Instantiation, *, use_cache: bool = True) -> CheckResult:
    """Compile ``inst`` as MLX renders it (:func:`msl_lint.lint_call`); also check its
    calls' launch shapes. The verdict is cached on disk by a hash of the rendered source,
    the shim, the lint and the compiler."""
    c = inst.first
    path = _build.cache_dir() / "frontend" / f"{_cache_key(c)}.json"
    if use_cache and path.is_file():
        data = json.loads(path.read_text())
        errors, warns = data["errors"], data["warnings"]
    else:
        r = msl_lint.lint_call(
            c.source, c.header, c.input_names, [a.render_info() for a in c.inputs],
            c.output_names, c.output_dtypes, c.template, name=c.name,
            atomic_outputs=c.atomic_outputs)
        errors = preamble_collisions(c.header) + [str(i) for i in r.issues
                                                  if i.severity == "error"]
        warns = [str(i) for i in r.issues if i.severity != "error"]
        if use_cache:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"errors": errors, "warnings": warns}))
            os.replace(tmp, path)
    return CheckResult(inst, _launch_errors(inst) + errors, warns)


def check_all(insts: Sequence[Instantiation], *, workers: int | None = None,
              use_cache: bool = True) -> list[CheckResult]:
    """:func:`check_instantiation` for each, ``workers`` clang processes at a time."""
    from concurrent.futures import ThreadPoolExecutor

    workers = workers or max(1, min(8, os.cpu_count() or 1))
    with ThreadPoolExecutor(workers) as ex:
        return list(ex.map(lambda i: check_instantiation(i, use_cache=use_cache), insts))


def _first_error(r: CheckResult) -> str:
    return r.errors[0].splitlines()[0] if r.errors else ""


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m mlx_lily.testing.msl_frontend --report [--family F ...] [--layers N]``."""
    p = argparse.ArgumentParser(prog="python -m mlx_lily.testing.msl_frontend",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--report", action="store_true",
                   help="print every instantiation's verdict, not only the failures")
    p.add_argument("--family", action="append", choices=sorted(FAMILIES),
                   help="model family to record (repeatable; default: all)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--warnings", action="store_true", help="print compiler warnings too")
    p.add_argument("--no-cache", action="store_true")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="write every instantiation (its calls, verdict, errors) as JSON")
    a = p.parse_args(argv)
    families = a.family or list(FAMILIES)
    mx.set_default_device(mx.cpu)
    calls, per_family = [], {}
    for fam in families:
        fc = record_model(fam, a.layers)
        per_family[fam] = (len(fc), len(instantiations(fc)))
        calls += fc
    insts = instantiations(calls)
    results = check_all(insts, use_cache=not a.no_cache)
    failed = [r for r in results if not r.ok]
    for fam, (nc, ni) in per_family.items():
        print(f"{fam}: {nc} metal_kernel calls, {ni} instantiations")
    print(f"instantiations recorded: {len(insts)} (all families, deduplicated)")
    print(f"passed: {len(results) - len(failed)}")
    print(f"failed: {len(failed)}")
    for r in results:
        if a.report or not r.ok:
            mark = "FAIL" if not r.ok else "ok  "
            print(f"  {mark} {r.instantiation.describe()}")
            if not r.ok:
                print(f"       first error: {_first_error(r)}")
            if a.warnings:
                for w in r.warnings:
                    print(f"       warning: {w.splitlines()[0]}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump([_result_json(r) for r in results], fh, indent=1)
    return 1 if failed else 0


def _call_json(c: Call) -> dict:
    def dt(d):
        return str(d).replace("mlx.core.", "")

    def tv(v):
        return dt(v) if isinstance(v, mx.Dtype) else v

    return {"context": c.context, "grid": list(c.grid), "threadgroup": list(c.threadgroup),
            "inputs": [{"name": n, "shape": list(a.shape), "dtype": dt(a.dtype),
                        "size": a.size, "space": a.space}
                       for n, a in zip(c.input_names, c.inputs)],
            "outputs": [{"name": n, "shape": list(s), "dtype": dt(d)}
                        for n, s, d in zip(c.output_names, c.output_shapes, c.output_dtypes)],
            "template": [[k, tv(v)] for k, v in c.template],
            "atomic_outputs": c.atomic_outputs,
            "ensure_row_contiguous": c.ensure_row_contiguous, "init_value": c.init_value}


def _result_json(r: CheckResult) -> dict:
    inst = r.instantiation
    return {"name": inst.first.name, "kernel_name": inst.kernel_name, "ok": r.ok,
            "errors": r.errors, "warnings": r.warnings,
            "source_sha256": hashlib.sha256(inst.msl.encode()).hexdigest(),
            "calls": [_call_json(c) for c in inst.calls]}


if __name__ == "__main__":
    raise SystemExit(main())
