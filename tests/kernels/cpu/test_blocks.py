"""blockwise: the same bits whatever the block size and thread count; fallbacks; bad input."""
import time

import numpy as np
import pytest

from npformer.kernels.cpu import blocks
from npformer.kernels.cpu.blocks import blockwise
from npformer.kernels.cpu.threads import get_num_threads, set_num_threads


def _chain(out, x, y):
    """An element-wise chain with a transcendental, like the activations'."""
    np.multiply(x, y, out=out)
    out += 0.5
    np.tanh(out, out=out)
    out *= x


def _row_softmax(out, x):
    np.subtract(x, x.max(axis=-1, keepdims=True), out=out)
    np.exp(out, out=out)
    out /= out.sum(axis=-1, keepdims=True)


def small_blocks(monkeypatch, n):
    """Blocks of n elements, for one thread and for several (so small arrays use threads too)."""
    monkeypatch.setattr(blocks, "BLOCK_ELEMENTS", n)
    monkeypatch.setattr(blocks, "THREAD_BLOCK_ELEMENTS", n)
    monkeypatch.setattr(blocks, "MIN_THREAD_ELEMENTS", n)


@pytest.fixture
def threads():
    before = get_num_threads()
    yield lambda n: set_num_threads(n, blas=False)             # the pool alone
    set_num_threads(before, blas=False)


@pytest.mark.parametrize("block, thread_block", [(64, 64), (64, 1000), (1000, 1000), (1 << 16, 1 << 18)])
def test_results_are_bit_identical_for_any_block_size_and_thread_count(monkeypatch, threads, block, thread_block):
    rng = np.random.default_rng(0)
    x, y = (rng.standard_normal((3, 70001)).astype(np.float32) for _ in range(2))   # odd size: a short last block
    whole = np.empty_like(x)
    _chain(whole, x, y)                                  # one pass over the whole arrays
    small_blocks(monkeypatch, block)
    monkeypatch.setattr(blocks, "THREAD_BLOCK_ELEMENTS", thread_block)
    for n in (1, 2, 3):
        threads(n)
        got = blockwise(_chain, np.empty_like(x), x, y)
        assert np.array_equal(got, whole), f"block={block} thread_block={thread_block} threads={n}"


def test_rows_are_kept_whole(monkeypatch, threads):
    x = np.random.default_rng(1).standard_normal((999, 37)).astype(np.float32)
    whole = np.empty_like(x)
    _row_softmax(whole, x)
    small_blocks(monkeypatch, 100)   # 2 rows a block
    for n in (1, 2):
        threads(n)
        got = blockwise(_row_softmax, np.empty_like(x), x, row=37)
        assert np.array_equal(got, whole)
        np.testing.assert_allclose(got.sum(-1), 1, rtol=1e-6)


def test_out_may_alias_an_input(monkeypatch):
    small_blocks(monkeypatch, 128)
    x = np.arange(1000, dtype=np.float64)
    blockwise(lambda o, a: np.multiply(a, 2, out=o), x, x)
    np.testing.assert_array_equal(x, 2 * np.arange(1000))


def test_non_contiguous_and_small_arrays_run_whole():
    calls = []

    def fn(out, x):
        calls.append(out.shape)
        np.negative(x, out=out)
    x = np.ones((400, 400)).T                            # not C-contiguous
    assert np.array_equal(blockwise(fn, np.empty((400, 400)), x), -x)
    small = np.ones((5, 5))
    assert np.array_equal(blockwise(fn, np.empty((5, 5)), small), -small)
    assert calls == [(400, 400), (5, 5)]


def test_an_exception_in_a_helper_thread_is_raised(monkeypatch, threads):
    small_blocks(monkeypatch, 10)
    threads(2)

    def fn(out, x):
        if x[0] > 50:
            raise RuntimeError("bad block")
        out[...] = x
    with pytest.raises(RuntimeError, match="bad block"):
        blockwise(fn, np.empty(100), np.arange(100.0))


def test_bad_input(monkeypatch):
    with pytest.raises(ValueError, match=r"output's shape \(3,\), got \(4,\)"):
        blockwise(np.negative, np.empty(3), np.empty(4))
    with pytest.raises(ValueError, match="row=5 must be the size of the last axis"):
        blockwise(np.negative, np.empty((2, 3)), np.empty((2, 3)), row=5)
    with pytest.raises(ValueError, match="expected an int >= 1, got 0"):
        set_num_threads(0)
    with pytest.raises(TypeError, match="expected an int, got str 'two'"):
        set_num_threads("two")


def test_nested_calls_run_in_their_own_thread(monkeypatch, threads):
    """A block function that itself calls blockwise on a large array must not wait on the pool
    from a pool thread (with one helper that would deadlock)."""
    small_blocks(monkeypatch, 8)
    threads(2)
    inner = np.arange(64.0)

    def fn(out, x):
        out[...] = x + blockwise(lambda o, a: np.multiply(a, 2, out=o), np.empty_like(inner), inner).sum()
    got = blockwise(fn, np.empty(64), np.arange(64.0))
    np.testing.assert_array_equal(got, np.arange(64.0) + 2 * inner.sum())


def test_threads_only_for_arrays_of_two_thread_runs(monkeypatch, threads):
    """Below two threads' minimum run everything runs in the calling thread, in the small blocks;
    from there each thread takes one contiguous run, in the threads' larger blocks."""
    import threading
    monkeypatch.setattr(blocks, "BLOCK_ELEMENTS", 10)
    monkeypatch.setattr(blocks, "THREAD_BLOCK_ELEMENTS", 40)
    monkeypatch.setattr(blocks, "MIN_THREAD_ELEMENTS", 100)
    threads(2)
    seen = []

    def fn(out, x):
        seen.append((threading.current_thread() is threading.main_thread(), x.size))
        out[...] = x
        time.sleep(0.005)                                # the pool thread has woken before the caller is done
    blockwise(fn, np.empty(199), np.arange(199.0))       # < 2 runs of 100: 20 small blocks, here
    assert all(main for main, _ in seen) and [n for _, n in seen] == [10] * 19 + [9]
    seen.clear()
    blockwise(fn, np.empty(200), np.arange(200.0))       # 2 runs of 100, one on a pool thread
    assert sorted(seen) == [(False, 20), (False, 40), (False, 40), (True, 20), (True, 40), (True, 40)]


def test_block_elements_are_larger_when_threads_share_the_work(monkeypatch):
    assert blocks.block_elements(1) == blocks.BLOCK_ELEMENTS
    assert blocks.block_elements(2) == blocks.block_elements(3) == blocks.THREAD_BLOCK_ELEMENTS >= blocks.BLOCK_ELEMENTS
    monkeypatch.setattr(blocks, "THREAD_BLOCK_ELEMENTS", 8)              # never smaller than one thread's
    assert blocks.block_elements(2) == blocks.BLOCK_ELEMENTS


def test_zero_dimensional_arrays_are_computed_in_place():
    """ufuncs on 0-d arrays return scalars; blockwise hands fn 1-element views so out= still works."""
    from npformer.ops.activations import gelu_backward, gelu_forward
    x = np.asarray(0.7, dtype=np.float32)
    out = blockwise(lambda o, a: np.multiply(a, 2.0, out=o), np.empty_like(x), x)
    assert out.shape == () and out == np.float32(1.4)
    for form in ("none", "tanh"):
        y, cache = gelu_forward(np.asarray(1.5), approximate=form)
        ref, _ = gelu_forward(np.asarray([1.5]), approximate=form)
        assert y.shape == () and y == ref[0]
        assert gelu_backward(np.asarray(2.0), cache).shape == ()
