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
Both GELUs run as one chain of in-place ufuncs per cache-sized block of the array
(:func:`npformer.backend.blocks.blockwise`), so no full-size intermediate is ever allocated.
ReLU is ``maximum(x, 0)`` (NaN stays NaN, as PyTorch) and its backward ``dy * [x > 0]``: a mask
multiply, many times faster than ``where`` with a data-dependent mask.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

from npformer.backend import accumulation_dtype, erf, get_array_module
from npformer.backend.blocks import blockwise
from npformer.ops import fused
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
    return xp.maximum(x, 0), ReluCache(x > 0)


def relu_backward(dy, cache: ReluCache):
    # fwd: y = max(x, 0)  ->  dx = dy * [x > 0]
    return dy * cache.positive


def gelu_forward(x, approximate: str = "none"):
    """``approximate`` is ``"none"`` (erf) or ``"tanh"``, as PyTorch's argument."""
    if fused.use_fused(x) and approximate in ("none", "tanh"):   # CuPy: one element-wise kernel
        return fused.gelu_forward(x, approximate)
    expect_float(x, "x")
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    xp = get_array_module(x)
    xa = x.astype(accumulation_dtype(x.dtype), copy=False)
    block = _gelu_erf_block if approximate == "none" else _gelu_tanh_block
    y = blockwise(block, xp.empty_like(xa), xa)          # (...)
    return y.astype(x.dtype, copy=False), GeluCache(x, approximate)


def _gelu_erf_block(y, x):
    """y = x Phi(x) = x (1 + erf(x / sqrt 2)) / 2, in y."""
    xp = get_array_module(x)
    erf(xp.multiply(x, _INV_SQRT_2, out=y), out=y)      # erf(x / sqrt 2)
    y += 1.0
    y *= 0.5                                             # Phi(x)
    y *= x


def _gelu_tanh_block(y, x):
    """y = x/2 (1 + tanh(u)), in y."""
    _tanh_of_arg(x, y)                                   # tanh(u)
    y += 1.0
    y *= 0.5
    y *= x


def _tanh_of_arg(x, out):
    """tanh(u), u = sqrt(2/pi) (x + 0.044715 x^3) on x clipped to [-100, 100] (tanh is exactly +-1
    beyond); returns the clipped x too."""
    xp = get_array_module(x)
    xc = xp.clip(x, -100.0, 100.0)
    xp.multiply(xc, xc, out=out)
    out *= _C
    out += 1.0
    out *= xc
    out *= _SQRT_2_OVER_PI                               # u
    return xp.tanh(out, out=out), xc


def gelu_backward(dy, cache: GeluCache):
    if fused.use_fused(dy, cache.x):
        return fused.gelu_backward(dy, cache)
    x, approximate = cache
    xp = get_array_module(dy, x)
    x = x.astype(accumulation_dtype(x.dtype), copy=False)
    block = _gelu_erf_grad_block if approximate == "none" else _gelu_tanh_grad_block
    d = blockwise(block, xp.empty_like(x), x, dy)        # (...)
    return d.astype(dy.dtype, copy=False)


def _gelu_erf_grad_block(d, x, dy):
    # fwd: y = x Phi(x)  ->  dx = dy * (Phi(x) + x phi(x))
    xp = get_array_module(x)
    erf(xp.multiply(x, _INV_SQRT_2, out=d), out=d)
    d += 1.0
    d *= 0.5                                             # Phi(x)
    g = x * x
    g *= -0.5
    xp.exp(g, out=g)
    g *= x
    g *= _INV_SQRT_2PI                                   # x phi(x)
    d += g
    d *= dy


def _gelu_tanh_grad_block(d, x, dy):
    # fwd: y = x/2 (1 + tanh(u))  ->  dx = dy * (1/2 (1 + t) + x/2 (1 - t^2) du/dx)
    xp = get_array_module(x)
    t, xc = _tanh_of_arg(x, xp.empty_like(x))
    xp.multiply(t, t, out=d)
    xp.subtract(1.0, d, out=d)                           # 1 - t^2
    du = xc * xc
    du *= 3.0 * _C
    du += 1.0
    du *= _SQRT_2_OVER_PI                                # du/dx
    d *= du
    d *= xc
    d *= 0.5
    t += 1.0
    t *= 0.5
    d += t
    d *= dy
