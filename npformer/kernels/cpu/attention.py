"""Scaled dot-product attention for NumPy, block by block of heads, the blocks shared out between
threads (reference: :mod:`npformer.ops.attention`, the same signature, cache and results).

The reference runs each step over all (B, H, Tq, Tk) scores: S, then P, then P_drop, then out, each
a pass over memory and each matmul a loop of small products. Here the whole chain runs on one block
at a time: a few heads of one batch element (or, for long sequences, a run of query rows of one
head; or, for short sequences, several whole batch elements), about 64K scores (up to 256K when
threads share the work: :func:`blocks`), which stay in cache from the product that makes them to
the product that uses them:

    forward, per block:   S = (q * scale) k^T + bias  ->  P = softmax(S) (kept: the cache)
                          ->  P_drop = P * keep * scale  ->  out = P_drop v
    backward, per block:  P_drop again  ->  dv += P_drop^T dout,  dP = (dout v^T) * keep * scale
                          ->  dS = P * (dP - rowsum(dP * P)) * scale  ->  dq = dS k,  dk += dS^T q

Under ``is_causal`` a block computes all of this over the keys its last row may attend and no further
(:func:`keys_seen`, FlashAttention's rule for tiles wholly in the future): its P is 0 beyond them, as
the mask makes it, and the backward reads the causal shift from the cache. A head of more than
BLOCK_ELEMENTS scores (T > 256) is cut into runs of rows, so up to half its work goes (3/8 at T 512); a
block of whole heads computes every key its last row sees, all of them at Tq = Tk. Keys in the future of
every row of a block are never read (a NaN there does not reach its outputs, where the reference's full
product spreads it). On the 2-core AMD VM (2026-12-02, ``python benchmarks/causal_attention.py``: B 1, H
8, head size 64, float32, one thread) the forward and backward ran 1.4-1.6x faster at T 512-2048 with
numba's row loops, 1.1-1.8x NumPy alone.

Threads take contiguous runs of whole heads (a head's query-row blocks stay on one thread, so dk
and dv sum in a fixed order), with BLAS at one thread each, also when timing leaves a single run
(:mod:`npformer.kernels.cpu.threads`).
Each block computes the same products and row operations whichever thread runs it, so the results
do not depend on the number of threads. The dropout mask is the reference's, made as booleans
before the blocks run, one run of it per thread (:class:`~npformer.kernels.cpu.dropout.KeepMask`).
16-bit inputs are computed in float32 (scores, softmax, products, the sums
of dk and dv) and rounded where kept or returned, as the reference.

The output is written as (B, Tq, H, hv) in memory (returned as its (B, H, Tq, hv) view), so merging
the heads after it is a view, not a copy; the backward can write dq, dk and dv into any arrays of
their shapes with a contiguous last axis (``attention_backward_into``), which self-attention's
backward uses to write them straight into its packed gradient (:mod:`npformer.kernels.multihead`).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import numpy

from npformer.backend import accumulation_dtype
from npformer.checks import expect_grad, expect_row_buffer
from npformer.kernels.cpu import numpy_floats
from npformer.kernels.cpu.blocks import BLOCK_ELEMENTS, block_elements
from npformer.kernels.cpu.dropout import KeepMask, apply_keep, draw_keep
from npformer.kernels.cpu.softmax import softmax_grad_rows, softmax_rows
from npformer.kernels.cpu.threads import run_parallel, split, threads_for
from npformer.kernels.multihead import packed_cache, packed_self_attention_backward
from npformer.ops.attention import AttentionCache, check_attention_inputs
from npformer.ops.dropout import DropoutCache, dropout_active, dropout_mask, keep_mask, keep_scale
from npformer.ops.masks import attention_bias, causal_shift

__all__ = ["scaled_dot_product_attention_forward", "scaled_dot_product_attention_backward", "self_attention_backward",
           "blocks", "keys_seen", "RowKernels", "attention_forward", "attention_backward", "attention_backward_into",
           "self_attention_backward_with", "accepts_self_attention_backward"]


def blocks(b: int, h: int, tq: int, tk: int, parts: int = 1) -> list[list[tuple[slice, slice, slice]]]:
    """The blocks of a (b, h, tq, tk) score array, grouped by head: ``[[(batch, heads, rows), ...], ...]``.

    A group is one head cut into runs of query rows (when a head has more than BLOCK_ELEMENTS
    scores), a run of whole batch elements (when one holds at most ``size`` scores), or a few whole
    heads of one batch element (about ``size`` scores). ``size`` is
    :func:`~npformer.kernels.cpu.blocks.block_elements` of ``parts`` (larger blocks when threads
    share the work, so that fewer NumPy calls hand the GIL over), but at most a thread's share of
    all the scores (never under BLOCK_ELEMENTS), so that every thread gets blocks. Each block is a
    contiguous run of the scores in C order. Runs of batch elements are made a multiple of
    ``parts`` in number where the batch allows, so that ``parts`` threads get equal shares
    (gpt-tiny's 12 elements of 16K scores: 2 blocks of 6 for two threads). Only whole heads are
    grouped by ``parts``: a head's runs of rows, over which dk and dv are summed, are the same for
    any thread count, and so are the results."""
    per_head = tq * tk
    if per_head > BLOCK_ELEMENTS:
        rows = max(1, BLOCK_ELEMENTS // tk)
        return [[(slice(i, i + 1), slice(j, j + 1), slice(r, min(r + rows, tq))) for r in range(0, tq, rows)]
                for i in range(b) for j in range(h)]
    size = min(block_elements(parts), max(BLOCK_ELEMENTS, -(-b * h * per_head // max(parts, 1))))
    if h * per_head <= size:
        n = max(1, size // max(h * per_head, 1))
        if parts > 1 and b > 0:
            runs = -(-b // n)                            # blocks of n elements
            runs = -(-runs // parts) * parts             # rounded up to a multiple of the parts
            n = -(-b // runs)                            # elements a block
        return [[(slice(i, min(i + n, b)), slice(0, h), slice(0, tq))] for i in range(0, b, n)]
    n = max(1, size // max(per_head, 1))
    return [[(slice(i, i + 1), slice(j, min(j + n, h)), slice(0, tq))] for i in range(b) for j in range(0, h, n)]


def keys_seen(rows: slice, tk: int, shift: int | None) -> slice:
    """The keys a block of query ``rows`` may attend, ``slice(0, n)``: all ``tk`` without a causal mask;
    with one of ``shift`` (:func:`~npformer.ops.masks.causal_shift`: query i attends no key j > i + shift),
    those below ``rows.stop + shift``, the block's last row's. The block computes its scores, softmax and
    products over these n keys alone (FlashAttention's rule: no work on tiles wholly in the future);
    its P beyond them is 0, as the mask makes it."""
    return slice(0, tk if shift is None else min(tk, max(0, rows.stop + shift)))


def _parallel(shape: tuple, run_block) -> None:
    """run_block(block) for every block of a ``shape`` (b, h, tq, tk) score array, the groups split in
    contiguous runs over the threads; the blocks' products on BLAS at one thread however many runs
    there are (so the thread count, which sets the runs' count and how many whole heads a block
    holds, :func:`~npformer.kernels.cpu.threads.threads_for`, changes no bit: every head's products and rows
    are computed the same way in any block)."""
    threads = threads_for(shape[0] * shape[1], 1)
    groups = blocks(*shape, parts=threads)

    def run(a: int, b: int) -> None:
        for group in groups[a:b]:
            for block in group:
                run_block(block)
    parts = split(len(groups), threads)
    run_parallel([lambda a=a, b=b: run(a, b) for a, b in parts], blas_one_thread=True)


class RowKernels(NamedTuple):
    """The row operations a block runs, in place on (b', h', r, n) blocks, contiguous but for a causal
    block's rows of S and P (n of Tk keys, :func:`keys_seen`):
    ``softmax(s)`` (P into S's buffer), ``softmax_grad(dp, p)`` (dS into dP's buffer, dP always a
    fresh product) and
    ``apply_keep(out, x, keep, scale)`` (dropout's ``out = x * keep * scale``; out may be x); and
    ``keep_mask``, the :class:`~npformer.kernels.cpu.dropout.KeepMask` (sub)class that draws the mask."""

    softmax: Callable[[Any], Any]
    softmax_grad: Callable[[Any, Any], Any]
    apply_keep: Callable[[Any, Any, Any, Any], None]
    keep_mask: type


def _softmax(s):
    """P = softmax(S) in S's buffer (float32 or float64: 16-bit blocks are widened first)."""
    return softmax_rows(s, s)


def _softmax_grad(dp, p):
    """dS = P * (dP - rowsum(dP * P)) in dP's buffer."""
    return softmax_grad_rows(dp, p, dp)


NUMPY_ROWS = RowKernels(_softmax, _softmax_grad, apply_keep, KeepMask)


def scaled_dot_product_attention_forward(q, k, v, *, attn_mask=None, key_padding_mask=None,
                                         is_causal: bool = False, causal_alignment: str = "top_left",
                                         dropout_p: float = 0.0, rng=None, training: bool = True,
                                         scale: float | None = None, need_weights: bool = False):
    return attention_forward(NUMPY_ROWS, q, k, v, attn_mask, key_padding_mask, is_causal, causal_alignment,
                             dropout_p, rng, training, scale, need_weights)


def scaled_dot_product_attention_backward(dout, cache):
    return attention_backward(NUMPY_ROWS, dout, cache)


def self_attention_backward(dout, cache):
    """:func:`npformer.ops.multihead.self_attention_backward` with the heads' gradients written into
    the packed gradient (no merge copy)."""
    return self_attention_backward_with(NUMPY_ROWS, dout, cache)


def self_attention_backward_with(rows_: RowKernels, dout, cache):
    """The self-attention backward above with the row operations ``rows_``."""
    return packed_self_attention_backward(functools.partial(attention_backward_into, rows_), numpy, dout, cache)


def accepts_self_attention_backward(dout, cache) -> bool:
    """A self-attention cache of this attention (no past keys) and a NumPy float gradient."""
    return packed_cache(cache, AttentionCache) and numpy_floats(dout, cache.attn.p)


def attention_forward(rows_: RowKernels, q, k, v, attn_mask, key_padding_mask, is_causal, causal_alignment,
                      dropout_p, rng, training, scale, need_weights):
    """The forward above with the row operations ``rows_`` (the compiled CPU paths pass theirs)."""
    scale = check_attention_inputs(q, k, v, scale, dropout_p)
    b, h, tq, _ = q.shape
    tk, hv = k.shape[2], v.shape[3]
    shape = (b, h, tq, tk)
    dtype = q.dtype
    acc = accumulation_dtype(dtype)                      # 16-bit: scores, softmax, products in float32
    wide = acc != dtype
    bias = attention_bias(shape, acc, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                          is_causal=is_causal, causal_alignment=causal_alignment, xp=numpy)
    if bias is not None:
        bias = numpy.broadcast_to(bias, shape)           # (B, H, Tq, Tk) view: blocks slice it
    scale_t = acc.type(scale)
    p = numpy.empty(shape, dtype)                        # (B, H, Tq, Tk) S, then P in place
    out = numpy.empty((b, tq, h, hv), dtype).transpose(0, 2, 1, 3)   # (B, H, Tq, hv) view of (B, Tq, H, hv)
    keep = keep_s = None
    if dropout_active(q, dropout_p, rng, training):    # (its errors: no rng)
        if dropout_p == 1.0:
            keep, keep_s = dropout_mask(p, dropout_p, rng)   # nothing kept, nothing drawn: the reference's
        else:
            keep, keep_s = numpy.empty(shape, bool), keep_scale(dropout_p, dtype)
            draw_keep(rows_.keep_mask(rng, dropout_p), keep)   # in runs side by side
    weights = numpy.empty(shape, dtype) if need_weights else None
    shift = causal_shift(tq, tk, causal_alignment) if is_causal else None

    def run_block(block) -> None:
        i, heads, rows = block
        keys = keys_seen(rows, tk, shift)                # the rest lie in every row's future: P = 0 there
        if keys.stop < tk:
            p[i, heads, rows, keys.stop:] = 0
            if weights is not None:
                weights[i, heads, rows, keys.stop:] = 0
            if keys.stop == 0:                           # no row sees a key: out = 0, as for a fully masked row
                out[i, heads, rows] = 0
                return
        qb, kb = q[i, heads, rows].astype(acc, copy=False), k[i, heads, keys].astype(acc, copy=False)
        s = p[i, heads, rows, keys] if not wide else numpy.empty(p[i, heads, rows, keys].shape, acc)   # (b', h', r, n)
        numpy.matmul(qb * scale_t, kb.swapaxes(-1, -2), out=s)
        if bias is not None:
            s += bias[i, heads, rows, keys]              # -inf where blocked
        rows_.softmax(s)                                 # P, an all -inf row -> 0
        if wide:
            p[i, heads, rows, keys] = s                  # P rounded to the inputs' dtype (the cache)
            s = p[i, heads, rows, keys]
        p_drop = s
        if keep is not None:
            m = keep[i, heads, rows, keys]
            p_drop = weights[i, heads, rows, keys] if weights is not None else numpy.empty(s.shape, dtype)
            rows_.apply_keep(p_drop, s, m, keep_s)       # (b', h', r, n) P * m / (1 - p)
        elif weights is not None:
            weights[i, heads, rows, keys] = p_drop
        if wide:
            out[i, heads, rows] = numpy.matmul(p_drop.astype(acc), v[i, heads, keys].astype(acc))
        else:
            numpy.matmul(p_drop, v[i, heads, keys], out=out[i, heads, rows])

    _parallel(shape, run_block)
    drop = DropoutCache(keep, keep_s, shape, dtype)      # (None, None: no dropout ran)
    return out, weights, AttentionCache(q, k, v, p, drop, scale, shift)


def attention_backward(rows_: RowKernels, dout, cache):
    """The backward above with the row operations ``rows_``."""
    dq, dk, dv = (numpy.empty(a.shape, a.dtype) for a in (cache.q, cache.k, cache.v))   # (B, H, T, hs / hv)
    attention_backward_into(rows_, dout, cache, dq, dk, dv)
    return dq, dk, dv


def attention_backward_into(rows_: RowKernels, dout, cache, dq, dk, dv) -> None:
    """The backward with the row operations ``rows_``, writing into ``dq``, ``dk``, ``dv``: NumPy
    arrays of q's, k's and v's shapes and dtype with a contiguous last axis (views of a larger
    array included: every element is written)."""
    q, k, v, p, drop, scale, shift = cache
    expect_grad(dout, "dout", q.shape[:3] + v.shape[3:], q.dtype)
    for name, g, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        expect_row_buffer(g, name, like)
    b, h, tq, tk = p.shape
    dtype, keep = q.dtype, (keep_mask(drop) if drop.dropped else None)   # (B, H, Tq, Tk) m
    acc = accumulation_dtype(dtype)                      # 16-bit: the products and dS in float32
    wide = acc != dtype
    scale_t = acc.type(scale)
    # dk and dv sum over a head's row blocks: in float32 for 16-bit, rounded once at the end
    dk_sum, dv_sum = (numpy.empty(dk.shape, acc), numpy.empty(dv.shape, acc)) if wide else (dk, dv)

    def run_block(block) -> None:
        i, heads, rows = block
        keys = keys_seen(rows, tk, shift)                # P = 0 beyond: no gradient reaches those keys
        if rows.start == 0:                              # a head's first block: its keys are the fewest
            dv_sum[i, heads, keys.stop:], dk_sum[i, heads, keys.stop:] = 0, 0
        if keys.stop == 0:
            dq[i, heads, rows] = 0
            return
        p_c = p[i, heads, rows, keys]                    # (b', h', r, n)
        p_drop = p_c
        if keep is not None:
            p_drop = numpy.empty(p_c.shape, dtype)
            rows_.apply_keep(p_drop, p_c, keep[i, heads, rows, keys], drop.scale)
        g = dout[i, heads, rows].astype(acc, copy=False)                # (b', h', r, hv)
        vb, kb = v[i, heads, keys].astype(acc, copy=False), k[i, heads, keys].astype(acc, copy=False)
        # fwd: out = P_drop @ v  ->  dv = P_drop^T @ dout,  dP_drop = dout @ v^T
        dv_part = numpy.matmul(p_drop.astype(acc, copy=False).swapaxes(-1, -2), g)
        dp = numpy.matmul(g, vb.swapaxes(-1, -2))                        # (b', h', r, n), fresh
        if keep is not None:                             # fwd: P_drop = P * m / (1 - p)
            rows_.apply_keep(dp, dp, keep[i, heads, rows, keys], drop.scale)
        ds = rows_.softmax_grad(dp, p_c.astype(acc, copy=False))        # fwd: P = softmax(S), in dp's buffer
        ds *= scale_t                                    # fwd: S = (q * scale) k^T + bias
        if wide:
            dq[i, heads, rows] = numpy.matmul(ds, kb)
        else:
            numpy.matmul(ds, kb, out=dq[i, heads, rows])
        dk_part = numpy.matmul(ds.swapaxes(-1, -2), q[i, heads, rows].astype(acc, copy=False))
        if rows.start == 0:
            dv_sum[i, heads, keys], dk_sum[i, heads, keys] = dv_part, dk_part
        else:
            dv_sum[i, heads, keys] += dv_part
            dk_sum[i, heads, keys] += dk_part

    _parallel((b, h, tq, tk), run_block)
    if wide:
        dk[...], dv[...] = dk_sum, dv_sum
