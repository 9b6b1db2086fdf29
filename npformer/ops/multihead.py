"""Multi-head attention with a packed input projection, as ``torch.nn.functional.multi_head_attention_forward``
(batch-first).

    [Q; K; V] = [query W_q^T + b_q;  key W_k^T + b_k;  value W_v^T + b_v]      W_in = [W_q; W_k; W_v] (3E, E)
    head_i = attention(Q_i, K_i, V_i)       split E into H heads of hs = E / H: (B, T, E) -> (B, H, T, hs)
    out = concat_i(head_i) W_o^T + b_o

Self-attention (``query is key is value``) does one fused (B*T, E) @ (E, 3E) projection; otherwise
each input is projected with its slice of ``W_in``. The backward returns one gradient per distinct
input: for self-attention ``dquery`` holds the whole input gradient and ``dkey = dvalue = None``;
when only ``key is value`` (cross-attention over a memory), ``dkey`` holds the sum and ``dvalue``
is None.
"""
from __future__ import annotations

from typing import Any, NamedTuple

from npformer.backend import get_array_module
from npformer.ops.attention import (scaled_dot_product_attention_backward,
                                    scaled_dot_product_attention_forward)
from npformer.ops.linear import matmul_last
from npformer.ops.checks import describe, expect_float, expect_ndim, expect_same_dtype, expect_shape

__all__ = ["MultiHeadCache", "multi_head_attention_forward", "multi_head_attention_backward"]


class MultiHeadCache(NamedTuple):
    inputs: tuple        # the distinct inputs: (x,), (query, kv) or (query, key, value), each (B, T, E)
    sharing: str         # "self", "kv" or "none"
    in_proj_weight: Any  # (3E, E)
    has_in_bias: bool
    attn: Any            # AttentionCache
    merged: Any          # (B, Tq, E) heads concatenated, the input of the output projection
    out_proj_weight: Any # (E, E)
    has_out_bias: bool
    num_heads: int


def _split(x, h):
    b, t, e = x.shape
    return x.reshape(b, t, h, e // h).transpose(0, 2, 1, 3)                      # (B, H, T, hs)


def _merge(x):
    b, h, t, hs = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b, t, h * hs)                         # (B, T, E)


def multi_head_attention_forward(query, key, value, num_heads: int, in_proj_weight, in_proj_bias,
                                 out_proj_weight, out_proj_bias, *, attn_mask=None,
                                 key_padding_mask=None, is_causal: bool = False,
                                 causal_alignment: str = "top_left", dropout_p: float = 0.0, rng=None,
                                 training: bool = True, need_weights: bool = True,
                                 average_attn_weights: bool = True):
    """Returns ``(out, weights or None, cache)``: out (B, Tq, E); weights (B, Tq, Tk) averaged over
    heads or (B, H, Tq, Tk)."""
    for name, a in (("query", query), ("key", key), ("value", value)):
        expect_float(a, name)
        expect_ndim(a, name, 3, "(B, T, E), batch first")
    b, tq, e = query.shape
    if num_heads <= 0 or e % num_heads:
        raise ValueError(f"embed_dim {e} is not divisible by num_heads {num_heads}")
    if key.shape[0] != b or key.shape[2] != e or value.shape != key.shape:
        raise ValueError(f"key and value: expected shape (B, Tk, E)=({b}, *, {e}) matching each other "
                         f"and query {tuple(query.shape)}, got key {describe(key)} and value {describe(value)}")
    expect_shape(in_proj_weight, "in_proj_weight", (3 * e, e), "(3E, E)")
    expect_shape(out_proj_weight, "out_proj_weight", (e, e), "(E, E)")
    if in_proj_bias is not None:
        expect_shape(in_proj_bias, "in_proj_bias", (3 * e,), "(3E,)")
    if out_proj_bias is not None:
        expect_shape(out_proj_bias, "out_proj_bias", (e,), "(E,)")
    expect_same_dtype(query=query, key=key, value=value, in_proj_weight=in_proj_weight,
                      in_proj_bias=in_proj_bias, out_proj_weight=out_proj_weight, out_proj_bias=out_proj_bias)
    xp = get_array_module(query, key, value, in_proj_weight, out_proj_weight)
    h = num_heads

    if query is key and key is value:
        sharing, inputs = "self", (query,)
        qkv = matmul_last(query, in_proj_weight.T)                   # (B, T, 3E), one fused matmul
        if in_proj_bias is not None:
            qkv += in_proj_bias
        q, k, v = qkv[..., :e], qkv[..., e:2 * e], qkv[..., 2 * e:]
    else:
        w_q, w_k, w_v = in_proj_weight[:e], in_proj_weight[e:2 * e], in_proj_weight[2 * e:]
        q = matmul_last(query, w_q.T)                                # (B, Tq, E)
        if key is value:
            sharing, inputs = "kv", (query, key)
            kv = matmul_last(key, in_proj_weight[e:].T)              # (B, Tk, 2E)
            if in_proj_bias is not None:
                kv += in_proj_bias[e:]
            k, v = kv[..., :e], kv[..., e:]
        else:
            sharing, inputs = "none", (query, key, value)
            k, v = matmul_last(key, w_k.T), matmul_last(value, w_v.T)            # (B, Tk, E)
            if in_proj_bias is not None:
                k += in_proj_bias[e:2 * e]
                v += in_proj_bias[2 * e:]
        if in_proj_bias is not None:
            q += in_proj_bias[:e]

    heads, weights, attn = scaled_dot_product_attention_forward(
        _split(q, h), _split(k, h), _split(v, h), attn_mask=attn_mask, key_padding_mask=key_padding_mask,
        is_causal=is_causal, causal_alignment=causal_alignment, dropout_p=dropout_p, rng=rng,
        training=training, need_weights=need_weights)                            # (B, H, Tq, hs)
    merged = _merge(heads)                                                        # (B, Tq, E)
    out = matmul_last(merged, out_proj_weight.T)                                              # (B, Tq, E)
    if out_proj_bias is not None:
        out += out_proj_bias
    if weights is not None and average_attn_weights:
        weights = weights.mean(axis=1)                                            # (B, Tq, Tk)
    cache = MultiHeadCache(inputs, sharing, in_proj_weight, in_proj_bias is not None, attn, merged,
                           out_proj_weight, out_proj_bias is not None, h)
    return out, weights, cache


