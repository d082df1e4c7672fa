"""Bad checkpoints through the patched ``mlx_lm.load``: a clear error naming the file and
tensor, and the user's directory untouched."""

import json

import mlx.core as mx
import pytest
from mlx_lm import load

import mlx_lily
from _ckpt_fixtures import copy_model_files, dir_hashes, tiny_sharded_ckpt  # noqa: F401
from mlx_lily.checkpoint import CheckpointError

A_LOG = "language_model.model.layers.0.linear_attn.A_log"


def test_missing_shard_via_load(tiny_sharded_ckpt, tmp_path):
    d = copy_model_files(tiny_sharded_ckpt, tmp_path / "ckpt")
    victim = sorted(d.glob("model-*.safetensors"))[1]
    victim.unlink()
    before = dir_hashes(d)
    with mlx_lily.patched():
        with pytest.raises(CheckpointError, match=victim.name):
            load(str(d))
    assert dir_hashes(d) == before


def test_wrong_shape_via_load(tiny_sharded_ckpt, tmp_path):
    d = copy_model_files(tiny_sharded_ckpt, tmp_path / "ckpt")
    shard = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"][A_LOG]
    tensors, meta = mx.load(str(d / shard), return_metadata=True)
    tensors[A_LOG] = mx.zeros((5,), dtype=mx.float32)
    mx.save_safetensors(str(d / shard), tensors, metadata=meta)
    before = dir_hashes(d)
    with mlx_lily.patched():
        with pytest.raises(CheckpointError) as e:
            load(str(d))
    assert shard in str(e.value) and A_LOG in str(e.value)
    assert dir_hashes(d) == before


def test_no_quantization_warns_and_loads_stock(tiny_sharded_ckpt, tmp_path):
    d = copy_model_files(tiny_sharded_ckpt, tmp_path / "ckpt")
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("quantization")
    cfg.pop("quantization_config", None)
    (d / "config.json").write_text(json.dumps(cfg))
    before = dir_hashes(d)
    with mlx_lily.patched():
        with pytest.warns(UserWarning, match="no 'quantization' block"):
            with pytest.raises(Exception):
                load(str(d))  # mlx-lm itself cannot read packed weights as float ones
    assert dir_hashes(d) == before


def test_good_checkpoint_loads_and_is_prepared(tiny_sharded_ckpt):
    before = dir_hashes(tiny_sharded_ckpt)
    with mlx_lily.patched():
        model, tok = load(str(tiny_sharded_ckpt))
        gdn = model.layers[0].linear_attn
        assert getattr(gdn, "_lily", None) is not None and gdn._lily.in_proj is not None
    assert dir_hashes(tiny_sharded_ckpt) == before
