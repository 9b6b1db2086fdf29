"""The Transformer's layers, as ``torch.nn.Transformer*`` with ``batch_first=True`` (Vaswani et al. 2017).

Encoder layer, post-norm (the paper, ``norm_first=False``) and pre-norm (``norm_first=True``)::

    post:  x = norm1(x + dropout1(SA(x)));          x = norm2(x + dropout2(FF(x)))
    pre:   x = x + dropout1(SA(norm1(x)));          x = x + dropout2(FF(norm2(x)))
    FF(h) = linear2(dropout(act(linear1(h))))       one op: npformer.ops.feedforward

The decoder layer adds cross-attention over the encoder output ``memory`` between the two, with
``norm2`` and ``dropout2`` there and ``norm3``/``dropout3`` around the feed-forward block, as PyTorch.
Each line of ``forward`` is written with the layer's modules, and ``backward`` runs them in reverse;
a residual ``x + f(x)`` sends ``dout`` both ways, ``dx = dout + f'(x)^T dout``. Parameter names equal
PyTorch's ``state_dict`` keys.

A fast path stands below these lines (:mod:`npformer.nn.fused_layers`): where the fused residual +
layer norm kernel runs (CuPy, fast paths on), each ``norm(x + dropout(branch))`` is one op, with the
same sub-layers, masks and results; ``npformer.kernels.disabled()`` gives the plain lines everywhere.

Incremental decoding runs the same ``forward`` on the new positions only, with ``kv_cache`` (a
:class:`~npformer.nn.attention.KVCache` per attention module) holding the earlier positions' keys
and values: one formula for training and for decoding.
"""
from __future__ import annotations

import copy
import functools

from npformer.checks import one_of, positive_int
from npformer.errors import RangeError
from npformer.nn import fused_layers, init
from npformer.nn.attention import KVCache, MultiheadAttention
from npformer.nn.dropout import Dropout
from npformer.nn.linear import Linear
from npformer.nn.module import Module, ModuleList
from npformer.nn.normalization import LayerNorm
from npformer.ops.feedforward import ACTIVATIONS, feed_forward_backward, feed_forward_forward

__all__ = ["FeedForwardBlock", "TransformerEncoderLayer", "TransformerDecoderLayer",
           "TransformerEncoder", "TransformerDecoder", "Transformer"]


class FeedForwardParts(Module):
    """``linear1``, ``dropout`` and ``linear2`` held as PyTorch names them, run as the one feed-forward op."""

    def _init_feed_forward(self, d_model, dim_feedforward, dropout, activation, bias, kw):
        self.activation = one_of(activation, "activation", tuple(ACTIVATIONS))
        self.linear1 = Linear(d_model, dim_feedforward, bias=bias, **kw)
        self.dropout = Dropout(dropout)
        self.linear2 = Linear(dim_feedforward, d_model, bias=bias, **kw)

    def _feed_forward(self, h):
        active = self.training and self.dropout.p > 0
        out, cache = feed_forward_forward(h, *self.linear1.arrays(), *self.linear2.arrays(),
                                          activation=self.activation, dropout_p=self.dropout.p if active else 0.0,
                                          rng=self.generator(h) if active else None, training=active)
        self._push(cache)
        return out                                                                # (B, T, C)

    def _feed_forward_backward(self, dout):
        dx, dw1, db1, dw2, db2 = feed_forward_backward(dout, self._pop())
        self.linear1.accumulate(dw1, db1)
        self.linear2.accumulate(dw2, db2)
        return dx                                                                 # (B, T, C)


class FeedForwardBlock(FeedForwardParts):
    """The position-wise feed-forward network on its own (no residual, no norm)."""

    def __init__(self, d_model, dim_feedforward, dropout=0.0, activation="relu", bias=True, *,
                 dtype=None, backend=None, rng=None):
        super().__init__()
        rng = init.host_generator(rng)
        self._init_feed_forward(d_model, dim_feedforward, dropout, activation, bias,
                                dict(dtype=dtype, backend=backend, rng=rng))
        self.manual_seed(init.stream_seed(rng))          # this module's dropout stream

    def forward(self, x):
        return self._feed_forward(x)

    def backward(self, dout):
        return self._feed_forward_backward(dout)


