"""The patch API and the patched model end to end against stock mlx-lm (CPU)."""

import contextlib
import copy
import warnings

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models import cache as cache_mod
from mlx_lm.models import qwen3_5, qwen3_next

import _models
import mlx_lily
from mlx_lily import backend, config
from mlx_lily.testing.generation import batch_greedy, greedy

PROMPT = [1, 5, 9, 33, 100, 7, 8, 9, 200, 11, 42, 17]
KINDS = ("qwen3_5_moe", "qwen3_5", "qwen3_next")

PATCHED = [
    (qwen3_next.Qwen3NextAttention, "__call__"),
    (qwen3_next.Qwen3NextSparseMoeBlock, "__call__"),
    (qwen3_next.Qwen3NextGatedDeltaNet, "__call__"),
    (qwen3_next.Qwen3NextDecoderLayer, "__call__"),
    (qwen3_5.GatedDeltaNet, "__call__"),
    (qwen3_5.DecoderLayer, "__call__"),
    (qwen3_next.Qwen3NextModel, "__call__"),
    (qwen3_5.Qwen3_5TextModel, "__call__"),
]


def originals():
    return {(c, n): c.__dict__[n] for c, n in PATCHED}


def test_roundtrip_restores_originals_by_identity():
    import mlx_lm.utils

    before = originals()
    load_before = mlx_lm.utils.load_model
    h = mlx_lily.patch()
    assert mlx_lily.is_patched() and h.active
    for key, f in before.items():
        assert key[0].__dict__[key[1]] is not f
    assert mlx_lm.utils.load_model is not load_before
    assert mlx_lily.unpatch(h) is True
    assert not mlx_lily.is_patched()
    for key, f in before.items():
        assert key[0].__dict__[key[1]] is f
    assert mlx_lm.utils.load_model is load_before
    assert mlx_lily.unpatch() is False


def test_patch_is_idempotent():
    before = originals()
    h1 = mlx_lily.patch()
    after_first = originals()
    h2 = mlx_lily.patch()
    assert h1 is h2
    assert originals() == after_first
    mlx_lily.unpatch()
    assert originals() == before


def test_patched_context_manager_restores():
    before = originals()
    with mlx_lily.patched() as h:
        assert h.active
    assert originals() == before and not mlx_lily.is_patched()


def test_stale_handle_does_nothing():
    h = mlx_lily.patch()
    mlx_lily.unpatch(h)
    h2 = mlx_lily.patch()
    assert mlx_lily.unpatch(h) is False and mlx_lily.is_patched()
    mlx_lily.unpatch(h2)


@pytest.mark.parametrize("kind", KINDS)
def test_logits_and_64_greedy_tokens_match_stock(tiny_models, kind):
    model = tiny_models[kind]
    x = mx.array([PROMPT])
    ref_logits = model(x)
    ref_tokens = greedy(model, PROMPT, 64)
    with mlx_lily.patched(model):
        out = model(x)
        tokens = greedy(model, PROMPT, 64)
    assert mx.array_equal(out, ref_logits).item(), float(mx.abs(out - ref_logits).max())
    assert tokens == ref_tokens


def _inner(model):
    return getattr(model, "language_model", model).model


@pytest.mark.parametrize("kind", KINDS)
def test_compiled_decode_steps_match_stock(tiny_models, kind, monkeypatch):
    """MLX_LILY_COMPILE=1: every layer's decode step runs as an mx.compile'd function
    (default on GPU backends only); 64 greedy tokens and their log-probs equal stock's."""
    model = tiny_models[kind]
    ref = [(int(t), lp) for (t, lp), _ in zip(
        generate_step(mx.array(PROMPT), model, max_tokens=64), range(64))]
    monkeypatch.setenv("MLX_LILY_COMPILE", "1")
    with mlx_lily.patched(model):
        got = [(int(t), lp) for (t, lp), _ in zip(
            generate_step(mx.array(PROMPT), model, max_tokens=64), range(64))]
        steps = _inner(model)._lily_steps
    assert [t for t, _ in got] == [t for t, _ in ref]
    assert all(mx.array_equal(a, b).item() for (_, a), (_, b) in zip(got, ref))
    assert sorted({i for i, _ in steps.fns}) == list(range(len(_inner(model).layers)))
    assert all(callable(f) for f in steps.fns.values())


def test_compiled_decode_follows_switches(tiny_models, monkeypatch):
    """A kill switch set between steps gives a fresh set of compiled functions (traced
    under the new switches); switching back replays the first set (the model keeps the
    recent configurations' steps); answers stay stock's. Off on the CPU by default."""
    model = tiny_models["qwen3_5_moe"]
    c_ref = model.make_cache()
    model(mx.array([PROMPT]), cache=c_ref)
    refs = [model(mx.array([[t]]), cache=c_ref) for t in (5, 6, 7)]
    with mlx_lily.patched(model):
        c = model.make_cache()
        model(mx.array([PROMPT]), cache=c)
        monkeypatch.delenv("MLX_LILY_COMPILE", raising=False)
        _inner(model).__dict__.pop("_lily_steps", None)
        model(mx.array([[1]]), cache=copy.deepcopy(c))
        assert "_lily_steps" not in _inner(model).__dict__
        monkeypatch.setenv("MLX_LILY_COMPILE", "1")
        out1 = model(mx.array([[5]]), cache=c)
        first = _inner(model)._lily_steps
        monkeypatch.setenv("MLX_LILY_DISABLE", "moe_experts")
        out2 = model(mx.array([[6]]), cache=c)
        second = _inner(model)._lily_steps
        monkeypatch.delenv("MLX_LILY_DISABLE")
        traced = first.fns.copy()
        out3 = model(mx.array([[7]]), cache=c)
        again = _inner(model)._lily_steps
    assert first is not second and first.key != second.key
    assert "moe_experts" in second.key[1]
    assert again is first and first.fns == traced
    for out, ref in zip((out1, out2, out3), refs):
        assert mx.array_equal(out, ref).item()


