"""2-d matrix products that also work while a CUDA graph is being captured.

CuPy refuses every cuBLAS call while its stream is capturing (``NotImplementedError: calling cuBLAS
API during stream capture is currently unsupported``, CuPy 13 and 14: its ``setStream`` checks, and
its ``gemmEx`` calls it), so a training step with any product in it could not be captured (seen on
an H100, 2026-11-26). cuBLAS itself supports capture (its "CUDA Graphs support" section: everything
but results written to host memory). So while the current stream captures, :func:`matmul` calls
``cublasGemmEx`` itself, through ctypes, with the arguments CuPy's ``a @ b`` passes (the same operand
order, transposes, leading dimensions, compute type and algorithm choice; the 1 x 1 case stays
CuPy's reduction), so cuBLAS picks the same kernel and the replayed graph gives eager's bits.
Outside a capture, and for NumPy arrays, :func:`matmul` is ``a @ b``.

The captured products run on a cuBLAS handle of npformer's own, as llm.c keeps one handle and one
workspace for all its products (``llmc/cublas_common.h``): :func:`prepare_capture`, called before a
capture begins (:class:`npformer.training.cuda_graph.CudaGraphStep` does), creates it for the current
device, once, with a workspace it keeps (:data:`WORKSPACE_BYTES`), so that cuBLAS allocates nothing
inside the graph. Each captured product binds that handle to the current stream and workspace
(:func:`_bound_handle`). CuPy's own handle, which its eager products use, is never read or changed.

cuBLAS is column-major: a row-major C (M, N) is a column-major (N, M) matrix, so C = A B is computed
as C^T = B^T A^T, B first. An operand whose memory is Fortran-ordered is passed as it is, a
C-ordered one as the transpose of its memory, anything else after a copy (:func:`gemm_arguments`).
"""
from __future__ import annotations

import ctypes
import os
from typing import Any, NamedTuple

import numpy

from npformer.backend import is_cupy_array
from npformer.backend.matmul_precision import (CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_COMPUTE_64F,
                                               CUBLAS_COMPUTE_64F_PEDANTIC, CUBLAS_DEFAULT_MATH,
                                               CUBLAS_TF32_TENSOR_OP_MATH, cupy_cublas_compute_type)
from npformer.kernels.cuda.runtime import compute_capability

__all__ = ["matmul", "gemm_arguments", "GemmArguments", "prepare_capture", "CublasHandle", "capturing",
           "WORKSPACE_BYTES"]

# The handle's workspace: cuBLAS's documentation (cublasSetWorkspace) recommends 32 MiB on Hopper
# (sm_90) and 4 MiB on earlier GPUs, and llm.c keeps 32 MiB on every GPU; so does npformer (28 MiB
# more than needed before Hopper, once per device). Not less: given less room than the default pool
# CuPy's handle computes in, cuBLAS could choose another kernel than eager's (a split-K one needs
# workspace), and the replay would not give eager's bits (tests/kernels/cuda/test_gemm.py checks them).
WORKSPACE_BYTES = 32 << 20
# cuBLAS and CUDA enum values (cublas_api.h, library_types.h: a stable ABI)
_OP_N, _OP_T = 0, 1
_CUDA_TYPES = {"float16": 2, "float32": 0, "float64": 1, "bfloat16": 14}     # dtype name -> cudaDataType_t
_GEMM_DEFAULT, _GEMM_DEFAULT_TENSOR_OP = -1, 99
# The cuBLAS functions npformer calls, with their prototypes (cublas_api.h): each returns a status
_VOID_P, _INT = ctypes.c_void_p, ctypes.c_int
_PROTOTYPES = {
    "cublasCreate_v2": [_VOID_P],                                      # (cublasHandle_t *handle)
    "cublasSetStream_v2": [_VOID_P, _VOID_P],                          # (handle, cudaStream_t)
    "cublasSetWorkspace_v2": [_VOID_P, _VOID_P, ctypes.c_size_t],      # (handle, workspace, bytes)
    "cublasSetMathMode": [_VOID_P, _INT],                              # (handle, cublasMath_t)
    # (handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc,
    #  computeType, algo)
    "cublasGemmEx": [_VOID_P, _INT, _INT, _INT, _INT, _INT, _VOID_P, _VOID_P, _INT, _INT, _VOID_P, _INT, _INT,
                     _VOID_P, _VOID_P, _INT, _INT, _INT, _INT],
}

# "lib": the cuBLAS library (ctypes); "devices": device id -> its CublasHandle, made once
_state: dict[str, Any] = {"lib": None, "devices": {}}


class CublasHandle(NamedTuple):
    """npformer's cuBLAS handle on one device and the workspace its products compute in; both live as
    long as the process (as CuPy's handles do), so a captured graph can replay them at any time."""

    handle: int          # cublasHandle_t, created on this device
    workspace: Any       # (WORKSPACE_BYTES,) uint8 device array


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
    import cupy
    return _gemm_in_capture(a, b, cupy)


