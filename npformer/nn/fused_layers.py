"""A fast path for the Transformer layers: each residual block as one fused op.

:class:`~npformer.nn.transformer.TransformerEncoderLayer` and ``TransformerDecoderLayer`` read like
the paper, a module per step (``x = norm1(x + dropout1(SA(x)))``). Where the residual ops have a
fused kernel (CuPy arrays with the fast paths on: :mod:`npformer.kernels`), the layer runs the same
lines through these functions instead, each ``norm(x + dropout(branch))`` one op
(:mod:`npformer.ops.residual`), so the dropout mask, the sum and the layer norm take one kernel and
one pass over memory, forward and backward::

    s = x + dropout(branch),  y = norm(s)     ->  residual_dropout_layer_norm_forward
    x + dropout(branch)                       ->  residual_dropout_forward (pre-norm's last sum)

The attention and feed-forward sub-layers are the layer's own modules in both paths, and the masks
come from the same dropout streams in the same order, so the two paths give the same model
(tests/nn/test_fused_layers.py: parity with the plain layers on every layout, forward, backward and
gradients). ``npformer.kernels.disabled()`` switches this path off with the kernels it stands for.
Each forward returns the caches of its residual ops, which the layer keeps for its backward.
"""
from __future__ import annotations

from npformer.dispatch import implementation
from npformer.ops.dropout import dropout_term_backward
from npformer.ops.residual import (residual_dropout_forward, residual_dropout_layer_norm_backward,
                                   residual_dropout_layer_norm_forward)

__all__ = ["takes_fused_blocks", "encoder_layer_forward", "encoder_layer_backward", "decoder_layer_forward",
           "decoder_layer_backward"]


def takes_fused_blocks(x) -> bool:
    """Whether a layer fed ``x`` runs here: where the fused residual + layer norm op would run a fast
    path (a kernel), not its reference."""
    return implementation(residual_dropout_layer_norm_forward, x, x) != "reference"


def _add_norm(skip, branch, drop, norm):
    """``s = skip + drop(branch)``, ``y = norm(s)``: ``(s, y, cache)`` from one op."""
    active = drop.training and drop.p > 0
    return residual_dropout_layer_norm_forward(
        skip, branch, None if norm.weight is None else norm.weight.data,
        None if norm.bias is None else norm.bias.data, eps=norm.eps, p=drop.p,
        rng=drop.generator(branch) if active else None, training=active)       # (B, T, C) x 2, cache


def _add_norm_backward(ds, dy, norm, cache):
    """``(dskip, dbranch)`` from the gradient of s (None when s had no other use) and of norm(s)."""
    # fwd: s = skip + drop(branch), y = norm(s)  ->  dskip = ds + norm'(dy),  dbranch = drop'(dskip)
    dskip, dbranch, dweight, dbias = residual_dropout_layer_norm_backward(ds, dy, cache)
    if norm.weight is not None:
        norm.weight.accumulate(dweight)
    if norm.bias is not None:
        norm.bias.accumulate(dbias)
    return dskip, dbranch                                                     # (B, T, C), (B, T, C)


def _add_dropout(skip, branch, drop):
    """``skip + drop(branch)``: ``(s, cache)`` from one op."""
    active = drop.training and drop.p > 0
    return residual_dropout_forward(skip, branch, p=drop.p, rng=drop.generator(branch) if active else None,
                                    training=active)                          # (B, T, C), cache


def encoder_layer_forward(layer, x, self_attention):
    """The encoder layer's forward; ``self_attention(h)`` is its SA sub-layer. ``(y, caches)``."""
    if layer.norm_first:
        # x1 = x + drop1(SA(norm1(x))), h = norm2(x1);  y = x1 + drop2(FF(h))
        x, h, c1 = _add_norm(x, self_attention(layer.norm1(x)), layer.dropout1, layer.norm2)
        y, c2 = _add_dropout(x, layer._feed_forward(h), layer.dropout2)
        return y, (c1, c2)
    # x1 = norm1(x + drop1(SA(x)));  y = norm2(x1 + drop2(FF(x1)))
    _, x, c1 = _add_norm(x, self_attention(x), layer.dropout1, layer.norm1)
    _, y, c2 = _add_norm(x, layer._feed_forward(x), layer.dropout2, layer.norm2)
    return y, (c1, c2)


