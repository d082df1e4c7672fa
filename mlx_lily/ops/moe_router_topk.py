"""MoE router: logits, fp32 softmax over all experts, top-k, renormalisation, and the
shared-expert sigmoid gate.

Contract (``moe_router_topk_reference``), matching mlx-lm's ``Qwen3NextSparseMoeBlock``:
``probs = softmax(gate(x))`` computed in fp32 and rounded to the activation dtype;
the k largest probabilities are chosen; when ``norm_topk_prob`` the k scores are
divided by their sum (in the activation dtype); ``shared = sigmoid(shared_expert_gate(x))``.

Ties. mlx-lm selects with ``argpartition``, which leaves the choice between equal
probabilities at the k-th place unspecified (and it differs between backends); with
bf16 probabilities such ties are common. ``tie_break="lowest_id"`` (the kernels'
contract) breaks them towards the LOWEST expert id and orders the k picks by decreasing
probability (a stable descending sort). ``tie_break="stock"`` selects exactly as mlx-lm
does, so the reference path reproduces stock mlx-lm bit for bit; the two agree on every
row without an exact tie at the k-th place.

Kernel (``lily_moe_router_topk``, ``shaders/{metal,cuda}/moe_router_topk.*``): one launch,
one threadgroup per token row: the quantized GEMV over the fused router rows (E logits +
the shared-expert gate, 16-byte weight loads, ``scale*dot(q,x) + bias*sum(x)`` per group
in fp32, logits rounded to the activation dtype like ``quantized_matmul``'s output), then
one simdgroup/warp does the fp32 softmax (probabilities rounded to the activation dtype),
k rounds of a lane-parallel argmax with ties to the lowest id, the renormalisation (sum in
fp32 rounded to the activation dtype, as MLX's bf16 ``sum`` does) and the sigmoid gate.
The dispatcher uses it for a fused quantized router (``QProj`` with parts ``(E, 1)`` or
``(E,)``) and at most ``MAX_ROWS`` rows (any number while ``batch_decode`` is on:
``row_limit``); everything else runs the reference.
Source: Qwen3-Next / Qwen3.5 MoE routing (softmax top-k with renormalisation).
"""

from __future__ import annotations

import mlx.core as mx

from .. import kernels
from ..backend import current_backend
from ..registry import switch_on
from .proj import Proj
from . import qgemv

NAME = "moe_router_topk"


def topk_lowest_id(probs: mx.array, k: int) -> mx.array:
    """Indices ``[..., k]`` (uint32) of the k largest entries along the last axis, ties to
    the lowest index, ordered by decreasing value."""
    order = mx.argsort(-probs.astype(mx.float32), axis=-1)
    return order[..., :k]


def moe_router_topk_reference(x: mx.array, router, k: int, norm_topk_prob: bool, *,
                              tie_break: str = "lowest_id"):
    """Route each row of ``x`` to ``k`` experts.

    Args:
        x: ``[..., D]`` activations (bf16 in the real model).
        router: callable ``x -> [logits [..., E]]`` or ``[logits, shared_logit [..., 1]]``
            (an ``mlx_lily.qproj.QProj`` over the router, 8-bit in MLX checkpoints, fused
            with the shared-expert gate when both exist).
        k: experts per token; norm_topk_prob: renormalise the k scores.
        tie_break: ``"lowest_id"`` or ``"stock"`` (see the module docstring).
    Returns:
        ``(inds, scores, shared)``: ``inds`` uint32 ``[..., k]``, ``scores`` ``[..., k]`` in
        the router output dtype, ``shared`` ``[..., 1]`` (sigmoid applied) or None.
    """
    parts = router(x)
    probs = mx.softmax(parts[0], axis=-1, precise=True)
    if tie_break == "lowest_id":
        inds = topk_lowest_id(probs, k)
    elif tie_break == "stock":
        inds = mx.argpartition(probs, kth=-k, axis=-1)[..., -k:]
    else:
        raise ValueError(f"tie_break must be 'lowest_id' or 'stock', got {tie_break!r}")
    scores = mx.take_along_axis(probs, inds, axis=-1)
    if norm_topk_prob:
        scores = scores / scores.sum(axis=-1, keepdims=True)
    shared = mx.sigmoid(parts[1]) if len(parts) > 1 else None
    return inds, scores, shared


