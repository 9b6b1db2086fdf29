"""The optimisers' update rules, element by element, over one array or a whole flat buffer.

    Adam:   g = g + wd p (L2, Adam)  or  p = p (1 - lr wd) (decoupled, AdamW: Loshchilov & Hutter 2019)
            m = b1 m + (1 - b1) g,   v = b2 v + (1 - b2) g^2
            p = p - lr/(1 - b1^t) * m / (sqrt(v)/sqrt(1 - b2^t) + eps)
    SGD:    d = g + wd p;  buf = d (first step) | momentum buf + (1 - dampening) d
            d = d + momentum buf (nesterov) | buf;   p = p - lr d
    norm:   sum_of_squares(g) = sum_i g_i^2, in float64, in a fixed order (below)

Sources: the algorithm boxes of torch.optim.Adam/AdamW/SGD; Adam is evaluated in torch's order
(the bias corrections applied to sqrt(v) and to the step size, not to m and v).

The gradient an update reads is ``g = grad * grad_scale`` (:func:`scaled_grad`), converted to the
parameter's dtype first: mixed precision's float32 masters step with the model's 16-bit gradients
and the factor 1 / S (S the loss scale) times the clipping factor, so no float32 copy of the
gradients is made or kept (torch's fused optimisers take the scale the same way). S is a power of two,
so ``float32(grad) * (c / S)`` has the bits of ``float32(grad) / S`` then ``* c``: one rounding.

Unlike the other ops these update their arguments in place (``param``, the moments and
``param_copy``): an optimiser step rewrites the parameters, and fresh arrays would double the
memory. They are element-wise, so one call over a flat buffer (:mod:`npformer.nn.flat`) gives
exactly what one call per parameter gives, and the arithmetic runs in the arrays' dtype with each
Python number rounded to it first (NumPy's rule for a Python scalar), operation by operation as
written. A CUDA kernel (:mod:`npformer.kernels.cuda.optim`) does ``adam_update`` in one launch.

The order of the sum of squares is part of its definition, so that every CPU implementation gives
the same bits on every CPU (a vectorising compiler or NumPy's pairwise sum would let the vector
width of the machine or the library's version choose it): element i's square goes to lane
i mod SQUARES_LANES, each lane adds its squares in index order starting from 0, and the lanes are
then added in pairs, (l0 + l1), (l2 + l3), ..., halving until one is left. The CUDA kernel has its
own fixed order (a fixed grid of partial sums), the same from run to run on any GPU.
"""
from __future__ import annotations

import math
from typing import Any

from npformer.backend import get_array_module, is_float_dtype
from npformer.checks import (checked_by_caller, describe, expect_float, expect_same_dtype, expect_shape,
                             positive_in_dtype, positive_int, real)
from npformer.dispatch import dispatched
from npformer.errors import InputTypeError

__all__ = ["adam_update", "sgd_update", "sum_of_squares", "check_update_arrays", "grad_dtype_fits", "scaled_grad",
           "RULES", "PAIRS", "hyperparameter", "adam_corrections", "add_squares_to_lanes", "sum_lanes",
           "SQUARES_CHUNK", "SQUARES_LANES"]

SQUARES_CHUNK = 1 << 20     # elements converted to float64 at a time by sum_of_squares (8 MB)
SQUARES_LANES = 64          # the sum's lanes (module docstring); SQUARES_CHUNK is a multiple of it
INF = math.inf
# hyperparameter -> (low, high, low excluded, high excluded): the update ops' checks and the optimisers'
# (npformer.training.optim checks every group by them); a pair (PAIRS) is checked per item
RULES = {"lr": (0, INF, False, False), "weight_decay": (0, INF, False, False),
         "momentum": (0, INF, False, False), "dampening": (0, 1, False, False),
         "betas": (0, 1, False, True), "eps": (0, INF, True, False)}
PAIRS = ("betas",)          # hyperparameters given as a pair, each item checked by its rule


def hyperparameter(v: Any, name: str, rule: str | None = None) -> float:
    """``v`` as a ``float`` within the bounds of ``RULES[rule or name]`` (``rule``: "betas" for one
    of the pair, named "beta1" or "betas[0]")."""
    low, high, low_open, high_open = RULES[rule or name]
    return real(v, name, low, high, low_open=low_open, high_open=high_open)


