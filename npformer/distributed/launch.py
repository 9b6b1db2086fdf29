"""How ``npformer train`` finds out that ``mpirun`` started it, and the communicator it then trains over.

The command line makes no communicator for a plain run, so ``npformer train`` never initialises MPI
unless it was launched by an MPI launcher. That test is the one place npformer reads the launcher's
environment: ``mpirun`` (MPICH's Hydra, Open MPI's PRRTE, Intel MPI) gives each process variables
such as ``PMI_RANK`` or ``PMIX_RANK``. Only their presence is read, so that a missing mpi4py is an
error rather than N separate runs writing one checkpoint; the rank and the number of ranks come from
the MPI library (``MPI.COMM_WORLD``).

Under ``mpirun -n N``: ``--backend numpy`` trains over :class:`~.mpi.MPICommunicator`; ``--backend
cupy`` over :func:`~.nccl.nccl_world` (NCCL, bootstrapped by MPI, one GPU a rank). ``mpirun -n 1`` is
a plain run.
"""
from __future__ import annotations

import os
from typing import Mapping

from npformer.distributed.communicator import Communicator
from npformer.distributed.mpi import MPICommunicator
from npformer.distributed.nccl import nccl_world

__all__ = ["LAUNCHER_VARIABLES", "launched_by_mpi", "world_communicator"]

# set by mpirun/mpiexec for each process it starts: Hydra (MPICH, Intel MPI), PRRTE/PMIx (Open MPI 5),
# ORTE (Open MPI 4), Slurm's srun with PMI
LAUNCHER_VARIABLES = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")


def launched_by_mpi(environ: Mapping[str, str] | None = None) -> bool:
    """True when an MPI launcher started this process."""
    environ = os.environ if environ is None else environ
    return any(name in environ for name in LAUNCHER_VARIABLES)


def world_communicator(backend: str) -> Communicator | None:
    """The communicator of every process ``mpirun`` started, for a model on ``backend``; None for a
    plain run (no launcher, or one process). A DistributedError names what is missing (mpi4py and
    MPI; NCCL for cupy)."""
    if not launched_by_mpi():
        return None
    comm = MPICommunicator()
    if comm.size == 1:
        return None
    return nccl_world(comm) if backend == "cupy" else comm
