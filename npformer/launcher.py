"""Whether a launcher started this process as one rank of a run, and the rank it gave it: an MPI
launcher (``mpirun``, ``mpiexec``, ``srun``), read from its environment (the one place npformer reads
it; host-side code), or ``npformer train --processes N``, which says so in the process it starts
(:func:`started_as_rank`, :mod:`npformer.distributed.local`).

The launcher gives each process it starts variables such as ``PMI_RANK`` (MPICH's Hydra, Intel MPI,
Slurm's PMI), ``PMIX_RANK`` (Open MPI 5's PRRTE) or ``OMPI_COMM_WORLD_RANK`` (Open MPI 4). Their
presence decides whether ``npformer train`` makes a communicator (:mod:`npformer.distributed.launch`;
the rank and the number of ranks then come from the MPI library) and whether progress is drawn as a
bar (:mod:`npformer.progress`). The rank read here serves only what runs before MPI is initialised:
a usage error is printed by rank 0 alone.
"""
from __future__ import annotations

import os
from typing import Mapping

__all__ = ["LAUNCHER_VARIABLES", "RANK_VARIABLES", "launched_by_mpi", "launcher_rank", "started_as_rank"]

# set by mpirun/mpiexec for each process it starts: Hydra (MPICH, Intel MPI), PRRTE/PMIx (Open MPI 5),
# ORTE (Open MPI 4), Slurm's srun with PMI
LAUNCHER_VARIABLES = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")
RANK_VARIABLES = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK")


def launched_by_mpi(environ: Mapping[str, str] | None = None) -> bool:
    """True when an MPI launcher started this process."""
    environ = os.environ if environ is None else environ
    return any(name in environ for name in LAUNCHER_VARIABLES)


_started_as: dict[str, int] = {}       # set by npformer's own launcher in each process it starts


def started_as_rank(rank: int) -> None:
    """Said by ``npformer train --processes N`` in each process it starts, before the command runs."""
    _started_as["rank"] = rank


def launcher_rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's rank as the launcher numbered it; 0 when no launcher started it (or it gave no
    rank a number can be read from)."""
    if "rank" in _started_as:
        return _started_as["rank"]
    environ = os.environ if environ is None else environ
    for name in RANK_VARIABLES:
        value = environ.get(name, "")
        if value.strip().isdigit():
            return int(value)
    return 0
