"""The decode timeline's bookkeeping (``mlx_lily.bench.timeline``), off a GPU: the GPU
timer kernels are replaced by host clock reads, so every figure is a host figure and the
relations between them must hold."""
import time

import mlx.core as mx
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
    for s in r["steps_ms"]:
        assert min(s["build"], s["dispatch"], s["wait"]) >= 0
        # one token's interval holds its build, dispatch and wait (plus loop overhead)
        assert s["interval"] >= s["build"] + s["dispatch"] + s["wait"] - 1e-3
    assert abs(r["clock_offset_ns"]) < 5e8  # one clock here: offset ~0


def test_run_loop_refuses_without_timer():
    if gpu_clock.available():
        pytest.skip("CUDA backend present")
    with pytest.raises(RuntimeError, match="CUDA"):
        timeline.calibrate()
