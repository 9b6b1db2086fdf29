"""Adam's update and the sum of squares in one compiled pass over the flat buffers (reference:
:mod:`npformer.ops.optim`).

Adam: each element's parameter, gradient and moments are read once and written once, the
reference's operations in its order, each constant rounded to the arrays' dtype first and no
fused multiply-adds, so the bits are the reference's (tested). The buffer is cut into one run per
thread. Mixed precision's 16-bit ``param_copy`` and gradients take the NumPy fast path.
"""
from __future__ import annotations

import math

import numpy
from numba import njit

from npformer.checks import expect_float
from npformer.kernels.numba_cpu.rows import over_rows
from npformer.ops.optim import SQUARES_LANES, adam_corrections, check_update_arrays, sum_lanes

__all__ = ["adam_update", "sum_of_squares"]


@njit(nogil=True, error_model="numpy", cache=True)     # no fastmath: the reference's roundings, operation by operation
def _adam(p, g, m, v, scale, l2, wd, decay, b1, one_minus_b1, b2, one_minus_b2, bias2, eps, step_size, start, stop):
    p, g, m, v = p[start:stop], g[start:stop], m[start:stop], v[start:stop]
    for i in range(p.size):
        gi = g[i] * scale                                   # exact for scale 1
        gi = p[i] * wd + gi if l2 else gi
        pi = p[i] * decay
        mi = m[i] * b1
        mi = mi + gi * one_minus_b1
        vi = v[i] * b2
        vi = vi + (gi * gi) * one_minus_b2
        denom = math.sqrt(vi) / bias2 + eps
        m[i], v[i] = mi, vi
        p[i] = pi - (mi / denom) * step_size


@njit(nogil=True, error_model="numpy", cache=True)     # no fastmath: the reference's order of additions
def _squares(x, lanes):
    """The reference's lanes (npformer.ops.optim): lane j adds x[j]^2, x[j + L]^2, ... in order (the
    inner loop over the L independent lanes is what vectorises; no sum is reassociated)."""
    n_lanes = lanes.size
    full = x.size - x.size % n_lanes
    for start in range(0, full, n_lanes):
        for j in range(n_lanes):
            xj = numpy.float64(x[start + j])
            lanes[j] += xj * xj
    for j in range(x.size - full):
        xj = numpy.float64(x[full + j])
        lanes[j] += xj * xj


def adam_update(param, grad, exp_avg, exp_avg_sq, *, step: int, lr: float, beta1: float, beta2: float,
                eps: float, weight_decay: float = 0.0, decoupled: bool = False, param_copy=None,
                grad_scale: float = 1.0) -> None:
    """One Adam/AdamW step in place, as the reference op (its arguments and checks)."""
    check_update_arrays(param, grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
    bias2, step_size = adam_corrections(param.dtype, step, lr, beta1, beta2, eps, weight_decay, grad_scale)
    t = param.dtype.type
    l2, decay = weight_decay != 0 and not decoupled, weight_decay != 0 and decoupled
    flat = [a.reshape(-1) for a in (param, grad, exp_avg, exp_avg_sq)]       # (N,) views (C-contiguous)
    over_rows(_adam, flat[0].size, 1, *flat, t(grad_scale), l2, t(weight_decay),
              t(1.0 - lr * weight_decay) if decay else t(1.0), t(beta1), t(1.0 - beta1), t(beta2), t(1.0 - beta2),
              t(bias2), t(eps), t(step_size))


def sum_of_squares(x):
    """``sum x^2`` in float64 (a 0-d array), in one pass, in the reference's order of additions."""
    expect_float(x, "x")
    flat = numpy.ascontiguousarray(x).reshape(-1)
    lanes = numpy.zeros(SQUARES_LANES, numpy.float64)
    _squares(flat, lanes)
    return sum_lanes(lanes)
