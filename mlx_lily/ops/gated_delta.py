"""Gated DeltaNet mixer core: conv1d with its state, SiLU, l2-normalised q/k, gates,
the gated delta-rule recurrence with an fp32 state, and the gated RMSNorm.

Contract (``gated_delta_reference``), matching mlx-lm's ``qwen3_5.GatedDeltaNet`` between
its input projections and ``out_proj``:

1. ``x = concat(conv_state, qkv)`` over time (rows where ``mask`` is False zeroed first);
   the new conv state is the last ``K-1`` raw rows (per sequence at ``lengths`` when
   given); ``c = silu(depthwise_conv1d(x, conv_weight))`` over the ``C = 2*Hk*Dk + Hv*Dv``
   channels, split into q ``[B,S,Hk,Dk]``, k, v ``[B,S,Hv,Dv]``.
2. ``q = l2norm(q) * Dk**-0.5``, ``k = l2norm(k)`` (eps 1e-6 on the sum of squares).
3. ``beta = sigmoid(b)``, ``g = exp(-exp(A_log) * softplus(a + dt_bias))`` in fp32.
4. Per (batch, v-head h; q/k head ``h // (Hv/Hk)``), state ``S [Dv, Dk]`` fp32:
   ``S *= g; kv = S k; delta = (v - kv) * beta; S += delta k^T; y = S q``; a masked step
   leaves S unchanged.
5. ``out = (norm_weight * rmsnorm(y)) * silu(z)`` per v-head (fp32 math, cast to the
   input dtype), returned as ``[B, S, Hv*Dv]``.

Kernels (``gated_delta`` routes to them on Metal and CUDA when ``kernel_unsupported`` is
None; everything else runs the reference):

- S == 1: ``lily_gdn_decode``, ONE launch per layer and step: conv step + SiLU + l2norm +
  gates + delta rule with the fp32 state in registers (read once, written once) + gated
  RMSNorm; new conv state and state as outputs.
- S > 1: ``lily_gdn_prep`` (conv over the chunk with the carried state, SiLU, l2norm,
  gates), ``lily_gdn_scan`` (register-resident sequential scan over the chunk),
  ``lily_gdn_norm`` (gated RMSNorm): three launches per layer and chunk.
  ``MLX_LILY_GDN_PREFILL=chunked``: ``scan_chunked`` (the chunkwise form on MLX matmuls,
  compiled) replaces ``lily_gdn_scan`` where fp32 matmuls stay fp32 (``MLX_ENABLE_TF32=0``:
  ``tf32_matmuls``).

Numerics: activations are rounded to the input dtype where mlx-lm materialises arrays
(conv output, the sigmoid inside SiLU, normalised q/k, y, normalised y), so q/k/v match
the reference bit for bit but for rare 1-ulp flips; the gates (beta, g) are computed in
fp32 throughout (the reference rounds sigmoid(b) and softplus to bf16), so kernel and
reference states differ by ~1e-3 relative, the size of the reference's own gate rounding.
Reductions run in a different order than the reference's.

Source: Yang et al., "Gated Delta Networks: Improving Mamba2 with Delta Rule" (2024);
Qwen3-Next / Qwen3.5 linear-attention layers.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn

from .. import kernels as _k
from ..backend import current_backend

NAME = "gated_delta"


def conv_step_reference(qkv, conv_weight, conv_state, mask=None, lengths=None):
    """Causal depthwise conv1d with carried state, then SiLU.

    Args:
        qkv: ``[B, S, C]``; conv_weight: ``[C, K, 1]`` (MLX layout); conv_state:
            ``[B, K-1, C]`` or None (zeros); mask: ``[B, S]`` bool or None;
            lengths: ``[B]`` int (valid rows per sequence in this call) or None.
    Returns:
        ``(conv_out [B, S, C], new_conv_state [B, K-1, C])`` in ``qkv``'s dtype.
    """
    B, S, C = qkv.shape
    K = conv_weight.shape[1]
    if conv_state is None:
        conv_state = mx.zeros((B, K - 1, C), dtype=qkv.dtype)
    if mask is not None:
        qkv = mx.where(mask[..., None], qkv, 0)
    conv_input = mx.concatenate([conv_state, qkv], axis=1)
    n_keep = K - 1
    if lengths is not None:
        ends = mx.clip(lengths, 0, S)
        positions = (ends[:, None] + mx.arange(n_keep))[..., None]
        new_state = mx.take_along_axis(conv_input, positions, axis=1)
    else:
        new_state = mx.contiguous(conv_input[:, -n_keep:, :])
    out = nn.silu(mx.conv1d(conv_input, conv_weight, groups=C))
    return out, new_state


def gated_rms_norm_reference(y, z, weight, eps):
    """``(weight * rmsnorm(y)) * silu(z)`` over the last axis, fp32 math, ``y``'s dtype."""
    x = mx.fast.rms_norm(y, weight, eps)
    return (nn.silu(z.astype(mx.float32)) * x.astype(mx.float32)).astype(y.dtype)


def gated_delta_reference(qkv, z, b, a, conv_weight, conv_state, A_log, dt_bias, state,
                          norm_weight, *, num_k_heads, head_k_dim, num_v_heads,
                          head_v_dim, eps, mask=None, lengths=None):
    """The GDN mixer between projections and ``out_proj`` (module docstring, steps 1-5).

    Args:
        qkv: ``[B, S, 2*Hk*Dk + Hv*Dv]`` projected q|k|v (bf16); z: ``[B, S, Hv, Dv]``;
        b, a: ``[B, S, Hv]``; conv_weight ``[C, K, 1]``; conv_state ``[B, K-1, C]`` or None;
        A_log, dt_bias: ``[Hv]`` (fp32 / bf16); state: ``[B, Hv, Dv, Dk]`` fp32 or None;
        norm_weight: ``[Dv]``; eps: gated-RMSNorm epsilon; mask ``[B, S]`` bool or None;
        lengths ``[B]`` or None (batched prefill, see ``conv_step_reference``).
    Returns:
        ``(out [B, S, Hv*Dv] in qkv's dtype, new_conv_state, new_state fp32)``.
    """
    from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk

    B, S, _ = qkv.shape
    Hk, Dk, Hv, Dv = num_k_heads, head_k_dim, num_v_heads, head_v_dim
    conv_out, new_conv = conv_step_reference(qkv, conv_weight, conv_state, mask, lengths)
    key_dim = Hk * Dk
    q, k, v = mx.split(conv_out, [key_dim, 2 * key_dim], -1)
    q = q.reshape(B, S, Hk, Dk)
    k = k.reshape(B, S, Hk, Dk)
    v = v.reshape(B, S, Hv, Dv)
    q, k = normalize_qk(q, k, inv_scale=Dk**-0.5, eps=1e-6)
    y, new_state = gated_delta_update(q, k, v, a, b, A_log, dt_bias, state, mask,
                                      use_kernel=True)
    out = gated_rms_norm_reference(y, z, norm_weight, eps)
    return out.reshape(B, S, -1), new_conv, new_state


# ---------------------------------------------------------------- kernels
# Launch contracts (Metal and CUDA twins share names, buffers, templates and grids).
# Every input is read through its *_strides (ensure_row_contiguous=False): the patched
# forward passes row-slice views of one fused projection, which would otherwise be copied
# on every call.
#
# lily_gdn_decode (S == 1): template T, Hk, Hv, Dk, Dv, KS, NW, HAS_MASK, HAS_LEN, PACKED;
#   grid (32*NW, B*Hv, 1), threadgroup (32*NW, 1, 1). PACKED: ``qkv`` is the fused input
#   projection's whole row ``q|k|v|z|b|a`` and z/b/a are read from it (inputs unread).
# lily_gdn_prep (S > 1): template T, Hk, Hv, D, KS, TT, HAS_MASK, HAS_LEN;
#   grid (D*(2*Hk+Hv)*ceil(S/TT), B, 1), threadgroup (D, 1, 1).
# lily_gdn_scan: template T, Hk, Hv, Dk, Dv, LPR, RPL, WPB;
#   grid (32*WPB, Dv/(WPB*(32/LPR)*RPL), B*Hv), threadgroup (32*WPB, 1, 1).
# lily_gdn_norm: template T, Hv, Dv, RPB; grid (32*RPB*ceil(B*S*Hv/RPB), 1, 1),
#   threadgroup (32*RPB, 1, 1).
DECODE = _k.KernelSpec(
    "lily_gdn_decode", "gdn_decode",
    ("qkv", "z", "b", "a", "conv_w", "conv_state", "A_log", "dt_bias", "state", "norm_w",
     "eps", "mask", "lengths", "hin", "res", "in_nw", "in_eps", "w", "scales", "biases",
     "counters", "ow", "oscales", "obiases"),
    ("out", "conv_out", "state_out", "h_out", "proj", "r_out", "r_parts"),
    ensure_row_contiguous=False)
