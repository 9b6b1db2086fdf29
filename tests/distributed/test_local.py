"""``npformer train --processes N`` (npformer.distributed.local): LocalCommunicator against the interface
checks every communicator runs (ranks as threads of this process, over a real shared-memory block and a
multiprocessing barrier), in chunks larger and smaller than a slot, the same bits on every rank, a stopped
rank breaking the others' wait; and the command end to end: the weights of ``mpirun -n 2`` bit for bit
where MPI is installed, one process's to rounding with dropout off, errors printed once."""
import multiprocessing
import subprocess
import sys
import threading
from multiprocessing import shared_memory

import numpy as np
import pytest

from npformer.distributed.local import SLOT_BYTES, LocalCommunicator
from npformer.errors import DistributedError, RangeError
from tests.distributed.cases import comparable_parts
from tests.distributed.interface_checks import run_interface_checks
from tests.distributed.launcher import mpirun

TINY = ["--model", "gpt", "--task", "charlm", "--d-model", "16", "--heads", "2", "--layers", "1", "--ff", "32",
        "--block-size", "8", "--batch-size", "4", "--steps", "4", "--log-every", "2", "--eval-every", "0",
        "--warmup", "1", "--no-final-eval"]


def on_ranks(size: int, work, slot_bytes: int = SLOT_BYTES, before=None):
    """``work(comm)`` on ``size`` threads, each with its rank's LocalCommunicator over one new block;
    the results in rank order (a thread's exception re-raised). ``before(barrier)`` runs first."""
    block = shared_memory.SharedMemory(create=True, size=size * slot_bytes)
    barrier = multiprocessing.get_context("spawn").Barrier(size)
    if before is not None:
        before(barrier)
    results, errors = [None] * size, []

    def run(rank):
        comm = LocalCommunicator(rank, size, block.name, barrier, slot_bytes)
        try:
            results[rank] = work(comm)
        except BaseException as exc:        # noqa: B036 - handed to the test thread below
            errors.append(exc)
        finally:
            comm.close()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        block.close()
        block.unlink()
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("slot_bytes", [SLOT_BYTES, 8])
@pytest.mark.parametrize("size", [1, 2, 3])
def test_the_local_communicator_does_what_the_interface_says(size, slot_bytes):
    """Also with slots of 8 bytes, so that every array goes in several chunks (one element of float64)."""
    for rank, report in enumerate(on_ranks(size, lambda comm: run_interface_checks(comm, size), slot_bytes)):
        failed = [name for name, ok in report.items() if not ok]
        assert not failed, f"rank {rank} of {size}: {failed}"
        assert len(report) == (13 if size > 1 else 12)        # one broadcast root when size is 1


def test_every_rank_gets_the_same_bits_of_a_sum_in_rank_order():
    """float32 sums of three ranks' values, whose rounding depends on the order: every rank gets the
    sum taken in rank order, (a0 + a1) + a2, across chunk boundaries too."""
    rng = np.random.default_rng(0)
    values = [rng.standard_normal(1000).astype(np.float32) * 10.0 ** k for k in (0, 4, -4)]
    want = (values[0] + values[1]) + values[2]
    got = on_ranks(3, lambda comm: comm.all_reduce(values[comm.rank].copy()), slot_bytes=256)
    for rank in range(3):
        assert np.array_equal(got[rank], want), rank


def test_a_stopped_rank_breaks_the_others_wait_with_a_clear_error():
    """The launcher aborts the barrier when a rank fails; a rank's next collective then raises."""
    with pytest.raises(DistributedError, match="another process of this run stopped"):
        on_ranks(2, lambda comm: comm.all_reduce(np.ones(3)), before=lambda barrier: barrier.abort())


def test_a_root_outside_the_ranks_is_refused():
    with pytest.raises(RangeError, match=r"expected a root rank in 0\.\.1, got 2"):
        on_ranks(2, lambda comm: comm.broadcast(np.ones(3), root=2))


