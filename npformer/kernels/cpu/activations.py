"""GELU for NumPy as one in-place chain of ufuncs per cache-sized block, with float32 formulas
(reference: :mod:`npformer.ops.activations`).

No full-size intermediate is allocated: each block of 64K elements (256K when threads share the
work: :func:`~npformer.kernels.cpu.blocks.block_elements`) runs the whole formula in its output
slice. The forward keeps ``cdf = y / x`` (Phi(x), or (1 + tanh(u)) / 2) in its cache, so the
backward needs no CDF of its own, only phi(x) or du/dx: 7 passes for the erf form, bit for bit the
recomputing backward's result, and 11 and no tanh for the tanh form, where 1 - tanh(u)^2 is
4 cdf (1 - cdf) (within 16.4 float32 epsilons of the float64 derivative on [-12, 12], against 10.3
recomputed: the rounding of cdf near 1). ``gpt-tiny``'s NumPy-alone step went from 118 to 108 ms on
1 thread and from 99 to 90 on 2 (alternated in one process, 2026-11-29); the cache holds one more
array of x's size in the accumulation dtype. A cache without ``cdf`` (the reference's forward)
gets the recomputing backward. float64 uses the reference erf (W. J. Cody's, :mod:`npformer.backend.special`).
float32 (and 16-bit, computed in float32) GELU takes the Gaussian CDF as the compiled GELU does
(:mod:`npformer.kernels.numba_cpu.vector_math`), one rational function and no transcendental ufunc:

    Phi(x) = (1 + erf(x / sqrt 2)) / 2,   erf(z) = z P(z^2) / Q(z^2)   (:data:`ERF_P`, :data:`ERF_Q`)

with the 1/sqrt 2 and the halves folded into the coefficients, then clipped to [0, 1]: the rational
function passes 1 at |z| = 4.0 and grows beyond, so the clip makes the far tails exactly 0 and 1
(GELU(-100) is -0, as the reference's). Within 3e-7 of the CDF everywhere (tested). NumPy's float32
tanh and exp cost 3-6 ns an element on an AVX2 CPU, against about 0.3 for a multiply or an add:
the earlier tanh form of erf below, 25 passes and a tanh, made GELU 10.6 ns an element; this one
is 26 passes and nothing else.

:func:`erf_float32` is the more accurate float32 erf (within 6 ulp, against 7 for the rational one),

    erf(x) = tanh(u),   u = atanh(erf(x)) = x N(x^2) / D(x^2),   x clipped to [-4.25, 4.25]

N and D are degree-5 polynomials with positive coefficients (so Horner's rule adds no cancellation),
a rational least-squares fit of atanh(erf(x)) / x on [0, 4.25], reweighted towards minimax
(Lawson), made for npformer in float64 against ``math.erfc`` (``benchmarks/fit_erf_float32.py``
reproduces both fits): relative error 3.1e-9 in u. Near 0, erf = u to first order; towards 1,
tanh shrinks u's error by 1 - erf^2, so the float32 result is within a few units in the last place
everywhere (measured worst 4.3 ulp, 94% within one; the test bounds it by 6). At |x| = 4.25,
u = 10.4 and tanh is 1 in float32, so the clip changes nothing.
"""
from __future__ import annotations

import math

import numpy

from npformer.backend import accumulation_dtype, erf
from npformer.checks import expect_grad, one_of
from npformer.kernels.cpu.blocks import blockwise
from npformer.ops.activations import (APPROXIMATIONS, INV_SQRT_2, INV_SQRT_2PI, SQRT_2_OVER_PI, TANH_CLIP,
                                      TANH_CUBIC, GeluCache)

__all__ = ["ERF_P", "ERF_Q", "erf_float32", "gelu_forward", "gelu_backward"]

# u = x N(x^2) / D(x^2) ~ atanh(erf(x)), coefficients in increasing powers.
_F32_NUM = tuple(numpy.float32(c) for c in (
    1.12837917057275, 0.4597956676206843, 0.09709545804005135, 0.0115513388509442,
    0.0006501027227137126, 8.1921443221321e-06))
