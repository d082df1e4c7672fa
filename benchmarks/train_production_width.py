#!/usr/bin/env python
"""Train a Qwen3.5-MoE model at Qwen3.6-35B-A3B's per-layer widths and save it as an MLX 4-bit checkpoint.

The production-width counterpart of ``benchmarks/train_fixture.py`` (whose data, tokenizer,
config and conv functions it reuses): mlx-lm's ``qwen3_5_moe``
architecture with hidden 2048, 4 layers (GDN, GDN, GDN, attention), GDN 16 key heads / 32
value heads of 128, attention 16 query / 2 KV heads of 256 with partial RoPE 0.25 and the
output gate, 64 experts of 512 top-8 plus the 512-wide shared expert, and a byte-level BPE
vocabulary of 16384 trained on the Python standard library's sources (the tiny fixture's
corpus and split). Training is bf16 (parameters, activations and AdamW state; A_log fp32)
from a fixed seed on the GPU (eager steps, each built while the GPU runs the last;
``--compile on`` traces the step with ``mx.compile``, at the cost of JIT-compiling every
fused kernel on a cold machine); the checkpoint is cast to bf16 and
quantised with mlx-lm's own ``quantize_model`` (affine, group 64, 4 bits; ``mlp.gate`` and
``mlp.shared_expert_gate`` at 8 bits, the model's ``quant_predicate``) and saved with
``save_model`` / ``save_config``, like ``mlx_lm.convert -q``.

Training-only forms (the saved model is mlx-lm's; each is checked against mlx-lm's own code
at start-up): the GDN recurrence in chunked UT form (``chunked_gated_delta_update``: the tiny
fixture's form with a block-doubling triangular inverse, which stays accurate where the
fixture's power product overflows fp32);
the depthwise conv as shifted multiply-adds; and, with ``--moe-train dense`` (the default),
the MoE experts as two dense matmuls over all experts with the router weights scattered
into a ``[tokens, experts]`` matrix (zero for experts not chosen): the same function and
gradients as mlx-lm's ``SwitchGLU`` gather path, in plain GEMMs (8x the expert FLOPs, no
gather/scatter or grouped GEMM). ``--moe-train sparse`` trains through mlx-lm's
``SwitchGLU`` (``gather_mm``) instead.

Time: ``--time-budget-s`` counts from the script's start (data preparation included);
training stops ``--post-reserve-s`` before its end, and the model is then evaluated and
saved, which may take longer than the reserve (176 s on an 80 GB H100 against 120 s). The
production-width preset trains 100 steps (on that H100 a budget of 330 s let all 100 run:
training ended at 198 s of the 210 s it allowed; a run cut by the budget says so in its
recipe); ``--steps auto`` fits the step count to the budget from the measured time of
warm-up steps 3-12 (recorded; ``--steps N`` reproduces a run's schedule). Output: the
checkpoint folder with ``RECIPE.md``, ``summary.json`` (also ``--summary``) and ``numerics_reference.json`` (token ids
of validation-split files, for ``benchmarks/numerics_long.py``). A folder whose
``summary.json`` carries the same recipe key is reused unless ``--force``.

Usage::

    python benchmarks/train_production_width.py                      # GPU, <= 6 min
    python benchmarks/train_production_width.py --smoke --out /tmp/pw # CPU toy run, ~2 min
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_fixture as tf  # noqa: E402

DEFAULT_OUT = Path(os.environ.get("MLX_LILY_CACHE_DIR") or Path.home() / ".cache" / "mlx-lily") \
    / "models" / "qwen35moe-production-width"
SUMMARY_SCHEMA = "mlx-lily-train-production-width"
#: device memory from which ``--micro-batch auto`` runs the whole batch at once (the 4 x 4,096
#: token batch trains on a 141 GB H200 and runs out of memory on an 80 GB H100)
WHOLE_BATCH_MEMORY = 120 * 10**9
REFERENCE_TOKENS = 40960  # ids stored for numerics_long.py (32K context + decode steps)

#: Qwen3.6-35B-A3B's per-layer widths (real model: 256 experts, 40 layers, vocab 248320).
PRESETS = {
    "production-width": dict(
        vocab=16384, hidden=2048, gdn_k_heads=16, attn_heads=16, kv_heads=2, experts=64,
        top_k=8, moe_intermediate=512, batch=4, seq_len=4096, lr=8e-4, warmup=40,
        val_windows=16, max_chars=0, time_budget_s=360.0, post_reserve_s=120.0,
        steps="100", dtype="bfloat16", sample_tokens=32),
    # CPU toy scale: same code paths, a minute or two on two cores
    "smoke": dict(
        vocab=2048, hidden=256, gdn_k_heads=2, attn_heads=4, kv_heads=1, experts=16,
        top_k=4, moe_intermediate=128, batch=4, seq_len=256, lr=3e-3, warmup=4,
        val_windows=2, max_chars=1_000_000, time_budget_s=170.0, post_reserve_s=45.0,
        steps="8", dtype="float32", sample_tokens=8),
}


# --------------------------------------------------------------------------
# chunked Gated DeltaNet with a stable triangular inverse (training only)
# --------------------------------------------------------------------------
def unit_lower_inverse(A, C: int):
    """``(I + A)^-1`` for strictly lower-triangular ``A [..., C, C]`` (C a power of two) by
    block doubling: with ``X_b`` the block-diagonal inverse of block size b and ``L`` the
    lower off-diagonal blocks of each 2b-block, ``X_2b = X_b - X_b L X_b``. Two matmuls a
    level; every intermediate is an exact inverse of a diagonal block, so nothing grows
    beyond the inverse itself (the product ``(I - A)(I + A^2)(I + A^4)...`` forms powers of
    A that overflow fp32 for correlated keys with beta near 1)."""
    import mlx.core as mx
    import numpy as np

    X = mx.broadcast_to(mx.eye(C, dtype=A.dtype), A.shape)
    idx = np.arange(C)
    b = 1
    while b < C:
        same2b = (idx[:, None] // (2 * b)) == (idx[None, :] // (2 * b))
        lower = ((idx[:, None] // b) % 2 == 1) & ((idx[None, :] // b) % 2 == 0)
        L = A * mx.array((same2b & lower).astype(np.float32), dtype=A.dtype)
        X = X - X @ (L @ X)
        b *= 2
    return X


def chunked_gated_delta_update(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, *,
                               chunk: int = 32, **_):
    """The gated delta rule in chunked UT form: ``train_fixture.chunked_gated_delta_update``
    (same math as mlx-lm's ``gated_delta_ops``) with the unit-triangular inverse by
    ``unit_lower_inverse``. Shapes as ``gated_delta_update``: q/k ``[B, T, Hk, Dk]``, v
    ``[B, T, Hv, Dv]``, a/b ``[B, T, Hv]``; returns ``(y [B, T, Hv, Dv], state [B, Hv, Dv,
    Dk] fp32)``; gates, beta and the state in fp32.

    Raises:
        ValueError: ``chunk`` is not a power of two.
    """
    if chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two, got {chunk}")
    return tf.chunked_gated_delta_update(q, k, v, a, b, A_log, dt_bias, state, mask,
                                         chunk=chunk, inverse=unit_lower_inverse)


def _check_limit(limit: float, cuda_limit: float) -> float:
    """A start-up check's relative-error limit: ``cuda_limit`` on MLX's CUDA backend, where
    the H200 read 2.6e-3 (chunked GDN) and 2.6e-4 (dense MoE) against 1e-3 / 1e-4 (fp32
    matmuls there likely run as TF32: MLX_ENABLE_TF32 defaults on), else ``limit``."""
    import mlx.core as mx

    on_cuda = mx.default_device() == mx.gpu and mx.cuda.is_available()
    return cuda_limit if on_cuda else limit


def check_chunked_matches_ops(chunk: int = 32):
    """Start-up check: ``chunked_gated_delta_update`` == mlx-lm's ``gated_delta_ops`` on
    random gates and on the hard case (keys 0.95-correlated, beta ~ 0.98, decay ~ 1), where
    the power-product inverse of ``train_fixture`` overflows. Returns the max relative error."""
    import mlx.core as mx
    from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk

    ks = mx.random.split(mx.random.key(123), 8)
    B, T, Hk, Hv, D = 2, 2 * chunk + 13, 2, 4, 128
    worst = 0.0
    for hard in (False, True):
        q = mx.random.normal((B, T, Hk, D), key=ks[0])
        k = mx.random.normal((B, T, Hk, D), key=ks[1])
        if hard:
            k = 0.95 * mx.random.normal((1, 1, Hk, D), key=ks[6]) + 0.05 * k
        v = mx.random.normal((B, T, Hv, D), key=ks[2])
        q, k = normalize_qk(q, k, inv_scale=D**-0.5, eps=1e-6)
        a = mx.full((B, T, Hv), -6.0) if hard else mx.random.normal((B, T, Hv), key=ks[3]) - 2
        b = mx.full((B, T, Hv), 4.0) if hard else mx.random.normal((B, T, Hv), key=ks[4]) + 1
        A_log = mx.log(mx.array([0.01, 0.3, 2.0, 8.0]))
        dt_bias = mx.zeros(Hv) if hard else mx.ones(Hv)
        s0 = 0.1 * mx.random.normal((B, Hv, D, D), key=ks[5])
        y1, s1 = gated_delta_update(q, k, v, a, b, A_log, dt_bias, s0, use_kernel=False)
        y2, s2 = chunked_gated_delta_update(q, k, v, a, b, A_log, dt_bias, s0, chunk=chunk)
        ey = mx.abs(y1 - y2).max().item() / max(mx.abs(y1).max().item(), 1e-6)
        es = mx.abs(s1 - s2).max().item() / max(mx.abs(s1).max().item(), 1e-6)
        worst = max(worst, ey, es)
    if not worst <= _check_limit(1e-3, 5e-3):
        raise RuntimeError(f"chunked GDN mismatch vs gated_delta_ops: {worst:.2e}")
    return worst


# --------------------------------------------------------------------------
# dense-dispatch MoE block (training only)
# --------------------------------------------------------------------------
def dense_moe_block(block, x, router_logits_sink=None):
    """``Qwen3NextSparseMoeBlock.__call__`` with the routed experts as dense matmuls.

    Routing exactly as mlx-lm: ``softmax(gate(x))`` (precise), the top-k by
    ``argpartition``, scores renormalised when ``norm_topk_prob``. The k scores are then
    scattered into ``w [N, E]`` (zero elsewhere) and ``y = ((silu(x Wg^T) * (x Wu^T)) *
    repeat(w, I)) Wd`` with ``Wg, Wu`` the experts' ``[E*I, D]`` stacks and ``Wd`` the
    ``[E*I, D]`` stack of down projections: ``sum_j s_j expert_{e_j}(x)``, the same value and
    gradients (an expert with weight 0 gets none) as the ``SwitchGLU`` gather path.

    Args:
        block: an un-quantised ``Qwen3NextSparseMoeBlock``.
        x: ``[..., D]`` activations.
        router_logits_sink: list the router logits ``[..., E]`` are appended to (aux loss).
    Returns:
        ``[..., D]`` in x's dtype.
    """
    import mlx.core as mx
    import mlx.nn as nn

    logits = block.gate(x)
    if router_logits_sink is not None:
        router_logits_sink.append(logits)
    gates = mx.softmax(logits, axis=-1, precise=True)
    k = block.top_k
    inds = mx.stop_gradient(mx.argpartition(gates, kth=-k, axis=-1)[..., -k:])
    scores = mx.take_along_axis(gates, inds, axis=-1)
    if block.norm_topk_prob:
        scores = scores / scores.sum(axis=-1, keepdims=True)
    sw = block.switch_mlp
    wg, wu, wd = sw.gate_proj.weight, sw.up_proj.weight, sw.down_proj.weight  # [E,I,D] x2, [E,D,I]
    E, I, D = wg.shape
    lead = x.shape[:-1]
    xf = x.reshape(-1, D)
    n = xf.shape[0]
    onehot = (inds.reshape(n, k)[..., None] == mx.arange(E, dtype=inds.dtype)).astype(scores.dtype)
    w = (onehot * scores.reshape(n, k, 1)).sum(axis=1)  # [N, E]
    g = xf @ wg.reshape(E * I, D).T
    u = xf @ wu.reshape(E * I, D).T
    h = nn.silu(g) * u
    h = (h.reshape(n, E, I) * w[..., None].astype(h.dtype)).reshape(n, E * I)
    y = h @ wd.transpose(0, 2, 1).reshape(E * I, D)
    shared = mx.sigmoid(block.shared_expert_gate(xf)) * block.shared_expert(xf)
    return (y + shared).reshape(*lead, D)


def check_dense_moe_matches(hidden: int = 64, inter: int = 32, experts: int = 8, k: int = 3):
    """Start-up check: ``dense_moe_block`` == mlx-lm's ``Qwen3NextSparseMoeBlock`` (fp32)."""
    import mlx.core as mx
    from mlx_lm.models import qwen3_next

    args = qwen3_next.ModelArgs(
        model_type="qwen3_next", hidden_size=hidden, num_hidden_layers=1, intermediate_size=inter,
        num_attention_heads=2, num_key_value_heads=1, linear_num_value_heads=2,
        linear_num_key_heads=1, linear_key_head_dim=32, linear_value_head_dim=32,
        linear_conv_kernel_dim=4, num_experts=experts, num_experts_per_tok=k,
        decoder_sparse_step=1, shared_expert_intermediate_size=inter, mlp_only_layers=[],
        moe_intermediate_size=inter, rms_norm_eps=1e-6, vocab_size=64, rope_theta=1e4,
        partial_rotary_factor=0.25, max_position_embeddings=128, norm_topk_prob=True,
        head_dim=32)
    mx.random.seed(11)
    block = qwen3_next.Qwen3NextSparseMoeBlock(args)
    x = mx.random.normal((2, 40, hidden), key=mx.random.key(5))
    ref = block(x)
    got = dense_moe_block(block, x)
    err = (mx.abs(ref - got).max() / mx.maximum(mx.abs(ref).max(), 1e-6)).item()
    if err > _check_limit(1e-4, 1e-3):
        raise RuntimeError(f"dense MoE block mismatch vs Qwen3NextSparseMoeBlock: {err:.2e}")
    return err


# --------------------------------------------------------------------------
# args
# --------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="production-width")
    p.add_argument("--smoke", action="store_true", help="--preset smoke (CPU toy scale)")
    p.add_argument("--out", type=Path, default=None,
                   help=f"checkpoint folder (default {DEFAULT_OUT}; smoke: a temp folder)")
    p.add_argument("--summary", type=Path, default=None, help="also write summary.json here")
    p.add_argument("--force", action="store_true", help="train even if --out holds this recipe")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", default=None, help="'auto' (fit the time budget) or a step count")
    p.add_argument("--stop-at", type=int, default=None,
                   help="stop after this step, keeping the --steps schedule")
    p.add_argument("--max-steps", type=int, default=4000, help="upper bound for --steps auto")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="wall-time cap of the whole script (data prep, training, saving)")
    p.add_argument("--post-reserve-s", type=float, default=None,
                   help="seconds kept for evaluation, quantisation and saving after training")
    p.add_argument("--moe-train", choices=("dense", "sparse"), default="dense")
    p.add_argument("--gdn-chunk", type=int, default=64, help="power of two")
    p.add_argument("--compile", choices=("on", "off"), default="off",
                   help="mx.compile the train step (off: eager steps, the next one built while "
                        "the GPU runs the last; a cold compile JITs every fused kernel first)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                   help="training dtype (smoke: float32, MLX's CPU bf16 matmuls are slow)")
    p.add_argument("--sample-tokens", type=int, default=None)
    p.add_argument("--no-fast-blas", action="store_true",
                   help="CPU only: skip train_fixture's OpenBLAS shim")
    p.add_argument("--fast-blas", action="store_true",
                   help="CPU runs of other presets: use train_fixture's OpenBLAS shim too")
    p.add_argument("--micro-batch", default="auto",
                   help="rows per forward/backward, gradients averaged over the batch's rows "
                        "('auto': the whole batch where the GPU has >= %d GB, else 1 row)"
                        % (WHOLE_BATCH_MEMORY // 10**9))
    p.add_argument("--aux-coef", type=float, default=0.01, help="router load-balance loss")
    for name, typ in (("vocab", int), ("hidden", int), ("gdn-k-heads", int), ("attn-heads", int),
                      ("kv-heads", int), ("experts", int), ("top-k", int),
                      ("moe-intermediate", int), ("batch", int), ("seq-len", int), ("lr", float),
                      ("warmup", int), ("val-windows", int), ("max-chars", int)):
        p.add_argument(f"--{name}", type=typ, default=None, help="override the preset")
    a = p.parse_args(argv)
    if a.smoke:
        a.preset = "smoke"
    for key, val in PRESETS[a.preset].items():
        if getattr(a, key, None) is None:
            setattr(a, key, val)
    if a.steps is None:
        a.steps = "auto"
    if a.steps != "auto":
        a.steps = int(a.steps)
    if a.out is None:
        a.out = DEFAULT_OUT if a.preset != "smoke" else Path("/tmp") / f"mlx-lily-pw-smoke-{os.getuid()}"
    return a


def resolve_micro_batch(value, batch: int, mx) -> int:
    """Rows per forward/backward: ``value`` (an int, or ``"auto"``: the whole ``batch`` on
    the CPU or a GPU with at least ``WHOLE_BATCH_MEMORY`` bytes, else 1). Raises
    ``SystemExit`` naming ``--micro-batch`` unless it divides ``batch``."""
    if value == "auto":
        if mx.default_device() != mx.gpu:
            rows = batch
        else:  # Metal reports memory_size, MLX's CUDA build total_memory; unknown: 1 row
            info = mx.device_info()
            mem = info.get("memory_size") or info.get("total_memory") or 0
            rows = batch if mem >= WHOLE_BATCH_MEMORY else 1
    else:
        try:
            rows = int(value)
        except ValueError:
            raise SystemExit(f"--micro-batch {value!r}: give 'auto' or a row count") from None
    if rows < 1 or batch % rows:
        raise SystemExit(f"--micro-batch {rows} must divide --batch {batch}")
    return rows


def accumulated_grads(vg, model, x, y, rows: int):
    """One step's ``(ce, aux, grads)`` over ``rows`` rows of ``x`` / ``y`` ([B, T] int32
    token ids) at a time: each slice's loss and gradients (``vg(model, x, y)`` ->
    ``((loss, (ce, aux)), grads)``) evaluated before the next, so its activations are
    freed; gradients summed in fp32, averaged and cast to each parameter's dtype; ce and
    aux the slices' means. For a loss that is a mean over equal-length rows this is the
    whole batch's gradient; the router load-balance term is each slice's own."""
    import mlx.core as mx
    from mlx.utils import tree_map

    n = x.shape[0] // rows
    acc = None
    ces, auxes = [], []
    for i in range(n):
        sl = slice(i * rows, (i + 1) * rows)
        (_, (ce, aux)), grads = vg(model, x[sl], y[sl])
        grads = tree_map(lambda g: g.astype(mx.float32), grads)
        acc = grads if acc is None else tree_map(mx.add, acc, grads)
        ces.append(ce)
        auxes.append(aux)
        mx.eval(acc, ces, auxes)
    grads = tree_map(lambda g, p: (g / n).astype(p.dtype), acc, model.trainable_parameters())
    return mx.mean(mx.stack(ces)), mx.mean(mx.stack(auxes)), grads


def recipe_key(args, list_hash: str, versions: dict) -> str:
    """sha256 of what determines the trained model (not the output paths or the budget)."""
    keep = {k: (v if not isinstance(v, Path) else None) for k, v in sorted(vars(args).items())
            if k not in ("out", "summary", "force", "time_budget_s", "post_reserve_s", "smoke",
                         "no_fast_blas", "fast_blas", "sample_tokens")}
    if keep.get("micro_batch") == keep.get("batch"):  # whole batches: the keys of before
        keep.pop("micro_batch", None)
    blob = json.dumps({"args": keep, "files": list_hash, "versions": versions}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def lr_at(step: int, total: int, lr: float, warmup: int) -> float:
    """Linear warm-up from 2% to ``lr`` over ``warmup`` steps, then cosine to 5% at ``total``."""
    if step <= warmup:
        return lr * (0.02 + 0.98 * step / max(1, warmup))
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return lr * (0.05 + 0.95 * 0.5 * (1.0 + math.cos(math.pi * frac)))


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------
def main(argv=None):
    """Train, evaluate, quantise and save; print the recipe; write summary.json. Exit 0."""
    args = parse_args(argv)
    if args.preset == "smoke" or args.fast_blas:
        tf._maybe_reexec_with_fast_blas(args)  # CPU runs: train_fixture's BLAS shim
    t_start = time.time()

    import numpy as np
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten, tree_map_with_path
    import mlx_lm
    from mlx_lm.models import qwen3_5, qwen3_5_moe, qwen3_next
    from mlx_lm.utils import quantize_model, save_config, save_model

    def log(msg):
        print(f"[train_production_width {time.time() - t_start:7.1f}s] {msg}", file=sys.stderr,
              flush=True)

    args.micro_batch = resolve_micro_batch(args.micro_batch, args.batch, mx)
    versions = {"python": platform.python_version(), "mlx": mx.__version__,
                "mlx_lm": mlx_lm.__version__}
    root, files = tf.stdlib_files()
    list_hash = hashlib.sha256("\n".join(files).encode()).hexdigest()
    key = recipe_key(args, list_hash, versions)
    out = args.out.expanduser().resolve()
    if not args.force and (out / "summary.json").is_file():
        try:
            old = json.loads((out / "summary.json").read_text())
        except (OSError, ValueError):
            old = {}
        if old.get("recipe_key") == key and (out / "config.json").is_file():
            log(f"{out} already holds this recipe (key {key[:12]}); reusing it (--force retrains)")
            old["reused"] = True
            if args.summary:
                args.summary.parent.mkdir(parents=True, exist_ok=True)
                args.summary.write_text(json.dumps(old, indent=1) + "\n")
            print(json.dumps(old, indent=1))
            return 0

    device = str(mx.default_device())
    use_compile = args.compile == "on"
    log(f"device {device}; mlx {mx.__version__}; mlx-lm {mlx_lm.__version__}; preset {args.preset}")
    chk_gdn = check_chunked_matches_ops(args.gdn_chunk)
    chk_conv = tf.check_conv_matches()
    chk_moe = check_dense_moe_matches()
    log(f"checks: chunked GDN {chk_gdn:.1e}, shifted conv {chk_conv:.1e}, dense MoE {chk_moe:.1e}")

    # ---- data + tokenizer (the tiny fixture's corpus and split)
    train_files, val_files = tf.split_files(files)
    cap = args.max_chars if args.max_chars > 0 else 1 << 62
    train_texts, train_used = tf.read_texts(root, train_files, cap)
    val_texts, val_used = tf.read_texts(root, val_files, cap)
    dhash = tf.data_hash(root, train_used + val_used)
    n_chars = sum(map(len, train_texts))
    log(f"{len(files)} stdlib files; train {len(train_used)} files / {n_chars} chars, "
        f"val {len(val_used)} files / {sum(map(len, val_texts))} chars")
    tok = tf.train_tokenizer(train_texts, args.vocab)
    eot = tok.token_to_id("<|endoftext|>")

    def encode_all(texts):
        ids = []
        for enc in tok.encode_batch(texts):
            ids.extend(enc.ids)
            ids.append(eot)
        return np.array(ids, dtype=np.int32)

    train_ids = encode_all(train_texts)
    val_ids = encode_all(val_texts)
    t_data = time.time() - t_start
    log(f"tokenizer vocab {tok.get_vocab_size()}; train {train_ids.size} tokens, val {val_ids.size} "
        f"tokens ({n_chars / train_ids.size:.2f} chars/token); data prep done")

    # ---- model (bf16; A_log fp32 as the model's cast_predicate says)
    config = tf.make_config(args.vocab, args)
    mx.random.seed(args.seed)
    model = qwen3_5_moe.Model(qwen3_5_moe.ModelArgs.from_dict(config))
    cast_pred = model.cast_predicate

    def to_dtype(dtype):
        def f(k, v):
            if cast_pred(k) and mx.issubdtype(v.dtype, mx.floating):
                return v.astype(dtype)
            return v
        model.update(tree_map_with_path(f, model.parameters()))

    train_dtype = getattr(mx, args.dtype)
    to_dtype(train_dtype)
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    E, K = args.experts, args.top_k
    active = n_params - len(config["text_config"]["layer_types"]) * 3 * args.hidden \
        * args.moe_intermediate * (E - K)
    log(f"model: {n_params / 1e6:.1f}M parameters ({active / 1e6:.1f}M active per token)")

    layers = model.language_model.model.layers
    router_logits: list = []
    moe_cls = qwen3_next.Qwen3NextSparseMoeBlock

    class _DenseMoe(moe_cls):
        def __call__(self, x):
            return dense_moe_block(self, x, router_logits)

    class _RecordingGate(nn.Linear):
        def __call__(self, x):
            y = super().__call__(x)
            router_logits.append(y)
            return y

    class _ShiftedConv(nn.Conv1d):
        def __call__(self, x):
            return tf.depthwise_conv1d_shifted(self, x)

    gdn_convs = [layer.linear_attn.conv1d for layer in layers if layer.is_linear]
    orig_gdu = qwen3_5.gated_delta_update

    def training_forms(on: bool, moe: bool | None = None):
        """Install (``on``) or remove the training-only forms; ``moe`` overrides for the
        MoE block alone."""
        moe = on if moe is None else moe
        qwen3_5.gated_delta_update = (
            (lambda *a, **kw: chunked_gated_delta_update(*a, chunk=args.gdn_chunk, **kw))
            if on else orig_gdu)
        for c in gdn_convs:
            c.__class__ = _ShiftedConv if on else nn.Conv1d
        for layer in layers:
            if args.moe_train == "dense":
                layer.mlp.__class__ = _DenseMoe if moe else moe_cls
            else:
                layer.mlp.gate.__class__ = _RecordingGate if moe else nn.Linear

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
        aux = aux / max(1, len(router_logits))
        router_logits.clear()
        return ce + args.aux_coef * aux, (ce, aux)

    opt = optim.AdamW(learning_rate=lr_at(1, 10**9, args.lr, args.warmup), weight_decay=0.01,
                      betas=[0.9, 0.98])
    opt.init(model.trainable_parameters())
    vg = nn.value_and_grad(model, loss_fn)
    state = [model.state, opt.state]

    def train_step(x, y):
        (_, (ce, aux)), grads = vg(model, x, y)
        grads, gnorm = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        return ce, aux, gnorm

    def train_step_micro(x, y):
        """``train_step`` in micro-batches (``accumulated_grads``), one clipped update."""
        ce, aux, grads = accumulated_grads(vg, model, x, y, args.micro_batch)
        grads, gnorm = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        return ce, aux, gnorm

    if args.micro_batch < args.batch:
        if use_compile:
            raise SystemExit("--compile on needs --micro-batch equal to --batch")
        train_step = train_step_micro
        log(f"micro-batches of {args.micro_batch} rows ({args.batch // args.micro_batch} "
            f"per step)")
    elif use_compile:
        from functools import partial

        train_step = partial(mx.compile, inputs=state, outputs=state)(train_step)

    T, Bsz = args.seq_len, args.batch
    rng = np.random.default_rng(args.seed)
    vrng = np.random.default_rng(args.seed + 1)
    vstarts = vrng.integers(0, val_ids.size - T - 1, size=args.val_windows)
    vx = np.stack([val_ids[s:s + T + 1] for s in vstarts])

    # MLX's CUDA gather_qmm puts (tokens x top-k) on a grid dimension, which CUDA caps at
    # 65,535 (4 windows of 4,096 tokens x 8 experts fail with "invalid argument"): the
    # 4-bit model is evaluated in calls of fewer rows
    q_windows = max(1, 65535 // (T * args.top_k))

    def val_ce(m, bs=4):
        losses = []
        for i in range(0, len(vx), bs):
            logits = m(mx.array(vx[i:i + bs, :-1]))
            ce = nn.losses.cross_entropy(logits.astype(mx.float32), mx.array(vx[i:i + bs, 1:]))
            losses.append(ce.mean().item())
        return float(np.mean(losses))

    budget_end = t_start + args.time_budget_s - args.post_reserve_s
    training_forms(True)
    model.train()
    mx.eval(model.parameters(), opt.state)
    total = args.steps if args.steps != "auto" else None
    calib = (3, 12)  # steps whose mean time sets --steps auto (after the first steps' JIT)
    if total is None and args.warmup <= calib[1] + 1:
        raise SystemExit(f"--steps auto needs --warmup > {calib[1] + 1} (the schedule is fixed "
                         f"at step {calib[1]}, inside the warm-up)")
    t_train = time.time()
    t_calib0 = None
    ce_hist, step_times = [], []
    steps_done, stopped_early, stop_reason = 0, False, ""

    def issue(step):
        """Build step ``step``'s graph and start it (``async_eval``): Python builds the next
        step while the GPU runs this one."""
        opt.learning_rate = lr_at(step, total or 10**9, args.lr, args.warmup)
        starts = rng.integers(0, train_ids.size - T - 1, size=Bsz)
        batch = np.stack([train_ids[s:s + T + 1] for s in starts])
        outs = train_step(mx.array(batch[:, :-1]), mx.array(batch[:, 1:]))
        mx.async_eval(*outs, state)
        return outs

    issued, inflight, t_prev = 0, None, time.time()
    while True:
        nxt = issued + 1
        reason = ("" if total is None or nxt <= total else "done")
        if not reason and args.stop_at is not None and nxt > args.stop_at:
            reason = f"--stop-at {args.stop_at}"
        if not reason and time.time() > budget_end:
            reason = "time budget"
        new = None
        if not reason:
            new, issued = issue(nxt), nxt
        if inflight is not None:
            step, (ce, aux, gnorm) = inflight
            ce_hist.append(ce.item())  # waits for that step
            now = time.time()
            step_times.append(now - t_prev)
            t_prev = now
            steps_done = step
            if not math.isfinite(ce_hist[-1]):
                raise RuntimeError(f"training diverged at step {step}: cross-entropy {ce_hist[-1]}")
            if step == calib[0] - 1:
                t_calib0 = now
            if total is None and step == calib[1]:
                per = (now - t_calib0) / (calib[1] - calib[0] + 1)
                fit = step + int((budget_end - now) / per * 0.97)
                total = max(issued + 1, args.warmup + 1, min(args.max_steps, fit))
                log(f"--steps auto: {per:.3f} s/step measured over steps {calib[0]}-{calib[1]}: "
                    f"{total} steps fit the budget")
            if step % 25 == 0 or step <= 2:
                tps = Bsz * T * len(step_times[-20:]) / max(1e-9, sum(step_times[-20:]))
                log(f"step {step}/{total or '?'} ce {np.mean(ce_hist[-20:]):.3f} "
                    f"aux {aux.item():.3f} gnorm {gnorm.item():.2f} "
                    f"lr {lr_at(step, total or 10**9, args.lr, args.warmup):.2e} "
                    f"{step_times[-1]:.3f}s/step {tps:,.0f} tok/s "
                    f"(elapsed {now - t_train:.0f}s)")
        inflight = None if new is None else (issued, new)
        if new is None:
            if reason != "done":
                stopped_early, stop_reason = True, reason
                log(f"{reason}: stopped at step {steps_done} (recipe: --steps {total} "
                    f"--stop-at {steps_done})")
            break
    train_wall = time.time() - t_train
    steady = step_times[2:] or step_times
    tokens_per_s = Bsz * T * len(steady) / max(1e-9, sum(steady))
    final_train = float(np.mean(ce_hist[-20:]))
    model.eval()

    # ---- validation: the trained weights in fp32 through mlx-lm's GDN recurrence and conv
    # (the MoE block stays in its dense form: the same function, no fp32 gather_mm), and
    # through the chunked GDN form too: the difference shows the form's error on these weights
    to_dtype(mx.float32)
    val_fp32_chunked = val_ce(model)
    training_forms(False, moe=args.moe_train == "dense")
    val_fp32 = val_ce(model)
    training_forms(False)
    to_dtype(mx.bfloat16)  # exact for bf16-trained weights
    log(f"training done: {steps_done} steps in {train_wall:.0f}s ({tokens_per_s:,.0f} tok/s steady); "
        f"train ce {final_train:.3f}; val ce fp32 {val_fp32:.3f} (ppl {math.exp(val_fp32):.2f}; "
        f"chunked GDN form {val_fp32_chunked:.4f})")

    # ---- quantise like mlx_lm.convert -q and save
    model, qconfig = quantize_model(model, config, 64, 4, mode="affine",
                                    quant_predicate=model.quant_predicate)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_model(tmp, model)
    save_config(qconfig, tmp / "config.json")
    tf.save_tokenizer(tok, tmp)
    ref_ids, ref_files = [], []
    for f in val_used:  # validation files in order, each closed by <|endoftext|>
        ref_ids.extend(tok.encode((root / f).read_text(encoding="utf-8", errors="replace")).ids)
        ref_ids.append(eot)
        ref_files.append(f)
        if len(ref_ids) >= REFERENCE_TOKENS:
            break
    (tmp / "numerics_reference.json").write_text(json.dumps({
        "source": f"stdlib:validation split, {len(ref_files)} files from {ref_files[0]}",
        "python": platform.python_version(), "split": "val",
        "ids": ref_ids[:REFERENCE_TOKENS]}) + "\n")
    del model
    mx.clear_cache()

    # ---- reload through mlx_lm.load (stock code) and evaluate the 4-bit checkpoint
    qmodel, qtok = mlx_lm.load(str(tmp))
    val_q = val_ce(qmodel, bs=min(4, q_windows))
    prompt = "def "
    sample = mlx_lm.generate(qmodel, qtok, prompt=prompt, max_tokens=args.sample_tokens, verbose=False)
    log(f"4-bit reload: val ce {val_q:.3f} (ppl {math.exp(val_q):.2f}); sample {prompt + sample!r}")
    size = sum(p.stat().st_size for p in tmp.iterdir())
    wall = time.time() - t_start
    t = config["text_config"]
    cmd = "python benchmarks/train_production_width.py" + (
        " " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip()
    summary = {
        "schema": SUMMARY_SCHEMA, "schema_version": 1, "recipe_key": key, "command": cmd,
        "preset": args.preset, "seed": args.seed, "steps_schedule": total,
        "steps_done": steps_done, "stopped_early": stopped_early, "stop_reason": stop_reason,
        "reproduce": f"--steps {total}" + (f" --stop-at {steps_done}" if stopped_early else ""),
        "batch": Bsz, "micro_batch": args.micro_batch, "seq_len": T,
        "tokens_trained": steps_done * Bsz * T,
        "lr": args.lr, "warmup": args.warmup, "moe_train": args.moe_train,
        "compiled_step": use_compile, "dtype": args.dtype, "gdn_chunk": args.gdn_chunk,
        "params": int(n_params), "active_params": int(active),
        "widths": {k_: t[k_] for k_ in ("hidden_size", "linear_num_key_heads",
                                         "linear_num_value_heads", "num_attention_heads",
                                         "num_key_value_heads", "head_dim", "num_experts",
                                         "num_experts_per_tok", "moe_intermediate_size",
                                         "shared_expert_intermediate_size", "vocab_size",
                                         "num_hidden_layers")},
        "data": {"files_listed": len(files), "train_files": len(train_used),
                 "val_files": len(val_used), "train_chars": n_chars,
                 "train_tokens": int(train_ids.size), "val_tokens": int(val_ids.size),
                 "file_list_sha256": list_hash, "data_sha256": dhash},
        "checks": {"chunked_gdn": chk_gdn, "shifted_conv": chk_conv, "dense_moe": chk_moe},
        "train_ce_last20": final_train, "train_ppl": math.exp(final_train),
        "val_ce_fp32": val_fp32, "val_ppl_fp32": math.exp(val_fp32),
        "val_ce_fp32_chunked_gdn": val_fp32_chunked,
        "val_ce_4bit": val_q, "val_ppl_4bit": math.exp(val_q),
        "val_windows": int(len(vx)), "tokens_per_s": tokens_per_s,
        "step_time_s_median": float(np.median(steady)),
        "wall_s": {"data_prep": t_data, "train": train_wall, "total": wall},
        "time_budget_s": args.time_budget_s, "size_bytes": int(size),
        "sample": prompt + sample, "device": device, "versions": versions,
        "platform": f"{platform.machine()} {platform.system()}",
    }
    recipe = f"""# {out.name}: recipe

Generated by `benchmarks/train_production_width.py` (do not edit by hand).

- Command: `{cmd}`; recipe key `{key[:16]}`
- Seed {args.seed}; {steps_done} steps of a {total}-step schedule{f' (stopped by {stop_reason}; reproduce with `{summary["reproduce"]}`)' if stopped_early else f' (reproduce with `--steps {total}`)'}; batch {Bsz} x {T} tokens ({steps_done * Bsz * T:,} tokens){f', in micro-batches of {args.micro_batch} rows' if args.micro_batch < Bsz else ''}; AdamW lr {args.lr} (warm-up {args.warmup}, cosine to 5%), wd 0.01, betas (0.9, 0.98), clip 1.0, router aux-loss {args.aux_coef}; {args.dtype} parameters and optimizer state (A_log fp32)
- Architecture: mlx-lm `qwen3_5_moe`; hidden {t['hidden_size']}; 4 layers (GDN, GDN, GDN, attention); GDN Hk {t['linear_num_key_heads']} x 128, Hv {t['linear_num_value_heads']} x 128, conv 4; attention {t['num_attention_heads']} q / {t['num_key_value_heads']} kv heads of 256, partial rotary 0.25, theta 1e7, output gate; MoE {t['num_experts']} experts top-{t['num_experts_per_tok']} (intermediate {t['moe_intermediate_size']}) + shared expert ({t['shared_expert_intermediate_size']}); vocab {t['vocab_size']}; {n_params / 1e6:.1f}M parameters, {active / 1e6:.1f}M active per token
- Training forms: chunked GDN (chunk {args.gdn_chunk}; vs `gated_delta_ops` {chk_gdn:.1e}), shifted depthwise conv ({chk_conv:.1e}), MoE {args.moe_train} ({'dense dispatch vs SparseMoeBlock ' + format(chk_moe, '.1e') if args.moe_train == 'dense' else 'mlx-lm SwitchGLU'}); `mx.compile`d step: {use_compile}
- Quantisation: bf16, then `mlx_lm.utils.quantize_model(group_size=64, bits=4, mode="affine")` with the model's `quant_predicate` (8-bit `mlp.gate`, `mlp.shared_expert_gate`); `save_model` / `save_config`
- Data: Python {platform.python_version()} standard library (the tiny fixture's list and split); {len(train_used)} train files ({n_chars:,} chars, {train_ids.size:,} tokens), {len(val_used)} validation files ({val_ids.size:,} tokens); file list sha256 `{list_hash}`, data sha256 `{dhash}`
- Tokenizer: byte-level BPE (`tokenizers`), {tok.get_vocab_size()} ids; `<|endoftext|>` {eot}, `<|im_start|>` {tok.token_to_id('<|im_start|>')}, `<|im_end|>` {tok.token_to_id('<|im_end|>')} (eos)
- Train cross-entropy (last 20 steps): {final_train:.4f} (ppl {math.exp(final_train):.2f})
- Validation ({len(vx)} windows of {T}): trained weights in fp32 {val_fp32:.4f} (ppl {math.exp(val_fp32):.2f}; through the chunked GDN form {val_fp32_chunked:.4f}); saved 4-bit checkpoint via `mlx_lm.load` {val_q:.4f} (ppl {math.exp(val_q):.2f})
- Throughput: {tokens_per_s:,.0f} tokens/s (median step {np.median(steady):.3f} s); data prep {t_data:.0f} s, training {train_wall:.0f} s, total {wall:.0f} s on {device}, {platform.machine()} {platform.system()}, mlx {mx.__version__}, mlx-lm {mlx_lm.__version__}
- Greedy sample from `{prompt}`: `{(prompt + sample)!r}`
- `numerics_reference.json`: {min(len(ref_ids), REFERENCE_TOKENS)} ids of {len(ref_files)} validation files for `benchmarks/numerics_long.py`
- Size on disk: {size / 1e6:.1f} MB
"""
    (tmp / "RECIPE.md").write_text(recipe)
    (tmp / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    if args.summary:
        args.summary.parent.mkdir(parents=True, exist_ok=True)
        args.summary.write_text(json.dumps(summary, indent=1) + "\n")
    log(f"saved {out} ({size / 1e6:.1f} MB); total {wall:.0f}s")
    print(recipe)
    return 0


if __name__ == "__main__":
    sys.exit(main())
