"""benchmarks/numerics_long.py: metrics, and routing capture through the patched model (CPU)."""
import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "fixtures" / "qwen35moe-tiny-trained"


def _load():
    spec = importlib.util.spec_from_file_location("numerics_long", REPO / "benchmarks" / "numerics_long.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_routing_agreement_counts_shared_choices():
    nl = _load()
    ref = np.array([[0, 1, 2, 3], [4, 5, 6, 7]])
    test = np.array([[3, 2, 1, 9], [7, 6, 5, 4]])  # order ignored; one of eight differs
    assert nl.routing_agreement(ref, test) == pytest.approx(7 / 8)
    assert nl.routing_agreement(ref, ref[:, ::-1]) == 1.0


def test_compare_reports_disagreement():
    nl = _load()
    rng = np.random.default_rng(0)
    a = rng.normal(size=(6, 11)).astype(np.float32)
    tgt = [1, 2, 3, 4, 5, 6]
    same = nl.compare(a, a.copy(), tgt)
    assert same["kl_mean"] == pytest.approx(0.0, abs=1e-12)
    assert same["top1_agreement"] == 1.0 and same["ppl_rel_diff"] == pytest.approx(0.0, abs=1e-12)
    flipped = nl.compare(a, a[:, ::-1].copy(), tgt)
    assert flipped["kl_mean"] > 0.1 and flipped["top1_agreement"] < 1.0


@pytest.mark.skipif(not (FIXTURE / "numerics_reference.json").is_file(), reason="fixture missing")
def test_cpu_run_captures_routing_of_every_engine(tmp_path, monkeypatch):
    nl = _load()
    out = tmp_path / "r.json"
    checked = []
    serving = nl.why_not_serving
    monkeypatch.setattr(nl, "why_not_serving", lambda m: (checked.append(m), serving(m))[1])
    rc = nl.main([str(FIXTURE), "--contexts", "48", "--measure-prefill", "8", "--decode-steps",
                  "2", "--prefill-step", "16", "--kernels", "default", "--out", str(out)])
    assert rc == 0 and checked == ["default"]  # Lily's engine ran only once it served
    res = json.loads(out.read_text())
    (ctx,) = res["contexts"]
    pairs = ctx["pairs"]
    for pair in ("fp32 -> stock", "stock -> lily-default", "fp32 -> lily-default"):
        for sec in ("prefill", "decode", "all"):
            per = pairs[pair][sec]["routing_agreement_per_layer"]
            assert len(per) == res["moe_layers"] == 4
            assert all(0.0 <= x <= 1.0 for x in per)
    assert pairs["stock -> lily-default"]["all"]["positions"] == 10
    # Lily's routing comes from its own router op, not mlx-lm's SwitchGLU
    lily_src = set(ctx["times"]["lily-default-eager"]["routing_sources"])
    assert lily_src and "SwitchGLU" not in lily_src
    assert ctx["times"]["stock"]["routing_sources"] == ["SwitchGLU"]
    # the CPU reference path routes as stock does
    assert pairs["stock -> lily-default"]["all"]["routing_agreement_min"] >= 0.95
    assert "eager_vs_compiled" in " ".join(pairs)


@pytest.mark.skipif(not (FIXTURE / "numerics_reference.json").is_file(), reason="fixture missing")
def test_a_mode_where_lily_stands_aside_is_skipped_and_the_rest_measured(tmp_path, monkeypatch):
    nl = _load()
    out = tmp_path / "r.json"
    serving = nl.why_not_serving
    monkeypatch.setattr(nl, "why_not_serving",
                        lambda m: "aside for this test" if m == "all" else serving(m))
    rc = nl.main([str(FIXTURE), "--contexts", "48", "--measure-prefill", "8", "--decode-steps",
                  "2", "--prefill-step", "16", "--kernels", "all,default", "--out", str(out)])
    assert rc == 1
    res = json.loads(out.read_text())
    assert res["skipped_modes"] == {"all": "aside for this test"}
    (ctx,) = res["contexts"]
    assert "stock -> lily-default" in ctx["pairs"]
    assert not any("lily-all" in k for k in ctx["pairs"]) and "lily-all" not in ctx["times"]
    assert "skipped lily-all: aside for this test" in out.with_suffix(".md").read_text()


@pytest.fixture
def _aligned(monkeypatch):
    from mlx_lily.testing.cuda_emu import aligned_emu_buffers

    yield from aligned_emu_buffers(monkeypatch)


@pytest.mark.parametrize("ci", [0, 2])
def test_capture_reads_the_decode_kernels_ids(ci, _aligned):
    """The one-launch MoE block's ids (read from its scratch) and the routed gate+up
    kernel's ids, both run on the CUDA twin's emulator: equal to each other and to the
    router reference on the same row."""
    from mlx_lily.testing.cuda_emu import HAS_EMU, cuda_on_emu

    if not HAS_EMU:
        pytest.skip("no Metal emulator here")
    import mlx.core as mx
    import test_op_moe_experts as T
    from mlx_lily.ops import moe_experts as M
    from mlx_lily.ops.add_rms_norm import add_rms_norm_reference
    from mlx_lily.ops.norm_qgemv import SPEC as NQ_SPEC, plan as nq_plan

    nl = _load()
    nl.install_capture()
    try:
        d, i, e, k, rows, bits, gs, dtype, off = T.FUSED_CASES[ci]
        blk, router, wts, hin, res, nw = T._fused_inputs(T.FUSED_CASES[ci])
        eps = 1e-6
        counters = mx.zeros((off + M.FUSED_COUNTERS + 2,), dtype=mx.int32)
        kg, kd, init3 = T.kernels_for("cuda-emu")
        with nl.REC.forward() as calls:
            y, h = M.fused_plan(cuda_on_emu(M.FUSED_SPEC), wts, router, hin.shape, dtype, k,
                                True, off)(hin, res, nw, eps, counters, hin)
            logits3, _ = nq_plan(cuda_on_emu(NQ_SPEC), hin.shape, dtype, router.weight,
                                 router.scales, router.biases, router.group_size, router.bits,
                                 rpw=M.FUSED_RPW[0])(hin, res, nw, eps)
            y3, inds3, _, _ = M.decode_plan(
                kg, kd, wts, hin.shape, dtype, k, False, topk=True, pre_norm=True,
                gate_up=(4, M.FUSED_RPW[1]), down=(4, M.FUSED_RPW[2], 1))(
                    hin, res, nw, eps, logits3)
            mx.eval(y, y3)
        assert [c[0] for c in calls] == ["moe_fused", "moe_experts_routed"]
        fused, routed = (np.array(c[1]).reshape(-1, k) for c in calls)
        assert fused.shape == (rows, k)
        assert np.array_equal(np.sort(fused, 1), np.sort(routed, 1))
        with mx.stream(mx.cpu):
            _, x = add_rms_norm_reference(hin, res, nw, eps)
        ref = np.array(T._route_ref(x, router, k)[0]).reshape(-1, k)
        assert nl.routing_agreement(ref, fused) >= 0.5  # same routing up to near-ties
        assert set(np.unique(fused)) <= set(range(e))
    finally:
        nl.uninstall_capture()


def test_default_kernels_on_a_gpu_without_a_record_are_the_shipped_set(monkeypatch):
    from mlx_lily import backend, kernels, qualify

    nl = _load()
    monkeypatch.setattr(backend, "current_backend", lambda: "cuda")
    monkeypatch.setattr(kernels, "shipped_matches", lambda be: False)  # e.g. an H100
    monkeypatch.setattr(qualify, "record_ops", lambda be: None)  # no valid record
    said = []
    got = nl.kernels_for_mode("default", said.append)
    assert got.split(",") == sorted(kernels.VERIFIED["cuda"]) and "shipped" in said[0]
    for rec in (frozenset(), frozenset({"attention"})):  # the device's record decides
        monkeypatch.setattr(qualify, "record_ops", lambda be, rec=rec: rec)
        assert nl.kernels_for_mode("default", said.append) == "verified"
    monkeypatch.setattr(qualify, "record_ops", lambda be: None)
    monkeypatch.setattr(kernels, "shipped_matches", lambda be: True)  # an H200
    assert nl.kernels_for_mode("default", said.append) == "verified"
    assert nl.kernels_for_mode("all", said.append) == "all"
    assert nl.kernels_for_mode("qgemv+attention", said.append) == "qgemv,attention"


def test_a_lily_that_stepped_aside_is_not_measured(monkeypatch):
    import mlx_lily

    nl = _load()
    monkeypatch.setattr(mlx_lily, "backend_info",
                        lambda: {"patch": "stepped-aside", "stepped_aside": "no kernel qualified"})
    assert re.search("--kernels default: Lily is stepped-aside", nl.why_not_serving("default"))
    monkeypatch.setattr(mlx_lily, "backend_info", lambda: {"patch": "patched"})
    assert nl.why_not_serving("default") is None


def test_each_mode_is_one_op_of_the_default_set_with_what_it_requires(monkeypatch):
    from mlx_lily import kernels

    nl = _load()
    modes = nl.each_op_modes("add_rms_norm,qgemv,gdn_out_proj,gdn_proj,gdn_packed,"
                             "gated_delta,norm_qgemv,qgemv_out,attention", "cuda")
    assert modes == [
        "add_rms_norm",
        "gated_delta",
        "attention",
        "qgemv",
        "qgemv+norm_qgemv",
        "gated_delta+gdn_packed",
        "qgemv+qgemv_out",
        "gated_delta+qgemv+norm_qgemv+gdn_packed+gdn_proj",
        "gated_delta+qgemv+norm_qgemv+gdn_packed+qgemv_out+gdn_proj+gdn_out_proj",
    ]
    monkeypatch.setattr(kernels, "verified_ops", lambda be: frozenset({"attention", "attn_packed"}))
    assert nl.each_op_modes("verified", "cuda") == ["attention", "attention+attn_packed"]
    monkeypatch.setattr(kernels, "verified_ops", lambda be: frozenset())
    assert nl.each_op_modes("verified", "cpu") == []
    assert nl.kernels_for_mode("qgemv+qgemv_out") == "qgemv,qgemv_out"


@pytest.mark.skipif(not (FIXTURE / "numerics_reference.json").is_file(), reason="fixture missing")
def test_each_mode_with_no_default_op_says_so():
    """On the CPU the default set holds no op: ``--kernels each`` stops with that, instead
    of measuring nothing of Lily's."""
    nl = _load()
    with pytest.raises(SystemExit, match="--kernels each: the default set has no op here"):
        nl.main([str(FIXTURE), "--contexts", "48", "--measure-prefill", "8", "--kernels",
                 "each"])
