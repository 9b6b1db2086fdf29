"""softmax / log-softmax: reference, rows sum to 1, gradcheck, -inf rows, extreme logits, dtypes."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from npformer.ops.softmax import (log_softmax_backward, log_softmax_forward, softmax_backward,
                                  softmax_forward)
from npformer.tools.gradcheck import gradcheck
from tests.helpers import assert_gradcheck, host, randn, seeds

shapes = st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple)


def reference_softmax(x):
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@given(shape=shapes, seed=seeds, scale=st.sampled_from([0.1, 1.0, 5.0]))
def test_softmax_gradcheck_and_reference(xp, shape, seed, scale):
    x = randn(xp, shape, seed, scale=scale)
    y, _ = softmax_forward(x)
    np.testing.assert_allclose(host(y), reference_softmax(host(x)), rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(host(y).sum(-1), 1.0, rtol=0, atol=1e-14)
    assert_gradcheck(gradcheck(softmax_forward, softmax_backward, {"x": x}, seed=seed))


@given(shape=shapes, seed=seeds)
def test_log_softmax_gradcheck_and_reference(xp, shape, seed):
    x = randn(xp, shape, seed, scale=3.0)
    ly, _ = log_softmax_forward(x)
    np.testing.assert_allclose(host(ly), np.log(reference_softmax(host(x))), rtol=1e-12, atol=1e-13)
    assert_gradcheck(gradcheck(log_softmax_forward, log_softmax_backward, {"x": x}, seed=seed))


@given(shape=st.tuples(st.integers(1, 3), st.integers(2, 6)), seed=seeds, data=st.data())
def test_softmax_gradcheck_with_masked_entries(xp, shape, seed, data):
    """-inf entries (masked keys) get probability 0 and gradient 0; the others are checked as usual."""
    x = host(randn(xp, shape, seed))
    blocked = np.array(data.draw(st.lists(st.booleans(), min_size=x.size, max_size=x.size))).reshape(shape)
    blocked[:, 0] = False                                # one free entry per row
    x[blocked] = -np.inf
    y, cache = softmax_forward(xp.asarray(x))
    assert np.all(host(y)[blocked] == 0)
    dx = host(softmax_backward(randn(xp, shape, seed + 1), cache))
    assert np.all(dx[blocked] == 0) and np.all(np.isfinite(dx))


def test_fully_masked_row_gives_zeros_not_nan(xp):
    x = xp.asarray([[-np.inf, -np.inf, -np.inf], [0.0, 1.0, -np.inf]])
    y, cache = softmax_forward(x)
    assert np.array_equal(host(y)[0], [0, 0, 0])
    np.testing.assert_allclose(host(y)[1].sum(), 1.0)
    dx = softmax_backward(randn(xp, (2, 3), 0), cache)
    assert np.array_equal(host(dx)[0], [0, 0, 0]) and np.all(np.isfinite(host(dx)))
    ly, lcache = log_softmax_forward(x)
    assert np.all(host(ly)[0] == -np.inf)
    dout = randn(xp, (2, 3), 1)
    np.testing.assert_array_equal(host(log_softmax_backward(dout, lcache))[0], host(dout)[0])


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")   # float16's -inf, documented
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_extreme_logits_are_finite(xp, dtype):
    x = xp.asarray([[1e4, -1e4, 0.0], [-1e4, -1e4, -1e4], [6e4, 6e4, -6e4]]).astype(dtype)
    y, cache = softmax_forward(x)
    ly, lcache = log_softmax_forward(x)
    assert y.dtype == x.dtype and ly.dtype == x.dtype
    assert np.all(np.isfinite(host(y))) and not np.any(np.isnan(host(ly)))
    # log p = -1.2e5 is below float16's range and rounds to -inf there; every other entry is finite
    representable = np.ones((3, 3), bool)
    representable[2, 2] = dtype != "float16"
    assert np.all(np.isfinite(host(ly)[representable]))
    np.testing.assert_allclose(host(ly).astype(np.float64)[0], [0, -2e4, -1e4], rtol=1e-3)
    np.testing.assert_allclose(host(y).astype(np.float64), [[1, 0, 0], [1 / 3] * 3, [0.5, 0.5, 0]],
                               atol=1e-3)
    dout = xp.ones_like(x)
    assert np.all(np.isfinite(host(softmax_backward(dout, cache))))
    assert np.all(np.isfinite(host(log_softmax_backward(dout, lcache))))


def test_very_long_rows_float32_match_float64(xp):
    x64 = randn(xp, (2, 100_000), 0, scale=10.0)
    y32, _ = softmax_forward(x64.astype(xp.float32))
    y64, _ = softmax_forward(x64)
    np.testing.assert_allclose(host(y32), host(y64), rtol=2e-4, atol=1e-9)
    np.testing.assert_allclose(host(y32).astype(np.float64).sum(-1), 1.0, atol=1e-5)


def test_softmax_is_pure_and_works_on_views(xp):
    base = randn(xp, (4, 3), 0)
    view = base.T                                        # (3, 4) non-contiguous
    before = base.copy()
    y, cache = softmax_forward(view)
    softmax_backward(randn(xp, (3, 4), 1), cache)
    assert xp.array_equal(base, before)
    np.testing.assert_allclose(host(y), reference_softmax(host(view)), rtol=1e-13)


def test_softmax_bad_input(xp):
    with pytest.raises(TypeError, match="x: expected a floating-point array"):
        softmax_forward(xp.arange(3))
    with pytest.raises(TypeError, match="x: expected a numpy or cupy array"):
        log_softmax_forward([1.0, 2.0])


def test_blocked_float32_rows_match_float64(xp):
    """Large float32 inputs run in row blocks over threads (npformer.backend.blocks); every row,
    a fully masked one included, must match the float64 computation within float32 rounding."""
    x = host(randn(xp, (700, 130), 0, scale=4.0)).astype(np.float32)
    x[5, 1:] = -np.inf                                   # one free entry
    x[6] = -np.inf                                       # a fully masked row
    dy = host(randn(xp, (700, 130), 1)).astype(np.float32)
    for fwd, bwd in ((softmax_forward, softmax_backward), (log_softmax_forward, log_softmax_backward)):
        y, cache = fwd(xp.asarray(x))
        dx = bwd(xp.asarray(dy), cache)
        y64, cache64 = fwd(xp.asarray(x.astype(np.float64)))
        dx64 = bwd(xp.asarray(dy.astype(np.float64)), cache64)
        assert y.dtype == dx.dtype == np.float32
        fin = np.isfinite(host(y64))
        np.testing.assert_array_equal(np.isfinite(host(y)), fin)
        if fwd is softmax_forward:
            np.testing.assert_allclose(host(y)[fin], host(y64)[fin], rtol=2e-6, atol=1e-7)
        else:   # log y = (x - max) - log(sum): float32 rounds both terms, so the bound scales with them
            with np.errstate(invalid="ignore"):          # -inf - -inf in the fully masked row
                shift = np.abs(x - np.max(x, axis=-1, keepdims=True))[fin]
            eps = np.finfo(np.float32).eps
            err = np.abs(host(y)[fin] - host(y64)[fin])
            assert np.all(err <= 2 * eps * (shift + np.abs(host(y64)[fin]) + np.log(130)))
        np.testing.assert_allclose(host(dx), host(dx64), rtol=1e-5, atol=2e-6)
