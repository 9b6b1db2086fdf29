"""``NormEncoder``: a small Transformer encoder that tags every token, with the normalisation as a
choice, for comparing LayerNorm with BatchNorm in one architecture (``npformer study norms``).

    x = dropout(E[ids] * sqrt(d) + PE)                       (B, T, C), padding = ids == pad_id
    post-norm layer:  x = N1(x + drop(SA(x)));   x = N2(x + drop(FF(x)))
    pre-norm layer:   x = x + drop(SA(N1(x)));   x = x + drop(FF(N2(x)))     (then a final norm)
    logits = x W^T + b                                       (B, T, K) one class per position

N is ``norm``: "layer" (LayerNorm: each position normalised over its own C features), "batch"
(BatchNorm1d over all B*T positions, padding included, which is what ``torch.nn.BatchNorm1d`` does
to a padded batch) or "batch_masked" (BatchNorm1d with the padding positions left out of the
statistics). The layers are :class:`npformer.nn.experimental.ConfigurableEncoderLayer` with the norm
chosen, so ``npformer.nn.transformer`` stays LayerNorm-only. BatchNorm's running statistics are
buffers, saved by ``state_dict`` with the parameters.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from npformer.checks import non_negative_int, one_of, positive_int, probability, token_ids
from npformer.errors import RangeError, ShapeError
from npformer.nn import init
from npformer.nn.dropout import Dropout
from npformer.nn.embedding import Embedding, PositionalEncoding
from npformer.nn.experimental import NORMS, ConfigurableEncoderLayer, make_norm
from npformer.nn.linear import Linear
from npformer.nn.module import Module, ModuleList
from npformer.ops.feedforward import ACTIVATIONS

__all__ = ["NORMS", "NormEncoderConfig", "NormEncoder"]

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

    def __post_init__(self):
        for name in ("vocab_size", "num_classes", "d_model", "nhead", "num_layers", "dim_feedforward", "max_len"):
            positive_int(getattr(self, name), name)
        if self.d_model % self.nhead:
            raise ShapeError(f"d_model {self.d_model} is not divisible by nhead {self.nhead}")
        probability(self.dropout, "dropout")
        one_of(self.activation, "activation", tuple(ACTIVATIONS))
        one_of(self.norm, "norm", tuple(NORMS))
        if non_negative_int(self.pad_id, "pad_id") >= self.vocab_size:
            raise RangeError(f"pad_id: expected an id in [0, {self.vocab_size}), got {self.pad_id}")

    def to_dict(self) -> dict:
        return asdict(self)


class NormEncoder(Module):
    """Token ids (B, T) -> per-position class logits (B, T, K)."""

    def __init__(self, config: NormEncoderConfig, *, dtype=None, backend=None, rng=None):
        super().__init__()
        c = self.config = config
        one_of(c.norm, "norm", tuple(NORMS))
        rng = init.host_generator(rng)
        kw = dict(dtype=dtype, backend=backend)
        # no padding_idx: the padding row is an ordinary row, so its gradient is the true one. Under
        # "batch" it is not zero (padding moves the statistics, so it reaches every valid output);
        # under "layer" and "batch_masked" padding never reaches a valid position and it is zero.
        self.embed = Embedding(c.vocab_size, c.d_model, std=c.d_model ** -0.5, rng=rng, **kw)
        self.pos = PositionalEncoding(c.d_model, c.max_len)
        self.dropout = Dropout(c.dropout)
        self.layers = ModuleList(ConfigurableEncoderLayer(c.d_model, c.nhead, c.dim_feedforward, c.dropout,
                                                          c.activation, norm_first=c.norm_first, norm=c.norm,
                                                          rng=rng, **kw)
                                 for _ in range(c.num_layers))
        self.norm = make_norm(c.norm, c.d_model, **kw) if c.norm_first else None
        self.head = Linear(c.d_model, c.num_classes, rng=rng, **kw)
        self.scale = math.sqrt(c.d_model)
        self.manual_seed(init.stream_seed(rng))          # the model's dropout stream

    def forward(self, ids):
        token_ids(ids, "ids", self.config.vocab_size)
        padding = ids == self.config.pad_id                                       # (B, T)
        e = self.embed(ids)                                                       # (B, T, C)
        x = self.dropout(self.pos(e * e.dtype.type(self.scale)))                  # (B, T, C), the scale in e's dtype
        for layer in self.layers:
            x = layer(x, src_key_padding_mask=padding)
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
        de = self.pos.backward(self.dropout.backward(d))                          # (B, T, C)
        self.embed.backward(de * de.dtype.type(self.scale))
