"""Scaled dot-product attention for NumPy with compiled row operations (reference:
:mod:`npformer.ops.attention`): the NumPy fast path's blocks, threads and dropout stream
(:mod:`npformer.kernels.cpu.attention`), each block's softmax and softmax backward one compiled loop
over its rows (:mod:`~npformer.kernels.numba_cpu.softmax`) instead of a chain of NumPy passes, and
its dropout product one loop too (:mod:`~npformer.kernels.numba_cpu.dropout`).
"""
from __future__ import annotations

from npformer.kernels.cpu.attention import RowKernels, attention_backward, attention_forward
from npformer.kernels.numba_cpu.dropout import apply_keep
from npformer.kernels.numba_cpu.softmax import softmax_grad_rows_in_place, softmax_rows_in_place

__all__ = ["scaled_dot_product_attention_forward", "scaled_dot_product_attention_backward"]


def _softmax(s):
    """P = softmax(S) in the contiguous block S's buffer."""
    rows = s.reshape(-1, s.shape[-1])                    # (b' h' r, Tk) view
    softmax_rows_in_place(rows, 0, rows.shape[0])
    return s


def _softmax_grad(dp, p):
    """dS = P * (dP - rowsum(dP * P)) in dP's buffer."""
    rows, p_rows = dp.reshape(-1, dp.shape[-1]), p.reshape(-1, p.shape[-1])
    softmax_grad_rows_in_place(rows, p_rows, 0, rows.shape[0])
    return dp


COMPILED_ROWS = RowKernels(_softmax, _softmax_grad, apply_keep)


def scaled_dot_product_attention_forward(q, k, v, *, attn_mask=None, key_padding_mask=None,
                                         is_causal: bool = False, causal_alignment: str = "top_left",
                                         dropout_p: float = 0.0, rng=None, training: bool = True,
                                         scale: float | None = None, need_weights: bool = False):
    return attention_forward(COMPILED_ROWS, q, k, v, attn_mask, key_padding_mask, is_causal, causal_alignment,
                             dropout_p, rng, training, scale, need_weights)


def scaled_dot_product_attention_backward(dout, cache):
    return attention_backward(COMPILED_ROWS, dout, cache)
