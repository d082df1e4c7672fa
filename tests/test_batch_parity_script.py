"""benchmarks/gpu/batch_parity.py: the onset of a batch-vs-alone difference, and one run with a
request joining on the tiny checkpoint (CPU: Lily steps aside; the script's code runs)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from _ckpt_fixtures import tiny_ckpt  # noqa: F401

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu" / "batch_parity.py"
_spec = importlib.util.spec_from_file_location("batch_parity", _PATH)
bp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bp)


def test_onset_finds_the_first_step_that_differs():
    a = [np.zeros(4, np.float32) for _ in range(5)]
    b = [x.copy() for x in a]
    assert bp.onset(a, b, [1, 2, 3, 4, 5], [1, 2, 3, 4, 5]) == (-1, [0.0] * 5)
    b[2][1] = 0.25  # the arithmetic parts at step 2; the tokens still agree
    first, per = bp.onset(a, b, [1, 2, 3, 4, 5], [1, 2, 3, 4, 5])
    assert first == 2 and per == [0.0, 0.0, 0.25, 0.0, 0.0]
    # tokens part at step 1: later steps were fed different tokens and are not compared;
    # identical log-probabilities up to there cannot hide the differing token
    first, per = bp.onset(a, b, [1, 2, 3, 4, 5], [1, 9, 3, 4, 5])
    assert first == 1 and per == [0.0, 0.0]
    assert bp.onset([], [], [1, 2], [1, 3]) == (1, [])
    b[0][0] = float("nan")
    assert bp.onset(a, b, [1], [1])[0] == 0


def test_join_run_on_the_tiny_checkpoint(tiny_ckpt, tmp_path):  # noqa: F811
    env = dict(os.environ, MLX_LILY_QUALIFY="0")
    r = subprocess.run([sys.executable, str(_PATH), "--model", str(tiny_ckpt), "--lengths",
                        "37,5,13", "--gen", "5", "--join", "1", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    lily = json.loads((tmp_path / "batch_parity.json").read_text())["arms"]["lily"]
    assert lily["join"] == 1 and len(lily["batched"]) == 3
    assert json.loads((tmp_path / "batch_parity.json").read_text())["env"]["MLX_LILY_QUALIFY"] == "0"
    # the CPU runs mlx-lm's own code: every row equals its prompt alone, at every step
    assert lily["first_diff"] == [-1, -1, -1]
    assert lily["first_logprobs_diff_step"] == [-1, -1, -1]
    assert all(len(row) == 5 and set(row) == {0.0} for row in lily["logprobs_max_diff_per_step"])
