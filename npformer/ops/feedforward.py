"""Position-wise feed-forward network (Vaswani et al. 2017, eq. 2), in PyTorch's layer order:

    h = x W1^T + b1;   a = act(h);   a' = dropout(a);   out = a' W2^T + b2
    x: (..., C), W1: (F, C), W2: (C, F);  act in {relu, gelu (erf), gelu_tanh}

The backward runs the same four ops in reverse, each with its own op's backward.
"""
from __future__ import annotations

from typing import Any, NamedTuple

from npformer.checks import one_of
from npformer.dispatch import dispatched
from npformer.errors import ShapeError
from npformer.ops.activations import gelu_backward, gelu_forward, relu_backward, relu_forward
from npformer.ops.dropout import dropout_term, dropout_term_backward
from npformer.ops.linear import linear_backward, linear_forward

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


def feed_forward_activation(w1, w2, activation: str):
    """The ``ACTIVATIONS`` entry of ``activation``, after checking it and that w2 is (C, F) for w1
    (F, C) (every implementation of the forward calls this first)."""
    entry = ACTIVATIONS[one_of(activation, "activation", tuple(ACTIVATIONS))]
    if w2.ndim == 2 and w1.ndim == 2 and w2.shape != (w1.shape[1], w1.shape[0]):
        raise ShapeError(f"w2: expected shape (C, F)=({w1.shape[1]}, {w1.shape[0]}) to match w1 (F, C)="
                         f"{tuple(w1.shape)}, got {tuple(w2.shape)}")
    return entry


@dispatched
def feed_forward_forward(x, w1, b1, w2, b2, *, activation: str = "relu", dropout_p: float = 0.0,
                         rng=None, training: bool = True):
    """Returns ``(out, cache)``; ``b1``/``b2`` may be None (bias=False)."""
    act_fwd, act_kw, act_bwd = feed_forward_activation(w1, w2, activation)
    h, lin1 = linear_forward(x, w1, b1)                  # (..., F)
    a, act = act_fwd(h, **act_kw)                        # (..., F)
    a, drop = dropout_term(a, dropout_p, rng=rng, training=training)
    out, lin2 = linear_forward(a, w2, b2)                # (..., C)
    return out, FeedForwardCache(lin1, act, act_bwd, drop, lin2)


@dispatched
def feed_forward_backward(dout, cache: FeedForwardCache):
    """Returns ``(dx, dw1, db1, dw2, db2)``; the bias gradients are None where the forward had none."""
    da, dw2, db2 = linear_backward(dout, cache.lin2)     # fwd: out = a' W2^T + b2
    da = dropout_term_backward(da, cache.drop)           # fwd: a' = dropout(a)
    dh = cache.act_backward(da, cache.act)               # fwd: a = act(h)
    dx, dw1, db1 = linear_backward(dh, cache.lin1)       # fwd: h = x W1^T + b1
    return dx, dw1, db1, dw2, db2
