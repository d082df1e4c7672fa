"""The A/B harness end to end on the trained tiny fixture (CPU): schema, outputs, gate."""
import copy
import json
from pathlib import Path

import pytest

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "qwen35moe-tiny-trained"

pytestmark = pytest.mark.skipif(
    not (FIXTURE / "config.json").is_file(),
    reason="trained fixture missing: run `python benchmarks/train_fixture.py`")


@pytest.fixture(scope="module")
def ab_run(tmp_path_factory):
    """One short harness run: two lengths, both sweeps, 4 decode steps."""
    from mlx_lily.bench import ab

    out = tmp_path_factory.mktemp("ab")
    code = ab.main([str(FIXTURE), "--lengths", "32,64", "--decode-steps", "4", "--warmup", "1",
                    "--out", str(out)])
    return code, out, json.loads((out / "ab.json").read_text())


def test_end_to_end_outputs_and_schema(ab_run):
    from mlx_lily.bench import ab

    code, out, res = ab_run
    assert code == 0
    assert ab.validate_result(res)
    assert (out / "ab.md").stat().st_size > 0
    png = out / "ab.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert res["gate"]["passed"] is True
    assert res["backend"] in ("cpu", "metal", "cuda")
    assert res["checkpoint"]["kind"] == "path" and len(res["checkpoint"]["tensors_sha256"]) == 64
    assert set(res["lily_backend_info"]["ops"]) >= {"gated_delta", "attention"}
    rows = {(r["sweep"], r["length"]): r for r in res["rows"]}
    assert set(rows) == {("prefill", 32), ("prefill", 64), ("decode", 32), ("decode", 64)}
    for (sweep, length), r in rows.items():
        assert r["status"] == "ok", r
        assert r["ratio"] > 0
        for arm in ("stock", "lily"):
            rounds = r["arms"][arm]["rounds"]
            assert [x["round"] for x in rounds] == [0, 1]
            # round 1: stock first; round 2: lily first
            assert [x["position"] for x in rounds] == ([0, 1] if arm == "stock" else [1, 0])
            assert r["arms"][arm]["tok_s"] > 0
            if sweep == "decode":
                assert all(x["n_intervals"] == 4 for x in rounds)
        if sweep == "decode":
            assert r["context_built_by"] == "lily"
            # identical caches + matching numerics: both arms decode the same tokens
            assert not any(f.startswith("decode-tokens-diverge") for f in r["flags"])
    md = (out / "ab.md").read_text()
    assert "| 32 |" in md and "| 64 |" in md and "PASSED" in md


def test_validator_rejects_bad_results(ab_run):
    from mlx_lily.bench import ab

    res = ab_run[2]
    bad = copy.deepcopy(res)
    del bad["checkpoint"]["tensors_sha256"]
    with pytest.raises(ValueError, match="tensors_sha256"):
        ab.validate_result(bad)
    bad = copy.deepcopy(res)
    bad["gate"]["passed"] = False
    with pytest.raises(ValueError, match="gate failed"):
        ab.validate_result(bad)
    bad = copy.deepcopy(res)
    bad["rows"][0]["arms"]["lily"]["rounds"].pop()
    with pytest.raises(ValueError, match="rounds"):
        ab.validate_result(bad)
    bad = copy.deepcopy(res)
    bad["settings"]["order"].pop()
    with pytest.raises(ValueError, match="settings.order"):
        ab.validate_result(bad)
    bad = copy.deepcopy(res)
    bad["rows"][0]["status"] = "fast"
    with pytest.raises(ValueError, match="status"):
        ab.validate_result(bad)


def test_gate_refuses_injected_wrong_result(tmp_path):
    from mlx_lily.bench import ab

    code = ab.main([str(FIXTURE), "--lengths", "32", "--decode-steps", "4", "--warmup", "0",
                    "--inject-wrong", "--out", str(tmp_path)])
    assert code != 0
    res = json.loads((tmp_path / "ab.json").read_text())
    assert ab.validate_result(res)
    assert res["gate"]["passed"] is False and res["gate"]["injected_wrong"] is True
    assert res["rows"] == []
    assert not (tmp_path / "ab.png").exists()
    assert "FAILED" in (tmp_path / "ab.md").read_text()


