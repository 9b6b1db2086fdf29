"""Self-attention's backward with the heads' gradients written straight into the packed gradient
(reference: :func:`npformer.ops.multihead.self_attention_backward`, the version to read).

The reference merges dq, dk and dv into the (B, T, 3E) gradient of the packed projection with one
copy each. The fast paths here give the attention backward the three thirds of that array to write
into instead (views (B, H, T, hs) of a (B, T, 3, H, hs) buffer), so the in-projection's backward
reads them where they were written. The CPU attention (:mod:`npformer.kernels.cpu.attention`) and
the CUDA flash attention (:mod:`npformer.kernels.cuda.multihead`) each pass their own
``backward_into``; the products are the reference's, on the same values.
"""
from __future__ import annotations

from typing import Any, Callable

from npformer.ops.linear import check_linear_grad, linear_backward
from npformer.ops.multihead import MultiHeadCache, split_heads

__all__ = ["packed_self_attention_backward", "packed_cache"]


def packed_self_attention_backward(backward_into: Callable[..., None], xp: Any, dout, cache: MultiHeadCache):
    """Returns ``(dx, din_proj_weight, din_proj_bias, dout_proj_weight, dout_proj_bias)`` as the
    reference; ``backward_into(dout_heads, attention_cache, dq, dk, dv)`` writes the heads' gradients."""
    check_linear_grad(dout, cache.out_proj)         # dout: the gradient of the output projection's output
    # fwd: out = merge(heads) @ W_o^T + b_o  ->  dmerged = dout @ W_o
    dmerged, dw_out, db_out = linear_backward(dout, cache.out_proj)             # (B, T, E), (E, E), (E,)
    b, t, e = dmerged.shape
    h = cache.num_heads
    dqkv = xp.empty((b, t, 3, h, e // h), dtype=dmerged.dtype)                  # (B, T, 3, H, hs)
    dq, dk, dv = [dqkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3)]         # (B, H, T, hs) views
    # fwd: heads = attention(split(q), split(k), split(v))  ->  dq, dk, dv into the packed gradient
    backward_into(split_heads(dmerged, h), cache.attn, dq, dk, dv)
    # fwd: [q | k | v] = x @ W_in^T + b_in  ->  dx = [dq | dk | dv] @ W_in,  dW_in = [dq | dk | dv]^T x
    dx, dw_in, db_in = linear_backward(dqkv.reshape(b, t, 3 * e), cache.projections[0])
    return dx, dw_in, db_in, dw_out, db_out


def packed_cache(cache, attention_cache_type: type) -> bool:
    """Whether ``cache`` is a self-attention cache (one packed projection, no past keys: training)
    whose attention cache is an ``attention_cache_type``."""
    return (isinstance(cache, MultiHeadCache) and isinstance(cache.attn, attention_cache_type)
            and len(cache.projections) == 1 and cache.past == 0)
