"""``Seq2Seq``: the paper's encoder-decoder Transformer with embeddings and an output head
(Vaswani et al. 2017, figure 1), over integer token ids.

    x = dropout(E_src[src] * sqrt(d) + PE)            memory = Encoder(x, src padding)
    y = dropout(E_tgt[tgt_in] * sqrt(d) + PE)          h = Decoder(y, memory, causal + padding)
    logits = h W^T  (W = E_tgt when tied, section 3.4; E_src = E_tgt too with share_embeddings)

Embeddings start N(0, 1/d) so that after the sqrt(d) scale they have unit variance, and a tied
head starts with logits of unit scale. Padding tokens (``pad_id``) are masked as keys everywhere.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from npformer.checks import non_negative_int, one_of, positive_int, probability, token_ids
from npformer.errors import RangeError, ShapeError
from npformer.nn import init
from npformer.nn.dropout import Dropout
from npformer.nn.embedding import Embedding, LearnedPositionalEncoding, PositionalEncoding
from npformer.nn.head import OutputHead
from npformer.nn.module import Module
from npformer.nn.transformer import Transformer
from npformer.ops.feedforward import ACTIVATIONS

__all__ = ["Seq2SeqConfig", "Seq2Seq", "PAPER_SIZES"]

# The paper's two sizes (Vaswani et al. 2017, Table 3; dropout: section 5.4 and Table 3's big row).
PAPER_SIZES = {
    "base": dict(d_model=512, nhead=8, num_encoder_layers=6, num_decoder_layers=6, dim_feedforward=2048,
                 dropout=0.1),
    "big": dict(d_model=1024, nhead=16, num_encoder_layers=6, num_decoder_layers=6, dim_feedforward=4096,
                dropout=0.3),
}


@dataclass(frozen=True)
class Seq2SeqConfig:
    src_vocab_size: int
    tgt_vocab_size: int
    d_model: int = 128
    nhead: int = 4
    num_encoder_layers: int = 2
    num_decoder_layers: int = 2
    dim_feedforward: int = 512
    dropout: float = 0.1
    activation: str = "relu"
    norm_first: bool = False
    max_len: int = 256
    pad_id: int = 0
    tie_embeddings: bool = True      # output head shares the target embedding (section 3.4)
    positional: str = "sinusoidal"   # or "learned" (one trained table shared by source and target)
    share_embeddings: bool = False   # one embedding for source and target (a shared vocabulary, section 3.4)

    def __post_init__(self):
        for name in ("src_vocab_size", "tgt_vocab_size", "d_model", "nhead", "num_encoder_layers",
                     "num_decoder_layers", "dim_feedforward", "max_len"):
            positive_int(getattr(self, name), name)
        if self.d_model % self.nhead:
            raise ShapeError(f"d_model {self.d_model} is not divisible by nhead {self.nhead}")
        probability(self.dropout, "dropout")
        one_of(self.activation, "activation", tuple(ACTIVATIONS))
        one_of(self.positional, "positional", ("sinusoidal", "learned"))
        if self.share_embeddings and self.src_vocab_size != self.tgt_vocab_size:
            raise RangeError("share_embeddings: one embedding for source and target needs one vocabulary, got "
                             f"src_vocab_size {self.src_vocab_size} and tgt_vocab_size {self.tgt_vocab_size}")
        smallest = min(self.src_vocab_size, self.tgt_vocab_size)
        if non_negative_int(self.pad_id, "pad_id") >= smallest:
            raise RangeError(f"pad_id: expected an id in [0, {smallest}) (both vocabularies), got {self.pad_id}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def paper(cls, size: str, vocab_size: int = 37000, **overrides) -> "Seq2SeqConfig":
        """The paper's ``"base"`` or ``"big"`` model (:data:`PAPER_SIZES`) over one shared vocabulary
        (37,000 tokens of byte-pair encoding for English-German), with the three-way sharing of
        section 3.4: source embedding = target embedding = output projection."""
        one_of(size, "size", tuple(PAPER_SIZES))
        return cls(**{"src_vocab_size": vocab_size, "tgt_vocab_size": vocab_size, **PAPER_SIZES[size],
                      "share_embeddings": True, "tie_embeddings": True, **overrides})


class Seq2Seq(Module):
    def __init__(self, config: Seq2SeqConfig, *, dtype=None, backend=None, rng=None):
        super().__init__()
        c = self.config = config
        rng = init.host_generator(rng)
        kw = dict(dtype=dtype, backend=backend)
        std = c.d_model ** -0.5
        self.src_embed = Embedding(c.src_vocab_size, c.d_model, padding_idx=c.pad_id, std=std, rng=rng, **kw)
        # shared: one module under both names (its per-call caches are consumed in reverse, so the
        # backward's target-then-source order pops each call's own; the two gradients add up)
        self.tgt_embed = (self.src_embed if c.share_embeddings else
                          Embedding(c.tgt_vocab_size, c.d_model, padding_idx=c.pad_id, std=std, rng=rng, **kw))
        if c.positional == "sinusoidal":
            self.pos = PositionalEncoding(c.d_model, c.max_len)
        elif c.positional == "learned":
            self.pos = LearnedPositionalEncoding(c.d_model, c.max_len, rng=rng, **kw)
        else:
            raise RangeError(f"positional: expected one of 'sinusoidal', 'learned', got {c.positional!r}")
        self.src_dropout, self.tgt_dropout = Dropout(c.dropout), Dropout(c.dropout)
        self.transformer = Transformer(c.d_model, c.nhead, c.num_encoder_layers, c.num_decoder_layers,
                                       c.dim_feedforward, c.dropout, c.activation,
                                       norm_first=c.norm_first, rng=rng, **kw)
        self.generator = OutputHead(c.d_model, c.tgt_vocab_size,
                                    tied=self.tgt_embed.weight if c.tie_embeddings else None, rng=rng, **kw)
        self.scale = math.sqrt(c.d_model)
        self.manual_seed(init.stream_seed(rng))          # the model's dropout stream

    # -- pieces, also used by decoding -------------------------------------------------------------
    def _embed(self, embed, dropout, ids, offset=0):
        e = embed(ids)                                                            # (B, T, C)
        return dropout(self.pos(e * e.dtype.type(self.scale), offset))            # (B, T, C), the scale in e's dtype

    def _embed_backward(self, embed, dropout, dx):
        # fwd: x = dropout(E[ids] * sqrt(d) + PE)  ->  dE[ids] += sqrt(d) * dropout'(dx)
        de = self.pos.backward(dropout.backward(dx))                              # (B, T, C)
        embed.backward(de * de.dtype.type(self.scale))

    def encode(self, src):
        """memory (B, S, C) and the source padding mask (B, S), True = padding."""
        token_ids(src, "src", self.config.src_vocab_size)
        self._check_length(src, "src")
        src_pad = src == self.config.pad_id                                       # (B, S)
        x = self._embed(self.src_embed, self.src_dropout, src)
        return self.transformer.encoder(x, src_key_padding_mask=src_pad), src_pad

    def decode(self, tgt_in, memory, src_pad, kv_cache: list | None = None, *, tgt_padded: bool = True):
        """Logits (B, T, V) of the next tokens for every prefix of ``tgt_in``.

        ``tgt_padded``: ``pad_id`` in ``tgt_in`` marks padding, masked as keys (a training batch). A
        prefix that decoding generated has no padding (a ``pad_id`` the model emitted, or a ``bos_id``
        equal to it, is a token like any other), so decoding passes False and every token is a key.

        With ``kv_cache`` (:meth:`new_cache`; inference, under ``no_grad`` in eval mode) ``tgt_in``
        holds only the new target tokens, after those already in the cache: the same logits as the
        last rows of a decode of the whole prefix with ``tgt_padded=False``, at a cost linear in the
        prefix length per step (a cached prefix is never padded)."""
        offset = 0 if kv_cache is None else len(kv_cache[0][0])
        token_ids(tgt_in, "tgt_in", self.config.tgt_vocab_size)
        self._check_length(tgt_in, "tgt_in", offset)
        padded = tgt_padded and kv_cache is None
        tgt_pad = tgt_in == self.config.pad_id if padded else None                # (B, T) True = padding
        y = self._embed(self.tgt_embed, self.tgt_dropout, tgt_in, offset)
        h = self.transformer.decoder(y, memory, tgt_key_padding_mask=tgt_pad, memory_key_padding_mask=src_pad,
                                     tgt_is_causal=True, kv_cache=kv_cache)
        return self.generator(h)                                                  # (B, T, V)

    def new_cache(self) -> list:
        """One (self-attention, cross-attention) pair of key/value caches per decoder layer."""
        return self.transformer.decoder.new_cache()

    # -- training ----------------------------------------------------------------------------------
    def forward(self, src, tgt_in):
        """src (B, S), tgt_in (B, T) integer ids -> logits (B, T, V)."""
        memory, src_pad = self.encode(src)
        return self.decode(tgt_in, memory, src_pad)

    def backward(self, dlogits):
        """Accumulates every parameter gradient (ids have none); returns None."""
        # fwd: logits = generator(decoder(y, memory))  (the generator's weight is E_tgt when tied)
        dh = self.generator.backward(dlogits)
        dy, dmemory = self.transformer.decoder.backward(dh)
        self._embed_backward(self.tgt_embed, self.tgt_dropout, dy)
        # fwd: memory = encoder(x)  ->  dx from the memory's gradient, summed over the decoder's layers
        dx = self.transformer.encoder.backward(dmemory)
        self._embed_backward(self.src_embed, self.src_dropout, dx)

    def _check_length(self, ids, name, offset=0):
        if offset + ids.shape[1] > self.config.max_len:
            raise RangeError(f"{name}: length {offset + ids.shape[1]} exceeds max_len={self.config.max_len}")
