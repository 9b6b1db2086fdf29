"""Linear layers for NumPy with the matrix products split between the CPU fast paths' threads
(reference: :mod:`npformer.ops.linear`, the same signature, cache and products).

Each product is cut into one part per thread of :mod:`npformer.kernels.cpu.threads`, each part one
single-threaded BLAS call:

    forward:   out[rows] = x[rows] @ W^T + b                    rows split
    backward:  dx[rows] = dout[rows] @ W                        rows split
               dW[outs] = dout[:, outs]^T @ x                   output features split
               db[outs] = sum of dout[:, outs] over rows        (beside dW's part, dout's columns warm)

Every element is one BLAS dot product over the same K whichever part holds it; the parts depend
only on the shapes and the thread count. NumPy sums a column slice down its rows as it sums the
whole array, so db is the reference's bit for bit (tested). A product under :data:`MIN_PARALLEL_FLOPS`
a part runs whole on the calling thread, with BLAS held at one thread when the pool has more: BLAS's
own workers are never woken, since they spin on the cores the pool and other programs want (why,
with the measurements: :mod:`npformer.kernels.cpu.threads`).

Until 2026-11-29 the layers of a model with d_model under 256 (nanoGPT's CPU recipe, the default
``npformer train``) left their products to BLAS's own threads: 2-9% faster on a quiet machine, and
with a CPU hog on every core slower than one thread (gpt-tiny, NumPy alone: 332 against 171 ms).
"""
from __future__ import annotations

import functools

import numpy

from npformer.backend import accumulation_dtype, matmul
from npformer.checks import expect_grad
from npformer.kernels.cpu.threads import get_num_threads, in_parallel_region, run_parallel, split
from npformer.ops.linear import LinearCache, as_rows, check_linear_inputs

__all__ = ["linear_forward", "linear_backward", "MIN_PARALLEL_FLOPS"]

MIN_PARALLEL_FLOPS = 1 << 24       # 16 MFLOP a part (0.2-0.4 ms of BLAS), against a hand-off's 17-90 us
ROW_MULTIPLE = 16                  # part boundaries (rows of the products)


def _parts(flops: int) -> int:
    """Parts of a product of ``flops``: from the shapes and the thread count alone, never from timing."""
    if in_parallel_region():
        return 1
    return max(1, min(get_num_threads(), flops // MIN_PARALLEL_FLOPS))


def _product(a, b, out) -> None:
    """out = a @ b, one BLAS call: float16 through :func:`npformer.backend.matmul` (float32 sums
    rounded once; NumPy's own float16 product has no BLAS), other dtypes straight into ``out``."""
    if a.dtype == numpy.float16:
        out[...] = matmul(a, b)
    else:
        numpy.matmul(a, b, out=out)


def _run(tasks: list) -> None:
    """The parts, on the pool; one part on this thread, with BLAS at one thread if the pool has more."""
    run_parallel(tasks, blas_one_thread=get_num_threads() > 1)


def linear_forward(x, weight, bias=None):
    check_linear_inputs(x, weight, bias)
    c_out, c_in = weight.shape
    x2 = as_rows(x)                                                  # (N, C_in)
    n = x2.shape[0]
    out = numpy.empty((n, c_out), dtype=x.dtype)                     # (N, C_out)
    w_t = weight.T                                                   # (C_in, C_out) view

    def part(a: int, b: int) -> None:
        _product(x2[a:b], w_t, out[a:b])
        if bias is not None:
            out[a:b] += bias

    _run([functools.partial(part, a, b) for a, b in split(n, _parts(2 * n * c_in * c_out), ROW_MULTIPLE)])
    return out.reshape(x.shape[:-1] + (c_out,)), LinearCache(x, weight, bias is not None)


def linear_backward(dout, cache: LinearCache):
    x, weight, has_bias = cache
    c_out, c_in = weight.shape
    expect_grad(dout, "dout", x.shape[:-1] + (c_out,), x.dtype)
    d2, x2 = as_rows(dout), as_rows(x)                               # (N, C_out), (N, C_in)
    n = d2.shape[0]
    dx = numpy.empty((n, c_in), dtype=x.dtype)                       # (N, C_in)
    dweight = numpy.empty((c_out, c_in), dtype=x.dtype)              # (C_out, C_in)
    dbias = numpy.empty(c_out, dtype=x.dtype) if has_bias else None  # (C_out,)
    # fwd: out = x @ W^T + b  ->  dx = dout @ W,  dW = dout^T @ x,  db = sum_N dout
    parts = _parts(4 * n * c_in * c_out)
    rows, outs = ([(0, n)], [(0, c_out)]) if parts == 1 else (split(n, parts, ROW_MULTIPLE),
                                                               split(c_out, parts, ROW_MULTIPLE))

    def part(k: int) -> None:
        if k < len(rows):
            a, b = rows[k]
            _product(d2[a:b], weight, dx[a:b])
        if k < len(outs):
            a, b = outs[k]
            _product(d2[:, a:b].T, x2, dweight[a:b])
            if has_bias:             # in float32 for float16, as the reference's accumulated_sum
                d2[:, a:b].sum(axis=0, dtype=accumulation_dtype(d2.dtype), out=dbias[a:b])

    _run([functools.partial(part, k) for k in range(max(len(rows), len(outs)))])
    return dx.reshape(x.shape), dweight, dbias
