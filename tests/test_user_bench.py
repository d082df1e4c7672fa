"""benchmarks/user_bench.py: parsing mlx_lm.benchmark's output and the results table."""

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "user_bench.py"
_spec = importlib.util.spec_from_file_location("user_bench", _PATH)
ub = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ub)

OUTPUT = """Running warmup..
Timing with prompt_tokens=512, generation_tokens=128, batch_size=1.
Trial 1:  prompt_tps=7000.500, generation_tps=260.000, peak_memory=21.000, total_time=1.2
Trial 2:  prompt_tps=7100.500, generation_tps=264.000, peak_memory=21.000, total_time=1.1
Averages: prompt_tps=7050.500, generation_tps=262.000, peak_memory=21.000
"""


def test_parse_output_reads_averages_and_trials():
    r = ub.parse_output(OUTPUT)
    assert r["averages"] == {"prompt_tps": 7050.5, "generation_tps": 262.0, "peak_memory": 21.0}
    assert [t["generation_tps"] for t in r["trials"]] == [260.0, 264.0]


def test_parse_output_without_averages_is_empty():
    assert ub.parse_output("Traceback ...\nRuntimeError: boom\n")["averages"] == {}


@pytest.mark.parametrize("text,want", [("512:128", (512, 128, 1)), ("4096:64:4", (4096, 64, 4))])
def test_parse_case(text, want):
    assert ub.parse_case(text) == want


@pytest.mark.parametrize("text", ["512", "a:1", "0:1", "1:2:3:4", "-1:5"])
def test_parse_case_rejects(text):
    with pytest.raises(ValueError, match="--cases"):
        ub.parse_case(text)


def test_lily_flag_only_on_lily_arm():
    stock = ub.bench_command("M", 1, 2, 3, 4, "stock", [])
    lily = ub.bench_command("M", 1, 2, 3, 4, "lily", [])
    assert "--lily" not in stock and lily[-1] == "--lily"
    assert stock[:3] == [sys.executable, "-m", "mlx_lm.benchmark"]


def test_markdown_ratio_and_error_cells():
    res = {"model": "M", "trials": 2, "device": "dev", "commit": "c",
           "versions": {"mlx": "1", "mlx_lm": "2", "mlx_lily": "3"},
           "cases": [{"prompt": 512, "gen": 128, "batch": 1, "arms": {
               "stock": ub.parse_output(OUTPUT.replace("262.000", "131.000")),
               "lily": ub.parse_output(OUTPUT)}},
               {"prompt": 4096, "gen": 128, "batch": 2, "arms": {
                   "stock": {"averages": {}, "error": "exit 1"}, "lily": ub.parse_output(OUTPUT)}}]}
    md = ub.render_markdown(res)
    assert "| 512 | 128 | 1 | 7,050.5 | 131.0 | 7,050.5 | 262.0 | 2.00x |" in md
    assert "| 4096 | 128 | 2 | error | error | 7,050.5 | 262.0 | - |" in md


def test_failed_child_is_recorded(tmp_path):
    r = ub.run_arm([sys.executable, "-c", "import sys; print('oops'); sys.exit(3)"], 30, {})
    assert r["error"] == "exit 3" and r["tail"] == ["oops"]


def test_lily_env_keeps_only_lily_variables():
    env = {"MLX_LILY_QGEMV_MMA": "1", "MLX_LILY_KERNELS": "verified", "PATH": "/bin",
           "MLX_LILY_TREE_REV": "abc"}
    assert ub.lily_env(env) == {"MLX_LILY_KERNELS": "verified", "MLX_LILY_QGEMV_MMA": "1",
                                "MLX_LILY_TREE_REV": "abc"}
