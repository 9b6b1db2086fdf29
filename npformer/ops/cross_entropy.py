"""Cross-entropy from logits with ``ignore_index`` and label smoothing, as
``torch.nn.functional.cross_entropy``; log-softmax and the loss are fused (llm.c style).

    log p = log_softmax(z)                                    z: (..., V) logits, t: (...) targets
    q = (1 - s) onehot(t) + s / V                             s: label smoothing
    loss_i = -sum_j q_j log p_j  = -(1 - s) log p_t - s/V sum_j log p_j     (0 where t = ignore_index)
    mean: sum_i loss_i / N_valid      sum: sum_i loss_i      none: loss_i
    dz_i = (p_i - q_i) * dloss_i / (N_valid for mean)         (0 rows where t = ignore_index)

When every target is ignored, ``mean`` returns 0 with a zero gradient (PyTorch returns NaN: a
deliberate difference, so a batch of only padding cannot poison training).
The cache keeps only the log-probabilities; p is recomputed as exp(log p) in backward.
``dloss`` is a 0-d array for mean/sum and of shape ``targets.shape`` for none. 16-bit logits are
computed (and the loss summed) in float32; loss and ``dlogits`` come back in the logits' dtype.
Targets may use any integer dtype; ``ignore_index`` may even be a valid class id (it is then ignored).
"""
from __future__ import annotations

from typing import Any, NamedTuple

from npformer.backend import accumulation_dtype, get_array_module
from npformer.checks import (describe, expect_float, expect_grad, expect_int, expect_rows, integer, one_of,
                             probability, values_checked)
from npformer.dispatch import dispatched
from npformer.errors import RangeError, ShapeError
from npformer.ops.softmax import log_softmax_forward

__all__ = ["CrossEntropyCache", "cross_entropy_forward", "cross_entropy_backward"]

REDUCTIONS = ("mean", "sum", "none")


class CrossEntropyCache(NamedTuple):
    """Only log p is kept (p = exp(log p) in backward); targets and validity are (...)-shaped."""

    logp: Any            # (..., V) log-probabilities (accumulation dtype)
    targets: Any         # (...) targets with ignored positions set to 0
    valid: Any           # (...) bool, not ignored
    count: Any           # () max(N_valid, 1) for mean, in logp's dtype (kept on the device); 1 for sum, none
    smoothing: float
    reduction: str
    dtype: Any


@dispatched
def cross_entropy_forward(logits, targets, *, reduction: str = "mean", ignore_index: int = -100,
                          label_smoothing: float = 0.0):
    """Returns ``(loss, cache)``: a 0-d array for mean/sum, shape ``targets.shape`` for none."""
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
    bad = valid & ((t < 0) | (t >= v))                   # (...)
    if values_checked() and bool(bad.any()):            # (skipped inside a CUDA graph capture)
        raise RangeError(f"targets: class ids must be in [0, {v}) or ignore_index={ignore_index}, "
                         f"got {int(t[bad].reshape(-1)[0])} (V={v})")
    safe_t = xp.where(valid, t, 0)                       # (...)
    logp, _ = log_softmax_forward(logits.astype(accumulation_dtype(logits.dtype), copy=False))  # (..., V)
    picked = xp.take_along_axis(logp, safe_t[..., None], axis=-1)[..., 0]     # (...)
    if s == 0:
        nll = -picked                                    # (...)
    else:                                                # -sum_j q_j log p_j, q = (1-s) onehot + s/V
        nll = -(1.0 - s) * picked - (s / v) * logp.sum(axis=-1)                  # (...)
    nll = xp.where(valid, nll, 0)                        # (...) ignored positions contribute 0
    if reduction == "none":
        loss, count = nll, 1                             # (...)
    else:
        # N_valid stays on the device (no host sync): the same division as by the int count
        count = xp.maximum(valid.sum(), 1).astype(logp.dtype) if reduction == "mean" else 1     # ()
        loss = nll.sum() / count                         # () all ignored: 0 / 1 = 0
    cache = CrossEntropyCache(logp, safe_t, valid, count, s, reduction, logits.dtype)
    return xp.asarray(loss).astype(logits.dtype), cache  # () or (...), in the logits' dtype


@dispatched
def cross_entropy_backward(dloss, cache: CrossEntropyCache):
    """Returns ``dlogits`` (..., V)."""
    logp, t, valid, count, s, reduction, dtype = cache
    expect_grad(dloss, "dloss", tuple(t.shape) if reduction == "none" else (), dtype,
                f"the loss of reduction={reduction!r}")
    xp = get_array_module(dloss, logp)
    v = logp.shape[-1]
    # fwd: loss_i = -sum_j q_ij log p_ij,  log p = z - lse(z)  ->  dz_i = (p_i - q_i) * dloss_i / N
    dz = xp.exp(logp)                                    # (..., V) p, recomputed from log p
    if s:
        dz -= s / v                                      # q's uniform part
    rows = dz.reshape(-1, v)                             # (N, V) view of the fresh dz
    rows[xp.arange(rows.shape[0]), t.reshape(-1)] -= 1.0 - s   # q's one-hot part (one entry a row)
    scale = dloss.astype(logp.dtype) / count             # () or (...)
    scale = xp.where(valid, scale, 0)                    # (...) ignored rows get no gradient
    dz *= scale[..., None]                               # (..., V)
    return dz.astype(dtype, copy=False)                  # (..., V)
