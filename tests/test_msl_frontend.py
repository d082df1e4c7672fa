"""The Metal front-end check (``mlx_lily.testing.msl_frontend``): every ``metal_kernel``
instantiation a production-width forward makes, rendered as MLX renders it from the
arrays passed and compiled with Metal's address spaces kept apart, must compile; a planted
``constant``-vs-``device`` mistake must not."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_lily import kernels
from mlx_lily.ops import gated_delta as G
from mlx_lily.testing import msl_frontend as F

from mlx_lily.testing.metal_emu import CompilerUnavailable, _build

try:
    _build.compiler_version()
    HAS_CLANG = True
except CompilerUnavailable:  # pragma: no cover - no clang >= 15 (ziglang) here
    HAS_CLANG = False

pytestmark = pytest.mark.skipif(not HAS_CLANG, reason="clang (ziglang) unavailable")

# A helper that takes its buffer as `const device float*` (as qgemv_common.h's GEMV helper
# did when this check found gdn_decode's bug).
HELPER = """
inline float first_of(const device float* p) { return p[0]; }
"""
BODY = """
uint i = thread_position_in_grid.x;
if (USE) {
  out[i] = first_of(x) + x[i];
} else {
  out[i] = 0.0f;
}
"""


def _planted_calls(n_elements: int) -> list:
    k = F.RecordingKernel(name="planted", input_names=["x"], output_names=["out"],
                          source=BODY, header=HELPER)
    with F.recording() as rec:
        k(inputs=[mx.zeros((n_elements,))], output_shapes=[(n_elements,)],
          output_dtypes=[mx.float32], grid=(n_elements, 1, 1), threadgroup=(32, 1, 1),
          template=[("USE", False)])
    return rec


def test_planted_constant_input_to_device_helper_fails():
    """A 4-element input is `const constant float*` in MLX's signature: handing it to a
    `const device float*` helper fails, even in a branch the template switches off;
    with 8 elements (`device`) the same kernel passes."""
    (bad,) = F.instantiations(_planted_calls(4))
    assert "const constant float* x [[buffer(0)]]" in bad.msl
    r = F.check_instantiation(bad, use_cache=False)
    assert not r.ok
    assert "no matching function for call to 'first_of'" in r.errors[0]
    (good,) = F.instantiations(_planted_calls(8))
    assert "const device float* x [[buffer(0)]]" in good.msl
    assert F.check_instantiation(good, use_cache=False).ok


def test_render_follows_the_arrays_passed():
    """0-d input: `const constant T&`; < 8 elements: `constant T*`; MLX's name (its
    template hash keeps the leading `_` of `<`: `r__3`) and the template line."""
    k = F.RecordingKernel(name="r", input_names=["s", "c", "d"], output_names=["o"],
                          source="o[0] = s + c[0] + d[0] + float(d_shape[0]);")
    with F.recording() as rec:
        k(inputs=[mx.array(1.0), mx.zeros((7,)), mx.zeros((2, 4))], output_shapes=[(1,)],
          output_dtypes=[mx.float32], grid=(1, 1, 1), threadgroup=(1, 1, 1),
          template=[("N", 3)])
    (c,) = rec
    assert [a.space for a in c.inputs] == ["constant", "constant", "device"]
    kname, msl = c.render()
    assert kname == "custom_kernel_r__3_floats_floatc_float_float"
    assert "const constant float& s [[buffer(0)]]" in msl
    assert "const constant float* c [[buffer(1)]]" in msl
    assert "const device float* d [[buffer(2)]]" in msl
    assert "const constant int* d_shape [[buffer(3)]]" in msl
    assert f'template [[host_name("{kname}")]] [[kernel]] decltype({kname}<3>) {kname}<3>;' in msl
    assert F.check_instantiation(F.instantiations(rec)[0], use_cache=False).ok


def _gdn_decode(get_kernel, dtype=mx.bfloat16):
    """One unpacked GDN decode step (no PROJ) through the op."""
    Hk, Hv, D, KS, B = 2, 4, 128, 4, 1
    C = 2 * Hk * D + Hv * D
    t = dtype
    return G.gated_delta_fused(
        mx.zeros((B, 1, C), t), mx.zeros((B, 1, Hv, D), t), mx.zeros((B, 1, Hv), t),
        mx.zeros((B, 1, Hv), t), mx.zeros((C, KS, 1), t), mx.zeros((B, KS - 1, C), t),
        mx.zeros((Hv,), mx.float32), mx.zeros((Hv,), t),
        mx.zeros((B, Hv, D, D), mx.float32), mx.zeros((D,), t),
        num_k_heads=Hk, head_k_dim=D, num_v_heads=Hv, head_v_dim=D, eps=1e-6,
        get_kernel=get_kernel)


def _gdn_decode_calls(dtype=mx.bfloat16):
    with F.recording() as rec:
        _gdn_decode(lambda spec: kernels.build(spec, "metal"), dtype)
    return rec


# qgemv_common.h's GEMV helper as it was when this check found the bug: w, scales and
# biases typed `const device`
_OLD_GATHER = ("inline void lily_qgemv_gather(XP xr, const device uint32_t* w, "
               "const device S* scales, const device S* biases, thread const int* rows, "
               "int sl, thread float* acc) {\n")


def _with_old_gather(call):
    import dataclasses
    import re

    # the header as MLX gets it: comments and blanks squeezed (kernels.metal_parts)
    head, n = re.subn(r"inline void lily_qgemv_gather\(XP xr,\s*WP w,\s*SP scales,\s*SP biases,"
                      r"[^{]*\{\n", _OLD_GATHER, call.header)
    assert n == 1
    head, n = re.subn(r"typename XP,\s*typename WP,\s*typename SP>\s*"
                      r"inline void lily_qgemv_gather",
                      "typename XP>\ninline void lily_qgemv_gather", head)
    assert n == 1
    head, n = re.subn(r"typedef typename lily_word_ptr<WP,\s*BPL>::type W4P;\s*"
                      r"W4P w4\s*=\s*reinterpret_cast<W4P>\(w\);",
                      "const device uint4* w4 = reinterpret_cast<const device uint4*>(w);", head)
    assert n == 1
    return dataclasses.replace(call, header=head)


def test_gdn_decode_old_helper_with_a_four_element_stand_in_fails(monkeypatch):
    """The bug this check found, on a copy of the real kernel: gdn_decode without PROJ
    passed its unread 4-element stand-in `w` (MLX: `constant`) to the device-only
    `lily_qgemv_gather`, inside a plain `if (PROJ)`. Either fix alone makes it compile:
    the stand-in's 8 elements (`device`) or today's address-space generic helper."""
    monkeypatch.setattr(G, "_DUMMY", {})
    monkeypatch.setattr(kernels, "DEVICE_MIN_ELEMS", 4)
    (call,) = _gdn_decode_calls()
    assert [a for n, a in zip(call.input_names, call.inputs) if n == "w"][0].space == "constant"
    (bad,) = F.instantiations([_with_old_gather(call)])
    r = F.check_instantiation(bad, use_cache=False)
    assert not r.ok and "no matching function for call to 'lily_qgemv_gather'" in r.errors[0]
    (generic,) = F.instantiations([call])  # today's helper takes the constant stand-in
    assert F.check_instantiation(generic, use_cache=False).ok
    monkeypatch.setattr(G, "_DUMMY", {})
    monkeypatch.undo()
    (call,) = _gdn_decode_calls()
    assert [a for n, a in zip(call.input_names, call.inputs) if n == "w"][0].space == "device"
    (good,) = F.instantiations([_with_old_gather(call)])  # today's stand-in: device
    r = F.check_instantiation(good, use_cache=False)
    assert r.ok, r.errors
    assert not r.warnings, r.warnings  # no out-of-range constant index into ps / xs


def test_gdn_decode_fp32_with_four_element_stand_ins_fails(monkeypatch):
    """fp32 activations: a 4-element stand-in of T (16 bytes) is `constant` and reaches
    `lily_gdn_pending_norm(const device T* hin, ...)`; the check and the emulator both
    reject it; with today's 8-element stand-ins both accept it."""
    monkeypatch.setattr(G, "_DUMMY", {})
    monkeypatch.setattr(kernels, "DEVICE_MIN_ELEMS", 4)
    (bad,) = F.instantiations(_gdn_decode_calls(mx.float32))
    r = F.check_instantiation(bad, use_cache=False)
    assert not r.ok and "lily_gdn_pending_norm" in r.errors[0]
    from mlx_lily.testing import metal_emu

    if metal_emu.available():  # the emulator keeps address spaces too: it fails the same way
        with pytest.raises(metal_emu.MetalEmuCompileError, match="lily_gdn_pending_norm"):
            _gdn_decode(lambda s: kernels.build(s, "metal", factory=metal_emu.metal_kernel),
                        mx.float32)
    monkeypatch.setattr(G, "_DUMMY", {})
    monkeypatch.undo()
    (good,) = F.instantiations(_gdn_decode_calls(mx.float32))
    r = F.check_instantiation(good, use_cache=False)
    assert r.ok, r.errors