def test_budget_marks_rows_not_run(tmp_path):
    from mlx_lily.bench import ab

    code = ab.main([str(FIXTURE), "--sweeps", "prefill", "--lengths", "16,8K", "--budget-s", "0.001",
                    "--warmup", "0", "--out", str(tmp_path)])
    assert code == 0
    res = json.loads((tmp_path / "ab.json").read_text())
    ab.validate_result(res)
    r16, r8k = res["rows"]
    assert r16["status"] == "ok"  # the first length has nothing to predict from
    assert r8k["status"] == "not_run" and "budget" in r8k["reason"]
    assert r8k["arms"]["stock"]["rounds"] == [] and r8k["ratio"] is None


def test_deadline_marks_later_rows_not_run(tmp_path, monkeypatch):
    """--deadline-s: rows that would start after the deadline are not run (the clock is
    faked: each prefill measurement takes 10 s), and the results are written."""
    from mlx_lily.bench import ab

    now = [0.0]
    monkeypatch.setattr(ab.time, "perf_counter", lambda: now[0])

    def fake_prefill(model, ids, step):
        now[0] += 10.0
        return {"seconds": 0.01, "tok_s": len(ids) / 0.01, "peak_memory_bytes": 1 << 20,
                "first_token": 0}

    monkeypatch.setattr(ab, "measure_prefill", fake_prefill)
    monkeypatch.setenv("MLX_LILY_PREFILL_EVAL_LAYERS", "2")
    code = ab.main([str(FIXTURE), "--sweeps", "prefill", "--lengths", "16,32,64",
                    "--deadline-s", "35", "--warmup", "0", "--out", str(tmp_path)])
    assert code == 0
    res = json.loads((tmp_path / "ab.json").read_text())
    ab.validate_result(res)
    assert res["settings"]["deadline_s"] == 35
    assert res["lily_env"]["MLX_LILY_PREFILL_EVAL_LAYERS"] == "2"
    assert "MLX_LILY_PREFILL_EVAL_LAYERS=2" in (tmp_path / "ab.md").read_text()
    statuses = [r["status"] for r in res["rows"]]
    assert statuses == ["ok", "not_run", "not_run"]  # 4 measurements (40 s) in row 1
    assert "deadline" in res["rows"][1]["reason"]


def test_lily_only_rows_over_budget(tmp_path, monkeypatch):
    """--lily-only-over-budget: where only stock is predicted over budget, Lily runs alone
    and the stock figure is a labelled linear prediction (timings faked: stock 10 ms/token,
    Lily 10 us/token, budget 1 s)."""
    from mlx_lily.bench import ab

    arm_now = {}
    orig_ctx = ab.arm_context

    def ctx(arm, *a, **k):
        arm_now["arm"] = arm
        return orig_ctx(arm, *a, **k)

    def fake_prefill(model, ids, step):
        dt = len(ids) * (1e-2 if arm_now["arm"] == "stock" else 1e-5)
        return {"seconds": dt, "tok_s": len(ids) / dt, "peak_memory_bytes": 1 << 20,
                "first_token": 0}

    monkeypatch.setattr(ab, "arm_context", ctx)
    monkeypatch.setattr(ab, "measure_prefill", fake_prefill)
    code = ab.main([str(FIXTURE), "--sweeps", "prefill", "--lengths", "16,8K", "--budget-s", "1",
                    "--warmup", "0", "--lily-only-over-budget", "--out", str(tmp_path)])
    assert code == 0
    res = json.loads((tmp_path / "ab.json").read_text())
    ab.validate_result(res)
    r16, r8k = res["rows"]
    assert r16["status"] == "ok" and r16["ratio"] == pytest.approx(1000.0)
    assert r8k["status"] == "lily_only" and r8k["ratio"] is None
    assert r8k["arms"]["stock"]["rounds"] == [] and len(r8k["arms"]["lily"]["rounds"]) == 2
    assert r8k["stock_predicted_tok_s"] == pytest.approx(100.0)
    assert res["summary"]["prefill"]["rows_lily_only"] == 1
    md = (tmp_path / "ab.md").read_text()
    assert "not run (predicted 100.0)" in md and "~1000.0 vs predicted" in md
    bad = json.loads(json.dumps(res))
    bad["rows"][1]["arms"]["stock"]["rounds"] = [r16["arms"]["stock"]["rounds"][0]]
    with pytest.raises(ValueError, match="stock rounds"):
        ab.validate_result(bad)
    # without the flag the same row is not run at all
    code = ab.main([str(FIXTURE), "--sweeps", "prefill", "--lengths", "16,8K", "--budget-s", "1",
                    "--warmup", "0", "--out", str(tmp_path / "b")])
    rows = json.loads((tmp_path / "b" / "ab.json").read_text())["rows"]
    assert rows[1]["status"] == "not_run" and rows[1]["arms"]["lily"]["rounds"] == []


