"""Flash attention (npformer.ops.flash_attention): equal to the plain op in outputs and gradients over
shapes, tile sizes, every mask kind and both causal alignments; float64 gradchecks (with and without
dropout); dropout's keep rate and scaling; fully masked rows and huge scores in fp16/32/64; bad input;
memory (the cache holds no (Tq, Tk) array; traced peak memory grows linearly in T); multi-head
attention, MultiheadAttention and a whole GPT with attention="flash" equal to "plain"."""
import tracemalloc

import numpy as np

from npformer import kernels
import pytest
from hypothesis import given, strategies as st

from npformer.backend import backend_name, default_rng
from npformer.models.gpt import GPT, GPTConfig
from npformer.nn.attention import MultiheadAttention
from npformer.ops.attention import (scaled_dot_product_attention_backward as sdpa_backward,
                                    scaled_dot_product_attention_forward as sdpa_forward)
from npformer.ops.flash_attention import FlashAttentionCache
from npformer.ops.flash_attention import flash_attention_backward as flash_backward
from npformer.ops.flash_attention import flash_attention_forward as flash_forward
from npformer.ops.multihead import multi_head_attention_backward, multi_head_attention_forward
from npformer.tools.gradcheck import gradcheck, gradcheck_module
from tests.helpers import assert_gradcheck, batch, head_size, heads, host, padding_masks, randn, seeds

CAUSAL = st.sampled_from([None, "top_left", "bottom_right"])
MASKS = st.sampled_from(["none", "padding", "bool2d", "bool3d", "bool4d", "float2d", "float4d", "padding+bool2d"])
LENGTHS = st.integers(1, 9)
BLOCKS = st.integers(1, 5)       # divides T or not; 5 > T covers one tile


def draw_masks(data, xp, kind, b, h, tq, tk, seed):
    """Keyword masks of ``kind``; bool masks are random, so some rows may be fully masked."""
    kw = {}
    if "padding" in kind:
        kw["key_padding_mask"] = xp.asarray(data.draw(padding_masks(b, tk)))
    if "bool" in kind:
        shape = {"bool2d": (tq, tk), "bool3d": (b * h, tq, tk), "bool4d": (b, h, tq, tk)}[kind.split("+")[-1]]
        kw["attn_mask"] = xp.asarray(np.random.default_rng(seed).random(shape) < 0.3)
    if kind.startswith("float"):
        shape = (tq, tk) if kind == "float2d" else (b, h, tq, tk)
        m = host(randn(xp, shape, seed + 5, scale=2.0))
        m[np.random.default_rng(seed).random(shape) < 0.2] = -np.inf          # -inf entries block, as in torch
        kw["attn_mask"] = xp.asarray(m)
    return kw


def causal_kw(causal):
    return {"is_causal": causal is not None, "causal_alignment": causal or "top_left"}


def qkv(xp, b, h, tq, tk, hs, hv, seed, dtype="float64"):
    return (randn(xp, (b, h, tq, hs), seed, dtype=dtype), randn(xp, (b, h, tk, hs), seed + 1, dtype=dtype),
            randn(xp, (b, h, tk, hv), seed + 2, dtype=dtype))


def assert_same(a, b, tol=1e-12):
    np.testing.assert_allclose(host(a), host(b), rtol=tol, atol=tol)


@given(b=batch, h=heads, hs=head_size, hv=head_size, tq=LENGTHS, tk=LENGTHS, bq=BLOCKS, bk=BLOCKS,
       causal=CAUSAL, kind=MASKS, seed=seeds, data=st.data())
def test_equals_plain_op_outputs_and_gradients(xp, b, h, hs, hv, tq, tk, bq, bk, causal, kind, seed, data):
    q, k, v = qkv(xp, b, h, tq, tk, hs, hv, seed)
    kw = {**draw_masks(data, xp, kind, b, h, tq, tk, seed), **causal_kw(causal)}
    scale = data.draw(st.sampled_from([None, 0.3, -0.3, 0.0]))
    ref, _, ref_cache = sdpa_forward(q, k, v, scale=scale, **kw)
    out, cache = flash_forward(q, k, v, scale=scale, block_q=bq, block_k=bk, **kw)
    assert out.dtype == q.dtype and out.shape == ref.shape
    assert_same(out, ref)
    dout = randn(xp, out.shape, seed + 3)
    for g, r in zip(flash_backward(dout, cache), sdpa_backward(dout, ref_cache)):
        assert g.dtype == q.dtype
        assert_same(g, r)


