"""Data-parallel training over several processes: MPI on CPUs, NCCL on GPUs.

Each process (a *rank*) holds the whole model and takes its rows of every global batch; after the
backward the ranks sum their weighted gradients with an all-reduce, so each then takes the same
optimiser step and the weights stay equal. ``mpirun -n N npformer train ...`` does it for every model;
:class:`DataParallel` does it in a loop of your own. The layers, bottom-up:

    communicator     the interface: rank, size, all_reduce, broadcast, barrier
    mpi, nccl        its implementations: MPI through mpi4py (NumPy arrays), NCCL through CuPy,
    local            and shared memory between the processes of npformer train --processes N
    buckets          gradients packed into a few contiguous buffers, one collective each
    sampler          this rank's rows of the global batch
    data_parallel    DataParallel: checks the ranks agree, broadcasts the weights, reduces gradients
    launch           what ``npformer train`` uses under ``mpirun``

Host-side code: mpi4py and CuPy are imported when a communicator is made, never on ``import npformer``.
"""
from npformer.distributed.buckets import DEFAULT_BUCKET_BYTES, Bucket, Buckets, pack, plan_buckets, unpack
from npformer.distributed.communicator import REDUCE_OPS, Communicator
from npformer.distributed.data_parallel import DataParallel, ReducedStep, check_same_config, gather_rows
from npformer.distributed.launch import launched_by_mpi, world_communicator
from npformer.distributed.local import LocalCommunicator, run_processes
from npformer.distributed.mpi import MPICommunicator, import_mpi
from npformer.distributed.nccl import NCCLCommunicator, import_nccl, nccl_world
from npformer.distributed.sampler import shard_rows, take_shard

__all__ = ["Communicator", "REDUCE_OPS", "MPICommunicator", "LocalCommunicator", "run_processes", "NCCLCommunicator",
           "import_mpi", "import_nccl", "nccl_world", "DataParallel", "ReducedStep", "check_same_config", "gather_rows",
           "Bucket", "Buckets", "plan_buckets", "pack", "unpack", "DEFAULT_BUCKET_BYTES", "shard_rows", "take_shard",
           "launched_by_mpi", "world_communicator"]
