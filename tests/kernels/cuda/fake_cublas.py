"""Stand-ins for what npformer's captured products (npformer.kernels.cuda.gemm) call, so the CPU tests
the handle and workspace logic and the cuBLAS call itself:

* :class:`FakeCublas`, the cuBLAS library: it hands out handles, records every call with the handle
  it was made on, and computes ``cublasGemmEx`` with NumPy from the operands' addresses (the tests
  pass NumPy arrays and their host addresses), as cuBLAS's documentation defines it (column-major,
  ``C = alpha op(A) op(B) + beta C``, C not read when beta is 0);
* :func:`fake_cupy`, the few parts of CuPy the module uses: NumPy's ``empty`` (recorded), a current
  device and stream the test sets, and CuPy's own cuBLAS handle, which must never be asked for.
"""
from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np

from npformer.backend import resolve_dtype

CUDA_TYPES = {2: "float16", 0: "float32", 1: "float64", 14: "bfloat16"}    # cudaDataType_t -> dtype name


def _column_major(address: int, dtype, rows: int, cols: int, ld: int) -> np.ndarray:
    """The (rows, cols) column-major matrix with leading dimension ``ld`` at a host ``address``."""
    assert ld >= max(1, rows)
    itemsize = np.dtype(dtype).itemsize
    count = ld * (cols - 1) + rows
    memory = np.frombuffer((ctypes.c_char * (count * itemsize)).from_address(address), dtype)
    return np.lib.stride_tricks.as_strided(memory, shape=(rows, cols), strides=(itemsize, ld * itemsize))


class FakeCublas:
    """The cuBLAS library, as ``gemm._state["lib"]``: ``calls`` holds ``(name, handle, *arguments)``."""

    def __init__(self):
        self.created: list[int] = []
        self.calls: list[tuple] = []

    # the methods have cuBLAS's names and arguments; each returns CUBLAS_STATUS_SUCCESS
    def cublasCreate_v2(self, out):
        handle = out._obj                                    # ctypes.byref(c_void_p): where to write it
        handle.value = 0xC0B1A5 + len(self.created)
        self.created.append(handle.value)
        self.calls.append(("create", handle.value))
        return 0

    def cublasSetStream_v2(self, handle, stream):
        self.calls.append(("stream", handle.value, stream.value))
        return 0

    def cublasSetWorkspace_v2(self, handle, workspace, size):
        self.calls.append(("workspace", handle.value, workspace.value, size))
        return 0

    def cublasSetMathMode(self, handle, mode):
        self.calls.append(("math", handle.value, mode))
        return 0

    def cublasGemmEx(self, handle, transa, transb, m, n, k, alpha, a, a_type, lda, b, b_type, ldb,
                     beta, c, c_type, ldc, compute, algo):
        self.calls.append(("gemm", handle.value, compute, algo))
        assert a_type == b_type == c_type
        dtype = resolve_dtype(np, CUDA_TYPES[c_type])         # bfloat16: ml_dtypes'
        op_a = _column_major(a.value, dtype, *((m, k) if transa == 0 else (k, m)), lda)
        op_b = _column_major(b.value, dtype, *((k, n) if transb == 0 else (n, k)), ldb)
        op_a, op_b = (op_a if transa == 0 else op_a.T), (op_b if transb == 0 else op_b.T)
        out = _column_major(c.value, dtype, m, n, ldc)
        product = alpha._obj.value * (op_a.astype(np.float64) @ op_b.astype(np.float64))
        out[...] = product if beta._obj.value == 0 else product + beta._obj.value * out
        return 0

    def on(self, handle: int) -> list[tuple]:
        """The calls made on ``handle``, without it."""
        return [(call[0], *call[2:]) for call in self.calls if call[1] == handle]


def fake_cupy(allocations: list | None = None):
    """CuPy's parts that gemm uses: set ``.device`` and ``.stream`` for the current device id and
    stream address; ``cupys_handle_asked`` counts requests for CuPy's own cuBLAS handle (none allowed)."""
    xp = SimpleNamespace(uint8=np.uint8, device=0, stream=0x5000, cupys_handle_asked=0)

    def empty(shape, dtype):
        if allocations is not None:
            allocations.append(("empty", shape, np.dtype(dtype).name))
        return np.empty(shape, dtype)

    def cupys_handle():
        xp.cupys_handle_asked += 1
        raise AssertionError("CuPy's cuBLAS handle was asked for")

    xp.empty = empty
    xp.cuda = SimpleNamespace(Device=lambda: SimpleNamespace(id=xp.device),
                              get_current_stream=lambda: SimpleNamespace(ptr=xp.stream),
                              get_cublas_handle=cupys_handle, device=SimpleNamespace(get_cublas_handle=cupys_handle))
    return xp
