"""Scaled dot-product attention for NumPy with the softmax and its backward run in the score buffer
itself (reference: :mod:`npformer.ops.attention`, the same signature, cache and results).

The reference allocates S, then P = softmax(S), then dP, then dS: four (B, H, Tq, Tk) arrays. Here
P overwrites S and dS overwrites dP, row block by row block (:mod:`npformer.kernels.cpu.blocks`),
which halves the largest temporaries of a training step's attention. 16-bit scores are widened to
float32 for the softmax, as the reference does.
"""
from __future__ import annotations

import numpy

from npformer.backend import accumulation_dtype
from npformer.checks import expect_grad
from npformer.kernels.cpu.blocks import blockwise
from npformer.kernels.cpu.softmax import softmax_grad_rows, softmax_rows
from npformer.ops.attention import AttentionCache, check_attention_inputs
from npformer.ops.dropout import DropoutCache, dropout_forward
from npformer.ops.masks import attention_bias

__all__ = ["scaled_dot_product_attention_forward", "scaled_dot_product_attention_backward"]


def _in_rows(kernel, out, *arrays):
    """kernel(out, *arrays) over blocks of whole rows of (B, H, Tq, Tk) arrays; ``out`` may be an input."""
    if out.dtype != accumulation_dtype(out.dtype):       # 16-bit scores: the softmax runs in float32
        wide = [a.astype(numpy.float32) for a in arrays]
        out[...] = kernel(numpy.empty_like(wide[0]), *wide)
        return out
    return blockwise(kernel, out, *arrays, row=out.shape[-1])


def scaled_dot_product_attention_forward(q, k, v, *, attn_mask=None, key_padding_mask=None,
                                         is_causal: bool = False, causal_alignment: str = "top_left",
                                         dropout_p: float = 0.0, rng=None, training: bool = True,
                                         scale: float | None = None, need_weights: bool = False):
    scale = check_attention_inputs(q, k, v, scale, dropout_p)
    bias = attention_bias(q.shape[:3] + k.shape[2:3], q.dtype, attn_mask=attn_mask,
                          key_padding_mask=key_padding_mask, is_causal=is_causal,
                          causal_alignment=causal_alignment, xp=numpy)   # broadcasts to (B, H, Tq, Tk)
    s = (q * scale) @ k.swapaxes(-1, -2)                 # (B, H, Tq, Tk); scaled first, as the reference
    if bias is not None:
        s += bias                                        # -inf where blocked
    p = _in_rows(softmax_rows, s, s)                     # (B, H, Tq, Tk) P in s's buffer; all -inf row -> 0
    if training and dropout_p > 0:
        p_drop, drop = dropout_forward(p, dropout_p, rng=rng, training=True)   # (B, H, Tq, Tk)
    else:
        p_drop, drop = p, DropoutCache(None, p.shape, p.dtype)
    out = p_drop @ v                                     # (B, H, Tq, hv)
    weights = None
    if need_weights:                                     # never the cached P itself: callers may write to it
        weights = p_drop.copy() if drop.scaled_mask is None else p_drop    # (B, H, Tq, Tk)
    return out, weights, AttentionCache(q, k, v, p, drop, scale)


def scaled_dot_product_attention_backward(dout, cache):
    q, k, v, p, drop, scale = cache
    expect_grad(dout, "dout", q.shape[:3] + v.shape[3:], q.dtype)
    p_drop = p if drop.scaled_mask is None else p * drop.scaled_mask           # (B, H, Tq, Tk), recomputed
    # fwd: out = P_drop @ v  ->  dP_drop = dout @ v^T,  dv = P_drop^T @ dout
    dv = p_drop.swapaxes(-1, -2) @ dout                  # (B, H, Tk, hv)
    dp = dout @ v.swapaxes(-1, -2)                       # (B, H, Tq, Tk), fresh: updated in place below
    if drop.scaled_mask is not None:
        dp *= drop.scaled_mask                           # fwd: P_drop = P * m / (1 - p)
    # fwd: P = softmax(S)  ->  dS = P * (dP - sum_k dP * P), in dp's buffer
    ds = _in_rows(softmax_grad_rows, dp, p, dp)          # (B, H, Tq, Tk)
    # fwd: S = q @ k^T * scale + bias  ->  dq = dS @ k * scale,  dk = dS^T @ q * scale
    ds *= scale
    dq = ds @ k                                          # (B, H, Tq, hs)
    dk = ds.swapaxes(-1, -2) @ q                         # (B, H, Tk, hs)
    return dq, dk, dv