def test_parse_lengths_and_prompt_ids():
    from mlx_lily.bench import ab

    assert ab.parse_lengths("256,1K,2k,128K") == [256, 1024, 2048, 131072]
    with pytest.raises(ValueError):
        ab.parse_lengths("12x")
    a = ab.synthetic_ids(500, 100, [0, 5, 99], seed=3)
    b = ab.synthetic_ids(500, 100, [0, 5, 99], seed=3)
    assert (a == b).all() and a.max() < 100 and not set(a.tolist()) & {0, 5, 99}
    hi, exclude = ab.vocab_bounds({"text_config": {"vocab_size": 248320}})
    assert hi == 248044 and exclude == []


def test_copy_cache_is_independent():
    import mlx.core as mx
    import mlx_lm
    from mlx_lily.bench import ab

    model, _ = mlx_lm.load(str(FIXTURE))
    ids = list(range(10, 30))
    ctx = ab.build_context(model, ids, 2048)
    before = [mx.array(a) for c in ctx for a in (c.state[:2] if hasattr(c, "offset") else c.state[0])]
    offsets = [getattr(c, "offset", None) for c in ctx]
    c2 = ab.copy_cache(ctx)
    assert [type(c) for c in c2] == [type(c) for c in ctx]
    ab.measure_decode(model, c2, 7, 3)
    after = [a for c in ctx for a in (c.state[:2] if hasattr(c, "offset") else c.state[0])]
    assert [getattr(c, "offset", None) for c in ctx] == offsets
    assert all(mx.array_equal(x, y).item() for x, y in zip(before, after))
    assert [getattr(c, "offset", None) for c in c2] != offsets


