"""The CPU fast paths' thread pool (npformer.kernels.cpu.threads): results in order, every part
finished before an exception is raised, BLAS restored, concurrent callers and forked children."""
import os
import threading
import time

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from npformer.kernels.cpu import threads


@pytest.fixture
def thread_count():
    before = threads.get_num_threads()
    yield lambda n: threads.set_num_threads(n, blas=False)    # the pool alone
    threads.set_num_threads(before, blas=False)


def test_results_come_back_in_task_order_and_parts_run_on_other_threads(thread_count):
    thread_count(3)
    names = threads.run_parallel([lambda i=i: (i, threading.current_thread().name) for i in range(3)])
    assert [i for i, _ in names] == [0, 1, 2]
    assert names[0][1] == threading.current_thread().name
    assert {n for _, n in names[1:]} == {"npformer-cpu"}
    assert len({id(w) for w in threads._workers(2)}) == 2


def test_an_exception_is_raised_after_every_part_has_finished(thread_count):
    thread_count(3)
    finished = []

    def slow():
        time.sleep(0.05)
        finished.append("slow")

    def fails():
        raise ValueError("part failed")
    with pytest.raises(ValueError, match="part failed"):
        threads.run_parallel([fails, slow, slow])
    assert finished == ["slow", "slow"]
    assert threads.run_parallel([lambda: 1, lambda: 2, lambda: 3]) == [1, 2, 3]   # the pool still works


def test_blas_threads_are_one_inside_a_region_and_restored_after(thread_count):
    blas = threads._blas_controllers()
    if not blas:
        pytest.skip("threadpoolctl finds no BLAS library in this process")
    thread_count(2)
    before = [c.num_threads for c in blas]
    seen = threads.run_parallel([lambda: [c.num_threads for c in blas]] * 2)
    assert seen == [[1] * len(blas)] * 2
    assert [c.num_threads for c in blas] == before


def test_concurrent_callers_get_their_own_results(thread_count):
    """A second thread calling while the pool is busy runs its parts itself: the same results."""
    thread_count(2)
    out = {}

    def caller(k):
        for j in range(50):
            got = threads.run_parallel([lambda: (k, j, 0), lambda: (time.sleep(1e-4), (k, j, 1))[1]])
            assert got == [(k, j, 0), (k, j, 1)]
        out[k] = True
    callers = [threading.Thread(target=caller, args=(k,)) for k in range(3)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    assert out == {0: True, 1: True, 2: True}


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork on this platform")
def test_a_forked_child_starts_its_own_workers(thread_count):
    thread_count(2)
    assert threads.run_parallel([lambda: 1, lambda: 2]) == [1, 2]        # the parent's workers exist
    pid = os.fork()
    if pid == 0:                                      # the child: exit 0 only if the region runs
        code = 1
        try:
            code = 0 if threads.run_parallel([lambda: np.ones(3).sum(), lambda: 2.0]) == [3.0, 2.0] else 1
        finally:
            os._exit(code)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.01)
    os.kill(pid, 9)
    pytest.fail("run_parallel hung in a forked child")


def test_threads_for_cuts_by_work_and_thread_count_and_not_inside_a_region(thread_count):
    thread_count(3)
    assert threads.threads_for(10, 4) == 2
    assert threads.threads_for(100, 4) == 3
    assert threads.threads_for(3, 4) == 1 and threads.threads_for(0, 4) == 1
    assert threads.run_parallel([lambda: threads.threads_for(100, 1)] * 2) == [1, 1]
    thread_count(1)
    assert threads.threads_for(100, 1) == 1


@pytest.fixture
def two_blas_threads():
    """BLAS at two threads (restored after); skipped where threadpoolctl finds no BLAS."""
    if not threads._blas_controllers():
        pytest.skip("threadpoolctl finds no BLAS library in this process")
    with threadpool_limits(2, user_api="blas"):
        yield


def test_the_pool_waits_while_blas_threads_are_awake(monkeypatch, thread_count, two_blas_threads):
    """After a product on BLAS's own threads, work is not cut for the pool until BLAS_AWAKE_SECONDS
    have passed (BLAS's workers spin meanwhile); with BLAS at one thread nothing is noted."""
    thread_count(2)
    monkeypatch.setattr(threads, "BLAS_AWAKE_SECONDS", 60.0)
    assert not threads.blas_awake() and threads.threads_for(100, 1) == 2
    threads.note_blas_product()
    assert threads.blas_awake() and threads.threads_for(100, 1) == 1
    monkeypatch.setitem(threads._state, "blas_awake_until", 0.0)
    with threadpool_limits(1, user_api="blas"):
        threads.note_blas_product()
    assert not threads.blas_awake()


