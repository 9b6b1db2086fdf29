"""Compiled row loops shared out between the CPU fast paths' threads.

``kernel(*arrays, start, stop)`` handles rows ``[start, stop)``; compiled with ``nogil=True`` it runs on
several threads at once. :func:`over_rows` cuts the rows into chunks of about
:data:`CHUNK_ELEMENTS` elements and each thread takes the next chunk as it finishes one. A thread
slowed down by another program (or by BLAS's workers, which keep a core busy for a while after each
matrix product) then simply takes fewer chunks. Every chunk is computed the same way whichever
thread takes it, so the results do not depend on the threads or the timing.
"""
from __future__ import annotations

import itertools
from typing import Any, Callable

from npformer.kernels.cpu.blocks import MIN_THREAD_ELEMENTS
from npformer.kernels.cpu.threads import run_parallel, threads_for

__all__ = ["over_rows", "CHUNK_ELEMENTS", "CHEAP"]

CHUNK_ELEMENTS = 1 << 15          # 128 KB of float32 a chunk: a few microseconds of work, in L2
CHEAP = 1 << 20                   # elements a thread for loops of a few operations an element


def over_rows(kernel: Callable[..., Any], n_rows: int, width: int, *args: Any, multiple: int = 1,
              per_thread: int = MIN_THREAD_ELEMENTS) -> None:
    """``kernel(*args, start, stop)`` over ``range(n_rows)`` of rows of ``width`` elements, every chunk
    boundary a multiple of ``multiple``, with a thread for every ``per_thread`` elements (at most
    the thread count): :data:`CHEAP` for loops of a few operations an element (a hand-off to a
    sleeping thread costs about 60 microseconds on the 2-core development machine: layer norm,
    softmax's backward and cross-entropy ran faster on one thread up to about 1M elements)."""
    work = n_rows * max(width, 1)
    threads = threads_for(work, per_thread)
    if threads <= 1 or n_rows <= multiple:
        kernel(*args, 0, n_rows)
        return
    rows = max(multiple, CHUNK_ELEMENTS // max(width, 1) // multiple * multiple)     # rows a chunk
    n_chunks = -(-n_rows // rows)
    chunks = itertools.count()                       # next() is atomic under the GIL

    def take() -> None:
        for i in iter(chunks.__next__, None):
            if i >= n_chunks:
                return
            kernel(*args, i * rows, min((i + 1) * rows, n_rows))

    run_parallel([take] * threads)
