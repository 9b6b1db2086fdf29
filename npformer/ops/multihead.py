"""Multi-head attention with PyTorch's packed input projection (Vaswani et al. 2017, sec. 3.2.2;
``torch.nn.functional.multi_head_attention_forward`` with ``batch_first=True``).

    Q = query W_q^T + b_q,  K = key W_k^T + b_k,  V = value W_v^T + b_v     W_in = [W_q; W_k; W_v] (3E, E)
    head_h = attention(Q_h, K_h, V_h)      E split into H heads of hs = E / H: (B, T, E) -> (B, H, T, hs)
    out = concat_h(head_h) W_o^T + b_o

Projections: self-attention (``query is key is value``) does ONE fused (B*T, E) @ (E, 3E) product;
when only ``key is value`` (cross-attention over a memory) the query uses the W_q slice and
key/value share one (B*Tk, E) @ (E, 2E) product with the [W_k; W_v] slice; otherwise each input
uses its own slice.

Gradients of inputs passed more than once are summed into one: the backward returns one gradient
per *distinct* input object. Self-attention: ``dquery`` is the whole input gradient and ``dkey =
dvalue = None``. ``key is value`` but not ``query``: ``dkey`` holds the sum over key and value and
``dvalue = None``. Otherwise all three are arrays. (Identity, not equality, decides: equal copies
are treated as distinct inputs.)

Masks, fully masked rows (zero output and gradient) and the returned weights (after dropout, as
PyTorch) are those of :mod:`npformer.ops.attention`; the weights are averaged over heads to
(B, Tq, Tk) unless ``average_attn_weights=False`` gives (B, H, Tq, Tk).
"""
from __future__ import annotations

from numbers import Integral
from typing import Any, NamedTuple

from npformer.backend import get_array_module
from npformer.ops.attention import (AttentionCache, scaled_dot_product_attention_backward,
                                    scaled_dot_product_attention_forward)
from npformer.checks import describe, expect_float, expect_ndim, expect_same_dtype, expect_shape
from npformer.ops.flash_attention import (FlashAttentionCache, check_implementation, flash_attention_backward,
                                          flash_attention_forward)
from npformer.ops.linear import matmul_last

__all__ = ["MultiHeadCache", "multi_head_attention_forward", "multi_head_attention_backward"]


class MultiHeadCache(NamedTuple):
    """The distinct inputs, the weights, the attention cache and the merged heads."""

    inputs: tuple          # self: (x,) (B, T, E); kv: (query, kv); none: (query, key, value)
    sharing: str           # "self", "kv" or "none"
    in_proj_weight: Any    # (3E, E)
    has_in_bias: bool
    attn: AttentionCache   # of the (B, H, T, hs) heads
    merged: Any            # (B, Tq, E) heads concatenated: the input of the output projection
    out_proj_weight: Any   # (E, E)
    has_out_bias: bool


def _split(x, h):
    b, t, e = x.shape
    return x.reshape(b, t, h, e // h).transpose(0, 2, 1, 3)                      # (B, H, T, hs)


def _merge(x):
    b, h, t, hs = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b, t, h * hs)                         # (B, T, E)


def _merge_packed(*parts):
    """concatenate([merge(p) for p in parts], axis=-1) with one copy per part, no second pass."""
    b, h, t, hs = parts[0].shape
    out = get_array_module(parts[0]).empty((b, t, len(parts), h, hs), dtype=parts[0].dtype)
    for i, part in enumerate(parts):
        out[:, :, i] = part.transpose(0, 2, 1, 3)                                # (B, T, H, hs)
    return out.reshape(b, t, len(parts) * h * hs)                                 # (B, T, n*E)


