"""Multi-head attention with PyTorch's packed input projection (Vaswani et al. 2017, sec. 3.2.2;
``torch.nn.functional.multi_head_attention_forward`` with ``batch_first=True``).

    Q = query W_q^T + b_q,  K = key W_k^T + b_k,  V = value W_v^T + b_v     W_in = [W_q; W_k; W_v] (3E, E)
    head_h = attention(Q_h, K_h, V_h)      E split into H heads of hs = E / H: (B, T, E) -> (B, H, T, hs)
    out = concat_h(head_h) W_o^T + b_o

Two ops, chosen by the caller (never by object identity, so equal arrays behave alike on every backend):

* :func:`multi_head_attention_forward` ``(query, key, value)``: each input projected by its slice of
  W_in; the backward returns a gradient for each of the three. A caller that passed one array as
  several inputs adds their gradients (the chain rule for a variable used three times).
* :func:`self_attention_forward` ``(x)``: query = key = value = x in one packed (B*T, E) @ (E, 3E)
  product; the backward returns ``dx``, the three paths summed in one (B*T, 3E) @ (3E, E) product.

Incremental decoding (a key/value cache): ``past_key``/``past_value`` (B, H, Tp, hs), the projected
keys and values of earlier positions, go before the new ones (Tk = Tp + Tnew); the cache returned
holds the whole key and value heads (``cache.attn.k``, ``cache.attn.v``) for the next step. The past
is a constant: the backward returns gradients for the new positions only. The general op may take
``key = value = None`` with a past (cross-attention over a memory projected on an earlier call).

Masks, fully masked rows (zero output and gradient) and the returned weights (after dropout, as
PyTorch) are those of :mod:`npformer.ops.attention`; the weights are averaged over heads to
(B, Tq, Tk) unless ``average_attn_weights=False`` gives (B, H, Tq, Tk). ``attention="flash"`` runs
:mod:`npformer.ops.flash_attention` (memory linear in T; no weights), ``"plain"``
:mod:`npformer.ops.attention`, ``"auto"`` the flash op on CuPy arrays when no weights are asked for
and the plain one otherwise (:func:`attend`, the one place that chooses).

Both ops check every input at their top, masks included, then run their parts (projections,
attention) inside :func:`npformer.checks.inputs_checked`, so no array is checked twice.
"""
from __future__ import annotations

from typing import Any, NamedTuple

from npformer.backend import accumulated_sum, get_array_module, is_cupy_array
from npformer.checks import describe, expect_ndim, expect_same_float, expect_shape, inputs_checked, positive_int
from npformer.dispatch import dispatched
from npformer.errors import RangeError, ShapeError
from npformer.ops.attention import scaled_dot_product_attention_backward, scaled_dot_product_attention_forward
from npformer.ops.flash_attention import (FlashAttentionCache, check_implementation, flash_attention_backward,
                                          flash_attention_forward)
from npformer.ops.linear import LinearCache, check_linear_grad, linear_backward, linear_forward
from npformer.ops.masks import check_masks

__all__ = ["split_heads", "merge_heads", "MultiHeadCache", "attend", "self_attention_forward",
           "self_attention_backward", "multi_head_attention_forward", "multi_head_attention_backward"]


def split_heads(x, num_heads: int):
    """(B, T, H * hs) -> (B, H, T, hs), a view."""
    b, t, e = x.shape
    return x.reshape(b, t, num_heads, e // num_heads).transpose(0, 2, 1, 3)      # (B, H, T, hs)


def merge_heads(x):
    """(B, H, T, hs) -> (B, T, H * hs): a view when the heads lie in memory as (B, T, H, hs) (the CUDA
    flash attention writes them so), one copy otherwise."""
    b, h, t, hs = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b, t, h * hs)                         # (B, T, E)


class MultiHeadCache(NamedTuple):
    """The projections' caches, the attention's cache and the output projection's cache."""

    projections: tuple     # LinearCache: (qkv,) for self-attention; (q, k, v) with None for a key/value not given
    attn: Any              # AttentionCache | FlashAttentionCache of the (B, H, T, hs) heads
    out_proj: LinearCache  # input: the merged heads (B, Tq, E)
    num_heads: int
    past: int              # Tp: key positions that came from past_key / past_value (no gradient)