def test_attn_prefill_without_gate_passes():
    from mlx_lily.ops import attention as A

    bf = mx.bfloat16
    with F.recording() as rec:
        A.prefill_attention(mx.zeros((1, 16, 8, 256), bf), mx.zeros((1, 2, 8, 256), bf),
                            mx.zeros((1, 2, 8, 256), bf), 0.0625, gate=None, backend="metal")
    (inst,) = F.instantiations(rec)
    assert dict(inst.first.template)["GATED"] is False
    r = F.check_instantiation(inst)
    assert r.ok, r.errors


def test_threadgroup_size_over_the_limit_fails():
    k = F.RecordingKernel(name="big", input_names=["x"], output_names=["o"],
                          source="o[thread_position_in_grid.x] = x[0];")
    with F.recording() as rec:
        k(inputs=[mx.zeros((8,))], output_shapes=[(2048,)], output_dtypes=[mx.float32],
          grid=(2048, 1, 1), threadgroup=(2048, 1, 1))
    r = F.check_instantiation(F.instantiations(rec)[0], use_cache=False)
    assert not r.ok and "2048 threads" in r.errors[0]


@pytest.fixture(scope="module")
def production_calls():
    return {fam: F.record_model(fam) for fam in F.FAMILIES}


def test_production_forwards_record_every_kernel(production_calls):
    names = {c.name for calls in production_calls.values() for c in calls}
    assert {"lily_gdn_prep", "lily_gdn_scan", "lily_gdn_norm", "lily_gdn_decode",
            "lily_attn_prefill", "lily_attn_qk_norm_rope", "lily_attn_decode_partial",
            "lily_attn_decode_combine", "lily_add_rms_norm", "lily_qgemv", "lily_norm_qgemv",
            "lily_moe_router_topk", "lily_moe_gate_up", "lily_moe_down", "moeg_gate_up",
            "moeg_down", "moeg_combine"} <= names
    moe = production_calls["qwen3_5_moe"]
    contexts = {c.context.split("@")[0] for c in moe}
    assert {"prefill-8", "prefill-2048", "decode-whole", "decode-per-layer",
            "decode-eager", "prefill-2x8", "decode-eager-2x"} <= contexts
    # the production widths reached the kernels
    dec = [c for c in moe if c.name == "lily_moe_router_topk"]
    assert any(dict(c.template).get("E") == 256 and dict(c.template).get("D") == 2048
               for c in dec)


