"""Linear on CuPy (reference: :mod:`npformer.ops.linear`): the reference's products through
:func:`npformer.kernels.cuda.gemm.matmul` (CuPy's ``@``, or the same cuBLAS call made directly while
a CUDA graph is captured), and the bias gradient as one coalesced column-sum kernel."""
from __future__ import annotations

from npformer.checks import expect_grad
from npformer.kernels.cuda.activations import bias_grad
from npformer.kernels.cuda.gemm import matmul
from npformer.ops.linear import LinearCache, as_rows, check_linear_inputs

__all__ = ["linear_forward", "linear_backward"]


def _matmul_last(x, w):
    """``x @ w`` over the last axis of ``x`` (..., K) with ``w`` (K, N), as one 2-d product."""
    return matmul(as_rows(x), w).reshape(x.shape[:-1] + (w.shape[-1],))   # (..., N)


def linear_forward(x, weight, bias=None):
    """``out = x @ W^T + b``; returns ``(out, cache)`` as the reference."""
    check_linear_inputs(x, weight, bias)
    out = _matmul_last(x, weight.T)                      # (..., C_out)
    if bias is not None:
        out += bias
    return out, LinearCache(x, weight, bias is not None)


def linear_backward(dout, cache):
    """Returns ``(dx, dweight, dbias)`` as the reference."""
    x, weight, has_bias = cache
    c_out, c_in = weight.shape
    expect_grad(dout, "dout", x.shape[:-1] + (c_out,), x.dtype)
    dout2 = as_rows(dout)                                # (N, C_out)
    # fwd: out = x @ W^T + b  ->  dx = dout @ W,  dW = dout^T @ x,  db = sum over rows of dout
    dx = _matmul_last(dout, weight)                      # (..., C_in)
    dweight = matmul(dout2.T, as_rows(x))                # (C_out, C_in)
    return dx, dweight, bias_grad(dout) if has_bias else None
