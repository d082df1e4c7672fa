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
    assert len(head) + len(body) < 600, (head, body)
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
    assert kernels.cuda_launch_parts(spec) is kernels._LAUNCH_PARTS[spec]


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
    odd = tmp_path / 'we"ird'
    with pytest.raises(OSError, match="#include"):
        kernels.cuda_include_parts(SPECS[0], odd)


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
