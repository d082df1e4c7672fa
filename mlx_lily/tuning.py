"""Benchmarking knobs: every ``MLX_LILY_*`` variable the runtime reads besides the user
settings of ``mlx_lily.config``. They exist for sweeps and A/B runs; a user never needs
them (``docs/tuning.md`` lists them; ``KNOBS`` is the source a test checks it against).

Code reads ``tuning.<attr>`` (e.g. ``tuning.kv_step``); the value follows the environment
as ``config`` settings do (read at use, once per ``env_frozen`` block), with the same rule
for a bad value: one warning naming the variable and the accepted values, then the
default. ``None`` as a default means "the built-in table decides" (per backend, per shape).
This module imports neither MLX nor mlx-lm.
"""

from __future__ import annotations

from .config import (BadValue, Setting, cached, count, flag, install_properties, int_range,
                     int_tuple, one_of)


_WORDS = {"0": False, "off": False, "no": False, "false": False,
          "1": True, "on": True, "yes": True, "true": True}


def _switch(raw: str) -> bool:
    v = _WORDS.get(raw.lower())
    if v is None:
        raise BadValue()
    return v


def _text(raw: str) -> str:
    return raw


def _library(raw: str) -> str:
    from pathlib import Path

    if "/" in raw and not Path(raw).is_file():
        raise BadValue("no such file")
    return raw


KNOBS: dict = {k.attr: k for k in (
    Setting("compile_whole", "MLX_LILY_COMPILE_WHOLE", True, flag, "'1', '0'",
            "0: compiled decode steps per layer instead of the whole stack as one function"),
    Setting("compile_attn", "MLX_LILY_COMPILE_ATTN", True, flag, "'1', '0'",
            "0: attention layers' decode steps run eagerly inside compiled decode"),
    Setting("whole_replay", "MLX_LILY_WHOLE_REPLAY", True, flag, "'1', '0'",
            "0: every whole-stack decode step takes the full path (no replay from the "
            "previous step's ledger)"),
    Setting("nvrtc", "MLX_LILY_NVRTC", None, _library,
            "a path to libnvrtc.so, or a library name the loader finds",
            "the NVRTC library for ahead-of-time CUDA compiles when MLX has not loaded one"),
    Setting("gdn_scan", "MLX_LILY_GDN_SCAN", None, int_tuple(3, 1, 32),
            "three integers 1..32 'LPR,RPL,WPB' (e.g. '8,1,4')",
            "launch shape of the GDN prefill scan kernel (default: gated_delta.SCAN_CONFIG)"),
    Setting("prefill_eval_layers", "MLX_LILY_PREFILL_EVAL_LAYERS", None, count,
            "an integer (0: one group)",
            "decoder layers per async-eval group of a prefill chunk, on every backend "
            "(default: patching.PREFILL_EVAL_LAYERS)"),
    Setting("moe_tile_rows", "MLX_LILY_MOE_TILE_ROWS", None,
            one_of("16", "32", "64", values={"16": 16, "32": 32, "64": 64}), "'16', '32', '64'",
            "grouped-GEMM expert tile height (default: chosen from the expert load)"),
    Setting("gdn_prefill", "MLX_LILY_GDN_PREFILL", "kernel", one_of("kernel", "chunked"),
            "'kernel', 'chunked'",
            "chunked: GDN prefill scan by the chunkwise MLX-matmul form (needs "
            "MLX_ENABLE_TF32=0 on GPUs)"),
    Setting("norm_gemv", "MLX_LILY_NORM_GEMV", "fused", one_of("fused", "split"),
            "'fused', 'split'",
            "split: add + RMSNorm, then the GEMV, as two launches (instead of norm_qgemv)"),
    Setting("kv_step", "MLX_LILY_KV_STEP", None, int_range(1),
            "an integer >= 1", "KV-cache growth step in tokens (default: "
            "patches.qwen3_next.DEFAULT_KV_STEP)"),
    Setting("gdn_proj_split", "MLX_LILY_GDN_PROJ_SPLIT", None, int_range(1, 16),
            "an integer 1..16", "CUDA: blocks per (batch, v-head) of the gdn_proj launch "
            "(default: gated_delta.PROJ_SPLIT)"),
    Setting("gdn_batch_fold", "MLX_LILY_GDN_BATCH_FOLD", None, int_range(1, 8),
            "an integer 1..8", "CUDA: batch rows per block of the gdn_proj launch (each "
            "weight tile read once for them; default: gated_delta.BATCH_FOLD)"),
    Setting("moe_fused_rpw", "MLX_LILY_MOE_FUSED_RPW", None, int_tuple(3, 1, 8),
            "three integers 1..8 'r,g,d' (e.g. '2,4,1')",
            "rows per lane group of the one-launch MoE kernel's phases (default: "
            "moe_experts.FUSED_RPW)"),
    Setting("step_aside", "MLX_LILY_STEP_ASIDE", True, _switch,
            "'1', '0' (also on/off, yes/no)",
            "0: keep Lily's forwards installed where no kernel would run (references run)"),
    Setting("inject_fault", "MLX_LILY_INJECT_FAULT", "", _text,
            "op:kind[,op:kind...] (mlx_lily.first_contact.FAULT_KINDS)",
            "tests only: make an op's kernels fail at first contact"),
    Setting("qualify_emulate", "MLX_LILY_QUALIFY_EMULATE", False,
            one_of("0", "1", values={"0": False, "1": True}), "'0', '1'",
            "tests only: qualification's child process runs the Metal kernels emulated"),
    Setting("decode_pf", "MLX_LILY_DECODE_PF", None,
            one_of("1", "2", values={"1": 1, "2": 2}), "'1', '2'",
            "load groups in flight per warp in the attention decode kernel (default: "
            "attention.DECODE_PREFETCH)"),
    Setting("prefix_cache_every", "MLX_LILY_PREFIX_CACHE_EVERY", 8192, int_range(0),
            "an integer >= 0 (0: none)",
            "tokens between periodic snapshots of a long prefill (mlx_lily.prefix_cache)"),
    Setting("prefix_cache_snapshots", "MLX_LILY_PREFIX_CACHE_SNAPSHOTS", 32, int_range(0),
            "an integer >= 0",
            "most snapshots one prefix-cache store keeps, besides its byte limit"),
)}