def test_compiled_decode_key_follows_norm_gemv_split(tiny_models, monkeypatch):
    """``MLX_LILY_NORM_GEMV=split`` set between steps gives a fresh compiled step (its
    choice is traced into the graph); ``fused`` and unset share one key."""
    from mlx_lily.ops import norm_qgemv

    model = tiny_models["qwen3_5_moe"]
    c_ref = model.make_cache()
    model(mx.array([PROMPT]), cache=c_ref)
    refs = [model(mx.array([[t]]), cache=c_ref) for t in (5, 6, 7)]
    with mlx_lily.patched(model):
        c = model.make_cache()
        model(mx.array([PROMPT]), cache=c)
        monkeypatch.setenv("MLX_LILY_COMPILE", "1")
        monkeypatch.delenv(norm_qgemv.SPLIT_ENV, raising=False)
        out1 = model(mx.array([[5]]), cache=c)
        first = _inner(model)._lily_steps
        monkeypatch.setenv(norm_qgemv.SPLIT_ENV, "fused")
        out2 = model(mx.array([[6]]), cache=c)
        assert _inner(model)._lily_steps is first
        monkeypatch.setenv(norm_qgemv.SPLIT_ENV, "split")
        out3 = model(mx.array([[7]]), cache=c)
        second = _inner(model)._lily_steps
    assert second is not first and second.key != first.key
    for out, ref in zip((out1, out2, out3), refs):
        assert mx.array_equal(out, ref).item()


def test_compiled_decode_failure_falls_back(tiny_models, monkeypatch):
    """A layer whose compiled step fails to build runs uncompiled (one warning each)."""
    from mlx_lily.patches import qwen3_next as nxt

    model = tiny_models["qwen3_5_moe"]
    c_ref = model.make_cache()
    model(mx.array([PROMPT]), cache=c_ref)
    ref = model(mx.array([[9]]), cache=c_ref)

    def broken(*_):
        def fn(*__):
            raise RuntimeError("trace failed")
        return fn

    monkeypatch.setattr(nxt.decode_graph, "_gdn_step", broken)
    monkeypatch.setenv("MLX_LILY_COMPILE", "1")
    nxt.decode_graph.drop_compiled_steps()  # no step traced by an earlier test replays
    with mlx_lily.patched(model):
        c = model.make_cache()
        model(mx.array([PROMPT]), cache=c)
        with pytest.warns(UserWarning, match="runs uncompiled"):
            out = model(mx.array([[9]]), cache=c)
        fns = _inner(model)._lily_steps.fns
    layers = _inner(model).layers
    by_layer = {i: f for (i, _), f in fns.items()}
    assert sorted(by_layer) == list(range(len(layers)))
    assert all((by_layer[i] is False) == l.is_linear for i, l in enumerate(layers))
    assert mx.array_equal(out, ref).item()
    for a, b in zip(c, c_ref):
        assert all(mx.array_equal(u, v).item() for u, v in zip(a.state, b.state)
                   if u is not None and hasattr(u, "shape") and u.shape == v.shape)


@pytest.mark.parametrize("compile_mode", ["1", "0"])
@pytest.mark.parametrize("when", ["after_decode", "after_prepare"])
def test_replaced_weights_are_picked_up(monkeypatch, compile_mode, when):
    """load_weights after patch(model): fused projections and compiled decode steps are
    rebuilt from the new weights (the answer equals stock's with them)."""
    from mlx.utils import tree_flatten

    monkeypatch.setenv("MLX_LILY_COMPILE", compile_mode)
    new = tree_flatten(_models.build("qwen3_5_moe", seed=1).parameters())
    ref_model = _models.build("qwen3_5_moe", seed=1)

    def step(m):
        c = m.make_cache()
        m(mx.array([PROMPT]), cache=c)
        return m(mx.array([[5]]), cache=c)

    ref = step(ref_model)
    model = _models.build("qwen3_5_moe", seed=0)
    with mlx_lily.patched(model):
        if when == "after_decode":
            step(model)
        model.load_weights(new)
        got = step(model)
    assert mx.array_equal(got, ref).item(), float(mx.abs(got - ref).max())


def test_replaced_layer_drops_compiled_steps(monkeypatch):
    """A decoder layer object swapped in after decode steps (same class, new arrays):
    the compiled steps traced over the old one are dropped and traced again."""
    monkeypatch.setenv("MLX_LILY_COMPILE", "1")
    model = _models.build("qwen3_5_moe", seed=2)
    with mlx_lily.patched(model):
        c = model.make_cache()
        model(mx.array([PROMPT]), cache=c)
        model(mx.array([[5]], ), cache=c)
        inner = _inner(model)
        before = dict(inner._lily_steps.fns)
        assert before
        inner.layers[1] = copy.deepcopy(inner.layers[1])
        model(mx.array([[6]]), cache=c)
        after = inner._lily_steps.fns
    assert after and all(after[k] is not f for k, f in before.items() if k in after)


def test_deepcopy_after_compiled_steps_and_unpatch_keeps_them(monkeypatch):
    """A deep copy starts without compiled steps. Unpatch keeps the model's (stock code
    runs meanwhile); the next patch with the same switches reuses the same functions;
    ``drop_compiled_steps`` releases them."""
    from mlx_lily.patches.qwen3_next import drop_compiled_steps

    monkeypatch.setenv("MLX_LILY_COMPILE", "1")
    model = _models.build("qwen3_5_moe", seed=2)
    c = model.make_cache()
    with mlx_lily.patched(model):
        model(mx.array([PROMPT]), cache=c)
        model(mx.array([[5]]), cache=c)
        kept = _inner(model)._lily_steps
        fns = dict(kept.fns)
        assert fns
        twin = copy.deepcopy(model)
        assert not _inner(twin)._lily_steps.fns
        c2 = twin.make_cache()
        twin(mx.array([PROMPT]), cache=c2)
        a = twin(mx.array([[5]]), cache=c2)
    assert _inner(model)._lily_steps is kept
    c3 = model.make_cache()
    model(mx.array([PROMPT]), cache=c3)
    assert mx.array_equal(a, model(mx.array([[5]]), cache=c3)).item()  # stock code
    with mlx_lily.patched(model):
        c4 = model.make_cache()
        model(mx.array([PROMPT]), cache=c4)
        b = model(mx.array([[5]]), cache=c4)
        assert _inner(model)._lily_steps is kept
        assert all(kept.fns[k] is f for k, f in fns.items())
    assert mx.array_equal(a, b).item()
    drop_compiled_steps()
    assert "_lily_steps" not in _inner(model).__dict__


