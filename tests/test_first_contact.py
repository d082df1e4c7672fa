"""Safe first contact under the Metal emulator: injected kernel failures (a broken source,
an oversized threadgroup, a launch error, a wrong and a non-finite result) turn off the
failing op only, with one warning naming it; the other ops keep their kernels, and the
model's answers equal the reference's for the failed op (the answers with that op off).

A few light ops keep CI time small (the emulator runs every GPU thread as a fiber)."""

from __future__ import annotations

import warnings

import mlx.core as mx
import numpy as np
import pytest

import _models
import mlx_lily
from mlx_lily import first_contact, kernels
from mlx_lily.testing.dispatch import emulated_metal

try:
    from mlx_lily.testing.metal_emu import available as _emu_available

    HAS_EMU = bool(_emu_available())
except Exception:  # pragma: no cover - emulator toolchain missing
    HAS_EMU = False

needs_emu = pytest.mark.skipif(not HAS_EMU, reason="Metal emulator unavailable")

OPS = ["add_rms_norm", "moe_router_topk", "qgemv"]  # backend.OP_NAMES order


@pytest.fixture(scope="module")
def model():
    return _models.build("qwen3_5_moe", seed=3)


def _logits(model):
    return np.array(first_contact.forward_logits(model, 8, 0))


def _run(model, monkeypatch, fault=None, ops=OPS):
    """First contact of ``model`` with ``ops`` under the emulator, ``fault`` injected
    (``op:kind``); returns (report, logits after it, warnings)."""
    if fault:
        monkeypatch.setenv(first_contact.INJECT_ENV, fault)
    with emulated_metal():
        with mlx_lily.patched(model, ops=ops):
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                rep = first_contact.check(model, prefill_len=0)
            return rep, _logits(model), [str(x.message) for x in w]


def test_fault_parsing(monkeypatch):
    monkeypatch.setenv(first_contact.INJECT_ENV, "qgemv:wrong, attention:build")
    assert first_contact.injected_fault("qgemv") == "wrong"
    assert first_contact.injected_fault("attention") == "build"
    assert first_contact.injected_fault("gated_delta") is None
    monkeypatch.setenv(first_contact.INJECT_ENV, "qgemv:melt")
    with pytest.raises(ValueError, match="MLX_LILY_INJECT_FAULT"):
        first_contact.injected_fault("qgemv")


def test_agree_rejects_gross_errors():
    ref = mx.random.normal((4, 64), key=mx.random.key(0))
    noise = 0.3 * mx.random.normal((4, 64), key=mx.random.key(1))
    assert first_contact.agree(ref + noise, ref)["ok"]
    assert not first_contact.agree(1 - 3 * ref, ref)["ok"]
    bad = first_contact.agree(ref + float("nan"), ref)
    assert not bad["ok"] and bad["finite"] is False


@needs_emu
def test_clean_first_contact_keeps_every_op(model, monkeypatch):
    rep, _, warned = _run(model, monkeypatch)
    assert rep["failed"] == {}, rep
    assert rep["active"] == OPS
    assert rep["agreement"]["ok"], rep
    assert {k.split("/")[0] for k in rep["launched"]} == set(OPS)
    assert not [w for w in warned if "turned off" in w]


@needs_emu
@pytest.mark.parametrize("kind", ["build", "threadgroup", "launch", "wrong", "nonfinite"])
def test_injected_failure_turns_only_that_op_off(model, monkeypatch, kind):
    bad = "qgemv"
    rep, got, warned = _run(model, monkeypatch, f"{bad}:{kind}")
    assert set(rep["failed"]) == {bad}, rep
    assert kernels.runtime_disabled().keys() == {bad}
    assert rep["active"] == [op for op in OPS if op != bad]
    off = [w for w in warned if "turned off" in w]
    assert len(off) == 1 and off[0].startswith(f"mlx-lily: {bad} kernels"), warned
    # the answers equal those with the failed op's kernels off from the start
    kernels.clear_runtime_disabled()
    monkeypatch.delenv(first_contact.INJECT_ENV)
    with emulated_metal():
        with mlx_lily.patched(model, ops=[op for op in OPS if op != bad]):
            want = _logits(model)
    np.testing.assert_array_equal(got, want)