PREP = _k.KernelSpec(
    "lily_gdn_prep", "gdn_prep",
    ("qkv", "conv_w", "conv_state", "a", "b", "A_log", "dt_bias", "mask", "lengths"),
    ("qn", "kn", "vv", "g", "beta", "conv_out"), ensure_row_contiguous=False)
SCAN = _k.KernelSpec(
    "lily_gdn_scan", "gdn_scan",
    ("qn", "kn", "vv", "g", "beta", "state"), ("y", "state_out"),
    ensure_row_contiguous=False)
NORM = _k.KernelSpec(
    "lily_gdn_norm", "gdn_norm", ("y", "z", "norm_w", "eps"), ("out",),
    ensure_row_contiguous=False)
#: Metal variant of the scan with q/k staged in threadgroup memory per block of steps
#: (``MLX_LILY_GDN_SCAN_LOAD=staged``; the CUDA scan stages them already): same launch
#: contract, needs ``Dk / LPR`` a multiple of 4.
SCAN_STAGED = _k.KernelSpec(
    "lily_gdn_scan_staged", "gdn_scan_staged", SCAN.inputs, SCAN.outputs,
    ensure_row_contiguous=False)
SPECS = (DECODE, PREP, SCAN, NORM)

_FLOATS = (mx.bfloat16, mx.float16, mx.float32)
PREP_TT = 16
NORM_RPB = 4
# (lanes per state row, rows per lane group, warps per block) of the scan, per backend.
# CUDA: gated_delta_bench's sweep at 2048 tokens on the H200 (ms per layer, q/k staged in
# shared memory per block): (16,2,4) 1.00, (8,1,4) 1.07, (8,2,4) 1.31, (16,4,2) 1.50,
# (8,1,8) 1.65, (16,1,8) 1.77, (32,4,1) 1.91, (32,2,2) 1.95, (32,1,4) 2.43, every
# configuration within the same error of the reference at production dims. The A/B gate's
# fp32 anchor (synthetic Qwen3.6-35B-A3B, 64 positions) put Lily at distance / top-1
# 0.246 / 0.531 with (16,2,4) (failed: stock 0.213 / 0.672), 0.225 / 0.594 with (8,1,4)
# and 0.224 / 0.609 with (32,4,1) (passed): (8,1,4) is the default until the cause of
# (16,2,4)'s larger distance is known.
SCAN_CONFIG = {"cuda": (8, 1, 4), "metal": (8, 1, 4)}
SCAN_ENV = "MLX_LILY_GDN_SCAN"


def scan_config(backend: str) -> tuple:
    """``(LPR, RPL, WPB)`` for ``lily_gdn_scan`` on ``backend``; ``MLX_LILY_GDN_SCAN=8,2,4``
    overrides (benchmark sweeps: ``tuning.gdn_scan``)."""
    from .. import tuning

    cfg = tuning.gdn_scan
    return cfg if cfg is not None else SCAN_CONFIG.get(backend, (8, 1, 4))


