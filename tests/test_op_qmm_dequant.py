"""``prefill_dequant``: many-row quantized projections as ``mx.dequantize`` + ``mx.matmul``
(CUDA only) vs the contract, MLX's ``quantized_matmul``; the switches and the call sites
(``QProj``, ``one_row_linear``, the shared expert: ``layouts.mlp``)."""
from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlx_lily.ops import qmm_dequant as Q
from mlx_lily.patches import layouts as L

from _close import rel_err
from _models import shared_expert


def qlinear(o, k, bits=4, gs=64, dtype=mx.bfloat16, seed=0):
    mx.random.seed(seed)
    lin = nn.Linear(k, o, bias=False)
    lin.weight = (mx.random.normal((o, k)) * k ** -0.5).astype(dtype)
    return nn.QuantizedLinear.from_linear(lin, gs, bits)


def truth(x, layer):
    """fp32 product with the fp32 dequantized weight."""
    w = mx.dequantize(layer.weight, scales=layer.scales.astype(mx.float32),
                      biases=layer.biases.astype(mx.float32), group_size=layer.group_size,
                      bits=layer.bits)
    return mx.matmul(x.astype(mx.float32), w.T)


def count_dequantize(monkeypatch) -> list:
    """The weight shapes of every ``mx.dequantize`` call from now on (the op module's)."""
    calls = []
    real = mx.dequantize

    def counting(*a, **k):
        calls.append(a[0].shape)
        return real(*a, **k)

    monkeypatch.setattr(Q.mx, "dequantize", counting)
    return calls


@pytest.fixture
def as_cuda(monkeypatch):
    """The current backend reads "cuda" in the op module (the arrays stay on the CPU) and
    every kernel switch is allowed, small test weights pass ``MIN_OUT``; a counter of
    ``mx.dequantize`` calls."""
    monkeypatch.setattr(Q, "current_backend", lambda: "cuda")
    monkeypatch.setattr(Q, "MIN_OUT", 1)
    monkeypatch.setenv("MLX_LILY_KERNELS", "all")
    yield count_dequantize(monkeypatch)


@pytest.mark.parametrize("o,k,bits,gs,rows,dtype", [
    (96, 256, 4, 64, 300, mx.bfloat16),
    (40, 128, 8, 32, 256, mx.float16),
    (33, 512, 4, 128, 257, mx.bfloat16),
])
def test_path_matches_quantized_matmul(as_cuda, o, k, bits, gs, rows, dtype):
    layer = qlinear(o, k, bits, gs, dtype, seed=o + k)
    x = mx.random.normal((1, rows, k)).astype(dtype)
    y = Q.qmm_dequant(x, layer.weight, layer.scales, layer.biases, gs, bits)
    assert as_cuda == [layer.weight.shape]  # the dequantize path ran
    ref = Q.qmm_dequant_reference(x, layer.weight, layer.scales, layer.biases, gs, bits)
    assert y.dtype == ref.dtype == dtype and y.shape == ref.shape == (1, rows, o)
    # against the fp32 truth: within half-precision rounding, and no further than MLX's
    # own quantized_matmul (on this CPU the reference's error is the larger: 3.5e-2 vs
    # 5e-3 on the first case)
    t = truth(x, layer)
    assert rel_err(y, t) <= max(1.5e-2, rel_err(ref, t)), (rel_err(y, t), rel_err(ref, t))
    # a wrong weight is caught by the same check
    bad = qlinear(o, k, bits, gs, dtype, seed=o + k)
    bad.scales = bad.scales * 1.1
    assert rel_err(y, truth(x, bad)) > max(1.5e-2, rel_err(ref, t))


def test_not_served_cases(as_cuda, monkeypatch):
    layer = qlinear(64, 256)
    w, s, b = layer.weight, layer.scales, layer.biases
    x = mx.random.normal((1, 300, 256)).astype(mx.bfloat16)
    assert Q.try_dequant(x[:, :255], w, s, b, 64, 4) is None  # too few rows
    assert Q.try_dequant(x.astype(mx.float32), w, s, b, 64, 4) is None  # dtype != scales'
    assert Q.try_dequant(x, w, s, None, 64, 4) is None
    assert Q.try_dequant(x, w, s, b, 64, 4, mode="mxfp4") is None
    monkeypatch.setattr(Q, "MAX_WEIGHT_ELEMENTS", 64 * 256 - 1)
    assert Q.try_dequant(x, w, s, b, 64, 4) is None  # weight over the scratch cap
    monkeypatch.setattr(Q, "MAX_WEIGHT_ELEMENTS", 1 << 26)
    monkeypatch.setattr(Q, "MIN_OUT", 65)
    assert Q.try_dequant(x, w, s, b, 64, 4) is None  # too few outputs (the router)
    assert as_cuda == []


