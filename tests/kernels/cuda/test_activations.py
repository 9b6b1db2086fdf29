"""Fused GELU (both forms), bias-add, bias gradient and bias-add + GELU against the plain ops."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from npformer.kernels import cuda, disabled
from npformer.ops.activations import gelu_backward, gelu_forward
from npformer.ops.linear import linear_backward, linear_forward
from npformer.tools.gradcheck import gradcheck
from tests.helpers import assert_gradcheck, host, randn, seeds
from tests.kernels.cuda.conftest import DTYPES, assert_close

shapes = st.lists(st.integers(1, 7), min_size=0, max_size=3).map(tuple)
forms = st.sampled_from(["none", "tanh"])


def _grad_scale(dy):
    """gelu'(x) lies in [-0.17, 1.13] for both forms, so |dx| <= 1.13 |dy|."""
    return max(1.0, 1.13 * float(np.abs(host(dy).astype(np.float64)).max(initial=0)))


@given(shape=shapes, form=forms, dtype=st.sampled_from(DTYPES), seed=seeds, scale=st.sampled_from([0.5, 3.0, 30.0]))
def test_gelu_matches_plain(fx, shape, form, dtype, seed, scale):
    x = randn(fx.xp, shape, seed, dtype=dtype, scale=scale)
    dy = randn(fx.xp, shape, seed + 1, dtype=dtype)
    with disabled():
        y_ref, cache_ref = gelu_forward(x, approximate=form)
        dx_ref = gelu_backward(dy, cache_ref)
    y, cache = cuda.gelu_forward(x, approximate=form)
    assert cache.approximate == form
    assert_close(y, y_ref, dtype, what="y")
    assert_close(cuda.gelu_backward(dy, cache), dx_ref, dtype, scale=_grad_scale(dy), what="dx")
    assert_close(cuda.gelu_backward(dy, cache_ref), dx_ref, dtype, scale=_grad_scale(dy), what="fused on plain cache")


@given(shape=st.tuples(st.integers(1, 3), st.integers(1, 5)), form=forms, seed=seeds)
def test_gelu_gradcheck_float64(fx, shape, form, seed):
    def forward(x):
        return cuda.gelu_forward(x, approximate=form)

    x = randn(fx.xp, shape, seed, scale=2.0)
    assert_gradcheck(gradcheck(forward, cuda.gelu_backward, {"x": x}, seed=seed))


