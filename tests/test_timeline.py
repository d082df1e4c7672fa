"""The decode timeline's bookkeeping (``mlx_lily.bench.timeline``), off a GPU: the GPU
timer kernels are replaced by host clock reads, so every figure is a host figure and the
relations between them must hold."""
import time

import mlx.core as mx
import numpy as np
import pytest

from mlx_lily.bench import gpu_clock, timeline


def _now():
    t = time.time_ns()
    return mx.array([t & 0xFFFFFFFF, t >> 32], dtype=mx.uint32)


@pytest.fixture
def host_clock(monkeypatch):
    monkeypatch.setattr(gpu_clock, "available", lambda: True)
    monkeypatch.setattr(gpu_clock, "spin_us", lambda x, us: (x + 0, _now()))
    monkeypatch.setattr(gpu_clock, "stamp", lambda *deps: _now())


def test_run_loop_records(host_clock):
    from mlx_lily.bench.ab import build_context, copy_cache, load_target

    t = load_target(synthetic="tiny")
    ctx = build_context(t.model, list(range(5, 40)), 16)
    r = timeline.run_loop(t.model, copy_cache(ctx), 7, steps=5, warmup=2)
    assert set(r["median_ms"]) == set(timeline.KEYS)
    assert len(r["steps_ms"]) == 5 and r["tok_s"] > 0
    tol = 0.5  # ms: the calibration's bracket around a host-clock "GPU" read
    for s in r["steps_ms"]:
        assert min(s["build"], s["dispatch"], s["wait"]) >= 0
        # one token's interval holds its build, dispatch and wait (plus loop overhead)
        assert s["interval"] >= s["build"] + s["dispatch"] + s["wait"] - 1e-3
        # the stand-in stamps are read while the step is built: its start and end lie
        # inside the build, before the dispatch, after the previous step's end
        assert -tol <= s["gpu_busy"] <= s["build"] + tol
        assert -s["build"] - tol <= s["start_after_dispatch_begin"] <= tol
        assert s["end_after_dispatch_end"] <= tol
        assert s["gpu_idle_before"] >= -tol
    assert abs(r["clock_offset_ns"]) < 5e8  # one clock here: offset ~0

    from mlx_lily.bench.ab import _decode_timeline

    m = _decode_timeline(t.model, ctx, 7)  # what the A/B's --decode-timeline records
    assert set(m) == set(timeline.KEYS) | {"clock_align_err_ms"}


@pytest.mark.parametrize("gc_mode", ["on", "off", "freeze"])
def test_run_loop_gc_modes_and_cpu_times(host_clock, gc_mode):
    """The collector mode applies during the loop only (a model call that leaves cyclic
    garbage: collections counted unless off) and each step's CPU time of a phase lies
    within its wall time."""
    import gc

    from mlx_lily.bench.ab import build_context, copy_cache, load_target

    t = load_target(synthetic="tiny")
    ctx = build_context(t.model, list(range(5, 40)), 16)

    def cyclic_model(*args, **kw):
        for _ in range(3000):
            x: list = []
            x.append(x)
        return t.model(*args, **kw)

    assert gc.isenabled()
    r = timeline.run_loop(cyclic_model, copy_cache(ctx), 7, steps=4, warmup=1,
                          gc_mode=gc_mode)
    assert gc.isenabled() and gc.get_freeze_count() == 0
    assert r["gc_mode"] == gc_mode and len(r["gc_collections"]) == 3
    if gc_mode == "off":
        assert r["gc_collections"] == [0, 0, 0]
    else:
        assert r["gc_collections"][0] > 0
    for s in r["steps_ms"]:
        for phase in ("build", "dispatch"):
            assert 0 <= s[f"{phase}_cpu"] <= s[phase] + 1.0  # ms: clock granularity
    with pytest.raises(ValueError, match="gc_mode"):
        timeline.run_loop(t.model, copy_cache(ctx), 7, steps=1, warmup=0, gc_mode="later")


def test_calibrate_refuses_without_timer():
    if gpu_clock.available():
        pytest.skip("CUDA backend present")
    with pytest.raises(RuntimeError, match="CUDA"):
        timeline.calibrate()


