"""Host phases against the GPU's own start and end of each pipelined decode step (MLX's
CUDA backend): the measurement behind ``benchmarks/gpu/decode_timeline.py`` and the A/B's
``--decode-timeline``.

The loop is ``mlx_lm.generate.generate_step``'s: build step n+1, ``mx.async_eval`` it, then
``.item()`` on step n's token. The host records ``time.time_ns()`` after each phase (build,
dispatch, wait); the GPU records its nanosecond timer (PTX ``%globaltimer``, through
``mlx_lily.bench.gpu_clock``) when step n+1 starts (a one-block pass-through kernel on the
token, ahead of the model) and when it ends (a stamp kernel taking the token, the
log-probs). ``calibrate`` puts both clocks on one axis: a lone
stamp kernel evaluated between two host reads (the narrowest bracket of its tries; its
half-width is the alignment error).
"""
from __future__ import annotations

import statistics
import time

import mlx.core as mx

from mlx_lily.bench import gpu_clock

#: Per-step figures (ms in ``run_loop``'s results): ``interval`` (between consecutive
#: tokens), host ``build`` / ``dispatch`` (inside ``async_eval``) / ``wait`` (inside
#: ``.item()``), ``gpu_busy`` (the step's start to end on the GPU), ``gpu_idle_before``
#: (GPU end of the previous step to this one's start), ``start_after_dispatch_begin`` (GPU
#: start minus the host's start of the dispatch) and ``end_after_dispatch_end``. In one
#: row, ``build``, ``dispatch`` and the ``gpu_*`` / ``*_dispatch_*`` figures are of the step
#: dispatched in that iteration, ``wait`` and ``interval`` of the step before it (the one
#: whose token ``.item()`` returns): medians are unaffected, per-step rows pair so.
#: ``build_cpu`` / ``dispatch_cpu``: the calling thread's CPU time in those phases
#: (``time.thread_time_ns``); a phase whose wall time far exceeds its CPU time waited
#: (descheduled, blocked in a lock or a driver call), one whose CPU time grew too ran
#: slower or did more.
KEYS = ("interval", "build", "dispatch", "wait", "gpu_busy", "gpu_idle_before",
        "start_after_dispatch_begin", "end_after_dispatch_end", "build_cpu", "dispatch_cpu")
#: ``run_loop``'s ``gc`` modes: Python's cyclic collector as it is, off during the loop,
#: or with every object allocated before the loop frozen (``gc.freeze``) out of its scans.
GC_MODES = ("on", "off", "freeze")


def calibrate(tries: int = 15) -> tuple[int, int]:
    """``(offset_ns, half_width_ns)``: GPU timer minus host ``time_ns`` at one instant,
    from the narrowest of ``tries`` host brackets around a lone stamp kernel."""
    x = mx.zeros((4,), mx.float32)
    mx.eval(gpu_clock.stamp(x))
    best = None
    for _ in range(tries):
        mx.synchronize()
        t = gpu_clock.stamp(x)
        h0 = time.time_ns()
        mx.eval(t)
        h1 = time.time_ns()
        g = gpu_clock.ns(t)
        if best is None or h1 - h0 < best[1] - best[0]:
            best = (h0, h1, g)
    h0, h1, g = best
    return g - (h0 + h1) // 2, (h1 - h0) // 2


def run_loop(model, cache, first: int, steps: int, warmup: int, gc_mode: str = "on") -> dict:
    """The generate_step loop from ``cache`` (mlx-lm cache list, updated in place) and token
    ``first`` with host and GPU stamps: ``steps`` timed steps after ``warmup``; Python's
    cyclic collector in ``gc_mode`` (``GC_MODES``) during the loop, restored after.

    Returns:
        ``{"median_ms": {key: ms}, "steps_ms": [...], "clock_offset_ns",
        "clock_align_err_ns", "tok_s", "gc_mode", "gc_collections": collections during
        the loop, per generation}`` (keys: ``KEYS``).
    Raises:
        RuntimeError: not on MLX's CUDA backend (``gpu_clock``).
        ValueError: ``gc_mode`` not in ``GC_MODES``.
    """
    import gc

    if gc_mode not in GC_MODES:
        raise ValueError(f"run_loop: gc_mode {gc_mode!r} is not one of {GC_MODES}")
    was_enabled = gc.isenabled()
    thaw = gc_mode == "freeze" and gc.get_freeze_count() == 0  # leave a caller's freeze
    if gc_mode == "off":
        gc.disable()
    elif gc_mode == "freeze":
        gc.collect()
        gc.freeze()
    before = [g["collections"] for g in gc.get_stats()]
    try:
        out = _run_loop(model, cache, first, steps, warmup)
        # read before the collector is back on (its first allocation may collect)
        out["gc_collections"] = [g["collections"] - b for g, b in zip(gc.get_stats(), before)]
    finally:
        if thaw:
            gc.unfreeze()
        if was_enabled:
            gc.enable()
    out["gc_mode"] = gc_mode
    return out


