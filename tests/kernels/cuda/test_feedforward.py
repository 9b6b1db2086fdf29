"""The GELU feed-forward block with bias + GELU + dropout fused, against the reference op: output and
all five gradients, the dropout op's mask position by position, either backward on either cache,
float64 gradchecks through the kernels, which blocks take it."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from npformer.kernels import cuda, disabled, implementation
from npformer.ops.dropout import dropout_forward
from npformer.ops.feedforward import feed_forward_backward, feed_forward_forward
from npformer.tools.gradcheck import gradcheck
from tests.helpers import assert_gradcheck, assert_same_dropout, host, randn, seeds
from tests.kernels.cuda.conftest import DTYPES, assert_close

forms = st.sampled_from(["gelu", "gelu_tanh"])
dropouts = st.sampled_from([(0.0, True), (0.3, True), (0.3, False), (1.0, True)])


def rng(fx, seed):
    return fx.xp.random.default_rng(seed)


def _weights(xp, c, f, seed, dtype):
    return (randn(xp, (f, c), seed + 1, dtype, scale=0.5), randn(xp, (f,), seed + 2, dtype),
            randn(xp, (c, f), seed + 3, dtype, scale=0.5), randn(xp, (c,), seed + 4, dtype))


@given(lead=st.lists(st.integers(1, 3), min_size=1, max_size=2).map(tuple), c=st.sampled_from([1, 3, 8]),
       f=st.sampled_from([1, 5, 33]), act=forms, drop=dropouts, dtype=st.sampled_from(DTYPES), seed=seeds)
def test_matches_the_reference_op(fx, lead, c, f, act, drop, dtype, seed):
    p, training = drop
    x = randn(fx.xp, lead + (c,), seed, dtype)
    w1, b1, w2, b2 = _weights(fx.xp, c, f, seed, dtype)
    dout = randn(fx.xp, lead + (c,), seed + 5, dtype)
    kw = dict(activation=act, dropout_p=p, training=training)
    with disabled():
        out_ref, c_ref = feed_forward_forward(x, w1, b1, w2, b2, rng=rng(fx, seed), **kw)
        grads_ref = feed_forward_backward(dout, c_ref)
    out, cache = cuda.feed_forward_forward(x, w1, b1, w2, b2, rng=rng(fx, seed), **kw)
    # the dropout op's entries dropped, for one seed; the fused kernel keeps the seed (p = 1 stores zeros)
    assert_same_dropout(cache.drop, c_ref.drop, stored=p == 1.0)
    np.testing.assert_array_equal(host(cache.act.x), host(c_ref.act.x))   # h = x W1^T + b1, the same roundings
    rows = int(np.prod(lead))
    # |out| <= F max|a'| max|W2| + |b2|, |a'| <= |h| / (1 - p); the gradients are sums of F or rows products
    big = max(1.0, float(np.abs(host(c_ref.act.x).astype(np.float64)).max(initial=0))) / (1 - min(p, 0.5))
    assert_close(out, out_ref, dtype, scale=f * big + 2, what="out")
    scales = (f * c * big, rows * big, rows * c * big, rows * big, rows)
    with disabled():
        plain_on_fused = feed_forward_backward(dout, cache)
    for label, grads in (("fused", cuda.feed_forward_backward(dout, cache)),
                         ("plain backward on the fused cache", plain_on_fused),
                         ("fused backward on the plain cache", cuda.feed_forward_backward(dout, c_ref))):
        for name, got, ref, scale in zip(("dx", "dw1", "db1", "dw2", "db2"), grads, grads_ref, scales):
            assert_close(got, ref, dtype, scale=max(1.0, 4 * scale), what=f"{label}: {name}")


@given(shape=st.tuples(st.integers(1, 3), st.integers(1, 3)), c=st.integers(1, 3), f=st.integers(1, 4),
       act=forms, p=st.sampled_from([0.0, 0.4]), seed=seeds)
def test_gradcheck_float64(fx, shape, c, f, act, p, seed):
    def forward(x, w1, b1, w2, b2):   # a fresh generator per call: one fixed mask
        return cuda.feed_forward_forward(x, w1, b1, w2, b2, activation=act, dropout_p=p, rng=rng(fx, seed))

    w1, b1, w2, b2 = _weights(fx.xp, c, f, seed, "float64")
    inputs = {"x": randn(fx.xp, shape + (c,), seed), "w1": w1, "b1": b1, "w2": w2, "b2": b2}
    assert_gradcheck(gradcheck(forward, cuda.feed_forward_backward, inputs, seed=seed))


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_gelu_dropout_drops_what_the_dropout_op_drops(fx, dtype):
    z, b = randn(fx.xp, (40, 33), 1, dtype, scale=2.0), randn(fx.xp, (33,), 2, dtype)
    a, act, drop = cuda.bias_gelu_dropout_forward(z, b, "tanh", 0.25, rng(fx, 9))
    with disabled():
        a_ref, drop_ref = dropout_forward(cuda.bias_gelu_forward(z, b, "tanh")[0], 0.25, rng=rng(fx, 9))
    assert_same_dropout(drop, drop_ref, stored=False)
    np.testing.assert_array_equal(host(a), host(a_ref))   # gelu rounded, then times the mask: one rounding each


def test_only_gelu_blocks_with_a_first_bias_take_it(fx):
    x = randn(fx.xp, (2, 3, 4), 0)
    w1, b1, w2, b2 = _weights(fx.xp, 4, 6, 0, "float64")
    assert implementation(feed_forward_forward, x, w1, b1, w2, b2, activation="gelu") == "cuda"
    assert implementation(feed_forward_forward, x, w1, b1, w2, b2, activation="relu") == "reference"
    assert implementation(feed_forward_forward, x, w1, None, w2, b2, activation="gelu") == "reference"
    with disabled():
        _, relu_cache = feed_forward_forward(x, w1, b1, w2, b2, activation="relu")
    assert implementation(feed_forward_backward, x, relu_cache) == "reference"
    with pytest.raises(ValueError, match=r"w2: expected shape \(C, F\)=\(4, 6\)"):
        cuda.feed_forward_forward(x, w1, b1, w1, b2, activation="gelu")
