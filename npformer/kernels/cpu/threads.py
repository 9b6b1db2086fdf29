"""The CPU fast paths' threads: one pool, and BLAS kept to one thread while the fast paths use it.

NumPy's ufuncs and its BLAS calls release the GIL, so Python threads can run them on several cores
at once. Four things decide whether that pays on a small machine:

* one persistent pool (threads are started once, not per call), each worker handed its part
  through a queue: a hand-off and its return cost 17 to 90 microseconds on the 2-core development
  machine (a VM: waking a sleeping thread is slow there), against 92 and more through
  ``concurrent.futures``; a part its worker has not started when the caller is done with its own
  is run by the caller, so a worker the scheduler has set aside is never waited for;
* every product the fast paths run is a single-threaded BLAS call (:mod:`npformer.kernels.cpu.linear`
  cuts a product into one part per thread by its shapes; a product too small to cut runs with BLAS
  held at one thread too), so BLAS's own workers are never woken;
* a worker that waits sleeps on its queue, where OpenBLAS's workers spin for about 0.1 s (2^28
  clock cycles) after each product they ran;
* while other programs take the calling thread's CPU from it (:func:`machine_busy`), element-wise
  work is not cut at all: a thread preempted while it holds the GIL stops the other.

The last three are what a busy machine decides. With a CPU hog on each of the 2 cores, nanoGPT's
CPU recipe (``gpt-tiny``, NumPy alone) stepped in 332 ms at 2 threads with its products on BLAS's
threads, against 171 ms at ``--threads 1``: a product's part waited for a spinning worker the
scheduler had set aside for the hog. Now it steps in 132 ms at 2 threads, against 161 at 1
(``python benchmarks/busy_machine.py --no-numba``, 2026-11-29). On a quiet machine BLAS's threads
were the faster for such small products (2-9% of that step), which is the price of a default that
never falls behind one thread.

    parts = threads_for(work, per_thread)     # how many parts (1 .. get_num_threads())
    run_parallel([f, g])        # f() on this thread, g() on a pool thread, BLAS at 1 thread; waits

:func:`set_num_threads` sets how many threads the fast paths use, and BLAS's with them (exported as
``npformer.set_num_threads``; BLAS's count then serves the products run outside the fast paths:
the reference ops, a user's own); the default is the number of CPUs this process may run on, or fewer
when BLAS was set to fewer threads before (an ``OMP_NUM_THREADS`` a user gave). With 1 every fast
path runs on the calling thread alone, with BLAS as the caller set it. The element-wise fast paths
compute each element the same way whichever part holds it, and a product's parts follow its shapes
and the thread count alone, so no result depends on timing (tests/kernels/test_step_bits.py: a whole
step's bits quiet and beside a CPU hog on every core).

BLAS threads are controlled through ``threadpoolctl`` (a dependency of npformer); where it cannot
find the BLAS library, regions still run in parallel and BLAS keeps its own setting. The fast paths
assume one thread of the program calls npformer at a time (as a training loop does); a second
caller that arrives while the pool is busy runs its tasks one after another on its own thread
(the same parts: the same results). After ``os.fork`` the child starts its own workers.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import queue
import threading
import time
from typing import Any, Callable, Iterator, Sequence

import numpy
from numpy.lib import NumpyVersion

from npformer.checks import positive_int

try:
    import resource
except ImportError:                                      # Windows
    resource = None

__all__ = ["get_num_threads", "set_num_threads", "usable_cpus", "within_cpus", "run_parallel", "split",
           "in_parallel_region", "threads_for", "machine_busy", "BUSY_PREEMPTIONS_PER_SECOND",
           "BUSY_WINDOW_SECONDS"]

BUSY_PREEMPTIONS_PER_SECOND = 15   # a quiet machine: about 3; a CPU hog beside each core: about 95
BUSY_WINDOW_SECONDS = 0.25         # how often the count is read (the state holds in between)
_ERRSTATE_IN_CONTEXT = NumpyVersion(numpy.__version__) >= "2.0.0"   # numpy.errstate in a context variable


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


_state: dict[str, Any] = {"threads": None, "workers": [], "blas": None, "switches": None}
_busy = threading.Lock()        # held by the thread whose tasks the workers run
_local = threading.local()      # .inside: running a part of a parallel region; .busy, .preemptions: machine_busy()


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
    count, and 1 inside a parallel region or while :func:`machine_busy`."""
    if in_parallel_region() or machine_busy():
        return 1
    return max(1, min(get_num_threads(), work // max(per_thread, 1)))


def machine_busy() -> bool:
    """True while other threads are taking this thread's CPU from it: the scheduler preempted the
    calling thread more than :data:`BUSY_PREEMPTIONS_PER_SECOND` times a second over the last
    :data:`BUSY_WINDOW_SECONDS` (its involuntary context switches, ``getrusage(RUSAGE_THREAD)``;
    False where there is no such count). Measured on the 2-core development VM, a thread running
    NumPy work was preempted 3 times a second on the quiet machine, 29 beside one CPU hog and 95
    beside one on each core.

    The element-wise fast paths then keep their work whole on the calling thread. Their parts are
    chains of short NumPy calls, each of which takes the GIL back when it returns, and a thread
    preempted while holding it stops the other: with a CPU hog on each of the 2 cores, gpt-tiny
    (NumPy alone, 2 threads) stepped in 204 ms with its element-wise work cut and 127 ms with it
    whole (one thread: 189); quiet, cut was 6% faster (98 against 104 ms). Only the number of parts
    follows this, and each element is computed the same way in any part, so no result does
    (tests/kernels/test_step_bits.py). (The load average, the first signal tried, did not move on
    that VM with a hog on every core for 40 s.)"""
    now = time.monotonic()
    last = getattr(_local, "preemptions", None)           # (time, count) at the window's start
    if last is not None and now - last[0] < BUSY_WINDOW_SECONDS:
        return _local.busy
    count = _preemptions()
    if count is None:
        _local.preemptions, _local.busy = (now, 0), False
        return False
    if last is not None:
        _local.busy = (count - last[1]) / (now - last[0]) > BUSY_PREEMPTIONS_PER_SECOND
    else:
        _local.busy = False
    _local.preemptions = (now, count)
    return _local.busy


def _preemptions() -> int | None:
    """The calling thread's involuntary context switches so far, or None where they are not counted."""
    try:
        return resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw
    except (AttributeError, OSError):                    # not Linux (no resource, or no RUSAGE_THREAD)
        return None


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


def _blas_switches() -> list[tuple[Callable[[], int], Callable[[int], Any]]]:
    """(get, set) of each BLAS library's thread count, found once: OpenBLAS's own C functions where
    threadpoolctl can name them, its methods otherwise. The functions are what threadpoolctl calls
    for an OpenBLAS on its own threads, without its lookup of the symbol on every call (on the
    development VM a region's read, lower and restore took 20 us through threadpoolctl and 5 us
    direct; a gpt-tiny step on 2 threads makes about 40 regions)."""
    if _state["switches"] is None:
        switches = []
        for c in _blas_controllers():
            get = put = None
            if c.internal_api == "openblas" and getattr(c, "threading_layer", None) == "pthreads":
                try:                         # threadpoolctl's symbol lookup (its naming of every OpenBLAS build)
                    get, put = c._get_symbol("openblas_get_num_threads"), c._get_symbol("openblas_set_num_threads")
                except Exception:
                    get = put = None
            if get is None or put is None:
                get, put = (lambda c=c: c.num_threads), c.set_num_threads
            switches.append((get, put))
        _state["switches"] = switches
    return _state["switches"]


class _Part:
    """One task of a region: whichever thread claims it first (a pool thread, or the caller once its
    own part is done) runs it; ``done`` is released when a pool thread that claimed it has finished.
    It runs in a copy of the caller's context (:func:`contextvars.copy_context`), where NumPy from
    2.0 on keeps its floating-point error handling; under an older NumPy, which keeps it per thread,
    with the caller's ``numpy.geterr()`` set on the thread that runs it. Either way a caller's
    ``numpy.errstate`` holds for the parts a pool thread runs too. (``numpy.geterr`` costs several
    microseconds a call, the context's copy a fraction of one.)"""

    __slots__ = ("fn", "context", "errors", "claim", "done", "outcome")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn, self.context = fn, contextvars.copy_context()
        self.errors = None if _ERRSTATE_IN_CONTEXT else numpy.geterr()
        self.claim, self.done = threading.Lock(), threading.Lock()
        self.done.acquire()
        self.outcome: tuple = (None, None)

    def run(self) -> None:
        try:
            if self.errors is not None and numpy.geterr() != self.errors:
                numpy.seterr(**self.errors)      # (a pool thread's: it runs npformer's parts alone)
            self.outcome = (self.context.run(_run_part, self.fn), None)
        except BaseException as e:          # handed back to the caller by run_parallel
            self.outcome = (None, e)


class _Worker:
    """A pool thread: it takes parts from its queue, runs those it claims, and skips those the
    caller claimed first (a part it reached too late: the scheduler had set it aside)."""

    def __init__(self) -> None:
        self.parts: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="npformer-cpu", daemon=True).start()

    def _loop(self) -> None:
        while True:
            part = self.parts.get()
            if part.claim.acquire(blocking=False):
                part.run()
                part.done.release()


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
    """Run every task once, the first on this thread and the others on the pool, with BLAS at one
    thread until all have finished; returns their results in order (an exception in any is re-raised
    after all have run). A task whose pool thread has not started it when this thread is done with
    its own runs here instead: a busy machine's scheduler may have set that thread aside, and waiting
    for it would make the region slower than one thread. Inside a part the tasks run one after
    another on this thread; a single task runs on this thread as it is (BLAS as the caller set it),
    or with BLAS at one thread if ``blas_one_thread``: for work whose products must be computed the
    same way however many parts it is cut into (BLAS's threads may add a product's terms in another
    order than one thread)."""
    if len(tasks) <= 1 and not blas_one_thread:          # the common case of a small op: no region
        return [tasks[0]()] if tasks else []
    if in_parallel_region():
        return [fn() for fn in tasks]
    if len(tasks) <= 1:
        with _blas_at_one_thread():
            return [fn() for fn in tasks]
    if not _busy.acquire(blocking=False):      # another thread's region is running (BLAS at one): inline
        return [_run_part(fn) for fn in tasks]
    try:
        with _blas_at_one_thread():
            parts = [_Part(fn) for fn in tasks[1:]]
            for worker, part in zip(_workers(len(parts)), parts):
                worker.parts.put(part)
            try:
                results = [_run_part(tasks[0])]
            finally:                             # every part finished before anything is raised
                for part in parts:
                    if part.claim.acquire(blocking=False):
                        part.run()               # its worker has not started it: run it here
                    else:
                        part.done.acquire()      # its worker is running it
            for part in parts:
                result, error = part.outcome
                if error is not None:
                    raise error
                results.append(result)
            return results
    finally:
        _busy.release()


@contextlib.contextmanager
def _blas_at_one_thread() -> Iterator[None]:
    """BLAS held to one thread inside the block, its setting restored after."""
    switches = _blas_switches()
    before = [get() for get, _ in switches]
    try:
        for (_, put), n in zip(switches, before):
            if n != 1:
                put(1)
        yield
    finally:
        for (_, put), n in zip(switches, before):
            if n != 1:
                put(n)
