"""Batch prefill one sequence at a time, so a request's prefill does not depend on what it
was batched with.

mlx-lm's ``BatchGenerator`` prefills the prompts it starts together as one right-padded
``[B, L_max]`` call (``PromptProcessingBatch.prompt``), and a request joining a running
batch is prefilled that way beside the other new ones. On a GPU the matrix products of
that call see ``B * L_max`` rows, and MLX picks their kernels (and with them the order of
the sums) by the number of rows, so a prompt's first-token distribution differed between
alone and beside a longer prompt (an H100, ``docs/results.md``). Here each sequence of
such a call runs as a batch of one, through the same code and shapes as that request
alone, and the rows' caches are then merged the way mlx-lm merges caches
(``BatchKVCache.merge``: left-padded to the longest row).

The cost is prefill throughput: ``B`` calls of ``[1, L_i]`` rows instead of one of
``[B, L_max]`` (eight 512-token prompts on an H100: about 7,500 prompt tok/s instead of
20,000, ``docs/results.md``).
"""

from __future__ import annotations

import copy
import functools

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache


def _row_kv(c: BatchKVCache, i: int, pad: int) -> BatchKVCache:
    """Row ``i`` of ``c`` (whose left padding is ``pad`` entries) as a one-row
    ``BatchKVCache``: what that sequence's cache is when ``BatchGenerator`` runs it alone
    (an empty one, or its history with the left padding cut and the buffer's free rows
    kept, so the longest row keeps the capacity it has alone)."""
    row = BatchKVCache([0])
    row.step = c.step
    if c.keys is None:
        return row
    n = c._idx - pad
    if n > 0:
        row.keys = mx.contiguous(c.keys[i:i + 1, :, pad:])
        row.values = mx.contiguous(c.values[i:i + 1, :, pad:])
        row.offset = row.offset + n
        row._idx = n
    return row


def _row_arrays(c: ArraysCache, i: int) -> ArraysCache:
    """Row ``i`` of ``c`` as a one-row ``ArraysCache``: its state arrays sliced (a missing
    array stays missing) and its ``left_padding`` (``advance`` takes it below zero as
    tokens pass), as the sequence's cache is when it runs alone."""
    row = ArraysCache(len(c.cache))
    if not c.empty():
        row.cache = [None if a is None else a[i:i + 1] for a in c.cache]
    row = ArraysCache.merge([row])
    if c.left_padding is not None:
        row.left_padding = c.left_padding[i:i + 1]
    return row


def _merge_kv(rows: list) -> BatchKVCache:
    """One ``BatchKVCache`` of the one-row caches ``rows``, each row right-aligned at the
    longest row's length (left-padded, as ``BatchKVCache.merge`` places them), with the
    longest row's capacity (what that row has alone, and mlx-lm's padded call would have
    left; a decode step picks its split-K block from it) and the largest growth step."""
    lengths = [0 if r.keys is None else r._idx for r in rows]
    longest = max(lengths)
    merged = BatchKVCache([longest - n for n in lengths])
    merged.step = max(r.step for r in rows)
    live = [r for r in rows if r.keys is not None]
    if not live:
        return merged
    cap = max([longest] + [r.keys.shape[2] for r, n in zip(rows, lengths)
                           if n == longest and r.keys is not None])
    k0, v0 = live[0].keys, live[0].values
    keys = mx.zeros((len(rows), k0.shape[1], cap, k0.shape[3]), k0.dtype)
    values = mx.zeros((len(rows), v0.shape[1], cap, v0.shape[3]), v0.dtype)
    for i, (r, n) in enumerate(zip(rows, lengths)):
        if n:
            keys[i:i + 1, :, longest - n:longest] = r.keys[..., :n, :]
            values[i:i + 1, :, longest - n:longest] = r.values[..., :n, :]
    merged.keys, merged.values = keys, values
    merged.offset = merged.offset + longest
    merged._idx = longest
    return merged


def _merge_arrays(rows: list) -> ArraysCache:
    """One ``ArraysCache`` of the one-row caches ``rows``; ``left_padding`` kept per row
    (the SSM mask a row has alone) where every row has one."""
    merged = ArraysCache.merge(rows)
    pads = [r.left_padding for r in rows]
    merged.left_padding = None if any(p is None for p in pads) else mx.concatenate(pads)
    return merged


def per_row_unsupported(batch, tokens) -> str | None:
    """Why ``batch.prompt(tokens)`` keeps mlx-lm's one padded call, or None.

    Args:
        batch: an mlx-lm ``PromptProcessingBatch``.
        tokens: the call's prompt token ids, one list per sequence.
    Returns:
        A short reason, or None when every sequence is prefilled alone: a patched Lily
        model, two or more sequences, ``batch_decode`` on (the same switch as the batched
        decode steps) and only caches this module splits (mlx-lm's ``BatchKVCache``
        with no pending padding, ``ArraysCache`` with no padding left to enter; the
        negative ``left_padding`` that ``advance`` leaves after tokens passed is none).
    """
    from mlx_lily.patches.blocks import batch_kernels_on

    if len(tokens) < 2:
        return "one sequence"
    if not getattr(batch.model, "_lily_prepared", False):
        return "not a Lily model"
    if not batch_kernels_on():
        return "batch_decode off"
    for c in batch.prompt_cache:
        if type(c) is BatchKVCache:
            if c._right_padding is not None or (c.keys is None and
                                                 mx.any(c.left_padding != 0).item()):
                return "a BatchKVCache with pending padding"
        elif type(c) is ArraysCache:
            if c.lengths is not None or (c.left_padding is not None
                                         and mx.any(c.left_padding > 0).item()):
                return "an ArraysCache with padding"
        else:
            return f"cache type {type(c).__name__}"
    return None


def wrap_prompt(original):
    """``PromptProcessingBatch.prompt`` prefilling each sequence alone where
    ``per_row_unsupported`` allows it, else ``original`` (mlx-lm's method). The returned
    method takes ``tokens`` (one list of ids per sequence) and raises ValueError, as
    mlx-lm's does, when their number differs from the batch's."""

    @functools.wraps(original)
    def prompt(self, tokens):
        if per_row_unsupported(self, tokens) is not None:
            return original(self, tokens)
        if len(self.uids) != len(tokens):
            raise ValueError("The batch length doesn't match the number of inputs")
        # each attention cache's left padding read once (one host sync per cache)
        pads = [c.left_padding.tolist() if type(c) is BatchKVCache and c.keys is not None
                else None for c in self.prompt_cache]
        rows = [[_row_kv(c, i, int(p[i]) if p else 0) if type(c) is BatchKVCache
                 else _row_arrays(c, i) for c, p in zip(self.prompt_cache, pads)]
                for i in range(len(tokens))]
        self.prompt_cache = []  # the rows hold the history now: one copy at a time
        for i, toks in enumerate(tokens):
            one = copy.copy(self)  # shares model, step size, ...; its own row below
            one.uids = [self.uids[i]]
            one.tokens = [self.tokens[i]]  # the same list: extended in place
            one.prompt_cache = rows[i]
            if len(toks):
                original(one, [toks])
            rows[i] = one.prompt_cache
        self.prompt_cache = [
            _merge_kv(layer) if type(layer[0]) is BatchKVCache else _merge_arrays(layer)
            for layer in zip(*rows)]
        mx.eval([c.state for c in self.prompt_cache])

    return prompt
