"""Which arrays the CUDA paths take, compiling the kernels once, and launching them.

``import`` of this module never imports CuPy: :func:`device_floats` only looks at the arrays it is
given (a CuPy array implies CuPy is loaded), and CuPy is imported when a kernel is first launched.
"""
from __future__ import annotations

import importlib
from typing import Any, NamedTuple

import numpy

from npformer.backend import accumulation_dtype, is_cupy_array
from npformer.errors import InputTypeError, ShapeError
from npformer.kernels.cuda.source import COL_X, COL_Y, CUDA_SOURCE, MAX_THREADS, NVRTC_OPTIONS, TYPES, cuda_type

__all__ = ["Module", "device_floats", "address", "kernel", "launch_rows", "launch_elements", "launch_columns",
           "shipped_modules", "check_capability", "COMMON_MODULE", "ELEMENT_THREADS", "BFLOAT16_CAPABILITY"]

MAX_GRID = 65535        # blocks per launch axis; the kernels loop over what is left (grid-stride)
MAX_CHUNKS = 512        # row chunks of a column pass (their partial sums are added at the end)
ELEMENT_THREADS = 256   # threads per block of the element-wise launches
COMMON_MODULE = "common"
BFLOAT16_CAPABILITY = 80    # bfloat16 on the GPU (cvt.rn.bf16.f32, mma.sync .bf16): compute capability 8.0 on
# The theoretical occupancy (resident warps per SM / 64) each kernel of the common module keeps at
# its launcher's block size, on (sm_80, sm_90), every dtype: the lowest benchmarks/cuda_kernels.py
# measured on 2026-11-27 (registers limit the ones under 1.0). tests/kernels/cuda/test_compile.py
# holds every kernel to it, so a change that costs occupancy is seen; raise a floor when a kernel gains.
# 2026-11-29, the layer norms keep mu instead of x-hat: their forwards reach 1.0 on sm_90 (no x-hat
# written), their backwards recompute x-hat and take 34 registers on sm_90 in float64 alone (the
# gradient checks' dtype; float32 and the 16-bit types 25-30): 0.75 there.
# 2026-11-30, the fused backwards hash the dropout mask again from its seed: add_dropout_ln_bwd takes 37
# registers on sm_80 in float64 alone (0.75; the others 32); bias_gelu_bwd 38 in float32 on sm_80 (0.75,
# within its floor; 32 on sm_90, and 29-30 in the 16-bit types on both) and 44 in float64 on sm_90 (0.625).
OCCUPANCY_FLOORS = {
    "softmax_fwd": (1.0, 1.0), "softmax_bwd": (1.0, 1.0), "layer_norm_fwd": (1.0, 1.0),
    "layer_norm_bwd": (1.0, 0.75), "ln_param_grads": (1.0, 1.0), "bias_grad": (1.0, 1.0),
    "bias_gelu_bwd": (0.75, 0.625), "gelu_fwd": (1.0, 0.625), "gelu_bwd": (1.0, 1.0), "bias_gelu_fwd": (1.0, 1.0),
    "bias_add": (0.75, 1.0), "dropout_fwd": (1.0, 1.0), "dropout_bwd": (1.0, 1.0), "add_dropout_fwd": (1.0, 1.0),
    "add_dropout_ln_fwd": (1.0, 1.0), "add_dropout_ln_bwd": (0.75, 0.75), "cross_entropy_fwd": (1.0, 1.0),
    "cross_entropy_bwd": (1.0, 1.0), "adam_update": (0.625, 0.625), "adam_bf16_copy_update": (0.625, 0.625),
    "adam_f16_grad_update": (0.625, 0.625), "adam_bf16_grad_update": (0.625, 0.625), "sum_squares": (1.0, 1.0),
}


class Module(NamedTuple):
    """One CUDA module: its source, NVRTC options, and the template instantiations it compiles
    (``{name in tables and reports: name expression}``, CuPy's RawModule ``name_expressions``; the
    ``extern "C"`` kernels of the source need none), and the compute capabilities it is compiled for
    (``benchmarks/cuda_kernels.py`` checks it for those; the Hopper modules, sm_90a: 9.0 only)."""
    source: str
    options: tuple
    kernels: dict
    archs: tuple = (80, 90)


