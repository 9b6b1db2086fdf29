"""How CuPy's matrix products compute: TF32 as an opt-in for float32, float16 on tensor cores with
float32 accumulation (re-exported by :mod:`npformer.backend`).

cuBLAS takes a *compute type* per product, besides the inputs' dtype. What CuPy asks for:

=================  ========================================  ==========================================
inputs             CuPy's default                            here
=================  ========================================  ==========================================
float32            ``CUBLAS_COMPUTE_32F``: exact float32     the same, or with
                   multiply-adds (CUDA cores)                ``set_float32_matmul_precision("tf32")``
                                                             ``CUBLAS_COMPUTE_32F_FAST_TF32``: inputs
                                                             rounded to TF32 (10 mantissa bits) on
                                                             tensor cores, float32 accumulation
float16            ``CUBLAS_COMPUTE_32F`` with the tensor-   set explicitly to CuPy's FP32 compute type
                   core algorithm (compute capability >= 7)  (the same today): float16 products,
                                                             float32 sums, never float16 accumulation
=================  ========================================  ==========================================

This holds for CuPy's 2-d products (``cupy.dot``/``matmul`` of matrices), which are what every
:mod:`npformer.ops.linear` product is (leading axes are flattened first). CuPy's batched products
(``matmul`` of 3-d and more arrays, e.g. the plain attention's ``q @ k^T``) take a different route:
they copy non-contiguous operands, compute float16 in float32 (a converted copy), and use the cuBLAS
handle's math mode, which TF32 mode sets too (``CUBLAS_TF32_TENSOR_OP_MATH``). The CUDA flash
attention (the default on CuPy) does not go through cuBLAS; it follows the same switch with its own
kernels: float32 on TF32 tensor cores (mma.sync m16n8k8) while TF32 is on, float32 multiply-adds
otherwise (:func:`npformer.kernels.cuda.flash_attention.tensor_core_variant`).

TF32 keeps float32's range but only about 3 significant decimal digits per input, the precision
PyTorch's ``torch.backends.cuda.matmul.allow_tf32 = True`` chooses; so it is an opt-in
(``npformer train --tf32``, ``TrainConfig.tf32``). It needs compute capability 8.0 (Ampere) or later;
CuPy warns and keeps float32 on an older GPU. NumPy's BLAS has no such mode: asking for TF32 on the
NumPy backend is an error, not a silent no-op.
"""
from __future__ import annotations

import importlib
from types import ModuleType

import numpy

from npformer.backend.array_module import get_backend
from npformer.errors import RangeError

__all__ = ["FLOAT32_MATMUL_PRECISIONS", "set_float32_matmul_precision", "float32_matmul_precision"]

FLOAT32_MATMUL_PRECISIONS = ("highest", "tf32")     # float32 multiply-adds, or TF32 tensor cores
# cublasMath_t and cublasComputeType_t values (cublas_api.h, a stable ABI): CuPy 14's bindings no
# longer name the TF32 math mode
CUBLAS_DEFAULT_MATH, CUBLAS_TF32_TENSOR_OP_MATH = 0, 3
CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_PEDANTIC, CUBLAS_COMPUTE_32F_FAST_TF32 = 68, 69, 77
CUBLAS_COMPUTE_64F, CUBLAS_COMPUTE_64F_PEDANTIC = 70, 71


def _cupy_parts():
    """(CuPy's matmul module, the cuBLAS bindings, this thread's cuBLAS handle)."""
    linalg = importlib.import_module("cupy._core._routines_linalg")
    cublas = importlib.import_module("cupy_backends.cuda.libs.cublas")
    handle = importlib.import_module("cupy.cuda.device").get_cublas_handle()
    return linalg, cublas, handle


