"""An in-process stand-in for ``cupy.cuda.nccl``: the ranks are threads of one process and the "device
buffers" are host memory, read and written at the addresses NCCLCommunicator passes, as NCCL would.

It implements the part of the module NCCLCommunicator uses: ``get_unique_id``, ``NcclCommunicator(ndev,
uid, rank)`` with ``allReduce(send, recv, count, dtype, op, stream)`` and ``bcast(buf, count, dtype, root,
stream)``, and the dtype and op constants (NCCL's values). Ranks that share a unique id form one group;
each collective meets at a barrier, reduces the deposited copies, meets again and writes.
"""
import ctypes
import random
import threading

import numpy as np

NCCL_UINT8, NCCL_INT32, NCCL_INT64, NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64 = 1, 2, 4, 6, 7, 8
NCCL_SUM, NCCL_MAX, NCCL_MIN = 0, 2, 3
DTYPES = {NCCL_UINT8: np.uint8, NCCL_INT32: np.int32, NCCL_INT64: np.int64, NCCL_FLOAT16: np.float16,
          NCCL_FLOAT32: np.float32, NCCL_FLOAT64: np.float64}
REDUCE = {NCCL_SUM: np.sum, NCCL_MAX: np.max, NCCL_MIN: np.min}

_groups: dict = {}
_lock = threading.Lock()


def get_unique_id():
    return tuple(random.randrange(-128, 128) for _ in range(128))


def _memory(address: int, count: int, dtype: int) -> np.ndarray:
    """``count`` elements of ``dtype`` at ``address``, as a writable NumPy view."""
    dt = np.dtype(DTYPES[dtype])
    return np.frombuffer((ctypes.c_byte * (count * dt.itemsize)).from_address(address), dtype=dt)


class _Group:
    def __init__(self, ndev):
        self.barrier = threading.Barrier(ndev, timeout=30)
        self.slots = [None] * ndev


class NcclCommunicator:
    def __init__(self, ndev, uid, rank):
        with _lock:
            self.group = _groups.setdefault(tuple(uid), _Group(ndev))
        self.rank = rank

    def _meet(self, data):
        """Deposit ``data``, wait for every rank, return every rank's deposit (then wait again, so no
        rank overwrites its slot before all have read)."""
        self.group.slots[self.rank] = data
        self.group.barrier.wait()
        everyone = list(self.group.slots)
        self.group.barrier.wait()
        return everyone

    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
        everyone = self._meet(_memory(sendbuf, count, datatype).copy())
        _memory(recvbuf, count, datatype)[...] = REDUCE[op](np.stack(everyone), axis=0)

    def bcast(self, buff, count, datatype, root, stream):
        everyone = self._meet(_memory(buff, count, datatype).copy())
        _memory(buff, count, datatype)[...] = everyone[root]