def multi_head_attention_backward(dout, cache: MultiHeadCache):
    """Returns ``(dquery, dkey, dvalue, din_proj_weight, din_proj_bias, dout_proj_weight, dout_proj_bias)``."""
    inputs, sharing, w_in, has_in_bias, attn, merged, w_out, has_out_bias, h = cache
    e = w_out.shape[0]
    # fwd: out = merged @ W_o^T + b_o  ->  dmerged = dout @ W_o,  dW_o = dout^T merged,  db_o = sum dout
    dout2 = dout.reshape(-1, e)                                                   # (B*Tq, E)
    dw_out = dout2.T @ merged.reshape(-1, e)                                      # (E, E)
    db_out = dout2.sum(axis=0) if has_out_bias else None                          # (E,)
    dmerged = matmul_last(dout, w_out)                                                        # (B, Tq, E)
    dq, dk, dv = scaled_dot_product_attention_backward(_split(dmerged, h), attn)  # (B, H, T, hs) each
    dq, dk, dv = _merge(dq), _merge(dk), _merge(dv)                               # (B, T, E) each
    xp = get_array_module(dout)
    # fwd: [q, k, v] = x_{q,k,v} @ W_{q,k,v}^T + b  ->  dx = d @ W,  dW = d^T x,  db = sum d
    if sharing == "self":
        (x,) = inputs
        dqkv = xp.concatenate([dq, dk, dv], axis=-1)                              # (B, T, 3E)
        d2 = dqkv.reshape(-1, 3 * e)
        dw_in = d2.T @ x.reshape(-1, e)                                           # (3E, E)
        db_in = d2.sum(axis=0) if has_in_bias else None
        return matmul_last(dqkv, w_in), None, None, dw_in, db_in, dw_out, db_out
    query = inputs[0]
    dquery = matmul_last(dq, w_in[:e])                                                        # (B, Tq, E)
    dw_q = dq.reshape(-1, e).T @ query.reshape(-1, e)                             # (E, E)
    if sharing == "kv":
        kv_in = inputs[1]
        dkv = xp.concatenate([dk, dv], axis=-1)                                   # (B, Tk, 2E)
        dkey = matmul_last(dkv, w_in[e:])                                                     # (B, Tk, E)
        dw_kv = dkv.reshape(-1, 2 * e).T @ kv_in.reshape(-1, e)                   # (2E, E)
        dw_in = xp.concatenate([dw_q, dw_kv], axis=0)                             # (3E, E)
        dvalue = None
    else:
        key, value = inputs[1], inputs[2]
        dkey, dvalue = matmul_last(dk, w_in[e:2 * e]), matmul_last(dv, w_in[2 * e:])                      # (B, Tk, E)
        dw_in = xp.concatenate([dw_q, dk.reshape(-1, e).T @ key.reshape(-1, e),
                                dv.reshape(-1, e).T @ value.reshape(-1, e)], axis=0)   # (3E, E)
    db_in = xp.concatenate([dq.reshape(-1, e).sum(axis=0), dk.reshape(-1, e).sum(axis=0),
                            dv.reshape(-1, e).sum(axis=0)]) if has_in_bias else None
    return dquery, dkey, dvalue, dw_in, db_in, dw_out, db_out