def _scan_ok(cfg, Dk, Dv) -> bool:
    lpr, rpl, wpb = cfg
    rb = wpb * (32 // lpr) * rpl
    return (lpr in (1, 2, 4, 8, 16, 32) and Dk % lpr == 0 and rpl >= 1
            and 1 <= wpb <= 32 and Dv % rb == 0)


def decode_warps(Dv: int) -> int:
    """Warps per threadgroup of ``lily_gdn_decode`` (8 state rows per warp, at most 16)."""
    return max(1, min(16, Dv // 8))


_DUMMY: dict = {}


def _dummy(name, dtype=None):
    """Stand-in for an absent input (never read: HAS_MASK / HAS_LEN / PROJ false): mask,
    lengths, an epsilon (``"eps"``: ``SCALAR_ELEMS`` elements, Metal ``constant`` like
    the real one), or a buffer of ``dtype`` with ``DEVICE_MIN_ELEMS`` elements, so that
    MLX renders it ``const device T*`` as it renders the real buffer (a Metal helper
    taking ``const device T*`` rejects a ``constant`` pointer even in an untaken branch)."""
    a = _DUMMY.get((name, dtype))
    if a is None:
        if name == "mask":
            a = _k.const_array([True], mx.bool_)
        elif name == "lengths":
            a = _k.const_array([0], mx.int32)
        elif name == "eps":
            a = _k.const_array([0], dtype)
        else:
            a = _k.const_array([0] * _k.DEVICE_MIN_ELEMS, dtype)
        _DUMMY[(name, dtype)] = a
    return a


class DecodeProj(NamedTuple):
    """The input projection that ``lily_gdn_decode`` computes itself under ``PROJ``:
    the row ``x = rms_norm(h0 + res) * norm_w`` (``eps``) and the fused q|k|v|z|b|a
    affine-quantized weight (``[P, K*bits/32]`` uint32, scales/biases ``[P, K/group_size]``,
    P = 2*Hk*Dk + 2*Hv*Dv + 2*Hv rows in that order; row-contiguous arrays: the kernel
    reads them without strides). ``counters``: an int32 array of zeros
    (``proj_counters``), at least B*Hv of them to spread each head's rows over
    ``PROJ_SPLIT`` blocks on CUDA, B*Hv + B with ``OutProj``; every launch leaves them
    zeros. Launches that share counters must be ordered (MLX runs independent graph nodes
    concurrently on CUDA): give each recurrent state its own (the patch keeps them on the
    cache object)."""

    h0: mx.array
    res: mx.array
    norm_w: mx.array
    eps: float
    w: mx.array
    scales: mx.array
    biases: mx.array
    group_size: int
    bits: int
    counters: mx.array | None = None


class OutProj(NamedTuple):
    """``out_proj`` for ``lily_gdn_decode``'s OUTP: ``[K, Hv*Dv]`` affine-quantized weight
    (uint32 ``[K, Hv*Dv*bits/32]``, scales/biases ``[K, Hv*Dv/group_size]``), no bias;
    row-contiguous arrays. With the input projection inside (``DecodeProj``) it has that
    projection's bits and group size; on a packed row (``gated_delta_packed``) its own
    ``group_size`` and ``bits``."""

    w: mx.array
    scales: mx.array
    biases: mx.array
    group_size: int | None = None
    bits: int | None = None


def counters_needed(B: int, Hv: int, out_proj: bool = True) -> int:
    """Arrival counters a launch of ``B`` rows and ``Hv`` v-heads uses: one per (row, head)
    for SPLIT, one more per row for OUTP."""
    return B * Hv + (B if out_proj else 0)


def proj_counters(n: int) -> mx.array:
    """A fresh int32 array of ``n`` zeros for ``DecodeProj.counters``, materialised now
    (no graph node: safe to create inside ``mx.compile`` tracing). Give each layer its
    own: launches sharing one must not run concurrently."""
    import numpy as np

    return mx.array(np.zeros(max(int(n), 1), np.int32))


_PARAMS_OK: dict = {}


def _params_reason(conv_weight, A_log, dt_bias, norm_weight, T, C, Hv, Dv):
    """(reason or None, conv kernel size) for a layer's parameters; cached per parameter
    objects (weak references), since they are the same arrays every step."""
    import weakref

    key = id(conv_weight)
    hit = _PARAMS_OK.get(key)
    if (hit is not None and hit[0]() is conv_weight and hit[1]() is A_log
            and hit[2]() is dt_bias and hit[3]() is norm_weight and hit[4] == (C, Hv, Dv)
            and hit[5] == T):
        return None, hit[6]
    ws = conv_weight.shape
    if len(ws) != 3 or ws[0] != C or ws[2] != 1:
        return "conv weight shape", 0
    K = ws[1]
    if not 2 <= K <= 8:
        return "conv kernel size", 0
    if conv_weight.dtype != T or norm_weight.dtype != T:
        return "mixed dtypes", 0
    if A_log.shape != (Hv,) or dt_bias.shape != (Hv,) or norm_weight.shape != (Dv,):
        return "parameter shapes", 0
    if A_log.dtype not in _FLOATS or dt_bias.dtype not in _FLOATS:
        return "parameter dtypes", 0
    try:
        refs = tuple(weakref.ref(t) for t in (conv_weight, A_log, dt_bias, norm_weight))
        if len(_PARAMS_OK) > 4096:
            _PARAMS_OK.clear()
        _PARAMS_OK[key] = refs + ((C, Hv, Dv), T, K)
    except TypeError:
        pass
    return None, K


def kernel_unsupported(qkv, z, b, a, conv_weight, conv_state, A_log, dt_bias, state,
                       norm_weight, *, num_k_heads, head_k_dim, num_v_heads, head_v_dim,
                       eps=1e-6, mask=None, lengths=None, scan_cfg=(8, 1, 4)):
    """Why the fused kernels cannot serve this call, or None when they can.

    Served: mask None or bool ``[B, S]``, lengths None or int32 ``[B]`` (mlx-lm's batched
    ``ArraysCache``); ``Dk == Dv``, a multiple of 32 up to 256;
    ``Hv % Hk == 0``; conv kernel size 2..8; one float dtype ``T`` for qkv, z, b, a,
    conv weight, conv state and norm weight; ``A_log``/``dt_bias`` ``[Hv]`` of any float
    dtype; state None or fp32 ``[B, Hv, Dv, Dk]``; any B and S >= 1 (S > 1 also needs the
    scan config ``(LPR, RPL, WPB)`` to tile Dv). Any strides (inputs are read through
    them). Kept lean: it runs on every decode step of every GDN layer.
    """
    Hk, Dk, Hv, Dv = num_k_heads, head_k_dim, num_v_heads, head_v_dim
    qs = qkv.shape
    if len(qs) != 3:
        return "qkv rank"
    B, S, C = qs
    if mask is not None and (mask.shape != (B, S) or mask.dtype != mx.bool_):
        return "mask"
    if lengths is not None and (lengths.shape != (B,) or lengths.dtype != mx.int32):
        return "lengths"
    if S < 1 or B < 1:
        return "empty"
    if Dk != Dv or Dk % 32 or not 32 <= Dk <= 256:
        return "head dims"
    if Hk < 1 or Hv % Hk:
        return "heads"
    if C != 2 * Hk * Dk + Hv * Dv:
        return "channels"
    T = qkv.dtype
    if T not in _FLOATS:
        return "dtype"
    reason, K = _params_reason(conv_weight, A_log, dt_bias, norm_weight, T, C, Hv, Dv)
    if reason is not None:
        return reason
    if z.shape != (B, S, Hv, Dv) or b.shape != (B, S, Hv) or a.shape != (B, S, Hv):
        return "z/b/a shape"
    if z.dtype != T or b.dtype != T or a.dtype != T:
        return "mixed dtypes"
    if conv_state is not None and (conv_state.shape != (B, K - 1, C) or conv_state.dtype != T):
        return "conv state"
    if state is not None and (state.shape != (B, Hv, Dv, Dk) or state.dtype != mx.float32):
        return "state"
    if S > 1 and not _scan_ok(scan_cfg, Dk, Dv):
        return "scan config"
    return None


def gated_delta_fused(qkv, z, b, a, conv_weight, conv_state, A_log, dt_bias, state,
                      norm_weight, *, num_k_heads, head_k_dim, num_v_heads, head_v_dim,
                      eps, get_kernel, scan_cfg=(8, 1, 4), decode_nw=None, mask=None,
                      lengths=None, init_value=None, packed=False, scan="kernel", proj=None,
                      proj_split=1, return_proj=False, out_proj=None, batch_fold=1,
                      out_counters=None):
    """The fused kernels for a call ``kernel_unsupported`` accepted.

    S == 1: one ``lily_gdn_decode`` launch. S > 1: ``lily_gdn_prep`` (conv, SiLU, l2norm,
    gates), ``lily_gdn_scan`` (register-resident recurrence), ``lily_gdn_norm`` (gated
    RMSNorm). ``get_kernel(spec)`` returns the kernel object (``kernels.get`` for the
    current backend, or an emulator-built one in tests); ``scan_cfg`` = (LPR, RPL, WPB) of
    the scan, ``decode_nw`` the decode kernel's warps (default ``decode_warps(Dv)``; must
    divide Dv). ``mask``/``lengths`` as in the reference: masked rows enter the conv as
    zeros and leave the state unchanged (their outputs are padding, not compared); lengths
    pick the new conv state. ``init_value`` (tests: NaN) pre-fills every output so an
    element a kernel never writes shows up. Returns ``(out [B,S,Hv*Dv], new_conv_state,
    new_state)``, the results of ``gated_delta_reference`` within rounding (module
    docstring, Numerics). ``packed`` (S == 1 only): ``qkv`` is the whole
    ``[B, 1, C + Hv*Dv + 2*Hv]`` projection row and z, b, a are ignored (see
    ``gated_delta_packed``). ``scan="chunked"`` (S > 1): the recurrence runs as
    ``scan_chunked`` (MLX matmuls, compiled) between the prep and norm kernels instead of
    ``lily_gdn_scan`` (masked steps reach it as decay 1, beta 0, as the prep kernel writes);
    ``scan="staged"``: ``lily_gdn_scan_staged`` where ``get_kernel`` has it (Metal) and
    ``Dk / LPR`` is a multiple of 4, else ``lily_gdn_scan``.
    ``proj`` (a ``DecodeProj``; S == 1, qkv/z/b/a None): the kernel computes the packed
    row itself (``PROJ``) and a fourth result, the residual sum ``h0 + res``, is returned
    (see ``gated_delta_proj``); ``proj_split`` blocks per head share the projection rows
    (> 1 needs ``proj.counters``; CUDA only); ``return_proj`` adds a fifth result, the
    rows each head read ``[B, Hv, 2*Dk+2*Dv+2]`` fp32 (tests). ``out_proj`` (an
    ``OutProj``, with ``proj``; CUDA; ``proj.counters`` of B*Hv + B zeros): the kernel
    also applies ``out_proj`` (``OUTP``) and its result ``r [B, 1, K]`` follows ``h``;
    without ``proj``, on a ``packed`` row with ``out_proj.bits`` / ``group_size`` and
    ``out_counters`` (int32, at least B zeros, left zeros), ``r`` is the fourth result.
    ``batch_fold`` (with ``proj``; CUDA): batch rows per block (``BN``); each weight tile
    of the projection and out_proj GEMVs is read once for them, and every row gets the
    arithmetic of ``batch_fold=1`` (bit-identical on the emulator and on an H200).

    Raises:
        ValueError: ``proj`` with S > 1; ``out_proj`` without ``proj`` and without a packed
            row, its bits / group size or ``out_counters``; ``proj_split`` > 1
            or ``out_proj`` without enough ``proj.counters``; ``batch_fold`` other than 1
            without ``proj``, or outside 1..``MAX_BATCH_FOLD``.
    """
    Hk, Dk, Hv, Dv = num_k_heads, head_k_dim, num_v_heads, head_v_dim
    if proj is not None:
        B, S, _ = proj.h0.shape
        T = proj.h0.dtype
        if S != 1:
            raise ValueError(f"gated_delta_fused: proj serves one step (S == 1), got S={S}")
        packed = True
        qkv = z = b = a = _dummy("x", T)
    else:
        B, S, _ = qkv.shape
        T = qkv.dtype
    C = 2 * Hk * Dk + Hv * Dv
    if packed and proj is None:
        z = b = a = qkv
    K = conv_weight.shape[1]
    if conv_state is None:
        conv_state = mx.zeros((B, K - 1, C), dtype=T)
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    eps_a = _k.f32_scalar(eps)
    extra = {} if init_value is None else {"init_value": init_value}
    flags = [("HAS_MASK", mask is not None), ("HAS_LEN", lengths is not None)]
    if mask is None:
        mask = _dummy("mask")
    if lengths is None:
        lengths = _dummy("lengths")
    fold = int(batch_fold)
    if fold != 1 and (proj is None or not 1 <= fold <= MAX_BATCH_FOLD):
        raise ValueError(f"gated_delta_fused: batch_fold={batch_fold} needs proj and "
                         f"1..{MAX_BATCH_FOLD}")
    if S == 1:
        nw = decode_nw or decode_warps(Dv)
        split = 1
        if out_proj is not None and proj is None and (
                not packed or out_proj.bits is None or out_proj.group_size is None
                or out_counters is None or out_counters.size < B):
            raise ValueError("gated_delta_fused: out_proj needs proj, or a packed row with "
                             "out_proj's bits and group size and out_counters of B zeros")
        if proj is not None:
            kdim = proj.h0.shape[-1]
            split = int(proj_split)
            need = counters_needed(B, Hv, out_proj is not None)
            if ((split > 1 or out_proj is not None)
                    and (proj.counters is None or proj.counters.size < need)):
                raise ValueError(f"gated_delta_fused: proj_split={split}"
                                 f"{' with out_proj' if out_proj is not None else ''} needs "
                                 f"counters of at least {need} zeros")
            pin = [proj.h0, proj.res, proj.norm_w, _k.f32_scalar(proj.eps), proj.w,
                   proj.scales, proj.biases,
                   proj.counters if need > B * Hv or split > 1 else _dummy("n", mx.int32)]
            ptmpl = [("PROJ", True), ("S", proj.scales.dtype), ("K", kdim),
                     ("BITS", proj.bits), ("GS", proj.group_size), ("RPW", PROJ_RPW)]
            h_shape, p_shape = (B, 1, kdim), (B, Hv, 2 * Dk + 2 * Dv + 2)
        elif out_proj is not None:  # packed row, out_proj inside: K/S/BITS/GS are ow's
            kdim = out_proj.w.shape[0]
            pin = [_dummy("x", T), _dummy("x", T), _dummy("x", T), _dummy("eps", mx.float32),
                   _dummy("w", mx.uint32), _dummy("x", T), _dummy("x", T), out_counters]
            ptmpl = [("PROJ", False), ("S", out_proj.scales.dtype), ("K", kdim),
                     ("BITS", out_proj.bits), ("GS", out_proj.group_size), ("RPW", 1)]
            h_shape = p_shape = (1,)
        else:
            pin = [_dummy("x", T), _dummy("x", T), _dummy("x", T), _dummy("eps", mx.float32),
                   _dummy("w", mx.uint32), _dummy("x", T), _dummy("x", T),
                   _dummy("n", mx.int32)]
            ptmpl = [("PROJ", False), ("S", T), ("K", 32), ("BITS", 4), ("GS", 32),
                     ("RPW", 1)]
            h_shape = p_shape = (1,)
        if out_proj is not None:
            pin += [out_proj.w, out_proj.scales, out_proj.biases]
            otmpl = [("OUTP", True), ("ORPW", OUT_RPW)]
            r_shape, rp_shape = (B, 1, kdim), (B, Hv, kdim)
        else:
            pin += [_dummy("w", mx.uint32), _dummy("x", T), _dummy("x", T)]
            otmpl = [("OUTP", False), ("ORPW", 1)]
            r_shape = rp_shape = (1,)
        out, new_conv, new_state, h, rows, r, _ = get_kernel(DECODE)(
            inputs=[qkv, z, b, a, conv_weight, conv_state, A_log, dt_bias, state,
                    norm_weight, eps_a, mask, lengths] + pin,
            template=[("T", T), ("Hk", Hk), ("Hv", Hv), ("Dk", Dk),
                      ("Dv", Dv), ("KS", K), ("NW", nw)] + flags
            + [("PACKED", bool(packed))] + ptmpl + [("SPLIT", split)] + otmpl
            + [("BN", fold)],
            grid=(32 * nw * split, -(-B // fold) * Hv, 1), threadgroup=(32 * nw, 1, 1),
            output_shapes=[(B, 1, Hv * Dv), (B, K - 1, C), (B, Hv, Dv, Dk), h_shape, p_shape,
                           r_shape, rp_shape],
            output_dtypes=[T, T, mx.float32, T, mx.float32, T, mx.float32], **extra)
        if proj is not None:
            res = (out, new_conv, new_state, h) + ((r,) if out_proj is not None else ())
            return res + ((rows,) if return_proj else ())
        if out_proj is not None:
            return out, new_conv, new_state, r
        return out, new_conv, new_state
    D = Dk
    n_tiles = -(-S // PREP_TT)
    qn, kn, vv, g, beta, new_conv = get_kernel(PREP)(
        inputs=[qkv, conv_weight, conv_state, a, b, A_log, dt_bias, mask, lengths],
        template=[("T", T), ("Hk", Hk), ("Hv", Hv), ("D", D), ("KS", K),
                  ("TT", PREP_TT)] + flags,
        grid=(D * (2 * Hk + Hv) * n_tiles, B, 1), threadgroup=(D, 1, 1),
        output_shapes=[(B, S, Hk, Dk), (B, S, Hk, Dk), (B, S, Hv, Dv), (B, S, Hv),
                       (B, S, Hv), (B, K - 1, C)],
        output_dtypes=[mx.float32, mx.float32, T, mx.float32, mx.float32, T], **extra)
    if scan == "chunked":
        y, new_state = _compiled_scan(CHUNK)(qn, kn, vv, g, beta, state)
        y = mx.contiguous(y.astype(T))  # the norm kernel reads y rows as laid out
    else:
        lpr, rpl, wpb = scan_cfg
        rb = wpb * (32 // lpr) * rpl
        k_scan = None
        if scan == "staged" and (Dk // lpr) % 4 == 0:
            k_scan = get_kernel(SCAN_STAGED)
        y, new_state = (k_scan or get_kernel(SCAN))(
            inputs=[qn, kn, vv, g, beta, state],
            template=[("T", T), ("Hk", Hk), ("Hv", Hv), ("Dk", Dk), ("Dv", Dv),
                      ("LPR", lpr), ("RPL", rpl), ("WPB", wpb)],
            grid=(32 * wpb, Dv // rb, B * Hv), threadgroup=(32 * wpb, 1, 1),
            output_shapes=[(B, S, Hv, Dv), (B, Hv, Dv, Dk)],
            output_dtypes=[T, mx.float32], **extra)
    rows = B * S * Hv
    (out,) = get_kernel(NORM)(
        inputs=[y, z, norm_weight, eps_a],
        template=[("T", T), ("Hv", Hv), ("Dv", Dv), ("RPB", NORM_RPB)],
        grid=(32 * NORM_RPB * (-(-rows // NORM_RPB)), 1, 1),
        threadgroup=(32 * NORM_RPB, 1, 1),
        output_shapes=[(B, S, Hv * Dv)], output_dtypes=[T], **extra)
    return out, new_conv, new_state


# ---------------------------------------------------------------- chunked scan
PREFILL_ENV = "MLX_LILY_GDN_PREFILL"  # "chunked": scan_chunked instead of lily_gdn_scan
CHUNK = 64
_CHUNK_CONST: dict = {}


def _chunk_constants(C: int):
    """``(I, incl, strict, level_masks)`` for chunk size ``C`` (a power of two): identity,
    lower-triangular masks with and without the diagonal, and per doubling level ``s`` the
    positions of the blocks below the diagonal that ``unit_lower_inverse`` fills."""
    c = _CHUNK_CONST.get(C)
    if c is None:
        import numpy as np

        i = np.arange(C)
        lv = []
        s = 1
        while s < C:
            same = (i[:, None] // (2 * s)) == (i[None, :] // (2 * s))
            lv.append(mx.array((same & ((i[:, None] % (2 * s)) >= s)
                                & ((i[None, :] % (2 * s)) < s)).astype(np.float32)))
            s *= 2
        c = (mx.eye(C, dtype=mx.float32), mx.array(np.tril(np.ones((C, C), np.float32))),
             mx.array(np.tril(np.ones((C, C), np.float32), -1)), lv)
        _CHUNK_CONST[C] = c
    return c


_SCAN_FNS: dict = {}


def _compiled_scan(chunk: int):
    """``scan_chunked`` at ``chunk`` under ``mx.compile`` (elementwise ops fused; one
    trace per input shape)."""
    fn = _SCAN_FNS.get(chunk)
    if fn is None:
        fn = _SCAN_FNS[chunk] = mx.compile(
            lambda q, k, v, g, beta, state: scan_chunked(q, k, v, g, beta, state, chunk))
    return fn


def tf32_matmuls(backend: str) -> bool:
    """Whether MLX may run fp32 matmuls at reduced (TF32-like) precision on ``backend``:
    on CUDA, and on Metal GPUs that support it, unless ``MLX_ENABLE_TF32=0`` (MLX reads it
    once per process, at its first such matmul; this reads the environment now).
    ``scan_chunked`` would then carry the state with ~1e-3 relative error."""
    import os

    return backend in ("cuda", "metal") and os.environ.get("MLX_ENABLE_TF32", "1") != "0"


def prefill_scan(backend: str) -> str:
    """``"chunked"`` when ``MLX_LILY_GDN_PREFILL=chunked`` (``scan_chunked`` between the
    prep and norm kernels) and fp32 matmuls are fp32 (``tf32_matmuls`` False); else on
    Metal with ``MLX_LILY_GDN_SCAN_LOAD=staged`` ``"staged"`` (``lily_gdn_scan_staged``);
    else ``"kernel"`` (``lily_gdn_scan``, the default)."""
    from .. import config, tuning

    kernel = "staged" if backend == "metal" and tuning.gdn_scan_load == "staged" else "kernel"
    if tuning.gdn_prefill != "chunked":
        return kernel
    if tf32_matmuls(backend):
        config.warn_user("mlx-lily: MLX_LILY_GDN_PREFILL=chunked ignored: MLX runs fp32 matmuls "
                         "in TF32 here (set MLX_ENABLE_TF32=0 to use it)", stacklevel=3)
        return kernel
    return "chunked"


def unit_lower_inverse(a: mx.array) -> mx.array:
    """``(I + a)^-1`` for strictly lower-triangular ``a [..., C, C]`` (C a power of two),
    fp32, by block doubling: with ``X`` the inverse of the diagonal blocks of size ``s``,
    ``X - X (L o M_s) X`` is the inverse of the blocks of size ``2s`` (``M_s`` selects each
    block's lower-left quarter). ``log2(C)`` levels of two batched matmuls; the result is
    exact up to fp32 rounding (no series truncation)."""
    C = a.shape[-1]
    eye, _, _, levels = _chunk_constants(C)
    lo = eye + a
    x = mx.broadcast_to(eye, a.shape)
    for m in levels:
        x = x - x @ (lo * m) @ x
    return x


def scan_chunked(q, k, v, g, beta, state, chunk: int = CHUNK):
    """The gated delta-rule scan (module docstring, step 4; ``mlx_lm``'s
    ``gated_delta_ops`` without a mask) in the chunked form: within a chunk of ``chunk``
    steps the recurrence is a triangular solve and matmuls, across chunks an affine map of
    the state, applied chunk after chunk (one ``addmm`` each).

    Per (batch, v-head), with ``S`` the state as ``[Dk, Dv]``, ``b_t`` the running product
    of the decays inside the chunk and ``A_tj = beta_t (k_t . k_j) b_t / b_j`` (j < t):
    ``D = (I + A)^-1 diag(beta) (V - diag(b) K S)`` (the chunk's deltas),
    ``y = diag(b) Q S + ((Q K^T) o G) D`` with ``G_tj = b_t / b_j`` (j <= t), and
    ``S' = b_C S + (diag(b_C / b) K)^T D``. Decay ratios are exponentials of sums of log
    decays over the steps between (no products of small numbers, no differences of large
    prefix sums); padded steps have decay 1 and beta 0.

    Args:
        q, k: ``[B, S, Hk, Dk]`` fp32 (normalised, q scaled); v: ``[B, S, Hv, Dv]``;
        g, beta: ``[B, S, Hv]`` fp32 (decay in (0, 1], beta in [0, 1]); state:
        ``[B, Hv, Dv, Dk]`` fp32; chunk: a power of two.
    Returns:
        ``(y [B, S, Hv, Dv] fp32, new_state [B, Hv, Dv, Dk] fp32)``.
    Raises:
        ValueError: ``chunk`` not a power of two, or Hv not a multiple of Hk.
    Source: Yang et al., "Gated Delta Networks" (2024), the chunkwise form (WY / UT
    transform) of the delta rule, Yang et al., "Parallelizing Linear Transformers with
    the Delta Rule over Sequence Length" (2024).
    """
    C = int(chunk)
    if C < 1 or C & (C - 1):
        raise ValueError(f"scan_chunked: chunk must be a power of two, got {chunk}")
    B, S, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    if Hv % Hk:
        raise ValueError(f"scan_chunked: {Hv} v-heads not a multiple of {Hk} k-heads")
    f32 = mx.float32
    if Hv > Hk:
        q = mx.repeat(q, Hv // Hk, axis=2)
        k = mx.repeat(k, Hv // Hk, axis=2)
    N = -(-S // C)
    pad = N * C - S
    lg = mx.log(mx.maximum(g.astype(f32), 1e-30))
    bt = beta.astype(f32)
    v = v.astype(f32)
    if pad:
        zq = [(0, 0), (0, pad), (0, 0), (0, 0)]
        q, k, v = mx.pad(q, zq), mx.pad(k, zq), mx.pad(v, zq)
        lg = mx.pad(lg, [(0, 0), (0, pad), (0, 0)])
        bt = mx.pad(bt, [(0, 0), (0, pad), (0, 0)])

    def heads(x):  # [B, N*C, H, D] -> [B, H, N, C, D]
        return x.reshape(B, N, C, Hv, x.shape[-1]).transpose(0, 3, 1, 2, 4)

    qh, kh, vh = heads(q), heads(k), heads(v)
    lg = lg.reshape(B, N, C, Hv).transpose(0, 3, 1, 2)
    bt = bt.reshape(B, N, C, Hv).transpose(0, 3, 1, 2)
    _, incl, strict, _ = _chunk_constants(C)
    gam = mx.cumsum(lg, axis=-1)  # log b_t
    # log(b_t / b_j) as the sum over j < i <= t itself, not a difference of prefix sums
    # (those reach thousands when decays underflow and would cancel)
    seg = mx.cumsum(mx.broadcast_to(lg[..., :, None], lg.shape + (C,)) * strict, axis=-2)
    gi = mx.exp(seg) * incl  # b_t / b_j, j <= t
    a = bt[..., :, None] * (kh @ kh.swapaxes(-1, -2)) * (gi * strict)
    tinv = unit_lower_inverse(a)
    u = tinv @ (bt[..., None] * vh)  # [.., C, Dv]
    w = tinv @ ((bt * mx.exp(gam))[..., None] * kh)  # [.., C, Dk]
    kt = kh * mx.exp(mx.cumsum(lg, axis=-1, reverse=True) - lg)[..., None]  # b_C / b_j
    bc = mx.exp(gam[..., -1])  # [B, Hv, N]
    eye_k = mx.eye(Dk, dtype=f32)
    m = bc[..., None, None] * eye_k - kt.swapaxes(-1, -2) @ w  # [.., Dk, Dk]
    cst = kt.swapaxes(-1, -2) @ u  # [.., Dk, Dv]
    s_cur = state.astype(f32).swapaxes(-1, -2)  # [B, Hv, Dk, Dv]
    entering = []
    for n in range(N):
        entering.append(s_cur)
        s_cur = mx.addmm(cst[:, :, n], m[:, :, n], s_cur)
    s_in = mx.stack(entering, axis=2)  # [B, Hv, N, Dk, Dv]
    d = u - w @ s_in
    y = (qh * mx.exp(gam)[..., None]) @ s_in + ((qh @ kh.swapaxes(-1, -2)) * gi) @ d
    y = y.transpose(0, 2, 3, 1, 4).reshape(B, N * C, Hv, Dv)[:, :S]
    return y, s_cur.swapaxes(-1, -2)


def has_kernel(backend: str) -> bool:
    """True on ``"metal"`` / ``"cuda"`` when that backend is available here: the fused
    decode step and prefill kernels then serve the calls ``kernel_unsupported`` accepts."""
    if backend not in ("metal", "cuda"):
        return False
    return _k.get(DECODE, backend) is not None


def gated_delta(qkv, z, b, a, conv_weight, conv_state, A_log, dt_bias, state, norm_weight,
                **dims):
    """Dispatcher: the fused kernels when they serve this backend and call (see
    ``kernel_unsupported``), else the reference. Same arguments and results as
    ``gated_delta_reference``."""
    backend = current_backend()
    if backend == "metal" or backend == "cuda":
        cfg = scan_config(backend) if qkv.shape[1] > 1 else (8, 1, 4)
        if (kernel_unsupported(qkv, z, b, a, conv_weight, conv_state, A_log, dt_bias, state,
                               norm_weight, scan_cfg=cfg, **dims) is None
                and _k.get(DECODE, backend) is not None):
            return gated_delta_fused(
                qkv, z, b, a, conv_weight, conv_state, A_log, dt_bias, state, norm_weight,
                get_kernel=lambda spec: _k.get(spec, backend), scan_cfg=cfg,
                scan=prefill_scan(backend) if qkv.shape[1] > 1 else "kernel", **dims)
    return gated_delta_reference(qkv, z, b, a, conv_weight, conv_state, A_log, dt_bias,
                                 state, norm_weight, **dims)


PACKED_OP = "gdn_packed"  # the packed decode form's switch (MLX_LILY_DISABLE / _KERNELS)


def has_packed_kernel(backend: str) -> bool:
    """True when ``gated_delta_packed`` runs its one-launch decode kernel on ``backend``."""
    return has_kernel(backend) and _k.kernels_allowed(PACKED_OP, backend)


class _Shape:
    """Shape and dtype of an array not built (``kernel_unsupported`` reads only these)."""

    __slots__ = ("shape", "dtype")

    def __init__(self, shape, dtype):
        self.shape, self.dtype = shape, dtype


def split_packed(y, *, num_k_heads, head_k_dim, num_v_heads, head_v_dim, **_):
    """``(qkv, z [B,S,Hv,Dv], b, a)`` views of a fused input projection ``y`` whose last
    axis is ``q|k|v|z|b|a`` (``C + Hv*Dv + 2*Hv`` wide; ``C = 2*Hk*Dk + Hv*Dv``).

    Raises:
        ValueError: the last axis has another width."""
    B, S, P = y.shape
    C = 2 * num_k_heads * head_k_dim + num_v_heads * head_v_dim
    zw = num_v_heads * head_v_dim
    if P != C + zw + 2 * num_v_heads:
        raise ValueError(f"gated_delta_packed: projection width {P}, expected "
                         f"{C + zw + 2 * num_v_heads} (q|k|v|z|b|a)")
    qkv, z, b, a = mx.split(y, [C, C + zw, C + zw + num_v_heads], axis=-1)
    return qkv, z.reshape(B, S, num_v_heads, head_v_dim), b, a


def packed_out_unsupported(y, out_proj: OutProj, counters, *, num_v_heads, head_v_dim,
                           **_) -> str | None:
    """Why ``lily_gdn_decode`` cannot apply ``out_proj`` inside on the packed row ``y``
    ``[B, 1, P]``, or None: the weight ``[K, Hv*Dv]`` 4- or 8-bit affine with its
    ``bits`` / ``group_size`` given and scales of a float dtype, each head's columns whole
    groups and a power-of-two number of 16-byte words, ``K`` a multiple of 4, a result of
    ``y``'s dtype (as ``mx.quantized_matmul`` would return), and ``counters`` with at
    least B zeros."""
    Hv, Dv = num_v_heads, head_v_dim
    bits, gs = out_proj.bits, out_proj.group_size
    if bits not in (4, 8) or gs not in (32, 64, 128):
        return "out_proj quantization"
    vpl = 128 // bits
    words = Dv // vpl
    k = out_proj.w.shape[0] if out_proj.w.ndim == 2 else 0
    if (not k or k % 4 or out_proj.w.shape != (k, Hv * Dv * bits // 32)
            or out_proj.w.dtype != mx.uint32):
        return "out_proj weight"
    if (out_proj.scales.shape != (k, Hv * Dv // gs) or out_proj.biases.shape
            != out_proj.scales.shape or out_proj.scales.dtype not in (mx.bfloat16, mx.float16,
                                                                      mx.float32)
            or out_proj.biases.dtype != out_proj.scales.dtype):
        return "out_proj scales"
    if Dv % gs or gs % vpl or words * vpl != Dv or words > 32 or words & (words - 1):
        return "out_proj head slice"
    if not _k.stock_result_dtype(y.dtype, out_proj.scales.dtype):
        return "out_proj dtype"
    if counters is None or counters.size < y.shape[0]:
        return "counters"
    return None


#: ``MLX_LILY_GDN_PACKED_OUTP=1`` (``tuning.gdn_packed_outp``; CUDA): where the packed
#: decode row comes from a separate projection, ``lily_gdn_decode`` applies ``out_proj``
#: itself (one launch fewer per GDN layer; each row's out_proj per head, simt) instead of
#: the output projection's GEMV launch.
PACKED_OUTP_ENV = "MLX_LILY_GDN_PACKED_OUTP"


def packed_outp_requested(backend: str) -> bool:
    """Whether a packed decode row takes ``out_proj`` inside on ``backend``: CUDA, the
    benchmarking knob ``MLX_LILY_GDN_PACKED_OUTP``, and the switches of ``gdn_out_proj``
    and of the launch it replaces (``qgemv_out``)."""
    from .. import tuning
    from ..registry import switch_on
    from . import qgemv as _qg

    return (backend == "cuda" and bool(tuning.gdn_packed_outp) and switch_on(OUT_OP, backend)
            and switch_on(_qg.OUT_PROJ_OP, backend))


def gated_delta_packed(y, conv_weight, conv_state, A_log, dt_bias, state, norm_weight,
                       out_proj: OutProj | None = None, counters=None, **dims):
    """``gated_delta`` on the fused input projection's output ``y [B, S, C+Hv*Dv+2*Hv]``
    (``q|k|v|z|b|a``, as ``qwen3_5``'s four projections fused at patch time). A decode
    step (S == 1) the kernel serves is one ``lily_gdn_decode`` launch reading z, b, a
    from ``y``'s columns (no split or reshape in the graph); anything else splits ``y``
    (``split_packed``) and calls ``gated_delta``. Same results as ``gated_delta``.

    With ``out_proj`` (an ``OutProj`` with its bits and group size) and ``counters``
    (int32, at least B zeros, left zeros) a fourth result follows: ``r [B, 1, K]`` when
    the launch also applied ``out_proj`` (``packed_outp_requested`` and
    ``packed_out_unsupported`` allow), else None (the caller applies it as without)."""
    if out_proj is not None:
        backend = current_backend()
        if y.shape[1] == 1 and packed_outp_requested(backend) and (
                packed_out_unsupported(y, out_proj, counters, **dims) is None
                and _k.kernels_allowed(PACKED_OP, backend)
                and _packed_kernel_serves(y, conv_weight, conv_state, A_log, dt_bias, state,
                                          norm_weight, **dims)
                and _k.get(DECODE, backend) is not None):
            return gated_delta_fused(
                y, None, None, None, conv_weight, conv_state, A_log, dt_bias, state,
                norm_weight, get_kernel=lambda spec: _k.get(spec, backend), packed=True,
                out_proj=out_proj, out_counters=counters, **dims)
        return (*gated_delta_packed(y, conv_weight, conv_state, A_log, dt_bias, state,
                                    norm_weight, **dims), None)
    backend = current_backend()
    if y.shape[1] == 1 and (backend == "metal" or backend == "cuda") and _k.kernels_allowed(
            PACKED_OP, backend):
        if (_packed_kernel_serves(y, conv_weight, conv_state, A_log, dt_bias, state,
                                  norm_weight, **dims)
                and _k.get(DECODE, backend) is not None):
            return gated_delta_fused(
                y, None, None, None, conv_weight, conv_state, A_log, dt_bias, state,
                norm_weight, get_kernel=lambda spec: _k.get(spec, backend), packed=True,
                **dims)
    return gated_delta(*split_packed(y, **dims), conv_weight, conv_state, A_log, dt_bias,
                       state, norm_weight, **dims)


def _packed_kernel_serves(y, conv_weight, conv_state, A_log, dt_bias, state, norm_weight,
                          **dims) -> bool:
    """Whether ``lily_gdn_decode`` takes the packed row ``y [B, 1, P]`` (its width and
    what ``kernel_unsupported`` accepts)."""
    Hk, Dk = dims["num_k_heads"], dims["head_k_dim"]
    Hv, Dv = dims["num_v_heads"], dims["head_v_dim"]
    B, S, P = y.shape
    C = 2 * Hk * Dk + Hv * Dv
    T = y.dtype
    return S == 1 and P == C + Hv * Dv + 2 * Hv and kernel_unsupported(
        _Shape((B, S, C), T), _Shape((B, S, Hv, Dv), T), _Shape((B, S, Hv), T),
        _Shape((B, S, Hv), T), conv_weight, conv_state, A_log, dt_bias, state,
        norm_weight, **dims) is None


# ---------------------------------------------------------------- projection inside
PROJ_OP = "gdn_proj"  # the decode kernel computes its own input projection (switch)
#: Weight rows per lane group and pass of ``lily_gdn_decode``'s PROJ GEMV.
PROJ_RPW = 4
#: out_proj rows per lane group and pass under OUTP.
OUT_RPW = 4
#: Blocks per (batch, v-head) sharing the PROJ GEMV, per backend (CUDA: 32 heads on one
#: block each kept 32 of the H200's 132 SMs busy, 49 us per layer under ncu;
#: Metal's twin takes 1 only).
PROJ_SPLIT = {"cuda": 4, "metal": 1}
PROJ_SPLIT_ENV = "MLX_LILY_GDN_PROJ_SPLIT"  # CUDA: blocks per head, overriding PROJ_SPLIT
#: Batch rows per block of the PROJ launch (``BN``), per backend. CUDA: at 1, a batch of
#: B rows reads each head's projection and out_proj weights B times, in B*Hv*PROJ_SPLIT
#: blocks of 512 threads (one per SM at the ~100 registers ptxas gives them: about B
#: waves on 132 SMs); folding reads them once per block of rows, but serialises the rows'
#: recurrence steps in the block: on the H200 folds of 2 / 4 / 8 were slower at every B
#: of 2 / 4 / 8 (docs/results.md), hence 1. Metal's twin takes 1 only.
BATCH_FOLD = {"cuda": 1, "metal": 1}
#: Most batch rows one block folds (``MLX_LILY_GDN_BATCH_FOLD``'s range).
MAX_BATCH_FOLD = 8
#: Static shared memory a CUDA block may hold (the folded rows' inputs live there).
CUDA_STATIC_SHARED = 49152


def proj_split(backend: str) -> int:
    """Blocks per (batch, v-head) of the PROJ launch on ``backend``: ``PROJ_SPLIT``, or on
    CUDA ``MLX_LILY_GDN_PROJ_SPLIT`` (``tuning.gdn_proj_split``: an integer 1..16; another
    value warns once and keeps ``PROJ_SPLIT``)."""
    from .. import tuning

    v = tuning.gdn_proj_split if backend == "cuda" else None
    return PROJ_SPLIT.get(backend, 1) if v is None else v


def fold_shared_bytes(bn: int, K: int, Dk: int, Dv: int, nw: int, itemsize: int,
                      out_proj: bool) -> int:
    """Bytes of shared memory a ``lily_gdn_decode`` block takes under PROJ with ``bn``
    batch rows per block (its static arrays: ``bn`` input rows of ``K`` and, with
    ``out_proj``, ``bn`` out_proj inputs of ``Dv`` values of ``itemsize`` bytes, each
    padded to 16 bytes; q/k/v, the projection rows, the reduction slots)."""
    row = -(-K * itemsize // 16) * 16
    orow = -(-Dv * itemsize // 16) * 16
    fixed = 4 * (2 * Dk + Dv) + 4 * (2 * Dk + 2 * Dv + 2) + 4 * nw + 4
    return bn * row + (bn * orow if out_proj else 16) + fixed


def batch_fold(backend: str, B: int, K: int, Dk: int, Dv: int, itemsize: int,
               out_proj: bool) -> int:
    """Batch rows per block of a PROJ launch of ``B`` rows on ``backend``: 1 for one row
    and off CUDA; else ``BATCH_FOLD``, or ``MLX_LILY_GDN_BATCH_FOLD``
    (``tuning.gdn_batch_fold``: an integer 1..8), lowered until the block's shared
    memory (``fold_shared_bytes``) fits ``CUDA_STATIC_SHARED``. Not capped at ``B``: a
    partial group of rows runs in the same build, so one setting builds one kernel."""
    from .. import tuning

    if backend != "cuda" or B <= 1:
        return 1
    v = tuning.gdn_batch_fold
    bn = BATCH_FOLD.get(backend, 1) if v is None else v
    nw = decode_warps(Dv)
    while bn > 1 and fold_shared_bytes(bn, K, Dk, Dv, nw, itemsize,
                                       out_proj) > CUDA_STATIC_SHARED:
        bn -= 1
    return bn


def gated_delta_proj_reference(p: DecodeProj, conv_weight, conv_state, A_log, dt_bias, state,
                               norm_weight, out_proj: OutProj | None = None, **dims):
    """A GDN decoder layer's decode step from its pending input to the gated-norm output.

    Contract: ``y, h = norm_qgemv_reference(p.h0, p.res, p.norm_w, p.eps, p.w, p.scales,
    p.biases, p.group_size, p.bits)`` (residual add, RMSNorm, the fused q|k|v|z|b|a
    projection, rounded to the activation dtype), then ``gated_delta_reference`` on
    ``split_packed(y)``.

    Args:
        p: ``DecodeProj``: ``h0``, ``res`` ``[B, 1, K]`` one float dtype, ``norm_w [K]``,
            the projection weight ``[P, K*bits/32]`` uint32 with scales/biases
            ``[P, K/group_size]``, ``P = 2*Hk*Dk + 2*Hv*Dv + 2*Hv``.
        conv_weight .. norm_weight, dims: as ``gated_delta_reference`` (``mask``,
            ``lengths`` included).
        out_proj: an ``OutProj``: also ``r = qgemv_reference(out, out_proj...)`` with the
            projection's group size and bits.
    Returns:
        ``(out [B,1,Hv*Dv], new_conv_state, new_state fp32, h [B,1,K])``, and ``r [B,1,K]``
        last when ``out_proj`` is given.
    Raises:
        ValueError: the projection's width is not ``P`` (``split_packed``).
    Source: Yang et al. 2024 (gated delta rule); the input projection folded into the
    recurrence kernel as Lily's decode path folds projections into their consumers.
    """
    from .norm_qgemv import norm_qgemv_reference

    y, h = norm_qgemv_reference(p.h0, p.res, p.norm_w, p.eps, p.w, p.scales, p.biases,
                                p.group_size, p.bits)
    out, conv, st = gated_delta_reference(*split_packed(y, **dims), conv_weight, conv_state,
                                          A_log, dt_bias, state, norm_weight, **dims)
    if out_proj is None:
        return out, conv, st, h
    from .qgemv import qgemv_reference

    r = qgemv_reference(out, out_proj.w, out_proj.scales, out_proj.biases, p.group_size,
                        p.bits)
    return out, conv, st, h, r


OUT_OP = "gdn_out_proj"  # the decode kernel also applies out_proj (switch; CUDA)


def out_proj_unsupported(p: DecodeProj, out_proj: OutProj, *, num_v_heads, head_v_dim,
                         **_) -> str | None:
    """Why ``lily_gdn_decode`` cannot apply ``out_proj`` inside (OUTP) on top of a PROJ
    call, or None: the weight ``[K, Hv*Dv]`` quantized like the input projection (bits,
    group size, scale dtype), each head's columns whole groups and a power-of-two number
    of 16-byte words per row, ``p.counters`` with B*Hv + B zeros."""
    Hv, Dv = num_v_heads, head_v_dim
    B, _, K = p.h0.shape
    vpl = 128 // p.bits
    words = Dv // vpl
    if out_proj.w.shape != (K, Hv * Dv * p.bits // 32) or out_proj.w.dtype != mx.uint32:
        return "out_proj weight"
    if (out_proj.scales.shape != (K, Hv * Dv // p.group_size)
            or out_proj.biases.shape != out_proj.scales.shape
            or out_proj.scales.dtype != p.scales.dtype or out_proj.biases.dtype != p.scales.dtype):
        return "out_proj scales"
    if Dv % p.group_size or words * vpl != Dv or words > 32 or words & (words - 1):
        return "out_proj head slice"
    if p.counters is None or p.counters.size < counters_needed(B, Hv):
        return "counters"
    return None


def out_enabled(backend: str) -> bool:
    """Whether OUTP may run on ``backend`` now: CUDA, ``proj_enabled``, the
    ``gdn_out_proj`` switch and that of the launch it replaces (``qgemv_out``)."""
    from ..registry import switch_on
    from . import qgemv as _qg

    return (backend == "cuda" and proj_enabled(backend) and switch_on(OUT_OP, backend)
            and switch_on(_qg.OUT_PROJ_OP, backend))


def has_out_kernel(backend: str) -> bool:
    """True when ``gated_delta_proj`` with ``out_proj`` runs one launch on ``backend``."""
    return has_kernel(backend) and out_enabled(backend)


#: Threadgroup bytes ``lily_gdn_decode`` may take under PROJ (Apple's limit: 32 KiB).
PROJ_MAX_SHARED = 32768


def proj_unsupported(p: DecodeProj, conv_weight, conv_state, A_log, dt_bias, state,
                     norm_weight, *, num_k_heads, head_k_dim, num_v_heads, head_v_dim,
                     mask=None, lengths=None, **_):
    """Why ``lily_gdn_decode`` cannot compute this call with its projection inside
    (``PROJ``), or None: one step (S == 1); what ``norm_qgemv.supports`` accepts for the
    projection (4/8-bit affine, K up to its limit) with exactly ``P`` rows and a result
    of the activation dtype; what ``kernel_unsupported`` accepts for the rest; the
    threadgroup arrays within ``PROJ_MAX_SHARED``; and not a projection the tensor-core
    GEMV serves (``qgemv.mma_serves``: it reads the weight once for all rows)."""
    from . import norm_qgemv as _nq
    from . import qgemv as _qg

    Hk, Dk, Hv, Dv = num_k_heads, head_k_dim, num_v_heads, head_v_dim
    hs = p.h0.shape
    if len(hs) != 3 or hs[1] != 1:
        return "steps"
    B, S, K = hs
    T = p.h0.dtype
    C = 2 * Hk * Dk + Hv * Dv
    if p.w.ndim != 2 or p.w.shape[0] != C + Hv * Dv + 2 * Hv:
        return "projection rows"
    if not _k.stock_result_dtype(T, p.scales.dtype):
        return "projection dtype"
    if not _nq.supports(p.h0, p.res, p.norm_w, p.w, p.scales, p.biases, p.group_size,
                        p.bits):
        return "projection"
    if _qg.mma_serves(current_backend(), p.h0, p.w, p.scales, p.biases, p.group_size,
                      p.bits):
        return "tensor-core projection"
    if fold_shared_bytes(1, K, Dk, Dv, decode_warps(Dv), T.size, False) > PROJ_MAX_SHARED:
        return "threadgroup memory"
    return kernel_unsupported(
        _Shape((B, S, C), T), _Shape((B, S, Hv, Dv), T), _Shape((B, S, Hv), T),
        _Shape((B, S, Hv), T), conv_weight, conv_state, A_log, dt_bias, state, norm_weight,
        num_k_heads=Hk, head_k_dim=Dk, num_v_heads=Hv, head_v_dim=Dv, mask=mask,
        lengths=lengths)


def proj_enabled(backend: str) -> bool:
    """Whether the fused projection form may run on ``backend`` now: its switch
    (``gdn_proj``) and those of the two launches it replaces (``norm_qgemv`` with
    ``qgemv``, ``gdn_packed``) allow it, and ``MLX_LILY_NORM_GEMV`` is not ``split``."""
    from ..backend import op_enabled
    from ..registry import switch_on
    from . import norm_qgemv as _nq
    from . import qgemv as _qg

    if backend not in ("metal", "cuda"):
        return False
    return (switch_on(PROJ_OP, backend) and switch_on(PACKED_OP, backend)
            and switch_on(_nq.NAME, backend) and op_enabled(_qg.NAME)
            and _qg.USE_FOR_QPROJ.get(backend, False) and not _nq.split_requested())


def has_proj_kernel(backend: str) -> bool:
    """True when ``gated_delta_proj`` runs its one-launch kernel on ``backend``."""
    return has_kernel(backend) and proj_enabled(backend)


def gated_delta_proj(p: DecodeProj, conv_weight, conv_state, A_log, dt_bias, state,
                     norm_weight, out_proj: OutProj | None = None, **dims):
    """Dispatcher: one ``lily_gdn_decode`` launch with the projection inside (``PROJ``)
    when ``proj_enabled`` and ``proj_unsupported`` is None, with ``out_proj`` inside too
    (``OUTP``) when ``out_enabled`` and ``out_proj_unsupported`` is None; else the
    launches they replace (``norm_qgemv``, ``gated_delta_packed``, ``qgemv``: each its own
    dispatcher). Same arguments and results as ``gated_delta_proj_reference``."""
    backend = current_backend()
    served = (proj_enabled(backend) and proj_unsupported(
        p, conv_weight, conv_state, A_log, dt_bias, state, norm_weight, **dims) is None
        and _k.get(DECODE, backend) is not None)
    if (out_proj is not None and served and out_enabled(backend)
            and out_proj_unsupported(p, out_proj, **dims) is None):
        return gated_delta_fused(
            None, None, None, None, conv_weight, conv_state, A_log, dt_bias, state,
            norm_weight, get_kernel=lambda spec: _k.get(spec, backend), proj=p,
            proj_split=proj_split(backend), out_proj=out_proj,
            batch_fold=batch_fold(backend, p.h0.shape[0], p.h0.shape[-1],
                                  dims["head_k_dim"], dims["head_v_dim"], p.h0.dtype.size,
                                  True), **dims)
    if out_proj is not None:
        from ..registry import switch_on
        from . import qgemv as _qg

        res = gated_delta_proj(p, conv_weight, conv_state, A_log, dt_bias, state,
                               norm_weight, **dims)
        gemv = _qg.qgemv if switch_on(_qg.OUT_PROJ_OP, backend) else _qg.qgemv_reference
        return (*res, gemv(res[0], out_proj.w, out_proj.scales, out_proj.biases,
                           p.group_size, p.bits))
    if served:
        B, Hv = p.h0.shape[0], dims["num_v_heads"]
        split = proj_split(backend)
        if p.counters is None or p.counters.size < B * Hv:
            split = 1
        return gated_delta_fused(
            None, None, None, None, conv_weight, conv_state, A_log, dt_bias, state,
            norm_weight, get_kernel=lambda spec: _k.get(spec, backend), proj=p,
            proj_split=split,
            batch_fold=batch_fold(backend, B, p.h0.shape[-1], dims["head_k_dim"],
                                  dims["head_v_dim"], p.h0.dtype.size, False), **dims)
    from .norm_qgemv import norm_qgemv

    y, h = norm_qgemv(p.h0, p.res, p.norm_w, p.eps, p.w, p.scales, p.biases, p.group_size,
                      p.bits)
    return (*gated_delta_packed(y, conv_weight, conv_state, A_log, dt_bias, state,
                                norm_weight, **dims), h)