def test_weights_replaced_while_unpatched_rebuild_compiled_steps(monkeypatch):
    """Compiled steps kept over an unpatch are traced again when a layer's weights were
    replaced in the meantime; the answers follow the new weights (stock's)."""
    monkeypatch.setenv("MLX_LILY_COMPILE", "1")
    model = _models.build("qwen3_5_moe", seed=2)
    with mlx_lily.patched(model):
        c = model.make_cache()
        model(mx.array([PROMPT]), cache=c)
        model(mx.array([[5]]), cache=c)
        before = dict(_inner(model)._lily_steps.fns)
    donor = _models.build("qwen3_5_moe", seed=3)
    _inner(model).layers[1].update(_inner(donor).layers[1].parameters())
    c_ref = model.make_cache()
    model(mx.array([PROMPT]), cache=c_ref)
    want = model(mx.array([[5]]), cache=c_ref)
    with mlx_lily.patched(model):
        c = model.make_cache()
        model(mx.array([PROMPT]), cache=c)
        got = model(mx.array([[5]]), cache=c)
        after = _inner(model)._lily_steps.fns
    assert after and all(after[k] is not f for k, f in before.items() if k in after)
    assert float(mx.abs(got - want).max()) <= 1e-4 * max(1.0, float(mx.abs(want).max()))


def test_failed_prepare_leaves_nothing_patched(monkeypatch):
    from mlx_lily import patching

    def boom(model, **_):
        raise OSError("disk full")

    model = _models.build("qwen3_5_moe", seed=4)
    before = originals()
    monkeypatch.setattr(patching, "prepare_model", boom)
    with pytest.raises(OSError):
        mlx_lily.patch(model)
    assert not mlx_lily.is_patched()
    with pytest.raises(OSError):
        with mlx_lily.patched(model):
            pass
    assert not mlx_lily.is_patched()
    assert all(originals()[k] is v for k, v in before.items())


def test_model_loaded_before_patch_without_prepare_matches(tiny_models):
    """A model patched globally without prepare() runs unfused projections: same answer."""
    model = _models.build("qwen3_5_moe", seed=3)
    ref = model(mx.array([PROMPT]))
    mlx_lily.patch()
    try:
        assert mx.array_equal(model(mx.array([PROMPT])), ref).item()
    finally:
        mlx_lily.unpatch()


def test_prefill_longer_than_prefill_step_size(tiny_models):
    model = tiny_models["qwen3_5_moe"]
    prompt = [(i * 37 + 11) % 500 + 1 for i in range(150)]
    ref = greedy(model, prompt, 8, prefill_step_size=64)
    with mlx_lily.patched(model):
        got = greedy(model, prompt, 8, prefill_step_size=64)
    assert got == ref


def _batch(model, prompts, n):
    return batch_greedy(model, prompts, [n] * len(prompts))


def test_batch_of_two_matches_each_alone_and_stock(tiny_models):
    model = tiny_models["qwen3_5_moe"]
    prompts = [PROMPT, [3, 4, 5, 6, 300]]
    stock = _batch(model, prompts, 12)
    with mlx_lily.patched(model):
        lily = _batch(model, prompts, 12)
        alone = [greedy(model, p, 12) for p in prompts]
    assert lily == stock
    assert lily == alone


def test_caches_stay_mlx_lm_own_and_interchange(tiny_models):
    model = tiny_models["qwen3_5_moe"]
    c_stock = model.make_cache()
    model(mx.array([PROMPT]), cache=c_stock)
    with mlx_lily.patched(model):
        c_lily = model.make_cache()
        model(mx.array([PROMPT]), cache=c_lily)
    for a, b in zip(c_stock, c_lily):
        assert type(a) is type(b)
        sa, sb = a.state, b.state
        if isinstance(a, cache_mod.ArraysCache):
            for u, v in zip(a.cache, b.cache):
                assert u.shape == v.shape and u.dtype == v.dtype
                assert mx.array_equal(u, v).item()
            assert a.cache[1].dtype == mx.float32
        else:
            assert a.offset == b.offset
            assert mx.array_equal(sa[0][..., :a.offset, :], sb[0][..., :b.offset, :]).item()
    # continue the Lily-built cache with stock, and the stock-built cache with Lily
    nxt = mx.array([[77]])
    ref = model(nxt, cache=copy.deepcopy(c_stock))
    with_stock = model(nxt, cache=c_lily)
    with mlx_lily.patched(model):
        with_lily = model(nxt, cache=c_stock)
    assert mx.array_equal(ref, with_stock).item() and mx.array_equal(ref, with_lily).item()


def test_no_host_sync_inside_patched_forward(tiny_models):
    """A host sync (.item(), mx.eval, numpy) inside a traced function raises: tracing the
    patched forward with a fresh cache must succeed."""
    model = tiny_models["qwen3_5_moe"]

    def step(tokens):
        c = model.make_cache()
        return model(tokens, cache=c)

    x = mx.array([PROMPT])
    with mlx_lily.patched(model):
        traced = mx.compile(step)
        out = traced(x)
        ref = step(x)
    assert mx.allclose(out, ref, atol=1e-2, rtol=1e-2).item()


@pytest.mark.parametrize("op", list(backend.OP_NAMES) + ["all"])
def test_kill_switch_keeps_answers(tiny_models, monkeypatch, op):
    model = tiny_models["qwen3_5_moe"]
    ref = model(mx.array([PROMPT]))
    monkeypatch.setenv("MLX_LILY_DISABLE", op)
    with mlx_lily.patched(model):
        info = mlx_lily.backend_info()
        out = model(mx.array([PROMPT]))
    if op == "all":
        assert set(info["ops"].values()) == {"disabled"}
    else:
        assert info["ops"][op] == "disabled"
    assert mx.array_equal(out, ref).item()


