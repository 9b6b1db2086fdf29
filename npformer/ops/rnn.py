"""Recurrent layers with hand-written backpropagation through time, as ``torch.nn.RNN``/``LSTM``
(one layer, ``batch_first=True``; PyTorch's parameter layout and LSTM gate order i, f, g, o).

Elman RNN (Elman 1990), for t = 1..T:

    h_t = tanh(x_t W_ih^T + b_ih + h_{t-1} W_hh^T + b_hh)

LSTM (Hochreiter and Schmidhuber 1997, with the forget gate of Gers et al. 2000):

    [i, f, g, o] = x_t W_ih^T + b_ih + h_{t-1} W_hh^T + b_hh          (4 blocks of H)
    i, f, o = sigmoid(.),  g = tanh(.)
    c_t = f * c_{t-1} + i * g,        h_t = o * tanh(c_t)

Backward through time walks t = T..1 carrying dh (and dc) into step t-1:

    RNN:   da_t = (dout_t + dh_t) * (1 - h_t^2);            dh_{t-1} = da_t W_hh
    LSTM:  dc = dc_t + dh * o * (1 - tanh(c_t)^2);          dc_{t-1} = dc * f
           dpre = [dc*g * i(1-i), dc*c_{t-1} * f(1-f), dc*i * (1-g^2), dh*tanh(c_t) * o(1-o)]
           dh_{t-1} = dpre W_hh

Only the recurrent product is inside the loop: the input projection, dx, dW_ih, dW_hh and the
biases are one matmul each over all (B, T) rows. sigmoid(z) is evaluated as (1 + tanh(z/2)) / 2,
which never overflows, so any finite input gives finite outputs and gradients. ``out`` is
the stacked h_1..h_T (B, T, H); the cache keeps that same array (do not write into it). The
gradients come back in the order of the forward's arguments; h0 (and c0) None means zeros.
"""
from __future__ import annotations

from typing import Any, NamedTuple

from npformer.backend import accumulated_sum, get_array_module, matmul
from npformer.checks import describe, expect_float, expect_grad, expect_ndim, expect_same_dtype, expect_shape
from npformer.dispatch import dispatched
from npformer.errors import RangeError, ShapeError
from npformer.ops.linear import matmul_last

__all__ = ["RNNCache", "LSTMCache", "rnn_forward", "rnn_backward", "lstm_forward", "lstm_backward"]


class RNNCache(NamedTuple):
    x: Any           # (B, T, I)
    h0: Any          # (B, H)
    weight_ih: Any   # (H, I)
    weight_hh: Any   # (H, H)
    h: Any           # (B, T, H)   h_1..h_T (the forward's output)
    has_bias: bool


class LSTMCache(NamedTuple):
    x: Any           # (B, T, I)
    h0: Any          # (B, H)
    c0: Any          # (B, H)
    weight_ih: Any   # (4H, I)
    weight_hh: Any   # (4H, H)
    gates: Any       # (B, T, 4H)  i, f, g, o after their nonlinearities
    c: Any           # (B, T, H)   c_1..c_T
    tanh_c: Any      # (B, T, H)   tanh(c_t), kept rather than recomputed (one tanh per element saved)
    h: Any           # (B, T, H)   h_1..h_T (the forward's output)
    has_bias: bool


def _check(x, h0, c0, weight_ih, weight_hh, bias_ih, bias_hh, gates: int):
    """Validate shapes and dtypes; returns (xp, B, T, H) and zero states for missing h0/c0."""
    expect_float(x, "x")
    expect_ndim(x, "x", 3, "(B, T, input_size)")
    expect_ndim(weight_ih, "weight_ih", 2, f"({gates}*hidden_size, input_size)")
    b, t, i = x.shape
    if t < 1 or b < 1:
        raise ShapeError(f"x: expected at least one sequence of at least one step (B, T >= 1), got {describe(x)}")
    if weight_ih.shape[0] % gates or weight_ih.shape[1] != i:
        raise ShapeError(f"weight_ih: expected shape ({gates}*hidden_size, input_size={i}), got {describe(weight_ih)}")
    h = weight_ih.shape[0] // gates
    expect_shape(weight_hh, "weight_hh", (gates * h, h), f"({gates}*hidden_size, hidden_size)")
    if (bias_ih is None) != (bias_hh is None):
        raise RangeError("bias_ih and bias_hh: give both or neither (bias=False)")
    for name, a, shape, layout in (("bias_ih", bias_ih, (gates * h,), f"({gates}*hidden_size,)"),
                                   ("bias_hh", bias_hh, (gates * h,), f"({gates}*hidden_size,)"),
                                   ("h0", h0, (b, h), "(B, hidden_size)"), ("c0", c0, (b, h), "(B, hidden_size)")):
        if a is not None:
            expect_shape(a, name, shape, layout)
    expect_same_dtype(x=x, weight_ih=weight_ih, weight_hh=weight_hh, bias_ih=bias_ih, bias_hh=bias_hh,
                      h0=h0, c0=c0)
    xp = get_array_module(x, weight_ih, weight_hh, bias_ih, bias_hh, h0, c0)   # raises on mixed backends
    zeros = xp.zeros((b, h), dtype=x.dtype)
    return xp, b, t, h, (zeros if h0 is None else h0), (zeros if c0 is None else c0)


