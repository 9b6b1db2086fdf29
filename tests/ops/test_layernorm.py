"""layer_norm_forward / layer_norm_backward: reference, invariants, gradcheck, the cache (the input and
row statistics), extreme rows, bad input."""
import contextlib

import numpy as np
import pytest
from hypothesis import given, strategies as st

from npformer.errors import RangeError
from npformer.kernels import disabled
from npformer.ops.layernorm import layer_norm_backward, layer_norm_forward, normalised
from npformer.tools.gradcheck import gradcheck
from tests.helpers import assert_gradcheck, host, randn, seeds

shapes = st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(2, 8))


def reference(x, w, b, eps):
    x = np.asarray(x, np.float64)
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    y = (x - mu) / np.sqrt(var + eps)
    return y * (1 if w is None else w) + (0 if b is None else b)


@given(shape=shapes, affine=st.sampled_from(["both", "weight", "none"]), seed=seeds)
def test_layer_norm_gradcheck_and_reference(xp, shape, affine, seed):
    c = shape[-1]
    inputs = {"x": randn(xp, shape, seed, scale=2.0)}
    if affine != "none":
        inputs["weight"] = randn(xp, (c,), seed + 1)
    if affine == "both":
        inputs["bias"] = randn(xp, (c,), seed + 2)
    y, _ = layer_norm_forward(**inputs)
    ref = reference(host(inputs["x"]), host(inputs.get("weight", np.ones(c))), host(inputs.get("bias", np.zeros(c))), 1e-5)
    np.testing.assert_allclose(host(y), ref, rtol=1e-12, atol=1e-12)
    assert_gradcheck(gradcheck(layer_norm_forward, layer_norm_backward, inputs, seed=seed))


def test_rows_have_zero_mean_and_unit_variance(xp):
    x = randn(xp, (5, 64), 0, scale=3.0) + 7.0
    eps = 1e-5
    y, _ = layer_norm_forward(x, eps=eps)
    yh = host(y)
    var = host(x).var(-1)
    np.testing.assert_allclose(yh.mean(-1), 0, atol=1e-13)
    # the variance is var / (var + eps), exactly, not 1: eps is part of the definition
    np.testing.assert_allclose(yh.var(-1), var / (var + eps), rtol=1e-12)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_constant_rows_give_the_bias_and_no_nan(xp, dtype):
    x = xp.full((3, 6), 1e4 if dtype != "float16" else 1e3, dtype=dtype)
    w, b = xp.ones(6, dtype=dtype) * 2, xp.arange(6, dtype=dtype)
    y, cache = layer_norm_forward(x, w, b)
    assert y.dtype == x.dtype
    np.testing.assert_array_equal(host(y), np.broadcast_to(host(b), (3, 6)))
    dx, dw, db = layer_norm_backward(xp.ones_like(x), cache)
    assert all(np.isfinite(host(g)).all() for g in (dx, dw, db))


@pytest.mark.parametrize("fast", [True, False])
def test_eps_must_stay_positive_where_var_plus_eps_is_added(xp, fast):
    """eps = 1e-50 is > 0 but float32 rounds it to 0, and a constant row's xhat is then 0 * inf = NaN:
    refused for float32 x (and float16, normalised in float32), on every path; float64 keeps it, and
    a constant row gives y = b as for any eps (float16 x takes an eps as small as float32 holds)."""
    with contextlib.nullcontext() if fast else disabled():
        for dtype in ("float32", "float16"):
            with pytest.raises(RangeError, match="eps: expected a number that stays > 0 in float32, the dtype "
                                                 "it is added in, got 1e-50, which float32 rounds to 0"):
                layer_norm_forward(xp.full((1, 3), 5.0, dtype=dtype), eps=1e-50)
        b = xp.asarray([1.0, -2.0, 3.0])
        y, _ = layer_norm_forward(xp.full((2, 3), 5.0), xp.ones(3), b, eps=1e-50)
        np.testing.assert_array_equal(host(y), np.broadcast_to(host(b), (2, 3)))
        y, _ = layer_norm_forward(xp.full((2, 3), 5.0, dtype=xp.float16), eps=1e-40)   # a float32 subnormal
        assert not host(y).any()


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_the_cache_is_the_input_and_row_statistics(xp, dtype):
    """The cache keeps x itself and mu and rstd per row (no (..., C) array of its own, so 2 bytes an
    element for 16-bit input); the backward's xhat = (x - mu) * rstd is the forward's, bit for bit."""
    x = randn(xp, (2, 3, 16), 0, dtype, scale=2.0) + xp.asarray(3.0, dtype=dtype)
    w, b = randn(xp, (16,), 1, dtype), randn(xp, (16,), 2, dtype)
    with disabled():                                      # the reference's own cache
        y, cache = layer_norm_forward(x, w, b)
    acc = xp.float32 if dtype == "float16" else xp.dtype(dtype)
    assert cache.x is x and cache.mean.shape == cache.rstd.shape == (2, 3, 1)
    assert cache.mean.dtype == cache.rstd.dtype == acc
    assert [f for f in cache if getattr(f, "shape", None) == x.shape] == [x]
    xa = x.astype(acc)                                    # the forward's steps, by hand
    mu = xa.mean(axis=-1, keepdims=True)
    rstd = 1.0 / xp.sqrt(((xa - mu) * (xa - mu)).mean(axis=-1, keepdims=True) + 1e-5)
    xhat = (xa - mu) * rstd
    np.testing.assert_array_equal(host(normalised(cache)), host(xhat))
    np.testing.assert_array_equal(host(y), host((xhat * w + b).astype(dtype)))


def test_long_rows_float32_match_float64(xp):
    x64 = randn(xp, (4, 4096), 1, scale=5.0) + 3.0
    w, b = randn(xp, (4096,), 2), randn(xp, (4096,), 3)
    y32, c32 = layer_norm_forward(x64.astype(xp.float32), w.astype(xp.float32), b.astype(xp.float32))
    y64, c64 = layer_norm_forward(x64, w, b)
    np.testing.assert_allclose(host(y32), host(y64), rtol=1e-4, atol=1e-4)
    d = randn(xp, (4, 4096), 4)
    dx32 = layer_norm_backward(d.astype(xp.float32), c32)[0]
    dx64 = layer_norm_backward(d, c64)[0]
    np.testing.assert_allclose(host(dx32), host(dx64), rtol=1e-3, atol=1e-4)


def test_pure_and_views(xp):
    base = randn(xp, (6, 4), 0)
    x = base.T                                            # (4, 6) non-contiguous
    before = base.copy()
    y, cache = layer_norm_forward(x)
    layer_norm_backward(randn(xp, (4, 6), 1), cache)
    assert xp.array_equal(base, before)
    np.testing.assert_allclose(host(y), reference(host(x), None, None, 1e-5), rtol=1e-12)


def test_layer_norm_bad_input(xp):
    x = randn(xp, (2, 4), 0)
    with pytest.raises(ValueError, match=r"weight: expected shape \(4,\)"):
        layer_norm_forward(x, randn(xp, (3,), 1))
    with pytest.raises(ValueError, match="eps: expected a finite number > 0"):
        layer_norm_forward(x, eps=0.0)
    with pytest.raises(TypeError, match="dtype mismatch"):
        layer_norm_forward(x, xp.ones(4, dtype=xp.float32))
    with pytest.raises(TypeError, match="x: expected a floating-point array"):
        layer_norm_forward(xp.ones((2, 4), dtype=xp.int32))
