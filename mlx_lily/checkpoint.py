"""Check an MLX Qwen3.5/3.6 checkpoint directory before loading it.

Everything here reads only ``config.json``, ``model.safetensors.index.json`` and the
JSON headers of the ``model*.safetensors`` shards: no tensor data is read and
nothing in the directory is modified. No MLX import.

    from mlx_lily.checkpoint import validate_checkpoint, CheckpointError
    config = validate_checkpoint("path/to/Qwen3.6-35B-A3B-4bit")
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["CheckpointError", "expected_layout", "read_safetensors_header", "validate_checkpoint"]

INDEX_FILE = "model.safetensors.index.json"
NO_QUANT_MSG = (
    "config.json has no 'quantization' block: mlx-lily expects an MLX-quantized "
    "checkpoint (mlx_lm.convert -q)"
)
_FLOAT = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
# Keys mlx-lm's qwen3_5 sanitize drops, so a checkpoint may carry them harmlessly.
_DROPPED = ("mtp.", "vision_tower", "model.visual", "language_model.mtp.", "language_model.model.mtp.")


class CheckpointError(ValueError):
    """A checkpoint directory that mlx-lily cannot load; ``problems`` lists every issue found."""

    def __init__(self, message: str, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = problems or [message]


def _text_config(config: dict) -> dict:
    return config.get("text_config", config)


def expected_layout(config: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """Tensors an MLX checkpoint for ``config`` must hold, as ``{name: (shape, dtype)}``.

    ``config`` is a parsed ``config.json`` of model_type ``qwen3_5_moe``/``qwen3_5`` (with
    ``text_config``) or a bare text config. Names follow mlx-lm after sanitize
    (``language_model.model.layers.N...``), in mlx-lm's parameter order. dtypes are
    safetensors codes: quantized ``weight`` is ``"U32"`` ``[..., out, in*bits/32]`` with
    ``scales``/``biases`` in the model dtype ``[..., out, in/group]``; ``A_log`` is
    ``"F32"``; other float tensors use ``text_config.dtype`` (``"BF16"`` by default).
    Quantization follows ``config["quantization"]`` (affine only; per-path overrides;
    layers whose input width is not a multiple of the group size stay float, like
    ``mlx_lm.convert``). Without a ``quantization`` block every weight is float.
    Raises ``CheckpointError`` for missing config fields or an unsupported mode.
    """
    tc = _text_config(config)
    quant = config.get("quantization")
    try:
        fdt = _FLOAT.get(tc.get("dtype") or config.get("torch_dtype") or "bfloat16", "BF16")
        H, L, V = tc["hidden_size"], tc["num_hidden_layers"], tc["vocab_size"]
        nh, nkv = tc["num_attention_heads"], tc["num_key_value_heads"]
        hd = tc.get("head_dim") or H // nh
        hk, hv = tc["linear_num_key_heads"], tc["linear_num_value_heads"]
        dk, dv, K = tc["linear_key_head_dim"], tc["linear_value_head_dim"], tc["linear_conv_kernel_dim"]
        interval = tc.get("full_attention_interval", 4)
        E = tc.get("num_experts", 0)
        moe_i, shared_i = tc.get("moe_intermediate_size", 0), tc.get("shared_expert_intermediate_size", 0)
        dense_i = tc.get("intermediate_size") if not E else None
    except KeyError as e:
        raise CheckpointError(f"config.json text config lacks field {e.args[0]!r}") from None
    if quant is not None and quant.get("mode", "affine") != "affine":
        raise CheckpointError(f"unsupported quantization mode {quant.get('mode')!r} (affine only)")

    out: dict[str, tuple[tuple[int, ...], str]] = {}

    def linear(path: str, o: int, i: int, experts: int | None = None) -> None:
        lead = (experts,) if experts else ()
        if quant is None or i % quant["group_size"]:
            out[path + ".weight"] = (lead + (o, i), fdt)
            return
        ov = quant.get(path) if isinstance(quant.get(path), dict) else {}
        gs, bits = ov.get("group_size", quant["group_size"]), ov.get("bits", quant["bits"])
        out[path + ".weight"] = (lead + (o, i * bits // 32), "U32")
        out[path + ".scales"] = (lead + (o, i // gs), fdt)
        out[path + ".biases"] = (lead + (o, i // gs), fdt)

    def mlp(p: str, inter: int) -> None:  # Qwen3NextMLP parameter order: gate, down, up
        linear(p + ".gate_proj", inter, H)
        linear(p + ".down_proj", H, inter)
        linear(p + ".up_proj", inter, H)

    m = "language_model.model"
    linear(f"{m}.embed_tokens", V, H)
    for n in range(L):
        p = f"{m}.layers.{n}"
        if (n + 1) % interval:
            a, conv = p + ".linear_attn", 2 * hk * dk + hv * dv
            out[a + ".conv1d.weight"] = ((conv, K, 1), fdt)
            linear(a + ".in_proj_qkv", conv, H)
            linear(a + ".in_proj_z", hv * dv, H)
            linear(a + ".in_proj_b", hv, H)
            linear(a + ".in_proj_a", hv, H)
            out[a + ".dt_bias"] = ((hv,), fdt)
            out[a + ".A_log"] = ((hv,), "F32")
            out[a + ".norm.weight"] = ((dv,), fdt)
            linear(a + ".out_proj", H, hv * dv)
        else:
            a = p + ".self_attn"
            linear(a + ".q_proj", nh * hd * 2, H)  # per head [query | output gate]
            linear(a + ".k_proj", nkv * hd, H)
            linear(a + ".v_proj", nkv * hd, H)
            linear(a + ".o_proj", H, nh * hd)
            out[a + ".q_norm.weight"] = ((hd,), fdt)
            out[a + ".k_norm.weight"] = ((hd,), fdt)
        out[p + ".input_layernorm.weight"] = ((H,), fdt)
        out[p + ".post_attention_layernorm.weight"] = ((H,), fdt)
        if E:
            linear(p + ".mlp.gate", E, H)
            for proj, o, i in (("gate_proj", moe_i, H), ("up_proj", moe_i, H), ("down_proj", H, moe_i)):
                linear(f"{p}.mlp.switch_mlp.{proj}", o, i, experts=E)
            mlp(p + ".mlp.shared_expert", shared_i)
            linear(p + ".mlp.shared_expert_gate", 1, H)
        else:
            mlp(p + ".mlp", dense_i)
    out[f"{m}.norm.weight"] = ((H,), fdt)
    if not (tc.get("tie_word_embeddings") or config.get("tie_word_embeddings")):
        linear("language_model.lm_head", V, H)
    return out


def read_safetensors_header(path: str | os.PathLike) -> dict[str, dict]:
    """The JSON header of a safetensors file: ``{name: {"dtype", "shape", "data_offsets"}}``.

    Reads only the 8-byte length and the header (``__metadata__`` is dropped). Raises
    ``CheckpointError`` naming the file if it is not safetensors or is truncated.
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or n > min(size - 8, 100 << 20):
            raise CheckpointError(f"{path.name}: not a safetensors file (bad header length)")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path.name}: unreadable safetensors header ({e})") from None
    header.pop("__metadata__", None)
    end = max((t["data_offsets"][1] for t in header.values()), default=0)
    if 8 + n + end > size:
        raise CheckpointError(f"{path.name}: truncated ({size} bytes, header promises {8 + n + end})")
    return header


