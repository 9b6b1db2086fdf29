"""The CPU fast paths' threads: one pool, BLAS kept to one thread while the pool works, and the
pool left alone while BLAS's own threads are awake.

NumPy's ufuncs and its BLAS calls release the GIL, so Python threads can run them on several cores
at once. Three things decide whether that pays on a small machine:

* one persistent pool (threads are started once, not per call), each worker handed its task
  through a pair of locks: a hand-off and its return cost 17 to 90 microseconds on the 2-core
  development machine (a VM: waking a sleeping thread is slow there), against 92 and more through
  ``concurrent.futures``;
* OpenBLAS held to one thread inside a parallel region, so that a matmul run by a pool thread uses
  that thread alone;
* OpenBLAS's own workers keep spinning for about 0.1 s (2^28 clock cycles) after every product
  they ran, on the very cores the pool wants: a pool thread sharing a core with one runs at half
  speed. Yet for small products BLAS's threads are the faster of the two: a 2048 x 128 x 128
  product (67 MFLOP) took 0.36-0.39 ms on BLAS's two threads against 0.45-0.49 ms cut in two for
  the pool. And mixing them (BLAS's threads for some products, the pool for the rest) made a
  gpt-small step 1.3-1.4x slower.

So a training step should use one or the other throughout. The linear layers choose by the layer
(:mod:`npformer.kernels.cpu.linear`: layers under 256 features on either side, a model with a
small d_model, give their products to BLAS's threads, wider ones cut theirs for the pool, by the
shapes alone, so a product is always computed the same way), and every fast path asks
:func:`threads_for` how many parts to cut its element-wise work into. It answers 1 inside a
parallel region, and 1 while BLAS's workers are awake: for :data:`BLAS_AWAKE_SECONDS` after a
product ran on BLAS's own threads (:func:`note_blas_product`).
A small model (the default ``npformer train``, d_model 128) thus runs its products on BLAS's threads
and its element-wise work on the calling thread; a large one (the benchmark's gpt-small) cuts
products and element-wise work alike for the pool, and BLAS's workers stay asleep.

    parts = threads_for(work, per_thread)     # how many parts (1 .. get_num_threads())
    run_parallel([f, g])        # f() on this thread, g() on a pool thread, BLAS at 1 thread; waits

:func:`set_num_threads` sets how many threads the fast paths use, and BLAS's with them (exported as
``npformer.set_num_threads``); the default is the number of CPUs this process may run on, or fewer
when BLAS was set to fewer threads before (an ``OMP_NUM_THREADS`` a user gave). With 1 every fast
path runs on the calling thread alone, with BLAS as the
caller set it. The element-wise fast paths compute each element the same way whichever part holds
it, so timing may choose their parts without changing a bit; a product's parts never depend on
timing (BLAS's own threads may add its terms in another order: tested).

BLAS threads are controlled through ``threadpoolctl`` (a dependency of npformer); where it cannot
find the BLAS library, regions still run in parallel and BLAS keeps its own setting. The fast paths
assume one thread of the program calls npformer at a time (as a training loop does); a second
caller that arrives while the pool is busy runs its tasks one after another on its own thread
(the same parts: the same results). After ``os.fork`` the child starts its own workers.
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any, Callable, Iterator, Sequence

from npformer.checks import positive_int

__all__ = ["get_num_threads", "set_num_threads", "usable_cpus", "within_cpus", "run_parallel", "split",
           "in_parallel_region", "threads_for", "note_blas_product", "blas_awake", "BLAS_AWAKE_SECONDS"]

BLAS_AWAKE_SECONDS = 0.15      # OpenBLAS's workers spin 2^28 cycles (about 0.1 s measured) after a product


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask; the machine's count where there is none)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):      # not Linux
        return max(1, os.cpu_count() or 1)


def within_cpus(n: int, name: str) -> tuple[int, str | None]:
    """``n`` threads asked for by ``name`` (``--threads``), at most :func:`usable_cpus`: more threads than
    CPUs only wait for each other (128 threads on 2 CPUs made a step 24x slower). Returns the count to
    use and a note saying it was lowered (None when ``n`` fits)."""
    cpus = usable_cpus()
    if positive_int(n, name) <= cpus:
        return n, None
    return cpus, f"{name} {n} is more than the {cpus} CPUs this process may use; using {cpus}"


_state: dict[str, Any] = {"threads": None, "workers": [], "blas": None, "blas_awake_until": 0.0}
_busy = threading.Lock()        # held by the thread whose tasks the workers run
_local = threading.local()      # .inside: this thread is running a part of a parallel region


def get_num_threads() -> int:
    """Threads the CPU fast paths use (the calling thread included). Until :func:`set_num_threads`
    says otherwise: the CPUs this process may run on, or BLAS's thread count when BLAS was told fewer
    (``OMP_NUM_THREADS=1``, ``threadpoolctl``: the setting a user gave the library the pool works beside)."""
    n = _state["threads"]
    if n is None:
        blas = [c.num_threads for c in _blas_controllers()]
        n = _state["threads"] = max(1, min(usable_cpus(), max(blas, default=usable_cpus())))
    return n


def set_num_threads(n: int, *, blas: bool = True) -> None:
    """Use ``n`` threads (the calling thread and ``n - 1`` pool threads) in the CPU fast paths, and
    set BLAS's own threads to ``n`` as well (``blas=False``: the pool alone), so the two hold one count:
    ``npformer.set_num_threads`` and ``npformer train --threads``."""
    _state["threads"] = positive_int(n, "number of threads")
    if blas:
        for c in _blas_controllers():
            c.set_num_threads(n)


def in_parallel_region() -> bool:
    """True on a thread that is running a part of :func:`run_parallel` (nested calls run inline)."""
    return getattr(_local, "inside", False)


def threads_for(work: int, per_thread: int) -> int:
    """How many parts to cut ``work`` into, each at least ``per_thread`` of it: at most the thread
    count, and 1 inside a parallel region or while BLAS's own workers are awake (:func:`blas_awake`)."""
    if getattr(_local, "inside", False) or time.monotonic() < _state["blas_awake_until"]:
        return 1                                        # in a region, or blas_awake() (inlined: a hot path)
    return max(1, min(_state["threads"] or get_num_threads(), work // max(per_thread, 1)))


def blas_awake() -> bool:
    """True for :data:`BLAS_AWAKE_SECONDS` after :func:`note_blas_product`: BLAS's workers are still
    spinning on the other cores, so work cut for the pool would share a core with one.

    Why a clock and not the shapes: what it stands for is the state of other threads (BLAS's workers
    spin after *any* multi-threaded product, the caller's own included), which no shape of the
    element-wise op at hand shows: the same (B, T, E) bias-add follows a wide layer's pooled product
    in one model and a narrow layer's BLAS-threaded one in another. The clock only chooses how many
    parts element-wise work is cut into, and each element is computed the same way in any part, so
    no result depends on it (tests/kernels/test_step_bits.py: a whole step's bits with the window
    held open, shut, left to the clock, and left to it on a loaded machine). BLAS_AWAKE_SECONDS is
    OpenBLAS's own spin time (2^28 cycles, about 0.1 s at 2-3 GHz), not a tuning of one machine."""
    return time.monotonic() < _state["blas_awake_until"]


def note_blas_product() -> None:
    """Record that a product just ran with BLAS's own threads (when BLAS has more than one)."""
    blas = _state["blas"]
    for c in _blas_controllers() if blas is None else blas:
        if c.num_threads > 1:
            _state["blas_awake_until"] = time.monotonic() + BLAS_AWAKE_SECONDS
            return


def _blas_controllers() -> list:
    """threadpoolctl's controllers of the BLAS libraries loaded (found once); [] without it."""
    if _state["blas"] is None:
        try:
            from threadpoolctl import ThreadpoolController
            found = [c for c in ThreadpoolController().lib_controllers if c.user_api == "blas"]
        except Exception:       # threadpoolctl absent or unable to inspect this process
            found = []
        _state["blas"] = found
    return _state["blas"]


class _Worker:
    """A pool thread that runs one task at a time: ``start(fn)`` hands it over (releasing ``go``,
    which the thread waits on), ``finish()`` waits for it (``done``) and returns its result or
    re-raises its exception."""

    def __init__(self) -> None:
        self.go, self.done = threading.Lock(), threading.Lock()
        self.go.acquire()
        self.done.acquire()
        self.task: Callable[[], Any] | None = None
        self.outcome: tuple = (None, None)
        threading.Thread(target=self._loop, name="npformer-cpu", daemon=True).start()

    def _loop(self) -> None:
        while True:
            self.go.acquire()
            task, self.task = self.task, None
            try:
                self.outcome = (_run_part(task), None)
            except BaseException as e:      # handed back to the caller by finish()
                self.outcome = (None, e)
            self.done.release()

    def start(self, task: Callable[[], Any]) -> None:
        self.task = task
        self.go.release()

    def finish(self) -> Any:
        self.done.acquire()
        (result, error), self.outcome = self.outcome, (None, None)
        if error is not None:
            raise error
        return result


def _workers(n: int) -> list:
    """``n`` pool threads (started on first use, kept for the life of the process)."""
    workers = _state["workers"]
    while len(workers) < n:
        workers.append(_Worker())
    return workers[:n]


def _forget_workers() -> None:
    """In a forked child: the parent's pool threads do not exist there."""
    global _busy
    _state["workers"], _busy = [], threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_workers)


def split(n: int, parts: int, multiple: int = 1) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges covering ``range(n)`` in at most ``parts`` near-equal runs, each
    boundary a multiple of ``multiple`` (empty runs dropped)."""
    if parts <= 1:
        return [(0, n)] if n > 0 else []
    units = -(-n // multiple)
    parts = max(1, min(parts, units))
    bounds = [min(n, (units * k // parts) * multiple) for k in range(parts + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def _run_part(fn: Callable[[], Any]) -> Any:
    outer, _local.inside = in_parallel_region(), True
    try:
        return fn()
    finally:
        _local.inside = outer


def run_parallel(tasks: Sequence[Callable[[], Any]], *, blas_one_thread: bool = False) -> list:
    """Run every task, the first on this thread and the others on the pool, with BLAS at one thread
    until all have finished; returns their results in order (an exception in any is re-raised).
    Inside a part the tasks run one after another on this thread; a single task runs on this
    thread as it is (BLAS as the caller set it), or with BLAS at one thread if ``blas_one_thread``:
    for work whose products must be computed the same way however many parts timing cut it into
    (BLAS's threads may add a product's terms in another order than one thread)."""
    if len(tasks) <= 1 and not blas_one_thread:          # the common case of a small op: no region
        return [tasks[0]()] if tasks else []
    if getattr(_local, "inside", False):                  # in_parallel_region()
        return [fn() for fn in tasks]
    if len(tasks) <= 1:
        with _blas_at_one_thread():
            return [fn() for fn in tasks]
    if not _busy.acquire(blocking=False):      # another thread's region is running (BLAS at one): inline
        return [_run_part(fn) for fn in tasks]
    try:
        with _blas_at_one_thread():
            started = []
            try:
                for worker, fn in zip(_workers(len(tasks) - 1), tasks[1:]):
                    worker.start(fn)
                    started.append(worker)
                results = [_run_part(tasks[0])]
            finally:
                outcomes = []
                for worker in started:           # every part finished before anything is raised
                    try:
                        outcomes.append((worker.finish(), None))
                    except BaseException as e:
                        outcomes.append((None, e))
            for result, error in outcomes:
                if error is not None:
                    raise error
                results.append(result)
            return results
    finally:
        _busy.release()


@contextlib.contextmanager
def _blas_at_one_thread() -> Iterator[None]:
    """BLAS held to one thread inside the block, its setting restored after."""
    blas = _blas_controllers()
    before = [c.num_threads for c in blas]
    try:
        for c in blas:
            c.set_num_threads(1)
        yield
    finally:
        for c, n in zip(blas, before):
            c.set_num_threads(n)