def _check(query, key, value, num_heads, in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias,
           past_key, past_value, attn_mask, key_padding_mask, is_causal, causal_alignment, attention):
    expect_same_float(query=query, key=key, value=value, past_key=past_key, past_value=past_value,
                      in_proj_weight=in_proj_weight, in_proj_bias=in_proj_bias, out_proj_weight=out_proj_weight,
                      out_proj_bias=out_proj_bias)       # one float dtype, one backend
    expect_ndim(query, "query", 3, "(B, T, E), batch first")
    b, tq, e = query.shape
    h = positive_int(num_heads, "num_heads")
    if e % h:
        raise ShapeError(f"embed_dim {e} is not divisible by num_heads {h}")
    for name, a in (("key", key), ("value", value)):
        if a is None:
            continue
        expect_ndim(a, name, 3, "(B, T, E), batch first")
        if a.shape[0] != b or a.shape[2] != e:
            raise ShapeError(f"{name}: expected shape (B, Tk, E)=({b}, *, {e}) to match query "
                             f"{tuple(query.shape)}, got {describe(a)}")
    if (key is None) != (value is None) or (key is not None and value.shape != key.shape):
        raise ShapeError(f"value: expected the shape of key, got key {describe(key)} and value {describe(value)}")
    if (past_key is None) != (past_value is None):
        raise RangeError("past_key and past_value come together (both None, or both the earlier heads)")
    if key is None and past_key is None:
        raise RangeError("key and value may be None only with past_key/past_value (keys projected earlier)")
    for name, a in (("past_key", past_key), ("past_value", past_value)):
        if a is not None:
            expect_shape(a, name, (b, h, None, e // h), "(B, H, Tp, hs)")
    expect_shape(in_proj_weight, "in_proj_weight", (3 * e, e), "(3E, E) = [W_q; W_k; W_v]")
    expect_shape(out_proj_weight, "out_proj_weight", (e, e), "(E, E)")
    if in_proj_bias is not None:
        expect_shape(in_proj_bias, "in_proj_bias", (3 * e,), "(3E,)")
    if out_proj_bias is not None:
        expect_shape(out_proj_bias, "out_proj_bias", (e,), "(E,)")
    tk = (0 if key is None else key.shape[1]) + (0 if past_key is None else past_key.shape[2])
    check_masks((b, h, tq, tk), attn_mask, key_padding_mask, is_causal, causal_alignment, get_array_module(query))
    check_implementation(attention)


def _part(w, b, i, e):
    """The i-th (E, E) block of W_in and (E,) block of b_in (views); b None stays None."""
    return w[i * e:(i + 1) * e], None if b is None else b[i * e:(i + 1) * e]


def _heads(q, k, v, num_heads, past_key, past_value):
    """Split the (B, T, E) projections into heads and put the past keys and values before the new."""
    xp = get_array_module(q)
    qh = split_heads(q, num_heads)                                               # (B, H, Tq, hs)
    kh = None if k is None else split_heads(k, num_heads)                        # (B, H, Tnew, hs)
    vh = None if v is None else split_heads(v, num_heads)
    if past_key is not None and past_key.shape[2]:
        kh = past_key if kh is None else xp.concatenate([past_key, kh], axis=2)  # (B, H, Tp + Tnew, hs)
        vh = past_value if vh is None else xp.concatenate([past_value, vh], axis=2)
    return qh, kh, vh


def attend(qh, kh, vh, attention: str, need_weights: bool, **options):
    """``(heads, weights or None, cache)``: attention over the (B, H, T, hs) heads by the op
    ``attention`` names, "auto" resolved here (the module docstring); ``options`` are the masks and
    dropout arguments both attention ops take."""
    if attention == "auto":
        attention = "flash" if is_cupy_array(qh) and not need_weights else "plain"
    if attention == "flash":
        heads, cache = flash_attention_forward(qh, kh, vh, need_weights=need_weights, **options)
        return heads, None, cache
    return scaled_dot_product_attention_forward(qh, kh, vh, need_weights=need_weights, **options)


def _project_out(heads, weights, attn, projections, num_heads, past_key, out_proj_weight, out_proj_bias,
                 average_attn_weights):
    """Merge the heads, project out, average the weights over heads; returns the op's result."""
    out, out_cache = linear_forward(merge_heads(heads), out_proj_weight, out_proj_bias)   # (B, Tq, E)
    if weights is not None and average_attn_weights:
        weights = accumulated_sum(weights, axis=1) / weights.shape[1]            # (B, Tq, Tk) the mean
    past = 0 if past_key is None else past_key.shape[2]
    return out, weights, MultiHeadCache(projections, attn, out_cache, num_heads, past)


def _attention_backward(dout, cache: MultiHeadCache):
    """dq, dk, dv heads (B, H, T, hs) of the new positions, and the output projection's gradients."""
    check_linear_grad(dout, cache.out_proj)              # dout: the gradient of the output projection's output
    # fwd: out = merge(heads) @ W_o^T + b_o  ->  dmerged = dout @ W_o,  dW_o = dout^T merged,  db_o = sum dout
    dmerged, dw_out, db_out = linear_backward(dout, cache.out_proj)              # (B, Tq, E), (E, E), (E,)
    backward = flash_attention_backward if isinstance(cache.attn, FlashAttentionCache) else \
        scaled_dot_product_attention_backward
    # fwd: heads = attention(split(q), [past_k; split(k)], [past_v; split(v)])  ->  the past gets nothing
    dqh, dkh, dvh = backward(split_heads(dmerged, cache.num_heads), cache.attn)  # (B, H, T, hs) each
    p = cache.past
    return dqh, dkh[:, :, p:], dvh[:, :, p:], dw_out, db_out


def self_attention_forward(x, num_heads: int, in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias, *,
                           past_key=None, past_value=None, attn_mask=None, key_padding_mask=None,
                           is_causal: bool = False, causal_alignment: str = "top_left", dropout_p: float = 0.0,
                           rng=None, training: bool = True, need_weights: bool = True,
                           average_attn_weights: bool = True, attention: str = "plain"):
    """Self-attention over ``x`` (B, T, E); returns ``(out, weights or None, cache)`` as the general op.
    (Not dispatched: its parts are, and a fast path of the whole would stand in for no more than them.)"""
    _check(x, x, x, num_heads, in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias, past_key, past_value,
           attn_mask, key_padding_mask, is_causal, causal_alignment, attention)
    e = x.shape[2]
    with inputs_checked():
        qkv, proj = linear_forward(x, in_proj_weight, in_proj_bias)              # (B, T, 3E): one packed product
        q, k, v = qkv[..., :e], qkv[..., e:2 * e], qkv[..., 2 * e:]              # (B, T, E) views
        qh, kh, vh = _heads(q, k, v, num_heads, past_key, past_value)           # (B, H, T, hs)
        heads, weights, attn = attend(qh, kh, vh, attention, need_weights, attn_mask=attn_mask,
                                      key_padding_mask=key_padding_mask, is_causal=is_causal,
                                      causal_alignment=causal_alignment, dropout_p=dropout_p, rng=rng,
                                      training=training)
        return _project_out(heads, weights, attn, (proj,), num_heads, past_key, out_proj_weight, out_proj_bias,
                            average_attn_weights)


@dispatched
def self_attention_backward(dout, cache: MultiHeadCache):
    """Returns ``(dx, din_proj_weight, din_proj_bias, dout_proj_weight, dout_proj_bias)``; the bias
    gradients are None when the forward had no bias."""
    dqh, dkh, dvh, dw_out, db_out = _attention_backward(dout, cache)
    # fwd: [q | k | v] = x @ W_in^T + b_in  ->  dx = [dq | dk | dv] @ W_in,  dW_in = [dq | dk | dv]^T x
    xp = get_array_module(dout)
    dqkv = xp.concatenate([merge_heads(dqh), merge_heads(dkh), merge_heads(dvh)], axis=-1)   # (B, T, 3E)
    dx, dw_in, db_in = linear_backward(dqkv, cache.projections[0])               # (B, T, E), (3E, E), (3E,)
    return dx, dw_in, db_in, dw_out, db_out


def multi_head_attention_forward(query, key, value, num_heads: int, in_proj_weight, in_proj_bias,
                                 out_proj_weight, out_proj_bias, *, past_key=None, past_value=None,
                                 attn_mask=None, key_padding_mask=None, is_causal: bool = False,
                                 causal_alignment: str = "top_left", dropout_p: float = 0.0, rng=None,
                                 training: bool = True, need_weights: bool = True,
                                 average_attn_weights: bool = True, attention: str = "plain"):
    """Returns ``(out, weights or None, cache)``: out (B, Tq, E); weights (B, Tq, Tk) averaged over
    heads, or (B, H, Tq, Tk) with ``average_attn_weights=False``. Masks as in
    :func:`npformer.ops.masks.attention_bias` (a 3-d attn_mask is (B*H, Tq, Tk), as torch). Not dispatched,
    as :func:`self_attention_forward`."""
    _check(query, key, value, num_heads, in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias,
           past_key, past_value, attn_mask, key_padding_mask, is_causal, causal_alignment, attention)
    e = query.shape[2]
    with inputs_checked():
        q, proj_q = linear_forward(query, *_part(in_proj_weight, in_proj_bias, 0, e))      # (B, Tq, E)
        k = v = proj_k = proj_v = None
        if key is not None:
            k, proj_k = linear_forward(key, *_part(in_proj_weight, in_proj_bias, 1, e))    # (B, Tk, E)
            v, proj_v = linear_forward(value, *_part(in_proj_weight, in_proj_bias, 2, e))  # (B, Tk, E)
        qh, kh, vh = _heads(q, k, v, num_heads, past_key, past_value)           # (B, H, T, hs)
        heads, weights, attn = attend(qh, kh, vh, attention, need_weights, attn_mask=attn_mask,
                                      key_padding_mask=key_padding_mask, is_causal=is_causal,
                                      causal_alignment=causal_alignment, dropout_p=dropout_p, rng=rng,
                                      training=training)
        return _project_out(heads, weights, attn, (proj_q, proj_k, proj_v), num_heads, past_key, out_proj_weight,
                            out_proj_bias, average_attn_weights)


@dispatched
def multi_head_attention_backward(dout, cache: MultiHeadCache):
    """Returns ``(dquery, dkey, dvalue, din_proj_weight, din_proj_bias, dout_proj_weight, dout_proj_bias)``;
    ``dkey``/``dvalue`` are None when the forward took no key/value (the past alone), the bias
    gradients None when the forward had no bias."""
    dqh, dkh, dvh, dw_out, db_out = _attention_backward(dout, cache)
    xp = get_array_module(dout)
    grads, dws, dbs = [], [], []
    # fwd: q = query W_q^T + b_q, k = key W_k^T + b_k, v = value W_v^T + b_v  ->  each slice of W_in
    for d, proj in zip((dqh, dkh, dvh), cache.projections):
        if proj is None:                                 # no new keys/values: W_k, W_v got no gradient here
            e = dqh.shape[1] * dqh.shape[3]
            grads.append(None)
            dws.append(xp.zeros((e, e), dtype=dout.dtype))
            dbs.append(xp.zeros((e,), dtype=dout.dtype))
            continue
        dx, dw, db = linear_backward(merge_heads(d), proj)                       # (B, T, E), (E, E), (E,)
        grads.append(dx)
        dws.append(dw)
        dbs.append(db)
    dw_in = xp.concatenate(dws, axis=0)                                          # (3E, E)
    db_in = None if dbs[0] is None else xp.concatenate(dbs)                      # (3E,)
    return (*grads, dw_in, db_in, dw_out, db_out)
