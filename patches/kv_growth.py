"""KV-cache growth policy of a patched forward: plain ``KVCache`` objects grow by
``DEFAULT_KV_STEP`` tokens (``MLX_LILY_KV_STEP``) instead of mlx-lm's 256, a prefill leaves
``KV_HEADROOM`` free rows, and a decode step writes its row at an array offset
(``kv_write_index``)."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache



def kv_write_index(offset, row_shape):
    """Indices for writing one token's K or V row ``[B, Hkv, 1, D]`` into a whole cache
    buffer at position ``offset`` (int32 ``[1]``) with ``mx.put_along_axis(buf, idx, row,
    axis=2)``: ``offset`` broadcast to ``row_shape``. Not ``mx.slice_update`` at an array
    offset: on MLX's CUDA backend (0.32) that primitive launches its copy kernel over the
    whole buffer (``copy_general_dynamic`` sized by the output), 0.66 ms per write on a
    128K-token cache on the H200 (``benchmarks/gpu/kv_write_probe.py``) vs 0.05 ms for the
    static write stock mlx-lm does; ``put_along_axis`` (``ScatterAxis``) launches over the
    row only and updates the donated buffer in place."""
    return mx.broadcast_to(offset.reshape(1, 1, 1, 1), row_shape)


KV_STEP_ENV = "MLX_LILY_KV_STEP"  # tuning.kv_step


#: KV-cache capacity growth (tokens) for plain ``KVCache`` objects a patched forward sees
#: (and mlx-lm's ``BatchKVCache`` of one sequence, or of up to 8 while ``batch_decode`` is
#: on).
#: mlx-lm grows by 256; each growth changes the compiled decode step's shapes, so the step
#: that grows runs layer by layer and the next one traces the whole stack again
#: (``benchmarks/build_time.py --layers 40 --growth-steps 1100`` on this repository's CPU
#: box, stubbed kernels: at 256, 8 steps of 1100 over 5x the median, 37.4 ms
#: in all, against a 0.32 ms median). 2048 (the prefill chunk) cuts those events 8x for at
#: most 2047 unused cache rows per attention layer and sequence (4 MiB for Qwen3.6-35B-A3B's
#: 2 KV heads x 256 dims, bf16 K and V).
DEFAULT_KV_STEP = 2048


def _kv_step() -> int:
    """``MLX_LILY_KV_STEP`` (``tuning.kv_step``: an integer >= 1; a bad value warns once
    and keeps the default), else ``DEFAULT_KV_STEP``."""
    from mlx_lily import tuning

    v = tuning.kv_step
    return DEFAULT_KV_STEP if v is None else v


def _grows(c, batch: bool) -> bool:
    """Whether this policy applies to ``c``: a plain ``KVCache``, or with ``batch`` (the
    ``batch_decode`` switch on, or a batch of one sequence) also mlx-lm's
    ``BatchKVCache``, so a sequence's cache in a
    batch has the capacity it has alone (the compiled decode step's split-K block follows
    the capacity)."""
    return type(c) is KVCache or (batch and type(c) is BatchKVCache)


def kv_rows(c) -> int:
    """Rows written in an attention cache: ``offset`` of a ``KVCache``, ``_idx`` (common to
    every sequence; left padding included) of a ``BatchKVCache``."""
    return c._idx if type(c) is BatchKVCache else c.offset


def widen_kv_steps(cache, batch: bool = False) -> None:
    """Raise the growth step of every plain ``KVCache`` in ``cache`` (and ``BatchKVCache``
    with ``batch``) to ``_kv_step()`` (never lower it). Only the capacity changes:
    ``offset``, the rows up to it and the attention results are those of mlx-lm's growth
    (which trims to the offset before growing when the offset is not a multiple of the
    step). mlx-lm 0.32's
    ``KVCache.state`` is the whole buffer, so a cache saved with ``save_prompt_cache``
    carries up to step - 1 unused rows per attention layer, as it does at 256."""
    step = _kv_step()
    if step <= 0:
        return
    for c in cache:
        if _grows(c, batch) and c.step < step:
            c.step = step


#: Rows a multi-token (prefill) call leaves free in each plain ``KVCache`` it grew into:
#: ``generate_step`` runs the prompt's last token and builds the first generated one right
#: after the prefill chunks, and a step without room runs layer by layer and makes the
#: next one retrace the compiled stack. A prompt of 4096 tokens filled the 4096-row cache
#: exactly, so the first generated token paid that inside the time to first token.
KV_HEADROOM = 2


def kv_headroom(cache, rows: int = KV_HEADROOM, batch: bool = False) -> None:
    """Grow every plain ``KVCache`` in ``cache`` (and ``BatchKVCache`` with ``batch``) with
    fewer than ``rows`` free rows by its step (zeros appended along the sequence axis, as
    mlx-lm's own growth does when the offset is a multiple of the step): the growth the
    next decode step would do, done at the end of a prefill call instead. The written
    rows (``kv_rows``), ``offset`` and the rows up to it are unchanged."""
    for c in cache or ():
        if not _grows(c, batch) or c.keys is None or c.step <= 0:
            continue
        cap, used = c.keys.shape[2], kv_rows(c)
        if cap - used >= rows:
            continue
        keys, values = c.keys[..., :used, :], c.values[..., :used, :]
        n = ((used + rows + c.step - 1) // c.step) * c.step - used
        kz = mx.zeros((*keys.shape[:2], n, keys.shape[3]), keys.dtype)
        vz = mx.zeros((*values.shape[:2], n, values.shape[3]), values.dtype)
        c.keys = mx.concatenate([keys, kz], axis=2)
        c.values = mx.concatenate([values, vz], axis=2)
