"""What a user sees: the one status line printed when Lily patches a supported model (and
only then), ``backend_info()["patched"]``, and ``dir(mlx_lily)``."""

from __future__ import annotations

import warnings

import pytest

import mlx_lily
from mlx_lily import backend
from mlx_lily.backend import status_line, tracing_backend


@pytest.fixture(autouse=True)
def _unpatched(monkeypatch):
    for var in ("MLX_LILY_DISABLE", "MLX_LILY_KERNELS"):
        monkeypatch.delenv(var, raising=False)
    mlx_lily.unpatch()
    yield
    mlx_lily.unpatch()


def test_dir_lists_the_public_api():
    names = dir(mlx_lily)
    assert set(mlx_lily.__all__) <= set(names)
    assert not [n for n in names if n.startswith("_") and n != "__version__"], names


def test_backend_info_says_whether_patched():
    assert mlx_lily.backend_info()["patched"] is False
    mlx_lily.patch()
    assert mlx_lily.backend_info()["patched"] is True
    mlx_lily.unpatch()
    assert mlx_lily.backend_info()["patched"] is False


def test_status_line_counts_and_reasons(monkeypatch):
    n = len(backend.OP_NAMES)
    line = status_line("qwen3_5_moe")
    assert line.startswith("[mlx-lily] qwen3_5_moe on cpu: 0 of ")
    assert f"{n} ops: no GPU backend" in line and "mlx_lily.backend_info()" in line
    with tracing_backend("metal"):
        assert f"0 of {n} ops run kernels; {n} ops: not verified on metal" in status_line()
    monkeypatch.setenv("MLX_LILY_DISABLE", "qgemv")
    line = status_line()
    assert "qgemv: disabled by MLX_LILY_DISABLE" in line
    assert f"{n - 1} ops: no GPU backend" in line
    assert "\n" not in line


def test_printed_once_for_a_supported_model_only_when_asked(tiny_models, capsys):
    model = tiny_models["qwen3_5_moe"]
    mlx_lily.patch(model)  # a script's patch: silent
    assert "[mlx-lily]" not in capsys.readouterr().err
    mlx_lily.unpatch()
    model.__dict__.pop("_lily_announced", None)
    mlx_lily.patch(announce=True)  # what ``--lily`` does
    mlx_lily.prepare_model(model)
    mlx_lily.prepare_model(model)
    err = capsys.readouterr().err
    assert err.count("[mlx-lily]") == 1 and "qwen3_5_moe on cpu: 0 of" in err, err


def test_not_printed_for_an_unsupported_model(capsys):
    from mlx_lm.models import llama

    m = llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=1, intermediate_size=128,
        num_attention_heads=2, rms_norm_eps=1e-6, vocab_size=100, num_key_value_heads=2))
    mlx_lily.patch(announce=True)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert mlx_lily.prepare_model(m) is False
    assert "[mlx-lily]" not in capsys.readouterr().err
