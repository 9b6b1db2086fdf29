"""Inverted dropout, as ``torch.nn.functional.dropout``.

    training:   out = x * m / (1 - p),   m_i = [u_i >= p],  u_i ~ U[0, 1) from the Generator passed in
    eval:       out = x
    dx = dout * m / (1 - p)

The mask comes from the ``rng`` passed in (``npformer.backend.default_rng(seed, backend)``; a model
owns one, :meth:`npformer.nn.Module.manual_seed`), so a fixed seed gives a fixed mask:
u = ``rng.random(x.shape, dtype=float32)``, drawn in one call. Every implementation draws exactly
these uniforms, so the masks agree element by element. ``p = 1`` drops everything (output and
gradient are zero).
"""
from __future__ import annotations

from typing import Any, NamedTuple

from npformer.backend import get_array_module
from npformer.checks import expect_float, expect_grad, probability
from npformer.dispatch import dispatched
from npformer.errors import RangeError

__all__ = ["DropoutCache", "dropout_active", "keep_scale", "dropout_mask", "dropout_forward", "dropout_term",
           "dropout_backward", "dropout_term_backward"]


class DropoutCache(NamedTuple):
    """The keep-mask m as booleans (one byte an entry, a quarter of a float32 mask) and the scale
    1 / (1 - p) as a scalar of the input's dtype (0 for p = 1, where nothing is kept), or None for
    both when dropout was the identity; the input's shape and dtype (what the backward's ``dout``
    must have). ``out = x * keep * scale`` and ``dx = dout * keep * scale``."""

    keep: Any           # bool (same shape as x) or None
    scale: Any          # x's dtype scalar 1 / (1 - p), or None
    x_shape: tuple
    x_dtype: Any

    @classmethod
    def identity(cls, x) -> "DropoutCache":
        """The cache of a dropout that dropped nothing (eval mode or p = 0)."""
        return cls(None, None, x.shape, x.dtype)


def dropout_active(x, p, rng, training) -> bool:
    """Whether the forward drops anything (training and p > 0), after checking its inputs (every
    implementation of the forward calls this first)."""
    expect_float(x, "x")
    p = probability(p, "dropout probability p")
    if not training or p == 0.0:
        return False
    if rng is None:
        raise RangeError("dropout with p > 0 in training mode needs rng, a backend Generator "
                         "(npformer.backend.default_rng(seed, backend), or a module's generator)")
    return True


def keep_scale(p: float, dtype):
    """1 / (1 - p) rounded to ``dtype``, the factor kept entries are scaled by (0 for p = 1)."""
    return dtype.type(0.0 if p == 1.0 else 1.0 / (1.0 - p))


def dropout_mask(x, p: float, rng):
    """``(keep, scale)`` for ``x``: the keep-mask m = [u >= p] as booleans of x's shape, from
    ``rng``'s next uniforms (all False for p = 1, drawing nothing), and :func:`keep_scale`."""
    xp = get_array_module(x)
    if p == 1.0:
        return xp.zeros(x.shape, dtype=bool), keep_scale(p, x.dtype)   # (same as x)
    u = rng.random(x.shape, dtype=xp.float32)            # (same as x) uniform [0, 1)
    get_array_module(x, u)  # a NumPy Generator with CuPy data (or the reverse) raises here
    return xp.asarray(u >= p), keep_scale(p, x.dtype)    # (same as x) m (an array for 0-d x too)


@dispatched
def dropout_forward(x, p: float, rng=None, training: bool = True):
    """Returns ``(out, cache)``; ``rng`` is required when ``training`` and ``p > 0``."""
    if not dropout_active(x, p, rng, training):
        return x.copy(), DropoutCache.identity(x)
    keep, scale = dropout_mask(x, p, rng)                # (same as x), scalar
    return x * keep * scale, DropoutCache(keep, scale, x.shape, x.dtype)


def dropout_term(x, p: float, rng=None, training: bool = True):
    """``dropout(x)`` as a term that an op only reads (``x + dropout(b)``, the input of a product):
    ``(x, identity cache)`` with no copy when dropout drops nothing, else :func:`dropout_forward`'s
    result. (The op itself returns a fresh array, as every op does; a term need not be one.)"""
    if not dropout_active(x, p, rng, training):
        return x, DropoutCache.identity(x)
    return dropout_forward(x, p, rng=rng, training=training)     # (which checks its inputs itself)


@dispatched
def dropout_backward(dout, cache: DropoutCache):
    """``dx = dout * m / (1 - p)`` (a copy of dout when dropout was the identity)."""
    expect_grad(dout, "dout", cache.x_shape, cache.x_dtype)
    # fwd: out = x * m / (1 - p)  ->  dx = dout * m / (1 - p)
    if cache.keep is None:
        return dout.copy()
    return dout * cache.keep * cache.scale


def dropout_term_backward(dout, cache: DropoutCache):
    """The gradient of a :func:`dropout_term`, which the op's backward only reads: ``dout`` itself (no
    copy) when the dropout was the identity, else :func:`dropout_backward`'s result."""
    if cache.keep is None:
        expect_grad(dout, "dout", cache.x_shape, cache.x_dtype)
        return dout
    return dropout_backward(dout, cache)
