"""The residual connection around a sub-layer, with the sub-layer's dropout and the layer norm that
follows it, as the Transformer's layers use them (Vaswani et al. 2017, section 5.4: "dropout to the
output of each sub-layer, before it is added to the sub-layer input and normalized"):

    s = x + dropout(branch)                 branch = sublayer(...), x the skip input
    y = LayerNorm(s)                         (residual_dropout_layer_norm only)

    post-norm:  x' = LN(x + dropout(sublayer(x)))             the layer keeps y
    pre-norm:   x' = x + dropout(sublayer(LN(x)))             the layer keeps s; y = LN(s) is the
                                                              next sub-layer's input (its own norm)
Backward, with ds the gradient reaching s from elsewhere (pre-norm: the next residual's skip;
post-norm: none) and dy the gradient of y:

    dx = ds + LN'(dy)        (s = x + ...: the skip passes the gradient of s unchanged)
    dbranch = dropout'(dx) = dx * m / (1 - p)
    (without the norm: dx = ds, dbranch = dropout'(ds), the dropout op's backward)

Each is composed of the dropout and layer-norm ops (the same mask for one seed, the same caches);
a fused kernel stands in for the whole line on the GPU (:mod:`npformer.kernels`).
"""
from __future__ import annotations

from typing import Any, NamedTuple

from npformer.checks import expect_grad, expect_same_float, expect_shape
from npformer.dispatch import dispatched
from npformer.ops.dropout import dropout_backward, dropout_term
from npformer.ops.layernorm import (check_layer_norm_grad, check_layer_norm_inputs, layer_norm_backward,
                                    layer_norm_forward)

__all__ = ["ResidualNormCache", "check_residual_inputs", "residual_dropout_forward",
           "residual_dropout_layer_norm_forward", "residual_dropout_layer_norm_backward"]


class ResidualNormCache(NamedTuple):
    """The two ops' caches, in forward order."""

    drop: Any        # DropoutCache of dropout(branch)
    norm: Any        # LayerNormCache of y = LN(s)


def check_residual_inputs(x, branch) -> None:
    """The skip and the branch: float arrays of one shape and dtype (every implementation checks
    this first)."""
    expect_same_float(x=x, branch=branch)
    expect_shape(branch, "branch", x.shape, "(the shape of the skip input x)")


@dispatched
def residual_dropout_forward(x, branch, *, p: float = 0.0, rng=None, training: bool = True):
    """``s = x + dropout(branch)``; returns ``(s, DropoutCache)``. Its backward is the dropout op's:
    ``dx = ds`` (the skip) and ``dbranch = dropout_backward(ds, cache)``."""
    check_residual_inputs(x, branch)
    d, drop = dropout_term(branch, p, rng=rng, training=training)   # (..., C)
    return x + d, drop                                   # (..., C)


@dispatched
def residual_dropout_layer_norm_forward(x, branch, weight=None, bias=None, *, p: float = 0.0, rng=None,
                                        training: bool = True, eps: float = 1e-5):
    """``s = x + dropout(branch)``, ``y = LayerNorm(s)``; returns ``(s, y, ResidualNormCache)``."""
    check_residual_inputs(x, branch)
    check_layer_norm_inputs(x, weight, bias, eps)        # (s has x's shape and dtype)
    d, drop = dropout_term(branch, p, rng=rng, training=training)   # (..., C)
    s = x + d                                            # (..., C)
    y, norm = layer_norm_forward(s, weight, bias, eps)   # (..., C)
    return s, y, ResidualNormCache(drop, norm)


@dispatched
def residual_dropout_layer_norm_backward(ds, dy, cache: ResidualNormCache):
    """Returns ``(dx, dbranch, dweight, dbias)``; ``ds`` None when s had no other use (post-norm);
    None for an absent weight or bias."""
    if ds is not None:
        expect_grad(ds, "ds", cache.drop.x_shape, cache.drop.x_dtype)
    check_layer_norm_grad(dy, cache.norm)
    dsn, dweight, dbias = layer_norm_backward(dy, cache.norm)      # fwd: y = LN(s)
    dx = dsn if ds is None else ds + dsn                 # (..., C) fwd: s feeds y and (pre-norm) more
    dbranch = dropout_backward(dx, cache.drop)           # (..., C) fwd: s = x + dropout(branch)
    return dx, dbranch, dweight, dbias
