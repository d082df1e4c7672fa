"""Kernel variants the qualifier (``mlx_lily.qualify``) chooses between on each GPU.

``VARIANTS``: op name (``mlx_lily.registry``) -> variant name -> the settings
(environment variables of ``mlx_lily.tuning``, values as text) the variant runs under.
Every op also has the implicit ``"default"`` variant: the built-in tables, no setting.
No variant changes a result beyond floating-point summation order; each runs kernels
whose parity ``tests/test_variants.py`` checks under the Metal emulator.

- ``moe_experts``: slot groups of the decode down kernel (``lily_moe_down``): SL 1, 3 or
  9 (``moe_experts.DOWN_SLOT_SHAPES``; Metal's default is SL 1, CUDA's SL 3).
- ``attention``: the decode partial kernel, one simdgroup per query head ("simd") or per
  two ("simd2", ``lily_attn_decode_simd``, Metal only) instead of one simdgroup for all
  G heads of a KV head; and the fixed block of the long-context path (128 / 256 / 512
  keys, used from ``attention.SPLIT_K_MIN_CONTEXT`` cached tokens: a qualification whose
  decode context is shorter runs the default kernel for them).
- ``moe_topk_in_experts``: the routed MoE path with the residual add + RMSNorm computed
  once (``add_rms_norm``, then the plain router GEMV and gate+up) instead of folded into
  every gate+up threadgroup. The setting is global: the one-row projections split their
  norm the same way and ``gdn_proj`` steps aside while it is set.
- ``gated_delta``: the prefill scan with q/k staged in threadgroup memory per block of
  steps (``lily_gdn_scan_staged``, Metal only; the CUDA scan's pattern) instead of read
  from device memory by every lane group.
- ``moe_grouped``: the prefill grouped GEMMs reading a weight tile cooperatively (two
  threads per row, 16-byte words: ``moeg_*_coop``, Metal only; MLX ``gather_qmm_rhs``'s
  pattern) with the automatic tile height or 16 / 32 / 64 rows.
- ``qgemv``: launch shapes of the one-row GEMVs on Metal (the settings are global:
  ``lily_norm_qgemv`` follows the variant ``qgemv`` qualifies, so they are listed under
  one op, and a timed variant covers both kernels): 8 or 32
  rows per threadgroup instead of 16 at K 2048 (``MLX_LILY_QGEMV_SHAPE`` 2,4 / 8,4), 8
  bytes of weights per lane per step instead of 16 (``MLX_LILY_QGEMV_BPL=8``), and both
  as MLX's ``qmv_fast`` launches them (8 rows per 64-thread threadgroup, 8-byte loads);
  on CUDA the tensor-core form ``lily_qgemv_mma`` (``MLX_LILY_QGEMV_MMA=1``: each weight
  tile read once for the step's rows; ``CUDA_ONLY``). Under ``mma`` the norm-fused
  projections take ``lily_norm_qgemv_mma`` (or ``add_rms_norm`` and ``lily_qgemv_mma``)
  and ``gdn_proj`` steps aside for 4-bit projections (``qgemv.mma_serves``), at every
  number of rows.

Dispatch-level alternatives that are whole switches are not repeated here: the
qualifier already times each of ``gdn_proj`` (the GDN decode kernel computes its own
input projection vs a separate ``norm_qgemv`` GEMV launch feeding it) and
``norm_qgemv`` (the norm folded into the GEMV vs ``add_rms_norm`` + ``qgemv``) on vs off,
as ops of ``backend.OP_NAMES``.

``METAL_ONLY``: variants whose settings only act on Metal (other backends run the
default there); ``CUDA_ONLY`` likewise for CUDA. ``for_backend`` is the table one
backend qualifies: without those elsewhere, and without the variants equal to that
backend's default (``down_sl1`` and ``fixed_block_256`` on Metal, ``down_sl3`` and
``fixed_block_128`` on CUDA).
This module imports neither MLX nor mlx-lm (``for_backend`` imports the op modules).
"""

from __future__ import annotations

_DOWN = "MLX_LILY_MOE_DOWN_SHAPE"
_ATTN = "MLX_LILY_ATTN_DECODE"
_BLOCK = "MLX_LILY_ATTN_FIXED_BLOCK"
_LOAD = "MLX_LILY_MOEG_LOAD"
_QSHAPE = "MLX_LILY_QGEMV_SHAPE"
_QBPL = "MLX_LILY_QGEMV_BPL"
_QMMA = "MLX_LILY_QGEMV_MMA"

#: The one-row GEMV variants (``qgemv``'s; ``lily_norm_qgemv`` follows the same knobs).
_GEMV = {
    "rows_8": {_QSHAPE: "2,4"},
    "rows_32": {_QSHAPE: "8,4"},
    "bpl8": {_QBPL: "8"},
    "bpl8_rows_8": {_QBPL: "8", _QSHAPE: "2,4"},
}