def _check(query, key, value, num_heads, in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias):
    for name, a in (("query", query), ("key", key), ("value", value)):
        expect_float(a, name)
        expect_ndim(a, name, 3, "(B, T, E), batch first")
    b, tq, e = query.shape
    if isinstance(num_heads, bool) or not isinstance(num_heads, Integral):
        raise TypeError(f"num_heads: expected an int, got {describe(num_heads)}")
    if num_heads < 1:
        raise ValueError(f"num_heads: expected at least 1 head, got {num_heads}")
    if e % num_heads:
        raise ValueError(f"embed_dim {e} is not divisible by num_heads {num_heads}")
    for name, a in (("key", key), ("value", value)):
        if a.shape[0] != b:
            raise ValueError(f"{name}: expected batch size B={b} of query {tuple(query.shape)}, got {describe(a)}")
        if a.shape[2] != e:
            raise ValueError(f"{name}: expected embed_dim E={e} of query {tuple(query.shape)}, got {describe(a)}")
    if value.shape != key.shape:
        raise ValueError(f"value: expected the shape (B, Tk, E)={tuple(key.shape)} of key, got {describe(value)}")
    expect_shape(in_proj_weight, "in_proj_weight", (3 * e, e), "(3E, E) = [W_q; W_k; W_v]")
    expect_shape(out_proj_weight, "out_proj_weight", (e, e), "(E, E)")
    if in_proj_bias is not None:
        expect_shape(in_proj_bias, "in_proj_bias", (3 * e,), "(3E,)")
    if out_proj_bias is not None:
        expect_shape(out_proj_bias, "out_proj_bias", (e,), "(E,)")
    expect_same_dtype(query=query, key=key, value=value, in_proj_weight=in_proj_weight,
                      in_proj_bias=in_proj_bias, out_proj_weight=out_proj_weight, out_proj_bias=out_proj_bias)
    get_array_module(query, key, value, in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias)


def _project(x, w, bias):
    y = matmul_last(x, w.T)                              # (B, T, n*E), one 2-d matmul
    if bias is not None:
        y += bias                                        # y is fresh
    return y


def multi_head_attention_forward(query, key, value, num_heads: int, in_proj_weight, in_proj_bias,
                                 out_proj_weight, out_proj_bias, *, attn_mask=None,
                                 key_padding_mask=None, is_causal: bool = False,
                                 causal_alignment: str = "top_left", dropout_p: float = 0.0, rng=None,
                                 training: bool = True, need_weights: bool = True,
                                 average_attn_weights: bool = True, attention: str = "plain"):
    """Returns ``(out, weights or None, cache)``: out (B, Tq, E); weights (B, Tq, Tk) averaged over
    heads, or (B, H, Tq, Tk) with ``average_attn_weights=False``. Masks as in
    :func:`npformer.ops.masks.attention_bias` (a 3-d attn_mask is (B*H, Tq, Tk), as torch).
    ``attention="flash"`` runs :mod:`npformer.ops.flash_attention` (O(T) memory, no weights)."""
    _check(query, key, value, num_heads, in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias)
    check_implementation(attention)
    e, h = query.shape[2], num_heads
    b_in = [None] * 3 if in_proj_bias is None else \
        [in_proj_bias[:e], in_proj_bias[e:2 * e], in_proj_bias[2 * e:]]          # 3 x (E,) views
    if query is key and key is value:
        sharing, inputs = "self", (query,)
        qkv = _project(query, in_proj_weight, in_proj_bias)                      # (B, T, 3E), fused
        q, k, v = qkv[..., :e], qkv[..., e:2 * e], qkv[..., 2 * e:]              # (B, T, E) views
    else:
        q = _project(query, in_proj_weight[:e], b_in[0])                         # (B, Tq, E)
        if key is value:
            sharing, inputs = "kv", (query, key)
            b_kv = None if in_proj_bias is None else in_proj_bias[e:]           # (2E,)
            kv = _project(key, in_proj_weight[e:], b_kv)                         # (B, Tk, 2E), shared
            k, v = kv[..., :e], kv[..., e:]                                      # (B, Tk, E) views
        else:
            sharing, inputs = "none", (query, key, value)
            k = _project(key, in_proj_weight[e:2 * e], b_in[1])                  # (B, Tk, E)
            v = _project(value, in_proj_weight[2 * e:], b_in[2])                 # (B, Tk, E)

    if attention == "flash":
        weights = None
        heads, attn = flash_attention_forward(
            _split(q, h), _split(k, h), _split(v, h), attn_mask=attn_mask, key_padding_mask=key_padding_mask,
            is_causal=is_causal, causal_alignment=causal_alignment, dropout_p=dropout_p, rng=rng,
            training=training, need_weights=need_weights)                        # (B, H, Tq, hs)
    else:
        heads, weights, attn = scaled_dot_product_attention_forward(
            _split(q, h), _split(k, h), _split(v, h), attn_mask=attn_mask, key_padding_mask=key_padding_mask,
            is_causal=is_causal, causal_alignment=causal_alignment, dropout_p=dropout_p, rng=rng,
            training=training, need_weights=need_weights)                        # (B, H, Tq, hs)
    merged = _merge(heads)                                                        # (B, Tq, E)
    out = _project(merged, out_proj_weight, out_proj_bias)                        # (B, Tq, E)
    if weights is not None and average_attn_weights:
        weights = weights.mean(axis=1)                                            # (B, Tq, Tk)
    cache = MultiHeadCache(inputs, sharing, in_proj_weight, in_proj_bias is not None, attn, merged,
                           out_proj_weight, out_proj_bias is not None)
    return out, weights, cache


