"""residual_dropout (+ layer norm): against the formulas, the dropout op's mask for one seed, gradchecks
with a fixed mask (post-norm: no ds; pre-norm: ds and dy), eval mode, dtypes, bad input."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from npformer.backend import backend_name, default_rng
from npformer.ops.dropout import dropout_backward, dropout_forward
from npformer.ops.residual import (residual_dropout_forward, residual_dropout_layer_norm_backward,
                                   residual_dropout_layer_norm_forward)
from npformer.tools.gradcheck import gradcheck
from tests.helpers import assert_gradcheck, host, randn, seeds

shapes = st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(2, 6))


def _layer_norm(s, w, b, eps=1e-5):
    mu = s.mean(-1, keepdims=True)
    return (s - mu) / np.sqrt(((s - mu) ** 2).mean(-1, keepdims=True) + eps) * w + b


@given(shape=shapes, p=st.sampled_from([0.0, 0.2, 0.6]), seed=seeds)
def test_forward_is_add_then_layer_norm_with_the_dropout_ops_mask(xp, shape, p, seed):
    x, br = randn(xp, shape, seed), randn(xp, shape, seed + 1)
    w, b = randn(xp, shape[-1:], seed + 2), randn(xp, shape[-1:], seed + 3)
    name = backend_name(xp)
    s, y, cache = residual_dropout_layer_norm_forward(x, br, w, b, p=p, rng=default_rng(seed, name))
    d, drop = dropout_forward(br, p, rng=default_rng(seed, name))
    np.testing.assert_array_equal(host(s), host(x + d))
    if p:
        np.testing.assert_array_equal(host(cache.drop.keep), host(drop.keep))
    np.testing.assert_allclose(host(y), _layer_norm(host(x + d), host(w), host(b)), rtol=1e-12, atol=1e-12)
    s2, drop2 = residual_dropout_forward(x, br, p=p, rng=default_rng(seed, name))
    np.testing.assert_array_equal(host(s2), host(s))
    dout = randn(xp, shape, seed + 4)
    np.testing.assert_array_equal(host(dropout_backward(dout, drop2)), host(dropout_backward(dout, drop)))


@given(shape=shapes, p=st.sampled_from([0.0, 0.3]), affine=st.booleans(), seed=seeds)
def test_gradcheck_post_norm(xp, shape, p, affine, seed):
    """y = LN(x + dropout(branch)), s unused: ds = None."""
    name = backend_name(xp)

    def forward(x, branch, weight=None, bias=None):     # a fresh generator per call: one fixed mask
        s, y, cache = residual_dropout_layer_norm_forward(x, branch, weight, bias, p=p, rng=default_rng(seed, name))
        return y, cache

    inputs = {"x": randn(xp, shape, seed, scale=2.0), "branch": randn(xp, shape, seed + 1)}
    if affine:
        inputs.update(weight=randn(xp, shape[-1:], seed + 2), bias=randn(xp, shape[-1:], seed + 3))
    assert_gradcheck(gradcheck(forward, lambda dy, cache: residual_dropout_layer_norm_backward(None, dy, cache),
                               inputs, seed=seed))


@given(shape=shapes, p=st.sampled_from([0.0, 0.3]), seed=seeds)
def test_gradcheck_pre_norm_both_outputs(xp, shape, p, seed):
    """(s, y) both used: the fake loss sees them stacked; the backward gets ds and dy."""
    name = backend_name(xp)

    def forward(x, branch, weight, bias):
        s, y, cache = residual_dropout_layer_norm_forward(x, branch, weight, bias, p=p, rng=default_rng(seed, name))
        return xp.stack([s, y]), cache

    def backward(d, cache):
        return residual_dropout_layer_norm_backward(d[0], d[1], cache)

    inputs = {"x": randn(xp, shape, seed, scale=2.0), "branch": randn(xp, shape, seed + 1),
              "weight": randn(xp, shape[-1:], seed + 2), "bias": randn(xp, shape[-1:], seed + 3)}
    assert_gradcheck(gradcheck(forward, backward, inputs, seed=seed))


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_eval_mode_is_the_plain_residual_and_dtypes_kept(xp, dtype):
    x, br = randn(xp, (2, 3, 5), 0, dtype), randn(xp, (2, 3, 5), 1, dtype)
    s, y, cache = residual_dropout_layer_norm_forward(x, br, p=0.5, training=False)
    assert s.dtype == y.dtype == x.dtype and cache.drop.keep is None
    np.testing.assert_array_equal(host(s), host(x + br))
    dx, dbranch, dw, db = residual_dropout_layer_norm_backward(randn(xp, (2, 3, 5), 2, dtype),
                                                               randn(xp, (2, 3, 5), 3, dtype), cache)
    assert dx.dtype == dbranch.dtype == x.dtype and dw is None and db is None
    np.testing.assert_array_equal(host(dx), host(dbranch))
    assert dx is not dbranch


def test_bad_input(xp):
    x = randn(xp, (2, 4), 0)
    with pytest.raises(ValueError, match=r"branch: expected shape \(2, 4\) \(the shape of the skip input x\)"):
        residual_dropout_forward(x, randn(xp, (2, 5), 1))
    with pytest.raises(TypeError, match="dtype mismatch: x is float64 but branch is float32"):
        residual_dropout_layer_norm_forward(x, randn(xp, (2, 4), 1, "float32"))
    with pytest.raises(ValueError, match="needs rng"):
        residual_dropout_layer_norm_forward(x, x, p=0.5)
    _, _, cache = residual_dropout_layer_norm_forward(x, x)
    with pytest.raises(ValueError, match=r"ds: expected the shape of the forward's output, \(2, 4\)"):
        residual_dropout_layer_norm_backward(randn(xp, (4, 2), 0), x, cache)
