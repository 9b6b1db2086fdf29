"""The communicator interface every data-parallel piece talks to: five members, nothing more.

    rank          this process's number, 0 .. size - 1
    size          how many processes take part
    all_reduce(a, op="sum")     a <- op over every rank's a, in place, on every rank (returns a)
    broadcast(a, root=0)        a <- root's a, in place, on every rank (returns a)
    barrier()                   returns once every rank has called it

Every call is *collective*: every rank makes the same calls in the same order with arrays of the same
shape and dtype, or the run hangs (MPI and NCCL both match calls by their order, not by a name). The
arrays are C-contiguous and live where the implementation moves data from: host NumPy arrays for
:class:`~npformer.distributed.mpi.MPICommunicator` (MPI through mpi4py), device CuPy arrays for
:class:`~npformer.distributed.nccl.NCCLCommunicator` (NCCL through ``cupy.cuda.nccl``).

This is host-side code: it moves arrays between processes and never computes a gradient.
"""
from __future__ import annotations

from typing import Any

from npformer.backend import backend_name, is_array
from npformer.checks import describe
from npformer.errors import InputTypeError

__all__ = ["Communicator", "REDUCE_OPS", "check_buffer"]

REDUCE_OPS = ("sum", "max", "min")


class Communicator:
    """The interface (module docstring); :class:`~npformer.distributed.mpi.MPICommunicator` and
    :class:`~npformer.distributed.nccl.NCCLCommunicator` implement it."""

    rank: int
    size: int
    backend: str          # "numpy" or "cupy": where the arrays it takes live

    def all_reduce(self, array: Any, op: str = "sum") -> Any:
        raise NotImplementedError

    def broadcast(self, array: Any, root: int = 0) -> Any:
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, size={self.size})"


def check_buffer(array: Any, backend: str, where: str) -> None:
    """``array`` must be a C-contiguous array of ``backend`` (communication reads and writes its memory
    as one block); an InputTypeError names what came."""
    if not is_array(array) or backend_name(array) != backend:
        raise InputTypeError(f"{where}: expected a {backend} array, got {describe(array)}")
    if not array.flags.c_contiguous:
        raise InputTypeError(f"{where}: expected a C-contiguous array (communication moves one block of "
                             f"memory), got a strided view {describe(array)}; pass a contiguous copy")