def test_kill_switch_routes_to_stock_code(tiny_models, monkeypatch):
    model = tiny_models["qwen3_5_moe"]
    calls = []
    orig = qwen3_next.Qwen3NextSparseMoeBlock.__call__

    monkeypatch.setenv("MLX_LILY_DISABLE", "moe_router_topk,moe_experts")
    with mlx_lily.patched(model):
        from mlx_lily.patching import original

        stock = original(qwen3_next.Qwen3NextSparseMoeBlock)
        assert stock is orig

        def spy(self, x):
            calls.append(1)
            return stock(self, x)

        import mlx_lily.patching as P

        P._ORIGINALS[(qwen3_next.Qwen3NextSparseMoeBlock, "__call__")] = spy
        try:
            model(mx.array([PROMPT]))
        finally:
            P._ORIGINALS[(qwen3_next.Qwen3NextSparseMoeBlock, "__call__")] = stock
    assert len(calls) == len(model.layers)


def test_decoder_layer_patch_matches_stock(tiny_models):
    """The per-layer forward (used when the model-level fusion is not) matches stock."""
    model = tiny_models["qwen3_5_moe"]
    x = mx.random.normal((1, 5, 128)).astype(mx.bfloat16)
    ref = [layer(x) for layer in model.layers]
    with mlx_lily.patched(model):
        got = [layer(x) for layer in model.layers]
    assert all(mx.array_equal(a, b).item() for a, b in zip(ref, got))


def test_patch_ops_selection_and_unknown_op(tiny_models):
    with mlx_lily.patched(ops=["gated_delta"]):
        ops = mlx_lily.backend_info()["ops"]
        assert ops["gated_delta"] != "disabled" and ops["attention"] == "disabled"
    with pytest.raises(ValueError, match="unknown mlx-lily op"):
        mlx_lily.patch(ops=["nope"])
    assert not mlx_lily.is_patched()


def test_unsupported_model_type_warns_once_and_stays_stock():
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=1,
                           intermediate_size=128, num_attention_heads=2, rms_norm_eps=1e-6,
                           vocab_size=100, num_key_value_heads=2)
    model = llama.Model(args)
    x = mx.array([[1, 2, 3]])
    ref = model(x)
    import mlx_lily.patching as P

    P._WARNED_TYPES.discard("llama")
    with pytest.warns(UserWarning, match="model type 'llama' is not supported"):
        mlx_lily.patch(model)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        mlx_lily.prepare_model(model)  # second time: no second warning
    assert not [x for x in w if "mlx-lily" in str(x.message)], [str(x.message) for x in w]
    assert mx.array_equal(model(x), ref).item()


def _calls_original(monkeypatch, cls):
    import mlx_lily.patching as P

    seen = []
    stock = P._ORIGINALS[(cls, "__call__")]

    def spy(self, *a, **k):
        seen.append(1)
        return stock(self, *a, **k)

    monkeypatch.setitem(P._ORIGINALS, (cls, "__call__"), spy)
    return seen


def test_fallback_training_mode(tiny_models, monkeypatch):
    model = tiny_models["qwen3_5"]
    ref = model(mx.array([PROMPT]))
    with mlx_lily.patched(model):
        seen = _calls_original(monkeypatch, qwen3_5.GatedDeltaNet)
        model.train()
        try:
            out = model(mx.array([PROMPT]))
        finally:
            model.eval()
    assert seen and mx.array_equal(out, ref).item()


def test_fallback_quantized_kv_cache(tiny_models, monkeypatch):
    model = tiny_models["qwen3_5_moe"]

    def run():
        c = model.make_cache()
        c = [cache_mod.QuantizedKVCache(group_size=64, bits=8) if isinstance(x, cache_mod.KVCache)
             else x for x in c]
        return model(mx.array([PROMPT]), cache=c)

    ref = run()
    with mlx_lily.patched(model):
        seen = _calls_original(monkeypatch, qwen3_next.Qwen3NextAttention)
        out = run()
    assert seen and mx.array_equal(out, ref).item()


def test_fallback_sharded_moe(tiny_models, monkeypatch):
    model = _models.build("qwen3_5_moe", seed=5)
    x = mx.random.normal((1, 4, 128)).astype(mx.bfloat16)
    block = model.layers[0].mlp
    ref = block(x)
    with mlx_lily.patched(model):
        seen = _calls_original(monkeypatch, qwen3_next.Qwen3NextSparseMoeBlock)
        block.sharding_group = object()  # sharded blocks are never served by Lily
        try:
            with pytest.raises(Exception):
                block(x)  # stock code tries to use the (fake) group
        finally:
            block.sharding_group = None
    assert seen


def test_fallback_unsupported_rope_keeps_answer(tiny_models, monkeypatch):
    model = _models.build("qwen3_5_moe", seed=6)
    attn = model.layers[3].self_attn
    ref = model(mx.array([PROMPT]))
    orig_rope = attn.rope

    class OtherRope(nn.Module):
        def __call__(self, x, offset=0):
            return orig_rope(x, offset=offset)

    attn.rope = OtherRope()
    try:
        with mlx_lily.patched(model):
            seen = _calls_original(monkeypatch, qwen3_next.Qwen3NextAttention)
            out = model(mx.array([PROMPT]))
    finally:
        attn.rope = orig_rope
    assert seen and mx.array_equal(out, ref).item()


def test_prepare_keeps_values_and_parameter_tree(tiny_models):
    from mlx.utils import tree_flatten

    model = _models.build("qwen3_5_moe", seed=7)
    before = {k: mx.array(v) for k, v in tree_flatten(model.parameters())}
    mlx_lily.prepare_model(model)
    after = dict(tree_flatten(model.parameters()))
    assert before.keys() == after.keys()
    for k in before:
        assert before[k].dtype == after[k].dtype and mx.array_equal(before[k], after[k]).item(), k


def test_backend_info_shape():
    info = mlx_lily.backend_info()
    assert info["backend"] in ("metal", "cuda", "cpu")
    assert set(info["ops"]) == set(backend.OP_NAMES)
    assert set(info["ops"].values()) <= {"kernel", "reference", "disabled"}


