"""Teacher-forced numerics of Lily vs stock on the trained fixture (the CPU reference contract)."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "qwen35moe-tiny-trained"

pytestmark = pytest.mark.skipif(
    not (FIXTURE / "config.json").is_file(),
    reason="trained fixture missing: run `python benchmarks/train_fixture.py`")

FIELDS = ("positions", "ppl_stock", "ppl_lily", "ppl_rel_diff", "top1_agreement",
          "kl_stock_lily_mean", "max_abs_logit_diff", "mean_abs_logit_diff")


@pytest.fixture(scope="module")
def script_result(tmp_path_factory):
    """``python benchmarks/numerics.py FIXTURE --out X.json`` (teacher forced)."""
    out = tmp_path_factory.mktemp("num") / "numerics.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "numerics.py"), str(FIXTURE),
                        "--max-tokens", "256", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "perplexity stock" in p.stdout
    return json.loads(out.read_text())


def test_script_runs_and_reports_fields(script_result):
    r = script_result
    assert r["schema"] == "mlx-lily-numerics" and r["mode"] == "teacher_forced"
    assert r["reference"]["source"].startswith("numerics_reference.json")
    m = r["metrics"]
    for k in FIELDS:
        assert k in m and np.isfinite(m[k]), k
    assert m["positions"] >= 192
    assert m["all_finite"]
    # the fixture learned something: perplexity far below its 2048-token vocabulary
    assert m["ppl_stock"] < 500


def _cpu_reference(r):
    return r["backend"] == "cpu"


def test_cpu_reference_contract_teacher_forced(script_result):
    r = script_result
    if not _cpu_reference(r):
        pytest.skip("the 0.01% / 99.5% contract is for the CPU reference path")
    m = r["metrics"]
    assert abs(m["ppl_rel_diff"]) <= 1e-4, m
    assert m["top1_agreement"] >= 0.995, m


def test_cpu_reference_contract_incremental():
    """Token by token through the cache (the decode path)."""
    import mlx_lily
    from mlx_lily.bench import ab, numerics

    target = ab.load_target(str(FIXTURE))
    ids, _ = numerics.reference_ids(target, max_tokens=160)
    m = numerics.run_numerics(target, ids, incremental=True)
    assert m["positions"] == 159 and m["all_finite"]
    with mlx_lily.patched():
        backend = mlx_lily.backend_info()["backend"]
    if backend != "cpu":
        pytest.skip("the contract is for the CPU reference path")
    assert abs(m["ppl_rel_diff"]) <= 1e-4, m
    assert m["top1_agreement"] >= 0.995, m


def test_injected_difference_is_detected():
    from mlx_lily.bench import ab, numerics

    target = ab.load_target(str(FIXTURE))
    ids, _ = numerics.reference_ids(target, max_tokens=64)
    m = numerics.run_numerics(target, ids, inject_wrong=True)
    assert m["top1_agreement"] < 0.5
    assert not numerics.meets_targets(m)["all"]


def test_compare_logits_math():
    from mlx_lily.bench import numerics

    rng = np.random.default_rng(0)
    s = rng.normal(size=(9, 11)).astype(np.float32)
    ids = rng.integers(0, 11, size=9)
    m = numerics.compare_logits(s, s.copy(), ids)
    assert m["ppl_rel_diff"] == 0 and m["top1_agreement"] == 1 and m["max_abs_logit_diff"] == 0
    assert abs(m["kl_stock_lily_mean"]) < 1e-12
    ls = s[:-1] - np.log(np.exp(s[:-1]).sum(-1, keepdims=True))
    ref = np.exp(-ls[np.arange(8), ids[1:]].mean())
    assert np.isclose(m["ppl_stock"], ref, rtol=1e-6)
    m2 = numerics.compare_logits(s, s + 1.0, ids)  # a constant shift changes nothing but logits
    assert np.isclose(m2["ppl_rel_diff"], 0, atol=1e-6) and m2["top1_agreement"] == 1
    assert np.isclose(m2["max_abs_logit_diff"], 1.0)


def test_fp32_anchor_reported_and_gpu_targets(script_result):
    """The script compares both engines with the fp32 evaluation; on the CPU reference
    path Lily's distances equal stock's, so the fp32-anchored targets are met."""
    f = script_result["metrics"]["fp32"]
    for arm in ("stock", "lily"):
        assert np.isfinite(f[arm]["ppl_rel_diff"]) and 0 < f[arm]["top1_agreement"] <= 1
    if _cpu_reference(script_result):
        assert f["lily"]["ppl_rel_diff"] == f["stock"]["ppl_rel_diff"]
    assert script_result["meets_gpu_targets"]["all"] is True


def test_gpu_targets_rule():
    """Lily no further from fp32 than 1.5x stock's perplexity distance, top-1 agreement
    with fp32 at most 10 points below stock's; each rule can fail."""
    from mlx_lily.bench.numerics import meets_gpu_targets

    def m(d_s, d_l, t_s, t_l):
        return {"all_finite": True, "fp32": {
            "stock": {"ppl_rel_diff": d_s, "top1_agreement": t_s},
            "lily": {"ppl_rel_diff": d_l, "top1_agreement": t_l}}}

    assert meets_gpu_targets(m(-0.002, -0.0013, 0.915, 0.893))["all"]
    assert not meets_gpu_targets(m(-0.002, 0.0031, 0.915, 0.915))["ppl"]
    assert not meets_gpu_targets(m(-0.002, -0.001, 0.915, 0.80))["top1"]
    assert meets_gpu_targets({"all_finite": True}) is None
