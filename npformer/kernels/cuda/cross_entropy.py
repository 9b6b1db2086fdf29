"""Cross-entropy over the vocabulary in one pass per row (reference: :mod:`npformer.ops.cross_entropy`).

Forward, one block per row, one read of its V logits: a running max and sum of exponentials (and,
for label smoothing, of the logits' offsets from the max), combined at the end into the row's
``shift``, ``log_sum`` and loss ``-(1 - s) log p_t - s/V sum_j log p_j``. Nothing of size (N, V) is
written: the cache is the reference's (the logits themselves and the two per-row values).
Backward, one block per row: ``dz_j = (exp((z_j - shift) - log_sum) - s/V - (1 - s)[j = t]) dloss / N``
written straight into ``dz``, the only (N, V) array made. The targets' checks and the reduction of
the N row losses are the reference's (small (N,) arrays).
"""
from __future__ import annotations

import numpy

from npformer.backend import accumulation_dtype
from npformer.checks import expect_grad
from npformer.kernels.cuda.runtime import contiguous, device_xp, launch_rows, rows_of
from npformer.ops.cross_entropy import CrossEntropyCache, check_cross_entropy_inputs, loss_divisor, reduce_losses

__all__ = ["cross_entropy_forward", "cross_entropy_backward"]


def _smoothing_terms(acc, s: float, v: int):
    """(1 - s, s / V) in the accumulation dtype (the reference's Python floats meet acc arrays), and
    whether smoothing is on."""
    return acc.type(1.0 - s), acc.type(s / v), numpy.int32(s != 0)


def cross_entropy_forward(logits, targets, *, reduction: str = "mean", ignore_index: int = -100,
                          label_smoothing: float = 0.0, loss_dtype=None):
    """Returns ``(loss, CrossEntropyCache)``: a 0-d array for mean/sum, shape ``targets.shape`` for none,
    in ``loss_dtype`` (the logits' dtype, or their accumulation dtype: 16-bit logits are read as
    they are, with no float32 copy)."""
    safe_t, valid, s, loss_dt = check_cross_entropy_inputs(logits, targets, reduction, ignore_index,
                                                           label_smoothing, loss_dtype)
    xp = device_xp(logits)
    rows, v = rows_of(logits)
    acc = accumulation_dtype(logits.dtype)
    z = contiguous(xp, logits)
    t, ok = contiguous(xp, xp.asarray(safe_t)), contiguous(xp, xp.asarray(valid))   # (a 0-d target: arrays too)
    nll = xp.empty(safe_t.shape, dtype=acc)              # (...)
    shift = xp.empty(safe_t.shape + (1,), dtype=acc)     # (..., 1)
    log_sum = xp.empty(safe_t.shape + (1,), dtype=acc)   # (..., 1)
    if rows:
        # per row: shift, log_sum and the loss, in one read of the row
        launch_rows("cross_entropy_fwd", logits.dtype, rows, v,
                    (z, t, ok, nll, shift, log_sum, numpy.int64(rows), numpy.int32(v),
                     *_smoothing_terms(acc, s, v)))
    loss = reduce_losses(nll, valid, reduction)          # () or (...), as the reference
    cache = CrossEntropyCache(logits, shift, log_sum, safe_t, valid, s, reduction, logits.dtype, loss_dt)
    return xp.asarray(loss).astype(loss_dt), cache       # () or (...)


def cross_entropy_backward(dloss, cache):
    """Returns ``dlogits`` (..., V) in the logits' dtype, written in one pass."""
    logits, shift, log_sum, t, valid, s, reduction, dtype, loss_dtype = cache
    expect_grad(dloss, "dloss", tuple(t.shape) if reduction == "none" else (), loss_dtype,
                f"the loss of reduction={reduction!r}")
    xp = device_xp(dloss, logits)
    rows, v = rows_of(logits)
    acc = accumulation_dtype(dtype)
    scale = xp.where(valid, dloss.astype(acc) / loss_divisor(valid, reduction, acc), 0)   # (...) 0 for ignored rows
    z = contiguous(xp, logits)
    shift, log_sum = contiguous(xp, shift.astype(acc, copy=False)), contiguous(xp, log_sum.astype(acc, copy=False))
    t, scale = contiguous(xp, xp.asarray(t, dtype=xp.int64)), contiguous(xp, xp.asarray(scale, dtype=acc))
    dz = xp.empty(logits.shape, dtype=dtype)             # (..., V)
    if rows:
        # fwd: loss = -sum_j q_j log p_j  ->  dz = (p - q) * dloss / N, p from the row's shift and log_sum
        launch_rows("cross_entropy_bwd", dtype, rows, v,
                    (z, shift, log_sum, t, scale, dz, numpy.int64(rows), numpy.int32(v), *_smoothing_terms(acc, s, v)))
    return dz
