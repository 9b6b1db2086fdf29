"""Multi-head attention: a per-head loop reference, gradchecks of every input and parameter for the
self-attention op (the packed projection) and the general op (one array as key and value, or three),
with masks and dropout; self-attention equals the general op on copies with summed gradients; equal
arrays give equal results whether or not they are one object; incremental decoding with past keys
and values; weights; dtypes; PyTorch parity; bad input."""
import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

from npformer.backend import backend_name, default_rng
from npformer.ops.multihead import multi_head_attention_backward as mha_backward
from npformer.ops.multihead import multi_head_attention_forward as mha_forward
from npformer.ops.multihead import self_attention_backward, self_attention_forward, split_heads
from npformer.tools.gradcheck import gradcheck
from tests.helpers import NO_TORCH, assert_gradcheck, batch, host, padding_masks, randn, seeds, seq

PARAM_NAMES = ("in_proj_weight", "in_proj_bias", "out_proj_weight", "out_proj_bias")


def make_params(xp, e, seed, bias=True, dtype="float64"):
    """In the order of the backward's parameter gradients."""
    return {"in_proj_weight": randn(xp, (3 * e, e), seed, scale=0.5, dtype=dtype),
            "in_proj_bias": randn(xp, (3 * e,), seed + 1, dtype=dtype) if bias else None,
            "out_proj_weight": randn(xp, (e, e), seed + 2, dtype=dtype),
            "out_proj_bias": randn(xp, (e,), seed + 3, dtype=dtype) if bias else None}


def reference_mha(query, key, value, h, p, blocked=None):
    """Plain numpy, one head and one query at a time; returns (out (B, Tq, E), weights (B, H, Tq, Tk))."""
    w, bias = p["in_proj_weight"], p["in_proj_bias"]
    b, tq, e = query.shape
    tk, hs = key.shape[1], e // h
    proj = [x @ w[i * e:(i + 1) * e].T + (0 if bias is None else bias[i * e:(i + 1) * e])
            for i, x in enumerate((query, key, value))]
    concat, weights = np.zeros((b, tq, e)), np.zeros((b, h, tq, tk))
    for bi in range(b):
        for hd in range(h):
            cols = slice(hd * hs, (hd + 1) * hs)
            for i in range(tq):
                allowed = [j for j in range(tk) if blocked is None or not blocked[bi, i, j]]
                if not allowed:
                    continue
                s = np.array([proj[0][bi, i, cols] @ proj[1][bi, j, cols] / math.sqrt(hs) for j in allowed])
                a = np.exp(s - s.max())
                a /= a.sum()
                weights[bi, hd, i, allowed] = a
                concat[bi, i, cols] = a @ proj[2][bi, allowed][:, cols]
    out = concat @ p["out_proj_weight"].T + (0 if p["out_proj_bias"] is None else p["out_proj_bias"])
    return out, weights


def _blocked(pad, tq, causal):
    b, tk = pad.shape
    shift = 0 if causal == "top_left" else tk - tq
    return np.array([[[pad[bi, j] or (causal is not None and j > i + shift) for j in range(tk)]
                      for i in range(tq)] for bi in range(b)])


@given(b=batch, tq=seq, tk=seq, h=st.integers(1, 3), hs=st.integers(1, 2), kind=st.sampled_from(["self", "kv", "none"]),
       bias=st.booleans(), causal=st.sampled_from([None, "top_left", "bottom_right"]),
       dropout=st.sampled_from([0.0, 0.3]), seed=seeds, data=st.data())
