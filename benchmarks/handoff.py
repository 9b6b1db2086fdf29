"""What a second thread costs and gains on a small model's work: the CPU pool's hand-off, and a
matrix product of gpt-tiny's shapes cut in two on the pool against BLAS's own threads.

    python benchmarks/handoff.py [--rounds 40] [--idle-ms 1]

Three measurements, each the median (and the quartiles) over ``--rounds``, on two threads:

* the region: ``run_parallel`` of two tasks that do nothing, back to back, and after the pool's
  thread has slept ``--idle-ms`` (as between two ops of a step): when each task starts after the
  call, and when the call returns;
* one product of each of gpt-tiny's linear layers (768 rows; 128 -> 384, 128 -> 128, 128 -> 512,
  512 -> 128), forward (``x @ W^T``): whole on one thread (BLAS at one), cut by rows into two
  single-threaded BLAS calls on the pool (what ``npformer.kernels.cpu.linear`` does), and whole on
  BLAS's own two threads (OpenBLAS's workers, which spin between calls);
* for the pool's cut, how long each half takes on its thread, and when the pool thread's starts.

The first two ways are alternated in one process, for every shape; then all three again, BLAS's own
threads after the others (its workers keep spinning for a while after each call, and would take the
second core from the pool's thread), with a pause after them before the next shape: without it, the
next shape's cut on the pool met those workers and ran slower than one thread (the Intel VM,
2026-12-02: 553-843 us against 405-497 in the first pass).
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

import numpy
from threadpoolctl import threadpool_limits

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import npformer                                                       # noqa: E402
from npformer.kernels.cpu import threads                              # noqa: E402

BLAS_SPIN_SECONDS = 0.3   # OpenBLAS's workers spin for about 0.1 s after a call before they sleep
SHAPES = ((768, 128, 384), (768, 128, 128), (768, 128, 512), (768, 512, 128))   # (rows, in, out)


def _spread(values: list[float]) -> str:
    q = statistics.quantiles(values, n=4)
    return f"{statistics.median(values):7.0f} us [{q[0]:.0f}, {q[2]:.0f}]"


def _mark(starts: dict, name: str) -> None:
    starts[name] = time.perf_counter()


def region(rounds: int, idle_s: float) -> dict:
    """Start of the caller's task, of the pool's, and the return, in us after the call."""
    times: dict[str, list[float]] = {"caller's task starts": [], "pool's task starts": [], "call returns": []}
    for _ in range(rounds):
        if idle_s:
            time.sleep(idle_s)
        starts: dict[str, float] = {}
        t0 = time.perf_counter()
        threads.run_parallel([functools.partial(_mark, starts, "caller's task starts"),
                              functools.partial(_mark, starts, "pool's task starts")])
        end = time.perf_counter()
        for name, t in starts.items():
            times[name].append(1e6 * (t - t0))
        times["call returns"].append(1e6 * (end - t0))
    return times


def product(rounds: int, n: int, c_in: int, c_out: int, blas_threads: bool) -> dict:
    """The product x @ W^T: whole on one thread and cut in two on the pool, alternated; with
    ``blas_threads``, then whole on BLAS's own two threads."""
    rng = numpy.random.default_rng(0)
    x = rng.standard_normal((n, c_in), dtype=numpy.float32)
    w = rng.standard_normal((c_out, c_in), dtype=numpy.float32)
    out = numpy.empty((n, c_out), numpy.float32)
    halves = ((0, n // 2), (n // 2, n))
    spans: dict[str, list[float]] = {"whole, 1 thread": [], "cut in two on the pool": [],
                                     "  the caller's half": [], "  the pool's half": [],
                                     "  the pool's half starts": []}

    def whole() -> None:
        numpy.matmul(x, w.T, out=out)

    def timed(fn) -> float:
        """us of the second of two calls (the first warms the caches)."""
        fn()
        t = time.perf_counter()
        fn()
        return 1e6 * (time.perf_counter() - t)

    spent: list[tuple[float, float]] = [(0.0, 0.0), (0.0, 0.0)]     # (start, end) of each half, last call
    called = [0.0]                                                   # when the last cut was called

    def half(i: int) -> None:
        start = time.perf_counter()
        numpy.matmul(x[slice(*halves[i])], w.T, out=out[slice(*halves[i])])
        spent[i] = (start, time.perf_counter())

    def cut() -> None:
        called[0] = time.perf_counter()
        threads.run_parallel([lambda: half(0), lambda: half(1)], blas_one_thread=True)

    with threadpool_limits(1, user_api="blas"):
        for _ in range(rounds):
            spans["whole, 1 thread"].append(timed(whole))
            spans["cut in two on the pool"].append(timed(cut))
            (a0, a1), (b0, b1) = spent
            spans["  the caller's half"].append(1e6 * (a1 - a0))
            spans["  the pool's half"].append(1e6 * (b1 - b0))
            spans["  the pool's half starts"].append(1e6 * (b0 - called[0]))
    if blas_threads:
        with threadpool_limits(2, user_api="blas"):
            spans["whole, BLAS's 2 threads"] = [timed(whole) for _ in range(rounds)]
        time.sleep(BLAS_SPIN_SECONDS)        # the next shape's pool cut must not meet BLAS's spinning workers
    return spans


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/handoff.py", description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--idle-ms", type=float, default=1.0, help="the pool thread's sleep before each idle region")
    args = ap.parse_args(argv)
    if args.rounds < 4:
        ap.error(f"--rounds: expected at least 4 (for the quartiles), got {args.rounds}")
    npformer.set_num_threads(2)
    if npformer.get_num_threads() < 2:
        print("one CPU available: no second thread to measure")
        return 0
    print(f"{os.cpu_count()} CPUs; medians [quartiles] of {args.rounds} rounds")
    for idle in (0.0, args.idle_ms / 1e3):
        print(f"run_parallel of two empty tasks, {'back to back' if not idle else f'after {args.idle_ms:g} ms idle'}:")
        for name, values in region(args.rounds, idle).items():
            print(f"  {name:28s} {_spread(values)}")
    for blas_threads in (False, True):      # BLAS's spinning workers last: they would slow the pool's thread
        if blas_threads:
            print("the same products, now also on BLAS's own 2 threads (measured last):")
        for n, c_in, c_out in SHAPES:
            print(f"x ({n}, {c_in}) @ W^T ({c_in}, {c_out}), {2 * n * c_in * c_out / 1e6:.0f} MFLOP:")
            for name, values in product(args.rounds, n, c_in, c_out, blas_threads).items():
                print(f"  {name:28s} {_spread(values)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