class _Layer(FeedForwardParts):
    """What the encoder and decoder layers share: construction, in PyTorch's registration order. The
    study variants (another norm, no residual connection) are layers of their own:
    :class:`npformer.nn.experimental.ConfigurableEncoderLayer`."""

    def _init_layer(self, d_model, nhead, dim_feedforward, dropout, activation, layer_norm_eps, batch_first,
                    norm_first, bias, dtype, backend, rng, n_norms: int):
        if not batch_first:
            raise RangeError("npformer is batch-first: inputs are (B, T, C); batch_first must be True")
        rng = init.host_generator(rng)
        kw = dict(dtype=dtype, backend=backend, rng=rng)
        self.norm_first = bool(norm_first)
        self.self_attn = MultiheadAttention(d_model, nhead, dropout=dropout, bias=bias, **kw)
        if n_norms == 3:
            self.multihead_attn = MultiheadAttention(d_model, nhead, dropout=dropout, bias=bias, **kw)
        self._init_feed_forward(d_model, dim_feedforward, dropout, activation, bias, kw)
        for i in range(1, n_norms + 1):
            setattr(self, f"norm{i}", LayerNorm(d_model, eps=layer_norm_eps, bias=bias, dtype=dtype, backend=backend))
        for i in range(1, n_norms + 1):
            setattr(self, f"dropout{i}", Dropout(dropout))
        self.manual_seed(init.stream_seed(rng))          # this layer's dropout stream

    def _sa_block(self, h, **attention):
        """The self-attention sub-layer's output (B, T, C) (its weights are not asked for)."""
        return self.self_attn(h, need_weights=False, **attention)[0]


class TransformerEncoderLayer(_Layer):
    """Self-attention and feed-forward, each with a residual connection and layer norm."""

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int = 2048, dropout: float = 0.1,
                 activation: str = "relu", layer_norm_eps: float = 1e-5, batch_first: bool = True,
                 norm_first: bool = False, bias: bool = True, *, dtype=None, backend=None, rng=None):
        super().__init__()
        self._init_layer(d_model, nhead, dim_feedforward, dropout, activation, layer_norm_eps, batch_first,
                         norm_first, bias, dtype, backend, rng, n_norms=2)

    def forward(self, src, src_mask=None, src_key_padding_mask=None, is_causal: bool = False,
                kv_cache: KVCache | None = None):
        """``src`` (B, T, C) -> (B, T, C). With ``kv_cache``, ``src`` holds only the new positions,
        which attend causally to every cached one (a decoder-only model such as GPT)."""
        sa = functools.partial(self._sa_block, attn_mask=src_mask, key_padding_mask=src_key_padding_mask,
                               is_causal=is_causal, kv_cache=kv_cache)
        if fused_layers.takes_fused_blocks(src):        # the fast path (module docstring)
            y, caches = fused_layers.encoder_layer_forward(self, src, sa)
            self._push(caches)
            return y
        x = src                                                                   # (B, T, C)
        if self.norm_first:
            x = x + self.dropout1(sa(self.norm1(x)))
            x = x + self.dropout2(self._feed_forward(self.norm2(x)))
        else:
            x = self.norm1(x + self.dropout1(sa(x)))
            x = self.norm2(x + self.dropout2(self._feed_forward(x)))
        self._push(None)                                 # (the modules keep their own caches)
        return x                                                                  # (B, T, C)

    def backward(self, dout):
        """Returns ``dsrc``; parameter gradients accumulate."""
        caches = self._pop()
        if caches is not None:
            return fused_layers.encoder_layer_backward(self, dout, caches)
        if self.norm_first:
            # fwd: y = x1 + dropout2(FF(norm2(x1)))  ->  dx1 = dy + norm2'(FF'(dropout2'(dy)))
            dx1 = dout + self.norm2.backward(self._feed_forward_backward(self.dropout2.backward(dout)))
            # fwd: x1 = x + dropout1(SA(norm1(x)))  ->  dx = dx1 + norm1'(SA'(dropout1'(dx1)))
            return dx1 + self.norm1.backward(self.self_attn.backward(self.dropout1.backward(dx1))[0])
        # fwd: y = norm2(x1 + dropout2(FF(x1)))  ->  d = norm2'(dy);  dx1 = d + FF'(dropout2'(d))
        d = self.norm2.backward(dout)
        dx1 = d + self._feed_forward_backward(self.dropout2.backward(d))
        # fwd: x1 = norm1(x + dropout1(SA(x)))  ->  d = norm1'(dx1);  dx = d + SA'(dropout1'(d))
        d = self.norm1.backward(dx1)
        return d + self.self_attn.backward(self.dropout1.backward(d))[0]          # SA' sums all three paths


