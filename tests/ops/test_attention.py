"""Masks, scaled dot-product attention and multi-head attention: loop references, gradchecks over
shapes and masks (padding, causal in both alignments, additive, dropout), invariants, edge cases."""
import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

from npformer.backend import backend_name, default_rng
from npformer.ops.attention import (scaled_dot_product_attention_backward as sdpa_backward,
                                    scaled_dot_product_attention_forward as sdpa_forward)
from npformer.ops.masks import attention_bias, causal_mask
from npformer.ops.multihead import multi_head_attention_backward, multi_head_attention_forward
from npformer.tools.gradcheck import gradcheck
from tests.helpers import assert_gradcheck, batch, head_size, heads, host, padding_masks, randn, seeds, seq


def test_causal_mask_pictures(xp):
    top = host(causal_mask(2, 4, xp=xp)).astype(int)
    bottom = host(causal_mask(2, 4, alignment="bottom_right", xp=xp)).astype(int)
    assert top.tolist() == [[0, 1, 1, 1], [0, 0, 1, 1]]
    assert bottom.tolist() == [[0, 0, 0, 1], [0, 0, 0, 0]]
    np.testing.assert_array_equal(host(causal_mask(3, 3, xp=xp)),
                                  host(causal_mask(3, 3, alignment="bottom_right", xp=xp)))
    with pytest.raises(ValueError, match="causal alignment must be one of"):
        causal_mask(2, 2, alignment="left")


def reference_attention(q, k, v, blocked, scale):
    """Loops over b, h, i: softmax over the allowed keys; zeros for a row with none."""
    b, h, tq, _ = q.shape
    out = np.zeros((b, h, tq, v.shape[-1]))
    for bi in range(b):
        for hi in range(h):
            for i in range(tq):
                allowed = ~blocked[bi, hi, i]
                if not allowed.any():
                    continue
                s = np.array([q[bi, hi, i] @ k[bi, hi, j] * scale for j in range(k.shape[2])])
                e = np.where(allowed, np.exp(s - s[allowed].max()), 0.0)
                out[bi, hi, i] = (e / e.sum()) @ v[bi, hi]
    return out


@given(b=batch, h=heads, hs=head_size, tq=seq, tk=seq, causal=st.sampled_from([None, "top_left", "bottom_right"]),
       seed=seeds, data=st.data())
def test_attention_matches_loops_and_gradcheck(xp, b, h, hs, tq, tk, causal, seed, data):
    pad = data.draw(padding_masks(b, tk))
    q, k, v = randn(xp, (b, h, tq, hs), seed), randn(xp, (b, h, tk, hs), seed + 1), randn(xp, (b, h, tk, 3), seed + 2)
    kwargs = {"key_padding_mask": xp.asarray(pad), "is_causal": causal is not None,
              "causal_alignment": causal or "top_left"}
    out, _, _ = sdpa_forward(q, k, v, **kwargs)
    blocked = np.broadcast_to(pad[:, None, None, :], (b, h, tq, tk)).copy()
    if causal:
        blocked |= host(causal_mask(tq, tk, alignment=causal, xp=xp))
    np.testing.assert_allclose(host(out), reference_attention(host(q), host(k), host(v), blocked,
                                                              1 / math.sqrt(hs)), rtol=1e-12, atol=1e-13)
    assert_gradcheck(gradcheck(sdpa_forward, sdpa_backward, {"q": q, "k": k, "v": v}, kwargs=kwargs, seed=seed))


@given(b=batch, h=heads, tq=seq, tk=seq, seed=seeds, p=st.sampled_from([0.1, 0.5]),
       per_head=st.booleans())
def test_attention_gradcheck_float_mask_dropout_scale(xp, b, h, tq, tk, seed, p, per_head):
    mask = randn(xp, (b * h, tq, tk) if per_head else (tq, tk), seed + 5)
    name = backend_name(xp)

    def forward(q, k, v):   # a fresh generator each call: the same dropout mask every evaluation
        return sdpa_forward(q, k, v, attn_mask=mask, dropout_p=p, rng=default_rng(seed, name), scale=0.3)
    inputs = {"q": randn(xp, (b, h, tq, 2), seed), "k": randn(xp, (b, h, tk, 2), seed + 1),
              "v": randn(xp, (b, h, tk, 2), seed + 2)}
    assert_gradcheck(gradcheck(forward, sdpa_backward, inputs, seed=seed))


