"""dropout: inverted scaling, seeded mask, identity in eval, gradcheck with a fixed mask."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from npformer.backend import backend_name, default_rng
from npformer.ops.dropout import dropout_backward, dropout_forward, dropout_term, dropout_term_backward
from npformer.tools.gradcheck import gradcheck
from tests.helpers import assert_gradcheck, host, randn, seeds

shapes = st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple)


@given(shape=shapes, p=st.sampled_from([0.0, 0.1, 0.5, 0.9]), seed=seeds)
def test_dropout_gradcheck_with_fixed_mask(xp, shape, p, seed):
    name = backend_name(xp)

    def forward(x):   # a fresh generator per call: the same mask at every finite-difference point
        return dropout_forward(x, p, rng=default_rng(seed, name))

    assert_gradcheck(gradcheck(forward, dropout_backward, {"x": randn(xp, shape, seed)}, seed=seed))


def test_inverted_scaling_keeps_the_mean(xp):
    x = xp.ones((200_000,))
    out, cache = dropout_forward(x, 0.3, rng=default_rng(0, backend_name(xp)))
    kept = host(out) != 0
    np.testing.assert_allclose(host(out)[kept], 1 / 0.7, rtol=1e-15)
    assert abs(kept.mean() - 0.7) < 0.005                # 7 standard deviations of a binomial mean
    np.testing.assert_array_equal(host(dropout_backward(x, cache)), host(out))


@pytest.mark.parametrize("p, training", [(0.0, True), (0.5, False), (0.5, True)])
def test_a_dropout_term_and_its_gradient_are_their_inputs_when_nothing_drops(xp, p, training):
    """Inside an op that only reads them (a residual sum, a product's input), an identity dropout
    copies nothing either way; an active one is the dropout op's, forward and backward."""
    x, dout = randn(xp, (3, 4), 0), randn(xp, (3, 4), 1)
    rng = default_rng(2, backend_name(xp))
    term, cache = dropout_term(x, p, rng=rng, training=training)
    grad = dropout_term_backward(dout, cache)
    if p == 0.0 or not training:
        assert term is x and grad is dout
        return
    ref, ref_cache = dropout_forward(x, p, rng=default_rng(2, backend_name(xp)), training=training)
    np.testing.assert_array_equal(host(term), host(ref))
    np.testing.assert_array_equal(host(grad), host(dropout_backward(dout, ref_cache)))
    with pytest.raises(Exception, match="dout"):
        dropout_term_backward(dout[:2], cache)


def test_same_seed_same_mask_other_seed_other_mask(xp):
    x = randn(xp, (50, 50), 0)
    name = backend_name(xp)
    a, _ = dropout_forward(x, 0.5, rng=default_rng(1, name))
    b, _ = dropout_forward(x, 0.5, rng=default_rng(1, name))
    c, _ = dropout_forward(x, 0.5, rng=default_rng(2, name))
    assert xp.array_equal(a, b) and not xp.array_equal(a, c)


def test_eval_mode_and_p0_are_identity_copies(xp):
    x = randn(xp, (3, 4), 0)
    for kwargs in ({"p": 0.5, "training": False}, {"p": 0.0}):
        out, cache = dropout_forward(x, **kwargs)
        assert xp.array_equal(out, x) and out is not x
        dout = randn(xp, (3, 4), 1)
        assert xp.array_equal(dropout_backward(dout, cache), dout)


def test_p1_drops_everything(xp):
    x = randn(xp, (3, 4), 0)
    out, cache = dropout_forward(x, 1.0, rng=default_rng(0, backend_name(xp)))
    assert not host(out).any() and not host(dropout_backward(x, cache)).any()
    assert np.all(np.isfinite(host(out)))


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_dropout_preserves_dtype(xp, dtype):
    x = randn(xp, (4, 5), 0, dtype=dtype)
    out, cache = dropout_forward(x, 0.2, rng=default_rng(0, backend_name(xp)))
    assert out.dtype == x.dtype and dropout_backward(out, cache).dtype == x.dtype


def test_dropout_bad_input(xp):
    x = randn(xp, (2, 2), 0)
    with pytest.raises(ValueError, match=r"p: expected a probability in \[0, 1\], got 1.5"):
        dropout_forward(x, 1.5, rng=default_rng(0))
    with pytest.raises(ValueError, match="needs rng"):
        dropout_forward(x, 0.5)
    with pytest.raises(TypeError, match="x: expected a floating-point array"):
        dropout_forward(xp.ones((2,), dtype=bool), 0.5, rng=default_rng(0))


@pytest.mark.parametrize("p", [1e-9, 0.1, 0.3333, 0.5, 0.999999])
@pytest.mark.parametrize("shape", [(8, 4, 128, 128), (3, 5), (70_001, 2)])
def test_mask_is_exactly_random_float32_ge_p(shape, p):
    """The mask from raw PCG64 draws equals [rng.random(float32) >= p], and the generator goes on
    exactly as after rng.random (odd sizes take the plain path)."""
    x = np.ones(shape, dtype=np.float32)
    a, b = default_rng(11, "numpy"), default_rng(11, "numpy")
    out, cache = dropout_forward(x, p, rng=a)
    keep = b.random(shape, dtype=np.float32) >= p
    np.testing.assert_array_equal(cache.keep, keep)
    np.testing.assert_array_equal(out, keep * np.float32(1 / (1 - p)))
    np.testing.assert_array_equal(a.random(7), b.random(7))


def test_mask_with_other_bit_generators():
    x = np.ones((64, 64), dtype=np.float32)
    for bitgen in (np.random.MT19937, np.random.Philox, np.random.SFC64):
        a, b = np.random.Generator(bitgen(5)), np.random.Generator(bitgen(5))
        _, cache = dropout_forward(x, 0.25, rng=a)
        np.testing.assert_array_equal(cache.keep, b.random((64, 64), dtype=np.float32) >= 0.25)
