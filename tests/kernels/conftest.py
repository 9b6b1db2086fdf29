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


@pytest.fixture
def thread_count():
    """Sets the pool's thread count (BLAS's left alone) for the test, restored after it."""
    before = threads.get_num_threads()
    yield lambda n: threads.set_num_threads(n, blas=False)    # the pool alone
    threads.set_num_threads(before, blas=False)


@pytest.fixture
def tiny_blocks(monkeypatch):
    """Blocks of 8 scores (16 when threads share the work), thread runs of 8 elements and mask blocks
    of 3, so small arrays take every cut (attention: a head of more than 8 scores in runs of rows)."""
    from npformer.kernels.cpu import attention as cpu_attention, blocks as cpu_blocks
    monkeypatch.setattr(cpu_attention, "BLOCK_ELEMENTS", 8)
    monkeypatch.setattr(cpu_blocks, "BLOCK_ELEMENTS", 8)
    monkeypatch.setattr(cpu_blocks, "THREAD_BLOCK_ELEMENTS", 16)
    monkeypatch.setattr(cpu_dropout, "BLOCK_ELEMENTS", 8)
    monkeypatch.setattr(cpu_dropout, "MIN_THREAD_ELEMENTS", 8)
    monkeypatch.setattr(cpu_dropout, "MASK_BLOCK", 3)
