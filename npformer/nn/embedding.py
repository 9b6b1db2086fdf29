"""Token and position embeddings.

* ``Embedding(num_embeddings, embedding_dim, padding_idx=None)``: a lookup table, as ``torch.nn.Embedding``
  (initialised N(0, 1); the padding row starts at zero and receives no gradient).
* ``sinusoidal_table(max_len, d)``: the paper's fixed encoding (Vaswani et al. 2017, section 3.5)
  ``PE[pos, 2i] = sin(pos / 10000^(2i/d))``, ``PE[pos, 2i+1] = cos(pos / 10000^(2i/d))``.
* ``PositionalEncoding(d_model, max_len)``: ``x + PE[offset : offset + T]``, no parameters; the
  gradient passes through unchanged.
* ``LearnedPositionalEncoding(d_model, max_len)``: ``x + P[offset : offset + T]`` with a trained
  table P (BERT, GPT); ``dP[offset + t] += sum over the batch of dout[:, t]``.
"""
from __future__ import annotations

import math

from npformer.backend import DEFAULT_DTYPE, accumulated_sum, get_array_module, get_backend
from npformer.checks import integer, non_negative_int, positive_int
from npformer.errors import RangeError, ShapeError
from npformer.nn import init
from npformer.nn.module import Module, Parameter
from npformer.ops.embedding import embedding_backward, embedding_forward

__all__ = ["Embedding", "PositionalEncoding", "LearnedPositionalEncoding", "sinusoidal_table"]


class Embedding(Module):
    """``out = weight[ids]``; ``backward`` scatter-adds into ``weight.grad`` and returns None (ids are
    integers: nothing flows further back)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None, *,
                 std: float = 1.0, dtype=None, backend=None, rng=None):
        super().__init__()
        rng = init.host_generator(rng)   # one stream for all of this module's draws
        num_embeddings = positive_int(num_embeddings, "num_embeddings")
        embedding_dim = positive_int(embedding_dim, "embedding_dim")
        if padding_idx is not None:
            if not -num_embeddings <= integer(padding_idx, "padding_idx") < num_embeddings:
                raise RangeError(f"padding_idx must be in [-{num_embeddings}, {num_embeddings}), "
                                 f"got {padding_idx}")
            padding_idx %= num_embeddings
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        weight = init.normal((num_embeddings, embedding_dim), std, rng=rng, dtype=dtype, backend=backend)
        if padding_idx is not None:
            weight[padding_idx] = 0
        self.weight = Parameter(weight, decay=False)

    def forward(self, ids):
        out, cache = embedding_forward(ids, self.weight.data, padding_idx=self.padding_idx)
        self._push(cache)
        return out                                       # ids.shape + (C,)

    def backward(self, dout):
        self.weight.accumulate(embedding_backward(dout, self._pop()))
        return None

    def extra_repr(self) -> str:
        pad = "" if self.padding_idx is None else f", padding_idx={self.padding_idx}"
        return f"{self.num_embeddings}, {self.embedding_dim}{pad}"


def sinusoidal_table(max_len: int, d_model: int, *, dtype=None, backend=None):
    """The (max_len, d_model) table of the paper's sine/cosine encoding (odd d_model allowed)."""
    max_len, d_model = non_negative_int(max_len, "max_len"), positive_int(d_model, "d_model")
    xp = get_backend(backend)
    pos = xp.arange(max_len, dtype=xp.float64)[:, None]                       # (L, 1)
    freq = xp.exp(-math.log(10000.0) * xp.arange(0, d_model, 2, dtype=xp.float64) / d_model)  # (ceil(d/2),)
    angles = pos * freq                                                       # (L, ceil(d/2))
    table = xp.empty((max_len, d_model), dtype=xp.float64)                    # (L, d)
    table[:, 0::2] = xp.sin(angles)
    table[:, 1::2] = xp.cos(angles[:, : d_model // 2])
    return table.astype(xp.dtype(dtype or DEFAULT_DTYPE))


class PositionalEncoding(Module):
    """Adds the sinusoidal table to (B, T, C) inputs, starting at position ``offset``."""

    def __init__(self, d_model: int, max_len: int = 5000):
        super().__init__()
        self.d_model, self.max_len = positive_int(d_model, "d_model"), positive_int(max_len, "max_len")
        self._tables: dict = {}

    def table(self, xp, dtype):
        key = (xp.__name__, str(dtype))
        if key not in self._tables:
            self._tables[key] = sinusoidal_table(self.max_len, self.d_model, dtype=dtype, backend=xp.__name__)
        return self._tables[key]

    def forward(self, x, offset: int = 0):
        t = x.shape[-2]
        if offset + t > self.max_len:
            raise RangeError(f"positions {offset}..{offset + t - 1} exceed max_len={self.max_len} of "
                             "the positional encoding")
        if x.shape[-1] != self.d_model:
            raise ShapeError(f"x: expected last axis d_model={self.d_model}, got shape {tuple(x.shape)}")
        xp = get_array_module(x)
        return x + self.table(xp, x.dtype)[offset: offset + t]                # (B, T, C)

    def backward(self, dout):
        return dout                                      # fwd: y = x + PE  ->  dx = dy

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, max_len={self.max_len}"


class LearnedPositionalEncoding(Module):
    """Adds a trained (max_len, C) table to (B, T, C) inputs, starting at position ``offset``."""

    def __init__(self, d_model: int, max_len: int = 512, *, std: float = 0.02, dtype=None, backend=None,
                 rng=None):
        super().__init__()
        self.d_model, self.max_len = positive_int(d_model, "d_model"), positive_int(max_len, "max_len")
        self.weight = Parameter(init.normal((max_len, d_model), std, rng=rng, dtype=dtype, backend=backend),
                                decay=False)

    def forward(self, x, offset: int = 0):
        t = x.shape[-2]
        if offset + t > self.max_len:
            raise RangeError(f"positions {offset}..{offset + t - 1} exceed max_len={self.max_len} of "
                             "the positional table")
        self._push((offset, t))
        return x + self.weight.data[offset: offset + t]                          # (B, T, C)

    def backward(self, dout):
        offset, t = self._pop()
        xp = get_array_module(dout)
        d = accumulated_sum(dout.reshape(-1, t, dout.shape[-1]), axis=0)         # (T, C)
        grad = xp.zeros_like(self.weight.data)                                   # (L, C)
        grad[offset: offset + t] = d
        self.weight.accumulate(grad)                     # fwd: y = x + P[offset:]  ->  dP = sum_B dy
        return dout

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, max_len={self.max_len}"
