"""The combined input check of an op's arrays, npformer.checks.expect_same_float: the same errors as the
three checks it stands for (expect_float on each array, expect_same_dtype, get_array_module); the
checks' switches; positive_in_dtype (an eps that stays > 0 in its dtype)."""
import math

import numpy as np
import pytest

from npformer.checks import expect_float, expect_same_dtype, expect_same_float, positive_in_dtype
from npformer.errors import InputTypeError, RangeError
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


def test_an_op_called_by_another_op_trusts_its_checks():
    """Each array is checked once per public call: the dispatcher counts the ops running, and the
    array checks of an op nested in another return at once (the outer op checked what it passed
    on); scalar checks, which convert, always run; called on its own, the nested op checks."""
    import math
    import sys

    from npformer.checks import OP_DEPTH, checked_by_caller, expect_float, real
    from npformer.errors import InputTypeError, RangeError, ShapeError
    from npformer.ops.feedforward import feed_forward_forward
    from npformer.ops.linear import linear_forward
    assert not checked_by_caller()
    token = OP_DEPTH.set(2)
    try:
        assert checked_by_caller()
        expect_float([1.0], "x")                              # trusted: a caller checked it
        with pytest.raises(RangeError):
            real(math.nan, "lr")
    finally:
        OP_DEPTH.reset(token)
    with pytest.raises(InputTypeError):
        expect_float([1.0], "x")
    depths = []

    def hook(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "check_linear_inputs":
            depths.append(OP_DEPTH.get())
    x, w1, w2 = np.ones((2, 4)), np.ones((5, 4)), np.ones((4, 5))
    sys.setprofile(hook)
    try:
        feed_forward_forward(x, w1, None, w2, None)
    finally:
        sys.setprofile(None)
    assert depths == [1, 2, 2]           # the op's own check, then its two linears' (which return at once)
    with pytest.raises(ShapeError, match="C_in=4"):
        linear_forward(np.ones((2, 3)), w1)                   # on its own, linear checks


def test_multi_head_attention_checks_once_then_trusts_its_parts():
    """Multi-head attention is not dispatched: it checks every input at its top (masks included),
    then runs its projections and attention inside inputs_checked, so their array checks return at
    once; on their own, the same parts check."""
    import sys

    from npformer.checks import OP_DEPTH
    from npformer.ops.multihead import multi_head_attention_forward, self_attention_forward
    depths: dict[str, list] = {}

    def hook(frame, event, arg):
        if event == "call" and frame.f_code.co_name in ("check_linear_inputs", "check_attention_inputs"):
            depths.setdefault(frame.f_code.co_name, []).append(OP_DEPTH.get())
    x, w_in, w_out = np.ones((2, 3, 4)), np.ones((12, 4)), np.ones((4, 4))
    sys.setprofile(hook)
    try:
        self_attention_forward(x, 2, w_in, None, w_out, None, is_causal=True)
        multi_head_attention_forward(x, np.ones((2, 5, 4)), np.ones((2, 5, 4)), 2, w_in, None, w_out, None)
    finally:
        sys.setprofile(None)
    assert depths["check_linear_inputs"] == [2, 2] + [2, 2, 2, 2]    # in and out projections, both ops
    assert depths["check_attention_inputs"] == [2, 2]


def test_array_checks_can_be_switched_off():
    """arrays_unchecked() makes the expect_* array checks return at once in its block (Chainer's
    type_check = False): mixed dtypes then pass silently; an op's own shape
    comparisons and the scalar checks still run, and the checks are back after the block."""
    from npformer.checks import arrays_unchecked, checked_by_caller
    from npformer.errors import InputTypeError, RangeError, ShapeError
    from npformer.ops.layernorm import layer_norm_forward
    from npformer.ops.linear import linear_forward
    x, w = np.ones((2, 4), np.float32), np.ones((5, 4))
    with arrays_unchecked():
        assert checked_by_caller()
        out, _ = linear_forward(x, w)                                  # unchecked: no error
        with pytest.raises(ShapeError, match="C_in=4"):
            linear_forward(np.ones((2, 3)), w)                         # the op's own comparison
        with pytest.raises(RangeError, match="eps"):
            layer_norm_forward(np.ones((2, 4)), eps=-1.0)              # a scalar: still checked
    assert out.shape == (2, 5) and not checked_by_caller()
    with pytest.raises(InputTypeError, match="dtype mismatch"):
        linear_forward(x, w)


def test_positive_in_dtype_refuses_what_the_dtype_rounds_to_0():
    """An eps > 0 must stay > 0 in the dtype it is added in: float32's subnormals pass, 1e-50 does not;
    1e-8 is 0 in float16; the non-positive and non-finite are refused as by real()."""
    assert positive_in_dtype(1e-40, "eps", np.dtype(np.float32)) == 1e-40
    assert positive_in_dtype(1e-300, "eps", np.dtype(np.float64)) == 1e-300
    for v, dtype in ((1e-50, np.float32), (1e-8, np.float16)):
        with pytest.raises(RangeError, match=f"eps: expected a number that stays > 0 in {np.dtype(dtype)}, the "
                                             f"dtype it is added in, got {v!r}, which {np.dtype(dtype)} rounds to 0"):
            positive_in_dtype(v, "eps", np.dtype(dtype))
    for v in (0.0, -1.0, math.inf):
        with pytest.raises(RangeError, match="eps: expected a finite number > 0"):
            positive_in_dtype(v, "eps", np.dtype(np.float64))