class TransformerDecoderLayer(_Layer):
    """Masked self-attention, cross-attention over ``memory``, feed-forward; residual + norm each."""

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int = 2048, dropout: float = 0.1,
                 activation: str = "relu", layer_norm_eps: float = 1e-5, batch_first: bool = True,
                 norm_first: bool = False, bias: bool = True, *, dtype=None, backend=None, rng=None):
        super().__init__()
        self._init_layer(d_model, nhead, dim_feedforward, dropout, activation, layer_norm_eps, batch_first,
                         norm_first, bias, dtype, backend, rng, n_norms=3)

    def forward(self, tgt, memory, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
                memory_key_padding_mask=None, tgt_is_causal: bool = False, memory_is_causal: bool = False,
                kv_cache: tuple[KVCache, KVCache] | None = None):
        """``tgt`` (B, T, C), ``memory`` (B, S, C) -> (B, T, C). With ``kv_cache`` = (self-attention
        cache, cross-attention cache), ``tgt`` holds only the new target positions and the memory is
        projected on the first call only."""
        self_cache, cross_cache = (None, None) if kv_cache is None else kv_cache
        sa = functools.partial(self._sa_block, attn_mask=tgt_mask, key_padding_mask=tgt_key_padding_mask,
                               is_causal=tgt_is_causal, kv_cache=self_cache)
        mha = functools.partial(self._mha_block, memory=memory, attn_mask=memory_mask,
                                key_padding_mask=memory_key_padding_mask, is_causal=memory_is_causal,
                                kv_cache=cross_cache)
        if fused_layers.takes_fused_blocks(tgt):        # the fast path (module docstring)
            y, caches = fused_layers.decoder_layer_forward(self, tgt, sa, mha)
            self._push(caches)
            return y
        x = tgt                                                                   # (B, T, C)
        if self.norm_first:
            x = x + self.dropout1(sa(self.norm1(x)))
            x = x + self.dropout2(mha(self.norm2(x)))
            x = x + self.dropout3(self._feed_forward(self.norm3(x)))
        else:
            x = self.norm1(x + self.dropout1(sa(x)))
            x = self.norm2(x + self.dropout2(mha(x)))
            x = self.norm3(x + self.dropout3(self._feed_forward(x)))
        self._push(None)                                 # (the modules keep their own caches)
        return x                                                                  # (B, T, C)

    def _mha_block(self, h, memory, **attention):
        """The cross-attention sub-layer's output (B, T, C): ``h`` attends over ``memory`` (B, S, C)."""
        return self.multihead_attn(h, memory, memory, need_weights=False, **attention)[0]

    def _cross_attention_backward(self, d):
        # fwd: a = MHA(h, memory, memory)  ->  dh = dquery,  dmemory = dkey + dvalue (memory was both)
        dq, dk, dv = self.multihead_attn.backward(d)
        return dq, dk + dv                                                        # (B, T, C), (B, S, C)

    def backward(self, dout):
        """Returns ``(dtgt, dmemory)``; parameter gradients accumulate."""
        caches = self._pop()
        if caches is not None:
            return fused_layers.decoder_layer_backward(self, dout, caches)
        if self.norm_first:
            # fwd: y = x2 + dropout3(FF(norm3(x2)))  ->  dx2 = dy + norm3'(FF'(dropout3'(dy)))
            dx2 = dout + self.norm3.backward(self._feed_forward_backward(self.dropout3.backward(dout)))
            # fwd: x2 = x1 + dropout2(MHA(norm2(x1), memory))  ->  dx1 = dx2 + norm2'(dquery),  dmemory
            dq, dmem = self._cross_attention_backward(self.dropout2.backward(dx2))
            dx1 = dx2 + self.norm2.backward(dq)
            # fwd: x1 = x + dropout1(SA(norm1(x)))  ->  dx = dx1 + norm1'(SA'(dropout1'(dx1)))
            return dx1 + self.norm1.backward(self.self_attn.backward(self.dropout1.backward(dx1))[0]), dmem
        # fwd: y = norm3(x2 + dropout3(FF(x2)))  ->  d = norm3'(dy);  dx2 = d + FF'(dropout3'(d))
        d = self.norm3.backward(dout)
        dx2 = d + self._feed_forward_backward(self.dropout3.backward(d))
        # fwd: x2 = norm2(x1 + dropout2(MHA(x1, memory)))  ->  d = norm2'(dx2);  dx1 = d + dquery,  dmemory
        d = self.norm2.backward(dx2)
        dq, dmem = self._cross_attention_backward(self.dropout2.backward(d))
        # fwd: x1 = norm1(x + dropout1(SA(x)))  ->  d = norm1'(dx1);  dx = d + SA'(dropout1'(d))
        d = self.norm1.backward(d + dq)
        return d + self.self_attn.backward(self.dropout1.backward(d))[0], dmem


