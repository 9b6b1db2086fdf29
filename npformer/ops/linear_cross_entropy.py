"""The output head and the cross-entropy together, a chunk of rows at a time: the loss of
``cross_entropy(x W^T + b, t)`` and every gradient, without the (N, V) logits.

    z_i = x_i W^T + b                      x: (..., C) rows x_i, W: (V, C), b: (V,), t: (...) targets
    loss = sum_i loss_i / N_valid (mean),  sum_i loss_i (sum)       loss_i as cross_entropy_forward's
    dz_i = (p_i - q_i) * dloss / N_valid   (1 for sum; 0 rows where t_i = ignore_index)
    dx_i = dz_i W,   dW = sum_i dz_i^T x_i,   db = sum_i dz_i

Why: the head of a language model makes the largest arrays of its training step. At GPT-2's shape
(N = B T = 8192 rows, V = 50257) the float32 logits take 1.6 GB and their gradient as much again,
while x takes 25 MB. The rows are independent until dW and db sum over them, so they are taken
``chunk_rows`` at a time: a chunk's logits, its losses and dz, then dx of its rows and its share of
dW and db; the chunk's logits and dz are gone before the next chunk's are made. The gradient is made
in the same pass, so ``dloss`` is given up front: the loss ends the step, and its upstream gradient
is known before the forward starts (1, or the loss scale S under mixed precision; every gradient is
linear in it).

Each chunk runs the unfused ops, ``linear_forward``, ``cross_entropy_forward`` (reduction sum),
``cross_entropy_backward`` with ``dloss / N_valid`` and ``linear_backward``, so their fast paths (the
CUDA cross-entropy kernels) serve here too, and one chunk gives the unfused step's numbers bit for
bit. The cross-entropy runs in the accumulation dtype (float32 for 16-bit x: its loss in float32,
``loss_dtype``; dz comes back in x's dtype for the products, as mixed precision does unfused; the
CUDA kernels read the 16-bit logits and write the 16-bit dz with no float32 copy of either);
with several chunks dW and db add up in that dtype too, rounded to x's dtype once at the end.
"""
from __future__ import annotations

import math
from numbers import Real
from typing import Any, NamedTuple

from npformer.backend import accumulation_dtype, get_array_module, is_array
from npformer.checks import (class_ids, describe, expect_float, expect_int, expect_rows, integer, one_of,
                             positive_int, probability, real, values_unchecked)
from npformer.errors import InputTypeError, ShapeError
from npformer.ops.cross_entropy import cross_entropy_backward, cross_entropy_forward, loss_divisor
from npformer.ops.linear import as_rows, check_linear_inputs, linear_backward, linear_forward

__all__ = ["LOGITS_CHUNK_BYTES", "LinearCrossEntropy", "chunk_rows_for", "linear_cross_entropy"]

LOGITS_CHUNK_BYTES = 1 << 28     # a chunk's logits in the accumulation dtype: at most 256 MiB
REDUCTIONS = ("mean", "sum")     # "none" has a loss per row and a dloss per row: use the unfused ops


class LinearCrossEntropy(NamedTuple):
    """The loss and its gradients (already multiplied by ``dloss``)."""

    loss: Any       # () in the accumulation dtype
    dx: Any         # (..., C) in x's dtype
    dweight: Any    # (V, C)
    dbias: Any      # (V,), or None without a bias
    valid: Any      # (...) bool: the targets the loss counts (not ignore_index)


