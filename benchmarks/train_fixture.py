#!/usr/bin/env python
"""Train the tiny Qwen3.5-MoE test fixture (``tests/fixtures/qwen35moe-tiny-trained``).

A 4-layer model of the exact mlx-lm ``qwen3_5_moe`` architecture (3 Gated
DeltaNet layers + 1 gated GQA attention layer, MoE with a shared expert and
top-k routing in every layer), with the dimensions Lily's kernels specialise
on: GDN heads of 128 (Hv = 2 * Hk), attention head_dim 256 with partial rotary
0.25 and GQA 4:1 (8:1 made a training step ~2x slower on the shared 2-core CPU).  It is trained with MLX on the CPU on the Python standard
library's own sources (a fixed, sorted list of files, so the text exists on
every machine), with a byte-level BPE tokenizer trained by ``tokenizers``, then
cast to bf16 and quantised exactly like ``mlx_lm.convert -q`` (affine, group
64, 4 bits; ``mlp.gate`` / ``mlp.shared_expert_gate`` at 8 bits) with
mlx-lm's own ``quantize_model`` / ``save_model`` / ``save_config``.

Training-only speedups (neither changes the model that is saved):

* The Gated DeltaNet recurrence is evaluated in its chunked (UT-transform)
  form during training; it is mathematically identical to mlx-lm's sequential
  ``gated_delta_ops`` and is checked against it at start-up.  Evaluation of
  the saved 4-bit checkpoint uses mlx-lm's stock code.
* The GDN depthwise causal conv is evaluated as K shifted multiply-adds during
  training (MLX's CPU grouped convolution is slow); same weights, checked at start-up.
* The pip ``mlx[cpu]`` wheel links the netlib reference BLAS (~5 GFLOP/s).
  When gcc and numpy's bundled OpenBLAS are available the script re-executes
  itself with ``LD_PRELOAD`` of a 10-line shim mapping ``cblas_sgemm`` to
  OpenBLAS (about 10x faster).  ``--no-fast-blas`` disables it.

Usage::

    python benchmarks/train_fixture.py                 # ~10-12 min on 2 cores
    python benchmarks/train_fixture.py --steps 20 --out /tmp/fx   # smoke run
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "tests" / "fixtures" / "qwen35moe-tiny-trained"

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}

# --------------------------------------------------------------------------
# fast BLAS shim (training only)
# --------------------------------------------------------------------------
_SHIM_C = r"""
#include <stdint.h>
typedef int64_t I;
extern void scipy_cblas_sgemm64_(int, int, int, I, I, I, float, const float*, I,
                                 const float*, I, float, float*, I);
extern void scipy_cblas_dgemm64_(int, int, int, I, I, I, double, const double*, I,
                                 const double*, I, double, double*, I);
void cblas_sgemm(int o, int ta, int tb, int m, int n, int k, float al, const float* a,
                 int lda, const float* b, int ldb, float be, float* c, int ldc)
{ scipy_cblas_sgemm64_(o, ta, tb, m, n, k, al, a, lda, b, ldb, be, c, ldc); }
void cblas_dgemm(int o, int ta, int tb, int m, int n, int k, double al, const double* a,
                 int lda, const double* b, int ldb, double be, double* c, int ldc)
{ scipy_cblas_dgemm64_(o, ta, tb, m, n, k, al, a, lda, b, ldb, be, c, ldc); }
"""


def _build_blas_shim() -> str | None:
    """Compile the cblas -> numpy-OpenBLAS shim; return its path or None."""
    try:
        import numpy

        libdir = Path(numpy.__file__).resolve().parent.parent / "numpy.libs"
        libs = sorted(libdir.glob("libscipy_openblas64_*.so"))
        gcc = shutil.which("gcc") or shutil.which("cc")
        if not libs or not gcc:
            return None
        cache = Path(tempfile.gettempdir()) / f"mlx_lily_blas_shim_{os.getuid()}"
        cache.mkdir(exist_ok=True)
        src, so = cache / "shim.c", cache / "libmlxlily_blas_shim.so"
        if not so.exists():
            src.write_text(_SHIM_C)
            subprocess.run(
                [gcc, "-O2", "-shared", "-fPIC", str(src), "-o", str(so), str(libs[0]),
                 f"-Wl,-rpath,{libdir}"],
                check=True, capture_output=True,
            )
        return str(so)
    except Exception:  # pragma: no cover - best effort
        return None


def _maybe_reexec_with_fast_blas(args) -> str:
    """Re-exec under LD_PRELOAD with the BLAS shim (Linux only). Returns blas mode."""
    if os.environ.get("MLX_LILY_BLAS_SHIM"):
        return "openblas-shim"
    if args.no_fast_blas or platform.system() != "Linux":
        return "default"
    so = _build_blas_shim()
    if so is None:
        print("[train_fixture] fast BLAS shim unavailable; using MLX's default BLAS", file=sys.stderr)
        return "default"
    env = dict(os.environ)
    env["LD_PRELOAD"] = (so + " " + env.get("LD_PRELOAD", "")).strip()
    env["MLX_LILY_BLAS_SHIM"] = so
    env.setdefault("OPENBLAS_NUM_THREADS", "1")  # no spin-waiting threads on shared cores
    os.execve(sys.executable, [sys.executable, *sys.argv], env)
    return "unreachable"


# --------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------
def stdlib_files() -> tuple[Path, list[str]]:
    """The fixed, sorted list of stdlib ``.py`` files (relative posix paths)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if any(part in EXCLUDED_DIRS for part in rel.parts[:-1]):
            continue
        if rel.name.startswith("test_"):
            continue
        out.append(rel.as_posix())
    return root, sorted(out)


