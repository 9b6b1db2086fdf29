"""The optimiser as one kernel launch (reference: :mod:`npformer.ops.optim`).

    adam_update:     m, v, p (and the float16 or bfloat16 copy of p, under mixed precision, whose
                     16-bit gradients it may read with their scale) in one pass over the arrays: a
                     whole flat buffer (:mod:`npformer.nn.flat`) in one launch, where the reference
                     runs a dozen CuPy kernels, and the plain optimiser a dozen per parameter
    sum_of_squares:  sum x^2 in float64 (gradient clipping's norm, mixed precision's finite check):
                     one launch of block partial sums (a fixed grid, so a fixed order of additions)
                     and one sum of at most SQUARES_BLOCKS partials

Adam's arithmetic is the reference's, operation by operation in the parameter's dtype (float32 or
float64; float16 parameters take the reference), without fused multiply-adds: the same bits as the
reference op, with one exception in float32. CuPy compiles every module with ``-ftz=true``, after
npformer's own options (NVRTC takes the last, and CuPy offers no way around it), so float32
denormals, |x| < 1.18e-38, are flushed to zero wherever they are read or made: a float32 parameter,
gradient or moment that small (or an update that makes one) gives 0 where NumPy keeps the denormal.
Float64 is not flushed. tests/kernels/cuda/test_compile.py checks this against the PTX NVRTC makes.
The CUDA C is in :mod:`npformer.kernels.cuda.optim_source`.
"""
from __future__ import annotations

import numpy

from npformer.checks import expect_float, expect_shape
from npformer.kernels.cuda.optim_source import SQUARES_THREADS
from npformer.kernels.cuda.runtime import contiguous, device_floats, device_xp, kernel, launch_elements
from npformer.ops.optim import adam_corrections, check_update_arrays

__all__ = ["adam_update", "sum_of_squares", "accepts_adam", "SQUARES_BLOCKS"]

SQUARES_BLOCKS = 1024   # most blocks (and partial sums) of one sum_of_squares launch
_ADAM_DTYPES = (numpy.dtype(numpy.float32), numpy.dtype(numpy.float64))
# the model weights' dtype -> the entry point that writes them (optim.cu), reading float32 gradients or
# the model's own 16-bit ones (mixed precision's masters stepping with the model's gradients); float16
# also without a copy
_COPY_ENTRIES = {"float16": "adam_update", "bfloat16": "adam_bf16_copy_update"}
_GRAD_ENTRIES = {"float16": "adam_f16_grad_update", "bfloat16": "adam_bf16_grad_update"}


def accepts_adam(param, grad, exp_avg, exp_avg_sq, *, param_copy=None, **hyperparameters) -> bool:
    """C-contiguous CuPy float32/float64 arrays of one dtype; a copy, if any, float16 or bfloat16 of a
    float32 parameter (mixed precision's masters and model), C-contiguous, of the parameter's shape;
    the gradient of the parameter's dtype, or of the copy's (the model's gradients)."""
    arrays = (param, grad, exp_avg, exp_avg_sq)
    if not (device_floats(param, exp_avg, exp_avg_sq) and device_floats(grad) and param.dtype in _ADAM_DTYPES
            and all(a.flags.c_contiguous and a.shape == param.shape for a in arrays)):
        return False
    if param_copy is None:
        return grad.dtype == param.dtype
    return (device_floats(param_copy) and param_copy.dtype.name in _COPY_ENTRIES and param.dtype == numpy.float32
            and param_copy.flags.c_contiguous and param_copy.shape == param.shape
            and grad.dtype in (param.dtype, param_copy.dtype))


def adam_update(param, grad, exp_avg, exp_avg_sq, *, step: int, lr: float, beta1: float, beta2: float,
                eps: float, weight_decay: float = 0.0, decoupled: bool = False, param_copy=None,
                grad_scale: float = 1.0) -> None:
    """One Adam/AdamW step in place, as the reference op (its arguments and checks)."""
    check_update_arrays(param, grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
    if param_copy is not None:
        expect_shape(param_copy, "param_copy", tuple(param.shape), "(the parameter's shape)")
    bias2, step_size = adam_corrections(param.dtype, step, lr, beta1, beta2, eps, weight_decay, grad_scale)
    xp = device_xp(param, grad, exp_avg, exp_avg_sq, param_copy)
    if param.size == 0:
        return
    t = param.dtype.type                 # each Python number rounded to the dtype, as NumPy does
    copy = param_copy if param_copy is not None else xp.empty(1, dtype=numpy.float16)   # stand-in, unread
    l2, decoupled_decay = weight_decay != 0 and not decoupled, weight_decay != 0 and decoupled
    if param_copy is None:
        entry = "adam_update"
    else:
        entries = _GRAD_ENTRIES if grad.dtype != param.dtype else _COPY_ENTRIES
        entry = entries[param_copy.dtype.name]
    launch_elements(entry, param.dtype, param.size, (
        param, grad, exp_avg, exp_avg_sq, copy, numpy.int64(param.size), t(grad_scale),
        t(beta1), t(1.0 - beta1), t(beta2), t(1.0 - beta2), t(weight_decay), t(1.0 - lr * weight_decay),
        t(bias2), t(eps), t(step_size),
        numpy.int32(l2), numpy.int32(decoupled_decay), numpy.int32(param_copy is not None)))


def sum_of_squares(x):
    """``sum x^2`` in float64, a 0-d array, as the reference op."""
    expect_float(x, "x")
    xp = device_xp(x)
    x = contiguous(xp, x)
    blocks = max(1, min(-(-x.size // SQUARES_THREADS), SQUARES_BLOCKS))
    part = xp.empty(blocks, dtype=numpy.float64)        # (blocks,)
    kernel("sum_squares", x.dtype)((blocks,), (SQUARES_THREADS,), (x, part, numpy.int64(x.size)))
    return xp.asarray(part.sum(), dtype=numpy.float64)   # ()