def test_primitive_count_smoke(tmp_path):
    from mlx_lily.bench import primitives

    out = tmp_path / "prim.json"
    assert primitives.main([str(FIXTURE), "--context", "16", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["n_layers"] == 4
    for arm in ("stock", "lily"):
        a = r["arms"][arm]
        assert a["step"]["total"] > a["forward"]["total"] > 50
        assert a["per_layer_step"] == pytest.approx(a["step"]["total"] / 4)
        assert sum(a["step"]["by_label"].values()) == a["step"]["total"]
        assert any(k.startswith("Quantized") or k.startswith("Gather") for k in a["step"]["by_label"])


def test_primitive_count_traced_kernel_path(tmp_path):
    """``--trace-backend metal`` records Lily's step on the Metal kernel path on a machine
    without Metal: custom kernels replace most of stock's primitives, nothing is
    evaluated, and the forced backend is gone afterwards."""
    from mlx_lily import backend
    from mlx_lily.bench import primitives

    out = tmp_path / "prim.json"
    assert primitives.main([str(FIXTURE), "--context", "16", "--trace-backend", "metal",
                            "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    lily, stock = r["arms"]["lily"], r["arms"]["stock"]
    assert lily["traced_backend"] == "metal"
    assert lily["step"]["by_label"].get("CustomKernel", 0) >= 4 * 4
    assert "CustomKernel" not in stock["step"]["by_label"]
    assert lily["step"]["total"] < stock["step"]["total"] / 2
    assert lily["build_ms_median"] > 0
    assert backend.current_backend() == "cpu"


def test_tracing_backend_rejects_unknown_and_restores():
    from mlx_lily import backend

    with pytest.raises(ValueError, match="expected 'metal' or 'cuda'"):
        with backend.tracing_backend("vulkan"):
            pass
    with backend.tracing_backend("metal"):
        assert backend.current_backend() == "metal"
        with backend.tracing_backend("cuda"):
            assert backend.current_backend() == "cuda"
        assert backend.current_backend() == "metal"
    assert backend.current_backend() == "cpu"


def test_gate_fp32_anchor():
    """The fp32 anchor accepts a Lily that is as close to fp32 as stock (here: identical),
    even when the fixed thresholds are made impossible, and still refuses a wrong Lily;
    the model's own parameter arrays are restored by identity."""
    from mlx.utils import tree_flatten

    from mlx_lily.bench import ab

    import mlx_lily

    target = ab.load_target(synthetic="tiny")
    mlx_lily.prepare_model(target.model)  # the Lily arm's one-time re-layout, done up front
    before = {k: id(v) for k, v in tree_flatten(target.model.parameters())}
    ids = list(range(5, 21))
    strict = dict(rel_tol=-1.0, top1_min=1.01, greedy_tokens=2)
    g = ab.correctness_gate(target, ids, ids[:4], **strict)
    assert g["fp32_anchor"]["passed"] and g["passed"]
    assert g["fp32_anchor"]["lily_rel_to_fp32"] == g["fp32_anchor"]["stock_rel_to_fp32"]
    bad = ab.correctness_gate(target, ids, ids[:4], inject_wrong=True, **strict)
    assert not bad["passed"] and not bad["fp32_anchor"]["passed"]
    none = ab.correctness_gate(target, ids, ids[:4], anchor="none", **strict)
    assert not none["passed"] and none["fp32_anchor"] is None
    assert {k: id(v) for k, v in tree_flatten(target.model.parameters())} == before


def test_git_info_falls_back_to_the_stamped_revision(monkeypatch):
    """Where the installed copy is no git checkout (GPU machines), the commit comes from
    ``MLX_LILY_TREE_REV`` (``<sha>`` or ``<sha>+dirty``); a checkout's own git wins."""
    from mlx_lily.bench import ab

    real = ab.git_info()
    monkeypatch.setenv(ab.TREE_REV_ENV, "abc123+dirty")
    if real["commit"]:  # this checkout's own git wins
        assert ab.git_info() == real
    monkeypatch.setattr(ab.subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(OSError()))
    assert ab.git_info() == {"commit": "abc123", "dirty": True, "source": ab.TREE_REV_ENV}
    monkeypatch.setenv(ab.TREE_REV_ENV, "abc123")
    assert ab.git_info()["dirty"] is False
    monkeypatch.delenv(ab.TREE_REV_ENV)
    assert ab.git_info() == {"commit": None, "dirty": None}


def test_round_orders_and_drift():
    from mlx_lily.bench import ab

    assert ab.round_orders(3) == [("stock", "lily"), ("lily", "stock"), ("stock", "lily")]
    with pytest.raises(ValueError, match="at least 2"):
        ab.round_orders(1)
    assert ab._drift(100.0, 110.0) == pytest.approx(10 / 105)
    # a first round carrying one-time cost: the median of three ignores it
    row = ab._new_row("prefill", 4096)
    for arm, vals in (("stock", [200.0, 260.0, 262.0]), ("lily", [900.0, 10000.0, 10200.0])):
        row["arms"][arm]["rounds"] = [{"tok_s": v, "peak_memory_bytes": 1} for v in vals]
    ab._finish_row(row)
    assert row["arms"]["lily"]["tok_s"] == 10000.0 and row["arms"]["stock"]["tok_s"] == 260.0
    assert row["ratio"] == pytest.approx(10000.0 / 260.0)
    assert "drift>3%:lily" in row["flags"]


def test_rounds_option_rejects_one(capsys):
    from mlx_lily.bench import ab

    with pytest.raises(SystemExit):
        ab.main(["--synthetic", "tiny", "--rounds", "1"])
    assert "--rounds must be at least 2" in capsys.readouterr().err


def test_three_rounds_median_end_to_end(tmp_path, monkeypatch):
    """--rounds 3 on the fixture with faked prefill timings in which every arm's first round
    at a length is 10x slower: the row's figure is the median (the warm one), the order
    alternates, and the result validates with three rounds per arm."""
    from mlx_lily.bench import ab

    arm_now, seen = {}, set()
    orig_ctx = ab.arm_context

    def ctx(arm, *a, **k):
        arm_now["arm"] = arm
        return orig_ctx(arm, *a, **k)

    def fake_prefill(model, ids, step):
        key = (arm_now["arm"], len(ids))
        per_tok = (1e-2 if arm_now["arm"] == "stock" else 1e-4) * (1 if key in seen else 10)
        seen.add(key)
        dt = len(ids) * per_tok
        return {"seconds": dt, "tok_s": len(ids) / dt, "peak_memory_bytes": 1 << 20,
                "first_token": 0}

    monkeypatch.setattr(ab, "arm_context", ctx)
    monkeypatch.setattr(ab, "measure_prefill", fake_prefill)
    code = ab.main([str(FIXTURE), "--sweeps", "prefill", "--lengths", "16", "--rounds", "3",
                    "--warmup", "0", "--out", str(tmp_path)])
    assert code == 0
    res = json.loads((tmp_path / "ab.json").read_text())
    ab.validate_result(res)
    assert res["settings"]["rounds"] == 3
    (row,) = res["rows"]
    for arm in ("stock", "lily"):
        assert [r["round"] for r in row["arms"][arm]["rounds"]] == [0, 1, 2]
    assert [r["position"] for r in row["arms"]["stock"]["rounds"]] == [0, 1, 0]
    assert row["arms"]["stock"]["tok_s"] == pytest.approx(100.0)
    assert row["arms"]["lily"]["tok_s"] == pytest.approx(1e4)
    assert row["ratio"] == pytest.approx(100.0)
    assert "3 rounds per row" in (tmp_path / "ab.md").read_text()
    bad = copy.deepcopy(res)
    bad["rows"][0]["arms"]["lily"]["rounds"].pop()
    with pytest.raises(ValueError, match="rounds"):
        ab.validate_result(bad)


def test_decode_timeline_off_cuda_is_none():
    """--decode-timeline needs the GPU timer: elsewhere the round carries None."""
    from mlx_lily.bench import ab, gpu_clock

    if gpu_clock.available():
        pytest.skip("CUDA backend present")
    assert ab._decode_timeline(None, [], 0) is None


def test_missing_local_checkpoint_is_named(tmp_path):
    """A checkpoint written as a local path that does not exist fails with the folder's
    name, before mlx-lm would turn it into a hub lookup; hub ids stay hub ids."""
    from mlx_lily.bench import ab as abm

    for p in (str(tmp_path / "no_such_ckpt"), "./no_such_ckpt", "../x/no_such_ckpt", "a/b/c"):
        with pytest.raises(FileNotFoundError, match="does not exist"):
            abm.load_target(p)
    assert not abm._looks_local("mlx-community/Qwen3.6-35B-A3B-4bit")
    assert not abm._looks_local("tiny")


def test_gate_authority_decides_on_a_trained_checkpoint(tmp_path):
    """With a trained authority checkpoint the gate's verdict is that model's teacher-forced
    check: a correct Lily passes even when the fixed thresholds on the target are made
    impossible, a wrong Lily fails, and no fp32 anchor runs; ``resolve`` finds the cached
    model only on GPU backends and names a folder without a reference."""
    from mlx_lily.bench import ab, authority

    target = ab.load_target(synthetic="tiny")
    ids = list(range(5, 21))
    strict = dict(rel_tol=-1.0, top1_min=1.01, greedy_tokens=2)
    g = ab.correctness_gate(target, ids, ids[:4], authority=FIXTURE, **strict)
    a = g["authority"]
    assert g["passed"] and a["passed"] and g["fp32_anchor"] is None
    assert not all(g["checks"].values())  # the target's own checks are still measured
    assert a["metrics"]["top1_agreement"] >= authority.THRESHOLDS["top1_agreement_min"]
    assert a["feed"]["context"] + a["feed"]["decode_steps"] < 320  # shrunk to the reference
    assert a["metrics"]["positions"] == a["feed"]["measure_prefill"] + a["feed"]["decode_steps"]
    bad = ab.correctness_gate(target, ids, ids[:4], authority=FIXTURE, inject_wrong=True, **strict)
    assert not bad["passed"] and not bad["authority"]["passed"] and bad["fp32_anchor"] is None

    assert authority.resolve("none", "cuda") is None
    assert authority.resolve(str(FIXTURE), "cpu") == FIXTURE
    with pytest.raises(ValueError, match="numerics_reference.json"):
        authority.resolve(str(tmp_path), "cuda")


def test_gate_authority_adds_to_a_trained_target_s_own_checks():
    """A target that is not random-weight (the trained fixture's folder: no synth marker)
    keeps its own checks: with them made impossible (and no anchor) the gate fails even
    though the authority passes; a NaN Lily never reaches the authority."""
    from mlx_lily.bench import ab

    target = ab.load_target(str(FIXTURE))
    assert target.identity["random_weights"] is False
    ids = list(range(5, 21))
    g = ab.correctness_gate(target, ids, ids[:4], authority=FIXTURE, anchor="none",
                            rel_tol=-1.0, top1_min=1.01, greedy_tokens=2)
    assert g["authority"]["passed"] and not g["passed"]
    ok = ab.correctness_gate(target, ids, ids[:4], authority=FIXTURE, greedy_tokens=2)
    assert ok["passed"] and ok["authority"]["passed"]


def _authority_folder(tmp_path, ids, vocab=100, summary=True, preset="production-width"):
    import json as _json

    from mlx_lily.bench import authority

    (tmp_path / authority.REFERENCE_FILE).write_text(_json.dumps({"ids": ids}))
    (tmp_path / "config.json").write_text(_json.dumps({"text_config": {"vocab_size": vocab}}))
    if summary:
        (tmp_path / "summary.json").write_text(_json.dumps(
            {"schema": authority.TRAINER_SCHEMA, "preset": preset, "steps_done": 3}))
    return tmp_path


def test_gate_authority_auto_uses_the_cached_model_on_gpu_only(tmp_path, monkeypatch):
    from mlx_lily.bench import authority

    monkeypatch.setattr(authority, "default_checkpoint", lambda: tmp_path)
    assert authority.resolve("auto", "cuda") is None  # nothing cached yet
    _authority_folder(tmp_path, list(range(70)))
    assert authority.resolve("auto", "cuda") == tmp_path
    assert authority.resolve("auto", "metal") == tmp_path
    assert authority.resolve("auto", "cpu") is None
    assert authority.reference_ids(tmp_path) == list(range(70))
    seen = []
    _authority_folder(tmp_path, list(range(70)), preset="smoke")  # another recipe's model
    assert authority.resolve("auto", "cuda", log=seen.append) is None
    assert "preset 'smoke'" in seen[0]


def test_gate_authority_names_what_is_wrong_with_a_folder(tmp_path):
    from mlx_lily.bench import authority

    (tmp_path / "few").mkdir()
    few = _authority_folder(tmp_path / "few", list(range(10)), summary=False)
    with pytest.raises(ValueError, match="10 ids"):
        authority.resolve(str(few), "cuda")
    (tmp_path / "vocab").mkdir()
    out = _authority_folder(tmp_path / "vocab", list(range(200)), vocab=100, summary=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        authority.resolve(str(out), "cuda")
    (tmp_path / "nocfg").mkdir()
    (tmp_path / "nocfg" / authority.REFERENCE_FILE).write_text('{"ids": [1]}')
    with pytest.raises(ValueError, match="config.json not found"):
        authority.resolve(str(tmp_path / "nocfg"), "cuda")
    # no weights: the gate's authority fails with the reason instead of raising
    (tmp_path / "noweights").mkdir()
    nw = _authority_folder(tmp_path / "noweights", list(range(70)), summary=False)
    r = authority.authority_gate(nw, lambda m: __import__("contextlib").nullcontext(m),
                                 log=lambda *_: None)
    assert r["passed"] is False and r["error"] and r["metrics"] is None
