import pytest

from npformer.kernels.cpu import threads


@pytest.fixture(autouse=True)
def machine_not_busy(monkeypatch):
    """The fast paths cut their work as the thread count and the shapes say, whatever the load of the
    machine running the tests (in production a busy machine keeps element-wise work whole:
    tests/kernels/cpu/test_threads.py tests that rule, tests/kernels/test_step_bits.py that it
    changes no bit)."""
    monkeypatch.setattr(threads, "machine_busy", lambda: False)

