"""Every reference op's 16-bit path (float16, and bfloat16 through ml_dtypes) against float64 on the same
inputs, on NumPy: the forward's outputs and the backward's gradients within the 16-bit dtype's rounding.
The reference ops alone run (``kernels.disabled()``; bfloat16 never reaches a fast path, and the fast
paths are held to the reference ops by their own parity tests).

The inputs are drawn in float64 and rounded to the 16-bit dtype once; the reference runs the op in
float64 on exactly those values, so the only differences are the 16-bit path's own roundings. With
u the unit roundoff (float16 2^-11, bfloat16 2^-8; ``ml_dtypes.finfo(...).eps / 2``), each output
is rounded once (u of its magnitude), and each intermediate the op rounds to 16 bits (a softmax's
P before P @ V, a hidden layer between two products, an RNN's state from step to step) adds u of
each of the terms it passes into a sum of n of them; float32 accumulation adds n * 2^-24 of those
terms (below u for every n here). So, per output, with scale = max(1, max |reference|) standing for
the terms' magnitude (the inputs are standard normal, the sizes small)::

    max |got - reference| <= (1 + rounded * n) * u * scale

``rounded``: the 16-bit roundings of intermediates on the longest path to that output, ``n``: the
longest sum they feed; both stated in each case below. (CuPy's 16-bit paths are checked by the
CUDA kernels' tests against these same reference ops.)
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from npformer import kernels
from npformer.backend import bfloat16, default_rng
from npformer.ops import (activations, attention, batchnorm, cross_entropy, dropout, embedding, feedforward,
                          flash_attention, layernorm, linear, multihead, optim, relative_attention, residual, rnn,
                          softmax)

pytest.importorskip("ml_dtypes", reason="bfloat16 needs ml_dtypes (pip install 'npformer[bfloat16]')")

LOW = ("float16", "bfloat16")
ROUNDOFF = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}      # u: half the spacing above 1


def resolve(name):
    return bfloat16() if name == "bfloat16" else np.dtype(name)


class Inputs:
    """Standard-normal inputs drawn in float64, rounded to ``low``, held in ``dtype`` (``low`` itself
    for the 16-bit run, float64 for the reference: the same values)."""

    def __init__(self, low, dtype):
        self.low, self.dtype, self.seed = resolve(low), resolve(dtype), 0

    def __call__(self, *shape, scale=1.0):
        self.seed += 1
        a = np.random.default_rng(self.seed).standard_normal(shape) * scale
        return a.astype(self.low).astype(self.dtype)


def _linear(a):
    x, w, b = a(4, 64, 8), a(5, 8, scale=0.5), a(5)
    out, cache = linear.linear_forward(x, w, b)
    return (out, *linear.linear_backward(a(4, 64, 5), cache))     # dW, db: sums over 256 rows


def _relu(a):
    x = a(6, 7)
    x = np.where(np.abs(x) < 0.05, 0.5, x).astype(x.dtype)            # away from the kink
    y, cache = activations.relu_forward(x)
    return y, activations.relu_backward(a(6, 7), cache)


def _gelu(approximate):
    def case(a):
        y, cache = activations.gelu_forward(a(6, 7, scale=2.0), approximate=approximate)
        return y, activations.gelu_backward(a(6, 7), cache)
    return case


def _dropout(a):
    x = a(6, 7)
    y, cache = dropout.dropout_forward(x, 0.25, rng=default_rng(3))     # the same mask in both runs
    return y, dropout.dropout_backward(a(6, 7), cache)


def _softmax(log):
    fwd, bwd = ((softmax.log_softmax_forward, softmax.log_softmax_backward) if log else
                (softmax.softmax_forward, softmax.softmax_backward))

    def case(a):
        y, cache = fwd(a(5, 9, scale=3.0))
        return y, bwd(a(5, 9), cache)
    return case


def _layer_norm(a):
    y, cache = layernorm.layer_norm_forward(a(4, 64, 16), a(16), a(16))
    return (y, *layernorm.layer_norm_backward(a(4, 64, 16), cache))   # dw, db: sums over 256 rows


def _batch_norm(a):
    y, _, cache = batchnorm.batch_norm_forward(a(4, 64, 5), a(5), a(5))
    return (y, *batchnorm.batch_norm_backward(a(4, 64, 5), cache))   # statistics over 256 rows


def _cross_entropy(a):
    targets = np.random.default_rng(9).integers(0, 11, (4, 6))
    loss, cache = cross_entropy.cross_entropy_forward(a(4, 6, 11, scale=2.0), targets, label_smoothing=0.1)
    return loss, cross_entropy.cross_entropy_backward(np.asarray(1.5, loss.dtype), cache)


def _embedding(a):
    ids = np.random.default_rng(9).integers(0, 7, (4, 64))         # repeated ids: the backward sums them
    out, cache = embedding.embedding_forward(ids, a(7, 5))
    return out, embedding.embedding_backward(a(4, 64, 5), cache)


def _sdpa(a):
    q, k, v = a(2, 2, 5, 8), a(2, 2, 6, 8), a(2, 2, 6, 4)
    out, _, cache = attention.scaled_dot_product_attention_forward(q, k, v, is_causal=True,
                                                                   causal_alignment="bottom_right")
    return (out, *attention.scaled_dot_product_attention_backward(a(2, 2, 5, 4), cache))


def _flash(a):
    q, k, v = a(2, 2, 5, 8), a(2, 2, 6, 8), a(2, 2, 6, 4)
    out, cache = flash_attention.flash_attention_forward(q, k, v, is_causal=True, causal_alignment="bottom_right",
                                                         block_q=2, block_k=4)
    return (out, *flash_attention.flash_attention_backward(a(2, 2, 5, 4), cache))


def _feed_forward(a):
    x, w1, b1, w2, b2 = a(3, 4, 8), a(16, 8, scale=0.4), a(16), a(8, 16, scale=0.3), a(8)
    out, cache = feedforward.feed_forward_forward(x, w1, b1, w2, b2, activation="gelu")
    return (out, *feedforward.feed_forward_backward(a(3, 4, 8), cache))


def _self_attention(a):
    e = 8
    x, w_in, b_in, w_out, b_out = a(2, 5, e), a(3 * e, e, scale=0.4), a(3 * e), a(e, e, scale=0.4), a(e)
    out, weights, cache = multihead.self_attention_forward(x, 2, w_in, b_in, w_out, b_out, is_causal=True,
                                                           need_weights=True)      # averaged over the heads
    return (out, weights, *(g for g in multihead.self_attention_backward(a(2, 5, e), cache) if g is not None))


def _cross_attention(a):
    e = 8
    w_in, b_in, w_out, b_out = a(3 * e, e, scale=0.4), a(3 * e), a(e, e, scale=0.4), a(e)
    out, _, cache = multihead.multi_head_attention_forward(a(2, 4, e), a(2, 6, e), a(2, 6, e), 2, w_in, b_in,
                                                           w_out, b_out, need_weights=False)
    return (out, *(g for g in multihead.multi_head_attention_backward(a(2, 4, e), cache) if g is not None))


def _rel_shift(a):
    y, cache = relative_attention.rel_shift_forward(a(2, 3, 4, 6))
    return y, relative_attention.rel_shift_backward(a(2, 3, 4, 6), cache)


def _relative_attention(a):
    h, hs, tq, tk, c = 2, 4, 3, 5, 8
    q, k, v = a(2, h, tq, hs), a(2, h, tk, hs), a(2, h, tk, hs)
    out, cache = relative_attention.relative_attention_forward(q, k, v, a(tk, c), a(h * hs, c, scale=0.4),
                                                               a(h, hs), a(h, hs))
    return (out, *relative_attention.relative_attention_backward(a(2, h, tq, hs), cache))


def _residual(a):
    s, _ = residual.residual_dropout_forward(a(3, 4, 8), a(3, 4, 8), p=0.25, rng=default_rng(3))
    s2, y, ncache = residual.residual_dropout_layer_norm_forward(a(4, 64, 8), a(4, 64, 8), a(8), a(8), p=0.25,
                                                                  rng=default_rng(4))
    grads = residual.residual_dropout_layer_norm_backward(a(4, 64, 8), a(4, 64, 8), ncache)
    return (s, s2, y, *(g for g in grads if g is not None))


def _rnn(a):
    x, h0, w_ih, w_hh, b_ih, b_hh = a(2, 5, 4), a(2, 6), a(6, 4, scale=0.4), a(6, 6, scale=0.3), a(6), a(6)
    out, cache = rnn.rnn_forward(x, h0, w_ih, w_hh, b_ih, b_hh)
    return (out, *(g for g in rnn.rnn_backward(a(2, 5, 6), cache) if g is not None))   # db: over B*T = 10


def _lstm(a):
    x, h0, c0 = a(2, 5, 4), a(2, 3), a(2, 3)
    w_ih, w_hh, b_ih, b_hh = a(12, 4, scale=0.4), a(12, 3, scale=0.4), a(12), a(12)
    out, c_n, cache = rnn.lstm_forward(x, h0, c0, w_ih, w_hh, b_ih, b_hh)
    return (out, c_n, *(g for g in rnn.lstm_backward(a(2, 5, 3), cache, dc_n=a(2, 3)) if g is not None))


def _sum_of_squares(a):
    return (optim.sum_of_squares(a(40, 9)),)


# name: (case, rounded, n) -- the intermediates rounded to 16 bits on the longest path, and the
# longest sum they feed (see the module docstring)
CASES = {
    "linear": (_linear, 1, 1),                        # the product rounded, then the bias added
    "relu": (_relu, 0, 1),
    "gelu": (_gelu("none"), 0, 1),                    # computed in float32, rounded once
    "gelu_tanh": (_gelu("tanh"), 0, 1),
    "dropout": (_dropout, 1, 1),                      # 1 / (1 - p) is rounded to the dtype
    "softmax": (_softmax(False), 1, 9),               # y rounded, then sum(dy * y) over 9
    "log_softmax": (_softmax(True), 1, 9),            # log y rounded, exp(log y) * sum(dy)
    "layer_norm": (_layer_norm, 0, 1),                # statistics and xhat in float32
    "batch_norm": (_batch_norm, 0, 1),
    "cross_entropy": (_cross_entropy, 0, 1),          # float32 throughout, rounded at the end
    "embedding": (_embedding, 0, 1),                  # rows copied; repeats summed in float64
    "sdpa": (_sdpa, 2, 6),                            # P rounded, then P @ V over Tk = 6; dP
    "flash": (_flash, 2, 6),                          # the same, a block at a time
    "feed_forward": (_feed_forward, 4, 16),           # h, gelu(h) rounded, summed over F = 16; twice back
    "self_attention": (_self_attention, 6, 24),       # q/k/v, P, heads rounded; 3E = 24 back into dx
    "cross_attention": (_cross_attention, 6, 24),
    "rel_shift": (_rel_shift, 0, 1),                  # a copy
    "relative_attention": (_relative_attention, 4, 8),   # r W_r^T, P rounded; C = 8 back into dr
    "residual": (_residual, 2, 8),                    # the dropout scale, s; LayerNorm over C = 8
    "rnn": (_rnn, 10, 6),                             # h rounded at each of T = 5 steps, forward and back
    "lstm": (_lstm, 20, 12),                          # h and c at each of 5 steps; 4H = 12 gates
    "sum_of_squares": (_sum_of_squares, 0, 1),        # float64 sum of the exact squares
}


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("low", LOW)
def test_16_bit_path_matches_float64_within_its_rounding(low, name):
    case, rounded, n = CASES[name]
    with kernels.disabled():
        got = case(Inputs(low, low))
        ref = case(Inputs(low, "float64"))
    u = ROUNDOFF[low]
    tol = (1 + rounded * n) * u
    assert len(got) == len(ref)
    for i, (g, r) in enumerate(zip(got, ref)):
        if name == "sum_of_squares":               # a float64 sum whatever the input's dtype
            assert g.dtype == r.dtype == np.float64
        else:
            assert g.dtype == resolve(low), f"{name} output {i}: dtype {g.dtype}, expected {low}"
        g64, r64 = np.asarray(g).astype(np.float64), np.asarray(r).astype(np.float64)
        assert g64.shape == r64.shape and np.isfinite(r64).all()
        scale = max(1.0, float(np.abs(r64).max()))
        err = float(np.abs(g64 - r64).max())
        assert err <= tol * scale, (f"{name} ({low}) output {i}: max error {err:.3g} > (1 + {rounded} * {n}) * "
                                    f"u {u:g} * scale {scale:.3g}")


def test_the_roundoff_is_ml_dtypes_eps_halved():
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 needs ml_dtypes (pip install 'npformer[bfloat16]')")
    for low in LOW:
        assert ROUNDOFF[low] == float(ml_dtypes.finfo(resolve(low)).eps) / 2
    assert math.isclose(ROUNDOFF["bfloat16"], 2.0 ** -8)