def test_one_free_key_copies_its_value_and_weights_sum_to_one(xp):
    q, k, v = randn(xp, (2, 2, 3, 4), 0), randn(xp, (2, 2, 5, 4), 1), randn(xp, (2, 2, 5, 4), 2)
    pad = np.ones((2, 5), bool)
    pad[0, 3] = pad[1, 0] = False
    out, w, _ = sdpa_forward(q, k, v, key_padding_mask=xp.asarray(pad), need_weights=True)
    np.testing.assert_allclose(host(out)[0], np.broadcast_to(host(v)[0, :, 3:4], (2, 3, 4)), rtol=1e-14)
    np.testing.assert_allclose(host(out)[1], np.broadcast_to(host(v)[1, :, 0:1], (2, 3, 4)), rtol=1e-14)
    _, w, _ = sdpa_forward(q, k, v, need_weights=True, is_causal=True)
    np.testing.assert_allclose(host(w).sum(-1), 1.0, atol=1e-14)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_fully_masked_rows_give_zeros_not_nan(xp, dtype):
    q, k, v = (randn(xp, (1, 2, 3, 4), i, dtype=dtype) for i in range(3))
    mask = np.zeros((3, 3), bool)
    mask[1] = True                                       # query 1 may attend nothing
    out, w, cache = sdpa_forward(q, k, v, attn_mask=xp.asarray(mask), need_weights=True)
    dq, dk, dv = sdpa_backward(xp.ones_like(out), cache)
    assert out.dtype == q.dtype and all(g.dtype == q.dtype for g in (dq, dk, dv))
    assert np.all(host(out)[:, :, 1] == 0) and np.all(host(w)[:, :, 1] == 0) and np.all(host(dq)[:, :, 1] == 0)
    assert all(np.isfinite(host(a)).all() for a in (out, dq, dk, dv))


def test_huge_scores_stay_finite_and_views_work(xp):
    q = randn(xp, (1, 1, 3, 4), 0, scale=1e3)
    k = randn(xp, (1, 1, 4, 3), 1, scale=1e3).swapaxes(-1, -2)   # a non-contiguous view (1, 1, 3, 4)
    v = randn(xp, (1, 1, 3, 4), 2)
    out, _, cache = sdpa_forward(q, k, v)
    grads = sdpa_backward(xp.ones_like(out), cache)
    assert np.isfinite(host(out)).all() and all(np.isfinite(host(g)).all() for g in grads)
    out_c, _, _ = sdpa_forward(q, xp.ascontiguousarray(k), v)
    np.testing.assert_array_equal(host(out), host(out_c))


def test_attention_bias_and_bad_masks(xp):
    bias = attention_bias(2, 1, 2, 3, xp.float16, key_padding_mask=xp.asarray([[False, False, True]] * 2), xp=xp)
    assert bias.dtype == xp.float16 and np.isneginf(host(bias)[..., 2]).all()   # -inf, not -1e9
    q = randn(xp, (2, 1, 2, 4), 0)
    k = randn(xp, (2, 1, 3, 4), 1)
    with pytest.raises(ValueError, match=r"attn_mask: expected shape \(Tq, Tk\)=\(2, 3\)"):
        sdpa_forward(q, k, k, attn_mask=xp.zeros((3, 2), bool))
    with pytest.raises(ValueError, match=r"key_padding_mask: expected shape \(B, Tk\)=\(2, 3\)"):
        sdpa_forward(q, k, k, key_padding_mask=xp.zeros((2, 2), bool))
    with pytest.raises(TypeError, match="attn_mask: expected a bool mask"):
        sdpa_forward(q, k, k, attn_mask=xp.zeros((2, 3), dtype=xp.int64))
    with pytest.raises(ValueError, match=r"k: expected shape \(B, H, Tk, hs\)"):
        sdpa_forward(q, randn(xp, (2, 1, 3, 5), 1), k)
    with pytest.raises(ValueError, match="q: expected a 4-d array"):
        sdpa_forward(q[0], k, k)


def _mha_params(xp, e, seed, bias=True):
    """In the order of the backward's gradients: in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias."""
    return {"in_proj_weight": randn(xp, (3 * e, e), seed, scale=0.5),
            "in_proj_bias": randn(xp, (3 * e,), seed + 2) if bias else None,
            "out_proj_weight": randn(xp, (e, e), seed + 1),
            "out_proj_bias": randn(xp, (e,), seed + 3) if bias else None}


@given(b=batch, tq=seq, tk=seq, h=st.sampled_from([1, 2, 3]), kind=st.sampled_from(["self", "kv", "none"]),
       seed=seeds, data=st.data())