def test_cli_host_profile(host_clock, tmp_path):
    """--host-profile N: after the rounds, each arm's N profiled steps, written per arm; the
    profile covers the model's forward (the loop's build)."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "decode_timeline.py"
    spec = importlib.util.spec_from_file_location("decode_timeline_cli", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "tl"
    assert mod.main(["--synthetic", "tiny", "--context", "24", "--steps", "3", "--warmup", "1",
                     "--rounds", "1", "--arms", "stock,lily", "--host-profile", "5",
                     "--out", str(out)]) == 0
    assert (out / "decode_timeline.json").exists()
    for arm in ("stock", "lily"):
        text = (out / f"host_profile_{arm}.txt").read_text()
        assert "function calls" in text and "__call__" in text


@pytest.mark.parametrize("spec", ["x:NOEQUALS", ":A=1", "lily:A=1"])
def test_cli_rejects_bad_arm_env(spec):
    """A malformed or clashing --arm-env stops before any model is loaded."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "decode_timeline.py"
    r = subprocess.run([sys.executable, str(script), "--synthetic", "tiny", "--arm-env", spec],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--arm-env" in r.stderr


def test_prefill_run_chunks(host_clock):
    """generate_step's prefill split: all tokens but the last in chunks, then the last
    step; host phases non-negative, the stand-in GPU span inside the build; the A/B's
    --prefill-timeline records it."""
    from mlx_lily.bench.ab import _prefill_timeline, load_target

    t = load_target(synthetic="tiny")
    ids = list(range(5, 45))  # 40 tokens: chunks of 16, 16, 7, then the last token
    r = timeline.prefill_run(t.model, ids, 16)
    assert [c["tokens"] for c in r["chunks"]] == [16, 16, 7, 1]
    assert r["total_ms"] > 0 and r["tok_s"] > 0
    tol = 0.5
    for c in r["chunks"]:
        assert set(c) == set(timeline.PREFILL_KEYS)
        assert min(c["build"], c["dispatch"], c["wait"]) >= 0
        assert -tol <= c["gpu_busy"] <= c["build"] + tol
        assert c["start_after_dispatch_begin"] <= tol
        assert c["host_after_gpu_end"] >= -tol
        assert c["clear"] >= 0
    assert r["chunks"][-1]["clear"] == 0
    assert sum(c["build"] + c["dispatch"] + c["wait"] for c in r["chunks"]) <= r["total_ms"]
    with pytest.raises(ValueError, match="empty"):
        timeline.prefill_run(t.model, [], 16)
    assert [c["tokens"] for c in _prefill_timeline(t.model, ids[:5], 16)["chunks"]] == [4, 1]
    # the A/B hands over a list of numpy ints (an H200 run once failed on them)
    np_ids = list(np.arange(5, 12, dtype=np.int32))
    assert [c["tokens"] for c in _prefill_timeline(t.model, np_ids, 16)["chunks"]] == [6, 1]


@pytest.mark.parametrize("script", ["gpu/long_context_bench.py", "gpu/precompile_bench.py",
                                    "decode_profile.py", "gpu/decode_timeline.py",
                                    "gpu/dispatch_bench.py", "startup.py"])
def test_gpu_scripts_explain_and_exit_off_gpu(script, tmp_path):
    """Without a GPU backend the GPU benchmarks print why they measure nothing and exit 0
    at once (a new user ran decode_profile.py for 300 s on a CPU before this)."""
    import subprocess
    import sys
    from pathlib import Path

    from mlx_lily.backend import current_backend

    if current_backend() != "cpu":
        pytest.skip("a GPU backend is present")
    path = Path(__file__).resolve().parents[1] / "benchmarks" / script
    args = {"decode_profile.py": ["--synthetic", "tiny"],
            "gpu/decode_timeline.py": ["--synthetic", "tiny"],
            "gpu/dispatch_bench.py": ["--out", str(tmp_path)]}.get(script, [])
    r = subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "nothing measured" in r.stdout, (r.stdout, r.stderr)


def test_arm_env_helpers(monkeypatch):
    """The benchmarks' --arm-env parsing and per-arm environment switch (shared by
    decode_profile.py and decode_timeline.py)."""
    import os

    from mlx_lily.bench import env_override, parse_arm_envs

    assert parse_arm_envs(["a:X=1", "b:Y="], taken=("lily",)) == {"a": ("X", "1"), "b": ("Y", "")}
    for bad in (["a:X"], [":X=1"], ["aX=1"], ["a:=1"], ["lily:X=1"], ["a:X=1", "a:Y=2"]):
        with pytest.raises(ValueError, match="--arm-env"):
            parse_arm_envs(bad, taken=("lily",))
    monkeypatch.delenv("LILY_T_VAR", raising=False)
    monkeypatch.setenv("LILY_T_OLD", "0")
    with env_override("LILY_T_VAR", "1"), env_override("LILY_T_OLD", "2"), env_override(None):
        assert os.environ["LILY_T_VAR"] == "1" and os.environ["LILY_T_OLD"] == "2"
    assert "LILY_T_VAR" not in os.environ and os.environ["LILY_T_OLD"] == "0"


def test_prefill_bench_variants(host_clock, tmp_path, monkeypatch):
    """``benchmarks/gpu/prefill_bench.py`` on the tiny preset with host clocks: every
    variant runs, the cache limit is restored, rows carry the figures."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "prefill_bench.py"
    spec = importlib.util.spec_from_file_location("prefill_bench", path)
    pb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pb)
    limit = mx.set_cache_limit(123 << 20)
    try:
        assert pb.main(["--preset", "tiny", "--lengths", "40", "--rounds", "1",
                        "--out", str(tmp_path)]) == 0
        assert mx.set_cache_limit(limit) == 123 << 20
    finally:
        mx.set_cache_limit(limit)
    import json
    res = json.loads((tmp_path / "prefill_bench.json").read_text())
    assert [r["variant"] for r in res["rows"]] == list(pb.VARIANTS)
    for r in res["rows"]:
        assert r["tok_s_median"] > 0 and len(r["runs"]) == 1
        assert sum(c["tokens"] for c in r["runs"][0]["chunks"]) == 40
