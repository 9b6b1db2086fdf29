"""Softmax and log-softmax rows, forward and backward, one compiled loop each (reference:
:mod:`npformer.ops.softmax`).

Per row: the maximum (0 when it is not finite: no inf - inf; taken on the floats' bits as ordered
integers, which vectorises), then ``exp(x - max)`` and its sum in one pass, then one scaling pass;
everything after the first read stays in cache. A row of -inf
gives zeros (softmax) or stays -inf (log-softmax), as the reference. float32 rows use the
vectorised :func:`~npformer.kernels.numba_cpu.vector_math.exp32`.
"""
from __future__ import annotations

import math

import numpy
from numba import njit, types
from numba.extending import overload

from npformer.checks import expect_grad, expect_rows
from npformer.kernels.cpu.blocks import MIN_THREAD_ELEMENTS
from npformer.kernels.numba_cpu.rows import CHEAP, over_rows
from npformer.kernels.numba_cpu.vector_math import FASTMATH, vexp
from npformer.ops.softmax import SoftmaxCache

__all__ = ["row_max", "softmax_rows", "softmax_rows_in_place", "softmax_grad_rows", "softmax_grad_rows_in_place",
           "log_softmax_rows", "log_softmax_grad_rows", "softmax_forward", "softmax_backward",
           "log_softmax_forward", "log_softmax_backward"]


def _ordered_max(bits_type):
    """max of a float row computed on its bits as integers: the integer key i ^ ((i >> 31) & 0x7FF...F)
    orders the floats as the floats order (-inf lowest, +inf highest) and an integer max vectorises
    (a float max with NaN semantics does not: five times slower)."""
    shift = bits_type(8 * numpy.dtype(bits_type).itemsize - 1)
    low = bits_type(numpy.iinfo(bits_type).max)
    least = bits_type(numpy.iinfo(bits_type).min)

    def row_max_bits(x):
        b = x.view(bits_type)
        m = least
        for j in range(b.size):
            i = b[j]
            key = i ^ ((i >> shift) & low)
            m = key if key > m else m
        return m ^ ((m >> shift) & low)
    return row_max_bits


_max_bits32 = njit(inline="always", error_model="numpy")(_ordered_max(numpy.int32))
_max_bits64 = njit(inline="always", error_model="numpy")(_ordered_max(numpy.int64))


def row_max(x):
    """max(x) over a float row, 0 when it is not finite (so x - max has no inf - inf). A NaN in x
    gives some value here, and the NaN itself then makes the row's sum, so the row, NaN."""
    m = x.max()
    return m if math.isfinite(m) else x.dtype.type(0)


@overload(row_max, inline="always")
def _row_max_typed(x):
    if x.dtype == types.float32:
        def impl(x):
            m = numpy.int32(_max_bits32(x)).view(numpy.float32)
            return m if math.isfinite(m) else numpy.float32(0)
    else:
        def impl(x):
            m = numpy.int64(_max_bits64(x)).view(numpy.float64)
            return m if math.isfinite(m) else 0.0
    return impl


@njit(nogil=True, fastmath=FASTMATH, error_model="numpy", cache=True)
def softmax_rows(y, x, start, stop):
    for r in range(start, stop):
        xr, yr = x[r], y[r]
        m = row_max(xr)
        s = xr.dtype.type(0)
        for j in range(xr.size):
            e = vexp(xr[j] - m)
            yr[j] = e
            s += e
        inv = xr.dtype.type(1) / (s if s != 0 else xr.dtype.type(1))     # all -inf: zeros stay zeros
        for j in range(xr.size):
            yr[j] *= inv


