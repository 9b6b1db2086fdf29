"""The communicators in one process: NCCLCommunicator over an in-process stand-in for cupy.cuda.nccl
(ranks as threads, host memory as the buffers) against the same interface checks the MPI ranks run,
DataParallel over it against one process, and the errors for a missing mpi4py or NCCL. The real
NCCL runs where CuPy and a GPU are present (one GPU: a one-rank communicator)."""
import sys
import threading

import numpy as np
import pytest

from npformer.distributed import DataParallel, NCCLCommunicator, import_mpi, import_nccl, world_communicator
from npformer.errors import BackendUnavailableError, DistributedError, InputTypeError
from npformer.models.gpt import GPT, GPTConfig
from npformer.ops.cross_entropy import cross_entropy_backward, cross_entropy_forward
from tests.distributed import fake_nccl
from tests.distributed.interface_checks import run_interface_checks


def on_threads(size: int, work):
    """``work(comm)`` on ``size`` threads, each with its rank's NCCLCommunicator over the stand-in;
    returns the results in rank order (re-raises a thread's exception)."""
    uid = fake_nccl.get_unique_id()
    results, errors = [None] * size, []

    def run(rank):
        try:
            comm = NCCLCommunicator(fake_nccl.NcclCommunicator(size, uid, rank), rank, size, nccl=fake_nccl,
                                    backend="numpy")
            results[rank] = work(comm)
        except BaseException as exc:        # noqa: B036 - handed to the test thread below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("size", [1, 2, 3])
def test_the_nccl_communicator_does_what_the_interface_says(size):
    for rank, report in enumerate(on_threads(size, lambda comm: run_interface_checks(comm, size))):
        failed = [name for name, ok in report.items() if not ok]
        assert not failed, f"rank {rank} of {size}: {failed}"
        assert len(report) == (13 if size > 1 else 12)        # one broadcast root when size is 1


def test_nccl_refuses_a_dtype_it_has_no_type_for():
    def work(comm):
        with pytest.raises(InputTypeError, match="NCCL moves float16, float32, float64.*got complex128"):
            comm.all_reduce(np.zeros(2, dtype=np.complex128))
        return True
    assert on_threads(1, work) == [True]


def _tiny_gpt():
    return GPT(GPTConfig(vocab_size=11, block_size=6, n_layer=1, n_head=2, d_model=8, dim_feedforward=16,
                         dropout=0.0), dtype="float64", rng=0)


def _grads_after_backward(model, x, y, dp=None):
    loss, cache = cross_entropy_forward(model(x), y)
    model.backward(cross_entropy_backward(np.ones((), np.float64), cache))
    if dp is not None:
        dp.reduce_gradients(float(loss), y.size)
    return {name: p.grad.copy() for name, p in model.named_parameters()}


def test_data_parallel_over_the_nccl_stand_in_gives_the_joined_batch_gradients():
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 11, (4, 6)), rng.integers(0, 11, (4, 6))
    expected = _grads_after_backward(_tiny_gpt(), x, y)

    def work(comm):
        model = _tiny_gpt()
        if comm.rank == 1:     # another rank's weights: DataParallel replaces them by rank 0's
            for p in model.parameters():
                p.data += 1.0
        dp = DataParallel(model, comm, bucket_bytes=512)       # several buckets
        return _grads_after_backward(model, *dp.shard(x, y), dp)

    for grads in on_threads(2, work):
        for name, g in grads.items():
            np.testing.assert_allclose(g, expected[name], rtol=1e-12, atol=1e-14 * np.abs(expected[name]).max())


def test_a_model_on_another_backend_than_the_communicator_is_refused():
    class OnGPU:
        backend = "cupy"
    with pytest.raises(InputTypeError, match="moves cupy arrays but the model lives on numpy"):
        DataParallel(_tiny_gpt(), OnGPU())


def test_a_missing_mpi4py_is_one_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)          # import mpi4py now fails
    with pytest.raises(DistributedError, match="needs mpi4py and an MPI library: mpi4py is not installed; "
                                               "pip install mpi4py mpich"):
        import_mpi()
    monkeypatch.setenv("PMI_RANK", "0")                          # as if mpirun had started this process
    with pytest.raises(DistributedError, match="mpi4py is not installed"):
        world_communicator("numpy")


def test_a_plain_run_makes_no_communicator(monkeypatch):
    from npformer.distributed.launch import LAUNCHER_VARIABLES
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setitem(sys.modules, "mpi4py", None)          # and never imports mpi4py
    assert world_communicator("numpy") is None


def test_a_missing_nccl_is_one_clear_error(monkeypatch):
    try:
        import_nccl()
    except BackendUnavailableError:
        pytest.skip("CuPy or a GPU is absent: BackendUnavailableError names it before NCCL is looked for")
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", None)
    with pytest.raises(DistributedError, match="needs NCCL"):
        import_nccl()


@pytest.mark.gpu
def test_the_real_nccl_on_one_gpu_does_what_the_interface_says():
    cupy = pytest.importorskip("cupy", reason="CuPy not installed: this test runs the communicator on device arrays")
    try:
        nccl = import_nccl()
    except (BackendUnavailableError, DistributedError) as exc:
        pytest.skip(str(exc))
    comm = NCCLCommunicator(nccl.NcclCommunicator(1, nccl.get_unique_id(), 0), 0, 1, nccl=nccl)
    a = cupy.arange(6, dtype=cupy.float32)
    assert comm.all_reduce(a) is a and bool((a == cupy.arange(6)).all())
    assert bool((comm.broadcast(a, root=0) == cupy.arange(6)).all())
    comm.barrier()
    with pytest.raises(InputTypeError, match="expected a cupy array"):
        comm.all_reduce(np.zeros(3))
