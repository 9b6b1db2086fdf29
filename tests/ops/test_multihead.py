"""Multi-head attention: a per-head loop reference, gradchecks of every input and parameter for
self-attention (the fused projection), shared key/value and separate inputs (Tq != Tk), with masks
and dropout; the fused path equals the separate one; weights; dtypes; PyTorch parity; bad input."""
import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

from npformer.backend import backend_name, default_rng
from npformer.ops.multihead import multi_head_attention_backward as mha_backward
from npformer.ops.multihead import multi_head_attention_forward as mha_forward
from npformer.tools.gradcheck import gradcheck
from tests.helpers import assert_gradcheck, batch, host, padding_masks, randn, seeds, seq

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
        return mha_forward(query, key, value, **fixed, **p, rng=default_rng(seed, name))

    x, mem, val = randn(xp, (b, tq, e), seed + 9), randn(xp, (b, tk, e), seed + 8), randn(xp, (b, tk, e), seed + 7)
    if kind == "self":
        def fwd(x, **p):
            return call(x, x, x, **p)
        inputs, args = {"x": x}, (x, x, x)
    elif kind == "kv":
        def fwd(query, mem, **p):
            return call(query, mem, mem, **p)
        inputs, args = {"query": x, "mem": mem}, (x, mem, mem)
    else:
        fwd, inputs, args = call, {"query": x, "key": mem, "value": val}, (x, mem, val)
    n = len(inputs)

    def bwd(d, cache):
        g = mha_backward(d, cache)
        assert all(a is None for a in g[n:3])            # one gradient per distinct input
        assert (g[4] is None) == (g[6] is None) == (not bias)
        return g[:n] + tuple(a for a in g[3:] if a is not None)
    fwd.__name__ = f"multi_head_attention[{kind}]"
    if dropout == 0.0:
        out, w, _ = fwd(**inputs, **params, average_attn_weights=False)
        ref, ref_w = reference_mha(*(host(a) for a in args), h, {k: None if v is None else host(v)
                                                                 for k, v in params.items()}, _blocked(pad, tq, causal))
        np.testing.assert_allclose(host(out), ref, rtol=1e-11, atol=1e-12)
        np.testing.assert_allclose(host(w), ref_w, rtol=1e-11, atol=1e-13)
    present = {k: v for k, v in params.items() if v is not None}
    assert_gradcheck(gradcheck(fwd, bwd, {**inputs, **present}, seed=seed))


@pytest.mark.parametrize("share", ["self", "kv"])
def test_shared_inputs_equal_separate_copies_with_summed_gradients(xp, share):
    b, t, e, h = 2, 4, 6, 3
    p = make_params(xp, e, 0)
    x = randn(xp, (b, t, e), 1)
    mem = x if share == "self" else randn(xp, (b, 5, e), 2)
    query = x
    pad = np.zeros((b, mem.shape[1]), bool)
    pad[1, 1] = True
    kw = {"key_padding_mask": xp.asarray(pad), "need_weights": True}
    out, w, cache = mha_forward(query, mem, mem, h, **p, **kw)
    out_sep, w_sep, cache_sep = mha_forward(query.copy(), mem.copy(), mem.copy(), h, **p, **kw)
    np.testing.assert_allclose(host(out), host(out_sep), rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(host(w), host(w_sep), rtol=1e-13, atol=1e-15)
    dout = randn(xp, out.shape, 3)
    g, gs = mha_backward(dout, cache), mha_backward(dout, cache_sep)
    if share == "self":
        assert g[1] is None and g[2] is None
        np.testing.assert_allclose(host(g[0]), host(gs[0] + gs[1] + gs[2]), rtol=1e-12, atol=1e-13)
    else:
        assert g[2] is None
        np.testing.assert_allclose(host(g[0]), host(gs[0]), rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(host(g[1]), host(gs[1] + gs[2]), rtol=1e-12, atol=1e-13)
    for a, c in zip(g[3:], gs[3:]):
        np.testing.assert_allclose(host(a), host(c), rtol=1e-12, atol=1e-13)


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
    torch = pytest.importorskip("torch", reason="torch not installed: this PyTorch parity check needs it (pip install torch==2.13.0)")
    e, h, b, tq, tk = 6, 3, 2, 4, 4 if self_attention else 5
    p = {k: host(v) for k, v in make_params(xp, e, 0).items()}
    x, mem = host(randn(xp, (b, tq, e), 1)), host(randn(xp, (b, tk, e), 2))
    pad = np.zeros((b, tk), bool)
    pad[1, -1] = True
    mask = np.zeros((tq, tk), bool)
    mask[0, 1] = True
    dout = host(randn(xp, (b, tq, e), 3))
    kv = x if self_attention else mem
    out, w, cache = mha_forward(*(xp.asarray(a) for a in (x, kv, kv)), h, **{k: xp.asarray(v) for k, v in p.items()},
                                attn_mask=xp.asarray(mask), key_padding_mask=xp.asarray(pad))
    grads = [host(g) for g in mha_backward(xp.asarray(dout), cache) if g is not None]

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
    with pytest.raises(ValueError, match="num_heads: expected at least 1 head, got 0"):
        mha_forward(y, y, y, 0, **p)
    with pytest.raises(TypeError, match="num_heads: expected an int, got float 2.0"):
        mha_forward(y, y, y, 2.0, **p)
    with pytest.raises(ValueError, match=r"query: expected a 3-d array \(B, T, E\), batch first"):
        mha_forward(y[0], y, y, 2, **p)
    with pytest.raises(TypeError, match="query: expected a floating-point array"):
        mha_forward(xp.zeros((2, 3, 6), xp.int64), y, y, 2, **p)
    with pytest.raises(ValueError, match=r"key: expected batch size B=2 of query \(2, 3, 6\), got .*\(3, 4, 6\)"):
        mha_forward(y, randn(xp, (3, 4, 6), 2), randn(xp, (3, 4, 6), 3), 2, **p)
    with pytest.raises(ValueError, match=r"value: expected batch size B=2 of query"):
        mha_forward(y, randn(xp, (2, 4, 6), 2), randn(xp, (1, 4, 6), 3), 2, **p)
    with pytest.raises(ValueError, match=r"key: expected embed_dim E=6 of query \(2, 3, 6\), got .*\(2, 4, 4\)"):
        mha_forward(y, randn(xp, (2, 4, 4), 2), randn(xp, (2, 4, 4), 3), 2, **p)
    with pytest.raises(ValueError, match=r"value: expected the shape \(B, Tk, E\)=\(2, 4, 6\) of key, "
                                         r"got .*\(2, 5, 6\)"):
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