def _linear_grads(d, x, w):
    """fwd: y = x @ W^T + b  ->  dx = d @ W,  dW = d^T @ x,  db = sum over rows of d."""
    n = d.shape[-1]
    d2 = d.reshape(-1, n)                                                         # (B*T, n)
    return matmul_last(d, w), d2.T @ x.reshape(-1, x.shape[-1]), d2.sum(axis=0)   # (B, T, E), (n, E), (n,)


def multi_head_attention_backward(dout, cache: MultiHeadCache):
    """Returns ``(dquery, dkey, dvalue, din_proj_weight, din_proj_bias, dout_proj_weight,
    dout_proj_bias)``; ``dkey``/``dvalue`` are None for a repeated input (module docstring), the
    bias gradients None when the forward had no bias."""
    inputs, sharing, w_in, has_in_bias, attn, merged, w_out, has_out_bias = cache
    e = w_out.shape[0]
    h = attn.q.shape[1]
    xp = get_array_module(dout, w_in)
    # fwd: out = merged @ W_o^T + b_o  ->  dmerged = dout @ W_o,  dW_o = dout^T merged,  db_o = sum dout
    dmerged, dw_out, db_out = _linear_grads(dout, merged, w_out)                  # (B, Tq, E), (E, E), (E,)
    # fwd: merged = merge(heads), heads = attention(split(q), split(k), split(v))
    attn_backward = flash_attention_backward if isinstance(attn, FlashAttentionCache) else \
        scaled_dot_product_attention_backward
    dqh, dkh, dvh = attn_backward(_split(dmerged, h), attn)                      # (B, H, T, hs) each
    # fwd: [q|k|v] = x @ W_in[slice]^T + b_in[slice]  ->  dx = d @ W_in[slice], dW_in[slice] = d^T x
    if sharing == "self":
        dqkv = _merge_packed(dqh, dkh, dvh)                                       # (B, T, 3E)
        dx, dw_in, db_in = _linear_grads(dqkv, inputs[0], w_in)                   # (B, T, E), (3E, E), (3E,)
        grads = (dx, None, None)
    elif sharing == "kv":
        dquery, dw_q, db_q = _linear_grads(_merge(dqh), inputs[0], w_in[:e])      # (B, Tq, E), (E, E), (E,)
        dkv = _merge_packed(dkh, dvh)                                             # (B, Tk, 2E)
        dmem, dw_kv, db_kv = _linear_grads(dkv, inputs[1], w_in[e:])              # (B, Tk, E), (2E, E), (2E,)
        dw_in = xp.concatenate([dw_q, dw_kv], axis=0)                             # (3E, E)
        db_in = xp.concatenate([db_q, db_kv])                                     # (3E,)
        grads = (dquery, dmem, None)
    else:
        parts = [_linear_grads(d, x, w_in[i * e:(i + 1) * e])                   # (B, T, E), (E, E), (E,)
                 for i, (d, x) in enumerate(zip(map(_merge, (dqh, dkh, dvh)), inputs))]
        dw_in = xp.concatenate([p[1] for p in parts], axis=0)                     # (3E, E)
        db_in = xp.concatenate([p[2] for p in parts])                             # (3E,)
        grads = tuple(p[0] for p in parts)                                        # (B, Tq|Tk, E) each
    return grads + (dw_in, db_in if has_in_bias else None, dw_out, db_out if has_out_bias else None)
