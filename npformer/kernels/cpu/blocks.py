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

Threads: NumPy ufuncs release the GIL, so with :func:`set_num_threads` above 1, arrays of at least
two 256K-element blocks are shared out between that many threads. The default is 1. On the 2-core development machine two threads nearly
halve a GELU or softmax on its own (1M floats: 2.2 -> 1.3 ms, 2.3 -> 1.1 ms), yet whole training
steps (gpt-small, gpt-medium, seq2seq-base) were about 3% slower with them in quiet runs, probably
because right after each matrix product OpenBLAS's worker thread is still spinning on the second
core, which the helper thread then has to share.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy

from npformer.checks import positive_int
from npformer.errors import ShapeError

__all__ = ["blockwise", "set_num_threads", "get_num_threads", "BLOCK_ELEMENTS", "THREAD_BLOCK_ELEMENTS"]

BLOCK_ELEMENTS = 1 << 16          # 256 KB of float32 per intermediate: several fit in L2
THREAD_BLOCK_ELEMENTS = 1 << 18   # blocks handed to threads: fewer ufunc calls, fewer GIL hand-offs
_state: dict[str, Any] = {"threads": 1, "pool": None, "pool_size": 0}
_lock = threading.Lock()
_local = threading.local()        # .inside: this thread is running blocks (no nested hand-off)


def get_num_threads() -> int:
    """Threads :func:`blockwise` uses (the calling thread included); 1 until :func:`set_num_threads`."""
    return _state["threads"]


def set_num_threads(n: int) -> None:
    """Use ``n`` threads (the calling thread and ``n - 1`` helpers) for element-wise blocks."""
    _state["threads"] = positive_int(n, "number of threads")


def _pool(helpers: int) -> ThreadPoolExecutor:
    with _lock:
        if _state["pool_size"] < helpers:
            if _state["pool"] is not None:
                _state["pool"].shutdown(wait=False)
            _state["pool"] = ThreadPoolExecutor(max_workers=helpers, thread_name_prefix="npformer-blocks")
            _state["pool_size"] = helpers
        return _state["pool"]


def _parts(n_items: int, per_block: int) -> list[tuple[int, int]]:
    return [(i, min(i + per_block, n_items)) for i in range(0, n_items, per_block)]


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
    # Threads only for arrays of two thread blocks or more: each ufunc call takes the GIL for its
    # set-up, and with 64K-element blocks two threads spend much of their time handing it over.
    threads = 1 if getattr(_local, "inside", False) else get_num_threads()
    if threads > 1 and out.size >= 2 * THREAD_BLOCK_ELEMENTS:
        parts = _parts(flat[0].shape[0], max(1, THREAD_BLOCK_ELEMENTS // width))
    else:
        threads, parts = 1, _parts(flat[0].shape[0], max(1, BLOCK_ELEMENTS // width))

    def run(chunk):
        outer, _local.inside = getattr(_local, "inside", False), True
        try:
            for i, j in chunk:
                fn(*(a[i:j] for a in flat))
        finally:
            _local.inside = outer

    # A blockwise call made from inside a block runs in its own thread (above): waiting on the
    # pool from a pool thread could deadlock.
    threads = min(threads, len(parts))
    if threads == 1:
        run(parts)
        return out
    share = -(-len(parts) // threads)                   # contiguous runs of parts, one per thread
    runs = [parts[k:k + share] for k in range(0, len(parts), share)]
    futures = [_pool(len(runs) - 1).submit(run, chunk) for chunk in runs[1:]]
    run(runs[0])
    for f in futures:
        f.result()                                      # re-raises an exception from a helper
    return out
