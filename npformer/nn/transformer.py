"""The Transformer's layers, as ``torch.nn.Transformer*`` with ``batch_first=True`` (Vaswani et al. 2017).

Encoder layer, post-norm (the paper, ``norm_first=False``) and pre-norm (``norm_first=True``)::

    post:  x = norm1(x + drop1(SA(x)));          x = norm2(x + drop2(FF(x)))
    pre:   x = x + drop1(SA(norm1(x)));          x = x + drop2(FF(norm2(x)))
    FF(h) = linear2(drop(act(linear1(h))))

The decoder layer adds cross-attention over the encoder output ``memory`` between the two, with
``norm2`` and ``drop2`` there and ``norm3``/``drop3`` around the feed-forward block, as PyTorch.
Every backward runs the forward's lines in reverse; a residual ``x + f(x)`` sends ``dout`` both
ways, ``dx = dout + f'(x)^T dout``. Parameter names equal PyTorch's ``state_dict`` keys.
"""
from __future__ import annotations

import copy

from npformer.nn import init
from npformer.nn.attention import MultiheadAttention
from npformer.nn.dropout import Dropout
from npformer.nn.linear import Linear
from npformer.nn.module import Module, ModuleList
from npformer.nn.normalization import LayerNorm
from npformer.ops.feedforward import ACTIVATIONS

__all__ = ["FeedForwardBlock", "TransformerEncoderLayer", "TransformerDecoderLayer",
           "TransformerEncoder", "TransformerDecoder", "Transformer", "ACTIVATIONS"]

def _activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {name!r}")
    return ACTIVATIONS[name]


class _FeedForward(Module):
    """Mixin for the position-wise block ``linear2(dropout(act(linear1(h))))`` of a layer."""

    def _ff_init(self, d_model, dim_feedforward, dropout, activation, bias, kw):
        self.activation = activation
        self._act_fwd, self._act_kw, self._act_bwd = _activation(activation)
        self.linear1 = Linear(d_model, dim_feedforward, bias=bias, **kw)
        self.dropout = Dropout(dropout)
        self.linear2 = Linear(dim_feedforward, d_model, bias=bias, **kw)

    def _ff(self, h):
        a, act_cache = self._act_fwd(self.linear1(h), **self._act_kw)             # (B, T, F)
        self._push(act_cache)
        return self.linear2(self.dropout(a))                                      # (B, T, C)

    def _ff_backward(self, dout):
        # fwd: y = linear2(drop(act(linear1(h))))  ->  back through each, newest first
        da = self.dropout.backward(self.linear2.backward(dout))                   # (B, T, F)
        return self.linear1.backward(self._act_bwd(da, self._pop()))              # (B, T, C)


class FeedForwardBlock(_FeedForward):
    """The position-wise feed-forward network on its own (no residual, no norm)."""

    def __init__(self, d_model, dim_feedforward, dropout=0.0, activation="relu", bias=True, *,
                 dtype=None, backend=None, rng=None):
        super().__init__()
        rng = init.host_generator(rng)
        self._ff_init(d_model, dim_feedforward, dropout, activation, bias, dict(dtype=dtype, backend=backend, rng=rng))
        self.manual_seed(init.stream_seed(rng))          # this module's dropout stream

    def forward(self, x):
        return self._ff(x)

    def backward(self, dout):
        return self._ff_backward(dout)


class _Layer(_FeedForward):
    """What the encoder and decoder layers share: construction, self-attention with its dropout."""

    def _layer_init(self, d_model, nhead, dim_feedforward, dropout, activation, layer_norm_eps, batch_first,
                    norm_first, bias, dtype, backend, rng, cross_attention: bool):
        if not batch_first:
            raise ValueError("npformer is batch-first: inputs are (B, T, C); batch_first must be True")
        kw = dict(dtype=dtype, backend=backend, rng=init.host_generator(rng))
        self.norm_first = norm_first
        # registration order = PyTorch's state_dict order
        self.self_attn = MultiheadAttention(d_model, nhead, dropout=dropout, bias=bias, **kw)
        if cross_attention:
            self.multihead_attn = MultiheadAttention(d_model, nhead, dropout=dropout, bias=bias, **kw)
        self._ff_init(d_model, dim_feedforward, dropout, activation, bias, kw)
        n = 3 if cross_attention else 2
        for i in range(1, n + 1):
            setattr(self, f"norm{i}", LayerNorm(d_model, eps=layer_norm_eps, bias=bias, dtype=dtype,
                                                backend=backend))
        for i in range(1, n + 1):
            setattr(self, f"dropout{i}", Dropout(dropout))
        self.manual_seed(init.stream_seed(kw["rng"]))    # this layer's dropout stream

    def _sa(self, h, mask, padding, is_causal):
        a, _ = self.self_attn(h, h, h, attn_mask=mask, key_padding_mask=padding, need_weights=False,
                              is_causal=is_causal)
        return self.dropout1(a)                                                   # (B, T, C)

    def _sa_backward(self, dout):
        return self.self_attn.backward(self.dropout1.backward(dout))[0]           # (B, T, C)


