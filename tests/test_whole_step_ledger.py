"""The whole-stack decode step's replay from the previous step's results
(``decode_graph._WholeLedger``): a step whose caches hold exactly what the previous whole
step stored takes its inputs from there instead of checking and reading every cache. Its
logits must be bit-identical to the full path's at every step, including steps where the
caches were changed in between (a state replaced, a KV cache rolled back, another
sequence's caches), where the KV cache grows, and where the ledger must not be used.

Every Metal kernel runs on the emulator, with the compiled steps built as plain functions
(``decode_graph.uncompiled``: the emulator cannot run inside ``mx.compile``)."""

from __future__ import annotations

import contextlib
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


def _state(caches, moe_attr):
    """Every array a step leaves in ``caches`` (GDN states; KV rows up to the offset and
    the offset; each cache's MoE output, the next step's ordering input) as numpy."""
    out = []
    for c in caches:
        if hasattr(c, "offset"):
            n = c.offset
            out += [np.array(n), np.array(c.keys[..., :n, :].astype(mx.float32)),
                    np.array(c.values[..., :n, :].astype(mx.float32))]
        else:
            out += [np.array(a.astype(mx.float32)) for a in c.cache]
        m = c.__dict__.get(moe_attr)
        out.append(None if m is None else np.array(m.astype(mx.float32)))
    return out


def _decode(model, steps, meddle=None, ledger=True, kv_step="256"):
    """Greedy decoding of ``steps`` one-token calls after ``PROMPT``, KV growth step
    ``kv_step`` (at 256 the decode crosses it); ``meddle(i, caches)`` runs before step ``i`` and returns the
    caches to use. With ``ledger=False`` no step replays. Returns ``(logits np.float32
    [steps, V], replayed: one bool per step, states: _state after each step)``."""
    from mlx_lily.patches.launch_order import MOE_AFTER_ATTR

    replayed = []
    real = dg._replay_whole_step

    def counting(*a):
        replayed[-1] = True
        return real(*a)

    dg.drop_compiled_steps()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dg, "_replay_whole_step", counting)
        if not ledger:
            mp.setattr(dg, "_new_ledger", lambda *a: None)
        with emulated_metal(), dg.uncompiled(), pytest.MonkeyPatch.context() as env:
            env.setenv("MLX_LILY_COMPILE", "1")  # emulated_metal turned it off (undone first)
            env.setenv("MLX_LILY_KV_STEP", kv_step)
            env.delenv("MLX_LILY_COMPILE_ATTN", raising=False)
            with mlx_lily.patched(model):
                caches = {"a": make_prompt_cache(model), "env": env}
                y = model(mx.array([PROMPT]), cache=caches["a"])
                tok = int(mx.argmax(y[0, -1]).item())
                out, states = [], []
                for i in range(steps):
                    c = caches["a"] if meddle is None else meddle(i, caches)
                    replayed.append(False)
                    y = model(mx.array([[tok]]), cache=c)
                    row = y[0, -1].astype(mx.float32)
                    out.append(np.array(row))
                    states.append(_state(c, MOE_AFTER_ATTR))
                    tok = int(mx.argmax(row).item())
    dg.drop_compiled_steps()
    return np.stack(out), replayed, states


def _same_states(got, want):
    for i, (g, w) in enumerate(zip(got, want)):
        assert len(g) == len(w)
        for j, (a, b) in enumerate(zip(g, w)):
            assert (a is None) == (b is None), (i, j)
            if a is not None:
                np.testing.assert_array_equal(a, b, err_msg=f"step {i}, array {j}")


def test_replayed_steps_equal_full_steps(model):
    """Plain decoding across the KV cache's growth: the same logits and cache contents
    (MoE outputs included), bit for bit, with and without replays; most steps replay."""
    want, r0, s0 = _decode(model, 10, ledger=False)
    got, r, s = _decode(model, 10)
    assert not any(r0) and sum(r) >= 6
    np.testing.assert_array_equal(got, want)
    _same_states(s, s0)


