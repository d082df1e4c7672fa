"""The prefix cache (``mlx_lily.prefix_cache``): snapshots of a hybrid model's GDN state let a
follow-up prompt prefill only what is new, with greedy output identical to a cold run.

Models: a 2-layer synthetic Qwen3.6 (one GDN layer, one attention layer, the real tokenizer
and chat template), written once per module. Through the Python helper (``prefill``) in
process, and through ``mlx_lm.server`` with Lily on loopback (subprocesses)."""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
import urllib.request
from pathlib import Path

import mlx.core as mx
import pytest

ROOT = Path(__file__).resolve().parent.parent
MINI = dict(hidden_size=64, num_hidden_layers=2, full_attention_interval=2,
            num_attention_heads=8, num_key_value_heads=1, linear_num_key_heads=2,
            linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=64, shared_expert_intermediate_size=64)
N_GEN = 3
TOOLS = [{"type": "function", "function": {
    "name": "ls", "description": "List a directory.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}]


def _bench():
    spec = importlib.util.spec_from_file_location("agent_loop", ROOT / "benchmarks" / "agent_loop.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("agent_loop", mod)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def mini_ckpt(tmp_path_factory):
    from mlx_lily.synth import _text_config, write_checkpoint

    return write_checkpoint(_text_config(**MINI), tmp_path_factory.mktemp("pc") / "mini", 0)


@pytest.fixture(scope="module")
def mini(mini_ckpt):
    """The model patched as the Lily server runs it (patched for each test that needs it)."""
    from mlx_lm import load

    return load(str(mini_ckpt))


def render(tok, msgs, tools=None):
    return list(tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True,
                                        tokenize=True))


def greedy(model, rest, cache, n=N_GEN):
    from mlx_lm.generate import generate_step

    return [t for t, _ in generate_step(mx.array(rest), model, prompt_cache=cache, max_tokens=n)]


_COLD: dict = {}


def cold(model, tokens, n=N_GEN):
    """Greedy tokens of ``tokens`` from an empty cache (memoized per patch state)."""
    import mlx_lily
    from mlx_lm.models.cache import make_prompt_cache

    key = (id(model), mlx_lily.is_patched(), tuple(tokens), n)
    if key not in _COLD:
        _COLD[key] = greedy(model, tokens, make_prompt_cache(model), n)
    return _COLD[key]


def lcp(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def expected_cached(tok, history, cur, every=0):
    """Deepest snapshot point of an earlier (completed) prompt that is a prefix of ``cur``."""
    from mlx_lily.prefix_cache import message_boundaries, snapshot_points

    best = 0
    for prev in history:
        pts = snapshot_points(len(prev), boundaries=message_boundaries(tok, prev), every=every)
        lim = min(lcp(prev, cur), len(cur) - 1)
        best = max([best] + [p for p in pts if p <= lim])
    return best


def conversation():
    """Three requests of an agent loop: a task; a tool call (with reasoning, kept by the
    template after the last user turn) and its result; a final answer and a new user turn
    (the template now drops the earlier turn's reasoning)."""
    sys_msg = {"role": "system", "content": "You are a careful assistant. " * 4}
    m0 = [sys_msg, {"role": "user", "content": "List the files in the project root."}]
    m1 = m0 + [{"role": "assistant", "content": "Looking.",
                "reasoning_content": "I should call the ls tool.",
                "tool_calls": [{"type": "function",
                                "function": {"name": "ls", "arguments": {"path": "."}}}]},
               {"role": "tool", "content": "README.md setup.py src tests docs"}]
    m2 = m1 + [{"role": "assistant", "content": "There are five entries."},
               {"role": "user", "content": "Which one holds the tests?"}]
    return [m0, m1, m2]


# ---------------------------------------------------------------------------------------
# Python helper
# ---------------------------------------------------------------------------------------

def run_helper(model, tok, store, prompts, key="m", every=0):
    from mlx_lily.prefix_cache import prefill

    out = []
    for p in prompts:
        r = prefill(model, p, store, key=key, tokenizer=tok, every=every)
        gen = greedy(model, r.rest, r.cache)
        store.insert_cache(key, p + gen, r.cache)
        out.append((r.cached_tokens, gen))
    return out


def test_helper_tool_turns_reasoning_dropped_and_divergence(mini):
    import mlx_lily

    mlx_lily.patch()
    from mlx_lily.prefix_cache import PrefixCache

    model, tok = mini
    msgs = conversation()
    prompts = [render(tok, m) for m in msgs]
    # an edit inside the first user message: back to that message's start
    edited = [msgs[0][0], {"role": "user", "content": "List the files in the docs folder."}]
    prompts.append(render(tok, edited))
    store = PrefixCache()
    got = run_helper(model, tok, store, prompts)
    for i, (p, (cached, gen)) in enumerate(zip(prompts, got)):
        assert cached == expected_cached(tok, prompts[:i], p), i
        assert gen == cold(model, p), i
    # extending the cached prompt: all of it is reused but its last token
    assert got[1][0] == len(prompts[0]) - 1
    # reasoning dropped: the prompts part where prompt 1's assistant turn starts its
    # reasoning; restored from the snapshot before prompt 0's thinking tail
    turn = lcp(prompts[1], prompts[2])
    assert turn == len(prompts[0]) - 2 < len(prompts[1]) - 20
    assert got[2][0] == turn
    # an edit inside the first user message: back to that message's start
    assert 0 < got[3][0] < lcp(prompts[0], prompts[3]) < len(prompts[0]) - 5
    assert store.counters["snapshot_hits"] == 3


def test_helper_shorter_prompt_and_repeat(mini):
    import mlx_lily

    mlx_lily.patch()
    from mlx_lily.prefix_cache import PrefixCache, prefill

    model, tok = mini
    long = render(tok, conversation()[0])
    store = PrefixCache()
    run_helper(model, tok, store, [long], every=16)
    # shorter than the deepest snapshots, right after a snapshot, the whole prompt
    for n in (40, 17, len(long)):
        r = prefill(model, long[:n], store, key="m", every=16)
        assert r.cached_tokens == expected_cached(tok, [long], long[:n], every=16), n
        assert greedy(model, r.rest, r.cache) == cold(model, long[:n]), n
    assert r.cached_tokens == len(long) - 1


def test_helper_two_conversations_interleaved(mini):
    import mlx_lily

    mlx_lily.patch()
    from mlx_lily.prefix_cache import PrefixCache

    model, tok = mini
    a = conversation()[:2]
    b = [[{"role": "system", "content": "Answer in French."}] + m[1:] for m in a]
    order = [render(tok, a[0]), render(tok, b[0]), render(tok, a[1]),
             render(tok, b[1])]
    store = PrefixCache()
    got = run_helper(model, tok, store, order)
    assert [g[0] for g in got] == [expected_cached(tok, order[:i], p)
                                   for i, p in enumerate(order)]
    assert got[2][0] == len(order[0]) - 1 and got[3][0] == len(order[1]) - 1
    for p, (_, gen) in zip(order, got):
        assert gen == cold(model, p)


def test_helper_eviction_keeps_byte_limit(mini):
    import mlx_lily
    from mlx_lily.prefix_cache import PrefixCache, prefill, snapshot_nbytes

    mlx_lily.patch()
    model, tok = mini
    prompts = [render(tok, m) for m in conversation()]
    snap = snapshot_nbytes(model)
    assert snap > 0
    # room for one full cache (KV + state) of the last prompt and three snapshots
    r = prefill(model, prompts[-1], PrefixCache(), key="m", every=0)
    store = PrefixCache(max_bytes=sum(c.nbytes for c in r.cache) + 3 * snap)
    for p in prompts:
        r = prefill(model, p, store, key="m", tokenizer=tok, every=0)
        assert store.nbytes <= store.max_bytes
        gen = greedy(model, r.rest, r.cache)
        assert gen == cold(model, p)
        store.insert_cache("m", p + gen, r.cache)
        assert store.nbytes <= store.max_bytes
    assert store.counters["evicted"] > 0
    assert store.counters["snapshot_hits"] >= 1


def test_store_snapshot_state_is_copied_fp32(mini):
    from mlx_lm.models.cache import ArraysCache, make_prompt_cache

    from mlx_lily.prefix_cache import PrefixCache

    model, _ = mini
    cache = make_prompt_cache(model)
    tokens = list(range(100, 120))
    model(mx.array(tokens)[None], cache=cache)
    store = PrefixCache()
    store.insert_cache("m", tokens, cache, cache_type="snapshot")
    ((_, n, nbytes),) = store.snapshots()
    assert n == 20
    state = [c for c in cache if isinstance(c, ArraysCache)][0]
    assert state.cache[1].dtype == mx.float32
    entry = next(iter(store._entries.values()))
    layer = next(l for l in entry.cache if l is not None)
    assert layer[1].dtype == mx.float32 and layer[1] is not state.cache[1]
    assert nbytes == sum(a.nbytes for a in state.cache)
    # no donor (full entry through these tokens) yet: not usable
    assert store.fetch_nearest_cache("m", tokens + [5, 6])[0] is None


def test_store_end_of_prefill_donor_then_snapshot(mini):
    """The server stores the end of a prefill as a full cache: the donor of that prompt's
    snapshots while it generates; the final cache turns it into a snapshot."""
    import copy

    from mlx_lm.models.cache import make_prompt_cache

    import mlx_lily
    from mlx_lily.prefix_cache import PrefixCache, message_boundaries, snapshot_points
    from mlx_lily.prefix_cache.plan import prefill_points

    mlx_lily.patch()
    model, tok = mini
    p = render(tok, conversation()[0])
    pts = snapshot_points(len(p), boundaries=message_boundaries(tok, p))
    store = PrefixCache()
    cache = make_prompt_cache(model)
    prefill_points(model, cache, p, 0, pts, store, "m", step=64)
    store.insert_cache("m", p[:-1], copy.deepcopy(cache), cache_type="assistant")
    assert store.stats_by_type()["assistant"]["n_sequences"] == 1
    other = p[:pts[-3]] + tok.encode("Different question?")
    c2, rest = store.fetch_nearest_cache("m", other)
    assert len(other) - len(rest) == pts[-3] and store.counters["snapshot_hits"] == 1
    assert greedy(model, rest, c2) == cold(model, other)
    before = store.nbytes
    gen = greedy(model, p[-1:], cache)
    store.insert_cache("m", p + gen, cache)
    stats = store.stats_by_type()
    assert stats["assistant"]["n_sequences"] == 1 and stats["snapshot"]["n_sequences"] == len(pts)
    assert store.nbytes < before + sum(c.nbytes for c in cache)


def test_patch_installs_and_unpatch_restores(monkeypatch):
    import mlx_lm.models.cache as mc

    import mlx_lily
    from mlx_lily.prefix_cache import PrefixCache, installed

    orig = mc.LRUPromptCache
    assert orig is not PrefixCache
    mlx_lily.patch()
    assert mc.LRUPromptCache is PrefixCache and installed()
    mlx_lily.unpatch()
    assert mc.LRUPromptCache is orig and not installed()
    monkeypatch.setenv("MLX_LILY_PREFIX_CACHE", "0")
    mlx_lily.patch()
    assert mc.LRUPromptCache is orig and not installed()
    mlx_lily.unpatch()


def test_patch_survives_prefix_cache_failure(monkeypatch):
    import mlx_lm.models.cache as mc

    import mlx_lily
    import mlx_lily.prefix_cache as pc

    orig = mc.LRUPromptCache

    def broken():
        raise RuntimeError("boom")

    monkeypatch.setattr(pc, "install_if_enabled", broken)
    with pytest.warns(UserWarning, match="prefix cache not installed.*boom"):
        mlx_lily.patch()
    assert mlx_lily.is_patched() and mc.LRUPromptCache is orig
    mlx_lily.unpatch()


def test_server_hooks_reversible():
    import mlx_lm.server as srv

    import mlx_lily
    from mlx_lily.prefix_cache import PrefixCache

    tokenize, stream_generate, lru = (srv.ResponseGenerator.__dict__["_tokenize"],
                                      srv.stream_generate, srv.LRUPromptCache)
    mlx_lily.patch()
    assert srv.LRUPromptCache is PrefixCache
    PrefixCache()  # what mlx_lm.server.run builds: hooks the server module
    assert srv.ResponseGenerator._tokenize.__wrapped__ is tokenize
    assert srv.stream_generate.__wrapped__ is stream_generate
    mlx_lily.unpatch()
    assert srv.ResponseGenerator.__dict__["_tokenize"] is tokenize
    assert srv.stream_generate is stream_generate and srv.LRUPromptCache is lru


def test_settings_parse(monkeypatch):
    from mlx_lily.prefix_cache import DEFAULT_EVERY, settings

    monkeypatch.setenv("MLX_LILY_PREFIX_CACHE_EVERY", "512")
    assert settings().every == 512
    monkeypatch.setenv("MLX_LILY_PREFIX_CACHE_EVERY", "lots")
    from mlx_lily import config

    config.WARNED.discard(("MLX_LILY_PREFIX_CACHE_EVERY", "lots"))  # one warning per process
    with pytest.warns(UserWarning, match="MLX_LILY_PREFIX_CACHE_EVERY"):
        assert settings().every == DEFAULT_EVERY


# ---------------------------------------------------------------------------------------
# mlx_lm.server with Lily, on 127.0.0.1
# ---------------------------------------------------------------------------------------

def post(server, msgs, tools=None, **extra):
    """A greedy non-streamed chat request: ``(token ids, cached_tokens, prompt_tokens)``."""
    body = {"messages": msgs, "max_tokens": N_GEN, "temperature": 0.0, "logprobs": True,
            **({"tools": tools} if tools else {}), **extra}
    req = urllib.request.Request(f"http://127.0.0.1:{server.port}/v1/chat/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        out = json.loads(r.read())
    ids = [c["id"] for c in out["choices"][0]["logprobs"]["content"]]
    u = out["usage"]
    return ids, u["prompt_tokens_details"]["cached_tokens"], u["prompt_tokens"]


def matches_cold(ids, ref):
    """The server stops at an end token; the cold run does not."""
    return len(ids) >= 1 and ids == ref[:len(ids)]


@pytest.fixture(scope="module")
def lily_server(mini_ckpt, tmp_path_factory):
    srv = _bench().Server("lily", mini_ckpt, tmp_path_factory.mktemp("srv"),
                          env={"MLX_LILY_PREFIX_CACHE_EVERY": "0"})
    yield srv
    srv.stop()


def test_server_batched_and_sequential_paths(lily_server, mini):
    import mlx_lily

    model, tok = mini
    msgs = conversation()
    prompts = [render(tok, m) for m in msgs]
    mlx_lily.patch()
    refs = [cold(model, p) for p in prompts]
    for i, (m, p) in enumerate(zip(msgs, prompts)):
        ids, cached, n = post(lily_server, m)
        assert n == len(p)
        assert cached == expected_cached(tok, prompts[:i], p), i
        assert matches_cold(ids, refs[i]), i
    # the same turns with a seed: mlx-lm serves them one at a time (_serve_single)
    other = [[{"role": "system", "content": "Be brief."}] + m[1:] for m in msgs[:2]]
    seq_prompts = [render(tok, m) for m in other]
    for i, (m, p) in enumerate(zip(other, seq_prompts)):
        ids, cached, _ = post(lily_server, m, seed=0)
        assert cached == expected_cached(tok, prompts + seq_prompts[:i], p), i
        assert matches_cold(ids, cold(model, p)), i
    assert "snapshot:" in lily_server.output()


def test_server_concurrent_and_shorter(lily_server, mini):
    import mlx_lily

    model, tok = mini
    convs = [[{"role": "system", "content": f"Project {k} assistant."}] + m[1:]
             for k in ("alpha", "beta") for m in conversation()[:2]]
    mlx_lily.patch()
    results = {}

    def go(i):
        results[i] = post(lily_server, convs[i])

    # first turns of two conversations at once, then their second turns at once
    for pair in ((0, 2), (1, 3)):
        threads = [threading.Thread(target=go, args=(i,)) for i in pair]
        [t.start() for t in threads]
        [t.join(timeout=300) for t in threads]
    for i, m in enumerate(convs):
        p = render(tok, m)
        assert matches_cold(results[i][0], cold(model, p)), i
    assert results[1][1] == len(render(tok, convs[0])) - 1
    assert results[3][1] == len(render(tok, convs[2])) - 1
    # a prompt shorter than the snapshots stored for it (a plain completion of a prefix)
    text = tok.decode(render(tok, convs[1])[:40])
    short = tok.encode(text)
    body = {"prompt": text, "max_tokens": N_GEN, "temperature": 0.0, "logprobs": True}
    req = urllib.request.Request(f"http://127.0.0.1:{lily_server.port}/v1/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        out = json.loads(r.read())
    assert out["usage"]["prompt_tokens"] == len(short)
    assert 0 < out["usage"]["prompt_tokens_details"]["cached_tokens"] < len(short) - 1
    ids = [c["id"] for c in out["choices"][0]["logprobs"]["content"]]
    assert matches_cold(ids, cold(model, short))


def test_server_eviction_small_byte_limit(mini_ckpt, mini, tmp_path):
    import mlx_lily
    from mlx_lily.prefix_cache import snapshot_nbytes

    model, tok = mini
    msgs = conversation()[:3]
    prompts = [render(tok, m) for m in msgs]
    limit = 3 * snapshot_nbytes(model) + 400_000
    srv = _bench().Server("lily", mini_ckpt, tmp_path, [f"--prompt-cache-bytes={limit}"],
                          env={"MLX_LILY_PREFIX_CACHE_EVERY": "0"})
    try:
        mlx_lily.patch()
        for m, p in zip(msgs, prompts):
            ids, _, _ = post(srv, m)
            assert matches_cold(ids, cold(model, p))
        log = srv.output()
    finally:
        srv.stop()
    # mlx-lm logs the cache (count, GB with two decimals) before each request
    counts = [int(line.split("snapshot:")[1].split()[0])
              for line in log.splitlines() if "- snapshot:" in line]
    assert len(counts) == len(msgs) and counts[-1] > 0
    from mlx_lily.prefix_cache import message_boundaries, snapshot_points

    unbounded = sum(len(snapshot_points(len(p), start=expected_cached(tok, prompts[:i], p),
                                        boundaries=message_boundaries(tok, p)))
                    for i, p in enumerate(prompts[:2]))
    assert max(counts) <= limit // snapshot_nbytes(model) < unbounded


def test_agent_loop_benchmark_token_counts(mini_ckpt, tmp_path):
    """The agent benchmark on CPU: Lily processes only each step's new tokens."""
    bench = _bench()
    bench.main(["--model", str(mini_ckpt), "--steps", "3", "--target-tokens", "700",
                "--max-tokens", "2", "--modes", "lily-main", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "agent_loop.json").read_text())
    lily, exp = res["modes"]["lily-main"], res["expected"]
    assert len(lily) == 4
    assert lily[0]["processed"] == exp[0]["prompt"] > 400
    for i in range(1, 4):
        assert lily[i]["prompt_tokens"] == exp[i]["prompt"]
        assert lily[i]["processed"] == exp[i]["expected"] <= exp[i]["new"] + res["every"]
        assert exp[i]["new"] < exp[i]["prompt"] / 2
    assert (tmp_path / "agent_loop.md").read_text().startswith("# Agent loop")


def test_agent_loop_markdown_marks_steps_not_sent():
    """Steps a mode was not sent (``--stock-from-step``) show as '-', are left out of its
    totals and of the time-to-first-token ratio."""
    bench = _bench()
    row = lambda i, ttft, proc: {"step": i, "prompt_tokens": 100 * (i + 1),  # noqa: E731
                                 "cached_tokens": 0, "processed": proc, "ttft_s": ttft,
                                 "total_s": ttft, "text": "x"}
    result = {"steps": 2, "target_tokens": 300, "model": "m", "command": "c",
              "expected": [{"prompt": 100 * (i + 1), "new": 100, "expected": 100}
                           for i in range(3)],
              "modes": {"stock": [None, None, row(2, 2.0, 300)],
                        "lily": [row(0, 1.0, 100), row(1, 0.1, 100), row(2, 0.1, 100)]}}
    md = bench.markdown(result)
    lines = md.splitlines()
    step1 = next(l for l in lines if l.startswith("| 1 |"))
    assert step1.split("|")[5:8] == [" - ", " - ", " - "]
    total = next(l for l in lines if l.startswith("| total"))
    assert total.split("|")[5].strip() == "300"
    assert "last step 0.050" in md and "max 0.050" in md