@njit(nogil=True, fastmath=FASTMATH, error_model="numpy", cache=True)
def softmax_rows_in_place(x, start, stop):
    """x = softmax(x) row by row. (A kernel of its own: given one array as both input and output,
    :func:`softmax_rows`' vectorised loops would find them overlapping and run element by element.)"""
    for r in range(start, stop):
        xr = x[r]
        m = row_max(xr)
        s = xr.dtype.type(0)
        for j in range(xr.size):
            e = vexp(xr[j] - m)
            xr[j] = e
            s += e
        inv = xr.dtype.type(1) / (s if s != 0 else xr.dtype.type(1))
        for j in range(xr.size):
            xr[j] *= inv


@njit(nogil=True, fastmath=FASTMATH, error_model="numpy", cache=True)
def softmax_grad_rows_in_place(dy, y, start, stop):
    """dy = y * (dy - sum(dy * y)) row by row (dy overwritten; see :func:`softmax_rows_in_place`)."""
    for r in range(start, stop):
        yr, dyr = y[r], dy[r]
        dot = yr.dtype.type(0)
        for j in range(yr.size):
            dot += dyr[j] * yr[j]
        for j in range(yr.size):
            dyr[j] = (dyr[j] - dot) * yr[j]


@njit(nogil=True, fastmath=FASTMATH, error_model="numpy", cache=True)
def softmax_grad_rows(dx, y, dy, start, stop):
    for r in range(start, stop):
        yr, dyr, dxr = y[r], dy[r], dx[r]
        dot = yr.dtype.type(0)
        for j in range(yr.size):
            dot += dyr[j] * yr[j]
        for j in range(yr.size):
            dxr[j] = (dyr[j] - dot) * yr[j]


@njit(nogil=True, fastmath=FASTMATH, error_model="numpy", cache=True)
def log_softmax_rows(z, x, start, stop):
    for r in range(start, stop):
        xr, zr = x[r], z[r]
        m = row_max(xr)
        s = xr.dtype.type(0)
        for j in range(xr.size):
            s += vexp(xr[j] - m)
        ls = math.log(s) if s > 0 else xr.dtype.type(0)                  # all -inf: stays -inf
        for j in range(xr.size):
            zr[j] = (xr[j] - m) - ls                   # the reference's order: m + ls would lose ls when |m| >> ls


@njit(nogil=True, fastmath=FASTMATH, error_model="numpy", cache=True)
def log_softmax_grad_rows(dx, logy, dy, start, stop):
    for r in range(start, stop):
        lr, dyr, dxr = logy[r], dy[r], dx[r]
        total = lr.dtype.type(0)
        for j in range(lr.size):
            total += dyr[j]
        for j in range(lr.size):
            dxr[j] = dyr[j] - vexp(lr[j]) * total


def _run(kernel, *arrays, per_thread=MIN_THREAD_ELEMENTS):
    """``kernel`` over the rows of arrays of one shape (..., N) and dtype; returns its output."""
    shape = arrays[0].shape
    rows = [numpy.ascontiguousarray(a).reshape(-1, shape[-1]) for a in arrays]
    out = numpy.empty_like(rows[0])
    over_rows(kernel, rows[0].shape[0], shape[-1], out, *rows, per_thread=per_thread)
    return out.reshape(shape)


def softmax_forward(x):
    expect_rows(x, "x")
    y = _run(softmax_rows, x)                            # (..., N)
    return y, SoftmaxCache(y)


def softmax_backward(dy, cache):
    expect_grad(dy, "dy", cache.y.shape, cache.y.dtype)
    # fwd: y = exp(x - m) / s  ->  dx = y * (dy - <dy, y>)
    return _run(softmax_grad_rows, cache.y, dy, per_thread=CHEAP)


def log_softmax_forward(x):
    expect_rows(x, "x")
    z = _run(log_softmax_rows, x)                        # (..., N)
    return z, SoftmaxCache(z)


def log_softmax_backward(dy, cache):
    expect_grad(dy, "dy", cache.y.shape, cache.y.dtype)
    # fwd: log y = x - lse(x)  ->  dx = dy - softmax(x) * sum(dy)
    return _run(log_softmax_grad_rows, cache.y, dy)
