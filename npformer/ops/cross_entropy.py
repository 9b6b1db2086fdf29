"""Cross-entropy from logits with ``ignore_index`` and label smoothing, as
``torch.nn.functional.cross_entropy``; log-softmax and the loss are fused (llm.c style).

    log p = log_softmax(z)                                    z: (..., V) logits, t: (...) targets
    q = (1 - s) onehot(t) + s / V                             s: label smoothing
    loss_i = -sum_j q_j log p_j  = -(1 - s) log p_t - s/V sum_j log p_j     (0 where t = ignore_index)
    mean: sum_i loss_i / N_valid      sum: sum_i loss_i      none: loss_i
    dz_i = (p_i - q_i) * dloss_i / (N_valid for mean)         (0 rows where t = ignore_index)

When every target is ignored, ``mean`` returns 0 with a zero gradient (PyTorch returns NaN: a
deliberate difference, so a batch of only padding cannot poison training).
The cache holds no (..., V) array of its own: it keeps the logits (the caller's array) and each
row's normaliser, log p = (z - shift) - log_sum, so backward recomputes log p exactly as forward
computed it and writes dz from it (a fused kernel does the same in one pass over each row).
``dloss`` is a 0-d array for mean/sum and of shape ``targets.shape`` for none. 16-bit logits are
computed (and the loss summed) in float32; ``dlogits`` comes back in the logits' dtype, and so does the
loss unless ``loss_dtype`` asks for the accumulation dtype (float32 for 16-bit logits), as mixed
precision takes it: the loss is then not rounded to 16 bits and ``dloss`` comes in that dtype. The
caller then keeps no float32 copy of the logits (the CUDA kernels read the 16-bit ones and write the
16-bit gradient; this op converts inside, a copy gone when it returns), and the numbers are those of
the op on a float32 copy, bit for bit: the conversion is exact and every step after it the same.
Targets may use any integer dtype; ``ignore_index`` may even be a valid class id (it is then ignored).
"""
from __future__ import annotations

from typing import Any, NamedTuple

from npformer.backend import accumulation_dtype, get_array_module
from npformer.checks import (class_ids, describe, expect_float, expect_grad, expect_int, expect_rows, integer,
                             one_of, probability)
from npformer.dispatch import dispatched
from npformer.errors import RangeError, ShapeError

__all__ = ["CrossEntropyCache", "check_cross_entropy_inputs", "loss_dtype_for", "log_normaliser", "loss_divisor",
           "reduce_losses", "cross_entropy_forward", "cross_entropy_backward"]

REDUCTIONS = ("mean", "sum", "none")


class CrossEntropyCache(NamedTuple):
    """The logits and each row's normaliser (log p is recomputed from them in backward); targets
    and validity are (...)-shaped. Every field is the reference backward's: the normaliser instead
    of log p keeps no (..., V) array (the largest of a language model's step). Backward recounts the
    valid targets for the mean (:func:`loss_divisor`) rather than keeping the count."""

    logits: Any          # (..., V) the forward's input (not a copy)
    shift: Any           # (..., 1) max_j z_j, 0 where not finite (accumulation dtype)
    log_sum: Any         # (..., 1) log sum_j exp(z_j - shift), 0 where the sum is 0
    targets: Any         # (...) targets with ignored positions set to 0
    valid: Any           # (...) bool, not ignored
    smoothing: float
    reduction: str
    dtype: Any           # the logits' (and dlogits')
    loss_dtype: Any      # the loss's (and dloss')


def check_cross_entropy_inputs(logits, targets, reduction, ignore_index, label_smoothing, loss_dtype=None):
    """The forward's checks (every implementation runs them); returns ``(safe_targets, valid, s,
    loss_dtype)``: the targets as int64 with ignored positions set to 0, where they are not ignored,
    the smoothing as a float, and the loss's dtype (:func:`loss_dtype_for`)."""
    expect_float(logits, "logits")
    expect_rows(logits, "logits", "(..., V)")
    expect_int(targets, "targets")
    one_of(reduction, "reduction", REDUCTIONS)
    s = probability(label_smoothing, "label_smoothing")
    ignore_index = integer(ignore_index, "ignore_index")
    if tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ShapeError(f"targets: expected shape {tuple(logits.shape[:-1])} (the logits' shape "
                         f"without the class axis), got {describe(targets)}")
    v = logits.shape[-1]
    xp = get_array_module(logits, targets)
    t = targets.astype(xp.int64, copy=False)             # (...) unsigned ids compare safely with -100
    valid = t != ignore_index                            # (...)
    class_ids(t, valid, v, ignore_index)
    return xp.where(valid, t, 0), valid, s, loss_dtype_for(logits.dtype, loss_dtype)   # (...), (...), float, dtype


def loss_dtype_for(logits_dtype, loss_dtype):
    """The loss's dtype: the logits' (``loss_dtype`` None), or ``loss_dtype`` when it is the logits'
    or their accumulation dtype (float32 for 16-bit logits), in which the loss is computed."""
    choices = (logits_dtype, accumulation_dtype(logits_dtype))
    if loss_dtype is None:
        return logits_dtype
    for choice in choices:
        if choice == loss_dtype:
            return choice
    raise RangeError(f"loss_dtype: expected None, the logits' dtype {choices[0]} or their accumulation "
                     f"dtype {choices[1]}, got {loss_dtype!r}")


