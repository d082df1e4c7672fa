"""The qualifier's kernel variants (``mlx_lily.variants``): the table names known ops and
valid knob values, the knobs reach the launchers (CUDA's defaults unchanged), and every
variant's kernels match the op's reference under the Metal emulator (outputs
NaN-poisoned by the emulator, odd lengths, production head dims; the production shapes
are marked ``slow``)."""

from __future__ import annotations

import contextlib

import mlx.core as mx
import pytest

import mlx_lily.ops.attention as A
from mlx_lily import config, qualify, registry, tuning, variants
from mlx_lily.ops import moe_experts as M
from mlx_lily.testing.backends import metal_emu_available

from _close import assert_close

needs_emu = pytest.mark.skipif(not metal_emu_available(),
                               reason="Metal emulator unavailable (needs clang >= 15 / ziglang)")
_KNOB_BY_ENV = {k.env: k for k in tuning.KNOBS.values()}


def _entries():
    return [(op, name, env) for op, vs in variants.VARIANTS.items()
            for name, env in vs.items()]


# ----------------------------------------------------------------------------- the table
def test_qualifier_reads_this_table():
    assert qualify.VARIANTS is variants.VARIANTS


def test_every_variant_names_a_known_op_and_valid_knob_values():
    assert _entries()
    for op, name, env in _entries():
        assert op in registry.NAMES, op
        assert name != qualify.DEFAULT_VARIANT and env, (op, name)
        for var, raw in env.items():
            knob = _KNOB_BY_ENV.get(var)
            assert knob is not None, f"{op}/{name}: {var} is not a tuning knob"
            knob.parse(raw)  # raises config.BadValue for a value the knob refuses
    for op, name in variants.METAL_ONLY:
        assert name in variants.VARIANTS[op]


def test_table_check_can_fail():
    with pytest.raises(config.BadValue):
        _KNOB_BY_ENV["MLX_LILY_MOE_DOWN_SHAPE"].parse("8,2,9")  # 2304 threads
    with pytest.raises(config.BadValue):
        _KNOB_BY_ENV["MLX_LILY_ATTN_FIXED_BLOCK"].parse("300")


def test_for_backend_drops_defaults_and_other_backends_variants():
    metal, cuda = variants.for_backend("metal"), variants.for_backend("cuda")
    assert "down_sl1" not in metal["moe_experts"] and "down_sl3" in metal["moe_experts"]
    assert "down_sl3" not in cuda["moe_experts"] and "down_sl1" in cuda["moe_experts"]
    assert "decode_simd" in metal["attention"] and "decode_simd" not in cuda["attention"]
    assert "fixed_block_256" not in metal["attention"]
    assert "fixed_block_128" not in cuda["attention"] and "fixed_block_512" in cuda["attention"]
    for table in (metal, cuda):
        for op, vs in table.items():
            assert set(vs) <= set(variants.VARIANTS[op])
    # a qualification decoding below the fixed-block threshold does not time those blocks
    short = variants.for_backend("metal", decode_context=64)
    assert "fixed_block_128" in metal["attention"]
    assert "fixed_block_128" not in short["attention"] and "decode_simd" in short["attention"]
    from mlx_lily.ops import attention as A

    long = variants.for_backend("metal", decode_context=A.SPLIT_K_MIN_CONTEXT)
    assert "fixed_block_128" in long["attention"]


def test_dispatch_level_alternatives_are_qualified_as_switches():
    """The folded-vs-separate alternatives that are whole switches (``gdn_proj``,
    ``norm_qgemv``) are ops the qualifier times on vs off."""
    from mlx_lily import backend

    for name in ("gdn_proj", "norm_qgemv", "moe_topk_in_experts"):
        assert name in backend.OP_NAMES


# ----------------------------------------------------------------------------- knobs
def test_knobs_reach_the_launch_parameters(monkeypatch):
    for var in ("MLX_LILY_MOE_DOWN_SHAPE", "MLX_LILY_ATTN_DECODE", "MLX_LILY_ATTN_FIXED_BLOCK"):
        monkeypatch.delenv(var, raising=False)
    assert M.launch_shapes("cuda") == (M.GATE_UP_SHAPE["cuda"], M.DOWN_SHAPE["cuda"])
    assert M.launch_shapes("metal")[1] == (4, 2, 1)
    assert A.decode_variant("metal") == "gqa" and A.decode_variant("cuda") == "gqa"
    assert A.fixed_block("cuda") == 128 and A.fixed_block("metal") == 256
    monkeypatch.setenv("MLX_LILY_MOE_DOWN_SHAPE", "2,2,9")
    assert M.launch_shapes("metal")[1] == (2, 2, 9)
    monkeypatch.setenv("MLX_LILY_ATTN_DECODE", "simd2")
    assert A.decode_variant("metal") == "simd2"
    assert A.decode_variant("cuda") == "gqa"  # no CUDA twin: the default kernel there
    monkeypatch.setenv("MLX_LILY_ATTN_FIXED_BLOCK", "64")
    assert A.decode_block(A.SPLIT_K_MIN_CONTEXT, 1, 2, "metal") == 64
    assert A.decode_block(A.SPLIT_K_MIN_CONTEXT, 1, 2, "cuda") == 64
    assert A.decode_block(4096, 1, 2, "metal") == 32  # the general rule below the cap