def encoder_layer_backward(layer, dout, caches):
    """The encoder layer's backward from :func:`encoder_layer_forward`'s caches; returns ``dsrc``."""
    c1, c2 = caches
    if layer.norm_first:
        # fwd: y = x1 + drop2(FF(h))  ->  dx1 = dy (the skip),  dh = FF'(drop2'(dy))
        dh = layer._feed_forward_backward(dropout_term_backward(dout, c2))
        # fwd: x1 = x + drop1(a), h = norm2(x1)  ->  dx1 += norm2'(dh),  da = drop1'(dx1)
        dx1, da = _add_norm_backward(dout, dh, layer.norm2, c1)
        # fwd: a = SA(norm1(x))  ->  dx = dx1 + norm1'(SA'(da))
        return dx1 + layer.norm1.backward(layer.self_attn.backward(da)[0])
    # fwd: y = norm2(x1 + drop2(FF(x1)))  ->  d = norm2'(dy);  dx1 = d + FF'(drop2'(d))
    d, dbranch = _add_norm_backward(None, dout, layer.norm2, c2)
    dx1 = d + layer._feed_forward_backward(dbranch)
    # fwd: x1 = norm1(x + drop1(SA(x)))  ->  d = norm1'(dx1);  dx = d + SA'(drop1'(d))
    d, dbranch = _add_norm_backward(None, dx1, layer.norm1, c1)
    return d + layer.self_attn.backward(dbranch)[0]                           # SA' sums all three paths


def decoder_layer_forward(layer, x, self_attention, cross_attention):
    """The decoder layer's forward; ``self_attention(h)`` and ``cross_attention(h)`` (over the memory)
    are its two attention sub-layers. ``(y, caches)``."""
    if layer.norm_first:
        # x1 = x + drop1(SA(norm1(x))), h = norm2(x1);  x2 = x1 + drop2(MHA(h, memory)), h = norm3(x2)
        x, h, c1 = _add_norm(x, self_attention(layer.norm1(x)), layer.dropout1, layer.norm2)
        x, h, c2 = _add_norm(x, cross_attention(h), layer.dropout2, layer.norm3)
        y, c3 = _add_dropout(x, layer._feed_forward(h), layer.dropout3)        # y = x2 + drop3(FF(h))
        return y, (c1, c2, c3)
    # x1 = norm1(x + drop1(SA(x)));  x2 = norm2(x1 + drop2(MHA(x1, memory)));  y = norm3(x2 + drop3(FF(x2)))
    _, x, c1 = _add_norm(x, self_attention(x), layer.dropout1, layer.norm1)
    _, x, c2 = _add_norm(x, cross_attention(x), layer.dropout2, layer.norm2)
    _, y, c3 = _add_norm(x, layer._feed_forward(x), layer.dropout3, layer.norm3)
    return y, (c1, c2, c3)


def decoder_layer_backward(layer, dout, caches):
    """The decoder layer's backward from :func:`decoder_layer_forward`'s caches; ``(dtgt, dmemory)``."""
    c1, c2, c3 = caches
    if layer.norm_first:
        # fwd: y = x2 + drop3(FF(h3))  ->  dx2 = dy (the skip),  dh3 = FF'(drop3'(dy))
        dh = layer._feed_forward_backward(dropout_term_backward(dout, c3))
        # fwd: x2 = x1 + drop2(a), h3 = norm3(x2)  ->  dx2 += norm3'(dh3),  da = drop2'(dx2)
        dx2, da = _add_norm_backward(dout, dh, layer.norm3, c2)
        # fwd: a = MHA(h2, memory)  ->  dh2 = dquery,  dmemory
        dh, dmem = layer._cross_attention_backward(da)
        # fwd: x1 = x + drop1(a), h2 = norm2(x1)  ->  dx1 = dx2 + norm2'(dh2),  da = drop1'(dx1)
        dx1, da = _add_norm_backward(dx2, dh, layer.norm2, c1)
        # fwd: a = SA(norm1(x))  ->  dx = dx1 + norm1'(SA'(da))
        return dx1 + layer.norm1.backward(layer.self_attn.backward(da)[0]), dmem
    # fwd: y = norm3(x2 + drop3(FF(x2)))  ->  d = norm3'(dy);  dx2 = d + FF'(drop3'(d))
    d, dbranch = _add_norm_backward(None, dout, layer.norm3, c3)
    dx2 = d + layer._feed_forward_backward(dbranch)
    # fwd: x2 = norm2(x1 + drop2(MHA(x1, memory)))  ->  d = norm2'(dx2);  dx1 = d + dquery,  dmemory
    d, dbranch = _add_norm_backward(None, dx2, layer.norm2, c2)
    dq, dmem = layer._cross_attention_backward(dbranch)
    # fwd: x1 = norm1(x + drop1(SA(x)))  ->  d = norm1'(dx1);  dx = d + SA'(drop1'(d))
    d, dbranch = _add_norm_backward(None, d + dq, layer.norm1, c1)
    return d + layer.self_attn.backward(dbranch)[0], dmem
