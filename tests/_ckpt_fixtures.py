"""Session-scoped synthetic checkpoints shared by test_synth.py and test_checkpoint.py.

Import the fixtures into a test module (``from _ckpt_fixtures import tiny_ckpt``).
Each checkpoint is built once per session, even when several modules import the fixture.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

_BUILT: dict[str, Path] = {}

# Files validate_checkpoint reads (tokenizer files are not copied into scratch copies).
MODEL_FILES = ("config.json", "model.safetensors.index.json", "generation_config.json")


def _once(key: str, factory, build) -> Path:
    if key not in _BUILT:
        _BUILT[key] = build(factory.mktemp(key))
    return _BUILT[key]


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """Tiny preset, seed 0, single shard, with tokenizer: built via ensure_tiny_checkpoint."""
    from mlx_lily.synth import ensure_tiny_checkpoint

    return _once("tiny", tmp_path_factory, lambda d: ensure_tiny_checkpoint(cache_dir=d))


@pytest.fixture(scope="session")
def tiny_sharded_ckpt(tmp_path_factory) -> Path:
    """Tiny preset, seed 0, split into several 8 MiB shards, no tokenizer files."""
    from mlx_lily.synth import write_checkpoint

    return _once(
        "tiny_sharded", tmp_path_factory,
        lambda d: write_checkpoint("tiny", d / "ckpt", 0, max_shard_bytes=8 << 20, tokenizer=False),
    )


def copy_model_files(src: Path, dst: Path) -> Path:
    """Copy config, index and shards (not the tokenizer) of ``src`` into new dir ``dst``."""
    dst.mkdir(parents=True)
    for p in src.iterdir():
        if p.name in MODEL_FILES or p.suffix == ".safetensors":
            shutil.copy2(p, dst / p.name)
    return dst


def dir_hashes(d: Path) -> dict[str, str]:
    """sha256 of every file in ``d`` (by name)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.is_file()}
