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

The scale 1 / (1 - p) is a scalar of x's accumulation dtype (:func:`npformer.backend.accumulation_dtype`:
float32 for 16-bit x), and ``x * m * scale`` is computed in that dtype and rounded to x's once
(:func:`keep_scaled`), as the CUDA kernels compute it. In float16 the scale itself would be inf for
p > 1 - 1/65504 (p = 0.99999: 1e5), and every dropped entry 0 * inf = NaN; this way a dropped entry is
0 and a kept one x / (1 - p) rounded, inf only where that value itself exceeds float16's 65504. (A
dropped inf or NaN still gives NaN, x * 0, as in PyTorch.)

The backward needs the forward's mask, and a cache may hold it in either of two forms
(:class:`DropoutCache`): the mask itself as booleans (this op and the CPU fast paths: one byte an
entry, read back faster there than hashed again), or only the seed's two draws, the mask hashed again
where the backward uses it (the fused CUDA kernels, as FlashAttention recomputes its dropout: at
GPT-2 124M's shape, B8 T1024, 453 MB of masks a step are never stored). :func:`keep_mask` gives the
mask of either, so every backward accepts both.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

from npformer.backend import accumulation_dtype, get_array_module
from npformer.checks import expect_float, expect_grad, probability
from npformer.dispatch import dispatched
from npformer.errors import RangeError

__all__ = ["SPLITMIX64", "DropoutCache", "dropout_active", "seed_draws", "seed_of", "draw_seed", "keep_threshold",
           "keep_bits", "keep_scale", "keep_scaled", "seed_mask", "dropout_mask", "keep_mask", "dropout_forward",
           "dropout_term", "dropout_backward", "dropout_term_backward"]

SPLITMIX64 = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)   # golden gamma, two mixers
_GOLDEN, _MIX1, _MIX2 = SPLITMIX64
_NEEDS_RNG = ("dropout with p > 0 in training mode needs rng, a backend Generator "
              "(npformer.backend.default_rng(seed, backend), or a module's generator)")


class DropoutCache(NamedTuple):
    """What the backward needs of a dropout: the keep-mask m, stored as booleans in ``keep`` (one byte
    an entry, a quarter of a float32 mask), or kept as its seed: ``keep`` None, ``draws`` the seed's
    two float64 uniforms and ``p`` the rate (:func:`keep_mask` remakes the mask; a CUDA kernel hashes
    it where it uses it); the scale 1 / (1 - p) as a scalar of the input's accumulation dtype (0 for
    p = 1, where nothing is kept; :func:`keep_scale`); the input's shape and dtype (what the backward's
    ``dout`` must have). ``keep``, ``scale`` and ``draws`` are all None when dropout was the identity.
    ``out = x * m * scale`` and ``dx = dout * m * scale``, each computed in the scale's dtype and
    rounded to x's (:func:`keep_scaled`)."""

    keep: Any           # bool (same shape as x), or None: kept as its seed, or the identity
    scale: Any          # 1 / (1 - p), a scalar of x's accumulation dtype, or None for the identity
    x_shape: tuple
    x_dtype: Any
    draws: Any = None   # (2,) float64: the seed's draws when the mask is not stored
    p: float = 0.0      # the rate, which remakes the mask from the seed

    @classmethod
    def identity(cls, x) -> "DropoutCache":
        """The cache of a dropout that dropped nothing (eval mode or p = 0)."""
        return cls(None, None, x.shape, x.dtype)

    @classmethod
    def of_seed(cls, draws, p: float, x) -> "DropoutCache":
        """The cache of a dropout of ``x`` at rate p (0 < p < 1) whose mask is kept as the seed made of
        ``draws`` (:func:`seed_draws`), not stored."""
        return cls(None, keep_scale(p, x.dtype), x.shape, x.dtype, draws, p)

    @property
    def dropped(self) -> bool:
        """Whether the forward dropped anything (False: dropout was the identity)."""
        return self.scale is not None


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
    """1 / (1 - p), the factor kept entries are scaled by (0 for p = 1), as a scalar of ``dtype``'s
    accumulation dtype: float32 for 16-bit floats, where float16 would round it to inf for
    p > 1 - 1/65504 (module docstring)."""
    return accumulation_dtype(dtype).type(0.0 if p == 1.0 else 1.0 / (1.0 - p))


def keep_scaled(x, keep, scale):
    """``x * m * scale`` (``keep`` the booleans m, ``scale`` from :func:`keep_scale`) computed in the
    scale's dtype and rounded once to x's: 0 where dropped (for a finite x), x / (1 - p) rounded where
    kept."""
    return (x.astype(scale.dtype, copy=False) * keep * scale).astype(x.dtype, copy=False)   # (same as x)


def seed_mask(draws, shape: tuple, p: float):
    """The keep-mask m = [u >= p] as booleans of ``shape`` for the seed made of ``draws`` (an array
    for a 0-d shape too)."""
    xp = get_array_module(draws)
    n = xp.arange(math.prod(shape), dtype=xp.uint64)     # (size,) flat indices
    return keep_bits(seed_of(draws, xp), n, p).reshape(shape)   # (shape)


def dropout_mask(x, p: float, rng):
    """``(keep, scale)`` for ``x``: the keep-mask m = [u >= p] as booleans of x's shape, from one seed
    drawn from ``rng`` (all False for p = 1, drawing nothing), and :func:`keep_scale`."""
    xp = get_array_module(x)
    if p == 1.0:
        return xp.zeros(x.shape, dtype=bool), keep_scale(p, x.dtype)   # (same as x)
    return seed_mask(seed_draws(rng, x, xp), x.shape, p), keep_scale(p, x.dtype)   # (same as x) m


def keep_mask(cache: DropoutCache):
    """The keep-mask of a dropout that dropped: its stored booleans, or the mask remade from its seed."""
    if cache.keep is not None:
        return cache.keep
    return seed_mask(cache.draws, cache.x_shape, cache.p)          # (same as x)


@dispatched
def dropout_forward(x, p: float, rng=None, training: bool = True):
    """Returns ``(out, cache)``; ``rng`` is required when ``training`` and ``p > 0``."""
    if not dropout_active(x, p, rng, training):
        return x.copy(), DropoutCache.identity(x)
    keep, scale = dropout_mask(x, p, rng)                # (same as x), scalar
    return keep_scaled(x, keep, scale), DropoutCache(keep, scale, x.shape, x.dtype)


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
    if not cache.dropped:
        return dout.copy()
    return keep_scaled(dout, keep_mask(cache), cache.scale)


def dropout_term_backward(dout, cache: DropoutCache):
    """The gradient of a :func:`dropout_term`, which the op's backward only reads: ``dout`` itself (no
    copy) when the dropout was the identity, else :func:`dropout_backward`'s result."""
    if not cache.dropped:
        expect_grad(dout, "dout", cache.x_shape, cache.x_dtype)
        return dout
    return dropout_backward(dout, cache)