def shipped_modules() -> dict[str, Module]:
    """Every CUDA module npformer compiles, by name: the one list the runtime compiles from and
    ``benchmarks/cuda_kernels.py`` checks with NVIDIA's compiler (CuPy appends its own options:
    ``-ftz=true``, the architecture, ``--device-as-default-execution-space``)."""
    from npformer.kernels.cuda.flash_source import (FLASH_NVRTC_OPTIONS, FLASH_SOURCE, FLASH_WGMMA_NVRTC_OPTIONS,
                                                    MODULE_KERNELS, WGMMA_MODULE_KERNELS)
    modules = {COMMON_MODULE: Module(CUDA_SOURCE, NVRTC_OPTIONS, {})}
    for (dtype, d), kernels in MODULE_KERNELS.items():
        modules[flash_module_name(dtype, d)] = Module(FLASH_SOURCE, FLASH_NVRTC_OPTIONS, kernels)
    for (dtype, d), kernels in WGMMA_MODULE_KERNELS.items():
        modules[flash_module_name(dtype, d, wgmma=True)] = Module(FLASH_SOURCE, FLASH_WGMMA_NVRTC_OPTIONS, kernels,
                                                                  (90,))
    return modules


def flash_module_name(dtype: Any, d: int, wgmma: bool = False) -> str:
    """``flash_<f16|bf16|f32|f64>_d<D>``: the name of the flash attention module of ``dtype`` and bucket D
    (``..._sm90a``: its Hopper kernels, ``wgmma``)."""
    return f"flash_{cuda_type(dtype)[2]}_d{d}" + ("_sm90a" if wgmma else "")


# Whether an array is one the kernels run on: a CuPy array. A name of its own, not a wrapper (one call
# fewer at each fast path's test), which the tests' CPU emulation of the kernels swaps for NumPy arrays.
is_device_array = is_cupy_array


def device_floats(*arrays: Any, dtype: Any = None) -> bool:
    """Whether the CUDA paths take these arrays (cheap; never imports CuPy).

    True when every non-None argument is a non-empty CuPy array, all of one dtype among
    float16/bfloat16/float32/float64 (and of ``dtype``, when given). Anything else (NumPy arrays,
    mixed dtypes, empty arrays, non-arrays) goes to the reference op, which also gives the error
    messages for bad input.
    """
    found = None
    for a in arrays:
        if a is None:
            continue
        if not is_device_array(a) or a.size == 0:
            return False
        if found is None:
            found = a.dtype
        elif a.dtype != found:
            return False
    return found is not None and found.name in TYPES and (dtype is None or numpy.dtype(dtype) == found)


def array_module():
    """The array module of the fused path: cupy (the CPU emulation swaps in numpy)."""
    return importlib.import_module("cupy")


def compute_capability() -> int:
    """The current GPU's compute capability as an int (90 for an H100); the CPU emulation says 90."""
    return int(importlib.import_module("cupy").cuda.Device().compute_capability)


def float32_on_tf32() -> bool:
    """Whether CuPy's float32 products run on TF32 tensor cores (the opt-in of
    :func:`npformer.backend.set_float32_matmul_precision`): the fused kernels that multiply tiles of
    float32 (flash attention) follow it."""
    from npformer.backend.matmul_precision import cupy_float32_on_tf32
    return cupy_float32_on_tf32()


def check_capability(dtype: Any) -> None:
    """InputTypeError for bfloat16 on a GPU below compute capability 8.0 (it has no bfloat16 conversions
    nor tensor-core products: an A100, H100 or H200 has them); the kernels call it before their first
    launch of a dtype."""
    if numpy.dtype(dtype).name == "bfloat16" and compute_capability() < BFLOAT16_CAPABILITY:
        c = compute_capability()
        raise InputTypeError(f"bfloat16 arrays on a GPU of compute capability {c // 10}.{c % 10}: the CUDA kernels "
                             f"take bfloat16 from compute capability {BFLOAT16_CAPABILITY // 10}.0 on (an A100, "
                             "H100 or H200); use float16 on this GPU")