# lily_moe_router_topk: template T, S, D, E, K, BITS, GS, HAS_SHARED, NORM, NW, RPW,
# PRE_NORM; grid (32*NW, N, 1), threadgroup (32*NW, 1, 1). With PRE_NORM the row is
# ``rms_norm(hin + res) * nw`` computed in the kernel (``h`` and ``xn`` written out);
# otherwise ``x`` (hin/res/nw/eps unread, h/xn one-element placeholders).
SPEC = kernels.KernelSpec(
    name="lily_moe_router_topk", stem="moe_router_topk",
    inputs=("x", "w", "scales", "biases", "hin", "res", "nw", "eps"),
    outputs=("inds", "scores", "shared", "h", "xn"))
#: The switch of the add+RMSNorm prologue (``moe_router_topk_pending``).
PRE_NORM_OP = "moe_router_norm"
#: Widest row the kernel stages in threadgroup memory, and the bytes it may take there
#: with the logits (Apple's limit per threadgroup).
MAX_D = 8192
MAX_THREADGROUP_BYTES = 32768

#: Rows (tokens) per call the kernel takes; one threadgroup per row re-reads the router
#: weights, so long prefill chunks go to the reference (``quantized_matmul``). While
#: batched decode (``BATCH_OP``) is on there is no limit: a prompt prefilled in a batch
#: is routed by the same kernel as alone (``row_limit``).
MAX_ROWS = 64
BATCH_OP = "batch_decode"
#: Rows one launch can take at all (grid y: CUDA's limit of 65535 blocks).
MAX_GRID_ROWS = 65535
#: Launch shape: warps per threadgroup (one threadgroup per row); rows per lane group
#: is chosen so the router rows take two passes (``router_rpw``), at most ``MAX_RPW``.
NW = 16
MAX_RPW = 10
#: 16-byte weight words one lane holds at once (the CUDA body issues a pass's loads
#: before its math: STEPS * RPW words plus their scales and biases in registers; at 512
#: threads a thread may use at most 128 registers, and 8-bit D=2048 with RPW 4 took 158:
#: "too many resources requested for launch" on the H200).
MAX_WORDS_PER_LANE = 8
MAX_EXPERTS = 1024

_FLOATS = (mx.bfloat16, mx.float16, mx.float32)


def supports(x: mx.array, router, k: int) -> bool:
    """True when the router kernel computes this call: ``router`` is a quantized
    ``QProj`` (affine, 4/8-bit, group 32/64/128) with parts ``(E,)`` or ``(E, 1)``
    (logits, shared-expert gate), ``k <= min(32, E)``, float activations, at most
    ``MAX_ROWS`` rows, and an input width the lane mapping covers (on CUDA with at most
    ``MAX_WORDS_PER_LANE`` weight words per lane for one row: D <= 4096 at 8 bits)."""
    if not isinstance(router, Proj) or not router.quantized:
        return False
    if (router.mode or "affine") != "affine" or router.bits not in (4, 8):
        return False
    if router.group_size not in (32, 64, 128) or router.biases is None:
        return False
    sizes = tuple(router.sizes)
    if len(sizes) not in (1, 2) or (len(sizes) == 2 and sizes[1] != 1):
        return False
    e = sizes[0]
    if not (1 <= k <= min(32, e)) or e > MAX_EXPERTS or router.out_features != sum(sizes):
        return False
    if x.dtype not in _FLOATS or router.scales.dtype not in _FLOATS:
        return False
    d = x.shape[-1]
    if d > MAX_D or d * x.dtype.size + 4 * (e + 1 + NW) > MAX_THREADGROUP_BYTES:
        return False
    if router.weight.shape[1] * 32 != d * router.bits or d % router.group_size:
        return False
    steps = qgemv.words_per_lane(d, router.bits)
    if steps is None:
        return False
    if current_backend() == "cuda" and steps > MAX_WORDS_PER_LANE:
        return False  # even one row per lane holds more words than registers allow
    rows = x.size // d
    limit = row_limit(current_backend())
    return 1 <= rows <= (MAX_GRID_ROWS if limit is None else limit)


