"""Memory-efficient attention: FlashAttention's tiled forward with an online softmax and a backward
that recomputes each tile (Dao et al. 2022, Algorithms 1-2; Dao 2023, FlashAttention-2, sec. 3.1).

The results of :mod:`npformer.ops.attention` (same masks, both causal alignments, zero output and
zero gradient for a fully masked row, 16-bit inputs accumulated in float32) without ever holding a
(Tq, Tk) array. Queries go in blocks i of ``block_q`` rows; for each, the running row max m, sum l
and output acc are updated key block j (``block_k`` keys) by key block j:

    S = q_i k_j^T * scale + bias_ij                  (B, H, bq, bk): one tile
    m' = max(m, rowmax S);  P = exp(S - m');  a = exp(m - m')
    l = a l + rowsum P;     acc = a acc + dropout(P) v_j;   m = m'
    out_i = acc / l;        lse_i = m + log l         (the row's log-sum-exp, kept for backward)

Backward, key blocks outer and query blocks inner; P is recomputed from lse, never stored:

    P = exp(S - lse_i);   dv_j += P_drop^T dout_i;   dP = dropout'(dout_i v_j^T)
    dS = P * (dP - D_i),  D_i = rowsum(dout_i * out_i)   (= rowsum(P * dP): FlashAttention-2's trick)
    dq_i += dS k_j * scale;   dk_j += dS^T q_i * scale

The scale multiplies the product, q k^T * scale, where the plain op scales q first, (q * scale) k^T;
the CUDA kernels fold it into the exponent after the product as well. The two orders round
differently (the tests compare them to rounding), and they part where q k^T itself overflows:
float32 scores beyond 3.4e38 before scaling (|q|, |k| about 1e19 and more) are inf here and NaN in
the softmax, which a small scale would have kept finite in the plain op. 16-bit inputs cannot reach
that (their products are at most hs 65504^2 in float32).

Memory: the cache holds q, k, v, out and lse (B, H, Tq, 1): O(T), where the plain op keeps the
(B, H, Tq, Tk) probabilities; the temporaries are a few (B, H, bq, bk) tiles. With ``is_causal`` a
key block wholly in the future of a query block is skipped, and only tiles that straddle the
diagonal build a causal bias. A fully masked row ends with l = 0: its output is 0 and its lse is
+inf, so the recomputed P is exactly 0 there and it passes no gradient.

Dropout: the dropout op's counter-based mask (:mod:`npformer.ops.dropout`), one seed drawn from
``rng`` and element (b, h, i, j) at its flat index ((b H + h) Tq + i) Tk + j, so a tile makes its own
bits and the backward regenerates them; the mask does not depend on the block sizes. The plain op
drops its (B, H, Tq, Tk) probabilities with the same op, so for one seed the two drop the same
entries.

The attention weights are never formed, so ``need_weights=True`` raises; use the plain op for them.

This is the version to read. On CuPy arrays a CUDA kernel stands in for it (same arguments, cache and
results; :mod:`npformer.kernels.cuda.flash_attention`, its CUDA C mapped to the lines here);
``npformer.kernels.disabled()`` runs this code instead.
"""
from __future__ import annotations

from typing import Any, NamedTuple

from npformer.backend import accumulation_dtype, get_array_module
from npformer.ops.attention import check_attention_inputs   # the plain op's input rules and messages
from npformer.checks import expect_grad, one_of, positive_int
from npformer.dispatch import dispatched
from npformer.errors import RangeError
from npformer.ops.dropout import keep_bits, seed_draws, seed_of
from npformer.ops.masks import causal_shift, check_masks, mask_bias

__all__ = ["IMPLEMENTATIONS", "check_implementation", "FlashAttentionCache", "flash_attention_forward",
           "flash_attention_backward", "check_flash_arguments", "flash_masks"]