class TransformerEncoder(Module):
    """``num_layers`` copies of ``encoder_layer`` (deep copies, as PyTorch), then an optional norm."""

    def __init__(self, encoder_layer: TransformerEncoderLayer, num_layers: int, norm: LayerNorm | None = None):
        super().__init__()
        self.num_layers = positive_int(num_layers, "num_layers")
        self.layers = ModuleList(copy.deepcopy(encoder_layer) for _ in range(num_layers))
        self.norm = norm
        self.share_stream(encoder_layer.random_stream)  # the copies draw from one stream, not L equal ones

    def forward(self, src, mask=None, src_key_padding_mask=None, is_causal: bool = False,
                kv_cache: list[KVCache] | None = None):
        """``kv_cache``: one :class:`KVCache` per layer, for incremental decoding."""
        x = src
        for i, layer in enumerate(self.layers):
            x = layer(x, src_mask=mask, src_key_padding_mask=src_key_padding_mask, is_causal=is_causal,
                      kv_cache=None if kv_cache is None else kv_cache[i])
        return x if self.norm is None else self.norm(x)

    def backward(self, dout):
        # fwd: y = norm(layer_L(... layer_1(x)))  ->  back through the norm, then the layers newest first
        d = dout if self.norm is None else self.norm.backward(dout)
        for layer in reversed(list(self.layers)):
            d = layer.backward(d)
        return d

    def new_cache(self) -> list[KVCache]:
        """An empty key/value cache per layer."""
        return [KVCache() for _ in self.layers]


