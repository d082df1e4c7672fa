"""Greedy generation helpers shared by the tests and the GPU benchmarks: one prompt
through mlx-lm's ``generate_step``, and prompts batched through mlx-lm's
``BatchGenerator`` (what ``mlx_lm.server`` and ``batch_generate`` use)."""

from __future__ import annotations


def greedy_trace(model, prompt, n: int, **kw) -> tuple:
    """``(tokens, logprobs)``: the first ``n`` greedy token ids (ints) of ``prompt`` (a list
    of ids) through ``mlx_lm.generate.generate_step`` (``kw`` passed on, e.g.
    ``prefill_step_size``), and every step's log-probabilities (a list of ``n``
    ``mx.array [V]`` in the model's dtype), to find the first step at which
    two runs' arithmetic departs (a differing token may come steps later)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    out, lps = [], []
    for (tok, lp), _i in zip(generate_step(mx.array(prompt), model, max_tokens=n, **kw),
                             range(n)):
        out.append(int(tok))
        lps.append(lp.reshape(-1))
    return out, lps


def greedy(model, prompt, n: int, **kw) -> list:
    """The first ``n`` greedy token ids of ``prompt`` (``greedy_trace``'s tokens)."""
    return greedy_trace(model, prompt, n, **kw)[0]


def batch_generator(model, n: int, **gen_kw):
    """An empty mlx-lm ``BatchGenerator`` as ``mlx_lm.server`` runs ``n`` concurrent
    requests: no stop token, prefill and decode batches of up to ``n`` rows; ``gen_kw``
    goes to ``BatchGenerator`` (e.g. ``prefill_step_size``)."""
    from mlx_lm.generate import BatchGenerator

    return BatchGenerator(model, stop_tokens=[[-1]], prefill_batch_size=n,
                          completion_batch_size=n, **gen_kw)


def batch_greedy(model, prompts, max_tokens, logprobs: list | None = None, **gen_kw) -> list:
    """Greedy token ids per prompt through ``BatchGenerator``: all prompts prefilled
    together, row i stopping after ``max_tokens[i]`` tokens (no stop token); ``gen_kw``
    goes to ``BatchGenerator`` (e.g. ``prefill_step_size``). With ``logprobs`` (an empty
    list), it receives each row's per-step log-probabilities (a list of ``mx.array [V]``
    per row, in prompt order)."""
    gen = batch_generator(model, len(prompts), **gen_kw)
    uids = gen.insert(prompts, list(max_tokens))
    out = {u: [] for u in uids}
    lps = {} if logprobs is not None else None
    _collect(gen, out, logprobs=lps)
    gen.close()
    if logprobs is not None:
        logprobs.extend(lps.get(u, []) for u in uids)
    return [out[u] for u in uids]


def _collect(gen, out: dict, steps: int | None = None, logprobs: dict | None = None) -> None:
    """Append each generated token to ``out[uid]`` (and, with ``logprobs``, its
    log-probabilities ``[V]`` to ``logprobs[uid]``): ``steps`` decode steps of ``gen``, or
    until it has nothing left to generate."""
    while steps is None or steps > 0:
        responses = gen.next_generated()
        if not responses:
            return
        for r in responses:
            out[r.uid].append(int(r.token))
            if logprobs is not None:
                logprobs.setdefault(r.uid, []).append(r.logprobs.reshape(-1))
        if steps is not None:
            steps -= 1


def batch_greedy_joining(model, first, later, max_tokens, join_after: int = 2,
                         logprobs: list | None = None, **gen_kw) -> list:
    """Greedy token ids per prompt through one ``BatchGenerator`` whose requests arrive at
    two times, as ``mlx_lm.server`` receives them: the prompts ``first`` are inserted and
    decoded ``join_after`` steps, then ``later`` join the running batch (prefilled while
    the others wait, then decoded with them). Row i (``first + later`` order) stops after
    ``max_tokens[i]`` tokens (no stop token); ``gen_kw`` goes to ``BatchGenerator`` (e.g.
    ``prefill_step_size``). With ``logprobs`` (an empty list), it receives each row's
    per-step log-probabilities (a list of ``mx.array [V]`` per row, in row order). Raises
    ValueError when the first requests would finish before the others join
    (``join_after`` must be below their lengths)."""
    n_first = len(first)
    if join_after >= min(max_tokens[:n_first]):
        raise ValueError(f"join_after={join_after}: every first request must still run")
    n = len(first) + len(later)
    gen = batch_generator(model, n, **gen_kw)
    uids = gen.insert(list(first), list(max_tokens[:n_first]))
    out = {u: [] for u in uids}
    lps = {} if logprobs is not None else None
    _collect(gen, out, join_after, lps)
    more = gen.insert(list(later), list(max_tokens[n_first:]))
    out.update({u: [] for u in more})
    uids = list(uids) + list(more)
    _collect(gen, out, logprobs=lps)
    gen.close()
    if logprobs is not None:
        logprobs.extend(lps.get(u, []) for u in uids)
    return [out[u] for u in uids]
