"""Fused projections: several linear layers that read the same input, run as one matmul.

A ``QProj`` holds one weight matrix whose rows are the concatenated output rows of its
parts (MLX affine-quantized ``[out, in*bits/32]`` uint32 with bf16 scales/biases
``[out, in/group]``, or a dense ``[out, in]`` weight). The concatenation is built once, at
patch or load time (``QProj.fuse``), never per step; each original layer's arrays are
then replaced by row slices of the fused buffer (same values, no second copy).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .ops import norm_qgemv as _norm_qgemv
from .ops import qgemv as _qgemv
from .ops import qmm_dequant as _qmm_dequant
from .ops.proj import PendingNorm, Proj, resolve

__all__ = ["PendingNorm", "Proj", "QProj", "resolve"]


class QProj(Proj):
    """A ``mlx_lily.ops.proj.Proj`` (the arrays and quantization parameters the ops
    read) that runs itself: one-row inputs through ``qgemv``, many-row ones through
    ``qmm_dequant`` where they serve, else ``mx.quantized_matmul``; built from mlx-lm's
    linear layers by ``view`` / ``fuse``.
    """

    def __call__(self, x: mx.array, split: bool = True) -> list:
        """Project ``x [..., in]`` and return the parts ``[..., size_i]`` (a list), or with
        ``split=False`` the whole ``[..., out_features]`` output as a one-item list.

        A one-row input of a quantized projection runs the ``qgemv`` kernel when it
        serves on this backend (``mlx_lily.ops.qgemv.for_qproj``), a many-row one the
        dequantize + dense matmul path where it serves (``mlx_lily.ops.qmm_dequant``),
        else ``mx.quantized_matmul``.
        """
        if self.quantized:
            y = _qgemv.for_qproj(x, self)
            if y is None:
                y = _qmm_dequant.try_dequant(x, self.weight, self.scales, self.biases,
                                             self.group_size, self.bits, self.mode)
            if y is None:
                y = mx.quantized_matmul(x, self.weight, scales=self.scales,
                                        biases=self.biases, transpose=True,
                                        group_size=self.group_size, bits=self.bits,
                                        mode=self.mode)
        else:
            y = x @ self.weight.T
        return self._parts(y) if split else [y]

    def call_pending(self, pending, split: bool = True) -> list:
        """Project the row ``pending`` stands for (``mlx_lily.qproj.PendingNorm``: a
        residual add + RMSNorm not yet computed) and return the parts, as ``__call__``
        on ``pending.resolve()`` would. A one-row input of a quantized projection runs
        the add, the norm and the GEMV as one kernel (``mlx_lily.ops.norm_qgemv``) when
        it serves; ``pending.h`` holds the residual sum afterwards either way."""
        if self.quantized:
            r = _norm_qgemv.for_qproj(pending.h0, pending.res, pending.weight, pending.eps,
                                      self)
            if r is not None:
                y, pending.h = r
                return self._parts(y) if split else [y]
        return self(pending.resolve(), split)

    def _parts(self, y):
        if len(self.sizes) == 1:
            return [y]
        cuts, acc = [], 0
        for s in self.sizes[:-1]:
            acc += s
            cuts.append(acc)
        return mx.split(y, cuts, axis=-1)

    @staticmethod
    def compatible(layers) -> bool:
        """True when ``layers`` can share one matmul: all ``nn.QuantizedLinear`` with equal
        (group_size, bits, mode), biases present, no additive bias; or all bias-free
        ``nn.Linear`` of one dtype; and equal input widths."""
        if not layers:
            return False
        if all(type(l) is nn.QuantizedLinear for l in layers):
            p = {(l.group_size, l.bits, l.mode) for l in layers}
            return (len(p) == 1 and all("bias" not in l and l.get("biases") is not None
                                        for l in layers)
                    and len({l.weight.shape[1] for l in layers}) == 1)
        if all(type(l) is nn.Linear for l in layers):
            return (all("bias" not in l for l in layers)
                    and len({(l.weight.dtype, l.weight.shape[1]) for l in layers}) == 1)
        return False

    @classmethod
    def view(cls, layers) -> "QProj | None":
        """Wrap ONE compatible layer without copying (``len(layers) == 1``), or None."""
        if len(layers) != 1 or not cls.compatible(layers):
            return None
        l = layers[0]
        if type(l) is nn.QuantizedLinear:
            return cls(l.weight, l.scales, l.biases, l.group_size, l.bits, l.mode,
                       (int(l.weight.shape[0]),))
        return cls(l.weight, None, None, None, None, None, (int(l.weight.shape[0]),))

    @classmethod
    def fuse(cls, layers) -> "QProj | None":
        """Concatenate compatible layers' rows into one projection (evaluates it) and
        point each layer's arrays at its slice of the fused buffer. None if incompatible.
        """
        if not cls.compatible(layers):
            return None
        sizes = tuple(int(l.weight.shape[0]) for l in layers)
        names = ("weight", "scales", "biases") if type(layers[0]) is nn.QuantizedLinear \
            else ("weight",)
        fused = {n: mx.concatenate([l[n] for l in layers], axis=0) for n in names}
        mx.eval(list(fused.values()))
        start = 0
        for l, s in zip(layers, sizes):
            for n in names:
                l[n] = fused[n][start:start + s]
            start += s
        mx.eval([l[n] for l in layers for n in names])
        l0 = layers[0]
        if len(names) == 3:
            return cls(fused["weight"], fused["scales"], fused["biases"], l0.group_size,
                       l0.bits, l0.mode, sizes)
        return cls(fused["weight"], None, None, None, None, None, sizes)