def prepare_capture(xp) -> CublasHandle:
    """npformer's cuBLAS handle and workspace on the current device, created on the first call for
    it (``xp``: cupy). Call it before a capture begins: creating a handle allocates device memory,
    and the workspace must not come from the graph's memory pool. One handle per device, not per
    thread: two threads capturing on one device at once would rebind each other's stream (npformer
    captures from one thread)."""
    device = xp.cuda.Device().id
    found = _state["devices"].get(device)
    if found is None:
        lib = _library()
        handle = ctypes.c_void_p()
        _check(lib.cublasCreate_v2(ctypes.byref(handle)), "cublasCreate")     # on the current device
        found = CublasHandle(handle.value, xp.empty(WORKSPACE_BYTES, dtype=xp.uint8))
        _state["devices"][device] = found
    return found


def _bound_handle(xp, compute: int) -> ctypes.c_void_p:
    """The current device's handle, bound to the current stream, its workspace, and the math mode
    npformer gives CuPy's handle with this compute type (the TF32 switch sets both)."""
    device = xp.cuda.Device().id
    own = _state["devices"].get(device)
    if own is None:
        raise RuntimeError(f"captured matmul: npformer's cuBLAS handle for device {device} is made before a "
                           "capture begins: call npformer.kernels.cuda.gemm.prepare_capture(cupy) first "
                           "(CudaGraphStep does)")
    lib = _state["lib"]
    handle = ctypes.c_void_p(own.handle)
    _check(lib.cublasSetStream_v2(handle, ctypes.c_void_p(xp.cuda.get_current_stream().ptr)), "cublasSetStream")
    # after the stream: cublasSetStream puts the handle back on cuBLAS's default workspace pool
    _check(lib.cublasSetWorkspace_v2(handle, ctypes.c_void_p(_address(own.workspace)), WORKSPACE_BYTES),
           "cublasSetWorkspace")
    math = CUBLAS_TF32_TENSOR_OP_MATH if compute == CUBLAS_COMPUTE_32F_FAST_TF32 else CUBLAS_DEFAULT_MATH
    _check(lib.cublasSetMathMode(handle, math), "cublasSetMathMode")
    return handle


def _gemm_in_capture(a, b, xp):
    dtype = numpy.dtype(a.dtype)
    if dtype.name not in _CUDA_TYPES or b.dtype != dtype:
        raise TypeError(f"captured matmul: expected two float16/32/64 or bfloat16 arrays of one dtype, got "
                        f"{a.dtype} and {b.dtype}")
    call = gemm_arguments(a, b)
    out = xp.empty((a.shape[0], b.shape[1]), dtype=dtype)              # (M, N)
    compute = cupy_cublas_compute_type(dtype)
    scalar = ctypes.c_double if compute in (CUBLAS_COMPUTE_64F, CUBLAS_COMPUTE_64F_PEDANTIC) else ctypes.c_float
    one, zero = scalar(1.0), scalar(0.0)                               # out = 1 * A B + 0 * out
    capability = compute_capability()
    algo = _GEMM_DEFAULT_TENSOR_OP if capability >= 80 or (capability >= 70 and dtype == numpy.float16) \
        else _GEMM_DEFAULT
    handle = _bound_handle(xp, compute)
    cuda_type = _CUDA_TYPES[dtype.name]
    _check(_state["lib"].cublasGemmEx(
        handle, call.trans_first, call.trans_second, call.m, call.n, call.k, ctypes.byref(one),
        ctypes.c_void_p(_address(call.first)), cuda_type, call.ld_first,
        ctypes.c_void_p(_address(call.second)), cuda_type, call.ld_second, ctypes.byref(zero),
        ctypes.c_void_p(_address(out)), cuda_type, call.ldc, compute, algo), "cublasGemmEx")
    return out


def _address(x) -> int:
    """A CuPy array's device address (a test with NumPy arrays swaps in their host address)."""
    return x.data.ptr


def _library():
    """The cuBLAS library CuPy loaded, opened with ctypes and given the prototypes (once).

    ``cupy.cuda.cublas`` loads it (CuPy 14 through NVIDIA's cuda-pathfinder, CuPy 13 through the
    dynamic linker); ``RTLD_NOLOAD`` then opens the copy already loaded under its soname
    (``libcublas.so.<CUDA major>``, as cuda-pathfinder checks for one), and never loads a second one,
    so these calls and CuPy's eager products run the same cuBLAS."""
    if _state["lib"] is None:
        import cupy
        cupy.cuda.cublas                                                 # noqa: B018 (loads the library)
        soname = f"libcublas.so.{cupy.cuda.runtime.runtimeGetVersion() // 1000}"
        try:
            lib = ctypes.CDLL(soname, mode=os.RTLD_NOLOAD)
        except OSError as exc:
            raise RuntimeError(f"captured matmul: {soname}, the cuBLAS of CuPy's CUDA version, is not loaded "
                               f"in this process after CuPy's cuBLAS module was imported ({exc})") from exc
        for name, argtypes in _PROTOTYPES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
        _state["lib"] = lib
    return _state["lib"]


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"captured matmul: {what} returned cuBLAS status {status}")
