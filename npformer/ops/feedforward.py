"""Position-wise feed-forward network (Vaswani et al. 2017, eq. 2), in PyTorch's layer order:

    h = x W1^T + b1;   a = act(h);   a' = dropout(a);   out = a' W2^T + b2
    x: (..., C), W1: (F, C), W2: (C, F);  act in {relu, gelu (erf), gelu_tanh}

The backward runs the same four ops in reverse, each with its own op's backward.
"""
from __future__ import annotations

from typing import Any, NamedTuple

from npformer.checks import expect_ndim, expect_same_float, expect_shape, one_of
from npformer.dispatch import dispatched
from npformer.errors import ShapeError
from npformer.ops.activations import gelu_backward, gelu_forward, relu_backward, relu_forward
from npformer.ops.dropout import dropout_term, dropout_term_backward
from npformer.ops.linear import check_linear_grad, check_linear_inputs, linear_backward, linear_forward

__all__ = ["FeedForwardCache", "feed_forward_activation", "feed_forward_forward", "feed_forward_backward",
           "ACTIVATIONS"]

ACTIVATIONS = {"relu": (relu_forward, {}, relu_backward),
               "gelu": (gelu_forward, {"approximate": "none"}, gelu_backward),
               "gelu_tanh": (gelu_forward, {"approximate": "tanh"}, gelu_backward)}


class FeedForwardCache(NamedTuple):
    """The four ops' caches, in forward order, and the activation's backward."""

    lin1: Any          # LinearCache of h = x W1^T + b1
    act: Any           # ReluCache or GeluCache of a = act(h)
    act_backward: Any
    drop: Any          # DropoutCache of a' = dropout(a)
    lin2: Any          # LinearCache of out = a' W2^T + b2


def feed_forward_activation(x, w1, b1, w2, b2, activation: str):
    """The ``ACTIVATIONS`` entry of ``activation``, after checking it and the arrays: x, w1 (F, C), b1
    (F,) as a linear's inputs, w2 (C, F) and b2 (C,) to match (every implementation of the forward
    calls this first)."""
    entry = ACTIVATIONS[one_of(activation, "activation", tuple(ACTIVATIONS))]
    check_linear_inputs(x, w1, b1)
    expect_same_float(x=x, w2=w2, b2=b2)
    expect_ndim(w2, "w2", 2, "(C, F)")
    f, c = w1.shape
    if w2.shape != (c, f):
        raise ShapeError(f"w2: expected shape (C, F)=({c}, {f}) to match w1 (F, C)={tuple(w1.shape)}, got "
                         f"{tuple(w2.shape)}")
    if b2 is not None:
        expect_shape(b2, "b2", (c,), "(C,)")
    return entry


@dispatched
def feed_forward_forward(x, w1, b1, w2, b2, *, activation: str = "relu", dropout_p: float = 0.0,
                         rng=None, training: bool = True):
    """Returns ``(out, cache)``; ``b1``/``b2`` may be None (bias=False)."""
    act_fwd, act_kw, act_bwd = feed_forward_activation(x, w1, b1, w2, b2, activation)
    h, lin1 = linear_forward(x, w1, b1)                  # (..., F)
    a, act = act_fwd(h, **act_kw)                        # (..., F)
    a, drop = dropout_term(a, dropout_p, rng=rng, training=training)
    out, lin2 = linear_forward(a, w2, b2)                # (..., C)
    return out, FeedForwardCache(lin1, act, act_bwd, drop, lin2)


@dispatched
def feed_forward_backward(dout, cache: FeedForwardCache):
    """Returns ``(dx, dw1, db1, dw2, db2)``; the bias gradients are None where the forward had none."""
    check_linear_grad(dout, cache.lin2)                  # dout: the gradient of the second linear's output
    da, dw2, db2 = linear_backward(dout, cache.lin2)     # fwd: out = a' W2^T + b2
    da = dropout_term_backward(da, cache.drop)           # fwd: a' = dropout(a)
    dh = cache.act_backward(da, cache.act)               # fwd: a = act(h)
    dx, dw1, db1 = linear_backward(dh, cache.lin1)       # fwd: h = x W1^T + b1
    return dx, dw1, db1, dw2, db2