@given(b=batch, h=heads, hs=head_size, tq=LENGTHS, tk=LENGTHS, bq=BLOCKS, bk=BLOCKS, causal=CAUSAL,
       kind=MASKS, p=st.sampled_from([0.2, 0.6]), seed=seeds, data=st.data())
def test_with_dropout_equals_plain_op_for_one_seed(xp, b, h, hs, tq, tk, bq, bk, causal, kind, p, seed, data):
    """Both drop with the dropout op's counter-based mask at the score's flat index, one seed drawn
    from the generator: for one seed they drop the same entries, whatever the tiles (outputs and
    gradients), and leave the generator in the same state."""
    q, k, v = qkv(xp, b, h, tq, tk, hs, hs, seed)
    kw = {**draw_masks(data, xp, kind, b, h, tq, tk, seed), **causal_kw(causal), "dropout_p": p}
    rng_ref, rng = default_rng(seed, backend_name(xp)), default_rng(seed, backend_name(xp))
    ref, _, ref_cache = sdpa_forward(q, k, v, rng=rng_ref, **kw)
    out, cache = flash_forward(q, k, v, block_q=bq, block_k=bk, rng=rng, **kw)
    assert_same(out, ref)
    dout = randn(xp, out.shape, seed + 3)
    for g, r in zip(flash_backward(dout, cache), sdpa_backward(dout, ref_cache)):
        assert_same(g, r)
    assert_same(rng.random(3), rng_ref.random(3), tol=0)


@given(b=st.integers(1, 2), h=st.integers(1, 2), hs=head_size, tq=st.integers(1, 6), tk=st.integers(1, 6),
       bq=st.integers(1, 4), bk=st.integers(1, 4), causal=CAUSAL, kind=MASKS, seed=seeds, data=st.data())
def test_gradcheck_masks(xp, b, h, hs, tq, tk, bq, bk, causal, kind, seed, data):
    q, k, v = qkv(xp, b, h, tq, tk, hs, 3, seed)
    kw = {**draw_masks(data, xp, kind, b, h, tq, tk, seed), **causal_kw(causal), "block_q": bq, "block_k": bk}
    assert_gradcheck(gradcheck(flash_forward, flash_backward, {"q": q, "k": k, "v": v}, kwargs=kw, seed=seed))


@given(b=st.integers(1, 2), h=st.integers(1, 2), tq=st.integers(1, 6), tk=st.integers(1, 6), bq=st.integers(1, 4),
       bk=st.integers(1, 4), p=st.sampled_from([0.1, 0.5]), causal=CAUSAL, seed=seeds)
def test_gradcheck_dropout_fixed_seed(xp, b, h, tq, tk, bq, bk, p, causal, seed):
    name = backend_name(xp)

    def forward(q, k, v):   # a fresh generator per call: every evaluation draws the same seed, so the same masks
        return flash_forward(q, k, v, dropout_p=p, rng=default_rng(seed, name), block_q=bq, block_k=bk,
                             **causal_kw(causal))
    q, k, v = qkv(xp, b, h, tq, tk, 2, 2, seed)
    assert_gradcheck(gradcheck(forward, flash_backward, {"q": q, "k": k, "v": v}, seed=seed))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_keep_rate_scaling_and_tile_independence(xp, p):
    # With v = I (Tk x Tk) the output is P_drop itself: every entry is 0 or P / (1 - p).
    b, h, tq, tk = 2, 4, 64, 64
    q, k, _ = qkv(xp, b, h, tq, tk, 8, 1, 0)
    eye = xp.asarray(np.broadcast_to(np.eye(tk), (b, h, tk, tk)).copy())
    _, probs, _ = sdpa_forward(q, k, eye, need_weights=True, is_causal=True)
    runs = [flash_forward(q, k, eye, dropout_p=p, rng=default_rng(7, backend_name(xp)), is_causal=True,
                          block_q=bq, block_k=bk)[0] for bq, bk in ((128, 128), (16, 8), (5, 7))]
    for other in runs[1:]:                      # the mask depends on the seed and the index, not the tiles
        assert_same(other, runs[0])
    w, probs = host(runs[0]), host(probs)
    kept = w != 0
    np.testing.assert_allclose(w[kept], probs[kept] / (1 - p), rtol=1e-12)
    n = int((probs > 0).sum())                  # the causal future is 0 either way
    rate = kept.sum() / n
    assert abs(rate - (1 - p)) < 5 * np.sqrt(p * (1 - p) / n), (rate, 1 - p, n)
    assert (kept[:, 0] != kept[:, 1]).any() and (kept[0] != kept[1]).any()      # heads and batches differ
    other_seed, _ = flash_forward(q, k, eye, dropout_p=p, rng=default_rng(8, backend_name(xp)), is_causal=True)
    assert (host(other_seed) != w).any()


