"""Dropout's mask for NumPy's default bit generator (PCG64) from its raw bits (reference:
:mod:`npformer.ops.dropout`).

Drawing the float32 uniforms is most of dropout's cost. NumPy builds a float32 uniform as
(b >> 8) * 2^-24 from each 32-bit half b of a 64-bit draw (low half first), so u >= p exactly when
b >= ceil(p * 2^24) * 2^8: one integer comparison per element skips the float conversion (about
1.5x faster). The mask is the reference's bit for bit and the generator ends in the same state
(tested). Other generators, odd sizes, or a PCG64 holding a spare 32-bit half run the reference.
"""
from __future__ import annotations

import math

import numpy

from npformer.kernels.cpu import numpy_floats
from npformer.ops.dropout import DropoutCache, dropout_active

__all__ = ["accepts", "dropout_forward"]

_STEP = 1 << 16              # draws per block: no full-size temporary


def accepts(x, p=0.0, rng=None, training=True) -> bool:
    """A NumPy float array, with a PCG64 generator whose next draws this path reproduces."""
    bitgen = getattr(rng, "bit_generator", None)
    return (numpy_floats(x) and type(bitgen) is numpy.random.PCG64 and x.size % 2 == 0
            and not bitgen.state["has_uint32"])


def dropout_forward(x, p: float, rng=None, training: bool = True):
    if not dropout_active(x, p, rng, training):
        return x.copy(), DropoutCache(None, x.shape, x.dtype)
    if p == 1.0:
        scaled = numpy.zeros_like(x)                     # (same as x)
        return x * scaled, DropoutCache(scaled, x.shape, x.dtype)
    # u = (b >> 8) 2^-24 >= float32(p)  <=>  b >= ceil(float32(p) 2^24) 2^8, b a 32-bit half of a draw
    threshold = numpy.uint32(math.ceil(float(numpy.float32(p)) * 2.0 ** 24) << 8)
    keep = numpy.empty(x.size, dtype=x.dtype)            # (N,)
    for i in range(0, x.size, _STEP):
        halves = rng.bit_generator.random_raw(min(_STEP, x.size - i) // 2).view(numpy.uint32)
        numpy.greater_equal(halves, threshold, out=keep[i:i + halves.size])
    scaled = keep.reshape(x.shape)                       # (same as x)
    scaled *= x.dtype.type(1.0 / (1.0 - p))              # m / (1 - p)
    return x * scaled, DropoutCache(scaled, x.shape, x.dtype)
