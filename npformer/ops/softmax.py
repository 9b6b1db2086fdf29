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
from npformer.backend.blocks import blockwise
from npformer.ops import fused
from npformer.ops.checks import expect_float

__all__ = ["SoftmaxCache", "softmax_forward", "softmax_backward",
           "log_softmax_forward", "log_softmax_backward", "softmax_rows", "softmax_grad_rows"]


class SoftmaxCache(NamedTuple):
    """Softmax keeps its output y (..., N); log-softmax keeps log y (..., N)."""

    y: Any


# Row kernels: each computes whole rows (the last axis) of its output from the same rows of its
# inputs, in place where it can, so the ops below run them block by block (npformer.backend.blocks)
# and attention runs them on its own fresh score matrix.

def _shift_rows(z, x):
    """z = x - max(x) per row, an all -inf row's max taken as 0 (no inf - inf); z may be x."""
    xp = get_array_module(x)
    m = x.max(axis=-1, keepdims=True)                    # (r, 1)
    xp.subtract(x, xp.where(xp.isfinite(m), m, 0), out=z)
    return z


def softmax_rows(y, x):
    """y = softmax(x) along the last axis (y may be x); a row of -inf gives zeros."""
    xp = get_array_module(x)
    xp.exp(_shift_rows(y, x), out=y)
    s = y.sum(axis=-1, keepdims=True)                    # (r, 1)
    y /= xp.where(s == 0, 1, s)                          # fully masked row: 0 / 1 = 0
    return y


def softmax_grad_rows(dx, y, dy):
    """dx = y * (dy - sum(dy * y)) along the last axis (dx may be dy)."""
    xp = get_array_module(dy, y)
    dot = (dy * y).sum(axis=-1, keepdims=True, dtype=accumulation_dtype(y.dtype))   # (r, 1)
    xp.subtract(dy, dot.astype(dx.dtype, copy=False), out=dx)
    dx *= y
    return dx


def _log_softmax_rows(z, x):
    xp = get_array_module(x)
    _shift_rows(z, x)
    s = xp.exp(z).sum(axis=-1, keepdims=True)            # (r, 1)
    z -= xp.log(xp.where(s > 0, s, 1))                   # an all -inf row stays -inf


def _log_softmax_grad_rows(dx, logy, dy):
    xp = get_array_module(dy, logy)
    total = dy.sum(axis=-1, keepdims=True, dtype=accumulation_dtype(dy.dtype)).astype(dx.dtype, copy=False)
    xp.exp(logy, out=dx)
    dx *= total
    xp.subtract(dy, dx, out=dx)


def _rows(kernel, out_dtype, *arrays):
    """kernel(out, *arrays) over blocks of whole rows; the arrays share one shape (..., N)."""
    xp = get_array_module(*arrays)
    arrays = [xp.ascontiguousarray(a) for a in arrays]
    out = xp.empty(arrays[0].shape, dtype=out_dtype)
    return blockwise(kernel, out, *arrays, row=arrays[0].shape[-1] if arrays[0].ndim else None)


def softmax_forward(x):
    """Probabilities along the last axis; returns ``(y, cache)``."""
    if fused.use_fused(x):                               # CuPy: one kernel per row (ops.fused)
        return fused.softmax_forward(x)
    expect_float(x, "x")
    xa = x.astype(accumulation_dtype(x.dtype), copy=False)   # 16-bit: the shift could overflow
    y = _rows(softmax_rows, xa.dtype, xa).astype(x.dtype, copy=False)   # (..., N)
    return y, SoftmaxCache(y)


def softmax_backward(dy, cache: SoftmaxCache):
    """``dx = y * (dy - sum(dy * y))``."""
    if fused.use_fused(dy, cache.y):
        return fused.softmax_backward(dy, cache)
    y = cache.y
    xp = get_array_module(dy, y)
    # fwd: y = exp(x - m) / s  ->  dx = y * (dy - <dy, y>)
    return _rows(softmax_grad_rows, xp.result_type(dy, y), y, dy)    # (..., N)


def log_softmax_forward(x):
    """Log-probabilities along the last axis; returns ``(log_y, cache)``."""
    if fused.use_fused(x):
        return fused.log_softmax_forward(x)
    expect_float(x, "x")
    xa = x.astype(accumulation_dtype(x.dtype), copy=False)
    z = _rows(_log_softmax_rows, xa.dtype, xa)            # (..., N)
    z = z.astype(x.dtype, copy=False)                    # 16-bit: below -65504 rounds to -inf
    return z, SoftmaxCache(z)


def log_softmax_backward(dy, cache: SoftmaxCache):
    """``dx = dy - softmax * sum(dy)``; the softmax is recomputed as exp(log y), not stored."""
    if fused.use_fused(dy, cache.y):
        return fused.log_softmax_backward(dy, cache)
    xp = get_array_module(dy, cache.y)
    # fwd: log y = x - lse(x)  ->  dx = dy - softmax(x) * sum(dy)
    return _rows(_log_softmax_grad_rows, xp.result_type(dy, cache.y), cache.y, dy)   # (..., N)
