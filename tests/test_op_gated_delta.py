"""gated_delta op: reference vs stock mlx-lm, fused kernels vs reference and vs a float64
oracle of the kernels' documented arithmetic, dispatcher routing, CUDA compile checks.

Backends: "reference" (always: the reference tests), "metal-emu" (Metal twins on the CPU
emulator, small head counts with production head dims 128), "cuda-emu" (the CUDA twins'
bodies on the same emulator, CUDA names mapped), "metal"/"cuda" (real devices, marked
gpu). The float64 oracle checks the kernels tightly (state 1e-5 of max, outputs within one
ulp); the comparison with mlx-lm's reference is looser because the reference rounds its
gates to bf16 (the kernels keep them fp32). nvcc results are cached on disk by rendered
source ($MLX_LILY_CUDA_CHECK_CACHE, default ~/.cache/mlx-lily/cuda-check).
"""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest

import mlx.core as mx

from mlx_lily import config
from mlx_lily import kernels as K
from mlx_lily.ops import gated_delta as G

# fp32 matmuls in fp32 on CUDA for the chunked-scan tests (MLX reads this once, at its
# first fp32 matmul; the GPU suite runs each test file in its own process)
os.environ.setdefault("MLX_ENABLE_TF32", "0")
from mlx_lily.testing.backends import metal_kernel_factory, parity_backends

from _close import assert_close, rel_err
from _models import gated_delta_net

BF = mx.bfloat16
KERNEL_BACKENDS = [b for b in parity_backends() if b != "reference"]
if "metal-emu" in KERNEL_BACKENDS:
    KERNEL_BACKENDS.insert(KERNEL_BACKENDS.index("metal-emu") + 1, "cuda-emu")

# "cuda-emu": the CUDA twin's body run on the Metal emulator, with CUDA names mapped
# onto the emulator's (``mlx_lily.testing.cuda_emu.cuda_on_emu``). It checks the CUDA
# bodies' indexing, synchronisation and arithmetic on the CPU; NVRTC acceptance is
# checked separately by nvcc.


def _case_id(c):
    return ",".join(f"{k}={v}" for k, v in c.items())


def _param(b):
    return pytest.param(b, marks=pytest.mark.gpu) if b in ("metal", "cuda") else b


# ------------------------------------------------------------------ inputs
def make_inputs(B, S, Hk=2, Hv=4, D=128, KS=4, dtype=BF, seed=0, fused_views=True,
                conv_state=True, state=True, state_scale=0.1, a_log_dtype=mx.float32,
                exotic=False):
    """Random GDN inputs. ``fused_views``: qkv, z, b, a are row-slice views of one fused
    projection output, as the patched forward passes them; ``exotic``: every input is a
    transposed / stepped / offset view (the kernels read everything through strides)."""
    rng = np.random.default_rng(seed)
    C = 2 * Hk * D + Hv * D

    def arr(shape, scale=1.0, dt=dtype, offset=0.0):
        return mx.array((offset + scale * rng.standard_normal(shape)).astype(np.float32)).astype(dt)

    if fused_views:
        W = C + Hv * D + 2 * Hv + 3  # odd tail: views are not aligned to anything nice
        y = arr((B, S, W))
        qkv, z, b, a, _ = mx.split(y, [C, C + Hv * D, C + Hv * D + Hv, C + Hv * D + 2 * Hv],
                                   axis=-1)
        z = z.reshape(B, S, Hv, D)
    else:
        qkv, z, b, a = arr((B, S, C)), arr((B, S, Hv, D)), arr((B, S, Hv)), arr((B, S, Hv))
    if exotic:  # every input a strided view with non-trivial strides in every axis
        qkv = arr((B, C, S)).transpose(0, 2, 1)
        z = arr((B, S, D, Hv)).transpose(0, 1, 3, 2)
        b, a = arr((B, Hv, S)).transpose(0, 2, 1), arr((B, Hv, S)).transpose(0, 2, 1)
        return dict(
            qkv=qkv, z=z, b=b, a=a,
            conv_weight=arr((KS, C, 1), 0.3).transpose(1, 0, 2),
            conv_state=arr((B, KS + 1, 2 * C))[:, 1:KS, ::2],
            A_log=mx.array(np.log(rng.uniform(1, 16, 2 * Hv)).astype(np.float32))[::2],
            dt_bias=arr((2 * Hv,), 0.1, offset=1.0)[1::2],
            state=arr((B, Hv, D, D), state_scale, mx.float32).swapaxes(2, 3),
            norm_weight=arr((3 * D,), 0.1, offset=1.0)[::3],
        ), dict(num_k_heads=Hk, head_k_dim=D, num_v_heads=Hv, head_v_dim=D, eps=1e-6)
    return dict(
        qkv=qkv, z=z, b=b, a=a,
        conv_weight=arr((C, KS, 1), 0.3),
        conv_state=arr((B, KS - 1, C)) if conv_state else None,
        A_log=mx.array(np.log(rng.uniform(1, 16, Hv)).astype(np.float32)).astype(a_log_dtype),
        dt_bias=arr((Hv,), 0.1, offset=1.0),
        state=arr((B, Hv, D, D), state_scale, mx.float32) if state else None,
        norm_weight=arr((D,), 0.1, offset=1.0),
    ), dict(num_k_heads=Hk, head_k_dim=D, num_v_heads=Hv, head_v_dim=D, eps=1e-6)


def f32(x):
    return np.array(x.astype(mx.float32))


# ------------------------------------------------------------------ float64 oracle
def _rnd(x, dtype):
    x = np.asarray(x, np.float32)
    if dtype == mx.float32:
        return x.astype(np.float64)
    if dtype == mx.float16:
        return x.astype(np.float16).astype(np.float64)
    u = x.view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


def _sig(x):
    return 1.0 / (1.0 + np.exp(-x))


def oracle(qkv, z, b, a, conv_weight, conv_state, A_log, dt_bias, state, norm_weight, *,
           num_k_heads, head_k_dim, num_v_heads, head_v_dim, eps, mask=None, lengths=None):
    """The kernels' arithmetic in float64, rounding to T where they do (shader notes).
    Masked rows: zero conv input, g = 1, beta = 0 (state unchanged, output = S q)."""
    T = qkv.dtype
    Hk, Dk, Hv, Dv = num_k_heads, head_k_dim, num_v_heads, head_v_dim
    B, S, C = qkv.shape
    KS = conv_weight.shape[1]
    r = functools.partial(_rnd, dtype=T)
    live = np.ones((B, S), bool) if mask is None else np.array(mask)
    x = f32(qkv).astype(np.float64) * live[..., None]
    cs = (f32(conv_state).astype(np.float64) if conv_state is not None
          else np.zeros((B, KS - 1, C)))
    xin = np.concatenate([cs, x], axis=1)
    w = f32(conv_weight)[:, :, 0].astype(np.float32)
    acc = np.zeros((B, S, C), np.float32)
    for j in range(KS):
        acc = acc + (xin[:, j:j + S, :].astype(np.float32) * w[:, j])
    xb = r(acc)
    act = r(xb * r(_sig(xb)))
    q = act[..., :Hk * Dk].reshape(B, S, Hk, Dk)
    k = act[..., Hk * Dk:2 * Hk * Dk].reshape(B, S, Hk, Dk)
    v = act[..., 2 * Hk * Dk:].reshape(B, S, Hv, Dv)
    qk_eps = np.float32(1e-6) / np.float32(Dk)

    def l2(t, scale):
        rs = 1.0 / np.sqrt((t * t).sum(-1, keepdims=True) / Dk + qk_eps)
        return r(r(t * rs) * r(scale))

    q = l2(q, 1.0 / Dk)
    k = l2(k, Dk ** -0.5)
    beta = _sig(f32(b).astype(np.float64))
    sp_in = f32(a).astype(np.float64) + f32(dt_bias).astype(np.float64)
    sp = np.maximum(sp_in, 0) + np.log1p(np.exp(-np.abs(sp_in)))
    g = np.exp(-np.exp(f32(A_log).astype(np.float64)) * sp)
    g = np.where(live[..., None], g, 1.0)
    beta = np.where(live[..., None], beta, 0.0)
    S_ = (f32(state).astype(np.float64) if state is not None else np.zeros((B, Hv, Dv, Dk)))
    rep = Hv // Hk
    qh = np.repeat(q, rep, axis=2)
    kh = np.repeat(k, rep, axis=2)
    ys = np.zeros((B, S, Hv, Dv))
    for t in range(S):
        S_ = S_ * g[:, t, :, None, None]
        kv = np.einsum("bhvk,bhk->bhv", S_, kh[:, t])
        delta = (v[:, t] - kv) * beta[:, t, :, None]
        S_ = S_ + delta[..., None] * kh[:, t, :, None, :]
        ys[:, t] = np.einsum("bhvk,bhk->bhv", S_, qh[:, t])
    yb = r(ys)
    rstd = 1.0 / np.sqrt((yb * yb).mean(-1, keepdims=True) + np.float32(eps))
    nwt = f32(norm_weight).astype(np.float64)
    zf = f32(z).astype(np.float64)
    out = r(zf * _sig(zf) * r(r(yb * rstd) * nwt))
    if lengths is None:
        new_conv = xin[:, S:S + KS - 1, :]
    else:
        ends = np.clip(np.array(lengths), 0, S)
        new_conv = np.stack([xin[i, e:e + KS - 1, :] for i, e in enumerate(ends)])
    return out.reshape(B, S, Hv * Dv), new_conv, S_


# ------------------------------------------------------------------ kernel runners
@functools.lru_cache(maxsize=None)
def _kernel(spec, backend):
    if backend == "cuda":
        return K.build(spec, "cuda")
    if backend == "cuda-emu":
        from mlx_lily.testing.cuda_emu import cuda_on_emu

        return cuda_on_emu(spec)
    return K.build(spec, "metal", factory=metal_kernel_factory(backend))


def run_kernels(backend, inp, dims, scan_cfg=(8, 1, 4), scan="kernel"):
    reason = G.kernel_unsupported(**inp, **dims, scan_cfg=scan_cfg)
    assert reason is None, reason
    stream = mx.gpu if backend in ("metal", "cuda") else mx.cpu
    with mx.stream(stream):
        # real devices: NaN-filled outputs (the emulator poisons them itself)
        init = float("nan") if backend in ("metal", "cuda") else None
        out = G.gated_delta_fused(**inp, **dims, scan_cfg=scan_cfg, init_value=init,
                                  get_kernel=lambda spec: _kernel(spec, backend), scan=scan)
        mx.eval(out)
    return out


