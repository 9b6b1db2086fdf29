"""embedding_forward / embedding_backward: loop references, repeated ids, padding_idx, gradcheck,
dtypes, views, float16 accumulation, torch oracle, bad input."""
import contextlib

import numpy as np
import pytest
from hypothesis import given, strategies as st

from npformer.kernels import disabled
from npformer.ops.embedding import embedding_backward, embedding_forward
from npformer.tools.gradcheck import gradcheck
from tests.helpers import NO_TORCH, assert_gradcheck, batch, host, randn, seeds, seq


def ids_array(xp, values, dtype="int64"):
    return xp.asarray(np.asarray(values, dtype=dtype))


def reference_forward(ids, weight):
    """out[idx] = weight[ids[idx]] by an explicit loop over every position."""
    ids, weight = np.asarray(ids), np.asarray(weight)
    out = np.empty(ids.shape + weight.shape[1:], dtype=weight.dtype)
    for idx in np.ndindex(*ids.shape):
        out[idx] = weight[ids[idx]]
    return out


def reference_backward(dout, ids, v, padding_idx=None):
    """dW[v] = sum of dout over the positions holding id v, one position at a time."""
    dout, ids = np.asarray(dout, dtype=np.float64), np.asarray(ids)
    dw = np.zeros((v, dout.shape[-1]))
    for idx in np.ndindex(*ids.shape):
        dw[ids[idx]] += dout[idx]
    if padding_idx is not None:
        dw[padding_idx] = 0.0
    return dw


@st.composite
def embedding_cases(draw):
    """ids of shape (B, T) (or a 1-d / 0-d shape), V, C, a padding_idx (or None) that ids avoid."""
    rank = draw(st.integers(0, 2))
    lead = ((draw(batch), draw(seq)), (draw(seq),), ())[2 - rank]
    v, c = draw(st.integers(1, 6)), draw(st.integers(1, 4))
    pad = draw(st.none() | st.integers(-v, v - 1)) if v > 1 else None
    allowed = [i for i in range(v) if pad is None or i != pad % v]
    n = int(np.prod(lead, dtype=int))
    ids = np.array(draw(st.lists(st.sampled_from(allowed), min_size=n, max_size=n)), dtype=np.int64)
    return ids.reshape(lead), v, c, pad


@given(case=embedding_cases(), seed=seeds)
def test_embedding_gradcheck_and_references(xp, case, seed):
    """Every element of W; ids avoid the padding row, whose gradient is zero by definition."""
    ids_h, v, c, pad = case
    ids, weight = xp.asarray(ids_h), randn(xp, (v, c), seed)
    out, cache = embedding_forward(ids, weight, padding_idx=pad)
    assert out.shape == ids_h.shape + (c,)
    np.testing.assert_array_equal(host(out), reference_forward(ids_h, host(weight)))
    dout = randn(xp, out.shape, seed + 1)
    np.testing.assert_allclose(host(embedding_backward(dout, cache)),
                               reference_backward(host(dout), ids_h, v), rtol=1e-13, atol=1e-14)
    report = gradcheck(embedding_forward, embedding_backward, {"ids": ids, "weight": weight},
                       kwargs={"padding_idx": pad}, seed=seed)
    assert_gradcheck(report)


def test_repeated_ids_add_up(xp):
    """The same id many times (and in several rows): its gradient is the sum, not the last write."""
    ids_h = np.array([[2, 2, 2, 0], [2, 1, 0, 2]])
    ids, weight = xp.asarray(ids_h), randn(xp, (4, 3), 0)
    _, cache = embedding_forward(ids, weight)
    dout = randn(xp, (2, 4, 3), 1)
    dw = host(embedding_backward(dout, cache))
    ref = reference_backward(host(dout), ids_h, 4)
    np.testing.assert_allclose(dw, ref, rtol=1e-13, atol=1e-15)
    d = host(dout)
    np.testing.assert_allclose(dw[2], d[0, 0] + d[0, 1] + d[0, 2] + d[1, 0] + d[1, 3], rtol=1e-13)
    assert np.array_equal(dw[3], np.zeros(3))           # an unused row gets exactly zero