# The ``attention=`` choices of multi-head attention ("auto": flash on CuPy arrays when no weights are
# asked for, plain otherwise; npformer.ops.multihead.attend resolves it per call).
IMPLEMENTATIONS = ("auto", "plain", "flash")


def check_implementation(attention) -> str:
    """``attention`` is one of IMPLEMENTATIONS: "auto", "plain" or "flash"."""
    return one_of(attention, "attention", IMPLEMENTATIONS)


class Masks(NamedTuple):
    attn: Any       # (Tq, Tk) or (B, H, Tq, Tk), bool (True = blocked) or float (added); or None
    padding: Any    # (B, Tk) bool or float, or None
    shift: Any      # causal: query i may attend keys j <= i + shift; None without is_causal


class FlashAttentionCache(NamedTuple):
    """O(T): no (Tq, Tk) array. P is recomputed tile by tile from lse; dropout masks from the seed."""

    q: Any             # (B, H, Tq, hs)
    k: Any             # (B, H, Tk, hs)
    v: Any             # (B, H, Tk, hv)
    out: Any           # (B, H, Tq, hv)
    lse: Any           # (B, H, Tq, 1) accumulation dtype; +inf on fully masked rows
    masks: Masks
    dropout_p: float   # 0.0 when no dropout ran
    seed_draws: Any    # (2,) float64: the dropout seed's draws (ops.dropout.seed_draws), or None
    scale: float
    block_q: int
    block_k: int


def flash_masks(b, h, tq, tk, attn_mask, key_padding_mask, is_causal, alignment, xp) -> Masks:
    """Checked by :func:`npformer.ops.masks.check_masks`, as the plain attention's are."""
    attn_mask = check_masks((b, h, tq, tk), attn_mask, key_padding_mask, is_causal, alignment, xp)
    shift = causal_shift(tq, tk, alignment) if is_causal else None
    return Masks(attn_mask, key_padding_mask, shift)


def _scores(qi, kj, masks, scale, i0, i1, j0, j1, xp):
    """S = q_i k_j^T * scale + bias of the tile rows i0:i1, keys j0:j1."""
    s = qi @ kj.swapaxes(-1, -2)                                                  # (B, H, bq, bk)
    s *= scale                                                                    # s is fresh
    if masks.attn is not None:
        s += mask_bias(masks.attn[..., i0:i1, j0:j1], s.dtype, xp)                    # (.., .., bq, bk)
    if masks.padding is not None:
        s += mask_bias(masks.padding[:, None, None, j0:j1], s.dtype, xp)              # (B, 1, 1, bk)
    if masks.shift is not None and j1 - 1 > i0 + masks.shift:                     # the tile straddles the diagonal
        future = xp.arange(j0, j1)[None, :] > xp.arange(i0, i1)[:, None] + masks.shift   # (bq, bk)
        s += mask_bias(future, s.dtype, xp)
    return s


def _visible(i1, j0, shift) -> bool:
    """Some query of rows < i1 may attend key j0 (False: the tile is wholly in the future)."""
    return shift is None or j0 <= i1 - 1 + shift


def _keep(seed, p, shape, i0, i1, j0, j1, dtype, xp):
    """Scaled keep-mask m / (1 - p) of the tile: the dropout op's mask (:func:`keep_bits`) at the
    element's flat index n = ((b H + h) Tq + i) Tk + j."""
    b, h, tq, tk = shape
    u64 = xp.uint64
    n = (xp.arange(b * h, dtype=u64).reshape(b, h, 1, 1) * u64(tq * tk)
         + (xp.arange(i0, i1, dtype=u64)[:, None] * u64(tk) + xp.arange(j0, j1, dtype=u64)))  # (B, H, bq, bk)
    keep = keep_bits(seed, n, p)                                                  # (B, H, bq, bk)
    return keep.astype(dtype) * (1.0 / (1.0 - p)) if p < 1 else xp.zeros(keep.shape, dtype)


