"""Linear layers for NumPy with the matrix products split between the CPU fast paths' threads
(reference: :mod:`npformer.ops.linear`, the same signature, cache and products).

A threaded BLAS leaves its worker threads spinning for a while after each product, on the cores
the element-wise work that follows wants (measured: an element-wise op right after a product ran
up to twice as slow). Here each product is cut into one part per thread of
:mod:`npformer.kernels.cpu.threads`, each part one single-threaded BLAS call:

    forward:   out[rows] = x[rows] @ W^T + b                    rows split
    backward:  dx[rows] = dout[rows] @ W                        rows split
               dW[outs] = dout[:, outs]^T @ x                   output features split
               db[outs] = sum of dout[:, outs] over rows        (beside dW's part, dout's columns warm)

so BLAS's own workers are never woken and nothing spins. Every element is one BLAS dot product
over the same K whichever part holds it; the parts depend only on the shapes and the thread count.
NumPy sums a column slice down its rows as it sums the whole array, so db is the reference's bit
for bit (tested).
Products under :data:`MIN_PARALLEL_FLOPS` run as the reference.
"""
from __future__ import annotations

import numpy

from npformer.checks import expect_grad
from npformer.kernels.cpu.threads import get_num_threads, in_parallel_region, run_parallel, split
from npformer.ops.linear import LinearCache, check_linear_inputs

__all__ = ["linear_forward", "linear_backward", "MIN_PARALLEL_FLOPS"]

MIN_PARALLEL_FLOPS = 1 << 26       # 67 MFLOP a part: below, BLAS's own threads hand off faster than the pool
ROW_MULTIPLE = 16                  # part boundaries (rows of the products)


def _threads(flops: int) -> int:
    return 1 if in_parallel_region() else min(get_num_threads(), flops // MIN_PARALLEL_FLOPS)


def linear_forward(x, weight, bias=None):
    check_linear_inputs(x, weight, bias)
    c_out, c_in = weight.shape
    x2 = x.reshape(-1, c_in)                                         # (N, C_in)
    n = x2.shape[0]
    out = numpy.empty((n, c_out), dtype=x.dtype)                     # (N, C_out)
    w_t = weight.T                                                   # (C_in, C_out) view

    def part(a: int, b: int) -> None:
        numpy.matmul(x2[a:b], w_t, out=out[a:b])
        if bias is not None:
            out[a:b] += bias

    run_parallel([lambda a=a, b=b: part(a, b) for a, b in split(n, _threads(2 * n * c_in * c_out), ROW_MULTIPLE)])
    return out.reshape(x.shape[:-1] + (c_out,)), LinearCache(x, weight, bias is not None)


def linear_backward(dout, cache: LinearCache):
    x, weight, has_bias = cache
    c_out, c_in = weight.shape
    expect_grad(dout, "dout", x.shape[:-1] + (c_out,), x.dtype)
    d2, x2 = dout.reshape(-1, c_out), x.reshape(-1, c_in)            # (N, C_out), (N, C_in)
    n = d2.shape[0]
    dx = numpy.empty((n, c_in), dtype=x.dtype)                       # (N, C_in)
    dweight = numpy.empty((c_out, c_in), dtype=x.dtype)              # (C_out, C_in)
    dbias = numpy.empty(c_out, dtype=x.dtype) if has_bias else None  # (C_out,)
    # fwd: out = x @ W^T + b  ->  dx = dout @ W,  dW = dout^T @ x,  db = sum_N dout
    parts = _threads(4 * n * c_in * c_out)
    rows, outs = split(n, parts, ROW_MULTIPLE), split(c_out, parts, ROW_MULTIPLE)

    def part(k: int) -> None:
        if k < len(rows):
            a, b = rows[k]
            numpy.matmul(d2[a:b], weight, out=dx[a:b])
        if k < len(outs):
            a, b = outs[k]
            numpy.matmul(d2[:, a:b].T, x2, out=dweight[a:b])
            if has_bias:
                d2[:, a:b].sum(axis=0, out=dbias[a:b])

    run_parallel([lambda k=k: part(k) for k in range(max(len(rows), len(outs)))])
    return dx.reshape(x.shape), dweight, dbias