class TransformerDecoder(Module):
    """``num_layers`` copies of ``decoder_layer``, then an optional norm; ``backward`` returns
    ``(dtgt, dmemory)`` with the memory gradient summed over the layers."""

    def __init__(self, decoder_layer: TransformerDecoderLayer, num_layers: int, norm: LayerNorm | None = None):
        super().__init__()
        self.num_layers = positive_int(num_layers, "num_layers")
        self.layers = ModuleList(copy.deepcopy(decoder_layer) for _ in range(num_layers))
        self.norm = norm
        self.share_stream(decoder_layer.random_stream)  # the copies draw from one stream, not L equal ones

    def forward(self, tgt, memory, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
                memory_key_padding_mask=None, tgt_is_causal: bool = False, memory_is_causal: bool = False,
                kv_cache: list[tuple[KVCache, KVCache]] | None = None):
        """``kv_cache``: one (self-attention, cross-attention) pair of caches per layer."""
        x = tgt
        for i, layer in enumerate(self.layers):
            x = layer(x, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                      tgt_key_padding_mask=tgt_key_padding_mask,
                      memory_key_padding_mask=memory_key_padding_mask, tgt_is_causal=tgt_is_causal,
                      memory_is_causal=memory_is_causal, kv_cache=None if kv_cache is None else kv_cache[i])
        return x if self.norm is None else self.norm(x)

    def backward(self, dout):
        # fwd: y = norm(layer_L(... layer_1(x, memory), memory))  ->  every layer adds to dmemory
        d = dout if self.norm is None else self.norm.backward(dout)
        dmemory = None
        for layer in reversed(list(self.layers)):
            d, dm = layer.backward(d)
            dmemory = dm if dmemory is None else dmemory + dm
        return d, dmemory

    def new_cache(self) -> list[tuple[KVCache, KVCache]]:
        """An empty (self-attention, cross-attention) pair of key/value caches per layer."""
        return [(KVCache(), KVCache()) for _ in self.layers]


class Transformer(Module):
    """The paper's encoder-decoder over already-embedded (B, S, C) / (B, T, C) inputs, as
    ``torch.nn.Transformer`` (both stacks end in a layer norm; every matrix starts xavier-uniform)."""

    def __init__(self, d_model: int = 512, nhead: int = 8, num_encoder_layers: int = 6,
                 num_decoder_layers: int = 6, dim_feedforward: int = 2048, dropout: float = 0.1,
                 activation: str = "relu", layer_norm_eps: float = 1e-5, batch_first: bool = True,
                 norm_first: bool = False, bias: bool = True, *, dtype=None, backend=None, rng=None):
        super().__init__()
        rng = init.host_generator(rng)
        kw = dict(dtype=dtype, backend=backend)
        common = dict(dim_feedforward=dim_feedforward, dropout=dropout, activation=activation,
                      layer_norm_eps=layer_norm_eps, batch_first=batch_first, norm_first=norm_first,
                      bias=bias, rng=rng, **kw)
        nkw = dict(eps=layer_norm_eps, bias=bias, **kw)
        self.encoder = TransformerEncoder(TransformerEncoderLayer(d_model, nhead, **common),
                                          num_encoder_layers, LayerNorm(d_model, **nkw))
        self.decoder = TransformerDecoder(TransformerDecoderLayer(d_model, nhead, **common),
                                          num_decoder_layers, LayerNorm(d_model, **nkw))
        self.d_model, self.nhead = d_model, nhead
        for p in self.parameters():                      # PyTorch's _reset_parameters
            if p.data.ndim > 1:
                p.data = init.xavier_uniform(p.shape, rng=rng, dtype=p.dtype, backend=backend)
        self.manual_seed(init.stream_seed(rng))          # the model's dropout stream

    def forward(self, src, tgt, src_mask=None, tgt_mask=None, memory_mask=None,
                src_key_padding_mask=None, tgt_key_padding_mask=None, memory_key_padding_mask=None,
                src_is_causal: bool = False, tgt_is_causal: bool = False, memory_is_causal: bool = False):
        memory = self.encoder(src, mask=src_mask, src_key_padding_mask=src_key_padding_mask,
                              is_causal=src_is_causal)                            # (B, S, C)
        return self.decoder(tgt, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                            tgt_key_padding_mask=tgt_key_padding_mask,
                            memory_key_padding_mask=memory_key_padding_mask,
                            tgt_is_causal=tgt_is_causal, memory_is_causal=memory_is_causal)

    def backward(self, dout):
        """Returns ``(dsrc, dtgt)``."""
        # fwd: memory = encoder(src);  y = decoder(tgt, memory)  ->  dmemory flows into the encoder
        dtgt, dmemory = self.decoder.backward(dout)
        return self.encoder.backward(dmemory), dtgt
