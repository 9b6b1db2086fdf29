"""Fused dropout forward and backward against the plain op: the same seed gives the same mask, output and
gradient, bit for bit."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from npformer.backend import accumulation_dtype
from npformer.kernels import cuda, disabled
from npformer.ops.dropout import DropoutCache, dropout_backward, dropout_forward, seed_draws
from npformer.tools.gradcheck import gradcheck
from tests.helpers import assert_gradcheck, assert_same_dropout, host, randn, seeds
from tests.kernels.cuda.conftest import DTYPES

shapes = st.lists(st.integers(1, 9), min_size=0, max_size=3).map(tuple)


def rng(fx, seed):
    return fx.xp.random.default_rng(seed)


@given(shape=shapes, p=st.sampled_from([0.1, 0.5, 0.7, 0.9]), dtype=st.sampled_from(DTYPES), seed=seeds)
def test_same_seed_gives_the_plain_mask_and_output_exactly(fx, shape, p, dtype, seed):
    """Both make the seed of the generator's two draws and keep element n by the top 24 bits of
    splitmix64(seed + n golden) (the kernel hashing in its threads), scale by 1/(1-p) in the
    accumulation dtype and round the product once: every value is the same IEEE result, and the
    generator ends the same."""
    x = randn(fx.xp, shape, seed, dtype=dtype, scale=3.0)
    rng_ref, rng_kernel = rng(fx, seed), rng(fx, seed)
    with disabled():
        out_ref, cache_ref = dropout_forward(x, p, rng=rng_ref)
    out, cache = cuda.dropout_forward(x, p, rng=rng_kernel)
    np.testing.assert_array_equal(host(rng_kernel.random(3)), host(rng_ref.random(3)))
    assert out.dtype == x.dtype and cache.keep.dtype == bool and out.shape == x.shape
    np.testing.assert_array_equal(host(cache.keep), host(cache_ref.keep))
    assert cache.scale == cache_ref.scale and cache.scale.dtype == accumulation_dtype(x.dtype)
    np.testing.assert_array_equal(host(out), host(out_ref))
    dout = randn(fx.xp, shape, seed + 1, dtype=dtype)
    with disabled():
        dx_ref = host(dropout_backward(dout, cache_ref))
        np.testing.assert_array_equal(host(dropout_backward(dout, cache)), dx_ref)
    # the mask kept as its seed (as the fused kernels keep it): remade by the plain op, hashed again
    # by the kernel
    seeded = DropoutCache.of_seed(seed_draws(rng(fx, seed), x, fx.xp), p, x)
    assert_same_dropout(seeded, cache_ref, stored=False)
    with disabled():
        np.testing.assert_array_equal(host(dropout_backward(dout, seeded)), dx_ref)
    for c in (cache, cache_ref, seeded):               # the fused backward on every form of cache
        dx = cuda.dropout_backward(dout, c)
        assert dx.dtype == x.dtype
        np.testing.assert_array_equal(host(dx), dx_ref)


def test_float16_where_1_over_1_minus_p_overflows_float16(fx):
    """p = 0.99999: 1 / (1 - p) = 1e5 is beyond float16's 65504; the kernels take it in float32, as
    the plain op keeps it, and give the plain op's values bit for bit, forward and backward, from a
    stored mask and one hashed again: 0 where dropped, x * 1e5 rounded where kept (a kept 1e-3 is
    100.0625, a kept 1 inf), no NaN."""
    p, xp = 0.99999, fx.xp
    x = randn(xp, (1 << 20,), 0, dtype="float16", scale=1e-3)
    with disabled():
        _, cache_ref = dropout_forward(x, p, rng=rng(fx, 4))
    kept = np.flatnonzero(host(cache_ref.keep))
    assert kept.size >= 2
    x_host = host(x)
    x_host[kept[:2]] = [1.0, 1e-3]
    x = xp.asarray(x_host)
    with disabled(), np.errstate(over="ignore"):
        out_ref, cache_ref = dropout_forward(x, p, rng=rng(fx, 4))
        dx_ref = host(dropout_backward(x, cache_ref))
    out, cache = cuda.dropout_forward(x, p, rng=rng(fx, 4))
    np.testing.assert_array_equal(host(out), host(out_ref))
    assert not np.isnan(host(out)).any() and np.count_nonzero(host(out)) == kept.size - (x_host[kept] == 0).sum()
    np.testing.assert_array_equal(host(out)[kept[:2]], [np.inf, 100.0625])
    seeded = DropoutCache.of_seed(seed_draws(rng(fx, 4), x, xp), p, x)
    for c in (cache, seeded):
        np.testing.assert_array_equal(host(cuda.dropout_backward(x, c)), dx_ref)


def test_backward_of_non_finite_and_non_contiguous_gradients(fx):
    """inf or NaN where an entry was dropped gives NaN, as the plain product does; a transposed dout
    is read through a contiguous copy."""
    x = randn(fx.xp, (6, 8), 0, dtype="float32")
    _, cache = cuda.dropout_forward(x, 0.5, rng=rng(fx, 1))
    dout = randn(fx.xp, (8, 6), 1, dtype="float32").T
    dout[0, :] = float("inf")
    dout[1, :] = float("nan")
    with disabled(), np.errstate(invalid="ignore"):
        ref = host(dropout_backward(dout, cache))
    got = host(cuda.dropout_backward(dout, cache))
    np.testing.assert_array_equal(got, ref)
    assert np.isnan(got[0][~host(cache.keep)[0]]).all()
    identity = cuda.dropout_forward(x, 0.5, training=False)[1]
    np.testing.assert_array_equal(host(cuda.dropout_backward(dout, identity)), host(dout))


@given(shape=st.lists(st.integers(1, 5), min_size=0, max_size=2).map(tuple), p=st.sampled_from([0.1, 0.5, 0.9]),
       seed=seeds)
def test_gradcheck_float64_with_fixed_mask(fx, shape, p, seed):
    def forward(x):   # a fresh generator per call: the same mask at every finite-difference point
        return cuda.dropout_forward(x, p, rng=rng(fx, seed))

    assert_gradcheck(gradcheck(forward, cuda.dropout_backward, {"x": randn(fx.xp, shape, seed)}, seed=seed))


def test_inverted_scaling_keeps_the_mean(fx):
    x = fx.xp.ones((200_000,), dtype="float32")
    out, cache = cuda.dropout_forward(x, 0.3, rng=rng(fx, 0))
    kept = host(out) != 0
    np.testing.assert_allclose(host(out)[kept], np.float32(1 / 0.7), rtol=0)
    assert abs(kept.mean() - 0.7) < 0.005                # 7 standard deviations of a binomial mean


@pytest.mark.parametrize("dtype", DTYPES)
def test_identity_cases_and_p_one(fx, dtype):
    x = randn(fx.xp, (3, 4), 1, dtype=dtype)
    for p, training in ((0.0, True), (0.5, False)):
        out, cache = cuda.dropout_forward(x, p, rng=None, training=training)
        assert cache.keep is None and out is not x
        np.testing.assert_array_equal(host(out), host(x))
    out, cache = cuda.dropout_forward(x, 1.0, rng=rng(fx, 0))
    assert not host(out).any() and not host(cache.keep).any() and out.dtype == x.dtype


def test_non_contiguous_input(fx):
    x = randn(fx.xp, (8, 6), 2, dtype="float32").T[:, ::3]
    assert not x.flags.c_contiguous
    with disabled():
        out_ref, _ = dropout_forward(x, 0.4, rng=rng(fx, 5))
    out, _ = cuda.dropout_forward(x, 0.4, rng=rng(fx, 5))
    np.testing.assert_array_equal(host(out), host(out_ref))


def test_bad_input_is_refused(fx):
    x = randn(fx.xp, (2, 3), 0)
    with pytest.raises(ValueError, match=r"p: expected a probability in \[0, 1\]"):
        cuda.dropout_forward(x, 1.5, rng=rng(fx, 0))
    with pytest.raises(ValueError, match="needs rng"):
        cuda.dropout_forward(x, 0.5)
    _, cache = cuda.dropout_forward(x, 0.5, rng=rng(fx, 0))
    with pytest.raises(ValueError, match=r"dout: expected the shape of the forward's output, \(2, 3\)"):
        cuda.dropout_backward(randn(fx.xp, (3, 2), 0), cache)