def check_flash_arguments(q, k, v, scale, dropout_p, need_weights, block_q, block_k):
    """The forward's argument checks (the CUDA kernel's too); returns ``(scale, block_q, block_k)``."""
    scale = check_attention_inputs(q, k, v, scale, dropout_p)
    if need_weights:
        raise RangeError("need_weights=True: flash attention never forms the (Tq, Tk) attention weights; "
                         "pass need_weights=False, or use the plain op (attention='plain') to get them")
    return scale, positive_int(block_q, "block_q"), positive_int(block_k, "block_k")   # tile sizes


@dispatched
def flash_attention_forward(q, k, v, *, attn_mask=None, key_padding_mask=None, is_causal: bool = False,
                            causal_alignment: str = "top_left", dropout_p: float = 0.0, rng=None,
                            training: bool = True, scale: float | None = None, need_weights: bool = False,
                            block_q: int = 128, block_k: int = 128):
    """Returns ``(out, cache)``, out (B, H, Tq, hv): the plain op's output, tile by tile.

    Arguments as :func:`npformer.ops.attention.scaled_dot_product_attention_forward`; ``block_q`` and
    ``block_k`` are the tile sizes (any positive ints: the last tile is shorter).
    """
    scale, block_q, block_k = check_flash_arguments(q, k, v, scale, dropout_p, need_weights, block_q, block_k)
    xp = get_array_module(q, k, v)
    b, h, tq, hs = q.shape
    tk, hv = k.shape[2], v.shape[3]
    masks = flash_masks(b, h, tq, tk, attn_mask, key_padding_mask, is_causal, causal_alignment, xp)
    acc_dt = accumulation_dtype(q.dtype)
    p = float(dropout_p) if training and dropout_p > 0 else 0.0
    draws = seed_draws(rng, q, xp) if p > 0 else None                             # (2,)
    seed = seed_of(draws, xp) if p > 0 else None                                  # ()
    out = xp.empty((b, h, tq, hv), dtype=q.dtype)                                 # (B, H, Tq, hv)
    lse = xp.empty((b, h, tq, 1), dtype=acc_dt)                                   # (B, H, Tq, 1)
    for i0 in range(0, tq, block_q):
        i1 = min(i0 + block_q, tq)
        qi = q[:, :, i0:i1].astype(acc_dt, copy=False)                            # (B, H, bq, hs)
        m = xp.full((b, h, i1 - i0, 1), -xp.inf, dtype=acc_dt)                    # running row max
        l = xp.zeros((b, h, i1 - i0, 1), dtype=acc_dt)                            # running row sum
        acc = xp.zeros((b, h, i1 - i0, hv), dtype=acc_dt)                         # running P_drop v
        for j0 in range(0, tk, block_k):
            j1 = min(j0 + block_k, tk)
            if not _visible(i1, j0, masks.shift):
                break                                                             # so is every later key block
            s = _scores(qi, k[:, :, j0:j1].astype(acc_dt, copy=False), masks, scale, i0, i1, j0, j1, xp)
            m_new = xp.maximum(m, s.max(axis=-1, keepdims=True))                 # (B, H, bq, 1)
            shift = xp.where(xp.isinf(m_new), 0.0, m_new)                         # all -inf so far: no inf - inf
            s -= shift
            pt = xp.exp(s, out=s)                                                 # (B, H, bq, bk) P, unnormalised
            alpha = xp.exp(m - shift)                                             # (B, H, bq, 1), 0 at the start
            l *= alpha
            l += pt.sum(axis=-1, keepdims=True)
            if p > 0:
                pt *= _keep(seed, p, (b, h, tq, tk), i0, i1, j0, j1, acc_dt, xp)
            acc *= alpha
            acc += pt @ v[:, :, j0:j1].astype(acc_dt, copy=False)                 # (B, H, bq, hv)
            m = m_new
        empty = l == 0                                                            # fully masked rows
        out[:, :, i0:i1] = acc / xp.where(empty, 1.0, l)                          # (B, H, bq, hv)
        lse[:, :, i0:i1] = xp.where(empty, xp.inf, m + xp.log(xp.where(empty, 1.0, l)))
    return out, FlashAttentionCache(q, k, v, out, lse, masks, p, draws, scale, block_q, block_k)