def chunk_rows_for(n_rows: int, vocab: int, itemsize: int, budget: int | None = None) -> int:
    """Rows per chunk: as many as keep a chunk's logits within ``budget`` bytes (default
    :data:`LOGITS_CHUNK_BYTES`; at least one row), spread evenly over the chunks that takes (8192 rows
    of V = 50257 in float32: 7 chunks of 1171)."""
    budget = LOGITS_CHUNK_BYTES if budget is None else budget
    most = max(1, budget // max(vocab * itemsize, 1))
    chunks = max(1, math.ceil(n_rows / most))
    return max(1, math.ceil(n_rows / chunks))


def _check_dloss(dloss) -> None:
    """A finite real number, or a 0-d float array. An array's value is not read: it may be a loss scale
    on the device (``MixedPrecision.scaled_dloss``), and reading it would sync the host to the device."""
    if is_array(dloss) and not isinstance(dloss, Real):
        expect_float(dloss, "dloss")
        if dloss.ndim != 0:
            raise ShapeError(f"dloss: expected a number or a 0-d array (the gradient of the scalar loss), "
                             f"got {describe(dloss)}")
    elif isinstance(dloss, (bool, str)) or not isinstance(dloss, Real):
        raise InputTypeError(f"dloss: expected a real number or a 0-d float array, got {describe(dloss)}")
    else:
        real(dloss, "dloss")                         # NaN or inf: every gradient would be NaN


def _check(x, weight, bias, targets, dloss, reduction, ignore_index, label_smoothing, chunk_rows):
    expect_float(x, "x")
    expect_rows(x, "x", "(..., C)")
    check_linear_inputs(x, weight, bias)
    expect_int(targets, "targets")
    if tuple(targets.shape) != tuple(x.shape[:-1]):
        raise ShapeError(f"targets: expected shape {tuple(x.shape[:-1])} (x's shape without the feature "
                         f"axis), got {describe(targets)}")
    one_of(reduction, "reduction", REDUCTIONS)
    probability(label_smoothing, "label_smoothing")
    integer(ignore_index, "ignore_index")
    if chunk_rows is not None:
        positive_int(chunk_rows, "chunk_rows")
    _check_dloss(dloss)


def _chunk(x, weight, bias, targets, dloss, acc, ce_options: dict) -> tuple:
    """One chunk of rows: ``(summed loss, dx, dW, db)``; its logits and their gradient live only in here."""
    z, lin = linear_forward(x, weight, bias)                                      # (n, V) x's dtype
    with values_unchecked():                             # the caller checked every target at once
        loss, ce = cross_entropy_forward(z, targets, reduction="sum", loss_dtype=acc, **ce_options)
    dz = cross_entropy_backward(dloss, ce)                                        # (n, V) x's dtype
    del z, ce                                            # the logits go before the products are made
    return (loss,) + linear_backward(dz, lin)


def linear_cross_entropy(x, weight, targets, bias=None, *, dloss=1.0, reduction: str = "mean",
                         ignore_index: int = -100, label_smoothing: float = 0.0,
                         chunk_rows: int | None = None) -> LinearCrossEntropy:
    """The loss and the gradients of x, W and b times ``dloss`` (a finite number or a 0-d float array, which stays
    on the device), ``chunk_rows`` rows at a time (default :func:`chunk_rows_for`)."""
    _check(x, weight, bias, targets, dloss, reduction, ignore_index, label_smoothing, chunk_rows)
    xp = get_array_module(x, weight, targets, dloss)
    acc = accumulation_dtype(x.dtype)
    v = weight.shape[0]
    x2, t = as_rows(x), targets.reshape(-1).astype(xp.int64, copy=False)        # (N, C), (N,)
    n = x2.shape[0]
    valid = t != ignore_index                                                     # (N,)
    class_ids(t, valid, v, ignore_index)                 # once for every chunk (each then skips it)
    count = loss_divisor(valid, reduction, acc)          # () N_valid for the mean
    d = xp.asarray(xp.asarray(dloss, dtype=acc) / count)   # () the upstream gradient of each row's loss
    step = chunk_rows or chunk_rows_for(n, v, acc.itemsize)
    ce_options = dict(ignore_index=ignore_index, label_smoothing=label_smoothing)
    if step >= n:                                        # one chunk: the unfused ops' arrays as they come
        loss, dx, dweight, dbias = _chunk(x2, weight, bias, t, d, acc, ce_options)
    else:
        loss, dx, dweight, dbias = 0, xp.empty_like(x2), None, None
        for start in range(0, n, step):
            rows = slice(start, start + step)
            loss_c, dx[rows], dw_c, db_c = _chunk(x2[rows], weight, bias, t[rows], d, acc, ce_options)
            loss = loss + loss_c
            if dweight is None:                          # dW and db add up in the accumulation dtype
                dweight, dbias = dw_c.astype(acc, copy=False), None if db_c is None else db_c.astype(acc)
            else:
                dweight += dw_c
                if dbias is not None:
                    dbias += db_c
            del dw_c, db_c                               # (each chunk's go before the next one's are made)
        dweight = dweight.astype(x.dtype, copy=False)
        dbias = None if dbias is None else dbias.astype(x.dtype, copy=False)
    loss = xp.asarray(loss / count)                      # () (NumPy makes a scalar of 0-d arithmetic)
    return LinearCrossEntropy(loss, dx.reshape(x.shape), dweight, dbias, valid.reshape(targets.shape))
