"""The CPU fast paths' threads: one pool, and BLAS kept to one thread while the pool works.

NumPy's ufuncs and its BLAS calls release the GIL, so Python threads can run them on several cores
at once. Two things make that pay on a small machine:

* one persistent pool (threads are started once, not per call), each worker handed its task
  through a pair of locks: a hand-off and its return cost about 18 microseconds on the 2-core
  development machine, against 92 through ``concurrent.futures`` (its futures, queue and
  conditions), and a training step makes a hundred or more of them;
* OpenBLAS held to one thread inside a parallel region. OpenBLAS's own workers otherwise keep
  spinning for a while after each matrix product, on the very cores the pool wants; and a matmul
  run by a pool thread should use that thread alone.

    run_parallel([f, g])        # f() on this thread, g() on a pool thread, BLAS at 1 thread; waits

:func:`set_num_threads` sets how many threads the fast paths use; the default is the number of CPUs
this process may run on. With 1 every fast path runs on the calling thread alone, with BLAS as the
caller set it. The split of work into parts depends only on that number and the shapes, never on
timing, so results are the same from run to run at a fixed thread count (tested).

BLAS threads are controlled through ``threadpoolctl`` (a dependency of npformer); where it cannot
find the BLAS library, regions still run in parallel and BLAS keeps its own setting. The fast paths
assume one thread of the program calls npformer at a time (as a training loop does); a second
caller that arrives while the pool is busy runs its tasks one after another on its own thread
(the same parts: the same results). After ``os.fork`` the child starts its own workers.
"""
from __future__ import annotations

import os
import threading
from typing import Any, Callable, Sequence

from npformer.checks import positive_int

__all__ = ["get_num_threads", "set_num_threads", "run_parallel", "split", "in_parallel_region"]


def _cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):      # not Linux
        return max(1, os.cpu_count() or 1)


_state: dict[str, Any] = {"threads": _cpus(), "workers": [], "blas": None}
_busy = threading.Lock()        # held by the thread whose tasks the workers run
_local = threading.local()      # .inside: this thread is running a part of a parallel region


def get_num_threads() -> int:
    """Threads the CPU fast paths use (the calling thread included)."""
    return _state["threads"]


def set_num_threads(n: int) -> None:
    """Use ``n`` threads (the calling thread and ``n - 1`` pool threads) in the CPU fast paths."""
    _state["threads"] = positive_int(n, "number of threads")


def in_parallel_region() -> bool:
    """True on a thread that is running a part of :func:`run_parallel` (nested calls run inline)."""
    return getattr(_local, "inside", False)


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


def run_parallel(tasks: Sequence[Callable[[], Any]]) -> list:
    """Run every task, the first on this thread and the others on the pool, with BLAS at one thread
    until all have finished; returns their results in order (an exception in any is re-raised).
    Inside a part the tasks run one after another on this thread. A single task runs on this
    thread with BLAS at one thread too (work too small to split: a product handed to BLAS's own
    threads there runs slower, and leaves them spinning on the other cores), unless the thread
    count is 1, where BLAS keeps the caller's setting."""
    if not tasks or in_parallel_region() or (len(tasks) == 1 and get_num_threads() == 1):
        return [fn() for fn in tasks]
    if not _busy.acquire(blocking=False):      # another thread's region is running: this one inline
        return [_run_part(fn) for fn in tasks]
    blas = _blas_controllers()
    before = [c.num_threads for c in blas]
    try:
        for c in blas:
            c.set_num_threads(1)
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
        for c, n in zip(blas, before):
            c.set_num_threads(n)
        _busy.release()
