"""Element-wise work on NumPy arrays in cache-sized blocks, optionally spread over threads.

A chain of NumPy ufuncs over a large array (a GELU, a softmax) makes every step a full pass over
memory and every intermediate a fresh multi-MB array; on Linux each fresh array is paid for again
in page faults. :func:`blockwise` runs the same chain on slices of about 64K elements instead, so the
intermediates are small and stay in cache.

    blockwise(fn, out, x, y)      # fn(out_part, x_part, y_part) for matching slices of the arrays

``fn`` must compute each output element from the same elements of the inputs (or, with ``row=C``,
from the same rows of C values: softmax), so the parts are independent and the result is bit for
bit the same whatever the block size and number of threads (tested). On CuPy, for small arrays, and
for arrays that are not C-contiguous, ``fn`` runs once on the whole arrays.

Threads: arrays of at least :data:`MIN_THREAD_ELEMENTS` per thread are cut into one contiguous run
of blocks per thread (:mod:`npformer.kernels.cpu.threads`: its pool and thread count, BLAS at one
thread meanwhile). NumPy ufuncs release the GIL, so the runs go on side by side, but each ufunc
takes it back when it returns, and a thread that finds it held sleeps until it is handed over:
on the 2-core development VM, two threads each running a chain of three float32 ufuncs over their
own arrays went 1.0-1.4x faster than one at 64K-128K elements a call (10-15 us), 1.2-1.55x at
256K and 1.6-1.8x at 1M, in two runs (``python benchmarks/gil_scaling.py``). So a run cut between
threads goes in blocks of :data:`THREAD_BLOCK_ELEMENTS` (256K), four times fewer calls and
hand-overs than cache-sized blocks, at the price of intermediates in L3 rather than L2; one thread
alone keeps :data:`BLOCK_ELEMENTS` (:func:`block_elements`). Measured on that VM (2026-11-30, float32,
``python benchmarks/thread_blocks.py``, 64K against 256K, medians of 10 alternated rounds): on two
threads GELU's 768 x 512 forward 1.71 -> 1.12 ms and its 1024 x 2048 forward 8.4 -> 6.0 ms, AdamW
over gpt-tiny's 0.8M parameters 2.36 -> 1.69 ms (128K and 512K between or level); on one thread
256K was no faster (that GELU forward 1.75 against 1.86 ms, its backward 0.93 against 1.20). The
compiled paths (:mod:`npformer.kernels.numba_cpu`) hold no GIL inside a kernel.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy

from npformer.errors import ShapeError
from npformer.kernels.cpu.threads import run_parallel, split, threads_for

__all__ = ["blockwise", "block_elements", "BLOCK_ELEMENTS", "THREAD_BLOCK_ELEMENTS", "MIN_THREAD_ELEMENTS"]

BLOCK_ELEMENTS = 1 << 16          # 256 KB of float32 per intermediate: several fit in L2
THREAD_BLOCK_ELEMENTS = 1 << 18   # a block of a run cut between threads: fewer GIL hand-overs
MIN_THREAD_ELEMENTS = 1 << 17     # a thread's run is at least this long (else the hand-off costs more)


def block_elements(threads: int) -> int:
    """Elements a block holds when its work is cut between ``threads`` threads: :data:`BLOCK_ELEMENTS`
    on one, :data:`THREAD_BLOCK_ELEMENTS` (or BLOCK_ELEMENTS if that is larger) on several."""
    return BLOCK_ELEMENTS if threads <= 1 else max(BLOCK_ELEMENTS, THREAD_BLOCK_ELEMENTS)


def blockwise(fn: Callable[..., Any], out: Any, *arrays: Any, row: int | None = None) -> Any:
    """``fn(out_part, *array_parts)`` over matching slices of ``out`` and ``arrays``; returns ``out``.

    Every array must have ``out``'s shape. ``row=C`` slices whole rows of the last axis (of size C),
    for functions that reduce along it; otherwise the arrays are sliced as flat element sequences.
    """
    shape = out.shape
    for a in arrays:
        if a.shape != shape:
            raise ShapeError(f"blockwise: every array must have the output's shape {shape}, got {a.shape}")
    whole = (type(out) is not numpy.ndarray or out.size <= BLOCK_ELEMENTS
             or not all(a.flags.c_contiguous for a in (out,) + arrays))
    if row is not None and (out.ndim == 0 or shape[-1] != row):
        raise ShapeError(f"blockwise: row={row} must be the size of the last axis of {shape}")
    if out.ndim == 0:     # ufuncs on 0-d arrays return scalars, which out= cannot take: use 1-element views
        fn(out.reshape(1), *(a.reshape(1) for a in arrays))
        return out
    if whole:
        fn(out, *arrays)
        return out
    width = 1 if row is None else max(row, 1)
    flat = [a.reshape(-1, width) if row is not None else a.reshape(-1) for a in (out,) + arrays]
    n_rows = flat[0].shape[0]
    threads = threads_for(out.size, MIN_THREAD_ELEMENTS)
    per_block = max(1, block_elements(threads) // width)

    def run(start: int, stop: int) -> None:
        for i in range(start, stop, per_block):
            fn(*(a[i:min(i + per_block, stop)] for a in flat))

    if threads <= 1:
        run(0, n_rows)
    else:
        run_parallel([lambda a=a, b=b: run(a, b) for a, b in split(n_rows, threads)])
    return out
