"""Fused layer norm over the last axis (reference: :mod:`npformer.ops.layernorm`).

Forward, one block per row: ``mu = mean x``, ``var = mean (x - mu)^2`` (two passes, as the plain
op), ``rstd = 1 / sqrt(var + eps)``, ``xhat = (x - mu) rstd`` (cached, float32 for 16-bit input),
``y = xhat w + b``. Backward: ``dx = rstd (g - mean g - xhat mean(g xhat))``, ``g = dy w``, one
block per row; ``dw = sum dy xhat`` and ``db = sum dy`` in one coalesced column pass.
"""
from __future__ import annotations

import numpy

from npformer.backend import accumulation_dtype
from npformer.checks import expect_grad
from npformer.errors import InputTypeError
from npformer.kernels.cuda.runtime import contiguous, device_xp, launch_columns, launch_rows, rows_of
from npformer.ops.layernorm import LayerNormCache, check_layer_norm_inputs

__all__ = ["layer_norm_forward", "layer_norm_backward", "layer_norm_param_grads", "check_cache_dtypes"]


def layer_norm_forward(x, weight=None, bias=None, eps: float = 1e-5):
    """Returns ``(y, LayerNormCache(xhat, rstd, weight, has_bias, dtype))``."""
    check_layer_norm_inputs(x, weight, bias, eps)
    xp = device_xp(x, weight, bias)
    rows, n = rows_of(x)
    acc = accumulation_dtype(x.dtype)
    x = contiguous(xp, x)
    w = contiguous(xp, weight) if weight is not None else x   # x stands in for an absent w or b:
    b = contiguous(xp, bias) if bias is not None else x        # never read (has_w, has_b = 0)
    y = xp.empty(x.shape, dtype=x.dtype)                 # (..., C)
    xhat = xp.empty(x.shape, dtype=acc)                  # (..., C)
    rstd = xp.empty(x.shape[:-1] + (1,), dtype=acc)      # (..., 1)
    if rows:
        launch_rows("layer_norm_fwd", x.dtype, rows, n,
                    (x, w, b, y, xhat, rstd, numpy.int64(rows), numpy.int32(n), acc.type(eps),
                     numpy.int32(weight is not None), numpy.int32(bias is not None)))
    return y, LayerNormCache(xhat, rstd, weight, bias is not None, x.dtype)


def check_cache_dtypes(xhat, rstd, dtype) -> None:
    """The kernels read xhat and rstd in the accumulation dtype of the input's ``dtype``."""
    acc = accumulation_dtype(dtype)
    if xhat.dtype != acc or rstd.dtype != acc:
        raise InputTypeError(f"cache: expected xhat and rstd in {acc} for {numpy.dtype(dtype)} input, "
                             f"got {xhat.dtype} and {rstd.dtype}")


def layer_norm_backward(dy, cache):
    """Returns ``(dx, dweight, dbias)``; None for an absent weight or bias."""
    xhat, rstd, weight, has_bias, dtype = cache
    expect_grad(dy, "dy", xhat.shape, dtype)
    xp = device_xp(dy, weight)
    check_cache_dtypes(xhat, rstd, dtype)
    rows, n = rows_of(xhat)
    dy, xhat, rstd = contiguous(xp, dy), contiguous(xp, xhat), contiguous(xp, rstd)
    w = contiguous(xp, weight) if weight is not None else dy   # stand-in, never read
    dx = xp.empty(dy.shape, dtype=dtype)                 # (..., C)
    if rows:
        # fwd: xhat = (x - mu) * rstd  ->  dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
        launch_rows("layer_norm_bwd", dtype, rows, n,
                    (dy, xhat, rstd, w, dx, numpy.int64(rows), numpy.int32(n),
                     numpy.int32(weight is not None)))
    return (dx, *layer_norm_param_grads(dy, xhat, weight, has_bias, dtype))


def layer_norm_param_grads(dy, xhat, weight, has_bias, dtype):
    """``(dweight, dbias)`` from contiguous ``dy`` and ``xhat`` (..., C) in one column pass; None for
    an absent weight or bias."""
    if weight is None and not has_bias:
        return None, None
    xp = device_xp(dy)
    rows, n = rows_of(xhat)
    if rows:
        # fwd: y = xhat * w + b  ->  dw = sum dy * xhat,  db = sum dy
        part_dw, part_db = launch_columns(xp, "ln_param_grads", dtype, rows, n, (dy, xhat), (), 2)
        sum_dw, sum_db = part_dw.sum(axis=0), part_db.sum(axis=0)   # (C,)
    else:
        sum_dw = sum_db = xp.zeros((n,), dtype=accumulation_dtype(dtype))
    dweight = sum_dw.astype(dtype) if weight is not None else None
    dbias = sum_db.astype(dtype) if has_bias else None
    return dweight, dbias
