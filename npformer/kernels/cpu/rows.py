"""Sums along the last axis for the CPU fast paths: ``einsum`` contractions on short rows.

NumPy's ``x.sum(axis=-1)`` starts a reduction for every row, which on short rows costs more than
the arithmetic: on the 2-core AMD VM (one thread, float32), a block of 64K attention scores in
rows of 64 took 37 us to sum against 12 by ``einsum``, and ``(dy * y).sum(axis=-1)`` 50 against 18
(the exp of the same block: 90-110 us); 2048 layer-norm rows of 128, 99 against 40. ``einsum`` also
never builds the product's array. But it adds a row's terms in a few SIMD lanes one after another,
where NumPy's ``sum`` adds them pairwise, and its rounding grows with the row: the worst relative
error of float32 sums of uniform numbers against float64 was 2.0e-7 (pairwise 1.2e-7) at 1024 terms,
3.2e-7 at 4096 and 1.4e-6 at 50257 (pairwise 1.0-1.3e-7). So rows longer than :data:`SHORT_ROW`,
where a reduction per row costs little anyway, take NumPy's ``sum``. Either way each row is summed
by the same loop however many rows a call holds: a fast path that runs rows block by block gets the
same bits for any blocks.

    row_sum(x)       # (..., N) -> (..., 1): sum of x along the last axis
    row_dot(x, y)    # (..., N), (..., N) -> (..., 1): sum of x * y along the last axis
"""
from __future__ import annotations

import numpy

__all__ = ["row_sum", "row_dot", "SHORT_ROW"]

SHORT_ROW = 1024       # the longest row summed by einsum (as accurate as the pairwise sum up to here)


def row_sum(x):
    """sum(x) along the last axis, kept as an axis of 1: (..., N) -> (..., 1)."""
    if x.shape[-1] > SHORT_ROW:
        return x.sum(axis=-1, keepdims=True)
    return numpy.einsum("...n->...", x)[..., None]


def row_dot(x, y):
    """sum(x * y) along the last axis, kept as an axis of 1 (on short rows without the product's array)."""
    if x.shape[-1] > SHORT_ROW:
        return (x * y).sum(axis=-1, keepdims=True)
    return numpy.einsum("...n,...n->...", x, y)[..., None]
