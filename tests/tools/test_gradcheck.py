"""The gradient checker is tested too: correct backwards pass, broken ones fail, reports say where."""
from typing import Any, NamedTuple

import numpy as np
import pytest

from npformer.errors import InputTypeError, RangeError, ShapeError
from npformer.tools.gradcheck import EPS, FLOOR, TOL, GradcheckError, check_gradients, gradcheck, gradcheck_module


class _Cache(NamedTuple):
    x: Any
    w: Any


def fwd(x, w):
    """out = x @ w^T + x * x (elementwise on matching shapes)."""
    return x @ w.T + (x * x).sum(-1, keepdims=True), _Cache(x, w)


def bwd(dout, c):
    return dout @ c.w + 2 * c.x * dout.sum(-1, keepdims=True), dout.T @ c.x


def bwd_flipped_sign(dout, c):
    dx, dw = bwd(dout, c)
    return dx, -dw


def bwd_dropped_term(dout, c):
    return dout @ c.w, dout.T @ c.x       # forgets d(x*x)/dx


def bwd_mutating_cache(dout, c):
    c.x[...] = 0
    return bwd(dout, c)


def _inputs(seed=0):
    r = np.random.default_rng(seed)
    return {"x": r.standard_normal((3, 4)), "w": r.standard_normal((5, 4))}


def test_correct_backward_passes():
    report = gradcheck(fwd, bwd, _inputs())
    assert report.passed, str(report)
    assert report.worst < 1e-8
    assert [c.name for c in report.checks] == ["x", "w"]
    assert [c.n_checked for c in report.checks] == [12, 20]


@pytest.mark.parametrize("broken", [bwd_flipped_sign, bwd_dropped_term])
def test_broken_backward_fails_and_says_where(broken):
    report = gradcheck(fwd, broken, _inputs(), seed=11)
    assert not report.passed
    text = str(report)
    assert "FAIL" in text and "eps=0.0001" in text and f"tol={TOL:g}" in text and "seed=11" in text
    bad = [c for c in report.checks if not c.passed][0]
    assert bad.worst_index is not None and bad.worst_rel_error > 1e-3
    with pytest.raises(GradcheckError, match="analytic=.*numeric="):
        report.raise_if_failed()


def test_mutating_the_cache_is_caught():
    report = gradcheck(fwd, bwd_mutating_cache, _inputs())
    assert not report.passed
    assert "cache.x was mutated by backward" in str(report)


def test_mutating_an_input_is_caught():
    def fwd_mutating(x, w):
        out, cache = fwd(x, w)
        x += 0.0 * x + 1e-3
        return out, cache
    report = gradcheck(fwd_mutating, bwd, _inputs())
    assert not report.passed and "input x was mutated" in str(report)


def test_wrong_gradient_shape_or_count_is_reported():
    report = gradcheck(fwd, lambda d, c: (bwd(d, c)[0].T, bwd(d, c)[1]), _inputs())
    assert not report.passed and "gradient shape (4, 3) != input shape (3, 4)" in str(report)
    report = gradcheck(fwd, lambda d, c: bwd(d, c)[0], _inputs())
    assert not report.passed and "backward returned 1 gradients for the 2 differentiable inputs" in str(report)


def test_float32_is_refused():
    with pytest.raises(InputTypeError, match="gradcheck needs float64 arrays; x is float32"):
        gradcheck(fwd, bwd, {k: v.astype(np.float32) for k, v in _inputs().items()})


