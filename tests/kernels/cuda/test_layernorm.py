"""Fused layer norm against the plain op: values, the cache (x itself, mu and rstd), all three gradients,
constant rows, dtypes, layouts."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from npformer.kernels import cuda, disabled
from npformer.ops.layernorm import layer_norm_backward, layer_norm_forward, normalised
from npformer.tools.gradcheck import gradcheck
from tests.helpers import assert_gradcheck, host, randn, seeds
from tests.kernels.cuda.conftest import DTYPES, assert_close

row_lengths = st.sampled_from([1, 2, 7, 40, 300])
leading = st.lists(st.integers(1, 3), min_size=0, max_size=2).map(tuple)
affines = st.sampled_from(["both", "weight", "bias", "none"])


def _params(xp, c, affine, seed, dtype):
    w = randn(xp, (c,), seed + 1, dtype=dtype) if affine in ("both", "weight") else None
    b = randn(xp, (c,), seed + 2, dtype=dtype) if affine in ("both", "bias") else None
    return w, b


def _scales(dy, w, cache):
    """The magnitude each gradient is a sum of (the conditioning of its additions), per the formulas
    dx = rstd (g - mean g - xhat mean(g xhat)), dw = sum dy xhat, db = sum dy (g = dy w)."""
    c = dy.shape[-1]
    dy = np.abs(host(dy).astype(np.float64)).reshape(-1, c)
    xhat = np.abs(host(normalised(cache)).astype(np.float64)).reshape(-1, c)
    rstd = np.abs(host(cache.rstd).astype(np.float64)).reshape(-1, 1)
    g = dy * (1 if w is None else np.abs(host(w).astype(np.float64)))
    dx = rstd * (g + g.mean(-1, keepdims=True) + xhat * (g * xhat).mean(-1, keepdims=True))
    return [max(1.0, float(v.max(initial=0))) for v in (dx, (dy * xhat).sum(0), dy.sum(0))]


def _compare(x, w, b, dy, dtype, eps=1e-5):
    with disabled():
        y_ref, cache_ref = layer_norm_forward(x, w, b, eps=eps)
        grads_ref = layer_norm_backward(dy, cache_ref)
    y, cache = cuda.layer_norm_forward(x, w, b, eps=eps)
    assert_close(y, y_ref, dtype, what="y")
    acc = str(cache_ref.rstd.dtype)
    assert cache.mean.dtype == cache.rstd.dtype == acc and cache.rstd.shape == cache.mean.shape == cache_ref.rstd.shape
    assert cache.x is x or not x.flags.c_contiguous        # the input itself (a contiguous copy of a view)
    assert_close(cache.mean, cache_ref.mean, acc, scale=max(1.0, float(np.abs(host(x).astype(np.float64)).max())),
                 what="mean")
    assert_close(cache.rstd, cache_ref.rstd, acc, what="rstd")
    assert_close(normalised(cache), normalised(cache_ref), acc, what="xhat")
    scales = _scales(dy, w, cache_ref)
    with disabled():
        plain_on_fused = layer_norm_backward(dy, cache)
    for label, grads in (("fused", cuda.layer_norm_backward(dy, cache)),
                         ("plain backward on the fused cache", plain_on_fused),
                         ("fused backward on the plain cache", cuda.layer_norm_backward(dy, cache_ref))):
        for name, got, ref, scale in zip(("dx", "dweight", "dbias"), grads, grads_ref, scales):
            assert (got is None) == (ref is None), f"{label}: {name}"
            if ref is not None:
                assert_close(got, ref, dtype, scale=scale, what=f"{label}: {name}")


@given(lead=leading, n=row_lengths, affine=affines, dtype=st.sampled_from(DTYPES), seed=seeds,
       shift=st.sampled_from([0.0, 5.0]))
def test_matches_plain_forward_and_backward(fx, lead, n, affine, dtype, seed, shift):
    x = randn(fx.xp, lead + (n,), seed, dtype=dtype, scale=2.0) + fx.xp.asarray(shift, dtype=dtype)
    w, b = _params(fx.xp, n, affine, seed, dtype)
    _compare(x, w, b, randn(fx.xp, lead + (n,), seed + 3, dtype=dtype), dtype)


# bias without weight returns (dx, None, dbias), which gradcheck's positional matching cannot take
@given(shape=st.tuples(st.integers(1, 3), st.integers(2, 7)), affine=st.sampled_from(["both", "weight", "none"]),
       seed=seeds)
def test_gradcheck_float64(fx, shape, affine, seed):
    inputs = {"x": randn(fx.xp, shape, seed, scale=2.0)}
    w, b = _params(fx.xp, shape[-1], affine, seed, "float64")
    if w is not None:
        inputs["weight"] = w
    if b is not None:
        inputs["bias"] = b
    assert_gradcheck(gradcheck(cuda.layer_norm_forward, cuda.layer_norm_backward, inputs, seed=seed))


@pytest.mark.parametrize("dtype", DTYPES)
def test_constant_rows_give_the_bias_and_finite_gradients(fx, dtype):
    x = fx.xp.full((3, 6), 1e4 if dtype != "float16" else 1e3, dtype=dtype)
    w, b = fx.xp.ones(6, dtype=dtype) * 2, fx.xp.arange(6, dtype=dtype)
    y, cache = cuda.layer_norm_forward(x, w, b)
    np.testing.assert_array_equal(host(y), np.broadcast_to(host(b), (3, 6)))
    grads = cuda.layer_norm_backward(fx.xp.ones_like(x), cache)
    assert all(np.isfinite(host(g)).all() for g in grads)
    _compare(x, w, b, randn(fx.xp, (3, 6), 1, dtype=dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_inputs(fx, dtype):
    x = randn(fx.xp, (6, 4, 10), 5, dtype=dtype).transpose(1, 0, 2)[:, ::2]   # (4, 3, 10), strided
    dy = randn(fx.xp, (10, 3, 4), 6, dtype=dtype).transpose(2, 1, 0)
    w = randn(fx.xp, (20,), 7, dtype=dtype)[::2]
    b = randn(fx.xp, (10,), 8, dtype=dtype)
    assert not (x.flags.c_contiguous or dy.flags.c_contiguous or w.flags.c_contiguous)
    before = [host(a).copy() for a in (x, dy, w, b)]
    _compare(x, w, b, dy, dtype)
    for a, h in zip((x, dy, w, b), before):
        np.testing.assert_array_equal(host(a), h)        # inputs untouched


def test_long_rows_and_many_rows(fx):
    x = randn(fx.xp, (3, 4096), 1, dtype="float32", scale=5.0) + fx.xp.float32(3)
    w, b = randn(fx.xp, (4096,), 2, dtype="float32"), randn(fx.xp, (4096,), 3, dtype="float32")
    _compare(x, w, b, randn(fx.xp, (3, 4096), 4, dtype="float32"), "float32")
    x = randn(fx.xp, (600, 3), 5)                      # many rows: a column pass of several chunks
    w, b = randn(fx.xp, (3,), 6), randn(fx.xp, (3,), 7)
    _compare(x, w, b, randn(fx.xp, (600, 3), 8), "float64")


def test_bad_input_is_refused(fx):
    x = randn(fx.xp, (2, 4), 0)
    with pytest.raises(ValueError, match=r"weight: expected shape \(4,\)"):
        cuda.layer_norm_forward(x, randn(fx.xp, (3,), 0))
    with pytest.raises(TypeError, match="dtype mismatch"):
        cuda.layer_norm_forward(x, randn(fx.xp, (4,), 0, dtype="float32"))
    with pytest.raises(ValueError, match="eps: expected a finite number > 0"):
        cuda.layer_norm_forward(x, eps=0.0)
    _, cache = cuda.layer_norm_forward(x)
    with pytest.raises(TypeError, match="dy: expected the dtype of the forward's output, float64"):
        cuda.layer_norm_backward(randn(fx.xp, (2, 4), 0, dtype="float32"), cache)
    with pytest.raises(ValueError, match=r"dy: expected the shape of the forward's output, \(2, 4\)"):
        cuda.layer_norm_backward(randn(fx.xp, (2, 5), 0), cache)
