"""Elman RNN and LSTM ops: a per-element loop reference, float64 gradchecks of backpropagation
through time (every input, state and parameter, c_n's gradient included), state carry-over,
dtype, views, saturation without NaN and every bad input."""
import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

from npformer.backend import get_array_module
from npformer.ops.rnn import lstm_backward, lstm_forward, rnn_backward, rnn_forward
from npformer.tools.gradcheck import gradcheck
from tests.helpers import assert_gradcheck, batch, host, randn, seeds, seq

sizes = st.integers(1, 4)


def _params(xp, gates, i, h, seed, bias=True, scale=0.7, dtype="float64"):
    p = {"weight_ih": randn(xp, (gates * h, i), seed + 1, dtype, scale),
         "weight_hh": randn(xp, (gates * h, h), seed + 2, dtype, scale)}
    if bias:
        p["bias_ih"] = randn(xp, (gates * h,), seed + 3, dtype, scale)
        p["bias_hh"] = randn(xp, (gates * h,), seed + 4, dtype, scale)
    return p


def reference_rnn(x, h0, w_ih, w_hh, b_ih, b_hh):
    """Element by element with math.tanh: h[b, t, j] = tanh(sum_k x w_ih + b_ih + sum_k h w_hh + b_hh)."""
    b, t, i = x.shape
    hid = w_hh.shape[0]
    out = np.zeros((b, t, hid))
    for n in range(b):
        prev = list(h0[n])
        for s in range(t):
            cur = [math.tanh(sum(x[n, s, k] * w_ih[j, k] for k in range(i)) + b_ih[j]
                             + sum(prev[k] * w_hh[j, k] for k in range(hid)) + b_hh[j]) for j in range(hid)]
            out[n, s] = prev = cur
    return out


def reference_lstm(x, h0, c0, w_ih, w_hh, b_ih, b_hh):
    """Element by element, gates i, f, g, o, sigmoid as 1 / (1 + exp(-z))."""
    b, t, i = x.shape
    hid = w_hh.shape[1]
    sig = lambda z: 1.0 / (1.0 + math.exp(-z))            # noqa: E731
    out, c_last = np.zeros((b, t, hid)), np.zeros((b, hid))
    for n in range(b):
        h, c = list(h0[n]), list(c0[n])
        for s in range(t):
            z = [sum(x[n, s, k] * w_ih[r, k] for k in range(i)) + b_ih[r]
                 + sum(h[k] * w_hh[r, k] for k in range(hid)) + b_hh[r] for r in range(4 * hid)]
            c = [sig(z[hid + j]) * c[j] + sig(z[j]) * math.tanh(z[2 * hid + j]) for j in range(hid)]
            h = [sig(z[3 * hid + j]) * math.tanh(c[j]) for j in range(hid)]
            out[n, s] = h
        c_last[n] = c
    return out, c_last


def lstm_with_cn(x, h0, c0, weight_ih, weight_hh, bias_ih=None, bias_hh=None):
    """The LSTM's h_1..h_T with c_T appended as step T+1, so one gradcheck covers dc_n too."""
    out, c_n, cache = lstm_forward(x, h0, c0, weight_ih, weight_hh, bias_ih, bias_hh)
    return get_array_module(out).concatenate([out, c_n[:, None]], axis=1), cache        # (B, T+1, H)


def lstm_with_cn_backward(dout, cache):
    return lstm_backward(dout[:, :-1], cache, dout[:, -1])


def test_rnn_matches_loop_reference(xp):
    x, h0 = randn(xp, (2, 4, 3), 0), randn(xp, (2, 5), 1)
    p = _params(xp, 1, 3, 5, 2)
    out, _ = rnn_forward(x, h0, **p)
    ref = reference_rnn(*(host(a) for a in (x, h0, p["weight_ih"], p["weight_hh"], p["bias_ih"], p["bias_hh"])))
    np.testing.assert_allclose(host(out), ref, rtol=1e-13, atol=1e-14)