def test_bad_arguments_are_npformer_errors_raised_before_backward_runs():
    """Found by fuzzing: eps=0 divided by zero, eps=NaN failed every element as "at a kink", a negative
    max_elements or a list input raised NumPy's or Python's errors, a bare-array forward was read as
    (out, cache) = (rows of it), and a dout of the wrong shape was reported as the backward's fault."""
    def never(dout, cache):
        raise AssertionError("backward must not be called")
    x = _inputs()
    for kw, exc, msg in [
            ({"eps": 0}, RangeError, "eps: expected a finite number > 0, got 0"),
            ({"eps": float("nan")}, RangeError, "eps: expected a finite number > 0, got nan"),
            ({"eps": -1e-4}, RangeError, "eps: expected a finite number > 0, got -0.0001"),
            ({"eps": "1e-4"}, InputTypeError, "eps: expected a real number, got str"),
            ({"max_elements": -1}, RangeError, "max_elements: expected an int >= 1, got -1"),
            ({"max_elements": 0}, RangeError, "max_elements: expected an int >= 1, got 0"),
            ({"seed": "a"}, InputTypeError, "seed: expected an int, got str 'a'"),
            ({"seed": -1}, RangeError, "seed: expected an int >= 0, got -1"),
            ({"mode": "grid"}, RangeError, "mode: expected one of 'elements', 'direction', got 'grid'"),
            ({"dout": 1.0}, InputTypeError, "dout: expected a numpy or cupy array, got float 1.0"),
            ({"dout": np.ones((2, 2))}, ShapeError, r"dout: expected the shape of the forward's output, \(3, 5\), "
                                                    r"got numpy float64 array of shape \(2, 2\)"),
            ({"dout": np.ones((3, 5), np.float32)}, InputTypeError, "dout: expected the dtype of the forward's output"),
            ({"inputs": [x["x"], x["w"]]}, InputTypeError,
             "inputs: expected a dict of name -> float64 array, got list"),
            ({"inputs": {"x": [1.0, 2.0], "w": x["w"]}}, InputTypeError,
             r"inputs\['x'\]: expected a numpy or cupy array \(float64 to be checked\), got list")]:
        inputs = kw.pop("inputs", x)
        with pytest.raises(exc, match=msg):
            gradcheck(fwd, never, inputs, **kw)
    with pytest.raises(InputTypeError, match=r"forward: expected a tuple \(out, \.\.\., cache\) of at least two, "
                                             "the output array first, got numpy float64 array of shape"):
        gradcheck(lambda x, w: fwd(x, w)[0], never, x)
    with pytest.raises(InputTypeError, match="forward: expected a tuple .*got tuple"):
        gradcheck(lambda x, w: (fwd(x, w)[0],), never, x)
    with pytest.raises(RangeError, match="eps: expected a finite number > 0, got 0"):
        check_gradients(lambda: x["x"] * 2, {"x": x["x"]}, {"x": 2 * np.ones((3, 4))}, np.ones((3, 4)), eps=0)
    with pytest.raises(InputTypeError, match="arrays: expected a dict of name -> float64 array, got list"):
        check_gradients(lambda: x["x"] * 2, [x["x"]], {"x": 2 * np.ones((3, 4))}, np.ones((3, 4)))
    report = gradcheck(fwd, lambda d, c: ([[0.0]], bwd(d, c)[1]), x)       # a list for a gradient: reported
    assert not report.passed and "backward returned list [[0.0]], not an array" in str(report)


def test_gradcheck_module_needs_a_module():
    from npformer.nn import Linear
    with pytest.raises(InputTypeError, match="module: expected an npformer Module, got function"):
        gradcheck_module(lambda x: x, {"x": np.ones((2, 3))})
    linear = Linear(3, 2, dtype=np.float64, rng=0)
    with pytest.raises(InputTypeError, match="inputs: expected a dict of name -> float64 array, got list"):
        gradcheck_module(linear, [np.ones((2, 3))])
    with pytest.raises(RangeError, match="eps: expected a finite number > 0, got -1"):
        gradcheck_module(linear, {"x": np.ones((2, 3))}, eps=-1)
    assert gradcheck_module(linear, {"x": np.random.default_rng(0).standard_normal((2, 3))}).passed


def test_sampled_and_direction_modes():
    big = {"x": np.random.default_rng(1).standard_normal((6, 9)), "w": np.random.default_rng(2).standard_normal((7, 9))}
    report = gradcheck(fwd, bwd, big, max_elements=10)
    assert report.passed and all(c.n_checked == 10 for c in report.checks)
    report = gradcheck(fwd, bwd, big, mode="direction")
    assert report.passed and all(c.n_checked == 1 for c in report.checks)
    assert not gradcheck(fwd, bwd_dropped_term, big, mode="direction").passed


def test_check_gradients_restores_arrays_bit_for_bit():
    x = np.random.default_rng(0).standard_normal((2, 3))
    before = x.copy()
    dout = np.ones((2, 3)) * 0.5
    report = check_gradients(lambda: np.sin(x), {"x": x}, {"x": np.cos(x) * dout}, dout)
    assert report.passed
    np.testing.assert_array_equal(x, before)


def test_floor_judges_tiny_gradients_by_absolute_error():
    # A gradient of 1e-7 computed as 0 is an absolute error of 1e-7 > TOL * FLOOR = 1e-9: it must fail.
    x = np.array([0.3])
    report = check_gradients(lambda: 1e-7 * x, {"x": x}, {"x": np.zeros(1)}, np.ones(1))
    assert not report.passed
    assert TOL * FLOOR == pytest.approx(1e-9) and EPS == 1e-4


