"""``MultiheadAttention(embed_dim, num_heads, dropout=0.0, bias=True)``, as ``torch.nn.MultiheadAttention``
with ``batch_first=True``.

    head_i = softmax(Q_i K_i^T / sqrt(hs) + mask) V_i,   Q = query W_q^T + b_q, ...
    out = concat(head_1 .. head_H) W_o^T + b_o

Parameters keep PyTorch's names and layout: ``in_proj_weight`` (3E, E) = [W_q; W_k; W_v],
``in_proj_bias`` (3E,), ``out_proj.weight`` (E, E), ``out_proj.bias`` (E,). Masks follow
``nn.MultiheadAttention``: a bool ``attn_mask``/``key_padding_mask`` entry True means "may not attend";
a float mask is added to the scores. A query whose every key is masked gets a zero output and zero
gradient (PyTorch gives NaN there); see ``npformer.ops.attention``.
"""
from __future__ import annotations

from npformer.backend import get_array_module
from npformer.nn import init
from npformer.nn.linear import Linear
from npformer.nn.module import Module, Parameter
from npformer.ops.attention import scaled_dot_product_attention_forward
from npformer.ops.flash_attention import check_implementation
from npformer.ops.linear import matmul_last
from npformer.ops.multihead import multi_head_attention_backward, multi_head_attention_forward

__all__ = ["MultiheadAttention", "KVCache"]


def _split_heads(x, h):
    b, t, e = x.shape
    return x.reshape(b, t, h, e // h).transpose(0, 2, 1, 3)                      # (B, H, T, hs)


class KVCache:
    """The projected keys and values of the positions seen so far, per attention module, for
    incremental decoding: step t projects only the new token and attends over all cached keys."""

    def __init__(self):
        self.k = None                                    # (B, H, T, hs)
        self.v = None                                    # (B, H, T, hs)

    def __len__(self) -> int:
        return 0 if self.k is None else int(self.k.shape[2])

    def reorder(self, index) -> None:
        """Keep the rows ``index`` (beam search reorders hypotheses every step)."""
        if self.k is not None:
            self.k, self.v = self.k[index], self.v[index]


def _project(x, weight, bias, part, e):
    w = weight[part * e:(part + 1) * e]                  # (E, E)
    y = matmul_last(x, w.T)                              # (B, T, E)
    return y if bias is None else y + bias[part * e:(part + 1) * e]


class MultiheadAttention(Module):
    """Self- or cross-attention over batch-first (B, T, E) inputs; ``forward`` returns (out, weights)."""

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True, *,
                 dtype=None, backend=None, rng=None, attention: str = "plain"):
        super().__init__()
        rng = init.host_generator(rng)   # one stream for all of this module's draws
        if num_heads <= 0 or embed_dim % num_heads:
            raise ValueError(f"embed_dim {embed_dim} is not divisible by num_heads {num_heads}")
        if not 0.0 <= dropout <= 1.0:
            raise ValueError(f"dropout must be in [0, 1], got {dropout!r}")
        self.embed_dim, self.num_heads, self.dropout = embed_dim, num_heads, float(dropout)
        check_implementation(attention)
        self.attention = attention       # "plain", or "flash": tiled, O(T) memory, no weights (ops.flash_attention)
        self.head_dim = embed_dim // num_heads
        kw = dict(dtype=dtype, backend=backend)
        # PyTorch's _reset_parameters: xavier-uniform packed projection, zero biases.
        self.in_proj_weight = Parameter(init.xavier_uniform((3 * embed_dim, embed_dim), rng=rng, **kw))
        self.in_proj_bias = Parameter(init.zeros((3 * embed_dim,), **kw), decay=False) if bias else None
        self.out_proj = Linear(embed_dim, embed_dim, bias=bias, rng=rng, **kw)
        if bias:
            self.out_proj.bias.data[...] = 0
        self.manual_seed(init.stream_seed(rng))          # this module's dropout stream

    def forward(self, query, key, value, key_padding_mask=None, need_weights: bool = True,
                attn_mask=None, average_attn_weights: bool = True, is_causal: bool = False,
                causal_alignment: str = "top_left"):
        active = self.training and self.dropout > 0
        out, weights, cache = multi_head_attention_forward(
            query, key, value, self.num_heads, self.in_proj_weight.data,
            None if self.in_proj_bias is None else self.in_proj_bias.data,
            self.out_proj.weight.data, None if self.out_proj.bias is None else self.out_proj.bias.data,
            attn_mask=attn_mask, key_padding_mask=key_padding_mask, is_causal=is_causal,
            causal_alignment=causal_alignment, dropout_p=self.dropout if active else 0.0,
            rng=self.generator(query) if active else None, training=active,
            need_weights=need_weights, average_attn_weights=average_attn_weights, attention=self.attention)
        self._push(cache)
        return out, weights                              # (B, Tq, E), (B, Tq, Tk) | (B, H, Tq, Tk) | None

    def backward(self, dout):
        """Returns ``(dquery, dkey, dvalue)``; for self-attention (query is key is value) the whole
        input gradient is ``dquery`` and the other two are None; when only key is value, ``dkey``
        holds their sum and ``dvalue`` is None."""
        dq, dk, dv, dw_in, db_in, dw_out, db_out = multi_head_attention_backward(dout, self._pop())
        self.in_proj_weight.accumulate(dw_in)
        self.out_proj.weight.accumulate(dw_out)
        if self.in_proj_bias is not None:
            self.in_proj_bias.accumulate(db_in)
            self.out_proj.bias.accumulate(db_out)
        return dq, dk, dv

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, dropout={self.dropout}, " \
               f"bias={self.in_proj_bias is not None}"

    def attend_cached(self, query, cache: KVCache, source=None, key_padding_mask=None):
        """Inference-only attention with a key/value cache (no caches saved for backward).

        ``source`` None: self-attention; the new rows' keys/values are appended to ``cache`` and the
        queries attend causally, aligned bottom-right (query i of the Tq new ones is position
        len(cache) - Tq + i). ``source`` given: cross-attention over a fixed memory, projected into
        ``cache`` on the first call only.
        """
        xp = get_array_module(query)
        e, h = self.embed_dim, self.num_heads
        w, b = self.in_proj_weight.data, None if self.in_proj_bias is None else self.in_proj_bias.data
        q = _split_heads(_project(query, w, b, 0, e), h)                              # (B, H, Tq, hs)
        if source is None or cache.k is None:
            src = query if source is None else source
            k = _split_heads(_project(src, w, b, 1, e), h)                            # (B, H, Tnew, hs)
            v = _split_heads(_project(src, w, b, 2, e), h)
            cache.k = k if cache.k is None else xp.concatenate([cache.k, k], axis=2)  # (B, H, T, hs)
            cache.v = v if cache.v is None else xp.concatenate([cache.v, v], axis=2)
        out, _, _ = scaled_dot_product_attention_forward(
            q, cache.k, cache.v, key_padding_mask=key_padding_mask, is_causal=source is None,
            causal_alignment="bottom_right")                                          # (B, H, Tq, hs)
        bsz, _, tq, _ = out.shape
        out = out.transpose(0, 2, 1, 3).reshape(bsz, tq, e)                           # (B, Tq, E)
        out = matmul_last(out, self.out_proj.weight.data.T)
        return out if self.out_proj.bias is None else out + self.out_proj.bias.data