def validate_checkpoint(path: str | os.PathLike) -> dict:
    """Check an MLX checkpoint directory before loading it; return its parsed ``config.json``.

    Checks: ``config.json`` exists and parses; it has a ``quantization`` block; every
    shard named in ``model.safetensors.index.json`` exists (without an index, at least
    one ``model*.safetensors``); the index agrees with the shard headers; every tensor's
    shape and dtype equals :func:`expected_layout`; no expected tensor is missing and no
    unexpected one is present (keys mlx-lm's sanitize drops, like ``mtp.*``, are allowed).
    Reads safetensors headers only, never tensor data; writes nothing.

    Raises ``CheckpointError`` (a ``ValueError``); its message names the offending file
    and tensor with the expected and found shape/dtype, and ``.problems`` lists all issues.
    """
    root = Path(path)
    cfg_file = root / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{root}: no config.json")
    try:
        config = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"config.json is not valid JSON: {e}") from None
    if not isinstance(config, dict) or "quantization" not in config:
        raise CheckpointError(NO_QUANT_MSG)
    expected = expected_layout(config)

    index_map: dict[str, str] = {}
    files = {p.name for p in root.glob("model*.safetensors")}  # mlx-lm loads all of these
    if (root / INDEX_FILE).is_file():
        try:
            index_map = json.loads((root / INDEX_FILE).read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{INDEX_FILE}: unreadable ({e!r})") from None
        for shard in sorted(set(index_map.values())):
            if not (root / shard).is_file():
                raise CheckpointError(f"shard {shard} listed in {INDEX_FILE} is missing from {root}")
    if not files:
        raise CheckpointError(f"{root}: no model*.safetensors shards")

    problems: list[str] = []
    found_in: dict[str, str] = {}
    for fname in sorted(files):
        for name, info in read_safetensors_header(root / fname).items():
            shape, dtype = tuple(info["shape"]), info["dtype"]
            if name in found_in:
                problems.append(f"{fname}: tensor {name} is also in {found_in[name]}")
            found_in[name] = fname
            if index_map and index_map.get(name, fname) != fname:
                problems.append(f"{fname}: tensor {name} is listed in {INDEX_FILE} under {index_map[name]}")
            if name not in expected:
                if not name.startswith(_DROPPED):
                    problems.append(f"{fname}: unexpected tensor {name} shape {shape} {dtype}")
                continue
            eshape, edtype = expected[name]
            ok_dtype = dtype == edtype or (name.endswith("A_log") and dtype in _FLOAT.values())
            if shape != eshape or not ok_dtype:
                problems.append(
                    f"{fname}: tensor {name} expected shape {eshape} {edtype}, found shape {shape} {dtype}"
                )
    for name in expected:
        if name not in found_in:
            where = f"{index_map[name]} (per {INDEX_FILE})" if name in index_map else "any shard"
            problems.append(f"tensor {name} is missing from {where}")
    if problems:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise CheckpointError(problems[0] + more, problems)
    return config