_F32_DEN = tuple(numpy.float32(c) for c in (
    1.0, 0.3164035440953693, 0.057415587639446916, 0.005590108712857948,
    0.000185244167329455, 6.354971555587409e-07))
_F32_CLIP = numpy.float32(4.25)

# erf(z) = z P(z^2) / Q(z^2) on |z| <= 3.92 (the compiled GELU's too), coefficients in increasing powers
ERF_P = (1.128379146150889, 0.19039797894379917, 0.05274778031143245, 0.003765301953347802,
         0.00028488427210124145, 2.0502666780606595e-06)
ERF_Q = (1.0, 0.5020685567773281, 0.11410576691588548, 0.014968578895834476, 0.001162475180370602,
         3.8093651424546496e-05)
# Phi(x) = 1/2 + x P'(x^2) / Q'(x^2): z = x / sqrt 2 and the half folded in, P'_k = P_k / (2 sqrt 2 2^k)
_PHI_NUM = tuple(numpy.float32(c / (2.0 * math.sqrt(2.0) * 2.0 ** k)) for k, c in enumerate(ERF_P))
_PHI_DEN = tuple(numpy.float32(c / 2.0 ** k) for k, c in enumerate(ERF_Q))
_PHI_CLIP = numpy.float32(4.5 * math.sqrt(2.0))   # |z| = 4.5, where the rational erf is 1 + 1.3e-5: clipped to 1


def _horner(coef, s, out):
    """out = coef[0] + coef[1] s + ... + coef[-1] s^(n-1), in place in ``out`` (not ``s``)."""
    numpy.multiply(s, coef[-1], out=out)
    for c in coef[-2:0:-1]:
        out += c
        out *= s
    out += coef[0]
    return out


def _erf_float32_block(out, x):
    """``out = erf(x)`` for float32 arrays with the formula above (``out`` may be ``x``)."""
    xc = numpy.clip(x, -_F32_CLIP, _F32_CLIP, out=out)  # NaN stays NaN, +-inf -> +-4.25 -> +-1
    s = xc * xc
    num = _horner(_F32_NUM, s, numpy.empty_like(s))
    den = _horner(_F32_DEN, s, numpy.empty_like(s))
    num /= den
    num *= xc                                            # u = x N / D
    return numpy.tanh(num, out=out)


def erf_float32(x):
    """erf of a float32 array by the formula above, in blocks (a fresh array)."""
    x = numpy.asarray(x, dtype=numpy.float32, order="C")
    return blockwise(_erf_float32_block, numpy.empty_like(x), x)


def _phi_float32_block(y, x):
    """y = Phi(x) for float32 x by the rational erf (the module docstring)."""
    w = numpy.clip(x, -_PHI_CLIP, _PHI_CLIP, out=y)     # NaN stays NaN; beyond, Phi is clipped to 0 or 1
    s = w * w
    num = _horner(_PHI_NUM, s, numpy.empty_like(s))
    num /= _horner(_PHI_DEN, s, numpy.empty_like(s))
    num *= w
    num += 0.5
    numpy.clip(num, 0.0, 1.0, out=y)


def _phi_block(y, x):
    """y = Phi(x) = (1 + erf(x / sqrt 2)) / 2, in y."""
    if y.dtype == numpy.float32:
        _phi_float32_block(y, x)
        return
    erf(numpy.multiply(x, INV_SQRT_2, out=y), out=y)
    y += 1.0
    y *= 0.5


def _gelu_erf_block(y, x, cdf):
    _phi_block(cdf, x)
    numpy.multiply(cdf, x, out=y)                        # x Phi(x)


def _tanh_of_arg(x, out):
    """tanh(u) in ``out`` and x clipped to [-100, 100] (tanh is exactly +-1 beyond)."""
    xc = numpy.clip(x, -TANH_CLIP, TANH_CLIP)
    numpy.multiply(xc, xc, out=out)
    out *= TANH_CUBIC
    out += 1.0
    out *= xc
    out *= SQRT_2_OVER_PI                                # u
    return numpy.tanh(out, out=out), xc


