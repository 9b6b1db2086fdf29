"""``GPT``: a decoder-only Transformer language model (Radford et al. 2018, 2019).

    x = dropout(wte[idx] + wpe[0..T-1])                (B, T, C)
    x = block_l(x, causal)  for l = 1..L               pre-norm (GPT-2) or post-norm (GPT-1)
    logits = ln_f(x) wte^T                             tied head (ln_f only in pre-norm)

A block is ``TransformerEncoderLayer`` with a causal mask: self-attention and a GELU feed-forward,
each in a residual branch. GPT-2's initialisation: every weight matrix N(0, 0.02^2), biases zero,
and the two projections that write into the residual stream (``self_attn.out_proj.weight``,
``linear2.weight``) N(0, (0.02 / sqrt(2 L))^2) so the stream's variance does not grow with depth
(``scaled_residual_init=False`` keeps them at 0.02, as GPT-1).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from npformer.backend import get_array_module
from npformer.nn import init
from npformer.nn.attention import KVCache
from npformer.nn.dropout import Dropout
from npformer.nn.embedding import Embedding
from npformer.nn.head import OutputHead
from npformer.nn.module import Module, ModuleList
from npformer.nn.normalization import LayerNorm
from npformer.nn.transformer import TransformerEncoderLayer

__all__ = ["GPTConfig", "GPT"]


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    block_size: int = 128            # the longest context (learned positions)
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    dim_feedforward: int | None = None   # default 4 * d_model
    dropout: float = 0.1
    activation: str = "gelu_tanh"    # GPT-2's GELU approximation
    norm_first: bool = True          # GPT-2 (pre-norm); False gives GPT-1's post-norm blocks
    layer_norm_eps: float = 1e-5
    bias: bool = True
    tie_embeddings: bool = True
    scaled_residual_init: bool = True  # GPT-2's 0.02 / sqrt(2 L) on the residual projections; False: 0.02

    def to_dict(self) -> dict:
        return asdict(self)


class GPT(Module):
    def __init__(self, config: GPTConfig, *, dtype=None, backend=None, rng=None):
        super().__init__()
        c = self.config = config
        rng = init.host_generator(rng)
        kw = dict(dtype=dtype, backend=backend)
        ff = c.dim_feedforward or 4 * c.d_model
        self.wte = Embedding(c.vocab_size, c.d_model, std=0.02, rng=rng, **kw)
        self.wpe = Embedding(c.block_size, c.d_model, std=0.02, rng=rng, **kw)
        self.drop = Dropout(c.dropout)
        self.layers = ModuleList(
            TransformerEncoderLayer(c.d_model, c.n_head, ff, c.dropout, c.activation, c.layer_norm_eps,
                                    norm_first=c.norm_first, bias=c.bias, rng=rng, **kw)
            for _ in range(c.n_layer))
        self.ln_f = LayerNorm(c.d_model, c.layer_norm_eps, bias=c.bias, **kw) if c.norm_first else None
        self.head = OutputHead(c.d_model, c.vocab_size, tied=self.wte.weight if c.tie_embeddings else None,
                               rng=rng, **kw)
        residual_std = 0.02 / math.sqrt(2 * c.n_layer) if c.scaled_residual_init else 0.02
        for name, p in self.named_parameters():
            if p.data.ndim == 2 and not name.startswith(("wte", "wpe", "head")):
                std = residual_std if name.endswith(("out_proj.weight", "linear2.weight")) else 0.02
                p.data = init.normal(p.shape, std, rng=rng, dtype=p.dtype, backend=backend)
            elif name.endswith("bias") and not name.startswith(("ln_f",)) and "norm" not in name:
                p.data[...] = 0
        self.manual_seed(init.stream_seed(rng))          # the model's dropout stream

    def _check(self, idx, offset=0):
        if not hasattr(idx, "dtype") or idx.dtype.kind not in "iu" or idx.ndim != 2:
            raise TypeError(f"idx: expected a 2-d integer array (B, T) of token ids, got "
                            f"{getattr(idx, 'dtype', type(idx).__name__)} {tuple(getattr(idx, 'shape', ()))}")
        if offset + idx.shape[1] > self.config.block_size:
            raise ValueError(f"sequence of length {offset + idx.shape[1]} exceeds block_size="
                             f"{self.config.block_size}")

    def _embed(self, idx, offset=0):
        xp = get_array_module(idx)
        pos = xp.arange(offset, offset + idx.shape[1])                          # (T,)
        return self.drop(self.wte(idx) + self.wpe(pos))                           # (B, T, C)

    def forward(self, idx):
        """idx (B, T) -> logits (B, T, V) of the next token at every position."""
        self._check(idx)
        x = self._embed(idx)
        for layer in self.layers:
            x = layer(x, is_causal=True)
        if self.ln_f is not None:
            x = self.ln_f(x)
        return self.head(x)                                                       # (B, T, V)

    def backward(self, dlogits):
        dx = self.head.backward(dlogits)
        if self.ln_f is not None:
            dx = self.ln_f.backward(dx)
        for layer in reversed(list(self.layers)):
            dx = layer.backward(dx)
        dx = self.drop.backward(dx)
        # fwd: x = wte[idx] + wpe[pos]  ->  both tables receive dx (wpe summed over the batch)
        self.wpe.backward(dx.sum(axis=0))
        self.wte.backward(dx)

    # -- inference with a key/value cache -----------------------------------------------------------
    def new_cache(self) -> list:
        return [KVCache() for _ in self.layers]

    def forward_cached(self, idx, cache: list):
        """Logits (B, Tnew, V) of new tokens given ``cache`` (inference only, under ``no_grad``)."""
        offset = len(cache[0])
        self._check(idx, offset)
        x = self._embed(idx, offset)
        for layer, kv in zip(self.layers, cache):
            x = layer.step(x, kv)
        if self.ln_f is not None:
            x = self.ln_f(x)
        return self.head(x)