def _check_vs_oracle(got, want, T):
    """Tight check against the float64 oracle. Device exp/rsqrt may differ from the
    oracle's by an fp32 ulp or two, which now and then flips a bf16 rounding of q/k/v (one
    T ulp in one element, then a whole state column drifts ~1e-4): so 99.5% of the state
    must be within 1e-5 of max|S|, all of it within 2e-3; outputs within 3 T ulps, and at
    most 2% of them different at all. Wrong indexing or a low-precision state fails all
    of these by orders of magnitude."""
    out, conv, state = got
    o_out, o_conv, o_state = want
    np.testing.assert_array_equal(f32(conv), o_conv.astype(np.float32))
    assert_close(state, o_state, rtol=2e-3, scale="max", what="state")
    assert_close(state, o_state, rtol=1e-5, scale="max", atol=1e-7, max_bad_frac=5e-3,
                 what="state, 99.5%")
    if T == mx.float32:
        assert_close(out, o_out, rtol=1e-5, scale="max", what="out")
        return
    assert_close(out, o_out, dtype=T, ulps=3.03, ulp_of=np.maximum(np.abs(o_out), 2.0 ** -6),
                 max_diff_frac=0.02, what="out")


def cpu_reference(**kw):
    """``gated_delta_reference`` evaluated on the CPU stream: the contract's own backend.
    On the H200, MLX's CUDA evaluation of the same reference sat ~0.5% (L2, state) from
    its CPU evaluation while the kernels passed the tight float64-oracle checks, so GPU
    runs compare the kernels with the CPU evaluation. Array inputs are copied through
    numpy first: the CPU stream evaluating arrays still pending on the GPU stream crashed
    MLX 0.32.4's CUDA build (segfault on the H200)."""
    def host(v):
        if not isinstance(v, mx.array):
            return v
        a = np.array(v.astype(mx.float32) if v.dtype == mx.bfloat16 else v)
        return mx.array(a, dtype=v.dtype)

    mx.eval([v for v in kw.values() if isinstance(v, mx.array)])
    mx.synchronize()
    with mx.stream(mx.cpu):
        out = G.gated_delta_reference(**{k: host(v) for k, v in kw.items()})
        mx.eval(out)
    return out


def _check_vs_reference(got, ref):
    """Kernel vs mlx-lm's reference: the reference rounds gates (beta, softplus) to bf16
    and computes its sigmoid in bf16 steps, so differences are a few bf16 ulps in the
    output and ~1e-3 relative in the state; the conv state is exact."""
    out, conv, state = got
    r_out, r_conv, r_state = ref
    np.testing.assert_array_equal(f32(conv), f32(r_conv))
    assert_close(state, r_state, rtol=1e-2, scale="max", l2=5e-3, what="state")
    assert_close(out, r_out, rtol=2e-2, scale="max", l2=1e-2, what="out")


# ------------------------------------------------------------------ reference vs stock mlx-lm
@pytest.mark.parametrize("S", [1, 5])
@pytest.mark.parametrize("with_cache", [False, True, "batched"])
def test_reference_matchesgated_delta_net(S, with_cache):
    """Reference + projections == mlx-lm's GatedDeltaNet.__call__, bit for bit (also with
    the batched cache's mask and lengths)."""
    from mlx_lm.models.cache import ArraysCache

    m = gated_delta_net()
    B = 2
    rng = np.random.default_rng(S)
    x = mx.array(rng.standard_normal((B, S, 64)).astype(np.float32)).astype(BF)
    cache = stock_cache = mask = lengths = None
    if with_cache:
        cache, stock_cache = ArraysCache(size=2), ArraysCache(size=2)
        cs = mx.array(rng.standard_normal((B, 3, m.conv_dim)).astype(np.float32)).astype(BF)
        st = mx.array(0.1 * rng.standard_normal((B, 4, 128, 128)).astype(np.float32))
        cache[0], cache[1] = cs, st
        stock_cache[0], stock_cache[1] = cs, st
        if with_cache == "batched":
            lengths = mx.array([S, max(S - 2, 0)])
            stock_cache.lengths = mx.array([S, max(S - 2, 0)])  # advance() updates it
            mask = mx.arange(S)[None, :] < lengths[:, None]
            mask = mask & (mx.arange(S)[None, :] >= mx.array([1, 0])[:, None])
    want = m(x, mask=mask, cache=stock_cache)
    qkv = m.in_proj_qkv(x)
    z = m.in_proj_z(x).reshape(B, S, m.num_v_heads, m.head_v_dim)
    out, new_conv, new_state = G.gated_delta_reference(
        qkv, z, m.in_proj_b(x), m.in_proj_a(x), m.conv1d.weight,
        cache[0] if cache else None, m.A_log, m.dt_bias, cache[1] if cache else None,
        m.norm.weight, num_k_heads=m.num_k_heads, head_k_dim=m.head_k_dim,
        num_v_heads=m.num_v_heads, head_v_dim=m.head_v_dim, eps=m.norm.eps, mask=mask,
        lengths=lengths)
    got = m.out_proj(out)
    np.testing.assert_array_equal(f32(got), f32(want))
    if with_cache:
        np.testing.assert_array_equal(f32(new_conv), f32(stock_cache[0]))
        np.testing.assert_array_equal(np.array(new_state), np.array(stock_cache[1]))


def test_oracle_matches_reference_loosely():
    """The float64 oracle (the kernels' arithmetic) and mlx-lm's reference agree to the
    reference's bf16 gate rounding; guards the oracle itself."""
    inp, dims = make_inputs(1, 6, seed=3)
    _check_vs_reference(tuple(mx.array(t.astype(np.float32)) for t in oracle(**inp, **dims)),
                        G.gated_delta_reference(**inp, **dims))


# ------------------------------------------------------------------ kernels
DECODE_CASES = [
    dict(B=1),
    dict(B=3, seed=1),
    dict(B=2, Hk=1, Hv=3, seed=2),                       # odd head count, G=3
    dict(B=1, Hk=2, Hv=2, seed=3, fused_views=False),    # G=1, contiguous inputs
    dict(B=2, conv_state=False, state=False, seed=4),    # first token, no cache
    dict(B=1, D=64, seed=5),                             # smaller head dim
    dict(B=1, KS=3, seed=6, a_log_dtype=BF),             # other conv width, bf16 A_log
    dict(B=1, dtype=mx.float16, seed=7),
    dict(B=1, dtype=mx.float32, seed=8),
    dict(B=2, Hv=2, Hk=1, seed=9, exotic=True),
]


@pytest.mark.parametrize("backend", [_param(b) for b in KERNEL_BACKENDS])
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: _case_id(c))
def test_decode_kernel(backend, case):
    case = dict(case)
    inp, dims = make_inputs(S=1, **case)
    got = run_kernels(backend, inp, dims)
    _check_vs_oracle(got, oracle(**inp, **dims), inp["qkv"].dtype)
    if inp["qkv"].dtype == BF:
        _check_vs_reference(got, cpu_reference(**inp, **dims))


PREFILL_CASES = [
    dict(B=1, S=2),
    dict(B=2, S=19, seed=1),                             # partial prep tile
    dict(B=1, S=33, Hk=1, Hv=3, seed=2, cfg=(4, 1, 4)),
    dict(B=1, S=8, seed=3, cfg=(16, 2, 4), conv_state=False, state=False),
    dict(B=1, S=3, seed=4, cfg=(32, 4, 1), fused_views=False, KS=2),
    dict(B=1, S=12, seed=5, D=64, cfg=(8, 2, 2)),
    dict(B=1, S=5, seed=6, dtype=mx.float32, cfg=(2, 1, 1)),
    dict(B=2, S=6, Hv=2, Hk=1, seed=7, exotic=True),
    dict(B=1, S=4, Hk=16, Hv=32, seed=8, cfg=G.SCAN_CONFIG["cuda"]),  # production heads
    dict(B=2, S=21, seed=9, cfg=(32, 4, 1)),  # CUDA: 4-step stages, 4-step ring: 5 + 1
    dict(B=1, S=37, Hk=16, Hv=32, seed=13, cfg=G.SCAN_CONFIG["cuda"]),  # default, 3 stages
    dict(B=1, S=16, seed=10, cfg=(32, 4, 1)),  # whole CUDA stages only (4 steps each)
    dict(B=1, S=40, seed=11, cfg=(8, 1, 8)),  # CUDA: 16-step stages, two and a part
    dict(B=2, S=37, seed=12, cfg=(16, 1, 8)),
]


@pytest.mark.parametrize("backend", [_param(b) for b in KERNEL_BACKENDS])
@pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: _case_id(c))
def test_prefill_kernels(backend, case):
    case = dict(case)
    cfg = case.pop("cfg", (8, 1, 4))
    inp, dims = make_inputs(**case)
    got = run_kernels(backend, inp, dims, scan_cfg=cfg)
    _check_vs_oracle(got, oracle(**inp, **dims), inp["qkv"].dtype)
    if inp["qkv"].dtype == BF:
        _check_vs_reference(got, cpu_reference(**inp, **dims))


STAGED_CASES = [
    dict(B=1, S=37, Hk=16, Hv=32, seed=13),  # production heads: 8-step stages, 4 and a part
    dict(B=1, S=2, seed=20),                 # one partial stage
    dict(B=2, S=19, seed=21, exotic=True),   # strided views, two sequences
    dict(B=1, S=16, seed=3, cfg=(16, 1, 4), conv_state=False, state=False),  # whole stages
    dict(B=1, S=9, seed=23, cfg=(32, 4, 1)),  # E 4, one simdgroup: 2-step stages
    dict(B=1, S=12, seed=24, D=64, cfg=(8, 2, 2), dtype=mx.float16),
    dict(B=1, S=5, seed=25, dtype=mx.float32, Hk=1, Hv=3),  # G 3
]


@pytest.mark.parametrize("backend", [_param(b) for b in KERNEL_BACKENDS
                                     if b in ("metal", "metal-emu")])
@pytest.mark.parametrize("case", STAGED_CASES, ids=lambda c: _case_id(c))
def test_prefill_staged_scan(backend, case):
    """``scan="staged"`` (``lily_gdn_scan_staged``, Metal): q/k staged in threadgroup
    memory; the float64 oracle and reference checks of the kernel scan, the staged kernel
    really launched, and the result within summation order of ``lily_gdn_scan``'s."""
    case = dict(case)
    cfg = case.pop("cfg", (8, 1, 4))
    inp, dims = make_inputs(**case)
    launched = []
    get = lambda spec: launched.append(spec.name) or _kernel(spec, backend)  # noqa: E731
    with mx.stream(mx.gpu if backend == "metal" else mx.cpu):
        init = float("nan") if backend == "metal" else None
        got = G.gated_delta_fused(**inp, **dims, scan_cfg=cfg, init_value=init,
                                  get_kernel=get, scan="staged")
        mx.eval(got)
    assert "lily_gdn_scan_staged" in launched and "lily_gdn_scan" not in launched, launched
    _check_vs_oracle(got, oracle(**inp, **dims), inp["qkv"].dtype)
    if inp["qkv"].dtype == BF:
        _check_vs_reference(got, cpu_reference(**inp, **dims))
    plain = run_kernels(backend, inp, dims, scan_cfg=cfg)
    assert_close(got[2], plain[2], rtol=1e-5, scale="max", what="state vs lily_gdn_scan")


