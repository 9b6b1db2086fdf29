"""Self-attention's backward on CuPy with no copy to merge the heads' gradients (reference:
:func:`npformer.ops.multihead.self_attention_backward`, the version to read).

The reference merges dq, dk and dv into the packed (B, T, 3E) gradient of the packed projection with
one copy. Here the flash attention kernels write them straight into the three thirds of that array
(views (B, H, T, hs) of a (B, T, 3, H, hs) buffer), so the in-projection's backward reads them where
they were written. With the forward's heads read in place from the packed projection and its output
written as (B, T, H, hs) (:mod:`npformer.kernels.cuda.flash_attention`), a training step splits and
merges heads with no copy at all (tests/kernels/cuda/test_multihead.py counts them). The body is
shared with the CPU attention's (:mod:`npformer.kernels.multihead`).
"""
from __future__ import annotations

from npformer.kernels.cuda import runtime
from npformer.kernels.cuda.flash_attention import accepts_backward as flash_accepts_backward
from npformer.kernels.cuda.flash_attention import flash_attention_backward_into
from npformer.kernels.multihead import packed_cache, packed_self_attention_backward
from npformer.ops.flash_attention import FlashAttentionCache
from npformer.ops.multihead import MultiHeadCache

__all__ = ["self_attention_backward", "accepts_self_attention_backward"]


def self_attention_backward(dout, cache: MultiHeadCache):
    """Returns ``(dx, din_proj_weight, din_proj_bias, dout_proj_weight, dout_proj_bias)`` as the reference."""
    return packed_self_attention_backward(flash_attention_backward_into, runtime.device_xp(dout), dout, cache)


def accepts_self_attention_backward(dout, cache) -> bool:
    """A self-attention cache of the CUDA flash path with no past keys (training), CuPy ``dout``."""
    if not packed_cache(cache, FlashAttentionCache):
        return False
    return runtime.device_floats(dout, dtype=cache.attn.q.dtype) and flash_accepts_backward(cache.attn.out,
                                                                                          cache.attn)