def _down_shape(raw: str) -> tuple:
    v = int_tuple(3, 1, 16)(raw)
    if 32 * v[0] * v[2] > 1024:
        raise BadValue("32*NW*SL threads exceed 1024")
    return v


def _qgemv_shape(raw: str) -> tuple:
    v = int_tuple(2, 1, 32)(raw)  # NW <= 32: 32*NW <= 1024 threads
    if v[1] > 8:
        raise BadValue("RPW above 8")
    return v


KNOBS.update({k.attr: k for k in (
    Setting("qgemv_shape", "MLX_LILY_QGEMV_SHAPE", None, _qgemv_shape,
            "two integers 'NW,RPW', NW 1..32 (32*NW <= 1024 threads), RPW 1..8 "
            "(e.g. '2,4')",
            "Metal: simdgroups per threadgroup and output rows per lane group of "
            "lily_qgemv / lily_norm_qgemv (default: qgemv.launch_shape)"),
    Setting("qgemv_bpl", "MLX_LILY_QGEMV_BPL", None,
            one_of("16", "8", values={"16": 16, "8": 8}), "'16', '8'",
            "Metal: weight bytes each lane loads per step in lily_qgemv / "
            "lily_norm_qgemv (default: qgemv.BYTES_PER_LANE)"),
    Setting("qgemv_mma", "MLX_LILY_QGEMV_MMA", False, _switch,
            "'1', '0' (also on/off, yes/no)",
            "CUDA: 1: decode GEMVs of qgemv (LM head, output projections) on tensor cores "
            "(lily_qgemv_mma: each weight tile read once for all rows), and the 4-bit "
            "norm-fused projections too (lily_norm_qgemv_mma; gdn_proj steps aside)"),
    Setting("gdn_packed_outp", "MLX_LILY_GDN_PACKED_OUTP", False, _switch,
            "'1', '0' (also on/off, yes/no)",
            "CUDA: 1: where a GDN decode row is projected by a separate launch (e.g. under "
            "MLX_LILY_QGEMV_MMA), the GDN decode kernel applies out_proj itself"),
    Setting("attn_decode", "MLX_LILY_ATTN_DECODE", None, one_of("gqa", "simd", "simd2"),
            "'gqa', 'simd', 'simd2'",
            "Metal: the decode attention partial kernel (default: "
            "attention.DECODE_VARIANT)"),
    Setting("attn_fixed_block", "MLX_LILY_ATTN_FIXED_BLOCK", None,
            one_of("32", "64", "128", "256", "512",
                   values={"32": 32, "64": 64, "128": 128, "256": 256, "512": 512}),
            "'32', '64', '128', '256', '512'",
            "keys per block of long-context decode attention (default: "
            "attention.FIXED_BLOCK)"),
    Setting("attn_decode_warps", "MLX_LILY_ATTN_DECODE_WARPS", None, int_range(1, 65536),
            "an integer 1..65536",
            "warps (simdgroups) the shorter-context decode attention block rule aims for "
            "(default: attention.TARGET_SIMDGROUPS)"),
    Setting("moe_down_shape", "MLX_LILY_MOE_DOWN_SHAPE", None, _down_shape,
            "three integers 1..16 'NW,RPW,SL' with 32*NW*SL <= 1024 (e.g. '4,2,3')",
            "launch shape of the decode MoE down kernel (default: "
            "moe_experts.DOWN_SHAPE)"),
    Setting("moeg_load", "MLX_LILY_MOEG_LOAD", None, one_of("row", "coop"),
            "'row', 'coop'",
            "Metal: how the prefill grouped GEMMs read a weight tile (default: "
            "moe_grouped.WEIGHT_LOAD)"),
    Setting("cuda_source", "MLX_LILY_CUDA_SOURCE", "include", one_of("include", "inline"),
            "'include', 'inline'",
            "CUDA: how kernel sources reach MLX: #include lines naming copies under "
            "<cache_dir>/cuda-src (include) or the whole texts (inline, which MLX hashes "
            "at every launch); read when a process builds its kernels"),
    Setting("gdn_scan_load", "MLX_LILY_GDN_SCAN_LOAD", None, one_of("direct", "staged"),
            "'direct', 'staged'",
            "Metal: the GDN prefill scan reads q/k from device memory per lane group "
            "(direct, the default) or staged in threadgroup memory per block of steps"),
)})


