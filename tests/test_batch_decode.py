"""Batch invariance: a sequence decoded in a batch of mlx-lm's ``BatchGenerator`` (left-padded
``BatchKVCache``, batched ``ArraysCache``) gets the tokens it gets decoded alone.

Contract (issue 27): greedy, mixed prompt lengths, each row of a batch equals that prompt
generated alone, token for token; on the CPU references (Lily patched, CPU backend) the
batch also equals stock mlx-lm's batch; with the Metal kernels (the emulator) a batched
decode step runs the same kernels as a one-sequence step, row by row, so a row's logits
are bit-identical to the same sequence's logits decoded alone. The GPU tests (``-m gpu``)
check the same on the machine's own backend.
"""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator, _merge_caches, generate_step
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

import _models
import mlx_lily
from mlx_lily.testing.dispatch import emulated_metal

try:
    from mlx_lily.testing.metal_emu import available as _emu_available

    HAS_EMU = bool(_emu_available())
except Exception:  # pragma: no cover - emulator toolchain missing
    HAS_EMU = False

needs_emu = pytest.mark.skipif(not HAS_EMU, reason="Metal emulator unavailable")

LENGTHS = (5, 37, 130)


def prompt_of(n: int, seed: int) -> list:
    return [(i * 37 + 11 * seed) % 500 + 1 for i in range(n)]


def greedy_alone(model, prompt, n):
    out = []
    for (tok, _), _i in zip(generate_step(mx.array(prompt), model, max_tokens=n), range(n)):
        out.append(int(tok))
    return out


def batch_generate(model, prompts, max_tokens):
    """Greedy tokens per prompt through ``BatchGenerator`` (all prompts prefilled together,
    each row stopping after its own ``max_tokens``)."""
    gen = BatchGenerator(model, stop_tokens=[[-1]], prefill_batch_size=len(prompts),
                         completion_batch_size=len(prompts))
    uids = gen.insert(prompts, list(max_tokens))
    out = {u: [] for u in uids}
    while responses := gen.next_generated():
        for r in responses:
            out[r.uid].append(int(r.token))
    gen.close()
    return [out[u] for u in uids]


@pytest.fixture(scope="module")
def model():
    return _models.build("qwen3_5_moe")


# ------------------------------------------------------------------------- CPU references
def test_cpu_batch_equals_stock_and_alone(model):
    """Lily on the CPU (references): BatchGenerator's tokens equal stock's, and each row
    equals its prompt generated alone; rows finish at different steps."""
    prompts = [prompt_of(n, i) for i, n in enumerate(LENGTHS)]
    max_tokens = (8, 5, 7)
    stock = batch_generate(model, prompts, max_tokens)
    with mlx_lily.patched(model):
        lily = batch_generate(model, prompts, max_tokens)
        alone = [greedy_alone(model, p, n) for p, n in zip(prompts, max_tokens)]
    assert lily == stock
    assert lily == alone


@pytest.mark.slow
def test_cpu_batch_with_a_prompt_past_the_prefill_step(model):
    """A 2049-token prompt (two prefill chunks) batched with short ones: same tokens as
    stock's batch and as each prompt alone."""
    prompts = [prompt_of(n, i) for i, n in enumerate((5, 2049, 37))]
    stock = batch_generate(model, prompts, (4, 4, 4))
    with mlx_lily.patched(model):
        lily = batch_generate(model, prompts, (4, 4, 4))
        alone = [greedy_alone(model, p, 4) for p in prompts]
    assert lily == stock
    assert lily == alone


# ------------------------------------------------------------------------- Metal emulator
def _prefill_alone(model, prompt):
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)
    mx.eval(logits)
    return cache, int(mx.argmax(logits[0, -1]).item())


def _decode_alone(model, cache, tok, n):
    """(tokens, logits [n, V] fp32) of n greedy decode steps from ``tok``."""
    toks, rows = [], []
    for _ in range(n):
        logits = model(mx.array([[tok]]), cache=cache)[0, -1]
        mx.eval(logits)
        rows.append(np.array(logits.astype(mx.float32)))
        tok = int(mx.argmax(logits).item())
        toks.append(tok)
    return toks, np.stack(rows)


@needs_emu
def test_emulated_batched_decode_rows_bit_identical_to_alone(model):
    """With every Metal kernel on (emulator): prompts of 5 / 37 / 130 tokens prefilled
    alone, their caches merged as ``BatchGenerator`` merges them (left-padded
    ``BatchKVCache``), then decoded together: every row's logits are bit-identical to the
    same sequence decoded alone at every step, also after a row leaves the batch
    (``filter``, as when a request finishes)."""
    from mlx_lily.ops import attention as A
    from mlx_lily.testing.dispatch import count_kernel_launches

    steps, leave_after = 5, 2
    prompts = [prompt_of(n, i) for i, n in enumerate(LENGTHS)]
    with emulated_metal():
        with mlx_lily.patched(model):
            pre = [_prefill_alone(model, p) for p in prompts]
            alone = [_decode_alone(model, copy.deepcopy(c), t, steps) for c, t in pre]
            caches = _merge_caches([copy.deepcopy(c) for c, _ in pre])
            assert any(type(c) is BatchKVCache for c in caches)
            rows = list(range(len(prompts)))
            toks = [t for _, t in pre]
            with pytest.MonkeyPatch.context() as mp:
                calls = count_kernel_launches(mp)
                for step in range(steps):
                    if step == leave_after:  # the middle request finishes
                        rows = [0, 2]
                        keep = [0, 2]
                        for c in caches:
                            c.filter(keep)
                        toks = [toks[i] for i in keep]
                    logits = model(mx.array(toks)[:, None], cache=caches)[:, -1]
                    mx.eval(logits)
                    got = np.array(logits.astype(mx.float32))
                    for j, r in enumerate(rows):
                        assert np.array_equal(got[j], alone[r][1][step]), (step, r)
                    toks = [int(t) for t in mx.argmax(logits, axis=-1).tolist()]
                    assert toks == [alone[r][0][step] for r in rows]
    # the batched steps ran the attention decode kernels (not the stock SDPA)
    assert A.DECODE_PARTIAL.name in calls and A.QK_NORM_ROPE.name in calls


@needs_emu
def test_emulated_batch_generate_equals_alone(model):
    """With every Metal kernel on (emulator): BatchGenerator over prompts of 5 / 37 / 130
    tokens (prefilled together, right-padded, then decoded as a left-padded batch),
    rows finishing at different steps, gives each prompt the tokens it gets alone."""
    prompts = [prompt_of(n, i) for i, n in enumerate(LENGTHS)]
    max_tokens = (6, 4, 5)
    with emulated_metal():
        with mlx_lily.patched(model):
            alone = [greedy_alone(model, p, n) for p, n in zip(prompts, max_tokens)]
            batch = batch_generate(model, prompts, max_tokens)
    assert batch == alone
