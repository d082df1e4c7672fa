"""CUDA kernel sources handed to MLX as ``#include`` lines (``kernels.cuda_include_parts``):
the lines expand to the kernel's texts, MLX generates the same kernel signature from
them, the files are content-addressed, and an unwritable folder or the ``inline`` knob
hands MLX the texts themselves."""

from __future__ import annotations

import importlib
import pkgutil
import re
import warnings
from pathlib import Path

import mlx.core as mx
import pytest

from mlx_lily import cuda_cache, kernels
from mlx_lily import ops as _ops

_INCLUDE = re.compile(r'^#include "(/[^"]+)"\n', re.M)


def _all_cuda_specs():
    """Every ``KernelSpec`` defined in ``mlx_lily.ops`` whose CUDA source exists."""
    specs = {}
    for m in pkgutil.iter_modules(_ops.__path__):
        mod = importlib.import_module(f"mlx_lily.ops.{m.name}")
        for v in vars(mod).values():
            if isinstance(v, kernels.KernelSpec):
                try:
                    kernels.shader_path("cuda", v.stem + ".cu")
                except FileNotFoundError:
                    continue
                specs[v.name] = v
    return sorted(specs.values(), key=lambda s: s.name)


SPECS = _all_cuda_specs()


def _expand(text: str) -> str:
    """What a preprocessor reads for ``text``: each absolute ``#include`` line replaced by
    its file, comment lines gone."""
    out = _INCLUDE.sub(lambda m: Path(m.group(1)).read_text(), text)
    return re.sub(r"^// [\w ]+\n", "", out, flags=re.M)


def _launch(spec, header, body):
    return cuda_cache.Launch(spec.name, header, body, tuple(spec.inputs),
                             tuple((mx.bfloat16, 2) for _ in spec.inputs),
                             tuple(spec.outputs), tuple(mx.float32 for _ in spec.outputs),
                             (("T", mx.bfloat16), ("D", 64)))