def split_files(files: list[str], val_every: int = 20, val_offset: int = 7):
    """Deterministic split: every ``val_every``-th file (by sorted index) is val."""
    train = [f for i, f in enumerate(files) if i % val_every != val_offset]
    val = [f for i, f in enumerate(files) if i % val_every == val_offset]
    return train, val


def read_texts(root: Path, files: list[str], max_chars: int) -> tuple[list[str], list[str]]:
    """Read files in order until ``max_chars`` characters are collected."""
    texts, used, total = [], [], 0
    for f in files:
        t = (root / f).read_text(encoding="utf-8", errors="replace")
        if not t.strip():
            continue
        texts.append(t)
        used.append(f)
        total += len(t)
        if total >= max_chars:
            break
    return texts, used


def data_hash(root: Path, files: list[str]) -> str:
    """sha256 over (relative path, content) of every file used."""
    h = hashlib.sha256()
    for f in files:
        h.update(f.encode())
        h.update(b"\0")
        h.update((root / f).read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE with the three Qwen specials appended at the end of the vocab."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIALS),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens(SPECIALS)
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    return tok


def save_tokenizer(tok, out: Path):
    """Save as tokenizer.json + tokenizer_config.json (loadable by mlx_lm.load)."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    # keep the chat template inside tokenizer_config.json as well (older loaders)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg["model_max_length"] = 65536
    # portable across transformers 4.x and 5.x
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg.pop("backend", None)
    cfg.pop("extra_special_tokens", None)
    cfg["additional_special_tokens"] = ["<|im_start|>"]
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


# --------------------------------------------------------------------------
# model
# --------------------------------------------------------------------------
def make_config(vocab_size: int, args) -> dict:
    """The HF-style nested config (like Qwen3.6-35B-A3B's, scaled down)."""
    n_layers = 4
    text = {
        "model_type": "qwen3_5_moe_text",
        "attention_bias": False,
        "attn_output_gate": True,
        "bos_token_id": vocab_size - 3,
        "eos_token_id": vocab_size - 1,
        "pad_token_id": vocab_size - 3,
        "dtype": "bfloat16",
        "full_attention_interval": 4,
        "layer_types": [
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n_layers)
        ],
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": args.hidden,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": args.gdn_k_heads,
        "linear_num_value_heads": 2 * args.gdn_k_heads,
        "mamba_ssm_dtype": "float32",
        "max_position_embeddings": 262144,
        "moe_intermediate_size": args.moe_intermediate,
        "shared_expert_intermediate_size": args.moe_intermediate,
        "num_attention_heads": args.attn_heads,
        "num_key_value_heads": args.kv_heads,
        "num_experts": args.experts,
        "num_experts_per_tok": args.top_k,
        "norm_topk_prob": True,
        "num_hidden_layers": n_layers,
        "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000000,
            "rope_type": "default",
        },
        "tie_word_embeddings": False,
        "vocab_size": vocab_size,
    }
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": text,
        "tie_word_embeddings": False,
        "eos_token_id": vocab_size - 1,
    }


