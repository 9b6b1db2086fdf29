"""Fused layer norm over the last axis (reference: :mod:`npformer.ops.layernorm`).

Forward, one block per row: ``mu = mean x``, ``var = mean (x - mu)^2`` (two passes, as the plain
op), ``rstd = 1 / sqrt(var + eps)``, ``xhat = (x - mu) rstd``, ``y = xhat w + b``; the cache is the
reference's: x itself, and mu and rstd per row (float32 for 16-bit input), no xhat written.
Backward: ``xhat`` recomputed from them as the forward computed it, ``dx = rstd (g - mean g - xhat
mean(g xhat))``, ``g = dy w``, one block per row; ``dw = sum dy xhat`` and ``db = sum dy`` in one
coalesced column pass.
"""
from __future__ import annotations

import numpy

from npformer.backend import accumulation_dtype
from npformer.checks import expect_grad
from npformer.errors import InputTypeError
from npformer.kernels.cuda.runtime import contiguous, device_xp, launch_columns, launch_rows, rows_of
from npformer.ops.layernorm import LayerNormCache, check_layer_norm_inputs

__all__ = ["layer_norm_forward", "layer_norm_backward", "layer_norm_param_grads", "check_cache_dtypes",
           "statistics_of"]


def layer_norm_forward(x, weight=None, bias=None, eps: float = 1e-5):
    """Returns ``(y, LayerNormCache(x, mean, rstd, weight, has_bias, dtype))``."""
    check_layer_norm_inputs(x, weight, bias, eps)
    xp = device_xp(x, weight, bias)
    rows, n = rows_of(x)
    acc = accumulation_dtype(x.dtype)
    x = contiguous(xp, x)
    w = contiguous(xp, weight) if weight is not None else x   # x stands in for an absent w or b:
    b = contiguous(xp, bias) if bias is not None else x        # never read (has_w, has_b = 0)
    y = xp.empty(x.shape, dtype=x.dtype)                 # (..., C)
    mean = xp.empty(x.shape[:-1] + (1,), dtype=acc)      # (..., 1)
    rstd = xp.empty(x.shape[:-1] + (1,), dtype=acc)      # (..., 1)
    if rows:
        launch_rows("layer_norm_fwd", x.dtype, rows, n,
                    (x, w, b, y, mean, rstd, numpy.int64(rows), numpy.int32(n), acc.type(eps),
                     numpy.int32(weight is not None), numpy.int32(bias is not None)))
    return y, LayerNormCache(x, mean, rstd, weight, bias is not None, x.dtype)


def check_cache_dtypes(cache) -> None:
    """The kernels read the cache's x in the input's dtype, and mu and rstd in its accumulation dtype."""
    acc = accumulation_dtype(cache.dtype)
    if cache.x.dtype != cache.dtype or cache.mean.dtype != acc or cache.rstd.dtype != acc:
        raise InputTypeError(f"cache: expected x in {numpy.dtype(cache.dtype)} and mean and rstd in {acc}, got "
                             f"{cache.x.dtype}, {cache.mean.dtype} and {cache.rstd.dtype}")


def statistics_of(xp, cache) -> tuple:
    """The cache's ``(x, mean, rstd)``, contiguous, as the kernels read them (after the dtype check)."""
    check_cache_dtypes(cache)
    return contiguous(xp, cache.x), contiguous(xp, cache.mean), contiguous(xp, cache.rstd)


def layer_norm_backward(dy, cache):
    """Returns ``(dx, dweight, dbias)``; None for an absent weight or bias."""
    _, _, _, weight, has_bias, dtype = cache
    expect_grad(dy, "dy", cache.x.shape, dtype)
    xp = device_xp(dy, weight)
    x, mean, rstd = statistics_of(xp, cache)
    rows, n = rows_of(x)
    dy = contiguous(xp, dy)
    w = contiguous(xp, weight) if weight is not None else dy   # stand-in, never read
    dx = xp.empty(dy.shape, dtype=dtype)                 # (..., C)
    if rows:
        # fwd: xhat = (x - mu) * rstd  ->  dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
        launch_rows("layer_norm_bwd", dtype, rows, n,
                    (dy, x, mean, rstd, w, dx, numpy.int64(rows), numpy.int32(n),
                     numpy.int32(weight is not None)))
    return (dx, *layer_norm_param_grads(dy, (x, mean, rstd), weight, has_bias, dtype))


def layer_norm_param_grads(dy, stats, weight, has_bias, dtype):
    """``(dweight, dbias)`` from contiguous ``dy`` (..., C) and the forward's ``stats`` ``(x, mean,
    rstd)`` (contiguous, :func:`statistics_of`) in one column pass; None for an absent weight or bias."""
    if weight is None and not has_bias:
        return None, None
    xp = device_xp(dy)
    rows, n = rows_of(dy)
    if rows:
        # fwd: y = xhat * w + b  ->  dw = sum dy * xhat,  db = sum dy  (xhat = (x - mu) * rstd)
        part_dw, part_db = launch_columns(xp, "ln_param_grads", dtype, rows, n, (dy, *stats), (), 2)
        sum_dw, sum_db = part_dw.sum(axis=0), part_db.sum(axis=0)   # (C,)
    else:
        sum_dw = sum_db = xp.zeros((n,), dtype=accumulation_dtype(dtype))
    dweight = sum_dw.astype(dtype) if weight is not None else None
    dbias = sum_db.astype(dtype) if has_bias else None
    return dweight, dbias
