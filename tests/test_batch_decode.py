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
from mlx_lm.generate import _merge_caches
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

import _models
import mlx_lily
from mlx_lily import kernels
from mlx_lily.ops import gated_delta as gdn_ops
from mlx_lily.testing.dispatch import emulated_metal
from mlx_lily.testing.generation import batch_greedy, batch_greedy_joining, greedy

try:
    from mlx_lily.testing.metal_emu import available as _emu_available

    HAS_EMU = bool(_emu_available())
except Exception:  # pragma: no cover - emulator toolchain missing
    HAS_EMU = False

needs_emu = pytest.mark.skipif(not HAS_EMU, reason="Metal emulator unavailable")

LENGTHS = (5, 37, 130)


def prompt_of(n: int, seed: int) -> list:
    return [(i * 37 + 11 * seed) % 500 + 1 for i in range(n)]


@pytest.fixture(scope="module")
def model():
    return _models.build("qwen3_5_moe")


# ------------------------------------------------------------------------- CPU references
def test_cpu_batch_equals_stock_and_alone(model):
    """Lily on the CPU (references): BatchGenerator's tokens equal stock's, and each row
    equals its prompt generated alone; rows finish at different steps."""
    prompts = [prompt_of(n, i) for i, n in enumerate(LENGTHS)]
    max_tokens = (8, 5, 7)
    stock = batch_greedy(model, prompts, max_tokens)
    with mlx_lily.patched(model):
        lily = batch_greedy(model, prompts, max_tokens)
        alone = [greedy(model, p, n) for p, n in zip(prompts, max_tokens)]
    assert lily == stock
    assert lily == alone


#: Two requests running when a third joins (37 / 5 tokens, then 130), and how many
#: tokens each asks for: the first two still decoding when the third arrives, all three
#: finishing at different steps.
JOIN_FIRST, JOIN_LATER, JOIN_MAX = (37, 5), (130,), (8, 6, 5)


def _join_prompts():
    n = len(JOIN_FIRST)
    return ([prompt_of(k, i) for i, k in enumerate(JOIN_FIRST)],
            [prompt_of(k, n + i) for i, k in enumerate(JOIN_LATER)])


def test_cpu_batch_with_a_request_joining_equals_stock_and_alone(model):
    """Lily on the CPU (references): a request joining a running BatchGenerator batch
    (``mlx_lm.server``'s case; the batch caches are extended and re-padded) gives the
    tokens stock's batch gives, and each prompt the tokens it gets alone."""
    first, later = _join_prompts()
    stock = batch_greedy_joining(model, first, later, JOIN_MAX)
    with mlx_lily.patched(model):
        lily = batch_greedy_joining(model, first, later, JOIN_MAX)
        alone = [greedy(model, p, n) for p, n in zip(first + later, JOIN_MAX)]
    assert lily == stock
    assert lily == alone


@pytest.mark.slow
def test_cpu_batch_with_a_prompt_past_the_prefill_step(model):
    """A 2049-token prompt (two prefill chunks) batched with short ones: same tokens as
    stock's batch and as each prompt alone."""
    prompts = [prompt_of(n, i) for i, n in enumerate((5, 2049, 37))]
    stock = batch_greedy(model, prompts, (4, 4, 4))
    with mlx_lily.patched(model):
        lily = batch_greedy(model, prompts, (4, 4, 4))
        alone = [greedy(model, p, 4) for p in prompts]
    assert lily == stock
    assert lily == alone


def _rows_dependent_embedding(model, monkeypatch):
    """Make the embedding's result depend on the call's rows, as the kernel MLX picks for a
    GPU matmul does: a prefill chunk of two or more sequences gets its embeddings scaled
    by 1.05; one sequence, and any decode step, does not."""
    cls = type(model.language_model.model.embed_tokens)
    embed = cls.__call__

    def call(self, x):
        out = embed(self, x)
        return out * 1.05 if x.ndim == 2 and x.shape[0] > 1 and x.shape[1] > 1 else out

    monkeypatch.setattr(cls, "__call__", call)


#: Prefill chunks of 16 tokens: the 37- and 130-token prompts take several
#: ``PromptProcessingBatch.prompt`` calls, the later ones on caches with history.
SMALL_STEP = 16


def _same(a_lps, b_lps) -> bool:
    return all(len(la) == len(lb) and all(mx.array_equal(a, b).item()
                                          for a, b in zip(la, lb))
               for la, lb in zip(a_lps, b_lps))


def test_batch_prefill_runs_each_sequence_alone(model, monkeypatch):
    """Under the patch, ``BatchGenerator``'s prefill runs one sequence at a time
    (``patches.batch_prefill``), both when prompts start together and when two requests
    join a running batch, over several prefill chunks: with an op whose arithmetic depends
    on the call's rows, every row's tokens and every step's log-probabilities still equal
    that prompt alone. With mlx-lm's one padded call (the per-row prefill refused) the same
    op moves the log-probabilities, so the check can fail."""
    from mlx_lily.patches import batch_prefill
    from mlx_lily.testing.generation import greedy_trace

    first = [prompt_of(37, 0), prompt_of(5, 1)]
    later = [prompt_of(130, 2), prompt_of(21, 3)]
    max_tokens = (8, 6, 5, 4)
    kw = {"prefill_step_size": SMALL_STEP}
    _rows_dependent_embedding(model, monkeypatch)
    with mlx_lily.patched(model):
        alone = [greedy_trace(model, p, n, **kw) for p, n in zip(first + later, max_tokens)]
        join_lps: list = []
        joined = batch_greedy_joining(model, first, later, max_tokens, logprobs=join_lps, **kw)
        together_lps: list = []
        together = batch_greedy(model, first + later, max_tokens, logprobs=together_lps, **kw)
        monkeypatch.setattr(batch_prefill, "per_row_unsupported", lambda *a: "refused")
        padded_lps: list = []
        batch_greedy_joining(model, first, later, max_tokens, logprobs=padded_lps, **kw)
    alone_lps = [lps for _, lps in alone]
    assert joined == [t for t, _ in alone] == together
    assert _same(alone_lps, join_lps) and _same(alone_lps, together_lps)
    assert not _same(alone_lps, padded_lps)