@pytest.mark.parametrize("pad, row", [(1, 1), (-1, 3), (-4, 0), (0, 0)])
def test_padding_row_gets_zero_gradient(xp, pad, row):
    """padding_idx in [-V, V) is normalised like torch (-1 is the last row); only that row is zeroed."""
    ids_h = np.array([[0, 1, 3, 1], [3, 2, 0, 1]])
    ids, weight = xp.asarray(ids_h), randn(xp, (4, 2), 0)
    out, cache = embedding_forward(ids, weight, padding_idx=pad)
    assert cache.padding_idx == row
    np.testing.assert_array_equal(host(out), reference_forward(ids_h, host(weight)))  # lookup unchanged
    dout = randn(xp, (2, 4, 2), 1)
    np.testing.assert_allclose(host(embedding_backward(dout, cache)),
                               reference_backward(host(dout), ids_h, 4, padding_idx=row), rtol=1e-13)


def test_matches_torch(xp):
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    ids_h = np.random.default_rng(0).integers(0, 7, size=(3, 5))
    w_h, dout_h = host(randn(xp, (7, 4), 1)), host(randn(xp, (3, 5, 4), 2))
    for pad in (None, 2, -3):
        tw = torch.tensor(w_h, requires_grad=True)
        tout = torch.nn.functional.embedding(torch.tensor(ids_h), tw, padding_idx=pad)
        tout.backward(torch.tensor(dout_h))
        out, cache = embedding_forward(xp.asarray(ids_h), xp.asarray(w_h), padding_idx=pad)
        np.testing.assert_array_equal(host(out), tout.detach().numpy())
        np.testing.assert_allclose(host(embedding_backward(xp.asarray(dout_h), cache)),
                                   tw.grad.numpy(), rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_dtype_preserved_and_inputs_untouched(xp, dtype):
    ids = ids_array(xp, [[1, 0, 1], [2, 2, 0]])
    weight = randn(xp, (3, 4), 0, dtype=dtype)
    before_ids, before_w = ids.copy(), weight.copy()
    out, cache = embedding_forward(ids, weight, padding_idx=0)
    dout = randn(xp, (2, 3, 4), 1, dtype=dtype)
    before_dout = dout.copy()
    dw = embedding_backward(dout, cache)
    assert out.dtype == weight.dtype and dw.dtype == weight.dtype and dw.shape == (3, 4)
    assert xp.array_equal(ids, before_ids) and xp.array_equal(weight, before_w)
    assert xp.array_equal(dout, before_dout) and xp.array_equal(cache.ids, before_ids)
    out[...] = 0                                         # the output is a fresh array, not a view of W
    assert xp.array_equal(weight, before_w)


@pytest.mark.parametrize("dtype", ["int8", "int32", "uint8", "uint64"])
def test_any_integer_id_dtype(xp, dtype):
    ids = ids_array(xp, [[3, 0], [1, 3]], dtype=dtype)
    weight = randn(xp, (4, 2), 0)
    out, cache = embedding_forward(ids, weight)
    np.testing.assert_array_equal(host(out), reference_forward(host(ids), host(weight)))
    dout = randn(xp, (2, 2, 2), 1)
    np.testing.assert_allclose(host(embedding_backward(dout, cache)),
                               reference_backward(host(dout), host(ids), 4), rtol=1e-13)


def test_non_contiguous_ids_weight_and_dout(xp):
    ids_h = np.random.default_rng(0).integers(0, 5, size=(4, 3))
    ids = xp.asarray(ids_h).T                            # (3, 4) transposed view
    weight = randn(xp, (2, 5), 1).T                      # (5, 2) transposed view
    dout = randn(xp, (2, 4, 3), 2).transpose(2, 1, 0)    # (3, 4, 2) non-contiguous
    out, cache = embedding_forward(ids, weight)
    np.testing.assert_array_equal(host(out), reference_forward(ids_h.T, host(weight)))
    np.testing.assert_allclose(host(embedding_backward(dout, cache)),
                               reference_backward(host(dout), ids_h.T, 5), rtol=1e-13)


def test_empty_and_scalar_ids(xp):
    weight = randn(xp, (3, 2), 0)
    out, cache = embedding_forward(xp.zeros((2, 0), dtype=xp.int64), weight)
    assert out.shape == (2, 0, 2)
    assert xp.array_equal(embedding_backward(xp.zeros((2, 0, 2)), cache), xp.zeros((3, 2)))
    out, cache = embedding_forward(ids_array(xp, 2), weight)
    assert out.shape == (2,) and xp.array_equal(out, weight[2])
    dw = embedding_backward(xp.asarray(np.array([1.5, -2.0])), cache)
    np.testing.assert_array_equal(host(dw), [[0, 0], [0, 0], [1.5, -2.0]])


@pytest.mark.parametrize("fast", [True, False])
def test_embedding_dim_0(xp, fast):
    """A table of C = 0 columns (V, 0): the output is (..., 0) and the gradient the (V, 0) zeros, on
    every path (reshape(-1, 0) of the gradient was ambiguous and raised), padding row or not; an empty
    batch of ids too."""
    weight = xp.ones((4, 0), dtype=xp.float32)
    with contextlib.nullcontext() if fast else disabled():
        for ids, pad in ((ids_array(xp, [[1, 2, 2]]), None), (ids_array(xp, [3, 0]), 0),
                         (xp.zeros((2, 0), dtype=xp.int64), None)):
            out, cache = embedding_forward(ids, weight, padding_idx=pad)
            assert out.shape == ids.shape + (0,) and out.dtype == xp.float32
            dw = embedding_backward(xp.ones_like(out), cache)
            assert dw.shape == (4, 0) and dw.dtype == xp.float32


def test_float16_repeated_ids_accumulate_in_float32(xp):
    """4096 copies of 0.1 sum to 409.6; a float16 running sum would stall at 256 (spacing 0.25)."""
    ids = xp.zeros((4096,), dtype=xp.int64)
    _, cache = embedding_forward(ids, randn(xp, (2, 1), 0, dtype="float16"))
    dw = embedding_backward(xp.full((4096, 1), 0.1, dtype=xp.float16), cache)
    assert dw.dtype == xp.float16
    np.testing.assert_allclose(float(host(dw)[0, 0]), 4096 * float(np.float16(0.1)), rtol=1e-3)


def test_extreme_values_pass_through_exactly(xp):
    weight = xp.asarray(np.array([[1e30, -1e-30], [np.finfo(np.float32).max, 0.0]], dtype=np.float32))
    out, cache = embedding_forward(ids_array(xp, [1, 0, 1]), weight)
    np.testing.assert_array_equal(host(out), host(weight)[[1, 0, 1]])
    dw = embedding_backward(xp.ones((3, 2), dtype=xp.float32) * 1e30, cache)
    assert np.all(np.isfinite(host(dw))) and float(host(dw)[1, 0]) == pytest.approx(2e30, rel=1e-6)


def test_bad_input(xp):
    weight = randn(xp, (4, 3), 0)
    with pytest.raises(TypeError, match="ids: expected an integer array"):
        embedding_forward(xp.asarray([0.0, 1.0]), weight)
    with pytest.raises(TypeError, match="ids: expected a numpy or cupy array"):
        embedding_forward([0, 1], weight)
    with pytest.raises(ValueError, match=r"in \[0, 4\).*values from 0 to 4"):
        embedding_forward(ids_array(xp, [0, 4, 1]), weight)
    with pytest.raises(ValueError, match=r"in \[0, 4\).*values from -1 to 2"):
        embedding_forward(ids_array(xp, [[2, -1]]), weight)
    with pytest.raises(ValueError, match=r"weight: expected a 2-d array \(V, C\), got .*shape \(4,\)"):
        embedding_forward(ids_array(xp, [0]), randn(xp, (4,), 0))
    with pytest.raises(ValueError, match=r"weight: expected a 2-d array \(V, C\), got .*shape \(4, 3, 1\)"):
        embedding_forward(ids_array(xp, [0]), randn(xp, (4, 3, 1), 0))
    with pytest.raises(TypeError, match="weight: expected a floating-point array"):
        embedding_forward(ids_array(xp, [0]), xp.zeros((4, 3), dtype=xp.int64))
    for pad in (4, -5):
        with pytest.raises(ValueError, match=rf"padding_idx must be in \[-4, 4\), got {pad}"):
            embedding_forward(ids_array(xp, [0]), weight, padding_idx=pad)
    for pad in (1.0, True, "0"):
        with pytest.raises(TypeError, match="padding_idx must be an int or None"):
            embedding_forward(ids_array(xp, [0]), weight, padding_idx=pad)
    _, cache = embedding_forward(ids_array(xp, [[0, 1]]), weight)
    with pytest.raises(ValueError, match=r"dout: expected the shape of the forward's output, \(1, 2, 3\)"):
        embedding_backward(randn(xp, (2, 3), 1), cache)
    wrong = f"dout: expected the dtype of the forward.s output, float64, got {xp.__name__} int64"
    with pytest.raises(TypeError, match=wrong):
        embedding_backward(xp.ones((1, 2, 3), dtype=xp.int64), cache)


def test_numpy_integer_padding_idx_is_accepted(xp):
    _, cache = embedding_forward(ids_array(xp, [0, 1]), randn(xp, (3, 2), 0), padding_idx=np.int64(-1))
    assert cache.padding_idx == 2 and type(cache.padding_idx) is int
