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
ReLU is ``maximum(x, 0)``: NaN stays NaN, as in PyTorch.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

from npformer.backend import accumulation_dtype, erf, get_array_module
from npformer.checks import expect_float, expect_grad, one_of
from npformer.dispatch import dispatched

__all__ = ["APPROXIMATIONS", "ReluCache", "GeluCache", "relu_forward", "relu_backward", "gelu_forward",
           "gelu_backward"]

APPROXIMATIONS = ("none", "tanh")      # GELU's ``approximate`` argument, as PyTorch's
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
INV_SQRT_2 = 1.0 / math.sqrt(2.0)
INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
TANH_CUBIC = 0.044715                  # the cubic coefficient of u
TANH_CLIP = 100.0                      # |x| beyond which tanh(u) is exactly +-1 in float64


class ReluCache(NamedTuple):
    positive: Any    # bool, x > 0
    dtype: Any       # x's dtype


class GeluCache(NamedTuple):
    x: Any
    approximate: str
    cdf: Any = None  # the forward's y / x (Phi(x), or (1 + tanh(u)) / 2), where a fast path keeps it


@dispatched
def relu_forward(x):
    expect_float(x, "x")
    xp = get_array_module(x)
    return xp.maximum(x, 0), ReluCache(x > 0, x.dtype)


@dispatched
def relu_backward(dy, cache: ReluCache):
    expect_grad(dy, "dy", cache.positive.shape, cache.dtype)
    # fwd: y = max(x, 0)  ->  dx = dy * [x > 0]
    return dy * cache.positive


def _tanh_u(x):
    """(tanh(u), x clipped to [-100, 100]) with u = sqrt(2/pi) (x + 0.044715 x^3) of the clipped x."""
    xp = get_array_module(x)
    xc = xp.clip(x, -TANH_CLIP, TANH_CLIP)
    return xp.tanh(SQRT_2_OVER_PI * (xc + TANH_CUBIC * xc * xc * xc)), xc


@dispatched
def gelu_forward(x, approximate: str = "none"):
    """``approximate`` is ``"none"`` (erf) or ``"tanh"``, as PyTorch's argument."""
    expect_float(x, "x")
    one_of(approximate, "approximate", APPROXIMATIONS)
    xa = x.astype(accumulation_dtype(x.dtype), copy=False)
    if approximate == "none":
        y = xa * (0.5 * (1.0 + erf(xa * INV_SQRT_2)))            # x Phi(x)
    else:
        y = 0.5 * xa * (1.0 + _tanh_u(xa)[0])                    # x/2 (1 + tanh(u))
    return y.astype(x.dtype, copy=False), GeluCache(x, approximate)


@dispatched
def gelu_backward(dy, cache: GeluCache):
    x, approximate = cache.x, cache.approximate
    expect_grad(dy, "dy", x.shape, x.dtype)
    xp = get_array_module(dy, x)
    xa = x.astype(accumulation_dtype(x.dtype), copy=False)
    if approximate == "none":
        # fwd: y = x Phi(x)  ->  dx = dy * (Phi(x) + x phi(x))
        cdf = 0.5 * (1.0 + erf(xa * INV_SQRT_2))                 # Phi(x)
        pdf = xp.exp(-0.5 * xa * xa) * INV_SQRT_2PI              # phi(x)
        dx = dy * (cdf + xa * pdf)
    else:
        # fwd: y = x/2 (1 + tanh(u))  ->  dx = dy * (1/2 (1 + t) + x/2 (1 - t^2) du/dx)
        t, xc = _tanh_u(xa)
        du = SQRT_2_OVER_PI * (1.0 + 3.0 * TANH_CUBIC * xc * xc)
        dx = dy * (0.5 * (1.0 + t) + 0.5 * xc * (1.0 - t * t) * du)
    return dx.astype(dy.dtype, copy=False)