def test_batch_prefill_merged_cache_matches_the_rows(model):
    """After a per-row prefill of prompts of 37 and 5 tokens, in two calls as a segmented
    prompt takes them (20 + 16 and 3 + 1 tokens), the batch's caches hold each row's keys
    right-aligned at the longest row (left padding 0 / 32, as ``BatchKVCache.merge`` places
    them), with the capacity and growth step the longest row has alone (not its length,
    nor a buffer regrown from it), and the GDN states of each row alone."""
    from mlx_lm.generate import PromptProcessingBatch

    prompts = [prompt_of(37, 0), prompt_of(5, 1)]
    cuts = (20, 3)
    with mlx_lily.patched(model):
        batch = PromptProcessingBatch(model, [0, 1], [make_prompt_cache(model)
                                                      for _ in prompts])
        batch.prompt([p[:k] for p, k in zip(prompts, cuts)])
        batch.prompt([p[k:-1] for p, k in zip(prompts, cuts)])
        alone = []
        for i, (p, k) in enumerate(zip(prompts, cuts)):
            one = PromptProcessingBatch(model, [i], [make_prompt_cache(model)])
            one.prompt([p[:k]])
            one.prompt([p[k:-1]])
            alone.append(one.prompt_cache)
    n_kv = 0
    for j, c in enumerate(batch.prompt_cache):
        rows = [a[j] for a in alone]
        if type(c) is BatchKVCache:
            n_kv += 1
            assert c._idx == 36 and c.left_padding.tolist() == [0, 32]
            assert c.offset.tolist() == [36, 4]
            assert c.keys.shape[2] == rows[0].keys.shape[2] > 36
            assert c.step == rows[0].step
            for i, (r, n) in enumerate(zip(rows, (36, 4))):
                assert mx.array_equal(c.keys[i:i + 1, :, 36 - n:36], r.keys[..., :n, :]).item()
                assert mx.array_equal(c.values[i:i + 1, :, 36 - n:36],
                                      r.values[..., :n, :]).item()
        else:
            for i, r in enumerate(rows):
                assert all(mx.array_equal(a[i:i + 1], b).item()
                           for a, b in zip(c.cache, r.cache))
            assert c.left_padding.tolist() == [r.left_padding.item() for r in rows]
    assert n_kv > 0


def test_batch_prefill_per_row_refusals(model, monkeypatch):
    """Which ``PromptProcessingBatch.prompt`` calls keep mlx-lm's padded call."""
    from types import SimpleNamespace

    from mlx_lm.models.cache import ArraysCache, RotatingKVCache

    from mlx_lily.patches.batch_prefill import per_row_unsupported

    two = [[1, 2], [3]]

    def reason(caches, m=model):
        return per_row_unsupported(SimpleNamespace(model=m, prompt_cache=caches), two)

    with mlx_lily.patched(model):
        caches = _merge_caches([make_prompt_cache(model) for _ in range(2)])
        assert reason(caches) is None
        assert per_row_unsupported(SimpleNamespace(model=model, prompt_cache=caches),
                                   [[1, 2]]) == "one sequence"
        assert reason(caches, object()) == "not a Lily model"
        rotating = _merge_caches([[RotatingKVCache(max_size=8)] for _ in range(2)])
        assert reason(rotating) == "cache type BatchRotatingKVCache"
        padded = ArraysCache(2)
        padded.prepare(lengths=[2, 1])
        assert reason([padded]) == "an ArraysCache with padding"
        passed = ArraysCache(2, left_padding=[0, 0])
        passed.advance(3)  # tokens went through: left_padding [-3, -3], nothing to enter
        assert reason([passed]) is None
        kv = BatchKVCache([0, 0])
        kv.prepare(right_padding=[0, 2])
        assert reason([kv]) == "a BatchKVCache with pending padding"
        monkeypatch.setenv("MLX_LILY_DISABLE", "batch_decode")
        assert reason(caches) == "batch_decode off"


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


def check_decode_parity(model, lengths=LENGTHS, steps=6, leave_after=2):
    """Prompts of ``lengths`` prefilled alone, their caches merged as ``BatchGenerator``
    merges them (left-padded ``BatchKVCache``), then decoded together for ``steps`` steps
    (the second row leaves at step ``leave_after`` and all but the first two steps later,
    ``filter``, as when requests finish; the last steps are a batch of one):
    every row's logits must be bit-identical to the same sequence decoded alone at every
    step. Runs under whatever backend and patch the caller set up; returns the kernel
    names launched by the batched steps."""
    from mlx_lily.testing.dispatch import count_kernel_launches

    prompts = [prompt_of(n, i) for i, n in enumerate(lengths)]
    pre = [_prefill_alone(model, p) for p in prompts]
    alone = [_decode_alone(model, copy.deepcopy(c), t, steps) for c, t in pre]
    caches = _merge_caches([copy.deepcopy(c) for c, _ in pre])
    assert any(type(c) is BatchKVCache for c in caches)
    rows = list(range(len(prompts)))
    toks = [t for _, t in pre]
    with pytest.MonkeyPatch.context() as mp:
        calls = count_kernel_launches(mp)
        for step in range(steps):
            keep = None
            if step == leave_after and len(rows) > 2:  # the second request finishes
                keep = [0] + list(range(2, len(rows)))
            elif step == leave_after + 2 and len(rows) > 1:  # one request left
                keep = [0]
            if keep is not None:
                rows = [rows[i] for i in keep]
                for c in caches:
                    c.filter(keep)
                toks = [toks[i] for i in keep]
            logits = model(mx.array(toks)[:, None], cache=caches)[:, -1]
            mx.eval(logits)
            got = np.array(logits.astype(mx.float32))
            for j, r in enumerate(rows):
                diff = float(np.abs(got[j] - alone[r][1][step]).max())
                assert np.array_equal(got[j], alone[r][1][step]), (step, r, diff)
            toks = [int(t) for t in mx.argmax(logits, axis=-1).tolist()]
            assert toks == [alone[r][0][step] for r in rows]
    return calls


