import pytest

from npformer.kernels.cpu import threads


@pytest.fixture(autouse=True)
def parts_as_asked(monkeypatch):
    """The CPU fast paths cut their work as the thread count and the shapes say, whatever product
    ran on BLAS's own threads just before (in production the pool waits while BLAS's workers are
    awake: tests/kernels/cpu/test_threads.py tests that rule, and that it changes no result)."""
    monkeypatch.setattr(threads, "BLAS_AWAKE_SECONDS", 0.0)
    monkeypatch.setitem(threads._state, "blas_awake_until", 0.0)