def test_reference_and_gradcheck_every_input_and_parameter(xp, b, tq, tk, h, hs, kind, bias, causal, dropout,
                                                            seed, data):
    e = h * hs
    tk = tq if kind == "self" else tk
    params = make_params(xp, e, seed, bias)
    pad = data.draw(padding_masks(b, tk))
    fixed = {"num_heads": h, "key_padding_mask": xp.asarray(pad), "is_causal": causal is not None,
             "causal_alignment": causal or "top_left", "dropout_p": dropout}
    name = backend_name(xp)

    def call(query, key, value, **p):   # a fresh generator per call: the same dropout mask each time
        p = {"in_proj_bias": None, "out_proj_bias": None, **p}   # absent biases are not differentiated
        if kind == "self":
            return self_attention_forward(query, **fixed, **p, rng=default_rng(seed, name))
        return mha_forward(query, key, value, **fixed, **p, rng=default_rng(seed, name))

    x, mem, val = randn(xp, (b, tq, e), seed + 9), randn(xp, (b, tk, e), seed + 8), randn(xp, (b, tk, e), seed + 7)
    if kind == "self":
        def fwd(x, **p):
            return call(x, None, None, **p)
        inputs, args = {"x": x}, (x, x, x)
    elif kind == "kv":
        def fwd(query, mem, **p):
            return call(query, mem, mem, **p)
        inputs, args = {"query": x, "mem": mem}, (x, mem, mem)
    else:
        fwd, inputs, args = call, {"query": x, "key": mem, "value": val}, (x, mem, val)

    def bwd(d, cache):
        if kind == "self":
            dx, *params = self_attention_backward(d, cache)
            grads = (dx,)
        else:
            dq, dk, dv, *params = mha_backward(d, cache)
            grads = (dq, dk + dv) if kind == "kv" else (dq, dk, dv)   # mem was key and value: the sum
        assert (params[1] is None) == (params[3] is None) == (not bias)
        return grads + tuple(a for a in params if a is not None)
    fwd.__name__ = f"multi_head_attention[{kind}]"
    if dropout == 0.0:
        out, w, _ = fwd(**inputs, **params, average_attn_weights=False)
        ref, ref_w = reference_mha(*(host(a) for a in args), h, {k: None if v is None else host(v)
                                                                 for k, v in params.items()}, _blocked(pad, tq, causal))
        np.testing.assert_allclose(host(out), ref, rtol=1e-11, atol=1e-12)
        np.testing.assert_allclose(host(w), ref_w, rtol=1e-11, atol=1e-13)
    present = {k: v for k, v in params.items() if v is not None}
    assert_gradcheck(gradcheck(fwd, bwd, {**inputs, **present}, seed=seed))