@pytest.mark.filterwarnings("ignore:overflow encountered in multiply")   # the plain op's -0.5 x x -> -inf
@pytest.mark.parametrize("form", ["none", "tanh"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_extreme_inputs_match_plain_and_stay_finite(fx, form, dtype):
    """Beyond the tanh clip (|x| > 100), float16's range edge (bfloat16's: float32's), and zero; no inf * 0
    anywhere."""
    big = {"float16": 6e4, "bfloat16": 3e38, "float32": 1e30, "float64": 1e200}[dtype]
    x = fx.xp.asarray([-big, -150.0, -100.0, -99.5, -8.0, -1e-3, 0.0, 1e-3, 8.0, 99.5, 100.0, 150.0, big]).astype(dtype)
    dy = fx.xp.ones_like(x)
    y, cache = cuda.gelu_forward(x, approximate=form)
    dx = cuda.gelu_backward(dy, cache)
    assert np.isfinite(host(y)).all() and np.isfinite(host(dx)).all()
    with disabled():
        y_ref, cache_ref = gelu_forward(x, approximate=form)
        assert_close(y, y_ref, dtype, what="y")
        assert_close(dx, gelu_backward(dy, cache_ref), dtype, what="dx")


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_non_contiguous(fx, dtype):
    x = randn(fx.xp, (6, 5), 3, dtype=dtype, scale=3.0).T[::2]
    dy = randn(fx.xp, (5, 6), 4, dtype=dtype)[:, ::-1][::2]
    assert not x.flags.c_contiguous and not dy.flags.c_contiguous
    for form in ("none", "tanh"):
        with disabled():
            y_ref, cache_ref = gelu_forward(x, approximate=form)
            dx_ref = gelu_backward(dy, cache_ref)
        y, cache = cuda.gelu_forward(x, approximate=form)
        assert_close(y, y_ref, dtype)
        assert_close(cuda.gelu_backward(dy, cache), dx_ref, dtype, scale=_grad_scale(dy))


@given(lead=st.lists(st.integers(1, 4), min_size=0, max_size=2).map(tuple), c=st.sampled_from([1, 3, 33, 70]),
       dtype=st.sampled_from(DTYPES), seed=seeds)
def test_bias_add_and_bias_grad_match_linear(fx, lead, c, dtype, seed):
    """linear_forward's ``out += bias`` and linear_backward's ``dbias = dout2.sum(axis=0)``."""
    x = randn(fx.xp, lead + (c,), seed, dtype=dtype)
    b = randn(fx.xp, (c,), seed + 1, dtype=dtype)
    assert_close(cuda.bias_add_forward(x, b), x + b, dtype, what="x + b")
    eye = fx.xp.eye(c, dtype=dtype)
    with disabled():
        _, cache = linear_forward(x, eye, b)
        dbias_ref = linear_backward(x, cache)[2]
    rows = max(1, x.size // c)
    scale = max(1.0, rows * float(np.abs(host(x).astype(np.float64)).max()))
    assert_close(cuda.bias_grad(x), dbias_ref, dtype, scale=scale, what="dbias")


@given(lead=st.lists(st.integers(1, 4), min_size=0, max_size=2).map(tuple), f=st.sampled_from([1, 5, 33, 70]),
       form=forms, dtype=st.sampled_from(DTYPES), seed=seeds)
def test_bias_gelu_matches_bias_add_then_gelu(fx, lead, f, form, dtype, seed):
    z = randn(fx.xp, lead + (f,), seed, dtype=dtype, scale=2.0)
    b = randn(fx.xp, (f,), seed + 1, dtype=dtype)
    da = randn(fx.xp, lead + (f,), seed + 2, dtype=dtype)
    with disabled():
        h_ref = z + b                                    # linear_forward's out += bias
        a_ref, cache_ref = gelu_forward(h_ref, approximate=form)
        dh_ref = gelu_backward(da, cache_ref)
        db_ref = dh_ref.reshape(-1, f).sum(axis=0)       # linear_backward's dbias
    a, cache = cuda.bias_gelu_forward(z, b, approximate=form)
    assert_close(cache.x, h_ref, dtype, what="h")
    assert_close(a, a_ref, dtype, what="a")
    dz, db = cuda.bias_gelu_backward(da, cache)
    assert_close(dz, dh_ref, dtype, scale=_grad_scale(da), what="dz")
    rows = max(1, z.size // f)
    assert_close(db, db_ref, dtype, scale=rows * _grad_scale(da), what="dbias")
    with disabled():                                   # the cache is gelu's: the plain backward takes it
        assert_close(gelu_backward(da, cache), dh_ref, dtype, scale=_grad_scale(da), what="plain on fused cache")


@given(shape=st.tuples(st.integers(1, 3), st.integers(1, 5)), form=forms, seed=seeds)
def test_bias_gelu_gradcheck_float64(fx, shape, form, seed):
    def forward(z, bias):
        return cuda.bias_gelu_forward(z, bias, approximate=form)

    inputs = {"z": randn(fx.xp, shape, seed, scale=2.0), "bias": randn(fx.xp, shape[-1:], seed + 1)}
    assert_gradcheck(gradcheck(forward, cuda.bias_gelu_backward, inputs, seed=seed))


def test_many_rows_use_several_column_chunks(fx):
    z = randn(fx.xp, (5000, 3), 1, dtype="float32")
    b = randn(fx.xp, (3,), 2, dtype="float32")
    da = randn(fx.xp, (5000, 3), 3, dtype="float32")
    _, cache = cuda.bias_gelu_forward(z, b)
    dz, db = cuda.bias_gelu_backward(da, cache)
    with disabled():
        ref = gelu_backward(da, gelu_forward(z + b)[1]).sum(axis=0)
    assert_close(db, ref, "float32", scale=5000 * _grad_scale(da))
    assert_close(cuda.bias_grad(da), da.sum(axis=0), "float32", scale=5000 * _grad_scale(da))


def test_bad_input_is_refused(fx):
    x = randn(fx.xp, (2, 4), 0)
    with pytest.raises(ValueError, match="approximate: expected one of 'none', 'tanh'"):
        cuda.gelu_forward(x, approximate="erf")
    with pytest.raises(ValueError, match=r"bias: expected shape \(4,\)"):
        cuda.bias_gelu_forward(x, randn(fx.xp, (3,), 0))
    with pytest.raises(TypeError, match="dtype mismatch"):
        cuda.bias_add_forward(x, randn(fx.xp, (4,), 0, dtype="float32"))
    _, cache = cuda.gelu_forward(x)
    with pytest.raises(TypeError, match="dy: expected the dtype of the forward's output, float64"):
        cuda.gelu_backward(randn(fx.xp, (2, 4), 0, dtype="float32"), cache)
    with pytest.raises(ValueError, match=r"dy: expected the shape of the forward's output, \(2, 4\)"):
        cuda.gelu_backward(randn(fx.xp, (2, 5), 0), cache)