def test_decode_attention_rejects_an_unknown_variant():
    q = mx.zeros((1, 16, 1, 256), mx.bfloat16)
    kv = mx.zeros((1, 2, 8, 256), mx.bfloat16)
    with pytest.raises(ValueError, match="variant"):
        A.decode_attention(q, kv, kv, 1.0, variant="fast", backend="metal")


# ----------------------------------------------------------------------------- emulator
_EMU: dict = {}


@contextlib.contextmanager
def _metal_emu_attention(monkeypatch):
    """Attention's dispatchers on the emulated Metal kernels; yields the names of the
    kernels launched."""
    from mlx_lily import kernels
    from mlx_lily.testing import metal_emu

    launched: list = []

    def kern(spec, be):
        if be != "metal":
            return None
        k = _EMU.get(spec)
        if k is None:
            k = _EMU[spec] = kernels.build(spec, "metal", factory=metal_emu.metal_kernel)

        def run(**kw):
            launched.append(spec.name)
            return k(**kw)

        return run

    monkeypatch.setattr(A, "current_backend", lambda: "metal")
    monkeypatch.setattr(A, "_kernel", kern)
    yield launched


def _rand(shape, dtype, scale=1.0):
    return (scale * mx.random.normal(shape)).astype(dtype)


def _kv_views(B, Hkv, T, D, dtype):
    cap = ((T + 255) // 256) * 256 + 256
    return (_rand((B, Hkv, cap, D), dtype)[..., :T, :],
            _rand((B, Hkv, cap, D), dtype)[..., :T, :])


def _attention_case(monkeypatch, env, *, B, Hq, Hkv, D, T, dt, split_k_min=None):
    """The gated decode through ``sdpa_gated`` under ``env`` on the emulated Metal
    kernels, against the fp32 reference; returns (out, the default variant's out)."""
    mx.random.seed(T + Hq + D)
    q = _rand((B, Hq, 1, D), dt)
    k, v = _kv_views(B, Hkv, T, D, dt)
    gate = _rand((B, 1, Hq, 2 * D), dt)[..., D:]
    scale = D ** -0.5
    f32 = [x.astype(mx.float32) for x in (q, k, v)]
    ref = A.sdpa_gated_reference(*f32, scale, None, gate.astype(mx.float32))
    if split_k_min is not None:
        monkeypatch.setattr(A, "SPLIT_K_MIN_CONTEXT", split_k_min)
    outs = []
    with _metal_emu_attention(monkeypatch) as launched:
        for e in ({}, env):
            for var in ("MLX_LILY_ATTN_DECODE", "MLX_LILY_ATTN_FIXED_BLOCK"):
                monkeypatch.delenv(var, raising=False)
            for var, raw in e.items():
                monkeypatch.setenv(var, raw)
            out = A.sdpa_gated(q, k, v, scale, None, gate)
            mx.eval(out)
            outs.append(out)
    simd = env.get("MLX_LILY_ATTN_DECODE", "gqa") != "gqa"
    partial = (A.DECODE_SIMD if simd else A.DECODE_PARTIAL).name
    assert launched == [A.DECODE_PARTIAL.name, A.DECODE_COMBINE.name,
                        partial, A.DECODE_COMBINE.name], launched
    tol = 1e-2 if dt == mx.bfloat16 else 2e-3
    assert_close(outs[1], ref, rtol=tol, atol=tol, what=f"attention {env}")
    return outs[1], outs[0]


ATTN = variants.VARIANTS["attention"]


@needs_emu
@pytest.mark.parametrize("name", sorted(ATTN))
def test_attention_variant_matches_reference(name, monkeypatch):
    """Hq 16 / Hkv 2 / D 256 (Qwen3.6's heads), T 77 (odd: a partial last block); the
    fixed-block variants with the long-context threshold lowered to 128 and T 301. The
    decode kernels of a variant give the default's result bit for bit at the same
    blocks (same per-head arithmetic)."""
    env = ATTN[name]
    fixed = "MLX_LILY_ATTN_FIXED_BLOCK" in env
    out, default = _attention_case(monkeypatch, env, B=1, Hq=16, Hkv=2, D=256,
                                   T=301 if fixed else 77, dt=mx.bfloat16,
                                   split_k_min=128 if fixed else None)
    if not fixed:
        assert mx.array_equal(out, default).item()


@needs_emu
@pytest.mark.parametrize("hps", ["simd", "simd2"])
@pytest.mark.parametrize("heads", [(6, 2, 128, mx.float16), (24, 4, 256, mx.bfloat16)],
                         ids=["G3-D128-fp16", "qwen3_5-G6-D256"])
def test_simd_decode_other_head_layouts(hps, heads, monkeypatch):
    """G 3 (odd: simd2's last simdgroup holds one head) at D 128 in fp16, and Qwen3.5's
    24 q / 4 KV heads of 256; B 2, T 45."""
    Hq, Hkv, D, dt = heads
    _attention_case(monkeypatch, {"MLX_LILY_ATTN_DECODE": hps}, B=2, Hq=Hq, Hkv=Hkv, D=D,
                    T=45, dt=dt)


@needs_emu
@pytest.mark.parametrize("hps", ["simd", "simd2"])
def test_simd_decode_valid_length_from_array(hps, monkeypatch):
    """DYN_T: whole cache buffers with NaN past tlen give the views' result bit for bit."""
    B, Hq, Hkv, D, T, cap, dt = 1, 16, 2, 256, 70, 130, mx.bfloat16
    mx.random.seed(3)
    q = _rand((B, Hq, 1, D), dt)
    tail = mx.arange(cap)[None, None, :, None] >= T
    kb = mx.where(tail, float("nan"), _rand((B, Hkv, cap, D), dt)).astype(dt)
    vb = mx.where(tail, float("nan"), _rand((B, Hkv, cap, D), dt)).astype(dt)
    with _metal_emu_attention(monkeypatch):
        want = A.decode_attention(q, kb[:, :, :T], vb[:, :, :T], D ** -0.5, block=32,
                                  backend="metal", variant=hps)
        got = A.decode_attention(q, kb, vb, D ** -0.5, block=32, backend="metal",
                                 variant=hps, tlen=mx.array([T], dtype=mx.int32))
        mx.eval(want, got)
    assert not mx.isnan(got).any().item()
    assert mx.array_equal(got, want).item()


@needs_emu
@pytest.mark.slow
@pytest.mark.parametrize("name", ["decode_simd", "decode_simd2"])
def test_attention_variant_production_shape(name, monkeypatch):
    """Qwen3.6-35B-A3B's decode at 4099 cached tokens (odd)."""
    out, default = _attention_case(monkeypatch, ATTN[name], B=1, Hq=16, Hkv=2, D=256,
                                   T=4099, dt=mx.bfloat16)
    assert mx.array_equal(out, default).item()


def _moe_case(monkeypatch, env, *, d, i, e, k, rows, backend="metal-emu",
              random_codes=False):
    from test_op_moe_experts import check_close, route, truth
    from _models import moe_block
    from mlx_lily.patches import layouts
    from mlx_lily.testing.cuda_emu import kernel_for

    blk = moe_block(d=d, e=e, k=k, i=i, seed=d + i + e + k, dtype=mx.bfloat16,
                    random_codes=random_codes)
    x = mx.random.normal((rows, 1, d)).astype(mx.bfloat16)
    inds, scores, shared = route(blk, x)
    res = mx.random.normal(x.shape).astype(mx.bfloat16)
    wts = layouts.decode_weights(blk.switch_mlp, blk.shared_expert)
    for var, raw in env.items():
        monkeypatch.setenv(var, raw)
    gu, dn = M.fit_launch_shapes(d, i, k, 4, "cuda" if backend == "cuda-emu" else "metal")
    assert dn == tuple(int(t) for t in env["MLX_LILY_MOE_DOWN_SHAPE"].split(","))
    kg, _ = kernel_for(M.GATE_UP_SPEC, backend)
    kd, _ = kernel_for(M.DOWN_SPEC, backend)
    y = M.launch_decode(kg, kd, x, inds, scores, shared, wts, res, gate_up=gu, down=dn)
    t, mag = truth(x, inds, scores, shared, wts, res)
    check_close(y, t, mag, mx.bfloat16)


MOE = variants.VARIANTS["moe_experts"]


@pytest.fixture
def _aligned(monkeypatch):
    from mlx_lily.testing.cuda_emu import aligned_emu_buffers

    yield from aligned_emu_buffers(monkeypatch)


@needs_emu
@pytest.mark.parametrize("name", sorted(MOE))
@pytest.mark.parametrize("k,e", [(8, 11), (10, 12)], ids=["top8", "qwen3_next-top10"])
def test_moe_down_variant_matches_truth(name, k, e, monkeypatch, _aligned):
    """D 2048 / I 512 (Qwen3.6's and Qwen3-Next's), top-8 + shared (9 slots) and
    top-10 + shared (11: slot groups of unequal length), 3 rows."""
    _moe_case(monkeypatch, MOE[name], d=2048, i=512, e=e, k=k, rows=3)


@needs_emu
@pytest.mark.parametrize("name", sorted(MOE))
def test_moe_down_variant_cuda_twin(name, monkeypatch, _aligned):
    """The variants apply on CUDA too (``variants.for_backend("cuda")``): the CUDA twin's
    body under the emulator, at CUDA's register-fitted shapes."""
    _moe_case(monkeypatch, MOE[name], d=2048, i=512, e=11, k=8, rows=2, backend="cuda-emu")


@needs_emu
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MOE))
def test_moe_down_variant_production_shape(name, monkeypatch, _aligned):
    """Qwen3.6-35B-A3B's experts: 256 of them (random codes and scales), top-8, one row."""
    _moe_case(monkeypatch, MOE[name], d=2048, i=512, e=256, k=8, rows=1, random_codes=True)