def test_self_attention_is_the_general_op_on_copies_with_summed_gradients(xp):
    b, t, e, h = 2, 4, 6, 3
    p = make_params(xp, e, 0)
    x = randn(xp, (b, t, e), 1)
    pad = np.zeros((b, t), bool)
    pad[1, 1] = True
    kw = {"key_padding_mask": xp.asarray(pad), "need_weights": True, "is_causal": True}
    out, w, cache = self_attention_forward(x, h, **p, **kw)
    out_sep, w_sep, cache_sep = mha_forward(x.copy(), x.copy(), x.copy(), h, **p, **kw)
    np.testing.assert_allclose(host(out), host(out_sep), rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(host(w), host(w_sep), rtol=1e-13, atol=1e-15)
    dout = randn(xp, out.shape, 3)
    dx, *params = self_attention_backward(dout, cache)
    dq, dk, dv, *params_sep = mha_backward(dout, cache_sep)
    np.testing.assert_allclose(host(dx), host(dq + dk + dv), rtol=1e-12, atol=1e-13)
    for a, c in zip(params, params_sep):
        np.testing.assert_allclose(host(a), host(c), rtol=1e-12, atol=1e-13)


def test_one_array_or_equal_copies_give_the_same_results(xp):
    """No branch on object identity: CuPy's asarray makes a new object per call, so equal arrays must
    take the same path as one array passed twice (this differed on a GPU before)."""
    b, t, s_len, e, h = 2, 3, 5, 6, 2
    p = make_params(xp, e, 0)
    q, mem = randn(xp, (b, t, e), 1), randn(xp, (b, s_len, e), 2)
    dout = randn(xp, (b, t, e), 3)
    once = mha_forward(q, mem, mem, h, **p)
    twice = mha_forward(q, mem.copy(), xp.asarray(mem.copy()), h, **p)
    for a, c in zip(once[:2], twice[:2]):
        np.testing.assert_array_equal(host(a), host(c))
    for a, c in zip(mha_backward(dout, once[2]), mha_backward(dout, twice[2])):
        np.testing.assert_array_equal(host(a), host(c))


@pytest.mark.parametrize("causal", [False, True])
def test_past_keys_and_values_give_the_last_rows_of_the_full_attention(xp, causal):
    """Incremental decoding: positions [0, Tp) projected earlier, Tnew new queries aligned bottom-right."""
    b, t, tp, e, h = 2, 5, 3, 6, 2
    p = make_params(xp, e, 0)
    x = randn(xp, (b, t, e), 1)
    full, _, full_cache = self_attention_forward(x, h, **p, is_causal=causal, causal_alignment="bottom_right")
    _, _, past_cache = self_attention_forward(x[:, :tp], h, **p, is_causal=causal)
    pk, pv = past_cache.attn.k, past_cache.attn.v                                 # (B, H, Tp, hs)
    new, _, cache = self_attention_forward(x[:, tp:], h, **p, past_key=pk, past_value=pv, is_causal=causal,
                                           causal_alignment="bottom_right")
    np.testing.assert_allclose(host(new), host(full[:, tp:]), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(host(cache.attn.k), host(full_cache.attn.k), rtol=1e-13, atol=1e-14)
    # the past is a constant: gradients for the new positions and the parameters, checked numerically
    kw = dict(past_key=pk, past_value=pv, is_causal=causal, causal_alignment="bottom_right", num_heads=h)
    assert_gradcheck(gradcheck(self_attention_forward, self_attention_backward,
                               {"x": x[:, tp:].copy(), **p}, kwargs=kw, label="self-attention with a past"))
    # cross-attention over a memory projected on an earlier call: key = value = None
    mem = randn(xp, (b, 4, e), 2)
    ref, _, ref_cache = mha_forward(x, mem, mem, h, **p)
    got, _, got_cache = mha_forward(x, None, None, h, **p, past_key=ref_cache.attn.k, past_value=ref_cache.attn.v)
    np.testing.assert_allclose(host(got), host(ref), rtol=1e-13, atol=1e-14)
    dq, dk, dv, *_ = mha_backward(randn(xp, got.shape, 4), got_cache)
    assert dk is None and dv is None and dq.shape == x.shape
    head = split_heads(x, h)
    assert head.shape == (b, h, t, e // h)


def test_weights_averaged_per_head_none_and_after_dropout(xp):
    e, h = 6, 3
    p = make_params(xp, e, 0)
    q, kv = randn(xp, (2, 4, e), 1), randn(xp, (2, 5, e), 2)
    _, w_heads, _ = mha_forward(q, kv, kv, h, **p, average_attn_weights=False)
    _, w_avg, _ = mha_forward(q, kv, kv, h, **p)
    assert w_heads.shape == (2, h, 4, 5) and w_avg.shape == (2, 4, 5)
    np.testing.assert_allclose(host(w_avg), host(w_heads).mean(1), rtol=1e-14)
    np.testing.assert_allclose(host(w_avg).sum(-1), 1.0, rtol=0, atol=1e-14)
    assert mha_forward(q, kv, kv, h, **p, need_weights=False)[1] is None
    # With dropout the weights are those actually applied to V (as torch): out = merge(W_h V_h) W_o^T + b_o.
    out, w, _ = mha_forward(q, kv, kv, h, **p, dropout_p=0.4, rng=default_rng(1, backend_name(xp)),
                            average_attn_weights=False)
    wi, bi = host(p["in_proj_weight"]), host(p["in_proj_bias"])
    v = (host(kv) @ wi[2 * e:].T + bi[2 * e:]).reshape(2, 5, h, 2).transpose(0, 2, 1, 3)
    heads = (host(w) @ v).transpose(0, 2, 1, 3).reshape(2, 4, e)
    np.testing.assert_allclose(host(out), heads @ host(p["out_proj_weight"]).T + host(p["out_proj_bias"]),
                               rtol=1e-12, atol=1e-13)
    kept = host(w) != 0
    assert not kept.all()                                # some weights were dropped ...
    np.testing.assert_allclose(host(w)[kept], host(w_heads)[kept] / (1 - 0.4), rtol=1e-13)   # ... the rest rescaled


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_fully_masked_rows_and_dtype_preserved(xp, dtype):
    e, h = 4, 2
    p = make_params(xp, e, 0, dtype=dtype)
    x = randn(xp, (2, 3, e), 1, dtype=dtype)
    mem = randn(xp, (2, 5, e), 2, dtype=dtype)[:, ::-1]                         # a reversed (strided) view
    mask = np.zeros((3, 5), bool)
    mask[2] = True                                                              # query 2 may attend nothing
    before = [host(a).copy() for a in (x, mem)]
    out, w, cache = mha_forward(x, mem, mem, h, **p, attn_mask=xp.asarray(mask))
    grads = mha_backward(randn(xp, out.shape, 3, dtype=dtype), cache)
    present = [g for g in grads if g is not None]
    assert all(a.dtype == x.dtype and np.isfinite(host(a)).all() for a in (out, w, *present))
    np.testing.assert_array_equal(host(out)[:, 2], np.broadcast_to(host(p["out_proj_bias"]), (2, e)))
    assert not host(w)[:, 2].any() and not host(grads[0])[:, 2].any()
    assert all(np.array_equal(host(a), bf) for a, bf in zip((x, mem), before))
    if dtype == "float64":
        c_out, _, _ = mha_forward(x, xp.ascontiguousarray(mem), xp.ascontiguousarray(mem), h, **p,
                                  attn_mask=xp.asarray(mask))
        np.testing.assert_allclose(host(out), host(c_out), rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("self_attention", [True, False])
def test_against_torch_multihead_attention(xp, self_attention):
    """Both ops against torch; one array fed as query, key and value to the general op gives torch's
    input gradient as the sum of the three (torch sums them inside autograd)."""
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    e, h, b, tq, tk = 6, 3, 2, 4, 4 if self_attention else 5
    p = {k: host(v) for k, v in make_params(xp, e, 0).items()}
    x, mem = host(randn(xp, (b, tq, e), 1)), host(randn(xp, (b, tk, e), 2))
    pad = np.zeros((b, tk), bool)
    pad[1, -1] = True
    mask = np.zeros((tq, tk), bool)
    mask[0, 1] = True
    dout = host(randn(xp, (b, tq, e), 3))
    kv = x if self_attention else mem
    dev = {k: xp.asarray(v) for k, v in p.items()}
    masks = dict(attn_mask=xp.asarray(mask), key_padding_mask=xp.asarray(pad))
    out, w, cache = mha_forward(*(xp.asarray(a) for a in (x, kv, kv)), h, **dev, **masks)
    dq, dk, dv, *params = (host(g) for g in mha_backward(xp.asarray(dout), cache))
    grads = ([dq + dk + dv] if self_attention else [dq, dk + dv]) + params
    if self_attention:                                   # and the packed op: the same numbers
        out_s, w_s, cache_s = self_attention_forward(xp.asarray(x), h, **dev, **masks)
        np.testing.assert_allclose(host(out_s), host(out), rtol=1e-13, atol=1e-14)
        for g, s_g in zip(grads, self_attention_backward(xp.asarray(dout), cache_s)):
            np.testing.assert_allclose(host(s_g), g, rtol=1e-12, atol=1e-13)

    m = torch.nn.MultiheadAttention(e, h, batch_first=True, dtype=torch.float64)
    with torch.no_grad():
        m.in_proj_weight.copy_(torch.from_numpy(p["in_proj_weight"]))
        m.in_proj_bias.copy_(torch.from_numpy(p["in_proj_bias"]))
        m.out_proj.weight.copy_(torch.from_numpy(p["out_proj_weight"]))
        m.out_proj.bias.copy_(torch.from_numpy(p["out_proj_bias"]))
    tx, tm = torch.from_numpy(x).requires_grad_(), torch.from_numpy(mem).requires_grad_()
    t_kv = tx if self_attention else tm
    t_out, t_w = m(tx, t_kv, t_kv, key_padding_mask=torch.from_numpy(pad), attn_mask=torch.from_numpy(mask))
    t_out.backward(torch.from_numpy(dout))
    np.testing.assert_allclose(host(out), t_out.detach().numpy(), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(host(w), t_w.detach().numpy(), rtol=1e-12, atol=1e-13)
    want = [tx.grad] + ([] if self_attention else [tm.grad]) + [m.in_proj_weight.grad, m.in_proj_bias.grad,
                                                                 m.out_proj.weight.grad, m.out_proj.bias.grad]
    for g, t in zip(grads, want, strict=True):
        np.testing.assert_allclose(g, t.numpy(), rtol=1e-11, atol=1e-12)


def test_bad_input(xp):
    p = make_params(xp, 6, 0)
    y = randn(xp, (2, 3, 6), 1)
    p10 = make_params(xp, 10, 0)
    z = randn(xp, (2, 3, 10), 1)
    with pytest.raises(ValueError, match="embed_dim 10 is not divisible by num_heads 3"):
        mha_forward(z, z, z, 3, **p10)
    with pytest.raises(ValueError, match="num_heads: expected an int >= 1, got 0"):
        mha_forward(y, y, y, 0, **p)
    with pytest.raises(TypeError, match="num_heads: expected an int, got float 2.0"):
        mha_forward(y, y, y, 2.0, **p)
    with pytest.raises(ValueError, match=r"query: expected a 3-d array \(B, T, E\), batch first"):
        mha_forward(y[0], y, y, 2, **p)
    with pytest.raises(TypeError, match="query: expected a floating-point array"):
        mha_forward(xp.zeros((2, 3, 6), xp.int64), y, y, 2, **p)
    with pytest.raises(ValueError, match=r"key: expected shape \(B, Tk, E\)=\(2, \*, 6\) to match query "
                                         r"\(2, 3, 6\), got .*\(3, 4, 6\)"):
        mha_forward(y, randn(xp, (3, 4, 6), 2), randn(xp, (3, 4, 6), 3), 2, **p)
    with pytest.raises(ValueError, match=r"value: expected shape \(B, Tk, E\)=\(2, \*, 6\) to match query"):
        mha_forward(y, randn(xp, (2, 4, 6), 2), randn(xp, (1, 4, 6), 3), 2, **p)
    with pytest.raises(ValueError, match=r"key: expected shape \(B, Tk, E\)=\(2, \*, 6\) .* got .*\(2, 4, 4\)"):
        mha_forward(y, randn(xp, (2, 4, 4), 2), randn(xp, (2, 4, 4), 3), 2, **p)
    with pytest.raises(ValueError, match=r"value: expected the shape of key, got key .*\(2, 4, 6\) and value "
                                         r".*\(2, 5, 6\)"):
        mha_forward(y, randn(xp, (2, 4, 6), 2), randn(xp, (2, 5, 6), 3), 2, **p)
    for name, shape, want in (("in_proj_weight", (6, 6), r"\(18, 6\) \(3E, E\)"), ("in_proj_bias", (6,), r"\(18,\)"),
                              ("out_proj_weight", (6, 18), r"\(6, 6\)"), ("out_proj_bias", (18,), r"\(6,\)")):
        with pytest.raises(ValueError, match=f"{name}: expected shape {want}"):
            mha_forward(y, y, y, 2, **{**p, name: randn(xp, shape, 4)})
    y32 = y.astype(xp.float32)
    with pytest.raises(TypeError, match="dtype mismatch: query is float32 but in_proj_weight is float64"):
        mha_forward(y32, y32, y32, 2, **p)
    with pytest.raises(TypeError, match="dtype mismatch: query is float64 but key is float32"):
        mha_forward(y, y32, y32, 2, **p)
    with pytest.raises(ValueError, match=r"key_padding_mask: expected shape \(B, Tk\)=\(2, 3\)"):
        mha_forward(y, y, y, 2, **p, key_padding_mask=xp.zeros((2, 4), bool))
    with pytest.raises(ValueError, match=r"attn_mask: expected shape \(Tq, Tk\)=\(3, 3\) or "
                                         r"\(B\*H, Tq, Tk\)=\(4, 3, 3\)"):
        mha_forward(y, y, y, 2, **p, attn_mask=xp.zeros((2, 3, 3), bool))
    with pytest.raises(TypeError, match="attn_mask: expected a bool mask"):
        mha_forward(y, y, y, 2, **p, attn_mask=xp.zeros((3, 3), xp.int8))
    pk = randn(xp, (2, 2, 4, 3), 5)
    with pytest.raises(ValueError, match="past_key and past_value come together"):
        mha_forward(y, y, y, 2, **p, past_key=pk)
    with pytest.raises(ValueError, match="key and value may be None only with past_key/past_value"):
        mha_forward(y, None, None, 2, **p)
    with pytest.raises(ValueError, match=r"past_key: expected shape \(2, 2, \*, 3\) \(B, H, Tp, hs\)"):
        self_attention_forward(y, 2, **p, past_key=pk[:1], past_value=pk[:1])
