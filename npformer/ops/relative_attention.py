"""Relative multi-head attention of Transformer-XL (Dai et al. 2019, sec. 3.3), over a memory.

The keys and values cover [memory; segment]: Tk = M + Tq positions, the M memory positions first. The
query i of the segment sits at position M + i, the key j at position j, their distance is M + i - j.
Per head (the head index is left out):

    score[i, j] = (q_i + u)^T k_j  +  (q_i + v)^T W_r R_{M+i-j}        terms (a)+(c), (b)+(d) of sec. 3.3
    S = score * scale + bias,  P = softmax(S),  out = dropout(P) @ values

R holds fixed encodings of the distances; ``r`` passes them as rows for Tk-1, Tk-2, ..., 0 (row m is
R_{Tk-1-m}), so BD_raw = (q + v) (r W_r^T)^T has BD_raw[i, m] = (q_i + v)^T W_r R_{Tk-1-m}, and
:func:`rel_shift_forward` moves each row so that column j holds distance M + i - j. u and v are the
two learned biases (one per head), W_r (H * hs, C) projects the encodings to every head.

The attention is causal by construction: distances are never negative, so a query may attend the
memory and the segment's keys up to itself (the bottom-right causal mask of ``ops.masks``); the
shifted entries beyond that are other rows' values, always masked. ``attn_mask`` and
``key_padding_mask`` block more keys (bool True = may not attend, -inf; float masks are added), and
a query whose every key is blocked gets zero output and passes zero gradient, as in ``ops.attention``.

Backward (dS = softmax backward of dP, as in ``ops.attention``):

    dAC = dBD = dS * scale,    dBD_raw = rel_shift_backward(dBD)
    dq = dAC k + dBD_raw rk,   du = sum_{B, Tq} dAC k,   d(bias v) = sum_{B, Tq} dBD_raw rk
    dk = dAC^T (q + u),   dvalues = dropout(P)^T dout,   drk = sum_B dBD_raw^T (q + v)
    dW_r = drk^T r,   dr = drk W_r                                          (rk = r W_r^T per head)

16-bit inputs are computed in float32, as in ``ops.attention``: the scores (a float16 score beyond
65,504 would be inf and the softmax NaN), the softmax and each product, forward and backward; they are
rounded to the inputs' dtype where they are kept or returned: rk (the projection r W_r^T, as a linear
layer's output), P (the cache), the output and the gradients. So float16 relative attention is finite
wherever the float32 result is, and within float16 rounding of it.
"""
from __future__ import annotations

from typing import Any, NamedTuple

from npformer.backend import accumulation_dtype, get_array_module, matmul
from npformer.checks import describe, expect_float, expect_grad, expect_ndim, expect_same_dtype, expect_shape
from npformer.dispatch import dispatched
from npformer.errors import ShapeError
from npformer.ops.attention import check_attention_inputs
from npformer.ops.dropout import DropoutCache, dropout_forward, keep_mask, keep_scaled
from npformer.ops.masks import attention_bias
from npformer.ops.softmax import SoftmaxCache, softmax_backward, softmax_forward

__all__ = ["RelShiftCache", "rel_shift_forward", "rel_shift_backward", "RelativeAttentionCache",
           "relative_attention_forward", "relative_attention_backward"]


class RelShiftCache(NamedTuple):
    """Only the input's shape and dtype: the shift is a fixed rearrangement."""

    x_shape: tuple          # (..., Tq, Tk)
    x_dtype: Any


@dispatched
def rel_shift_forward(x):
    """out[..., i, j] = x[..., i, j + Tq - 1 - i] for j <= i + Tk - Tq (the rest: other rows' entries).

    The trick of the paper's code: pad one zero column in front, read the (Tq, Tk + 1) block as
    (Tk + 1, Tq), drop its first row and read the rest as (Tq, Tk). Needs Tk >= Tq.
    """
    expect_float(x, "x")
    if x.ndim < 2 or x.shape[-1] < x.shape[-2]:
        raise ShapeError(f"x: expected (..., Tq, Tk) with Tk >= Tq (keys = memory + segment), got {describe(x)}")
    xp = get_array_module(x)
    *lead, tq, tk = x.shape
    padded = xp.concatenate([xp.zeros((*lead, tq, 1), dtype=x.dtype), x], axis=-1)   # (..., Tq, Tk+1)
    flat = padded.reshape(*lead, tq * (tk + 1))                                     # (..., Tq*(Tk+1))
    return flat[..., tq:].reshape(*lead, tq, tk), RelShiftCache(tuple(x.shape), x.dtype)   # (..., Tq, Tk)