def test_a_small_linear_layer_runs_on_blas_threads_and_keeps_element_wise_work_on_this_thread(
        monkeypatch, thread_count, two_blas_threads):
    from npformer.kernels.cpu import blocks, linear
    thread_count(2)
    monkeypatch.setattr(threads, "BLAS_AWAKE_SECONDS", 60.0)
    cut = []
    monkeypatch.setattr(blocks, "run_parallel", lambda tasks: cut.append(len(tasks)) or [f() for f in tasks])
    x = np.ones((4 * blocks.MIN_THREAD_ELEMENTS,), np.float32)
    blocks.blockwise(lambda o, a: np.add(a, 1, out=o), np.empty_like(x), x)
    assert cut == [2]                                              # BLAS asleep: cut for the pool
    linear.linear_forward(np.ones((64, 32), np.float32), np.ones((16, 32), np.float32))   # one part
    assert threads.blas_awake()
    blocks.blockwise(lambda o, a: np.add(a, 1, out=o), np.empty_like(x), x)
    assert cut == [2]                                              # awake: on this thread, uncut


@pytest.mark.parametrize("shape", [(300, 64, 96), (1001, 130, 67), (64, 512, 48), (700, 256, 256),
                                   (500, 128, 512)])    # 65,536 entries, a 128-wide side: narrow
def test_a_products_parts_depend_on_its_shapes_not_on_timing(monkeypatch, thread_count, two_blas_threads, shape):
    """BLAS's own threads may add a product's terms in another order than one thread (OpenBLAS cuts K
    for some shapes), so linear's parts must not follow blas_awake(): its forward and backward are
    the same bits whether BLAS's workers were just woken or not, at 1 and 2 threads; narrow layers
    (a side under MIN_PARALLEL_WIDTH features) run as one part, on BLAS's threads, and say so."""
    from npformer.kernels.cpu import linear
    n, c_in, c_out = shape
    rng = np.random.default_rng(n)
    x, w = rng.standard_normal((n, c_in), dtype=np.float32), rng.standard_normal((c_out, c_in), dtype=np.float32)
    b, dy = rng.standard_normal(c_out, dtype=np.float32), rng.standard_normal((n, c_out), dtype=np.float32)
    monkeypatch.setattr(linear, "MIN_PARALLEL_FLOPS", 1 << 20)
    cut = []
    parts_of = linear._parts                                       # each product's number of parts
    monkeypatch.setattr(linear, "_parts", lambda *args: cut.append(parts_of(*args)) or cut[-1])

    def run():
        out, cache = linear.linear_forward(x, w, b)
        return (out, *linear.linear_backward(dy, cache))
    for count in (1, 2):
        thread_count(count)
        monkeypatch.setattr(threads, "BLAS_AWAKE_SECONDS", 60.0)
        monkeypatch.setitem(threads._state, "blas_awake_until", 0.0)
        asleep = run()
        narrow = min(c_in, c_out) < linear.MIN_PARALLEL_WIDTH
        assert threads.blas_awake() == (narrow or count == 1)        # one part: BLAS's own threads
        assert cut[-2:] == [1, 1] if narrow or count == 1 else cut[-2:] == [2, 2]
        threads.note_blas_product()
        for got, want in zip(run(), asleep):
            np.testing.assert_array_equal(got, want)
        assert cut[-2:] == cut[-4:-2]


def test_set_num_threads_holds_blas_and_the_pool_together():
    """npformer.set_num_threads(n) sets the pool's count and BLAS's; the default follows a BLAS that
    was told fewer threads before npformer ran (OMP_NUM_THREADS=1: the setting a user gave)."""
    import subprocess
    import sys
    import npformer
    blas = threads._blas_controllers()
    before = (threads.get_num_threads(), [c.num_threads for c in blas])
    try:
        npformer.set_num_threads(1)
        assert threads.get_num_threads() == 1 and all(c.num_threads == 1 for c in blas)
        threads.set_num_threads(2, blas=False)                     # the pool alone
        assert threads.get_num_threads() == 2 and all(c.num_threads == 1 for c in blas)
    finally:
        threads.set_num_threads(before[0], blas=False)
        for c, n in zip(blas, before[1]):
            c.set_num_threads(n)
    if not blas:
        pytest.skip("threadpoolctl found no BLAS library to read the default from")
    code = "import npformer; print(npformer.get_num_threads())"
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"})
    assert got.stdout.strip() == "1"


def test_a_configs_threads_apply_when_its_trainer_is_made():
    from npformer.training.config import make_config
    from npformer.training.registry import make_trainer
    blas = threads._blas_controllers()
    before = (threads.get_num_threads(), [c.num_threads for c in blas])
    try:
        make_trainer(make_config({"task": "copy", "d_model": 8, "heads": 2, "layers": 1, "ff": 8, "steps": 2,
                                  "n_train": 20, "n_valid": 4, "batch_size": 4, "threads": 1}), log=lambda _: None)
        assert threads.get_num_threads() == 1 and all(c.num_threads == 1 for c in blas)
    finally:
        threads.set_num_threads(before[0], blas=False)
        for c, n in zip(blas, before[1]):
            c.set_num_threads(n)