def test_a_kink_is_reported_not_compared_and_a_wrong_gradient_elsewhere_still_fails():
    """relu at exactly 0: no finite difference exists there; within 2 eps of it (5e-5), a step of
    eps / 10 is out of the kink's reach, and that element is compared."""
    x = np.array([0.0, 5e-5, 0.7, -0.4])
    dout = np.array([1.0, 1.0, 1.0, 1.0])
    relu = lambda: np.maximum(x, 0)                      # noqa: E731
    good = check_gradients(relu, {"x": x}, {"x": (x > 0) * dout}, dout)
    assert good.passed and good.checks[0].n_kinks == 1 and "1 at a kink" in str(good)
    assert not check_gradients(relu, {"x": x}, {"x": np.array([0.0, 0.5, 1.0, 0.0])}, dout).passed
    bad = check_gradients(relu, {"x": x}, {"x": np.array([0.0, 1.0, 0.5, 0.0])}, dout)
    assert not bad.passed and bad.checks[0].worst_index == (2,)
    all_kinks = check_gradients(lambda: np.abs(x[:1]), {"x": x}, {"x": np.zeros(4)}, np.ones(1))
    assert all_kinks.passed                               # elements 1..3 do not move |x[0]|: smooth
    only = np.array([0.0])
    stuck = check_gradients(lambda: np.abs(only), {"x": only}, {"x": np.zeros(1)}, np.ones(1))
    assert not stuck.passed and "every checked element is at a kink" in str(stuck)


def test_a_kink_hidden_beside_a_large_slope_is_found_by_a_smaller_step_and_a_real_error_is_not_hidden():
    """f(x) = 100 x + relu(x) at x = 1.5 eps: the ReLU switches between h and 2h, yet the central
    differences at h and 2h agree to 1e-2 of the slope (101 against 100.875), so the kink test alone
    calls the point smooth and the five-point estimate (101.04) misses the true 101 by 2e-4 > TOL.
    A step of eps / 10 does not reach 0: it agrees, so the element is compared there, not failed. The
    same point with a wrong analytic gradient (100: the ReLU's term dropped) still fails."""
    x = np.array([1.5 * EPS, 0.3])
    f = lambda: 100 * x + np.maximum(x, 0)               # noqa: E731
    dout = np.ones(2)
    right = check_gradients(f, {"x": x}, {"x": np.array([101.0, 101.0])}, dout)
    assert right.passed and right.checks[0].n_kinks == 0, str(right)
    wrong = check_gradients(f, {"x": x}, {"x": np.array([100.0, 101.0])}, dout)
    assert not wrong.passed and wrong.checks[0].worst_index == (0,), str(wrong)
    # direction mode, over many directions (some reach the kink, some do not): right passes, wrong fails
    y = np.array([1.5 * EPS])
    g = lambda: 100 * y + np.maximum(y, 0)                # noqa: E731
    for seed in range(20):
        assert check_gradients(g, {"y": y}, {"y": np.array([101.0])}, np.ones(1), mode="direction",
                               seed=seed).passed
        assert not check_gradients(g, {"y": y}, {"y": np.array([100.0])}, np.ones(1), mode="direction",
                                   seed=seed).passed


def test_a_kink_within_reach_of_every_direction_is_measured_with_a_smaller_step():
    """A ReLU input 5e-5 from 0 that every parameter moves (its sum): almost every direction reaches
    the kink with a step of eps (2 eps |sum v| ~ 8e-4), so five redrawn directions all met it and
    the check failed with no error anywhere (a tiny Transformer-XL on a GPU, 2026-11-26). A step of
    eps / 100 is out of reach: the right gradient passes, a wrong one (the ReLU's term dropped) fails."""
    x = np.random.default_rng(0).standard_normal(16)
    shift = x.sum() - 5e-5
    f = lambda: np.stack([3.0 * np.maximum(x.sum() - shift, 0.0), (x ** 2).sum()])   # noqa: E731
    dout = np.array([1.0, 0.5])
    right = 3.0 + x                                      # d/dx of 3 relu(sum x - shift) + 0.5 sum x^2
    for seed in range(20):
        report = check_gradients(f, {"x": x}, {"x": right}, dout, mode="direction", seed=seed)
        assert report.passed and report.checks[0].n_kinks == 0, str(report)
        assert not check_gradients(f, {"x": x}, {"x": x.copy()}, dout, mode="direction", seed=seed).passed
