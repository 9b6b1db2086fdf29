"""Layer norm for NumPy with row statistics by ``einsum`` and the backward in place (reference:
:mod:`npformer.ops.layernorm`).

The variance ``sum (x - mu)^2 / C`` and the backward's ``mean(g * xhat)`` are row dot products
(``einsum("...c,...c->...")``), which never build the (..., C) product the reference's
``(xc * xc).mean(-1)`` allocates, and the row means are ``einsum`` row sums (NumPy's ``mean`` along
a short last axis pays a reduction call per row: 99 against 40 us for 2048 rows of 128); the
backward recomputes xhat from the cache (:func:`~npformer.ops.layernorm.normalised`, the forward's
arithmetic) and updates its one other (..., C) array in place.
"""
from __future__ import annotations

import numpy

from npformer.backend import accumulation_dtype
from npformer.checks import expect_grad
from npformer.ops.layernorm import LayerNormCache, check_layer_norm_inputs, normalised

__all__ = ["layer_norm_forward", "layer_norm_backward"]


def layer_norm_forward(x, weight=None, bias=None, eps: float = 1e-5):
    check_layer_norm_inputs(x, weight, bias, eps)
    c = x.shape[-1]
    xa = x.astype(accumulation_dtype(x.dtype), copy=False)
    mu = numpy.einsum("...c->...", xa)[..., None] / c    # (..., 1)
    xhat = xa - mu                                       # (..., C) fresh
    var = numpy.einsum("...c,...c->...", xhat, xhat)[..., None] / c   # (..., 1)
    rstd = 1.0 / numpy.sqrt(var + eps)                   # (..., 1)
    xhat *= rstd
    y = xhat * weight if weight is not None else xhat.copy()   # (..., C)
    if bias is not None:
        y += bias
    return y.astype(x.dtype, copy=False), LayerNormCache(x, mu, rstd, weight, bias is not None, x.dtype)


def layer_norm_backward(dy, cache):
    _, _, rstd, weight, has_bias, dtype = cache
    expect_grad(dy, "dy", cache.x.shape, dtype)
    xhat = normalised(cache)                             # (..., C) fwd: xhat = (x - mu) * rstd
    c = xhat.shape[-1]
    dya = dy.astype(xhat.dtype, copy=False)
    rows = dya.reshape(-1, c)                            # (N, C)
    # fwd: y = xhat * w + b  ->  dw = sum dy * xhat,  db = sum dy,  dxhat = dy * w
    dweight = numpy.einsum("nc,nc->c", rows, xhat.reshape(-1, c)).astype(dtype) if weight is not None else None
    dbias = rows.sum(axis=0).astype(dtype) if has_bias else None
    g = dya * weight if weight is not None else dya.copy()   # (..., C) fresh: becomes dx
    # fwd: xhat = (x - mu) * rstd  ->  dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
    g_xhat = numpy.einsum("...c,...c->...", g, xhat)[..., None] / c    # (..., 1) mean(g * xhat)
    g -= numpy.einsum("...c->...", g)[..., None] / c
    g -= xhat * g_xhat
    g *= rstd
    return g.astype(dtype, copy=False), dweight, dbias
