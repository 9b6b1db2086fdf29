"""The CPU fast paths' row sums (npformer.kernels.cpu.rows): NumPy's sums to float rounding, the same
bits for a row whatever else the call holds (the fast paths sum rows block by block), and rows
longer than SHORT_ROW summed pairwise, as NumPy's sum (its accuracy on long rows)."""
import numpy as np
from hypothesis import given, strategies as st

from npformer.kernels.cpu.rows import SHORT_ROW, row_dot, row_sum
from tests.helpers import randn, seeds

row_shapes = st.tuples(st.integers(1, 4), st.integers(1, 9), st.sampled_from([1, 2, 7, 64, 129, SHORT_ROW]))


@given(shape=row_shapes, seed=seeds, dtype=st.sampled_from(["float32", "float64"]))
def test_row_sums_are_numpys_and_do_not_depend_on_the_other_rows(shape, seed, dtype):
    x, y = randn(np, shape, seed, dtype), randn(np, shape, seed + 1, dtype)
    s, d = row_sum(x), row_dot(x, y)
    assert s.shape == d.shape == shape[:-1] + (1,) and s.dtype == d.dtype == np.dtype(dtype)
    rtol = 1e-12 if dtype == "float64" else 1e-5
    scale = np.abs(x).sum(axis=-1, keepdims=True)           # the sums' condition: cancellation allowed
    assert (np.abs(s - x.sum(axis=-1, keepdims=True)) <= rtol * scale).all()
    assert (np.abs(d - (x * y).sum(axis=-1, keepdims=True)) <= rtol * np.abs(x * y).sum(-1, keepdims=True)).all()
    for rows in (slice(0, 1), slice(1, None), slice(None, None, 2)):   # other blocks of rows: the same bits
        np.testing.assert_array_equal(row_sum(x[rows]), s[rows])
        np.testing.assert_array_equal(row_dot(x[rows], y[rows]), d[rows])


def test_long_rows_are_summed_pairwise():
    """A vocabulary-long row: NumPy's pairwise sum bit for bit, within 2e-7 of the float64 sum."""
    x = np.random.default_rng(0).random((8, 50257)).astype(np.float32)
    np.testing.assert_array_equal(row_sum(x), x.sum(axis=-1, keepdims=True))
    np.testing.assert_array_equal(row_dot(x, x), (x * x).sum(axis=-1, keepdims=True))
    exact = x.astype(np.float64).sum(axis=-1, keepdims=True)
    assert (np.abs(row_sum(x) - exact) <= 2e-7 * exact).all()
    assert SHORT_ROW < x.shape[-1]
