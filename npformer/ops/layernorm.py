"""Layer normalisation over the last axis, as ``torch.nn.functional.layer_norm`` (Ba et al. 2016).

    mu = mean(x),  rstd = 1 / sqrt(var(x) + eps)          (per row of C values; biased variance)
    xhat = (x - mu) * rstd,        y = xhat * w + b

Backward in the closed form (no graph through mean and var), with g = dy * w:

    dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
    dw = sum over rows of dy * xhat,     db = sum over rows of dy

The cache keeps ``xhat`` and ``rstd``: ``xhat`` costs one array but saves recomputing it.
A constant row has var = 0, so xhat = 0 and y = b (eps > 0 keeps rstd finite). 16-bit inputs
are normalised in float32 and rounded back.
"""
from __future__ import annotations

from typing import Any, NamedTuple

from npformer.backend import accumulation_dtype, get_array_module
from npformer.ops import fused
from npformer.ops.checks import expect_float, expect_same_dtype, expect_shape

__all__ = ["LayerNormCache", "layer_norm_forward", "layer_norm_backward"]


class LayerNormCache(NamedTuple):
    xhat: Any        # (..., C) normalised input, in the accumulation dtype
    rstd: Any        # (..., 1)
    weight: Any      # (C,) or None
    has_bias: bool
    dtype: Any       # the input's dtype (gradients are returned in it)


def check_layer_norm_inputs(x, weight, bias, eps) -> None:
    """The input checks of the forward (shared with the fused CuPy kernel)."""
    expect_float(x, "x")
    if x.ndim < 1:
        raise ValueError("x: expected at least 1 axis (..., C), got a 0-d array")
    c = x.shape[-1]
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None:
            expect_shape(p, name, (c,), "(C,) matching the last axis of x")
    expect_same_dtype(x=x, weight=weight, bias=bias)
    if not float(eps) > 0:
        raise ValueError(f"eps must be > 0 (it keeps constant rows finite), got {eps!r}")


def layer_norm_forward(x, weight=None, bias=None, eps: float = 1e-5):
    """Returns ``(y, cache)``; ``weight``/``bias`` of shape (C,) or None (no affine / no bias)."""
    if fused.use_fused(x, weight, bias):                 # CuPy: one kernel per row (ops.fused)
        return fused.layer_norm_forward(x, weight, bias, eps=eps)
    check_layer_norm_inputs(x, weight, bias, eps)
    xp = get_array_module(x, weight, bias)
    c = x.shape[-1]
    xa = x.astype(accumulation_dtype(x.dtype), copy=False)
    mu = xa.mean(axis=-1, keepdims=True)                 # (..., 1)
    xhat = xa - mu                                       # (..., C) fresh
    var = xp.einsum("...c,...c->...", xhat, xhat)[..., None] / c   # (..., 1), no (..., C) square
    rstd = 1.0 / xp.sqrt(var + eps)                      # (..., 1)
    xhat *= rstd
    y = xhat * weight if weight is not None else xhat.copy()   # (..., C)
    if bias is not None:
        y += bias
    return y.astype(x.dtype, copy=False), LayerNormCache(xhat, rstd, weight, bias is not None, x.dtype)


def layer_norm_backward(dy, cache: LayerNormCache):
    """Returns ``(dx, dweight, dbias)``; None for an absent weight or bias."""
    if fused.use_fused(dy, cache.weight, dtype=cache.dtype):
        return fused.layer_norm_backward(dy, cache)
    xhat, rstd, weight, has_bias, dtype = cache
    xp = get_array_module(dy, xhat)
    c = xhat.shape[-1]
    dya = dy.astype(xhat.dtype, copy=False)
    rows = dya.reshape(-1, c)                            # (N, C)
    # fwd: y = xhat * w + b  ->  dw = sum dy * xhat,  db = sum dy,  dxhat = dy * w
    dweight = xp.einsum("nc,nc->c", rows, xhat.reshape(-1, c)).astype(dtype) if weight is not None else None
    dbias = rows.sum(axis=0).astype(dtype) if has_bias else None
    g = dya * weight if weight is not None else dya.copy()   # (..., C) fresh: becomes dx
    # fwd: xhat = (x - mu) * rstd  ->  dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
    g_xhat = xp.einsum("...c,...c->...", g, xhat)[..., None] / c    # (..., 1) mean(g * xhat)
    g -= g.mean(axis=-1, keepdims=True)
    g -= xhat * g_xhat
    g *= rstd
    return g.astype(dtype, copy=False), dweight, dbias
