import pytest

from npformer.kernels.cpu import dropout as cpu_dropout
from npformer.kernels.cpu import threads


@pytest.fixture(autouse=True)
def machine_not_busy(monkeypatch):
    """The fast paths cut their work as the thread count and the shapes say, whatever the load of the
    machine running the tests (in production a busy machine keeps element-wise work whole:
    tests/kernels/cpu/test_threads.py tests that rule, tests/kernels/test_step_bits.py that it
    changes no bit)."""
    monkeypatch.setattr(threads, "machine_busy", lambda: False)


@pytest.fixture(autouse=True)
def small_masks_blocked(monkeypatch):
    """The NumPy dropout fast path takes any size here, so its parity cases may be small (in
    production masks under MIN_BLOCKED_ELEMENTS take the reference: test_small_masks_take_the_reference)."""
    monkeypatch.setattr(cpu_dropout, "MIN_BLOCKED_ELEMENTS", 1)
