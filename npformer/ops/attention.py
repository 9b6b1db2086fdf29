"""Scaled dot-product attention (Vaswani et al. 2017, sec. 3.2.1, eq. 1) with masks and dropout.

    S = (q * scale) k^T + bias      q: (B, H, Tq, hs), k: (B, H, Tk, hs), scale = 1/sqrt(hs) by default
    P = softmax(S)                  bias: 0 / -inf from bool masks, plus float masks (ops.masks)
    P_drop = dropout(P)             inverted dropout on the probabilities, in training only
    out = P_drop v                  v: (B, H, Tk, hv), out: (B, H, Tq, hv)

    dv = P_drop^T dout,  dP = dropout'(dout v^T),  dS = P * (dP - sum_k dP * P),
    dq = dS k * scale,   dk = dS^T q * scale

Masks follow ``torch.nn.MultiheadAttention`` (bool True = *may not attend*, float = added).
``torch.nn.functional.scaled_dot_product_attention`` uses the opposite bool convention (True = may
attend); npformer follows ``nn.MultiheadAttention`` everywhere.

q is scaled before the product, as PyTorch's SDPA does. 16-bit inputs are computed in float32 (the
scores, the softmax, each product) and rounded to their dtype where they are kept or returned: P
(the cache) and the outputs. The scores of finite float16 inputs can exceed float16's 65,504 (|q| =
|k| = 1e4 with hs = 8 give scaled scores of 3e8, which float16 would make inf and the softmax NaN),
as can dout v^T in the backward; PyTorch's CPU attention computes them in float32 too. So float16
attention is finite wherever the float32 result is, and within float16 rounding of it.

Fully masked query rows (every key blocked): the row of S is all -inf, the guarded softmax gives it
zero probabilities, so its output is zero and it passes zero gradient to q, k and v, with no NaN.
``torch.nn.MultiheadAttention`` returns NaN there; npformer's choice is zero output, zero gradient.

Returned weights (``need_weights=True``) follow ``torch.nn.functional.multi_head_attention_forward``:
they are the probabilities *after* dropout, the matrix actually multiplied with v (in training with
dropout_p > 0 the kept entries are scaled by 1/(1-p) and rows no longer sum to 1). Without dropout
(eval, or p = 0) they are the softmax probabilities: each row sums to 1, a fully masked row to 0.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

from npformer.backend import accumulation_dtype, get_array_module
from npformer.checks import describe, expect_grad, expect_ndim, expect_same_float, probability, real
from npformer.dispatch import dispatched
from npformer.errors import ShapeError
from npformer.ops.dropout import DropoutCache, dropout_forward, keep_mask, keep_scaled
from npformer.ops.masks import attention_bias, causal_shift
from npformer.ops.softmax import SoftmaxCache, softmax_backward, softmax_forward

__all__ = ["AttentionCache", "check_attention_inputs", "scaled_dot_product_attention_forward",
           "scaled_dot_product_attention_backward"]


class AttentionCache(NamedTuple):
    """What the backward needs; P_drop is recomputed from P and the dropout mask, not stored."""

    q: Any                 # (B, H, Tq, hs)
    k: Any                 # (B, H, Tk, hs)
    v: Any                 # (B, H, Tk, hv)
    p: Any                 # (B, H, Tq, Tk) softmax probabilities, before dropout
    dropout: DropoutCache  # keep-mask (B, H, Tq, Tk) or its seed, and scale; the identity when none ran
    scale: float
    causal_shift: int | None = None   # is_causal: query i attends no key j > i + causal_shift (P is 0 there)


def check_attention_inputs(q, k, v, scale, dropout_p) -> float:
    """The input checks of every attention op; returns the scale (1/sqrt(hs) when ``scale`` is None)."""
    expect_same_float(q=q, k=k, v=v)
    for name, a in (("q", q), ("k", k), ("v", v)):
        expect_ndim(a, name, 4, "(B, H, T, head_size)")
    b, h, tq, hs = q.shape
    if k.shape[:2] != (b, h) or k.shape[3] != hs:
        raise ShapeError(f"k: expected shape (B, H, Tk, hs)=({b}, {h}, *, {hs}) to match q "
                         f"{tuple(q.shape)}, got {describe(k)}")
    if v.shape[:3] != k.shape[:3]:
        raise ShapeError(f"v: expected shape (B, H, Tk, hv)=({b}, {h}, {k.shape[2]}, *) to match k "
                         f"{tuple(k.shape)}, got {describe(v)}")
    if hs == 0 or k.shape[2] == 0:
        raise ShapeError(f"attention needs hs >= 1 and Tk >= 1, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    probability(dropout_p, "dropout_p")
    return 1.0 / math.sqrt(hs) if scale is None else real(scale, "scale")


@dispatched
def scaled_dot_product_attention_forward(q, k, v, *, attn_mask=None, key_padding_mask=None,
                                         is_causal: bool = False, causal_alignment: str = "top_left",
                                         dropout_p: float = 0.0, rng=None, training: bool = True,
                                         scale: float | None = None, need_weights: bool = False):
    """Returns ``(out, weights or None, cache)``: out (B, H, Tq, hv), weights (B, H, Tq, Tk).

    ``rng`` (a backend Generator, :func:`npformer.backend.default_rng`) is required when
    ``training`` and ``dropout_p > 0``; otherwise dropout is the identity. See the module docstring
    for the mask convention, fully masked rows and which weights are returned.
    """
    scale = check_attention_inputs(q, k, v, scale, dropout_p)
    xp = get_array_module(q, k, v)
    acc = accumulation_dtype(q.dtype)                    # float32 for 16-bit inputs (module docstring)
    bias = attention_bias(q.shape[:3] + k.shape[2:3], acc, attn_mask=attn_mask,
                          key_padding_mask=key_padding_mask, is_causal=is_causal,
                          causal_alignment=causal_alignment, xp=xp)   # broadcasts to (B, H, Tq, Tk)
    s = (q.astype(acc) * scale) @ k.astype(acc).swapaxes(-1, -2)   # (B, H, Tq, Tk), q scaled first
    if bias is not None:
        s = s + bias                                     # (B, H, Tq, Tk), -inf where blocked
    p = softmax_forward(s)[0].astype(q.dtype, copy=False)   # (B, H, Tq, Tk); an all -inf row -> 0
    if training and dropout_p > 0:
        p_drop, drop = dropout_forward(p, dropout_p, rng=rng, training=True)   # (B, H, Tq, Tk)
    else:
        p_drop, drop = p, DropoutCache.identity(p)
    out = (p_drop.astype(acc, copy=False) @ v.astype(acc, copy=False)).astype(q.dtype, copy=False)   # (B, H, Tq, hv)
    weights = None
    if need_weights:                                     # never the cached P itself: callers may write to it
        weights = p_drop if drop.dropped else p_drop.copy()           # (B, H, Tq, Tk)
    shift = causal_shift(q.shape[2], k.shape[2], causal_alignment) if is_causal else None
    return out, weights, AttentionCache(q, k, v, p, drop, scale, shift)


@dispatched
def scaled_dot_product_attention_backward(dout, cache: AttentionCache):
    """Returns ``(dq, dk, dv)`` for ``dout`` (B, H, Tq, hv)."""
    q, k, v, p, drop, scale, _ = cache
    expect_grad(dout, "dout", q.shape[:3] + v.shape[3:], q.dtype)
    acc = accumulation_dtype(q.dtype)                    # float32 for 16-bit inputs (module docstring)
    q, k, v, dout = [a.astype(acc, copy=False) for a in (q, k, v, dout)]
    keep = keep_mask(drop) if drop.dropped else None    # (B, H, Tq, Tk) m
    p_drop = p if keep is None else keep_scaled(p, keep, drop.scale)   # (B, H, Tq, Tk), the forward's
    p_drop, p = p_drop.astype(acc, copy=False), p.astype(acc, copy=False)
    # fwd: out = P_drop @ v  ->  dP_drop = dout @ v^T,  dv = P_drop^T @ dout
    dv = p_drop.swapaxes(-1, -2) @ dout                  # (B, H, Tk, hv)
    dp = dout @ v.swapaxes(-1, -2)                       # (B, H, Tq, Tk) dP_drop
    if keep is not None:                                 # fwd: P_drop = P * m / (1 - p)
        dp = dp * keep * drop.scale
    # fwd: P = softmax(S)  ->  dS = P * (dP - sum_k dP * P)   (0 at masked keys and fully masked rows)
    ds = softmax_backward(dp, SoftmaxCache(p))           # (B, H, Tq, Tk)
    # fwd: S = q @ k^T * scale + bias  ->  dq = dS @ k * scale,  dk = dS^T @ q * scale  (bias is constant)
    ds = ds * scale
    dq = ds @ k                                          # (B, H, Tq, hs)
    dk = ds.swapaxes(-1, -2) @ q                         # (B, H, Tk, hs)
    dtype = cache.q.dtype
    return dq.astype(dtype, copy=False), dk.astype(dtype, copy=False), dv.astype(dtype, copy=False)
