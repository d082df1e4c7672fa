"""The one closeness check of the test suite: relative error plus ulps of a float type.

Every kernel test compares an output with a truth (a float64 oracle, an fp32 product, the
op's pure-MLX reference) through ``assert_close``. Its bound per element is

    |got - want| <= atol + rtol * scale + ulps * EPS[dtype] * ulp_of

where ``scale`` and ``ulp_of`` default to ``|want|`` (``scale="max"``: ``max |want|``), so a
test states its tolerance as "so many ulps of the output type at this magnitude, plus this
much relative fp32 summation error" instead of a hand-rolled formula. Arrays may be MLX
arrays of any float type or numpy arrays; the check runs in float64.
"""

from __future__ import annotations

import numpy as np

import mlx.core as mx

#: Machine epsilon per float type: the spacing of floats in [1, 2), i.e. one ulp at 1.0.
#: Half of it is the unit roundoff (the largest relative error of one rounding).
EPS = {mx.bfloat16: 2.0 ** -7, mx.float16: 2.0 ** -10, mx.float32: 2.0 ** -23}


def f64(x) -> np.ndarray:
    """``x`` (an MLX array of any dtype, a numpy array or a scalar) as a float64 array."""
    if isinstance(x, mx.array):
        if x.dtype in (mx.bfloat16, mx.float16):
            x = x.astype(mx.float32)
        x = np.array(x)
    return np.asarray(x, dtype=np.float64)


def binade(x) -> np.ndarray:
    """``2 ** floor(log2 |x|)`` elementwise: times ``EPS[dtype]`` it is the spacing of
    ``dtype`` at ``x`` (one ulp of ``x`` exactly, not one ulp of 1.0 scaled by ``|x|``)."""
    a = np.maximum(np.abs(f64(x)), 1e-30)
    return np.exp2(np.floor(np.log2(a)))


def rel_err(got, want) -> float:
    """``max |got - want| / max |want|`` (``max |want|`` taken as 1 when it is 0)."""
    g, w = f64(got), f64(want)
    return float(np.abs(g - w).max() / (np.abs(w).max() or 1.0))


def rel_l2(got, want, axis=None) -> float:
    """``||got - want|| / ||want||`` (L2), over the whole array or per slice along
    ``axis`` (the largest slice's value then; norms below 1e-6 read as 1e-6)."""
    g, w = f64(got), f64(want)
    if axis is None:
        return float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30))
    d = np.sqrt(((g - w) ** 2).sum(axis))
    n = np.maximum(np.sqrt((w ** 2).sum(axis)), 1e-6)
    return float((d / n).max())


def assert_close(got, want, *, rtol=0.0, atol=0.0, ulps=0.0, dtype=None, scale=None,
                 ulp_of=None, l2=None, max_bad_frac=0.0, max_diff_frac=None,
                 elementwise=True, what=""):
    """Assert ``got`` is close to ``want``.

    Args:
        got, want: arrays of one shape (MLX or numpy, any float dtype); ``want`` is the
            truth.
        rtol: relative tolerance, times ``scale``.
        atol: absolute tolerance (a scalar or an array broadcast against ``want``).
        ulps: tolerance in ulps of ``dtype`` (``EPS[dtype]``), times ``ulp_of``.
        dtype: the float type whose ulps ``ulps`` counts (an ``mx.Dtype``); required when
            ``ulps`` is non-zero.
        scale: what ``rtol`` multiplies: ``|want|`` elementwise (default), ``"max"`` for
            ``max |want|``, or an array / scalar.
        ulp_of: what ``ulps * EPS[dtype]`` multiplies: ``|want|`` (default), ``"max"``,
            or an array / scalar (e.g. ``binade(want)`` for exact ulp spacing, or the
            magnitude of the terms a sum was built from).
        l2: also require ``||got - want|| <= l2 * ||want||``.
        max_bad_frac: the fraction of elements allowed over the bound (default none).
        max_diff_frac: also require at most this fraction of elements to differ at all.
        elementwise: False to check only ``l2`` / ``max_diff_frac``.
        what: a label for failure messages.

    Raises:
        AssertionError: shapes differ, ``got`` holds NaN or inf (an unwritten element),
            or a bound fails; the message names the worst element's error and bound.
    """
    g, w = f64(got), f64(want)
    label = f"{what}: " if what else ""
    assert g.shape == w.shape, f"{label}shape {g.shape} != {w.shape}"
    assert np.isfinite(g).all() or not np.isfinite(w).all(), \
        f"{label}non-finite output (unwritten element?)"
    err = np.abs(g - w)
    aw = np.abs(w)

    def resolve(v):
        if v is None:
            return aw
        if isinstance(v, str):
            assert v == "max", v
            return aw.max() if aw.size else 0.0
        return np.abs(f64(v))

    if elementwise:
        if ulps:
            assert dtype in EPS, f"assert_close: ulps needs a float dtype, got {dtype}"
            ulp_term = ulps * EPS[dtype] * resolve(ulp_of)
        else:
            ulp_term = 0.0
        bound = f64(atol) + rtol * resolve(scale) + ulp_term
        bad = err > bound
        frac = float(bad.mean()) if bad.size else 0.0
        if frac > max_bad_frac:
            excess = np.where(bad, err - bound, -np.inf)
            i = np.unravel_index(np.argmax(excess), err.shape)
            b = np.broadcast_to(bound, err.shape)[i]
            raise AssertionError(
                f"{label}{bad.sum()} of {bad.size} elements over the bound "
                f"(allowed fraction {max_bad_frac}); worst at {tuple(int(j) for j in i)}: "
                f"got {g[i]!r}, want {w[i]!r}, err {err[i]:.4g} > bound {b:.4g}; "
                f"max err {err.max():.4g}, max |want| {aw.max():.4g}")
    if l2 is not None:
        r = rel_l2(g, w)
        assert r <= l2, f"{label}relative L2 error {r:.4g} > {l2}"
    if max_diff_frac is not None:
        d = float((err > 0).mean()) if err.size else 0.0
        assert d <= max_diff_frac, f"{label}{d:.4g} of elements differ (allowed {max_diff_frac})"
