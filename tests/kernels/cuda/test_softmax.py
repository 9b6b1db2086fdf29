"""Fused softmax / log-softmax against the plain ops: values, gradients, -inf rows, extremes, layouts."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from npformer.kernels import cuda, disabled
from npformer.ops.softmax import (log_softmax_backward, log_softmax_forward, softmax_backward,
                                  softmax_forward)
from npformer.tools.gradcheck import gradcheck
from tests.helpers import assert_gradcheck, host, randn, seeds
from tests.kernels.cuda.conftest import DTYPES, assert_close

# Row lengths: one thread, a partial warp, several elements per thread of a full block.
row_lengths = st.sampled_from([1, 2, 5, 33, 70, 300])
leading = st.lists(st.integers(1, 3), min_size=0, max_size=2).map(tuple)


def _dx_scale(dy, y, log):
    """What dx is a sum of: y (|dy| + sum |dy y|) for softmax, |dy| + exp(log y) sum |dy| for log-softmax."""
    dy, y = np.abs(host(dy).astype(np.float64)), host(y).astype(np.float64)
    p = np.exp(y) if log else np.abs(y)
    total = (dy if log else dy * p).sum(-1, keepdims=True)
    return max(1.0, float((dy + p * total if log else p * (dy + total)).max()))


PAIRS = {False: (softmax_forward, softmax_backward, cuda.softmax_forward, cuda.softmax_backward),
         True: (log_softmax_forward, log_softmax_backward, cuda.log_softmax_forward, cuda.log_softmax_backward)}


@given(lead=leading, n=row_lengths, dtype=st.sampled_from(DTYPES), log=st.booleans(), seed=seeds,
       scale=st.sampled_from([0.1, 1.0, 8.0]))
def test_matches_plain_forward_and_backward(fx, lead, n, dtype, log, seed, scale):
    fwd, bwd, ffwd, fbwd = PAIRS[log]
    x = randn(fx.xp, lead + (n,), seed, dtype=dtype, scale=scale)
    dy = randn(fx.xp, lead + (n,), seed + 1, dtype=dtype)
    with disabled():
        y_ref, cache_ref = fwd(x)
        dx_ref = bwd(dy, cache_ref)
    y, cache = ffwd(x)
    assert_close(y, y_ref, dtype, what="y")
    dx = fbwd(dy, cache)
    scale_dx = _dx_scale(dy, y_ref, log)
    assert_close(dx, dx_ref, dtype, scale=scale_dx, what="dx")
    # the caches are interchangeable: the plain backward on the fused cache and the reverse
    with disabled():
        assert_close(bwd(dy, cache), dx_ref, dtype, scale=scale_dx, what="plain dx on fused cache")
    assert_close(fbwd(dy, cache_ref), dx_ref, dtype, scale=scale_dx, what="fused dx on plain cache")


@given(shape=st.tuples(st.integers(1, 3), st.integers(1, 6)), log=st.booleans(), seed=seeds)
def test_gradcheck_float64(fx, shape, log, seed):
    _, _, ffwd, fbwd = PAIRS[log]
    assert_gradcheck(gradcheck(ffwd, fbwd, {"x": randn(fx.xp, shape, seed, scale=3.0)}, seed=seed))


@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_entries_and_fully_masked_rows(fx, dtype):
    x = host(randn(fx.xp, (4, 7), 3)).astype(dtype)
    x[0, [1, 4]] = -np.inf                               # some keys masked
    x[1] = -np.inf                                       # a query that may attend to nothing
    x = fx.xp.asarray(x)
    dy = randn(fx.xp, (4, 7), 4, dtype=dtype)
    y, cache = cuda.softmax_forward(x)
    yh = host(y)
    assert np.all(yh[0, [1, 4]] == 0) and np.array_equal(yh[1], np.zeros(7, dtype))
    dx = host(cuda.softmax_backward(dy, cache))
    assert np.all(dx[0, [1, 4]] == 0) and np.array_equal(dx[1], np.zeros(7, dtype)) and np.isfinite(dx).all()
    ly, lcache = cuda.log_softmax_forward(x)
    assert np.all(host(ly)[1] == -np.inf) and not np.isnan(host(ly)).any()
    np.testing.assert_array_equal(host(cuda.log_softmax_backward(dy, lcache))[1], host(dy)[1])
    with disabled():
        assert_close(y, softmax_forward(x)[0], dtype)
        assert_close(ly, log_softmax_forward(x)[0], dtype, scale=10.0)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")   # float16's -inf, as the plain op
@pytest.mark.parametrize("dtype", DTYPES)
def test_extreme_logits_match_plain(fx, dtype):
    x = fx.xp.asarray([[1e4, -1e4, 0.0], [-1e4, -1e4, -1e4], [6e4, 6e4, -6e4]]).astype(dtype)
    y, cache = cuda.softmax_forward(x)
    ly, lcache = cuda.log_softmax_forward(x)
    assert np.isfinite(host(y)).all() and not np.isnan(host(ly)).any()
    with disabled():
        assert_close(y, softmax_forward(x)[0], dtype)
        assert_close(ly, log_softmax_forward(x)[0], dtype, scale=1.2e5)
    dout = fx.xp.ones_like(x)
    assert np.isfinite(host(cuda.softmax_backward(dout, cache))).all()
    assert np.isfinite(host(cuda.log_softmax_backward(dout, lcache))).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_input_and_gradient(fx, dtype):
    """Transposed head views, as attention produces: (B, T, H, S) read as (B, H, T, S)."""
    x = randn(fx.xp, (2, 5, 3, 9), 7, dtype=dtype, scale=2.0).transpose(0, 2, 1, 3)
    dy = randn(fx.xp, (2, 9, 3, 5), 8, dtype=dtype).transpose(0, 2, 3, 1)
    assert not x.flags.c_contiguous and not dy.flags.c_contiguous
    x_before, dy_before = host(x).copy(), host(dy).copy()
    y, cache = cuda.softmax_forward(x)
    dx = cuda.softmax_backward(dy, cache)
    with disabled():
        y_ref, cache_ref = softmax_forward(x)
        dx_ref = softmax_backward(dy, cache_ref)
    assert_close(y, y_ref, dtype)
    assert_close(dx, dx_ref, dtype, scale=_dx_scale(dy, y_ref, False))
    np.testing.assert_array_equal(host(x), x_before)     # inputs untouched
    np.testing.assert_array_equal(host(dy), dy_before)


def test_long_rows_and_many_rows(fx):
    """Rows longer than a block (each thread strides over many values) and more rows than threads."""
    x = randn(fx.xp, (3, 4096), 9, dtype="float32", scale=4.0)
    y, _ = cuda.softmax_forward(x)
    with disabled():
        assert_close(y, softmax_forward(x)[0], "float32")
    np.testing.assert_allclose(host(y).astype(np.float64).sum(-1), 1.0, atol=1e-5)
    x = randn(fx.xp, (700, 3), 10, dtype="float64")
    with disabled():
        assert_close(cuda.softmax_forward(x)[0], softmax_forward(x)[0], "float64")


def test_bad_input_is_refused(fx):
    with pytest.raises(TypeError, match="floating-point"):
        cuda.softmax_forward(fx.xp.arange(3))
    with pytest.raises(ValueError, match="0-d"):
        cuda.softmax_forward(fx.xp.asarray(1.0))
    y, cache = cuda.softmax_forward(randn(fx.xp, (2, 3), 0))
    with pytest.raises(ValueError, match=r"dy: expected the shape of the forward's output, \(2, 3\)"):
        cuda.softmax_backward(randn(fx.xp, (2, 4), 0), cache)
    assert cuda.softmax_forward(fx.xp.zeros((0, 3)))[0].shape == (0, 3)   # no rows: nothing to launch