def test_kernel_policy_default_is_verified_only(monkeypatch):
    from mlx_lily import kernels

    monkeypatch.setitem(kernels.VERIFIED, "cuda", frozenset({"qgemv"}))
    monkeypatch.setenv("MLX_LILY_KERNELS", "verified")
    assert kernels.kernels_allowed("qgemv", "cuda")
    assert not kernels.kernels_allowed("attention", "cuda")
    assert not kernels.kernels_allowed("qgemv", "metal")
    monkeypatch.setenv("MLX_LILY_KERNELS", "all")
    assert kernels.kernels_allowed("attention", "metal")
    monkeypatch.setenv("MLX_LILY_KERNELS", "verified,gated_delta")
    assert kernels.kernels_allowed("gated_delta", "cuda") and kernels.kernels_allowed("qgemv", "cuda")
    assert not kernels.kernels_allowed("attention", "cuda")
    monkeypatch.delenv("MLX_LILY_KERNELS")
    assert not kernels.kernels_allowed("attention", "cuda")
    spec_ops = {s: kernels.op_of(kernels.KernelSpec("n", s, (), ())) for s in
                ("gdn_scan", "attn_prefill", "moeg_route_scan", "moeg_down", "moe_down", "qgemv")}
    assert spec_ops == {"gdn_scan": "gated_delta", "attn_prefill": "attention",
                        "moeg_route_scan": "moe_route", "moeg_down": "moe_grouped",
                        "moe_down": "moe_experts", "qgemv": "qgemv"}


def test_env_value_follows_os_environ(monkeypatch):
    """The fast environment read sees changes made through ``os.environ`` at once."""
    from mlx_lily.backend import env_value, op_enabled

    monkeypatch.delenv("MLX_LILY_TEST_ENV", raising=False)
    assert env_value("MLX_LILY_TEST_ENV", "dflt") == "dflt"
    monkeypatch.setenv("MLX_LILY_TEST_ENV", "on,é")
    assert env_value("MLX_LILY_TEST_ENV") == "on,é"
    monkeypatch.setenv("MLX_LILY_DISABLE", "qgemv")
    assert not op_enabled("qgemv") and op_enabled("attention")
    monkeypatch.setenv("MLX_LILY_DISABLE", "")
    assert op_enabled("qgemv")


def test_kernel_cache_env_set_by_patch_is_restored(monkeypatch):
    monkeypatch.delenv("MLX_PTX_CACHE_DIR", raising=False)
    monkeypatch.setenv("MLX_LILY_CACHE_DIR", "/nonexistent/lily")
    import os

    mlx_lily.patch()
    assert os.environ["MLX_PTX_CACHE_DIR"] == "/nonexistent/lily/cuda-kernels"
    mlx_lily.unpatch()
    assert "MLX_PTX_CACHE_DIR" not in os.environ
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", "/user/choice")
    mlx_lily.patch()
    mlx_lily.unpatch()
    assert os.environ["MLX_PTX_CACHE_DIR"] == "/user/choice"


def test_env_frozen_reads_each_switch_once_per_block(monkeypatch):
    """Inside ``env_frozen`` (one forward of the patched decoder stack) a switch keeps the
    value it had when first read; outside, every read sees the environment as it is."""
    from mlx_lily.backend import env_frozen, env_value, op_enabled

    monkeypatch.setenv("MLX_LILY_DISABLE", "qgemv")
    with env_frozen():
        assert not op_enabled("qgemv")
        monkeypatch.setenv("MLX_LILY_DISABLE", "attention")
        assert not op_enabled("qgemv") and op_enabled("attention")
        with env_frozen():  # nested: the same snapshot
            assert env_value("MLX_LILY_DISABLE") == "qgemv"
        assert env_value("MLX_LILY_UNSET_SWITCH", "dflt") == "dflt"
    assert op_enabled("qgemv") and not op_enabled("attention")
    assert env_value("MLX_LILY_DISABLE") == "attention"


def test_weight_signature_sees_replaced_submodules():
    """``WeightSig``: an array, a sub-module or a list of modules replaced after it was
    taken makes it invalid (quantizing or LoRA-wrapping a layer swaps modules, not arrays)."""
    import mlx.nn as nn

    from mlx_lily.patches.qwen3_next import WeightSig

    m = nn.Module()
    m.proj = nn.Linear(4, 4)
    m.blocks = [nn.Linear(4, 4)]
    sig = WeightSig(m)
    assert sig.valid()
    m.proj = nn.Linear(4, 4)
    assert not sig.valid()
    sig = WeightSig(m)
    m.blocks = [m.blocks[0]]
    assert not sig.valid()
    sig = WeightSig(m)
    m.proj.weight = mx.zeros((4, 4))
    assert not sig.valid()


def _mutations():
    """Each way ``mlx.nn`` (and a user) replaces or removes a module's array or child."""
    import mlx.nn as nn

    def setattr_array(m):
        m.proj.weight = mx.zeros((4, 4))

    def setattr_none(m):  # a non-array value pops the item
        m.proj.bias = None

    def update(m):
        m.update({"proj": {"weight": mx.ones((4, 4))}})

    def load_weights(m):
        m.load_weights([("proj.weight", mx.ones((4, 4))), ("proj.bias", mx.ones((4,)))])

    def set_dtype(m):
        m.set_dtype(mx.float16)

    def delete(m):
        del m.proj["bias"]

    def pop(m):
        m.proj.pop("bias")

    def setitem(m):
        m["proj"] = nn.Linear(4, 4)

    def update_modules(m):
        m.update_modules({"proj": nn.Linear(4, 4)})

    def quantize(m):
        nn.quantize(m, group_size=32, bits=4, class_predicate=lambda p, x: p == "proj")

    return [setattr_array, setattr_none, update, load_weights, set_dtype, delete, pop,
            setitem, update_modules, quantize]


@pytest.mark.parametrize("mutate", _mutations(), ids=lambda f: f.__name__)
@pytest.mark.parametrize("patched", [True, False])
def test_weight_signature_fast_path_sees_every_mutation(mutate, patched):
    """While patched, ``WeightSig.valid()`` answers from the count of module item mutations
    (``patching.module_mutations``) when nothing changed; every way of replacing an array
    or a child still makes it invalid, patched or not, and a valid signature stays valid
    after unrelated mutations."""
    import mlx.nn as nn

    from mlx_lily.patches.qwen3_next import WeightSig

    def build():
        m = nn.Module()
        m.proj = nn.Linear(32, 32)
        m.proj.weight = mx.zeros((4, 4))
        m.proj.bias = mx.zeros((4,))
        return m

    with (mlx_lily.patched() if patched else contextlib.nullcontext()):
        m = build()
        sig = WeightSig(m)
        assert sig._tracked == patched and sig.valid() and sig.valid()
        other = nn.Linear(4, 4)
        other.weight = mx.ones((4, 4))  # elsewhere: the full check runs once, still valid
        assert sig.valid()
        if mutate.__name__ == "quantize":
            m.proj = nn.Linear(32, 32)
            sig = WeightSig(m)
        mutate(m)
        assert not sig.valid()
        assert not sig.valid()


