"""Attention masks: the causal mask in two alignments, and the merge of every mask into one additive
bias of the scores (Vaswani et al. 2017, sec. 3.2.3: "masking out (setting to -inf) ... illegal
connections").

Convention, as ``torch.nn.MultiheadAttention`` and everywhere in npformer: in a bool mask ``True``
means *may not attend*; a float mask is added to the scores as it is. Blocked entries become
``-inf`` in the bias, never a large finite number such as -1e9 (float16 tops out at 65504, so that
is already -inf there, and in float32 a finite stand-in leaks probability into fully masked rows).
(``torch.nn.functional.scaled_dot_product_attention`` uses the opposite bool convention, True =
may attend; npformer does not follow it.)

Causal alignment, x = may not attend::

    top_left (PyTorch's is_causal)          bottom_right (key/value cache: the Tq queries are
    query i sees keys j <= i                the last Tq of the Tk positions) j <= i + (Tk - Tq)

    Tq=2, Tk=4   k0 k1 k2 k3                Tq=2, Tk=4   k0 k1 k2 k3
            q0    .  x  x  x                        q0    .  .  .  x
            q1    .  .  x  x                        q1    .  .  .  .

    Tq=3, Tk=2   k0 k1                      Tq=3, Tk=2   k0 k1
            q0    .  x                              q0    x  x      <- sees nothing: its output
            q1    .  .                              q1    .  x         is zero (see ops.attention)
            q2    .  .                              q2    .  .

With Tq == Tk the two alignments are the same lower-triangular mask.
"""
from __future__ import annotations

from numbers import Integral

from npformer.backend import get_array_module, get_backend, is_float_dtype, resolve_dtype
from npformer.checks import describe, expect_bool_or_float, non_negative_int, one_of
from npformer.errors import BackendMismatchError, InputTypeError, ShapeError

__all__ = ["ALIGNMENTS", "causal_shift", "causal_mask", "check_masks", "mask_bias", "attention_bias"]

ALIGNMENTS = ("top_left", "bottom_right")


def _check_alignment(alignment) -> None:
    one_of(alignment, "causal alignment", ALIGNMENTS)


def causal_shift(tq: int, tk: int, alignment: str) -> int:
    """The causal mask's shift: query i may attend keys j <= i + shift (0 top-left, Tk - Tq bottom-right)."""
    return 0 if alignment == "top_left" else tk - tq


def causal_mask(tq: int, tk: int, *, alignment: str = "top_left", xp="numpy"):
    """Bool (Tq, Tk), True = may not attend: key j lies in query i's future.

    ``alignment="top_left"``: query i may attend keys j <= i. ``"bottom_right"``: query i is
    position i + (Tk - Tq), so it may attend j <= i + (Tk - Tq). ``xp``: the backend of the mask
    ("numpy", "cupy" or the module), NumPy unless told.
    """
    non_negative_int(tq, "tq")
    non_negative_int(tk, "tk")
    _check_alignment(alignment)
    xp = get_backend(xp)
    return xp.arange(tk)[None, :] > xp.arange(tq)[:, None] + causal_shift(tq, tk, alignment)   # (Tq, Tk)


def mask_bias(mask, dtype, xp):
    """Bool: True -> -inf, False -> 0. Float: cast to the scores' dtype (values kept)."""
    if mask.dtype.kind == "b":
        return xp.where(mask, -xp.inf, 0.0).astype(dtype)                       # (mask's shape)
    return mask.astype(dtype)                                                    # (mask's shape), a copy