def test_multi_head_gradcheck_self_and_cross(xp, b, tq, tk, h, kind, seed, data):
    e = 2 * h
    params = _mha_params(xp, e, seed)
    if kind == "self":
        tk = tq
    pad = xp.asarray(data.draw(padding_masks(b, tk)))
    fixed = {"num_heads": h, "key_padding_mask": pad, "is_causal": kind == "self"}
    if kind == "self":
        def fwd(x, **p):
            return multi_head_attention_forward(x, x, x, **fixed, **p)

        def bwd(d, c):
            g = multi_head_attention_backward(d, c)
            assert g[1] is None and g[2] is None
            return (g[0],) + g[3:]
        inputs = {"x": randn(xp, (b, tq, e), seed + 9), **params}
    elif kind == "kv":
        def fwd(query, mem, **p):
            return multi_head_attention_forward(query, mem, mem, **fixed, **p)

        def bwd(d, c):
            g = multi_head_attention_backward(d, c)
            assert g[2] is None
            return (g[0], g[1]) + g[3:]
        inputs = {"query": randn(xp, (b, tq, e), seed + 9), "mem": randn(xp, (b, tk, e), seed + 8), **params}
    else:
        def fwd(**kw):
            return multi_head_attention_forward(**kw, **fixed)
        bwd = multi_head_attention_backward
        inputs = {"query": randn(xp, (b, tq, e), seed + 9), "key": randn(xp, (b, tk, e), seed + 8),
                  "value": randn(xp, (b, tk, e), seed + 7), **params}
    fwd.__name__ = f"multi_head_attention[{kind}]"
    assert_gradcheck(gradcheck(fwd, bwd, inputs, seed=seed))


def test_multi_head_equals_per_head_reference_and_weights(xp):
    e, h = 6, 3
    p = _mha_params(xp, e, 0)
    q, kv = randn(xp, (2, 4, e), 1), randn(xp, (2, 5, e), 2)
    out, w, _ = multi_head_attention_forward(q, kv, kv, h, **p, average_attn_weights=False)
    W, bvec = host(p["in_proj_weight"]), host(p["in_proj_bias"])
    Q, K, V = host(q) @ W[:e].T + bvec[:e], host(kv) @ W[e:2 * e].T + bvec[e:2 * e], host(kv) @ W[2 * e:].T + bvec[2 * e:]
    heads = []
    for i in range(h):
        sl = slice(2 * i, 2 * i + 2)
        s = Q[..., sl] @ K[..., sl].swapaxes(-1, -2) / math.sqrt(2)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        np.testing.assert_allclose(host(w)[:, i], a, rtol=1e-12)
        heads.append(a @ V[..., sl])
    ref = np.concatenate(heads, -1) @ host(p["out_proj_weight"]).T + host(p["out_proj_bias"])
    np.testing.assert_allclose(host(out), ref, rtol=1e-12, atol=1e-12)
    _, w_avg, _ = multi_head_attention_forward(q, kv, kv, h, **p)
    np.testing.assert_allclose(host(w_avg), host(w).mean(1), rtol=1e-14)


def test_multi_head_float32_and_bad_input(xp):
    p32 = {k: (None if v is None else v.astype(xp.float32)) for k, v in _mha_params(xp, 4, 0).items()}
    x = randn(xp, (2, 3, 4), 1, dtype="float32")
    out, _, cache = multi_head_attention_forward(x, x, x, 2, **p32)
    assert out.dtype == xp.float32 and all(g is None or g.dtype == xp.float32
                                           for g in multi_head_attention_backward(xp.ones_like(out), cache))
    p = _mha_params(xp, 6, 0)
    y = randn(xp, (2, 3, 6), 1)
    with pytest.raises(ValueError, match="embed_dim 6 is not divisible by num_heads 4"):
        multi_head_attention_forward(y, y, y, 4, **p)
    with pytest.raises(ValueError, match=r"key and value: expected shape \(B, Tk, E\)=\(2, \*, 6\)"):
        multi_head_attention_forward(y, randn(xp, (3, 3, 6), 2), randn(xp, (3, 3, 6), 2), 2, **p)
    with pytest.raises(ValueError, match=r"in_proj_weight: expected shape \(18, 6\)"):
        multi_head_attention_forward(y, y, y, 2, **{**p, "in_proj_weight": randn(xp, (6, 6), 3)})
    with pytest.raises(TypeError, match="dtype mismatch"):
        multi_head_attention_forward(y.astype(xp.float32), y.astype(xp.float32), y.astype(xp.float32), 2, **p)
    with pytest.raises(ValueError, match=r"key_padding_mask: expected shape \(B, Tk\)=\(2, 3\)"):
        multi_head_attention_forward(y, y, y, 2, **p, key_padding_mask=xp.zeros((2, 4), bool))