def _gelu_tanh_block(y, x, cdf):
    _tanh_of_arg(x, cdf)                                 # tanh(u)
    cdf += 1.0
    cdf *= 0.5                                           # (1 + tanh(u)) / 2
    numpy.multiply(cdf, x, out=y)                        # x/2 (1 + tanh(u))


def _gelu_erf_grad_from_cdf_block(d, x, dy, cdf):
    # fwd: y = x Phi(x)  ->  dx = dy * (Phi(x) + x phi(x)), Phi(x) kept by the forward
    numpy.multiply(x, x, out=d)
    d *= -0.5
    numpy.exp(d, out=d)
    d *= x
    d *= INV_SQRT_2PI                                    # x phi(x)
    d += cdf
    d *= dy


def _gelu_erf_grad_block(d, x, dy):
    # the same, Phi(x) recomputed (a cache from the reference's forward keeps none)
    cdf = numpy.empty_like(x)
    _phi_block(cdf, x)
    _gelu_erf_grad_from_cdf_block(d, x, dy, cdf)


def _gelu_tanh_grad_from_cdf_block(d, x, dy, cdf):
    # fwd: y = x c, c = (1 + t) / 2 kept by the forward  ->  dx = dy * (c + x/2 (1 - t^2) du/dx),
    # where 1 - t^2 = 4 c (1 - c)
    xc = numpy.clip(x, -TANH_CLIP, TANH_CLIP)
    numpy.subtract(1.0, cdf, out=d)
    d *= cdf                                             # c (1 - c)
    du = xc * xc
    du *= 3.0 * TANH_CUBIC
    du += 1.0
    du *= 2.0 * SQRT_2_OVER_PI                           # 2 du/dx
    d *= du
    d *= xc
    d += cdf
    d *= dy


def _gelu_tanh_grad_block(d, x, dy):
    # fwd: y = x/2 (1 + tanh(u))  ->  dx = dy * (1/2 (1 + t) + x/2 (1 - t^2) du/dx)
    t, xc = _tanh_of_arg(x, numpy.empty_like(x))
    numpy.multiply(t, t, out=d)
    numpy.subtract(1.0, d, out=d)                        # 1 - t^2
    du = xc * xc
    du *= 3.0 * TANH_CUBIC
    du += 1.0
    du *= SQRT_2_OVER_PI                                 # du/dx
    d *= du
    d *= xc
    d *= 0.5
    t += 1.0
    t *= 0.5
    d += t
    d *= dy


def gelu_forward(x, approximate: str = "none"):
    one_of(approximate, "approximate", APPROXIMATIONS)
    xa = numpy.asarray(x, dtype=accumulation_dtype(x.dtype), order="C")   # (ascontiguousarray makes 0-d 1-d)
    block = _gelu_erf_block if approximate == "none" else _gelu_tanh_block
    cdf = numpy.empty_like(xa)                           # (...) y / x, kept for the backward
    y = blockwise(block, numpy.empty_like(xa), xa, cdf)  # (...)
    return y.astype(x.dtype, copy=False), GeluCache(x, approximate, cdf)


def gelu_backward(dy, cache):
    x, approximate, cdf = cache
    expect_grad(dy, "dy", x.shape, x.dtype)
    acc = accumulation_dtype(x.dtype)
    xa, dya = numpy.asarray(x, dtype=acc, order="C"), numpy.asarray(dy, dtype=acc, order="C")
    if cdf is None:                                      # the reference's forward: the CDF recomputed
        block = _gelu_erf_grad_block if approximate == "none" else _gelu_tanh_grad_block
        d = blockwise(block, numpy.empty_like(xa), xa, dya)          # (...)
    else:
        block = _gelu_erf_grad_from_cdf_block if approximate == "none" else _gelu_tanh_grad_from_cdf_block
        d = blockwise(block, numpy.empty_like(xa), xa, dya, cdf)     # (...)
    return d.astype(dy.dtype, copy=False)