def greedy_token(model, cache, tok):
    """One decode step as mlx-lm's ``generate_step`` builds it for greedy sampling: the
    logits of ``tok`` (``[1]`` int32) against ``cache``, their log-probabilities and the
    argmax. Builds only (the caller evaluates, on its stream).

    Returns:
        ``(y, logprobs)``: ``[1]`` uint32 token and ``[1, vocab]`` log-probabilities.
    """
    logits = model(tok[None], cache=cache)[:, -1, :]
    logprobs = logits - mx.logsumexp(logits, keepdims=True)
    return mx.argmax(logprobs, axis=-1), logprobs


def _run_loop(model, cache, first: int, steps: int, warmup: int) -> dict:
    from mlx_lm.generate import generation_stream

    zero = mx.array([0, 0, 0, 0], dtype=mx.uint32)  # spin 0 us (16 bytes: device memory)
    mx.eval(zero)

    def step(tok):
        with mx.stream(generation_stream):
            t_in, g0 = gpu_clock.spin_us(tok, zero)
            y, logprobs = greedy_token(model, cache, t_in)
            # y depends on every layer, whose kernels also write the cache states: y and
            # logprobs are enough (more inputs would add to MLX's graph-size count)
            g1 = gpu_clock.stamp(y, logprobs)
        return y, logprobs, g0, g1

    cur = step(mx.array([first], dtype=mx.int32))
    mx.async_eval(*cur)
    recs = []
    cpu = time.thread_time_ns
    for _ in range(steps + warmup + 1):  # intervals need the step before
        c0, h0 = cpu(), time.time_ns()
        nxt = step(cur[0])
        c1, h1 = cpu(), time.time_ns()
        mx.async_eval(*nxt)
        c2, h2 = cpu(), time.time_ns()
        cur[0].item()
        h3 = time.time_ns()
        recs.append({"h": (h0, h1, h2, h3), "c": (c0, c1, c2), "arrays": nxt})
        cur = nxt
    cur[0].item()
    mx.synchronize()
    off, err = calibrate()
    rows = []
    for i in range(1, len(recs)):
        h0, h1, h2, h3 = recs[i]["h"]
        g0 = gpu_clock.ns(recs[i]["arrays"][2]) - off
        g1 = gpu_clock.ns(recs[i]["arrays"][3]) - off
        pg1 = gpu_clock.ns(recs[i - 1]["arrays"][3]) - off
        c0, c1, c2 = recs[i]["c"]
        rows.append({"interval": h3 - recs[i - 1]["h"][3], "build": h1 - h0,
                     "dispatch": h2 - h1, "wait": h3 - h2, "gpu_busy": g1 - g0,
                     "gpu_idle_before": g0 - pg1, "start_after_dispatch_begin": g0 - h1,
                     "end_after_dispatch_end": g1 - h2, "build_cpu": c1 - c0,
                     "dispatch_cpu": c2 - c1})
    rows = rows[warmup:]
    med = {k: statistics.median(r[k] for r in rows) / 1e6 for k in KEYS}
    return {"median_ms": med, "steps_ms": [{k: r[k] / 1e6 for k in KEYS} for r in rows],
            "clock_offset_ns": off, "clock_align_err_ns": err,
            "tok_s": 1e3 / med["interval"]}