def test_norm_once_variant_splits_the_routed_norm(monkeypatch):
    """``norm_once`` is the setting the routed MoE path reads to compute the add +
    RMSNorm once (its kernels' parity: tests/test_op_moe_experts.py, routed cases with
    and without PRE_NORM)."""
    from mlx_lily.ops import norm_qgemv

    monkeypatch.delenv(norm_qgemv.SPLIT_ENV, raising=False)
    assert not norm_qgemv.split_requested()
    for var, raw in variants.VARIANTS["moe_topk_in_experts"]["norm_once"].items():
        monkeypatch.setenv(var, raw)
    assert norm_qgemv.split_requested()


# ----------------------------------------------------------------------------- grouped GEMM
GROUPED = variants.VARIANTS["moe_grouped"]


def _grouped_case(env, *, N, E, tile_rows, kind="topk"):
    """The prefill grouped GEMMs with the coop weight load against the row load (bit
    for bit) and the reference, D 2048 / I 512 (Qwen3.6's), top-8."""
    import numpy as np
    from test_op_moe_grouped import check, getter, lay, make_inputs, make_layer
    from mlx_lily.ops import moe_grouped as mg

    assert env[variants._LOAD] == "coop"
    mx.random.seed(N + E + tile_rows)
    sw, sh = make_layer(2048, 512, E)
    x, inds, scores, sgate = make_inputs(N, 8, E, 2048, kind, rng=np.random.default_rng(N))
    get = getter("metal-emu")
    launched = []

    def counted(spec):
        k = get(spec)
        return lambda **kw: launched.append(spec.name) or k(**kw)

    outs = [mg.grouped_experts(x, inds, scores, *lay(sw, sh), sgate, tile_rows=tile_rows,
                               get_kernel=counted, load=load) for load in ("row", "coop")]
    mx.eval(outs)
    assert [n for n in launched if n.startswith("moeg_") and "route" not in n] == [
        "moeg_gate_up", "moeg_down", "moeg_combine",
        "moeg_gate_up_coop", "moeg_down_coop", "moeg_combine"], launched
    assert mx.array_equal(outs[0], outs[1]).item()
    check(outs[1], x, inds, scores, sw, sh, sgate)


