"""Scaled dot-product attention (Vaswani et al. 2017, sec. 3.2.1, eq. 1) with masks and dropout.

    S = q k^T * scale + bias        q: (B, H, Tq, hs), k: (B, H, Tk, hs), scale = 1/sqrt(hs) by default
    P = softmax(S)                  bias: 0 / -inf from bool masks, plus float masks (ops.masks)
    P_drop = dropout(P)             inverted dropout on the probabilities, in training only
    out = P_drop v                  v: (B, H, Tk, hv), out: (B, H, Tq, hv)

    dv = P_drop^T dout,  dP = dropout'(dout v^T),  dS = P * (dP - sum_k dP * P),
    dq = dS k * scale,   dk = dS^T q * scale

Masks follow ``torch.nn.MultiheadAttention`` (bool True = *may not attend*, float = added).
``torch.nn.functional.scaled_dot_product_attention`` uses the opposite bool convention (True = may
attend); npformer follows ``nn.MultiheadAttention`` everywhere.

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
from numbers import Real
from typing import Any, NamedTuple

from npformer.backend import accumulation_dtype, get_array_module
from npformer.backend.blocks import blockwise
from npformer.ops.checks import describe, expect_float, expect_ndim, expect_same_dtype
from npformer.ops.dropout import DropoutCache, dropout_forward
from npformer.ops.masks import attention_bias
from npformer.ops import fused
from npformer.ops.softmax import SoftmaxCache, softmax_grad_rows, softmax_rows

__all__ = ["AttentionCache", "scaled_dot_product_attention_forward",
           "scaled_dot_product_attention_backward"]


class AttentionCache(NamedTuple):
    """What the backward needs; P_drop is recomputed from P and the dropout mask, not stored."""

    q: Any                 # (B, H, Tq, hs)
    k: Any                 # (B, H, Tk, hs)
    v: Any                 # (B, H, Tk, hv)
    p: Any                 # (B, H, Tq, Tk) softmax probabilities, before dropout
    dropout: DropoutCache  # scaled keep-mask (B, H, Tq, Tk), or None inside when no dropout ran
    scale: float


def _check_inputs(q, k, v, scale, dropout_p):
    for name, a in (("q", q), ("k", k), ("v", v)):
        expect_float(a, name)
        expect_ndim(a, name, 4, "(B, H, T, head_size)")
    expect_same_dtype(q=q, k=k, v=v)
    b, h, tq, hs = q.shape
    if k.shape[:2] != (b, h) or k.shape[3] != hs:
        raise ValueError(f"k: expected shape (B, H, Tk, hs)=({b}, {h}, *, {hs}) to match q "
                         f"{tuple(q.shape)}, got {describe(k)}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v: expected shape (B, H, Tk, hv)=({b}, {h}, {k.shape[2]}, *) to match k "
                         f"{tuple(k.shape)}, got {describe(v)}")
    if hs == 0 or k.shape[2] == 0:
        raise ValueError(f"attention needs hs >= 1 and Tk >= 1, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, Real)
                              or not math.isfinite(scale)):
        raise TypeError(f"scale: expected a finite real number or None (1/sqrt(hs)), got {describe(scale)}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, Real) or not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p: expected a probability in [0, 1], got {describe(dropout_p)}")


def scaled_dot_product_attention_forward(q, k, v, *, attn_mask=None, key_padding_mask=None,
                                         is_causal: bool = False, causal_alignment: str = "top_left",
                                         dropout_p: float = 0.0, rng=None, training: bool = True,
                                         scale: float | None = None, need_weights: bool = False):
    """Returns ``(out, weights or None, cache)``: out (B, H, Tq, hv), weights (B, H, Tq, Tk).

    ``rng`` (a backend Generator, :func:`npformer.backend.default_rng`) is required when
    ``training`` and ``dropout_p > 0``; otherwise dropout is the identity. See the module docstring
    for the mask convention, fully masked rows and which weights are returned.
    """
    _check_inputs(q, k, v, scale, dropout_p)
    xp = get_array_module(q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    bias = attention_bias(q.shape[:3] + k.shape[2:3], q.dtype, attn_mask=attn_mask,
                          key_padding_mask=key_padding_mask, is_causal=is_causal,
                          causal_alignment=causal_alignment, xp=xp)   # broadcasts to (B, H, Tq, Tk)
    s = q @ k.swapaxes(-1, -2)                           # (B, H, Tq, Tk)
    s *= scale                                           # s is fresh: scaling in place mutates nothing
    if bias is not None:
        s += bias                                        # (B, H, Tq, Tk), -inf where blocked
    if fused.use_fused(s):                               # CuPy: one kernel per row (ops.fused)
        p, _ = fused.softmax_forward(s)                  # (B, H, Tq, Tk)
    else:
        p = _rows(softmax_rows, s, s)                    # (B, H, Tq, Tk) in s's buffer; all -inf row -> 0
    if training and dropout_p > 0:
        p_drop, drop = dropout_forward(p, dropout_p, rng=rng, training=True)   # (B, H, Tq, Tk)
    else:
        p_drop, drop = p, DropoutCache(None)
    out = p_drop @ v                                     # (B, H, Tq, hv)
    weights = None
    if need_weights:                                     # never the cached P itself: callers may write to it
        weights = p_drop.copy() if drop.scaled_mask is None else p_drop    # (B, H, Tq, Tk)
    return out, weights, AttentionCache(q, k, v, p, drop, scale)


def scaled_dot_product_attention_backward(dout, cache: AttentionCache):
    """Returns ``(dq, dk, dv)`` for ``dout`` (B, H, Tq, hv)."""
    q, k, v, p, drop, scale = cache
    p_drop = p if drop.scaled_mask is None else p * drop.scaled_mask           # (B, H, Tq, Tk), recomputed
    # fwd: out = P_drop @ v  ->  dP_drop = dout @ v^T,  dv = P_drop^T @ dout
    dv = p_drop.swapaxes(-1, -2) @ dout                  # (B, H, Tk, hv)
    dp = dout @ v.swapaxes(-1, -2)                       # (B, H, Tq, Tk), fresh: updated in place below
    if drop.scaled_mask is not None:
        # fwd: P_drop = P * m / (1 - p)  ->  dP = dP_drop * m / (1 - p)
        dp *= drop.scaled_mask
    # fwd: P = softmax(S)  ->  dS = P * (dP - sum_k dP * P)   (0 at masked keys and fully masked rows)
    if fused.use_fused(dp, p):
        ds = fused.softmax_backward(dp, SoftmaxCache(p))  # (B, H, Tq, Tk)
    else:
        ds = _rows(softmax_grad_rows, dp, p, dp)         # (B, H, Tq, Tk) in dp's buffer
    # fwd: S = q @ k^T * scale + bias  ->  dq = dS @ k * scale,  dk = dS^T @ q * scale  (bias is constant)
    ds *= scale
    dq = ds @ k                                          # (B, H, Tq, hs)
    dk = ds.swapaxes(-1, -2) @ q                         # (B, H, Tk, hs)
    return dq, dk, dv


def _rows(kernel, out, *arrays):
    """kernel(out, *arrays) over blocks of whole rows of (B, H, Tq, Tk) arrays (npformer.backend.blocks)."""
    if out.dtype != accumulation_dtype(out.dtype):       # 16-bit scores: the softmax runs in float32
        xp = get_array_module(out)
        wide = [a.astype(xp.float32) for a in arrays]
        out[...] = kernel(xp.empty_like(wide[0]), *wide)
        return out
    return blockwise(kernel, out, *arrays, row=out.shape[-1])
