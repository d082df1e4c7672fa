"""Per-device qualification (``mlx_lily.qualify``) and stepping aside (``mlx_lily.patch``):
the pass/fail and speed rules, the record (atomic, identity-checked, invalidated by a
kernel source edit), the shipped record's device match, the child process's time limit
(an injected hang), injected failures under the Metal emulator, and ``patch()`` leaving
mlx-lm's own code in place where no kernel would run."""

from __future__ import annotations

import contextlib
import json
from collections import Counter
import os
import shutil
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import _models
import mlx_lily
from mlx_lily import backend, first_contact, kernels, patching, qualify
from mlx_lily.testing.dispatch import emulated_metal

try:
    from mlx_lily.testing.metal_emu import available as _emu_available

    HAS_EMU = bool(_emu_available())
except Exception:  # pragma: no cover - emulator toolchain missing
    HAS_EMU = False

needs_emu = pytest.mark.skipif(not HAS_EMU, reason="Metal emulator unavailable")
FIXTURE = Path(__file__).parent / "fixtures" / "qwen35moe-tiny-trained"
LIGHT_OPS = "add_rms_norm,moe_router_topk"
FAST = ["--ops", LIGHT_OPS, "--decode-steps", "1", "--decode-rounds", "2",
        "--decode-context", "4", "--prefill-len", "8", "--prefill-reps", "1",
        "--parity-prefill", "0"]
#: The paired timing's smallest useful run: one decode step per round, two rounds, one
#: prefill round (tests whose timings are not stubbed).
QUICK = dict(decode_steps=1, decode_rounds=2, prefill_reps=1, method=qualify.GREEDY)