@dispatched
def rel_shift_backward(dout, cache: RelShiftCache):
    """The same rearrangement run backwards: every output entry is one input entry (or the zero pad)."""
    expect_grad(dout, "dout", cache.x_shape, cache.x_dtype)
    xp = get_array_module(dout)
    *lead, tq, tk = cache.x_shape
    # fwd: out = flat[Tq:] of [0 | x]  ->  dflat = [0 (dropped head) | dout],  dx = dpadded[:, 1:]
    dflat = xp.zeros((*lead, tq * (tk + 1)), dtype=dout.dtype)                      # (..., Tq*(Tk+1))
    dflat[..., tq:] = dout.reshape(*lead, tq * tk)
    return dflat.reshape(*lead, tq, tk + 1)[..., 1:]                                 # (..., Tq, Tk)


class RelativeAttentionCache(NamedTuple):
    """What the backward needs; q + u and q + v are recomputed from q, and P_drop from P and the mask."""

    q: Any                 # (B, H, Tq, hs)
    k: Any                 # (B, H, Tk, hs)
    v: Any                 # (B, H, Tk, hv)
    r: Any                 # (Tk, C) encodings of distances Tk-1 .. 0
    r_weight: Any          # (H*hs, C)
    rk: Any                # (H, Tk, hs) the projected encodings, r W_r^T split into heads
    bias_u: Any            # (H, hs)
    bias_v: Any            # (H, hs)
    p: Any                 # (B, H, Tq, Tk) softmax probabilities, before dropout
    dropout: DropoutCache  # keep-mask (B, H, Tq, Tk) or its seed, and scale; the identity when none ran
    shift: RelShiftCache
    scale: float


def _check(q, k, v, r, r_weight, bias_u, bias_v, scale, dropout_p) -> float:
    """The attention op's checks (returning the scale), then the relative terms' and the memory's."""
    scale = check_attention_inputs(q, k, v, scale, dropout_p)
    b, h, tq, hs = q.shape
    tk = k.shape[2]
    if tq == 0 or tk < tq:
        raise ShapeError(f"relative attention needs Tq >= 1 and Tk = M + Tq >= Tq (memory first), "
                         f"got q {tuple(q.shape)} and k {tuple(k.shape)}")
    expect_float(r, "r")
    expect_ndim(r, "r", 2, "(Tk, C): encodings of distances Tk-1 .. 0")
    if r.shape[0] != tk:
        raise ShapeError(f"r: expected one row per key, shape (Tk, C)=({tk}, *), got {describe(r)}")
    expect_shape(r_weight, "r_weight", (h * hs, r.shape[1]), "(H*hs, C)")
    expect_shape(bias_u, "bias_u", (h, hs), "(H, hs)")
    expect_shape(bias_v, "bias_v", (h, hs), "(H, hs)")
    expect_same_dtype(q=q, r=r, r_weight=r_weight, bias_u=bias_u, bias_v=bias_v)
    get_array_module(q, r, r_weight, bias_u, bias_v)
    return scale


@dispatched
def relative_attention_forward(q, k, v, r, r_weight, bias_u, bias_v, *, attn_mask=None,
                               key_padding_mask=None, dropout_p: float = 0.0, rng=None,
                               training: bool = True, scale: float | None = None):
    """Returns ``(out, cache)``: out (B, H, Tq, hv). Masks (Tq, Tk)/(B, H, Tq, Tk) and (B, Tk) as
    :func:`npformer.ops.masks.attention_bias`, on top of the causal mask over memory + segment."""
    scale = _check(q, k, v, r, r_weight, bias_u, bias_v, scale, dropout_p)
    xp = get_array_module(q, k, v)
    b, h, tq, hs = q.shape
    tk = k.shape[2]
    acc = accumulation_dtype(q.dtype)                    # float32 for 16-bit inputs (module docstring)
    bias = attention_bias((b, h, tq, tk), acc, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                          is_causal=True, causal_alignment="bottom_right", xp=xp)   # (.., .., Tq, Tk)
    rk = matmul(r, r_weight.T).reshape(tk, h, hs).transpose(1, 0, 2)                # (H, Tk, hs), in q's dtype
    qa, ka, rka = (a.astype(acc, copy=False) for a in (q, k, rk))
    # the queries are scaled before the products (a float16 q k^T may overflow where the scaled one fits)
    qu = (qa + bias_u.astype(acc, copy=False)[:, None, :]) * scale                  # (B, H, Tq, hs) (q + u) * scale
    qv = (qa + bias_v.astype(acc, copy=False)[:, None, :]) * scale                  # (B, H, Tq, hs) (q + v) * scale
    ac = qu @ ka.swapaxes(-1, -2)                                                   # (B, H, Tq, Tk) AC * scale
    bd_raw = qv @ rka.swapaxes(-1, -2)                                              # (B, H, Tq, Tk) BD_raw * scale
    bd, shift = rel_shift_forward(bd_raw)                                           # (B, H, Tq, Tk)
    s = ac + bd                                                                     # (B, H, Tq, Tk)
    s += bias                                                                       # -inf where blocked
    p = softmax_forward(s)[0].astype(q.dtype, copy=False)                           # (B, H, Tq, Tk)
    if training and dropout_p > 0:
        p_drop, drop = dropout_forward(p, dropout_p, rng=rng, training=True)        # (B, H, Tq, Tk)
    else:
        p_drop, drop = p, DropoutCache.identity(p)
    out = (p_drop.astype(acc, copy=False) @ v.astype(acc, copy=False)).astype(q.dtype, copy=False)   # (B, H, Tq, hv)
    return out, RelativeAttentionCache(q, k, v, r, r_weight, rk, bias_u, bias_v, p, drop, shift, scale)