def address(a) -> int:
    """The device address of CuPy array ``a``'s first element (a pointer field of a kernel's params
    struct; the CPU emulation gives a NumPy array's)."""
    return a.data.ptr


def compile_module(source: str, options: tuple, name_expressions: tuple = ()):
    """One ``cupy.RawModule`` (NVRTC compiles it on the first kernel lookup; CuPy caches the binary), with
    the template instantiations ``name_expressions`` (get_function takes each)."""
    return importlib.import_module("cupy").RawModule(code=source, options=options,
                                                     name_expressions=tuple(name_expressions) or None)


_cache: dict = {}


def kernel(name: str, dtype: Any):
    """The entry point ``npf_<name>_<f16|bf16|f32|f64>``, looked up once per name and dtype."""
    key = (name, numpy.dtype(dtype))
    fn = _cache.get(key)
    if fn is None:
        check_capability(key[1])
        if "module" not in _cache:
            module = shipped_modules()[COMMON_MODULE]
            _cache["module"] = compile_module(module.source, module.options)
        fn = _cache[key] = _cache["module"].get_function(f"npf_{name}_{cuda_type(key[1])[2]}")
    return fn


def device_xp(*arrays: Any):
    """The array module for these arrays; TypeError unless each is a CuPy array of a supported dtype."""
    for a in arrays:
        if a is None:
            continue
        if not is_device_array(a):
            raise InputTypeError(f"the fused CUDA kernels take CuPy arrays; got {type(a).__module__}."
                            f"{type(a).__name__} (the reference op takes NumPy arrays)")
        if a.dtype.name not in TYPES:
            raise InputTypeError(f"the fused CUDA kernels take float16, bfloat16, float32 or float64 arrays; "
                                 f"got {a.dtype}")
    return array_module()


def contiguous(xp, a):
    """``a`` itself when C-contiguous (the kernels index flat rows), else a contiguous copy."""
    return a if a.flags.c_contiguous else xp.ascontiguousarray(a)


def rows_of(x) -> tuple[int, int]:
    """(number of rows, row length) of ``x`` seen as (..., N); ValueError for 0-d or N = 0."""
    if x.ndim < 1:
        raise ShapeError("x: expected at least 1 axis (..., N), got a 0-d array")
    n = x.shape[-1]
    if n == 0:
        raise ShapeError(f"x: the last axis is empty (shape {tuple(x.shape)}); rows need at least one value")
    if n >= 2 ** 31:
        raise ValueError(f"rows of {n} values are longer than the kernels' int index allows")
    return x.size // n, n


def row_threads(n: int) -> int:
    """Threads per row block: the power of two >= n, between 32 (one warp) and MAX_THREADS."""
    t = 32
    while t < n and t < MAX_THREADS:
        t *= 2
    return t


def launch_rows(name: str, dtype: Any, rows: int, n: int, args: tuple) -> None:
    """One block per row (grid-stride over rows beyond MAX_GRID)."""
    kernel(name, dtype)((min(rows, MAX_GRID),), (row_threads(n),), args)


def launch_elements(name: str, dtype: Any, total: int, args: tuple) -> None:
    """ELEMENT_THREADS threads a block, one element per thread (grid-stride beyond MAX_GRID blocks)."""
    kernel(name, dtype)((max(1, min(-(-total // ELEMENT_THREADS), MAX_GRID)),), (ELEMENT_THREADS,), args)


def launch_columns(xp, name: str, dtype: Any, rows: int, n: int, before: tuple, after: tuple,
                   n_partials: int) -> list:
    """A column pass over (rows, n); returns its ``n_partials`` partial sums, each (n_chunks, n).

    The kernel's arguments are ``before``, the partial-sum arrays, ``rows, n, chunk``, ``after``.
    """
    chunk = max(COL_Y, -(-rows // MAX_CHUNKS))
    n_chunks = -(-rows // chunk)
    parts = [xp.empty((n_chunks, n), dtype=accumulation_dtype(dtype)) for _ in range(n_partials)]
    args = tuple(before) + tuple(parts) + (numpy.int64(rows), numpy.int32(n), numpy.int64(chunk)) + tuple(after)
    kernel(name, dtype)((-(-n // COL_X), n_chunks), (COL_X, COL_Y), args)
    return parts
