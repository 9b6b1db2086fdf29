"""The Transformer's layers, as ``torch.nn.Transformer*`` with ``batch_first=True`` (Vaswani et al. 2017).

Encoder layer, post-norm (the paper, ``norm_first=False``) and pre-norm (``norm_first=True``)::

    post:  x = norm1(x + drop1(SA(x)));          x = norm2(x + drop2(FF(x)))
    pre:   x = x + drop1(SA(norm1(x)));          x = x + drop2(FF(norm2(x)))
    FF(h) = linear2(dropout(act(linear1(h))))    one op: npformer.ops.feedforward

Each residual is one op with its dropout and the norm that follows it (npformer.ops.residual):
``s = x + drop(branch)`` and ``y = norm(s)`` together (post-norm keeps y; pre-norm keeps s as the
stream and y as the next sub-layer's input), and the pre-norm layer's last ``x + drop(branch)``.

The decoder layer adds cross-attention over the encoder output ``memory`` between the two, with
``norm2`` and ``drop2`` there and ``norm3``/``drop3`` around the feed-forward block, as PyTorch.
Every backward runs the forward's lines in reverse; a residual ``x + f(x)`` sends ``dout`` both
ways, ``dx = dout + f'(x)^T dout``. Parameter names equal PyTorch's ``state_dict`` keys.

Incremental decoding runs the same ``forward`` on the new positions only, with ``kv_cache`` (a
:class:`~npformer.nn.attention.KVCache` per attention module) holding the earlier positions' keys
and values: one formula for training and for decoding.
"""
from __future__ import annotations

import copy

