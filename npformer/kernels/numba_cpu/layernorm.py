"""Layer norm forward and backward, one compiled pass over each row (reference:
:mod:`npformer.ops.layernorm`).

Forward, per row: the mean, then ``sum (x - mu)^2`` (two passes over a row already in cache, the
reference's two-pass variance), ``rstd = 1 / sqrt(var + eps)`` correctly rounded
(:func:`~npformer.kernels.numba_cpu.vector_math.inv_sqrt`: 0 for var = inf, as the reference), then
``y = xhat w + b``; the cache is the reference's (x, mu and rstd, no xhat). Backward, per row:
``xhat = (x - mu) rstd`` recomputed as the forward computed it, ``g = dy w``, ``mean(g)`` and
``mean(g xhat)`` in one pass, then ``dx`` in a second. The parameter gradients ``dw = sum dy xhat``
and ``db = sum dy`` are summed over blocks of :data:`ROWS_PER_PART` rows into a (parts, C) array,
then over the parts in order: the same sums whatever the thread count.
"""
from __future__ import annotations

import numpy
from numba import njit

from npformer.backend import accumulation_dtype
from npformer.checks import expect_grad
from npformer.kernels.numba_cpu.rows import CHEAP, over_rows
from npformer.kernels.numba_cpu.vector_math import FASTMATH, inv_sqrt
from npformer.ops.layernorm import LayerNormCache, check_layer_norm_inputs

__all__ = ["layer_norm_forward", "layer_norm_backward", "ROWS_PER_PART"]

ROWS_PER_PART = 64


@njit(nogil=True, fastmath=FASTMATH, error_model="numpy", cache=True)
def _forward(y, mean, rstd, x, weight, bias, eps, start, stop):
    c = x.shape[1]
    n_c = x.dtype.type(c)                              # (divisions in the rows' dtype)
    for r in range(start, stop):
        xr, yr = x[r], y[r]
        total = xr.dtype.type(0)
        for j in range(c):
            total += xr[j]
        mu = total / n_c
        ss = xr.dtype.type(0)
        for j in range(c):
            d = xr[j] - mu
            ss += d * d
        rs = inv_sqrt(ss / n_c + eps)                  # (not FASTMATH's estimate: NaN for var = inf)
        mean[r], rstd[r] = mu, rs
        for j in range(c):
            h = (xr[j] - mu) * rs
            if weight is not None:
                h = h * weight[j]
            if bias is not None:
                h = h + bias[j]
            yr[j] = h


@njit(nogil=True, fastmath=FASTMATH, error_model="numpy", cache=True)
def _backward(dx, dweight_parts, dbias_parts, dy, x, mean, rstd, weight, start, stop):
    c = dy.shape[1]
    n_c = dy.dtype.type(c)
    for r in range(start, stop):
        dyr, xr, dxr = dy[r], x[r], dx[r]
        mu, rs = mean[r], rstd[r]
        xhr = dxr                                      # xhat = (x - mu) rstd, the forward's, held in dx
        for j in range(c):
            xhr[j] = (xr[j] - mu) * rs
        part = r // ROWS_PER_PART
        if dweight_parts is not None:
            dwp = dweight_parts[part]
            for j in range(c):
                dwp[j] += dyr[j] * xhr[j]
        if dbias_parts is not None:
            dbp = dbias_parts[part]
            for j in range(c):
                dbp[j] += dyr[j]
        g_sum = dyr.dtype.type(0)
        gx_sum = dyr.dtype.type(0)
        for j in range(c):
            g = dyr[j] * weight[j] if weight is not None else dyr[j]
            g_sum += g
            gx_sum += g * xhr[j]
        g_mean, gx_mean = g_sum / n_c, gx_sum / n_c
        for j in range(c):                             # (dx[j] overwrites xhat[j], read just before)
            g = dyr[j] * weight[j] if weight is not None else dyr[j]
            dxr[j] = rs * (g - g_mean - xhr[j] * gx_mean)


def layer_norm_forward(x, weight=None, bias=None, eps: float = 1e-5):
    check_layer_norm_inputs(x, weight, bias, eps)
    c = x.shape[-1]
    rows = numpy.ascontiguousarray(x).reshape(-1, c)                 # (N, C)
    y = numpy.empty_like(rows)                                       # (N, C)
    mean, rstd = numpy.empty((rows.shape[0], 1), rows.dtype), numpy.empty((rows.shape[0], 1), rows.dtype)   # (N, 1)
    w = None if weight is None else numpy.ascontiguousarray(weight, dtype=x.dtype)
    b = None if bias is None else numpy.ascontiguousarray(bias, dtype=x.dtype)
    over_rows(_forward, rows.shape[0], c, y, mean[:, 0], rstd[:, 0], rows, w, b, x.dtype.type(eps),
              per_thread=CHEAP)
    stats = x.shape[:-1] + (1,)
    return y.reshape(x.shape), LayerNormCache(x, mean.reshape(stats), rstd.reshape(stats), weight,
                                              bias is not None, x.dtype)


def layer_norm_backward(dy, cache):
    x, mean, rstd, weight, has_bias, dtype = cache
    expect_grad(dy, "dy", x.shape, dtype)
    c = x.shape[-1]
    acc = accumulation_dtype(dtype)
    dys = numpy.ascontiguousarray(dy, dtype=acc).reshape(-1, c)     # (N, C)
    xs = numpy.ascontiguousarray(x, dtype=acc).reshape(-1, c)       # (N, C)
    mu = numpy.ascontiguousarray(mean, dtype=acc).reshape(-1)       # (N,)
    rs = numpy.ascontiguousarray(rstd, dtype=acc).reshape(-1)       # (N,)
    n = dys.shape[0]
    parts = -(-n // ROWS_PER_PART)
    dw_parts = numpy.zeros((parts, c), acc) if weight is not None else None   # (parts, C)
    db_parts = numpy.zeros((parts, c), acc) if has_bias else None              # (parts, C)
    w = None if weight is None else numpy.ascontiguousarray(weight, dtype=acc)
    dx = numpy.empty_like(dys)
    over_rows(_backward, n, c, dx, dw_parts, db_parts, dys, xs, mu, rs, w, multiple=ROWS_PER_PART,
              per_thread=CHEAP)
    dweight = dw_parts.sum(axis=0).astype(dtype) if dw_parts is not None else None
    dbias = db_parts.sum(axis=0).astype(dtype) if db_parts is not None else None
    return dx.reshape(x.shape).astype(dtype, copy=False), dweight, dbias
