"""``nn.RNN`` and ``nn.LSTM``: float64 module gradchecks (input, initial states, every parameter,
with gradients arriving through output, h_n and c_n at once), parity with ``torch.nn.RNN``/``LSTM``
(batch_first=True, the same weights; skipped without torch), repeated use, no_grad, bad arguments."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from npformer.backend import get_array_module
from npformer.nn import LSTM, RNN, no_grad
from npformer.tools.gradcheck import gradcheck_module
from tests.helpers import assert_gradcheck, batch, host, randn, seeds, seq

ATOL64 = 1e-10
sizes = st.integers(1, 4)


def _build(kind, i, h, bias=True, seed=0, xp=np):
    cls = RNN if kind == "rnn" else LSTM
    return cls(i, h, bias=bias, rng=seed, backend=xp.__name__).to(dtype="float64")


def _all_outputs(m, x, h0, c0=None):
    """output, h_n and (LSTM) c_n concatenated along time: one gradcheck covers all three."""
    xp = get_array_module(x)
    if isinstance(m, LSTM):
        out, (h_n, c_n) = m(x, (h0, c0))
        return xp.concatenate([out, h_n.transpose(1, 0, 2), c_n.transpose(1, 0, 2)], axis=1)
    out, h_n = m(x, h0)
    return xp.concatenate([out, h_n.transpose(1, 0, 2)], axis=1)          # (B, T+1, H)


def _all_backward(m, d):
    if isinstance(m, LSTM):
        t = d.shape[1] - 2
        dx, (dh0, dc0) = m.backward(d[:, :t], d[:, t][None], d[:, t + 1][None])
        return dx, dh0, dc0
    t = d.shape[1] - 1
    return m.backward(d[:, :t], d[:, t][None])


@given(kind=st.sampled_from(["rnn", "lstm"]), b=batch, t=seq, i=sizes, h=sizes, bias=st.booleans(),
       seed=seeds)
def test_module_gradcheck(xp, kind, b, t, i, h, bias, seed):
    m = _build(kind, i, h, bias, seed, xp)
    inputs = {"x": randn(xp, (b, t, i), seed), "h0": randn(xp, (1, b, h), seed + 1)}
    if kind == "lstm":
        inputs["c0"] = randn(xp, (1, b, h), seed + 2)
    assert_gradcheck(gradcheck_module(m, inputs, forward=lambda mod, **kw: _all_outputs(mod, **kw),
                                      backward=_all_backward, seed=seed))


def test_state_dict_names_are_pytorchs():
    assert list(RNN(3, 4).state_dict()) == ["weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0"]
    sd = LSTM(3, 4).state_dict()
    assert [tuple(v.shape) for v in sd.values()] == [(16, 3), (16, 4), (16,), (16,)]
    assert list(RNN(3, 4, bias=False).state_dict()) == ["weight_ih_l0", "weight_hh_l0"]
    bound = 1 / np.sqrt(4)
    assert all(np.abs(v).max() <= bound for v in sd.values())        # U(-1/sqrt(H), 1/sqrt(H))
    assert LSTM(3, 4).dtype == np.float32


@given(kind=st.sampled_from(["rnn", "lstm"]), b=batch, t=seq, i=sizes, h=sizes, bias=st.booleans(),
       with_state=st.booleans(), seed=seeds)
def test_parity_with_torch(kind, b, t, i, h, bias, with_state, seed):
    torch = pytest.importorskip("torch", reason="torch not installed: the PyTorch parity test needs it")
    torch.manual_seed(seed)
    cls = torch.nn.RNN if kind == "rnn" else torch.nn.LSTM
    theirs = cls(i, h, bias=bias, batch_first=True).double()
    ours = _build(kind, i, h, bias).load_state_dict({k: v.detach().numpy() for k, v in theirs.state_dict().items()})
    rng = np.random.default_rng(seed)
    x, h0, c0 = rng.standard_normal((b, t, i)), rng.standard_normal((1, b, h)), rng.standard_normal((1, b, h))
    dout, dh, dc = rng.standard_normal((b, t, h)), rng.standard_normal((1, b, h)), rng.standard_normal((1, b, h))
    tx, th, tc = (torch.tensor(a, requires_grad=True) for a in (x, h0, c0))
    if kind == "rnn":
        out, h_n = ours(x, h0 if with_state else None)
        dx, dh0 = ours.backward(dout, dh)
        tout, th_n = theirs(tx, th if with_state else None)
        (tout * torch.tensor(dout)).sum().add((th_n * torch.tensor(dh)).sum()).backward()
        pairs = [(out, tout), (h_n, th_n), (dx, tx.grad)] + ([(dh0, th.grad)] if with_state else [])
    else:
        out, (h_n, c_n) = ours(x, (h0, c0) if with_state else None)
        dx, (dh0, dc0) = ours.backward(dout, dh, dc)
        tout, (th_n, tc_n) = theirs(tx, (th, tc) if with_state else None)
        loss = (tout * torch.tensor(dout)).sum() + (th_n * torch.tensor(dh)).sum() + (tc_n * torch.tensor(dc)).sum()
        loss.backward()
        pairs = [(out, tout), (h_n, th_n), (c_n, tc_n), (dx, tx.grad)] + \
            ([(dh0, th.grad), (dc0, tc.grad)] if with_state else [])
    for ours_a, theirs_a in pairs:
        np.testing.assert_allclose(ours_a, theirs_a.detach().numpy(), rtol=0, atol=ATOL64)
    their_grads = {k: p.grad.numpy() for k, p in theirs.named_parameters()}
    for name, p in ours.named_parameters():
        np.testing.assert_allclose(p.grad, their_grads[name], rtol=0, atol=ATOL64, err_msg=name)


def test_two_uses_accumulate_the_sum_of_their_gradients(xp):
    m = _build("lstm", 2, 3, seed=1, xp=xp)
    x1, x2, d1, d2 = (randn(xp, s, k) for k, s in enumerate([(2, 3, 2), (1, 4, 2), (2, 3, 3), (1, 4, 3)]))
    separate = []
    for x, d in ((x1, d1), (x2, d2)):
        m.zero_grad()
        m(x)
        m.backward(d)
        separate.append({k: v.copy() for k, v in m.grads().items()})
    m.zero_grad()
    m(x1)
    m(x2)
    m.backward(d2)                                       # newest first
    m.backward(d1)
    for k, g in m.grads().items():
        np.testing.assert_allclose(host(g), host(separate[0][k] + separate[1][k]), rtol=1e-13, atol=1e-15)


def test_no_grad_saves_nothing_and_backward_needs_a_forward(xp):
    m = _build("rnn", 2, 3, xp=xp)
    with no_grad():
        m(randn(xp, (1, 2, 2), 0))
    assert m._saved == []
    with pytest.raises(RuntimeError, match="more times than forward"):
        m.backward(randn(xp, (1, 2, 3), 0))


def test_only_hn_gradient(xp):
    """backward(None, dh_n) is backward(zeros with dh_n at the last step)."""
    m = _build("rnn", 2, 3, seed=2, xp=xp)
    x, dh = randn(xp, (2, 4, 2), 0), randn(xp, (1, 2, 3), 1)
    m(x)
    dx_a, dh0_a = m.backward(None, dh)
    full = xp.zeros((2, 4, 3))
    full[:, -1] = dh[0]
    m(x)
    dx_b, dh0_b = m.backward(full)
    assert xp.array_equal(dx_a, dx_b) and xp.array_equal(dh0_a, dh0_b)


def test_bad_arguments(xp):
    with pytest.raises(ValueError, match="num_layers=1"):
        RNN(2, 3, num_layers=2)
    with pytest.raises(ValueError, match="batch_first=True"):
        LSTM(2, 3, batch_first=False)
    with pytest.raises(ValueError, match="bidirectional=False"):
        LSTM(2, 3, bidirectional=True)
    with pytest.raises(ValueError, match="dropout=0"):
        RNN(2, 3, dropout=0.5)
    with pytest.raises(ValueError, match="nonlinearity='tanh'"):
        RNN(2, 3, nonlinearity="relu")
    with pytest.raises(ValueError, match="hidden_size: expected an int >= 1, got 0"):
        RNN(2, 0)
    m, lstm = _build("rnn", 2, 3, xp=xp), _build("lstm", 2, 3, xp=xp)
    x = randn(xp, (2, 4, 2), 0)
    with pytest.raises(ValueError, match=r"hx: expected shape \(1, 2, 3\)"):
        m(x, randn(xp, (2, 3), 1))
    with pytest.raises(TypeError, match=r"hx: expected a tuple \(h_0, c_0\)"):
        lstm(x, randn(xp, (1, 2, 3), 1))
    with pytest.raises(ValueError, match=r"x: expected last axis|weight_ih: expected shape"):
        m(randn(xp, (2, 4, 5), 0))
    m(x)
    with pytest.raises(ValueError, match=r"dh_n: expected shape \(1, 2, 3\)"):
        m.backward(None, randn(xp, (2, 3), 1))
    with pytest.raises(ValueError, match=r"doutput: expected shape \(2, 4, 3\)"):
        m.backward(randn(xp, (2, 3, 3), 1))
    lstm(x)
    with pytest.raises(ValueError, match=r"dc_n: expected shape \(1, 2, 3\)"):
        lstm.backward(None, None, randn(xp, (2, 3), 1))
