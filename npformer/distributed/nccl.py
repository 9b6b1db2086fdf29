"""The communicator over NCCL, through CuPy (``cupy.cuda.nccl``): device (CuPy) arrays, one GPU a rank.

NCCL needs every rank to hold the same 128-byte unique id before it can connect them; rank 0 makes
one (``nccl.get_unique_id()``) and another communicator broadcasts it: MPI (:func:`nccl_world`), the
same ``mpirun`` that started the processes. Each rank then takes one GPU (its rank on its machine,
modulo the GPUs there) and builds ``nccl.NcclCommunicator(size, uid, rank)``. The collectives:

    all_reduce   NcclCommunicator.allReduce(buf, buf, count, dtype, op, stream)     in place
    broadcast    NcclCommunicator.bcast(buf, count, dtype, root, stream)            in place
    barrier      an all-reduce of one number, then the stream is synchronised (NCCL has no barrier)

NCCL enqueues each call on the current CuPy stream, so it is ordered with the kernels before and
after it and no synchronisation is needed between a backward, the all-reduce and the optimiser.

:class:`NCCLCommunicator` speaks only to that ``nccl`` module's API, passed in: the tests hand it
an in-process stand-in that reduces host memory between threads (``backend="numpy"``), so the same
code is exercised on a machine without a GPU.
"""
from __future__ import annotations

from types import ModuleType
from typing import Any

from npformer.checks import one_of
from npformer.distributed.communicator import REDUCE_OPS, Communicator, check_buffer
from npformer.errors import DistributedError, InputTypeError

__all__ = ["NCCLCommunicator", "import_nccl", "nccl_world", "UNIQUE_ID_BYTES"]

UNIQUE_ID_BYTES = 128
# NumPy dtype name -> the name of NCCL's constant for it in cupy.cuda.nccl
NCCL_DTYPES = {"float16": "NCCL_FLOAT16", "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64",
               "int32": "NCCL_INT32", "int64": "NCCL_INT64", "uint8": "NCCL_UINT8"}
NCCL_OPS = {"sum": "NCCL_SUM", "max": "NCCL_MAX", "min": "NCCL_MIN"}


def import_nccl() -> ModuleType:
    """``cupy.cuda.nccl``, or a DistributedError saying what is missing."""
    from npformer.backend import get_backend

    cupy = get_backend("cupy")            # BackendUnavailableError without CuPy or a GPU
    try:
        from cupy.cuda import nccl
    except ImportError as exc:
        raise DistributedError(f"data-parallel training on GPUs needs NCCL, and CuPy cannot load it ({exc}); "
                               "install the NCCL wheel of your CUDA version (pip install nvidia-nccl-cu12 for "
                               "CUDA 12), or train on the CPU with --backend numpy over MPI") from exc
    if not getattr(cupy.cuda, "nccl_enabled", True) or not getattr(nccl, "available", True):
        raise DistributedError("this CuPy was built without NCCL; install a CuPy wheel and the NCCL wheel of "
                               "your CUDA version (pip install nvidia-nccl-cu12 for CUDA 12)")
    return nccl


class NCCLCommunicator(Communicator):
    """The :class:`Communicator` of an NCCL communicator ``comm`` (``nccl.NcclCommunicator``) of
    ``size`` ranks; this one is ``rank``. Made by :func:`nccl_world`; takes C-contiguous CuPy arrays
    (NumPy arrays with ``backend="numpy"``, which only the in-process stand-in of the tests accepts)."""

    def __init__(self, comm: Any, rank: int, size: int, *, nccl: ModuleType, backend: str = "cupy"):
        self.comm, self.rank, self.size, self.nccl = comm, rank, size, nccl
        self.backend = one_of(backend, "backend", ("cupy", "numpy"))

    def _address(self, array) -> int:
        return array.data.ptr if self.backend == "cupy" else array.ctypes.data

    def _stream(self) -> int:
        if self.backend == "numpy":
            return 0
        import cupy
        return cupy.cuda.get_current_stream().ptr

    def _dtype(self, array) -> int:
        name = NCCL_DTYPES.get(str(array.dtype))
        if name is None:
            raise InputTypeError(f"NCCL moves {', '.join(NCCL_DTYPES)} arrays, got {array.dtype}")
        return getattr(self.nccl, name)

    def all_reduce(self, array, op="sum"):
        check_buffer(array, self.backend, "all_reduce")
        op = getattr(self.nccl, NCCL_OPS[one_of(op, "op", REDUCE_OPS)])
        ptr = self._address(array)
        self.comm.allReduce(ptr, ptr, array.size, self._dtype(array), op, self._stream())
        return array

    def broadcast(self, array, root=0):
        check_buffer(array, self.backend, "broadcast")
        self.comm.bcast(self._address(array), array.size, self._dtype(array), root, self._stream())
        return array

    def barrier(self):
        from npformer.backend import get_backend

        self.all_reduce(get_backend(self.backend).zeros(1, dtype="float32"))
        if self.backend == "cupy":
            import cupy
            cupy.cuda.get_current_stream().synchronize()


def nccl_world(bootstrap: Communicator, nccl: ModuleType | None = None) -> NCCLCommunicator:
    """An NCCL communicator over the same ranks as ``bootstrap`` (an MPICommunicator), one GPU a rank.

    Selects this rank's GPU first (its rank on this machine, modulo the GPUs there), so the model
    built afterwards lives on it. Collective: every rank of ``bootstrap`` calls it.
    """
    import numpy

    nccl = import_nccl() if nccl is None else nccl
    import cupy

    local = bootstrap.local_rank() if hasattr(bootstrap, "local_rank") else bootstrap.rank
    cupy.cuda.Device(local % cupy.cuda.runtime.getDeviceCount()).use()
    uid = numpy.zeros(UNIQUE_ID_BYTES, dtype=numpy.int64)          # NCCL's id: 128 C chars
    if bootstrap.rank == 0:
        uid[:] = nccl.get_unique_id()
    bootstrap.broadcast(uid, root=0)
    comm = nccl.NcclCommunicator(bootstrap.size, tuple(int(v) for v in uid), bootstrap.rank)
    return NCCLCommunicator(comm, bootstrap.rank, bootstrap.size, nccl=nccl)
