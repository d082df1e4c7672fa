"""Plain records the ops read: a (possibly fused) projection's arrays, and a layer input
whose residual add + RMSNorm is not computed yet. No mlx-lm classes: ``mlx_lily.qproj``
builds ``Proj`` objects from mlx-lm's linear layers and runs them.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass
class Proj:
    """One (possibly fused) projection ``x @ W^T`` split into ``sizes`` output parts: the
    arrays and parameters ops read (``mlx_lily.qproj.QProj`` adds running it).

    Attributes:
        weight, scales, biases: quantized layout (``scales``/``biases`` None when dense).
        group_size, bits, mode: MLX quantization parameters (None when dense).
        sizes: output widths of the parts, in order.
    """

    weight: mx.array
    scales: mx.array | None
    biases: mx.array | None
    group_size: int | None
    bits: int | None
    mode: str | None
    sizes: tuple

    @property
    def quantized(self) -> bool:
        return self.scales is not None

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])


class PendingNorm:
    """A layer input not computed yet: ``x = rms_norm(h0 + res) * weight`` (``eps``), with
    the residual sum ``h = h0 + res`` set once something consumes it. The decoder stack
    hands this to a mixer whose input projection can fold the add and the norm into its
    GEMV (``mlx_lily.qproj.QProj.call_pending``); any other consumer calls ``resolve()``.
    """

    __slots__ = ("h0", "res", "weight", "eps", "h", "_x", "counters")

    def __init__(self, h0: mx.array, res: mx.array, weight: mx.array, eps: float,
                 counters=None):
        self.h0, self.res, self.weight, self.eps = h0, res, weight, eps
        self.h = None
        self._x = None
        #: ``(int32 array, offset, after)``: arrival counters a one-launch consumer may
        #: use (``moe_experts.FUSED_COUNTERS`` from ``offset``, left zero) and the output of
        #: the previous launch on them (its launch must be ordered after it), or None
        self.counters = counters

    @property
    def shape(self):
        return self.h0.shape

    @property
    def dtype(self):
        return self.h0.dtype

    @property
    def resolved(self) -> mx.array | None:
        """The normalised input ``x`` when ``resolve()`` has computed it, else None."""
        return self._x

    def resolve(self) -> mx.array:
        """The normalised input ``x`` (``mlx_lily.ops.add_rms_norm``); sets ``h``."""
        if self._x is None:
            from .add_rms_norm import add_rms_norm

            self.h, self._x = add_rms_norm(self.h0, self.res, self.weight, self.eps)
        return self._x


def resolve(x):
    """``x`` itself, or the array a ``PendingNorm`` stands for."""
    return x.resolve() if isinstance(x, PendingNorm) else x
