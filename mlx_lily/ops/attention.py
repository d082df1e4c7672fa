"""Qwen3.5 gated GQA attention pieces: q/k RMSNorm + partial RoPE, scaled dot-product
attention over the KV cache, and the sigmoid output gate.

Contract:
- ``qk_norm_rope_reference``: ``q = rope(rmsnorm(q) * wq)``, ``k = rope(rmsnorm(k) * wk)``
  with rotate-half RoPE on the first ``rope_dims`` of each head (pairs ``(j, j+rope_dims/2)``),
  ``theta_j = base ** (-2j / rope_dims)``, positions ``offset + t``; heads moved to axis 1.
- ``sdpa_reference``: ``softmax(q k^T * scale + mask) v`` with GQA (query head h reads KV
  head ``h // (Hq/Hkv)``), fp32 softmax, as ``mx.fast.scaled_dot_product_attention``.
  Decode kernels use a general path below ``SPLIT_K_MIN_CONTEXT`` cached tokens and a
  fixed-block split-K path with a two-pass combine at or above it.
- ``output_gate_reference``: ``out * sigmoid(gate)``.
Source: Qwen3-Next / Qwen3.5 gated attention; RoPE (Su et al. 2021); GQA (Ainslie et al. 2023);
FlashAttention-2 (Dao 2023) and Flash-Decoding split-K (Dao et al. 2023) for the kernels.

Kernels (one launch contract per kernel, Metal and CUDA twins; see each shader's header):
- ``lily_attn_qk_norm_rope``: q/k RMSNorm + RoPE in one launch, offset as a 1-element
  int32 array (no recompilation per token).
- ``lily_attn_decode_partial`` + ``lily_attn_decode_combine``: decode (L == 1) split-K
  attention. Every simdgroup/warp owns one block of ``CH`` cached tokens of one KV head
  and all ``G = Hq/Hkv`` query heads that share it (GQA packing: each K/V row is read
  once for the G heads, rows read contiguously by neighbouring lanes); the combine kernel
  merges the per-block (max, sum, acc) partials and applies the optional output gate.
  Block size (``decode_block``): below ``SPLIT_K_MIN_CONTEXT`` the "general" rule sizes
  blocks so that ``B*Hkv*ceil(T/CH)`` simdgroups reach a per-backend target
  (``TARGET_SIMDGROUPS``: Qwen3.6 has 2 KV heads, so without a split a batch-1 decode
  would occupy 2 of 132 SMs on an H200; the target was measured, see there); at or above
  it the block is fixed (``FIXED_BLOCK``) and the number of blocks grows with the cache.
- ``lily_attn_prefill``: causal (or unmasked) flash attention of an L-token chunk over
  the whole cache (T = offset + L keys), GQA rows packed as ``i*G + h``; tensor cores on
  CUDA (mma m16n8k16), ``simdgroup_matrix`` on Metal; optional fused output gate.
Both SDPA kernels write ``[B, L, Hq, D]`` (the layout ``o_proj`` reads), so ``sdpa_gated``
returns the gated ``[B, L, Hq*D]`` attention output without a transpose copy.
"""

from __future__ import annotations

import math

import mlx.core as mx

from mlx_lily import kernels
from mlx_lily.backend import current_backend
from mlx_lily.kernels import KernelSpec

NAME = "attention"
SPLIT_K_MIN_CONTEXT = 32768

# Decode split-K plan. NSG simdgroups (warps) per threadgroup; each owns CH keys.
DECODE_SIMDGROUPS = 4
DECODE_BLOCK_MIN = 32
# Fixed block (keys per simdgroup) at T >= SPLIT_K_MIN_CONTEXT, per backend.
# CUDA: mlx_lm.benchmark's procedure in one process on the H200 (benchmarks/gpu/
# knob_sweep.py, B = 1, 128 generated tokens): with this block and 512 target warps,
# 32K decode 236 tok/s against 202 with 512 / 128, 4K 249 against 224 (docs/results.md).
# attention_bench's chained kernel-only sweep had favoured 256-512-key blocks at 32K and
# 512 at 128K; the whole step at 32K did not. 128K has not run with this block.
FIXED_BLOCK = {"cuda": 128, "metal": 256}
# Simdgroups the general rule aims for. CUDA: the same sweep (256 warps with a 64-key cap:
# 214 / 224 tok/s at 4K / 32K). Apple: up to 40 GPU cores x 8.
TARGET_SIMDGROUPS = {"cuda": 512, "metal": 320}

