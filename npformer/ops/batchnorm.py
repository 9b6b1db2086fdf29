"""Batch normalisation over the feature axis, as ``torch.nn.functional.batch_norm`` (Ioffe & Szegedy
2015), for channels-last inputs: x is (N, C) or (B, T, C) and every one of the C features has its
own statistics over all the other positions (N = B*T of them). torch's ``BatchNorm1d`` takes
(N, C, L) with the channels on axis 1; move the axis to compare (``x.transpose(0, 2, 1)``).

Training (batch statistics; the biased variance normalises, the unbiased one feeds the running
average, as torch)::

    mu = sum_i m_i x_i / n,   var = sum_i m_i (x_i - mu)^2 / n,   n = sum_i m_i     (per feature)
    xhat = (x - mu) * rstd,   rstd = 1 / sqrt(var + eps),   y = xhat * w + b
    running_mean <- (1 - momentum) running_mean + momentum mu
    running_var  <- (1 - momentum) running_var  + momentum var * n / (n - 1)

Eval: the same with mu, var = running_mean, running_var (constants, so dx = dy * w * rstd).

``padding_mask`` (B, T) bool, True = padding (the project's mask convention), is an option this
op adds: m_i = 0 for padding positions, so they take no part in the statistics. Every position,
padding included, is still normalised (with the statistics of the others). Without it m_i = 1.

Backward in the closed form (no graph through mu and var), with g = dy * w and sums over all N:

    dx_i = rstd * (g_i - m_i / n * (sum_j g_j + xhat_i * sum_j g_j xhat_j))
    dw = sum_i dy_i * xhat_i,    db = sum_i dy_i

Training needs n >= 2 (torch: "Expected more than 1 value per channel"): with one value the
variance is 0, xhat = 0, y = b whatever x is, and the unbiased variance divides by zero; a
ValueError says so. A constant feature (var = 0 with n >= 2) gives xhat = 0, y = b, no NaN
(eps > 0 keeps rstd = 1/sqrt(eps) finite, so dx = rstd * (g - mean(g)) is large but finite).
16-bit inputs are normalised in float32 and rounded back, as layer norm.
"""
from __future__ import annotations

from typing import Any, NamedTuple

from npformer.backend import accumulation_dtype, get_array_module
from npformer.checks import (describe, expect_float, expect_grad, expect_ndim, expect_same_dtype, expect_shape,
                             positive_in_dtype, probability)
from npformer.errors import InputTypeError, RangeError, ShapeError
from npformer.dispatch import dispatched
from npformer.ops.linear import as_rows

__all__ = ["RunningStats", "BatchNormCache", "batch_norm_forward", "batch_norm_backward"]


class RunningStats(NamedTuple):
    mean: Any        # (C,)
    var: Any         # (C,) unbiased


class BatchNormCache(NamedTuple):
    xhat: Any        # (N, C) normalised input (rows of x flattened), in the accumulation dtype
    rstd: Any        # (C,)
    scale: Any       # training: (N, 1) m_i / n with a padding mask, the float 1 / n without;
                     # eval: None (the statistics are constants)
    weight: Any      # (C,) or None
    has_bias: bool
    shape: tuple     # the input's shape
    dtype: Any       # the input's dtype (gradients are returned in it)


def _check(x, weight, bias, running, training, momentum, eps, padding_mask):
    expect_float(x, "x")
    expect_ndim(x, "x", (2, 3), "(N, C) or (B, T, C), features last")
    c = x.shape[-1]
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None:
            expect_shape(p, name, (c,), "(C,) matching the last axis of x")
    if running is not None:
        if not (isinstance(running, tuple) and len(running) == 2):
            raise InputTypeError(f"running: expected RunningStats(mean, var) or None, got {describe(running)}")
        expect_shape(running[0], "running mean", (c,), "(C,)")
        expect_shape(running[1], "running var", (c,), "(C,)")
    r_mean, r_var = (None, None) if running is None else running
    expect_same_dtype(x=x, weight=weight, bias=bias, running_mean=r_mean, running_var=r_var)
    positive_in_dtype(eps, "eps", accumulation_dtype(x.dtype))   # > 0 in var + eps keeps constant features finite
    probability(momentum, "momentum")
    if not training and running is None:
        raise RangeError("eval mode normalises with the running statistics: pass running=RunningStats(mean, var)")
    if padding_mask is not None:
        expect_shape(padding_mask, "padding_mask", x.shape[:-1], "(B, T) or (N,), True = padding")
        if padding_mask.dtype.kind != "b":
            raise InputTypeError(f"padding_mask: expected a bool array (True = padding), got {describe(padding_mask)}")


