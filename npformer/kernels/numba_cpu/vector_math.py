"""Scalar functions for compiled loops, as arithmetic the compiler can vectorise.

A loop that calls ``math.exp`` calls the C library once per element; one that calls :func:`exp32`
runs 16 lanes at a time. float32:

    exp(v) = 2^k e^r,   k = round(v / ln 2),  r = v - k ln 2 in [-ln2/2, ln2/2]

with ln 2 split in two parts (the first exact in 9 bits, so k ln2_hi is exact for |k| < 2^15),
e^r by its Taylor series to r^7 (remainder below 0.35^8 / 8! = 5e-9, under a float32 ulp), and 2^k
built in the exponent bits. Below -87 (where the result would be subnormal, under 1.7e-38) it gives
0, above 88 infinity (float32 overflows at 88.72; the callers pass v <= 21 or +inf), NaN gives NaN.

The float32 Gaussian CDF is ``(1 + erf(x / sqrt 2)) / 2`` with erf as one rational function,

    erf(z) = z P(z^2) / Q(z^2)   on |z| <= 3.92 (beyond, erf is +-1 in float32),

P and Q of degree 5 with positive coefficients, fitted for npformer (``benchmarks/fit_erf_float32.py``
reproduces them): relative error 1.9e-8 in float64, worst 6.7 float32 ulp (4e-7 absolute) evaluated
in float32. No exp and one division: the cheapest form, which the NumPy fast path's GELU uses too
(:data:`npformer.kernels.cpu.activations.ERF_P`, the coefficients' one home). float64 loops use the
C library (``math.erfc``, ``math.exp``).

One function here is there to be slower: :func:`inv_sqrt`, 1 / sqrt(v) correctly rounded where
:data:`FASTMATH` would let the compiler estimate it (NaN for v = inf).
"""
from __future__ import annotations

import math

import numpy
from numba import njit, types
from numba.extending import overload

from npformer.kernels.cpu.activations import ERF_P, ERF_Q

__all__ = ["FASTMATH", "exp32", "sigmoid32", "erf32", "phi32", "exp64", "phi64", "vexp", "inv_sqrt"]

# reassociation (vectorised sums), contraction (fused multiply-add) and reciprocals (1 / sqrt too: see
# inv_sqrt). Not "nnan"/"ninf": NaN and infinities in must come out as the reference gives them. Not "nsz":
# with it, reassociation may fold exp32's (c - k ln2_hi) - k ln2_lo into c - k (ln2_hi + ln2_lo)
# (measured: 67 ulp instead of 0.85)
FASTMATH = {"reassoc", "contract", "arcp"}

F = numpy.float32
_LOG2E = F(1.4426950408889634)
_LN2_HI = F(0.693359375)                     # 355/512, exact in float32
_LN2_LO = F(math.log(2.0) - 0.693359375)
_TAYLOR = tuple(F(1.0 / math.factorial(n)) for n in range(8))     # 1, 1, 1/2, ..., 1/7!
_LOW, _HIGH, _INF = F(-87.0), F(88.0), F(numpy.inf)
_P0, _P1, _P2, _P3, _P4, _P5 = (F(c) for c in ERF_P)
_Q1, _Q2, _Q3, _Q4, _Q5 = (F(c) for c in ERF_Q[1:])
_ERF_CLIP = F(3.92)
_INV_SQRT_2 = F(1.0 / math.sqrt(2.0))


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def exp32(v):
    c = min(max(v, _LOW), _HIGH)
    k = numpy.rint(c * _LOG2E)                           # (one vector instruction; floor(x + 0.5) was twice as slow)
    r = (c - k * _LN2_HI) - k * _LN2_LO
    p = _TAYLOR[7]
    p = p * r + _TAYLOR[6]
    p = p * r + _TAYLOR[5]
    p = p * r + _TAYLOR[4]
    p = p * r + _TAYLOR[3]
    p = p * r + _TAYLOR[2]
    p = p * r + _TAYLOR[1]
    p = p * r + _TAYLOR[0]
    y = p * numpy.int32((numpy.int32(k) + numpy.int32(127)) << numpy.int32(23)).view(numpy.float32)
    y = F(0.0) if v < _LOW else y
    y = _INF if v > _HIGH else y
    return v if v != v else y


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def sigmoid32(t):
    """1 / (1 + e^-t), float32; t beyond +-87 gives 1 and about 0."""
    return F(1.0) / (F(1.0) + exp32(-t))


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def erf32(z):
    """erf of float32 z: z P(z^2) / Q(z^2), exactly +-1 beyond +-3.92 (NaN stays NaN)."""
    c = min(max(z, -_ERF_CLIP), _ERF_CLIP)
    s = c * c
    num = ((((_P5 * s + _P4) * s + _P3) * s + _P2) * s + _P1) * s + _P0
    den = ((((_Q5 * s + _Q4) * s + _Q3) * s + _Q2) * s + _Q1) * s + F(1.0)
    e = c * num / den
    e = F(1.0) if z >= _ERF_CLIP else e
    e = F(-1.0) if z <= -_ERF_CLIP else e               # (so GELU's far tail is exactly 0)
    return z if z != z else e


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def phi32(x):
    """The standard normal CDF of float32 x."""
    return F(0.5) + F(0.5) * erf32(x * _INV_SQRT_2)


@njit(inline="always")
def exp64(v):
    return math.exp(v)


@njit(inline="always")
def phi64(x):
    """The standard normal CDF, float64: erfc(-x / sqrt 2) / 2 (no cancellation for x < 0)."""
    return 0.5 * math.erfc(-x * 0.7071067811865476)


def vexp(v):
    """exp in compiled loops of either float type: :func:`exp32` for float32, the C library's for
    float64 (chosen when the loop is compiled; one loop serves both dtypes)."""
    return math.exp(v)


@overload(vexp, inline="always")
def _vexp_typed(v):
    if v == types.float32:
        return lambda v: exp32(v)
    return lambda v: exp64(v)


def inv_sqrt(v):
    """1 / sqrt(v) correctly rounded in v's float type, for loops compiled with :data:`FASTMATH`. Its
    "arcp" lets LLVM turn float32 1 / sqrt(v) into the reciprocal square root estimate r and one
    Newton step, r (3 - v r^2) / 2: NaN for v = inf (r = 0; the reference gives 0) and for v = 0
    (inf), -inf for a subnormal v (r = inf), up to 2 ulp off elsewhere (measured). Compiled apart,
    without FASTMATH (LLVM inlines it, its flags kept): a square root and a division."""
    return 1.0 / math.sqrt(v)


@overload(inv_sqrt, jit_options={"fastmath": False, "error_model": "numpy"})
def _inv_sqrt_typed(v):
    one = F(1.0) if v == types.float32 else 1.0
    return lambda v: one / math.sqrt(v)