# Load groups in flight per warp/simdgroup in the decode partial kernel (``PF``: CUDA 8-key
# tiles, Metal key rows): results do not depend on it. 1 until a measurement picks 2;
# ``MLX_LILY_DECODE_PF=1|2`` overrides (benchmark sweeps).
DECODE_PREFETCH = {"cuda": 1, "metal": 1}
DECODE_PF_ENV = "MLX_LILY_DECODE_PF"

# Decode partial-kernel variants (``MLX_LILY_ATTN_DECODE``, ``tuning.attn_decode``), Metal
# only: "gqa" (default, ``lily_attn_decode_partial``: a simdgroup holds all G heads of a
# KV head), "simd" / "simd2" (``lily_attn_decode_simd`` with HPS 1 / 2 heads per
# simdgroup). Results do not depend on the variant (same per-head arithmetic and blocks).
DECODE_VARIANTS = {"gqa": 0, "simd": 1, "simd2": 2}
DECODE_VARIANT = {"cuda": "gqa", "metal": "gqa"}

# Prefill rows (packed query-head rows) per threadgroup, per backend (same grid formula).
PREFILL_ROWS = {"cuda": 64, "metal": 32}
PREFILL_THREADS = 128
PREFILL_SHARED_MEMORY = 98304  # CUDA dynamic shared memory (Q + 2 x (K + V) tiles, D <= 256)
# The prefill kernel has no key split: a call with few row blocks over a long cache (e.g. the
# short last chunk of a long prompt) would run on a handful of SMs/cores. Such calls
# (fewer than PREFILL_MIN_BLOCKS threadgroups and T > PREFILL_SMALL_T) use the reference.
PREFILL_MIN_BLOCKS = {"cuda": 64, "metal": 16}
PREFILL_SMALL_T = 8192

_DTYPES = (mx.bfloat16, mx.float16)
HEAD_DIMS = (128, 256)
_HEAD_DIMS = HEAD_DIMS
_LOG2E = 1.4426950408889634

QK_NORM_ROPE = KernelSpec(
    "lily_attn_qk_norm_rope", "attn_qk_norm_rope",
    ("queries", "keys", "q_weight", "k_weight", "rope", "offset"), ("q_out", "k_out", "v_out"),
    ensure_row_contiguous=False)
DECODE_PARTIAL = KernelSpec(
    "lily_attn_decode_partial", "attn_decode_partial",
    ("q", "k", "v", "params", "tlen"), ("part_o", "part_ml"), ensure_row_contiguous=False)
#: One simdgroup per query head (or per pair), MLX ``sdpa_vector_2pass``'s layout; Metal
#: only, chosen by ``decode_variant``; same partials as ``DECODE_PARTIAL``.
DECODE_SIMD = KernelSpec(
    "lily_attn_decode_simd", "attn_decode_simd",
    ("q", "k", "v", "params", "tlen"), ("part_o", "part_ml"), ensure_row_contiguous=False)
DECODE_COMBINE = KernelSpec(
    "lily_attn_decode_combine", "attn_decode_combine",
    ("part_o", "part_ml", "gate"), ("out",), ensure_row_contiguous=False)
PREFILL = KernelSpec(
    "lily_attn_prefill", "attn_prefill",
    ("q", "k", "v", "gate", "params"), ("out",), ensure_row_contiguous=False,
    shared_memory=PREFILL_SHARED_MEMORY)
SPECS = (QK_NORM_ROPE, DECODE_PARTIAL, DECODE_COMBINE, PREFILL)


# ----------------------------------------------------------------------------- references
def qk_norm_rope_reference(queries, keys, q_norm_weight, k_norm_weight, eps, *,
                           rope_dims, base, scale=1.0, traditional=False, offset=0):
    """Normalise and rotate q and k.

    Args:
        queries: ``[B, L, Hq, D]``; keys: ``[B, L, Hkv, D]`` (bf16); ``*_norm_weight``:
        ``[D]``; eps: RMSNorm epsilon; rope_dims: rotated leading dims (64 of 256 in
        Qwen3.5/3.6); base: theta; offset: position of the first row (int or ``[B]`` array).
    Returns:
        ``(q [B, Hq, L, D], k [B, Hkv, L, D])``.
    """
    q = mx.fast.rms_norm(queries, q_norm_weight, eps).transpose(0, 2, 1, 3)
    k = mx.fast.rms_norm(keys, k_norm_weight, eps).transpose(0, 2, 1, 3)
    q = mx.fast.rope(q, rope_dims, traditional=traditional, base=base, scale=scale,
                     offset=offset)
    k = mx.fast.rope(k, rope_dims, traditional=traditional, base=base, scale=scale,
                     offset=offset)
    return q, k