_BY_ENV = {k.env: a for a, k in KNOBS.items()}  # environment variable -> knob

#: Knob values this device's qualification record chose (``attr -> raw text``: the
#: settings of each qualified op's variant, ``qualify.record_variant_settings``), set by
#: ``kernels.verified_ops`` when it reads the record. A knob whose variable is set in the
#: environment keeps the environment's value.
QUALIFIED: dict = {}


def value(attr: str):
    """The knob ``attr`` now: its environment variable when set, else the value the
    qualification record chose (``QUALIFIED``), else its default.

    Raises:
        AttributeError: no knob has that name.
    """
    if QUALIFIED and attr in QUALIFIED and attr in KNOBS:
        from .config import env_value, read

        if not env_value(KNOBS[attr].env, ""):
            return read(KNOBS[attr], QUALIFIED[attr])
    return cached(KNOBS, attr, "mlx_lily.tuning")


def set_qualified(env_settings: dict) -> None:
    """Replace ``QUALIFIED`` with the knobs of ``env_settings`` (``{MLX_LILY_* name: raw
    value}``; names that are no knob are ignored)."""
    by_env = {k.env: a for a, k in KNOBS.items()}
    QUALIFIED.clear()
    QUALIFIED.update({by_env[v]: raw for v, raw in env_settings.items()
                      if v in by_env and raw is not None})


def values_of(envs) -> tuple:
    """``((env name, value), ...)`` for the knobs named by environment variable in
    ``envs``, in that order (each as ``value`` gives it; names that are no knob give
    None): a cache key that changes whenever one of those knobs does."""
    return tuple((e, value(_BY_ENV[e]) if e in _BY_ENV else None) for e in envs)


install_properties(__name__, KNOBS, value)
