"""Scaled dot-product attention: a loop reference, gradchecks over shapes and masks (padding, causal
in both alignments, additive float masks, dropout with a fixed seed, scale), invariants (one free key,
fully masked rows in fp16/32/64, huge scores, views, weights) and every bad input."""
import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

from npformer.backend import backend_name, default_rng
from npformer.ops.attention import (scaled_dot_product_attention_backward as sdpa_backward,
                                    scaled_dot_product_attention_forward as sdpa_forward)
from npformer.tools.gradcheck import gradcheck
from tests.helpers import (NO_TORCH, assert_gradcheck, assert_scores_beyond_float16, batch, head_size, heads, host,
                           padding_masks, randn, seeds, seq)

CAUSAL = st.sampled_from([None, "top_left", "bottom_right"])


def reference_attention(q, k, v, blocked=None, added=None, scale=None):
    """Loops over b, h, i: softmax over the keys not blocked (zeros when none is left), then @ v."""
    b, h, tq, hs = q.shape
    tk = k.shape[2]
    scale = 1 / math.sqrt(hs) if scale is None else scale
    out, probs = np.zeros((b, h, tq, v.shape[-1])), np.zeros((b, h, tq, tk))
    for bi in range(b):
        for hi in range(h):
            for i in range(tq):
                allowed = [j for j in range(tk) if blocked is None or not blocked[bi, hi, i, j]]
                if not allowed:
                    continue
                s = {j: float(np.dot(q[bi, hi, i], k[bi, hi, j])) * scale
                     + (0.0 if added is None else added[bi, hi, i, j]) for j in allowed}
                top = max(s.values())
                e = {j: math.exp(s[j] - top) for j in allowed}
                z = sum(e.values())
                for j in allowed:
                    probs[bi, hi, i, j] = e[j] / z
                    out[bi, hi, i] += e[j] / z * v[bi, hi, j]
    return out, probs


def blocked_from(b, h, tq, tk, pad=None, causal=None, mask=None):
    """The (B, H, Tq, Tk) bool 'may not attend' of the masks, by explicit comparison of indices."""
    blocked = np.zeros((b, h, tq, tk), bool)
    for bi, hi, i, j in np.ndindex(b, h, tq, tk):
        shift = 0 if causal == "top_left" else tk - tq
        blocked[bi, hi, i, j] = ((pad is not None and pad[bi, j]) or (causal is not None and j > i + shift)
                                 or (mask is not None and mask[i, j]))
    return blocked