def test_staged_scan_falls_back_where_it_cannot_run():
    """No staged kernel for the backend (``get_kernel`` None: CUDA has none) or ``Dk / LPR``
    not a multiple of 4: ``lily_gdn_scan`` runs."""
    inp, dims = make_inputs(1, 3, D=64, seed=30)
    for cfg, staged_exists in (((8, 1, 4), False), ((32, 4, 1), True)):  # E 8; E 2
        launched = []

        def get(spec):
            launched.append(spec.name)
            if spec is G.SCAN_STAGED and not staged_exists:
                return None
            return lambda **kw: [mx.zeros(s, t) for s, t in zip(kw["output_shapes"],
                                                                 kw["output_dtypes"])]
        G.gated_delta_fused(**inp, **dims, scan_cfg=cfg, get_kernel=get, scan="staged")
        assert "lily_gdn_scan" in launched, (cfg, launched)
    assert launched.count("lily_gdn_scan_staged") == 0  # E 2: not even asked for


def test_prefill_scan_choice_staged(monkeypatch):
    monkeypatch.delenv(G.PREFILL_ENV, raising=False)
    monkeypatch.setenv("MLX_LILY_GDN_SCAN_LOAD", "staged")
    assert G.prefill_scan("metal") == "staged"
    assert G.prefill_scan("cuda") == "kernel"
    monkeypatch.setenv(G.PREFILL_ENV, "chunked")  # chunked refused under TF32: staged stays
    monkeypatch.setattr(G, "tf32_matmuls", lambda backend: True)
    with pytest.warns(UserWarning, match="TF32"):
        assert G.prefill_scan("metal") == "staged"
    monkeypatch.delenv(G.PREFILL_ENV)
    monkeypatch.setenv("MLX_LILY_GDN_SCAN_LOAD", "direct")
    assert G.prefill_scan("metal") == "kernel"


@pytest.mark.parametrize("backend", [_param(b) for b in KERNEL_BACKENDS])
@pytest.mark.parametrize("case", [PREFILL_CASES[i] for i in (1, 2, 3, 6, 7)]
                         + [dict(B=1, S=150, seed=8)],  # three 64-step chunks, padded
                         ids=lambda c: _case_id(c))
def test_prefill_chunked_scan(backend, case):
    """``scan="chunked"``: the prep and norm kernels around ``scan_chunked`` (MLX ops)
    instead of ``lily_gdn_scan``; the same checks against the float64 oracle and the
    reference as the kernel scan."""
    case = dict(case)
    case.pop("cfg", None)
    inp, dims = make_inputs(**case)
    got = run_kernels(backend, inp, dims, scan="chunked")
    _check_vs_oracle(got, oracle(**inp, **dims), inp["qkv"].dtype)
    if inp["qkv"].dtype == BF:
        _check_vs_reference(got, cpu_reference(**inp, **dims))


def _scan_inputs(B, S, Hk, Hv, Dk, Dv, kind="random", seed=0):
    mx.random.seed(seed)
    q = mx.random.normal((B, S, Hk, Dk))
    k = mx.random.normal((B, S, Hk, Dk))
    if kind == "same_keys":
        k = mx.broadcast_to(k[:, :1], k.shape)
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    q = q / mx.linalg.norm(q, axis=-1, keepdims=True) * Dk ** -0.5
    v = mx.random.normal((B, S, Hv, Dv))
    lo, hi = {"tiny_decay": (50.0, 120.0), "no_decay": (0.0, 0.0)}.get(kind, (0.0, 2.0))
    g = mx.exp(-mx.random.uniform(lo, hi, (B, S, Hv)))
    if kind == "zero_then_slow":  # decays exactly 0 (the prep kernel's underflow), then ~1
        t = mx.arange(S)[None, :, None]
        g = mx.where(t % 64 < 32, 0.0, 0.999) * mx.ones((B, S, Hv))
    elif kind == "strong_then_slow":
        t = mx.arange(S)[None, :, None]
        g = mx.where(t % 64 < 32, 0.1353, 0.999) * mx.ones((B, S, Hv))
    beta = mx.random.uniform(0, 1, (B, S, Hv)) if kind != "same_keys" else mx.ones((B, S, Hv))
    state = mx.random.normal((B, Hv, Dv, Dk)) * 0.1
    return q, k, v, g, beta, state


@pytest.mark.parametrize("B,S,Hk,Hv,Dk,Dv,chunk,kind", [
    (1, 37, 2, 4, 16, 8, 8, "random"),         # padded last chunk, GQA 2:1
    (2, 64, 1, 2, 32, 16, 16, "random"),       # whole chunks, batch 2
    (1, 130, 2, 2, 16, 16, 64, "random"),
    (1, 5, 1, 1, 8, 8, 4, "random"),
    (1, 300, 2, 4, 32, 32, 64, "tiny_decay"),  # decays underflowing fp32
    (1, 300, 2, 4, 32, 32, 64, "no_decay"),
    (1, 200, 1, 2, 32, 32, 64, "same_keys"),   # one key repeated, beta 1
    (1, 256, 2, 2, 64, 64, 64, "zero_then_slow"),    # decay ratios across exact zeros
    (1, 256, 2, 2, 64, 64, 64, "strong_then_slow"),
])
def test_scan_chunked_matches_sequential_scan(B, S, Hk, Hv, Dk, Dv, chunk, kind):
    """``scan_chunked`` against mlx-lm's sequential ``gated_delta_ops`` (fp32, CPU):
    outputs and final state within fp32 rounding."""
    from mlx_lm.models.gated_delta import gated_delta_ops

    args = _scan_inputs(B, S, Hk, Hv, Dk, Dv, kind, seed=S + chunk)
    with mx.stream(mx.cpu):
        yr, sr = gated_delta_ops(*args)
        yc, sc = G.scan_chunked(*args, chunk=chunk)
        mx.eval(yr, sr, yc, sc)
    assert yc.shape == yr.shape and sc.shape == sr.shape and sc.dtype == mx.float32
    assert_close(yc, yr, rtol=1e-5, scale="max", what="out")
    assert_close(sc, sr, rtol=1e-5, scale="max", what="state")


def test_scan_chunked_detects_a_wrong_gate():
    """The check above fails when one step's decay differs (the test can fail)."""
    from mlx_lm.models.gated_delta import gated_delta_ops

    q, k, v, g, beta, st = _scan_inputs(1, 40, 1, 2, 16, 16)
    with mx.stream(mx.cpu):
        yr, _ = gated_delta_ops(q, k, v, g, beta, st)
        yc, _ = G.scan_chunked(q, k, v, g.at[0, 17, 1].multiply(0.5), beta, st, chunk=16)
    assert rel_err(yc, yr) > 1e-3


def test_unit_lower_inverse():
    rng = np.random.default_rng(0)
    for C in (1, 2, 8, 64):
        a = np.tril(rng.uniform(-1, 1, (3, C, C)), -1).astype(np.float32)
        with mx.stream(mx.cpu):
            x = np.array(G.unit_lower_inverse(mx.array(a)))
        want = np.linalg.inv(np.eye(C) + a.astype(np.float64))
        assert_close(x, want, rtol=1e-4, scale=max(1.0, np.abs(want).max()))
    with pytest.raises(ValueError):
        G.scan_chunked(*_scan_inputs(1, 4, 1, 1, 8, 8), chunk=48)


def test_prefill_scan_setting(monkeypatch):
    assert G.prefill_scan("cuda") == "kernel"
    monkeypatch.setenv(G.PREFILL_ENV, "chunked")
    monkeypatch.setenv("MLX_ENABLE_TF32", "0")
    assert G.prefill_scan("cuda") == "chunked"
    assert G.prefill_scan("metal") == "chunked"
    monkeypatch.setenv("MLX_ENABLE_TF32", "1")  # TF32 matmuls: the kernel scan, a warning
    for be in ("cuda", "metal"):
        with pytest.warns(UserWarning, match="TF32"):
            assert G.prefill_scan(be) == "kernel"


@pytest.mark.parametrize("backend", [_param(b) for b in KERNEL_BACKENDS])
def test_prefill_then_decode_chain(backend):
    """Prefill kernels, then decode steps fed the kernels' own caches, vs the reference
    chained the same way."""
    inp, dims = make_inputs(1, 9, seed=11, conv_state=False, state=False)
    got = run_kernels(backend, inp, dims)
    ref = cpu_reference(**inp, **dims)
    cs, st, rcs, rst = got[1], got[2], ref[1], ref[2]
    for i in range(3):
        step, _ = make_inputs(1, 1, seed=20 + i)
        for key in ("conv_weight", "A_log", "dt_bias", "norm_weight"):
            step[key] = inp[key]
        g = run_kernels(backend, dict(step, conv_state=cs, state=st), dims)
        r = cpu_reference(**dict(step, conv_state=rcs, state=rst), **dims)
        _check_vs_reference(g, r)
        cs, st, rcs, rst = g[1], g[2], r[1], r[2]


def _packed(inp):
    """The fused projection row ``q|k|v|z|b|a`` (contiguous) the split inputs came from."""
    B, S, _ = inp["qkv"].shape
    return mx.concatenate([inp["qkv"], inp["z"].reshape(B, S, -1), inp["b"], inp["a"]],
                          axis=-1)


PACKED_CASES = [dict(B=1), dict(B=3, seed=11), dict(B=2, Hk=1, Hv=3, seed=12),
                dict(B=1, conv_state=False, state=False, seed=13),
                dict(B=1, dtype=mx.float16, KS=3, seed=14)]


@pytest.mark.parametrize("backend", [_param(b) for b in KERNEL_BACKENDS])
@pytest.mark.parametrize("case", PACKED_CASES, ids=lambda c: _case_id(c))
def test_decode_kernel_packed(backend, case):
    """PACKED=true (z, b, a read from the fused projection row) gives exactly the split
    form's results: same arithmetic, other addresses."""
    inp, dims = make_inputs(S=1, **case)
    want = run_kernels(backend, inp, dims)
    y = _packed(inp)
    stream = mx.gpu if backend in ("metal", "cuda") else mx.cpu
    with mx.stream(stream):
        init = float("nan") if backend in ("metal", "cuda") else None
        got = G.gated_delta_fused(
            y, None, None, None, **{k: v for k, v in inp.items()
                                    if k not in ("qkv", "z", "b", "a")},
            **dims, init_value=init, packed=True,
            get_kernel=lambda spec: _kernel(spec, backend))
        mx.eval(got)
    for g, w in zip(got, want):
        assert g.shape == w.shape and mx.array_equal(g, w).item()