def test_dropout_eval_mode_p_one_and_rng_required(xp):
    q, k, v = qkv(xp, 2, 2, 5, 6, 4, 3, 0)
    ref, _, _ = sdpa_forward(q, k, v)
    evald, _ = flash_forward(q, k, v, dropout_p=0.5, training=False, block_q=2, block_k=4)
    assert_same(evald, ref)
    out, cache = flash_forward(q, k, v, dropout_p=1.0, rng=default_rng(0, backend_name(xp)), block_q=2)
    assert not host(out).any()
    assert not any(host(g).any() for g in flash_backward(randn(xp, out.shape, 3), cache))
    with pytest.raises(ValueError, match="dropout with p > 0 in training mode needs rng"):
        flash_forward(q, k, v, dropout_p=0.5)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_fully_masked_rows_zero_output_zero_grads_no_nan(xp, dtype):
    q, k, v = qkv(xp, 2, 2, 3, 5, 4, 4, 0, dtype=dtype)
    mask = np.zeros((3, 5), bool)
    mask[1] = True                                       # query 1 may attend nothing
    pad = np.zeros((2, 5), bool)
    pad[1] = True                                        # and batch 1 has only padding
    kw = {"attn_mask": xp.asarray(mask), "key_padding_mask": xp.asarray(pad), "block_q": 2, "block_k": 2}
    out, cache = flash_forward(q, k, v, **kw)
    dout = randn(xp, out.shape, 3, dtype=dtype)
    dq, dk, dv = flash_backward(dout, cache)
    assert all(a.dtype == q.dtype and np.isfinite(host(a)).all() for a in (out, dq, dk, dv))
    assert not host(out)[:, :, 1].any() and not host(out)[1].any()
    assert not host(dq)[:, :, 1].any() and not any(host(g)[1].any() for g in (dq, dk, dv))
    dout_zeroed = host(dout).copy()
    dout_zeroed[:, :, 1] = 0                             # the masked rows pass nothing to k and v
    _, dk2, dv2 = flash_backward(xp.asarray(dout_zeroed), cache)
    np.testing.assert_array_equal(host(dk), host(dk2))
    np.testing.assert_array_equal(host(dv), host(dv2))


