"""The CPU fast paths' threads: one pool, and BLAS kept to one thread while the pool works.

NumPy's ufuncs and its BLAS calls release the GIL, so Python threads can run them on several cores
at once. Two things make that pay on a small machine:

* one persistent pool (threads are started once, not per call);
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
assume one thread of the program calls npformer at a time (as a training loop does).
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from npformer.checks import positive_int

__all__ = ["get_num_threads", "set_num_threads", "run_parallel", "split", "in_parallel_region"]


def _cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):      # not Linux
        return max(1, os.cpu_count() or 1)


_state: dict[str, Any] = {"threads": _cpus(), "pool": None, "pool_size": 0, "blas": None}
_lock = threading.Lock()
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


def _pool(helpers: int) -> ThreadPoolExecutor:
    with _lock:
        if _state["pool_size"] < helpers:
            if _state["pool"] is not None:
                _state["pool"].shutdown(wait=False)
            _state["pool"] = ThreadPoolExecutor(max_workers=helpers, thread_name_prefix="npformer-cpu")
            _state["pool_size"] = helpers
        return _state["pool"]


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
    blas = _blas_controllers()
    before = [c.num_threads for c in blas]
    for c in blas:
        c.set_num_threads(1)
    futures = []
    try:
        futures = [_pool(len(tasks) - 1).submit(_run_part, fn) for fn in tasks[1:]]
        first = _run_part(tasks[0])
        return [first] + [f.result() for f in futures]
    finally:
        for f in futures:           # every part finished (an exception above left some running)
            f.exception()
        for c, n in zip(blas, before):
            c.set_num_threads(n)
