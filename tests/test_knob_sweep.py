"""benchmarks/gpu/knob_sweep.py: parsing groups, the pick rule, and one end-to-end run on the
tiny checkpoint (CPU: Lily steps aside, the sweep's own code still runs)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _ckpt_fixtures import tiny_ckpt  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
_PATH = ROOT / "benchmarks" / "gpu" / "knob_sweep.py"
_spec = importlib.util.spec_from_file_location("knob_sweep", _PATH)
ks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ks)


def test_parse_group_adds_default_first():
    g = ks.parse_group("512:128:2,4096:64=MLX_LILY_GDN_BATCH_FOLD=4 MLX_LILY_DECODE_PF=2,"
                       "MLX_LILY_ATTN_FIXED_BLOCK=128")
    assert g["cases"] == [(512, 128, 2), (4096, 64, 1)]
    assert g["settings"] == ["default", "MLX_LILY_GDN_BATCH_FOLD=4",
                             "MLX_LILY_DECODE_PF=2,MLX_LILY_ATTN_FIXED_BLOCK=128"]
    assert ks.parse_setting(g["settings"][2]) == {"MLX_LILY_DECODE_PF": "2",
                                                  "MLX_LILY_ATTN_FIXED_BLOCK": "128"}
    assert ks.parse_setting("MLX_LILY_MOE_FUSED_RPW=2,2,1,MLX_LILY_DECODE_PF=2") == {
        "MLX_LILY_MOE_FUSED_RPW": "2,2,1", "MLX_LILY_DECODE_PF": "2"}


@pytest.mark.parametrize("text", [
    "512:128:2", "512:128:2=", "512=default", "1:2=FOO=1", "1:2=MLX_LILY_X",
    "1:2=2,MLX_LILY_DECODE_PF=1",
    "1:2=MLX_LILY_NO_SUCH_KNOB=1",            # not a knob or setting
    "1:2=MLX_LILY_ATTN_FIXED_BLOCK=100",      # a value the knob does not accept
    "1:2=MLX_LILY_DECODE_PF=2,",              # a trailing comma joins the value: "2,"
    "1:2=MLX_LILY_MOE_FUSED_RPW=2,2",
])
def test_parse_group_rejects(text):
    with pytest.raises(ValueError):
        ks.parse_group(text)


def test_user_settings_are_accepted():
    assert ks.parse_setting("MLX_LILY_DISABLE=moe_fused") == {"MLX_LILY_DISABLE": "moe_fused"}


def test_round_order_balances_positions():
    assert ks.round_order(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert ks.round_order(["a", "b", "c"], 1) == ["c", "b", "a"]
    assert ks.round_order(["a", "b", "c"], 2) == ["a", "b", "c"]
    pos = {x: ks.round_order(["a", "b", "c", "d"], 0).index(x)
           + ks.round_order(["a", "b", "c", "d"], 1).index(x) for x in "abcd"}
    assert set(pos.values()) == {3}


def test_apply_env_sets_one_setting_and_clears_the_others():
    env = {"MLX_LILY_DECODE_PF": "2", "MLX_LILY_KERNELS": "all", "HOME": "/h"}
    names = {"MLX_LILY_DECODE_PF", "MLX_LILY_ATTN_FIXED_BLOCK"}
    ks.apply_env({"MLX_LILY_ATTN_FIXED_BLOCK": "64"}, names, env)
    assert env == {"MLX_LILY_ATTN_FIXED_BLOCK": "64", "MLX_LILY_KERNELS": "all", "HOME": "/h"}
    ks.apply_env({}, names, env)
    assert env == {"MLX_LILY_KERNELS": "all", "HOME": "/h"}


def _cell(*tps):
    return {"trials": [{"generation_tps": t} for t in tps]}


def test_summarize_and_pick():
    g = {"cases": [(1, 1, 1), (2, 2, 2)], "settings": ["default", "A=1", "B=1", "C=1"]}
    cells = {"1:1:1": {"default": _cell(100, 100), "A=1": _cell(110), "B=1": _cell(150),
                       "C=1": _cell(101)},
             "2:2:2": {"default": _cell(200), "A=1": _cell(220), "B=1": _cell(190),
                       "C=1": _cell(203)}}
    s = ks.summarize(g, cells)
    assert s["ratio_to_default"]["default"] == 1.0
    assert s["ratio_to_default"]["A=1"] == pytest.approx(1.1, abs=1e-4)
    assert s["worst_case_ratio"]["B=1"] == pytest.approx(0.95, abs=1e-4)
    # B has the highest mean ratio but loses one case by 5 %: A is kept
    assert s["pick"] == "A=1"
    # C gains 1-1.5 %: below MIN_GAIN, so default stays
    assert ks.pick_setting({"C=1": 1.012}, {"C=1": 1.01}) == "default"
    assert ks.pick_setting({"A=1": None}, {"A=1": None}) == "default"


def test_end_to_end_on_tiny_checkpoint(tiny_ckpt, tmp_path):  # noqa: F811
    env = dict(os.environ, MLX_LILY_QUALIFY="0")
    r = subprocess.run([sys.executable, str(_PATH), "--model", str(tiny_ckpt),
                        "--group", "12:3:1,12:3:2=MLX_LILY_GDN_BATCH_FOLD=2",
                        "--trials", "1", "--rounds", "2", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "knob_sweep.json").read_text())
    (g,) = res["groups"]
    assert g["settings"] == ["default", "MLX_LILY_GDN_BATCH_FOLD=2"]
    for case in ("12:3:1", "12:3:2"):
        for s in g["settings"]:
            cell = g["cells"][case][s]
            assert "errors" not in cell, cell
            assert len(cell["trials"]) == 2 and all(t["generation_tps"] > 0 for t in cell["trials"])
    assert g["pick"] in g["settings"]
    picks = (tmp_path / "picks.env").read_text()
    assert picks == ("" if g["pick"] == "default" else "MLX_LILY_GDN_BATCH_FOLD=2\n")