def test_packed_dispatcher_on_cpu_and_width_check():
    """``gated_delta_packed`` on the CPU is the reference on the split views; a row of
    the wrong width is refused with the expected width named."""
    for S in (1, 3):
        inp, dims = make_inputs(2, S, seed=20 + S)
        y = _packed(inp)
        rest = {k: v for k, v in inp.items() if k not in ("qkv", "z", "b", "a")}
        with mx.stream(mx.cpu):
            got = G.gated_delta_packed(y, **rest, **dims)
            want = G.gated_delta_reference(**inp, **dims)
        for g, w in zip(got, want):
            assert mx.array_equal(g, w).item()
    with pytest.raises(ValueError, match="expected"):
        G.gated_delta_packed(y[..., :-1], **rest, **dims)


# ------------------------------------------------------------------ projection inside (PROJ)
def make_proj(inp, dims, K=256, bits=4, gs=64, seed=0, strided=False):
    """A ``DecodeProj`` for the step of ``make_inputs``: random residual, delta, norm
    weight and a quantized q|k|v|z|b|a weight (``K`` wide); ``strided``: h0 and res are
    views stepping 2 along K (the kernel's element-load prologue)."""
    rng = np.random.default_rng(100 + seed)
    T = inp["conv_weight"].dtype
    B = inp["state"].shape[0] if inp["state"] is not None else inp["qkv"].shape[0]
    Hk, D, Hv = dims["num_k_heads"], dims["head_k_dim"], dims["num_v_heads"]
    P = 2 * Hk * D + 2 * Hv * D + 2 * Hv

    def arr(shape, scale=1.0, offset=0.0):
        return mx.array((offset + scale * rng.standard_normal(shape)).astype(np.float32)).astype(T)

    wf = mx.array((rng.standard_normal((P, K)) * K ** -0.5).astype(np.float32)).astype(T)
    w, scales, biases = mx.quantize(wf, group_size=gs, bits=bits)
    if strided:
        h0, res = arr((B, 1, 2 * K))[..., ::2], arr((B, 1, 2 * K))[..., 1::2]
    else:
        h0, res = arr((B, 1, K)), arr((B, 1, K))
    return G.DecodeProj(h0, res, arr((K,), 0.1, offset=1.0), 1e-6, w, scales, biases, gs, bits)


def _rest(inp):
    return {k: v for k, v in inp.items() if k not in ("qkv", "z", "b", "a")}


def _head_rows(Hk, Hv, Dk, Dv):
    """``[Hv, 2*Dk+2*Dv+2]`` indices of the projection row each v-head reads (the
    kernel's ``lily_gdn_proj_row``, written out independently)."""
    G_ = Hv // Hk
    C = 2 * Hk * Dk + Hv * Dv
    out = []
    for h in range(Hv):
        hk = h // G_
        out.append(list(range(hk * Dk, hk * Dk + Dk))
                   + list(range(Hk * Dk + hk * Dk, Hk * Dk + hk * Dk + Dk))
                   + list(range(2 * Hk * Dk + h * Dv, 2 * Hk * Dk + h * Dv + Dv))
                   + list(range(C + h * Dv, C + h * Dv + Dv))
                   + [C + Hv * Dv + h, C + Hv * Dv + Hv + h])
    return np.array(out)


def make_out_proj(p, dims, seed=0):
    """A random ``OutProj`` (``[K, Hv*Dv]``, quantized as ``p``'s weight)."""
    rng = np.random.default_rng(200 + seed)
    K_, Hv, Dv = p.h0.shape[-1], dims["num_v_heads"], dims["head_v_dim"]
    wf = mx.array((rng.standard_normal((K_, Hv * Dv)) * (Hv * Dv) ** -0.5).astype(np.float32))
    return G.OutProj(*mx.quantize(wf.astype(p.h0.dtype), group_size=p.group_size, bits=p.bits))


def run_proj(backend, p, inp, dims, mask=None, lengths=None, split=1, out_proj=None):
    """The PROJ launch (``split`` blocks per head; with ``out_proj`` also OUTP) and the
    launches it replaces (``lily_norm_qgemv``, the packed decode kernel, ``lily_qgemv``),
    all on ``backend``; checks the rows PROJ wrote against ``lily_norm_qgemv``'s output,
    the arrival counters (zeros again), and OUTP's ``r`` against ``lily_qgemv`` of the
    same kernel's ``out``. Returns PROJ's and the two-launch ``(out, conv, state, h)``."""
    from mlx_lily.ops import norm_qgemv as NQ
    from mlx_lily.ops import qgemv as Q

    stream = mx.gpu if backend in ("metal", "cuda") else mx.cpu
    init = float("nan") if backend in ("metal", "cuda") else None
    kw = dict(**dims, init_value=init, mask=mask, lengths=lengths,
              get_kernel=lambda spec: _kernel(spec, backend))
    B, Hv = p.h0.shape[0], dims["num_v_heads"]
    if split > 1 or out_proj is not None:
        p = p._replace(counters=G.proj_counters(B * Hv + B + 3))
    with mx.stream(stream):
        res = G.gated_delta_fused(None, None, None, None, **_rest(inp), proj=p,
                                  proj_split=split, return_proj=True, out_proj=out_proj, **kw)
        got, rows = res[:4], res[-1]
        y, h = NQ.launch(_kernel(NQ.SPEC, backend), p.h0, p.res, p.norm_w, p.eps, p.w,
                         p.scales, p.biases, p.group_size, p.bits, init_value=init)
        two = G.gated_delta_fused(y, None, None, None, **_rest(inp), packed=True, **kw)
        mx.eval(got, two, h, rows)
        if out_proj is not None:
            r = res[4]
            r_two = Q.launch(_kernel(Q.SPEC, backend), got[0], out_proj.w, out_proj.scales,
                             out_proj.biases, p.group_size, p.bits, init_value=init)
            mx.eval(r, r_two)
            # other fp32 summation orders (per head slice, then heads): one bf16 ulp at most
            assert_close(r, r_two, dtype=BF, ulps=1, ulp_of="max", atol=1e-6,
                         max_diff_frac=0.1, what="out_proj")
    want_rows = f32(y)[:, 0][:, _head_rows(dims["num_k_heads"], Hv, dims["head_k_dim"],
                                           dims["head_v_dim"])]
    assert_close(rows, want_rows, dtype=BF, ulps=2, ulp_of="max", max_diff_frac=0.02,
                 what="projection rows")
    if p.counters is not None:
        assert not np.array(p.counters).any(), "arrival counters not reset"
    return tuple(got), (*two, h)


def _check_proj(got, want):
    """``got`` (PROJ) against ``want`` (the two launches it replaces, same backend): the
    residual sum exact; conv state, state and output equal but for the rare one-ulp flips
    of the normalised row (the two kernels sum its squares in other orders; on the
    emulator every case here came out bit-identical) and what follows from them. A wrong
    projection row or head fails every bound by orders of magnitude."""
    out, conv, state, h = got
    w_out, w_conv, w_state, w_h = want
    np.testing.assert_array_equal(f32(h), f32(w_h))
    for g, w, tol, what in ((conv, w_conv, 2.0 ** -6, "conv"), (out, w_out, 2e-2, "out")):
        assert_close(g, w, rtol=tol, scale="max", max_diff_frac=0.02, what=what)
    assert_close(state, w_state, rtol=1e-2, scale="max", l2=5e-3, what="state")


def _check_proj_vs_reference(got, ref):
    """PROJ against ``gated_delta_proj_reference``: the residual sum exact, the rest
    within 12% (L2): the reference's CPU ``quantized_matmul`` in bf16 sat 1-8% (L2) from
    the kernels' fp32 GEMV on these inputs (the kernels match the float64 oracle in
    ``test_op_norm_qgemv``); a wrong row, head or gate is off by ~100%."""
    np.testing.assert_array_equal(f32(got[3]), f32(ref[3]))
    for g, w in zip(got[:3], ref[:3]):
        assert_close(g, w, l2=0.12, elementwise=False)


PROJ_CASES = [
    dict(B=1, K=256),                                   # 8 lanes per weight row
    dict(B=2, K=256, Hk=1, Hv=3, split=4, seed=5),       # 4 blocks per head (CUDA only)
    dict(B=1, K=2048, split=3, seed=6),                  # 3 blocks, uneven passes
    dict(B=2, K=256, Hk=1, Hv=2, split=2, out=True, seed=7),   # + out_proj (CUDA only)
    dict(B=1, K=512, Hk=2, Hv=4, D=64, out=True, seed=8),      # + out_proj, 2 words/row
    dict(B=1, K=2048, Hk=1, Hv=2, seed=1),              # the model's width: 32 lanes
    dict(B=2, K=512, Hk=1, Hv=3, seed=2, batched=True),  # mask + lengths, G = 3
    dict(B=1, K=128, bits=8, gs=32, dtype=mx.float16, KS=3, seed=3),
    dict(B=1, K=256, strided=True, seed=4, conv_state=False, state=False),
]


