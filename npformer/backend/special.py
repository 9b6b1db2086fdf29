"""erf for both backends: ``cupyx.scipy.special.erf`` on CuPy, rational approximations on NumPy.

NumPy has no erf ufunc and npformer must not need SciPy. Two NumPy paths:

* float64 (and every dtype but float32/float16): W. J. Cody's rational Chebyshev approximations
  (Math. Comp. 23 (1969) 631-637), the ones behind most C libraries' erf: three ranges of |x|,
  each a ratio of two polynomials, accurate to about one unit in the last place of float64
  (tests/backend/test_backend.py compares with ``math.erf``). The gradient checks run on it.
* float32 (float16 is computed in float32): one branch-free formula in float32,

      erf(x) = tanh(u),   u = atanh(erf(x)) = x N(x^2) / D(x^2),   x clipped to [-4.25, 4.25]

  N and D are degree-5 polynomials with positive coefficients (so Horner's rule adds no
  cancellation), a rational least-squares fit of atanh(erf(x)) / x on [0, 4.25], reweighted
  towards minimax (Lawson), made for npformer in float64 against ``math.erfc``
  (``benchmarks/fit_erf_float32.py`` reproduces it): relative error 3.1e-9 in u. Near 0,
  erf = u to first order; towards 1, tanh shrinks u's error by 1 - erf^2, so the float32 result
  is within a few units in the last place everywhere (measured worst 4.3 ulp, 94% within one;
  the test bounds it by 6). At |x| = 4.25, u = 10.4 and tanh is 1 in float32, so the clip
  changes nothing. It runs in cache-sized blocks (:mod:`npformer.backend.blocks`): about 25
  ufunc passes over 64K-element slices instead of Cody's float64 boolean-indexed ranges
  (1M floats: 54 ms -> 2.2 ms on the 2-core development machine).
"""
from __future__ import annotations

import importlib

import numpy

from npformer.backend.blocks import blockwise

# Cody's coefficients: |x| <= 0.46875 (erf), 0.46875 < |x| <= 4 (erfc), |x| > 4 (erfc).
_A = (3.16112374387056560e00, 1.13864154151050156e02, 3.77485237685302021e02,
      3.20937758913846947e03, 1.85777706184603153e-1)
_B = (2.36012909523441209e01, 2.44024637934444173e02, 1.28261652607737228e03,
      2.84423683343917062e03)
_C = (5.64188496988670089e-1, 8.88314979438837594e00, 6.61191906371416295e01,
      2.98635138197400131e02, 8.81952221241769090e02, 1.71204761263407058e03,
      2.05107837782607147e03, 1.23033935479799725e03, 2.15311535474403846e-8)
_D = (1.57449261107098347e01, 1.17693950891312499e02, 5.37181101862009858e02,
      1.62138957456669019e03, 3.29079923573345963e03, 4.36261909014324716e03,
      3.43936767414372164e03, 1.23033935480374942e03)
_P = (3.05326634961232344e-1, 3.60344899949804439e-1, 1.25781726111229246e-1,
      1.60837851487422766e-2, 6.58749161529837803e-4, 1.63153871373020978e-2)
_Q = (2.56852019228982242e00, 1.87295284992346725e00, 5.27905102951428412e-1,
      6.05183413124413191e-2, 2.33520497626869185e-3)
_INV_SQRT_PI = 5.6418958354775628695e-1


def _ratio(num_coef, den_coef, t, n):
    """(num[n] t^{n+1} + num[0] t^n + ... ) / (t^{n+1} + den[0] t^n + ...), Horner form as in Cody."""
    xnum = num_coef[-1] * t
    xden = t
    for i in range(n):
        xnum = (xnum + num_coef[i]) * t
        xden = (xden + den_coef[i]) * t
    return xnum, xden


def _erfc_scaled_tail(y, erfc_part):
    """Multiply by exp(-y^2), split as exp(-r^2) exp(-(y-r)(y+r)) with r = y rounded to 1/16."""
    r = numpy.trunc(y * 16.0) / 16.0
    return erfc_part * numpy.exp(-r * r) * numpy.exp(-(y - r) * (y + r))


