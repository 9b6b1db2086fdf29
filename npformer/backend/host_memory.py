"""Keep freed host memory for reuse, so that a training loop's large arrays stop costing page faults.

A training step allocates and frees the same multi-MB arrays every step (activations, gradients,
attention scores). glibc's malloc gives each block above its mmap threshold (128 KiB at first,
raised as such blocks are freed, up to 32 MiB) fresh pages from the kernel, and returns memory at
the top of its heap above its trim threshold. Either way the next step's arrays are new pages: the
kernel zeroes and maps each 4 KiB page on first touch. Measured on the 2-core development machine
for the gpt-small benchmark step: 11,000 page faults and about 40 ms of kernel time a step (of about
250), none after :func:`retain_freed_memory`.

    retain_freed_memory()       # blocks up to 32 MiB from the heap, and the heap never trimmed

After it, the process keeps what it freed (its resident memory stays at the step's peak, which the
next step reaches again anyway) and reuses it. ``npformer train`` calls it on the CPU; the benchmark
suite calls it before timing, for PyTorch and npformer alike (both allocate through malloc). It
changes the process's allocator, so a library never calls it on import. A no-op returning False
where the C library is not glibc.
"""
from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["retain_freed_memory", "set_malloc_thresholds", "MMAP_THRESHOLD", "TRIM_THRESHOLD"]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3     # mallopt's parameter numbers (malloc.h)
MMAP_THRESHOLD = 32 << 20                         # glibc's largest allowed: bigger blocks still get fresh pages
TRIM_THRESHOLD = 2 ** 31 - 1                      # the largest an int takes: the heap's top is kept


def set_malloc_thresholds(mmap_bytes: int, trim_bytes: int) -> bool:
    """Set glibc malloc's mmap and trim thresholds for this process; True if both were set, False
    where the C library has no ``mallopt`` (not glibc: musl, macOS, Windows)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_bytes)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_bytes))


def retain_freed_memory() -> bool:
    """Set glibc malloc's mmap threshold to :data:`MMAP_THRESHOLD` and its trim threshold to
    :data:`TRIM_THRESHOLD` for this process; True if both were set."""
    return set_malloc_thresholds(MMAP_THRESHOLD, TRIM_THRESHOLD)
