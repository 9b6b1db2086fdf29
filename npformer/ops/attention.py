"""Scaled dot-product attention (Vaswani et al. 2017, eq. 1) with masks and dropout.

    S = q k^T * scale + bias          q: (B, H, Tq, hs), k: (B, H, Tk, hs), scale = 1/sqrt(hs)
    P = softmax(S)                    bias: 0 / -inf from the masks, or float masks added
    out = dropout(P) v                v: (B, H, Tk, hv)

Masks follow ``torch.nn.MultiheadAttention``: a bool ``attn_mask``/``key_padding_mask`` entry True
means *may not attend*; a float mask is added (see :mod:`npformer.ops.masks`). Note that
``torch.nn.functional.scaled_dot_product_attention`` uses the opposite bool convention (True =
may attend); npformer follows ``MultiheadAttention`` everywhere.

A query whose every key is masked has an all -inf row; the guarded softmax gives it zero
probabilities, so its output is zero and it passes no gradient (PyTorch's MultiheadAttention
returns NaN there). The weights returned with ``need_weights`` are the probabilities *before*
dropout, which is what visualisation wants (PyTorch's MultiheadAttention returns them after
dropout when training with dropout; in eval mode the two agree).
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

from npformer.backend import get_array_module
from npformer.ops.checks import describe, expect_float, expect_ndim, expect_same_dtype
from npformer.ops.dropout import dropout_backward, dropout_forward
from npformer.ops.masks import attention_bias
from npformer.ops.softmax import SoftmaxCache, softmax_backward, softmax_forward

__all__ = ["AttentionCache", "scaled_dot_product_attention_forward",
           "scaled_dot_product_attention_backward"]


class AttentionCache(NamedTuple):
    q: Any               # (B, H, Tq, hs)
    k: Any               # (B, H, Tk, hs)
    v: Any               # (B, H, Tk, hv)
    p: Any               # (B, H, Tq, Tk) probabilities (before dropout)
    p_drop: Any          # (B, H, Tq, Tk) after dropout (p itself when no dropout)
    dropout: Any         # DropoutCache or None
    scale: float


def scaled_dot_product_attention_forward(q, k, v, *, attn_mask=None, key_padding_mask=None,
                                         is_causal: bool = False, causal_alignment: str = "top_left",
                                         dropout_p: float = 0.0, rng=None, training: bool = True,
                                         scale: float | None = None, need_weights: bool = False):
    """Returns ``(out, weights or None, cache)``; out (B, H, Tq, hv), weights (B, H, Tq, Tk)."""
    for name, a in (("q", q), ("k", k), ("v", v)):
        expect_float(a, name)
        expect_ndim(a, name, 4, "(B, H, T, head_size)")
    expect_same_dtype(q=q, k=k, v=v)
    xp = get_array_module(q, k, v)
    b, h, tq, hs = q.shape
    if k.shape[:2] != (b, h) or k.shape[3] != hs:
        raise ValueError(f"k: expected shape (B, H, Tk, hs)=({b}, {h}, *, {hs}) to match q "
                         f"{tuple(q.shape)}, got {describe(k)}")
    tk = k.shape[2]
    if v.shape[:3] != (b, h, tk):
        raise ValueError(f"v: expected shape (B, H, Tk, hv)=({b}, {h}, {tk}, *) to match k "
                         f"{tuple(k.shape)}, got {describe(v)}")
    scale = 1.0 / math.sqrt(hs) if scale is None else float(scale)
    bias = attention_bias(b, h, tq, tk, q.dtype, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                          is_causal=is_causal, causal_alignment=causal_alignment, xp=xp)
    s = q @ k.swapaxes(-1, -2)                           # (B, H, Tq, Tk)
    s *= scale
    if bias is not None:
        s += bias
    p, _ = softmax_forward(s)                            # (B, H, Tq, Tk), all -inf rows -> 0
    drop = None
    p_drop = p
    if training and dropout_p > 0:
        p_drop, drop = dropout_forward(p, dropout_p, rng=rng, training=True)
    out = p_drop @ v                                     # (B, H, Tq, hv)
    return out, (p if need_weights else None), AttentionCache(q, k, v, p, p_drop, drop, scale)


def scaled_dot_product_attention_backward(dout, cache: AttentionCache):
    """Returns ``(dq, dk, dv)``."""
    q, k, v, p, p_drop, drop, scale = cache
    # fwd: out = P_drop @ v  ->  dP_drop = dout @ v^T,  dv = P_drop^T @ dout
    dv = p_drop.swapaxes(-1, -2) @ dout                  # (B, H, Tk, hv)
    dp = dout @ v.swapaxes(-1, -2)                       # (B, H, Tq, Tk)
    if drop is not None:
        dp = dropout_backward(dp, drop)                  # fwd: P_drop = dropout(P)
    # fwd: P = softmax(S)  ->  dS = P * (dP - sum(dP * P))   (zero on masked and fully masked rows)
    ds = softmax_backward(dp, SoftmaxCache(p))
    ds *= scale
    # fwd: S = q @ k^T * scale  ->  dq = dS @ k,  dk = dS^T @ q
    dq = ds @ k                                          # (B, H, Tq, hs)
    dk = ds.swapaxes(-1, -2) @ q                         # (B, H, Tk, hs)
    return dq, dk, dv