def test_mutation_tracking_installed_and_removed_with_the_patch():
    """``patch()`` wraps ``mlx.nn.Module``'s item mutators and ``unpatch()`` removes them
    (by identity: MLX's own ``update`` comes back); a signature taken before a patch never
    takes the fast path after it (the count moves when tracking starts); a class that
    overrides a mutator is not tracked (full check)."""
    import mlx.nn as nn

    from mlx_lily import patching
    from mlx_lily.patches.qwen3_next import WeightSig

    own_update = nn.Module.__dict__["update"]
    assert "__setitem__" not in nn.Module.__dict__ and patching.module_mutations() is None
    m = nn.Module()
    m.w = mx.zeros((2,))
    before = WeightSig(m)
    with mlx_lily.patched():
        assert "__setitem__" in nn.Module.__dict__ and nn.Module.__dict__["update"] is not own_update
        c = patching.module_mutations()
        m.w = mx.ones((2,))
        assert patching.module_mutations() == c + 1
        assert not before.valid()

        class Custom(nn.Module):
            def __setitem__(self, k, v):
                dict.__setitem__(self, k, v)

        cm = Custom()
        cm.w = mx.zeros((2,))
        assert not patching.mutations_tracked(Custom) and not WeightSig(cm)._tracked
        s2 = WeightSig(cm)
        dict.__setitem__(cm, "w", mx.ones((2,)))
        assert not s2.valid()

        class OwnSetattr(nn.Module):
            def __setattr__(self, k, v):
                dict.__setitem__(self, k, v)

        assert not patching.mutations_tracked(OwnSetattr)
        assert patching.mutations_tracked(nn.Linear)
    assert "__setitem__" not in nn.Module.__dict__ and nn.Module.__dict__["update"] is own_update
    assert patching.module_mutations() is None


def test_cuda_default_kernel_set(monkeypatch):
    """What runs on CUDA by default: every op that passed its GPU tests and the A/B gate
    (``kernels.VERIFIED``), including qgemv_out and prefill_dequant; Metal
    runs none by default (no Apple-hardware run yet)."""
    from mlx_lily import kernels

    monkeypatch.delenv("MLX_LILY_KERNELS", raising=False)
    for op in ("qgemv_out", "prefill_dequant", "gated_delta", "moe_topk_in_experts"):
        assert kernels.kernels_allowed(op, "cuda")
        assert not kernels.kernels_allowed(op, "metal")
    assert set(kernels.VERIFIED["cuda"]) <= set(backend.OP_NAMES)


def _kv_caches(cache):
    return [c for c in cache if type(c) is cache_mod.KVCache]


def test_kv_caches_grow_in_bigger_steps_same_answers(tiny_models, monkeypatch):
    """A patched forward raises plain KVCaches' growth step to MLX_LILY_KV_STEP (default
    2048; never lowers it): fewer retraces of the compiled decode step; states and greedy
    tokens as stock's, also across a growth; 256 (mlx-lm's) leaves it; a bad value warns and
    keeps the default."""
    from mlx_lily.patches import qwen3_next as P

    model = tiny_models["qwen3_5_moe"]
    monkeypatch.delenv(P.KV_STEP_ENV, raising=False)
    prompt = [(i * 29 + 5) % 500 + 1 for i in range(40)]
    c_lily = model.make_cache()
    with mlx_lily.patched(model):
        model(mx.array([prompt]), cache=c_lily)
    kv = _kv_caches(c_lily)
    assert kv and all(c.step == 2048 and c.keys.shape[2] == 2048 for c in kv)
    c_stock = model.make_cache()
    model(mx.array([prompt]), cache=c_stock)
    for a, b in zip(_kv_caches(c_stock), kv):
        assert a.keys.shape[2] == 256 and a.offset == b.offset == len(prompt)
        n = a.offset  # KVCache.state is the whole buffer (capacity), rows past offset unused
        assert mx.array_equal(a.state[0][..., :n, :], b.state[0][..., :n, :]).item()
        assert mx.array_equal(a.state[1][..., :n, :], b.state[1][..., :n, :]).item()
    # across a growth: a 505-token prompt with step 512 grows after 7 tokens
    long_prompt = [(i * 31 + 7) % 500 + 1 for i in range(505)]
    ref = greedy(model, long_prompt, 12)
    monkeypatch.setenv(P.KV_STEP_ENV, "512")
    with mlx_lily.patched(model):
        got = greedy(model, long_prompt, 12)
    assert got == ref
    for raw, step in (("256", 256), ("zero", P.DEFAULT_KV_STEP)):  # bad: warn, default
        monkeypatch.setenv(P.KV_STEP_ENV, raw)
        config.WARNED.discard((P.KV_STEP_ENV, raw))
        c = model.make_cache()
        with mlx_lily.patched(model), warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            model(mx.array([prompt]), cache=c)
        assert all(x.step == step for x in _kv_caches(c))
        assert (raw == "zero") == any(P.KV_STEP_ENV in str(x.message) for x in w)


