"""linear_forward / linear_backward: reference, gradcheck, dtype, views, bad input."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from npformer.ops.linear import linear_backward, linear_forward
from npformer.tools.gradcheck import gradcheck
from tests.helpers import assert_gradcheck, host, randn, seeds

lead_shapes = st.lists(st.integers(1, 4), min_size=0, max_size=3).map(tuple)


@given(lead=lead_shapes, c_in=st.integers(1, 5), c_out=st.integers(1, 5), bias=st.booleans(),
       seed=seeds)
def test_linear_gradcheck(xp, lead, c_in, c_out, bias, seed):
    inputs = {"x": randn(xp, lead + (c_in,), seed), "weight": randn(xp, (c_out, c_in), seed + 1)}
    if bias:
        inputs["bias"] = randn(xp, (c_out,), seed + 2)
    assert_gradcheck(gradcheck(linear_forward, linear_backward, inputs, seed=seed))


def test_linear_matches_reference_loop(xp):
    x, w, b = randn(xp, (2, 3, 4), 0), randn(xp, (5, 4), 1), randn(xp, (5,), 2)
    out, _ = linear_forward(x, w, b)
    xh, wh, bh = host(x), host(w), host(b)
    ref = np.empty((2, 3, 5))
    for i in range(2):
        for t in range(3):
            for o in range(5):
                ref[i, t, o] = sum(xh[i, t, k] * wh[o, k] for k in range(4)) + bh[o]
    np.testing.assert_allclose(host(out), ref, rtol=1e-12, atol=1e-12)


def test_linear_without_bias_returns_none_dbias(xp):
    x, w = randn(xp, (3, 4), 0), randn(xp, (2, 4), 1)
    out, cache = linear_forward(x, w)
    dx, dw, db = linear_backward(randn(xp, (3, 2), 2), cache)
    assert db is None and dx.shape == x.shape and dw.shape == w.shape


def test_linear_float32_in_float32_out_and_inputs_untouched(xp):
    x, w, b = (randn(xp, s, i, dtype="float32") for i, s in enumerate([(2, 3), (4, 3), (4,)]))
    copies = [a.copy() for a in (x, w, b)]
    out, cache = linear_forward(x, w, b)
    grads = linear_backward(xp.ones_like(out), cache)
    assert out.dtype == xp.float32 and all(g.dtype == xp.float32 for g in grads)
    for a, c in zip((x, w, b), copies):
        assert xp.array_equal(a, c)


def test_linear_accepts_non_contiguous_views(xp):
    base = randn(xp, (4, 3, 2), 0)
    x = base.transpose(2, 1, 0)                          # (2, 3, 4), not contiguous
    w = randn(xp, (4, 5), 1).T                           # (5, 4), a transposed view
    out, cache = linear_forward(x, w)
    out_c, cache_c = linear_forward(xp.ascontiguousarray(x), xp.ascontiguousarray(w))
    np.testing.assert_allclose(host(out), host(out_c), rtol=1e-14)
    dout = randn(xp, out.shape, 2)
    for g, gc in zip(linear_backward(dout, cache)[:2], linear_backward(dout, cache_c)[:2]):
        np.testing.assert_allclose(host(g), host(gc), rtol=1e-13)


def test_linear_bad_input(xp):
    x, w = randn(xp, (2, 3), 0), randn(xp, (4, 3), 1)
    with pytest.raises(ValueError, match=r"last axis of size C_in=3.*got shape \(2, 5\)"):
        linear_forward(randn(xp, (2, 5), 0), w)
    with pytest.raises(ValueError, match=r"weight: expected a 2-d array"):
        linear_forward(x, randn(xp, (4,), 1))
    with pytest.raises(ValueError, match=r"bias: expected shape \(4,\)"):
        linear_forward(x, w, randn(xp, (3,), 2))
    with pytest.raises(TypeError, match=r"dtype mismatch: x is float32 but weight is float64"):
        linear_forward(x.astype(xp.float32), w)
    with pytest.raises(TypeError, match=r"x: expected a floating-point array"):
        linear_forward(xp.ones((2, 3), dtype=xp.int64), w)
    with pytest.raises(TypeError, match=r"x: expected a numpy or cupy array, got list"):
        linear_forward([[1.0, 2.0, 3.0]], w)


@pytest.mark.parametrize("x_shape, w_shape", [((3, 0), (4, 0)), ((2, 3, 0), (4, 0)), ((3, 5), (0, 5)),
                                              ((0, 5), (4, 5)), ((2, 0, 5), (4, 5))])
@pytest.mark.parametrize("path", ["fast", "reference"])
def test_linear_with_an_empty_axis_is_the_empty_sum(xp, x_shape, w_shape, path):
    """C_in = 0 (out = b: each output is an empty sum plus the bias), C_out = 0, or no rows: defined,
    as in PyTorch, on the reference and on the fast path (a reshape(-1, 0) raised NumPy's error).
    Every empty sum is exact; the bias gradient, a sum over the rows, is NumPy's to the bit on NumPy
    and within the bound of another summation order on CuPy (2.2e-16 apart on an H200)."""
    from npformer import kernels
    x, w = randn(xp, x_shape, 0), randn(xp, w_shape, 1)
    b = randn(xp, (w_shape[0],), 2)
    with kernels.disabled() if path == "reference" else kernels.disabled("numba"):
        out, cache = linear_forward(x, w, b)
        dout = randn(xp, out.shape, 3)
        dx, dw, db = linear_backward(dout, cache)
    assert out.shape == x_shape[:-1] + (w_shape[0],) and dx.shape == x_shape and dw.shape == w_shape
    np.testing.assert_array_equal(host(out), np.broadcast_to(host(b), out.shape) + host(x) @ host(w).T)
    rows = int(np.prod(x_shape[:-1]))
    dout2, x2 = host(dout).reshape(rows, w_shape[0]), host(x).reshape(rows, w_shape[1])
    np.testing.assert_array_equal(host(dw), dout2.T @ x2)
    np.testing.assert_array_equal(host(dx), host(dout) @ host(w))
    if xp is np:                                  # the same library's sum: the same order, the same bits
        np.testing.assert_array_equal(host(db), dout2.sum(axis=0))
    else:      # CuPy adds the rows in another order: two orders of n terms differ by <= (n - 1) eps sum|terms|
        bound = max(rows - 1, 0) * np.finfo(dout2.dtype).eps * np.abs(dout2).sum(axis=0)
        assert (np.abs(host(db) - dout2.sum(axis=0)) <= bound).all(), (host(db), dout2.sum(axis=0), bound)
