"""The CPU fast paths' thread pool (npformer.kernels.cpu.threads): results in order, every part
finished before an exception is raised, BLAS restored, concurrent callers and forked children."""
import os
import threading
import time
import warnings

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from npformer.kernels.cpu import threads


def test_results_come_back_in_task_order_and_parts_run_on_other_threads(thread_count):
    thread_count(3)
    first = lambda: (time.sleep(0.2), (0, threading.current_thread().name))[1]   # the workers start meanwhile
    names = threads.run_parallel([first] + [lambda i=i: (i, threading.current_thread().name) for i in (1, 2)])
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


@pytest.mark.parametrize("in_context", [True, False], ids=["numpy>=2 context", "numpy<2 geterr"])
def test_parts_run_under_the_callers_floating_point_error_handling(monkeypatch, thread_count, in_context):
    """A caller's numpy.errstate holds for the parts the pool's threads run too, so a 0/0 raises,
    warns or stays silent as it would on one thread: carried in the caller's context (NumPy 2) or
    set from its numpy.geterr() (older NumPy's per-thread state; here both carry it)."""
    if in_context and not threads._ERRSTATE_IN_CONTEXT:
        pytest.skip("this NumPy keeps numpy.errstate per thread, not in a context variable")
    monkeypatch.setattr(threads, "_ERRSTATE_IN_CONTEXT", in_context)
    thread_count(3)
    late = lambda: (time.sleep(0.2), None)[1]          # the caller's part: the workers take theirs
    zero = lambda: (threading.current_thread().name, np.zeros(2) / np.zeros(2))
    with np.errstate(invalid="raise"):
        with pytest.raises(FloatingPointError):
            threads.run_parallel([late, zero, zero])
    with np.errstate(invalid="ignore"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            names = [r[0] for r in threads.run_parallel([late, zero, zero])[1:]]
    assert names == ["npformer-cpu", "npformer-cpu"]


def test_a_part_whose_worker_has_not_started_it_runs_on_the_callers_thread(thread_count):
    """A worker the scheduler set aside (here: still busy with an earlier part) is not waited for:
    the caller runs the part itself once its own is done, and the worker skips it later."""
    thread_count(2)
    worker = threads._workers(1)[0]
    held, release = threading.Event(), threading.Event()
    blocker = threads._Part(lambda: (held.set(), release.wait(10)))
    worker.parts.put(blocker)
    assert held.wait(10)                                            # the worker is inside the blocker
    ran = []
    try:
        got = threads.run_parallel([lambda: "own", lambda: ran.append(threading.current_thread().name) or "other"])
        assert got == ["own", "other"] and ran == [threading.current_thread().name]
    finally:
        release.set()
    blocker.done.acquire()                                           # the worker is free again
    assert threads.run_parallel([lambda: (time.sleep(0.2), 1)[1], lambda: threading.current_thread().name]) == \
        [1, "npformer-cpu"]                                          # and skipped the part the caller ran


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


def test_a_thread_preempted_often_keeps_element_wise_work_whole(monkeypatch, thread_count):
    """machine_busy() counts the calling thread's involuntary context switches over windows of
    BUSY_WINDOW_SECONDS and says busy above BUSY_PREEMPTIONS_PER_SECOND (threads_for then answers 1);
    where they are not counted, never busy. (The conftest's fixture holds it False elsewhere.)"""
    monkeypatch.undo()                                             # the real machine_busy
    thread_count(2)
    clock, counts = [0.0], [0]
    monkeypatch.setattr(threads.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(threads, "_preemptions", lambda: counts[0])
    monkeypatch.setattr(threads._local, "preemptions", None, raising=False)
    window, limit = threads.BUSY_WINDOW_SECONDS, threads.BUSY_PREEMPTIONS_PER_SECOND

    def after(seconds, preemptions):
        clock[0] += seconds
        counts[0] += preemptions
        return threads.machine_busy()
    assert not after(0.0, 0)                                       # the first window starts
    assert not after(window, int(limit * window) - 1)              # below the rate: quiet
    assert after(window, int(limit * window * 4))                  # above it: busy
    assert threads.threads_for(100, 1) == 1
    assert after(window / 2, 0)                                    # within a window: the state holds
    assert not after(window, 0) and threads.threads_for(100, 1) == 2
    monkeypatch.setattr(threads, "_preemptions", lambda: None)
    assert not after(window, 10 ** 6)
    if hasattr(threads.resource, "RUSAGE_THREAD"):                 # Linux: counted
        monkeypatch.undo()
        assert isinstance(threads._preemptions(), int)


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


class _RecordingNumpy:
    """numpy, with each matmul recording BLAS's thread count at the time (for linear's module)."""

    def __init__(self):
        self.blas_threads: list[list[int]] = []

    def __getattr__(self, name):
        return getattr(np, name)

    def matmul(self, *args, **kwargs):
        self.blas_threads.append([c.num_threads for c in threads._blas_controllers()])
        return np.matmul(*args, **kwargs)


@pytest.mark.parametrize("shape", [(300, 64, 96), (1001, 130, 67), (64, 512, 48), (700, 256, 256),
                                   (500, 128, 512)])
def test_a_products_parts_follow_its_shapes_and_blas_stays_at_one_thread(monkeypatch, thread_count,
                                                                         two_blas_threads, shape):
    """linear's products are cut by their FLOPs and the thread count alone (never by timing), every
    part a single-threaded BLAS call while the pool has two threads, a product too small to cut
    included (BLAS's own workers are never woken); with one thread, BLAS as the caller set it."""
    from npformer.kernels.cpu import linear
    n, c_in, c_out = shape
    rng = np.random.default_rng(n)
    x, w = rng.standard_normal((n, c_in), dtype=np.float32), rng.standard_normal((c_out, c_in), dtype=np.float32)
    b, dy = rng.standard_normal(c_out, dtype=np.float32), rng.standard_normal((n, c_out), dtype=np.float32)
    monkeypatch.setattr(linear, "MIN_PARALLEL_FLOPS", 1 << 20)
    recorder = _RecordingNumpy()
    monkeypatch.setattr(linear, "numpy", recorder)
    cut = []
    parts_of = linear._parts                                       # each product's number of parts
    monkeypatch.setattr(linear, "_parts", lambda flops: cut.append(parts_of(flops)) or cut[-1])
    results = {}
    for count in (1, 2):
        thread_count(count)
        recorder.blas_threads.clear()
        out, cache = linear.linear_forward(x, w, b)
        results[count] = (out, *linear.linear_backward(dy, cache))
        forward, backward = 2 * n * c_in * c_out, 4 * n * c_in * c_out
        assert cut[-2:] == [max(1, min(count, forward >> 20)), max(1, min(count, backward >> 20))]
        want = 1 if count == 2 else 2                              # two_blas_threads: the caller's setting
        assert recorder.blas_threads and all(t == [want] * len(t) for t in recorder.blas_threads)
    for got, want in zip(results[2], results[1]):                  # cut or whole: the reference's tolerance
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def _cpu_ticks_of_threads_python_did_not_start() -> int:
    """User + system clock ticks of this process's threads that are not Python threads (BLAS's)."""
    python_threads = {t.native_id for t in threading.enumerate()}
    ticks = 0
    for tid in os.listdir("/proc/self/task"):
        if int(tid) in python_threads:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()   # from field 3 (state): utime is 14, stime 15
        except OSError:                                       # the thread ended meanwhile
            continue
        ticks += int(fields[11]) + int(fields[12])
    return ticks


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux's /proc/self/task")
@pytest.mark.parametrize("compiled", [False, True], ids=["numpy-paths", "numba-paths"])
def test_a_training_step_never_wakes_blas_workers(thread_count, two_blas_threads, compiled):
    """A step of a small model (d_model 64, whose products BLAS would thread) at two threads: BLAS's
    workers, which spin for about 0.1 s each time they are woken, take no CPU time. The control
    first shows that a product on BLAS's own threads does make them take some."""
    import contextlib
    from npformer import kernels
    from npformer.kernels import numba_cpu
    from npformer.models.gpt import GPT, GPTConfig
    from npformer.nn.flat import flatten_parameters
    from npformer.ops.cross_entropy import cross_entropy_backward, cross_entropy_forward
    from npformer.training import AdamW, clip_grad_norm
    if compiled and not numba_cpu.AVAILABLE:
        pytest.skip("numba not installed: the compiled CPU paths are off")
    if threads.usable_cpus() < 2:
        pytest.skip("one CPU: BLAS has no second thread to wake")
    thread_count(2)
    a = np.ones((512, 512), np.float32)
    before = _cpu_ticks_of_threads_python_did_not_start()
    for _ in range(4):
        a @ a                                                      # BLAS at two threads: its workers wake
        time.sleep(0.05)
    woken = _cpu_ticks_of_threads_python_did_not_start() - before
    if woken < 3:
        pytest.skip(f"BLAS's workers took {woken} clock ticks after 4 threaded products: they do not spin here")
    time.sleep(0.5)                                                # let them fall asleep
    model = GPT(GPTConfig(vocab_size=96, block_size=64, n_layer=2, n_head=4, d_model=64, dropout=0.1),
                dtype="float32", backend="numpy", rng=0)
    flatten_parameters(model)
    opt = AdamW(model.named_parameters(), lr=1e-3)
    ids = np.random.default_rng(0).integers(0, 96, (16, 64))
    with kernels.disabled("numba") if not compiled else contextlib.nullcontext():
        before = _cpu_ticks_of_threads_python_did_not_start()
        for _ in range(5):
            model.zero_grad()
            loss, cache = cross_entropy_forward(model(ids), ids)
            model.backward(cross_entropy_backward(np.ones((), np.float32), cache))
            clip_grad_norm(model.parameters(), 1.0)
            opt.step()
        time.sleep(0.05)
        taken = _cpu_ticks_of_threads_python_did_not_start() - before
    assert taken <= 1, f"BLAS's workers took {taken} clock ticks in 5 steps (after products: {woken} in 4)"


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