from npformer.checks import one_of, positive_int
from npformer.errors import RangeError
from npformer.nn import init
from npformer.nn.attention import KVCache, MultiheadAttention
from npformer.nn.dropout import Dropout
from npformer.nn.linear import Linear
from npformer.nn.module import Module, ModuleList
from npformer.nn.normalization import LayerNorm
from npformer.ops.dropout import dropout_term_backward
from npformer.ops.feedforward import ACTIVATIONS, feed_forward_backward, feed_forward_forward
from npformer.ops.residual import (residual_dropout_forward, residual_dropout_layer_norm_backward,
                                   residual_dropout_layer_norm_forward)

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
    """What the encoder and decoder layers share: construction (in PyTorch's registration order) and
    the residual blocks, one fused op each (:mod:`npformer.ops.residual`). The study variants (another
    norm, no residual connection) are layers of their own, composed of modules:
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

    def _add_norm(self, skip, branch, drop, norm):
        """``s = skip + drop(branch)`` and ``norm(s)``, as ``(s, norm(s))``: one op."""
        active = drop.training and drop.p > 0
        s, y, cache = residual_dropout_layer_norm_forward(
            skip, branch, None if norm.weight is None else norm.weight.data,
            None if norm.bias is None else norm.bias.data, eps=norm.eps, p=drop.p,
            rng=drop.generator(branch) if active else None, training=active)
        self._push(cache)
        return s, y                                                               # (B, T, C), (B, T, C)

    def _add_norm_backward(self, ds, dy, norm):
        """``(dskip, dbranch)`` from the gradient of s (None when s had no other use) and of norm(s)."""
        # fwd: s = skip + drop(branch), y = norm(s)  ->  dskip = ds + norm'(dy),  dbranch = drop'(dskip)
        dx, dbranch, dweight, dbias = residual_dropout_layer_norm_backward(ds, dy, self._pop())
        if norm.weight is not None:
            norm.weight.accumulate(dweight)
        if norm.bias is not None:
            norm.bias.accumulate(dbias)
        return dx, dbranch                                                        # (B, T, C), (B, T, C)

    def _add_dropout(self, skip, branch, drop):
        """``skip + drop(branch)``: one op."""
        active = drop.training and drop.p > 0
        s, cache = residual_dropout_forward(skip, branch, p=drop.p, rng=drop.generator(branch) if active else None,
                                            training=active)
        self._push(cache)
        return s                                                                  # (B, T, C)

    def _add_dropout_backward(self, ds):
        """The branch's gradient ``drop'(ds)`` (the skip's is ds itself)."""
        return dropout_term_backward(ds, self._pop())                             # (B, T, C)


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
        x = src                                                                   # (B, T, C)
        # a = SA(norm1(x)) pre-norm, SA(x) post-norm
        a, _ = self.self_attn(self.norm1(x) if self.norm_first else x, attn_mask=src_mask,
                              key_padding_mask=src_key_padding_mask, need_weights=False, is_causal=is_causal,
                              kv_cache=kv_cache)
        if self.norm_first:
            # x1 = x + drop1(a),  h = norm2(x1);  y = x1 + drop2(FF(h))
            x, h = self._add_norm(x, a, self.dropout1, self.norm2)
            return self._add_dropout(x, self._feed_forward(h), self.dropout2)
        # x1 = norm1(x + drop1(a));  y = norm2(x1 + drop2(FF(x1)))
        _, x = self._add_norm(x, a, self.dropout1, self.norm1)
        return self._add_norm(x, self._feed_forward(x), self.dropout2, self.norm2)[1]

    def backward(self, dout):
        """Returns ``dsrc``; parameter gradients accumulate."""
        if self.norm_first:
            # fwd: y = x1 + drop2(FF(h))  ->  dx1 = dy (the skip),  dh = FF'(drop2'(dy))
            dh = self._feed_forward_backward(self._add_dropout_backward(dout))
            # fwd: x1 = x + drop1(a), h = norm2(x1)  ->  dx1 += norm2'(dh),  da = drop1'(dx1)
            dx1, da = self._add_norm_backward(dout, dh, self.norm2)
            # fwd: a = SA(norm1(x))  ->  dx = dx1 + norm1'(SA'(da))
            return dx1 + self.norm1.backward(self.self_attn.backward(da)[0])
        # fwd: y = norm2(x1 + drop2(FF(x1)))  ->  d = norm2'(dy);  dx1 = d + FF'(drop2'(d))
        d, dbranch = self._add_norm_backward(None, dout, self.norm2)
        dx1 = d + self._feed_forward_backward(dbranch)
        # fwd: x1 = norm1(x + drop1(SA(x)))  ->  d = norm1'(dx1);  dx = d + SA'(drop1'(d))
        d, dbranch = self._add_norm_backward(None, dx1, self.norm1)
        return d + self.self_attn.backward(dbranch)[0]                            # SA' sums all three paths


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
        x = tgt                                                                   # (B, T, C)
        a, _ = self.self_attn(self.norm1(x) if self.norm_first else x, attn_mask=tgt_mask,
                              key_padding_mask=tgt_key_padding_mask, need_weights=False, is_causal=tgt_is_causal,
                              kv_cache=self_cache)
        if self.norm_first:
            # x1 = x + drop1(SA(norm1(x))), h = norm2(x1);  x2 = x1 + drop2(MHA(h, memory)), h = norm3(x2)
            x, h = self._add_norm(x, a, self.dropout1, self.norm2)
            a, _ = self.multihead_attn(h, memory, memory, attn_mask=memory_mask,
                                       key_padding_mask=memory_key_padding_mask, need_weights=False,
                                       is_causal=memory_is_causal, kv_cache=cross_cache)
            x, h = self._add_norm(x, a, self.dropout2, self.norm3)
            return self._add_dropout(x, self._feed_forward(h), self.dropout3)   # y = x2 + drop3(FF(h))
        # x1 = norm1(x + drop1(SA(x)));  x2 = norm2(x1 + drop2(MHA(x1, memory)));  y = norm3(x2 + drop3(FF(x2)))
        _, x = self._add_norm(x, a, self.dropout1, self.norm1)
        a, _ = self.multihead_attn(x, memory, memory, attn_mask=memory_mask, key_padding_mask=memory_key_padding_mask,
                                   need_weights=False, is_causal=memory_is_causal, kv_cache=cross_cache)
        _, x = self._add_norm(x, a, self.dropout2, self.norm2)
        return self._add_norm(x, self._feed_forward(x), self.dropout3, self.norm3)[1]

    def _cross_attention_backward(self, d):
        # fwd: a = MHA(h, memory, memory)  ->  dh = dquery,  dmemory = dkey + dvalue (memory was both)
        dq, dk, dv = self.multihead_attn.backward(d)
        return dq, dk + dv                                                        # (B, T, C), (B, S, C)

    def backward(self, dout):
        """Returns ``(dtgt, dmemory)``; parameter gradients accumulate."""
        if self.norm_first:
            # fwd: y = x2 + drop3(FF(h3))  ->  dx2 = dy (the skip),  dh3 = FF'(drop3'(dy))
            dh = self._feed_forward_backward(self._add_dropout_backward(dout))
            # fwd: x2 = x1 + drop2(a), h3 = norm3(x2)  ->  dx2 += norm3'(dh3),  da = drop2'(dx2)
            dx2, da = self._add_norm_backward(dout, dh, self.norm3)
            # fwd: a = MHA(h2, memory)  ->  dh2 = dquery,  dmemory
            dh, dmem = self._cross_attention_backward(da)
            # fwd: x1 = x + drop1(a), h2 = norm2(x1)  ->  dx1 = dx2 + norm2'(dh2),  da = drop1'(dx1)
            dx1, da = self._add_norm_backward(dx2, dh, self.norm2)
            # fwd: a = SA(norm1(x))  ->  dx = dx1 + norm1'(SA'(da))
            return dx1 + self.norm1.backward(self.self_attn.backward(da)[0]), dmem
        # fwd: y = norm3(x2 + drop3(FF(x2)))  ->  d = norm3'(dy);  dx2 = d + FF'(drop3'(d))
        d, dbranch = self._add_norm_backward(None, dout, self.norm3)
        dx2 = d + self._feed_forward_backward(dbranch)
        # fwd: x2 = norm2(x1 + drop2(MHA(x1, memory)))  ->  d = norm2'(dx2);  dx1 = d + dquery,  dmemory
        d, dbranch = self._add_norm_backward(None, dx2, self.norm2)
        dq, dmem = self._cross_attention_backward(dbranch)
        # fwd: x1 = norm1(x + drop1(SA(x)))  ->  d = norm1'(dx1);  dx = d + SA'(drop1'(d))
        d, dbranch = self._add_norm_backward(None, d + dq, self.norm1)
        return d + self.self_attn.backward(dbranch)[0], dmem


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