def test_prefill_step_default(tiny_models, monkeypatch):
    """While patched, ``generate_step`` (where mlx-lm and its ``cache_prompt`` look it up)
    gives a model Lily prepared the backend's prefill chunk (``PREFILL_STEP_SIZE``) unless
    the caller chose one: an explicit int always wins, the CLI's marked default does not;
    other models, a patch with no prefill op, ``MLX_LILY_PREFILL_STEP=0`` and a reference
    kept past ``unpatch()`` keep mlx-lm's default. Unpatching restores every name by
    identity."""
    import importlib

    import mlx_lm.cache_prompt
    import mlx_lm.chat

    from mlx_lily import patching

    gen = importlib.import_module("mlx_lm.generate")  # the module (the package exports a function)
    seen = []

    def spy(prompt, model, *args, **kwargs):
        seen.append(kwargs.get("prefill_step_size", "unset"))
        return iter(())

    monkeypatch.setattr(gen, "generate_step", spy)
    monkeypatch.setattr(mlx_lm.cache_prompt, "generate_step", spy)
    monkeypatch.setattr(patching, "PREFILL_STEP_SIZE", {backend.current_backend(): 16})
    monkeypatch.delenv(patching.PREFILL_STEP_ENV, raising=False)
    default_before = gen.DEFAULT_PREFILL_STEP_SIZE
    model = tiny_models["qwen3_5_moe"]

    class Other:
        model_type = "llama"

    with mlx_lily.patched(model):
        assert gen.generate_step is not spy and mlx_lm.cache_prompt.generate_step is gen.generate_step
        kept = gen.generate_step
        marked = gen.DEFAULT_PREFILL_STEP_SIZE
        assert type(marked) is patching.DefaultStepSize and marked == default_before
        assert type(mlx_lm.chat.DEFAULT_PREFILL_STEP_SIZE) is patching.DefaultStepSize
        args = gen.setup_arg_parser().parse_args(["--prompt", "x"])
        assert type(args.prefill_step_size) is patching.DefaultStepSize
        typed = gen.setup_arg_parser().parse_args(["--prefill-step-size", str(default_before)])
        assert type(typed.prefill_step_size) is int
        for kw in ({}, {"prefill_step_size": None}, {"prefill_step_size": marked},
                   {"prefill_step_size": typed.prefill_step_size}, {"prefill_step_size": 48}):
            gen.generate_step(mx.array([1]), model, **kw)
        assert seen == [16, 16, 16, default_before, 48]
        seen.clear()
        gen.generate_step(mx.array([1]), Other())
        gen.generate_step(mx.array([1]), Other(), prefill_step_size=marked)
        assert seen == ["unset", marked]
        seen.clear()
        patching._ENV_COUNT_WARNED.clear()
        for raw, want in (("32", 32), ("0", "unset"), ("many", 16)):  # bad: warn, default
            monkeypatch.setenv(patching.PREFILL_STEP_ENV, raw)
            with warnings.catch_warnings(record=True) as got:
                warnings.simplefilter("always")
                mlx_lm.cache_prompt.generate_step(mx.array([1]), model)
            assert seen.pop() == want, raw
            named = [w for w in got if patching.PREFILL_STEP_ENV in str(w.message)]
            assert len(named) == (raw == "many"), (raw, [str(w.message) for w in got])
        monkeypatch.delenv(patching.PREFILL_STEP_ENV)
    assert gen.generate_step is spy and mlx_lm.cache_prompt.generate_step is spy
    assert gen.DEFAULT_PREFILL_STEP_SIZE is default_before
    assert type(mlx_lm.chat.DEFAULT_PREFILL_STEP_SIZE) is int
    kept(mx.array([1]), model)  # a wrapper kept past unpatch() passes calls through
    assert seen.pop() == "unset"
    with mlx_lily.patched(model, ops=["add_rms_norm", "qgemv"]):  # no prefill op
        gen.generate_step(mx.array([1]), model)
    assert seen.pop() == "unset"
    fresh = _models.build("qwen3_5_moe")  # a model the patch never prepared
    with mlx_lily.patched():
        gen.generate_step(mx.array([1]), fresh)
    assert seen.pop() == "unset"


def test_prefill_step_default_chunks_same_tokens(tiny_models, monkeypatch):
    """A 40-token prompt prefilled in Lily's chunks (16 here: the model sees 16, 16, 7, then
    the last prompt token and the generated ones) decodes the same greedy tokens as stock
    mlx-lm's one 2048-token chunk."""
    import importlib

    from mlx_lily import patching

    monkeypatch.setattr(patching, "PREFILL_STEP_SIZE", {backend.current_backend(): 16})
    monkeypatch.delenv(patching.PREFILL_STEP_ENV, raising=False)
    model = tiny_models["qwen3_5_moe"]
    prompt = [(5 * i + 2) % 200 + 1 for i in range(40)]
    gen = importlib.import_module("mlx_lm.generate")
    emb_cls = type(_inner(model).embed_tokens)
    widths = []
    orig_call = emb_cls.__call__
    monkeypatch.setattr(emb_cls, "__call__",
                        lambda self, x: widths.append(x.shape[-1]) or orig_call(self, x))

    def run():
        widths.clear()
        return [int(t) for (t, _), _i in zip(gen.generate_step(mx.array(prompt), model,
                                                               max_tokens=6), range(6))]

    want = run()
    assert widths[0] == 39
    with mlx_lily.patched(model):
        got = run()
        assert widths[:4] == [16, 16, 7, 1]
    assert got == want


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_leaves_kv_headroom(tiny_models, kind, monkeypatch):
    """A multi-token call that leaves a plain KVCache fewer than ``KV_HEADROOM`` free rows
    grows it by a step right away (511 tokens at step 512: capacity 512 -> 1024), so the prompt's
    last token and the first generated one find room; the rows up to the offset, the
    logits and the greedy tokens are stock's. A call with room left, and one-token calls,
    change no capacity."""
    from mlx_lily.patches import qwen3_next as P

    model = tiny_models[kind]
    monkeypatch.setenv(P.KV_STEP_ENV, "512")
    prompt = [(i * 13 + 3) % 300 + 1 for i in range(511)]
    c_stock = model.make_cache()
    want = model(mx.array([prompt]), cache=c_stock)
    want_next = model(mx.array([[7]]), cache=c_stock)
    c_lily = model.make_cache()
    with mlx_lily.patched(model):
        got = model(mx.array([prompt]), cache=c_lily)
        kv = _kv_caches(c_lily)
        assert kv and all(c.offset == 511 and c.keys.shape[2] == 1024 for c in kv)
        got_next = model(mx.array([[7]]), cache=c_lily)
        model(mx.array([[9]]), cache=c_lily)
        assert all(c.offset == 513 and c.keys.shape[2] == 1024 for c in kv)
        roomy = model.make_cache()
        model(mx.array([prompt[:508]]), cache=roomy)
        assert all(c.keys.shape[2] == 512 for c in _kv_caches(roomy))
    for a, b in ((got, want), (got_next, want_next)):
        assert float(mx.abs(a - b).max()) <= 1e-4 * max(1.0, float(mx.abs(b).max()))
    for a, b in zip(_kv_caches(c_stock), kv):
        n = a.offset
        assert n == 512
        assert mx.array_equal(a.keys[..., :n, :], b.keys[..., :n, :]).item()
        assert mx.array_equal(a.values[..., :n, :], b.values[..., :n, :]).item()
    ref = greedy(model, prompt, 6)
    with mlx_lily.patched(model):
        assert greedy(model, prompt, 6) == ref


