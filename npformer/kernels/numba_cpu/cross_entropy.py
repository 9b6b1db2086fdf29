"""Cross-entropy forward and backward, one compiled pass over each row of logits each (reference:
:mod:`npformer.ops.cross_entropy`, whose semantics and cache these keep).

Forward, per row: the maximum, ``sum exp(z - max)`` in one pass (and ``sum (z - max)`` in another
with label smoothing), then the row's loss from the target's logit, ``log p_t = (z_t - max) -
log_sum`` in the reference's order; nothing of size (N, V) is written. Backward, per
row: ``dz = (p - q) dloss / N_valid`` with ``p = exp((z - shift) - log_sum)`` recomputed as forward
defined it, written straight into the gradient. Loss reductions are NumPy's sums over the (N,) row
losses, as the reference. 16-bit logits (float16, bfloat16) are taken too, through a float32 copy
made for each pass and dropped after it, as the reference computes them: the cache keeps the 16-bit
logits, and the gradient is rounded once to their dtype.
"""
from __future__ import annotations

import math

import numpy
from numba import njit

from npformer.backend import accumulation_dtype, is_float_dtype
from npformer.checks import expect_grad
from npformer.kernels.numba_cpu import AVAILABLE
from npformer.kernels.numba_cpu.rows import CHEAP, over_rows
from npformer.kernels.numba_cpu.softmax import row_max
from npformer.kernels.numba_cpu.vector_math import FASTMATH, vexp
from npformer.ops.cross_entropy import CrossEntropyCache, check_cross_entropy_inputs, loss_divisor, reduce_losses

__all__ = ["accepts", "cross_entropy_forward", "cross_entropy_backward"]


def accepts(*arrays) -> bool:
    """NumPy float arrays, 16-bit ones included (logits; dloss): the loops run in their accumulation
    dtype, float32 for 16-bit logits, as the reference's arithmetic does."""
    return AVAILABLE and all(type(a) is numpy.ndarray and is_float_dtype(a.dtype) for a in arrays)


@njit(nogil=True, fastmath=FASTMATH, error_model="numpy", cache=True)
def _forward_rows(nll, shift, log_sum, z, targets, valid, smoothing, start, stop):
    v = z.shape[1]
    for r in range(start, stop):
        zr = z[r]
        m = row_max(zr)
        s = zr.dtype.type(0)
        for j in range(v):
            s += vexp(zr[j] - m)
        ls = math.log(s) if s > 0 else zr.dtype.type(0)
        shift[r], log_sum[r] = m, ls
        if not valid[r]:
            nll[r] = 0
            continue
        picked = (zr[targets[r]] - m) - ls             # log p_t
        if smoothing == 0:
            nll[r] = -picked
        else:
            total = zr.dtype.type(0)
            for j in range(v):
                total += zr[j] - m                     # (each <= 0: sum z - V m would cancel, or overflow)
            sum_logp = total - v * ls                  # sum_j log p_j = sum_j (z_j - m) - V log s
            nll[r] = -(1 - smoothing) * picked - (smoothing / v) * sum_logp


@njit(nogil=True, fastmath=FASTMATH, error_model="numpy", cache=True)
def _backward_rows(dz, z, shift, log_sum, targets, scale, smoothing, start, stop):
    v = z.shape[1]
    uniform = smoothing / z.dtype.type(v)              # (in the logits' dtype: float32 loops stay float32)
    for r in range(start, stop):
        zr, dzr, a = z[r], dz[r], scale[r]
        m, ls = shift[r], log_sum[r]
        for j in range(v):
            dzr[j] = (vexp((zr[j] - m) - ls) - uniform) * a
        dzr[targets[r]] -= (1 - smoothing) * a


def cross_entropy_forward(logits, targets, *, reduction: str = "mean", ignore_index: int = -100,
                          label_smoothing: float = 0.0, loss_dtype=None):
    safe_t, valid, s, loss_dt = check_cross_entropy_inputs(logits, targets, reduction, ignore_index,
                                                           label_smoothing, loss_dtype)
    v = logits.shape[-1]
    dt = accumulation_dtype(logits.dtype)
    z = numpy.ascontiguousarray(logits, dtype=dt).reshape(-1, v)     # (N, V) (a float32 copy of 16-bit logits)
    n = z.shape[0]
    nll, shift, log_sum = numpy.empty(n, dt), numpy.empty((n, 1), dt), numpy.empty((n, 1), dt)
    over_rows(_forward_rows, n, v, nll, shift[:, 0], log_sum[:, 0], z, safe_t.reshape(-1), valid.reshape(-1),
              dt.type(s), per_thread=CHEAP)
    lead = logits.shape[:-1]
    loss = reduce_losses(nll.reshape(lead), valid, reduction)          # () or (...)
    cache = CrossEntropyCache(logits, shift.reshape(lead + (1,)), log_sum.reshape(lead + (1,)), safe_t, valid,
                              s, reduction, logits.dtype, loss_dt)
    return numpy.asarray(loss).astype(loss_dt), cache


def cross_entropy_backward(dloss, cache: CrossEntropyCache):
    logits, shift, log_sum, t, valid, s, reduction, dtype, loss_dtype = cache
    expect_grad(dloss, "dloss", tuple(t.shape) if reduction == "none" else (), loss_dtype,
                f"the loss of reduction={reduction!r}")
    v = logits.shape[-1]
    acc = accumulation_dtype(dtype)
    z = numpy.ascontiguousarray(logits, dtype=acc).reshape(-1, v)   # (N, V)
    n = z.shape[0]
    scale = numpy.where(valid, dloss.astype(acc) / loss_divisor(valid, reduction, acc), 0).astype(acc).reshape(-1)   # (N,)
    shift_rows = numpy.ascontiguousarray(shift, dtype=acc).reshape(-1)
    log_sum_rows = numpy.ascontiguousarray(log_sum, dtype=acc).reshape(-1)
    dz = numpy.empty_like(z)
    over_rows(_backward_rows, n, v, dz, z, shift_rows, log_sum_rows, t.reshape(-1), scale, acc.type(s),
              per_thread=CHEAP)
    del z                                                            # (a 16-bit run's float32 copy)
    return dz.reshape(logits.shape).astype(dtype, copy=False)
