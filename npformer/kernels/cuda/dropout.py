"""Fused inverted dropout, forward and backward (reference: :mod:`npformer.ops.dropout`).

    seed: made of two float64 uniforms drawn from the Generator passed in, as the plain op makes it
          (drawn on the GPU, one launch; the kernel makes the seed of them: npf_seed)
    keep_n = splitmix64(seed + n golden) >> 40 >= keep_threshold(p)   (npf_keep, for element n)
    m = keep / (1 - p)  (1 / (1 - p) in the accumulation type A),   out = x m, rounded to x's dtype
    dx = dout m

so one seed gives the plain op's mask bit for bit. Each thread hashes its own elements' indices,
so no array of uniforms is drawn into memory and read back: the forward is one kernel that reads x
and writes ``out`` and the cached boolean mask (one byte an entry), and the backward one kernel
where the plain op's ``dout * keep * scale`` runs two.

This op stores its mask, as the plain op does, because the plain attention reads the mask of its
weights' dropout itself. The fused kernels whose backward is a kernel too (bias + GELU + dropout,
residual + dropout (+ layer norm)) store none: their caches keep the seed's draws
(``DropoutCache.of_seed``) and the backward kernels hash each bit again where they use it, one
splitmix64 an element against a byte written and read back (:func:`keep_arguments` gives a backward
kernel either form).
"""
from __future__ import annotations

import numpy

from npformer.backend import accumulation_dtype
from npformer.checks import expect_grad
from npformer.kernels.cuda.runtime import contiguous, device_xp, launch_elements
from npformer.kernels.cuda.source import DROP_FLAGS
from npformer.ops.dropout import DropoutCache, dropout_active, keep_scale, keep_scaled, keep_threshold, seed_draws

__all__ = ["dropout_forward", "dropout_backward", "keep_draws", "no_keep_draws", "keep_arguments", "DROP_NONE",
           "DROP_STORED", "DROP_HASHED"]

# a backward kernel's flag drop: where it finds the keep bits (prelude.cuh's NPF_DROP_*)
DROP_NONE, DROP_STORED, DROP_HASHED = (numpy.int32(DROP_FLAGS[name]) for name in ("DROP_NONE", "DROP_STORED",
                                                                                  "DROP_HASHED"))


def keep_draws(x, p: float, rng) -> tuple:
    """What a fused kernel needs to drop exactly the entries the reference drops for ``x`` (0 < p < 1):
    ``(draws, keep_min, scale)``: the two float64 uniforms the reference makes its seed of, drawn from
    ``rng`` on the GPU (the kernel makes the seed: no value goes to the host, and the draw is the one
    launch besides the kernel's), ``keep_threshold(p)`` as an int32, and ``1 / (1 - p)`` as a scalar
    of the accumulation type (:func:`~npformer.ops.dropout.keep_scale`)."""
    return seed_draws(rng, x, device_xp(x)), numpy.int32(keep_threshold(p)), keep_scale(p, x.dtype)


def no_keep_draws(xp, dtype) -> tuple:
    """:func:`keep_draws`'s stand-ins for a kernel that drops nothing (its flag ``drop`` 0): draws
    never read, 0 and 1."""
    return xp.empty((2,), dtype=xp.float64), numpy.int32(0), accumulation_dtype(dtype).type(1)


def keep_arguments(xp, cache: DropoutCache, dtype) -> tuple:
    """What a backward kernel takes of a dropout's cache: ``(keep, draws, keep_min, scale, drop)``.
    A stored mask: the booleans (contiguous), draws never read, 0, the scale as a scalar of the
    accumulation type and :data:`DROP_STORED`; a mask kept as its seed: a stand-in for the booleans,
    the draws, ``keep_threshold(p)``, the scale and :data:`DROP_HASHED`; the identity: stand-ins, 1 and
    :data:`DROP_NONE`."""
    acc = accumulation_dtype(dtype)
    unread_keep = xp.empty((1,), dtype=bool)
    if not cache.dropped:
        return (unread_keep, *no_keep_draws(xp, dtype)[:2], acc.type(1), DROP_NONE)
    if cache.keep is not None:
        return (contiguous(xp, cache.keep), no_keep_draws(xp, dtype)[0], numpy.int32(0), acc.type(cache.scale),
                DROP_STORED)
    return (unread_keep, contiguous(xp, cache.draws), numpy.int32(keep_threshold(cache.p)), acc.type(cache.scale),
            DROP_HASHED)


def dropout_forward(x, p: float, rng=None, training: bool = True):
    """Returns ``(out, DropoutCache(keep, scale, x_shape, x_dtype))``; ``rng`` is required when
    training with p > 0."""
    if not dropout_active(x, p, rng, training):
        return x.copy(), DropoutCache.identity(x)
    xp = device_xp(x)
    if p == 1.0:
        keep, scale = xp.zeros(x.shape, dtype=bool), keep_scale(p, x.dtype)   # (same as x)
        return keep_scaled(x, keep, scale), DropoutCache(keep, scale, x.shape, x.dtype)
    draws, keep_min, scale = keep_draws(x, p, rng)
    x = contiguous(xp, x)
    out = xp.empty(x.shape, dtype=x.dtype)               # (same as x)
    keep = xp.empty(x.shape, dtype=bool)                 # (same as x)
    if x.size:
        # out = x * m / (1 - p), the mask made in the kernel and kept for the backward
        launch_elements("dropout_fwd", x.dtype, x.size,
                        (x, draws, out, keep, numpy.int64(x.size), keep_min, scale))
    return out, DropoutCache(keep, keep_scale(p, x.dtype), x.shape, x.dtype)


def dropout_backward(dout, cache: DropoutCache):
    """``dx = dout * keep * scale`` in one kernel (a copy of dout when dropout was the identity)."""
    expect_grad(dout, "dout", cache.x_shape, cache.x_dtype)
    if not cache.dropped:
        return dout.copy()
    xp = device_xp(dout)
    dout = contiguous(xp, dout)
    keep, draws, keep_min, scale, drop = keep_arguments(xp, cache, dout.dtype)
    dx = xp.empty(dout.shape, dtype=dout.dtype)          # (same as x)
    if dout.size:
        # fwd: out = x * m / (1 - p)  ->  dx = dout * m / (1 - p), m stored or hashed again
        launch_elements("dropout_bwd", dout.dtype, dout.size,
                        (dout, keep, draws, dx, numpy.int64(dout.size), keep_min, scale, drop))
    return dx