#: Per-chunk figures of ``prefill_run`` (ms): host ``build`` (the model call),
#: ``dispatch`` (inside ``mx.async_eval``), ``wait`` (until the chunk's results are
#: ready), GPU ``gpu_busy`` (the chunk's start to end on the GPU), ``start_after_dispatch_begin``
#: and ``host_after_gpu_end`` (the host's return minus the GPU's end: sync latency),
#: ``clear`` (``mx.clear_cache()`` after the chunk, as generate_step calls it; 0 for the
#: last step), ``cache_mb`` (MLX's buffer cache, MiB, just before that clear).
PREFILL_KEYS = ("tokens", "build", "dispatch", "wait", "gpu_busy",
                "start_after_dispatch_begin", "host_after_gpu_end", "clear", "cache_mb")


def prefill_run(model, ids, prefill_step_size: int = 2048) -> dict:
    """A prompt through ``mlx_lm.generate.generate_step``'s prefill, chunk by chunk (all
    tokens but the last in chunks of ``prefill_step_size``, evaluating the cache states
    and clearing MLX's buffer cache after each; then the last token's step with its
    log-probs and greedy token), each chunk timed on the host and on the GPU.

    Args:
        model: an mlx-lm model (patched or not).
        ids: the prompt's token ids (at least 1).
        prefill_step_size: tokens per chunk, as ``generate_step``'s argument.
    Returns:
        ``{"chunks": [{key: value}], "total_ms", "tok_s", "clock_align_err_ns"}`` (keys:
        ``PREFILL_KEYS``; the last chunk is the final one-token-or-more step).
    Raises:
        RuntimeError: not on MLX's CUDA backend (``gpu_clock``).
        ValueError: an empty prompt.
    """
    from mlx.utils import tree_flatten
    from mlx_lm.generate import generation_stream
    from mlx_lm.models.cache import make_prompt_cache

    if len(ids) < 1:
        raise ValueError("prefill_run: empty prompt")
    zero = mx.array([0, 0, 0, 0], dtype=mx.uint32)
    mx.eval(zero)
    cache = make_prompt_cache(model)
    prompt = mx.array([int(t) for t in ids], dtype=mx.int32)  # numpy ints too
    raw = []
    mx.synchronize()
    t_start = time.time_ns()
    with mx.stream(generation_stream):
        while prompt.size > 1:
            n = min(prefill_step_size, prompt.size - 1)
            h0 = time.time_ns()
            chunk, g0 = gpu_clock.spin_us(prompt[:n], zero)
            model(chunk[None], cache=cache)
            states = [v for _, v in tree_flatten([c.state for c in cache])
                      if isinstance(v, mx.array)]
            g1 = gpu_clock.stamp(*states)
            h1 = time.time_ns()
            mx.async_eval(states, g0, g1)
            h2 = time.time_ns()
            mx.eval(g1)
            h3 = time.time_ns()
            cached = mx.get_cache_memory()
            h3c = time.time_ns()
            mx.clear_cache()
            raw.append((n, h0, h1, h2, h3, g0, g1, time.time_ns() - h3c, cached))
            prompt = prompt[n:]
        h0 = time.time_ns()
        last, g0 = gpu_clock.spin_us(prompt, zero)
        logits = model(last[None], cache=cache)[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        y = mx.argmax(logprobs, axis=-1)
        g1 = gpu_clock.stamp(y, logprobs)
        h1 = time.time_ns()
        mx.async_eval(y, logprobs, g0, g1)
        h2 = time.time_ns()
        y.item()
        h3 = time.time_ns()
        raw.append((int(prompt.size), h0, h1, h2, h3, g0, g1, 0, mx.get_cache_memory()))
    total = h3 - t_start
    mx.synchronize()
    off, err = calibrate()
    chunks = []
    for n, h0, h1, h2, h3, g0, g1, clr, cached in raw:
        s, e = gpu_clock.ns(g0) - off, gpu_clock.ns(g1) - off
        chunks.append({"tokens": n, "build": (h1 - h0) / 1e6, "dispatch": (h2 - h1) / 1e6,
                       "wait": (h3 - h2) / 1e6, "gpu_busy": (e - s) / 1e6,
                       "start_after_dispatch_begin": (s - h1) / 1e6,
                       "host_after_gpu_end": (h3 - e) / 1e6, "clear": clr / 1e6,
                       "cache_mb": cached / 2**20})
    return {"chunks": chunks, "total_ms": total / 1e6, "tok_s": len(ids) / (total / 1e9),
            "clock_align_err_ns": err}
