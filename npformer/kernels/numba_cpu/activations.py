"""GELU forward and backward as one compiled loop each (reference: :mod:`npformer.ops.activations`).

    exact:  y = x Phi(x)                    dx = dy (Phi(x) + x phi(x))
    tanh:   y = x sigmoid(2u)               dx = dy (s + 2 x s (1 - s) u'),  s = sigmoid(2u)
            u = sqrt(2/pi) (x + 0.044715 x^3)     ((1 + tanh u) / 2 = sigmoid(2u): no cancellation)

float32 runs :mod:`~npformer.kernels.numba_cpu.vector_math`'s vectorised exp and CDF; float64 the C
library's ``erfc``, ``exp`` and ``tanh``. x is clipped to +-100 inside u as the reference does.
"""
from __future__ import annotations

import math

import numpy
from numba import njit

from npformer.checks import expect_grad, one_of
from npformer.kernels.numba_cpu.rows import over_rows
from npformer.kernels.numba_cpu.vector_math import FASTMATH, exp32, phi32, phi64, sigmoid32
from npformer.ops.activations import APPROXIMATIONS, INV_SQRT_2PI, SQRT_2_OVER_PI, TANH_CLIP, TANH_CUBIC, GeluCache

__all__ = ["gelu_forward", "gelu_backward"]

F = numpy.float32
_INV_SQRT_2PI_32, _K32, _C32, _CLIP32 = F(INV_SQRT_2PI), F(SQRT_2_OVER_PI), F(TANH_CUBIC), F(TANH_CLIP)


@njit(nogil=True, fastmath=FASTMATH, error_model="numpy", cache=True)
def _forward32(y, x, tanh_form, start, stop):
    y, x = y[start:stop], x[start:stop]      # (loops from 0 to a length: indices known >= 0, vectorised)
    if tanh_form:
        for i in range(x.size):
            xc = min(max(x[i], -_CLIP32), _CLIP32)
            y[i] = x[i] * sigmoid32(F(2.0) * _K32 * (xc + _C32 * xc * xc * xc))
    else:
        for i in range(x.size):
            y[i] = x[i] * phi32(x[i])


@njit(nogil=True, fastmath=FASTMATH, error_model="numpy", cache=True)
def _backward32(dx, x, dy, tanh_form, start, stop):
    dx, x, dy = dx[start:stop], x[start:stop], dy[start:stop]
    if tanh_form:
        for i in range(x.size):
            xc = min(max(x[i], -_CLIP32), _CLIP32)
            s = sigmoid32(F(2.0) * _K32 * (xc + _C32 * xc * xc * xc))
            du = _K32 * (F(1.0) + F(3.0) * _C32 * xc * xc)
            dx[i] = dy[i] * (s + F(2.0) * xc * s * (F(1.0) - s) * du)
    else:
        for i in range(x.size):
            v = x[i]
            dx[i] = dy[i] * (phi32(v) + v * exp32(F(-0.5) * v * v) * _INV_SQRT_2PI_32)


@njit(nogil=True, error_model="numpy", cache=True)
def _forward64(y, x, tanh_form, start, stop):
    y, x = y[start:stop], x[start:stop]
    for i in range(x.size):
        v = x[i]
        if tanh_form:
            xc = min(max(v, -TANH_CLIP), TANH_CLIP)
            y[i] = 0.5 * v * (1.0 + math.tanh(SQRT_2_OVER_PI * (xc + TANH_CUBIC * xc * xc * xc)))
        else:
            y[i] = v * phi64(v)


@njit(nogil=True, error_model="numpy", cache=True)
def _backward64(dx, x, dy, tanh_form, start, stop):
    dx, x, dy = dx[start:stop], x[start:stop], dy[start:stop]
    for i in range(x.size):
        v = x[i]
        if tanh_form:
            xc = min(max(v, -TANH_CLIP), TANH_CLIP)
            t = math.tanh(SQRT_2_OVER_PI * (xc + TANH_CUBIC * xc * xc * xc))
            du = SQRT_2_OVER_PI * (1.0 + 3.0 * TANH_CUBIC * xc * xc)
            dx[i] = dy[i] * (0.5 * (1.0 + t) + 0.5 * xc * (1.0 - t * t) * du)
        else:
            dx[i] = dy[i] * (phi64(v) + v * math.exp(-0.5 * v * v) * INV_SQRT_2PI)


def gelu_forward(x, approximate: str = "none"):
    one_of(approximate, "approximate", APPROXIMATIONS)
    xf = x.ravel()                                       # (n,) contiguous (a copy only if x is not)
    y = numpy.empty_like(xf)
    kernel = _forward32 if x.dtype == numpy.float32 else _forward64
    over_rows(kernel, xf.size, 1, y, xf, approximate == "tanh")
    return y.reshape(x.shape), GeluCache(x, approximate)


def gelu_backward(dy, cache):
    x, approximate = cache.x, cache.approximate
    expect_grad(dy, "dy", x.shape, x.dtype)
    xf, dyf = x.ravel(), dy.ravel()                      # (n,), (n,) contiguous
    dx = numpy.empty_like(xf)
    kernel = _backward32 if x.dtype == numpy.float32 else _backward64
    over_rows(kernel, xf.size, 1, dx, xf, dyf, approximate == "tanh")
    return dx.reshape(x.shape)