def power_product_inverse(A, C: int):
    """``(I + A)^-1`` for strictly lower-triangular ``A [..., C, C]`` (C a power of two) as
    ``(I - A)(I + A^2)(I + A^4)...``: ``log2(C)`` differentiable matmuls. Overflows where
    ``A``'s powers grow (keys strongly correlated, beta near 1, little decay)."""
    import mlx.core as mx

    eye = mx.eye(C, dtype=mx.float32)
    P = -A
    Tinv = eye + P
    n = 2
    while n < C:
        P = P @ P
        Tinv = Tinv @ (eye + P)
        n *= 2
    return Tinv


def chunked_gated_delta_update(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, *,
                               chunk: int = 32, inverse=None, **_):
    """Gated delta rule in chunked UT form (training only; same math as gated_delta_ops).

    Within a chunk of C steps, with cumulative log-decays ``lg``, the per-step
    corrections ``U`` solve ``(I + A) U = beta * (V - exp(lg) * K S0^T)`` where
    ``A[t, s] = beta_t exp(lg_t - lg_s) k_t . k_s`` (s < t); outputs are
    ``exp(lg) * Q S0^T + (tril(exp(lg_t - lg_s)) * Q K^T) U`` and the state
    carries to the next chunk.  The unit-triangular inverse is ``inverse(A, C)``
    (default ``power_product_inverse``: a product of ``log2(C)`` matrix factors), so
    everything is differentiable matmuls.
    """
    import mlx.core as mx
    import mlx.nn as nn

    if mask is not None:
        from mlx_lm.models.gated_delta import gated_delta_update

        return gated_delta_update(q, k, v, a, b, A_log, dt_bias, state, mask, use_kernel=False)
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    dtype = q.dtype
    beta = mx.sigmoid(b.astype(mx.float32))
    logg = -mx.exp(A_log.astype(mx.float32)) * nn.softplus((a + dt_bias).astype(mx.float32))
    if Hv // Hk > 1:
        q = mx.repeat(q, Hv // Hk, -2)
        k = mx.repeat(k, Hv // Hk, -2)

    def heads_first(x):
        return x.astype(mx.float32).transpose(0, 2, 1, 3)

    q, k, v = heads_first(q), heads_first(k), heads_first(v)
    beta, logg = beta.transpose(0, 2, 1), logg.transpose(0, 2, 1)
    C = chunk
    N = (T + C - 1) // C
    Tp = N * C
    if Tp != T:
        p4 = [(0, 0), (0, 0), (0, Tp - T), (0, 0)]
        p3 = [(0, 0), (0, 0), (0, Tp - T)]
        q, k, v = mx.pad(q, p4), mx.pad(k, p4), mx.pad(v, p4)
        beta, logg = mx.pad(beta, p3), mx.pad(logg, p3)
    q = q.reshape(B, Hv, N, C, Dk)
    k = k.reshape(B, Hv, N, C, Dk)
    v = v.reshape(B, Hv, N, C, Dv)
    beta = beta.reshape(B, Hv, N, C)
    lg = mx.cumsum(logg.reshape(B, Hv, N, C), axis=-1)
    incl = mx.tri(C, dtype=mx.bool_)
    strict = mx.tri(C, k=-1, dtype=mx.bool_)
    G = mx.exp(mx.where(incl, lg[..., :, None] - lg[..., None, :], -mx.inf))
    A = mx.where(strict, beta[..., :, None] * G * (k @ k.swapaxes(-1, -2)), 0.0)
    Tinv = (inverse or power_product_inverse)(A, C)
    QK = (q @ k.swapaxes(-1, -2)) * G
    eg = mx.exp(lg)
    tail = mx.exp(lg[..., -1:] - lg)
    S = mx.zeros((B, Hv, Dv, Dk), mx.float32) if state is None else state.astype(mx.float32)
    ys = []
    for i in range(N):
        kn, qn = k[:, :, i], q[:, :, i]
        St = S.swapaxes(-1, -2)
        rhs = beta[:, :, i, :, None] * (v[:, :, i] - eg[:, :, i, :, None] * (kn @ St))
        U = Tinv[:, :, i] @ rhs
        ys.append(eg[:, :, i, :, None] * (qn @ St) + QK[:, :, i] @ U)
        S = mx.exp(lg[:, :, i, -1])[..., None, None] * S + (U * tail[:, :, i, :, None]).swapaxes(-1, -2) @ kn
    y = mx.stack(ys, axis=2).reshape(B, Hv, Tp, Dv)[:, :, :T].transpose(0, 2, 1, 3)
    return y.astype(dtype), S


def depthwise_conv1d_shifted(conv, x):
    """``conv(x)`` for mlx-lm's depthwise, unpadded, bias-free GDN ``nn.Conv1d`` as K shifted
    multiply-adds (training only: MLX's CPU grouped convolution is slow, ~0.4 s per layer
    forward+backward at 8x256 tokens)."""
    w = conv.weight[:, :, 0]  # [C, K]
    K = w.shape[1]
    L = x.shape[1] - K + 1
    y = x[:, 0:L, :] * w[:, 0]
    for k in range(1, K):
        y = y + x[:, k:k + L, :] * w[:, k]
    return y


def check_conv_matches(C: int = 96, K: int = 4):
    """Start-up check: shifted-sum depthwise conv == nn.Conv1d(groups=C)."""
    import mlx.core as mx
    import mlx.nn as nn

    conv = nn.Conv1d(C, C, K, groups=C, bias=False, padding=0)
    x = mx.random.normal((2, 37, C), key=mx.random.key(7))
    err = mx.abs(conv(x) - depthwise_conv1d_shifted(conv, x)).max().item()
    if err > 1e-5:
        raise RuntimeError(f"shifted depthwise conv mismatch: {err:.2e}")
    return err


def check_chunked_matches_ops():
    """Start-up check: chunked form == mlx-lm's sequential gated_delta_ops."""
    import mlx.core as mx
    from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk

    key = mx.random.key(123)
    ks = mx.random.split(key, 6)
    B, T, Hk, Hv, D = 2, 45, 2, 4, 128
    q = mx.random.normal((B, T, Hk, D), key=ks[0])
    k = mx.random.normal((B, T, Hk, D), key=ks[1])
    v = mx.random.normal((B, T, Hv, D), key=ks[2])
    q, k = normalize_qk(q, k, inv_scale=D**-0.5, eps=1e-6)
    a = mx.random.normal((B, T, Hv), key=ks[3]) - 2
    b = mx.random.normal((B, T, Hv), key=ks[4]) + 1
    A_log = mx.log(mx.array([0.01, 0.3, 2.0, 8.0]))
    dt_bias = mx.ones(Hv)
    s0 = 0.1 * mx.random.normal((B, Hv, D, D), key=ks[5])
    y1, s1 = gated_delta_update(q, k, v, a, b, A_log, dt_bias, s0, use_kernel=False)
    y2, s2 = chunked_gated_delta_update(q, k, v, a, b, A_log, dt_bias, s0, chunk=16)
    ey = mx.abs(y1 - y2).max().item() / max(mx.abs(y1).max().item(), 1e-6)
    es = mx.abs(s1 - s2).max().item() / max(mx.abs(s1).max().item(), 1e-6)
    if ey > 1e-4 or es > 1e-4:
        raise RuntimeError(f"chunked GDN mismatch vs gated_delta_ops: y {ey:.2e} state {es:.2e}")
    return max(ey, es)


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--aux-coef", type=float, default=0.01, help="router load-balance loss")
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--moe-intermediate", type=int, default=128)
    p.add_argument("--attn-heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--gdn-k-heads", type=int, default=2)
    p.add_argument("--max-chars", type=int, default=8_000_000, help="training text cap")
    p.add_argument("--val-windows", type=int, default=8)
    p.add_argument("--stop-at", type=int, default=None,
                   help="stop after this step while keeping the --steps schedule (reproduces a run "
                        "that --max-minutes stopped early)")
    p.add_argument("--max-minutes", type=float, default=19.0,
                   help="safety stop; the run is deterministic only if it is not hit")
    p.add_argument("--no-fast-blas", action="store_true")
    return p.parse_args(argv)


def main(argv=None):
    """Train, quantise and save the fixture; print a summary."""
    args = parse_args(argv)
    blas = _maybe_reexec_with_fast_blas(args)
    t_start = time.time()

    import numpy as np
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten, tree_map_with_path
    import mlx_lm
    from mlx_lm.models import qwen3_5, qwen3_5_moe
    from mlx_lm.utils import quantize_model, save_config, save_model

    def log(msg):
        print(f"[train_fixture {time.time() - t_start:7.1f}s] {msg}", file=sys.stderr, flush=True)

    log(f"blas={blas}; checking chunked GDN against gated_delta_ops")
    chk = check_chunked_matches_ops()
    chk_conv = check_conv_matches()
    log(f"chunked GDN max rel err {chk:.2e}; shifted conv max err {chk_conv:.1e}")

    # ---- data + tokenizer
    root, files = stdlib_files()
    train_files, val_files = split_files(files)
    train_texts, train_used = read_texts(root, train_files, args.max_chars)
    val_texts, val_used = read_texts(root, val_files, args.max_chars // 10)
    dhash = data_hash(root, train_used + val_used)
    list_hash = hashlib.sha256("\n".join(files).encode()).hexdigest()
    log(f"{len(files)} stdlib files; train {len(train_used)} files / {sum(map(len, train_texts))} chars, "
        f"val {len(val_used)} files / {sum(map(len, val_texts))} chars")
    tok = train_tokenizer(train_texts, args.vocab)
    eot = tok.token_to_id("<|endoftext|>")

    def encode_all(texts):
        ids = []
        for enc in tok.encode_batch(texts):
            ids.extend(enc.ids)
            ids.append(eot)
        return np.array(ids, dtype=np.int32)

    train_ids = encode_all(train_texts)
    val_ids = encode_all(val_texts)
    log(f"tokenizer vocab {tok.get_vocab_size()}; train {train_ids.size} tokens, val {val_ids.size} tokens "
        f"({sum(map(len, train_texts)) / train_ids.size:.2f} chars/token)")

    # ---- model
    config = make_config(args.vocab, args)
    mx.random.seed(args.seed)
    model = qwen3_5_moe.Model(qwen3_5_moe.ModelArgs.from_dict(config))
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    log(f"model: {n_params / 1e6:.2f}M parameters")

    router_logits: list = []

    class _RecordingGate(nn.Linear):
        def __call__(self, x):
            y = super().__call__(x)
            router_logits.append(y)
            return y

    layers = model.language_model.model.layers
    for layer in layers:
        g = _RecordingGate(args.hidden, args.experts, bias=False)
        g.weight = layer.mlp.gate.weight
        layer.mlp.gate = g

    orig_gdu = qwen3_5.gated_delta_update
    qwen3_5.gated_delta_update = chunked_gated_delta_update

    class _ShiftedConv(nn.Conv1d):
        def __call__(self, x):
            return depthwise_conv1d_shifted(self, x)

    gdn_convs = [layer.linear_attn.conv1d for layer in layers if layer.is_linear]
    for c in gdn_convs:
        c.__class__ = _ShiftedConv

    E, K = args.experts, args.top_k

    def loss_fn(model, x, y):
        router_logits.clear()
        logits = model(x)
        ce = nn.losses.cross_entropy(logits.astype(mx.float32), y).mean()
        aux = mx.array(0.0)
        for rl in router_logits:
            probs = mx.softmax(rl.astype(mx.float32), axis=-1)
            inds = mx.stop_gradient(mx.argpartition(probs, kth=-K, axis=-1)[..., -K:])
            frac = mx.zeros((E,)).at[inds.reshape(-1)].add(1.0) / inds.size
            aux = aux + E * (mx.stop_gradient(frac) * probs.reshape(-1, E).mean(axis=0)).sum()
        aux = aux / len(router_logits)
        router_logits.clear()
        return ce + args.aux_coef * aux, (ce, aux)

    sched = optim.join_schedules(
        [optim.linear_schedule(args.lr * 0.02, args.lr, args.warmup),
         optim.cosine_decay(args.lr, max(1, args.steps - args.warmup), args.lr * 0.05)],
        [args.warmup],
    )
    opt = optim.AdamW(learning_rate=sched, weight_decay=0.01, betas=[0.9, 0.98])
    vg = nn.value_and_grad(model, loss_fn)
    state = [model.state, opt.state]

    def train_step(x, y):
        (loss, (ce, aux)), grads = vg(model, x, y)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        return ce, aux

    def eval_step(x, y):
        logits = model(x)
        return nn.losses.cross_entropy(logits.astype(mx.float32), y).mean()

    T, Bsz = args.seq_len, args.batch
    rng = np.random.default_rng(args.seed)
    vrng = np.random.default_rng(args.seed + 1)
    vstarts = vrng.integers(0, val_ids.size - T - 1, size=args.val_windows)
    vx = np.stack([val_ids[s:s + T + 1] for s in vstarts])

    def val_loss_fp():
        model.eval()
        losses = [eval_step(mx.array(vx[i:i + 8, :-1]), mx.array(vx[i:i + 8, 1:])).item()
                  for i in range(0, len(vx), 8)]
        model.train()
        return float(np.mean(losses))

    model.train()
    mx.eval(model.parameters())
    t_train = time.time()
    ce_hist = []
    steps_done = 0
    stopped_early = False
    for step in range(1, args.steps + 1):
        starts = rng.integers(0, train_ids.size - T - 1, size=Bsz)
        batch = np.stack([train_ids[s:s + T + 1] for s in starts])
        ce, aux = train_step(mx.array(batch[:, :-1]), mx.array(batch[:, 1:]))
        mx.eval(ce, aux, state)
        ce_hist.append(ce.item())
        steps_done = step
        if step % 20 == 0 or step == 1:
            el = time.time() - t_train
            log(f"step {step}/{args.steps} ce {np.mean(ce_hist[-20:]):.3f} aux {aux.item():.3f} "
                f"lr {sched(mx.array(step)).item():.2e} {el / step:.2f}s/step")
        if step == args.steps // 2:
            log(f"step {step} val ce {val_loss_fp():.3f}")
        if args.stop_at is not None and step >= args.stop_at:
            log(f"--stop-at {args.stop_at} reached")
            stopped_early = True
            break
        if (time.time() - t_start) / 60 > args.max_minutes:
            log(f"max-minutes reached at step {step}: stopping early (run is not the default recipe)")
            stopped_early = True
            break
    train_wall = time.time() - t_train
    final_train = float(np.mean(ce_hist[-20:]))
    val_fp = val_loss_fp()
    log(f"training done: {steps_done} steps in {train_wall:.0f}s; train ce {final_train:.3f}; val ce (fp32) {val_fp:.3f}")

    # ---- restore stock modules, cast + quantise like mlx_lm.convert -q
    qwen3_5.gated_delta_update = orig_gdu
    for c in gdn_convs:
        c.__class__ = nn.Conv1d
    for layer in layers:
        g = nn.Linear(args.hidden, args.experts, bias=False)
        g.weight = layer.mlp.gate.weight
        layer.mlp.gate = g
    model.eval()
    cast_pred = model.cast_predicate

    def set_dtype(k, v):
        if cast_pred(k) and mx.issubdtype(v.dtype, mx.floating):
            return v.astype(mx.bfloat16)
        return v

    model.update(tree_map_with_path(set_dtype, model.parameters()))
    model, qconfig = quantize_model(model, config, 64, 4, mode="affine",
                                    quant_predicate=model.quant_predicate)

    out = args.out.resolve()
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_model(tmp, model)
    save_config(qconfig, tmp / "config.json")
    save_tokenizer(tok, tmp)

    # numerics reference: a val-split file, tokenised, stored with the fixture
    ref_file, ref_ids = None, None
    for f in val_used:
        ids = tok.encode((root / f).read_text(encoding="utf-8", errors="replace")).ids
        if len(ids) >= 320:
            ref_file, ref_ids = f, ids[:320]
            break
    (tmp / "numerics_reference.json").write_text(json.dumps({
        "source": f"stdlib:{ref_file}", "python": platform.python_version(),
        "split": "val", "ids": ref_ids}) + "\n")

    # ---- reload through mlx_lm.load (stock code path) and evaluate
    qwen3_5.gated_delta_update = orig_gdu
    qmodel, qtok = mlx_lm.load(str(tmp))
    qlosses = []
    for i in range(0, len(vx), 8):
        logits = qmodel(mx.array(vx[i:i + 8, :-1]))
        qlosses.append(nn.losses.cross_entropy(logits.astype(mx.float32), mx.array(vx[i:i + 8, 1:])).mean().item())
    val_q = float(np.mean(qlosses))
    prompt = "def "
    sample = mlx_lm.generate(qmodel, qtok, prompt=prompt, max_tokens=48, verbose=False)
    log(f"4-bit reload: val ce {val_q:.3f} (ppl {math.exp(val_q):.1f}); sample: {prompt + sample!r}")

    size = sum(p.stat().st_size for p in tmp.iterdir())
    wall = time.time() - t_start
    cmd = "python benchmarks/train_fixture.py" + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip()
    t = config["text_config"]
    recipe = f"""# qwen35moe-tiny-trained: recipe

Generated by `benchmarks/train_fixture.py` (do not edit by hand).

- Command: `{cmd}`
- Seed: {args.seed}; steps: {steps_done} of a {args.steps}-step schedule{f' (stopped early; reproduce with `--steps {args.steps} --stop-at {steps_done}`)' if stopped_early else ''}; batch {Bsz} x {T} tokens; AdamW lr {args.lr} (warmup {args.warmup}, cosine to 5%), wd 0.01, clip 1.0, router aux-loss {args.aux_coef}
- Architecture: mlx-lm `qwen3_5_moe`; hidden {t['hidden_size']}; 4 layers (GDN, GDN, GDN, attention; full_attention_interval 4); GDN Hk {t['linear_num_key_heads']} x 128, Hv {t['linear_num_value_heads']} x 128, conv 4; attention {t['num_attention_heads']} q heads / {t['num_key_value_heads']} kv heads, head_dim 256, partial rotary 0.25, theta 1e7, output gate; MoE {t['num_experts']} experts top-{t['num_experts_per_tok']} (intermediate {t['moe_intermediate_size']}) + shared expert ({t['shared_expert_intermediate_size']}); vocab {t['vocab_size']}; {n_params / 1e6:.2f}M parameters
- Quantisation: cast to bf16 (A_log kept fp32), then `mlx_lm.utils.quantize_model(group_size=64, bits=4, mode="affine")` with the model's `quant_predicate` (8-bit `mlp.gate`, `mlp.shared_expert_gate`); saved with `save_model` / `save_config`
- Data: Python {platform.python_version()} standard library `.py` files (`sysconfig.get_paths()["stdlib"]`, sorted, excluding test dirs / `test_*.py` / site-packages); every 20th file (index % 20 == 7) is validation. {len(files)} files listed; training text = the first {len(train_used)} train files ({sum(map(len, train_texts))} chars, {train_ids.size} tokens); validation = {len(val_used)} files ({val_ids.size} tokens)
- File-list sha256: `{list_hash}`
- Data (paths + contents of used files) sha256: `{dhash}`
- Tokenizer: byte-level BPE (`tokenizers`), {tok.get_vocab_size()} ids; specials appended last: `<|endoftext|>` {eot}, `<|im_start|>` {tok.token_to_id('<|im_start|>')}, `<|im_end|>` {tok.token_to_id('<|im_end|>')} (eos); trivial ChatML chat template
- Training-time GDN: chunked UT form (checked vs `gated_delta_ops`: max rel err {chk:.1e}); depthwise conv as shifted multiply-adds (checked vs `nn.Conv1d`: {chk_conv:.1e}); BLAS: {blas}
- Final train cross-entropy (mean of last 20 steps): {final_train:.4f} (ppl {math.exp(final_train):.2f})
- Final val cross-entropy, fp32 weights: {val_fp:.4f} (ppl {math.exp(val_fp):.2f})
- Final val cross-entropy, saved 4-bit checkpoint via `mlx_lm.load`: {val_q:.4f} (ppl {math.exp(val_q):.2f}) over {len(vx)} windows of {T}
- Training wall time: {train_wall:.0f} s; total script wall time: {wall:.0f} s; platform: {platform.machine()} {platform.system()}, mlx {mx.__version__}, mlx-lm {mlx_lm.__version__}
- Greedy sample from `{prompt}`: `{(prompt + sample)!r}`
- `numerics_reference.json`: first 320 tokens of `{ref_file}` (validation split) for `benchmarks/numerics.py`
- Size on disk: {size / 1e6:.2f} MB
"""
    (tmp / "RECIPE.md").write_text(recipe)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    log(f"saved {out} ({size / 1e6:.2f} MB)")
    print(recipe)
    return 0


if __name__ == "__main__":
    sys.exit(main())
