"""The embedding's backward for NumPy: each id's rows summed by one ``numpy.add.reduceat`` over the
rows sorted by id (reference: :mod:`npformer.ops.embedding`, the same signature, cache and result
to rounding).

    dW[v] = sum of dout[n] over the positions n where ids[n] == v

The reference's ``scatter_add`` adds each id's rows up in float64 by a segmented scan of
ceil(log2 N) elementwise passes over all N rows (fixed shapes, for CuPy); here the rows of each id
are summed in the order they came, in float64, by one call. Both are float64 sums of the same
values, rounded as the reference rounds them (once to the gradient's dtype; for 16-bit gradients to
float32 first, the reference's accumulation dtype), so they agree to float64 rounding before that.
"""
from __future__ import annotations

import numpy

from npformer.backend import accumulation_dtype
from npformer.checks import expect_grad
from npformer.kernels.cpu import numpy_floats
from npformer.ops.embedding import EmbeddingCache

__all__ = ["embedding_backward", "accepts_backward"]


def accepts_backward(dout, cache) -> bool:
    """A NumPy float gradient and an embedding cache of NumPy ids."""
    return numpy_floats(dout) and isinstance(cache, EmbeddingCache) and type(cache.ids) is numpy.ndarray


def embedding_backward(dout, cache: EmbeddingCache):
    ids, v, padding_idx, dim, dtype = cache
    expect_grad(dout, "dout", tuple(ids.shape) + (dim,), dtype)
    dweight = numpy.zeros((v, dim), dtype=accumulation_dtype(dout.dtype))      # (V, C)
    flat = ids.reshape(-1)                                                     # (N,)
    if flat.size:
        order = numpy.argsort(flat, kind="stable")                             # (N,) each id's rows in order
        sorted_ids = flat[order]
        starts = numpy.flatnonzero(numpy.concatenate([[True], sorted_ids[1:] != sorted_ids[:-1]]))   # (U,)
        rows = dout.reshape(flat.size, dim)[order]                             # (N, C) grouped by id (C may be 0)
        # fwd: out = W[ids]  ->  dW[v] = sum of the rows of id v
        dweight[sorted_ids[starts]] = numpy.add.reduceat(rows, starts, axis=0, dtype=numpy.float64)
    if padding_idx is not None:
        dweight[padding_idx] = 0
    return dweight.astype(dout.dtype, copy=False)                              # (V, C)
