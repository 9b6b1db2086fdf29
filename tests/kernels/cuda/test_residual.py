"""Fused residual add + dropout (+ layer norm) against the reference ops: the same mask position by
position for one seed, s exactly, y and every gradient (with and without ds), either backward on
either cache, float64 gradchecks through the kernels, p = 1, layouts, bad input."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from npformer.kernels import cuda, disabled
from npformer.ops.layernorm import normalised
from npformer.ops.residual import (residual_dropout_forward, residual_dropout_layer_norm_backward,
                                   residual_dropout_layer_norm_forward)
from npformer.tools.gradcheck import gradcheck
from tests.helpers import assert_gradcheck, assert_same_dropout, host, randn, seeds
from tests.kernels.cuda.conftest import DTYPES, assert_close

row_lengths = st.sampled_from([1, 2, 7, 40, 300])
leading = st.lists(st.integers(1, 3), min_size=0, max_size=2).map(tuple)
dropouts = st.sampled_from([(0.0, True), (0.1, True), (0.5, True), (0.5, False)])


def rng(fx, seed):
    return fx.xp.random.default_rng(seed)


def _scale(dy, ds, w, cache):
    """|dx| <= |ds| + rstd (|g| + mean|g| + |xhat| mean|g xhat|), g = dy w: the sizes the sums add up."""
    c = dy.shape[-1]
    g = np.abs(host(dy).astype(np.float64)).reshape(-1, c) * (1 if w is None else np.abs(host(w).astype(np.float64)))
    xhat = np.abs(host(normalised(cache)).astype(np.float64)).reshape(-1, c)
    rstd = np.abs(host(cache.rstd).astype(np.float64)).reshape(-1, 1)
    d = rstd * (g + g.mean(-1, keepdims=True) + xhat * (g * xhat).mean(-1, keepdims=True))
    if ds is not None:
        d = d + np.abs(host(ds).astype(np.float64)).reshape(-1, c)
    dy_abs = np.abs(host(dy).astype(np.float64)).reshape(-1, c)
    return [max(1.0, float(v.max(initial=0))) for v in (d, 2 * d, (dy_abs * xhat).sum(0), dy_abs.sum(0))]


@given(lead=leading, n=row_lengths, drop=dropouts, affine=st.sampled_from(["both", "weight", "none"]),
       with_ds=st.booleans(), dtype=st.sampled_from(DTYPES), seed=seeds)
def test_matches_the_reference_ops(fx, lead, n, drop, affine, with_ds, dtype, seed):
    p, training = drop
    shape = lead + (n,)
    x, br = randn(fx.xp, shape, seed, dtype, scale=2.0), randn(fx.xp, shape, seed + 1, dtype)
    w = randn(fx.xp, (n,), seed + 2, dtype) if affine != "none" else None
    b = randn(fx.xp, (n,), seed + 3, dtype) if affine == "both" else None
    dy, ds = randn(fx.xp, shape, seed + 4, dtype), (randn(fx.xp, shape, seed + 5, dtype) if with_ds else None)
    kw = dict(p=p, training=training, eps=1e-5)
    with disabled():
        s_ref, y_ref, c_ref = residual_dropout_layer_norm_forward(x, br, w, b, rng=rng(fx, seed), **kw)
        grads_ref = residual_dropout_layer_norm_backward(ds, dy, c_ref)
    s, y, cache = cuda.residual_dropout_layer_norm_forward(x, br, w, b, rng=rng(fx, seed), **kw)
    assert_same_dropout(cache.drop, c_ref.drop, stored=False)   # the same entries and scale; only the seed kept
    np.testing.assert_array_equal(host(s), host(s_ref))  # d = branch m, then x + d: the same roundings
    assert_close(y, y_ref, dtype, what="y")
    acc = str(c_ref.norm.rstd.dtype)
    assert cache.norm.x is s and cache.norm.mean.dtype == acc    # s itself, no xhat
    assert_close(cache.norm.mean, c_ref.norm.mean, acc, scale=max(1.0, float(np.abs(host(s).astype(np.float64)).max())),
                 what="mean")
    assert_close(cache.norm.rstd, c_ref.norm.rstd, acc, what="rstd")
    assert_close(normalised(cache.norm), normalised(c_ref.norm), acc, what="xhat")
    scales = _scale(dy, ds, w, c_ref.norm)
    with disabled():
        plain_on_fused = residual_dropout_layer_norm_backward(ds, dy, cache)
    for label, grads in (("fused", cuda.residual_dropout_layer_norm_backward(ds, dy, cache)),
                         ("plain backward on the fused cache", plain_on_fused),
                         ("fused backward on the plain cache", cuda.residual_dropout_layer_norm_backward(ds, dy, c_ref))):
        for name, got, ref, scale in zip(("dx", "dbranch", "dweight", "dbias"), grads, grads_ref, scales):
            assert (got is None) == (ref is None), f"{label}: {name}"
            if ref is not None:
                assert_close(got, ref, dtype, scale=scale, what=f"{label}: {name}")


@given(shape=st.lists(st.integers(1, 9), min_size=0, max_size=3).map(tuple), drop=dropouts,
       dtype=st.sampled_from(DTYPES), seed=seeds)
def test_residual_dropout_is_the_reference_bit_for_bit(fx, shape, drop, dtype, seed):
    p, training = drop
    x, br = randn(fx.xp, shape, seed, dtype, scale=2.0), randn(fx.xp, shape, seed + 1, dtype)
    with disabled():
        s_ref, c_ref = residual_dropout_forward(x, br, p=p, rng=rng(fx, seed), training=training)
    s, cache = cuda.residual_dropout_forward(x, br, p=p, rng=rng(fx, seed), training=training)
    np.testing.assert_array_equal(host(s), host(s_ref))
    assert_same_dropout(cache, c_ref, stored=False)


@given(shape=st.tuples(st.integers(1, 3), st.integers(2, 6)), p=st.sampled_from([0.0, 0.3]),
       affine=st.booleans(), seed=seeds)
def test_gradcheck_float64_both_outputs(fx, shape, p, affine, seed):
    def forward(x, branch, weight=None, bias=None):   # a fresh generator per call: one fixed mask
        s, y, cache = cuda.residual_dropout_layer_norm_forward(x, branch, weight, bias, p=p, rng=rng(fx, seed))
        return fx.xp.stack([s, y]), cache

    def backward(d, cache):
        return cuda.residual_dropout_layer_norm_backward(d[0], d[1], cache)

    inputs = {"x": randn(fx.xp, shape, seed, scale=2.0), "branch": randn(fx.xp, shape, seed + 1)}
    if affine:
        inputs.update(weight=randn(fx.xp, shape[-1:], seed + 2), bias=randn(fx.xp, shape[-1:], seed + 3))
    assert_gradcheck(gradcheck(forward, backward, inputs, seed=seed))


@given(shape=st.tuples(st.integers(1, 3), st.integers(2, 6)), seed=seeds)
def test_gradcheck_float64_post_norm(fx, shape, seed):
    def forward(x, branch, weight, bias):
        return cuda.residual_dropout_layer_norm_forward(x, branch, weight, bias, p=0.4, rng=rng(fx, seed))[1:]

    inputs = {"x": randn(fx.xp, shape, seed, scale=2.0), "branch": randn(fx.xp, shape, seed + 1),
              "weight": randn(fx.xp, shape[-1:], seed + 2), "bias": randn(fx.xp, shape[-1:], seed + 3)}
    assert_gradcheck(gradcheck(forward, lambda dy, c: cuda.residual_dropout_layer_norm_backward(None, dy, c),
                               inputs, seed=seed))


def test_p_one_drops_everything_and_draws_nothing(fx):
    x, br = randn(fx.xp, (3, 5), 0), randn(fx.xp, (3, 5), 1)
    g = rng(fx, 0)
    s, y, cache = cuda.residual_dropout_layer_norm_forward(x, br, p=1.0, rng=g)
    np.testing.assert_array_equal(host(s), host(x))
    assert not host(cache.drop.keep).any()
    assert g.random() == rng(fx, 0).random()            # the generator was not advanced


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_inputs_and_many_rows(fx, dtype):
    x = randn(fx.xp, (6, 4, 10), 5, dtype).transpose(1, 0, 2)[:, ::2]      # (4, 3, 10), strided
    br = randn(fx.xp, (10, 3, 4), 6, dtype).transpose(2, 1, 0)
    dy = randn(fx.xp, (4, 3, 10), 7, dtype)
    w = randn(fx.xp, (20,), 8, dtype)[::2]
    before = [host(a).copy() for a in (x, br, w)]
    with disabled():
        s_ref, y_ref, c_ref = residual_dropout_layer_norm_forward(x, br, w, p=0.3, rng=rng(fx, 1))
        grads_ref = residual_dropout_layer_norm_backward(dy, dy, c_ref)
    s, y, cache = cuda.residual_dropout_layer_norm_forward(x, br, w, p=0.3, rng=rng(fx, 1))
    np.testing.assert_array_equal(host(s), host(s_ref))
    assert_close(y, y_ref, dtype)
    for got, ref, scale in zip(cuda.residual_dropout_layer_norm_backward(dy, dy, cache)[:3], grads_ref,
                               _scale(dy, dy, w, c_ref.norm)):
        assert_close(got, ref, dtype, scale=scale)
    for a, h in zip((x, br, w), before):
        np.testing.assert_array_equal(host(a), h)        # inputs untouched
    x = randn(fx.xp, (600, 3), 9, "float32")             # many rows: the parameter column pass in chunks
    with disabled():
        _, _, c_ref = residual_dropout_layer_norm_forward(x, x, x[0], x[1])
        grads_ref = residual_dropout_layer_norm_backward(None, x, c_ref)
    _, _, cache = cuda.residual_dropout_layer_norm_forward(x, x, x[0], x[1])
    for got, ref, scale in zip(cuda.residual_dropout_layer_norm_backward(None, x, cache), grads_ref,
                               _scale(x, None, x[0], c_ref.norm)):
        assert_close(got, ref, "float32", scale=scale)


def test_bad_input_is_refused(fx):
    x = randn(fx.xp, (2, 4), 0)
    with pytest.raises(ValueError, match=r"branch: expected shape \(2, 4\)"):
        cuda.residual_dropout_layer_norm_forward(x, randn(fx.xp, (2, 5), 0))
    with pytest.raises(TypeError, match="dtype mismatch"):
        cuda.residual_dropout_forward(x, randn(fx.xp, (2, 4), 0, "float32"))
    with pytest.raises(ValueError, match="needs rng"):
        cuda.residual_dropout_forward(x, x, p=0.5)
    with pytest.raises(ValueError, match=r"weight: expected shape \(4,\)"):
        cuda.residual_dropout_layer_norm_forward(x, x, randn(fx.xp, (3,), 0))
    _, _, cache = cuda.residual_dropout_layer_norm_forward(x, x)
    with pytest.raises(TypeError, match="dy: expected the dtype of the forward's output, float64"):
        cuda.residual_dropout_layer_norm_backward(None, randn(fx.xp, (2, 4), 0, "float32"), cache)