def test_patch_without_optional_cli_modules(tiny_models, monkeypatch):
    """``mlx_lm.chat`` needs ``rich``, which mlx-lm does not declare: when it cannot be
    imported, ``patch()`` still applies everything else and leaves chat's names alone."""
    import importlib
    import sys

    for name in [n for n in sys.modules if n == "rich" or n.startswith("rich.")
                 or n in ("mlx_lm.chat", "mlx_lm.cli_ui")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "rich", None)
    gen = importlib.import_module("mlx_lm.generate")
    before = gen.generate_step
    with mlx_lily.patched(tiny_models["qwen3_5_moe"]):
        assert mlx_lily.is_patched() and gen.generate_step is not before
        assert "mlx_lm.chat" not in sys.modules
    assert gen.generate_step is before


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_eval_groups(tiny_models, kind, monkeypatch):
    """``MLX_LILY_PREFILL_EVAL_LAYERS=N`` starts evaluation after every N decoder layers
    of a multi-token call (none after the last, none in one-token calls); logits and
    caches are bitwise those of the ungrouped call. Under ``mx.compile`` the groups are
    skipped and the call still runs."""
    from mlx_lily import patching

    model = tiny_models[kind]
    n_layers = len(model.layers)
    prompt = mx.array([[(i * 7 + 5) % 300 + 1 for i in range(37)]])
    calls = []
    real = mx.async_eval

    def spy(*arrays):
        calls.append(len(arrays))
        return real(*arrays)

    def run(n):
        monkeypatch.setenv(patching.PREFILL_EVAL_ENV, str(n))
        c = model.make_cache()
        with mlx_lily.patched(model):
            del calls[:]
            a = model(prompt, cache=c)
            mx.eval(a)
            during_prefill = len(calls)
            b = model(mx.array([[11]]), cache=c)
        mx.eval(b)
        return a, b, c, during_prefill

    monkeypatch.setattr(mx, "async_eval", spy)
    a0, b0, c0, k0 = run(0)
    a1, b1, c1, k1 = run(1)
    monkeypatch.setattr(mx, "async_eval", real)
    assert k0 == 0
    assert k1 == n_layers - 1
    assert mx.array_equal(a0, a1).item() and mx.array_equal(b0, b1).item()
    from mlx.utils import tree_flatten

    s0, s1 = tree_flatten([c.state for c in c0]), tree_flatten([c.state for c in c1])
    assert len(s0) == len(s1) > 0
    for (_, u), (_, v) in zip(s0, s1):
        assert (u is None and v is None) or mx.array_equal(u, v).item()

    monkeypatch.setenv(patching.PREFILL_EVAL_ENV, "1")
    with mlx_lily.patched(model):
        compiled = mx.compile(lambda t: model(t))
        got = compiled(prompt)
    assert mx.allclose(got, model(prompt), atol=1e-4).item()


def test_prefill_eval_layers_policy(monkeypatch):
    """The group size: the environment's N on any backend for any multi-token call, else
    the backend's table entry for calls of at least ``PREFILL_EVAL_MIN_ROWS`` rows; never
    for one row or while only tracing."""
    from mlx_lily import patching

    monkeypatch.delenv(patching.PREFILL_EVAL_ENV, raising=False)
    monkeypatch.setattr(backend, "current_backend", lambda: "cuda")
    big = patching.PREFILL_EVAL_MIN_ROWS
    assert patching.prefill_eval_layers(big) == patching.PREFILL_EVAL_LAYERS["cuda"] > 0
    assert patching.prefill_eval_layers(big - 1) == 0
    assert patching.prefill_eval_layers(1) == 0
    monkeypatch.setattr(backend, "current_backend", lambda: "cpu")
    assert patching.prefill_eval_layers(big) == 0
    monkeypatch.setenv(patching.PREFILL_EVAL_ENV, "3")
    assert patching.prefill_eval_layers(2) == 3
    assert patching.prefill_eval_layers(1) == 0
    with backend.tracing_backend("cuda"):
        assert patching.prefill_eval_layers(big) == 0
    from mlx_lily import cuda_cache

    with cuda_cache.recording():
        assert patching.prefill_eval_layers(big) == 0
    assert patching.prefill_eval_layers(big) == 3
    patching._ENV_COUNT_WARNED.clear()
    for raw in ("0", "-2", "four"):
        monkeypatch.setenv(patching.PREFILL_EVAL_ENV, raw)
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            assert patching.prefill_eval_layers(big) == 0
        assert len(got) == (raw == "four"), (raw, [str(w.message) for w in got])


def test_compiled_attention_step_needs_its_kernels(tiny_models, monkeypatch):
    """The compiled attention decode step is chosen only while its packed kernels serve:
    with the switches on but no kernel (an op off by its qualification record or a failed
    first contact) the layer runs its eager path instead of failing to trace."""
    from mlx_lily.ops import attention as attn_ops
    from mlx_lily.patches import decode_graph

    model = tiny_models["qwen3_5_moe"]
    with mlx_lily.patched(model, force=True):
        layer = next(l for l in model.language_model.model.layers if not l.is_linear)
        monkeypatch.setattr(attn_ops, "has_packed_kernel", lambda backend: False)
        assert decode_graph._attn_static_head_dim(layer, mx.bfloat16) is None
        monkeypatch.setattr(attn_ops, "has_packed_kernel", lambda backend: True)
        monkeypatch.setattr(attn_ops, "packed_supported", lambda *a, **k: True)
        assert decode_graph._attn_static_head_dim(layer, mx.bfloat16) == 256
