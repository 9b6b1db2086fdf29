"""Fused inverted dropout forward (reference: :mod:`npformer.ops.dropout`).

    u ~ U[0, 1) from the Generator passed in, drawn exactly as the plain op draws it
    m = [u >= p] / (1 - p)  (1 / (1 - p) rounded to x's dtype),   out = x m

so one seed gives the plain op's mask bit for bit; the compare, scale and multiply are one kernel
that writes ``out`` and the cached scaled mask. The backward is the plain op's
``dout * scaled_mask``, a single CuPy kernel already, so it has no fused twin.
"""
from __future__ import annotations

import numpy

from npformer.backend import accumulation_dtype, get_array_module
from npformer.kernels.cuda.runtime import contiguous, device_xp, launch_elements
from npformer.ops.dropout import DropoutCache, dropout_active

__all__ = ["dropout_forward", "keep_draws"]


def keep_draws(x, p: float, rng):
    """What a fused kernel needs to drop exactly the entries the reference drops for ``x`` (0 < p < 1):
    the same uniforms ``u = rng.random(x.shape, float32)`` (contiguous, (same as x)) and the keep
    scale ``1 / (1 - p)`` rounded to x's dtype, as a scalar of the accumulation type."""
    xp = device_xp(x)
    u = rng.random(x.shape, dtype=xp.float32)            # (same as x)
    get_array_module(x, u)  # a NumPy Generator with CuPy data (or the reverse) raises here
    return contiguous(xp, u), accumulation_dtype(x.dtype).type(x.dtype.type(1.0 / (1.0 - p)))


def dropout_forward(x, p: float, rng=None, training: bool = True):
    """Returns ``(out, DropoutCache(scaled_mask, x_shape, x_dtype))``; ``rng`` is required when training with p > 0."""
    if not dropout_active(x, p, rng, training):
        return x.copy(), DropoutCache(None, x.shape, x.dtype)
    xp = device_xp(x)
    if p == 1.0:
        scaled = xp.zeros_like(x)                        # (same as x)
        return x * scaled, DropoutCache(scaled, x.shape, x.dtype)
    u, scale = keep_draws(x, p, rng)
    x = contiguous(xp, x)
    out = xp.empty(x.shape, dtype=x.dtype)               # (same as x)
    scaled = xp.empty(x.shape, dtype=x.dtype)            # (same as x)
    if x.size:
        # out = x * [u >= p] / (1 - p), the mask kept for the backward
        launch_elements("dropout_fwd", x.dtype, x.size,
                        (x, u, out, scaled, numpy.int64(x.size), numpy.float32(p), scale))
    return out, DropoutCache(scaled, x.shape, x.dtype)