def check_masks(scores_shape, attn_mask, key_padding_mask, is_causal, causal_alignment, xp):
    """Check the masks for scores (B, H, Tq, Tk) of backend ``xp`` (types, backends, shapes), and
    return ``attn_mask`` as (Tq, Tk) or (B, H, Tq, Tk) (a (B*H, Tq, Tk) mask reshaped), or None."""
    b, h, tq, tk = scores_shape
    if not isinstance(is_causal, bool):
        raise InputTypeError(f"is_causal: expected a bool, got {describe(is_causal)}")
    _check_alignment(causal_alignment)
    for name, m in (("attn_mask", attn_mask), ("key_padding_mask", key_padding_mask)):
        if m is not None:
            expect_bool_or_float(m, name)
            if get_array_module(m) is not xp:
                raise BackendMismatchError(f"{name}: expected a {xp.__name__} array like the scores, got {describe(m)}")
    if key_padding_mask is not None and tuple(key_padding_mask.shape) != (b, tk):
        raise ShapeError(f"key_padding_mask: expected shape (B, Tk)=({b}, {tk}) with True = padding, "
                         f"got {describe(key_padding_mask)}")
    if attn_mask is None or tuple(attn_mask.shape) in ((tq, tk), (b, h, tq, tk)):
        return attn_mask
    if tuple(attn_mask.shape) == (b * h, tq, tk):
        return attn_mask.reshape(b, h, tq, tk)                                    # (B, H, Tq, Tk)
    raise ShapeError(f"attn_mask: expected shape (Tq, Tk)=({tq}, {tk}) or (B*H, Tq, Tk)="
                     f"({b * h}, {tq}, {tk}) or (B, H, Tq, Tk)=({b}, {h}, {tq}, {tk}), "
                     f"got {describe(attn_mask)}")


def attention_bias(scores_shape, dtype, *, attn_mask=None, key_padding_mask=None,
                   is_causal: bool = False, causal_alignment: str = "top_left", xp):
    """One additive bias for scores of ``scores_shape`` = (B, H, Tq, Tk), or None with no mask.

    The bias is 4-d and broadcasts against the scores ((1, 1, Tq, Tk), (B, 1, 1, Tk) or
    (B, H, Tq, Tk) ...); it holds 0 where attention is allowed, -inf where a bool mask blocks, and
    the sum of the float masks given. It is always a fresh array of ``dtype``.

    ``attn_mask``: (Tq, Tk), (B*H, Tq, Tk) (row b*H + h, as torch) or (B, H, Tq, Tk); bool
    (True = may not attend) or float (added). ``key_padding_mask``: (B, Tk); bool (True =
    padding) or float (added). ``is_causal`` adds :func:`causal_mask` in ``causal_alignment`` to
    whatever masks are given (PyTorch's MultiheadAttention only takes it as a hint that attn_mask
    is causal). Float masks are cast to ``dtype``.
    """
    shape = tuple(scores_shape)
    if len(shape) != 4 or not all(isinstance(n, Integral) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise ShapeError(f"scores_shape: expected 4 lengths (B, H, Tq, Tk), got {scores_shape!r}")
    b, h, tq, tk = map(int, shape)
    xp = get_backend(xp)
    if not is_float_dtype(resolve_dtype(xp, dtype)):
        raise InputTypeError(f"dtype: expected the scores' floating dtype, got {dtype!r}")
    attn_mask = check_masks((b, h, tq, tk), attn_mask, key_padding_mask, is_causal, causal_alignment, xp)

    terms = []
    if attn_mask is not None:
        terms.append(mask_bias(attn_mask, dtype, xp))                              # (Tq, Tk) | (B, H, Tq, Tk)
    if key_padding_mask is not None:
        terms.append(mask_bias(key_padding_mask, dtype, xp)[:, None, None, :])     # (B, 1, 1, Tk)
    if is_causal:
        terms.append(mask_bias(causal_mask(tq, tk, alignment=causal_alignment, xp=xp), dtype, xp))  # (Tq, Tk)
    if not terms:
        return None
    bias = terms[0].reshape((1,) * (4 - terms[0].ndim) + terms[0].shape)          # (.., .., Tq|1, Tk)
    for t in terms[1:]:
        bias = bias + t                                                           # broadcast to (.., .., Tq|1, Tk)
    return bias