def test_lstm_matches_loop_reference(xp):
    x, h0, c0 = randn(xp, (2, 4, 3), 0), randn(xp, (2, 5), 1), randn(xp, (2, 5), 2)
    p = _params(xp, 4, 3, 5, 3)
    out, c_n, _ = lstm_forward(x, h0, c0, **p)
    ref, c_ref = reference_lstm(*(host(a) for a in (x, h0, c0, p["weight_ih"], p["weight_hh"],
                                                    p["bias_ih"], p["bias_hh"])))
    np.testing.assert_allclose(host(out), ref, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(host(c_n), c_ref, rtol=1e-13, atol=1e-14)


@given(b=batch, t=seq, i=sizes, h=sizes, bias=st.booleans(), seed=seeds)
def test_rnn_gradcheck(xp, b, t, i, h, bias, seed):
    inputs = {"x": randn(xp, (b, t, i), seed), "h0": randn(xp, (b, h), seed + 5), **_params(xp, 1, i, h, seed, bias)}
    assert_gradcheck(gradcheck(rnn_forward, rnn_backward, inputs, seed=seed))


@given(b=batch, t=seq, i=sizes, h=sizes, bias=st.booleans(), seed=seeds)
def test_lstm_gradcheck_with_cn(xp, b, t, i, h, bias, seed):
    inputs = {"x": randn(xp, (b, t, i), seed), "h0": randn(xp, (b, h), seed + 5),
              "c0": randn(xp, (b, h), seed + 6), **_params(xp, 4, i, h, seed, bias)}
    assert_gradcheck(gradcheck(lstm_with_cn, lstm_with_cn_backward, inputs, seed=seed, label="lstm"))


def test_missing_initial_state_is_zeros(xp):
    x, p1, p4 = randn(xp, (2, 3, 2), 0), _params(xp, 1, 2, 3, 1), _params(xp, 4, 2, 3, 2)
    z = xp.zeros((2, 3))
    assert xp.array_equal(rnn_forward(x, None, **p1)[0], rnn_forward(x, z, **p1)[0])
    a, b = lstm_forward(x, None, None, **p4), lstm_forward(x, z, z, **p4)
    assert xp.array_equal(a[0], b[0]) and xp.array_equal(a[1], b[1])
    dx, dh0 = rnn_backward(randn(xp, (2, 3, 3), 3), rnn_forward(x, None, **p1)[1])[:2]
    assert dh0.shape == (2, 3) and dx.shape == x.shape


def test_state_carries_over_a_split_sequence(xp):
    """Running steps 1..k, then k+1..T from (h_k, c_k), equals running 1..T at once."""
    x, p1, p4 = randn(xp, (2, 6, 3), 0), _params(xp, 1, 3, 4, 1), _params(xp, 4, 3, 4, 2)
    whole = rnn_forward(x, None, **p1)[0]
    first = rnn_forward(x[:, :2], None, **p1)[0]
    second = rnn_forward(x[:, 2:], first[:, -1], **p1)[0]
    np.testing.assert_allclose(host(xp.concatenate([first, second], 1)), host(whole), rtol=1e-14, atol=1e-15)
    out, c_n, _ = lstm_forward(x, None, None, **p4)
    o1, c1, _ = lstm_forward(x[:, :4], None, None, **p4)
    o2, c2, _ = lstm_forward(x[:, 4:], o1[:, -1], c1, **p4)
    np.testing.assert_allclose(host(xp.concatenate([o1, o2], 1)), host(out), rtol=1e-14, atol=1e-15)
    np.testing.assert_allclose(host(c2), host(c_n), rtol=1e-14, atol=1e-15)


def test_float32_in_float32_out_and_inputs_untouched(xp):
    for gates, fwd, bwd in ((1, rnn_forward, rnn_backward), (4, lstm_forward, lstm_backward)):
        x, h0 = randn(xp, (2, 3, 2), 0, "float32"), randn(xp, (2, 3), 1, "float32")
        states = (h0,) if gates == 1 else (h0, h0.copy())
        p = _params(xp, gates, 2, 3, 2, dtype="float32")
        copies = [a.copy() for a in (x, *states, *p.values())]
        res = fwd(x, *states, **p)
        grads = bwd(xp.ones_like(res[0]), res[-1])
        assert all(r.dtype == xp.float32 for r in res[:-1]) and all(g.dtype == xp.float32 for g in grads)
        for a, c in zip((x, *states, *p.values()), copies):
            assert xp.array_equal(a, c)


def test_views_give_the_same_result(xp):
    x = randn(xp, (3, 4, 2), 0).transpose(2, 1, 0)        # (2, 4, 3), not contiguous
    w_hh = randn(xp, (3, 3), 1).T                          # a transposed view
    w_ih = randn(xp, (3, 3), 2)
    out, cache = rnn_forward(x, None, w_ih, w_hh)
    out_c, cache_c = rnn_forward(xp.ascontiguousarray(x), None, w_ih, xp.ascontiguousarray(w_hh))
    np.testing.assert_allclose(host(out), host(out_c), rtol=1e-14)
    dout = randn(xp, out.shape, 3)
    for g, gc in zip(rnn_backward(dout, cache)[:4], rnn_backward(dout, cache_c)[:4]):
        np.testing.assert_allclose(host(g), host(gc), rtol=1e-13, atol=1e-15)


def test_saturated_units_give_finite_values_and_zero_gradients(xp):
    """Pre-activations of +-1e4 (exp(1e4) overflows): outputs saturate to +-1 / 0..1, gradients
    through the saturated units are 0, never NaN or inf."""
    x = randn(xp, (2, 3, 2), 0, scale=1e4)
    for gates, fwd, bwd in ((1, rnn_forward, rnn_backward), (4, lstm_forward, lstm_backward)):
        p = _params(xp, gates, 2, 3, 1, bias=False, scale=1.0)
        states = (None,) * (1 if gates == 1 else 2)
        res = fwd(x, *states, **p)
        grads = bwd(randn(xp, res[0].shape, 2), res[-1])
        for a in (*res[:-1], *[g for g in grads if g is not None]):
            assert bool(xp.isfinite(a).all())
        assert float(xp.abs(res[0]).max()) <= 1.0


def test_bad_input(xp):
    x, p1, p4 = randn(xp, (2, 3, 2), 0), _params(xp, 1, 2, 3, 1), _params(xp, 4, 2, 3, 2)
    with pytest.raises(ValueError, match=r"x: expected a 3-d array \(B, T, input_size\)"):
        rnn_forward(x[0], None, **p1)
    with pytest.raises(ValueError, match=r"B, T >= 1"):
        rnn_forward(x[:, :0], None, **p1)
    with pytest.raises(ValueError, match=r"weight_ih: expected shape \(1\*hidden_size, input_size=4\)"):
        rnn_forward(randn(xp, (2, 3, 4), 0), None, **p1)
    with pytest.raises(ValueError, match=r"weight_ih: expected shape \(4\*hidden_size"):
        lstm_forward(x, None, None, randn(xp, (6, 2), 0), randn(xp, (6, 2), 1))
    with pytest.raises(ValueError, match=r"weight_hh: expected shape \(3, 3\)"):
        rnn_forward(x, None, p1["weight_ih"], randn(xp, (3, 2), 0))
    with pytest.raises(ValueError, match=r"h0: expected shape \(2, 3\)"):
        rnn_forward(x, randn(xp, (1, 3), 0), **p1)
    with pytest.raises(ValueError, match=r"c0: expected shape \(2, 3\)"):
        lstm_forward(x, None, randn(xp, (2, 4), 0), **p4)
    with pytest.raises(ValueError, match=r"bias_ih: expected shape \(12,\)"):
        lstm_forward(x, None, None, **{**p4, "bias_ih": randn(xp, (3,), 0)})
    with pytest.raises(ValueError, match=r"give both or neither"):
        rnn_forward(x, None, p1["weight_ih"], p1["weight_hh"], p1["bias_ih"])
    with pytest.raises(TypeError, match=r"dtype mismatch: x is float32 but weight_ih is float64"):
        rnn_forward(x.astype(xp.float32), None, **p1)
    with pytest.raises(TypeError, match=r"x: expected a floating-point array"):
        rnn_forward(xp.ones((2, 3, 2), dtype=xp.int64), None, **p1)
    out, cache = rnn_forward(x, None, **p1)
    with pytest.raises(ValueError, match=r"dout: expected the shape of the outputs h_1..h_T \(B, T, hidden_size\), \(2, 3, 3\)"):
        rnn_backward(out[:, :2], cache)
    out, _, cache = lstm_forward(x, None, None, **p4)
    with pytest.raises(ValueError, match=r"dc_n: expected the shape of the last cell state c_T \(B, hidden_size\), \(2, 3\)"):
        lstm_backward(out, cache, out[:, 0, :2])
