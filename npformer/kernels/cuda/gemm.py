"""2-d matrix products that also work while a CUDA graph is being captured.

CuPy refuses every cuBLAS call while its stream is capturing (``NotImplementedError: calling cuBLAS
API during stream capture is currently unsupported``, CuPy 13 and 14: its ``setStream`` checks), so a
training step with any product in it could not be captured (seen on an H100, 2026-11-26). cuBLAS
itself supports capture (its "CUDA Graphs support" section: everything but results written to host
memory). So while the current stream captures, :func:`matmul` calls ``cublasGemmEx`` itself, through
ctypes, on CuPy's own cuBLAS handle, with the arguments CuPy's ``a @ b`` passes (the same operand
order, transposes, leading dimensions, compute type and algorithm choice; the 1 x 1 case stays
CuPy's reduction), so cuBLAS picks the same kernel and the replayed graph gives eager's bits. Before
the call the handle gets the capturing stream and a workspace of its own
(:data:`WORKSPACE_BYTES`, reserved before the capture by :func:`reserve_workspace`), so cuBLAS
allocates nothing inside the graph. Outside a capture, and for NumPy arrays, :func:`matmul` is
``a @ b``.

cuBLAS is column-major: a row-major C (M, N) is a column-major (N, M) matrix, so C = A B is computed
as C^T = B^T A^T, B first. An operand whose memory is Fortran-ordered is passed as it is, a
C-ordered one as the transpose of its memory, anything else after a copy (:func:`gemm_arguments`).
"""
from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any, NamedTuple

import numpy

from npformer.backend import is_cupy_array
from npformer.kernels.cuda.runtime import compute_capability

__all__ = ["matmul", "gemm_arguments", "GemmArguments", "reserve_workspace", "capturing", "WORKSPACE_BYTES"]

WORKSPACE_BYTES = 32 << 20          # NVIDIA's advice for Hopper (4 MiB suffices before it)
# cuBLAS and CUDA enum values (cublas_api.h, library_types.h: a stable ABI; CuPy 14 no longer names some)
_OP_N, _OP_T = 0, 1
_CUDA_TYPES = {numpy.dtype(numpy.float16): 2, numpy.dtype(numpy.float32): 0, numpy.dtype(numpy.float64): 1}
_COMPUTE_32F, _COMPUTE_32F_PEDANTIC, _COMPUTE_32F_FAST_TF32 = 68, 69, 77
_COMPUTE_64F, _COMPUTE_64F_PEDANTIC = 70, 71
_GEMM_DEFAULT, _GEMM_DEFAULT_TENSOR_OP = -1, 99

_state: dict[str, Any] = {"lib": None, "workspace": {}}


class GemmArguments(NamedTuple):
    """A column-major ``cublasGemmEx`` call computing the row-major (M, N) product A B."""

    trans_first: int     # CUBLAS_OP_N or _T, of the first operand (from B)
    trans_second: int    # of the second operand (from A)
    m: int               # N
    n: int               # M
    k: int               # K
    first: Any           # B, or its copy
    ld_first: int
    second: Any          # A^T's memory: A, or its copy
    ld_second: int
    ldc: int             # N: the output is C-contiguous