def set_float32_matmul_precision(precision: str, backend: str | ModuleType = "cupy") -> None:
    """``"tf32"``: CuPy's float32 products on TF32 tensor cores from now on (this process, this
    thread's cuBLAS handle); ``"highest"``: exact float32 again (the default). Either way float16
    products are set to accumulate in float32 on tensor cores.

    RangeError for ``"tf32"`` on the NumPy backend (it has no such mode); ``"highest"`` there is
    what NumPy always does, and accepted.
    """
    if precision not in FLOAT32_MATMUL_PRECISIONS:
        raise RangeError(f"float32 matmul precision: expected one of {', '.join(map(repr, FLOAT32_MATMUL_PRECISIONS))}, "
                         f"got {precision!r}")
    xp = get_backend(backend)
    if xp is numpy:
        if precision == "tf32":
            raise RangeError("TF32 is a tensor-core mode of NVIDIA GPUs (CuPy backend); the numpy backend "
                             "computes float32 products in float32: use backend 'cupy', or leave TF32 off")
        return
    linalg, cublas, handle = _cupy_parts()
    apply_matmul_precision(linalg, cublas, handle, precision == "tf32")


def apply_matmul_precision(linalg, cublas, handle, tf32: bool) -> None:
    """Set the compute types on CuPy's matmul module ``linalg`` and the math mode of ``handle``
    (the parts are passed in so that a test can hand in stand-ins)."""
    linalg.set_compute_type(numpy.float16, linalg.COMPUTE_TYPE_FP32)             # float32 accumulation
    linalg.set_compute_type(numpy.float32, linalg.COMPUTE_TYPE_TF32 if tf32 else linalg.COMPUTE_TYPE_DEFAULT)
    cublas.setMathMode(handle, CUBLAS_TF32_TENSOR_OP_MATH if tf32 else CUBLAS_DEFAULT_MATH)


def float32_matmul_precision(backend: str | ModuleType = "cupy") -> str:
    """``"tf32"`` when CuPy's float32 products run on TF32 tensor cores, else ``"highest"``."""
    xp = get_backend(backend)
    if xp is numpy:
        return "highest"
    return "tf32" if cupy_float32_on_tf32() else "highest"


def cupy_float32_on_tf32() -> bool:
    """Whether CuPy's float32 products run on TF32 now (CuPy imported, no device query: cheap enough
    for the kernels that follow the setting to ask at each call)."""
    linalg = importlib.import_module("cupy._core._routines_linalg")
    return linalg.get_compute_type(numpy.float32) == linalg.COMPUTE_TYPE_TF32


def cupy_cublas_compute_type(dtype) -> int:
    """The ``cublasComputeType_t`` CuPy's 2-d product of two ``dtype`` arrays (float16/32/64) asks
    cuBLAS for now: CuPy's compute-type setting for ``dtype`` (this module's TF32 switch, or CuPy's
    ``CUPY_TF32``), mapped as CuPy's ``tensordot_core_v11`` maps it. The products npformer makes
    itself while a CUDA graph is captured (:mod:`npformer.kernels.cuda.gemm`) pass the same, so that
    they compute as CuPy's eager ``a @ b`` does."""
    if numpy.dtype(dtype).name == "bfloat16":
        return CUBLAS_COMPUTE_32F                 # cuBLAS's one compute type for bfloat16 products (not TF32)
    linalg = importlib.import_module("cupy._core._routines_linalg")
    chosen = linalg.get_compute_type(dtype)
    if numpy.dtype(dtype) == numpy.float64:
        return CUBLAS_COMPUTE_64F_PEDANTIC if chosen == linalg.COMPUTE_TYPE_PEDANTIC else CUBLAS_COMPUTE_64F
    if chosen == linalg.COMPUTE_TYPE_PEDANTIC:
        return CUBLAS_COMPUTE_32F_PEDANTIC
    if chosen == linalg.COMPUTE_TYPE_TF32 and numpy.dtype(dtype) == numpy.float32:
        return CUBLAS_COMPUTE_32F_FAST_TF32
    return CUBLAS_COMPUTE_32F
