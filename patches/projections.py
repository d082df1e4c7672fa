"""Prepared data of patched Qwen3-Next / Qwen3.5 modules: fused projections (``QProj``)
built once from mlx-lm's linear layers, the weight signatures that tell when they are stale
(``WeightSig``), running a projection on an array or a ``PendingNorm``, and one-row views of
plain quantized layers (``one_row_linear``, ``lm_head``)."""

from __future__ import annotations

import operator
import threading
import weakref

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_next

from mlx_lily.ops import qgemv as _qgemv_ops, qmm_dequant
from mlx_lily.patching import module_mutations, mutations_tracked
from mlx_lily.qproj import PendingNorm, QProj


class WeightSig:
    """The identity of every array, sub-module and list of modules in one or more module
    trees when it was taken: ``valid()`` turns False once any of them is replaced
    (``load_weights``, ``update``, ``set_dtype``, quantization, a layer swapped for another). A copy (``copy.deepcopy``, pickling) is never valid, so a copied model
    rebuilds what it derived from its weights. Taken while patched (and no module in the
    trees overrides ``mlx.nn.Module``'s item mutators), ``valid()`` first compares the
    count of module item mutations (``mlx_lily.patching.module_mutations``) with the one
    it last saw: equal, nothing can have been replaced; else the full identity check."""

    __slots__ = ("_owners", "_keys", "_values", "_count", "_tracked")

    def __init__(self, module=None, *more):
        count = module_mutations()  # before reading the modules (see valid())
        mods = [] if module is None else [m for top in (module, *more)
                                          for _, m in top.named_modules()]
        entries = [(m, k, v) for m in mods for k, v in m.items()
                   if isinstance(v, (mx.array, nn.Module, list, tuple))]
        # parallel tuples, so that the full check runs in C
        self._owners = None if module is None else tuple(m for m, _, _ in entries)
        self._keys = tuple(k for _, k, _ in entries)
        self._values = tuple(v for _, _, v in entries)
        # while patched, the count of module item mutations answers first: unchanged,
        # nothing was replaced (~0.1 ms per decode step saved on the CPU box, 2631 entries)
        self._tracked = all(mutations_tracked(t) for t in {type(m) for m in mods})
        self._count = count

    def valid(self) -> bool:
        if self._owners is None:
            return False
        count = module_mutations()
        if self._tracked and count is not None and self._count == count:
            return True
        # the count read before the check: a mutation during the check moves it again
        ok = all(map(operator.is_, map(dict.get, self._owners, self._keys), self._values))
        if ok and count is not None:
            self._count = count
        return ok

    def __deepcopy__(self, memo):
        return WeightSig()

    def __reduce__(self):
        return (WeightSig, ())


class LilyState:
    """Per-module prepared data (fused projections); a plain object, so it never enters
    the module's parameter tree. ``rebuild(module)`` prepares the module again; ``sig``
    tells when its weights were replaced since."""

    def __init__(self, owner, rebuild, **projs):
        self.__dict__.update(projs)
        self.rebuild = rebuild
        self.sig = WeightSig(owner)


class _CheckedForward(threading.local):
    """True while a decoder stack whose weights ``check_weights`` has just validated (and
    whose stale fused projections it rebuilt) runs: ``projection`` then skips its own check."""

    active = False


CHECKED = _CheckedForward()


def refresh(module) -> None:
    """Re-prepare ``module`` (fused projections) from its current weights."""
    st = getattr(module, "_lily", None)
    if st is not None:
        module._lily = None
        st.rebuild(module)


def original(cls, name="__call__"):
    """The unpatched ``cls.<name>`` (``mlx_lily.patching.original``)."""
    from mlx_lily.patching import original as _orig

    return _orig(cls, name)


def projection(module, key, layers):
    """The fused projection prepared for ``module`` under ``key`` (its ``LilyState``,
    rebuilt first when its weights were replaced), or per-layer views of ``layers``."""
    st = getattr(module, "_lily", None)
    if st is not None and not CHECKED.active and not st.sig.valid():  # replaced weights
        refresh(module)
        st = getattr(module, "_lily", None)
    p = getattr(st, key, None) if st is not None else None
    if p is not None:
        return p
    return [QProj.view([l]) or _CallLayer(l) for l in layers]


class _CallLayer:
    """Adapter making any layer look like a one-part QProj."""

    def __init__(self, layer):
        self.layer = layer

    def __call__(self, x):
        return [self.layer(x)]


