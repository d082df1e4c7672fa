"""``benchmarks/gpu/phase_trace.py`` on the CPU: the wrapper that adds the ``trace`` output,
and the phase arithmetic on hand-made stamps (the kernels' stamps run only on a GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"))
import phase_trace as P  # noqa: E402


def test_traced_adds_one_trace_output_per_block():
    seen = {}

    def kernel(**kw):
        seen.update(kw)
        return [mx.zeros(s, d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"])]

    t = P.Traced(kernel)
    out = t(inputs=[], grid=(4 * 128, 3, 1), threadgroup=(128, 1, 1),
            output_shapes=[(5,)], output_dtypes=[mx.float32])
    assert len(out) == 1 and out[0].shape == (5,)
    assert seen["output_shapes"][-1] == (4 * 3 * P.SLOTS,)
    assert seen["output_dtypes"][-1] == mx.uint64
    assert len(t.traces) == 1 and t.traces[0].shape == (4 * 3 * P.SLOTS,)


def _moe_trace(t0):
    """Stamps (ns) of a launch with 2 router, 3 gate+up and 2 down tiles: router tiles
    done by t0+3000; gate+up waits over at t0+3500.., down waits at t0+9000; one gate+up
    block starts after the router phase (a later wave)."""
    rows = []
    for tick in range(7):
        start = t0 + (4000 if tick == 4 else 100 * tick)
        if tick < 2:  # router: 0 start, 1 ticket, 2 normed, 4 math done, 5 left
            rows.append([start, start + 50, start + 1000, 0, t0 + 3000 - 100 * tick,
                         t0 + 3100, tick, tick])
        elif tick < 5:
            w = t0 + 3500 + 100 * (tick - 2)
            rows.append([start, start + 50, w, w + 1500, w + 2500, w + 2600, tick, tick])
        else:
            w = t0 + 9000 + 100 * (tick - 5)
            rows.append([start, start + 50, w, w + 1000, w + 3000, w + 3100, tick, tick % 3])
    return np.array(rows, dtype=np.int64)


def test_moe_phases_from_stamps():
    r, t0, end = P._moe_launch(_moe_trace(10_000), (2, 3, 2))
    assert t0 == 10_000 and end == 10_000 + 9100 + 3100
    assert r["router_done_max"] == 3.0
    assert r["gate_up_wait_over_min"] == 3.5 and r["gate_up_wait_over_max"] == 3.7
    assert r["gate_up_inputs_us_median"] == 1.5 and r["gate_up_math_us_median"] == 1.0
    assert r["gate_up_late_starts"] == 1 and r["down_late_starts"] == 0
    assert r["down_done_max"] == 9.1 + 3.0 and r["end"] == 12.2
    assert r["sms"] == 5


def test_summary_takes_medians_and_gaps_between_launches():
    launches = np.stack([_moe_trace(10_000), _moe_trace(30_000)])
    s = P._summarise([{"gpu_s": 2e-5, "host_covered": True, "trace": launches}],
                     lambda tr: P._moe_launch(tr, (2, 3, 2)))
    assert s["launches"] == 2 and s["gpu_us_per_launch"] == [10.0]
    assert s["gap_us_median"] == (30_000 - (10_000 + 12_200)) / 1e3
    assert s["phases_us_median"]["end"] == 12.2
    assert s["end_us_spread"]["max"] == 12.2 and s["end_us_spread"]["p10"] == 12.2
    assert s["gap_us_spread"]["p50"] == s["gap_us_median"]


def test_gdn_phases_from_stamps():
    t0 = 1_000_000
    # 2 heads x 2 parts: part 1 of each head is last (slot 3), head 1's runs the sum
    tr = np.array([
        [t0, t0 + 500, t0 + 3000, 0, 0, 0, 0, 0],
        [t0 + 100, t0 + 600, t0 + 3200, t0 + 3400, t0 + 6400, t0 + 9400, 0, 1],
        [t0 + 50, t0 + 550, t0 + 3100, 0, 0, 0, 0, 2],
        [t0 + 150, t0 + 650, t0 + 3300, t0 + 3500, t0 + 6600, t0 + 9800, t0 + 11800, 3],
    ], dtype=np.int64)
    r, start, end = P._gdn_launch(tr)
    assert start == t0 and end == t0 + 11800
    assert r["proj_done_max"] == 3.3 and r["step_start_max"] == 3.5
    assert r["step_us_median"] == 3.05 and r["outproj_us_median"] == 3.1
    assert r["sum_us"] == 2.0 and r["end"] == 11.8 and r["sms"] == 4
