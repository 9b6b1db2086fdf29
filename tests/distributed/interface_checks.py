"""What every Communicator must do, as checks one rank runs; the same checks run on the ranks of
``mpirun -n 2`` (MPICommunicator) and on threads over the in-process NCCL stand-in (NCCLCommunicator)."""
import numpy as np

from npformer.errors import InputTypeError


def _expect_input_type_error(call) -> bool:
    try:
        call()
    except InputTypeError:
        return True
    return False


def run_interface_checks(comm, expected_size: int) -> dict:
    """Each check's outcome on this rank, ``name -> bool`` (True: as the interface says)."""
    r, n = comm.rank, comm.size
    out = {"rank and size": 0 <= r < n == expected_size}
    for dtype in (np.float16, np.float32, np.float64, np.int64, np.uint8):
        a = np.full((3, 2), r + 1, dtype=dtype)
        got = comm.all_reduce(a)
        out[f"all_reduce sum {np.dtype(dtype).name}, in place"] = (
            got is a and bool((a == n * (n + 1) // 2).all()) and a.dtype == dtype)
    a = np.arange(4, dtype=np.float64) + 10 * r
    out["all_reduce max"] = bool((comm.all_reduce(a.copy(), "max") == np.arange(4) + 10 * (n - 1)).all())
    out["all_reduce min"] = bool((comm.all_reduce(a.copy(), "min") == np.arange(4)).all())
    for root in (0, n - 1):
        b = np.arange(5, dtype=np.float32) + 100 * r
        got = comm.broadcast(b, root=root)
        out[f"broadcast from rank {root}, in place"] = got is b and bool((b == np.arange(5) + 100 * root).all())
    comm.barrier()
    out["barrier returns"] = True
    strided = np.zeros((4, 4))[:, ::2]
    out["strided array refused"] = _expect_input_type_error(lambda: comm.all_reduce(strided))
    out["a list refused"] = _expect_input_type_error(lambda: comm.broadcast([1.0, 2.0]))
    return out