@dispatched
def flash_attention_backward(dout, cache: FlashAttentionCache):
    """Returns ``(dq, dk, dv)`` for ``dout`` (B, H, Tq, hv), recomputing every tile of P."""
    q, k, v, out, lse, masks, p, draws, scale, block_q, block_k = cache
    expect_grad(dout, "dout", out.shape, out.dtype)
    xp = get_array_module(dout, q)
    seed = seed_of(draws, xp) if p > 0 else None                                  # ()
    acc_dt = lse.dtype
    b, h, tq, _ = q.shape
    tk = k.shape[2]
    do = dout.astype(acc_dt, copy=False)                                          # (B, H, Tq, hv)
    d = (do * out.astype(acc_dt, copy=False)).sum(axis=-1, keepdims=True)         # (B, H, Tq, 1) D = rowsum(dO * O)
    dq = xp.zeros(q.shape, dtype=acc_dt)                                          # (B, H, Tq, hs)
    dk = xp.zeros(k.shape, dtype=acc_dt)                                          # (B, H, Tk, hs)
    dv = xp.zeros(v.shape, dtype=acc_dt)                                          # (B, H, Tk, hv)
    for j0 in range(0, tk, block_k):
        j1 = min(j0 + block_k, tk)
        kj = k[:, :, j0:j1].astype(acc_dt, copy=False)                            # (B, H, bk, hs)
        vj = v[:, :, j0:j1].astype(acc_dt, copy=False)                            # (B, H, bk, hv)
        for i0 in range(0, tq, block_q):
            i1 = min(i0 + block_q, tq)
            if not _visible(i1, j0, masks.shift):
                continue                                                          # skipped in forward too
            qi = q[:, :, i0:i1].astype(acc_dt, copy=False)                        # (B, H, bq, hs)
            doi = do[:, :, i0:i1]                                                 # (B, H, bq, hv)
            s = _scores(qi, kj, masks, scale, i0, i1, j0, j1, xp)                 # (B, H, bq, bk)
            s -= lse[:, :, i0:i1]
            pt = xp.exp(s, out=s)                                                 # (B, H, bq, bk) P, recomputed
            keep = _keep(seed, p, (b, h, tq, tk), i0, i1, j0, j1, acc_dt, xp) if p > 0 else None
            # fwd: acc += P_drop @ v_j  ->  dv_j += P_drop^T @ dout_i,  dP_drop = dout_i @ v_j^T
            dv[:, :, j0:j1] += (pt if keep is None else pt * keep).swapaxes(-1, -2) @ doi
            ds = doi @ vj.swapaxes(-1, -2)                                        # (B, H, bq, bk) dP_drop
            # fwd: P_drop = P * m / (1 - p)  ->  dP = dP_drop * m / (1 - p)
            if keep is not None:
                ds *= keep
            # fwd: P = exp(S - lse)  ->  dS = P * (dP - D_i)   (0 at masked keys and fully masked rows)
            ds -= d[:, :, i0:i1]
            ds *= pt
            # fwd: S = q_i k_j^T * scale + bias  ->  dq_i += dS k_j * scale,  dk_j += dS^T q_i * scale
            ds *= scale
            dq[:, :, i0:i1] += ds @ kj                                            # (B, H, bq, hs)
            dk[:, :, j0:j1] += ds.swapaxes(-1, -2) @ qi                           # (B, H, bk, hs)
    return (dq.astype(q.dtype, copy=False), dk.astype(k.dtype, copy=False),
            dv.astype(v.dtype, copy=False))
