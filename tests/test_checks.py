"""The combined input check of an op's arrays, npformer.checks.expect_same_float: the same errors as the
three checks it stands for (expect_float on each array, expect_same_dtype, get_array_module)."""
import numpy as np
import pytest

from npformer.checks import expect_float, expect_same_dtype, expect_same_float
from npformer.errors import InputTypeError
from tests.helpers import posing_as_cupy


def test_floats_of_one_dtype_pass_and_none_is_skipped():
    x, w = np.zeros((2, 3), np.float32), np.zeros((4, 3), np.float32)
    assert expect_same_float(x=x, weight=w, bias=None) is None
    assert expect_same_float() is None and expect_same_float(bias=None) is None


@pytest.mark.parametrize("arrays", [
    {"x": np.zeros(3, np.float64), "weight": np.zeros(3, np.int32)},          # an integer array, second
    {"x": np.zeros(3, np.int64), "weight": np.zeros(3, np.float32)},          # first
    {"x": np.zeros(3, np.float64), "weight": np.zeros(3, np.float32)},        # floats of two dtypes
    {"x": np.zeros(3, np.float16), "weight": [1.0, 2.0, 3.0]},                # not an array
    {"x": np.zeros(3, np.float32), "weight": np.zeros(3, np.float64), "bias": np.zeros(3, bool)},
])
def test_the_error_is_the_one_of_the_separate_checks(arrays):
    with pytest.raises(InputTypeError) as separate:
        for name, a in arrays.items():
            expect_float(a, name)
        expect_same_dtype(**arrays)
    with pytest.raises(InputTypeError) as combined:
        expect_same_float(**arrays)
    assert str(combined.value) == str(separate.value)


def test_an_integer_array_is_named_before_a_dtype_mismatch():
    with pytest.raises(InputTypeError, match="bias: expected a floating-point array"):
        expect_same_float(x=np.zeros(3, np.float32), weight=np.zeros(3, np.float64), bias=np.zeros(3, np.int8))


def test_arrays_of_two_backends_are_refused(monkeypatch):
    x, w = np.ones((2, 3)), posing_as_cupy(monkeypatch, np.ones((4, 3)))
    with pytest.raises(TypeError, match="two backends were mixed"):
        expect_same_float(x=x, weight=w)
    expect_same_float(x=w, weight=w)        # one backend, even when it is not NumPy
