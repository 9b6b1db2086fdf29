"""The feed-forward block with its first bias, GELU and dropout fused (reference:
:mod:`npformer.ops.feedforward`, GELU activations with a first bias).

    z = x W1^T  (a plain matmul: the bias goes into the next kernel)
    h = z + b1,  a = dropout(gelu(h))          one kernel (the dropout op's mask for one seed)
    out = a W2^T + b2                          the plain linear op
    backward:  da = linear2'(dout);  dh = (da m / (1 - p)) gelu'(h) and db1 = sum dh in one kernel;
               dx, dW1 = the plain products of linear1's backward

The cache is the reference's (``LinearCache`` of h = x W1^T + b1, ``GeluCache(h)``, the dropout
mask, ``LinearCache`` of the output), so either backward takes either forward's cache.
"""
from __future__ import annotations

from npformer.kernels.cuda.activations import bias_gelu_dropout_backward, bias_gelu_dropout_forward
from npformer.kernels.cuda.runtime import device_floats
from npformer.ops.activations import GeluCache
from npformer.ops.feedforward import FeedForwardCache, feed_forward_activation
from npformer.ops.linear import check_linear_grad, linear_backward, linear_forward

__all__ = ["accepts_forward", "accepts_backward", "feed_forward_forward", "feed_forward_backward"]


def accepts_forward(x, w1, b1, w2, b2, activation) -> bool:
    """GELU (either form) after a first linear with a bias, on CuPy float arrays of one dtype (the
    feed-forward op's arguments of those names)."""
    return activation in ("gelu", "gelu_tanh") and b1 is not None and device_floats(x, w1, b1, w2, b2)


def accepts_backward(dout, cache) -> bool:
    """A cache of a GELU block whose first linear had a bias."""
    return (isinstance(cache, FeedForwardCache) and isinstance(cache.act, GeluCache) and cache.lin1.has_bias
            and device_floats(dout, cache.act.x))


def feed_forward_forward(x, w1, b1, w2, b2, *, activation: str = "relu", dropout_p: float = 0.0,
                         rng=None, training: bool = True):
    """Returns ``(out, FeedForwardCache)``, the reference's cache."""
    _, act_kw, act_bwd = feed_forward_activation(x, w1, b1, w2, b2, activation)
    z, lin1 = linear_forward(x, w1)                      # (..., F) x W1^T
    # h = z + b1, a = dropout(gelu(h)): one kernel
    a, act, drop = bias_gelu_dropout_forward(z, b1, act_kw["approximate"], dropout_p, rng, training)
    out, lin2 = linear_forward(a, w2, b2)                # (..., C)
    return out, FeedForwardCache(lin1._replace(has_bias=True), act, act_bwd, drop, lin2)


def feed_forward_backward(dout, cache):
    """Returns ``(dx, dw1, db1, dw2, db2)``."""
    check_linear_grad(dout, cache.lin2)                  # dout: the gradient of the second linear's output
    da, dw2, db2 = linear_backward(dout, cache.lin2)     # fwd: out = a' W2^T + b2
    # fwd: a' = dropout(gelu(h)), h = z + b1  ->  dh = da m / (1 - p) gelu'(h),  db1 = sum dh: one kernel
    dh, db1 = bias_gelu_dropout_backward(da, cache.act, cache.drop)
    dx, dw1, _ = linear_backward(dh, cache.lin1._replace(has_bias=False))   # fwd: z = x W1^T
    return dx, dw1, db1, dw2, db2
