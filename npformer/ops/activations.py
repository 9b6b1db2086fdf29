"""Element-wise activations: ReLU and GELU (exact and tanh approximation), as ``torch.nn.functional``.

    relu(x) = max(x, 0)                          drelu = dy * [x > 0]   (0 at x = 0, as PyTorch)
    gelu(x) = x * Phi(x),  Phi(x) = (1 + erf(x / sqrt 2)) / 2     (Hendrycks and Gimpel 2016)
        dgelu = dy * (Phi(x) + x * phi(x)),       phi(x) = exp(-x^2 / 2) / sqrt(2 pi)
    gelu_tanh(x) = x/2 * (1 + tanh(u)),  u = sqrt(2/pi) * (x + 0.044715 x^3)
        dgelu_tanh = dy * (1/2 (1 + t) + x/2 (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)),  t = tanh(u)

The caches keep ``x`` (ReLU keeps its boolean mask); the GELU backward recomputes Phi or tanh
rather than storing a second array. GELU computes 16-bit inputs in float32 (``x^3`` overflows
float16 from |x| > 40) and evaluates the tanh polynomial on x clipped to [-100, 100], where
tanh is already exactly +-1 and 1 - t^2 exactly 0, so no inf * 0 can appear for any finite x.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

from npformer.backend import accumulation_dtype, erf, get_array_module
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
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    xp = get_array_module(x)
    xa = x.astype(accumulation_dtype(x.dtype), copy=False)
    if approximate == "none":
        phi_cdf = erf(xa * _INV_SQRT_2)                  # (...)
        phi_cdf += 1.0
        phi_cdf *= 0.5
        y = xa * phi_cdf
    else:
        t = xp.tanh(_tanh_arg(xa, xp))
        t += 1.0
        y = 0.5 * xa * t
    return y.astype(x.dtype, copy=False), GeluCache(x, approximate)


def _tanh_arg(x, xp):
    """sqrt(2/pi) (x + 0.044715 x^3) on x clipped to [-100, 100] (tanh is exactly +-1 beyond)."""
    xc = xp.clip(x, -100.0, 100.0)
    return _SQRT_2_OVER_PI * xc * (1.0 + _C * (xc * xc))


def gelu_backward(dy, cache: GeluCache):
    x, approximate = cache
    xp = get_array_module(dy, x)
    x = x.astype(accumulation_dtype(x.dtype), copy=False)
    if approximate == "none":
        # fwd: y = x Phi(x)  ->  dx = dy * (Phi(x) + x phi(x))
        d = erf(x * _INV_SQRT_2)
        d += 1.0
        d *= 0.5
        d += x * xp.exp(-0.5 * x * x) * _INV_SQRT_2PI
    else:
        # fwd: y = x/2 (1 + tanh(u))  ->  dx = dy * (1/2 (1 + t) + x/2 (1 - t^2) du/dx)
        xc = xp.clip(x, -100.0, 100.0)
        t = xp.tanh(_tanh_arg(x, xp))
        d = 0.5 * xc * (1.0 - t * t) * (_SQRT_2_OVER_PI * (1.0 + 3.0 * _C * (xc * xc)))
        d += 0.5 * (1.0 + t)
    d *= dy
    return d.astype(dy.dtype, copy=False)