def test_rows_before_the_first_key_bottom_right(xp):
    # Tq > Tk aligned bottom-right: the first Tq - Tk queries see nothing, and whole tiles are skipped.
    q, k, v = qkv(xp, 1, 2, 9, 3, 4, 2, 0)
    out, cache = flash_forward(q, k, v, is_causal=True, causal_alignment="bottom_right", block_q=3, block_k=2)
    ref, _, ref_cache = sdpa_forward(q, k, v, is_causal=True, causal_alignment="bottom_right")
    assert not host(out)[:, :, :6].any() and np.isinf(host(cache.lse)[:, :, :6]).all()
    assert_same(out, ref)
    dout = randn(xp, out.shape, 1)
    for g, r in zip(flash_backward(dout, cache), sdpa_backward(dout, ref_cache)):
        assert_same(g, r)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_scores_of_1e4_stay_finite_and_pick_the_largest(xp, dtype):
    q = xp.asarray(np.full((1, 1, 2, 4), 50.0, dtype))
    k = xp.asarray(np.array([[[[-50.0] * 4, [50.0] * 4, [49.0] * 4]]], dtype))   # q.k = -1e4, 1e4, 9.8e3
    v = randn(xp, (1, 1, 3, 2), 2, dtype=dtype)
    for bk in (1, 2, 3):                                 # the largest score arrives in the first or a later tile
        out, cache = flash_forward(q, k, v, scale=1.0 if dtype == "float16" else 2.0, block_k=bk)
        grads = flash_backward(xp.ones_like(out), cache)
        assert out.dtype == q.dtype and all(np.isfinite(host(a)).all() for a in (out, *grads))
        np.testing.assert_array_equal(host(out), np.broadcast_to(host(v)[:, :, 1:2], out.shape))


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("float16", 1e-2)])
def test_low_precision_against_float64_views_and_no_mutation(xp, dtype, tol):
    q64, k64, v64 = qkv(xp, 2, 3, 7, 9, 8, 4, 0)
    pad = xp.asarray(np.array([[False] * 8 + [True], [False] * 9]))
    kw = {"key_padding_mask": pad, "is_causal": True, "causal_alignment": "bottom_right"}
    ref, _, ref_cache = sdpa_forward(q64, k64, v64, **kw)
    dout64 = randn(xp, ref.shape, 3)
    q = q64.astype(dtype)
    k = xp.ascontiguousarray(k64.swapaxes(-1, -2).astype(dtype)).swapaxes(-1, -2)   # a transposed view
    v = xp.ascontiguousarray(v64.transpose(0, 2, 1, 3).astype(dtype)).transpose(0, 2, 1, 3)  # head-split view
    assert not k.flags.c_contiguous and not v.flags.c_contiguous
    before = [host(a).copy() for a in (q, k, v)]
    out, cache = flash_forward(q, k, v, block_q=3, block_k=4, **kw)
    grads = flash_backward(dout64.astype(dtype), cache)
    assert all(a.dtype == q.dtype for a in (out, *grads)) and cache.lse.dtype == np.float32
    assert all(np.array_equal(host(a), b) for a, b in zip((q, k, v), before))
    np.testing.assert_allclose(host(out).astype(np.float64), host(ref), rtol=tol, atol=tol)
    for g, r in zip(grads, sdpa_backward(dout64, ref_cache)):
        np.testing.assert_allclose(host(g).astype(np.float64), host(r), rtol=tol, atol=tol)


def test_bad_input(xp):
    q, k = randn(xp, (2, 1, 2, 4), 0), randn(xp, (2, 1, 3, 4), 1)
    with pytest.raises(ValueError, match=r"q: expected a 4-d array \(B, H, T, head_size\)"):
        flash_forward(q[0], k, k)
    with pytest.raises(TypeError, match="v: expected a floating-point array"):
        flash_forward(q, k, xp.zeros((2, 1, 3, 4), xp.int32))
    with pytest.raises(TypeError, match="dtype mismatch: q is float64 but k is float32"):
        flash_forward(q, k.astype(xp.float32), k)
    with pytest.raises(ValueError, match=r"v: expected shape \(B, H, Tk, hv\)=\(2, 1, 3, \*\)"):
        flash_forward(q, k, randn(xp, (2, 1, 4, 4), 2))
    with pytest.raises(ValueError, match="attention needs hs >= 1 and Tk >= 1"):
        flash_forward(q, k[:, :, :0], k[:, :, :0])
    with pytest.raises(ValueError, match="need_weights=True: flash attention never forms"):
        flash_forward(q, k, k, need_weights=True)
    for bad in (0, -1, 2.0, True, None):
        with pytest.raises((ValueError, TypeError), match="block_q: expected an int"):
            flash_forward(q, k, k, block_q=bad)
    with pytest.raises(ValueError, match="block_k: expected an int >= 1, got 0"):
        flash_forward(q, k, k, block_k=0)
    with pytest.raises(ValueError, match=r"dropout_p: expected a probability in \[0, 1\]"):
        flash_forward(q, k, k, dropout_p=1.5)
    with pytest.raises(ValueError, match=r"attn_mask: expected shape \(Tq, Tk\)=\(2, 3\) or \(B\*H, Tq, Tk\)"):
        flash_forward(q, k, k, attn_mask=xp.zeros((3, 2), bool))
    with pytest.raises(TypeError, match="attn_mask: expected a bool mask"):
        flash_forward(q, k, k, attn_mask=xp.zeros((2, 3), xp.int64))
    with pytest.raises(ValueError, match=r"key_padding_mask: expected shape \(B, Tk\)=\(2, 3\)"):
        flash_forward(q, k, k, key_padding_mask=xp.zeros((2, 2), bool))
    with pytest.raises(ValueError, match="causal alignment: expected one of"):
        flash_forward(q, k, k, is_causal=True, causal_alignment="bottom-right")
    with pytest.raises(TypeError, match="is_causal: expected a bool"):
        flash_forward(q, k, k, is_causal=1)