@needs_emu
def test_emulated_batched_decode_rows_bit_identical_to_alone(model):
    """With every Metal kernel on (emulator): prompts of 5 / 37 / 130 tokens decoded as
    one left-padded batch give each row the logits of that sequence decoded alone, bit
    for bit (``check_decode_parity``), through the attention decode kernels."""
    from mlx_lily.ops import attention as A

    with emulated_metal():
        with mlx_lily.patched(model):
            calls = check_decode_parity(model)
    # the batched steps ran the attention decode kernels (not the stock SDPA)
    assert A.DECODE_PARTIAL.name in calls and A.QK_NORM_ROPE.name in calls


def check_prefill_parity(model, lengths):
    """Prompts of ``lengths`` prefilled together as ``BatchGenerator`` prefills them
    (fresh caches merged, right-padded to the longest, ``prepare(lengths=...,
    right_padding=...)``) against each prefilled alone: per row, the logits at its last
    prompt token; returns the rows whose logits are not bit-identical, with their max
    difference."""
    from mlx_lm.generate import _right_pad_prompts

    prompts = [prompt_of(n, i) for i, n in enumerate(lengths)]
    alone = []
    for p in prompts:
        logits = model(mx.array([p]), cache=make_prompt_cache(model))[0, -1]
        mx.eval(logits)
        alone.append(np.array(logits.astype(mx.float32)))
    caches = _merge_caches([make_prompt_cache(model) for _ in prompts])
    pad = [max(lengths) - n for n in lengths]
    for c in caches:
        c.prepare(lengths=list(lengths), right_padding=pad)
    logits = model(_right_pad_prompts(prompts), cache=caches)
    mx.eval(logits)
    bad = {}
    for b, n in enumerate(lengths):
        got = np.array(logits[b, n - 1].astype(mx.float32))
        if not np.array_equal(got, alone[b]):
            bad[b] = float(np.abs(got - alone[b]).max())
    return bad


#: The kernels whose prefill dispatch depends on the call's row count unless
#: ``batch_decode`` is on: the one-threadgroup router kernel then serves calls of at most
#: ``moe_router_topk.MAX_ROWS`` (64) token rows, so a 37-token prompt alone runs it and
#: the same prompt in a 2 x 130 batch the reference.
ROW_COUNT_DISPATCH = ("moe_router_topk",)


@needs_emu
def test_emulated_batched_prefill_rows_bit_identical_to_alone(model):
    """With the Metal kernels on (emulator) but ``ROW_COUNT_DISPATCH``: a right-padded
    batch prefill of prompts of 37 / 130 tokens (no left padding: the causal mask,
    attention through the flash kernel and the q/k norm + RoPE kernel at one position)
    gives each row the last-token logits of that prompt prefilled alone, bit for bit."""
    from mlx_lily import backend
    from mlx_lily.ops import attention as A
    from mlx_lily.testing.dispatch import count_kernel_launches

    ops = [o for o in backend.OP_NAMES if o not in ROW_COUNT_DISPATCH]
    with emulated_metal():
        with mlx_lily.patched(model, ops=ops), pytest.MonkeyPatch.context() as mp:
            calls = count_kernel_launches(mp)
            bad = check_prefill_parity(model, (37, 130))
    assert not bad, bad
    assert A.PREFILL.name in calls


@needs_emu
def test_emulated_short_prompt_prefill_in_a_batch_equals_alone(model):
    """Every Metal kernel on: a 5-token prompt (5 MoE rows, few enough for the decode
    kernels) prefilled inside a 5 / 37 batch gets the last-token logits it gets alone,
    bit for bit: a prefill chunk's MoE takes the grouped GEMM at any row count
    (``moe_experts.prefill_chunk``). With the decode kernels for short prompts this row
    differed (max 1.6 on this model; on the H200 the first generated token)."""
    with emulated_metal():
        with mlx_lily.patched(model):
            bad = check_prefill_parity(model, (5, 37))
    assert not bad, bad


@needs_emu
def test_emulated_batched_prefill_with_router_kernel(model):
    """Every Metal kernel on: the 37-token row of a 37 / 130 batch prefill (260 router
    rows, over ``MAX_ROWS``) is bit-identical to that prompt alone (37 rows): with
    ``batch_decode`` on, the router kernel takes any number of rows."""
    with emulated_metal():
        with mlx_lily.patched(model):
            bad = check_prefill_parity(model, (37, 130))
    assert not bad, bad