def log_normaliser(za):
    """``(shift, log_sum)`` of each row of ``za`` (..., V): log softmax(z) = (z - shift) - log_sum,
    with shift = max z (0 when not finite: no inf - inf) and log_sum = log sum exp(z - shift) (0 for
    a zero sum: an all -inf row stays -inf), the steps of :func:`~npformer.ops.softmax.log_softmax_forward`."""
    xp = get_array_module(za)
    m = za.max(axis=-1, keepdims=True)                   # (..., 1)
    shift = xp.where(xp.isfinite(m), m, 0)               # (..., 1)
    e = za - shift                                       # (..., V)
    total = xp.exp(e, out=e).sum(axis=-1, keepdims=True)   # (..., 1) sum exp(z - shift)
    return shift, xp.log(xp.where(total > 0, total, 1))  # (..., 1), (..., 1)


def loss_divisor(valid, reduction: str, dtype):
    """What the summed row losses are divided by: max(N_valid, 1) for mean (an array of ``dtype``,
    so the count is never read back to the host), 1 for sum and none."""
    if reduction != "mean":
        return 1
    xp = get_array_module(valid)
    return xp.maximum(valid.sum(), 1).astype(dtype)      # ()


def reduce_losses(nll, valid, reduction: str):
    """The loss from the row losses ``nll`` (...) (0 where not ``valid``): the rows themselves for
    none, their sum for sum, their sum over max(N_valid, 1) for mean (every implementation ends so)."""
    if reduction == "none":
        return nll                                       # (...)
    return nll.sum() / loss_divisor(valid, reduction, nll.dtype)   # () all ignored: 0 / 1 = 0


@dispatched
def cross_entropy_forward(logits, targets, *, reduction: str = "mean", ignore_index: int = -100,
                          label_smoothing: float = 0.0, loss_dtype=None):
    """Returns ``(loss, cache)``: a 0-d array for mean/sum, shape ``targets.shape`` for none, in
    ``loss_dtype`` (default the logits' dtype; or their accumulation dtype)."""
    safe_t, valid, s, loss_dt = check_cross_entropy_inputs(logits, targets, reduction, ignore_index,
                                                           label_smoothing, loss_dtype)
    v = logits.shape[-1]
    xp = get_array_module(logits, targets)
    za = xp.ascontiguousarray(logits.astype(accumulation_dtype(logits.dtype), copy=False))   # (..., V) rows
    shift, log_sum = log_normaliser(za)                  # (..., 1), (..., 1)  log p = (z - shift) - log_sum
    z_t = xp.take_along_axis(za, safe_t[..., None], axis=-1)                   # (..., 1)
    picked = ((z_t - shift) - log_sum)[..., 0]           # (...) log p_t
    if s == 0:
        nll = -picked                                    # (...)
    else:                                                # -sum_j q_j log p_j, q = (1-s) onehot + s/V
        logp = za - shift                                # (..., V)
        logp -= log_sum                                  # (..., V) log p
        nll = -(1.0 - s) * picked - (s / v) * logp.sum(axis=-1)                  # (...)
    nll = xp.where(valid, nll, 0)                        # (...) ignored positions contribute 0
    loss = reduce_losses(nll, valid, reduction)          # () or (...)
    cache = CrossEntropyCache(logits, shift, log_sum, safe_t, valid, s, reduction, logits.dtype, loss_dt)
    return xp.asarray(loss).astype(loss_dt), cache       # () or (...)


@dispatched
def cross_entropy_backward(dloss, cache: CrossEntropyCache):
    """Returns ``dlogits`` (..., V) in the logits' dtype; ``dloss`` has the loss's dtype."""
    logits, shift, log_sum, t, valid, s, reduction, dtype, loss_dtype = cache
    expect_grad(dloss, "dloss", tuple(t.shape) if reduction == "none" else (), loss_dtype,
                f"the loss of reduction={reduction!r}")
    xp = get_array_module(dloss, logits)
    v = logits.shape[-1]
    acc = accumulation_dtype(dtype)
    # fwd: loss_i = -sum_j q_ij log p_ij,  log p = z - lse(z)  ->  dz_i = (p_i - q_i) * dloss_i / N
    dz = xp.ascontiguousarray(logits.astype(acc, copy=False)) - shift   # (..., V)
    dz -= log_sum                                        # (..., V) log p, as forward computed it
    xp.exp(dz, out=dz)                                   # (..., V) p
    if s:
        dz -= s / v                                      # q's uniform part
    rows = dz.reshape(-1, v)                             # (N, V) view of the fresh dz
    rows[xp.arange(rows.shape[0]), t.reshape(-1)] -= 1.0 - s   # q's one-hot part (one entry a row)
    scale = dloss.astype(acc) / loss_divisor(valid, reduction, acc)    # () or (...)
    scale = xp.where(valid, scale, 0)                    # (...) ignored rows get no gradient
    dz *= scale[..., None]                               # (..., V)
    return dz.astype(dtype, copy=False)                  # (..., V)
