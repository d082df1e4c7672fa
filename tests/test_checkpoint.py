"""validate_checkpoint: accepts synthetic checkpoints, names the problem in bad ones, never writes."""

from __future__ import annotations

import json

import pytest

from _ckpt_fixtures import copy_model_files, dir_hashes, tiny_sharded_ckpt  # noqa: F401  (fixture)
from mlx_lily.checkpoint import CheckpointError, expected_layout, validate_checkpoint

A_LOG = "language_model.model.layers.0.linear_attn.A_log"


def _check_fails(d, *needles):
    before = dir_hashes(d)
    with pytest.raises(CheckpointError) as err:
        validate_checkpoint(d)
    assert dir_hashes(d) == before  # nothing modified
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))
    return err.value


def test_valid_sharded_checkpoint(tiny_sharded_ckpt):
    index = json.loads((tiny_sharded_ckpt / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    before = dir_hashes(tiny_sharded_ckpt)
    config = validate_checkpoint(tiny_sharded_ckpt)
    assert config == json.loads((tiny_sharded_ckpt / "config.json").read_text())
    assert dir_hashes(tiny_sharded_ckpt) == before


def test_sharded_checkpoint_loads(tiny_sharded_ckpt):
    import mlx.core as mx
    from mlx_lm.utils import load_model

    model, _ = load_model(tiny_sharded_ckpt)
    assert model(mx.array([[248045, 872]])).shape == (1, 2, 248320)


def test_missing_shard(tiny_sharded_ckpt, tmp_path):
    d = copy_model_files(tiny_sharded_ckpt, tmp_path / "ckpt")
    victim = sorted(d.glob("model-*.safetensors"))[1]
    victim.unlink()
    err = _check_fails(d, victim.name, "missing")
    assert "model.safetensors.index.json" in str(err)


def test_wrong_tensor_shape(tiny_sharded_ckpt, tmp_path):
    import mlx.core as mx

    d = copy_model_files(tiny_sharded_ckpt, tmp_path / "ckpt")
    shard = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"][A_LOG]
    tensors, meta = mx.load(str(d / shard), return_metadata=True)
    tensors[A_LOG] = mx.zeros((5,), dtype=mx.float32)  # config implies (4,)
    mx.save_safetensors(str(d / shard), tensors, metadata=meta)
    err = _check_fails(d, shard, A_LOG, "(4,)", "(5,)")
    assert err.problems == [str(err)]


def test_wrong_dtype_and_missing_tensor(tiny_sharded_ckpt, tmp_path):
    import mlx.core as mx

    d = copy_model_files(tiny_sharded_ckpt, tmp_path / "ckpt")
    wm = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    norm = "language_model.model.norm.weight"
    shard = wm[norm]
    tensors, meta = mx.load(str(d / shard), return_metadata=True)
    tensors[norm] = tensors[norm].astype(mx.float16)
    gone = next(k for k in tensors if k.endswith(".scales"))
    del tensors[gone]
    mx.save_safetensors(str(d / shard), tensors, metadata=meta)
    err = _check_fails(d, shard, norm, "BF16", "F16")
    assert any(gone in p and "missing" in p for p in err.problems)


def test_no_quantization_block(tiny_sharded_ckpt, tmp_path):
    d = copy_model_files(tiny_sharded_ckpt, tmp_path / "ckpt")
    config = json.loads((d / "config.json").read_text())
    del config["quantization"]
    (d / "config.json").write_text(json.dumps(config, indent=4))
    err = _check_fails(d)
    assert str(err) == (
        "config.json has no 'quantization' block: mlx-lily expects an MLX-quantized checkpoint (mlx_lm.convert -q)")


def test_truncated_shard_and_bad_config(tiny_sharded_ckpt, tmp_path):
    d = copy_model_files(tiny_sharded_ckpt, tmp_path / "ckpt")
    last = sorted(d.glob("model-*.safetensors"))[-1]
    last.write_bytes(last.read_bytes()[:-100])
    _check_fails(d, last.name, "truncated")
    (d / "config.json").write_text("{not json")
    _check_fails(d, "config.json")
    (d / "config.json").unlink()
    _check_fails(d, "no config.json")


def test_expected_layout_unquantized_and_dense():
    from mlx_lily.synth import PRESETS

    tc = PRESETS["tiny"]
    layout = expected_layout({"model_type": "qwen3_5_moe", "text_config": tc})
    assert layout["language_model.lm_head.weight"] == ((248320, 64), "BF16")
    assert not any(k.endswith(".scales") for k in layout)
    dense = dict(tc, num_experts=0, intermediate_size=256)
    layout = expected_layout({"text_config": dense, "quantization": {"group_size": 64, "bits": 4}})
    assert layout["language_model.model.layers.0.mlp.down_proj.weight"] == ((64, 32), "U32")
    assert not any(".switch_mlp." in k for k in layout)