VARIANTS: dict = {
    "moe_experts": {
        "down_sl1": {_DOWN: "4,2,1"},
        "down_sl3": {_DOWN: "4,2,3"},
        "down_sl9": {_DOWN: "2,2,9"},
    },
    "attention": {
        "decode_simd": {_ATTN: "simd"},
        "decode_simd2": {_ATTN: "simd2"},
        "fixed_block_128": {_BLOCK: "128"},
        "fixed_block_256": {_BLOCK: "256"},
        "fixed_block_512": {_BLOCK: "512"},
    },
    "moe_topk_in_experts": {
        "norm_once": {"MLX_LILY_NORM_GEMV": "split"},
    },
    "gated_delta": {
        "scan_staged": {"MLX_LILY_GDN_SCAN_LOAD": "staged"},
    },
    "moe_grouped": {
        "coop_load": {_LOAD: "coop"},
        "coop_load_tile16": {_LOAD: "coop", "MLX_LILY_MOE_TILE_ROWS": "16"},
        "coop_load_tile32": {_LOAD: "coop", "MLX_LILY_MOE_TILE_ROWS": "32"},
        "coop_load_tile64": {_LOAD: "coop", "MLX_LILY_MOE_TILE_ROWS": "64"},
    },
    "qgemv": {**{n: dict(e) for n, e in _GEMV.items()}, "mma": {_QMMA: "1"}},
}

#: Every environment variable a variant sets, in name order (compiled decode steps are
#: keyed by their values: ``patches.decode_graph.compile_key``).
KNOB_NAMES = tuple(sorted({e for op in VARIANTS.values() for env in op.values() for e in env}))

METAL_ONLY = frozenset({("attention", "decode_simd"), ("attention", "decode_simd2"),
                        ("gated_delta", "scan_staged"),
                        *(("moe_grouped", n) for n in ("coop_load", "coop_load_tile16",
                                                       "coop_load_tile32", "coop_load_tile64")),
                        *(("qgemv", n) for n in _GEMV)})
CUDA_ONLY = frozenset({("qgemv", "mma")})


def _default(env: str, backend: str):
    """The parsed value the built-in table gives knob ``env`` on ``backend`` (None: a
    knob without a per-backend table)."""
    if env == _DOWN:
        from .ops import moe_experts

        return moe_experts.DOWN_SHAPE.get(backend)
    if env == _LOAD:
        from .ops import moe_grouped

        return moe_grouped.WEIGHT_LOAD.get(backend)
    if env in (_QSHAPE, _QBPL):
        if backend != "metal":
            return None  # the knobs act on Metal only
        from .ops import qgemv

        return (qgemv.NW, qgemv.RPW) if env == _QSHAPE else qgemv.BYTES_PER_LANE["metal"]
    if env == _QMMA:
        return False  # off unless set (a CUDA variant)
    if env in (_ATTN, _BLOCK):
        from .ops import attention

        table = attention.DECODE_VARIANT if env == _ATTN else attention.FIXED_BLOCK
        return table.get(backend)
    return None


def is_default(env: dict, backend: str) -> bool:
    """Whether every setting of ``env`` gives what ``backend`` runs without it."""
    from . import tuning

    by_env = {k.env: k for k in tuning.KNOBS.values()}
    for var, raw in env.items():
        knob = by_env.get(var)
        if knob is None or _default(var, backend) != knob.parse(raw):
            return False
    return True


#: Variants that act only from ``attention.SPLIT_K_MIN_CONTEXT`` cached tokens (the
#: fixed-block decode path): a qualification decoding at a shorter context would time
#: the default kernel under their name.
LONG_CONTEXT = frozenset({("attention", n) for n in VARIANTS["attention"]
                          if n.startswith("fixed_block_")})


def for_backend(backend: str, table: dict | None = None,
                decode_context: int | None = None) -> dict:
    """``table`` (default ``VARIANTS``) as ``backend`` qualifies it: without the
    Metal-only variants elsewhere (and the CUDA-only ones off CUDA), without those equal
    to the backend's default, and, given a ``decode_context`` (tokens) below
    ``attention.SPLIT_K_MIN_CONTEXT``, without the ``LONG_CONTEXT`` variants (they would
    run the default kernel there)."""
    short = False
    if decode_context is not None:
        from .ops import attention

        short = decode_context < attention.SPLIT_K_MIN_CONTEXT
    out = {}
    for op, vs in (VARIANTS if table is None else table).items():
        keep = {name: env for name, env in vs.items()
                if (backend == "metal" or (op, name) not in METAL_ONLY)
                and (backend == "cuda" or (op, name) not in CUDA_ONLY)
                and not (short and (op, name) in LONG_CONTEXT)
                and not is_default(env, backend)}
        if keep:
            out[op] = keep
    return out