@pytest.mark.parametrize("backend", [_param(b) for b in KERNEL_BACKENDS])
@pytest.mark.parametrize("case", PROJ_CASES, ids=lambda c: _case_id(c))
def test_decode_kernel_proj(backend, case):
    """PROJ (the input add + RMSNorm + q|k|v|z|b|a GEMV inside the decode kernel) against
    the two launches it replaces on the same backend, and against the reference."""
    case = dict(case)
    K_, bits, gs = case.pop("K"), case.pop("bits", 4), case.pop("gs", 64)
    strided, batched = case.pop("strided", False), case.pop("batched", False)
    split, with_out = case.pop("split", 1), case.pop("out", False)
    if (split > 1 or with_out) and backend not in ("cuda", "cuda-emu"):
        pytest.skip("SPLIT > 1 and OUTP are the CUDA twin's")
    inp, dims = make_inputs(S=1, fused_views=False, **case)
    p = make_proj(inp, dims, K=K_, bits=bits, gs=gs, seed=case.get("seed", 0),
                  strided=strided)
    B = p.h0.shape[0]
    mask = mx.array([True, False] * (B // 2) + [True] * (B % 2)) [:, None] if batched else None
    lengths = mx.array([1, 0] * (B // 2) + [1] * (B % 2), mx.int32) if batched else None
    assert G.proj_unsupported(p, **_rest(inp), **dims, mask=mask, lengths=lengths) is None
    out_proj = make_out_proj(p, dims, seed=case.get("seed", 0)) if with_out else None
    got, two = run_proj(backend, p, inp, dims, mask=mask, lengths=lengths, split=split,
                        out_proj=out_proj)
    _check_proj(got, two)
    if p.h0.dtype == BF and not batched:
        _check_proj_vs_reference(got, cpu_reference_proj(p, inp, dims))


PACKED_OUT_CASES = [
    dict(B=3, K=256, Hk=1, Hv=2, seed=21),                      # 3 rows, 4-bit, groups of 64
    dict(B=2, K=512, Hk=2, Hv=4, D=64, seed=22, batched=True),  # mask + lengths, 2 words
    dict(B=1, K=2048, Hk=1, Hv=2, seed=23),                     # the model's width, one row
    dict(B=2, K=256, Hk=1, Hv=2, seed=25, bits=8, gs=128),      # 8-bit, groups of 128
]


@pytest.mark.parametrize("backend", [_param(b) for b in KERNEL_BACKENDS
                                     if b in ("cuda", "cuda-emu")])
@pytest.mark.parametrize("case", PACKED_OUT_CASES, ids=lambda c: _case_id(c))
def test_decode_kernel_packed_out_proj(backend, case):
    """OUTP on a packed row (no PROJ: the row an input, ``out_counters``): ``out`` / conv /
    state bit-identical to the packed launch without it, ``r`` within one bf16 ulp of
    ``lily_qgemv`` on that ``out`` (other fp32 orders), the counters zeros again, and each
    row of the batch bit-identical to that row launched alone (outputs NaN-poisoned on a
    GPU)."""
    from mlx_lily.ops import qgemv as Q

    case = dict(case)
    K_, batched = case.pop("K"), case.pop("batched", False)
    bits, gs = case.pop("bits", 4), case.pop("gs", 64)
    inp, dims = make_inputs(S=1, fused_views=False, **case)
    p = make_proj(inp, dims, K=K_, bits=bits, gs=gs, seed=case["seed"])
    o = make_out_proj(p, dims, seed=case["seed"])._replace(group_size=gs, bits=bits)
    B = p.h0.shape[0]
    y = mx.random.normal((B, 1, p.w.shape[0])).astype(BF)
    mask = mx.array([True, False] * (B // 2) + [True] * (B % 2))[:, None] if batched else None
    lengths = mx.array([1, 0] * (B // 2) + [1] * (B % 2), mx.int32) if batched else None
    stream = mx.gpu if backend == "cuda" else mx.cpu
    init = float("nan") if backend == "cuda" else None
    kw = dict(**dims, init_value=init, mask=mask, lengths=lengths,
              get_kernel=lambda spec: _kernel(spec, backend))
    ctr = G.proj_counters(B + 2)
    assert G.packed_out_unsupported(y, o, ctr, **dims) is None
    with mx.stream(stream):
        got = G.gated_delta_fused(y, None, None, None, **_rest(inp), packed=True,
                                  out_proj=o, out_counters=ctr, **kw)
        plain = G.gated_delta_fused(y, None, None, None, **_rest(inp), packed=True, **kw)
        r_gemv = Q.launch(_kernel(Q.SPEC, backend), got[0], o.w, o.scales, o.biases, gs,
                          bits, init_value=init)
        mx.eval(got, plain, r_gemv)
    for g, w in zip(got[:3], plain):
        assert mx.array_equal(g, w).item()
    assert_close(got[3], r_gemv, dtype=BF, ulps=1, ulp_of="max", atol=1e-6,
                 max_diff_frac=0.1, what="out_proj")
    assert not np.array(ctr).any(), "arrival counters not reset"
    if batched:
        return  # a masked row's results are padding
    for i in range(B):
        one = {k: (v[i:i + 1] if k in ("conv_state", "state") and v is not None else v)
               for k, v in _rest(inp).items()}
        with mx.stream(stream):
            alone = G.gated_delta_fused(y[i:i + 1], None, None, None, **one, packed=True,
                                        out_proj=o, out_counters=G.proj_counters(1), **kw)
            mx.eval(alone)
        for g, a in zip(got, alone):
            assert mx.array_equal(g[i:i + 1], a).item(), i


def test_packed_out_proj_reasons_and_routing(monkeypatch):
    """``packed_out_unsupported`` names what it refuses; ``gated_delta_packed`` with an
    ``out_proj`` takes the decode kernel's OUTP only under ``MLX_LILY_GDN_PACKED_OUTP=1``
    on CUDA (emulated), else the packed launch alone with None for ``r`` (the caller
    projects), with equal out, conv and state either way."""
    from mlx_lily.testing.dispatch import count_kernel_launches, emulated_cuda

    inp, dims = make_inputs(B=2, S=1, Hk=1, Hv=2, fused_views=False, seed=24)
    p = make_proj(inp, dims, K=256, seed=24)
    o = make_out_proj(p, dims, seed=24)._replace(group_size=64, bits=4)
    y = mx.random.normal((2, 1, p.w.shape[0])).astype(BF)
    ctr = G.proj_counters(4)
    assert G.packed_out_unsupported(y, o, ctr[:1], **dims) == "counters"
    assert G.packed_out_unsupported(y, o._replace(bits=None), ctr, **dims) == \
        "out_proj quantization"
    assert G.packed_out_unsupported(y, o._replace(w=o.w[:, :-1]), ctr, **dims) == \
        "out_proj weight"
    rest = _rest(inp)
    with emulated_cuda(), pytest.MonkeyPatch.context() as mp:
        calls = count_kernel_launches(mp)
        a = G.gated_delta_packed(y, *rest.values(), o, ctr, **dims)
        assert calls == ["lily_gdn_decode"] and a[3] is None, calls
        mp.setenv("MLX_LILY_GDN_PACKED_OUTP", "1")
        del calls[:]
        b = G.gated_delta_packed(y, *rest.values(), o, ctr, **dims)
        assert calls == ["lily_gdn_decode"], calls
        assert G.packed_out_unsupported(
            y, o._replace(scales=o.scales.astype(mx.float32),
                          biases=o.biases.astype(mx.float32)), ctr, **dims) == "out_proj dtype"
    for g, w in zip(a[:3], b[:3]):
        assert mx.array_equal(g, w).item()
    assert b[3] is not None and b[3].shape == (2, 1, p.h0.shape[-1])


FOLD_CASES = [
    dict(B=3, K=256, Hk=1, Hv=2, split=2, out=True, fold=2, seed=9),    # a partial group
    dict(B=4, K=512, Hk=2, Hv=4, D=64, out=True, fold=4, seed=10),      # one group, 2 words
    dict(B=3, K=256, Hk=1, Hv=3, fold=3, seed=11, batched=True),        # mask + lengths
    dict(B=2, K=2048, Hk=1, Hv=2, split=3, fold=2, seed=12),            # the model's width
]


@pytest.mark.parametrize("backend", [_param(b) for b in KERNEL_BACKENDS
                                     if b in ("cuda", "cuda-emu")])
@pytest.mark.parametrize("case", FOLD_CASES, ids=lambda c: _case_id(c))
def test_decode_kernel_proj_batch_fold_bit_identical(backend, case):
    """``batch_fold`` (BN rows per block, each weight tile read once for them) gives
    every output bit-identical to ``batch_fold=1``, and each row equals that row launched
    alone: the folded rows get the unfolded arithmetic. NaN-filled outputs on a GPU."""
    case = dict(case)
    K_, fold = case.pop("K"), case.pop("fold")
    split, with_out = case.pop("split", 1), case.pop("out", False)
    batched = case.pop("batched", False)
    inp, dims = make_inputs(S=1, fused_views=False, **case)
    p = make_proj(inp, dims, K=K_, seed=case.get("seed", 0))
    B, Hv = p.h0.shape[0], dims["num_v_heads"]
    mask = mx.array([True, False] * (B // 2) + [True] * (B % 2))[:, None] if batched else None
    lengths = mx.array([1, 0] * (B // 2) + [1] * (B % 2), mx.int32) if batched else None
    out_proj = make_out_proj(p, dims, seed=case.get("seed", 0)) if with_out else None
    stream = mx.gpu if backend == "cuda" else mx.cpu
    init = float("nan") if backend == "cuda" else None
    kw = dict(**dims, init_value=init, get_kernel=lambda spec: _kernel(spec, backend))

    def launch(pp, rest, m, ln, bf):
        pp = pp._replace(counters=G.proj_counters(G.counters_needed(pp.h0.shape[0], Hv) + 3))
        with mx.stream(stream):
            res = G.gated_delta_fused(None, None, None, None, **rest, proj=pp,
                                      proj_split=split, return_proj=True, out_proj=out_proj,
                                      batch_fold=bf, mask=m, lengths=ln, **kw)
            mx.eval(res, pp.counters)
        assert not np.array(pp.counters).any(), "arrival counters not reset"
        return [np.array(r.astype(mx.float32)) for r in res]

    rest = _rest(inp)
    one = launch(p, rest, mask, lengths, 1)
    folded = launch(p, rest, mask, lengths, fold)
    names = ["out", "conv", "state", "h"] + (["r"] if with_out else []) + ["rows"]
    for n, a, b in zip(names, one, folded):
        assert np.isfinite(a).all() and np.isfinite(b).all(), n
        np.testing.assert_array_equal(a, b, err_msg=n)
    for i in range(B):  # each row alone (one block per head)
        pi = p._replace(h0=p.h0[i:i + 1], res=p.res[i:i + 1])
        ri = {k: (v[i:i + 1] if k in ("conv_state", "state") and v is not None else v)
              for k, v in rest.items()}
        alone = launch(pi, ri, None if mask is None else mask[i:i + 1],
                       None if lengths is None else lengths[i:i + 1], 1)
        for n, a, b in zip(names, alone, folded):
            np.testing.assert_array_equal(a[0], b[i], err_msg=f"{n}, row {i}")


def test_batch_fold_setting(monkeypatch):
    """``batch_fold``: 1 for one row, off CUDA and by default; ``MLX_LILY_GDN_BATCH_FOLD``
    on CUDA for any batch of 2 or more (not capped at B: one build per setting), lowered
    only to fit the block's shared memory, which ``fold_shared_bytes`` counts as the
    kernel declares it; a fold without ``proj`` raises in the launcher."""
    prod = (2048, 128, 128, 2, True)  # K, Dk, Dv, bf16, with out_proj
    monkeypatch.delenv("MLX_LILY_GDN_BATCH_FOLD", raising=False)
    assert G.batch_fold("metal", 8, *prod) == 1
    assert G.batch_fold("cuda", 8, *prod) == G.BATCH_FOLD["cuda"] == 1
    monkeypatch.setenv("MLX_LILY_GDN_BATCH_FOLD", "8")
    assert G.batch_fold("cuda", 8, *prod) == 8
    assert G.batch_fold("cuda", 3, *prod) == 8
    assert G.batch_fold("cuda", 1, *prod) == 1
    assert G.batch_fold("metal", 8, *prod) == 1
    # 8 rows at the model's widths: 8 x 4096 + 8 x 256 + the fixed arrays
    assert G.fold_shared_bytes(8, 2048, 128, 128, 16, 2, True) == \
        8 * 4096 + 8 * 256 + 4 * 384 + 4 * 514 + 4 * 16 + 4
    assert G.batch_fold("cuda", 8, 8192, 128, 128, 2, True) == 2  # 16.6 KB a row
    assert G.batch_fold("cuda", 8, 5376, 224, 224, 2, True) == 3
    assert G.fold_shared_bytes(3, 5376, 224, 224, 16, 2, True) <= G.CUDA_STATIC_SHARED
    monkeypatch.setenv("MLX_LILY_GDN_BATCH_FOLD", "9")  # one warning, then the table's
    config.WARNED.discard(("MLX_LILY_GDN_BATCH_FOLD", "9"))
    with pytest.warns(UserWarning, match="MLX_LILY_GDN_BATCH_FOLD"):
        assert G.batch_fold("cuda", 8, *prod) == 1
    inp, dims = make_inputs(S=1, fused_views=False, B=2, Hk=1, Hv=2)
    with pytest.raises(ValueError, match="batch_fold"):
        G.gated_delta_fused(**inp, **dims, get_kernel=lambda spec: None,
                            batch_fold=2)


def cpu_reference_proj(p, inp, dims):
    """``gated_delta_proj_reference`` evaluated on the CPU stream (see ``cpu_reference``)."""
    def host(v):
        a = np.array(v.astype(mx.float32) if v.dtype == mx.bfloat16 else v)
        return mx.array(a, dtype=v.dtype)

    mx.synchronize()
    hp = G.DecodeProj(*(host(v) if isinstance(v, mx.array) else v for v in p))
    rest = {k: host(v) if isinstance(v, mx.array) else v for k, v in _rest(inp).items()}
    with mx.stream(mx.cpu):
        out = G.gated_delta_proj_reference(hp, **rest, **dims)
        mx.eval(out)
    return out


def test_proj_dispatcher_on_cpu_and_reasons(monkeypatch):
    """On the CPU ``gated_delta_proj`` is the reference exactly; ``proj_unsupported``
    names what the PROJ launch does not take; ``proj_enabled`` follows the switches of
    the op and of the two launches it replaces."""
    inp, dims = make_inputs(2, 1, fused_views=False, seed=30)
    p = make_proj(inp, dims, K=256, seed=30)
    with mx.stream(mx.cpu):
        got = G.gated_delta_proj(p, **_rest(inp), **dims)
        want = G.gated_delta_proj_reference(p, **_rest(inp), **dims)
    for x, y in zip(got, want):
        assert x.shape == y.shape and mx.array_equal(x, y).item()
    assert G.proj_unsupported(p, **_rest(inp), **dims) is None
    assert G.proj_unsupported(p._replace(w=p.w[:-1], scales=p.scales[:-1],
                                         biases=p.biases[:-1]), **_rest(inp), **dims) == "projection rows"
    two = p._replace(h0=mx.concatenate([p.h0, p.h0], 1), res=mx.concatenate([p.res, p.res], 1))
    assert G.proj_unsupported(two, **_rest(inp), **dims) == "steps"
    assert G.proj_unsupported(p._replace(bits=3), **_rest(inp), **dims) == "projection"
    assert G.proj_unsupported(p._replace(h0=p.h0.astype(mx.float16), res=p.res.astype(mx.float16)),
                              **_rest(inp), **dims) == "projection dtype"
    assert G.proj_unsupported(p, **dict(_rest(inp), state=inp["state"].astype(BF)),
                              **dims) == "state"
    assert not G.proj_enabled("cpu")
    monkeypatch.setenv("MLX_LILY_KERNELS", "all")
    assert G.proj_enabled("metal")
    monkeypatch.setenv("MLX_LILY_DISABLE", G.PROJ_OP)
    assert not G.proj_enabled("metal")
    monkeypatch.setenv("MLX_LILY_DISABLE", "gdn_packed")
    assert not G.proj_enabled("metal")
    monkeypatch.delenv("MLX_LILY_DISABLE")
    monkeypatch.setenv("MLX_LILY_NORM_GEMV", "split")
    assert not G.proj_enabled("metal")
    monkeypatch.delenv("MLX_LILY_NORM_GEMV")
    monkeypatch.setenv("MLX_LILY_KERNELS", "verified")
    assert G.proj_enabled("cuda") == (G.PROJ_OP in K.VERIFIED["cuda"])


def test_out_proj_reference_and_reasons():
    """``gated_delta_proj`` with ``out_proj`` on the CPU is the reference (which is the
    PROJ reference plus ``qgemv_reference`` of its output) exactly;
    ``out_proj_unsupported`` names what OUTP does not take."""
    from mlx_lily.ops.qgemv import qgemv_reference

    inp, dims = make_inputs(2, 1, fused_views=False, seed=32)
    p = make_proj(inp, dims, K=256, seed=32)
    o = make_out_proj(p, dims, seed=32)
    with mx.stream(mx.cpu):
        got = G.gated_delta_proj(p, **_rest(inp), out_proj=o, **dims)
        want = G.gated_delta_proj_reference(p, **_rest(inp), out_proj=o, **dims)
        base = G.gated_delta_proj_reference(p, **_rest(inp), **dims)
        r = qgemv_reference(base[0], o.w, o.scales, o.biases, p.group_size, p.bits)
    assert len(got) == len(want) == 5
    for x, y in zip(got, want):
        assert x.shape == y.shape and mx.array_equal(x, y).item()
    assert mx.array_equal(want[4], r).item()
    Hv = dims["num_v_heads"]
    pc = p._replace(counters=G.proj_counters(2 * Hv + 2))
    assert G.out_proj_unsupported(pc, o, **dims) is None
    assert G.out_proj_unsupported(p, o, **dims) == "counters"
    assert G.out_proj_unsupported(pc._replace(counters=G.proj_counters(2 * Hv)), o,
                                  **dims) == "counters"
    assert G.out_proj_unsupported(pc, o._replace(w=o.w[:-1]), **dims) == "out_proj weight"
    assert G.out_proj_unsupported(pc, o._replace(scales=o.scales.astype(mx.float16)),
                                  **dims) == "out_proj scales"
    assert not G.out_enabled("metal") and not G.out_enabled("cpu")


def test_proj_split_setting(monkeypatch):
    monkeypatch.delenv(G.PROJ_SPLIT_ENV, raising=False)
    assert G.proj_split("cuda") == G.PROJ_SPLIT["cuda"]
    monkeypatch.setenv(G.PROJ_SPLIT_ENV, "2")
    assert G.proj_split("cuda") == 2 and G.proj_split("metal") == 1
    for bad in ("0", "x", "17"):  # one warning, then the table's value
        monkeypatch.setenv(G.PROJ_SPLIT_ENV, bad)
        config.WARNED.discard((G.PROJ_SPLIT_ENV, bad))
        with pytest.warns(UserWarning, match=G.PROJ_SPLIT_ENV):
            assert G.proj_split("cuda") == G.PROJ_SPLIT["cuda"]


def test_proj_dispatcher_routes(monkeypatch):
    """On a kernel backend with the switches on, a call ``proj_unsupported`` accepts is one
    PROJ launch; another falls back to the two launches' dispatchers."""
    calls = []
    monkeypatch.setenv("MLX_LILY_KERNELS", "all")
    monkeypatch.delenv(G.PROJ_SPLIT_ENV, raising=False)
    monkeypatch.setattr(G, "current_backend", lambda: "cuda")
    monkeypatch.setattr(G._k, "get", lambda spec, backend: object())
    monkeypatch.setattr(G, "gated_delta_fused",
                        lambda *a, **k: calls.append(k["proj_split"] if k.get("proj") else "other")
                        or (1, 2, 3, 4))
    inp, dims = make_inputs(1, 1, fused_views=False, seed=31)
    p = make_proj(inp, dims, K=256, seed=31)
    assert G.gated_delta_proj(p, **_rest(inp), **dims) == (1, 2, 3, 4)  # no counters: 1
    Hv = dims["num_v_heads"]
    G.gated_delta_proj(p._replace(counters=G.proj_counters(Hv - 1)), **_rest(inp), **dims)
    G.gated_delta_proj(p._replace(counters=G.proj_counters(Hv)), **_rest(inp), **dims)
    assert calls == [1, 1, G.PROJ_SPLIT["cuda"]]
    calls.clear()
    monkeypatch.setattr(G, "gated_delta_packed", lambda *a, **k: calls.append("packed") or (5, 6, 7))
    with mx.stream(mx.cpu):
        r = G.gated_delta_proj(p, **_rest(inp), **dims, mask=mx.ones((1, 1)))  # not bool
    assert r[:3] == (5, 6, 7) and calls == ["packed"]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [b for b in KERNEL_BACKENDS if b in ("metal", "cuda")])
def test_production_dims_proj_gpu(backend):
    """PROJ at Qwen3.6-35B-A3B dims (Hk=16, Hv=32, Dk=Dv=128, hidden 2048, 4-bit group
    64) against the two launches and the reference."""
    inp, dims = make_inputs(1, 1, Hk=16, Hv=32, fused_views=False, seed=40)
    p = make_proj(inp, dims, K=2048, seed=40)
    ref = cpu_reference_proj(p, inp, dims)
    for split in sorted({1, G.PROJ_SPLIT.get(backend, 1)}):
        got, two = run_proj(backend, p, inp, dims, split=split)
        _check_proj(got, two)
        _check_proj_vs_reference(got, ref)
    if backend == "cuda":  # OUTP with the model's out_proj shape [2048, 4096]
        got, two = run_proj(backend, p, inp, dims, split=G.PROJ_SPLIT["cuda"],
                            out_proj=make_out_proj(p, dims, seed=40))
        _check_proj(got, two)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [b for b in KERNEL_BACKENDS if b in ("metal", "cuda")])
@pytest.mark.parametrize("S,scan", [(1, "kernel"), (64, "kernel"), (200, "chunked")])
def test_production_dims_gpu(backend, S, scan):
    """Qwen3.6-35B-A3B dims (Hk=16, Hv=32, Dk=Dv=128), kernels vs the float64 oracle and
    vs the reference (``scan="chunked"``: the prep and norm kernels around
    ``scan_chunked``, with MLX's own GPU matmuls)."""
    if scan == "chunked" and G.tf32_matmuls(backend):
        pytest.skip("MLX runs fp32 matmuls in TF32 in this process (MLX_ENABLE_TF32)")
    inp, dims = make_inputs(1, S, Hk=16, Hv=32, seed=S)
    with mx.stream(mx.gpu):
        got = run_kernels(backend, inp, dims, scan_cfg=G.scan_config(backend), scan=scan)
    _check_vs_oracle(got, oracle(**inp, **dims), BF)
    _check_vs_reference(got, cpu_reference(**inp, **dims))
    if S == 1:  # the packed decode form at production dims: the same bits
        rest = {k: v for k, v in inp.items() if k not in ("qkv", "z", "b", "a")}
        with mx.stream(mx.gpu):
            packed = G.gated_delta_fused(_packed(inp), None, None, None, **rest, **dims,
                                         init_value=float("nan"), packed=True,
                                         get_kernel=lambda spec: _kernel(spec, backend))
            mx.eval(packed)
        assert all(mx.array_equal(p, g).item() for p, g in zip(packed, got))


def _masked_inputs(B, S, left_pad, lengths, seed, **kw):
    inp, dims = make_inputs(B, S, seed=seed, **kw)
    pos = np.arange(S)
    m = pos[None, :] >= np.array(left_pad)[:, None]
    if lengths is not None:
        m &= pos[None, :] < np.array(lengths)[:, None]
        inp["lengths"] = mx.array(np.array(lengths, np.int32))
    inp["mask"] = mx.array(m)
    return inp, dims


def _check_masked_vs_reference(got, ref, mask):
    """Masked rows' outputs are padding (mlx-lm's own backends disagree there): compare
    the output on live rows, the state and the conv state everywhere."""
    live = np.array(mask)
    _check_vs_reference((mx.array(f32(got[0]) * live[..., None]), got[1], got[2]),
                        (mx.array(f32(ref[0]) * live[..., None]), ref[1], ref[2]))


MASK_CASES = [
    dict(B=3, S=1, left_pad=[0, 1, 0], lengths=None, seed=30),            # batched decode
    dict(B=4, S=1, left_pad=[0, 1, 0, 0], lengths=[1, 1, 0, 5], seed=31),
    dict(B=3, S=7, left_pad=[0, 2, 7], lengths=None, seed=32),            # left-padded prefill
    dict(B=3, S=9, left_pad=[0, 0, 3], lengths=[9, 4, 2], seed=33, cfg=(16, 2, 4)),
    dict(B=2, S=20, left_pad=[0, 17], lengths=[20, 19], seed=34, exotic=True, Hv=2, Hk=1),
]


@pytest.mark.parametrize("backend", [_param(b) for b in KERNEL_BACKENDS])
@pytest.mark.parametrize("case", MASK_CASES, ids=lambda c: _case_id(c))
def test_masked_batches(backend, case):
    """mlx-lm's batched ArraysCache: left-padding masks and right-padding lengths."""
    case = dict(case)
    cfg = case.pop("cfg", (8, 1, 4))
    inp, dims = _masked_inputs(**case)
    got = run_kernels(backend, inp, dims, scan_cfg=cfg)
    _check_vs_oracle(got, oracle(**inp, **dims), inp["qkv"].dtype)
    _check_masked_vs_reference(got, cpu_reference(**inp, **dims), inp["mask"])


@pytest.mark.parametrize("backend", [_param(b) for b in KERNEL_BACKENDS])
@pytest.mark.parametrize("case", MASK_CASES[2:], ids=lambda c: _case_id(c))
def test_masked_batches_chunked_scan(backend, case):
    """Left-padding masks and lengths with ``scan="chunked"`` (masked steps reach the
    chunked scan as decay 1, beta 0)."""
    case = dict(case)
    case.pop("cfg", None)
    inp, dims = _masked_inputs(**case)
    got = run_kernels(backend, inp, dims, scan="chunked")
    _check_vs_oracle(got, oracle(**inp, **dims), inp["qkv"].dtype)
    _check_masked_vs_reference(got, cpu_reference(**inp, **dims), inp["mask"])


@pytest.mark.gpu
@pytest.mark.parametrize("S", [1, 16])
def test_dispatcher_on_device_gpu(S):
    """On a GPU backend the dispatcher serves production-dim calls with the kernels."""
    from mlx_lily.backend import current_backend

    backend = current_backend()
    if backend not in ("metal", "cuda"):
        pytest.skip("no GPU backend")
    assert G.has_kernel(backend)
    inp, dims = make_inputs(2, S, Hk=16, Hv=32, seed=40 + S)
    got = G.gated_delta(**inp, **dims)
    mx.eval(got)
    _check_vs_reference(got, cpu_reference(**inp, **dims))
    _check_vs_oracle(got, oracle(**inp, **dims), BF)


# ------------------------------------------------------------------ routing
def test_kernel_unsupported_reasons():
    inp, dims = make_inputs(1, 4)
    assert G.kernel_unsupported(**inp, **dims) is None
    assert G.kernel_unsupported(**inp, **dims, mask=mx.ones((1, 4), dtype=mx.bool_)) is None
    assert G.kernel_unsupported(**inp, **dims, lengths=mx.array([4])) is None
    assert G.kernel_unsupported(**inp, **dims, mask=mx.ones((1, 4))) == "mask"
    assert G.kernel_unsupported(**inp, **dims, mask=mx.ones((1, 3), dtype=mx.bool_)) == "mask"
    assert G.kernel_unsupported(**inp, **dims, lengths=mx.array([4], mx.int64)) == "lengths"
    bad = dict(inp, state=inp["state"].astype(BF))
    assert G.kernel_unsupported(**bad, **dims) == "state"
    bad = dict(inp, z=inp["z"].astype(mx.float32))
    assert G.kernel_unsupported(**bad, **dims) == "mixed dtypes"
    assert G.kernel_unsupported(**inp, **dict(dims, head_v_dim=64)) is not None
    assert G.kernel_unsupported(**inp, **dims, scan_cfg=(8, 4, 16)) == "scan config"
    one, dims1 = make_inputs(1, 1)
    assert G.kernel_unsupported(**one, **dims1, scan_cfg=(8, 4, 16)) is None  # decode ignores it
    odd, odd_dims = make_inputs(1, 1, D=48)
    assert G.kernel_unsupported(**odd, **odd_dims) == "head dims"
    # the per-layer parameter check is cached on the parameter objects: other objects
    # (even with the same shapes) are checked afresh
    assert G.kernel_unsupported(**inp, **dims) is None
    assert G.kernel_unsupported(**dict(inp, norm_weight=inp["norm_weight"].astype(mx.float32)),
                                **dims) == "mixed dtypes"
    assert G.kernel_unsupported(**dict(inp, conv_weight=inp["conv_weight"][:, :1]),
                                **dims) == "conv kernel size"
    assert G.kernel_unsupported(**dict(inp, A_log=inp["A_log"][:2]), **dims) == "parameter shapes"
    assert G.kernel_unsupported(**dict(inp, conv_state=inp["conv_state"][:, :2]),
                                **dims) == "conv state"
    assert G.kernel_unsupported(**inp, **dims) is None


def test_dispatcher_on_cpu_is_reference():
    inp, dims = make_inputs(1, 3)
    assert not G.has_kernel("cpu")
    with mx.stream(mx.cpu):
        got = G.gated_delta(**inp, **dims)
        want = G.gated_delta_reference(**inp, **dims)
    for x, y in zip(got, want):
        np.testing.assert_array_equal(f32(x), f32(y))


def test_dispatcher_routes_kernel_calls(monkeypatch):
    """On a kernel backend the dispatcher sends qualifying calls (masked ones included) to
    the fused path and the others to the reference."""
    calls = []
    monkeypatch.setattr(G, "current_backend", lambda: "metal")
    monkeypatch.setattr(G._k, "get", lambda spec, backend: object())
    monkeypatch.setattr(G, "gated_delta_fused", lambda *a, **k: calls.append("kernel") or "K")
    monkeypatch.setattr(G, "gated_delta_reference", lambda *a, **k: calls.append("ref") or "R")
    inp, dims = make_inputs(1, 4)
    assert G.gated_delta(**inp, **dims) == "K"
    assert G.gated_delta(**inp, **dims, mask=mx.ones((1, 4), dtype=mx.bool_)) == "K"
    assert G.gated_delta(**inp, **dims, mask=mx.ones((1, 4))) == "R"
    assert G.gated_delta(**inp, **dims, lengths=mx.array([4], mx.int64)) == "R"
    assert G.gated_delta(**dict(inp, state=inp["state"].astype(BF)), **dims) == "R"
    assert calls == ["kernel", "kernel", "ref", "ref", "ref"]


def test_dispatcher_passes_the_prefill_scan_choice(monkeypatch):
    """``MLX_LILY_GDN_PREFILL=chunked`` reaches the fused path for prefill calls only."""
    seen = []
    monkeypatch.setenv("MLX_ENABLE_TF32", "0")
    monkeypatch.setattr(G, "current_backend", lambda: "metal")
    monkeypatch.setattr(G._k, "get", lambda spec, backend: object())
    monkeypatch.setattr(G, "gated_delta_fused", lambda *a, **k: seen.append(k["scan"]))
    monkeypatch.setenv(G.PREFILL_ENV, "chunked")
    for S in (4, 1):
        inp, dims = make_inputs(1, S)
        G.gated_delta(**inp, **dims)
    monkeypatch.delenv(G.PREFILL_ENV)
    G.gated_delta(**make_inputs(1, 4)[0], **make_inputs(1, 4)[1])
    assert seen == ["chunked", "kernel", "kernel"]


def test_scan_config_env(monkeypatch):
    monkeypatch.setenv(G.SCAN_ENV, "16,2,4")
    assert G.scan_config("cuda") == (16, 2, 4)
    monkeypatch.delenv(G.SCAN_ENV)
    assert G.scan_config("cuda") == G.SCAN_CONFIG["cuda"]


# ------------------------------------------------------------------ CUDA compile checks
def _cuda_check():
    from mlx_lily.testing import cuda_check

    if cuda_check.nvcc_path() is None:
        pytest.skip("nvcc not installed")
    return cuda_check


@pytest.mark.slow
def test_cuda_decode_fold_registers():
    """The production PROJ + OUTP decode kernel fits the 128 registers per thread a block
    of 512 threads may have (else its launch fails), at every fold, and so does OUTP on a
    packed row (ptxas of nvcc; MLX's NVRTC may allocate differently)."""
    cc = _cuda_check()
    head, body = K.cuda_parts("gdn_decode")
    T, f = BF, mx.float32
    ins = [("qkv", T, 1), ("z", T, 1), ("b", T, 1), ("a", T, 1), ("conv_w", T, 3),
           ("conv_state", T, 3), ("A_log", f, 1), ("dt_bias", T, 1), ("state", f, 4),
           ("norm_w", T, 1), ("eps", f, 1), ("mask", mx.bool_, 2), ("lengths", mx.int32, 1),
           ("hin", T, 3), ("res", T, 3), ("in_nw", T, 1), ("in_eps", f, 1),
           ("w", mx.uint32, 2), ("scales", T, 2), ("biases", T, 2), ("counters", mx.int32, 1),
           ("ow", mx.uint32, 2), ("oscales", T, 2), ("obiases", T, 2)]
    outs = list(zip(["out", "conv_out", "state_out", "h_out", "proj", "r_out", "r_parts"],
                    [T, T, f, T, f, T, f]))
    for bn in range(1, G.MAX_BATCH_FOLD + 1):
        tmpl = dict(T=T, Hk=16, Hv=32, Dk=128, Dv=128, KS=4, NW=16, HAS_MASK=False,
                    HAS_LEN=False, PACKED=True, PROJ=True, S=T, K=2048, BITS=4, GS=64,
                    RPW=G.PROJ_RPW, SPLIT=G.PROJ_SPLIT["cuda"], OUTP=True, ORPW=G.OUT_RPW,
                    BN=bn)
        r = cc.resources("lily_gdn_decode", ins, outs, body, head, template=list(tmpl.items()))
        assert r["registers"] <= 128 and r["spill_stores"] == 0, (bn, r)
    # OUTP on a packed row (no PROJ; MLX_LILY_GDN_PACKED_OUTP), the model's shapes
    tmpl.update(PROJ=False, SPLIT=1, BN=1, RPW=1)
    r = cc.resources("lily_gdn_decode", ins, outs, body, head, template=list(tmpl.items()))
    assert r["registers"] <= 128 and r["spill_stores"] == 0, ("packed OUTP", r)


def cached_nvcc_check(name, inputs, outputs, source, header, template):
    """``cuda_check.check`` with an on-disk record of rendered sources that compiled
    (nvcc takes ~10 s per kernel here; unchanged kernels are not recompiled)."""
    import hashlib
    import os
    from pathlib import Path

    cc = _cuda_check()
    text = cc.render(name, inputs, outputs, source, header, template)
    stub = "".join(p.read_text() for p in sorted(cc._STUB.rglob("*")) if p.is_file())
    key = hashlib.sha256((text + stub + str(cc.nvcc_path())).encode()).hexdigest()[:24]
    d = Path(os.environ.get("MLX_LILY_CUDA_CHECK_CACHE",
                            Path.home() / ".cache" / "mlx-lily" / "cuda-check"))
    marker = d / key
    if marker.exists():
        return
    cc.check(name, inputs, outputs, source, header, template)
    d.mkdir(parents=True, exist_ok=True)
    marker.write_text(name)


def _cuda_cases():
    f = mx.float32
    cases = []
    for T in (BF, mx.float16, mx.float32):
        sig = {
            G.DECODE: (dict(qkv=(T, 3), z=(T, 4), b=(T, 3), a=(T, 3), conv_w=(T, 3),
                            conv_state=(T, 3), A_log=(f, 1), dt_bias=(T, 1), state=(f, 4),
                            norm_w=(T, 1), eps=(f, 1), mask=(mx.bool_, 2),
                            lengths=(mx.int32, 1), hin=(T, 3), res=(T, 3), in_nw=(T, 1),
                            in_eps=(f, 1), w=(mx.uint32, 2), scales=(T, 2), biases=(T, 2),
                            counters=(mx.int32, 1), ow=(mx.uint32, 2), oscales=(T, 2),
                            obiases=(T, 2)),
                       [T, T, f, T, f, T, f], dict(T=T, Hk=16, Hv=32, Dk=128, Dv=128, KS=4, NW=16,
                                             HAS_MASK=T == BF, HAS_LEN=T == BF, PACKED=T != BF,
                                             PROJ=False, S=T, K=32, BITS=4, GS=32, RPW=1,
                                             SPLIT=1, OUTP=False, ORPW=1, BN=1)),
            ("decode_proj", T): (
                dict(qkv=(T, 1), z=(T, 1), b=(T, 1), a=(T, 1), conv_w=(T, 3),
                     conv_state=(T, 3), A_log=(f, 1), dt_bias=(T, 1), state=(f, 4),
                     norm_w=(T, 1), eps=(f, 1), mask=(mx.bool_, 2), lengths=(mx.int32, 1),
                     hin=(T, 3), res=(T, 3), in_nw=(T, 1), in_eps=(f, 1), w=(mx.uint32, 2),
                     scales=(T, 2), biases=(T, 2), counters=(mx.int32, 1), ow=(mx.uint32, 2),
                     oscales=(T, 2), obiases=(T, 2)),
                [T, T, f, T, f, T, f], dict(T=T, Hk=16, Hv=32, Dk=128, Dv=128, KS=4, NW=16,
                                      HAS_MASK=T != BF, HAS_LEN=T != BF, PACKED=True, PROJ=True,
                                      S=T, K=2048 if T == BF else 256, BITS=4 if T == BF else 8,
                                      GS=64 if T == BF else 32, RPW=G.PROJ_RPW,
                                      SPLIT=G.PROJ_SPLIT["cuda"] if T == BF else 1,
                                      OUTP=T == BF, ORPW=G.OUT_RPW,
                                      BN=G.MAX_BATCH_FOLD if T == BF else 1)),
            G.PREP: (dict(qkv=(T, 3), conv_w=(T, 3), conv_state=(T, 3), a=(T, 3), b=(T, 3),
                          A_log=(f, 1), dt_bias=(T, 1), mask=(mx.bool_, 2),
                          lengths=(mx.int32, 1)),
                     [f, f, T, f, f, T], dict(T=T, Hk=16, Hv=32, D=128, KS=4, TT=G.PREP_TT,
                                              HAS_MASK=T == BF, HAS_LEN=T == BF)),
            G.NORM: (dict(y=(T, 4), z=(T, 4), norm_w=(T, 1), eps=(f, 1)), [T],
                     dict(T=T, Hv=32, Dv=128, RPB=G.NORM_RPB)),
        }
        cfgs = ([(8, 2, 4), (8, 1, 4), (4, 1, 4), (16, 2, 4), (32, 4, 1)] if T == BF
                else sorted({(8, 2, 4), G.SCAN_CONFIG["cuda"]}))
        for lpr, rpl, wpb in cfgs:
            sig[("scan", lpr, rpl, wpb)] = (
                dict(qn=(f, 4), kn=(f, 4), vv=(T, 4), g=(f, 3), beta=(f, 3), state=(f, 4)),
                [T, f], dict(T=T, Hk=16, Hv=32, Dk=128, Dv=128, LPR=lpr, RPL=rpl, WPB=wpb))
        for key, (ins, outs, tmpl) in sig.items():
            spec = (G.SCAN if key[0] == "scan" else G.DECODE if key[0] == "decode_proj"
                    else key)
            cases.append((spec, [(n, *ins[n]) for n in spec.inputs],
                          list(zip(spec.outputs, outs)), list(tmpl.items())))
    return cases


def test_cuda_bodies_compile():
    """Every CUDA body compiles with nvcc -arch=sm_90a as MLX 0.32 renders it: bf16,
    fp16, fp32 and the benchmarked scan configurations (2 nvcc processes at a time)."""
    from concurrent.futures import ThreadPoolExecutor

    _cuda_check()

    def one(case):
        spec, ins, outs, tmpl = case
        head, body = K.cuda_parts(spec.stem)
        cached_nvcc_check(spec.name, ins, outs, body, head, tmpl)

    with ThreadPoolExecutor(2) as ex:
        list(ex.map(one, _cuda_cases()))


def test_metal_bodies_lint():
    from mlx_lily.testing import msl_lint

    for spec in G.SPECS:
        res = msl_lint.lint_file(K.shader_path("metal", spec.stem + ".metal"))
        assert not res.issues, res.issues


def test_counters_belong_to_caches():
    """The patch keeps the SPLIT / OUTP / moe_fused arrival counters on each cache object
    (never shared between caches or their copies, so launches MLX may run concurrently never share them); no
    cache, no counters (one block per head, no OUTP); a traced step's stand-in cache
    hands over the real cache's."""
    from mlx_lm.models.cache import ArraysCache

    from mlx_lily.patches import qwen3_next as nxt

    a, b = ArraysCache(2), ArraysCache(2)
    ca, cb = nxt.gdn_counters(a, 66), nxt.gdn_counters(b, 66)
    assert ca is not cb and ca.size >= 66 and not np.array(ca).any()
    assert nxt.gdn_counters(a, 66) is ca  # kept
    assert nxt.gdn_counters(a, 200).size >= 200  # regrown for a larger batch
    assert nxt.gdn_counters(None, 66) is None
    assert nxt.gdn_counters(nxt._StepCache(None, None, ca), 66) is ca
    assert nxt.gdn_counters(nxt._StepCache(None, None, ca), 10 ** 6) is None
    assert nxt.gdn_counters(nxt._StepCache(None, None), 66) is None
    # copies of a cache (MLX's deepcopy of an array keeps its buffer) get their own
    import copy

    from mlx_lm.models.cache import KVCache

    for cp in (copy.copy, copy.deepcopy):
        a2 = cp(a)
        c2 = nxt.gdn_counters(a2, 66)
        assert c2 is not ca and nxt.gdn_counters(a2, 66) is c2
        assert memoryview(c2).tobytes() == bytes(4 * c2.size)
        assert np.asarray(memoryview(c2)).ctypes.data != np.asarray(memoryview(ca)).ctypes.data
    kv = KVCache()  # attention layers' caches hold the MoE block's counters
    assert nxt.gdn_counters(kv, 4) is nxt.gdn_counters(kv, 4)


def test_contiguous_out_proj():
    """``contiguous_qproj`` keeps a bias-free affine ``QuantizedLinear``'s arrays as
    row-contiguous arrays with the same values; anything else gets None."""
    import mlx.nn as nn

    from mlx_lily.patches import qwen3_next as nxt

    ql = nn.QuantizedLinear(128, 64, bias=False, group_size=64, bits=4)
    q = nxt.contiguous_qproj(ql)
    assert (q.bits, q.group_size, q.sizes) == (4, 64, (64,))
    for x, y in ((q.weight, ql.weight), (q.scales, ql.scales), (q.biases, ql.biases)):
        assert mx.array_equal(x, y).item()
    assert nxt.contiguous_qproj(nn.QuantizedLinear(128, 64, bias=True)) is None
    assert nxt.contiguous_qproj(nn.Linear(128, 64, bias=False)) is None


def test_out_enabled_switches_and_one_step_only(monkeypatch):
    """OUTP follows its own switch and ``qgemv_out``'s (the launch it replaces); a PROJ
    launch refuses more than one step."""
    monkeypatch.setenv("MLX_LILY_KERNELS", "all")
    monkeypatch.delenv("MLX_LILY_DISABLE", raising=False)
    assert G.out_enabled("cuda")
    for op in (G.OUT_OP, "qgemv_out", G.PROJ_OP):
        monkeypatch.setenv("MLX_LILY_DISABLE", op)
        assert not G.out_enabled("cuda"), op
    monkeypatch.delenv("MLX_LILY_DISABLE")
    inp, dims = make_inputs(1, 1, fused_views=False, seed=33)
    p = make_proj(inp, dims, K=256, seed=33)
    two = p._replace(h0=mx.concatenate([p.h0, p.h0], 1), res=mx.concatenate([p.res, p.res], 1))
    with pytest.raises(ValueError, match="S == 1"):
        G.gated_delta_fused(None, None, None, None, **_rest(inp), **dims, proj=two,
                            get_kernel=lambda spec: None)
