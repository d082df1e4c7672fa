"""The one table of Lily's ops and fusion switches, and the one answer to "does this call
run a kernel, and if not, why".

Every other list of ops is read from ``OPS``: ``backend.OP_NAMES`` (the names
``MLX_LILY_DISABLE`` / ``MLX_LILY_KERNELS`` / ``patch(ops=...)`` accept),
``ops.kernel_status`` (which module function says a kernel serves on a backend),
``kernels.op_of`` (which op a shader belongs to) and ``kernels.VERIFIED`` (what runs by
default). Adding a fusion switch is one ``Op(...)`` entry here plus its code in the op
module.

This module imports neither MLX nor mlx-lm (the settings parser and the startup hook read
it); the checks that need MLX import it when they run.
"""

from __future__ import annotations

import importlib
from typing import NamedTuple


class Op(NamedTuple):
    """One op or fusion switch.

    Attributes:
        name: the name settings use (``MLX_LILY_DISABLE=<name>``).
        kind: ``"op"`` (an op with its own reference and dispatcher) or ``"fusion"`` (a
            switch for one fused form of a parent op's launches).
        module: the op module under ``mlx_lily.ops`` that holds its code.
        status: function of ``module``, ``(backend: str) -> bool``: whether its kernel
            can serve on that backend now (kernel object built, switches allowing).
        stems: shader file stem prefixes of the kernels that belong to it
            (``shaders/<backend>/<stem>.*``; longest prefix wins).
        requires: names of the ops / switches that must be on too for it to run.
        backends: backends that have a kernel form of it.
        verified: backends where it is on by default (``MLX_LILY_KERNELS=verified``): its
            GPU parity tests and the A/B correctness gate on the full-size model passed
            with it running (the record is ``docs/results.md``).
        doc: one line: what runs when it is on.
        own_kernels: False when its work is MLX's own ops rather than Lily kernels (a
            launch census of Lily's kernels cannot see it: qualification times it).
        one_sequence: False when it serves only decode steps of several sequences, which
            qualification (one sequence) can neither check nor time.
    """

    name: str
    kind: str
    module: str
    status: str = "has_kernel"
    stems: tuple = ()
    requires: tuple = ()
    backends: tuple = ("metal", "cuda")
    verified: tuple = ()
    doc: str = ""
    own_kernels: bool = True
    one_sequence: bool = True


_GPU = ("metal", "cuda")

OPS: tuple = (
    Op("add_rms_norm", "op", "add_rms_norm", stems=("add_rms_norm",), verified=("cuda",),
       doc="residual add + RMSNorm in one launch"),
    Op("moe_router_topk", "op", "moe_router_topk", stems=("moe_router_topk",),
       verified=("cuda",), doc="MoE router GEMV + softmax + top-k in one launch"),
    Op("moe_experts", "op", "moe_experts", stems=("moe_gate_up", "moe_down"),
       verified=("cuda",), doc="decode MoE experts: gate+up and down GEMVs over the top-k"),
    Op("moe_grouped", "op", "moe_grouped", stems=("moeg_",), verified=("cuda",),
       doc="prefill MoE experts as grouped GEMMs over expert tiles"),
    # after moe_grouped: its kernels serve only the grouped GEMMs, which route by the
    # reference without them
    Op("moe_route", "op", "moe_route", stems=("moeg_route_",), requires=("moe_grouped",),
       verified=("cuda",),
       doc="sorting (token, expert) pairs into expert tiles on the GPU for moe_grouped"),
    Op("gated_delta", "op", "gated_delta", stems=("gdn_",), verified=("cuda",),
       doc="Gated DeltaNet: conv, gates, delta-rule scan and gated norm (decode, prefill)"),
    Op("attention", "op", "attention", stems=("attn_",), verified=("cuda",),
       doc="attention: q/k norm + RoPE, decode split-K SDPA, prefill flash SDPA"),
    Op("qgemv", "op", "qgemv", stems=("qgemv",), verified=("cuda",),
       doc="one-row quantized GEMV for fused projections"),
    Op("norm_qgemv", "op", "norm_qgemv", stems=("norm_qgemv",), requires=("qgemv",),
       verified=("cuda",), doc="residual add + RMSNorm folded into the next one-row GEMV"),
    Op("gdn_packed", "fusion", "gated_delta", "has_packed_kernel", requires=("gated_delta",),
       verified=("cuda",), doc="GDN decode reads the packed q|k|v|z|b|a projection"),
    Op("attn_packed", "fusion", "attention", "has_packed_kernel", requires=("attention",),
       verified=("cuda",), doc="attention decode reads the packed q|gate|k|v projection"),
    Op("moe_router_norm", "fusion", "moe_router_topk", "has_pre_norm_kernel",
       requires=("moe_router_topk",), verified=("cuda",),
       doc="post-attention add + RMSNorm inside the router kernel"),
    Op("moe_topk_in_experts", "fusion", "moe_experts", "has_routed_kernel",
       requires=("moe_experts",), verified=("cuda",),
       doc="routing (top-k) inside the experts' gate+up kernel"),
    Op("qgemv_out", "fusion", "qgemv", "has_out_proj_kernel", requires=("qgemv",),
       verified=("cuda",), doc="one-token output projections (GDN out_proj, o_proj) by qgemv"),
    Op("prefill_dequant", "op", "qmm_dequant", backends=("cuda",), verified=("cuda",),
       doc="many-row quantized matmuls as dequantize + dense matmul", own_kernels=False),
    Op("shared_dequant", "fusion", "qmm_dequant", "has_shared_kernel",
       requires=("prefill_dequant",), backends=("cuda",),
       doc="the shared expert's prefill matmuls through prefill_dequant", own_kernels=False),
    Op("gdn_proj", "fusion", "gated_delta", "has_proj_kernel",
       requires=("gdn_packed", "norm_qgemv", "qgemv"), verified=("cuda",),
       doc="GDN decode kernel computes its own input projection"),
    Op("gdn_out_proj", "fusion", "gated_delta", "has_out_kernel",
       requires=("gdn_proj", "qgemv_out"), backends=("cuda",), verified=("cuda",),
       doc="GDN decode kernel also applies out_proj"),
    Op("moe_fused", "fusion", "moe_experts", "has_fused_kernel", stems=("moe_decode",),
       requires=("moe_topk_in_experts", "norm_qgemv", "qgemv"), backends=("cuda",),
       verified=("cuda",), doc="the whole decode MoE block in one launch"),
    Op("batch_decode", "fusion", "attention", "has_packed_kernel",
       requires=("attention", "attn_packed", "qgemv"),
       doc="decode steps of 1-8 sequences in mlx-lm's batch caches (BatchGenerator, "
           "mlx_lm.server) through the one-sequence kernels, row by row",
       one_sequence=False),
)