def _input_part(x, weight_ih, bias_ih, bias_hh):
    pre = matmul_last(x, weight_ih.T)                    # (B, T, G*H)
    if bias_ih is not None:
        pre += bias_ih + bias_hh
    return pre


def _param_grads(dpre, x, h0, h, has_bias, xp):
    """dW_ih, dW_hh, db_ih, db_hh from the pre-activation gradients of every step at once."""
    h_prev = xp.concatenate([h0[:, None], h[:, :-1]], axis=1)      # (B, T, H) h_0..h_{T-1}, each step's input
    d2 = dpre.reshape(-1, dpre.shape[-1])                            # (B*T, G*H)
    dweight_ih = matmul(d2.T, x.reshape(-1, x.shape[-1]))            # (G*H, I)
    dweight_hh = matmul(d2.T, h_prev.reshape(-1, h_prev.shape[-1]))  # (G*H, H)
    dbias = accumulated_sum(d2, axis=0) if has_bias else None        # (G*H,)
    return dweight_ih, dweight_hh, dbias, (None if dbias is None else dbias.copy())


@dispatched
def rnn_forward(x, h0, weight_ih, weight_hh, bias_ih=None, bias_hh=None):
    """Elman RNN with tanh; returns ``(out, cache)``, out = h_1..h_T (B, T, H). h0 None: zeros."""
    xp, b, t, hid, h0, _ = _check(x, h0, None, weight_ih, weight_hh, bias_ih, bias_hh, 1)
    pre = _input_part(x, weight_ih, bias_ih, bias_hh)    # (B, T, H) the x part of every step
    h = xp.empty((b, t, hid), dtype=x.dtype)             # (B, T, H)
    w_hh_t = weight_hh.T                                 # (H, H)
    prev = h0
    for s in range(t):
        a = pre[:, s] + matmul(prev, w_hh_t)             # (B, H)
        prev = h[:, s] = xp.tanh(a)
    return h, RNNCache(x, h0, weight_ih, weight_hh, h, bias_ih is not None)


@dispatched
def rnn_backward(dout, cache: RNNCache):
    """Returns ``(dx, dh0, dweight_ih, dweight_hh, dbias_ih, dbias_hh)`` (biases None when absent).

    ``dout`` (B, T, H) is the gradient of every output step; the gradient of h_T returned as h_n
    by a module is added into ``dout[:, -1]``."""
    x, h0, weight_ih, weight_hh, h, has_bias = cache
    expect_grad(dout, "dout", h.shape, h.dtype, "the outputs h_1..h_T (B, T, hidden_size)")
    xp = get_array_module(dout, h)
    da = xp.empty_like(h)                                # (B, T, H)
    dh_next = xp.zeros_like(h0)                          # (B, H) from step t+1
    for s in range(h.shape[1] - 1, -1, -1):
        # fwd: h_t = tanh(a_t)  ->  da_t = (dout_t + dh_t) * (1 - h_t^2)
        hs = h[:, s]
        da[:, s] = (dout[:, s] + dh_next) * (1 - hs * hs)
        # fwd: a_t = ... + h_{t-1} W_hh^T  ->  dh_{t-1} = da_t W_hh
        dh_next = matmul(da[:, s], weight_hh)            # (B, H)
    # fwd: a_t = x_t W_ih^T + b_ih + h_{t-1} W_hh^T + b_hh  ->  all steps at once
    dx = matmul_last(da, weight_ih)                      # (B, T, I)
    dweight_ih, dweight_hh, dbias_ih, dbias_hh = _param_grads(da, x, h0, h, has_bias, xp)
    return dx, dh_next, dweight_ih, dweight_hh, dbias_ih, dbias_hh


def _sigmoid(z, xp):
    return 0.5 * (1 + xp.tanh(0.5 * z))                  # = 1 / (1 + exp(-z)), overflow-free