@needs_emu
def test_load_with_a_broken_kernel_does_not_fail(model, monkeypatch):
    """``patch(model)`` runs the real warm-up (first contact, with its longer prefill):
    a kernel that fails to build turns its op off with one warning; the patch stands."""
    from mlx_lily import patching

    warm = patching.warmup
    monkeypatch.setenv(first_contact.INJECT_ENV, "moe_router_topk:build")
    monkeypatch.setattr(first_contact, "PREFILL_LEN", 40)
    with emulated_metal():
        stub, patching.warmup = patching.warmup, warm  # emulated_metal() restores the real
        try:
            model.__dict__.pop("_lily_warm", None)
            with pytest.warns(UserWarning, match="moe_router_topk kernels turned off") as w:
                with mlx_lily.patched(model, ops=OPS) as h:
                    assert h.stepped_aside is None
                    rep = patching.last_warmup["first_contact"]
                    info = mlx_lily.backend_info()
        finally:
            patching.warmup = stub
    assert len([x for x in w if "turned off" in str(x.message)]) == 1
    assert set(rep["failed"]) == {"moe_router_topk"}, rep
    assert rep["failed"]["moe_router_topk"].startswith("MetalEmuCompileError"), rep
    assert rep["active"] == ["add_rms_norm", "qgemv"]
    assert info["runtime_disabled"].keys() == {"moe_router_topk"}
    assert info["ops"]["moe_router_topk"] == "reference" and info["ops"]["qgemv"] == "kernel"
    model.__dict__.pop("_lily_warm", None)


def test_warn_user_prints_where_warnings_are_errors(capsys):
    """A Lily warning announces a fallback: under ``-W error`` it goes to stderr instead of
    raising, and as a warning otherwise."""
    from mlx_lily import config

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config.warn_user("mlx-lily: test fallback", category=RuntimeWarning)
    assert capsys.readouterr().err == "RuntimeWarning: mlx-lily: test fallback\n"
    with pytest.warns(UserWarning, match="test fallback") as w:
        config.warn_user("mlx-lily: test fallback", stacklevel=1)
    assert w[0].filename == __file__  # stacklevel counts from the caller, as in warnings.warn
    assert capsys.readouterr().err == ""


@needs_emu
def test_load_with_a_broken_kernel_under_warnings_as_errors(model, monkeypatch, capsys):
    """With every warning an error (``python -W error``), a kernel that fails to build still
    turns only its own op off: its warning goes to stderr, the patch stands, and the
    report and answers equal those of the same load under the default filters."""
    from mlx_lily import patching

    warm = patching.warmup
    monkeypatch.setenv(first_contact.INJECT_ENV, "moe_router_topk:build")
    monkeypatch.setattr(first_contact, "PREFILL_LEN", 40)
    got = {}
    for action in ("error", "always"):
        kernels.clear_runtime_disabled()
        with emulated_metal():
            stub, patching.warmup = patching.warmup, warm
            try:
                model.__dict__.pop("_lily_warm", None)
                with warnings.catch_warnings(record=True) as w:
                    warnings.simplefilter(action)
                    with mlx_lily.patched(model, ops=OPS) as h:
                        assert h.stepped_aside is None
                        rep = patching.last_warmup["first_contact"]
                        got[action] = (rep["failed"], rep["active"], _logits(model))
            finally:
                patching.warmup = stub
                model.__dict__.pop("_lily_warm", None)
        err = capsys.readouterr().err
        off = [str(x.message) for x in w if "turned off" in str(x.message)]
        if action == "error":
            assert not off and err.count("kernels turned off") == 1, (off, err)
            assert "UserWarning: mlx-lily: moe_router_topk kernels turned off" in err
        else:
            assert len(off) == 1 and "kernels turned off" not in err, (off, err)
    assert set(got["error"][0]) == {"moe_router_topk"}, got["error"][0]
    assert got["error"][:2] == got["always"][:2]
    np.testing.assert_array_equal(got["error"][2], got["always"][2])


@needs_emu
def test_two_wrong_ops_are_both_found(model, monkeypatch):
    """Two ops giving wrong logits: the bisection finds each (one warning each); the third
    keeps its kernel."""
    rep, _, warned = _run(model, monkeypatch, "add_rms_norm:nonfinite,qgemv:wrong")
    assert rep["failed"].keys() == {"add_rms_norm", "qgemv"}, rep
    assert rep["failed"]["add_rms_norm"] == "non-finite result"
    assert rep["failed"]["qgemv"].startswith("wrong result (logit correlation")
    assert rep["active"] == ["moe_router_topk"]
    assert len([w for w in warned if "turned off" in w]) == 2, warned