def test_every_production_instantiation_compiles(production_calls):
    """The check itself: every recorded instantiation of the three families compiles as
    MLX renders it (the count is printed; `-s` shows it)."""
    calls = [c for fam in production_calls.values() for c in fam]
    insts = F.instantiations(calls)
    results = F.check_all(insts)
    failed = [(r.instantiation.describe(), r.errors[0]) for r in results if not r.ok]
    print(f"\nMetal front-end check: {len(insts)} instantiations, {len(insts) - len(failed)} "
          f"passed, {len(failed)} failed")
    assert len(insts) >= 50
    assert not failed, failed


def test_header_redefining_a_preamble_name_fails():
    """MLX puts its utils.h in front of every custom kernel: a header that defines one of
    its global names (`Limits`, `ceildiv`, a macro) would not build on a Mac."""
    if not F.preamble_names():
        pytest.skip("this MLX build ships no Metal kernel headers")
    assert {"Limits", "ceildiv", "elem_to_loc", "MTL_CONST"} <= F.preamble_names()
    k = F.RecordingKernel(name="clash", input_names=["x"], output_names=["o"],
                          source="o[0] = lily_twice(x[0]);",
                          header="inline float lily_twice(float v) { return 2.0f * v; }\n"
                                 "template <typename T> inline T ceildiv(T a, T b) {\n"
                                 "  return (a + b - 1) / b;\n}\n")
    with F.recording() as rec:
        k(inputs=[mx.zeros((8,))], output_shapes=[(1,)], output_dtypes=[mx.float32],
          grid=(1, 1, 1), threadgroup=(1, 1, 1))
    r = F.check_instantiation(F.instantiations(rec)[0], use_cache=False)
    assert not r.ok and "'ceildiv'" in r.errors[0] and "lily_twice" not in " ".join(r.errors)


def test_command_reports_counts_and_first_errors(monkeypatch, capsys, tmp_path):
    """`python -m mlx_lily.testing.msl_frontend`: counts per family and in all, then each
    failure with its first compiler error; exit status 1; `--json` keeps the calls."""
    import json

    planted = {"qwen3_5_moe": _planted_calls(4) + _planted_calls(8)}
    monkeypatch.setattr(F, "record_model", lambda fam, layers=4: planted[fam])
    out = tmp_path / "r.json"
    rc = F.main(["--family", "qwen3_5_moe", "--json", str(out), "--no-cache"])
    text = capsys.readouterr().out
    assert rc == 1
    assert "qwen3_5_moe: 2 metal_kernel calls, 2 instantiations" in text
    assert "instantiations recorded: 2" in text and "passed: 1" in text and "failed: 1" in text
    assert "FAIL planted<USE=0>(x=float32[4](constant*))" in text
    assert "first error: source:" in text and "first_of" in text
    data = json.loads(out.read_text())
    assert [d["ok"] for d in data] == [False, True]
    assert data[0]["calls"][0]["inputs"][0] == {"name": "x", "shape": [4], "dtype": "float32",
                                                "size": 4, "space": "constant"}