def test_switches(as_cuda, monkeypatch):
    layer = qlinear(64, 256)
    x = mx.random.normal((1, 300, 256)).astype(mx.bfloat16)
    args = (x, layer.weight, layer.scales, layer.biases, 64, 4)
    assert Q.try_dequant(*args) is not None
    monkeypatch.setenv("MLX_LILY_DISABLE", Q.NAME)
    assert Q.try_dequant(*args) is None
    monkeypatch.delenv("MLX_LILY_DISABLE")
    monkeypatch.setenv("MLX_LILY_KERNELS", "verified")  # on by default on CUDA
    assert Q.try_dequant(*args) is not None
    monkeypatch.setenv("MLX_LILY_KERNELS", "qgemv")  # a list without it
    assert Q.try_dequant(*args) is None
    monkeypatch.setenv("MLX_LILY_KERNELS", "all")
    monkeypatch.setattr(Q, "current_backend", lambda: "metal")
    assert Q.try_dequant(*args) is None


def test_off_cuda_the_reference_runs():
    layer = qlinear(64, 256)
    x = mx.random.normal((1, 300, 256)).astype(mx.bfloat16)
    args = (x, layer.weight, layer.scales, layer.biases, 64, 4)
    assert Q.try_dequant(*args) is None
    assert mx.array_equal(Q.qmm_dequant(*args), Q.qmm_dequant_reference(*args)).item()


def test_call_sites(as_cuda):
    """QProj (many rows), one_row_linear (prefill out_proj / o_proj) and the shared
    expert run the path and agree with the stock layers."""
    from mlx_lily.patches import qwen3_next as P
    from mlx_lily.qproj import QProj

    x = mx.random.normal((1, 300, 256)).astype(mx.bfloat16)
    layer = qlinear(96, 256, seed=3)
    want = layer(x)
    (y,) = QProj.view([layer])(x, split=False)
    assert len(as_cuda) == 1
    y2 = P.one_row_linear(layer, x)
    assert len(as_cuda) == 2
    del as_cuda[:]  # (truth() dequantizes too)
    t = truth(x, layer)
    for yy in (y, y2):
        assert rel_err(yy, t) <= max(1.5e-2, rel_err(want, t))
    mlp = shared_expert(256, 128)
    del as_cuda[:]
    y3 = L.mlp(mlp, x)
    assert as_cuda == [(256, 32), (256, 16)]  # gate|up stacked, down
    ref = mlp(x)
    # fp32 truth of the MLP from fp32-dequantized weights
    from mlx_lm.models.activations import swiglu
    a = swiglu(truth(x, mlp.gate_proj), truth(x, mlp.up_proj))
    t3 = truth(a.astype(mx.bfloat16), mlp.down_proj)
    assert rel_err(y3, t3) <= max(3e-2, 1.5 * rel_err(ref, t3)), (rel_err(y3, t3),
                                                                 rel_err(ref, t3))
    # one row: the decode paths, not this one
    del as_cuda[:]
    L.mlp(mlp, x[:, :1])
    P.one_row_linear(layer, x[:, :1])
    assert as_cuda == []


def test_shared_expert_production_widths_take_the_path(as_cuda, monkeypatch):
    """Qwen3.6's shared expert (2048 -> 512 gate and up, 512 -> 2048 down) under the real
    ``MIN_OUT``: gate|up as one stacked 1024-row weight, down alone; the stacked outputs
    split back exactly as the layers' own path computes them one by one."""
    monkeypatch.setattr(Q, "MIN_OUT", 1024)
    mlp = shared_expert(2048, 512)
    x = mx.random.normal((1, 300, 2048)).astype(mx.bfloat16)
    assert Q.linear(mlp.gate_proj, x) is None  # 512 outputs alone: under MIN_OUT
    del as_cuda[:]
    y = L.mlp(mlp, x)
    assert as_cuda == [(1024, 256), (2048, 64)]
    g, u = Q.stacked_linear((mlp.gate_proj, mlp.up_proj), x)
    monkeypatch.setattr(Q, "MIN_OUT", 1)
    for got, layer in ((g, mlp.gate_proj), (u, mlp.up_proj)):  # split in the right place
        alone = Q.linear(layer, x).astype(mx.float32)
        assert rel_err(got, alone) <= 1e-2
    from mlx_lm.models.activations import swiglu
    a = swiglu(truth(x, mlp.gate_proj), truth(x, mlp.up_proj))
    t = truth(a.astype(mx.bfloat16), mlp.down_proj)
    assert rel_err(y, t) <= max(3e-2, 1.5 * rel_err(mlp(x), t))