def run_projection(proj, x, split=True):
    """The parts of projection ``proj`` (a ``QProj`` or a list of one-part callables) of
    ``x``, an array or a ``PendingNorm`` (folded into the GEMV where the kernel serves);
    ``split=False`` (a ``QProj`` only): the unsplit output as a one-item list."""
    if isinstance(x, PendingNorm):
        if isinstance(proj, QProj):
            return proj.call_pending(x, split)
        x = x.resolve()
    if not split:
        return proj(x, split)
    if isinstance(proj, list):
        out = []
        for p in proj:
            out.extend(p(x))
        return out
    return proj(x)


def contiguous_qproj(layer):
    """A one-part ``QProj`` of a bias-free affine ``nn.QuantizedLinear`` whose arrays are
    row-contiguous (``mx.contiguous``, evaluated now: the same memory when they already
    are), for kernels that read weights without strides; None for any other layer."""
    if (type(layer) is not nn.QuantizedLinear or "bias" in layer
            or (getattr(layer, "mode", None) or "affine") != "affine"):
        return None
    w, s, b = (mx.contiguous(a) for a in (layer.weight, layer.scales, layer.biases))
    mx.eval(w, s, b)
    return QProj(w, s, b, layer.group_size, layer.bits, "affine", (int(w.shape[0]),))


OUT_PROJ_OP = _qgemv_ops.OUT_PROJ_OP


_VIEW_OWNERS: dict = {}  # id -> weakref of modules holding a cached one-row view


def one_row_linear(layer, x, attr="_lily_view", owner=None, op=OUT_PROJ_OP):
    """``layer(x)`` with a one-row input of a plain ``nn.QuantizedLinear`` (no bias)
    through the ``qgemv`` kernel (``QProj.__call__``: MLX's ``quantized_matmul`` exactly as
    ``nn.QuantizedLinear`` computes it wherever the kernel does not serve) while switch
    ``op`` is on and its kernels allowed (None: no switch of its own); any other layer or
    input: ``layer(x)``. A decode step of B sequences (``x [B, 1, in]``, B <= 8) is
    one-row input per sequence (``qgemv.decode_rows``). The one-part ``QProj`` view is cached on ``owner`` (default
    ``layer``) under ``attr`` per weight array (a weight swap is noticed; ``unpatch``
    drops the views). A many-row input (prefill) takes ``qmm_dequant.linear`` where its
    switch ``prefill_dequant`` serves, else ``layer(x)``."""
    if _qgemv_ops.decode_rows(x) is None:  # prefill: dequantize + matmul where it serves
        y = qmm_dequant.linear(layer, x)
        return layer(x) if y is None else y
    if type(layer) is not nn.QuantizedLinear or "bias" in layer:
        return layer(x)
    if op is not None:
        from mlx_lily import backend, registry

        if not registry.switch_on(op, backend.current_backend()):
            return layer(x)
    owner = layer if owner is None else owner
    cached = owner.__dict__.get(attr)
    if (cached is None or cached[0] is not layer.weight or cached[1] is not layer.scales
            or cached[2] is not layer.get("biases")):
        view = QProj.view([layer])
        if view is None:
            return layer(x)
        cached = (layer.weight, layer.scales, layer.get("biases"), view)
        object.__setattr__(owner, attr, cached)
        _VIEW_OWNERS[id(owner)] = (weakref.ref(owner), attr)
    return cached[3](x, split=False)[0]


def drop_views() -> None:
    """Forget every cached one-row view (``unpatch`` calls this: they hold weight arrays)."""
    for ref, attr in list(_VIEW_OWNERS.values()):
        m = ref()
        if m is not None:
            m.__dict__.pop(attr, None)
    _VIEW_OWNERS.clear()


def lm_head(owner, x):
    """``owner.lm_head(x)`` with a one-row input through the ``qgemv`` kernel (its output
    GEMV over the whole vocabulary; ``one_row_linear``), the view cached on ``owner``."""
    return one_row_linear(owner.lm_head, x, "_lily_head", owner, op=None)


def prepare_attention(attn) -> None:
    """Fuse q|k|v projections of one attention module (once)."""
    if getattr(attn, "_lily", None) is None:
        attn._lily = LilyState(attn, prepare_attention,
                               qkv=QProj.fuse([attn.q_proj, attn.k_proj, attn.v_proj]))


def prepare_moe(moe) -> None:
    """Fuse the router with the shared-expert gate (once)."""
    if isinstance(moe, qwen3_next.Qwen3NextSparseMoeBlock) and getattr(moe, "_lily", None) is None:
        moe._lily = LilyState(moe, prepare_moe,
                              router=QProj.fuse([moe.gate, moe.shared_expert_gate]))
