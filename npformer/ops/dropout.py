"""Inverted dropout, as ``torch.nn.functional.dropout``.

    training:   out = x * m / (1 - p),   m_i ~ Bernoulli(1 - p) drawn from the backend's Generator
    eval:       out = x
    dx = dout * m / (1 - p)

The mask comes from the ``rng`` passed in (``npformer.backend.default_rng(seed, backend)``), so a
fixed seed gives a fixed mask. ``p = 1`` drops everything (output and gradient are zero).
"""
from __future__ import annotations

from typing import Any, NamedTuple

from npformer.backend import get_array_module
from npformer.ops.checks import expect_float

__all__ = ["DropoutCache", "dropout_forward", "dropout_backward"]


class DropoutCache(NamedTuple):
    """The scaled keep-mask m / (1 - p) in the input's dtype, or None when dropout was the identity."""

    scaled_mask: Any    # (same shape as x) or None


def dropout_forward(x, p: float, rng=None, training: bool = True):
    """Returns ``(out, cache)``; ``rng`` is required when ``training`` and ``p > 0``."""
    expect_float(x, "x")
    if not 0.0 <= float(p) <= 1.0:
        raise ValueError(f"dropout probability p must be in [0, 1], got {p!r}")
    if not training or p == 0.0:
        return x.copy(), DropoutCache(None)
    if rng is None:
        raise ValueError("dropout with p > 0 in training mode needs rng, a backend Generator "
                         "(npformer.backend.default_rng(seed, backend))")
    xp = get_array_module(x)
    if p == 1.0:
        scaled = xp.zeros_like(x)                        # (same as x)
    else:
        u = rng.random(x.shape, dtype=xp.float32)        # (same as x) uniform [0, 1)
        get_array_module(x, u)  # a NumPy Generator with CuPy data (or the reverse) raises here
        xp.greater_equal(u, p, out=u)                    # keep-mask as 1.0 / 0.0, in the same buffer
        scaled = u.astype(x.dtype, copy=False)           # (same as x)
        scaled *= 1.0 / (1.0 - p)
    return x * scaled, DropoutCache(scaled)


def dropout_backward(dout, cache: DropoutCache):
    """``dx = dout * m / (1 - p)`` (a copy of dout when dropout was the identity)."""
    # fwd: out = x * m / (1 - p)  ->  dx = dout * m / (1 - p)
    if cache.scaled_mask is None:
        return dout.copy()
    return dout * cache.scaled_mask
