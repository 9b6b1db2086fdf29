"""``NormEncoder``: a small Transformer encoder that tags every token, with the normalisation as a
choice, for comparing LayerNorm with BatchNorm in one architecture (``npformer study norms``).

    x = dropout(E[ids] * sqrt(d) + PE)                       (B, T, C), padding = ids == pad_id
    post-norm layer:  x = N1(x + drop(SA(x)));   x = N2(x + drop(FF(x)))
    pre-norm layer:   x = x + drop(SA(N1(x)));   x = x + drop(FF(N2(x)))     (then a final norm)
    logits = x W^T + b                                       (B, T, K) one class per position

N is ``norm``: "layer" (LayerNorm: each position normalised over its own C features), "batch"
(BatchNorm1d over all B*T positions, padding included, which is what ``torch.nn.BatchNorm1d`` does
to a padded batch) or "batch_masked" (BatchNorm1d with the padding positions left out of the
statistics). The layers are written here from ``MultiheadAttention``, ``FeedForwardBlock`` and the
norms, so ``npformer.nn.transformer`` stays LayerNorm-only. BatchNorm's running statistics are
buffers, saved by ``state_dict`` with the parameters.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from npformer.backend import get_array_module
from npformer.nn import init
from npformer.nn.attention import MultiheadAttention
from npformer.nn.dropout import Dropout
from npformer.nn.embedding import Embedding, PositionalEncoding
from npformer.nn.linear import Linear
from npformer.nn.module import Module, ModuleList
from npformer.nn.normalization import LayerNorm
from npformer.nn.normalization_batch import BatchNorm1d
from npformer.nn.transformer import FeedForwardBlock

__all__ = ["NORMS", "NormEncoderConfig", "NormEncoderLayer", "NormEncoder"]

NORMS = {
    "layer": "LayerNorm: per position, over its C features",
    "batch": "BatchNorm1d: per feature, over all B*T positions, padding included (torch's behaviour)",
    "batch_masked": "BatchNorm1d: per feature, over the non-padding positions only",
}


def _make_norm(kind: str, d_model: int, kw: dict) -> Module:
    if kind not in NORMS:
        raise ValueError(f"norm must be one of {sorted(NORMS)}, got {kind!r}")
    return LayerNorm(d_model, **kw) if kind == "layer" else BatchNorm1d(d_model, **kw)


@dataclass(frozen=True)
class NormEncoderConfig:
    vocab_size: int
    num_classes: int
    d_model: int = 32
    nhead: int = 2
    num_layers: int = 2
    dim_feedforward: int = 64
    dropout: float = 0.0
    activation: str = "relu"
    norm: str = "layer"
    norm_first: bool = False
    max_len: int = 64
    pad_id: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


class NormEncoderLayer(Module):
    """Self-attention and feed-forward, each in a residual branch with the chosen norm."""

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int, dropout: float = 0.0,
                 activation: str = "relu", norm: str = "layer", norm_first: bool = False, *,
                 dtype=None, backend=None, rng=None):
        super().__init__()
        rng = init.host_generator(rng)
        kw = dict(dtype=dtype, backend=backend)
        self.norm_kind, self.norm_first = norm, norm_first
        self.self_attn = MultiheadAttention(d_model, nhead, dropout=dropout, rng=rng, **kw)
        self.ff = FeedForwardBlock(d_model, dim_feedforward, dropout, activation, rng=rng, **kw)
        self.norm1, self.norm2 = _make_norm(norm, d_model, kw), _make_norm(norm, d_model, kw)
        self.dropout1, self.dropout2 = Dropout(dropout), Dropout(dropout)
        self.manual_seed(init.stream_seed(rng))          # the model's dropout stream

    def _norm(self, norm: Module, x, padding):
        return norm(x, padding) if self.norm_kind == "batch_masked" else norm(x)  # (B, T, C)

    def _sa(self, h, padding):
        a, _ = self.self_attn(h, h, h, key_padding_mask=padding, need_weights=False)
        return self.dropout1(a)                                                   # (B, T, C)

    def forward(self, x, padding):
        """x (B, T, C), padding (B, T) bool, True = padding."""
        if self.norm_first:
            x = x + self._sa(self._norm(self.norm1, x, padding), padding)
            return x + self.dropout2(self.ff(self._norm(self.norm2, x, padding)))
        x = self._norm(self.norm1, x + self._sa(x, padding), padding)
        return self._norm(self.norm2, x + self.dropout2(self.ff(x)), padding)

    def backward(self, dout):
        def sa_backward(d):
            return self.self_attn.backward(self.dropout1.backward(d))[0]         # (B, T, C)

        def ff_backward(d):
            return self.ff.backward(self.dropout2.backward(d))                   # (B, T, C)
        if self.norm_first:
            # fwd: y = x1 + drop2(FF(N2(x1)))  ->  dx1 = dy + N2'(FF'(drop2'(dy)))
            dx1 = dout + self.norm2.backward(ff_backward(dout))
            # fwd: x1 = x + drop1(SA(N1(x)))  ->  dx = dx1 + N1'(SA'(drop1'(dx1)))
            return dx1 + self.norm1.backward(sa_backward(dx1))
        # fwd: y = N2(x1 + drop2(FF(x1)))  ->  d = N2'(dy);  dx1 = d + FF'(drop2'(d))
        d = self.norm2.backward(dout)
        dx1 = d + ff_backward(d)
        # fwd: x1 = N1(x + drop1(SA(x)))  ->  d = N1'(dx1);  dx = d + SA'(drop1'(d))
        d = self.norm1.backward(dx1)
        return d + sa_backward(d)


class NormEncoder(Module):
    """Token ids (B, T) -> per-position class logits (B, T, K)."""

    def __init__(self, config: NormEncoderConfig, *, dtype=None, backend=None, rng=None):
        super().__init__()
        c = self.config = config
        if c.norm not in NORMS:
            raise ValueError(f"norm must be one of {sorted(NORMS)}, got {c.norm!r}")
        rng = init.host_generator(rng)
        kw = dict(dtype=dtype, backend=backend)
        # no padding_idx: the padding row is an ordinary row, so its gradient is the true one. Under
        # "batch" it is not zero (padding moves the statistics, so it reaches every valid output);
        # under "layer" and "batch_masked" padding never reaches a valid position and it is zero.
        self.embed = Embedding(c.vocab_size, c.d_model, std=c.d_model ** -0.5, rng=rng, **kw)
        self.pos = PositionalEncoding(c.d_model, c.max_len)
        self.dropout = Dropout(c.dropout)
        self.layers = ModuleList(NormEncoderLayer(c.d_model, c.nhead, c.dim_feedforward, c.dropout,
                                                  c.activation, c.norm, c.norm_first, rng=rng, **kw)
                                 for _ in range(c.num_layers))
        self.norm = _make_norm(c.norm, c.d_model, kw) if c.norm_first else None
        self.head = Linear(c.d_model, c.num_classes, rng=rng, **kw)
        self.scale = math.sqrt(c.d_model)
        self.manual_seed(init.stream_seed(rng))          # the model's dropout stream

    def forward(self, ids):
        if not hasattr(ids, "dtype") or ids.dtype.kind not in "iu" or ids.ndim != 2:
            raise TypeError(f"ids: expected a 2-d integer array (B, T) of token ids, got "
                            f"{getattr(ids, 'dtype', type(ids).__name__)} {tuple(getattr(ids, 'shape', ()))}")
        get_array_module(ids)
        padding = ids == self.config.pad_id                                       # (B, T)
        x = self.dropout(self.pos(self.embed(ids) * self.scale))                  # (B, T, C)
        for layer in self.layers:
            x = layer(x, padding)
        if self.norm is not None:
            x = self.norm(x, padding) if self.config.norm == "batch_masked" else self.norm(x)
        return self.head(x)                                                       # (B, T, K)

    def backward(self, dlogits):
        """Accumulates every parameter gradient (ids have none); returns None."""
        d = self.head.backward(dlogits)
        if self.norm is not None:
            d = self.norm.backward(d)
        for layer in reversed(list(self.layers)):
            d = layer.backward(d)
        # fwd: x = drop(E[ids] * s + PE)  ->  dE[ids] += s * drop'(dx)
        self.embed.backward(self.pos.backward(self.dropout.backward(d)) * self.scale)
