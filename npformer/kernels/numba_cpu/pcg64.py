"""NumPy's PCG64 stream, compiled, turned straight into a dropout keep-mask (reference: the NumPy
fast path's :class:`~npformer.kernels.cpu.dropout.KeepMask`, itself the reference mask bit for bit).

PCG64 (O'Neill 2014, as NumPy implements it) keeps a 128-bit state s and an odd increment c:

    s <- s * M + c   (mod 2^128),   M = 2549297995355413924 * 2^64 + 4865540595714422341
    draw = rotr64(hi(s) xor lo(s), hi(s) >> 58)                 (XSL-RR: the new state's output)

Here s is two 64-bit halves: the low half of the product is lo * M_lo, the high half
hi(lo * M_lo) + hi * M_lo + lo * M_hi (mod 2^64), the carry of the increment's low half added in.
``hi(a * b)`` is LLVM's 128-bit multiply (:func:`mul_high`), one instruction on x86-64 and ARM64.

NumPy's ``random_raw`` calls the generator through a function pointer once a draw (about 2.9 ns a
draw measured here) and the mask then takes a comparison pass over the draws; :func:`write_keep`
compares each 32-bit half with the threshold as it is drawn and writes the two booleans (about
2 ns a draw, no array of draws). The state comes from a ``numpy.random.PCG64`` (:func:`split_state`),
so jumps (``advance``) and the caller's generator stay NumPy's own.
"""
from __future__ import annotations

import numpy
from llvmlite import ir
from numba import njit, types, uint64
from numba.extending import intrinsic

__all__ = ["mul_high", "write_keep", "split_state"]

_M_HI = numpy.uint64(2549297995355413924)
_M_LO = numpy.uint64(4865540595714422341)
_LOW_32 = numpy.uint64(0xFFFFFFFF)


@intrinsic
def mul_high(typingctx, a, b):
    """The high 64 bits of the 128-bit product of two uint64."""
    def codegen(context, builder, signature, args):
        wide = ir.IntType(128)
        product = builder.mul(builder.zext(args[0], wide), builder.zext(args[1], wide))
        return builder.trunc(builder.lshr(product, ir.Constant(wide, 64)), ir.IntType(64))
    return types.uint64(types.uint64, types.uint64), codegen


@njit(inline="always")
def _next(hi, lo, inc_hi, inc_lo):
    """One step of the state and the draw it gives: (hi, lo, draw)."""
    p_lo = lo * _M_LO
    p_hi = mul_high(lo, _M_LO) + hi * _M_LO + lo * _M_HI
    lo = p_lo + inc_lo
    hi = p_hi + inc_hi + uint64(lo < p_lo)                 # the carry out of the low half
    x = hi ^ lo
    r = hi >> uint64(58)
    return hi, lo, (x >> r) | (x << ((uint64(64) - r) & uint64(63)))


@njit(nogil=True, cache=True)
def write_keep(keep, hi, lo, inc_hi, inc_lo, threshold):
    """``keep[i] = half_i >= threshold`` for the 32-bit halves of the next ceil(n / 2) draws (low
    half first, as NumPy's float32 uniforms take them; an odd n drops the last draw's high half);
    returns the state after them as (hi, lo)."""
    n = keep.size
    for i in range(n // 2):
        hi, lo, draw = _next(hi, lo, inc_hi, inc_lo)
        keep[2 * i] = (draw & _LOW_32) >= threshold
        keep[2 * i + 1] = (draw >> uint64(32)) >= threshold
    if n % 2:
        hi, lo, draw = _next(hi, lo, inc_hi, inc_lo)
        keep[n - 1] = (draw & _LOW_32) >= threshold
    return hi, lo


def split_state(bitgen: numpy.random.PCG64) -> tuple:
    """(hi, lo, inc_hi, inc_lo) of a PCG64's state and increment, as uint64."""
    state = bitgen.state["state"]
    s, c = state["state"], state["inc"]
    return (numpy.uint64(s >> 64), numpy.uint64(s & 0xFFFFFFFFFFFFFFFF),
            numpy.uint64(c >> 64), numpy.uint64(c & 0xFFFFFFFFFFFFFFFF))