def sdpa_reference(q, k, v, scale, mask=None):
    """Attention ``[B, Hq, L, D]`` from q ``[B, Hq, L, D]``, k/v ``[B, Hkv, T, D]`` (views of
    the KV cache are fine), mask None, ``"causal"`` or a boolean/additive array."""
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def output_gate_reference(out, gate):
    """``out * sigmoid(gate)``; both ``[B, L, Hq*D]``."""
    return out * mx.sigmoid(gate)


def sdpa_gated_reference(q, k, v, scale, mask, gate):
    """``output_gate(sdpa(q, k, v).transpose(0, 2, 1, 3).reshape(B, L, -1), gate)``.

    Args:
        q: ``[B, Hq, L, D]``; k/v: ``[B, Hkv, T, D]``; gate: ``[B, L, Hq, D]`` or
            ``[B, L, Hq*D]`` (e.g. the strided gate half of ``q_proj``'s output).
    Returns:
        ``[B, L, Hq*D]`` in q's dtype.
    """
    B, _, L, _ = q.shape
    out = sdpa_reference(q, k, v, scale, mask).transpose(0, 2, 1, 3).reshape(B, L, -1)
    return output_gate_reference(out, gate.reshape(B, L, -1))


# ----------------------------------------------------------------------------- kernels
def _kernel(spec: KernelSpec, backend: str):
    """The kernel object for ``spec`` on ``backend`` (None when unavailable). Tests
    replace this to run the twins under the Metal emulator."""
    return kernels.get(spec, backend)


def has_kernel(backend: str) -> bool:
    """True when the decode/prefill attention kernels can serve on ``backend``."""
    if backend not in ("metal", "cuda"):
        return False
    return _kernel(DECODE_PARTIAL, backend) is not None


_CONST_CACHE: dict = {}  # small constant input arrays (data arrays, no graph nodes)


def _dummy_len():
    """Stand-in for the decode kernel's ``tlen`` input when DYN_T is off (never read)."""
    a = _CONST_CACHE.get("len")
    if a is None:
        a = _CONST_CACHE["len"] = kernels.const_array([0], mx.int32)
    return a


def _dummy_gate(dtype):
    """Stand-in for an absent gate (GATED false: never read), ``[1, 1, 1, 8]``: as many
    elements as MLX needs to pass it as ``const device T*``, the real gate's space."""
    key = ("gate", dtype)
    a = _CONST_CACHE.get(key)
    if a is None:
        a = mx.array([[[[0.0] * kernels.DEVICE_MIN_ELEMS]]], dtype=dtype)  # data, no graph
        _CONST_CACHE[key] = a
    return a


def _params(scale: float):
    key = ("scale", float(scale))
    a = _CONST_CACHE.get(key)
    if a is None:
        a = kernels.const_array([float(scale) * _LOG2E], mx.float32)
        _CONST_CACHE[key] = a
    return a


def _rope_params(eps, base, scale):
    key = ("rope", float(eps), float(base), float(scale))
    a = _CONST_CACHE.get(key)
    if a is None:
        a = kernels.const_array([float(eps), math.log2(float(base)), float(scale)], mx.float32)
        _CONST_CACHE[key] = a
    return a


def decode_prefetch(backend: str) -> int:
    """``PF`` of ``lily_attn_decode_partial`` on ``backend``: ``DECODE_PREFETCH``, or
    ``MLX_LILY_DECODE_PF`` (``tuning.decode_pf``: 1 or 2; another value warns once and
    keeps the table's)."""
    from .. import tuning

    pf = tuning.decode_pf
    return DECODE_PREFETCH.get(backend, 1) if pf is None else pf


def decode_variant(backend: str) -> str:
    """The decode partial kernel on ``backend`` (a ``DECODE_VARIANTS`` key):
    ``DECODE_VARIANT``, or ``MLX_LILY_ATTN_DECODE`` (``tuning.attn_decode``) on Metal; the
    other backends have only "gqa"."""
    from .. import tuning

    v = tuning.attn_decode
    if backend != "metal" or v is None:
        return DECODE_VARIANT.get(backend, "gqa")
    return v


def fixed_block(backend: str) -> int:
    """The fixed decode block on ``backend``: ``FIXED_BLOCK``, or
    ``MLX_LILY_ATTN_FIXED_BLOCK`` (``tuning.attn_fixed_block``: 32 to 512, powers of two)."""
    from .. import tuning

    v = tuning.attn_fixed_block
    return FIXED_BLOCK.get(backend, 256) if v is None else v