def _erf_numpy(x: numpy.ndarray) -> numpy.ndarray:
    x = numpy.asarray(x)
    dtype = x.dtype if x.dtype.kind == "f" else numpy.dtype(numpy.float64)
    xd = x.astype(numpy.float64)   # evaluate in float64, return the input's dtype
    y = numpy.abs(xd)
    out = numpy.empty_like(xd)

    small = y <= 0.46875
    ys = xd[small]
    num, den = _ratio(_A, _B, ys * ys, 3)
    out[small] = ys * (num + _A[3]) / (den + _B[3])

    mid = (y > 0.46875) & (y <= 4.0)
    ym = y[mid]
    num, den = _ratio(_C, _D, ym, 7)
    erfc = _erfc_scaled_tail(ym, (num + _C[7]) / (den + _D[7]))
    out[mid] = numpy.copysign(1.0 - erfc, xd[mid])

    big = y > 4.0
    yb = numpy.minimum(y[big], 30.0)   # erfc(30) underflows to 0; keeps inf finite
    inv2 = 1.0 / (yb * yb)
    num, den = _ratio(_P, _Q, inv2, 4)
    part = (_INV_SQRT_PI - inv2 * (num + _P[4]) / (den + _Q[4])) / yb
    erfc = _erfc_scaled_tail(yb, part)
    out[big] = numpy.copysign(1.0 - erfc, xd[big])

    nan = numpy.isnan(xd)
    out[nan] = numpy.nan
    return out.astype(dtype, copy=False)


# The float32 path: u = x N(x^2) / D(x^2) ~ atanh(erf(x)), coefficients in increasing powers.
_F32_NUM = tuple(numpy.float32(c) for c in (
    1.12837917057275, 0.4597956676206843, 0.09709545804005135, 0.0115513388509442,
    0.0006501027227137126, 8.1921443221321e-06))
_F32_DEN = tuple(numpy.float32(c) for c in (
    1.0, 0.3164035440953693, 0.057415587639446916, 0.005590108712857948,
    0.000185244167329455, 6.354971555587409e-07))
_F32_CLIP = numpy.float32(4.25)


def _horner(coef, s, out):
    """out = coef[0] + coef[1] s + ... + coef[-1] s^(n-1), in place in ``out`` (not ``s``)."""
    numpy.multiply(s, coef[-1], out=out)
    for c in coef[-2:0:-1]:
        out += c
        out *= s
    out += coef[0]
    return out


def erf_float32_block(out, x):
    """``out = erf(x)`` for float32 NumPy arrays with the branch-free formula above (``out`` may be ``x``)."""
    xc = numpy.clip(x, -_F32_CLIP, _F32_CLIP, out=out)  # NaN stays NaN, +-inf -> +-4.25 -> +-1
    s = xc * xc
    num = _horner(_F32_NUM, s, numpy.empty_like(s))
    den = _horner(_F32_DEN, s, numpy.empty_like(s))
    num /= den
    num *= xc                                            # u = x N / D
    return numpy.tanh(num, out=out)


def erf(x, out=None):
    """The error function, elementwise, on the backend of ``x``; returns ``x``'s float dtype.

    ``out`` (optional: ``x``'s shape and dtype, and it may be ``x`` itself) receives the result.
    """
    from npformer.backend import get_array_module

    xp = get_array_module(x, out)
    if xp is not numpy:
        res = importlib.import_module("cupyx.scipy.special").erf(x)
    else:
        x = numpy.asarray(x)
        if x.dtype == numpy.float32:
            return blockwise(erf_float32_block, numpy.empty_like(x) if out is None else out,
                             numpy.ascontiguousarray(x))
        if x.dtype == numpy.float16:
            res = erf(x.astype(numpy.float32)).astype(numpy.float16)
        else:
            res = _erf_numpy(x)
    if out is None:
        return res
    out[...] = res
    return out
