"""Embedding lookup, as ``torch.nn.functional.embedding``.

    out[..., :] = W[ids[...], :]           ids: any shape of integers in [0, V), W: (V, C)
    dW[v] = sum of dout over every position where ids == v     (a scatter-add: repeated ids add up)

The row ``padding_idx`` receives no gradient (it stays what it was, usually zeros), as in PyTorch;
a negative ``padding_idx`` in [-V, 0) counts from the end (normalised to ``padding_idx + V``).
The output is a fresh array (a gather), never a view of ``W``. Repeated ids are summed in at least
float32 (``accumulation_dtype``) and the gradient is returned in ``dout``'s dtype.
"""
from __future__ import annotations

from numbers import Integral
from typing import Any, NamedTuple

from npformer.backend import accumulation_dtype, get_array_module, scatter_add
from npformer.checks import describe, expect_float, expect_grad, expect_int, expect_ndim, ids_below
from npformer.dispatch import dispatched
from npformer.errors import InputTypeError, RangeError

__all__ = ["EmbeddingCache", "embedding_forward", "embedding_backward"]


class EmbeddingCache(NamedTuple):
    """What backward needs: the ids, V and the normalised padding row (never the table itself)."""

    ids: Any                 # (...) the integer ids
    num_embeddings: int      # V
    padding_idx: int | None  # normalised to [0, V)
    embedding_dim: int       # C
    dtype: Any               # the table's dtype (the output's)


@dispatched
def embedding_forward(ids, weight, padding_idx: int | None = None):
    """Returns ``(out, cache)`` with ``out`` of shape ``ids.shape + (C,)``."""
    expect_int(ids, "ids")
    expect_ndim(weight, "weight", 2, "(V, C)")
    expect_float(weight, "weight")
    xp = get_array_module(ids, weight)
    v = weight.shape[0]
    ids_below(ids, "ids", v, f"a table of {v} rows")
    if padding_idx is not None:
        if isinstance(padding_idx, bool) or not isinstance(padding_idx, Integral):
            raise InputTypeError(f"padding_idx must be an int or None, got {describe(padding_idx)}")
        if not -v <= padding_idx < v:
            raise RangeError(f"padding_idx must be in [-{v}, {v}), got {padding_idx}")
        padding_idx = int(padding_idx) % v               # torch's rule: -1 is the last row
    out = xp.take(weight, ids, axis=0)                   # ids.shape + (C,)
    return out, EmbeddingCache(ids, v, padding_idx, weight.shape[1], weight.dtype)


@dispatched
def embedding_backward(dout, cache: EmbeddingCache):
    """Returns ``dweight`` (V, C)."""
    ids, v, padding_idx, dim, dtype = cache
    expect_grad(dout, "dout", tuple(ids.shape) + (dim,), dtype)
    xp = get_array_module(dout, ids)
    c = dout.shape[-1]
    dweight = xp.zeros((v, c), dtype=accumulation_dtype(dout.dtype))   # (V, C)
    # fwd: out = W[ids]  ->  dW[ids] += dout  (repeated ids summed)
    rows = dout.reshape(ids.size, c).astype(dweight.dtype, copy=False)   # (N, C), N = ids.size (C may be 0)
    scatter_add(dweight, ids.reshape(-1), rows)          # (V, C) in place on the fresh dweight
    if padding_idx is not None:
        dweight[padding_idx] = 0                         # fresh array: no input is touched
    return dweight.astype(dout.dtype, copy=False)        # (V, C)