@needs_emu
@pytest.mark.parametrize("tile_rows", [16, 32, 64])
def test_grouped_coop_load_matches_row_load_and_reference(tile_rows, _aligned):
    """11 tokens (odd, 88 pairs) over 9 experts: partial tiles at every height."""
    env = GROUPED[f"coop_load_tile{tile_rows}"]
    assert env["MLX_LILY_MOE_TILE_ROWS"] == str(tile_rows)
    _grouped_case(env, N=11, E=9, tile_rows=tile_rows)


@needs_emu
@pytest.mark.slow
def test_grouped_coop_load_production_experts(_aligned):
    """256 experts (ids up to 255: the weight offsets of the production layer), 33
    tokens routed with a skewed load (a few experts take most pairs, most get none or
    one), 32-row tiles."""
    _grouped_case(GROUPED["coop_load"], N=33, E=256, tile_rows=32, kind="skew")


def test_grouped_load_knob(monkeypatch):
    from mlx_lily.ops import moe_grouped as mg

    monkeypatch.delenv("MLX_LILY_MOEG_LOAD", raising=False)
    assert mg.weight_load("metal") == "row" and mg.weight_load("cuda") == "row"
    monkeypatch.setenv("MLX_LILY_MOEG_LOAD", "coop")
    assert mg.weight_load("metal") == "coop"
    assert mg.weight_load("cuda") == "row"  # no CUDA twin of the coop kernels