@pytest.fixture
def fake_device(monkeypatch, tmp_path):
    """This machine poses as a Metal GPU named "Apple M9 Test" with its kernel sources in
    a copy under ``tmp_path`` and the cache folder in ``tmp_path``."""
    src = tmp_path / "metal"
    shutil.copytree(qualify.shader_dir("metal"), src)
    monkeypatch.setattr(qualify, "shader_dir", lambda be: src)
    monkeypatch.setattr(kernels, "_real_backend", lambda: "metal")
    monkeypatch.setattr(kernels, "device_name", lambda: "Apple M9 Test")
    monkeypatch.setenv("MLX_LILY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(qualify.QUALIFY_ENV, raising=False)
    kernels.forget_record()
    yield src
    kernels.forget_record()


def test_faster_rule():
    assert qualify.faster({"decode": 9.0, "prefill": 10.0}, {"decode": 10.0, "prefill": 10.0})[0]
    # a gain in one phase does not excuse a loss beyond the noise in the other
    assert not qualify.faster({"decode": 9.0, "prefill": 10.5}, {"decode": 10.0, "prefill": 10.0})[0]
    assert not qualify.faster({"decode": 9.95, "prefill": 10.0}, {"decode": 10.0, "prefill": 10.0})[0]
    ok, speed = qualify.faster({"decode": 5.0, "prefill": 10.1}, {"decode": 10.0, "prefill": 10.0})
    assert ok and speed["decode"] == 2.0


def test_faster_rule_allows_a_loss_inside_the_timings_noise():
    """The H200 row that motivated the allowance (warm qualification, 4 layers at
    Qwen3.6-35B-A3B widths): gated_delta decode 2.203 ms vs 2.136 ms, prefill 30.47 ms vs
    142.69 ms. A 3 % decode loss from paired rounds whose ratios spread widely is noise;
    the same loss from steady rounds is not."""
    kernel = {"decode": 2.203, "prefill": 30.47}
    base = {"decode": 2.136, "prefill": 142.69}
    assert not qualify.faster(kernel, base)[0]  # SLOWER_TOL alone
    # six rounds whose base / kernel ratios scatter around 0.97
    scatter = [1.0, 1.0, 1.3, 0.75, 1.3, 0.75]
    sp, se = qualify.ratio_stats([2.136] * 6, [2.203 * f for f in scatter])
    assert abs(sp - 2.136 / 2.203) < 1e-9 and qualify.NOISE_SIGMAS * se > 0.031
    noise = {"decode": se, "prefill": 0.0}
    assert qualify.faster(kernel, base, noise)[0]
    sp, se = qualify.ratio_stats([2.136] * 6, [2.203] * 6)
    steady = {"decode": se}
    assert se == 0.0 and qualify.allowance(steady, "decode") == qualify.SLOWER_TOL
    assert not qualify.faster(kernel, base, steady)[0]
    # a loss far outside the noise still fails, whatever the other phase gains
    assert not qualify.faster({"decode": 3.0, "prefill": 30.47}, base, noise)[0]
    # however noisy the timings, a phase may lose MAX_ALLOWANCE at most
    wild = {"decode": 1.0, "prefill": 1.0}
    assert qualify.allowance(wild, "decode") == qualify.MAX_ALLOWANCE
    assert not qualify.faster({"decode": 2.136 / 0.93, "prefill": 30.47}, base, wild)[0]
    # a small gain does not excuse a bigger loss inside the allowance: the product counts
    assert not qualify.faster({"decode": 2.136 / 0.96, "prefill": 142.69 / 1.02}, base, wild)[0]
    assert qualify.allowance({"decode": float("nan")}, "decode") == qualify.SLOWER_TOL


def test_median_standard_error():
    # sigma = IQR / 1.349; se = 1.2533 sigma / sqrt(n)
    assert abs(qualify.median_rel_se(0.1349, 16) - 1.2533 * 0.1 / 4) < 1e-12
    # three samples: range / d2(3)
    assert abs(qualify.median_rel_se(0.1693, 3) - 1.2533 * 0.1 / 3 ** 0.5) < 1e-12
    assert qualify.median_rel_se(0.2, 1) == 0.0
    assert qualify.median_rel_se(0.0, 16) == 0.0


def test_paired_rounds_cancel_a_drift():
    """Arms timed in alternation (A B, B A, ...) keep their ratio when the machine slows
    down measurement by measurement (10 % each): the median per-round ratio stays within
    a few percent of the true 2x, where timing all of A, then all of B, would read about
    2 / 1.1^4 = 1.37x."""
    order = []
    clock = iter(range(100))

    def arm(name):
        return lambda: contextlib.nullcontext(order.append(name))

    def measure(i):  # the machine slows 10 % per measurement; arm 1 does half the work
        return (1.0 if i == 0 else 0.5) * 1.1 ** next(clock)

    base, kern = qualify.paired_rounds([arm("a"), arm("b")], measure, 4)
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a"]
    sp, se = qualify.ratio_stats(base, kern)
    assert 1.95 < sp < 2.05 and se < 0.1
    assert qualify.ratio_stats([], []) == (None, 0.0)


def test_decide_takes_fastest_passing_variant():
    res = {"a": {"default": {"passed": True, "faster": True, "speedup": {"decode": 1.1}},
                 "wide": {"passed": True, "faster": True, "speedup": {"decode": 1.3}},
                 "broken": {"passed": False, "faster": True, "speedup": {"decode": 2.0}}},
           "b": {"default": {"passed": True, "faster": False, "speedup": {"decode": 0.9}}},
           "c": {"default": {"passed": False, "faster": False, "speedup": None}}}
    assert qualify.decide(res) == {"a": "wide"}


def test_parity_rule():
    good = {"ok": True, "rel": 0.05}
    chaotic = {"ok": True, "rel": 0.4}
    assert qualify.parity_ok(good)
    assert not qualify.parity_ok({"ok": False, "rel": 0.0})
    assert not qualify.parity_ok(chaotic)  # no anchor: fixed tolerance only
    assert qualify.parity_ok(chaotic, 0.36, 0.35, 0.55, 0.56)  # as far from fp32 as the reference
    assert not qualify.parity_ok(chaotic, 0.9, 0.35, 0.55, 0.56)


def _record(qualified):
    return {"schema": qualify.SCHEMA, "schema_version": qualify.SCHEMA_VERSION, "status": "ok",
            "identity": qualify.identity("metal"), "qualified": qualified,
            "ops": {op: {"default": {"passed": True, "faster": True}} for op in qualified}}


def test_record_applies_until_a_kernel_source_changes(fake_device, monkeypatch):
    assert qualify.record_status("metal") == "none"
    assert kernels.verified_ops("metal") == frozenset()  # no shipped record for Metal
    path = qualify.write_record(_record({"qgemv": "default"}), qualify.record_path("metal"))
    assert path.name == "metal-apple-m9-test.json" and json.loads(path.read_text())
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left
    kernels.forget_record()
    assert qualify.record_status("metal") == "valid"
    monkeypatch.setenv("MLX_LILY_KERNELS", "verified")
    assert kernels.kernels_allowed("qgemv", "metal")
    assert not kernels.kernels_allowed("attention", "metal")
    # an edited kernel source: the record no longer applies
    f = fake_device / "qgemv.metal"
    f.write_text(f.read_text() + "\n// edited\n")
    kernels.forget_record()
    assert qualify.record_status("metal") == "stale"
    assert qualify.record_ops("metal") is None
    assert not kernels.kernels_allowed("qgemv", "metal")
    # qualification off: records are ignored
    f.write_text(f.read_text().replace("\n// edited\n", ""))
    monkeypatch.setenv(qualify.QUALIFY_ENV, "0")
    kernels.forget_record()
    assert qualify.record_status("metal") == "off" and not kernels.kernels_allowed("qgemv", "metal")


def test_record_of_another_method_version_is_stale(fake_device):
    """A record written by another version of qualification's method (its decisions were
    timed another way) is redone, like one of another kernel source."""
    rec = dict(_record({"qgemv": "default"}), schema_version=qualify.SCHEMA_VERSION - 1)
    qualify.write_record(rec, qualify.record_path("metal"))
    kernels.forget_record()
    assert qualify.record_status("metal") == "stale"
    assert qualify.record_ops("metal") is None


def test_record_variant_settings_apply_when_serving(fake_device, monkeypatch):
    """A record that chose a non-default variant: reading it (``kernels.verified_ops``)
    applies that variant's knob values; a knob the user set in the environment keeps the
    user's value; a record that no longer applies (stale) applies none."""
    from mlx_lily import tuning

    monkeypatch.delenv("MLX_LILY_MOE_DOWN_SHAPE", raising=False)
    monkeypatch.delenv("MLX_LILY_ATTN_DECODE", raising=False)
    qualify.write_record(_record({"moe_experts": "down_sl9", "attention": "decode_simd",
                                  "qgemv": "default"}), qualify.record_path("metal"))
    kernels.forget_record()
    assert tuning.moe_down_shape is None
    assert kernels.verified_ops("metal") == {"moe_experts", "attention", "qgemv"}
    assert tuning.moe_down_shape == (2, 2, 9) and tuning.attn_decode == "simd"
    monkeypatch.setenv("MLX_LILY_ATTN_DECODE", "gqa")
    assert tuning.attn_decode == "gqa" and tuning.moe_down_shape == (2, 2, 9)
    f = fake_device / "qgemv.metal"
    f.write_text(f.read_text() + "\n// edited\n")
    kernels.forget_record()
    assert kernels.verified_ops("metal") == frozenset()
    assert tuning.moe_down_shape is None


def test_record_variant_settings_drop_a_clash(fake_device, monkeypatch):
    """Two chosen variants that set one variable to different values: neither value is
    applied (that pair was never timed together), with one warning; the rest apply."""
    table = {"qgemv": {"a": {"MLX_LILY_QGEMV_SHAPE": "2,4", "MLX_LILY_QGEMV_BPL": "8"}},
             "attention": {"b": {"MLX_LILY_QGEMV_SHAPE": "8,4"}}}
    monkeypatch.setattr(qualify, "variants_of", lambda op, be=None, dc=None: table.get(op, {}))
    qualify.write_record(_record({"qgemv": "a", "attention": "b"}), qualify.record_path("metal"))
    kernels.forget_record()
    with pytest.warns(UserWarning, match="MLX_LILY_QGEMV_SHAPE"):
        got = qualify.record_variant_settings("metal")
    assert got == {"MLX_LILY_QGEMV_BPL": "8"}


def test_shipped_record_matches_the_device_name(monkeypatch):
    monkeypatch.setattr(kernels, "_real_backend", lambda: "cuda")
    monkeypatch.setattr(qualify, "record_ops", lambda be: None)
    kernels.forget_record()
    monkeypatch.setattr(kernels, "device_name", lambda: "NVIDIA H200")
    assert kernels.verified_ops("cuda") == kernels.VERIFIED["cuda"]
    monkeypatch.setattr(kernels, "device_name", lambda: "NVIDIA GeForce RTX 4090")
    kernels.forget_record()
    assert kernels.verified_ops("cuda") == frozenset()
    kernels.forget_record()


def test_runtime_disabled_op_stays_off_under_all(monkeypatch):
    monkeypatch.setenv("MLX_LILY_KERNELS", "all")
    assert kernels.kernels_allowed("qgemv", "cuda")
    with pytest.warns(UserWarning, match="qgemv kernels turned off"):
        assert kernels.disable_for_process("qgemv", "test")
    assert not kernels.kernels_allowed("qgemv", "cuda")
    assert kernels.kernels_allowed("attention", "cuda")
    assert not kernels.disable_for_process("qgemv", "again")  # one warning only
    with kernels.only_ops(["qgemv", "attention"]):
        assert not kernels.kernels_allowed("qgemv", "cuda")
        assert kernels.kernels_allowed("attention", "cuda")
        assert not kernels.kernels_allowed("moe_route", "cuda")


@needs_emu
@pytest.mark.parametrize("kind", ["wrong", "nonfinite"])
def test_qualification_fails_only_the_injected_op(monkeypatch, kind):
    monkeypatch.setenv(first_contact.INJECT_ENV, f"qgemv:{kind}")
    model = _models.build("qwen3_5_moe", seed=3)
    with emulated_metal():
        res = qualify.qualify_model(model, ops=["add_rms_norm", "moe_router_topk", "qgemv"],
                                    decode_context=4, prefill_len=8, parity_prefill=0,
                                    seed=1, **QUICK)
    passed = {op: r["default"]["passed"] for op, r in res["ops"].items()}
    assert passed == {"add_rms_norm": True, "moe_router_topk": True, "qgemv": False}, res
    assert res["ops"]["qgemv"]["default"]["error"]
    assert "qgemv" not in res["qualified"]
    for op in ("add_rms_norm", "moe_router_topk"):
        r = res["ops"][op]["default"]
        assert r["agreement"]["finite"] and r["kernel_ms"]["decode"] > 0



def test_passing_set_bisects_to_the_breaking_op(monkeypatch):
    """One check when every op passes; a failing set is bisected over its prefixes (the op
    whose addition breaks it fails, with the ops that require it); a launch failure names
    its op without bisecting."""
    monkeypatch.setattr(first_contact, "requires", lambda op: {"d": ("c",)}.get(op, ()))
    calls: list = []

    def check(bad=None, fault=None):
        def run(opset):
            calls.append(list(opset))
            if fault in opset:
                return {"ok": False, "fault": fault, "agreement": None, "error": "launch",
                        "launched": {}}
            ok = bad not in opset
            return {"ok": ok, "fault": None, "agreement": {"ok": ok}, "launched": {},
                    "error": None if ok else "wrong"}
        return run

    good, verdict, failed = first_contact.passing_set(list("abcdefgh"), check())
    assert good == list("abcdefgh") and verdict["ok"] and failed == {} and len(calls) == 1
    calls.clear()
    good, verdict, failed = first_contact.passing_set(list("abcdefgh"), check(bad="c"))
    assert good == list("abefgh") and verdict["ok"]
    assert failed["c"]["error"] == "wrong" and "requires c" in failed["d"]["error"]
    assert len(calls) == 1 + 3 + 1, calls  # all, bisection over 8 prefixes, the rest
    calls.clear()
    good, _, failed = first_contact.passing_set(list("abcdefgh"), check(fault="f"))
    assert good == list("abcdegh") and set(failed) == {"f"} and len(calls) == 2


def _defaults_only(monkeypatch):
    """Each op qualifies its default variant alone (the counts below are per op set)."""
    monkeypatch.setattr(qualify, "variants_of", lambda op, backend=None, decode_context=None:
                        {qualify.DEFAULT_VARIANT: {}})


def _qualify_timed_by(monkeypatch, ops, decode, prefill=None, **kw):
    """``qualify_model`` on the emulated tiny model with its timing stubbed:
    ``decode(run, steps)`` and ``prefill(model, length)`` give each round's ms (prefill
    default 10.0), each op in its default variant only, one round of one step per phase
    unless ``kw`` says otherwise."""
    monkeypatch.setattr(qualify, "decode_round", decode)
    monkeypatch.setattr(qualify, "prefill_round", prefill or (lambda model, length: 10.0))
    _defaults_only(monkeypatch)
    model = _models.build("qwen3_5_moe", seed=3)
    args = dict(decode_steps=1, decode_rounds=1, prefill_reps=1, decode_context=4,
                prefill_len=8, parity_prefill=0, seed=1, method=qualify.GREEDY)
    args.update(kw)
    with emulated_metal():
        return qualify.qualify_model(model, ops=ops, **args)


def _first_contact_misses(monkeypatch):
    """First contact at the warm-up turns nothing off (qualification's own parity must
    find the fault)."""
    monkeypatch.setattr(first_contact, "check", lambda model, **kw: {
        "failed": {}, "active": [], "agreement": None, "launched": {}})


@needs_emu
def test_parity_bisection_finds_the_wrong_op(monkeypatch):
    """With every op on at once the logits are wrong: the bisection names qgemv (and the
    fusion that requires it), the others pass, in 4 probed forwards instead of one per op."""
    monkeypatch.setenv(first_contact.INJECT_ENV, "qgemv:wrong")
    _first_contact_misses(monkeypatch)
    _defaults_only(monkeypatch)  # qgemv's launch-shape variants would add their own parity
    model = _models.build("qwen3_5_moe", seed=3)
    ops = ["add_rms_norm", "moe_router_topk", "qgemv", "norm_qgemv"]
    lines: list = []
    with emulated_metal():
        res = qualify.qualify_model(model, ops=ops, decode_context=4, prefill_len=8,
                                    parity_prefill=0, seed=1, progress=lines.append, **QUICK)
    passed = {op: r["default"]["passed"] for op, r in res["ops"].items()}
    assert passed == {"add_rms_norm": True, "moe_router_topk": True, "qgemv": False,
                      "norm_qgemv": False}, res["ops"]
    assert "off the reference" in res["ops"]["qgemv"]["default"]["error"]
    assert "requires qgemv" in res["ops"]["norm_qgemv"]["default"]["error"]
    assert res["ops"]["qgemv"]["default"]["kernel_ms"] is None  # failed: not timed
    assert set(res["qualified"]) <= {"add_rms_norm", "moe_router_topk"}
    counts = res["counts"]
    # the parity phase: all, the bisection, the rest; each a prefill and a decode step
    assert counts["forwards"]["parity"] == 2 * (1 + 2 + 1), counts
    # plus the final check when an op was kept (timing on this CPU decides)
    final = res["overall"]["qualified_ms"] is not None
    assert counts["parity_forwards"] == 1 + 2 + 1 + final, counts
    assert {"warmup", "reference", "parity", "timing"} <= set(res["phases"])
    assert counts["timed_sets"] >= 2  # the two passing ops (and stock when one was kept)
    assert any("parity: 2 of 4 ops passed, failed: qgemv, norm_qgemv" in ln for ln in lines)
    assert all(ln.endswith(" s)") for ln in lines), lines


def test_variant_settings_apply_and_restore(monkeypatch):
    from mlx_lily.patches import decode_graph

    dropped = []
    monkeypatch.setattr(decode_graph, "drop_compiled_steps", lambda: dropped.append(1))
    monkeypatch.setenv("LILY_TEST_A", "before")
    monkeypatch.delenv("LILY_TEST_B", raising=False)
    with qualify.variant_settings({"LILY_TEST_A": None, "LILY_TEST_B": 3}):
        assert "LILY_TEST_A" not in os.environ and os.environ["LILY_TEST_B"] == "3"
        assert len(dropped) == 1  # no compiled step traced under other settings replays
    assert os.environ["LILY_TEST_A"] == "before" and "LILY_TEST_B" not in os.environ
    assert len(dropped) == 2
    with qualify.variant_settings({}):
        pass
    assert len(dropped) == 2
    # a variant knob is in the compiled steps' key: switching it keeps them
    from mlx_lily.variants import KNOB_NAMES

    knob = "MLX_LILY_MOE_DOWN_SHAPE"
    assert knob in KNOB_NAMES
    monkeypatch.delenv(knob, raising=False)
    monkeypatch.setattr(backend, "compile_mode", lambda be=None: "whole")
    before = decode_graph.compile_key()
    with qualify.variant_settings({knob: "2,2,9"}):
        under = decode_graph.compile_key()
    assert len(dropped) == 2 and under != before and decode_graph.compile_key() == before
    assert qualify.variants_of("qgemv")["default"] == {}


VARIANT_VAR = "LILY_TEST_VARIANT"


def _three_variants_qualified(monkeypatch, **kw):
    """``qualify_model`` of ``add_rms_norm`` with three variants, each setting
    ``VARIANT_VAR``: "wide" (5 ms a decode step), "wider" (8 ms) and "broken" (fails
    parity); the default and the references take 10 ms, prefill 10 ms. Returns
    ``(result, parity checks as (op set, variant), the variant each timed round ran)``."""
    var = VARIANT_VAR
    monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(qualify, "VARIANTS", {"add_rms_norm": {
        "wide": {var: "wide"}, "wider": {var: "wider"}, "broken": {var: "broken"}}})
    real_check = qualify._Parity.check
    checked, seen = [], []

    def check(self, opset, settings=None):
        checked.append((tuple(opset), (settings or {}).get(var)))
        v = real_check(self, opset, settings)
        if (settings or {}).get(var) == "broken":
            v = dict(v, ok=False, error="broken variant")
        return v

    times = {"wide": 5.0, "wider": 8.0}

    def fake_decode(run, steps):
        seen.append(os.environ.get(var))
        return times.get(os.environ.get(var), 10.0)

    monkeypatch.setattr(qualify._Parity, "check", check)
    monkeypatch.setattr(qualify, "decode_round", fake_decode)
    monkeypatch.setattr(qualify, "prefill_round", lambda model, length: 10.0)
    model = _models.build("qwen3_5_moe", seed=3)
    with emulated_metal():
        res = qualify.qualify_model(model, ops=["add_rms_norm"], decode_steps=1,
                                    decode_rounds=1, decode_context=4, prefill_len=8,
                                    parity_prefill=0, seed=1,
                                    **{"method": qualify.GREEDY, **kw})
    return res, checked, seen


@needs_emu
def test_variants_are_checked_timed_and_picked(monkeypatch):
    """Each variant of an op runs its parity and its timing under its own settings; a
    variant failing parity is not timed; the fastest passing variant that was faster is
    the op's qualified variant, and the final timing runs under it."""
    res, checked, seen = _three_variants_qualified(monkeypatch)
    r = res["ops"]["add_rms_norm"]
    assert list(r) == ["default", "wide", "wider", "broken"]
    assert [r[v]["passed"] for v in r] == [True, True, True, False]
    assert r["broken"]["error"] == "broken variant" and r["broken"]["kernel_ms"] is None
    assert [r[v]["faster"] for v in ("default", "wide", "wider")] == [False, True, True]
    assert res["qualified"] == {"add_rms_norm": "wide"}
    assert qualify.decide(res["ops"]) == {"add_rms_norm": "wide"}
    # one paired round each (base, then the variant): default, wide, wider, then stock
    # against the qualified set under "wide"
    assert seen == [None, None, None, "wide", None, "wider", None, "wide"], seen
    assert res["overall"]["speedup_vs_stock"]["decode"] == 2.0
    assert [s for _, s in checked] == [None, "wide", "wider", "broken", "wide"], checked
    assert VARIANT_VAR not in os.environ
    md = qualify.render_markdown({**res, "identity": {}})
    assert "| add_rms_norm | wide | yes | yes |" in md


@needs_emu
def test_decode_step_compiles_for_the_op_sets_qualification_tries(monkeypatch):
    """Every op set qualification times traces its decode step: with the attention
    switches on but the attention kernel off (attention not kept) the step must not fail
    to trace. ``mx.compile`` is replaced by the identity (the emulator runs eagerly; a
    trace runs the same Python), so a tracing failure shows as the compile warning."""
    import warnings

    from mlx_lily.patches import decode_graph

    model = _models.build("qwen3_5_moe", seed=3)
    names = list(backend.OP_NAMES)
    sets = [["attn_packed"], [o for o in names if o != "attention"], names]
    with emulated_metal(), pytest.MonkeyPatch.context() as mp:
        with mlx_lily.patched(model, force=True):
            mlx_lily.prepare_model(model)
            for ops in sets:
                with kernels.only_ops(ops):
                    eager = np.array(first_contact.forward_logits(model, 8, 0))
                    mp.setattr(backend, "compile_mode", lambda be=None: "whole")
                    mp.setattr(mx, "compile", lambda f, *a, **k: f)
                    before = decode_graph.TRACES[0]
                    with warnings.catch_warnings(record=True) as w:
                        warnings.simplefilter("always")
                        got = np.array(first_contact.forward_logits(model, 8, 0))
                    mp.undo()
                assert decode_graph.TRACES[0] > before, ops
                assert not [str(x.message) for x in w if "compiling" in str(x.message)], ops
                np.testing.assert_array_equal(got, eager)

def _child_env(**extra):
    env = dict(os.environ, MLX_LILY_QUALIFY_EMULATE="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), *sys.path])
    return env


@needs_emu
def test_child_process_qualifies_and_writes_the_record(fake_device, monkeypatch):
    real_identity = qualify.identity

    def slow_identity(be):  # the parent's own check takes 2 s: it must overlap the child
        time.sleep(2.0)
        return real_identity(be)

    monkeypatch.setattr(qualify, "identity", slow_identity)
    rec = qualify.run(str(FIXTURE), backend="metal", timeout_s=400, extra_args=FAST,
                      env=_child_env())
    assert rec["status"] == "ok", rec.get("log_tail")
    assert {op: r["default"]["passed"] for op, r in rec["ops"].items()} == {
        "add_rms_norm": True, "moe_router_topk": True}
    assert rec["model"]["layers"] == 4
    st = rec["startup"]  # where the time outside qualification went, in launch order
    load_parts = rec["model"]["lazy_load_s"] + rec["model"]["eval_s"]
    assert 0 < load_parts <= st["load_s"] and rec["model"]["eval_s"] > 0
    assert 0 < st["launch_to_main_s"] < st["launch_to_result_s"] <= st["launch_to_exit_s"]
    assert 0 < st["load_s"] < st["launch_to_result_s"] and st["launch_to_exit_s"] <= rec["wall_s"]
    assert st["parent_identity_s"] >= 2.0 and rec["wall_s"] - st["launch_to_exit_s"] < 1.0
    assert rec["identity"] == real_identity("metal")
    stored = json.loads(qualify.record_path("metal").read_text())
    assert stored["status"] == "ok" and stored["ops"] == rec["ops"]
    md = qualify.render_markdown(stored)
    assert "| add_rms_norm | default | yes |" in md
    assert "Child process, seconds from its launch: launch to main " in md
    assert "the parent's identity check (while the child ran) " in md
    assert "(lazy load " in md and "evaluating the kept weights " in md
    j, m = qualify.write_report(stored, fake_device.parent / "report")
    assert json.loads(j.read_text())["ops"] and m.read_text() == md


@needs_emu
def test_child_process_time_limit_kills_a_hanging_kernel(fake_device, monkeypatch):
    rec = qualify.run(str(FIXTURE), backend="metal", timeout_s=40, extra_args=FAST,
                      env=_child_env(MLX_LILY_INJECT_FAULT="add_rms_norm:hang"))
    assert rec["status"] == "timeout", rec
    assert any("injected hang in kernel lily_add_rms_norm" in ln for ln in rec["log_tail"])
    assert rec["qualified"] == {} and rec["wall_s"] < 70
    stored = json.loads(qualify.record_path("metal").read_text())
    assert stored["status"] == "timeout"
    kernels.forget_record()
    assert qualify.record_status("metal") == "valid" and qualify.record_ops("metal") == frozenset()


@needs_emu
def test_a_failing_parent_kills_its_child(fake_device, monkeypatch):
    """An error in the parent while the child runs (its identity check, computed then)
    kills the child's process group, propagates, and writes no record."""
    procs = []
    real_popen = qualify.subprocess.Popen

    def popen(*a, **kw):
        procs.append(real_popen(*a, **kw))
        return procs[-1]

    def unreadable(be):
        raise OSError("kernel sources unreadable")

    monkeypatch.setattr(qualify.subprocess, "Popen", popen)
    monkeypatch.setattr(qualify, "identity", unreadable)
    with pytest.raises(OSError, match="kernel sources unreadable"):
        qualify.run(str(FIXTURE), backend="metal", timeout_s=60, extra_args=FAST,
                    env=_child_env(MLX_LILY_INJECT_FAULT="add_rms_norm:hang"))
    (child,) = procs
    assert child.returncode == -9  # killed, and reaped
    assert not qualify.record_path("metal").exists()


# ----------------------------------------------------------------------------- stepping aside
def _stock_calls():
    from mlx_lm.models import qwen3_5, qwen3_next

    return (qwen3_5.GatedDeltaNet.__call__, qwen3_next.Qwen3NextSparseMoeBlock.__call__,
            qwen3_5.DecoderLayer.__call__)


def test_cpu_steps_aside_with_one_line(monkeypatch, capsys):
    monkeypatch.delenv(patching.STEP_ASIDE_ENV, raising=False)
    stock = _stock_calls()
    model = _models.build("qwen3_5_moe", seed=2)
    ids = mx.array([[3, 1, 4, 1, 5]])
    want = np.array(model(ids).astype(mx.float32))
    installed = []
    monkeypatch.setattr(patching, "INDEPENDENT_FEATURES",
                        [(lambda: installed.append(1) or "tok", lambda t: installed.remove(1))])
    h = mlx_lily.patch(model)
    try:
        assert h.stepped_aside and "CPU" in h.stepped_aside
        assert _stock_calls() == stock  # mlx-lm's own code stays
        assert not getattr(model, "_lily_prepared", False)
        assert installed == [1]  # independent features install anyway
        info = mlx_lily.backend_info()
        assert info["patch"] == "stepped-aside" and set(info["ops"].values()) == {"stock"}
        np.testing.assert_array_equal(np.array(model(ids).astype(mx.float32)), want)
        err = capsys.readouterr().err
        assert err.count("[mlx-lily] stepping aside") == 1, err
    finally:
        mlx_lily.unpatch()
    assert installed == []
    # forced: Lily's forwards run (the references, here)
    with mlx_lily.patched(model, force=True) as h:
        assert h.stepped_aside is None and _stock_calls() != stock
        assert mlx_lily.backend_info()["patch"] == "patched"


def test_gpu_without_record(monkeypatch, capsys, fake_device):
    """A GPU with no record: qualification off steps aside; on, only the load hook goes in
    and the first Lily checkpoint loaded is qualified, then Lily serves or steps aside."""
    monkeypatch.delenv(patching.STEP_ASIDE_ENV, raising=False)
    monkeypatch.setattr(backend, "current_backend", lambda: "metal")
    monkeypatch.setenv("MLX_LILY_KERNELS", "verified")
    stock = _stock_calls()
    monkeypatch.setenv(qualify.QUALIFY_ENV, "0")
    assert patching.kernel_plan()[0] == "aside"
    monkeypatch.delenv(qualify.QUALIFY_ENV)
    decision, reason = patching.kernel_plan()
    assert decision == "qualify" and "Apple M9 Test" in reason
    from mlx_lm import utils

    calls = []
    monkeypatch.setattr(qualify, "auto_qualify", lambda model=None, synthetic=None:
                        calls.append(model))
    h = mlx_lily.patch()
    try:
        assert h.qualify_pending and _stock_calls() == stock
        assert utils.load_model is not patching.original(utils, "load_model")
        utils.load_model(FIXTURE)  # qualifies (stubbed: nothing qualified), then steps aside
        assert calls == [str(FIXTURE)] and not h.qualify_pending
        assert h.stepped_aside and _stock_calls() == stock
    finally:
        mlx_lily.unpatch()
    err = capsys.readouterr().err
    assert "the first Lily model loaded is qualified first" in err
    assert ("[mlx-lily] stepping aside: qualification on Apple M9 Test (metal) passed no "
            "kernel faster than stock (record: ") in err


def test_step_aside_line_waits_for_a_supported_model(monkeypatch, capsys):
    """With ``announce`` (the ``--lily`` hook), the step-aside line is printed when a
    supported checkpoint is loaded, once, and not at ``patch()`` (before ``--help``)."""
    monkeypatch.delenv(patching.STEP_ASIDE_ENV, raising=False)
    monkeypatch.setattr(patching, "_ANNOUNCED", set())
    from mlx_lm import utils

    stock = _stock_calls()
    h = mlx_lily.patch(announce=True)
    try:
        assert h.stepped_aside and _stock_calls() == stock
        assert "[mlx-lily]" not in capsys.readouterr().err
        model, _ = utils.load_model(FIXTURE)
        utils.load_model(FIXTURE)
        assert not getattr(model, "_lily_prepared", False)
        err = capsys.readouterr().err
        assert err.count("[mlx-lily] stepping aside: the CPU backend") == 1, err
    finally:
        mlx_lily.unpatch()
    assert not hasattr(utils.load_model, "__wrapped__")  # the load hook is gone


@needs_emu
def test_launch_census_tells_the_phases_an_op_changes():
    """The census sees which phase's launches an op set changes: qgemv is decode-only,
    the packed attention switch changes attention's decode launches only, add+norm both;
    no op allowed, no launch."""
    model = _models.build("qwen3_5_moe", seed=3)
    with emulated_metal():
        with mlx_lily.patched(model, force=True):
            mlx_lily.prepare_model(model)

            def census(ops):
                return qualify.launch_census(model, ops, {}, context=4, prefill_len=40)

            none = census([])
            assert none == {"decode": {}, "prefill": {}}
            assert qualify.same_phases(census(["qgemv"]), none) == {"prefill"}
            assert qualify.same_phases(census(["add_rms_norm"]), none) == set()
            attn = census(["attention"])
            assert sum(attn["decode"].values()) > 0 and sum(attn["prefill"].values()) > 0
            assert qualify.same_phases(census(["attention", "attn_packed"]), attn) == {
                "prefill"}
            assert qualify.same_phases(None, none) == set()  # unknown: time everything


@needs_emu
def test_phases_with_the_same_launches_are_not_timed(monkeypatch):
    """A decode-only op reuses the base set's prefill time; an op that changes no launch
    at these shapes is not timed and does not qualify."""
    calls = {"decode": 0, "prefill": 0}

    def fake(phase):
        def timer(*args, **kwargs):
            calls[phase] += 1
            return 10.0
        return timer

    # moe_route with its requirement lifted: without moe_grouped no grouped prefill runs,
    # so its routing kernels launch nothing
    requires = first_contact.requires
    monkeypatch.setattr(first_contact, "requires",
                        lambda op: () if op == "moe_route" else requires(op))
    # (default variants only: qgemv's launch-shape variants would be timed too)
    res = _qualify_timed_by(monkeypatch, ["add_rms_norm", "moe_route", "qgemv", "attn_packed"],
                            fake("decode"), fake("prefill"))
    ops = res["ops"]
    assert ops["moe_route"]["default"]["passed"]
    assert "no kernel launch differs" in ops["moe_route"]["default"]["error"]
    assert ops["moe_route"]["default"]["kernel_ms"] is None
    assert ops["add_rms_norm"]["default"]["timing"]["reused"] == []
    assert ops["qgemv"]["default"]["timing"]["reused"] == ["prefill"]
    assert ops["qgemv"]["default"]["speedup"]["prefill"] == 1.0
    # the packed attention switch without the attention kernel: nothing to time
    assert ops["attn_packed"]["default"]["passed"]
    assert ops["attn_packed"]["default"]["kernel_ms"] is None
    assert "requires attention" in ops["attn_packed"]["default"]["error"]
    # one paired round per timed phase (each arm once): add_rms_norm both phases (and
    # an untimed first prefill chunk per arm), qgemv decode only, then the whole passing
    # set (without moe_route, which launches nothing, and attn_packed, whose requirement
    # is not a candidate) against the empty kept set, both phases
    assert res["overall"]["whole_set"]["ops"] == ["add_rms_norm", "qgemv"]
    assert not res["overall"]["whole_set"]["faster"]
    assert calls == {"decode": 2 + 2 + 2, "prefill": 4 + 0 + 4}, calls
    assert res["counts"]["phases_reused"] == {"prefill": 1}
    # three op sets, then the whole set and one without each of its three members
    assert res["counts"]["forwards"]["census"] == (3 + 4) * (1 + 2 + 1)
    assert res["qualified"] == {}


@needs_emu
@pytest.mark.parametrize("spread,kept", [(0.3, True), (0.0, False)], ids=["noisy", "steady"])
def test_noise_allowance_reaches_the_decision(monkeypatch, spread, kept):
    """qualify_model passes the paired rounds' spread to the rule: an op 2x faster in
    prefill and 3 % slower in decode is kept when its rounds' ratios scatter by about 30 %,
    not when they are steady; against stock (10.6 ms) the set is then faster."""
    import itertools

    factors = [1.0, 1.0, 1.3, 0.75, 1.3, 0.75] if spread else [1.0]
    kernel_decode = itertools.cycle([10.3 * f for f in factors])

    def on():
        return mlx_lily.is_patched() and "add_rms_norm" in (kernels._OVERRIDE[0] or ())

    def fake_decode(run, steps):
        if not mlx_lily.is_patched():
            return 10.6  # stock mlx-lm
        return next(kernel_decode) if on() else 10.0

    def fake_prefill(model, length):
        return 5.0 if on() else 10.0

    res = _qualify_timed_by(monkeypatch, ["add_rms_norm"], fake_decode, fake_prefill,
                            decode_rounds=6)
    r = res["ops"]["add_rms_norm"]["default"]
    assert r["noise"]["decode"] > 0 if spread else r["noise"]["decode"] == 0
    assert r["speedup"]["decode"] == pytest.approx(10.0 / 10.3)
    assert r["speedup"]["prefill"] == 2.0
    assert len(r["timing"]["decode_rounds"]["kernel"]) == 6
    assert r["faster"] is kept
    assert res["qualified"] == ({"add_rms_norm": "default"} if kept else {})


def test_dependent_chain_follows_the_registry():
    """An enabler's chain holds the ops that require it and their other candidate
    requirements; an op whose requirement is neither kept nor a candidate stays out."""
    req = first_contact.requires
    assert qualify.dependent_chain("attention", ["attention", "attn_packed", "batch_decode"],
                                   ["qgemv"], req) == ["attention", "attn_packed",
                                                       "batch_decode"]
    # batch_decode needs qgemv too: without it (not kept, not a candidate) it stays out
    assert qualify.dependent_chain("attention", ["attention", "attn_packed", "batch_decode"],
                                   [], req) == ["attention", "attn_packed"]
    kept = ["gated_delta", "qgemv", "moe_topk_in_experts", "qgemv_out"]
    pool = ["norm_qgemv", "gdn_packed", "gdn_proj", "gdn_out_proj", "moe_fused"]
    assert qualify.dependent_chain("norm_qgemv", pool, kept, req) == pool
    assert qualify.dependent_chain("norm_qgemv", [o for o in pool if o != "gdn_packed"],
                                   kept, req) == ["norm_qgemv", "moe_fused"]
    assert qualify.dependent_chain("qgemv_out", ["qgemv_out"], ["qgemv"], req) == ["qgemv_out"]
    assert qualify.dependent_chain("gdn_packed", pool, ["qgemv"], req) == []  # no gated_delta


@needs_emu
@pytest.mark.parametrize("together_ms,kept", [(9.0, True), (10.4, False)],
                         ids=["pays-off", "does-not"])
def test_an_enabler_qualifies_with_the_ops_that_require_it(monkeypatch, together_ms, kept):
    """``attention`` alone is slower (10.5 ms against 10); ``attn_packed`` cannot run
    without it, so it is not timed alone; the two together are timed as a chain against
    the set kept before, and kept whole only when that is faster."""
    def fake_decode(run, steps):
        on = kernels._OVERRIDE[0] or frozenset()  # the set qualify_model times
        if "attention" not in on:
            return 10.0  # references, and stock mlx-lm at the final timing
        return together_ms if "attn_packed" in on else 10.5

    res = _qualify_timed_by(monkeypatch, ["attention", "attn_packed"], fake_decode)
    att = res["ops"]["attention"]["default"]
    assert att["passed"] and att["faster"] is False
    note = res["ops"]["attn_packed"]["default"]["error"]
    assert ("qualified in the chain attention+attn_packed" if kept else "requires attention") in note
    [chain] = res["chains"]
    assert chain["ops"] == ["attention", "attn_packed"] and chain["faster"] is kept
    assert chain["speedup"]["decode"] == pytest.approx(10.0 / together_ms)
    assert res["qualified"] == ({"attention": "default", "attn_packed": "default"}
                                if kept else {})
    md = qualify.render_markdown({**res, "identity": {}})
    assert f"| attention+attn_packed | {'yes' if kept else 'no'} |" in md


@needs_emu
def test_a_chain_leaves_out_a_switch_that_changes_no_launch(monkeypatch):
    """A switch requiring ``attention``, ``attn_packed`` and ``qgemv`` that launches
    nothing different at one sequence (``batch_decode``, posing here as a one-sequence
    switch): the chain of ``attention`` leaves it (and ``qgemv``, which only it pulled
    in) out, so it never serves untimed."""
    from mlx_lily import registry

    monkeypatch.setitem(registry.BY_NAME, "batch_decode",
                        registry.get("batch_decode")._replace(one_sequence=True))

    def fake_decode(run, steps):
        on = kernels._OVERRIDE[0] or frozenset()
        if "attention" not in on:
            return 10.0
        return 9.0 if "attn_packed" in on else 10.5

    res = _qualify_timed_by(monkeypatch, ["attention", "qgemv", "attn_packed", "batch_decode"],
                            fake_decode)
    assert [c["ops"] for c in res["chains"]] == [["attention", "attn_packed"]]
    assert res["qualified"] == {"attention": "default", "attn_packed": "default"}


def test_a_chain_that_loses_an_op_at_the_final_check_leaves_whole():
    """A kept chain whose fusion fails the final check takes its enabler (not faster
    alone) with it, and an op that requires a removed one leaves too; an op outside the
    chain stays."""
    chosen = {o: "default" for o in ("qgemv", "attention", "attn_packed", "batch_decode")}
    results = {o: {"default": {"faster": True, "error": None}} for o in chosen}
    chains = [{"ops": ["attention", "attn_packed"], "faster": True},
              {"ops": ["qgemv"], "faster": False}]
    # attn_packed failed the final check; batch_decode requires attention
    left = qualify.unchained(["qgemv", "attention", "batch_decode"], chains, results, chosen)
    assert left == ["qgemv"]
    assert chains[0]["dropped_at_final_check"] == ["attn_packed"]
    assert "its chain lost attn_packed" in results["attention"]["default"]["error"]
    assert "requires attention" in results["batch_decode"]["default"]["error"]
    assert results["qgemv"]["default"]["error"] is None
    # nothing lost: the set is unchanged
    assert qualify.unchained(["qgemv", "attention", "attn_packed"], chains, results,
                             chosen) == ["qgemv", "attention", "attn_packed"]


# ----------------------------------------------------------------------------- depth
@pytest.mark.parametrize("kind", ["qwen3_5_moe", "qwen3_next"])
def test_deep_view_repeats_the_loaded_layers(kind):
    """``deep_view`` runs the loaded layers again in order up to the asked depth, sharing
    every module (no weight is copied), with one cache per layer of the view; the model
    itself is unchanged, and stock mlx-lm runs the view as a model of that depth (the
    same logits as the layers applied in that order by hand)."""
    model = _models.build(kind, seed=4)
    inner = qualify._inner_model(model)
    layers = list(inner.layers)
    view = qualify.deep_view(model, 2 * len(layers) + 1)
    vin = qualify._inner_model(view)
    assert len(vin.layers) == 2 * len(layers) + 1 and len(inner.layers) == len(layers)
    assert all(a is layers[i % len(layers)] for i, a in enumerate(vin.layers))
    assert vin.embed_tokens is inner.embed_tokens and vin.norm is inner.norm
    assert len(view.make_cache()) == len(vin.layers)
    assert qualify.deep_view(model, len(layers)) is model
    ids = mx.array([[3, 1, 4, 1, 5]])
    got = view(ids, cache=view.make_cache())
    # the same forward with the model's own layer list made that long, then restored
    inner.layers = list(vin.layers)
    try:
        want = model(ids, cache=model.make_cache())
    finally:
        inner.layers = layers
    assert mx.array_equal(got, want).item()
    assert qualify.full_depth(model) == len(layers)


@pytest.mark.parametrize("kind", ["qwen3_5_moe", "qwen3_next"])
def test_deep_view_traces_each_loaded_layer_once(kind, monkeypatch):
    """Decode steps of a deep view compiled layer by layer trace each loaded layer's
    module once per input form (its first place, the later ones with their norm
    pending), however deep the view: compiled functions are keyed by the module's first
    index. The view's steps equal the same steps run uncompiled."""
    from mlx_lily.patches import decode_graph

    model = _models.build(kind, seed=4)
    n = len(qualify._inner_model(model).layers)
    view = qualify.deep_view(model, 3 * n + 1)
    ids, steps = mx.array([[3, 1, 4, 1, 5]]), (7, 2, 9)

    def decode():
        cache = view.make_cache()
        view(ids, cache=cache)
        return [view(mx.array([[t]]), cache=cache) for t in steps]

    with mlx_lily.patched(model):
        monkeypatch.setenv("MLX_LILY_COMPILE", "0")
        want = decode()
        monkeypatch.setenv("MLX_LILY_COMPILE", "1")
        monkeypatch.setenv("MLX_LILY_COMPILE_WHOLE", "0")
        before = decode_graph.TRACES[0]
        got = decode()
        traces = decode_graph.TRACES[0] - before
        fns = qualify._inner_model(view)._lily_steps.fns
    assert {slot for slot, *_ in fns} <= set(range(n))
    assert 0 < len(fns) <= 2 * n
    assert traces <= 2 * n
    assert all(mx.allclose(a, b, rtol=1e-5, atol=1e-5).item() for a, b in zip(got, want))


@needs_emu
def test_decode_is_timed_at_the_asked_depth(monkeypatch):
    """With ``depth``, every timed decode round of both arms runs on the deep view (one
    cache per layer of the view), the record names the depth, and the model keeps its own
    layers."""
    depths = []
    real = qualify.decode_round

    def spy(run, steps):
        depths.append(len(run.cache))
        return real(run, steps)

    monkeypatch.setattr(qualify, "decode_round", spy)
    _defaults_only(monkeypatch)
    model = _models.build("qwen3_5_moe", seed=3)
    n = len(qualify._inner_model(model).layers)
    with emulated_metal():
        res = qualify.qualify_model(model, ops=["add_rms_norm"], decode_context=4,
                                    prefill_len=8, parity_prefill=0, seed=1, depth=2 * n,
                                    **QUICK)
    assert depths and set(depths) == {2 * n}, depths
    assert res["settings"]["depth"] == 2 * n
    assert len(qualify._inner_model(model).layers) == n
    assert "at %d layers" % (2 * n) in res["method"]


def _enablers_pay_together_ms(on) -> float:
    """Decode ms of a step with ``on``: qgemv and attention cost 0.3 ms each alone, their
    fusions (qgemv_out, attn_packed) with both save 1.5 ms, add_rms_norm costs 0.2 ms."""
    t = 10.0 + 0.3 * ("qgemv" in on) + 0.3 * ("attention" in on)
    t += 0.2 * ("add_rms_norm" in on)
    if {"qgemv", "qgemv_out", "attention", "attn_packed"} <= on:
        t -= 1.5
    return t


@needs_emu
def test_the_whole_passing_set_qualifies_when_it_beats_the_ops_kept_one_at_a_time(
        monkeypatch):
    """Two enablers whose chains are each slower alone but pay off together: the
    one-at-a-time pass and the chains keep nothing; the whole passing set is faster and
    qualifies. Its ops that nothing requires and that were not shown faster are timed
    once more without each: ``add_rms_norm`` (a small loss of its own) leaves, the
    fusions that make the set pay stay."""
    def fake_decode(run, steps):
        return _enablers_pay_together_ms(kernels._OVERRIDE[0] or frozenset())

    res = _qualify_timed_by(monkeypatch, ["add_rms_norm", "attention", "qgemv",
                                          "attn_packed", "qgemv_out"], fake_decode)
    assert all(not c["faster"] for c in res["chains"]), res["chains"]
    w = res["overall"]["whole_set"]
    assert w["ops"] == ["add_rms_norm", "attention", "qgemv", "attn_packed", "qgemv_out"]
    assert w["faster"] and w["speedup"]["decode"] == pytest.approx(10.0 / 9.3)
    left = {x["op"]: x["left"] for x in w["leave_one_out"]}
    assert left == {"qgemv_out": False, "attn_packed": False, "add_rms_norm": True}, left
    assert res["qualified"] == {o: "default" for o in w["ops"] if o != "add_rms_norm"}
    assert "whole passing set" in res["ops"]["qgemv_out"]["default"]["error"]
    assert "left out" in res["ops"]["add_rms_norm"]["default"]["error"]
    md = qualify.render_markdown({**res, "identity": {}})
    assert "Whole passing set in default variants" in md and "qualified instead" in md


def test_whole_set_leaves_out_ops_that_would_serve_untimed():
    """An op whose requirement failed leaves with it; an op that changes no launch and
    that nothing requires leaves; one that another member requires stays."""
    req = {"b": ("a",), "c": ("x",), "e": ("d",)}.get
    launches = {"a": 1, "b": 2, "d": 0, "e": 4}  # d launches nothing of its own

    def census(ops):
        n = sum(launches.get(o, 0) for o in ops)
        return {"decode": Counter({"k": n}), "prefill": Counter()}

    assert qualify.whole_set(["a", "b", "c", "d", "e"], lambda o: req(o, ()),
                             census) == ["a", "b", "d", "e"]
    launches["e"] = 0
    assert qualify.whole_set(["a", "b", "d", "e"], lambda o: req(o, ()), census) == ["a", "b"]


@needs_emu
def test_switches_for_several_sequences_are_not_candidates(monkeypatch):
    """``batch_decode`` serves only steps of several sequences: the one-sequence timing
    leaves it out, and the batch phase does not run while the ops it requires did not
    qualify (all timings equal here: nothing qualifies); the record says so."""
    res = _qualify_timed_by(monkeypatch, ["attention", "qgemv", "attn_packed", "batch_decode"],
                            lambda run, steps: 10.0)
    r = res["ops"]["batch_decode"]["default"]
    assert not r["passed"] and "batch phase not run" in r["error"] and r["kernel_ms"] is None
    assert "attention" in r["error"] and "batch_decode" not in res["qualified"]
    assert "batch_decode" not in (res["overall"].get("whole_set") or {}).get("ops", [])
    assert "batch" not in res["phases"]


def _small_batch_phase(monkeypatch):
    """The batch phase on short prompts (the emulator runs every launch on the host)."""
    monkeypatch.setattr(qualify, "BATCH_PROMPTS", (9, 5, 13, 7))
    monkeypatch.setattr(qualify, "BATCH_TOKENS", 4)
    monkeypatch.setattr(qualify, "BATCH_LENGTH", 8)
    monkeypatch.setattr(qualify, "BATCH_ROWS", 2)


BATCH_OPS = ["moe_router_topk", "attention", "attn_packed", "qgemv", "batch_decode"]


def _faster_with_each_kernel(run, steps):
    """A decode round's ms, 1 ms less for each one-sequence op of ``BATCH_OPS`` on."""
    on = kernels._OVERRIDE[0] or frozenset()
    return 10.0 - sum(o in on for o in BATCH_OPS[:-1])


def _with_batch_decode(ms):
    """``ms[0]`` while ``batch_decode`` is off, ``ms[1]`` while it is on."""
    return ms["batch_decode" in (kernels._OVERRIDE[0] or frozenset())]


@needs_emu
@pytest.mark.parametrize("decode_ms, prefill_ms, kept", [
    ((10.0, 6.0), (10.0, 10.0), True),    # batched steps faster, a prompt alone as fast
    ((10.0, 10.5), (10.0, 10.0), False),  # batched steps slower
    ((10.0, 6.0), (10.0, 11.0), False),   # a prompt alone prefills slower
])
def test_batch_phase_keeps_batch_decode_when_rows_equal_alone_and_it_pays(
        monkeypatch, decode_ms, prefill_ms, kept):
    """Once the ops it requires qualified, ``batch_decode`` is checked as the server runs
    it (``BatchGenerator``: four prompts, two joining the running batch, and two of one
    length; every row's tokens and log-probabilities equal the prompt alone, on the
    emulated kernels; a prompt alone, prefilled past the router kernel's row limit,
    against the references), then timed with vs without it: batched decode steps on the
    model's depth (batches of one length and of mixed lengths), a batch's prefill, and a
    prompt alone's prefill. It qualifies only when the batched steps are faster and a
    prompt alone prefills no slower."""
    _small_batch_phase(monkeypatch)
    started = []
    real_start = qualify.BatchDecodeRun.start

    def start(self):
        started.append((len(qualify._inner_model(self.model).layers),
                        kernels._OVERRIDE[0] or frozenset()))
        real_start(self)

    monkeypatch.setattr(qualify.BatchDecodeRun, "start", start)
    monkeypatch.setattr(qualify, "batch_round", lambda run, steps: _with_batch_decode(decode_ms))
    lines: list = []
    saved: list = []
    res = _qualify_timed_by(monkeypatch, BATCH_OPS, _faster_with_each_kernel,
                            prefill=lambda model, length: _with_batch_decode(prefill_ms),
                            progress=lines.append, depth=8,
                            checkpoint=lambda r: saved.append(json.loads(json.dumps(r))))
    assert set(BATCH_OPS[:-1]) <= set(res["qualified"]), res["qualified"]
    # the result as it stood before the batch phase (what a child saves first)
    (before,) = saved
    assert "batch_decode" not in before["qualified"]
    assert before["ops"]["batch_decode"]["default"]["error"] == "the batch phase did not finish"
    assert set(before["qualified"]) == set(res["qualified"]) - {"batch_decode"}
    r = res["ops"]["batch_decode"]["default"]
    assert r["passed"] and r["parity_set"] == qualify._ordered(BATCH_OPS), r
    v = r["agreement"]
    assert v["one_sequence"]["ok"] and v["joining"]["ok"] and v["equal"]["ok"], v
    assert v["joining"]["first_token_diff"] == [-1] * 4
    assert v["joining"]["first_logprobs_diff_step"] == [-1] * 4
    assert set(r["speedup"]) == {"batch_equal", "batch_mixed", "batch_prefill", "prefill"}
    assert r["speedup"]["batch_equal"] == pytest.approx(decode_ms[0] / decode_ms[1])
    assert r["faster"] is kept and ("batch_decode" in res["qualified"]) is kept
    # each shape's two runs: on the model's depth, one per arm (the qualified set alone,
    # and with batch_decode)
    base = frozenset(res["qualified"]) - {"batch_decode"}
    assert sorted(started, key=lambda x: len(x[1])) == [(8, base), (8, base),
                                                       (8, base | {"batch_decode"}),
                                                       (8, base | {"batch_decode"})]
    assert "batch" in res["phases"] and any("batch_decode parity" in x for x in lines)
    row = next(x for x in qualify.report_rows(res) if x["op"] == "batch_decode")
    assert "equal batches 10.000 ->" in row["error"] and "mixed batches" in row["error"]
    assert "batch prefill" in row["error"]
    assert v["one_sequence"]["launched"].get("moe_router_topk"), v["one_sequence"]


@needs_emu
def test_one_sequence_parity_past_the_router_row_limit_runs_the_router_kernel():
    """The batch phase's one-sequence parity prefills past the router kernel's row limit:
    with ``batch_decode`` (which lifts the limit) the kernel routes that chunk too, and
    the forward still passes against the references."""
    from mlx_lily.ops import moe_router_topk

    model = _models.build("qwen3_5_moe", seed=3)
    long = 2 * moe_router_topk.MAX_ROWS + 1
    p = first_contact.PROMPT_LEN
    with emulated_metal(), mlx_lily.patched(model):
        with kernels.only_ops(()), backend.compile_suspended():
            ref = first_contact.forward_logits(model, p, long, seed=1)
        par = qualify._Parity(model, qualify._Ledger(), ref, p, long, 1)
        off, on = par.check(BATCH_OPS[:-1]), par.check(BATCH_OPS)

    def routed(v):
        return sum(v["launched"].get("moe_router_topk", {}).values())

    assert off["ok"] and on["ok"], (off["error"], on["error"])
    assert routed(on) > routed(off) > 0


def test_a_child_stopped_in_the_batch_phase_keeps_its_one_sequence_result(
        fake_device, monkeypatch):
    """A child that wrote its result before the batch phase and then ran out of time
    leaves a valid record of that result, ``batch_decode`` not qualified, and says why."""
    real_popen = qualify.subprocess.Popen

    def popen(cmd, **kw):
        out = cmd[cmd.index("--child-out") + 1]
        Path(out).write_text(json.dumps({
            "partial": True, "identity": qualify.identity("metal"),
            "qualified": {"qgemv": "default"},
            "ops": {"qgemv": {"default": {"passed": True}},
                    "batch_decode": {"default": {"passed": False, "error": "unfinished"}}}}))
        return real_popen([sys.executable, "-c", "import time; time.sleep(60)"], **kw)

    monkeypatch.setattr(qualify.subprocess, "Popen", popen)
    rec = qualify.run(str(FIXTURE), backend="metal", timeout_s=3)
    assert rec["status"] == "ok" and rec["qualified"] == {"qgemv": "default"}, rec
    assert rec["batch_phase_stopped"] == "qualification did not finish within 3 s"
    assert "the batch phase did not finish" in rec["ops"]["batch_decode"]["default"]["error"]
    kernels.forget_record()
    assert qualify.record_ops("metal") == frozenset({"qgemv"})


@needs_emu
def test_batch_parity_tells_a_batch_that_departs_from_alone():
    """``batch_parity`` on the emulated kernels: with ``batch_decode`` every row equals
    its prompt alone; without it (a batch's decode steps take mlx-lm's code for
    attention, a prompt alone Lily's kernels) it reports the rows that differ."""
    model = _models.build("qwen3_5_moe", seed=3)
    prompts = qualify.batch_prompts((9, 5, 13, 7), seed=1)
    verdicts = {}
    with emulated_metal(), mlx_lily.patched(model):
        for name, ops in (("on", BATCH_OPS), ("off", BATCH_OPS[:-1])):
            with kernels.only_ops(ops):
                verdicts[name] = qualify.batch_parity(model, prompts, 2, 2, 4)
    assert verdicts["on"]["ok"] and verdicts["on"]["error"] is None, verdicts["on"]
    off = verdicts["off"]
    assert not off["ok"] and "differed from the prompt alone" in off["error"]
    assert any(d >= 0 for d in off["first_logprobs_diff_step"]), off


@needs_emu
def test_an_op_the_census_cannot_see_is_timed_in_both_phases(monkeypatch):
    """An op whose work is MLX's own ops (``prefill_dequant`` on CUDA; ``qgemv`` poses as
    one here) launches no Lily kernel a census could compare: with a census that sees no
    launch at all, such an op is still timed in both phases and stays in the whole set,
    while an op with kernels of its own (``add_rms_norm``) is not timed."""
    from mlx_lily import registry

    monkeypatch.setitem(registry.BY_NAME, "qgemv",
                        registry.get("qgemv")._replace(own_kernels=False))
    monkeypatch.setattr(qualify, "launch_census", lambda *a, **k: {
        ph: Counter() for ph in qualify.PHASES})
    calls = []

    def fake_prefill(model, length):
        calls.append(tuple(sorted(kernels._OVERRIDE[0] or ())))
        return 10.0

    res = _qualify_timed_by(monkeypatch, ["add_rms_norm", "qgemv"], lambda run, steps: 10.0,
                            fake_prefill)
    r = res["ops"]["qgemv"]["default"]
    assert set(r["speedup"]) == {"decode", "prefill"} and r["timing"]["reused"] == []
    assert ("qgemv",) in calls
    assert "no kernel launch differs" in res["ops"]["add_rms_norm"]["default"]["error"]
    assert res["overall"]["whole_set"]["ops"] == ["qgemv"]


# ----------------------------------------------------------------------------- top-down
def test_with_dependents_follows_requirements_through_members():
    req = {"b": ("a",), "c": ("b",), "d": ("x",), "e": ("a", "d")}.get
    ops = ["a", "b", "c", "d", "e"]
    assert qualify.with_dependents("a", ops, lambda o: req(o, ())) == ["a", "b", "c", "e"]
    assert qualify.with_dependents("b", ops, lambda o: req(o, ())) == ["b", "c"]
    assert qualify.with_dependents("c", ops, lambda o: req(o, ())) == ["c"]
    assert qualify.with_dependents("a", ["a", "c"], lambda o: req(o, ())) == ["a"]


@needs_emu
def test_top_down_keeps_the_ops_the_set_is_faster_with(monkeypatch):
    """The scenario of the greedy whole-set test, top-down: the whole passing set, then
    each member left out (fusions first, each base op with the fusions that require it):
    the same four ops qualify and ``add_rms_norm`` (slower with it) leaves, in 7 timed
    comparisons (the whole set, one per member, the final one against stock) where the
    greedy pass makes more."""
    def fake_decode(run, steps):
        on = kernels._OVERRIDE[0] or frozenset()
        # a fusion left on without its base op would cost: the base arm must drop both
        return _enablers_pay_together_ms(on) + 0.4 * ("qgemv_out" in on and "qgemv" not in on)

    ops = ["add_rms_norm", "attention", "qgemv", "attn_packed", "qgemv_out"]
    res = _qualify_timed_by(monkeypatch, ops, fake_decode, method=qualify.TOP_DOWN)
    assert res["settings"]["method"] == "top-down"
    assert "each member on (in each passing variant)" in res["method"]
    w = res["overall"]["whole_set"]
    assert w["ops"] == ops and w["speedup"]["decode"] == pytest.approx(10.0 / 9.3)
    assert res["qualified"] == {o: "default" for o in ops if o != "add_rms_norm"}
    r = res["ops"]
    assert r["add_rms_norm"]["default"]["speedup"]["decode"] == pytest.approx(9.1 / 9.3)
    assert "left out" in r["add_rms_norm"]["default"]["error"]
    # qgemv is timed with qgemv_out, which requires it: 10.5 ms without both, 9.3 with
    assert r["qgemv"]["default"]["speedup"]["decode"] == pytest.approx(10.5 / 9.3)
    assert r["qgemv_out"]["default"]["speedup"]["decode"] == pytest.approx(10.8 / 9.3)
    assert res["counts"]["timed_sets"] == 7  # the whole set, a member each, stock
    greedy = _qualify_timed_by(monkeypatch, ops, fake_decode)
    assert greedy["qualified"] == res["qualified"]
    assert greedy["counts"]["timed_sets"] > res["counts"]["timed_sets"]
    md = qualify.render_markdown({**res, "identity": {}})
    assert "against the references" in md and "the rest of the set" in md


@needs_emu
def test_top_down_leaves_a_base_op_with_the_fusions_that_require_it(monkeypatch):
    """A base op whose chain does not pay leaves together with the fusion that requires
    it; that fusion, timed first on its own, had stayed."""
    def fake_decode(run, steps):
        on = kernels._OVERRIDE[0] or frozenset()
        t = 10.0 + 1.0 * ("qgemv" in on)  # the base op costs more than its fusion gains
        t -= 0.5 * ({"qgemv", "qgemv_out"} <= on)
        return t

    res = _qualify_timed_by(monkeypatch, ["qgemv", "qgemv_out"], fake_decode,
                            method=qualify.TOP_DOWN)
    r = res["ops"]
    assert r["qgemv_out"]["default"]["speedup"]["decode"] == pytest.approx(11.0 / 10.5)
    assert r["qgemv"]["default"]["faster"] is False  # 10.0 without both, 10.5 with
    assert res["qualified"] == {}
    # kept alone first, then out with its base op: the record says so
    assert r["qgemv_out"]["default"]["faster"] is False
    assert "left out with qgemv" in r["qgemv_out"]["default"]["error"]


@needs_emu
def test_top_down_reports_the_sets_time_for_a_phase_not_timed(monkeypatch):
    """A decode-only member's prefill is not timed: its row carries the set's own prefill
    time (the whole set's here, 14 ms), not the references' (20 ms)."""
    def on():
        return kernels._OVERRIDE[0] or frozenset()

    res = _qualify_timed_by(
        monkeypatch, ["add_rms_norm", "qgemv"],
        lambda run, steps: 10.0 - 1.0 * ("qgemv" in on()) - 1.0 * ("add_rms_norm" in on()),
        lambda model, length: 20.0 - 6.0 * ("add_rms_norm" in on()), method=qualify.TOP_DOWN)
    q = res["ops"]["qgemv"]["default"]
    assert q["timing"]["reused"] == ["prefill"]
    assert q["kernel_ms"]["prefill"] == q["base_ms"]["prefill"] == 14.0
    assert res["qualified"] == {"add_rms_norm": "default", "qgemv": "default"}


@needs_emu
def test_top_down_survives_a_census_that_fails(monkeypatch):
    """``launch_census`` gives None when it cannot build the graph: every phase is then
    timed, as in the greedy method."""
    monkeypatch.setattr(qualify, "launch_census", lambda *a, **kw: None)
    res = _qualify_timed_by(
        monkeypatch, ["add_rms_norm"],
        lambda run, steps: 9.0 if "add_rms_norm" in (kernels._OVERRIDE[0] or ()) else 10.0,
        method=qualify.TOP_DOWN)
    assert res["qualified"] == {"add_rms_norm": "default"}
    assert res["ops"]["add_rms_norm"]["default"]["census"] is None


@needs_emu
def test_top_down_picks_the_fastest_passing_variant(monkeypatch):
    """Each passing variant of a member is timed against the set without the member;
    the fastest faster one stays, and the final timing runs under it."""
    var = VARIANT_VAR

    def census(model, opset, settings, **kw):  # the variants launch differently
        key = f"{','.join(sorted(opset))}|{(settings or {}).get(var)}"
        return {ph: Counter({key: 1}) for ph in qualify.PHASES}

    monkeypatch.setattr(qualify, "launch_census", census)
    res, _, seen = _three_variants_qualified(monkeypatch, method=qualify.TOP_DOWN)
    r = res["ops"]["add_rms_norm"]
    assert [r[v]["faster"] for v in ("default", "wide", "wider")] == [False, True, True]
    assert r["broken"]["kernel_ms"] is None
    assert res["qualified"] == {"add_rms_norm": "wide"}
    # the whole set vs the references, then default, wide and wider each against the set
    # without the op, then stock against the qualified set under "wide"
    assert seen == [None, None, None, None, None, "wide", None, "wider", None, "wide"], seen
    assert var not in os.environ


def test_unknown_method_is_refused():
    with pytest.raises(ValueError, match="method 'sideways'"):
        qualify.qualify_model(None, method="sideways")


def test_the_method_reaches_the_child(monkeypatch, fake_device):
    """``--method`` travels to the child's command line (and from there to
    ``qualify_model``, ``_child``); top-down when not given."""
    seen = {}

    def fake_run(model, synthetic, *, layers, timeout_s, extra_args, backend):
        seen["extra"] = list(extra_args)
        return {"status": "ok", "wall_s": 0.0}

    monkeypatch.setattr(qualify, "run", fake_run)
    monkeypatch.setattr(qualify._backend, "current_backend", lambda: "cuda")
    assert qualify.main(["--synthetic", "tiny", "--method", "greedy"]) == 0
    i = seen["extra"].index("--method")
    assert seen["extra"][i + 1] == "greedy"
    assert qualify.main(["--synthetic", "tiny"]) == 0  # the default (auto_qualify's too)
    assert seen["extra"][seen["extra"].index("--method") + 1] == "top-down"
    opts = qualify.build_parser().parse_args(
        ["--child", "--child-out", str(fake_device.parent / "child.json"), "--synthetic",
         "tiny", "--method", "top-down"])
    monkeypatch.setattr(qualify, "load_model", lambda *a: (None, {"depth": 4}))
    monkeypatch.setattr(qualify, "qualify_model",
                        lambda model, **kw: seen.update(child=kw["method"]) or {})
    assert qualify._child(opts) == 0 and seen["child"] == "top-down"