def row_limit(backend: str) -> int | None:
    """Rows per call the kernel takes on ``backend``: ``MAX_ROWS``, or None (any) while
    ``batch_decode`` is on, so that whether a row is routed by the kernel or by the
    reference (whose logits round differently) never depends on the other rows of the
    call: a prompt prefilled in a batch is then routed as it is alone (at a cost: each
    row's threadgroup re-reads the router weights, about 0.5 MB at 2048 -> 257 in 8 bits,
    where ``quantized_matmul`` reads them about once per tile; a call is still capped at
    ``MAX_GRID_ROWS``)."""
    return None if switch_on(BATCH_OP, backend) else MAX_ROWS


def router_rpw(rows: int, d: int, bits: int, nw: int = NW, backend: str | None = None) -> int:
    """Rows per lane group so that ``rows`` router rows take about two passes of the
    threadgroup (loads in flight vs registers), clamped to ``[1, MAX_RPW]`` and on CUDA
    (``backend``, default the current one) to ``MAX_WORDS_PER_LANE`` weight words per
    lane (the Metal body keeps no such tile)."""
    groups = nw * (32 // qgemv.lanes_per_row(d, bits))
    cap = MAX_RPW
    if (backend or current_backend()) == "cuda":
        cap = max(1, min(MAX_RPW, MAX_WORDS_PER_LANE // qgemv.words_per_lane(d, bits)))
    return max(1, min(cap, -(-rows // (2 * groups))))


def plan(kernel, router, x_shape, x_dtype, k: int, norm_topk_prob: bool, *,
         nw: int = NW, rpw: int | None = None, init_value: float | None = None,
         pre_norm: bool = False):
    """A callable launching the kernel object for inputs of one shape and dtype
    (template, grid and output shapes worked out once): ``run(x) -> (inds, scores,
    shared)``, or with ``pre_norm`` ``run(hin, res, nw, eps) -> (inds, scores, shared, h,
    xn)`` (``h = hin + res``, ``xn = rms_norm(h) * nw``, the row routed)."""
    d = x_shape[-1]
    lead = tuple(x_shape[:-1])
    n = 1
    for s_ in lead:
        n *= s_
    e = router.sizes[0]
    has_shared = len(router.sizes) == 2
    if rpw is None:
        rpw = router_rpw(router.out_features, d, router.bits, nw)
    tg = 32 * nw
    kw = dict(
        template=[("T", x_dtype), ("S", router.scales.dtype), ("D", d), ("E", e), ("K", k),
                  ("BITS", router.bits), ("GS", router.group_size),
                  ("HAS_SHARED", has_shared), ("NORM", bool(norm_topk_prob)),
                  ("NW", nw), ("RPW", rpw), ("PRE_NORM", bool(pre_norm))],
        grid=(tg, n, 1), threadgroup=(tg, 1, 1),
        output_shapes=[lead + (k,), lead + (k,), (n * kernels.ROW_PAD,)]
        + ([lead + (d,), lead + (d,)] if pre_norm else [(1,), (1,)]),
        output_dtypes=[mx.uint32, x_dtype, x_dtype, x_dtype, x_dtype])
    if init_value is not None:
        kw["init_value"] = init_value
    w, sc, bi = router.weight, router.scales, router.biases
    no_eps = kernels.f32_scalar(0.0)

    if pre_norm:
        def run_pre(hin, res, nw_, eps):
            inds, scores, shared, h, xn = kernel(
                inputs=[hin, w, sc, bi, hin, res, nw_, kernels.f32_scalar(eps)], **kw)
            shared = shared[:n].reshape(lead + (1,)) if has_shared else None
            return inds, scores, shared, h, xn

        return run_pre

    def run(x):
        inds, scores, shared, _, _ = kernel(inputs=[x, w, sc, bi, x, x, x, no_eps], **kw)
        return inds, scores, (shared[:n].reshape(lead + (1,)) if has_shared else None)

    return run


def launch(kernel, x: mx.array, router, k: int, norm_topk_prob: bool, *,
           nw: int = NW, rpw: int | None = None, init_value: float | None = None):
    """Run the ``lily_moe_router_topk`` kernel object on a call ``supports`` accepted.

    Returns ``(inds uint32 [..., k], scores [..., k], shared [..., 1] or None)`` with
    the contract of ``moe_router_topk_reference(..., tie_break="lowest_id")``.
    """
    return plan(kernel, router, x.shape, x.dtype, k, norm_topk_prob, nw=nw, rpw=rpw,
                init_value=init_value)(x)


def has_kernel(backend: str) -> bool:
    """True when the router kernel can run on ``backend`` here."""
    return backend in ("metal", "cuda") and kernels.get(SPEC, backend) is not None


def moe_router_topk(x, router, k, norm_topk_prob):
    """Dispatcher: the router kernel (one launch; ties to the lowest expert id) when it
    serves this backend and call (``supports``), else the reference with mlx-lm's own
    selection (``tie_break="stock"``), bit-identical to stock. The decision and launch
    parameters are cached on the ``QProj`` per (backend, shape, dtype, k, norm, row limit)."""
    backend = current_backend()
    if (backend in ("metal", "cuda") and isinstance(router, Proj)
            and kernels.kernels_allowed(NAME, backend)):
        plans = kernels.plan_cache(router, "_lily_router_plans")
        key = (backend, x.shape, x.dtype, k, bool(norm_topk_prob), row_limit(backend))
        run = plans.get(key, False)
        if run is False:
            run = None
            if supports(x, router, k):
                kern = kernels.get(SPEC, backend)
                if kern is not None:
                    run = plan(kern, router, x.shape, x.dtype, k, norm_topk_prob)
            plans[key] = run
        if run is not None:
            return run(x)
    return moe_router_topk_reference(x, router, k, norm_topk_prob, tie_break="stock")


def moe_router_topk_pending(pending, router, k, norm_topk_prob):
    """Route the row a ``mlx_lily.qproj.PendingNorm`` stands for (the residual add and the
    post-attention RMSNorm not computed yet). When the router kernel serves (as
    ``moe_router_topk``) and the ``moe_router_norm`` switch allows, ONE launch computes
    the add, the norm and the routing; else the norm is resolved and ``moe_router_topk``
    routes it. Returns ``(inds, scores, shared, x)`` with ``x`` the normalised row (the
    experts' input); ``pending.h`` holds the residual sum afterwards."""
    backend = current_backend()
    h0, res, nw_ = pending.h0, pending.res, pending.weight
    if (backend in ("metal", "cuda") and isinstance(router, Proj)
            and switch_on(PRE_NORM_OP, backend)):
        plans = kernels.plan_cache(router, "_lily_router_plans")
        key = (backend, h0.shape, h0.dtype, k, bool(norm_topk_prob), "pre_norm",
               row_limit(backend))
        run = plans.get(key, False)
        if run is False:
            run = None
            if (supports(h0, router, k) and res.shape == h0.shape and res.dtype == h0.dtype
                    and nw_.shape == (h0.shape[-1],) and nw_.dtype == h0.dtype):
                kern = kernels.get(SPEC, backend)
                if kern is not None:
                    run = plan(kern, router, h0.shape, h0.dtype, k, norm_topk_prob,
                               pre_norm=True)
            plans[key] = run
        if run is not None:
            inds, scores, shared, pending.h, x = run(h0, res, nw_, pending.eps)
            return inds, scores, shared, x
    x = pending.resolve()
    return (*moe_router_topk(x, router, k, norm_topk_prob), x)


def has_pre_norm_kernel(backend: str) -> bool:
    """True when ``moe_router_topk_pending`` runs its one-launch kernel on ``backend``."""
    return has_kernel(backend) and kernels.kernels_allowed(PRE_NORM_OP, backend)