class TransformerEncoderLayer(_Layer):
    """Self-attention and feed-forward, each with a residual connection and layer norm."""

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int = 2048, dropout: float = 0.1,
                 activation: str = "relu", layer_norm_eps: float = 1e-5, batch_first: bool = True,
                 norm_first: bool = False, bias: bool = True, *, dtype=None, backend=None, rng=None):
        super().__init__()
        self._layer_init(d_model, nhead, dim_feedforward, dropout, activation, layer_norm_eps, batch_first,
                         norm_first, bias, dtype, backend, rng, cross_attention=False)

    def forward(self, src, src_mask=None, src_key_padding_mask=None, is_causal: bool = False):
        x = src                                                                   # (B, T, C)
        if self.norm_first:
            x = x + self._sa(self.norm1(x), src_mask, src_key_padding_mask, is_causal)
            return x + self.dropout2(self._ff(self.norm2(x)))
        x = self.norm1(x + self._sa(x, src_mask, src_key_padding_mask, is_causal))
        return self.norm2(x + self.dropout2(self._ff(x)))

    def step(self, x, cache):
        """Inference with a key/value cache (``nn.attention.KVCache``): ``x`` (B, Tnew, C) holds only the
        new positions, which attend causally to every cached one (a decoder-only model such as GPT)."""
        if self.norm_first:
            x = x + self.self_attn.attend_cached(self.norm1(x), cache)
            return x + self._ff(self.norm2(x))
        x = self.norm1(x + self.self_attn.attend_cached(x, cache))
        return self.norm2(x + self._ff(x))

    def backward(self, dout):
        """Returns ``dsrc``; parameter gradients accumulate."""
        if self.norm_first:
            # fwd: y = x1 + drop2(FF(norm2(x1)))  ->  dx1 = dy + norm2'(FF'(drop2'(dy)))
            dx1 = dout + self.norm2.backward(self._ff_backward(self.dropout2.backward(dout)))
            # fwd: x1 = x + SA(norm1(x))  ->  dx = dx1 + norm1'(SA'(dx1))
            return dx1 + self.norm1.backward(self._sa_backward(dx1))
        # fwd: y = norm2(x1 + drop2(FF(x1)))  ->  d = norm2'(dy);  dx1 = d + FF'(drop2'(d))
        d = self.norm2.backward(dout)
        dx1 = d + self._ff_backward(self.dropout2.backward(d))
        # fwd: x1 = norm1(x + SA(x))  ->  d = norm1'(dx1);  dx = d + SA'(d)
        d = self.norm1.backward(dx1)
        return d + self._sa_backward(d)