@given(b=batch, h=heads, hs=head_size, tq=seq, tk=seq, causal=CAUSAL, seed=seeds, data=st.data())
def test_matches_loops_and_gradcheck_padding_causal(xp, b, h, hs, tq, tk, causal, seed, data):
    pad = data.draw(padding_masks(b, tk))
    q, k, v = randn(xp, (b, h, tq, hs), seed), randn(xp, (b, h, tk, hs), seed + 1), randn(xp, (b, h, tk, 3), seed + 2)
    kwargs = {"key_padding_mask": xp.asarray(pad), "is_causal": causal is not None,
              "causal_alignment": causal or "top_left"}
    out, w, _ = sdpa_forward(q, k, v, need_weights=True, **kwargs)
    ref, probs = reference_attention(host(q), host(k), host(v), blocked_from(b, h, tq, tk, pad, causal))
    np.testing.assert_allclose(host(out), ref, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(host(w), probs, rtol=1e-12, atol=1e-14)
    assert_gradcheck(gradcheck(sdpa_forward, sdpa_backward, {"q": q, "k": k, "v": v}, kwargs=kwargs, seed=seed))


@given(b=batch, h=heads, hs=head_size, tq=seq, tk=seq, seed=seeds, layout=st.sampled_from(["2d", "3d", "4d"]),
       scale=st.sampled_from([None, 0.3, 2.0, -0.3, 0.0]))
def test_matches_loops_and_gradcheck_float_mask_and_scale(xp, b, h, hs, tq, tk, seed, layout, scale):
    shape = {"2d": (tq, tk), "3d": (b * h, tq, tk), "4d": (b, h, tq, tk)}[layout]
    mask = randn(xp, shape, seed + 5, scale=2.0)
    added = np.broadcast_to(host(mask).reshape((b, h, tq, tk) if layout != "2d" else (tq, tk)), (b, h, tq, tk))
    q, k, v = randn(xp, (b, h, tq, hs), seed), randn(xp, (b, h, tk, hs), seed + 1), randn(xp, (b, h, tk, 2), seed + 2)
    out, _, _ = sdpa_forward(q, k, v, attn_mask=mask, scale=scale)
    ref, _ = reference_attention(host(q), host(k), host(v), added=added, scale=scale)
    np.testing.assert_allclose(host(out), ref, rtol=1e-12, atol=1e-13)
    assert_gradcheck(gradcheck(sdpa_forward, sdpa_backward, {"q": q, "k": k, "v": v},
                               kwargs={"attn_mask": mask, "scale": scale}, seed=seed))


@given(b=batch, h=heads, tq=seq, tk=seq, seed=seeds, p=st.sampled_from([0.1, 0.5]), causal=CAUSAL)
def test_gradcheck_dropout_fixed_seed(xp, b, h, tq, tk, seed, p, causal):
    name = backend_name(xp)

    def forward(q, k, v):   # a fresh generator per call: every evaluation draws the same dropout mask
        return sdpa_forward(q, k, v, dropout_p=p, rng=default_rng(seed, name), is_causal=causal is not None,
                            causal_alignment=causal or "top_left", need_weights=True)
    inputs = {"q": randn(xp, (b, h, tq, 2), seed), "k": randn(xp, (b, h, tk, 2), seed + 1),
              "v": randn(xp, (b, h, tk, 2), seed + 2)}
    assert_gradcheck(gradcheck(forward, sdpa_backward, inputs, seed=seed))
    # The weights returned are the ones after dropout (torch's convention): 0 or P / (1 - p), and out = W v.
    out, w, _ = forward(**inputs)
    _, probs = reference_attention(*(host(a) for a in inputs.values()),
                                   blocked=blocked_from(b, h, tq, tk, causal=causal))
    kept = host(w) != 0
    np.testing.assert_allclose(host(w)[kept], probs[kept] / (1 - p), rtol=1e-12)
    np.testing.assert_allclose(host(out), host(w) @ host(inputs["v"]), rtol=1e-12, atol=1e-14)


def test_dropout_eval_mode_and_p_one(xp):
    q, k, v = randn(xp, (2, 2, 3, 4), 0), randn(xp, (2, 2, 5, 4), 1), randn(xp, (2, 2, 5, 4), 2)
    plain, _, _ = sdpa_forward(q, k, v)
    evald, _, _ = sdpa_forward(q, k, v, dropout_p=0.5, training=False)      # no rng needed in eval
    np.testing.assert_array_equal(host(plain), host(evald))
    out, w, cache = sdpa_forward(q, k, v, dropout_p=1.0, rng=default_rng(0, backend_name(xp)), need_weights=True)
    assert not host(out).any() and not host(w).any()
    assert not any(host(g).any() for g in sdpa_backward(randn(xp, out.shape, 3), cache))


def test_one_free_key_copies_its_value_row(xp):
    q, k, v = randn(xp, (2, 2, 3, 4), 0), randn(xp, (2, 2, 5, 4), 1), randn(xp, (2, 2, 5, 6), 2)
    pad = np.ones((2, 5), bool)
    pad[0, 3] = pad[1, 0] = False
    out, w, _ = sdpa_forward(q, k, v, key_padding_mask=xp.asarray(pad), need_weights=True)
    np.testing.assert_array_equal(host(out)[0], np.broadcast_to(host(v)[0, :, 3:4], (2, 3, 6)))
    np.testing.assert_array_equal(host(out)[1], np.broadcast_to(host(v)[1, :, 0:1], (2, 3, 6)))
    np.testing.assert_array_equal(host(w)[0, ..., 3], 1.0)


@given(b=batch, h=heads, tq=seq, tk=seq, causal=CAUSAL, seed=seeds, data=st.data())
def test_weights_sum_to_one_except_fully_masked_rows(xp, b, h, tq, tk, causal, seed, data):
    mask = np.array(data.draw(st.lists(st.booleans(), min_size=tq * tk, max_size=tq * tk))).reshape(tq, tk)
    q, k, v = randn(xp, (b, h, tq, 3), seed), randn(xp, (b, h, tk, 3), seed + 1), randn(xp, (b, h, tk, 3), seed + 2)
    _, w, _ = sdpa_forward(q, k, v, attn_mask=xp.asarray(mask), is_causal=causal is not None,
                           causal_alignment=causal or "top_left", need_weights=True)
    empty = blocked_from(b, h, tq, tk, causal=causal, mask=mask).all(-1)
    np.testing.assert_allclose(host(w).sum(-1), np.where(empty, 0.0, 1.0), rtol=0, atol=1e-14)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_fully_masked_rows_zero_output_zero_grads_no_nan(xp, dtype):
    q, k, v = randn(xp, (2, 2, 3, 4), 0, dtype=dtype), randn(xp, (2, 2, 5, 4), 1, dtype=dtype), \
        randn(xp, (2, 2, 5, 4), 2, dtype=dtype)
    mask = np.zeros((3, 5), bool)
    mask[1] = True                                       # query 1 may attend nothing
    pad = np.zeros((2, 5), bool)
    pad[1] = True                                        # and batch 1 has only padding
    kwargs = {"attn_mask": xp.asarray(mask), "key_padding_mask": xp.asarray(pad), "need_weights": True}
    out, w, cache = sdpa_forward(q, k, v, **kwargs)
    dout = randn(xp, out.shape, 3, dtype=dtype)
    dq, dk, dv = sdpa_backward(dout, cache)
    assert all(a.dtype == q.dtype and np.isfinite(host(a)).all() for a in (out, w, dq, dk, dv))
    assert not host(out)[:, :, 1].any() and not host(out)[1].any() and not host(w)[:, :, 1].any()
    assert not host(dq)[:, :, 1].any() and not any(host(g)[1].any() for g in (dq, dk, dv))
    # the masked rows pass nothing to k and v: their upstream gradient does not matter
    dout_zeroed = host(dout).copy()
    dout_zeroed[:, :, 1] = 0
    _, dk2, dv2 = sdpa_backward(xp.asarray(dout_zeroed), cache)
    np.testing.assert_array_equal(host(dk), host(dk2))
    np.testing.assert_array_equal(host(dv), host(dv2))


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_scores_of_1e4_stay_finite_and_pick_the_largest(xp, dtype):
    q = xp.asarray(np.full((1, 1, 2, 4), 50.0, dtype))
    k = xp.asarray(np.array([[[[50.0] * 4, [-50.0] * 4, [49.0] * 4]]], dtype))   # q.k = 1e4, -1e4, 9.8e3
    v = randn(xp, (1, 1, 3, 2), 2, dtype=dtype)
    out, _, cache = sdpa_forward(q, k, v, scale=1.0 if dtype == "float16" else 2.0)  # f16 max: 65504
    grads = sdpa_backward(xp.ones_like(out), cache)
    assert out.dtype == q.dtype and all(np.isfinite(host(a)).all() for a in (out, *grads))
    np.testing.assert_array_equal(host(out), np.broadcast_to(host(v)[:, :, 0:1], out.shape))


def test_float32_preserved_views_and_no_mutation(xp):
    q32 = randn(xp, (2, 3, 4, 5), 0, dtype="float32")
    k32 = randn(xp, (2, 3, 5, 6), 1, dtype="float32").swapaxes(-1, -2)    # a transposed view (2, 3, 6, 5)
    v32 = randn(xp, (2, 6, 3, 4), 2, dtype="float32").transpose(0, 2, 1, 3)   # a head-split view (2, 3, 6, 4)
    assert not k32.flags.c_contiguous and not v32.flags.c_contiguous
    before = [host(a).copy() for a in (q32, k32, v32)]
    pad = xp.asarray(np.array([[False] * 5 + [True], [False] * 6]))
    out, w, cache = sdpa_forward(q32, k32, v32, key_padding_mask=pad, is_causal=True, need_weights=True)
    dout = randn(xp, out.shape, 3, dtype="float32")
    grads = sdpa_backward(dout, cache)
    assert all(a.dtype == xp.float32 for a in (out, w, *grads))
    assert all(np.array_equal(host(a), b) for a, b in zip((q32, k32, v32), before))
    c_out, _, c_cache = sdpa_forward(*(xp.ascontiguousarray(a) for a in (q32, k32, v32)),
                                     key_padding_mask=pad, is_causal=True)
    np.testing.assert_allclose(host(out), host(c_out), rtol=1e-6, atol=1e-6)
    for g, c in zip(grads, sdpa_backward(dout, c_cache)):
        np.testing.assert_allclose(host(g), host(c), rtol=1e-5, atol=1e-6)
    w[...] = 7.0                                         # writing to the returned weights leaves the cache alone
    for g, c in zip(grads, sdpa_backward(dout, cache)):
        np.testing.assert_array_equal(host(g), host(c))


def test_large_float32_blocked_softmax_matches_float64(xp):
    """Scores big enough for several row blocks (npformer.backend.blocks), causal, with dropout
    and a fully masked row: float32 against the same computation in float64."""
    q, k, v = (randn(xp, (2, 3, 200, 8), s, scale=2.0) for s in (0, 1, 2))
    pad = np.zeros((2, 200), bool)
    pad[1, :5] = True                                    # with top-left causal, rows 0-4 of batch 1 see nothing
    dout = randn(xp, (2, 3, 200, 8), 3)
    res = {}
    for dtype in ("float32", "float64"):
        args = [a.astype(dtype) for a in (q, k, v)]
        out, _, cache = sdpa_forward(*args, key_padding_mask=xp.asarray(pad), is_causal=True, dropout_p=0.2,
                                     rng=default_rng(5, backend_name(xp)))
        res[dtype] = [host(a) for a in (out, *sdpa_backward(dout.astype(dtype), cache))]
    assert all(a.dtype == np.float32 for a in res["float32"])
    assert np.all(res["float32"][0][1, :, :5] == 0) and all(np.isfinite(a).all() for a in res["float32"])
    for a32, a64 in zip(res["float32"], res["float64"]):
        np.testing.assert_allclose(a32, a64, rtol=1e-4, atol=1e-5 * np.abs(a64).max())


def test_against_torch_functional(xp):
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    q, k, v = (host(randn(xp, (2, 3, t, 4), s)) for s, t in ((0, 3), (1, 5), (2, 5)))
    pad = np.zeros((2, 5), bool)
    pad[0, 4] = True
    out, _, _ = sdpa_forward(*(xp.asarray(a) for a in (q, k, v)), key_padding_mask=xp.asarray(pad),
                             is_causal=True, causal_alignment="bottom_right", scale=0.4)
    blocked = pad[:, None, None, :] | np.triu(np.ones((3, 5), bool), k=1 + 5 - 3)
    ref = torch.nn.functional.scaled_dot_product_attention(   # torch's bool mask: True = MAY attend
        *(torch.from_numpy(a) for a in (q, k, v)), attn_mask=torch.from_numpy(~blocked), scale=0.4)
    np.testing.assert_allclose(host(out), ref.numpy(), rtol=1e-12, atol=1e-13)


def test_bad_input(xp):
    q, k = randn(xp, (2, 1, 2, 4), 0), randn(xp, (2, 1, 3, 4), 1)
    with pytest.raises(ValueError, match=r"q: expected a 4-d array \(B, H, T, head_size\)"):
        sdpa_forward(q[0], k, k)
    with pytest.raises(TypeError, match="v: expected a floating-point array"):
        sdpa_forward(q, k, xp.zeros((2, 1, 3, 4), xp.int32))
    with pytest.raises(TypeError, match="k: expected a numpy or cupy array, got list"):
        sdpa_forward(q, host(k).tolist(), k)
    with pytest.raises(TypeError, match="dtype mismatch: q is float64 but k is float32"):
        sdpa_forward(q, k.astype(xp.float32), k)
    with pytest.raises(ValueError, match=r"k: expected shape \(B, H, Tk, hs\)=\(2, 1, \*, 4\)"):
        sdpa_forward(q, randn(xp, (2, 1, 3, 5), 1), k)
    with pytest.raises(ValueError, match=r"k: expected shape \(B, H, Tk, hs\)=\(2, 1, \*, 4\)"):
        sdpa_forward(q, randn(xp, (1, 1, 3, 4), 1), k)
    with pytest.raises(ValueError, match=r"v: expected shape \(B, H, Tk, hv\)=\(2, 1, 3, \*\)"):
        sdpa_forward(q, k, randn(xp, (2, 1, 4, 4), 2))
    with pytest.raises(ValueError, match="attention needs hs >= 1 and Tk >= 1"):
        sdpa_forward(q, k[:, :, :0], k[:, :, :0])
    with pytest.raises(ValueError, match="scale: expected a finite number, got nan"):
        sdpa_forward(q, k, k, scale=float("nan"))
    with pytest.raises(ValueError, match=r"dropout_p: expected a probability in \[0, 1\]"):
        sdpa_forward(q, k, k, dropout_p=1.5)
    with pytest.raises(ValueError, match="dropout with p > 0 in training mode needs rng"):
        sdpa_forward(q, k, k, dropout_p=0.5)
    with pytest.raises(ValueError, match=r"attn_mask: expected shape \(Tq, Tk\)=\(2, 3\) or \(B\*H, Tq, Tk\)"):
        sdpa_forward(q, k, k, attn_mask=xp.zeros((3, 2), bool))
    with pytest.raises(TypeError, match="attn_mask: expected a bool mask"):
        sdpa_forward(q, k, k, attn_mask=xp.zeros((2, 3), xp.int64))
    with pytest.raises(ValueError, match=r"key_padding_mask: expected shape \(B, Tk\)=\(2, 3\)"):
        sdpa_forward(q, k, k, key_padding_mask=xp.zeros((2, 2), bool))
    with pytest.raises(ValueError, match="causal alignment: expected one of"):
        sdpa_forward(q, k, k, is_causal=True, causal_alignment="bottom-right")


@pytest.mark.parametrize("op", ["plain", "flash"])
def test_float16_scores_do_not_overflow_where_the_scaled_scores_fit(xp, op):
    """|q| = |k| = 100, hs = 8: q k^T = 80,000 is inf in float16, the scaled score 28,284 fits (as in
    PyTorch, whose SDPA scales first). The output matches the float32 computation rounded to float16."""
    from npformer.ops.flash_attention import flash_attention_forward
    b, h, t, hs = 1, 2, 3, 8
    q = xp.full((b, h, t, hs), 100.0, dtype=xp.float16)
    k = xp.full((b, h, t, hs), 100.0, dtype=xp.float16)
    v = randn(xp, (b, h, t, hs), 0, "float16")
    fwd = (lambda *a: sdpa_forward(*a)[0]) if op == "plain" else (lambda *a: flash_attention_forward(*a)[0])
    out = fwd(q, k, v)
    ref = fwd(q.astype(xp.float32), k.astype(xp.float32), v.astype(xp.float32))
    assert out.dtype == xp.float16 and bool(xp.isfinite(out).all())
    np.testing.assert_allclose(host(out).astype(np.float64), host(ref), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("op", ["plain", "flash"])
@pytest.mark.parametrize("path", ["fast", "reference"])
def test_float16_with_scores_beyond_float16_is_finite_and_within_its_rounding(xp, op, path):
    """Scores of 1e8 in float16 (tests.helpers.assert_scores_beyond_float16 says what holds and why)."""
    from npformer import kernels
    from npformer.ops import flash_attention
    forward, backward = {"plain": (sdpa_forward, sdpa_backward),
                         "flash": (flash_attention.flash_attention_forward,
                                   flash_attention.flash_attention_backward)}[op]
    with kernels.disabled() if path == "reference" else kernels.disabled("numba"):
        assert_scores_beyond_float16(xp, forward, backward)