# -- memory -----------------------------------------------------------------------------------------
def cache_arrays(cache):
    """Every array reachable from a cache (NamedTuples nest)."""
    found = []
    for field in cache:
        if hasattr(field, "shape") and hasattr(field, "dtype"):
            found.append(field)
        elif isinstance(field, tuple):
            found += cache_arrays(field)
    return found


def test_cache_holds_no_tq_by_tk_array(xp):
    b, h, tq, tk, hs = 2, 2, 96, 80, 4
    q, k, v = qkv(xp, b, h, tq, tk, hs, hs, 0, dtype="float32")
    pad = xp.asarray(np.arange(tk)[None, :] >= np.array([[tk], [tk - 7]]))
    out, cache = flash_forward(q, k, v, key_padding_mask=pad, is_causal=True, dropout_p=0.1,
                               rng=default_rng(0, backend_name(xp)), block_q=16, block_k=16)
    arrays = cache_arrays(cache)
    assert {a.size for a in arrays} == {q.size, k.size, out.size, b * h * tq, b * tk, 2}   # lse, padding, seed draws
    assert all(a.size < tq * tk for a in arrays)
    assert sum(a.nbytes for a in arrays) == q.nbytes + k.nbytes + v.nbytes + out.nbytes + cache.lse.nbytes \
        + pad.nbytes + cache.seed_draws.nbytes
    _, _, plain = sdpa_forward(q, k, v, key_padding_mask=pad, is_causal=True)
    assert max(a.size for a in cache_arrays(plain)) == b * h * tq * tk       # what the flash cache avoids