class TransformerDecoderLayer(_Layer):
    """Masked self-attention, cross-attention over ``memory``, feed-forward; residual + norm each."""

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int = 2048, dropout: float = 0.1,
                 activation: str = "relu", layer_norm_eps: float = 1e-5, batch_first: bool = True,
                 norm_first: bool = False, bias: bool = True, *, dtype=None, backend=None, rng=None):
        super().__init__()
        self._layer_init(d_model, nhead, dim_feedforward, dropout, activation, layer_norm_eps, batch_first,
                         norm_first, bias, dtype, backend, rng, cross_attention=True)

    def _mha(self, h, memory, mask, padding, is_causal):
        a, _ = self.multihead_attn(h, memory, memory, attn_mask=mask, key_padding_mask=padding,
                                   need_weights=False, is_causal=is_causal)
        return self.dropout2(a)                                                   # (B, T, C)

    def _mha_backward(self, dout):
        dq, dmem, _ = self.multihead_attn.backward(self.dropout2.backward(dout))  # key is value: dk is the sum
        return dq, dmem

    def forward(self, tgt, memory, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
                memory_key_padding_mask=None, tgt_is_causal: bool = False, memory_is_causal: bool = False):
        x = tgt                                                                   # (B, T, C)
        if self.norm_first:
            x = x + self._sa(self.norm1(x), tgt_mask, tgt_key_padding_mask, tgt_is_causal)
            x = x + self._mha(self.norm2(x), memory, memory_mask, memory_key_padding_mask, memory_is_causal)
            return x + self.dropout3(self._ff(self.norm3(x)))
        x = self.norm1(x + self._sa(x, tgt_mask, tgt_key_padding_mask, tgt_is_causal))
        x = self.norm2(x + self._mha(x, memory, memory_mask, memory_key_padding_mask, memory_is_causal))
        return self.norm3(x + self.dropout3(self._ff(x)))

    def step(self, x, memory, self_cache, cross_cache, memory_key_padding_mask=None):
        """Inference with key/value caches: ``x`` (B, Tnew, C) holds only the new target positions;
        ``cross_cache`` keeps the projected memory after the first call."""
        def sa(h):
            return self.self_attn.attend_cached(h, self_cache)

        def mha(h):
            return self.multihead_attn.attend_cached(h, cross_cache, source=memory,
                                                     key_padding_mask=memory_key_padding_mask)
        if self.norm_first:
            x = x + sa(self.norm1(x))
            x = x + mha(self.norm2(x))
            return x + self._ff(self.norm3(x))
        x = self.norm1(x + sa(x))
        x = self.norm2(x + mha(x))
        return self.norm3(x + self._ff(x))

    def backward(self, dout):
        """Returns ``(dtgt, dmemory)``; parameter gradients accumulate."""
        if self.norm_first:
            dx2 = dout + self.norm3.backward(self._ff_backward(self.dropout3.backward(dout)))
            dq, dmem = self._mha_backward(dx2)
            dx1 = dx2 + self.norm2.backward(dq)
            return dx1 + self.norm1.backward(self._sa_backward(dx1)), dmem
        d = self.norm3.backward(dout)
        dx2 = d + self._ff_backward(self.dropout3.backward(d))
        d = self.norm2.backward(dx2)
        dq, dmem = self._mha_backward(d)
        d = self.norm1.backward(d + dq)
        return d + self._sa_backward(d), dmem


class TransformerEncoder(Module):
    """``num_layers`` copies of ``encoder_layer`` (deep copies, as PyTorch), then an optional norm."""

    def __init__(self, encoder_layer: TransformerEncoderLayer, num_layers: int, norm: LayerNorm | None = None):
        super().__init__()
        self.layers = ModuleList(copy.deepcopy(encoder_layer) for _ in range(num_layers))
        self.num_layers = num_layers
        self.norm = norm
        self.share_stream(encoder_layer.random_stream)  # the copies draw from one stream, not L equal ones

    def forward(self, src, mask=None, src_key_padding_mask=None, is_causal: bool = False):
        x = src
        for layer in self.layers:
            x = layer(x, src_mask=mask, src_key_padding_mask=src_key_padding_mask, is_causal=is_causal)
        return x if self.norm is None else self.norm(x)

    def backward(self, dout):
        d = dout if self.norm is None else self.norm.backward(dout)
        for layer in reversed(list(self.layers)):
            d = layer.backward(d)
        return d


class TransformerDecoder(Module):
    """``num_layers`` copies of ``decoder_layer``, then an optional norm; ``backward`` returns
    ``(dtgt, dmemory)`` with the memory gradient summed over the layers."""

    def __init__(self, decoder_layer: TransformerDecoderLayer, num_layers: int, norm: LayerNorm | None = None):
        super().__init__()
        self.layers = ModuleList(copy.deepcopy(decoder_layer) for _ in range(num_layers))
        self.num_layers = num_layers
        self.norm = norm
        self.share_stream(decoder_layer.random_stream)  # the copies draw from one stream, not L equal ones

    def forward(self, tgt, memory, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
                memory_key_padding_mask=None, tgt_is_causal: bool = False, memory_is_causal: bool = False):
        x = tgt
        for layer in self.layers:
            x = layer(x, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                      tgt_key_padding_mask=tgt_key_padding_mask,
                      memory_key_padding_mask=memory_key_padding_mask,
                      tgt_is_causal=tgt_is_causal, memory_is_causal=memory_is_causal)
        return x if self.norm is None else self.norm(x)

    def backward(self, dout):
        d = dout if self.norm is None else self.norm.backward(dout)
        dmemory = None
        for layer in reversed(list(self.layers)):
            d, dm = layer.backward(d)
            dmemory = dm if dmemory is None else dmemory + dm
        return d, dmemory


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
        self.manual_seed(init.stream_seed(rng))          # this module's dropout stream

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
        dtgt, dmemory = self.decoder.backward(dout)
        return self.encoder.backward(dmemory), dtgt
