"""``MultiheadAttention(embed_dim, num_heads, dropout=0.0, bias=True)``, as ``torch.nn.MultiheadAttention``
with ``batch_first=True``.

    head_i = softmax(Q_i K_i^T / sqrt(hs) + mask) V_i,   Q = query W_q^T + b_q, ...
    out = concat(head_1 .. head_H) W_o^T + b_o

Parameters keep PyTorch's names and layout: ``in_proj_weight`` (3E, E) = [W_q; W_k; W_v],
``in_proj_bias`` (3E,), ``out_proj.weight`` (E, E), ``out_proj.bias`` (E,). Masks follow
``nn.MultiheadAttention``: a bool ``attn_mask``/``key_padding_mask`` entry True means "may not attend";
a float mask is added to the scores. A query whose every key is masked gets a zero output and zero
gradient (PyTorch gives NaN there); see ``npformer.ops.attention``.

``attention`` picks the attention op: ``"plain"`` (:mod:`npformer.ops.attention`, which can return
the weights), ``"flash"`` (:mod:`npformer.ops.flash_attention`: tiled, memory linear in T, no weights;
a CUDA kernel on CuPy arrays) or ``"auto"``, the default: flash for CuPy arrays when
``need_weights=False`` (GPU training), plain otherwise (NumPy, where plain is the faster, or when the
weights are asked for). The choice is made per call.

``forward(query, key, value)`` is PyTorch's call, and ``backward`` returns ``(dquery, dkey, dvalue)``.
``forward(query)`` alone is self-attention through one packed projection
(:func:`npformer.ops.multihead.self_attention_forward`); ``backward`` then returns ``(dx, None, None)``,
``dx`` holding all three paths. The call decides, never the arrays' identity.

Incremental decoding passes a :class:`KVCache`: self-attention appends the new positions' keys and
values to it and the queries (the last positions) attend causally over all of them, aligned
bottom-right; cross-attention projects its memory into the cache on the first call only.
"""
from __future__ import annotations

from npformer.checks import describe, positive_int, probability
from npformer.errors import InputTypeError, ShapeError
from npformer.nn import init
from npformer.nn.linear import Linear
from npformer.nn.module import Module, Parameter
from npformer.ops.flash_attention import check_implementation
from npformer.ops.multihead import (multi_head_attention_backward, multi_head_attention_forward,
                                    self_attention_backward, self_attention_forward)

__all__ = ["MultiheadAttention", "KVCache"]


class KVCache:
    """The projected keys and values (B, H, T, hs) of the positions seen so far, for one attention
    module during incremental decoding (inference only)."""

    def __init__(self):
        self.k = None                                    # (B, H, T, hs)
        self.v = None                                    # (B, H, T, hs)

    def __len__(self) -> int:
        return 0 if self.k is None else int(self.k.shape[2])


class MultiheadAttention(Module):
    """Self- or cross-attention over batch-first (B, T, E) inputs; ``forward`` returns (out, weights)."""

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True, *,
                 dtype=None, backend=None, rng=None, attention: str = "auto"):
        super().__init__()
        rng = init.host_generator(rng)   # one stream for all of this module's draws
        embed_dim, num_heads = positive_int(embed_dim, "embed_dim"), positive_int(num_heads, "num_heads")
        if embed_dim % num_heads:
            raise ShapeError(f"embed_dim {embed_dim} is not divisible by num_heads {num_heads}")
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.dropout = probability(dropout, "dropout")
        check_implementation(attention)
        self.attention = attention       # "auto", "plain", or "flash" (module docstring)
        self.head_dim = embed_dim // num_heads
        kw = dict(dtype=dtype, backend=backend)
        # PyTorch's _reset_parameters: xavier-uniform packed projection, zero biases.
        self.in_proj_weight = Parameter(init.xavier_uniform((3 * embed_dim, embed_dim), rng=rng, **kw))
        self.in_proj_bias = Parameter(init.zeros((3 * embed_dim,), **kw), decay=False) if bias else None
        self.out_proj = Linear(embed_dim, embed_dim, bias=bias, rng=rng, zero_bias=True, **kw)
        self.manual_seed(init.stream_seed(rng))          # this module's dropout stream

    def forward(self, query, key=None, value=None, key_padding_mask=None, need_weights: bool = True,
                attn_mask=None, average_attn_weights: bool = True, is_causal: bool = False,
                causal_alignment: str = "top_left", kv_cache: KVCache | None = None):
        """``(out (B, Tq, E), weights)``: weights (B, Tq, Tk), (B, H, Tq, Tk) with
        ``average_attn_weights=False``, or None with ``need_weights=False``. ``key``/``value`` None:
        self-attention. With ``kv_cache`` the causal mask is aligned bottom-right (the queries are the
        newest positions)."""
        active = self.training and self.dropout > 0
        self_attention = key is None and value is None
        past_key = past_value = None
        if kv_cache is not None:
            if not isinstance(kv_cache, KVCache):
                raise InputTypeError(f"kv_cache: expected a KVCache (npformer.nn.KVCache(), one per attention "
                                     f"module; a model's new_cache() makes them), got {describe(kv_cache)}")
            causal_alignment = "bottom_right"
            if kv_cache.k is not None and kv_cache.k.shape[0] != query.shape[0]:
                raise ShapeError(f"kv_cache: holds {kv_cache.k.shape[0]} sequences but the query has "
                                 f"{query.shape[0]}; start a new cache (model.new_cache()) for another batch")
            if kv_cache.k is not None:
                past_key, past_value = kv_cache.k, kv_cache.v
                if not self_attention:                   # cross-attention: the memory is projected already
                    key = value = None
        # the call decides which op: x alone is self-attention through one packed projection
        op, inputs = (self_attention_forward, (query,)) if self_attention else \
            (multi_head_attention_forward, (query, key, value))
        in_proj_bias = None if self.in_proj_bias is None else self.in_proj_bias.data
        out, attn_weights, cache = op(
            *inputs, self.num_heads, self.in_proj_weight.data, in_proj_bias, *self.out_proj.arrays(),
            past_key=past_key, past_value=past_value, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
            is_causal=is_causal, causal_alignment=causal_alignment, dropout_p=self.dropout if active else 0.0,
            rng=self.generator(query) if active else None, training=active, need_weights=need_weights,
            average_attn_weights=average_attn_weights, attention=self.attention)
        if kv_cache is not None:
            kv_cache.k, kv_cache.v = cache.attn.k, cache.attn.v              # (B, H, Tk, hs): all positions so far
        self._push(cache)
        return out, attn_weights                         # (B, Tq, E), (B, Tq, Tk) | (B, H, Tq, Tk) | None

    def backward(self, dout):
        """Returns ``(dquery, dkey, dvalue)``; ``(dx, None, None)`` after a self-attention call."""
        cache = self._pop()
        if len(cache.projections) == 1:
            dx, dw_in, db_in, dw_out, db_out = self_attention_backward(dout, cache)
            grads = (dx, None, None)
        else:
            *grads, dw_in, db_in, dw_out, db_out = multi_head_attention_backward(dout, cache)
        self.in_proj_weight.accumulate(dw_in)
        if self.in_proj_bias is not None:
            self.in_proj_bias.accumulate(db_in)
        self.out_proj.accumulate(dw_out, db_out)
        return tuple(grads)

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, dropout={self.dropout}, " \
               f"bias={self.in_proj_bias is not None}"
