"""Scaled dot-product attention for NumPy with compiled row operations (reference:
:mod:`npformer.ops.attention`): the NumPy fast path's blocks, threads and dropout stream
(:mod:`npformer.kernels.cpu.attention`), each block's softmax and softmax backward one compiled loop
over its rows (:mod:`~npformer.kernels.numba_cpu.softmax`) instead of a chain of NumPy passes, and
its dropout mask and product compiled too (:mod:`~npformer.kernels.numba_cpu.dropout`). Self-attention's
backward writes the heads' gradients into its packed gradient as on the NumPy path.
"""
from __future__ import annotations

import numpy

from npformer.kernels.cpu.attention import (RowKernels, attention_backward, attention_forward,
                                            self_attention_backward_with)
from npformer.kernels.multihead import packed_cache
from npformer.kernels.numba_cpu import numba_floats
from npformer.kernels.numba_cpu.dropout import CompiledKeepMask, apply_keep
from npformer.kernels.numba_cpu.softmax import softmax_grad_rows_in_place, softmax_rows_in_place
from npformer.ops.attention import AttentionCache

__all__ = ["scaled_dot_product_attention_forward", "scaled_dot_product_attention_backward", "self_attention_backward",
           "accepts_self_attention_backward"]


def _as_rows(block):
    """A (b', h', r, n) block as C-contiguous rows (b' h' r, n): a view of a contiguous block, else a copy
    (a causal block's n keys of each row's Tk: the compiled loops run 8-9 times slower on strided rows)."""
    return numpy.ascontiguousarray(block).reshape(-1, block.shape[-1])


def _softmax(s):
    """P = softmax(S) in S's buffer."""
    rows = _as_rows(s)
    softmax_rows_in_place(rows, 0, rows.shape[0])
    if not numpy.may_share_memory(rows, s):
        s[...] = rows.reshape(s.shape)
    return s


def _softmax_grad(dp, p):
    """dS = P * (dP - rowsum(dP * P)) in dP's buffer (a fresh product, contiguous: its rows are a view)."""
    rows = dp.reshape(-1, dp.shape[-1])
    softmax_grad_rows_in_place(rows, _as_rows(p), 0, rows.shape[0])
    return dp


COMPILED_ROWS = RowKernels(_softmax, _softmax_grad, apply_keep, CompiledKeepMask)


def scaled_dot_product_attention_forward(q, k, v, *, attn_mask=None, key_padding_mask=None,
                                         is_causal: bool = False, causal_alignment: str = "top_left",
                                         dropout_p: float = 0.0, rng=None, training: bool = True,
                                         scale: float | None = None, need_weights: bool = False):
    return attention_forward(COMPILED_ROWS, q, k, v, attn_mask, key_padding_mask, is_causal, causal_alignment,
                             dropout_p, rng, training, scale, need_weights)


def scaled_dot_product_attention_backward(dout, cache):
    return attention_backward(COMPILED_ROWS, dout, cache)


def self_attention_backward(dout, cache):
    """:func:`npformer.ops.multihead.self_attention_backward` with the heads' gradients written into
    the packed gradient (no merge copy)."""
    return self_attention_backward_with(COMPILED_ROWS, dout, cache)


def accepts_self_attention_backward(dout, cache) -> bool:
    """A self-attention cache of the CPU attention (no past keys) and a float32/float64 NumPy gradient."""
    return packed_cache(cache, AttentionCache) and numba_floats(dout, cache.attn.p)
