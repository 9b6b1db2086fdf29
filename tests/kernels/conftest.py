import pytest

from npformer.kernels.cpu import dropout as cpu_dropout
from npformer.kernels.cpu import threads


@pytest.fixture(autouse=True)
def parts_as_asked(monkeypatch):
    """The CPU fast paths cut their work as the thread count and the shapes say, whatever product
    ran on BLAS's own threads just before (in production the pool waits while BLAS's workers are
    awake: tests/kernels/cpu/test_threads.py tests that rule, and that it changes no result)."""
    monkeypatch.setattr(threads, "BLAS_AWAKE_SECONDS", 0.0)
    monkeypatch.setitem(threads._state, "blas_awake_until", 0.0)


@pytest.fixture(autouse=True)
def small_masks_streamed(monkeypatch):
    """The dropout fast paths take any even size here, so their parity cases may be small (in
    production masks under MIN_STREAM_ELEMENTS take the reference: test_small_masks_take_the_reference)."""
    monkeypatch.setattr(cpu_dropout, "MIN_STREAM_ELEMENTS", 2)
