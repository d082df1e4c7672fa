"""The whole-stack decode step's replay from the previous step's results
(``decode_graph._WholeLedger``): a step whose caches hold exactly what the previous whole
step stored takes its inputs from there instead of checking and reading every cache. Its
logits must be bit-identical to the full path's at every step, including steps where the
caches were changed in between (a state replaced, a KV cache rolled back, another
sequence's caches), where the KV cache grows, and where the ledger must not be used.

Every Metal kernel runs on the emulator, with the compiled steps built as plain functions
(``decode_graph.uncompiled``: the emulator cannot run inside ``mx.compile``)."""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

import _models
import mlx_lily
from mlx_lily.patches import decode_graph as dg
from mlx_lily.testing.dispatch import emulated_metal

try:
    from mlx_lily.testing.metal_emu import available as _emu_available

    HAS_EMU = bool(_emu_available())
except Exception:  # pragma: no cover - emulator toolchain missing
    HAS_EMU = False

pytestmark = pytest.mark.skipif(not HAS_EMU, reason="Metal emulator unavailable")

PROMPT = [(i * 37 + 11) % 500 + 1 for i in range(250)]


@pytest.fixture(scope="module")
def model():
    return _models.build("qwen3_5_moe")


def _decode(model, steps, meddle=None, ledger=True):
    """Greedy logits (``np.float32 [steps, V]``) of ``steps`` one-token calls after
    ``PROMPT``, KV growth step 256 (the decode crosses it); ``meddle(i, caches)`` runs
    before step ``i`` and returns the caches to use. With ``ledger=False`` no step
    replays. Returns ``(logits, replays)``."""
    replays = []
    real = dg._replay_whole_step

    def counting(*a):
        replays.append(1)
        return real(*a)

    dg.drop_compiled_steps()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dg, "_replay_whole_step", counting)
        if not ledger:
            mp.setattr(dg, "_new_ledger", lambda *a: None)
        with emulated_metal(), dg.uncompiled(), pytest.MonkeyPatch.context() as env:
            env.setenv("MLX_LILY_COMPILE", "1")  # emulated_metal turned it off (undone first)
            env.setenv("MLX_LILY_KV_STEP", "256")
            with mlx_lily.patched(model):
                caches = {"a": make_prompt_cache(model)}
                y = model(mx.array([PROMPT]), cache=caches["a"])
                tok = int(mx.argmax(y[0, -1]).item())
                out = []
                for i in range(steps):
                    c = caches["a"] if meddle is None else meddle(i, caches)
                    y = model(mx.array([[tok]]), cache=c)
                    row = y[0, -1].astype(mx.float32)
                    out.append(np.array(row))
                    tok = int(mx.argmax(row).item())
    dg.drop_compiled_steps()
    return np.stack(out), len(replays)


def test_replayed_steps_equal_full_steps(model):
    """Plain decoding across the KV cache's growth: the same logits, bit for bit, with
    and without replays; most steps replay."""
    want, n0 = _decode(model, 10, ledger=False)
    got, n = _decode(model, 10)
    assert n0 == 0 and n >= 6
    np.testing.assert_array_equal(got, want)


def _meddler():
    """Between steps: a GDN layer's recurrent state scaled (a new array), then a second
    sequence's caches decoded once and the first resumed, then every cache rolled back
    one step to copies taken earlier (the KV offsets moved back, the GDN arrays put back)."""
    saved = {}

    def meddle(i, caches):
        c = caches["a"]
        gdn = [x for x in c if type(x).__name__ == "ArraysCache"]
        if i == 2:
            gdn[0][1] = gdn[0][1] * 0.5
        if i == 4:
            caches["b"] = copy.deepcopy(c)
            return caches["b"]
        if i == 5:
            saved["c"] = [x.offset if hasattr(x, "offset") else list(x.cache) for x in c]
        if i == 7:
            for x, held in zip(c, saved["c"]):
                if isinstance(held, int):
                    x.offset = held
                else:
                    x.cache[:] = held
        return c

    return meddle


def test_replay_sees_caches_changed_between_steps(model):
    """Caches changed between steps (a state replaced, another sequence, a roll-back that
    puts earlier arrays back): the same logits, bit for bit, as the full path under the
    same changes, and the changes show in the logits (the roll-back repeats a step)."""
    want, _ = _decode(model, 10, meddle=_meddler(), ledger=False)
    got, n = _decode(model, 10, meddle=_meddler())
    assert n >= 3
    np.testing.assert_array_equal(got, want)
    plain, _ = _decode(model, 10, ledger=False)
    assert not np.array_equal(plain[2:4], want[2:4])  # the scaled state changed them


def test_ledger_matches_only_its_own_caches(model):
    """``_WholeLedger.matches`` refuses another cache list, a cache holding another
    array, a moved KV offset and another batch size."""
    dg.drop_compiled_steps()
    with emulated_metal(), dg.uncompiled(), pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLX_LILY_COMPILE", "1")
        with mlx_lily.patched(model):
            inner = model.language_model.model
            c = make_prompt_cache(model)
            model(mx.array([PROMPT[:20]]), cache=c)
            model(mx.array([[3]]), cache=c)
            led = inner._lily_steps.ledger
            h = inner.embed_tokens(mx.array([[3]]))
            assert led is not None and led.matches(c, h)
            assert not led.matches(make_prompt_cache(model), h)
            assert not led.matches(c, mx.concatenate([h, h]))
            kv = next(x for x in c if hasattr(x, "offset"))
            kv.offset -= 1
            assert not led.matches(c, h)
            kv.offset += 1
            gdn = next(x for x in c if type(x).__name__ == "ArraysCache")
            gdn[0] = gdn[0] + 0
            assert not led.matches(c, h)
    dg.drop_compiled_steps()


def test_build_time_ledger_ab_runs_both_arms(tmp_path):
    """``benchmarks/build_time.py --ledger-ab`` (4 layers, stubbed kernels, its own
    process: it stubs MLX's kernel factory): both arms time their steps, every timed step
    of the replay arm replays and none of the full arm's (``MLX_LILY_WHOLE_REPLAY=0``)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_LILY")}
    subprocess.run([sys.executable, str(root / "benchmarks" / "build_time.py"), "--layers",
                    "4", "--steps", "3", "--ledger-ab", "2", "--out", str(tmp_path)],
                   check=True, env=env, capture_output=True, timeout=600)
    res = json.loads((tmp_path / "build_time_ledger_ab.json").read_text())["ledger_ab"]
    assert res["full"]["steps"] == res["replay"]["steps"] == 6
    assert res["full"]["replayed"] == 0 and res["replay"]["replayed"] == 6
