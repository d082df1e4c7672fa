"""mlx-lily ops: one module per fused boundary.

Each module defines a pure-MLX ``*_reference`` (the contract; runs on any backend),
kernel factories that return None off their backend, and a dispatcher that picks the
kernel, the reference, or (kill switch) signals the caller to run stock mlx-lm code.
"""

from __future__ import annotations

import importlib

_MODULES = {
    "add_rms_norm": "mlx_lily.ops.add_rms_norm",
    "moe_router_topk": "mlx_lily.ops.moe_router_topk",
    "moe_route": "mlx_lily.ops.moe_route",
    "moe_experts": "mlx_lily.ops.moe_experts",
    "moe_grouped": "mlx_lily.ops.moe_grouped",
    "gated_delta": "mlx_lily.ops.gated_delta",
    "attention": "mlx_lily.ops.attention",
    "qgemv": "mlx_lily.ops.qgemv",
    "norm_qgemv": "mlx_lily.ops.norm_qgemv",
    "gdn_packed": "mlx_lily.ops.gated_delta:has_packed_kernel",
    "attn_packed": "mlx_lily.ops.attention:has_packed_kernel",
    "moe_router_norm": "mlx_lily.ops.moe_router_topk:has_pre_norm_kernel",
    "moe_topk_in_experts": "mlx_lily.ops.moe_experts:has_routed_kernel",
    "qgemv_out": "mlx_lily.ops.qgemv:has_out_proj_kernel",
    "prefill_dequant": "mlx_lily.ops.qmm_dequant",
    "shared_dequant": "mlx_lily.ops.qmm_dequant:has_shared_kernel",
    "gdn_proj": "mlx_lily.ops.gated_delta:has_proj_kernel",
    "gdn_out_proj": "mlx_lily.ops.gated_delta:has_out_kernel",
    "moe_fused": "mlx_lily.ops.moe_experts:has_fused_kernel",
}


def kernel_status(name: str, backend: str) -> bool:
    """True when op ``name`` has a custom kernel that can serve on ``backend`` now."""
    mod_name, _, fn = _MODULES[name].partition(":")
    return bool(getattr(importlib.import_module(mod_name), fn or "has_kernel")(backend))
