"""GPU benchmark scripts that have a CPU smoke mode run end to end here (small dims, the
Metal emulator posing as the GPU): their code paths do not rot between GPU runs."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_moe_decode_bench_emulated(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "moe_decode_bench.py"),
                        "--emulate", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((tmp_path / "moe_decode_bench.json").read_text())
    assert "errors" not in res, res.get("errors")
    assert res["backend"] == "metal"
    assert {"moe_layer", "variants", "qgemv", "routed_variants", "norm_gemv_split"} <= set(res)
    assert all(row["max_rel_diff"] == 0 for row in res["norm_gemv_split"])  # same rounding
    assert len(res["routed_variants"]) == 14  # 7 gate+up shapes, 7 down shapes


def test_qmm_dequant_bench_small(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "qmm_dequant_bench.py"),
                        "--small", "--reps", "1", "--calls", "1", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((tmp_path / "qmm_dequant_bench.json").read_text())
    rows = res["rows_by_shape"]
    assert [row["shape"] for row in rows] == ["small 4-bit", "small 8-bit"]
    for row in rows:
        assert all(row[f"{k}_us"] > 0 for k in ("qmm", "deq_mm", "deq", "mm"))
        assert row["max_rel_err"] < 0.1  # bf16-rounded dequantized weights vs qmm
    se = res["shared_expert_mlp"]
    assert se["served"] is False  # CPU: the stock module on both sides
    assert se["bit_identical"] is True and se["stock_us"] > 0 and se["lily_us"] > 0
