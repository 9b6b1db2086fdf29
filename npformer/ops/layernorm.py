"""Layer normalisation over the last axis, as ``torch.nn.functional.layer_norm`` (Ba et al. 2016).

    mu = mean(x),  rstd = 1 / sqrt(var(x) + eps)          (per row of C values; biased variance)
    xhat = (x - mu) * rstd,        y = xhat * w + b

Backward in the closed form (no graph through mean and var), with g = dy * w:

    dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
    dw = sum over rows of dy * xhat,     db = sum over rows of dy

The cache keeps the input x itself (not a copy) and each row's mu and rstd, as PyTorch's layer norm
does; the backward recomputes xhat = (x - mu) * rstd from them, the forward's arithmetic, so the bits
are the forward's. For 16-bit input that keeps 2 bytes an element where a float32 xhat took 4 (and
the GPU kernels write no xhat: 4 bytes an element less written, 2 less read). Since x is kept, not
copied, changing it in place before the backward changes the gradient, as for a linear layer's input.
A constant row has var = 0, so xhat = 0 and y = b (eps > 0 keeps rstd finite: eps must stay > 0
rounded to the dtype var + eps is computed in, so 1e-50 is refused for float32). 16-bit inputs are
normalised in float32 and rounded back. A row whose squared deviations overflow that dtype (float32:
|x - mu| beyond about 1.8e19) has var = inf, rstd = 0 and so y = b, on every path (PyTorch's float32
layer norm gives 0 there too), and a row whose sum overflows it (float32 values near its largest,
3.4e38) has mu = inf and y = NaN (PyTorch's float32 layer norm gives NaN there too); float64 input
keeps such rows normalised.
"""
from __future__ import annotations

from typing import Any, NamedTuple

from npformer.backend import accumulation_dtype, get_array_module
from npformer.checks import expect_grad, expect_rows, expect_same_float, expect_shape, positive_in_dtype
from npformer.dispatch import dispatched

__all__ = ["LayerNormCache", "normalised", "check_layer_norm_inputs", "check_layer_norm_grad", "layer_norm_forward",
           "layer_norm_backward"]


class LayerNormCache(NamedTuple):
    x: Any           # (..., C) the input (not a copy), in its dtype
    mean: Any        # (..., 1) mu, in the accumulation dtype
    rstd: Any        # (..., 1) in the accumulation dtype
    weight: Any      # (C,) or None
    has_bias: bool
    dtype: Any       # the input's dtype (gradients are returned in it)


def normalised(cache: LayerNormCache):
    """xhat = (x - mu) * rstd (..., C) in the accumulation dtype, as the forward computed it (one
    fresh array, scaled in place)."""
    xhat = cache.x.astype(cache.mean.dtype, copy=False) - cache.mean   # (..., C) fresh: x is never written
    xhat *= cache.rstd
    return xhat


def check_layer_norm_inputs(x, weight, bias, eps) -> None:
    """The forward's input checks (every implementation of it runs them)."""
    expect_same_float(x=x, weight=weight, bias=bias)     # one float dtype, one backend
    expect_rows(x, "x", "(..., C)")
    c = x.shape[-1]
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None:
            expect_shape(p, name, (c,), "(C,) matching the last axis of x")
    positive_in_dtype(eps, "eps", accumulation_dtype(x.dtype))   # eps > 0 where var + eps is added: constant rows


@dispatched
def layer_norm_forward(x, weight=None, bias=None, eps: float = 1e-5):
    """Returns ``(y, cache)``; ``weight``/``bias`` of shape (C,) or None (no affine / no bias)."""
    check_layer_norm_inputs(x, weight, bias, eps)
    xp = get_array_module(x, weight, bias)
    xa = x.astype(accumulation_dtype(x.dtype), copy=False)
    mu = xa.mean(axis=-1, keepdims=True)                 # (..., 1)
    xc = xa - mu                                         # (..., C)
    var = (xc * xc).mean(axis=-1, keepdims=True)         # (..., 1) biased, as torch
    rstd = 1.0 / xp.sqrt(var + eps)                      # (..., 1)
    xhat = xc * rstd                                     # (..., C)
    y = xhat if weight is None else xhat * weight        # (..., C)
    if bias is not None:
        y = y + bias
    return y.astype(x.dtype, copy=False), LayerNormCache(x, mu, rstd, weight, bias is not None, x.dtype)


def check_layer_norm_grad(dy, cache: LayerNormCache) -> None:
    """The backward's check: ``dy`` is the gradient of the forward's output."""
    expect_grad(dy, "dy", cache.x.shape, cache.dtype)


@dispatched
def layer_norm_backward(dy, cache: LayerNormCache):
    """Returns ``(dx, dweight, dbias)``; None for an absent weight or bias."""
    check_layer_norm_grad(dy, cache)
    _, _, rstd, weight, has_bias, dtype = cache
    xhat = normalised(cache)                             # (..., C) fwd: xhat = (x - mu) * rstd
    c = xhat.shape[-1]
    dya = dy.astype(xhat.dtype, copy=False)
    # fwd: y = xhat * w + b  ->  dw = sum dy * xhat,  db = sum dy  (over every row),  dxhat = dy * w
    dweight = (dya * xhat).reshape(-1, c).sum(axis=0).astype(dtype) if weight is not None else None
    dbias = dya.reshape(-1, c).sum(axis=0).astype(dtype) if has_bias else None
    g = dya if weight is None else dya * weight          # (..., C) dxhat
    # fwd: xhat = (x - mu) * rstd  ->  dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
    dx = rstd * (g - g.mean(axis=-1, keepdims=True) - xhat * (g * xhat).mean(axis=-1, keepdims=True))
    return dx.astype(dtype, copy=False), dweight, dbias
