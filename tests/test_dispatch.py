"""npformer.dispatch: which implementation of a dispatched op runs, and the switches."""
import threading

import pytest

from npformer import dispatch


def _op_with_paths():
    @dispatch.dispatched
    def double(x):
        return ("reference", 2 * x)
    dispatch.register(double, "first", lambda x: ("first", 2 * x), lambda x: x > 0)
    dispatch.register(double, "second", lambda x: ("second", 2 * x), lambda x: True)
    return double


def test_the_first_accepting_path_runs_in_registration_order():
    double = _op_with_paths()
    assert double(3) == ("first", 6) and dispatch.implementation(double, 3) == "first"
    assert double(-1) == ("second", -2) and dispatch.implementation(double, -1) == "second"
    assert double.reference(3) == ("reference", 6)


def test_disabled_runs_the_reference_and_named_disabling_skips_only_those():
    double = _op_with_paths()
    with dispatch.disabled():
        assert double(3)[0] == "reference" == dispatch.implementation(double, 3)
    with dispatch.disabled("first"):
        assert double(3)[0] == "second" == dispatch.implementation(double, 3)
        with dispatch.disabled("second"):                # names add up when nested
            assert double(3)[0] == "reference"
        assert double(3)[0] == "second"
    assert double(3)[0] == "first"
    with pytest.raises(TypeError, match="fast-path names"):
        with dispatch.disabled(1):
            pass


def test_the_switch_is_per_thread():
    double = _op_with_paths()
    seen = []
    with dispatch.disabled("first"):
        worker = threading.Thread(target=lambda: seen.append(double(3)[0]))
        worker.start()
        worker.join()
        assert double(3)[0] == "second"
    assert seen == ["first"]


def test_register_rejects_plain_functions_and_duplicate_names():
    double = _op_with_paths()
    with pytest.raises(TypeError, match="not marked @dispatched"):
        dispatch.register(lambda x: x, "cpu", lambda x: x, lambda x: True)
    with pytest.raises(ValueError, match="already has a fast path named 'first'"):
        dispatch.register(double, "first", lambda x: x, lambda x: True)
