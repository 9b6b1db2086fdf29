"""Self-attention's backward on CuPy with no copy to merge the heads' gradients (reference:
:func:`npformer.ops.multihead.self_attention_backward`, the version to read).

The reference merges dq, dk and dv into the packed (B, T, 3E) gradient of the packed projection with
one copy. Here the flash attention kernels write them straight into the three thirds of that array
(views (B, H, T, hs) of a (B, T, 3, H, hs) buffer), so the in-projection's backward reads them where
they were written. With the forward's heads read in place from the packed projection and its output
written as (B, T, H, hs) (:mod:`npformer.kernels.cuda.flash_attention`), a training step splits and
merges heads with no copy at all (tests/kernels/cuda/test_multihead.py counts them).
"""
from __future__ import annotations

from npformer.kernels.cuda import runtime
from npformer.kernels.cuda.flash_attention import accepts_backward as flash_accepts_backward
from npformer.kernels.cuda.flash_attention import flash_attention_backward_into
from npformer.ops.flash_attention import FlashAttentionCache
from npformer.ops.linear import linear_backward
from npformer.ops.multihead import MultiHeadCache, split_heads

__all__ = ["self_attention_backward", "accepts_self_attention_backward"]


def self_attention_backward(dout, cache: MultiHeadCache):
    """Returns ``(dx, din_proj_weight, din_proj_bias, dout_proj_weight, dout_proj_bias)`` as the reference."""
    # fwd: out = merge(heads) @ W_o^T + b_o  ->  dmerged = dout @ W_o
    dmerged, dw_out, db_out = linear_backward(dout, cache.out_proj)             # (B, T, E), (E, E), (E,)
    b, t, e = dmerged.shape
    h = cache.num_heads
    xp = runtime.device_xp(dmerged)
    dqkv = xp.empty((b, t, 3, h, e // h), dtype=dmerged.dtype)                  # (B, T, 3, H, hs)
    dq, dk, dv = (dqkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))         # (B, H, T, hs) views
    # fwd: heads = attention(split(q), split(k), split(v))  ->  dq, dk, dv into the packed gradient
    flash_attention_backward_into(split_heads(dmerged, h), cache.attn, dq, dk, dv)
    # fwd: [q | k | v] = x @ W_in^T + b_in  ->  dx = [dq | dk | dv] @ W_in,  dW_in = [dq | dk | dv]^T x
    dx, dw_in, db_in = linear_backward(dqkv.reshape(b, t, 3 * e), cache.projections[0])
    return dx, dw_in, db_in, dw_out, db_out


def accepts_self_attention_backward(dout, cache) -> bool:
    """A self-attention cache of the CUDA flash path with no past keys (training), CuPy ``dout``."""
    if not (isinstance(cache, MultiHeadCache) and isinstance(cache.attn, FlashAttentionCache)
            and len(cache.projections) == 1 and cache.past == 0):
        return False
    return runtime.device_floats(dout, dtype=cache.attn.q.dtype) and flash_accepts_backward(cache.attn.out,
                                                                                          cache.attn)