def adam_corrections(dtype, step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                     grad_scale: float) -> tuple[float, float]:
    """The checks of :func:`adam_update`'s numbers, which every implementation runs before it writes
    anything: each by the optimisers' :data:`RULES` (betas in [0, 1), eps > 0 and still > 0 in the
    parameter's ``dtype``), ``step`` an int >= 1, ``grad_scale`` >= 0. Returns the bias corrections
    sqrt(1 - b2^t) and lr / (1 - b1^t), both finite and the second's divisor > 0 once checked."""
    step = positive_int(step, "step")
    lr = hyperparameter(lr, "lr")
    beta1, beta2 = hyperparameter(beta1, "beta1", "betas"), hyperparameter(beta2, "beta2", "betas")
    positive_in_dtype(hyperparameter(eps, "eps"), "eps", dtype)
    hyperparameter(weight_decay, "weight_decay")
    real(grad_scale, "grad_scale", 0)
    return math.sqrt(1.0 - beta2 ** step), lr / (1.0 - beta1 ** step)


def check_update_arrays(param, grad, **arrays) -> None:
    """An update's arrays (None: absent) all have the parameter's shape and float dtype; ``grad`` may
    also be float16 or bfloat16 for a wider parameter (mixed precision's gradients of float32 masters)."""
    expect_float(param, "param")
    for name, a in {"grad": grad, **arrays}.items():
        if a is not None:
            expect_shape(a, name, tuple(param.shape), "(the parameter's shape)")
    expect_same_dtype(param=param, **arrays)
    if grad.dtype != param.dtype and not checked_by_caller():
        expect_float(grad, "grad")
        if not grad_dtype_fits(grad.dtype, param.dtype):
            raise InputTypeError(f"grad: expected {param.dtype} (the parameter's), or float16 or bfloat16 for a "
                                 f"wider parameter, got {describe(grad)}")


def grad_dtype_fits(grad_dtype, dtype) -> bool:
    """A gradient of ``grad_dtype`` can update a parameter of ``dtype``: the same dtype, or a 16-bit
    float gradient of a wider parameter (mixed precision's)."""
    return grad_dtype == dtype or (is_float_dtype(grad_dtype) and grad_dtype.itemsize == 2 < dtype.itemsize)


def scaled_grad(grad, param, grad_scale: float):
    """``grad * grad_scale`` in the parameter's dtype (``grad`` itself when there is nothing to do)."""
    if grad.dtype == param.dtype and grad_scale == 1.0:
        return grad
    g = grad.astype(param.dtype)                                    # (same as p), fresh
    if grad_scale != 1.0:
        g *= grad_scale                                             # rounded once, in p's dtype
    return g


