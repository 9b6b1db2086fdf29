"""The optimiser's update and sum of squares for NumPy, block by block (reference: :mod:`npformer.ops.optim`).

Over a whole flat buffer the reference's dozen ufunc calls are a dozen passes over memory and a
full-size scratch array (on Linux, fresh pages faulted in on every step). Here the same calls run
on blocks of about 64K elements (256K when threads share them:
:func:`~npformer.kernels.cpu.blocks.blockwise`), each block's parameter, gradient, moments and
scratch staying in cache through the whole formula. The operations are the reference's, in its
order and precision, so the bits are the same.
"""
from __future__ import annotations

import numpy

from npformer.checks import expect_float, expect_shape
from npformer.kernels.cpu import numpy_floats
from npformer.kernels.cpu.blocks import BLOCK_ELEMENTS, blockwise
from npformer.ops.optim import (SQUARES_LANES, adam_corrections, add_squares_to_lanes, check_update_arrays, scaled_grad,
                                sum_lanes)

__all__ = ["adam_update", "sum_of_squares", "accepts_adam"]


def accepts_adam(param, grad, exp_avg, exp_avg_sq, *, param_copy=None, **hyperparameters) -> bool:
    """NumPy float arrays, C-contiguous (the blocks are flat slices)."""
    arrays = [a for a in (param, grad, exp_avg, exp_avg_sq, param_copy) if a is not None]
    return numpy_floats(*arrays) and all(a.flags.c_contiguous for a in arrays)


def adam_update(param, grad, exp_avg, exp_avg_sq, *, step: int, lr: float, beta1: float, beta2: float,
                eps: float, weight_decay: float = 0.0, decoupled: bool = False, param_copy=None,
                grad_scale: float = 1.0) -> None:
    """One Adam/AdamW step in place, as the reference op (its arguments and checks)."""
    check_update_arrays(param, grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
    if param_copy is not None:
        expect_shape(param_copy, "param_copy", tuple(param.shape), "(the parameter's shape)")
    bias2, step_size = adam_corrections(param.dtype, step, lr, beta1, beta2, eps, weight_decay, grad_scale)
    l2, decay = weight_decay != 0 and not decoupled, weight_decay != 0 and decoupled

    def block(p, g, m, v, *copy):
        g = scaled_grad(g, p, grad_scale)                           # g = grad * grad_scale, in p's dtype
        tmp = numpy.empty_like(p)
        if l2:
            g = numpy.add(numpy.multiply(p, weight_decay), g)       # g = p wd + g (a block-sized array)
        if decay:
            p *= 1.0 - lr * weight_decay
        m *= beta1                                                  # m = b1 m + (1 - b1) g
        m += numpy.multiply(g, 1.0 - beta1, out=tmp)
        v *= beta2                                                  # v = b2 v + (1 - b2) g^2
        numpy.multiply(g, g, out=tmp)
        tmp *= 1.0 - beta2
        v += tmp
        numpy.sqrt(v, out=tmp)                                      # sqrt(v)/sqrt(1 - b2^t) + eps
        tmp /= bias2
        tmp += eps
        numpy.divide(m, tmp, out=tmp)                               # lr/(1 - b1^t) m / denom
        tmp *= step_size
        p -= tmp
        if copy:
            copy[0][...] = p

    blockwise(block, param, grad, exp_avg, exp_avg_sq, *([] if param_copy is None else [param_copy]))


def sum_of_squares(x):
    """``sum x^2`` in float64 (a 0-d array), block by block in cache, in the reference's order of
    additions (its lanes carried from block to block: the same bits; no BLAS call)."""
    expect_float(x, "x")
    flat = x.reshape(-1)                                            # (N,)
    lanes = numpy.zeros(SQUARES_LANES, dtype=numpy.float64)         # (L,)
    for start in range(0, flat.size, BLOCK_ELEMENTS):
        lanes = add_squares_to_lanes(lanes, flat[start:start + BLOCK_ELEMENTS].astype(numpy.float64))
    return sum_lanes(lanes)
