"""The feed-forward block: references, gradchecks with dropout on and off (a fixed mask), bias=False,
bad input."""
import numpy as np
import pytest
from hypothesis import assume, given, strategies as st

from npformer.backend import backend_name, default_rng
from npformer.ops.feedforward import feed_forward_backward, feed_forward_forward
from npformer.tools.gradcheck import gradcheck
from tests.helpers import assert_gradcheck, away_from_zero, host, randn, seeds


def _seeded(fn, seed, xp, **fixed):
    name = backend_name(xp)

    def run(**inputs):
        return fn(**inputs, **fixed, rng=default_rng(seed, name))
    run.__name__ = fn.__name__
    return run


@given(lead=st.tuples(st.integers(1, 3), st.integers(1, 4)), c=st.integers(1, 4), f=st.integers(1, 6),
       activation=st.sampled_from(["relu", "gelu", "gelu_tanh"]), p=st.sampled_from([0.0, 0.3]),
       bias=st.booleans(), seed=seeds)
def test_feed_forward_gradcheck(xp, lead, c, f, activation, p, bias, seed):
    inputs = {"x": away_from_zero(xp, lead + (c,), seed), "w1": randn(xp, (f, c), seed + 1),
              "b1": randn(xp, (f,), seed + 2), "w2": randn(xp, (c, f), seed + 3), "b2": randn(xp, (c,), seed + 4)}
    if not bias:
        inputs["b1"] = inputs["b2"] = None
        inputs = {k: v for k, v in inputs.items() if v is not None}
        fwd = _seeded(lambda x, w1, w2, **kw: feed_forward_forward(x, w1, None, w2, None, **kw), seed, xp,
                      activation=activation, dropout_p=p)

        def bwd(d, cache):
            dx, dw1, _, dw2, _ = feed_forward_backward(d, cache)
            return dx, dw1, dw2
    else:
        fwd = _seeded(feed_forward_forward, seed, xp, activation=activation, dropout_p=p)
        bwd = feed_forward_backward
    # relu's kinks: the hidden pre-activations must stay away from 0 as well
    if activation == "relu":
        h = host(inputs["x"]) @ host(inputs["w1"]).T + (host(inputs["b1"]) if bias else 0)
        assume(np.abs(h).min() >= 1e-2)
    assert_gradcheck(gradcheck(fwd, bwd, inputs, seed=seed))


def test_feed_forward_reference_and_eval_mode(xp):
    x, w1, b1, w2, b2 = randn(xp, (2, 3, 4), 0), randn(xp, (5, 4), 1), randn(xp, (5,), 2), randn(xp, (4, 5), 3), randn(xp, (4,), 4)
    out, _ = feed_forward_forward(x, w1, b1, w2, b2, dropout_p=0.5, training=False)
    ref = np.maximum(host(x) @ host(w1).T + host(b1), 0) @ host(w2).T + host(b2)
    np.testing.assert_allclose(host(out), ref, rtol=1e-12)


def test_feed_forward_bad_input(xp):
    x, w1, w2 = randn(xp, (2, 4), 0), randn(xp, (5, 4), 1), randn(xp, (4, 5), 2)
    with pytest.raises(ValueError, match="activation: expected one of 'relu', 'gelu', 'gelu_tanh'"):
        feed_forward_forward(x, w1, None, w2, None, activation="tanh")
    with pytest.raises(ValueError, match=r"w2: expected shape \(C, F\)=\(4, 5\)"):
        feed_forward_forward(x, w1, None, randn(xp, (5, 4), 2), None)
    with pytest.raises(ValueError, match=r"last axis of size C_in=4"):
        feed_forward_forward(randn(xp, (2, 3), 0), w1, None, w2, None)