def _meddler():
    """Between steps: a GDN layer's recurrent state scaled (a new array); an attention
    layer's key buffer scaled (a new array, same offset); a second sequence's caches
    decoded once, then the first resumed; every cache rolled back two steps to what it
    held earlier (KV offsets moved back, the GDN arrays put back); one step with
    ``MLX_LILY_COMPILE_ATTN=0``; after a plain step, one with a GDN cache's ``lengths``
    set."""
    saved = {}

    def meddle(i, caches):
        c, env = caches["a"], caches["env"]
        gdn = [x for x in c if type(x).__name__ == "ArraysCache"]
        kv = [x for x in c if hasattr(x, "offset")]
        env.delenv("MLX_LILY_COMPILE_ATTN", raising=False)
        gdn[0].lengths = None
        if i == 1:
            gdn[0][1] = gdn[0][1] * 0.5
        if i == 2:
            kv[0].keys = kv[0].keys * 0.5
        if i == 3:
            caches["b"] = copy.deepcopy(c)
            return caches["b"]
        if i == 4:
            saved["c"] = [x.offset if hasattr(x, "offset") else list(x.cache) for x in c]
        if i == 6:
            for x, held in zip(c, saved["c"]):
                if isinstance(held, int):
                    x.offset = held
                else:
                    x.cache[:] = held
        if i == 8:
            env.setenv("MLX_LILY_COMPILE_ATTN", "0")
        if i == 10:
            gdn[0].lengths = mx.array([1], dtype=mx.int32)
        return c

    return meddle


def test_replay_sees_caches_changed_between_steps(model):
    """Caches changed between steps (above): the same logits and cache contents, bit for
    bit, as the full path under the same changes; no replay at a changed step (the full
    path runs there and makes a new ledger), at the step without the compiled attention
    step or with ``lengths``; and the changes show in the logits."""
    kw = dict(meddle=_meddler(), kv_step="2048")  # no KV growth among the changes
    want, r0, s0 = _decode(model, 12, ledger=False, **kw)
    kw["meddle"] = _meddler()
    got, r, s = _decode(model, 12, **kw)
    np.testing.assert_array_equal(got, want)
    _same_states(s, s0)
    assert not any(r0)
    # 9 and 11 follow steps that ran layer by layer (no ledger)
    assert [r[i] for i in (1, 2, 3, 4, 6, 8, 9, 10, 11)] == [False] * 9, r
    assert r[5] and r[7], r
    plain, _, _ = _decode(model, 12, ledger=False, kv_step="2048")
    assert not np.array_equal(plain[1:3], want[1:3])  # the scaled state and keys


@contextlib.contextmanager
def _whole_steps(model):
    """``model`` patched, compiled steps on (built as plain functions) over the emulated
    Metal kernels; yields its text model. Compiled steps are dropped before and after."""
    dg.drop_compiled_steps()
    try:
        with emulated_metal(), dg.uncompiled(), pytest.MonkeyPatch.context() as mp:
            mp.setenv("MLX_LILY_COMPILE", "1")  # emulated_metal turned it off (undone first)
            with mlx_lily.patched(model):
                yield model.language_model.model
    finally:
        dg.drop_compiled_steps()


def test_a_dropped_cache_drops_the_ledger(model):
    """The ledger holds its caches weakly: once the user drops the cache list, its arrays
    are freed (no ledger left on the model)."""
    import gc
    import weakref

    with _whole_steps(model) as inner:
        c = make_prompt_cache(model)
        model(mx.array([PROMPT[:20]]), cache=c)
        for t in (3, 4):
            model(mx.array([[t]]), cache=c)
        assert inner._lily_steps.ledger is not None
        refs = [weakref.ref(x) for x in c]
        del c
        gc.collect()
        assert all(r() is None for r in refs)
        assert inner._lily_steps.ledger is None


def test_ledger_matches_only_its_own_caches(model):
    """``_WholeLedger.matches`` refuses another cache list, another batch size, a moved
    KV offset, a GDN cache with ``lengths`` (the model's forward sends such a step down
    the masked path before it gets here) and a cache holding another array."""
    with _whole_steps(model) as inner:
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
        gdn.lengths = mx.array([1], dtype=mx.int32)
        assert not led.matches(c, h)
        gdn.lengths = None
        assert led.matches(c, h)
        gdn[0] = gdn[0] + 0
        assert not led.matches(c, h)


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