def traced_peak(fn) -> int:
    """Peak bytes NumPy allocates while ``fn`` runs (NumPy reports its buffers to tracemalloc)."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        fn()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def test_peak_memory_grows_linearly_in_t_numpy():
    # Forward + backward at T, 2T, 4T: flash's growth doubles per doubling of T (linear), plain's quadruples.
    def flash(q, k, v):
        out, cache = flash_forward(q, k, v, is_causal=True, block_q=64, block_k=64)
        flash_backward(out, cache)

    def plain(q, k, v):      # the reference op (the CPU fast path's block temporaries blur the ratio)
        with kernels.disabled():
            out, _, cache = sdpa_forward(q, k, v, is_causal=True)
            sdpa_backward(out, cache)
    for fn, low, high in ((flash, 1.6, 2.4), (plain, 3.6, 4.4)):
        peaks = []
        for t in (256, 512, 1024):
            q, k, v = qkv(np, 1, 2, t, t, 8, 8, 0)
            peaks.append(traced_peak(lambda: fn(q, k, v)))
        growth = (peaks[2] - peaks[1]) / (peaks[1] - peaks[0])
        assert low < growth < high, (fn.__name__, peaks, growth)


# -- multi-head attention and modules with attention="flash" ----------------------------------------
@given(sharing=st.sampled_from(["self", "kv", "none"]), tq=LENGTHS, tk=LENGTHS, causal=CAUSAL,
       bias=st.booleans(), seed=seeds, data=st.data())
def test_multi_head_flash_equals_plain(xp, sharing, tq, tk, causal, bias, seed, data):
    b, e, h = 2, 6, 2
    tk = tq if sharing == "self" else tk
    query = randn(xp, (b, tq, e), seed)
    key = query if sharing == "self" else randn(xp, (b, tk, e), seed + 1)
    value = key if sharing != "none" else randn(xp, (b, tk, e), seed + 2)
    w = [randn(xp, (3 * e, e), seed + 3, scale=0.5), randn(xp, (3 * e,), seed + 4) if bias else None,
         randn(xp, (e, e), seed + 5, scale=0.5), randn(xp, (e,), seed + 6) if bias else None]
    kw = {**draw_masks(data, xp, "padding+bool2d", b, h, tq, tk, seed), **causal_kw(causal), "need_weights": False}
    ref, _, ref_cache = multi_head_attention_forward(query, key, value, h, *w, **kw)
    out, weights, cache = multi_head_attention_forward(query, key, value, h, *w, attention="flash", **kw)
    assert weights is None
    assert_same(out, ref)
    dout = randn(xp, out.shape, seed + 7)
    for g, r in zip(multi_head_attention_backward(dout, cache), multi_head_attention_backward(dout, ref_cache)):
        assert (g is None) == (r is None)
        if g is not None:
            assert_same(g, r)


def test_multihead_attention_module_flash_equals_plain_and_gradchecks(xp):
    kw = dict(dtype=xp.float64, backend=backend_name(xp), rng=3)
    plain, flash = MultiheadAttention(8, 2, **kw), MultiheadAttention(8, 2, attention="flash", **kw)
    x, mem = randn(xp, (2, 5, 8), 0), randn(xp, (2, 7, 8), 1)
    pad = xp.asarray(np.arange(7)[None, :] >= np.array([[7], [4]]))
    results = []
    for m in (plain, flash):                             # self-attention, then cross-attention on its output
        m.zero_grad()
        a, _ = m(x, x, x, need_weights=False, is_causal=True)
        c, _ = m(a, mem, mem, key_padding_mask=pad, need_weights=False)
        grads_c = m.backward(randn(xp, c.shape, 2))
        grads_a = m.backward(grads_c[0] + randn(xp, a.shape, 3))
        results.append((a, c, grads_c[1], grads_a[0]))
    for r, f in zip(*results):
        assert_same(f, r)
    for name, g in plain.grads().items():
        assert_same(flash.grads()[name], g)
    assert_gradcheck(gradcheck_module(flash, {"x": x}, forward=lambda m, x: m(
        x, need_weights=False, is_causal=True)[0], backward=lambda m, d: m.backward(d)[0]))
    with pytest.raises(ValueError, match="need_weights=True: flash attention never forms"):
        flash(x, x, x)
    with pytest.raises(ValueError, match=r"attention: expected one of 'auto', 'plain', 'flash', got 'fast'"):
        MultiheadAttention(8, 2, attention="fast")
    with pytest.raises(ValueError, match=r"attention: expected one of 'auto', 'plain', 'flash', got None"):
        multi_head_attention_forward(x, x, x, 2, plain.in_proj_weight.data, None, plain.out_proj.weight.data,
                                     None, attention=None)


def test_multihead_attention_auto_is_flash_on_cupy_without_weights_else_plain(xp):
    m = MultiheadAttention(8, 2, dtype=xp.float64, backend=backend_name(xp), rng=3)
    assert m.attention == "auto"
    x = randn(xp, (2, 5, 8), 0)
    m(x, need_weights=False)
    assert isinstance(m._saved[-1].attn, FlashAttentionCache) == (backend_name(xp) == "cupy")
    m.backward(randn(xp, (2, 5, 8), 1))
    _, weights = m(x, need_weights=True)                 # weights asked for: plain on every backend
    assert weights is not None and not isinstance(m._saved[-1].attn, FlashAttentionCache)
    m.backward(randn(xp, (2, 5, 8), 1))


def test_gpt_with_flash_attention_equals_plain(xp):
    config = GPTConfig(vocab_size=11, block_size=12, n_layer=2, n_head=2, d_model=8, dropout=0.0)
    models = [GPT(config, dtype=xp.float64, backend=backend_name(xp), rng=5) for _ in range(2)]
    for m in models[1].modules():                        # per module: here every attention of one model
        if isinstance(m, MultiheadAttention):
            m.attention = "flash"
    idx = xp.asarray(np.random.default_rng(0).integers(0, 11, (3, 12)))
    dlogits = randn(xp, (3, 12, 11), 1)
    logits = []
    for m in models:
        logits.append(m(idx))
        m.backward(dlogits)
    assert_same(logits[1], logits[0])
    for name, g in models[0].grads().items():
        assert_same(models[1].grads()[name], g)


def test_bench_flash_sweep_case_matches_plain():
    from npformer import bench
    b = bench.Backend("numpy", 1)
    cfg = dict(bench.QUICK, d=16, H=2)
    flash, plain = bench.flash_sweep_case(cfg, 40), bench.sweep_case(cfg, 40)
    assert bench.fits_memory(flash, b) and flash.name == "flash attention T=40"
    f_calls, p_calls = flash.build(b), plain.build(b)
    np.testing.assert_allclose(f_calls["fwd"]()[0], p_calls["fwd"]()[0], rtol=1e-5, atol=1e-6)
    for f, p in zip(f_calls["bwd"](), p_calls["bwd"]()):
        np.testing.assert_allclose(f, p, rtol=1e-4, atol=1e-5)
