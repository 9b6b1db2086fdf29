"""Inverted dropout, as ``torch.nn.functional.dropout``.

    training:   out = x * m / (1 - p),   m_i ~ Bernoulli(1 - p) drawn from the backend's Generator
    eval:       out = x
    dx = dout * m / (1 - p)

The mask comes from the ``rng`` passed in (``npformer.backend.default_rng(seed, backend)``), so a
fixed seed gives a fixed mask: m = [u >= p] with u = ``rng.random(shape, dtype=float32)``.
``p = 1`` drops everything (output and gradient are zero).

Drawing the uniforms is most of the cost. For NumPy's default bit generator (PCG64) the same mask is
made from the raw 64-bit draws: NumPy builds a float32 uniform as (b >> 8) * 2^-24 from each
32-bit half b of a draw (low half first), so u >= p exactly when b >= ceil(p * 2^24) * 2^8; one
integer comparison skips the float conversion (about 1.5x faster). The generator ends in the same
state, and a test checks the masks are identical.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy

from npformer.backend import get_array_module
from npformer.ops import fused
from npformer.ops.checks import expect_float

__all__ = ["DropoutCache", "dropout_forward", "dropout_backward"]


class DropoutCache(NamedTuple):
    """The scaled keep-mask m / (1 - p) in the input's dtype, or None when dropout was the identity."""

    scaled_mask: Any    # (same shape as x) or None


def dropout_active(x, p, rng, training) -> bool:
    """Whether the forward drops anything (training and p > 0), after checking its inputs (shared
    with the fused CuPy kernel)."""
    expect_float(x, "x")
    if not 0.0 <= float(p) <= 1.0:
        raise ValueError(f"dropout probability p must be in [0, 1], got {p!r}")
    if not training or p == 0.0:
        return False
    if rng is None:
        raise ValueError("dropout with p > 0 in training mode needs rng, a backend Generator "
                         "(npformer.backend.default_rng(seed, backend))")
    return True


def dropout_forward(x, p: float, rng=None, training: bool = True):
    """Returns ``(out, cache)``; ``rng`` is required when ``training`` and ``p > 0``."""
    if fused.use_fused(x):                               # CuPy: compare, scale, multiply in one kernel
        return fused.dropout_forward(x, p, rng=rng, training=training)
    if not dropout_active(x, p, rng, training):
        return x.copy(), DropoutCache(None)
    xp = get_array_module(x)
    if p == 1.0:
        scaled = xp.zeros_like(x)                        # (same as x)
    else:
        keep = _keep_mask(rng, x.shape, p, xp)           # (same as x) 1.0 / 0.0, float32
        get_array_module(x, keep)  # a NumPy Generator with CuPy data (or the reverse) raises here
        scaled = keep.astype(x.dtype, copy=False)        # (same as x)
        scaled *= 1.0 / (1.0 - p)
    return x * scaled, DropoutCache(scaled)


def _keep_mask(rng, shape, p, xp):
    """float32 [u >= p], u = rng.random(shape, dtype=float32), as 1.0 / 0.0 (see the module docstring)."""
    size = math.prod(shape)
    bitgen = getattr(rng, "bit_generator", None)
    if xp is not numpy or type(bitgen) is not numpy.random.PCG64 or size % 2 or bitgen.state["has_uint32"]:
        u = rng.random(shape, dtype=xp.float32)          # uniform [0, 1)
        return xp.greater_equal(u, p, out=u)             # 1.0 / 0.0 in the same buffer
    # u = (b >> 8) 2^-24 >= float32(p)  <=>  b >= ceil(float32(p) 2^24) 2^8, b a 32-bit half of a draw
    threshold = numpy.uint32(math.ceil(float(numpy.float32(p)) * 2.0 ** 24) << 8)
    keep = numpy.empty(size, dtype=numpy.float32)
    step = 1 << 16                                       # draws in blocks: no full-size temporary
    for i in range(0, size, step):
        halves = bitgen.random_raw(min(step, size - i) // 2).view(numpy.uint32)
        numpy.greater_equal(halves, threshold, out=keep[i:i + halves.size])
    return keep.reshape(shape)


def dropout_backward(dout, cache: DropoutCache):
    """``dx = dout * m / (1 - p)`` (a copy of dout when dropout was the identity)."""
    # fwd: out = x * m / (1 - p)  ->  dx = dout * m / (1 - p)
    if cache.scaled_mask is None:
        return dout.copy()
    return dout * cache.scaled_mask