def test_shared_switch(as_cuda, monkeypatch):
    """``shared_dequant`` is not verified yet: under the default ``MLX_LILY_KERNELS``, with
    its kill switch, or without ``prefill_dequant``, Qwen3.6's shared expert (gate 512 wide,
    under ``MIN_OUT``) runs the stock module; named next to ``verified`` it takes the
    stacked path. A wider shared expert keeps ``prefill_dequant``'s per-projection path
    with the switch off."""
    monkeypatch.setattr(Q, "MIN_OUT", 1024)
    mlp = shared_expert(2048, 512)
    x = mx.random.normal((1, 300, 2048)).astype(mx.bfloat16)
    for env in ({"MLX_LILY_KERNELS": "verified"}, {"MLX_LILY_KERNELS": "shared_dequant"},
                {"MLX_LILY_KERNELS": "all", "MLX_LILY_DISABLE": Q.SHARED_NAME},
                {"MLX_LILY_KERNELS": "all", "MLX_LILY_DISABLE": Q.NAME}):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        del as_cuda[:]
        assert mx.array_equal(L.mlp(mlp, x), mlp(x)).item()
        assert as_cuda == [], env
        monkeypatch.delenv("MLX_LILY_DISABLE", raising=False)
    monkeypatch.setenv("MLX_LILY_KERNELS", "verified," + Q.SHARED_NAME)
    del as_cuda[:]
    L.mlp(mlp, x)
    assert as_cuda == [(1024, 256), (2048, 64)]
    wide = shared_expert(2048, 1024, seed=6)
    monkeypatch.setenv("MLX_LILY_KERNELS", "verified")
    del as_cuda[:]
    L.mlp(wide, x)
    assert as_cuda == [(1024, 256), (1024, 256), (2048, 128)]  # gate, up, down one by one


def test_stacked_linear_refusals(as_cuda):
    """Layers of different quantization, a biased layer, a non-quantized layer, one row,
    no layers: None, and no dequantize built."""
    x = mx.random.normal((1, 300, 256)).astype(mx.bfloat16)
    a4, a8 = qlinear(64, 256, 4, seed=1), qlinear(64, 256, 8, seed=2)
    g32 = qlinear(64, 256, 4, gs=32, seed=3)
    biased = nn.QuantizedLinear(256, 64, bias=True, group_size=64, bits=4)
    dense = nn.Linear(256, 64, bias=False)
    f16 = qlinear(64, 256, 4, dtype=mx.float16, seed=4)  # fp16 scales/biases
    for layers in ((a4, a8), (a4, g32), (a4, biased), (a4, dense), (a4, f16), ()):
        assert Q.stacked_linear(layers, x) is None
    assert Q.stacked_linear((a4, a4), x[:, :1]) is None
    assert as_cuda == []
    one = Q.stacked_linear((a4,), x)
    assert len(one) == 1 and mx.array_equal(one[0], Q.linear(a4, x)).item()


@pytest.mark.gpu
def test_gpu_production_dims(monkeypatch):
    """On MLX's CUDA backend: Qwen3.6-35B-A3B's prefill projections (GDN in_proj, out_proj,
    the shared expert's down) over a 2048-token chunk, NaN-free and within half-precision
    rounding of the fp32 truth, no further than MLX's quantized_matmul."""
    from mlx_lily.backend import current_backend

    if current_backend() != "cuda":
        pytest.skip("needs MLX's CUDA backend")
    monkeypatch.setenv("MLX_LILY_KERNELS", "all")
    for o, k in ((12352, 2048), (2048, 4096), (2048, 512)):
        layer = qlinear(o, k, seed=o)
        x = mx.random.normal((1, 2048, k)).astype(mx.bfloat16)
        y = Q.try_dequant(x, layer.weight, layer.scales, layer.biases, 64, 4)
        assert y is not None
        ref = layer(x)
        t = truth(x, layer)
        assert not mx.isnan(y).any().item()
        assert rel_err(y, t) <= max(1.5e-2, rel_err(ref, t)), (o, k, rel_err(y, t))
    # the shared expert (2048 -> 512 -> 2048): gate|up stacked, down alone, 2048 rows
    mlp = shared_expert(2048, 512)
    x = mx.random.normal((1, 2048, 2048)).astype(mx.bfloat16)
    calls = count_dequantize(monkeypatch)
    y = L.mlp(mlp, x)
    assert calls == [(1024, 256), (2048, 64)]  # gate|up stacked, down: the path ran
    from mlx_lm.models.activations import swiglu
    a = swiglu(truth(x, mlp.gate_proj), truth(x, mlp.up_proj))
    t = truth(a.astype(mx.bfloat16), mlp.down_proj)
    assert not mx.isnan(y).any().item()
    assert rel_err(y, t) <= max(3e-2, 1.5 * rel_err(mlp(x), t)), rel_err(y, t)