BY_NAME: dict = {op.name: op for op in OPS}
NAMES: tuple = tuple(op.name for op in OPS)
BACKENDS = ("metal", "cuda", "cpu")


def get(name: str) -> Op:
    """The entry of ``name``.

    Raises:
        ValueError: no op or switch has that name.
    """
    try:
        return BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown mlx-lily op {name!r}; known: {list(NAMES)}") from None


def verified_by_backend() -> dict:
    """``{backend: frozenset(op names on by default)}`` for the GPU backends."""
    return {be: frozenset(op.name for op in OPS if be in op.verified) for be in _GPU}


def stem_ops() -> tuple:
    """``((stem prefix, op name), ...)``, longest prefix first (first match wins)."""
    pairs = [(stem, op.name) for op in OPS for stem in op.stems]
    return tuple(sorted(pairs, key=lambda p: -len(p[0])))


def status_functions() -> dict:
    """``{op name: "mlx_lily.ops.<module>[:<function>]"}`` (the ``ops._MODULES`` form)."""
    return {op.name: f"mlx_lily.ops.{op.module}"
            + ("" if op.status == "has_kernel" else f":{op.status}") for op in OPS}


def kernel_serves(name: str, backend: str) -> bool:
    """The op module's own answer: whether ``name``'s kernel can serve on ``backend`` now
    (``Op.status``; imports the op module)."""
    op = get(name)
    mod = importlib.import_module(f"mlx_lily.ops.{op.module}")
    return bool(getattr(mod, op.status)(backend))


def _switch_reason(name: str, backend: str) -> str | None:
    from . import backend as _b
    from . import kernels

    if not _b.op_enabled(name):
        if name in _b.disabled_ops():
            return "disabled by MLX_LILY_DISABLE"
        return "left out by patch(ops=...)"
    op = BY_NAME[name]
    if backend not in op.backends:
        return f"no {backend} kernel"
    if not kernels.kernels_allowed(name, backend):
        from . import config

        if "verified" in config.kernels:
            return (f"not verified on {backend} (MLX_LILY_KERNELS=verified; "
                    "MLX_LILY_KERNELS=all or a list naming it turns it on)")
        return "not listed in MLX_LILY_KERNELS"
    return None


def why_not(name: str, backend: str | None = None, call_reason: str | None = None) -> str | None:
    """Why ``name`` does not run its kernel, or None when it does.

    The checks, in order: its own switch (``MLX_LILY_DISABLE``, ``patch(ops=...)``), a
    kernel form on ``backend``, ``MLX_LILY_KERNELS`` (verified / all / a list), each op it
    ``requires``, the op module's ``status`` function (kernel object built on this
    machine, the module's own switches), and last ``call_reason``: the op's answer for one
    call (its ``*_unsupported`` function's string, e.g. ``"steps"``, ``"head_dim"``),
    which the caller computes.

    Args:
        name: an op or switch of ``OPS``.
        backend: ``"metal"``, ``"cuda"`` or ``"cpu"``; None = ``backend.current_backend()``.
        call_reason: None, or why this particular call is outside the kernel's contract.
    Returns:
        None (a kernel runs), or a short reason string.
    Raises:
        ValueError: an unknown name.
    """
    op = get(name)
    if backend is None:
        from .backend import current_backend

        backend = current_backend()
    reason = _switch_reason(name, backend)
    if reason is not None:
        return reason
    for req in op.requires:
        sub = why_not(req, backend)
        if sub is not None:
            return f"needs {req} ({sub})"
    if not kernel_serves(name, backend):
        return _unavailable_reason(name, backend)
    return call_reason


def _unavailable_reason(name: str, backend: str) -> str:
    if name == "gdn_proj":
        from . import tuning

        if tuning.norm_gemv == "split":
            return "MLX_LILY_NORM_GEMV=split"
    return f"kernel not available on this machine ({backend})"


def runs_kernel(name: str, backend: str | None = None) -> bool:
    """``why_not(name, backend) is None``."""
    return why_not(name, backend) is None


def switch_on(name: str, backend: str) -> bool:
    """The cheap part of ``why_not`` a decode step asks many times: ``name``'s own switch
    is on and ``MLX_LILY_KERNELS`` allows it on ``backend`` (requirements and the kernel
    object not checked)."""
    from . import backend as _b
    from . import kernels

    return _b.op_enabled(name) and kernels.kernels_allowed(name, backend)
