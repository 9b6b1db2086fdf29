"""Softmax and log-softmax rows computed in place over cache-sized blocks (reference:
:mod:`npformer.ops.softmax`).

Each row kernel computes whole rows of its output from the same rows of its inputs, writing into
its output (which may be an input), so :func:`~npformer.kernels.cpu.blocks.blockwise` can run it
block by block and attention can run it on its own fresh score matrix. 16-bit rows are computed in
float32 and rounded once, as the reference does. Row sums go through
:mod:`npformer.kernels.cpu.rows` (``einsum`` on short rows: cheaper on attention's rows of 64;
NumPy's pairwise ``sum`` on rows a vocabulary long).
"""
from __future__ import annotations

import numpy

from npformer.backend import accumulation_dtype
from npformer.checks import expect_grad, expect_rows
from npformer.kernels.cpu.blocks import blockwise
from npformer.kernels.cpu.rows import row_dot, row_sum
from npformer.ops.softmax import SoftmaxCache

__all__ = ["softmax_rows", "softmax_grad_rows", "softmax_forward", "softmax_backward",
           "log_softmax_forward", "log_softmax_backward"]


def _shift_rows(z, x):
    """z = x - max(x) per row, an all -inf row's max taken as 0 (no inf - inf); z may be x."""
    m = x.max(axis=-1, keepdims=True)                    # (r, 1)
    numpy.subtract(x, numpy.where(numpy.isfinite(m), m, 0), out=z)
    return z


def softmax_rows(y, x):
    """y = softmax(x) along the last axis (y may be x); a row of -inf gives zeros."""
    numpy.exp(_shift_rows(y, x), out=y)
    s = row_sum(y)                                       # (r, 1)
    y /= numpy.where(s == 0, 1, s)                       # fully masked row: 0 / 1 = 0
    return y


def softmax_grad_rows(dx, y, dy):
    """dx = y * (dy - sum(dy * y)) along the last axis (dx may be dy)."""
    dot = row_dot(dy, y)                                 # (r, 1)
    numpy.subtract(dy, dot, out=dx)
    dx *= y
    return dx


def _log_softmax_rows(z, x):
    _shift_rows(z, x)
    s = row_sum(numpy.exp(z))                            # (r, 1)
    z -= numpy.log(numpy.where(s > 0, s, 1))             # an all -inf row stays -inf


def _log_softmax_grad_rows(dx, logy, dy):
    total = row_sum(dy)                                  # (r, 1)
    numpy.exp(logy, out=dx)
    dx *= total
    numpy.subtract(dy, dx, out=dx)


def rows(kernel, out_dtype, *arrays):
    """kernel(out, *arrays) over blocks of whole rows of arrays of one shape (..., N), each read in
    the accumulation dtype; returns ``out`` in ``out_dtype``."""
    acc = accumulation_dtype(arrays[0].dtype)
    arrays = [numpy.asarray(a, dtype=acc, order="C") for a in arrays]
    out = blockwise(kernel, numpy.empty(arrays[0].shape, dtype=acc), *arrays, row=arrays[0].shape[-1])
    return out.astype(out_dtype, copy=False)


def softmax_forward(x):
    expect_rows(x, "x")
    y = rows(softmax_rows, x.dtype, x)                   # (..., N)
    return y, SoftmaxCache(y)


def softmax_backward(dy, cache):
    expect_grad(dy, "dy", cache.y.shape, cache.y.dtype)
    # fwd: y = exp(x - m) / s  ->  dx = y * (dy - <dy, y>)
    return rows(softmax_grad_rows, cache.y.dtype, cache.y, dy)


def log_softmax_forward(x):
    expect_rows(x, "x")
    z = rows(_log_softmax_rows, x.dtype, x)              # (..., N); 16-bit: below -65504 rounds to -inf
    return z, SoftmaxCache(z)


def log_softmax_backward(dy, cache):
    expect_grad(dy, "dy", cache.y.shape, cache.y.dtype)
    # fwd: log y = x - lse(x)  ->  dx = dy - softmax(x) * sum(dy)
    return rows(_log_softmax_grad_rows, cache.y.dtype, cache.y, dy)
