"""Data-parallel training on one machine without MPI: ``npformer train --processes N``.

On a machine with a few cores, N processes of one thread each use them better than one process on
N threads for a small model: each process has its own GIL, and the ranks meet once a step, in the
all-reduce of the gradients, where threads hand work over some forty times a step (measured on the
performance page, "A second process instead of a second thread"). The run means what
``mpirun -n N npformer train`` means (the documentation's data-parallel page): the global batch,
rank 0 alone prints, evaluates and writes, and a checkpoint resumes on the same number of ranks.

    run_processes(main, argv, n)   the launcher: n processes (spawned, not forked), each running
                                   ``main(argv)`` (the command line's) as one rank; returns when all
                                   have ended, and stops the others when one fails
    LocalCommunicator              the Communicator interface between them, over one block of shared
                                   memory with a slot of SLOT_BYTES a rank

An all-reduce goes in chunks of at most a slot: each rank copies its chunk into its own slot, all
wait at a barrier, and every rank reduces the slots in rank order (slot 0, then 1, ...) into its
array, so every rank gets the same bits, whatever the timing; a second barrier keeps the slots until
every rank has read them. A broadcast is the root's slot read by the others, between the same two
barriers. A rank that stops breaks the barrier (:func:`run_processes` aborts it), and the others'
next collective raises a DistributedError instead of waiting for ever. Ctrl-C reaches every process
of the terminal's group, ranks and launcher alike, and each stops as a plain run does. A launcher
killed outright (SIGKILL) cannot stop its ranks: they run on to their end, or wait at their next
collective if one of them died too.

Host-side code: it moves arrays between processes and never computes a gradient.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import sys
import threading
from multiprocessing import shared_memory
from typing import Any, Callable

import numpy

from npformer.checks import one_of
from npformer.distributed.communicator import REDUCE_OPS, Communicator, check_buffer
from npformer.errors import DistributedError, RangeError
from npformer.launcher import started_as_rank

__all__ = ["LocalCommunicator", "run_processes", "local_communicator", "local_world", "SLOT_BYTES"]

SLOT_BYTES = 4 << 20          # a rank's slot: the data-parallel buckets are at most 4 MiB
STOP_GRACE_S = 10.0           # how long the others get to stop after one failed, before they are terminated

_REDUCE = {"sum": numpy.add, "max": numpy.maximum, "min": numpy.minimum}
_world: dict[str, Any] = {}   # in a process run_processes started: rank, size, block name, barrier


class LocalCommunicator(Communicator):
    """``LocalCommunicator(rank, size, block_name, barrier)``: the :class:`Communicator` of the
    processes :func:`run_processes` started, over the shared-memory block ``block_name`` (``size``
    slots of ``slot_bytes``) and a ``multiprocessing`` barrier of ``size`` parties. Takes
    C-contiguous NumPy arrays."""

    backend = "numpy"

    def __init__(self, rank: int, size: int, block_name: str, barrier: Any, slot_bytes: int = SLOT_BYTES):
        self.rank, self.size, self.slot_bytes = rank, size, slot_bytes
        self._barrier = barrier
        self._block = shared_memory.SharedMemory(name=block_name)

    def all_reduce(self, array, op="sum"):
        check_buffer(array, self.backend, "all_reduce")
        reduce = _REDUCE[one_of(op, "op", REDUCE_OPS)]
        for chunk in self._chunks(array):
            self._slot(self.rank, chunk)[...] = chunk
            self._wait()
            numpy.copyto(chunk, self._slot(0, chunk))
            for r in range(1, self.size):                # rank order: the same sum on every rank
                reduce(chunk, self._slot(r, chunk), out=chunk)
            self._wait()
        return array

    def broadcast(self, array, root=0):
        check_buffer(array, self.backend, "broadcast")
        if not (isinstance(root, int) and 0 <= root < self.size):
            raise RangeError(f"broadcast: expected a root rank in 0..{self.size - 1}, got {root!r}")
        for chunk in self._chunks(array):
            if self.rank == root:
                self._slot(root, chunk)[...] = chunk
            self._wait()
            if self.rank != root:
                chunk[...] = self._slot(root, chunk)
            self._wait()
        return array

    def barrier(self):
        self._wait()

    def _wait(self) -> None:
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            raise DistributedError("another process of this run stopped (npformer train --processes), "
                                   "so this one stops too") from None

    def _chunks(self, array):
        """Views of ``array`` (C-contiguous) in runs of at most a slot's bytes."""
        flat = array.reshape(-1)
        per = max(1, self.slot_bytes // array.itemsize)
        return [flat[i:i + per] for i in range(0, flat.size, per)]

    def _slot(self, rank: int, like):
        """Rank ``rank``'s slot as an array of ``like``'s dtype and length (a view of the block, made
        for one collective: no view outlives it, so :meth:`close` can release the block)."""
        return numpy.ndarray(like.shape, like.dtype, buffer=self._block.buf, offset=rank * self.slot_bytes)

    def close(self) -> None:
        """Detach from the shared block (the launcher removes it when the run ends)."""
        self._block.close()


def local_world() -> tuple[int, int] | None:
    """(rank, size) in a process :func:`run_processes` started; None elsewhere."""
    return (_world["rank"], _world["size"]) if _world else None


def local_communicator() -> LocalCommunicator | None:
    """The communicator of the processes :func:`run_processes` started, in one of them; None elsewhere."""
    return LocalCommunicator(**_world) if _world else None


def _rank_main(command: Callable[[list[str]], int], argv: list[str], rank: int, size: int, block_name: str,
               barrier: Any) -> None:
    """A started process: ``command(argv)`` as rank ``rank`` of ``size``; its exit status is the result."""
    started_as_rank(rank)
    _world.update(rank=rank, size=size, block_name=block_name, barrier=barrier)
    sys.exit(command(argv))


def run_processes(command: Callable[[list[str]], int], argv: list[str], n: int) -> int:
    """Run ``command(argv)`` (``npformer.cli.main``: a module-level function, which a spawned process
    imports by name) in ``n`` new processes, ranks 0 .. n - 1 of one data-parallel run, and wait for
    them. When one fails the barrier is broken, so the others stop at their next collective
    (terminated after :data:`STOP_GRACE_S` if they do not). Returns rank 0's exit status,
    or the first failing rank's when rank 0 succeeded; 130 after Ctrl-C (which every process of the
    terminal's group receives: each stops as a plain run does)."""
    ctx = multiprocessing.get_context("spawn")           # no fork: BLAS and the pool have threads by now
    block = shared_memory.SharedMemory(create=True, size=n * SLOT_BYTES)
    barrier = ctx.Barrier(n)
    procs = [ctx.Process(target=_rank_main, args=(command, list(argv), rank, n, block.name, barrier),
                         name=f"npformer-rank-{rank}") for rank in range(n)]
    failed: list[int] = []
    try:
        for p in procs:
            p.start()
        pending = list(procs)
        while pending:
            ready = multiprocessing.connection.wait([p.sentinel for p in pending])
            for p in [p for p in pending if p.sentinel in ready]:
                p.join()
                pending.remove(p)
                if p.exitcode != 0:
                    if not failed:
                        barrier.abort()                  # the others' next collective raises
                    failed.append(procs.index(p))
    except KeyboardInterrupt:
        return 130                                       # (after the ranks stop, below)
    finally:
        _stop(procs)
        block.close()
        block.unlink()
    if failed and failed[0] != 0:
        print(f"npformer train: rank {failed[0]} of {n} stopped first (exit status "
              f"{_status(procs[failed[0]].exitcode)})", file=sys.stderr, flush=True)
    return _status(procs[0].exitcode) or (_status(procs[failed[0]].exitcode) if failed else 0)


def _status(exitcode: int | None) -> int:
    """A process's exit status as a shell gives it: 128 + N for one ended by signal N."""
    if exitcode is None:
        return 1
    return 128 - exitcode if exitcode < 0 else exitcode


def _stop(procs: list) -> None:
    """Wait up to STOP_GRACE_S for processes still running, then terminate them."""
    for p in procs:
        if p.pid is not None:
            p.join(STOP_GRACE_S)
            if p.is_alive():
                p.terminate()
                p.join()
