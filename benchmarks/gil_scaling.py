"""How much a second thread gains on a chain of cheap NumPy ufuncs, by the length of each call.

    python benchmarks/gil_scaling.py [--sizes 16384,65536,131072,262144,1048576] [--threads 2] [--elements 3e8]

Each thread runs ``y = x * x; y += 1; y *= x`` (float32, ``out=``: no allocation) over its own
array, again and again; the same total work runs first on one thread, then split over ``--threads``
threads. NumPy releases the GIL inside each ufunc and takes it back when the ufunc returns; a
thread that finds it held waits until the holder lets go and wakes it. Where waking a thread is
slow (a virtual machine), short calls spend their gain there: this measures where the element-wise
fast paths' blocks (``npformer.kernels.cpu.blocks``, 64K elements) stand.
"""
from __future__ import annotations

import argparse
import sys
import threading
import time

import numpy


def chain(x: numpy.ndarray, y: numpy.ndarray, repeats: int) -> None:
    for _ in range(repeats):
        numpy.multiply(x, x, out=y)
        numpy.add(y, 1.0, out=y)
        numpy.multiply(y, x, out=y)


def speed_up(size: int, threads: int, total: float = 3e8) -> tuple[float, float]:
    """(microseconds per ufunc call on one thread, speed-up of ``threads`` threads on the same work)."""
    repeats = max(1, int(total // size // 3))
    xs = [numpy.random.default_rng(i).standard_normal(size).astype(numpy.float32) for i in range(threads)]
    ys = [numpy.empty_like(x) for x in xs]
    chain(xs[0], ys[0], 2)                                   # warm
    start = time.perf_counter()
    for x, y in zip(xs, ys):
        chain(x, y, repeats)
    one = time.perf_counter() - start
    workers = [threading.Thread(target=chain, args=(x, y, repeats)) for x, y in zip(xs, ys)]
    start = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    many = time.perf_counter() - start
    return 1e6 * one / (3 * repeats * threads), one / many


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="16384,65536,131072,262144,1048576")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--elements", type=float, default=3e8, help="elements a ufunc chain covers, in all")
    args = parser.parse_args(argv)
    print(f"| float32 elements a call | us a call, one thread | speed-up on {args.threads} threads |")
    print("|---|---|---|")
    for size in (int(s) for s in args.sizes.split(",")):
        us, gain = speed_up(size, args.threads, args.elements)
        print(f"| {size:,} | {us:.1f} | {gain:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
