"""Tests of the MSL lint (mlx_lily.testing.msl_lint) and lint of every shaders/metal/*.metal body."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

import mlx.core as mx

from mlx_lily.testing import metal_emu
from mlx_lily.testing.msl_lint import lint_file, lint_metal_source, parse_body_file

pytestmark = pytest.mark.skipif(not metal_emu.available(), reason="no clang >= 15 (ziglang) for the MSL lint")

REPO = Path(__file__).resolve().parents[1]
BODIES = sorted((REPO / "shaders" / "metal").glob("*.metal"))


def codes(result):
    return sorted({(i.where, i.line, i.code) for i in result.issues})


GOOD = """
    uint i = thread_position_in_grid.x;
    threadgroup float buf[32];
    buf[thread_index_in_simdgroup] = static_cast<float>(x[i]);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float s = simd_sum(buf[thread_index_in_simdgroup]);
    float4 v = float4(s, 1.0f, float2(2.0f));
    out[i] = static_cast<T>(metal::precise::rsqrt(v.x + v.w) * scale + tile_sum(buf, 4));
"""

GOOD_HEADER = """
inline float tile_sum(threadgroup const float* p, int n) {
    float s = 0.0f;
    for (int k = 0; k < n; ++k) s += p[k];
    return s;
}
"""


def test_good_kernel_is_clean():
    r = lint_metal_source(
        GOOD, GOOD_HEADER, ["x", "scale"], ["out"], [("T", mx.bfloat16)],
        input_dtypes=["T", mx.float32], input_kinds=["array", "scalar"], output_dtypes=["T"],
    )
    assert r.ok, r.format()
    assert r.issues == []
    assert "const constant float& scale [[buffer(1)]]" in r.msl[0]


def test_mlx_lm_kernels_are_clean():
    from mlx_lm.kernels._common import BLOCK_SUM_HEADER
    import mlx_lm.models.gated_delta as gd
    import inspect

    src = inspect.getsource(gd._make_gated_delta_packed_kernel)
    body = src.split('source = r"""', 1)[1].split('"""', 1)[0]
    r = lint_metal_source(
        body, "", ["q", "k", "v", "g", "beta", "state_in", "T"], ["y", "state_out"],
        [("InT", mx.bfloat16), ("StT", mx.float32), ("Dk", 128), ("Dv", 128), ("Hk", 2), ("Hv", 4)],
        input_dtypes=["InT", "InT", "InT", None, None, "StT", mx.int32],
        input_kinds=["array"] * 6 + ["scalar"], output_dtypes=["InT", "StT"],
    )
    assert r.ok, r.format()
    blk = """
        threadgroup float buf[32];
        out[0] = block_sum<TG>(x[thread_position_in_grid.x], buf, thread_index_in_simdgroup, simdgroup_index_in_threadgroup);
    """
    r = lint_metal_source(blk, BLOCK_SUM_HEADER, ["x"], ["out"], [("TG", 256)])
    assert r.ok, r.format()


def test_address_space_mismatch_is_an_error():
    header = "inline void put(device float* p, float v) { p[0] = v; }\n"
    body = """
        threadgroup float buf[8];
        put(buf, 1.0f);
        out[0] = buf[0];
    """
    r = lint_metal_source(body, header, ["x"], ["out"])
    assert not r.ok
    assert ("source", 3, "clang") in codes(r), r.format()
    # a pointer to a thread-local variable is not a device pointer either
    r = lint_metal_source("float loc = 1.0f;\nput(&loc, 2.0f);\nout[0] = loc;", header, ["x"], ["out"])
    assert ("source", 2, "clang") in codes(r), r.format()
    # and constant inputs (< 8 elements) are not device memory
    r = lint_metal_source("put((device float*)0, x[0]);\nconst device float* p = x;\nout[0] = p[0];",
                          header, ["x"], ["out"], input_kinds=["small"])
    assert ("source", 2, "clang") in codes(r), r.format()
    r = lint_metal_source("const device float* p = x;\nout[0] = p[0];", header, ["x"], ["out"])
    assert r.ok, r.format()


def test_template_bodies_are_instantiated():
    body = "out[0] = x[0] * N + T(0);\nT* bad = x;\n"  # drops const: only seen when instantiated
    r = lint_metal_source(body, "", ["x"], ["out"], [("T", mx.float16), ("N", 2)],
                          input_dtypes=["T"], output_dtypes=["T"])
    assert ("source", 2, "clang") in codes(r), r.format()


@pytest.mark.parametrize(
    "snippet, expect",
    [
        ("double d = 1.0; out[0] = d;", "double"),
        ("long long n = 1; out[0] = n;", "long long"),
        ("float* p = new float[4]; out[0] = p[0];", "new"),
        ("float* p = 0; delete p; out[0] = 1.0f;", "delete"),
        ("if (x[0] > 0) goto done;\nout[0] = 1.0f;\ndone:\nout[1] = 2.0f;", "goto"),
        ("try { out[0] = 1.0f; } catch (...) {}", "exceptions"),
        ("out[0] = std::max(1.0f, x[0]);", "standard library"),
        ("float (*fp)(float) = nullptr; out[0] = 1.0f;", "function pointers"),
        ("thread_local float t = 0; out[0] = t;", "thread_local"),
    ],
)
def test_msl_restrictions(snippet, expect):
    r = lint_metal_source(snippet, "", ["x"], ["out"])
    assert not r.ok
    assert any(i.code == "msl-restriction" and expect in i.message for i in r.issues), r.format()


def test_header_restrictions_and_includes():
    header = "#include <metal_stdlib>\n#include \"mlx/backend/metal/kernels/utils.h\"\nstruct S { virtual float f(); };\n"
    r = lint_metal_source("out[0] = 1.0f;", header, ["x"], ["out"])
    msgs = {(i.where, i.line, i.message.split(":")[0]) for i in r.issues if i.code == "msl-restriction"}
    assert ("header", 2, '#include <mlx/backend/metal/kernels/utils.h>') in msgs, r.format()
    assert any(i.where == "header" and i.line == 3 and "virtual" in i.message for i in r.issues)
    assert not any(i.where == "header" and i.line == 1 for i in r.issues)  # <metal_stdlib> is fine


def test_threadgroup_memory_over_32k_is_an_error():
    body = "threadgroup float a[N];\nthreadgroup half b[1024];\na[0] = x[0]; b[0] = 1.0h;\nout[0] = a[0] + b[0];"
    r = lint_metal_source(body, "", ["x"], ["out"], [("N", 7680)])
    assert r.ok, r.format()  # 30720 + 2048 = 32768 bytes
    r = lint_metal_source(body, "", ["x"], ["out"], [("N", 7681)])
    assert any(i.code == "threadgroup-memory" for i in r.issues), r.format()


def test_body_file_convention(tmp_path):
    (tmp_path / "common.h").write_text("inline float thrice(float v) { return 3.0f * v; }\n")
    (tmp_path / "scale_add.metal").write_text(textwrap.dedent("""\
        // @kernel scale_add
        // @inputs x[N]:T, y[N] T, alpha[1]:float32 (alpha is a 1-element array)
        // @outputs out[N]
        // @template T=float32
        // @template T=bfloat16
        // @header common.h
        template <typename T> inline T twice(T v) { return v + v; }
        // ---- body ----
          uint i = thread_position_in_grid.x;
          out[i] = static_cast<T>(alpha[0] * static_cast<float>(x[i]) + thrice(twice(y[i])));
        """))
    spec = parse_body_file(tmp_path / "scale_add.metal")
    assert spec.name == "scale_add" and spec.input_names == ["x", "y", "alpha"]
    assert spec.inputs == [("x", "T", "array"), ("y", "T", "array"), ("alpha", "float32", "small")]
    assert spec.outputs == [("out", "T")]
    assert spec.templates == [[("T", mx.float32)], [("T", mx.bfloat16)]]
    assert spec.body.lstrip().startswith("uint i") and "twice" in spec.header and "thrice" in spec.header
    r = lint_file(tmp_path / "scale_add.metal")
    assert r.ok, r.format()
    assert len(r.msl) == 2 and "const constant float* alpha" in r.msl[0]
    # the same spec runs under the emulator
    k = spec.kernel(metal_emu.metal_kernel)
    x = mx.arange(8, dtype=mx.float32)
    out = k(inputs=[x, x, mx.array([2.0])], output_shapes=[(8,)], output_dtypes=[mx.float32],
            grid=(8, 1, 1), threadgroup=(8, 1, 1), template=spec.templates[0])[0]
    assert mx.array_equal(out, 8 * x).item()
    # issues point at the file line
    (tmp_path / "broken.metal").write_text("// @inputs x\n// @outputs out\n// ---- body ----\nout[0] = x[0];\nout[1] = nope;\n")
    r = lint_file(tmp_path / "broken.metal")
    assert not r.ok
    issue = r.issues[0]
    assert (issue.where, issue.line, issue.file_line) == ("source", 3, 5), r.format()
    assert f"broken.metal:5:" in str(issue)


@pytest.mark.skipif(not BODIES, reason="no shaders/metal/*.metal kernel bodies yet")
@pytest.mark.parametrize("path", BODIES, ids=[p.name for p in BODIES])
def test_shader_bodies_lint_clean(path):
    r = lint_file(path)
    assert r.ok, r.format()
