"""How ``npformer train`` finds out that ``mpirun`` started it (or its own ``--processes N``,
:mod:`~npformer.distributed.local`), and the communicator it then trains over.

The command line makes no communicator for a plain run, so ``npformer train`` never initialises MPI
unless it was launched by an MPI launcher (:func:`npformer.launcher.launched_by_mpi`, the one place
npformer reads the launcher's environment: ``mpirun`` gives each process variables such as
``PMI_RANK`` or ``PMIX_RANK``). Only their presence is read, so that a missing mpi4py is an
error rather than N separate runs writing one checkpoint; the rank and the number of ranks come from
the MPI library (``MPI.COMM_WORLD``).

Under ``mpirun -n N``: ``--backend numpy`` trains over :class:`~.mpi.MPICommunicator`; ``--backend
cupy`` over :func:`~.nccl.nccl_world` (NCCL, bootstrapped by MPI, one GPU a rank). ``mpirun -n 1`` is
a plain run.
"""
from __future__ import annotations

from npformer.distributed.communicator import Communicator
from npformer.distributed.local import local_communicator
from npformer.distributed.mpi import MPICommunicator
from npformer.distributed.nccl import nccl_world
from npformer.launcher import LAUNCHER_VARIABLES, launched_by_mpi

__all__ = ["LAUNCHER_VARIABLES", "launched_by_mpi", "world_communicator"]


def world_communicator(backend: str) -> Communicator | None:
    """The communicator of every process ``mpirun`` (or ``npformer train --processes``) started, for a
    model on ``backend``; None for a plain run (no launcher, or one process). A DistributedError names
    what is missing (mpi4py and MPI; NCCL for cupy)."""
    local = local_communicator()                 # a rank of npformer train --processes N
    if local is not None:
        return local
    if not launched_by_mpi():
        return None
    comm = MPICommunicator()
    if comm.size == 1:
        return None
    return nccl_world(comm) if backend == "cupy" else comm