@dispatched
def batch_norm_forward(x, weight=None, bias=None, running: RunningStats | None = None, *,
                       training: bool = True, momentum: float = 0.1, eps: float = 1e-5,
                       padding_mask=None):
    """Returns ``(y, new_running, cache)``.

    ``new_running`` is a fresh ``RunningStats`` updated with this batch in training, ``running``
    itself in eval, None when ``running`` is None (nothing is updated in place). ``padding_mask``
    is used in training only (eval statistics do not depend on the batch).
    """
    _check(x, weight, bias, running, training, momentum, eps, padding_mask)
    xp = get_array_module(x, weight, bias, padding_mask)
    acc = accumulation_dtype(x.dtype)
    rows = as_rows(x).astype(acc, copy=True)                            # (N, C) fresh (C may be 0)
    scale = None
    if training:
        m = None if padding_mask is None else (~padding_mask).reshape(-1, 1).astype(acc)   # (N, 1)
        n = rows.shape[0] if m is None else int(m.sum())
        if n < 2:
            raise ShapeError(f"batch norm in training needs more than 1 (non-padding) value per feature, "
                             f"got {n} in x of shape {tuple(x.shape)} (the variance would be 0 and y = "
                             "bias whatever x is); use eval mode with running statistics, or layer norm")
        if m is None:
            mu = rows.mean(axis=0)                                      # (C,)
            rows -= mu
            var = (rows * rows).mean(axis=0)                            # (C,)
            scale = 1.0 / n
        else:
            mu = (rows * m).sum(axis=0) / n                             # (C,)
            rows -= mu
            var = (rows * rows * m).sum(axis=0) / n                     # (C,)
            scale = m / n                                               # (N, 1)
        new_running = None
        if running is not None:
            r_mean, r_var = running
            new_running = RunningStats(
                ((1 - momentum) * r_mean.astype(acc) + momentum * mu).astype(x.dtype),
                ((1 - momentum) * r_var.astype(acc) + momentum * var * (n / (n - 1))).astype(x.dtype))
    else:
        mu, var = running[0].astype(acc), running[1].astype(acc)        # (C,)
        rows -= mu
        new_running = running
    rstd = 1.0 / xp.sqrt(var + eps)                                     # (C,)
    rows *= rstd                                                        # xhat (N, C)
    y = rows * weight if weight is not None else rows.copy()           # (N, C)
    if bias is not None:
        y += bias
    cache = BatchNormCache(rows, rstd, scale, weight, bias is not None, tuple(x.shape), x.dtype)
    return y.reshape(x.shape).astype(x.dtype, copy=False), new_running, cache


@dispatched
def batch_norm_backward(dy, cache: BatchNormCache):
    """Returns ``(dx, dweight, dbias)``; None for an absent weight or bias."""
    xhat, rstd, scale, weight, has_bias, shape, dtype = cache
    expect_grad(dy, "dy", shape, dtype)
    dya = as_rows(dy).astype(xhat.dtype, copy=False)                    # (N, C) (C may be 0)
    # fwd: y = xhat * w + b  ->  dw = sum dy * xhat,  db = sum dy,  dxhat = dy * w
    dweight = (dya * xhat).sum(axis=0).astype(dtype) if weight is not None else None
    dbias = dya.sum(axis=0).astype(dtype) if has_bias else None
    g = dya * weight if weight is not None else dya.copy()            # (N, C) fresh
    if scale is not None:
        # fwd: xhat = (x - mu) * rstd, mu and var over the rows with m_i = 1
        #   ->  dx = rstd * (g - m/n * (sum g + xhat * sum g xhat))
        g -= scale * (g.sum(axis=0) + xhat * (g * xhat).sum(axis=0))
    # eval: fwd xhat = (x - running_mean) * rstd  ->  dx = g * rstd
    g *= rstd
    return g.reshape(shape).astype(dtype, copy=False), dweight, dbias
