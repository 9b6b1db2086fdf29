"""Attention masks: causal masks in both alignments, and the merge of every mask kind into one
additive bias of 0 / -inf.

Convention (``torch.nn.MultiheadAttention``'s, used everywhere in npformer): in a bool mask,
``True`` means *may not attend*. A float mask is added to the scores as it is.
(``torch.nn.functional.scaled_dot_product_attention`` uses the opposite bool convention, True =
may attend; npformer does not follow it.)

Causal alignment when Tq != Tk (x = blocked), for Tq = 2, Tk = 4::

    top_left (PyTorch's is_causal)      bottom_right (key/value cache: queries are the last positions)
        k0 k1 k2 k3                         k0 k1 k2 k3
    q0   .  x  x  x                     q0   .  .  .  x
    q1   .  .  x  x                     q1   .  .  .  .

top_left: query i sees keys j <= i.  bottom_right: query i sees keys j <= i + (Tk - Tq).
"""
from __future__ import annotations

from npformer.backend import get_backend
from npformer.ops.checks import describe, expect_bool_or_float

__all__ = ["causal_mask", "attention_bias", "ALIGNMENTS"]

ALIGNMENTS = ("top_left", "bottom_right")


def causal_mask(tq: int, tk: int, *, alignment: str = "top_left", xp=None):
    """Bool (Tq, Tk), True = may not attend (a key in the query's future)."""
    if alignment not in ALIGNMENTS:
        raise ValueError(f"causal alignment must be one of {ALIGNMENTS}, got {alignment!r}")
    xp = xp or get_backend()
    shift = 0 if alignment == "top_left" else tk - tq
    return xp.arange(tk)[None, :] > xp.arange(tq)[:, None] + shift                  # (Tq, Tk)


def _as_bias(mask, dtype, xp):
    if mask.dtype.kind == "b":
        return xp.where(mask, -xp.inf, 0.0).astype(dtype)
    return mask.astype(dtype, copy=False)


def attention_bias(b: int, h: int, tq: int, tk: int, dtype, *, attn_mask=None, key_padding_mask=None,
                   is_causal: bool = False, causal_alignment: str = "top_left", xp=None):
    """One additive bias broadcastable to the scores (B, H, Tq, Tk), or None when nothing is masked.

    ``attn_mask``: (Tq, Tk), (B*H, Tq, Tk) or (B, H, Tq, Tk), bool or float.
    ``key_padding_mask``: (B, Tk), bool (True = padding) or float (added).
    """
    xp = xp or get_backend()
    bias = None
    if attn_mask is not None:
        expect_bool_or_float(attn_mask, "attn_mask")
        shape = tuple(attn_mask.shape)
        if shape == (tq, tk):
            m = attn_mask
        elif shape == (b * h, tq, tk):
            m = attn_mask.reshape(b, h, tq, tk)
        elif shape == (b, h, tq, tk):
            m = attn_mask
        else:
            raise ValueError(f"attn_mask: expected shape (Tq, Tk)=({tq}, {tk}), (B*H, Tq, Tk)="
                             f"({b * h}, {tq}, {tk}) or (B, H, Tq, Tk)=({b}, {h}, {tq}, {tk}), "
                             f"got {describe(attn_mask)}")
        bias = _as_bias(m, dtype, xp)
    if key_padding_mask is not None:
        expect_bool_or_float(key_padding_mask, "key_padding_mask")
        if tuple(key_padding_mask.shape) != (b, tk):
            raise ValueError(f"key_padding_mask: expected shape (B, Tk)=({b}, {tk}), True = padding, "
                             f"got {describe(key_padding_mask)}")
        pad = _as_bias(key_padding_mask, dtype, xp)[:, None, None, :]               # (B, 1, 1, Tk)
        bias = pad if bias is None else bias + pad
    if is_causal:
        causal = _as_bias(causal_mask(tq, tk, alignment=causal_alignment, xp=xp), dtype, xp)   # (Tq, Tk)
        bias = causal if bias is None else bias + causal
    return bias