@needs_emu
@pytest.mark.parametrize("lengths", [LENGTHS, (37, 37)], ids=["mixed", "equal"])
def test_emulated_batch_generate_equals_alone(model, lengths):
    """With every Metal kernel on (emulator): BatchGenerator over prompts of 5 / 37 / 130
    tokens (prefilled together, right-padded, then decoded as a left-padded batch), rows
    finishing at different steps, gives each prompt the tokens it gets alone; so do
    prompts of equal length (no padding: the batch's SSM mask is an all-true array, as in
    ``mlx_lm.benchmark -b N``)."""
    prompts = [prompt_of(n, i) for i, n in enumerate(lengths)]
    max_tokens = (6, 4, 5)[:len(prompts)]
    with emulated_metal():
        with mlx_lily.patched(model):
            alone = [greedy(model, p, n) for p, n in zip(prompts, max_tokens)]
            batch = batch_greedy(model, prompts, max_tokens)
    assert batch == alone


@needs_emu
def test_emulated_batch_with_a_request_joining_equals_alone(model):
    """With every Metal kernel on (emulator): a request joining a running BatchGenerator
    batch leaves every row's tokens equal to that prompt's alone."""
    first, later = _join_prompts()
    with emulated_metal():
        with mlx_lily.patched(model):
            alone = [greedy(model, p, n) for p, n in zip(first + later, JOIN_MAX)]
            batch = batch_greedy_joining(model, first, later, JOIN_MAX)
    assert batch == alone


@needs_emu
@pytest.mark.parametrize("compiled,mma", [(False, False), (True, False), (False, True),
                                          (False, "outp")],
                         ids=["eager", "whole-step", "eager-mma", "eager-mma-outp"])
def test_emulated_cuda_batch_with_a_request_joining_equals_alone(model, compiled, mma):
    """The CUDA kernels' bodies on the emulator (``emulated_cuda``: CUDA launch shapes and
    CUDA-only ops such as ``moe_fused`` and ``gdn_proj``), every kernel on: a request
    joining a running batch leaves every row's tokens and every step's log-probabilities
    equal to that prompt alone; with ``MLX_LILY_COMPILE=1`` a lone prompt decodes through
    the one-sequence whole-stack step (built uncompiled); with ``MLX_LILY_QGEMV_MMA=1``
    the decode GEMVs take the tensor-core kernel (its mma emulated with lane shuffles);
    "outp": also ``MLX_LILY_GDN_PACKED_OUTP=1`` (the GDN decode kernel applies out_proj
    to the row the tensor-core projection packed)."""
    from mlx_lily.testing.dispatch import emulated_cuda
    from mlx_lily.testing.generation import greedy_trace

    first, later = _join_prompts()
    if mma:  # a model of its own: launch plans cached on its projections name the kernels
        model = _models.build("qwen3_5_moe")
    # the inner MonkeyPatch undoes its setting before emulated_cuda restores its own
    with emulated_cuda() as twins, pytest.MonkeyPatch.context() as mp:
        if compiled:
            mp.setenv("MLX_LILY_COMPILE", "1")
        if mma:
            mp.setenv("MLX_LILY_QGEMV_MMA", "1")
        if mma == "outp":
            mp.setenv("MLX_LILY_GDN_PACKED_OUTP", "1")
        outp_calls = []
        fused = gdn_ops.gated_delta_fused

        def spy(*a, **kw):  # counts the decode launches applying out_proj to a packed row
            if kw.get("out_counters") is not None:
                outp_calls.append(1)
            return fused(*a, **kw)

        mp.setattr(gdn_ops, "gated_delta_fused", spy)
        with mlx_lily.patched(model):
            assert mlx_lily.backend_info()["ops"]["moe_fused"] == "kernel"
            alone = [greedy_trace(model, p, n) for p, n in zip(first + later, JOIN_MAX)]
            lps: list = []
            batch = batch_greedy_joining(model, first, later, JOIN_MAX, logprobs=lps)
            steps = model.language_model.model._lily_steps.recent if compiled else None
            built = {spec.name for spec, _ in kernels._CACHE}
    assert [t for t, _ in alone] == batch
    for (_, la), lb in zip(alone, lps):
        assert len(la) == len(lb)
        for a, b in zip(la, lb):
            assert mx.array_equal(a, b).item()
    assert "lily_moe_decode" not in twins and "lily_gdn_decode" not in twins
    if compiled:
        assert steps, "the one-sequence whole step did not run"
    assert ("lily_qgemv_mma" in built) == bool(mma) and "lily_qgemv_mma" not in twins
    assert ("lily_norm_qgemv_mma" in built) == bool(mma)
    assert bool(outp_calls) == (mma == "outp")


@needs_emu
@pytest.mark.parametrize("lengths", [(37, 37), (37,), LENGTHS], ids=["equal", "one", "mixed"])
def test_emulated_compiled_batch_steps_equal_alone(model, lengths):
    """Compiled decode steps on (``MLX_LILY_COMPILE=1``, built as plain functions by
    ``uncompiled()``: the emulator cannot run inside ``mx.compile``), every Metal kernel
    on: BatchGenerator over prompts of one length (``mlx_lm.benchmark -b N``) or one
    request (how ``mlx_lm.server`` runs a single request) takes the whole-stack decode
    step on the batch caches, and each prompt gets the tokens it gets alone through the
    one-sequence whole step (same greedy tokens); mixed lengths (left-padded) decode
    eagerly and also match. No KV growth inside the decode (capacity 2048)."""
    from mlx_lily.patches import decode_graph as dg

    prompts = [prompt_of(n, i) for i, n in enumerate(lengths)]
    max_tokens = (24, 20, 22)[:len(prompts)]
    inner = model.language_model.model
    dg.drop_compiled_steps()
    try:
        with emulated_metal(), dg.uncompiled(), pytest.MonkeyPatch.context() as mp:
            mp.setenv("MLX_LILY_COMPILE", "1")  # emulated_metal turned it off (undone first)
            with mlx_lily.patched(model):
                alone = [greedy(model, p, n) for p, n in zip(prompts, max_tokens)]
                assert inner._lily_steps.recent, "the one-sequence whole step did not run"
                batch = batch_greedy(model, prompts, max_tokens)
                batch_shapes = [k for k in inner._lily_steps.recent if k[0][0] == len(prompts)]
    finally:
        dg.drop_compiled_steps()
    assert batch == alone
    if len(set(lengths)) == 1 and len(prompts) > 1:
        assert batch_shapes, "the batch took no whole-stack step"