def _train(*args, cwd):
    return subprocess.run([sys.executable, "-m", "npformer", "train", *TINY, *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def _weights(path):
    with np.load(path, allow_pickle=False) as data:
        return {k: data[k] for k in data.files if data[k].dtype.kind == "f"}


def test_processes_train_as_mpirun_does_and_as_one_process_to_rounding(tmp_path):
    """--processes 2 with dropout on, the same run under mpirun -n 2: the same weights bit for bit
    (the same ranks, batches, dropout streams and sums); with --dropout 0, one process's weights to
    float32 rounding (only the order of the gradient's sum differs), the key biases aside: their exact
    gradient is 0, so their values are rounding noise in both runs. Rank 0 alone logs."""
    two = _train("--processes", "2", "--out-dir", "two", cwd=tmp_path)
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout.count("step     4/4") == 1 and "Traceback" not in two.stderr
    try:
        ref = mpirun(2, sys.executable, "-m", "npformer", "train", *TINY, "--threads", "1",
                     "--out-dir", str(tmp_path / "mpi"), cwd=tmp_path)
    except pytest.skip.Exception:
        ref = None                                     # no MPI here: the comparison below still runs
    if ref is not None:
        assert ref.returncode == 0, ref.stderr[-3000:]
        a, b = _weights(tmp_path / "two" / "last.npz"), _weights(tmp_path / "mpi" / "last.npz")
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    runs = [_train(*p, "--dropout", "0", "--out-dir", d, cwd=tmp_path) for p, d in ((("--processes", "2"), "p0"),
                                                                                    ((), "one"))]
    assert all(r.returncode == 0 for r in runs), [r.stderr[-2000:] for r in runs]
    a, b = _weights(tmp_path / "p0" / "last.npz"), _weights(tmp_path / "one" / "last.npz")
    assert a.keys() == b.keys()
    for k in a:
        for part, (got, expected) in comparable_parts(k, a[k], b[k]):
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6, err_msg=part)


def test_processes_errors_are_printed_once_and_a_checkpoint_resumes_on_its_count(tmp_path):
    """A bad count and more processes than CPUs are refused before any process starts; a batch the
    ranks do not divide stops every rank, printed once by rank 0; a 2-process checkpoint resumed on one
    process names --processes 2."""
    for args, message in ((("--processes", "0"), "--processes: expected an int >= 1, got 0"),
                          (("--processes", "100000"), "--processes 100000 is more than the"),
                          (("--processes", "2", "--batch-size", "3"), "batch")):
        r = _train(*args, "--out-dir", "bad", cwd=tmp_path)
        assert r.returncode == 2 and r.stderr.count("npformer train: error:") == 1, (args, r.stderr[-2000:])
        assert message in r.stderr, (args, r.stderr)
    first = _train("--processes", "2", "--out-dir", "run", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    again = _train("--steps", "6", "--out-dir", "run", "--resume", cwd=tmp_path)
    assert again.returncode == 2 and "resume it on 2 (--processes 2 or mpirun -n 2), not 1" in again.stderr
    more = _train("--steps", "6", "--out-dir", "run", "--resume", "--processes", "2", cwd=tmp_path)
    assert more.returncode == 0 and "step     6/6" in more.stdout, more.stderr[-3000:]


# npformer train with a Ctrl-C in step 3, sent by rank 0 to the whole process group as a terminal sends it
# (the launcher and both ranks get it); at module level, so each spawned rank (which imports this file as
# its __main__) patches its loop too
CTRL_C_IN_STEP_3 = """
import os, signal, sys
from npformer.training.loop import Trainer
real = Trainer.train_step

def train_step(self):
    if self.step + 1 == 3 and self.rank0:
        os.killpg(os.getpgrp(), signal.SIGINT)
    return real(self)

Trainer.train_step = train_step
if __name__ == "__main__":
    from npformer.cli import main
    sys.exit(main(sys.argv[1:]))
"""


def test_ctrl_c_stops_every_process_after_the_same_step_and_the_run_resumes_exactly(tmp_path):
    """Ctrl-C to --processes 2: the ranks agree on the step to stop after (a rank that went on would wait for
    the others, or pair its all-reduce with their checkpoint's), rank 0 saves it and says once how to go on
    (on 2 processes), exit status 130; resumed so, the run ends with an uninterrupted run's weights."""
    (tmp_path / "ctrl_c.py").write_text(CTRL_C_IN_STEP_3)
    stopped = subprocess.run([sys.executable, "ctrl_c.py", "train", *TINY, "--processes", "2", "--out-dir", "run"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=300, start_new_session=True)
    assert stopped.returncode == 130 and stopped.stderr == (
        "npformer train: interrupted at step 3 of 4; saved run/last.npz; continue with: npformer train --resume "
        "--out-dir run --processes 2\n"), stopped.stderr[-3000:]
    resumed = _train("--resume", "--out-dir", "run", "--processes", "2", cwd=tmp_path)
    straight = _train("--processes", "2", "--out-dir", "straight", cwd=tmp_path)
    assert resumed.returncode == straight.returncode == 0, (resumed.stderr[-3000:], straight.stderr[-3000:])
    a, b = _weights(tmp_path / "run" / "last.npz"), _weights(tmp_path / "straight" / "last.npz")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
