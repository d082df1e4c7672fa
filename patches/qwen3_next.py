"""Lily for mlx-lm's ``qwen3_next`` module (and the blocks ``qwen3_5`` reuses): the patch
targets and ``prepare``. The code lives in sibling modules, one per job, and is
re-exported here (the names other code and tests import):

- ``blocks``: block forwards (attention, MoE, GatedDeltaNet, decoder layer);
- ``stack``: the decoder-stack and top-model forwards;
- ``decode_graph``: compiled decode steps (per layer, whole stack);
- ``kv_growth``: KV-cache growth policy;
- ``projections``: prepared fused projections, weight signatures, one-row views;
- ``launch_order``: counters and ordering inputs of the one-launch kernels.
"""

from __future__ import annotations

# the names this module offered before the split (other modules and tests read them)

import operator  # noqa: F401
import threading  # noqa: F401
import weakref  # noqa: F401

import mlx.core as mx  # noqa: F401
import mlx.nn as nn  # noqa: F401
from mlx_lm.models import qwen3_next  # noqa: F401
from mlx_lm.models.cache import ArraysCache, KVCache  # noqa: F401

from mlx_lily.backend import op_enabled  # noqa: F401
from mlx_lily.patching import module_mutations, mutations_tracked, prefill_eval_layers  # noqa: F401
from mlx_lily.kernels import device_scalars  # noqa: F401
from mlx_lily.ops import attention as attn_ops  # noqa: F401
from mlx_lily.ops import qgemv as _qgemv_ops  # noqa: F401
from mlx_lily.ops import norm_qgemv as norm_qgemv_ops  # noqa: F401
from mlx_lily.ops import qmm_dequant  # noqa: F401
from mlx_lily.ops.add_rms_norm import add_rms_norm  # noqa: F401
from mlx_lily.ops import gated_delta as gdn_ops  # noqa: F401
from mlx_lily.ops.gated_delta import gated_delta, gated_delta_packed  # noqa: F401
from mlx_lily.ops.moe_experts import FUSED_COUNTERS, moe_experts, moe_experts_routed  # noqa: F401
from mlx_lily.ops.moe_router_topk import PRE_NORM_OP, moe_router_topk, moe_router_topk_pending  # noqa: F401
from mlx_lily.qproj import PendingNorm, QProj, resolve  # noqa: F401


from . import projections  # noqa: F401
from . import layouts  # noqa: F401
from .layouts import drop_plans  # noqa: F401
from . import launch_order  # noqa: F401
from . import blocks  # noqa: F401
from . import kv_growth  # noqa: F401
from . import decode_graph  # noqa: F401
from . import stack  # noqa: F401
from .projections import (  # noqa: F401
    _CallLayer,
    CHECKED,
    _CheckedForward,
    contiguous_qproj,
    drop_views,
    LilyState,
    lm_head,
    one_row_linear,
    original,
    OUT_PROJ_OP,
    prepare_attention,
    prepare_moe,
    projection,
    refresh,
    run_projection,
    _VIEW_OWNERS,
    WeightSig,
)
from .launch_order import (  # noqa: F401
    COUNTERS_ATTR,
    counters_for,
    _gdn_counter_count,
    gdn_counters,
    moe_after,
    MOE_AFTER_ATTR,
    moe_counters,
)
from .blocks import (  # noqa: F401
    attention_call,
    _attention_decode_packed,
    _attention_supported,
    gdn_core,
    gdn_core_proj,
    _gdn_dims,
    _gdn_finish,
    _gdn_store,
    gdn_supported,
    layer_input,
    layer_mixer,
    layer_tail,
    make_decoder_call,
    moe_call,
    next_gdn_call,
    _stock_routing,
)
from .kv_growth import (  # noqa: F401
    DEFAULT_KV_STEP,
    KV_HEADROOM,
    kv_headroom,
    _kv_step,
    KV_STEP_ENV,
    kv_write_index,
    widen_kv_steps,
)
from .decode_graph import (  # noqa: F401
    _attn_cache_ok,
    _attn_static_head_dim,
    _attn_step_fn,
    attn_step_ok,
    check_weights,
    COMPILE_ATTN_ENV,
    compile_key,
    compiled_steps,
    _CompiledSteps,
    drop_compiled_steps,
    _gdn_cache_ok,
    _gdn_step,
    _gdn_step_fn,
    gdn_step_ok,
    _mlp_tail,
    _MODELS_WITH_STEPS,
    RECENT_WHOLE_STEPS,
    run_compiled,
    run_whole_step,
    _StepCache,
    _weights_changed,
    _whole_step_fn,
)
from .stack import (  # noqa: F401
    _eval_ahead,
    make_lm_call,
    make_text_model_call,
)


MODEL_TYPES = ("qwen3_next",)


decoder_call = make_decoder_call(lambda: qwen3_next.Qwen3NextDecoderLayer)


model_call = make_text_model_call(qwen3_next, "Qwen3NextModel", "Qwen3NextDecoderLayer", False)


lm_model_call = make_lm_call(lambda: qwen3_next.Model, False)


def targets():
    """``(owner, attribute, replacement)`` triples for ``mlx_lily.patch``."""
    return [
        (qwen3_next.Qwen3NextAttention, "__call__", attention_call),
        (qwen3_next.Qwen3NextSparseMoeBlock, "__call__", moe_call),
        (qwen3_next.Qwen3NextGatedDeltaNet, "__call__", next_gdn_call),
        (qwen3_next.Qwen3NextDecoderLayer, "__call__", decoder_call),
        (qwen3_next.Qwen3NextModel, "__call__", model_call),
        (qwen3_next.Model, "__call__", lm_model_call),
    ]


def prepare(model) -> None:
    """One-time re-layouts for a loaded qwen3_next model."""
    for layer in model.layers:
        if not layer.is_linear:
            prepare_attention(layer.self_attn)
        prepare_moe(layer.mlp)