def count_whole_steps_on_batch_caches(monkeypatch) -> list:
    """A list that gets the batch size of every whole-stack decode step run on mlx-lm's
    batch caches (``stack.run_whole_step`` wrapped for the test)."""
    from mlx_lily.patches import stack

    seen = []
    real = stack.run_whole_step

    def counting(text_model, cs, layers, cache, h):
        y = real(text_model, cs, layers, cache, h)
        if y is not None and any(type(c) is BatchKVCache for c in cache):
            seen.append(h.shape[0])
        return y

    monkeypatch.setattr(stack, "run_whole_step", counting)
    return seen


@needs_emu
@pytest.mark.parametrize("lengths", [(37, 37), (2040, 2040)], ids=["short", "kv-growth"])
def test_emulated_compiled_batch_decode_logits_equal_alone(model, lengths, monkeypatch):
    """Compiled decode steps on (built uncompiled, as above), every Metal kernel on: two
    prompts of one length prefilled alone, merged as ``BatchGenerator`` merges them, then
    decoded together (one row leaves after 4 steps, ``filter``): every step's logits of
    every row equal those of the sequence decoded alone, bit for bit, and the batch steps
    after the first (which grows the merged cache) ran the whole-stack step on the batch
    caches. ``kv-growth``: the decode crosses 2048 tokens, where each sequence's own cache
    grows (an eager step alone; the merged cache grew at its first step)."""
    from mlx_lily.patches import decode_graph as dg

    whole_on_batch = count_whole_steps_on_batch_caches(monkeypatch)
    dg.drop_compiled_steps()
    try:
        with emulated_metal(), dg.uncompiled(), pytest.MonkeyPatch.context() as mp:
            mp.setenv("MLX_LILY_COMPILE", "1")  # emulated_metal turned it off (undone first)
            with mlx_lily.patched(model):
                check_decode_parity(model, lengths=lengths, steps=10, leave_after=2)
    finally:
        dg.drop_compiled_steps()
    assert 2 in whole_on_batch and 1 in whole_on_batch, whole_on_batch


def test_batch_kv_caches_grow_like_plain_ones_only_when_asked(monkeypatch):
    """``widen_kv_steps`` / ``kv_headroom`` with ``batch`` give a ``BatchKVCache`` the
    growth step and headroom of a plain cache (written rows, ``_idx``, ``offset`` and
    ``left_padding`` unchanged); without it the batch cache keeps mlx-lm's."""
    from mlx_lily.patches.kv_growth import DEFAULT_KV_STEP, kv_headroom, widen_kv_steps

    monkeypatch.delenv("MLX_LILY_KV_STEP", raising=False)
    c = BatchKVCache([1, 0])
    k = mx.arange(2 * 2 * 256 * 4, dtype=mx.float32).reshape(2, 2, 256, 4)
    c.update_and_fetch(k, k + 1)
    assert c.keys.shape[2] == c._idx == 256
    widen_kv_steps([c])
    kv_headroom([c])
    assert c.step == 256 and c.keys.shape[2] == 256
    widen_kv_steps([c], batch=True)
    assert c.step == DEFAULT_KV_STEP
    offset, lp = c.offset.tolist(), c.left_padding.tolist()
    kv_headroom([c], batch=True)
    assert c.keys.shape[2] == DEFAULT_KV_STEP and c._idx == 256
    assert c.offset.tolist() == offset and c.left_padding.tolist() == lp
    assert mx.array_equal(c.keys[..., :256, :], k).item()
    assert mx.array_equal(c.values[..., :256, :], k + 1).item()


def test_batch_unpadded_answer_dropped_when_padding_changes_in_place():
    """``batch_unpadded`` keeps its answer per ``left_padding`` array; mlx-lm's
    ``prepare`` / ``finalize`` add padding to that same array in place, so each
    multi-token call drops the answer (``forget_padding``), and a one-token call between
    ``prepare`` and ``finalize`` (``ArraysCache.lengths`` set) never takes the compiled
    batch step nor stores an answer."""
    from mlx_lm.models.cache import ArraysCache

    from mlx_lily.patches import decode_graph as dg, stack

    c = BatchKVCache([0, 0])
    k = mx.zeros((2, 2, 3, 8), mx.bfloat16)
    c.update_and_fetch(k, k)
    assert dg.batch_unpadded(c)
    c.left_padding += mx.array([0, 2])  # what finalize does: the same object
    assert dg.batch_unpadded(c)  # the stale answer the forget exists for
    dg.forget_padding([c])
    assert not dg.batch_unpadded(c)

    c2 = BatchKVCache([0, 0])
    c2.update_and_fetch(k, k)
    a = ArraysCache(2)
    a.lengths = mx.array([3, 1])
    h = mx.zeros((2, 1, 8), mx.bfloat16)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(stack, "_batch_decode_step", lambda h, cache: True)
        assert not stack._unpadded_batch_step(h, [a, c2])
        assert dg._PAD_MEMO not in c2.__dict__
        a.lengths = None
        assert stack._unpadded_batch_step(h, [a, c2]) == (c2._idx + 1 <= c2.keys.shape[2])


