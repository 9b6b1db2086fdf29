"""Inverted dropout, as ``torch.nn.functional.dropout``.

    training:   out = x * m / (1 - p),   m_n = [u_n >= p],  u_n uniform on [0, 1) for element n
    eval:       out = x
    dx = dout * m / (1 - p)

The uniforms come from a counter-based generator, as FlashAttention's and PyTorch's GPU dropout
draw theirs (Philox there): each call makes one 64-bit ``seed`` of two float64 uniforms drawn from
the ``rng`` passed in (``npformer.backend.default_rng(seed, backend)``; a model owns one,
:meth:`npformer.nn.Module.manual_seed`), and element n of x (its flat C-order index) gets

    z_n = splitmix64(seed + n * golden)           (Steele, Lea and Flood 2014; 64-bit arithmetic wraps)
    u_n = (z_n >> 40) / 2^24                      (its top 24 bits: a float32 uniform's resolution)

so the keep-mask is a function of (seed, n) alone. A fixed seed gives a fixed mask; any part of it
can be made on its own, in any order (a thread's block, a GPU thread's element, a flash-attention
tile, the backward recomputing a tile), with no array of draws in memory: a CUDA kernel makes its
bits where it uses them. Every implementation computes these same bits, so the masks agree element
by element on every backend; the generator advances by the seed's two draws whatever the size.
``p = 1`` drops everything (output and gradient are zero) and draws nothing.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

from npformer.backend import get_array_module
from npformer.checks import expect_float, expect_grad, probability
from npformer.dispatch import dispatched
from npformer.errors import RangeError

__all__ = ["SPLITMIX64", "DropoutCache", "dropout_active", "seed_draws", "seed_of", "draw_seed", "keep_threshold",
           "keep_bits", "keep_scale", "dropout_mask", "dropout_forward", "dropout_term", "dropout_backward",
           "dropout_term_backward"]

SPLITMIX64 = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)   # golden gamma, two mixers
_GOLDEN, _MIX1, _MIX2 = SPLITMIX64
_NEEDS_RNG = ("dropout with p > 0 in training mode needs rng, a backend Generator "
              "(npformer.backend.default_rng(seed, backend), or a module's generator)")


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
        raise RangeError(_NEEDS_RNG)
    return True


def seed_draws(rng, like, xp):
    """The two float64 uniforms a dropout seed is made of, drawn from ``rng`` on ``like``'s device (a
    CuPy Generator draws them on the GPU, so no value goes to the host)."""
    if rng is None:
        raise RangeError(_NEEDS_RNG)
    draws = rng.random((2,), dtype=xp.float64)          # (2,)
    get_array_module(draws, like)   # a NumPy Generator with CuPy data (or the reverse) raises here
    return draws


def seed_of(draws, xp):
    """The 64-bit seed of :func:`seed_draws`' two uniforms u0, u1 as a () uint64 array: its high and
    low halves are floor(u0 2^32) and floor(u1 2^32) (exact: the scaling is by a power of two)."""
    halves = (draws * 2.0 ** 32).astype(xp.uint64)       # (2,)
    return ((halves[:1] << xp.uint64(32)) | halves[1:]).reshape(())                # ()


def draw_seed(rng, like, xp):
    """One 64-bit seed from ``rng`` as a () uint64 array on ``like``'s device."""
    return seed_of(seed_draws(rng, like, xp), xp)


def keep_threshold(p: float) -> int:
    """The least top-24-bit value z >> 40 that is kept at rate p: u = (z >> 40) / 2^24 >= p exactly
    when z >> 40 >= ceil(p 2^24) (p 2^24 is exact in float64); 2^24, nothing kept, for p = 1."""
    return min(math.ceil(p * 2.0 ** 24), 1 << 24)


def keep_bits(seed, n, p: float):
    """The keep-mask [u_n >= p] of the flat indices ``n`` (a uint64 array) for one ``seed`` (a ()
    uint64 array of n's backend): splitmix64 of seed + n * golden, kept when its top 24 bits reach
    :func:`keep_threshold`. (splitmix64's last step, z ^= z >> 31, leaves the top 31 bits as they
    are, so it is left out.)"""
    xp = get_array_module(n)
    u64 = xp.uint64
    z = n * u64(_GOLDEN) + seed                          # (same as n) uint64 arithmetic wraps
    z ^= z >> u64(30)
    z *= u64(_MIX1)
    z ^= z >> u64(27)
    z *= u64(_MIX2)
    return (z >> u64(40)) >= u64(keep_threshold(p))     # (same as n)


def keep_scale(p: float, dtype):
    """1 / (1 - p) rounded to ``dtype``, the factor kept entries are scaled by (0 for p = 1)."""
    return dtype.type(0.0 if p == 1.0 else 1.0 / (1.0 - p))


def dropout_mask(x, p: float, rng):
    """``(keep, scale)`` for ``x``: the keep-mask m = [u >= p] as booleans of x's shape, from one seed
    drawn from ``rng`` (all False for p = 1, drawing nothing), and :func:`keep_scale`."""
    xp = get_array_module(x)
    if p == 1.0:
        return xp.zeros(x.shape, dtype=bool), keep_scale(p, x.dtype)   # (same as x)
    seed = draw_seed(rng, x, xp)                         # ()
    n = xp.arange(x.size, dtype=xp.uint64)               # (x.size,) flat indices
    return keep_bits(seed, n, p).reshape(x.shape), keep_scale(p, x.dtype)   # (same as x) m (an array for 0-d x too)


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
