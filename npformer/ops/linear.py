"""Linear (affine) map over the last axis, as ``torch.nn.functional.linear``.

    out = x @ W^T + b          x: (..., C_in), W: (C_out, C_in), b: (C_out,)
    dx = dout @ W,   dW = dout^T x,   db = sum of dout over every leading axis

Leading axes are flattened into one batch axis, so every product is one 2-d matmul of all the rows
(a 3-d ``x @ W^T`` would be one small product per leading index), through
:func:`npformer.backend.matmul` (``@`` in the operands' dtype, bfloat16 included). C_in = 0 is allowed, as in
PyTorch: the product is an empty sum, so ``out = b`` (zeros without a bias) and ``dW`` is empty.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

from npformer.backend import accumulated_sum, matmul
from npformer.checks import expect_grad, expect_ndim, expect_same_float, expect_shape
from npformer.dispatch import dispatched
from npformer.errors import ShapeError

__all__ = ["LinearCache", "check_linear_inputs", "check_linear_grad", "linear_forward", "linear_backward", "matmul_last", "as_rows"]


def as_rows(x):
    """``x`` (..., C) as a 2-d (N, C) array, N the product of the leading axes (also when C is 0,
    where ``reshape(-1, 0)`` would be ambiguous: a layer of 0 inputs or outputs is well defined)."""
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


def matmul_last(x, w):
    """``x @ w`` over the last axis of ``x`` (..., K) with ``w`` (K, N), as one 2-d matmul."""
    return matmul(as_rows(x), w).reshape(x.shape[:-1] + (w.shape[-1],))   # (..., N)


class LinearCache(NamedTuple):
    """What the backward needs: the input and the weight (the output is not needed)."""

    x: Any          # (..., C_in)
    weight: Any     # (C_out, C_in)
    has_bias: bool


def check_linear_inputs(x, weight, bias) -> None:
    """The forward's checks (every implementation runs them)."""
    expect_same_float(x=x, weight=weight, bias=bias)     # one float dtype, one backend
    expect_ndim(weight, "weight", 2, "(C_out, C_in)")
    c_out, c_in = weight.shape
    if x.ndim < 1 or x.shape[-1] != c_in:
        raise ShapeError(f"x: expected last axis of size C_in={c_in} to match weight (C_out, C_in)="
                         f"{tuple(weight.shape)}, got shape {tuple(x.shape)}")
    if bias is not None:
        expect_shape(bias, "bias", (c_out,), "(C_out,)")


def check_linear_grad(dout, cache: "LinearCache") -> None:
    """The backward's check: ``dout`` is the gradient of the forward's output (..., C_out)."""
    expect_grad(dout, "dout", cache.x.shape[:-1] + (cache.weight.shape[0],), cache.x.dtype)


@dispatched
def linear_forward(x, weight, bias=None):
    """``out = x @ W^T + b``; returns ``(out, cache)``."""
    check_linear_inputs(x, weight, bias)
    out = matmul_last(x, weight.T)                       # (..., C_out)
    if bias is not None:
        out += bias
    return out, LinearCache(x, weight, bias is not None)


@dispatched
def linear_backward(dout, cache: LinearCache):
    """Returns ``(dx, dweight, dbias)``; ``dbias`` is None when the forward had no bias."""
    check_linear_grad(dout, cache)
    x, weight, has_bias = cache
    dout2 = as_rows(dout)                                # (N, C_out)
    x2 = as_rows(x)                                      # (N, C_in)
    # fwd: out = x @ W^T + b  ->  dx = dout @ W,  dW = dout^T @ x,  db = sum_N dout
    dx = matmul(dout2, weight).reshape(x.shape)          # (..., C_in)
    dweight = matmul(dout2.T, x2)                        # (C_out, C_in)
    dbias = accumulated_sum(dout2, axis=0) if has_bias else None   # (C_out,)
    return dx, dweight, dbias