@dispatched
def adam_update(param: Any, grad: Any, exp_avg: Any, exp_avg_sq: Any, *, step: int, lr: float, beta1: float,
                beta2: float, eps: float, weight_decay: float = 0.0, decoupled: bool = False,
                param_copy: Any = None, grad_scale: float = 1.0) -> None:
    """One Adam (``decoupled=False``, L2 in the gradient) or AdamW step, in place; ``step`` is t >= 1,
    the number of this update. ``param_copy`` (optional, the parameter's shape, another dtype)
    receives the new parameter rounded to its dtype: mixed precision's 16-bit model weights. The
    gradient is ``grad * grad_scale`` (:func:`scaled_grad`). Every argument is checked before anything
    is written (:func:`adam_corrections`)."""
    check_update_arrays(param, grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
    if param_copy is not None:
        expect_shape(param_copy, "param_copy", tuple(param.shape), "(the parameter's shape)")
    bias2, step_size = adam_corrections(param.dtype, step, lr, beta1, beta2, eps, weight_decay, grad_scale)
    xp = get_array_module(param, grad, exp_avg, exp_avg_sq)
    grad = scaled_grad(grad, param, grad_scale)                     # (same as p)
    if weight_decay != 0 and not decoupled:
        grad = param * weight_decay + grad                          # (same as p), Adam: g = g + wd p
    elif weight_decay != 0:
        param *= 1.0 - lr * weight_decay                            # AdamW: p = p - lr wd p, first
    tmp = xp.empty_like(param)                                      # (same as p), the one scratch array
    exp_avg *= beta1                                                # m = b1 m + (1 - b1) g
    exp_avg += xp.multiply(grad, 1.0 - beta1, out=tmp)
    exp_avg_sq *= beta2                                             # v = b2 v + (1 - b2) g^2
    xp.multiply(grad, grad, out=tmp)
    tmp *= 1.0 - beta2
    exp_avg_sq += tmp
    denom = xp.sqrt(exp_avg_sq, out=tmp)                            # sqrt(v_hat) + eps, v_hat = v/(1 - b2^t)
    denom /= bias2                                                  # sqrt(1 - b2^t)
    denom += eps
    update = xp.divide(exp_avg, denom, out=tmp)                     # lr m_hat / (sqrt(v_hat) + eps)
    update *= step_size                                             # lr / (1 - b1^t)
    param -= update
    if param_copy is not None:
        param_copy[...] = param                                     # rounded to the copy's dtype


def sgd_update(param: Any, grad: Any, momentum_buffer: Any, *, lr: float, momentum: float, dampening: float,
               nesterov: bool, weight_decay: float, first: bool, param_copy: Any = None,
               grad_scale: float = 1.0) -> None:
    """One SGD step, in place. ``momentum_buffer`` is None when ``momentum`` is 0; on the ``first``
    step it is overwritten with d (torch's rule), later it is blended. The gradient is
    ``grad * grad_scale`` (:func:`scaled_grad`). Its numbers are checked by the optimisers' :data:`RULES`
    before anything is written."""
    lr, momentum = hyperparameter(lr, "lr"), hyperparameter(momentum, "momentum")
    dampening, weight_decay = hyperparameter(dampening, "dampening"), hyperparameter(weight_decay, "weight_decay")
    real(grad_scale, "grad_scale", 0)
    check_update_arrays(param, grad, momentum_buffer=momentum_buffer)
    if param_copy is not None:
        expect_shape(param_copy, "param_copy", tuple(param.shape), "(the parameter's shape)")
    grad = scaled_grad(grad, param, grad_scale)                     # (same as p)
    d = param * weight_decay + grad if weight_decay != 0 else grad   # (same as p), d = g + wd p
    if momentum != 0:
        buf = momentum_buffer
        if first:
            buf[...] = d                                            # buf = d
        else:
            buf *= momentum                                         # buf = momentum buf + (1 - dampening) d
            buf += (1.0 - dampening) * d
        d = d + momentum * buf if nesterov else buf                 # (same as p)
    param -= lr * d
    if param_copy is not None:
        param_copy[...] = param                                     # rounded to the copy's dtype


@dispatched
def sum_of_squares(x: Any) -> Any:
    """``sum x^2`` over every element, in float64 (a 0-d array): float16/32 squares cannot overflow.
    The additions go in the order the module docstring defines; chunks of SQUARES_CHUNK elements
    keep the float64 temporaries small without changing it."""
    expect_float(x, "x")
    xp = get_array_module(x)
    flat = x.reshape(-1)                                            # (N,)
    lanes = xp.zeros(SQUARES_LANES, dtype=xp.float64)               # (L,)
    for start in range(0, flat.size, SQUARES_CHUNK):
        lanes = add_squares_to_lanes(lanes, flat[start:start + SQUARES_CHUNK].astype(xp.float64))
    return sum_lanes(lanes)


def add_squares_to_lanes(lanes, x64):
    """The lanes after adding the squares of ``x64`` (float64, (n,), a scratch array: overwritten),
    whose first element goes to lane 0: lane j gets x64[j]^2, x64[j + L]^2, ... in that order."""
    xp = get_array_module(x64)
    sq = xp.multiply(x64, x64, out=x64)                             # (n,) squares, rounded once
    full = sq.size - sq.size % SQUARES_LANES
    rows = sq[:full].reshape(-1, SQUARES_LANES)                     # (n / L, L): column j is lane j
    if rows.shape[0]:
        rows[0] += lanes                                            # lane + first square, as a running sum
        lanes = rows.sum(axis=0)                                    # (L,): down each column, row by row
    tail = sq[full:]                                                # (n mod L,): the next squares of lanes 0..
    if tail.size:
        lanes = lanes.copy()
        lanes[:tail.size] += tail
    return lanes


def sum_lanes(lanes):
    """Lanes added in pairs, (l0 + l1), (l2 + l3), ..., halving to one (a 0-d array)."""
    while lanes.size > 1:
        lanes = lanes[0::2] + lanes[1::2]
    return lanes.reshape(())
