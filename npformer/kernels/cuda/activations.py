"""Fused GELU (reference: :mod:`npformer.ops.activations`), bias-add, and bias-add fused with GELU.

    gelu(x) = x (1 + erf(x / sqrt 2)) / 2               (approximate="none")
    gelu(x) = x/2 (1 + tanh(sqrt(2/pi) (xc + 0.044715 xc^3))),  xc = clip(x, -100, 100)  ("tanh")
    bias-add:       out = x + b over the last axis;   dbias = dout summed over the leading axes
    bias + GELU:    h = z + b,  a = gelu(h)  ->  dz = da gelu'(h),  dbias = sum dz
    + dropout:      a' = a m / (1 - p)  ->  da = da' m / (1 - p) first (the feed-forward block's order)

Each forward and backward is one kernel (bias + GELU backward writes ``dz`` and the column partial
sums of ``dbias`` in the same pass; with dropout, the mask is drawn as the dropout op draws it and
applied in the same kernel). 16-bit inputs are computed in float32 and rounded once.
"""
from __future__ import annotations

import numpy

from npformer.checks import expect_float, expect_grad, expect_same_dtype, expect_shape, one_of
from npformer.errors import ShapeError
from npformer.kernels.cuda.dropout import dropout_forward, keep_arguments, keep_draws, no_keep_draws
from npformer.kernels.cuda.runtime import contiguous, device_xp, launch_columns, launch_elements, rows_of
from npformer.ops.activations import APPROXIMATIONS, GeluCache
from npformer.ops.dropout import DropoutCache, dropout_active

__all__ = ["gelu_forward", "gelu_backward", "bias_add_forward", "bias_grad",
           "bias_gelu_forward", "bias_gelu_backward", "bias_gelu_dropout_forward", "bias_gelu_dropout_backward"]


def _tanh_form(approximate) -> numpy.int32:
    return numpy.int32(one_of(approximate, "approximate", APPROXIMATIONS) == "tanh")


def gelu_forward(x, approximate: str = "none"):
    """Returns ``(y, GeluCache(x, approximate))``."""
    expect_float(x, "x")
    form = _tanh_form(approximate)
    xp = device_xp(x)
    x = contiguous(xp, x)
    y = xp.empty(x.shape, dtype=x.dtype)                 # (...)
    if x.size:
        launch_elements("gelu_fwd", x.dtype, x.size, (x, y, numpy.int64(x.size), form))
    return y, GeluCache(x, approximate)


def gelu_backward(dy, cache):
    """``dx = dy * gelu'(x)``."""
    x, approximate = cache.x, cache.approximate
    form = _tanh_form(approximate)
    xp = device_xp(dy, x)
    expect_grad(dy, "dy", x.shape, x.dtype)
    dy, x = contiguous(xp, dy), contiguous(xp, x)
    dx = xp.empty(x.shape, dtype=x.dtype)                # (...)
    if x.size:
        # fwd: y = gelu(x)  ->  dx = dy * gelu'(x)
        launch_elements("gelu_bwd", x.dtype, x.size, (dy, x, dx, numpy.int64(x.size), form))
    return dx


def _check_bias(x, bias) -> int:
    expect_float(x, "x")
    if x.ndim < 1:
        raise ShapeError("x: expected at least 1 axis (..., C), got a 0-d array")
    expect_shape(bias, "bias", (x.shape[-1],), "(C,) matching the last axis of x")
    expect_same_dtype(x=x, bias=bias)
    return x.shape[-1]


def bias_add_forward(x, bias):
    """``out = x + bias`` over the last axis; a fresh array (the inputs are not touched)."""
    n = _check_bias(x, bias)
    xp = device_xp(x, bias)
    x, bias = contiguous(xp, x), contiguous(xp, bias)
    out = xp.empty(x.shape, dtype=x.dtype)               # (..., C)
    if x.size:
        launch_elements("bias_add", x.dtype, x.size, (x, bias, out, numpy.int64(x.size), numpy.int32(n)))
    return out


def bias_grad(dout):
    """``dbias`` (C,): ``dout`` (..., C) summed over every leading axis, in ``dout``'s dtype (summed
    in float32 for 16-bit input): linear's ``dout2.sum(axis=0)`` as one coalesced column pass."""
    expect_float(dout, "dout")
    xp = device_xp(dout)
    rows, n = rows_of(dout)
    dout = contiguous(xp, dout)
    if not rows:
        return xp.zeros((n,), dtype=dout.dtype)
    # fwd: out = x + b  ->  db = sum over rows of dout
    (part,) = launch_columns(xp, "bias_grad", dout.dtype, rows, n, (dout,), (), 1)
    return part.sum(axis=0).astype(dout.dtype)           # (C,)


