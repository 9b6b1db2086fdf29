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

so BLAS's own workers are not woken and nothing spins. Every element is one BLAS dot product
over the same K whichever part holds it; the parts depend only on the shapes and the thread count.
NumPy sums a column slice down its rows as it sums the whole array, so db is the reference's bit
for bit (tested).
Two kinds of product run as the reference instead, one BLAS call on BLAS's own threads (whose
hand-off is faster than the pool's, :mod:`npformer.kernels.cpu.threads`): those under
:data:`MIN_PARALLEL_FLOPS` a part, and every product of a layer narrower than
:data:`MIN_PARALLEL_WIDTH` on either side (a small model's layers, whose element-wise work then
stays off the pool too, rather than share a core with BLAS's spinning workers). The narrow side
classes a model's layers together: every linear layer of a Transformer has d_model on one side
(the attention projections, both feed-forward layers, the head), so a model with d_model under 256
runs all its products on BLAS's threads and a wider one cuts them all for the pool. Counting the
weight's entries instead did not: nanoGPT's CPU recipe (d_model 128, MLP 512) has feed-forward
weights of 65,536 entries like a 256 x 256 layer, which went to the pool while its attention's
products woke BLAS's workers (2 threads: 87 ms a step against 67 ms with every product on BLAS's
threads). One mix is left: a head narrower than its model (a character vocabulary of 65 under
d_model 384) runs on BLAS's threads beside a pool-cut model. The choice follows the shapes alone,
never timing, so a product is computed the same way in every run.
"""
from __future__ import annotations

import functools

import numpy

from npformer.backend import accumulation_dtype
from npformer.checks import expect_grad
from npformer.kernels.cpu.threads import get_num_threads, in_parallel_region, note_blas_product, run_parallel, split
from npformer.ops.linear import LinearCache, as_rows, check_linear_inputs

__all__ = ["linear_forward", "linear_backward", "MIN_PARALLEL_FLOPS", "MIN_PARALLEL_WIDTH"]

MIN_PARALLEL_FLOPS = 1 << 26       # 67 MFLOP a part: below, BLAS's own threads hand off faster than the pool
MIN_PARALLEL_WIDTH = 256           # features on the weight's narrow side: narrower layers' products stay with BLAS
ROW_MULTIPLE = 16                  # part boundaries (rows of the products)


def _parts(flops: int, c_out: int, c_in: int) -> int:
    """Parts of a product of ``flops`` with a (c_out, c_in) weight: from the shapes and the thread
    count alone, never from timing (BLAS's own threads may add a product's terms in another order
    than one thread does, so the choice must not vary from run to run)."""
    if min(c_out, c_in) < MIN_PARALLEL_WIDTH or in_parallel_region():
        return 1
    return max(1, min(get_num_threads(), flops // MIN_PARALLEL_FLOPS))


def linear_forward(x, weight, bias=None):
    check_linear_inputs(x, weight, bias)
    c_out, c_in = weight.shape
    x2 = as_rows(x)                                                  # (N, C_in)
    n = x2.shape[0]
    out = numpy.empty((n, c_out), dtype=x.dtype)                     # (N, C_out)
    w_t = weight.T                                                   # (C_in, C_out) view

    def part(a: int, b: int) -> None:
        numpy.matmul(x2[a:b], w_t, out=out[a:b])
        if bias is not None:
            out[a:b] += bias

    parts = _parts(2 * n * c_in * c_out, c_out, c_in)
    if parts == 1:                         # the whole product: one BLAS call, on BLAS's own threads
        part(0, n)
        note_blas_product()
    else:
        run_parallel([functools.partial(part, a, b) for a, b in split(n, parts, ROW_MULTIPLE)])
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
    parts = _parts(4 * n * c_in * c_out, c_out, c_in)
    rows, outs = ([(0, n)], [(0, c_out)]) if parts == 1 else (split(n, parts, ROW_MULTIPLE),
                                                               split(c_out, parts, ROW_MULTIPLE))

    def part(k: int) -> None:
        if k < len(rows):
            a, b = rows[k]
            numpy.matmul(d2[a:b], weight, out=dx[a:b])
        if k < len(outs):
            a, b = outs[k]
            numpy.matmul(d2[:, a:b].T, x2, out=dweight[a:b])
            if has_bias:             # in float32 for float16, as the reference's accumulated_sum
                d2[:, a:b].sum(axis=0, dtype=accumulation_dtype(d2.dtype), out=dbias[a:b])

    if parts == 1:                         # the whole product: one BLAS call, on BLAS's own threads
        part(0)
        note_blas_product()
    else:
        run_parallel([functools.partial(part, k) for k in range(max(len(rows), len(outs)))])
    return dx.reshape(x.shape), dweight, dbias
