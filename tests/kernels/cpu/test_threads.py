"""The CPU fast paths' thread pool (npformer.kernels.cpu.threads): results in order, every part
finished before an exception is raised, BLAS restored, concurrent callers and forked children."""
import os
import threading
import time

import numpy as np
import pytest

from npformer.kernels.cpu import threads


@pytest.fixture
def thread_count():
    before = threads.get_num_threads()
    yield threads.set_num_threads
    threads.set_num_threads(before)


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