def _bias_gelu(z, bias, approximate, p=0.0, rng=None):
    """(a, h, the dropout's seed draws or None): one kernel; dropout (0 < p < 1) when ``rng`` is given."""
    n = _check_bias(z, bias)
    form = _tanh_form(approximate)
    xp = device_xp(z, bias)
    z, bias = contiguous(xp, z), contiguous(xp, bias)
    h = xp.empty(z.shape, dtype=z.dtype)                 # (..., F)
    a = xp.empty(z.shape, dtype=z.dtype)                 # (..., F)
    if rng is not None:
        draws, keep_min, scale = keep_draws(z, p, rng)   # the dropout op's seed draws for a (same shape)
    else:
        draws, keep_min, scale = no_keep_draws(xp, z.dtype)
    if z.size:
        launch_elements("bias_gelu_fwd", z.dtype, z.size,
                        (z, bias, draws, h, a, numpy.int64(z.size), numpy.int32(n), form, keep_min,
                         scale, numpy.int32(rng is not None)))
    return a, h, (draws if rng is not None else None)


def bias_gelu_forward(z, bias, approximate: str = "none"):
    """``h = z + bias``, ``a = gelu(h)``; returns ``(a, GeluCache(h, approximate))``.

    ``z`` is a linear layer's output without its bias. The cache is the one ``gelu_forward(h)``
    returns, so ``gelu_backward`` (fused or plain) accepts it too.
    """
    a, h, _ = _bias_gelu(z, bias, approximate)
    return a, GeluCache(h, approximate)


def bias_gelu_dropout_forward(z, bias, approximate: str = "none", p: float = 0.0, rng=None, training: bool = True):
    """``a = dropout(gelu(z + bias))``; returns ``(a, GeluCache(h, approximate), DropoutCache)``, the
    caches ``gelu_forward(h)`` and ``dropout_forward(gelu(h))`` return (the same mask for one seed)."""
    if not dropout_active(z, p, rng, training):
        a, act = bias_gelu_forward(z, bias, approximate)
        return a, act, DropoutCache.identity(z)          # the identity: no copy of the fresh a
    if p == 1.0:                                         # everything dropped, nothing drawn
        a, act = bias_gelu_forward(z, bias, approximate)
        a, drop = dropout_forward(a, p, rng)
        return a, act, drop
    a, h, draws = _bias_gelu(z, bias, approximate, p, rng)
    return a, GeluCache(h, approximate), DropoutCache.of_seed(draws, p, z)   # the mask hashed again in the backward


def _bias_gelu_grads(dy, h, approximate, drop: DropoutCache):
    form = _tanh_form(approximate)
    xp = device_xp(dy, h)
    expect_grad(dy, "da", h.shape, h.dtype)
    rows, n = rows_of(h)
    dy, h = contiguous(xp, dy), contiguous(xp, h)
    dz = xp.empty(h.shape, dtype=h.dtype)                # (..., F)
    if not rows:
        return dz, xp.zeros((n,), dtype=h.dtype)
    keep, draws, keep_min, scale, drop_flag = keep_arguments(xp, drop, h.dtype)
    # fwd: a = gelu(h), h = z + b  ->  dz = da * gelu'(h),  db = sum over rows of dz
    (part,) = launch_columns(xp, "bias_gelu_bwd", h.dtype, rows, n, (dy, keep, draws, keep_min, scale, h, dz),
                             (form, drop_flag), 1)
    return dz, part.sum(axis=0).astype(h.dtype)          # (..., F), (F,)


def bias_gelu_backward(da, cache):
    """Returns ``(dz, dbias)``: ``dz = da * gelu'(h)`` and ``dbias = sum of dz over the rows``."""
    h, approximate = cache.x, cache.approximate
    return _bias_gelu_grads(da, h, approximate, DropoutCache.identity(h))


def bias_gelu_dropout_backward(da, act_cache, drop_cache):
    """Returns ``(dz, dbias)`` of ``a = dropout(gelu(z + bias))``: ``da`` times the mask first."""
    # fwd: a' = a * m / (1 - p)  ->  da = da' * m / (1 - p)   (in the same kernel)
    h, approximate = act_cache.x, act_cache.approximate
    return _bias_gelu_grads(da, h, approximate, drop_cache)
