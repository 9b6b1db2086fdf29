"""Fused softmax and log-softmax over the last axis (reference: :mod:`npformer.ops.softmax`).

One block per row: ``m = max x`` (0 for an all -inf row), ``s = sum exp(x - m)``, then
``y = exp(x - m) / s`` (``s = 0 -> 1``, so an all -inf row gives zeros) or
``log y = (x - m) - log s``. Backward, one block per row: ``dx = y (dy - sum(dy y))`` or
``dx = dy - exp(log y) sum(dy)``. 16-bit rows are computed in float32 and rounded once.
"""
from __future__ import annotations

import numpy

from npformer.checks import expect_float, expect_grad
from npformer.kernels.cuda.runtime import contiguous, device_xp, launch_rows, rows_of
from npformer.ops.softmax import SoftmaxCache

__all__ = ["softmax_forward", "softmax_backward", "log_softmax_forward", "log_softmax_backward"]


def _forward(x, log_out: int):
    expect_float(x, "x")
    xp = device_xp(x)
    rows, n = rows_of(x)
    x = contiguous(xp, x)
    y = xp.empty(x.shape, dtype=x.dtype)                 # (..., N)
    if rows:
        launch_rows("softmax_fwd", x.dtype, rows, n,
                    (x, y, numpy.int64(rows), numpy.int32(n), numpy.int32(log_out)))
    return y, SoftmaxCache(y)


def _backward(dy, cache, log_out: int):
    y = cache.y
    expect_grad(dy, "dy", y.shape, y.dtype)
    xp = device_xp(dy, y)
    rows, n = rows_of(y)
    dy, y = contiguous(xp, dy), contiguous(xp, y)       # a plain forward's y may be strided
    dx = xp.empty(y.shape, dtype=y.dtype)                # (..., N)
    if rows:
        launch_rows("softmax_bwd", y.dtype, rows, n,
                    (dy, y, dx, numpy.int64(rows), numpy.int32(n), numpy.int32(log_out)))
    return dx


def softmax_forward(x):
    """Returns ``(y, SoftmaxCache(y))``."""
    return _forward(x, 0)


def softmax_backward(dy, cache):
    """``dx = y * (dy - sum(dy * y))``."""
    # fwd: y = exp(x - m) / s  ->  dx = y * (dy - <dy, y>)
    return _backward(dy, cache, 0)


def log_softmax_forward(x):
    """Returns ``(log_y, SoftmaxCache(log_y))``; an all -inf row stays -inf."""
    return _forward(x, 1)


def log_softmax_backward(dy, cache):
    """``dx = dy - exp(log_y) * sum(dy)``."""
    # fwd: log y = x - lse(x)  ->  dx = dy - softmax(x) * sum(dy)
    return _backward(dy, cache, 1)
