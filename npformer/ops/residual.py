"""The residual glue around each sublayer (Vaswani et al. 2017, section 5.4):

    residual:  out = x + dropout(h)                     dx = dout,  dh = dropout'(dout)
    add_norm:  out = LayerNorm(x + dropout(h))  ("Add & Norm", the post-norm sublayer output)
"""
from __future__ import annotations

from typing import Any, NamedTuple

from npformer.checks import describe, expect_float
from npformer.ops.dropout import dropout_backward, dropout_forward
from npformer.ops.layernorm import layer_norm_backward, layer_norm_forward

__all__ = ["residual_forward", "residual_backward", "add_norm_forward", "add_norm_backward"]


class ResidualCache(NamedTuple):
    drop: Any


class AddNormCache(NamedTuple):
    drop: Any
    norm: Any


def _check(x, h):
    expect_float(x, "x")
    expect_float(h, "h")
    if tuple(x.shape) != tuple(h.shape):
        raise ValueError(f"x and h must have the same shape, got x {describe(x)} and h {describe(h)}")


def residual_forward(x, h, *, dropout_p: float = 0.0, rng=None, training: bool = True):
    _check(x, h)
    hd, drop = dropout_forward(h, dropout_p, rng=rng, training=training)
    return x + hd, ResidualCache(drop)


def residual_backward(dout, cache: ResidualCache):
    """Returns ``(dx, dh)``."""
    # fwd: out = x + dropout(h)  ->  dx = dout,  dh = dropout'(dout)
    return dout.copy(), dropout_backward(dout, cache.drop)


def add_norm_forward(x, h, weight, bias, *, eps: float = 1e-5, dropout_p: float = 0.0, rng=None,
                     training: bool = True):
    _check(x, h)
    hd, drop = dropout_forward(h, dropout_p, rng=rng, training=training)
    out, norm = layer_norm_forward(x + hd, weight, bias, eps=eps)
    return out, AddNormCache(drop, norm)


def add_norm_backward(dout, cache: AddNormCache):
    """Returns ``(dx, dh, dweight, dbias)``."""
    ds, dweight, dbias = layer_norm_backward(dout, cache.norm)   # fwd: out = LN(s)
    return ds, dropout_backward(ds, cache.drop), dweight, dbias  # fwd: s = x + dropout(h)