def decode_block(T: int, B: int, Hkv: int, backend: str) -> int:
    """Keys per simdgroup (``CH``) for a decode over ``T`` cached tokens.

    General rule (``T < SPLIT_K_MIN_CONTEXT``): the smallest power of two >= 32 with
    ``B*Hkv*ceil(T/CH)`` close to ``TARGET_SIMDGROUPS[backend]`` (or
    ``MLX_LILY_ATTN_DECODE_WARPS``), capped at the fixed block. Fixed-block rule
    (``T >= SPLIT_K_MIN_CONTEXT``): ``fixed_block(backend)``.
    """
    fixed = fixed_block(backend)
    if T >= SPLIT_K_MIN_CONTEXT:
        return fixed
    from .. import tuning

    target = tuning.attn_decode_warps or TARGET_SIMDGROUPS.get(backend, 320)
    want = max(1, -(-T * B * Hkv // target))
    ch = min(DECODE_BLOCK_MIN, fixed)
    while ch < want and ch < fixed:
        ch *= 2
    return ch


def _check_qk(queries, keys, q_norm_weight, k_norm_weight, rope_dims, traditional, offset):
    if queries.ndim != 4 or keys.ndim != 4:
        return False
    B, L, Hq, D = queries.shape
    if keys.shape[0] != B or keys.shape[1] != L or keys.shape[3] != D or L < 1:
        return False
    dt = queries.dtype
    if dt not in _DTYPES or keys.dtype != dt:
        return False
    if q_norm_weight.dtype != dt or k_norm_weight.dtype != dt:
        return False
    if q_norm_weight.shape != (D,) or k_norm_weight.shape != (D,):
        return False
    if D % 32 != 0 or not 32 <= D <= 512:
        return False
    if traditional or rope_dims % 2 != 0 or not 2 <= rope_dims <= D:
        return False
    if isinstance(offset, mx.array) and offset.size != 1:
        return False
    return True


def qk_norm_rope(queries, keys, q_norm_weight, k_norm_weight, eps, *, rope_dims, base,
                 scale=1.0, traditional=False, offset=0):
    """Dispatcher for ``qk_norm_rope_reference`` (same arguments and results).

    Uses ``lily_attn_qk_norm_rope`` for bf16/fp16, head_dim % 32 == 0 (<= 512), rotate-half
    RoPE and a scalar offset (int or 1-element array); otherwise the reference.
    """
    backend = current_backend()
    kern = None
    if backend in ("metal", "cuda") and _check_qk(queries, keys, q_norm_weight, k_norm_weight,
                                                   rope_dims, traditional, offset):
        kern = _kernel(QK_NORM_ROPE, backend)
    if kern is None:
        return qk_norm_rope_reference(queries, keys, q_norm_weight, k_norm_weight, eps,
                                      rope_dims=rope_dims, base=base, scale=scale,
                                      traditional=traditional, offset=offset)
    B, L, Hq, D = queries.shape
    Hkv = keys.shape[2]
    dt = queries.dtype
    if isinstance(offset, mx.array):
        off = offset.reshape(1).astype(mx.int32)
    else:
        off = kernels.device_scalars(mx.array([int(offset)], dtype=mx.int32))[:1]
    rope = _rope_params(eps, base, scale)
    q_out, k_out, _ = kern(
        inputs=[queries, keys, q_norm_weight, k_norm_weight, rope, off],
        output_shapes=[(B, Hq, L, D), (B, Hkv, L, D), (1,)], output_dtypes=[dt, dt, dt],
        grid=(32 * B * L * (Hq + Hkv), 1, 1), threadgroup=(32, 1, 1),
        template=[("T", dt), ("D", D), ("HQ", Hq), ("HKV", Hkv), ("R", int(rope_dims)),
                  ("PACKED", False)])
    return q_out, k_out


PACKED_OP = "attn_packed"  # the packed decode form's switch (MLX_LILY_DISABLE / _KERNELS)


def split_packed(y, n_heads, n_kv_heads, head_dim):
    """``(queries [B,L,Hq,D], gate [B,L,Hq,D], keys [B,L,Hkv,D], values [B,L,Hkv,D])``
    views of the fused q|k|v projection ``y [B, L, Hq*2D + 2*Hkv*D]`` (``q_proj``'s
    per-head q|gate halves, then k, then v), as mlx-lm's ``Qwen3NextAttention`` splits
    them."""
    B, L, _ = y.shape
    qw = n_heads * 2 * head_dim
    kw = n_kv_heads * head_dim
    q_out, keys, values = mx.split(y, [qw, qw + kw], axis=-1)
    queries, gate = mx.split(q_out.reshape(B, L, n_heads, -1), 2, axis=-1)
    return (queries, gate, keys.reshape(B, L, n_kv_heads, -1),
            values.reshape(B, L, n_kv_heads, -1))


def packed_supported(dtype, q_norm_weight, k_norm_weight, *, head_dim, rope_dims,
                     traditional=False, offset=0) -> bool:
    """Whether ``qkv_norm_rope_packed`` runs its kernel for a projection row of ``dtype``
    on the current backend (checked before the row is even built: ``attn_packed``
    allowed, bf16/fp16, norm weights ``[D]`` of that dtype, ``D % 32 == 0`` up to 512,
    rotate-half RoPE, a scalar offset)."""
    backend = current_backend()
    D = head_dim
    return (backend in ("metal", "cuda") and kernels.kernels_allowed(PACKED_OP, backend)
            and dtype in _DTYPES and q_norm_weight.dtype == dtype
            and k_norm_weight.dtype == dtype and q_norm_weight.shape == (D,)
            and k_norm_weight.shape == (D,) and D % 32 == 0 and 32 <= D <= 512
            and not traditional and rope_dims % 2 == 0 and 2 <= rope_dims <= D
            and not (isinstance(offset, mx.array) and offset.size != 1))


def qkv_norm_rope_packed_reference(y, q_norm_weight, k_norm_weight, eps, *, n_heads,
                                   n_kv_heads, head_dim, rope_dims, base, scale=1.0,
                                   traditional=False, offset=0):
    """``(q [B,Hq,L,D], k [B,Hkv,L,D], v [B,Hkv,L,D])`` from the fused projection ``y``:
    ``qk_norm_rope_reference`` on its q and k heads, v moved to ``[B,Hkv,L,D]``."""
    queries, _, keys, values = split_packed(y, n_heads, n_kv_heads, head_dim)
    q, k = qk_norm_rope_reference(queries, keys, q_norm_weight, k_norm_weight, eps,
                                  rope_dims=rope_dims, base=base, scale=scale,
                                  traditional=traditional, offset=offset)
    return q, k, values.transpose(0, 2, 1, 3)


def qkv_norm_rope_packed(y, q_norm_weight, k_norm_weight, eps, *, n_heads, n_kv_heads,
                         head_dim, rope_dims, base, scale=1.0, traditional=False, offset=0,
                         kernel=None, init_value=None):
    """One ``lily_attn_qk_norm_rope`` launch (``PACKED=true``) reading q, k and v straight
    from the fused projection ``y [B, L, Hq*2D + 2*Hkv*D]``: results of
    ``qkv_norm_rope_packed_reference``; ``offset`` an int, a 1-element array, or an int32
    ``[B]`` array of one position per batch row. Returns None when the kernel does not
    serve this call (backend, ``attn_packed`` switch, dtypes, dims: as ``qk_norm_rope``,
    an offset array of another size); ``kernel``
    overrides the kernel object (tests), ``init_value`` pre-fills the outputs."""
    D, Hq, Hkv = head_dim, n_heads, n_kv_heads
    if y.ndim != 3 or y.shape[-1] != Hq * 2 * D + 2 * Hkv * D:
        return None
    B, L, _ = y.shape
    dt = y.dtype
    if kernel is None:
        if not packed_supported(dt, q_norm_weight, k_norm_weight, head_dim=D,
                                rope_dims=rope_dims, traditional=traditional):
            return None
        kernel = _kernel(QK_NORM_ROPE, current_backend())
        if kernel is None:
            return None
    if isinstance(offset, mx.array) and offset.size not in (1, B):
        return None
    # one position for every row, or one per batch row (a left-padded batch's offsets)
    off = (offset.reshape(-1).astype(mx.int32) if isinstance(offset, mx.array)
           else kernels.device_scalars(mx.array([int(offset)], dtype=mx.int32))[:1])
    extra = {} if init_value is None else {"init_value": init_value}
    q, k, v = kernel(
        inputs=[y, y, q_norm_weight, k_norm_weight, _rope_params(eps, base, scale), off],
        output_shapes=[(B, Hq, L, D), (B, Hkv, L, D), (B, Hkv, L, D)],
        output_dtypes=[dt, dt, dt], grid=(32 * B * L * (Hq + 2 * Hkv), 1, 1),
        threadgroup=(32, 1, 1),
        template=[("T", dt), ("D", D), ("HQ", Hq), ("HKV", Hkv), ("R", int(rope_dims)),
                  ("PACKED", True)], **extra)
    return q, k, v


def _sdpa_route(q, k, v, mask, gate, backend="cuda"):
    """``"decode"``, ``"prefill"`` or None (reference) for this call."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        return None
    B, Hq, L, D = q.shape
    Bk, Hkv, T, Dk = k.shape
    if Bk != B or v.shape != k.shape or Dk != D or D not in HEAD_DIMS:
        return None
    dt = q.dtype
    if dt not in _DTYPES or k.dtype != dt or v.dtype != dt:
        return None
    if Hkv < 1 or Hq % Hkv != 0 or T < 1 or L < 1:
        return None
    if gate is not None:
        if gate.dtype != dt or gate.shape not in ((B, L, Hq, D), (B, L, Hq * D)):
            return None
    if not (mask is None or (isinstance(mask, str) and mask == "causal")):
        return None
    G = Hq // Hkv
    if L == 1:
        return "decode" if G <= 8 else None
    if isinstance(mask, str) and T < L:
        return None
    blocks = -(-(G * L) // PREFILL_ROWS.get(backend, 32)) * Hkv * B
    if T > PREFILL_SMALL_T and blocks < PREFILL_MIN_BLOCKS.get(backend, 16):
        return None
    return "prefill"


def decode_attention(q, k, v, scale, gate=None, *, block=None, backend=None,
                     gate_packed=False, init_value=None, tlen=None, prefetch=None,
                     variant=None):
    """Split-K GQA decode attention with the Lily kernels (no routing checks).

    Static cost at Qwen3.6-35B-A3B's decode shape (B 1, Hq 16, Hkv 2, D 256, bf16) over
    T = 4096 cached tokens, Metal (block CH 32, NS 128 blocks; the fixed-block path at
    T >= 32768 keeps NS = T/CH with CH 256): K/V read 8.39 MB (2*Hkv*T*D*2 B, growing
    with T), q 8 KB; partials written then read by the combine 2.11 MB
    (Hq*NS*(D+2)*4 B); output and gate 8 KB each.
    Partial kernel by ``variant``: "gqa" 64 threadgroups x 128 threads (4 simdgroups,
    each one block of all 8 heads: ~160 live fp32 per lane), "simd" 256 x 256 (8
    simdgroups, one head each, 34 live fp32 per lane), "simd2" 256 x 128 (2 heads per
    simdgroup, 52); no threadgroup memory. Combine: Hq*D/64 = 64 threadgroups x 256
    threads, 2064 B threadgroup memory.
    MLX competitor: ``sdpa_vector_2pass`` (MLX 0.32, GQA and T >= 4096; from 1024 on GPUs
    whose architecture name ends in 'd' or 's'): pass 1 threadgroup (32, G) per (kv head,
    block), one simdgroup per query head, keys strided by the block count (64 or 128 at
    T 4096, by architecture): the same 8.39 MB of K/V, bf16 partials 0.52-1.05 MB
    written and read, 128-256 threadgroups x 256 threads.

    Args:
        q: ``[B, Hq, 1, D]``; k/v: ``[B, Hkv, T, D]`` (cache views fine); gate: None or
            ``[B, 1, Hq, D]`` / ``[B, 1, Hq*D]`` in q's dtype; block: keys per simdgroup
            (default ``decode_block``); backend: default ``current_backend()``;
            gate_packed: ``gate`` is the fused q|k|v projection ``[B, 1, Hq*2D+2*Hkv*D]``
            (each head's gate read from its columns, no view); init_value: output fill;
            tlen: None, or an int32 ``[1]`` array: k/v are whole cache buffers of which
            only the first ``tlen`` keys count (static shapes for a compiled step);
            prefetch: ``PF`` (1 or 2, default ``decode_prefetch``), load groups in
            flight per warp (the result does not depend on it); variant: a
            ``DECODE_VARIANTS`` key (default ``decode_variant``; "simd"/"simd2" need the
            Metal kernel ``lily_attn_decode_simd``, which ignores ``prefetch``).
    Returns:
        ``[B, 1, Hq, D]`` (``attn * sigmoid(gate)`` when gate is given), q's dtype;
        ``[B, 1, Hq*D]`` with ``gate_packed`` (the layout ``o_proj`` reads).
    Raises:
        ValueError: ``prefetch`` not None, 1 or 2; ``variant`` not a ``DECODE_VARIANTS``
            key.
        RuntimeError: no kernel for the backend.
    """
    if prefetch not in (None, 1, 2):
        raise ValueError(f"decode_attention: prefetch must be 1 or 2, got {prefetch!r}")
    if variant is not None and variant not in DECODE_VARIANTS:
        raise ValueError(f"decode_attention: variant must be one of {list(DECODE_VARIANTS)}, "
                         f"got {variant!r}")
    backend = backend or current_backend()
    hps = DECODE_VARIANTS[variant or decode_variant(backend)]
    ks = _kernel(DECODE_SIMD, backend) if hps and backend == "metal" else None
    kp = ks or _kernel(DECODE_PARTIAL, backend)
    kc = _kernel(DECODE_COMBINE, backend)
    if kp is None or kc is None:
        raise RuntimeError(f"no attention decode kernel on backend {backend!r}")
    B, Hq, _, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    G = Hq // Hkv
    dt = q.dtype
    ch = int(block) if block else decode_block(T, B, Hkv, backend)
    ns = -(-T // ch)
    dyn = tlen is not None
    if ks is not None:  # one simdgroup per hps query heads, one threadgroup per block
        nsg = -(-G // hps)
        launch = dict(grid=(32 * nsg * ns, Hkv, B), threadgroup=(32 * nsg, 1, 1),
                      template=[("T", dt), ("D", D), ("G", G), ("CH", ch), ("HPS", hps),
                                ("DYN_T", dyn)])
    else:
        nsg = DECODE_SIMDGROUPS
        nblk = -(-ns // nsg)
        launch = dict(grid=(32 * nsg * nblk, Hkv, B), threadgroup=(32 * nsg, 1, 1),
                      template=[("T", dt), ("D", D), ("G", G), ("CH", ch), ("NSG", nsg),
                                ("DYN_T", dyn),
                                ("PF", int(prefetch) if prefetch else decode_prefetch(backend))])
    part_o, part_ml = kp(
        inputs=[q, k, v, _params(scale), tlen if dyn else _dummy_len()],
        output_shapes=[(B, Hq, ns, D), (B, Hq, ns, 2)], output_dtypes=[mx.float32, mx.float32],
        **launch)
    gated = gate is not None
    if gate_packed:
        g = gate
    else:
        g = gate.reshape(B, 1, Hq, D) if gated else _dummy_gate(dt)
    extra = {} if init_value is None else {"init_value": init_value}
    (out,) = kc(
        inputs=[part_o, part_ml, g],
        output_shapes=[(B, 1, Hq * D) if gate_packed else (B, 1, Hq, D)], output_dtypes=[dt],
        grid=(256 * (D // 64), Hq, B), threadgroup=(256, 1, 1),
        template=[("T", dt), ("D", D), ("GATED", gated), ("GATE_PACKED", bool(gate_packed))],
        **extra)
    return out


def prefill_attention(q, k, v, scale, causal=True, gate=None, *, backend=None):
    """Flash attention of an L-token chunk over T >= L keys with the Lily kernel.

    Args:
        q: ``[B, Hq, L, D]``; k/v: ``[B, Hkv, T, D]`` (the chunk's queries are the last
            L positions); causal: query i sees keys ``<= T-L+i``; gate: None or
            ``[B, L, Hq, D]`` / ``[B, L, Hq*D]``; backend: default ``current_backend()``.
    Returns:
        ``[B, L, Hq, D]`` in q's dtype (gated when gate is given).
    Raises:
        RuntimeError: no kernel for the backend.
    """
    backend = backend or current_backend()
    kern = _kernel(PREFILL, backend)
    if kern is None:
        raise RuntimeError(f"no attention prefill kernel on backend {backend!r}")
    B, Hq, L, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    dt = q.dtype
    br = PREFILL_ROWS[backend]
    gated = gate is not None
    g = gate.reshape(B, L, Hq, D) if gated else _dummy_gate(dt)
    (out,) = kern(
        inputs=[q, k, v, g, _params(scale)], output_shapes=[(B, L, Hq, D)],
        output_dtypes=[dt], grid=(PREFILL_THREADS * (-(-(G * L) // br)), Hkv, B),
        threadgroup=(PREFILL_THREADS, 1, 1),
        template=[("T", dt), ("D", D), ("G", G), ("BR", br), ("CAUSAL", bool(causal)),
                  ("GATED", gated)])
    return out


def _sdpa_kernel(q, k, v, scale, mask, gate):
    """``[B, L, Hq, D]`` from a kernel, or None when this call goes to the reference."""
    backend = current_backend()
    if backend not in ("metal", "cuda"):
        return None
    route = _sdpa_route(q, k, v, mask, gate, backend)
    if route == "decode":
        if _kernel(DECODE_PARTIAL, backend) is None:
            return None
        return decode_attention(q, k, v, scale, gate, backend=backend)
    if route == "prefill":
        if _kernel(PREFILL, backend) is None:
            return None
        return prefill_attention(q, k, v, scale, isinstance(mask, str), gate,
                                 backend=backend)
    return None


def sdpa(q, k, v, scale, mask=None):
    """Dispatcher for ``sdpa_reference``.

    Kernels serve bf16/fp16, head_dim 128/256, ``Hq % Hkv == 0``, mask None or
    ``"causal"``: L == 1 (any B, G <= 8) -> split-K decode; L > 1 (T >= L when causal)
    -> flash prefill, except few-row calls over long caches (``PREFILL_MIN_BLOCKS``,
    ``PREFILL_SMALL_T``). Array masks and everything else use the reference. The kernel result
    is a ``[B, Hq, L, D]`` transposed view of a ``[B, L, Hq, D]`` buffer.
    """
    out = _sdpa_kernel(q, k, v, scale, mask, None)
    if out is None:
        return sdpa_reference(q, k, v, scale, mask)
    return out.transpose(0, 2, 1, 3)


def sdpa_gated(q, k, v, scale, mask, gate):
    """Dispatcher for ``sdpa_gated_reference``: attention + output gate, ``[B, L, Hq*D]``.

    ``gate`` may be the ``[B, L, Hq, D]`` strided view of ``q_proj``'s gate half (read
    through its strides, no copy). Routing as ``sdpa``; the gate is fused into the decode
    combine / prefill epilogue.
    """
    out = _sdpa_kernel(q, k, v, scale, mask, gate)
    if out is None:
        return sdpa_gated_reference(q, k, v, scale, mask, gate)
    B, L = out.shape[0], out.shape[1]
    return out.reshape(B, L, -1)


def sdpa_gated_packed(q, k, v, scale, y, n_heads, n_kv_heads, head_dim):
    """``sdpa_gated`` for a decode step whose gate lives in the fused q|k|v projection
    ``y [B, 1, Hq*2D + 2*Hkv*D]``: the split-K kernels read each head's gate from ``y``'s
    columns (``GATE_PACKED``); any call they do not serve takes ``sdpa_gated`` on the gate
    view. Returns ``[B, 1, Hq*D]``."""
    backend = current_backend()
    if (backend in ("metal", "cuda") and kernels.kernels_allowed(PACKED_OP, backend)
            and y.dtype == q.dtype and _sdpa_route(q, k, v, None, None, backend) == "decode"
            and _kernel(DECODE_PARTIAL, backend) is not None):
        return decode_attention(q, k, v, scale, y, backend=backend, gate_packed=True)
    _, gate, _, _ = split_packed(y, n_heads, n_kv_heads, head_dim)
    return sdpa_gated(q, k, v, scale, None, gate)


def sdpa_gated_packed_rows(q, k, v, scale, y, starts, n_heads, n_kv_heads, head_dim):
    """``sdpa_gated_packed`` for a decode step of a left-padded batch: row ``b`` attends
    to its own keys ``k[b, :, starts[b]:]`` only (``starts``: host ints, the rows' left
    padding), each row through the arithmetic of that sequence decoding alone (the
    split-K block a one-sequence step picks for its key count), so a row's result does
    not depend on the other rows: one launch pair for all rows when they share one
    start (no padding), else one per row. q ``[B, Hq, 1, D]``, k/v ``[B, Hkv, T, D]`` (cache views), y the fused
    projection ``[B, 1, Hq*2D + 2*Hkv*D]``. Returns ``[B, 1, Hq*D]``, or None when the
    decode kernels do not serve this call (nothing launched)."""
    backend = current_backend()
    B, T = q.shape[0], k.shape[2]
    if (backend not in ("metal", "cuda") or not kernels.kernels_allowed(PACKED_OP, backend)
            or y.dtype != q.dtype or len(starts) != B
            or any(not 0 <= int(s) < T for s in starts)
            or _sdpa_route(q, k, v, None, None, backend) != "decode"
            or _kernel(DECODE_PARTIAL, backend) is None):
        return None
    Hkv = k.shape[1]
    if len(set(starts)) == 1:  # one launch pair; the block is a one-sequence step's
        s = int(starts[0])
        return decode_attention(q, k[:, :, s:], v[:, :, s:], scale, y, backend=backend,
                                gate_packed=True, block=decode_block(T - s, 1, Hkv, backend))
    rows = [decode_attention(q[b:b + 1], k[b:b + 1, :, int(s):], v[b:b + 1, :, int(s):],
                             scale, y[b:b + 1], backend=backend, gate_packed=True)
            for b, s in enumerate(starts)]
    return mx.concatenate(rows, axis=0)


def has_packed_kernel(backend: str) -> bool:
    """True when the packed decode forms (``qkv_norm_rope_packed``, ``sdpa_gated_packed``)
    run their kernels on ``backend``."""
    return has_kernel(backend) and kernels.kernels_allowed(PACKED_OP, backend)


def output_gate(out, gate):
    """Dispatcher for ``output_gate_reference`` (reference on every backend: one fused
    elementwise pair; the gate is fused into the SDPA kernels via ``sdpa_gated``)."""
    return output_gate_reference(out, gate)
