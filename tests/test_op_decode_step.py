"""The decode step on a GPU backend, end to end with every kernel: the whole decoder stack
as one compiled function (default), one compiled function per layer
(``MLX_LILY_COMPILE_WHOLE=0``) and uncompiled (``MLX_LILY_COMPILE=0``) give the same
logits step by step within rounding (teacher-forced, through a KV cache growth). The
comparison with stock mlx-lm is the A/B harness's gate (``benchmarks/ab.py``)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import mlx_lily
from mlx_lily.backend import current_backend

on_gpu = pytest.mark.skipif(current_backend() not in ("cuda", "metal"),
                            reason="needs a GPU backend (compiled decode steps, kernels)")

PROMPT = [(7 * i + 3) % 1000 + 10 for i in range(250)]  # 250 tokens: decode crosses 256
STEPS = 12


@pytest.fixture(scope="module")
def small_model():
    """Qwen3.6-35B-A3B's dims with 4 layers (3 GDN + 1 attention): the kernels' production
    shapes. (The ``tiny`` preset's 64-wide projections make MLX's own CUDA build pick a
    quantized-matmul kernel whose JIT needs CUDA's ``crt/mma.h``, absent from the
    H200 install it was run on.)"""
    from mlx_lily import synth

    model, _ = synth.build_model(synth._text_config(num_hidden_layers=4), seed=3)
    return model


def _forced_logits(model, tokens):
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array([PROMPT]), cache=cache)
    out = []
    for t in tokens:
        y = model(mx.array([[t]]), cache=cache)
        out.append(np.array(y[0, -1].astype(mx.float32)))
    return np.stack(out)


@pytest.mark.gpu
@on_gpu
def test_whole_step_matches_per_layer_and_eager(small_model, monkeypatch):
    rng = np.random.default_rng(0)
    tokens = [int(t) for t in rng.integers(10, 1000, STEPS)]
    got = {}
    for name, env in (("whole", {}), ("per_layer", {"MLX_LILY_COMPILE_WHOLE": "0"}),
                      ("eager", {"MLX_LILY_COMPILE": "0"})):
        with monkeypatch.context() as mp:
            for k, v in env.items():
                mp.setenv(k, v)
            with mlx_lily.patched(small_model):
                got[name] = _forced_logits(small_model, tokens)
                if name == "whole":
                    inner = getattr(small_model, "language_model", small_model).model
                    assert callable(inner._lily_steps.whole[1])
    scale = float(np.abs(got["eager"]).max())
    for name in ("whole", "per_layer"):
        err = float(np.abs(got[name] - got["eager"]).max())
        assert err <= 0.02 * scale, (name, err, scale)
        assert np.isfinite(got[name]).all()
    assert (got["whole"].argmax(-1) == got["per_layer"].argmax(-1)).mean() >= 0.9
    # a wrong answer is caught by the same comparison
    assert float(np.abs(got["whole"][::-1] - got["eager"]).max()) > 0.02 * scale


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("compile_env", ["1", "0"])
def test_independent_caches_in_one_eval(small_model, monkeypatch, compile_env):
    """Two sequences with their own caches, their decode steps built first and evaluated
    in ONE ``mx.eval`` (MLX may then run the two launches of a layer concurrently): each
    step's logits equal those of the same step evaluated alone, and every cache's arrival
    counters (``gdn_proj`` SPLIT / ``gdn_out_proj``) hold zeros afterwards. With counters
    shared per layer, interleaved arrivals could let a block run on half-written rows."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_lily.patches import qwen3_next as nxt

    monkeypatch.setenv("MLX_LILY_COMPILE", compile_env)
    prompts = [PROMPT, PROMPT[::-1]]
    with mlx_lily.patched(small_model):
        caches = []
        for p in prompts:
            c = make_prompt_cache(small_model)
            small_model(mx.array([p]), cache=c)
            mx.eval([x.state for x in c])
            caches.append(c)
        import copy

        alone = []
        for c, t in zip(copy.deepcopy(caches), (11, 12)):
            y = small_model(mx.array([[t]]), cache=c)
            alone.append(np.array(y[0, -1].astype(mx.float32)))
        ys = [small_model(mx.array([[t]]), cache=c) for c, t in zip(caches, (11, 12))]
        mx.eval(ys)
    for y, a in zip(ys, alone):
        assert np.array_equal(np.array(y[0, -1].astype(mx.float32)), a)
    ctrs = [getattr(x, nxt.COUNTERS_ATTR, (None, None))[1] for c in caches for x in c]
    ctrs = [x for x in ctrs if x is not None]
    assert ctrs and len({id(x) for x in ctrs}) == len(ctrs)
    assert not any(np.array(x).any() for x in ctrs)