@pytest.fixture
def fresh_parts(monkeypatch, tmp_path):
    """``cuda_launch_parts`` with an empty per-process cache, files under tmp_path."""
    monkeypatch.setattr(kernels, "_LAUNCH_PARTS", {})
    monkeypatch.setattr(kernels, "_INCLUDE_WARNED", [])
    monkeypatch.setenv("MLX_LILY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("MLX_LILY_CUDA_SOURCE", raising=False)
    return tmp_path


def test_specs_found():
    names = {s.name for s in SPECS}
    assert {"lily_moe_decode", "lily_gdn_decode", "lily_qgemv"} <= names, names


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_include_lines_expand_to_the_texts(spec, tmp_path):
    head, body = kernels.cuda_include_parts(spec, tmp_path)
    where = str(tmp_path.resolve())
    assert len((head + body).replace(where, "")) < 400, (head, body)
    assert _INCLUDE.match(body), body
    want_head, want_body = kernels.cuda_parts(spec.stem)
    assert _expand(head) == want_head
    assert _expand(body) == want_body


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_generated_signature_is_the_same(spec, tmp_path):
    """MLX picks the ``<input>_shape`` / ``_strides`` / ``_ndim`` arguments it passes from
    the body string: the include form must name the same ones."""
    inc = cuda_cache.render(_launch(spec, *kernels.cuda_include_parts(spec, tmp_path)))
    inl = cuda_cache.render(_launch(spec, *kernels.cuda_parts(spec.stem)))
    sig = lambda src: src[src.index("__global__ void"):src.index(") {\n")]  # noqa: E731
    assert sig(inc) == sig(inl)


def test_a_kernel_that_reads_shapes_keeps_them(tmp_path):
    spec = kernels.KernelSpec("lily_probe", "add_rms_norm", ("x", "r", "w", "eps"), ("y",))
    body = "int n = x_shape[0] + r_ndim; y[0] = n;\n"
    orig = kernels.cuda_parts
    try:
        kernels.cuda_parts = lambda stem: ("", body)
        head, inc = kernels.cuda_include_parts(spec, tmp_path)
    finally:
        kernels.cuda_parts = orig
    assert head == ""
    assert "x_shape" in inc and "r_ndim" in inc and "w_shape" not in inc
    sig = cuda_cache.render(_launch(spec, head, inc))
    assert "Shape x_shape" in sig and "int r_ndim" in sig and "x_strides" not in sig


def test_files_are_named_by_their_text_and_mended(tmp_path):
    spec = next(s for s in SPECS if s.name == "lily_qgemv")
    _, body = kernels.cuda_include_parts(spec, tmp_path)
    path = Path(_INCLUDE.match(body).group(1))
    assert path.parent.parent == tmp_path.resolve()
    assert path.parent.name.startswith("qgemv-")
    path.write_text("garbage")  # a damaged copy is written again, to the same name
    _, again = kernels.cuda_include_parts(spec, tmp_path)
    assert again == body and path.read_text() == kernels.cuda_parts("qgemv")[1]
    other = next(s for s in SPECS if s.name == "lily_add_rms_norm")
    _, body2 = kernels.cuda_include_parts(other, tmp_path)
    assert Path(_INCLUDE.match(body2).group(1)).parent != path.parent


def test_default_is_include_under_the_cache_dir(fresh_parts):
    spec = SPECS[0]
    head, body = kernels.cuda_launch_parts(spec)
    assert str((fresh_parts / "cache" / "cuda-src").resolve()) in body


def test_a_new_instantiation_restores_deleted_files(fresh_parts):
    """A cache folder cleaned while a process runs: the next launch of a new template
    (which MLX may compile) writes the files again before it launches."""
    import shutil

    spec = next(s for s in SPECS if s.name == "lily_add_rms_norm")
    calls = []
    k = kernels.RecordedCudaKernel(lambda **kw: calls.append(kw), spec)
    paths = [Path(m.group(1)) for m in _INCLUDE.finditer(k.header + k.body)]
    assert len(paths) == 2 and all(p.is_file() for p in paths)
    k(template=[("D", 64)], output_dtypes=[mx.float32])
    shutil.rmtree(paths[0].parent)
    k(template=[("D", 64)], output_dtypes=[mx.float32])  # seen: nothing to compile
    assert not paths[0].parent.exists()
    k(template=[("D", 128)], output_dtypes=[mx.float32])
    assert [p.read_text() for p in paths] == list(kernels.cuda_parts(spec.stem))
    assert len(calls) == 3


def test_a_missing_shader_raises_and_does_not_warn(fresh_parts):
    spec = kernels.KernelSpec("lily_nothing", "no_such_stem", ("x",), ("y",))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with pytest.raises(FileNotFoundError):
            kernels.cuda_launch_parts(spec)
    assert not [x for x in w if "mlx-lily" in str(x.message)], [str(x.message) for x in w]


def test_inline_knob_hands_mlx_the_texts(fresh_parts, monkeypatch):
    monkeypatch.setenv("MLX_LILY_CUDA_SOURCE", "inline")
    spec = SPECS[0]
    assert kernels.cuda_launch_parts(spec) == kernels.cuda_parts(spec.stem)
    assert not (fresh_parts / "cache" / "cuda-src").exists()


def test_unwritable_folder_falls_back_to_texts_with_one_warning(fresh_parts, monkeypatch):
    blocker = fresh_parts / "cache" / "cuda-src"  # a file where the folder would be
    blocker.parent.mkdir()
    blocker.write_text("not a folder")
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        for spec in SPECS[:3]:
            assert kernels.cuda_launch_parts(spec) == kernels.cuda_parts(spec.stem)
    msgs = [str(w.message) for w in got if "cuda-src" in str(w.message)]
    assert len(msgs) == 1 and "full texts" in msgs[0]


def test_a_folder_an_include_line_cannot_hold_is_refused(tmp_path):
    for odd in ('we"ird', "back\\slash", "caf\u00e9"):
        with pytest.raises(OSError, match="#include"):
            kernels.cuda_include_parts(SPECS[0], tmp_path / odd)
    head, body = kernels.cuda_include_parts(SPECS[0], tmp_path / "a b@c,d~e")
    assert "a b@c,d~e" in body


def test_a_folder_naming_an_argument_is_refused(tmp_path):
    """MLX passes ``x_shape`` when the body string holds it, include path included."""
    spec = next(s for s in SPECS if s.name == "lily_add_rms_norm")  # inputs x, r, w, eps
    with pytest.raises(OSError, match="x_shape"):
        kernels.cuda_include_parts(spec, tmp_path / "max_shape_cache")


@pytest.mark.gpu
@pytest.mark.skipif(not (hasattr(mx, "cuda") and mx.cuda.is_available()), reason="no CUDA")
def test_gpu_include_and_inline_kernels_agree_bitwise(tmp_path):
    from mlx_lily.ops import add_rms_norm as arn

    spec = arn.SPEC
    rows, d = 3, 2048
    x = mx.random.normal((rows, d)).astype(mx.bfloat16)
    r = mx.random.normal((rows, d)).astype(mx.bfloat16)
    w = mx.random.normal((d,)).astype(mx.bfloat16)
    outs = []
    for head, body in (kernels.cuda_include_parts(spec, tmp_path), kernels.cuda_parts(spec.stem)):
        k = mx.fast.cuda_kernel(name=spec.name, input_names=list(spec.inputs),
                                output_names=list(spec.outputs), source=body, header=head)
        outs.append(arn.add_rms_norm_fused(x, r, w, 1e-6, kernel=k, init_value=float("nan")))
    mx.eval(outs)
    for a, b in zip(*outs):
        assert mx.array_equal(a, b).item()
    h, n = arn.add_rms_norm_reference(x, r, w, 1e-6)
    assert mx.array_equal(outs[0][0], h).item()
    assert mx.allclose(outs[0][1].astype(mx.float32), n.astype(mx.float32), atol=0.05).item()


# ------------------------------------------------------------------- Metal: stripped texts
_TOKEN = re.compile(r'"(?:\\.|[^"\\\n])*"|[A-Za-z_]\w*|\d[\w.]*(?:[eEpP][+-]\d+)?'
                    r"|->|\+\+|--|<<=|>>=|<<|>>|<=|>=|==|!=|&&|\|\||[-+*/%&|^]=|::|\S")


def _tokens(text: str) -> list:
    """C tokens of ``text`` without comments (a small tokenizer of its own, so the check
    does not lean on the code it checks); preprocessor lines keep their line ends."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    out = []
    for line in text.splitlines():
        toks = _TOKEN.findall(line)
        if toks:
            out += toks + (["<eol>"] if line.lstrip().startswith("#") else [])
    return out


METAL_STEMS = sorted(p.stem for p in kernels.shader_path("metal", "qgemv.metal").parent.glob(
    "*.metal"))


@pytest.mark.parametrize("stem", METAL_STEMS)
def test_metal_texts_keep_their_tokens(stem):
    """``metal_parts`` drops comments and blanks only: the same tokens in the same order,
    and the same names MLX scans the body for (attributes, ``<input>_shape``)."""
    head, body = kernels.split_header(kernels.shader_source("metal", stem + ".metal"))
    got_head, got_body = kernels.metal_parts(stem)
    assert _tokens(got_head) == _tokens(head)
    assert _tokens(got_body) == _tokens(body)
    assert len(got_head) + len(got_body) < len(head) + len(body)
    names = lambda t: set(re.findall(r"[A-Za-z_]\w*", re.sub(r"//[^\n]*", "", t)))  # noqa: E731
    assert names(got_body) == names(re.sub(r"/\*.*?\*/", " ", body, flags=re.S))