# ------------------------------------------------------------------------- op level, both twins
def _attn_helpers():
    import test_op_attention as T

    return T


OP_BACKENDS = ["metal-emu", "cuda-emu", pytest.param("metal", marks=pytest.mark.gpu),
               pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("backend", OP_BACKENDS)
def test_qkv_norm_rope_packed_per_row_offsets(backend, monkeypatch):
    """One ``lily_attn_qk_norm_rope`` launch with one position per batch row: each row is
    bit-identical to that row launched alone at its own position, and close to the
    reference (``mx.fast.rope`` with an offset array)."""
    import mlx_lily.ops.attention as A
    from mlx_lily import kernels

    T = _attn_helpers()
    monkeypatch.setenv(kernels.KERNELS_ENV, "all")
    B, Hq, Hkv, D, R, dt = 3, 16, 2, 256, 64, mx.bfloat16
    mx.random.seed(5)
    y = T._packed_row(B, 1, Hq, Hkv, D, dt)
    wq = (1.0 + 0.1 * mx.random.normal((D,))).astype(dt)
    wk = (1.0 + 0.1 * mx.random.normal((D,))).astype(dt)
    offs = mx.array([5, 4100, 77], dtype=mx.int32)
    kw = dict(n_heads=Hq, n_kv_heads=Hkv, head_dim=D, rope_dims=R, base=1e7)
    rq, rk, rv = A.qkv_norm_rope_packed_reference(y, wq, wk, 1e-6, **kw, offset=offs)
    queries, _, keys, _ = A.split_packed(y, Hq, Hkv, D)
    with T.use_backend(backend, monkeypatch):
        q, k, v = A.qkv_norm_rope_packed(y, wq, wk, 1e-6, **kw, offset=offs)
        rows = [A.qkv_norm_rope_packed(y[b:b + 1], wq, wk, 1e-6, **kw, offset=offs[b:b + 1])
                for b in range(B)]
        assert A.qkv_norm_rope_packed(y, wq, wk, 1e-6, **kw, offset=offs[:2]) is None
        mx.eval(q, k, v, rows)
    for b, (qb, kb, vb) in enumerate(rows):
        assert mx.array_equal(q[b:b + 1], qb).item(), b
        assert mx.array_equal(k[b:b + 1], kb).item(), b
        assert mx.array_equal(v[b:b + 1], vb).item(), b
    T._assert_qk_close(q, rq, queries, wq, R, dt)
    T._assert_qk_close(k, rk, keys, wk, R, dt)
    assert mx.array_equal(v, rv).item()


@pytest.mark.parametrize("backend", OP_BACKENDS)
@pytest.mark.parametrize("starts,n", [([3, 0, 250], 300), ([4, 4, 4], 3000)],
                         ids=["mixed", "shared-start"])
def test_sdpa_gated_packed_rows_left_padded(backend, starts, n, monkeypatch):
    """Decode attention over a left-padded batch cache: row b reads only its keys
    ``[starts[b], T)`` (the padding holds NaN and never shows), bit-identical to the same
    row decoded alone over its own keys, and close to the masked fp32 reference. Rows
    sharing one start run as one launch pair with the one-sequence split-K block (at
    3000 keys a 3-row launch would otherwise pick a larger block than one row does)."""
    import mlx_lily.ops.attention as A
    from mlx_lily import kernels

    T = _attn_helpers()
    monkeypatch.setenv(kernels.KERNELS_ENV, "all")
    B, Hq, Hkv, D, dt = 3, 16, 2, 256, mx.bfloat16
    cap = -(-n // 256) * 256 + 256
    mx.random.seed(9)
    q = T._rand((B, Hq, 1, D), dt)
    kb = T._rand((B, Hkv, cap, D), dt)
    vb = T._rand((B, Hkv, cap, D), dt)
    pad = mx.arange(cap)[None, None, :, None] < mx.array(starts)[:, None, None, None]
    kb = mx.where(pad, mx.array(float("nan"), dt), kb)
    vb = mx.where(pad, mx.array(float("nan"), dt), vb)
    k, v = kb[..., :n, :], vb[..., :n, :]
    y = T._packed_row(B, 1, Hq, Hkv, D, dt)
    _, gate, _, _ = A.split_packed(y, Hq, Hkv, D)
    with T.use_backend(backend, monkeypatch):
        out = A.sdpa_gated_packed_rows(q, k, v, D ** -0.5, y, starts, Hq, Hkv, D)
        alone = [A.sdpa_gated_packed(q[b:b + 1], k[b:b + 1, :, s:], v[b:b + 1, :, s:],
                                     D ** -0.5, y[b:b + 1], Hq, Hkv, D)
                 for b, s in enumerate(starts)]
        assert A.sdpa_gated_packed_rows(q, k, v, D ** -0.5, y, [0, 0], Hq, Hkv, D) is None
        mx.eval(out, alone)
    assert out.shape == (B, 1, Hq * D)
    for b in range(B):
        assert mx.array_equal(out[b:b + 1], alone[b]).item(), b
    if len(set(starts)) == 1:  # the case where the batch's own block rule would differ
        kind = backend.replace("-emu", "")
        t = n - starts[0]
        assert A.decode_block(t, B, Hkv, kind) != A.decode_block(t, 1, Hkv, kind)
    for b, s in enumerate(starts):  # the fp32 truth of each row over its own keys
        ref = A.sdpa_gated_reference(*T._f32(q[b:b + 1], k[b:b + 1, :, s:], v[b:b + 1, :, s:]),
                                     D ** -0.5, None, gate[b:b + 1].astype(mx.float32))
        T._assert_close(out[b:b + 1], ref, dt)


# ------------------------------------------------------------------------- GPU (lead's H200)
def _gpu_backend():
    from mlx_lily.testing.backends import parity_backends

    have = parity_backends()
    return "cuda" if "cuda" in have else "metal" if "metal" in have else None


needs_gpu = pytest.mark.skipif(_gpu_backend() is None, reason="no GPU backend")


@pytest.fixture(scope="module")
def gpu_model():
    if _gpu_backend() is None:
        pytest.skip("no GPU backend")
    old = mx.default_device()
    mx.set_default_device(mx.gpu)
    try:
        return _models.build("qwen3_5_moe")
    finally:
        mx.set_default_device(old)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("compile_mode", ["default", "off", "fold"])
def test_gpu_batched_decode_rows_bit_identical_to_alone(gpu_model, compile_mode, monkeypatch):
    """On the GPU with the default kernels: a left-padded batch of 5 / 37 / 130-token
    sequences decodes each row bit-identically to that sequence alone (the alone steps
    compiled, ``default``, or eager, ``MLX_LILY_COMPILE=0``; the batch steps eager;
    ``fold``: the GDN decode serving the batch rows of a head in one block,
    ``MLX_LILY_GDN_BATCH_FOLD=8``)."""
    if compile_mode == "off":
        monkeypatch.setenv("MLX_LILY_COMPILE", "0")
    if compile_mode == "fold":
        monkeypatch.setenv("MLX_LILY_GDN_BATCH_FOLD", "8")
    old = mx.default_device()
    mx.set_default_device(mx.gpu)
    try:
        gpu_model._lily_warm = False  # first contact again: its failures are per test
        with mlx_lily.patched(gpu_model):
            check_decode_parity(gpu_model, lengths=(5, 37, 130, 700), steps=6)
            _assert_kernels_stayed_on()
    finally:
        mx.set_default_device(old)


def _assert_kernels_stayed_on():
    """A GPU parity test compares kernels, not references: no op may have been turned off
    by a failed first contact (a machine without CUDA's crt/ headers once turned every op
    off, and the comparison then passed on references alone)."""
    from mlx_lily import kernels

    from conftest import MLX_JIT_MISSING_HEADER

    off = kernels.runtime_disabled()
    if off and all(MLX_JIT_MISSING_HEADER in why for why in off.values()):
        pytest.skip(f"MLX's own JIT lacks CUDA's crt/ headers here: {len(off)} ops off")
    assert not off, f"kernels turned off at first contact, nothing to compare: {off}"


@pytest.mark.gpu
@needs_gpu
def test_gpu_batch_generate_equals_alone(gpu_model):
    """On the GPU with the default kernels: BatchGenerator over prompts of 5 / 37 / 130 /
    2049 tokens, rows finishing at different steps, gives each prompt its tokens alone."""
    prompts = [prompt_of(n, i) for i, n in enumerate((5, 37, 130, 2049))]
    max_tokens = (12, 6, 9, 8)
    old = mx.default_device()
    mx.set_default_device(mx.gpu)
    try:
        gpu_model._lily_warm = False  # first contact again: its failures are per test
        with mlx_lily.patched(gpu_model):
            alone = [greedy(gpu_model, p, n) for p, n in zip(prompts, max_tokens)]
            batch = batch_greedy(gpu_model, prompts, max_tokens)
            _assert_kernels_stayed_on()
    finally:
        mx.set_default_device(old)
    assert batch == alone


@pytest.mark.gpu
@needs_gpu
def test_gpu_batch_with_a_request_joining_equals_alone(gpu_model):
    """On the GPU with the default kernels: a request joining a running BatchGenerator
    batch leaves every row's tokens equal to that prompt's alone."""
    first, later = _join_prompts()
    old = mx.default_device()
    mx.set_default_device(mx.gpu)
    try:
        gpu_model._lily_warm = False  # first contact again: its failures are per test
        with mlx_lily.patched(gpu_model):
            alone = [greedy(gpu_model, p, n) for p, n in zip(first + later, JOIN_MAX)]
            batch = batch_greedy_joining(gpu_model, first, later, JOIN_MAX)
            _assert_kernels_stayed_on()
    finally:
        mx.set_default_device(old)
    assert batch == alone


# ------------------------------------------------------------------------- routing rules
def test_decode_rows_routes_by_tokens_per_sequence():
    """``qgemv.decode_rows``: a decode step of B <= 8 sequences (one token each) is B GEMV
    rows; a prefill chunk never is, whatever its row count (so a sequence's projections
    take one path at every batch size)."""
    from mlx_lily.ops import qgemv

    z = lambda *s: mx.zeros(s, mx.bfloat16)  # noqa: E731
    assert qgemv.decode_rows(z(64)) == 1
    assert qgemv.decode_rows(z(1, 64)) == 1
    assert qgemv.decode_rows(z(1, 1, 64)) == 1
    assert qgemv.decode_rows(z(3, 1, 64)) == 3
    assert qgemv.decode_rows(z(8, 1, 64)) == 8
    assert qgemv.decode_rows(z(9, 1, 64)) is None  # more rows than the kernel takes
    assert qgemv.decode_rows(z(1, 4, 64)) is None  # a 4-token prefill chunk
    assert qgemv.decode_rows(z(2, 3, 64)) is None
    assert qgemv.decode_rows(z(4, 64)) is None  # 2-D rows: not known to be one per sequence


def test_batch_decode_unsupported_reasons(model):
    """The batched attention decode path names why it does not serve a call."""
    from mlx_lily.patches.blocks import batch_decode_unsupported

    attn = next(l.self_attn for l in model.language_model.model.layers if not l.is_linear)
    D = model.language_model.model.layers[0].input_layernorm.weight.shape[0]
    c = BatchKVCache([0, 2])
    x = mx.zeros((2, 1, D), mx.bfloat16)
    assert batch_decode_unsupported(attn, x, c) == "cache not prefilled"
    k = mx.zeros((2, attn.num_key_value_heads, 3, attn.head_dim), mx.bfloat16)
    c.update_and_fetch(k, k)
    assert batch_decode_unsupported(attn, x, c) is None
    assert batch_decode_unsupported(attn, mx.zeros((2, 2, D), mx.bfloat16), c) == \
        "not a one-token step"
    assert batch_decode_unsupported(attn, mx.zeros((9, 1, D), mx.bfloat16), c) == \
        "more than 8 sequences"
    assert batch_decode_unsupported(attn, mx.zeros((3, 1, D), mx.bfloat16), c) == \
        "per-sequence offsets"


# ------------------------------------------------------------------------- the switch
def test_batch_decode_switch_off_restores_the_one_sequence_rule(model, monkeypatch):
    """``MLX_LILY_DISABLE=batch_decode``: a decode step of B > 1 sequences is not GEMV rows,
    the batched attention path names the switch, and the batched steps launch no attention
    decode kernel (the paths batch caches took before batched decode existed); a batch of
    one row is still one GEMV row."""
    from mlx_lily.ops import attention as A, qgemv
    from mlx_lily.patches.blocks import batch_decode_unsupported
    from mlx_lily.testing.dispatch import count_kernel_launches

    z = lambda *s: mx.zeros(s, mx.bfloat16)  # noqa: E731
    assert qgemv.decode_rows(z(3, 1, 64)) == 3
    monkeypatch.setenv("MLX_LILY_DISABLE", "batch_decode")
    assert qgemv.decode_rows(z(3, 1, 64)) is None
    assert qgemv.decode_rows(z(1, 1, 64)) == 1
    attn = next(l.self_attn for l in model.language_model.model.layers if not l.is_linear)
    D = model.language_model.model.layers[0].input_layernorm.weight.shape[0]
    c = BatchKVCache([0, 2])
    k = mx.zeros((2, attn.num_key_value_heads, 3, attn.head_dim), mx.bfloat16)
    c.update_and_fetch(k, k)
    assert batch_decode_unsupported(attn, z(2, 1, D), c).startswith("batch_decode off")


@needs_emu
def test_emulated_batch_decode_switch_off_launches_no_batched_kernels(model, monkeypatch):
    """With the switch off (every other Metal kernel on, emulator), a two-row decode step
    on ``BatchKVCache`` launches neither the attention decode kernels nor the GEMV."""
    from mlx_lily.ops import attention as A
    from mlx_lily.testing.dispatch import count_kernel_launches

    pre = [_prefill_alone(model, prompt_of(n, i)) for i, n in enumerate((5, 37))]
    caches = _merge_caches([copy.deepcopy(cc) for cc, _ in pre])
    with emulated_metal():  # (which clears MLX_LILY_DISABLE: set it inside)
        monkeypatch.setenv("MLX_LILY_DISABLE", "batch_decode")
        with mlx_lily.patched(model):
            with pytest.MonkeyPatch.context() as mp:
                calls = count_kernel_launches(mp)
                mx.eval(model(mx.array([t for _, t in pre])[:, None], cache=caches))
    assert calls, "the step launched no Lily kernel at all"
    assert A.DECODE_PARTIAL.name not in calls and A.QK_NORM_ROPE.name not in calls
    assert not any(n.startswith("lily_qgemv") or n.startswith("lily_norm_qgemv") for n in calls)


@needs_emu
def test_emulated_batch_of_one_takes_the_one_sequence_step_with_the_switch_off(model,
                                                                              monkeypatch):
    """``batch_decode`` off, every other Metal kernel on, compiled steps on (built
    uncompiled): one request through ``BatchGenerator`` (how ``mlx_lm.server`` runs a
    single request; mlx-lm's batch caches of one row) prefills and decodes through the
    one-sequence paths, the decode steps through the whole-stack step, and gets the tokens
    of the prompt alone; a logits-level check on a merged one-row cache is bit-identical
    at every step."""
    from mlx_lily import backend
    from mlx_lily.patches import decode_graph as dg

    whole_on_batch = count_whole_steps_on_batch_caches(monkeypatch)
    ops = [o for o in backend.OP_NAMES if o != "batch_decode"]
    prompt = prompt_of(37, 3)
    dg.drop_compiled_steps()
    try:
        with emulated_metal(), dg.uncompiled(), pytest.MonkeyPatch.context() as mp:
            mp.setenv("MLX_LILY_COMPILE", "1")  # emulated_metal turned it off (undone first)
            with mlx_lily.patched(model, ops=ops):
                alone = greedy(model, prompt, 12)
                assert not whole_on_batch
                batch = batch_greedy(model, [prompt], [12])
                assert whole_on_batch and set(whole_on_batch) == {1}, whole_on_batch
                whole_on_batch.clear()
                check_decode_parity(model, lengths=(37,), steps=6)
                assert whole_on_batch, "the merged one-row cache took no whole-stack step"
    finally:
        dg.drop_compiled_steps()
    assert batch == [alone]
