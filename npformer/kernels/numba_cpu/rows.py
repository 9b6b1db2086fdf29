"""Compiled row loops shared out between the CPU fast paths' threads.

``kernel(*arrays, start, stop)`` handles rows ``[start, stop)``; compiled with ``nogil=True`` it runs on
several threads at once. :func:`over_rows` cuts the rows into one contiguous run per thread (each at
least :data:`~npformer.kernels.cpu.blocks.MIN_THREAD_ELEMENTS` elements, else fewer threads), so the
parts depend only on the shape and the thread count.
"""
from __future__ import annotations

from typing import Any, Callable

from npformer.kernels.cpu.blocks import MIN_THREAD_ELEMENTS
from npformer.kernels.cpu.threads import get_num_threads, in_parallel_region, run_parallel, split

__all__ = ["over_rows"]


def over_rows(kernel: Callable[..., Any], n_rows: int, width: int, *args: Any, multiple: int = 1) -> None:
    """``kernel(*args, start, stop)`` over ``range(n_rows)`` of rows of ``width`` elements, the run
    boundaries multiples of ``multiple``."""
    work = n_rows * max(width, 1)
    threads = 1 if in_parallel_region() else min(get_num_threads(), work // MIN_THREAD_ELEMENTS)
    if threads <= 1 or n_rows <= multiple:
        kernel(*args, 0, n_rows)
        return
    run_parallel([lambda a=a, b=b: kernel(*args, a, b) for a, b in split(n_rows, threads, multiple)])
