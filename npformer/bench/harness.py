"""Timing and memory measurement: the clock and the meters every case is read with.

* :func:`time_call`: warm-up (a number of calls *and* a minimum time), then the median of repeats
  with quartiles and min/max; ``sync`` runs after every call so that GPU work is inside the clock.
* :func:`host_peak_mb`: the most resident memory calls add, sampled from ``/proc``.
* :func:`settle`: a pause between libraries so that idle BLAS/OpenMP threads stop spinning.
* :func:`load_average`, :func:`busy_machine` and :func:`repeats_disagree`: what says a timing may
  lie, recorded beside every result (a busy machine stretches medians and rounds them to the
  scheduler's slices; a fast path then reads slower than its reference).

Host-side only: imports numpy and the standard library.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable

import numpy

__all__ = ["summarize", "time_call", "settle", "host_peak_mb", "fix_malloc_thresholds", "load_average",
           "busy_machine", "repeats_disagree", "SPREAD_LIMIT"]

# a timing's repeats disagree when their interquartile range is above this share of their median
# (a quiet 2-core machine: under 0.1 for the suite's cases; busy, up to several times the median)
SPREAD_LIMIT = 0.5


def summarize(times_s: list[float]) -> dict:
    """Median, quartiles, min and max of a list of durations (seconds), in milliseconds."""
    ms = numpy.asarray(times_s, dtype=numpy.float64) * 1e3
    q1, med, q3 = numpy.percentile(ms, [25, 50, 75])
    return {"ms": float(med), "q1_ms": float(q1), "q3_ms": float(q3), "min_ms": float(ms.min()),
            "max_ms": float(ms.max()), "repeats": int(ms.size)}


def time_call(fn: Callable[[], Any], sync: Callable[[], None], warmup: int, repeats: int,
              budget_s: float, warmup_s: float = 0.0, clock: Callable[[], float] = time.perf_counter) -> dict:
    """Warm up, then time ``repeats`` calls (fewer, but at least 3, when one call is slow).

    Warm-up is at least ``max(warmup, 1)`` calls and goes on until ``warmup_s`` seconds have passed:
    first calls pay for allocation, compilation and thread start-up, and right after another library
    ran, its worker threads may still be spinning on the cores (PyTorch's first calls on a 2-core
    machine took 8 ms for a 0.05 ms op for about 0.1 s). None of the warm-up calls is reported; the
    result says how many there were (``warmup``)."""
    start, n_warm, last = clock(), 0, 0.0
    while n_warm < max(warmup, 1) or clock() - start < warmup_s:
        t0 = clock()
        fn()
        sync()
        last = clock() - t0
        n_warm += 1
    n = max(3, min(repeats, int(budget_s / max(last, 1e-9))))
    times = []
    for _ in range(n):
        t0 = clock()
        fn()
        sync()
        times.append(clock() - t0)
    return {**summarize(times), "warmup": n_warm}


def load_average() -> float | None:
    """The machine's 1-minute load average (runnable processes, this one's threads included), or None
    where the system does not keep one."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def busy_machine(load: float | None, threads: int, cpus: int) -> str | None:
    """A warning when other work holds the cores a run of ``threads`` threads on ``cpus`` usable CPUs
    assumes free: the load measured before the run started (``load``) leaves fewer than ``threads``
    CPUs idle. None on a machine quiet enough, or where no load average is kept."""
    if load is None or load + threads <= cpus + 0.5:
        return None
    return (f"busy machine: load average {load:.1f} before the run, {cpus} usable CPUs, {threads} "
            f"thread{'s' if threads != 1 else ''} asked; other processes share the cores and stretch every timing (medians, and ratios "
            f"against PyTorch, may be off; rerun when quiet, or with --threads 1 under taskset -c N)")


def repeats_disagree(timing: dict) -> bool:
    """Whether a timing's repeats disagree beyond :data:`SPREAD_LIMIT` (interquartile range over the median)."""
    return timing["q3_ms"] - timing["q1_ms"] > SPREAD_LIMIT * timing["ms"]


def settle(seconds: float) -> None:
    """Let the other library's idle BLAS/OpenMP threads stop spinning before a timing starts
    (OpenBLAS and OpenMP workers busy-wait a while after each call and would steal the cores)."""
    time.sleep(seconds)


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"{field} not in /proc/self/status")


def _glibc():
    import ctypes
    return ctypes.CDLL("libc.so.6")


def fix_malloc_thresholds() -> bool:
    """Fix glibc's mmap and trim thresholds at 64 KiB, so that memory freed earlier is not still
    resident and hiding a later call's peak; False where glibc's ``mallopt`` is unavailable."""
    from npformer.backend.host_memory import set_malloc_thresholds
    return set_malloc_thresholds(1 << 16, 1 << 16)


def host_peak_mb(fn: Callable[[], Any], min_s: float = 0.2) -> float | None:
    """Peak resident memory calls of ``fn`` add (MB), or None where /proc cannot tell.

    A thread samples VmRSS while ``fn`` runs (again and again for ``min_s``, so that a short-lived
    peak is likely to be seen); the kernel's own high-water mark (VmHWM, reset first) is taken too
    where it is higher, since it is updated lazily and can miss peaks on its own."""
    try:
        _glibc().malloc_trim(0)                           # free heap pages leave RSS: reuse shows
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")                                  # resets VmHWM to the current RSS
        base = _status_kb("VmRSS")
    except OSError:
        return None
    peak, stop = [base], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _status_kb("VmRSS"))
            time.sleep(2e-4)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    try:
        fn()
        while time.perf_counter() - t0 < min_s:
            fn()
    finally:
        stop.set()
        sampler.join()
    return max(peak[0], _status_kb("VmHWM"), base) / 1024.0 - base / 1024.0