@dispatched
def relative_attention_backward(dout, cache: RelativeAttentionCache):
    """Returns ``(dq, dk, dv, dr, dr_weight, dbias_u, dbias_v)`` for ``dout`` (B, H, Tq, hv)."""
    q, k, v, r, r_weight, rk, bias_u, bias_v, p, drop, shift, scale = cache
    expect_grad(dout, "dout", q.shape[:3] + v.shape[3:], q.dtype)
    h, tk, hs = rk.shape
    dtype, acc = q.dtype, accumulation_dtype(q.dtype)    # float32 for 16-bit inputs (module docstring)
    keep = keep_mask(drop) if drop.dropped else None                                # (B, H, Tq, Tk) m
    p_drop = p if keep is None else keep_scaled(p, keep, drop.scale)               # (B, H, Tq, Tk), the forward's
    p_drop, p = p_drop.astype(acc, copy=False), p.astype(acc, copy=False)
    q, k, v, dout, rk = (a.astype(acc, copy=False) for a in (q, k, v, dout, rk))
    # fwd: out = P_drop @ values  ->  dP_drop = dout @ values^T,  dvalues = P_drop^T @ dout
    dv = p_drop.swapaxes(-1, -2) @ dout                                             # (B, H, Tk, hv)
    dp = dout @ v.swapaxes(-1, -2)                                                  # (B, H, Tq, Tk) dP_drop
    if keep is not None:                                                            # fwd: P_drop = P * m / (1 - p)
        dp = keep_scaled(dp, keep, drop.scale)                                      # (B, H, Tq, Tk)
    # fwd: P = softmax(S)  (0 at blocked keys and fully masked rows)
    ds = softmax_backward(dp, SoftmaxCache(p))                                      # (B, H, Tq, Tk)
    # fwd: S = (AC + BD) * scale + bias  ->  dAC = dBD = dS * scale
    ds *= acc.type(scale)                                                           # ds is fresh
    # fwd: BD = rel_shift(BD_raw)
    dbd_raw = rel_shift_backward(ds, shift)                                         # (B, H, Tq, Tk)
    # fwd: AC = (q + u) @ k^T  ->  d(q + u) = dAC @ k,  dk = dAC^T @ (q + u)
    dqu = ds @ k                                                                    # (B, H, Tq, hs)
    dk = ds.swapaxes(-1, -2) @ (q + bias_u.astype(acc, copy=False)[:, None, :])    # (B, H, Tk, hs)
    # fwd: BD_raw = (q + v) @ rk^T  ->  d(q + v) = dBD_raw @ rk,  drk = sum_B dBD_raw^T @ (q + v)
    dqv = dbd_raw @ rk                                                              # (B, H, Tq, hs)
    drk = (dbd_raw.swapaxes(-1, -2) @ (q + bias_v.astype(acc, copy=False)[:, None, :])).sum(axis=0)   # (H, Tk, hs)
    # fwd: q + u, q + v (u, v broadcast over B and Tq)  ->  dq = both,  du, dv summed over B and Tq
    dq = dqu + dqv                                                                  # (B, H, Tq, hs)
    dbias_u = dqu.sum(axis=(0, 2))                                                  # (H, hs)
    dbias_v = dqv.sum(axis=(0, 2))                                                  # (H, hs)
    # fwd: rk = split_heads(r @ W_r^T)  ->  dr = drk2 @ W_r,  dW_r = drk2^T @ r
    drk2 = drk.transpose(1, 0, 2).reshape(tk, h * hs)                               # (Tk, H*hs)
    dr = drk2 @ r_weight.astype(acc, copy=False)                                    # (Tk, C)
    dr_weight = drk2.T @ r.astype(acc, copy=False)                                  # (H*hs, C)
    return tuple(g.astype(dtype, copy=False) for g in (dq, dk, dv, dr, dr_weight, dbias_u, dbias_v))
