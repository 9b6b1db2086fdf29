"""erf for both backends: ``cupyx.scipy.special.erf`` on CuPy, W. J. Cody's rational approximations
on NumPy.

NumPy has no erf ufunc and npformer must not need SciPy. Cody's rational Chebyshev approximations
(Math. Comp. 23 (1969) 631-637), the ones behind most C libraries' erf, split |x| into three
ranges, each a ratio of two polynomials, accurate to about one unit in the last place of float64
(tests/backend/test_backend.py compares with ``math.erf``). Every dtype is evaluated in float64 and
rounded once to its own dtype, so float32 and float16 results are correctly rounded but for ties.
The gradient checks run on this reference; the CPU fast path of GELU uses a cheaper float32 formula
(:mod:`npformer.kernels.cpu.activations`).
"""
from __future__ import annotations

import importlib

import numpy

from npformer.backend.array_module import get_array_module, is_float_dtype
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
    dtype = x.dtype if is_float_dtype(x.dtype) else numpy.dtype(numpy.float64)
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


def erf(x, out=None):
    """The error function, elementwise, on the backend of ``x``; returns ``x``'s float dtype.

    ``out`` (optional: ``x``'s shape and dtype, and it may be ``x`` itself) receives the result.
    """
    xp = get_array_module(x, out)
    if xp is not numpy:
        res = importlib.import_module("cupyx.scipy.special").erf(x)
    else:
        res = _erf_numpy(x)
    if out is None:
        return res
    out[...] = res
    return out
