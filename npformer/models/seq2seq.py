"""``Seq2Seq``: the paper's encoder-decoder Transformer with embeddings and an output head
(Vaswani et al. 2017, figure 1), over integer token ids.

    x = dropout(E_src[src] * sqrt(d) + PE)            memory = Encoder(x, src padding)
    y = dropout(E_tgt[tgt_in] * sqrt(d) + PE)          h = Decoder(y, memory, causal + padding)
    logits = h W^T  (W = E_tgt when tied, section 3.4)

Embeddings start N(0, 1/d) so that after the sqrt(d) scale they have unit variance, and a tied
head starts with logits of unit scale. Padding tokens (``pad_id``) are masked as keys everywhere.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from npformer.backend import get_array_module
from npformer.nn import init
from npformer.nn.attention import KVCache
from npformer.nn.dropout import Dropout
from npformer.nn.embedding import Embedding, LearnedPositionalEncoding, PositionalEncoding
from npformer.nn.head import OutputHead
from npformer.nn.module import Module
from npformer.nn.transformer import Transformer

__all__ = ["Seq2SeqConfig", "Seq2Seq"]


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

    def to_dict(self) -> dict:
        return asdict(self)


class Seq2Seq(Module):
    def __init__(self, config: Seq2SeqConfig, *, dtype=None, backend=None, rng=None):
        super().__init__()
        c = self.config = config
        rng = init.host_generator(rng)
        kw = dict(dtype=dtype, backend=backend)
        std = c.d_model ** -0.5
        self.src_embed = Embedding(c.src_vocab_size, c.d_model, padding_idx=c.pad_id, std=std, rng=rng, **kw)
        self.tgt_embed = Embedding(c.tgt_vocab_size, c.d_model, padding_idx=c.pad_id, std=std, rng=rng, **kw)
        if c.positional == "sinusoidal":
            self.pos = PositionalEncoding(c.d_model, c.max_len)
        elif c.positional == "learned":
            self.pos = LearnedPositionalEncoding(c.d_model, c.max_len, rng=rng, **kw)
        else:
            raise ValueError(f"positional must be 'sinusoidal' or 'learned', got {c.positional!r}")
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
        return dropout(self.pos(embed(ids) * self.scale, offset))                 # (B, T, C)

    def _embed_backward(self, embed, dropout, dx):
        embed.backward(self.pos.backward(dropout.backward(dx)) * self.scale)

    def encode(self, src):
        """memory (B, S, C) and the source padding mask (B, S), True = padding."""
        self._check_ids(src, "src", self.config.src_vocab_size)
        src_pad = src == self.config.pad_id                                       # (B, S)
        x = self._embed(self.src_embed, self.src_dropout, src)
        return self.transformer.encoder(x, src_key_padding_mask=src_pad), src_pad

    def decode(self, tgt_in, memory, src_pad):
        """Logits (B, T, V) of the next tokens for every prefix of ``tgt_in``."""
        self._check_ids(tgt_in, "tgt_in", self.config.tgt_vocab_size)
        tgt_pad = tgt_in == self.config.pad_id                                    # (B, T)
        y = self._embed(self.tgt_embed, self.tgt_dropout, tgt_in)
        h = self.transformer.decoder(y, memory, tgt_key_padding_mask=tgt_pad,
                                     memory_key_padding_mask=src_pad, tgt_is_causal=True)
        return self.generator(h)                                                  # (B, T, V)

    def new_decoder_cache(self) -> list:
        """One (self-attention, cross-attention) pair of key/value caches per decoder layer."""
        return [(KVCache(), KVCache()) for _ in self.transformer.decoder.layers]

    def decode_step(self, tokens, memory, src_pad, cache: list):
        """Logits (B, Tnew, V) for the new target tokens (B, Tnew) given the ones already in
        ``cache`` (inference only; run under ``no_grad`` in eval mode). Equal to the last rows of
        :meth:`decode` on the whole prefix, at a cost linear in the prefix length per step."""
        offset = len(cache[0][0])
        y = self.pos(self.tgt_embed(tokens) * self.scale, offset)                # (B, Tnew, C)
        for layer, (self_cache, cross_cache) in zip(self.transformer.decoder.layers, cache):
            y = layer.step(y, memory, self_cache, cross_cache, memory_key_padding_mask=src_pad)
        if self.transformer.decoder.norm is not None:
            y = self.transformer.decoder.norm(y)
        return self.generator(y)                                                  # (B, Tnew, V)

    # -- training ----------------------------------------------------------------------------------
    def forward(self, src, tgt_in):
        """src (B, S), tgt_in (B, T) integer ids -> logits (B, T, V)."""
        memory, src_pad = self.encode(src)
        return self.decode(tgt_in, memory, src_pad)

    def backward(self, dlogits):
        """Accumulates every parameter gradient (ids have none); returns None."""
        dh = self.generator.backward(dlogits)
        dy, dmemory = self.transformer.decoder.backward(dh)
        self._embed_backward(self.tgt_embed, self.tgt_dropout, dy)
        dx = self.transformer.encoder.backward(dmemory)
        self._embed_backward(self.src_embed, self.src_dropout, dx)

    def _check_ids(self, ids, name, vocab):
        if not hasattr(ids, "dtype") or ids.dtype.kind not in "iu" or ids.ndim != 2:
            raise TypeError(f"{name}: expected a 2-d integer array (B, T) of token ids, got "
                            f"{getattr(ids, 'dtype', type(ids).__name__)} "
                            f"{tuple(getattr(ids, 'shape', ()))}")
        if ids.shape[1] > self.config.max_len:
            raise ValueError(f"{name}: length {ids.shape[1]} exceeds max_len={self.config.max_len}")
        get_array_module(ids)
