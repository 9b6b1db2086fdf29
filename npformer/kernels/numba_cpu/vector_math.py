"""Scalar functions for compiled loops, as arithmetic the compiler can vectorise.

A loop that calls ``math.exp`` calls the C library once per element; one that calls :func:`exp32`
runs 16 lanes at a time. float32:

    exp(v) = 2^k e^r,   k = round(v / ln 2),  r = v - k ln 2 in [-ln2/2, ln2/2]

with ln 2 split in two parts (the first exact in 9 bits, so k ln2_hi is exact for |k| < 2^15),
e^r by its Taylor series to r^7 (remainder below 0.35^8 / 8! = 5e-9, under a float32 ulp), and 2^k
built in the exponent bits. Below -87 (where the result would be subnormal, under 1.7e-38) it gives
0, above 88 infinity (float32 overflows at 88.72; the callers pass v <= 21 or +inf), NaN gives NaN.

The float32 Gaussian CDF uses the GELU fast path's rational ``u(z) ~ atanh(erf(z))``
(:mod:`npformer.kernels.cpu.activations`: relative error 3.1e-9 on [0, 4.25]) as

    Phi(x) = (1 + erf(x / sqrt 2)) / 2 = (1 + tanh(u)) / 2 = sigmoid(2 u)

which has no cancellation as Phi goes to 0. Beyond |x| = 6.01 (z = 4.25, the end of the fit) it is
1 above and 0 below (the true tails are under 1e-9, as the NumPy fast path's float32 erf gives). float64 loops use the C library (``math.erfc``, ``math.exp``).
"""
from __future__ import annotations

import math

import numpy
from numba import njit, types
from numba.extending import overload

from npformer.kernels.cpu.activations import _F32_CLIP, _F32_DEN, _F32_NUM

__all__ = ["FASTMATH", "exp32", "sigmoid32", "phi32", "exp64", "phi64", "vexp"]

# reassociation (vectorised sums), contraction (fused multiply-add), signed zeros and reciprocals;
# not "nnan"/"ninf": NaN and infinities in must come out as the reference gives them
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}

F = numpy.float32
_LOG2E = F(1.4426950408889634)
_LN2_HI = F(0.693359375)                     # 355/512, exact in float32
_LN2_LO = F(math.log(2.0) - 0.693359375)
_TAYLOR = tuple(F(1.0 / math.factorial(n)) for n in range(8))     # 1, 1, 1/2, ..., 1/7!
_LOW, _HIGH, _INF = F(-87.0), F(88.0), F(numpy.inf)
_N0, _N1, _N2, _N3, _N4, _N5 = _F32_NUM
_D0, _D1, _D2, _D3, _D4, _D5 = _F32_DEN
_INV_SQRT_2 = F(1.0 / math.sqrt(2.0))


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def exp32(v):
    c = min(max(v, _LOW), _HIGH)
    k = math.floor(c * _LOG2E + F(0.5))
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
def phi32(x):
    """The standard normal CDF of float32 x (sigmoid of 2 u(x / sqrt 2))."""
    z0 = x * _INV_SQRT_2
    z = min(max(z0, -_F32_CLIP), _F32_CLIP)
    s = z * z
    num = ((((_N5 * s + _N4) * s + _N3) * s + _N2) * s + _N1) * s + _N0
    den = ((((_D5 * s + _D4) * s + _D3) * s + _D2) * s + _D1) * s + _D0
    p = sigmoid32(F(2.0) * z * num / den)
    return F(0.0) if z0 < -_F32_CLIP else p


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
