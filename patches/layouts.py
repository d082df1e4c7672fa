"""mlx-lm module layouts as the ops read them: which mlx-lm classes and attributes make up a
MoE block's experts and shared expert, turned into plain arrays and parameters
(``DecodeWeights``, ``GroupedWeights``, ``Experts``). The ops under ``mlx_lily/ops`` take
only those; this is the one place that knows mlx-lm's ``SwitchGLU``,
``QuantizedSwitchLinear``, ``SwiGLU`` and ``Qwen3NextMLP``."""

from __future__ import annotations

import functools

import mlx.core as mx
import mlx.nn as nn

from mlx_lily import kernels
from mlx_lily.ops import qgemv, qmm_dequant
from mlx_lily.ops.moe_experts import DecodeWeights, Experts
from mlx_lily.ops.moe_grouped import GroupedWeights

#: Scales/biases dtypes the decode kernels read.
_FLOATS = (mx.bfloat16, mx.float16, mx.float32)


def _qparams(layer):
    return (layer.bits, layer.group_size, getattr(layer, "mode", "affine") or "affine")


def decode_weights(switch_mlp, shared_expert) -> DecodeWeights | None:
    """Collect the weights for the decode kernels, or None when the module layout is
    not one they implement: mlx-lm ``SwitchGLU`` with SwiGLU activation and
    ``QuantizedSwitchLinear`` gate/up/down without additive bias, a shared expert with
    ``QuantizedLinear`` gate/up/down of the same intermediate size, all affine with one
    (bits in {4, 8}, group in {32, 64, 128})."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwiGLU, SwitchGLU

    if type(switch_mlp) is not SwitchGLU or type(switch_mlp.activation) is not SwiGLU:
        return None
    if shared_expert is None:
        return None
    sw = [switch_mlp.gate_proj, switch_mlp.up_proj, switch_mlp.down_proj]
    sh = [getattr(shared_expert, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(type(l) is QuantizedSwitchLinear for l in sw):
        return None
    if not all(type(l) is nn.QuantizedLinear for l in sh):
        return None
    if not _is_swiglu_mlp(shared_expert):
        return None
    layers = sw + sh
    if any("bias" in l or l.get("biases") is None for l in layers):
        return None
    if getattr(switch_mlp.gate_proj, "global_scale", None) is not None:
        return None
    params = {_qparams(l) for l in layers}
    if len(params) != 1:
        return None
    bits, gs, mode = params.pop()
    if mode != "affine" or bits not in (4, 8) or gs not in (32, 64, 128):
        return None
    gw, uw, dw = (l.weight for l in sw)
    if gw.ndim != 3 or gw.shape != uw.shape or gw.dtype != mx.uint32:
        return None
    e, i, dpk = gw.shape
    d = dpk * 32 // bits
    if dw.shape != (e, d, i * bits // 32):
        return None
    if sh[0].weight.shape != (i, dpk) or sh[1].weight.shape != (i, dpk):
        return None
    if sh[2].weight.shape != (d, i * bits // 32):
        return None
    sdt = {l.scales.dtype for l in layers} | {l.biases.dtype for l in layers}
    if len(sdt) != 1 or sdt.pop() not in _FLOATS:
        return None
    if d % gs or i % gs or qgemv.lanes_per_row(d, bits) is None \
            or qgemv.lanes_per_row(i, bits) is None:
        return None
    trip = lambda l: (l.weight, l.scales, l.biases)  # noqa: E731
    return DecodeWeights(trip(sw[0]), trip(sw[1]), trip(sw[2]), trip(sh[0]), trip(sh[1]),
                         trip(sh[2]), e, d, i, bits, gs)


def _is_swiglu_mlp(m) -> bool:
    """The shared expert computes ``down(silu(gate(x)) * up(x))`` (mlx-lm's
    ``Qwen3NextMLP``; ``qwen3_5`` reuses that class)."""
    try:
        from mlx_lm.models.qwen3_next import Qwen3NextMLP
    except ImportError:  # pragma: no cover
        return False
    return type(m) is Qwen3NextMLP


def _qswitch(layer):
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    return isinstance(layer, QuantizedSwitchLinear)


def grouped_weights(switch_mlp) -> GroupedWeights | str:
    """The stacked expert arrays for the prefill grouped GEMM (``moe_grouped``), or the
    reason (a short string) the module layout is not one it implements: mlx-lm
    ``SwitchGLU`` with SwiGLU activation and ``QuantizedSwitchLinear`` gate/up/down,
    4-bit affine group 64 with biases, without additive bias or global scale. Array
    shapes and dtypes are the op's checks (``moe_grouped.why_unsupported``)."""
    from mlx_lm.models.switch_layers import SwiGLU

    if not all(hasattr(switch_mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
        return "switch_mlp is not a SwitchGLU"
    if type(getattr(switch_mlp, "activation", None)) is not SwiGLU:
        return "activation is not SwiGLU"
    layers = (switch_mlp.gate_proj, switch_mlp.up_proj, switch_mlp.down_proj)
    for l in layers:
        if not _qswitch(l):
            return "experts not quantized (QuantizedSwitchLinear)"
        if (l.mode != "affine" or l.bits != 4 or l.group_size != 64
                or l.get("biases") is None or "bias" in l
                or getattr(l, "global_scale", None) is not None):
            return "experts not 4-bit affine group-64 without linear bias"
    return GroupedWeights(*((l["weight"], l["scales"], l["biases"]) for l in layers))


def mlp(module, x: mx.array) -> mx.array:
    """``module(x)`` for mlx-lm's ``Qwen3NextMLP`` (the shared expert: ``down(swiglu(
    gate(x), up(x)))``, mlx-lm's own ``swiglu``), ``x [..., D]`` -> ``[..., D]`` in
    ``x``'s dtype. With ``shared_dequant`` allowed, gate and up run as one stacked
    projection (``qmm_dequant.stacked_linear``: Qwen3.6's shared expert has 512 outputs
    each, under ``MIN_OUT`` alone); otherwise, or where the stack does not serve, each
    projection goes through ``qmm_dequant.linear`` on its own (``prefill_dequant``: gate
    must serve, else the whole call is ``module(x)``); down through ``linear`` where it
    serves. Any other module: ``module(x)``."""
    from mlx_lm.models import qwen3_next
    from mlx_lm.models.activations import swiglu

    if type(module) is not qwen3_next.Qwen3NextMLP:
        return module(x)
    gu = None
    if qmm_dequant.shared_stack_open():
        gu = qmm_dequant.stacked_linear((module.gate_proj, module.up_proj), x)
    if gu is None:
        g = qmm_dequant.linear(module.gate_proj, x)
        if g is None:
            return module(x)
        u = qmm_dequant.linear(module.up_proj, x)
        gu = (g, module.up_proj(x) if u is None else u)
    g, u = gu
    a = swiglu(g, u)
    d = qmm_dequant.linear(module.down_proj, a)
    return module.down_proj(a) if d is None else d


#: Attribute of a ``SwitchGLU`` holding what ``experts`` derives from its weights (a
#: ``kernels.PlanCache``: a deep copy starts empty).
_EXPERTS_ATTR = "_lily_experts"


def _weights_key(switch_mlp, shared_expert) -> tuple:
    """Names the block's weights: the shared expert and the stacked expert arrays (the
    cached entry holds them; a swap makes a new key)."""
    parts = (getattr(switch_mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj"))
    return (id(shared_expert),
            *(id(p.get("weight")) if isinstance(p, nn.Module) else id(p) for p in parts))


def experts(switch_mlp, shared_expert) -> Experts:
    """The ``Experts`` the MoE ops take for mlx-lm's ``switch_mlp`` (``SwitchGLU``) and
    ``shared_expert`` (``Qwen3NextMLP`` or None): the stock modules as callables, the
    shared expert for many rows (``mlp``), ``decode_weights``, ``grouped_weights`` and
    the launch-plan caches. The arrays and plans are cached on ``switch_mlp`` for its
    current weight arrays (derived again, with empty plans, when one is replaced); the
    modules are not (no reference cycle keeps a dropped model's arrays alive)."""
    cache = kernels.plan_cache(switch_mlp, _EXPERTS_ATTR)
    key = _weights_key(switch_mlp, shared_expert)
    entry = cache.get(key)
    if entry is None:
        cache.clear()  # the old entry holds the old arrays
        entry = cache[key] = (decode_weights(switch_mlp, shared_expert),
                              grouped_weights(switch_mlp), {})
    decode, grouped, plans = entry
    rows = None if shared_expert is None else functools.partial(mlp, shared_expert)
    return Experts(switch_mlp, shared_expert, rows, decode, grouped, plans)


def drop_plans(switch_mlp) -> None:
    """Forget the ``Experts`` and every launch plan cached on ``switch_mlp`` (they hold
    its arrays): called when its weights were replaced, so the old arrays are freed."""
    switch_mlp.__dict__.pop(_EXPERTS_ATTR, None)
