"""relu and gelu (erf and tanh forms): references, gradcheck, extremes, dtypes, bad input."""
import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

from npformer.ops.activations import gelu_backward, gelu_forward, relu_backward, relu_forward
from npformer.tools.gradcheck import gradcheck
from tests.helpers import assert_gradcheck, away_from_zero, host, randn, seeds

shapes = st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple)


@given(shape=shapes, seed=seeds)
def test_relu_gradcheck_and_reference(xp, shape, seed):
    x = away_from_zero(xp, shape, seed)
    y, _ = relu_forward(x)
    np.testing.assert_array_equal(host(y), np.maximum(host(x), 0))
    assert_gradcheck(gradcheck(relu_forward, relu_backward, {"x": x}, seed=seed))


def test_relu_gradient_at_zero_is_zero(xp):
    _, cache = relu_forward(xp.zeros(3))
    np.testing.assert_array_equal(host(relu_backward(xp.ones(3), cache)), 0)


@given(shape=shapes, seed=seeds, approximate=st.sampled_from(["none", "tanh"]))
def test_gelu_gradcheck_and_reference(xp, shape, seed, approximate):
    x = randn(xp, shape, seed, scale=3.0)
    y, _ = gelu_forward(x, approximate=approximate)
    xs = host(x).ravel()
    if approximate == "none":
        ref = [v * 0.5 * (1 + math.erf(v / math.sqrt(2))) for v in xs]
    else:
        ref = [0.5 * v * (1 + math.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v ** 3))) for v in xs]
    np.testing.assert_allclose(host(y).ravel(), ref, rtol=1e-13, atol=1e-15)
    assert_gradcheck(gradcheck(gelu_forward, gelu_backward, {"x": x},
                               kwargs={"approximate": approximate}, seed=seed))


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_extremes_are_finite_and_dtype_kept(xp, dtype, approximate):
    x = xp.asarray([-1e4, -60.0, -5.0, 0.0, 5.0, 60.0, 1e4]).astype(dtype)
    y, cache = gelu_forward(x, approximate=approximate)
    dx = gelu_backward(xp.ones_like(x), cache)
    assert y.dtype == x.dtype and dx.dtype == x.dtype
    yh, dh = host(y).astype(np.float64), host(dx).astype(np.float64)
    assert np.isfinite(yh).all() and np.isfinite(dh).all()
    assert yh[0] == 0 and yh[-1] == float(host(x)[-1])     # gelu(-inf side) -> 0, gelu(x) -> x
    np.testing.assert_allclose(dh[[0, -1]], [0, 1], atol=1e-3)


def test_activations_pure_and_bad_input(xp):
    x = randn(xp, (3, 4), 0)
    before = x.copy()
    for fwd, bwd in ((relu_forward, relu_backward), (gelu_forward, gelu_backward)):
        y, cache = fwd(x)
        bwd(xp.ones_like(y), cache)
    assert xp.array_equal(x, before)
    with pytest.raises(ValueError, match="approximate: expected one of 'none', 'tanh', got 'fast'"):
        gelu_forward(x, approximate="fast")
    with pytest.raises(TypeError, match="x: expected a floating-point array"):
        relu_forward(xp.arange(3))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_float32_matches_float64_within_float32_rounding(xp, approximate):
    """The float32 path (blocked, fast erf) against the float64 one on the same inputs.

    Bound: a few float32 eps on the scale of x (the erf or tanh result is accurate to a few ulp
    of a value <= 1, and x multiplies it), plus relative eps of the result.
    """
    x = randn(xp, (3, 70_001), 0, dtype="float32", scale=3.0)     # several blocks, a short last one
    dy = randn(xp, (3, 70_001), 1, dtype="float32")
    y, cache = gelu_forward(x, approximate=approximate)
    dx = gelu_backward(dy, cache)
    y64, cache64 = gelu_forward(x.astype(xp.float64), approximate=approximate)
    dx64 = gelu_backward(dy.astype(xp.float64), cache64)
    assert y.dtype == dx.dtype == np.float32
    eps = np.finfo(np.float32).eps
    xh, dyh = np.abs(host(x)).astype(np.float64), np.abs(host(dy)).astype(np.float64)
    assert np.all(np.abs(host(y) - host(y64)) <= 4 * eps * (xh + np.abs(host(y64))))
    assert np.all(np.abs(host(dx) - host(dx64)) <= 8 * eps * (1 + xh) * dyh + 2 * eps * np.abs(host(dx64)))


def test_relu_nan_propagates_and_mask_gradient(xp):
    x = xp.asarray([np.nan, -1.0, 2.0, 0.0])
    y, cache = relu_forward(x)
    assert np.isnan(host(y)[0]) and list(host(y)[1:]) == [0, 2, 0]
    np.testing.assert_array_equal(host(relu_backward(xp.asarray([5.0, 5.0, 5.0, 5.0]), cache)), [0, 0, 5, 0])
