"""Element-wise activations: ReLU and GELU (exact and tanh approximation), as ``torch.nn.functional``.

    relu(x) = max(x, 0)                          drelu = dy * [x > 0]   (0 at x = 0, as PyTorch)
    gelu(x) = x * Phi(x),  Phi(x) = (1 + erf(x / sqrt 2)) / 2     (Hendrycks and Gimpel 2016)
        dgelu = dy * (Phi(x) + x * phi(x)),       phi(x) = exp(-x^2 / 2) / sqrt(2 pi)
    gelu_tanh(x) = x/2 * (1 + tanh(u)),  u = sqrt(2/pi) * (x + 0.044715 x^3)
        dgelu_tanh = dy * (1/2 (1 + t) + x/2 (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)),  t = tanh(u)

The caches keep ``x`` (ReLU keeps its boolean mask); the GELU backward recomputes Phi or tanh
rather than storing a second array.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

from npformer.backend import erf, get_array_module
from npformer.ops.checks import expect_float

__all__ = ["ReluCache", "GeluCache", "relu_forward", "relu_backward", "gelu_forward", "gelu_backward"]

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_C = 0.044715


class ReluCache(NamedTuple):
    positive: Any    # bool, x > 0


class GeluCache(NamedTuple):
    x: Any
    approximate: str


def relu_forward(x):
    expect_float(x, "x")
    xp = get_array_module(x)
    positive = x > 0
    return xp.where(positive, x, 0).astype(x.dtype, copy=False), ReluCache(positive)


def relu_backward(dy, cache: ReluCache):
    xp = get_array_module(dy)
    # fwd: y = max(x, 0)  ->  dx = dy * [x > 0]
    return xp.where(cache.positive, dy, 0).astype(dy.dtype, copy=False)


def gelu_forward(x, approximate: str = "none"):
    """``approximate`` is ``"none"`` (erf) or ``"tanh"``, as PyTorch's argument."""
    expect_float(x, "x")
    xp = get_array_module(x)
    if approximate == "none":
        phi_cdf = erf(x * _INV_SQRT_2)                   # (...)
        phi_cdf += 1.0
        phi_cdf *= 0.5
        y = x * phi_cdf
    elif approximate == "tanh":
        t = xp.tanh(_SQRT_2_OVER_PI * (x + _C * (x * x * x)))
        t += 1.0
        y = 0.5 * x * t
    else:
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    return y.astype(x.dtype, copy=False), GeluCache(x, approximate)


def gelu_backward(dy, cache: GeluCache):
    x, approximate = cache
    xp = get_array_module(dy, x)
    if approximate == "none":
        # fwd: y = x Phi(x)  ->  dx = dy * (Phi(x) + x phi(x))
        d = erf(x * _INV_SQRT_2)
        d += 1.0
        d *= 0.5
        d += x * xp.exp(-0.5 * x * x) * _INV_SQRT_2PI
    else:
        # fwd: y = x/2 (1 + tanh(u))  ->  dx = dy * (1/2 (1 + t) + x/2 (1 - t^2) du/dx)
        x2 = x * x
        t = xp.tanh(_SQRT_2_OVER_PI * x * (1.0 + _C * x2))
        d = 0.5 * x * (1.0 - t * t) * (_SQRT_2_OVER_PI * (1.0 + 3.0 * _C * x2))
        d += 0.5 * (1.0 + t)
    d *= dy
    return d.astype(dy.dtype, copy=False)