def _operand(x, trans: int) -> tuple[Any, int, int]:
    """(array, op, leading dimension) for a 2-d operand ``x`` wanted as ``op(x)``-in-memory: Fortran
    order as it is (ld: its column stride, at least its rows), C order as the transposed op (ld: its
    row stride), else a C-ordered copy."""
    size = x.dtype.itemsize
    if x.flags.f_contiguous:
        return x, trans, max(x.strides[1] // size, x.shape[0])
    if not x.flags.c_contiguous:
        x = x.copy()
    return x, 1 - trans, x.strides[0] // size


def gemm_arguments(a, b) -> GemmArguments:
    """The call for ``a @ b``, ``a`` (M, K) and ``b`` (K, N) of one float dtype: CuPy's own choice
    (it views ``a`` as its transpose (K, M) and ``b`` as (K, N), then asks for C^T = B^T A^T)."""
    m_rows, k = a.shape
    n_cols = b.shape[1]
    second, trans_a, lda = _operand(a.T, _OP_N)           # (K, M): A^T
    first, trans_b, ldb = _operand(b, _OP_T)              # (K, N)
    return GemmArguments(trans_b, trans_a, n_cols, m_rows, k, first, ldb, second, lda, n_cols)


def capturing(a) -> bool:
    """Whether ``a`` is a CuPy array and the current CUDA stream is capturing a graph."""
    if not is_cupy_array(a):
        return False
    import cupy
    return bool(cupy.cuda.get_current_stream().is_capturing())


def matmul(a, b):
    """``a @ b`` for 2-d arrays of one float dtype; cuBLAS called directly while a graph is captured."""
    if not capturing(a) or a.shape[0] * b.shape[1] == 1 or a.size == 0 or b.size == 0:
        return a @ b                                       # (the 1 x 1 and empty cases call no cuBLAS)
    return _gemm_in_capture(a, b)


def reserve_workspace(xp) -> None:
    """Allocate the current device's cuBLAS workspace for captured products (once; call it before a
    capture begins, so the graph's memory pool does not hold it)."""
    device = xp.cuda.Device().id
    if device not in _state["workspace"]:
        _state["workspace"][device] = xp.empty(WORKSPACE_BYTES, dtype=xp.uint8)


def _gemm_in_capture(a, b):
    import cupy
    from cupy._core import _routines_linalg as linalg
    dtype = numpy.dtype(a.dtype)
    if dtype not in _CUDA_TYPES or b.dtype != dtype:
        raise TypeError(f"captured matmul: expected two float16/32/64 arrays of one dtype, got {a.dtype} and "
                        f"{b.dtype}")
    call = gemm_arguments(a, b)
    out = cupy.empty((a.shape[0], b.shape[1]), dtype=dtype)
    compute = _compute_type(linalg, dtype)
    scalar = ctypes.c_double if compute in (_COMPUTE_64F, _COMPUTE_64F_PEDANTIC) else ctypes.c_float
    one, zero = scalar(1.0), scalar(0.0)
    capability = compute_capability()
    algo = _GEMM_DEFAULT_TENSOR_OP if capability >= 80 or (capability >= 70 and dtype == numpy.float16) \
        else _GEMM_DEFAULT
    lib = _cublas()
    handle = ctypes.c_void_p(cupy.cuda.device.get_cublas_handle())
    _check(lib.cublasSetStream_v2(handle, ctypes.c_void_p(cupy.cuda.get_current_stream().ptr)), "cublasSetStream")
    reserve_workspace(cupy)
    workspace = _state["workspace"][cupy.cuda.Device().id]
    _check(lib.cublasSetWorkspace_v2(handle, ctypes.c_void_p(workspace.data.ptr), ctypes.c_size_t(WORKSPACE_BYTES)),
           "cublasSetWorkspace")
    cuda_type = _CUDA_TYPES[dtype]
    _check(lib.cublasGemmEx(handle, call.trans_first, call.trans_second, call.m, call.n, call.k, ctypes.byref(one),
                            ctypes.c_void_p(call.first.data.ptr), cuda_type, call.ld_first,
                            ctypes.c_void_p(call.second.data.ptr), cuda_type, call.ld_second, ctypes.byref(zero),
                            ctypes.c_void_p(out.data.ptr), cuda_type, call.ldc, compute, algo), "cublasGemmEx")
    return out


def _compute_type(linalg, dtype) -> int:
    """cuBLAS's compute type for ``dtype`` as CuPy would choose it (npformer's TF32 switch included)."""
    chosen = linalg.get_compute_type(dtype)
    if dtype == numpy.float64:
        return _COMPUTE_64F_PEDANTIC if chosen == linalg.COMPUTE_TYPE_PEDANTIC else _COMPUTE_64F
    if chosen == linalg.COMPUTE_TYPE_PEDANTIC:
        return _COMPUTE_32F_PEDANTIC
    if chosen == linalg.COMPUTE_TYPE_TF32 and dtype == numpy.float32:
        return _COMPUTE_32F_FAST_TF32
    return _COMPUTE_32F


def _cublas():
    """The cuBLAS library CuPy loaded (found among this process's mapped files), with the prototypes."""
    if _state["lib"] is None:
        lib = ctypes.CDLL(_cublas_path())
        lib.cublasSetStream_v2.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.cublasSetWorkspace_v2.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        lib.cublasGemmEx.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                     ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                     ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                     ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        for fn in (lib.cublasSetStream_v2, lib.cublasSetWorkspace_v2, lib.cublasGemmEx):
            fn.restype = ctypes.c_int
        _state["lib"] = lib
    return _state["lib"]


def _cublas_path() -> str:
    """The path of the libcublas CuPy uses: its handle is created first, so the library is mapped."""
    import cupy
    cupy.cuda.device.get_cublas_handle()
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if "/libcublas.so" in path:
                    return path
    except OSError:
        pass
    found = ctypes.util.find_library("cublas")
    if found is None:
        raise RuntimeError("captured matmul: the cuBLAS library CuPy uses was not found in this process")
    return found


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"captured matmul: {what} returned cuBLAS status {status}")