# ----------------------------------------------------------------------------- one-row GEMVs
GEMV = {n: e for n, e in variants.VARIANTS["qgemv"].items()  # the Metal launch variants
        if ("qgemv", n) not in variants.CUDA_ONLY}
_GEMV_KNOBS = ("MLX_LILY_QGEMV_SHAPE", "MLX_LILY_QGEMV_BPL")


def _gemv_env(monkeypatch, env):
    """Only ``env``'s GEMV knobs set, and the qgemv launcher on the Metal path."""
    from mlx_lily.ops import qgemv as Q

    for var in _GEMV_KNOBS:
        monkeypatch.delenv(var, raising=False)
    for var, raw in env.items():
        monkeypatch.setenv(var, raw)
    monkeypatch.setattr(Q, "current_backend", lambda: "metal")


def _gemv_want(env) -> dict:
    """The NW / RPW / BPL template values ``env`` gives the Metal launch at K 2048."""
    nw, rpw = (int(t) for t in env.get("MLX_LILY_QGEMV_SHAPE", "4,4").split(","))
    return {"NW": nw, "RPW": rpw, "BPL": int(env.get("MLX_LILY_QGEMV_BPL", "16"))}


def _gemv_run(monkeypatch, op, env, *, k, o, dt, rows, sdt=mx.bfloat16, seed=0, bits=4):
    """``op``'s Metal kernel (emulated: NaN-poisoned outputs) under ``env`` at K ``k`` /
    O ``o`` (``bits``, group 64) for each row count in ``rows``, checked against the fp32
    truth; returns the outputs. Asserts that the launch's template carries the
    variant's NW / RPW / BPL."""
    from mlx_lily.ops import norm_qgemv as NQ
    from mlx_lily.ops import qgemv as Q
    from mlx_lily.testing.cuda_emu import kernel_for

    _gemv_env(monkeypatch, env)
    mx.random.seed(seed + o)
    w = (mx.random.normal((o, k)) * k ** -0.5).astype(sdt)
    q, s, b = mx.quantize(w, 64, bits)
    outs = []
    for n in rows:
        tmpl = dict(Q.launch_args((n, k), dt, q, s, 64, bits)["template"])
        assert {key: tmpl[key] for key in ("NW", "RPW", "BPL")} == _gemv_want(env), tmpl
        if op == "qgemv":
            from test_op_qgemv import check_close, truth

            x = mx.random.normal((n, k)).astype(dt)
            kern, _ = kernel_for(Q.SPEC, "metal-emu")
            y = Q.launch(kern, x, q, s, b, 64, bits)
            mx.eval(y)
            check_close(y, truth(x, q, s, b, 64, bits), x, q, s, b, 64, bits, dt)
        else:
            from test_op_norm_qgemv import check, make_inputs

            h0, res, nw = make_inputs(n, k, dt, seed + n)
            kern, _ = kernel_for(NQ.SPEC, "metal-emu")
            y, h = NQ.launch(kern, h0, res, nw, 1e-6, q, s, b, 64, bits)
            mx.eval(y, h)
            check(y, h, h0, res, nw, 1e-6, q, s, b, 64, bits, dt)
        assert not mx.isnan(y).any().item()
        outs.append(y)
    return outs