@dispatched
def lstm_forward(x, h0, c0, weight_ih, weight_hh, bias_ih=None, bias_hh=None):
    """LSTM; returns ``(out, c_n, cache)``: out = h_1..h_T (B, T, H), c_n = c_T (B, H)."""
    xp, b, t, hid, h0, c0 = _check(x, h0, c0, weight_ih, weight_hh, bias_ih, bias_hh, 4)
    pre = _input_part(x, weight_ih, bias_ih, bias_hh)    # (B, T, 4H)
    gates = xp.empty_like(pre)                           # (B, T, 4H)
    c = xp.empty((b, t, hid), dtype=x.dtype)             # (B, T, H)
    tanh_c, h = xp.empty_like(c), xp.empty_like(c)       # (B, T, H)
    w_hh_t = weight_hh.T                                 # (H, 4H)
    h_prev, c_prev = h0, c0
    for s in range(t):
        z = pre[:, s] + matmul(h_prev, w_hh_t)           # (B, 4H)
        gs = gates[:, s]
        gs[:, :2 * hid] = _sigmoid(z[:, :2 * hid], xp)   # i, f
        gs[:, 2 * hid:3 * hid] = xp.tanh(z[:, 2 * hid:3 * hid])                   # g
        gs[:, 3 * hid:] = _sigmoid(z[:, 3 * hid:], xp)   # o
        i, f, g, o = gs[:, :hid], gs[:, hid:2 * hid], gs[:, 2 * hid:3 * hid], gs[:, 3 * hid:]
        c_prev = c[:, s] = f * c_prev + i * g            # (B, H)
        tanh_c[:, s] = xp.tanh(c_prev)
        h_prev = h[:, s] = o * tanh_c[:, s]              # (B, H)
    cache = LSTMCache(x, h0, c0, weight_ih, weight_hh, gates, c, tanh_c, h, bias_ih is not None)
    return h, c[:, -1].copy(), cache


@dispatched
def lstm_backward(dout, cache: LSTMCache, dc_n=None):
    """Returns ``(dx, dh0, dc0, dweight_ih, dweight_hh, dbias_ih, dbias_hh)``.

    ``dout`` (B, T, H) is the gradient of every h_t (a module adds dh_n into ``dout[:, -1]``);
    ``dc_n`` (B, H) the gradient of the returned c_n (None: zero)."""
    x, h0, c0, weight_ih, weight_hh, gates, c, tanh_c, h, has_bias = cache
    expect_grad(dout, "dout", h.shape, h.dtype, "the outputs h_1..h_T (B, T, hidden_size)")
    if dc_n is not None:
        expect_grad(dc_n, "dc_n", c.shape[:1] + c.shape[2:], c.dtype, "the last cell state c_T (B, hidden_size)")
    xp = get_array_module(dout, h)
    hid = h.shape[-1]
    dpre = xp.empty_like(gates)                          # (B, T, 4H)
    dh_next = xp.zeros_like(h0)                          # (B, H)
    dc_next = xp.zeros_like(c0) if dc_n is None else dc_n                       # (B, H)
    for s in range(h.shape[1] - 1, -1, -1):
        gs, tc = gates[:, s], tanh_c[:, s]
        i, f, g, o = gs[:, :hid], gs[:, hid:2 * hid], gs[:, 2 * hid:3 * hid], gs[:, 3 * hid:]
        c_prev = c[:, s - 1] if s else c0
        dh = dout[:, s] + dh_next                        # (B, H)
        # fwd: h_t = o * tanh(c_t)  ->  do = dh * tanh(c_t),  dc += dh * o * (1 - tanh(c_t)^2)
        do = dh * tc
        dc = dc_next + dh * o * (1 - tc * tc)            # (B, H)
        # fwd: c_t = f * c_{t-1} + i * g  ->  di = dc g,  df = dc c_{t-1},  dg = dc i,  dc_{t-1} = dc f
        d = dpre[:, s]
        # fwd: i, f, o = sigmoid(z), g = tanh(z)  ->  dz = d * s (1 - s),  dz = d * (1 - g^2)
        d[:, :hid] = dc * g * i * (1 - i)
        d[:, hid:2 * hid] = dc * c_prev * f * (1 - f)
        d[:, 2 * hid:3 * hid] = dc * i * (1 - g * g)
        d[:, 3 * hid:] = do * o * (1 - o)
        dc_next = dc * f
        # fwd: z_t = ... + h_{t-1} W_hh^T  ->  dh_{t-1} = dz_t W_hh
        dh_next = matmul(d, weight_hh)                   # (B, H)
    # fwd: z_t = x_t W_ih^T + b_ih + h_{t-1} W_hh^T + b_hh  ->  all steps at once
    dx = matmul_last(dpre, weight_ih)                    # (B, T, I)
    dweight_ih, dweight_hh, dbias_ih, dbias_hh = _param_grads(dpre, x, h0, h, has_bias, xp)
    return dx, dh_next, dc_next, dweight_ih, dweight_hh, dbias_ih, dbias_hh
