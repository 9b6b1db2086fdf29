"""No copies to split and merge heads on the CUDA path: the flash kernels read strided heads and write
(B, T, H, hs) ones, and self-attention's backward writes dq, dk, dv into the packed gradient
(npformer.kernels.cuda.multihead). Parity with the reference, and a count of the copies a forward and
backward of MultiheadAttention makes. Emulated here, and on a GPU where one is present (``fx``).

The fast paths run the same kernels and products as the reference on the same values, only reading
and writing them in other places, so the results are compared for equality.
"""
import numpy as np
import pytest

from npformer.kernels import implementation
from npformer.kernels.cuda import flash_attention as kernel
from npformer.nn.attention import MultiheadAttention
from npformer.ops import multihead
from npformer.ops.flash_attention import flash_attention_backward, flash_attention_forward
from tests.helpers import host, randn
from tests.kernels.cuda.conftest import DTYPES

B, T, H, HS = 2, 37, 3, 16          # ragged T: a partial last tile
E = H * HS


def _packed_heads(xp, dtype, seed=0):
    """q, k, v as the (B, H, T, hs) views of one packed (B, T, 3E) projection (no copies), and the buffer."""
    qkv = randn(xp, (B, T, 3 * E), seed, dtype)
    return [multihead.split_heads(qkv[..., i * E:(i + 1) * E], H) for i in range(3)], qkv


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernels_read_strided_heads_and_write_merged_ones(fx, dtype):
    xp = fx.xp
    (q, k, v), qkv = _packed_heads(xp, dtype)
    assert not q.flags.c_contiguous
    dout = randn(xp, (B, H, T, HS), 7, dtype)
    out, cache = flash_attention_forward(q, k, v, is_causal=True)
    assert all(xp.shares_memory(a, qkv) for a in (cache.q, cache.k, cache.v))          # read in place
    assert out.transpose(0, 2, 1, 3).flags.c_contiguous                                # (B, T, H, hs) memory
    dq, dk, dv = flash_attention_backward(dout, cache)
    assert all(g.transpose(0, 2, 1, 3).flags.c_contiguous for g in (dq, dk, dv))
    ref = [xp.ascontiguousarray(a) for a in (q, k, v)]                                 # the same heads, copied
    want_out, want_cache = flash_attention_forward(*ref, is_causal=True)
    want = flash_attention_backward(xp.ascontiguousarray(dout), want_cache)
    for got, exp, what in zip((out, dq, dk, dv), (want_out, *want), ("out", "dq", "dk", "dv")):
        np.testing.assert_array_equal(host(got), host(exp), err_msg=what)                # the same arithmetic


@pytest.mark.parametrize("dtype", DTYPES)
def test_self_attention_backward_fast_path_against_the_reference(fx, dtype):
    xp = fx.xp
    x = randn(xp, (B, T, E), 1, dtype)
    weights = (randn(xp, (3 * E, E), 2, dtype, scale=0.2), randn(xp, (3 * E,), 3, dtype),
               randn(xp, (E, E), 4, dtype, scale=0.2), randn(xp, (E,), 5, dtype))
    out, _, cache = multihead.self_attention_forward(x, H, *weights, is_causal=True, need_weights=False,
                                                     attention="flash")
    dout = randn(xp, out.shape, 6, dtype)
    assert implementation(multihead.self_attention_backward, dout, cache) == "cuda"
    got = multihead.self_attention_backward(dout, cache)
    want = multihead.self_attention_backward.reference(dout, cache)       # the same kernels, then a merge copy
    for g, w, what in zip(got, want, ("dx", "din_proj_weight", "din_proj_bias", "dout_proj_weight",
                                      "dout_proj_bias")):
        assert g.dtype == w.dtype == dtype, what
        np.testing.assert_array_equal(host(g), host(w), err_msg=what)


def test_multihead_attention_splits_and_merges_heads_without_copies(fx, monkeypatch):
    """One forward and backward of MultiheadAttention on the flash path: no array is made contiguous
    (xp.ascontiguousarray), every merge of heads is a view of what attention wrote, the attention reads
    q, k and v inside the one packed projection, and the backward runs the packed fast path."""
    xp = fx.xp
    copies, merges = [], []
    real_contiguous, real_merge = xp.ascontiguousarray, multihead.merge_heads

    def counting_contiguous(a, *args, **kwargs):
        if not a.flags.c_contiguous:
            copies.append(a.shape)
        return real_contiguous(a, *args, **kwargs)

    def spying_merge(*heads):
        merged = real_merge(*heads)
        merges.append(all(xp.shares_memory(merged, h) for h in heads))
        return merged
    monkeypatch.setattr(xp, "ascontiguousarray", counting_contiguous)
    monkeypatch.setattr(multihead, "merge_heads", spying_merge)
    mha = MultiheadAttention(E, H, attention="flash", backend="cupy" if fx.name == "cuda" else "numpy", rng=0)
    x = randn(xp, (B, T, E), 1, "float32")
    out, _ = mha(x, need_weights=False, is_causal=True)
    cache = mha._saved[-1]
    q, k, v = cache.attn.q, cache.attn.k, cache.attn.v          # interleaved in one buffer: views, not copies
    assert not q.flags.c_contiguous and xp.may_share_memory(q, k) and xp.may_share_memory(k, v)
    assert xp.shares_memory(cache.out_proj.x, cache.attn.out)          # the merged heads are attention's output
    assert implementation(multihead.self_attention_backward, out, cache) == "cuda"
    mha.backward(randn(xp, out.shape, 2, "float32"))
    assert copies == [] and merges == [True], (copies, merges)
    assert kernel.merged_heads(xp, B, H, T, HS, "float32").transpose(0, 2, 1, 3).flags.c_contiguous