@needs_emu
@pytest.mark.parametrize("dt", [mx.bfloat16, mx.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", sorted(GEMV))
@pytest.mark.parametrize("op", ["qgemv", "norm_qgemv"])
def test_gemv_variant_matches_reference(op, name, dt, monkeypatch, _aligned):
    """K 2048 (Qwen3.6's hidden width) into O 1003 (no multiple of 8, 16 or 32 rows: the
    last threadgroup's clamped rows), 1 and 3 rows. ``qgemv``'s shape variants give the
    default's result bit for bit (a row's arithmetic does not depend on the launch
    shape); ``norm_qgemv``'s change the sum-of-squares order only."""
    assert variants.VARIANTS["qgemv"][name] == GEMV[name]
    out = _gemv_run(monkeypatch, op, GEMV[name], k=2048, o=1003, dt=dt, rows=(1, 3))
    if op == "qgemv" and "MLX_LILY_QGEMV_BPL" not in GEMV[name]:
        default = _gemv_run(monkeypatch, op, {}, k=2048, o=1003, dt=dt, rows=(1, 3))
        for a, b in zip(out, default):
            assert mx.array_equal(a, b).item()


@needs_emu
@pytest.mark.parametrize("name", [n for n in sorted(GEMV) if "MLX_LILY_QGEMV_BPL" in GEMV[n]])
@pytest.mark.parametrize("op", ["qgemv", "norm_qgemv"])
def test_gemv_8_byte_loads_at_8_bits(op, name, monkeypatch, _aligned):
    """The router + shared-gate shape (2048 -> 257, 8-bit: 8 values per 8-byte word)."""
    _gemv_run(monkeypatch, op, GEMV[name], k=2048, o=257, dt=mx.bfloat16, rows=(1, 3),
              bits=8)


@needs_emu
@pytest.mark.parametrize("op", ["qgemv", "norm_qgemv"])
def test_gemv_8_byte_loads_equal_16_byte_loads(op, monkeypatch, _aligned):
    """fp32 activations (no output rounding to hide behind): the 8-byte path's result
    is the 16-byte path's within fp32 summation-order error (the per-lane partial sums
    split the row differently), K 2048 into O 7 (one clamped threadgroup), 3 rows."""
    k, o = 2048, 7
    ys = [_gemv_run(monkeypatch, op, {"MLX_LILY_QGEMV_BPL": bpl}, k=k, o=o,
                    dt=mx.float32, rows=(3,), seed=5)[0] for bpl in ("16", "8")]
    assert ys[0].dtype == mx.float32
    assert not mx.array_equal(ys[0], ys[1]).item()  # the knob changed the kernel's sums
    # the terms' magnitudes bound the summation-order error: |x| @ |w|^T ~ sqrt(K) here
    tol = 1e-5 * float(mx.abs(ys[0]).max().item() + k ** 0.5)
    assert float(mx.abs(ys[0] - ys[1]).max().item()) <= tol


@needs_emu
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(GEMV))
def test_gemv_variant_production_rows(name, monkeypatch, _aligned):
    """Qwen3.6-35B-A3B's packed q|k|v projection: K 2048 into 9216 rows, one row."""
    _gemv_run(monkeypatch, "norm_qgemv", GEMV[name], k=2048, o=9216, dt=mx.bfloat16,
              rows=(1,))


def test_gemv_knobs_parse_and_reach_only_metal(monkeypatch):
    from mlx_lily.ops import qgemv as Q

    shape, bpl = (_KNOB_BY_ENV[v] for v in _GEMV_KNOBS)
    assert shape.parse("2,4") == (2, 4) and shape.parse("32,8") == (32, 8)
    for bad in ("33,4", "0,4", "4,9", "4", "4,4,4", "a,b"):
        with pytest.raises(config.BadValue):
            shape.parse(bad)
    assert bpl.parse("8") == 8 and bpl.parse("16") == 16
    for bad in ("4", "32", "x"):
        with pytest.raises(config.BadValue):
            bpl.parse(bad)
    for var in _GEMV_KNOBS:
        monkeypatch.delenv(var, raising=False)
    assert Q.launch_shape(2048, 9216, 4, "metal") == (Q.NW, Q.RPW)
    assert Q.bytes_per_lane("metal") == 16
    monkeypatch.setenv("MLX_LILY_QGEMV_SHAPE", "8,2")
    monkeypatch.setenv("MLX_LILY_QGEMV_BPL", "8")
    assert Q.launch_shape(2048, 9216, 4, "metal") == (8, 2)
    assert Q.bytes_per_lane("metal") == 8
    # CUDA: unchanged (no BPL template on its twin)
    assert Q.launch_shape(2048, 9216, 4, "cuda") == (Q.NW, Q.RPW)
    assert Q.bytes_per_lane("cuda") == 16
    q = mx.zeros((9216, 256), mx.uint32)
    s = mx.zeros((9216, 32), mx.bfloat16)
    monkeypatch.setattr(Q, "current_backend", lambda: "cuda")
    kw = Q.launch_args((1, 2048), mx.bfloat16, q, s, 64, 4)
    assert [n for n, _ in kw["template"]] == ["T", "S", "K", "O", "BITS", "GS", "NW", "RPW"]
    with pytest.raises(ValueError, match="8-byte"):
        Q.launch_args((1, 2048), mx.bfloat16, q, s, 64, 4, bpl=8)
    monkeypatch.setattr(Q, "current_backend", lambda: "metal")
    kw = Q.launch_args((1, 2048), mx.bfloat16, q, s, 64, 4)
    assert dict(kw["template"])["BPL"] == 8 and kw["threadgroup"] == (256, 1, 1)
    assert kw["grid"] == (-(-9216 // 16) * 256, 1, 1)  # 8 warps x 2 rows


def test_bad_gemv_knob_warns_naming_the_variable(monkeypatch):
    from mlx_lily.ops import qgemv as Q

    from mlx_lily import config

    monkeypatch.setenv("MLX_LILY_QGEMV_SHAPE", "64,4")
    monkeypatch.setenv("MLX_LILY_QGEMV_BPL", "4")
    for key in (("MLX_LILY_QGEMV_SHAPE", "64,4"), ("MLX_LILY_QGEMV_BPL", "4")):
        config.WARNED.discard(key)  # each bad value warns once per process
    with pytest.warns(UserWarning, match="MLX_LILY_QGEMV_SHAPE"):
        assert Q.launch_shape(2048, 9216, 4, "metal") == (Q.NW, Q.RPW)
    with pytest.warns(UserWarning, match="MLX_LILY_QGEMV_BPL"):
        assert Q.bytes_per_lane("metal") == 16


@needs_emu
def test_qproj_plan_follows_the_gemv_knobs(monkeypatch, _aligned):
    """A one-row ``QProj`` call re-plans when a GEMV knob changes (the qualifier runs a
    variant in the process that ran the default): the launch carries the variant's
    NW / BPL, and the result stays within the fp32 truth's tolerance."""
    import mlx.nn as nn
    from mlx_lily.ops import qgemv as Q
    from mlx_lily.qproj import QProj
    from mlx_lily.testing.dispatch import emulated_metal_dispatch
    from test_op_qgemv import check_close, truth

    emulated_metal_dispatch(monkeypatch, Q)
    mx.random.seed(9)
    lin = nn.Linear(2048, 40, bias=False)
    lin.weight = (mx.random.normal((40, 2048)) * 0.02).astype(mx.bfloat16)
    proj = QProj.fuse([nn.QuantizedLinear.from_linear(lin, 64, 4)])
    seen = []
    real = Q.plan

    def spy(*a, **kw):
        _, shape, dt, w, sc, _b, gs, bits = a
        seen.append(dict(Q.launch_args(shape, dt, w, sc, gs, bits)["template"]))
        return real(*a, **kw)

    monkeypatch.setattr(Q, "plan", spy)
    x = mx.random.normal((1, 1, 2048)).astype(mx.bfloat16)
    t = truth(x.reshape(1, 2048), proj.weight, proj.scales, proj.biases, 64, 4)
    for env in ({}, {"MLX_LILY_QGEMV_BPL": "8", "MLX_LILY_QGEMV_SHAPE": "2,4"}, {}):
        for var in _GEMV_KNOBS:
            monkeypatch.delenv(var, raising=False)
        for var, raw in env.items():
            monkeypatch.setenv(var, raw)
        y = mx.concatenate(proj(x), axis=-1).reshape(1, 40)
        check_close(y, t, x.reshape(1, 2048), proj.weight, proj.scales, proj.biases, 64,
                    4, mx.bfloat16)
    assert [(d["NW"], d["BPL"]) for d in seen] == [(4, 16), (2, 8)]  # the third: cached


def test_gemv_variants_are_metal_only_and_not_the_default():
    """The launch-shape variants qualify on Metal only, the tensor-core form on CUDA
    only; neither is a backend's default."""
    metal, cuda = variants.for_backend("metal"), variants.for_backend("cuda")
    assert set(metal["qgemv"]) == set(GEMV) and set(cuda["qgemv"]) == {"mma"}
    assert ("qgemv", "mma") in variants.CUDA_ONLY and "mma" not in GEMV
    assert set(variants.VARIANTS["qgemv"]) == set(GEMV) | {"mma"}
    assert "qgemv" not in variants.for_backend("cpu")
    assert all(("qgemv", n) in variants.METAL_ONLY for n in GEMV)
    assert "norm_qgemv" not in variants.VARIANTS  # the knobs are global: one op owns them
    table = {"qgemv": {"same": {"MLX_LILY_QGEMV_SHAPE": "4,4"},
                       "same_bpl": {"MLX_LILY_QGEMV_BPL": "16"}}}
    assert variants.for_backend("metal", table) == {}


# ----------------------------------------------------------------------------- front end
_FRONT_END = {  # variant settings -> a kernel (and template value) only they record
    ("attention", "decode_simd"): ("lily_attn_decode_simd", "HPS", 1),
    ("attention", "decode_simd2"): ("lily_attn_decode_simd", "HPS", 2),
    ("moe_experts", "down_sl3"): ("lily_moe_down", "SL", 3),
    ("moe_experts", "down_sl9"): ("lily_moe_down", "SL", 9),
    ("moe_grouped", "coop_load"): ("moeg_gate_up_coop", "BM", 32),
    ("moe_grouped", "coop_load_tile64"): ("moeg_down_coop", "BM", 64),
    ("gated_delta", "scan_staged"): ("lily_gdn_scan_staged", "LPR", 8),
    ("qgemv", "bpl8"): ("lily_norm_qgemv", "BPL", 8),
    ("qgemv", "rows_8"): ("lily_qgemv", "NW", 2),
}


@needs_emu
@pytest.mark.slow
@pytest.mark.parametrize("op,name", sorted(_FRONT_END), ids=lambda v: str(v))
def test_variant_instantiations_pass_the_front_end_check(op, name, monkeypatch):
    """Qwen3.6-35B-A3B's recorded forward under the variant's settings: every Metal
    kernel instantiation renders and compiles as MLX 0.32 does
    (``mlx_lily.testing.msl_frontend``), the variant's kernel among them."""
    from mlx_lily.testing import msl_frontend as F

    for var, raw in variants.VARIANTS[op][name].items():
        monkeypatch.setenv(var, raw)
    calls = F.record_model("qwen3_5_moe")
    kname, key, want = _FRONT_END[(op, name)]
    assert any(c.name == kname and dict(c.template).get(key) == want for c in calls)
    results = F.check_all(F.instantiations(calls))
    failed = [(r.instantiation.describe(), r.errors[0]) for r in results if not r.ok]
    assert results and not failed, failed


# ----------------------------------------------------------------------------- qualifier
@needs_emu
def test_qualifier_checks_every_variant_on_the_emulator():
    """``qualify_model`` on emulated Metal (a tiny Qwen3.6-layout model) runs each
    variant of attention, moe_experts and gated_delta under its settings: every one Metal
    qualifies at that context is in the record, and passes parity."""
    res = _qualify_on_emu(["attention", "moe_experts", "gated_delta"])
    assert {"decode_simd", "decode_simd2"} <= set(res["ops"]["attention"])
    assert {"down_sl3", "down_sl9"} <= set(res["ops"]["moe_experts"])
    assert "scan_staged" in res["ops"]["gated_delta"]


@needs_emu
def test_qualifier_checks_the_gemv_variants_on_the_emulator():
    """The same for the one-row GEMVs: each of ``qgemv``'s launch variants is qualified
    under its settings and passes parity; ``norm_qgemv`` (whose kernel follows the same
    global knobs) has only its default."""
    res = _qualify_on_emu(["qgemv", "norm_qgemv"])
    assert set(GEMV) <= set(res["ops"]["qgemv"])
    assert set(res["ops"]["norm_qgemv"]) == {qualify.DEFAULT_VARIANT}


def _qualify_on_emu(ops) -> dict:
    import _models
    from mlx_lily.testing.dispatch import emulated_metal

    model = _models.build("qwen3_5_moe", seed=3)
    # parity on qualification's own positions (8-token prefill, a decode step, the last
    # 8 of a PARITY_PREFILL-token prefill: 17). With 9 positions (parity_prefill=0) one
    # near-tie top-1 flip (0.11) exceeds ANCHOR_TOP1_SLACK (0.1): gated_delta alone then
    # failed there (top-1 vs fp32 6/9, the references 7/9) with any MoE dispatch.
    with emulated_metal():
        res = qualify.qualify_model(model, ops=ops, decode_steps=1, decode_rounds=2,
                                    decode_context=4, prefill_len=8,
                                    parity_prefill=qualify.PARITY_PREFILL, prefill_reps=1,
                                    seed=1, method=qualify.GREEDY)
    for op in ops:
        # Metal's own variants: not those equal to its default, nor the fixed blocks
        # (they act from 32K cached tokens; this decodes at 4)
        want = {qualify.DEFAULT_VARIANT,
                *variants.for_backend("metal", decode_context=4).get(op, {})}
        assert set(res["ops"][op]) == want, (op, sorted(res["ops"][op]))
        failed = {v: r.get("error") for v, r in res["ops"][op].items() if not r["passed"]}
        assert not failed, (op, failed)
    return res
