"""Softmax and log-softmax over the last axis.

    y_i = exp(x_i - m) / sum_j exp(x_j - m),         m = max_j x_j (for stability)
    log y_i = x_i - m - log sum_j exp(x_j - m)

Backward from the output alone, never a Jacobian matrix:

    softmax:      dx = y * (dy - sum_j dy_j y_j)
    log-softmax:  dx = dy - exp(log y) * sum_j dy_j

Masked entries are ``-inf`` and get probability 0. A row whose every entry is ``-inf`` (a query
that may attend to nothing) gives softmax zeros, not NaN, and zero gradient; log-softmax gives
``-inf`` everywhere for it (the log of those zeros) and passes ``dy`` through unchanged.
16-bit inputs are computed in float32 and rounded to their own dtype at the end: a log-probability
below float16's range (about -65504, e.g. log-softmax of [6e4, -6e4]) rounds to ``-inf``, the
nearest value float16 has, and never to NaN.
"""
from __future__ import annotations

from typing import Any, NamedTuple

from npformer.backend import accumulation_dtype, get_array_module
from npformer.checks import expect_float, expect_grad, expect_rows
from npformer.dispatch import dispatched

__all__ = ["SoftmaxCache", "softmax_forward", "softmax_backward", "log_softmax_forward", "log_softmax_backward"]


class SoftmaxCache(NamedTuple):
    """Softmax keeps its output y (..., N); log-softmax keeps log y (..., N)."""

    y: Any


def _shifted(x):
    """x - max(x) per row in the accumulation dtype, an all -inf row's max taken as 0 (no inf - inf)."""
    xp = get_array_module(x)
    xa = x.astype(accumulation_dtype(x.dtype), copy=False)       # 16-bit: the shift could overflow
    m = xa.max(axis=-1, keepdims=True)                           # (..., 1)
    return xa - xp.where(xp.isfinite(m), m, 0)                   # (..., N)


@dispatched
def softmax_forward(x):
    """Probabilities along the last axis; returns ``(y, cache)``."""
    expect_float(x, "x")
    expect_rows(x, "x")
    xp = get_array_module(x)
    e = xp.exp(_shifted(x))                                      # (..., N)
    s = e.sum(axis=-1, keepdims=True)                            # (..., 1)
    y = (e / xp.where(s == 0, 1, s)).astype(x.dtype, copy=False)   # (..., N); fully masked row: 0 / 1 = 0
    return y, SoftmaxCache(y)


@dispatched
def softmax_backward(dy, cache: SoftmaxCache):
    """``dx = y * (dy - sum(dy * y))``."""
    y = cache.y
    expect_grad(dy, "dy", y.shape, y.dtype)
    acc = accumulation_dtype(y.dtype)
    ya, dya = y.astype(acc, copy=False), dy.astype(acc, copy=False)
    # fwd: y = exp(x - m) / s  ->  dx = y * (dy - <dy, y>)
    dot = (dya * ya).sum(axis=-1, keepdims=True)                 # (..., 1)
    return (ya * (dya - dot)).astype(y.dtype, copy=False)        # (..., N)


@dispatched
def log_softmax_forward(x):
    """Log-probabilities along the last axis; returns ``(log_y, cache)``."""
    expect_float(x, "x")
    expect_rows(x, "x")
    xp = get_array_module(x)
    z = _shifted(x)                                              # (..., N)
    s = xp.exp(z).sum(axis=-1, keepdims=True)                    # (..., 1)
    logy = (z - xp.log(xp.where(s > 0, s, 1))).astype(x.dtype, copy=False)   # an all -inf row stays -inf
    return logy, SoftmaxCache(logy)                              # 16-bit: below -65504 rounds to -inf


@dispatched
def log_softmax_backward(dy, cache: SoftmaxCache):
    """``dx = dy - softmax * sum(dy)``; the softmax is recomputed as exp(log y), not stored."""
    expect_grad(dy, "dy", cache.y.shape, cache.y.dtype)
    xp = get_array_module(dy, cache.y)
    acc = accumulation_dtype(cache.y.dtype)
    dya = dy.astype(acc, copy=False)
    # fwd: log y = x - lse(x)  ->  dx = dy - softmax(x) * sum(dy)
    total = dya.sum(axis=-1, keepdims=True)                      # (..., 1)
    dx = dya - xp.exp(cache.y.astype(acc, copy=False)) * total   # (..., N)
    return dx.astype(cache.y.dtype, copy=False)
