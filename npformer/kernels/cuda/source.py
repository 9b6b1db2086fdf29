"""The CUDA C behind npformer.kernels.cuda: every kernel in one source, compiled once by NVRTC.

Each kernel's formula is in the comment above it. Types: ``T`` is the storage type (``unsigned
short`` for float16, read and written as its 16 bits; ``npf_bf16`` for bfloat16, its 16 bits in a
struct of their own, prelude.cuh; ``float``; ``double``), ``A`` the type the arithmetic runs in
(``float`` for float16, bfloat16 and float32, ``double`` for float64), as the reference ops'
``accumulation_dtype``. The templates are instantiated per dtype as ``extern "C"`` entry points
named ``npf_<kernel>_<f16|bf16|f32|f64>`` (no C++ name mangling to look up).

Only :data:`HALF_CONVERSIONS` (two PTX ``cvt`` instructions) is device specific; the rest is plain
C++ plus CUDA's math functions (bfloat16's store: ``cvt.rn.bf16.f32`` on sm_80 and later, the same
bits in C elsewhere), which is what lets the tests compile and run it on the CPU
(tests/kernels/cuda/emulator.py) where no GPU is present.
"""
from __future__ import annotations

import re

import numpy

from npformer.kernels.cuda.files import read_source
from npformer.kernels.cuda.fused_source import FUSED_ENTRY_POINTS, FUSED_KERNELS
from npformer.kernels.cuda.optim_source import OPTIM_SOURCE
from npformer.ops.activations import INV_SQRT_2, INV_SQRT_2PI, SQRT_2_OVER_PI, TANH_CUBIC
from npformer.ops.dropout import SPLITMIX64

__all__ = ["HALF_CONVERSIONS", "PRELUDE", "KERNELS_SOURCE", "CUDA_SOURCE", "NVRTC_OPTIONS", "TYPES", "cuda_type",
           "dtype_name", "MAX_THREADS", "COL_X", "COL_Y"]


MAX_THREADS = 256       # threads per block of the row kernels (a power of two)
COL_X, COL_Y = 32, 8    # the column kernels' block: 32 columns x 8 row lanes

# Storage type, accumulation type and entry-point suffix per dtype, by the dtype's name: bfloat16 is
# ml_dtypes' (numpy.dtype(ml_dtypes.bfloat16), which CuPy allocates), named here so that nothing imports
# ml_dtypes (an optional extra) before a bfloat16 array exists.
TYPES = {"float16": ("unsigned short", "float", "f16"), "bfloat16": ("npf_bf16", "float", "bf16"),
         "float32": ("float", "float", "f32"), "float64": ("double", "double", "f64")}


def dtype_name(dtype) -> str:
    """The name :data:`TYPES` knows ``dtype`` by (a dtype, a scalar type, or already a name)."""
    return dtype if isinstance(dtype, str) and dtype in TYPES else numpy.dtype(dtype).name


def cuda_type(dtype) -> tuple[str, str, str] | None:
    """(storage type, arithmetic type, suffix) of ``dtype`` (a dtype, a scalar type or a name) from
    :data:`TYPES`; None for a dtype the kernels do not take."""
    return TYPES.get(dtype_name(dtype))

HALF_CONVERSIONS = read_source("half.cuh")
# A backward kernel's flag ``drop``: where it finds the forward's keep bits (nothing dropped, the stored
# booleans, the seed hashed again; npformer.kernels.cuda.dropout.keep_arguments passes them).
DROP_FLAGS = {"DROP_NONE": 0, "DROP_STORED": 1, "DROP_HASHED": 2}
# What every module starts with, dropout's hash constants (npformer.ops.dropout.SPLITMIX64) written into
# its npf_keep as CUDA C literals, and the flags above as its NPF_DROP_* macros.
_PRELUDE_LITERALS = {**{name: f"0x{value:016X}" for name, value in zip(("GOLDEN", "MIX1", "MIX2"), SPLITMIX64)},
                     **{name: str(value) for name, value in DROP_FLAGS.items()}}
PRELUDE = re.sub(r"@(\w+)@", lambda m: _PRELUDE_LITERALS[m.group(1)], read_source("prelude.cuh"))

# The kernels. @NAME@ placeholders are filled from Python (_constants): the block shapes, and the GELU
# constants as the exact float64 values the reference op uses (rounded to float once, as NumPy does).
_COMMON = PRELUDE + read_source("elementwise.cu")

# extern "C" entry points, instantiated per dtype: (name, parameters, call, shared memory kind).
_ENTRY_POINTS = (
    ("softmax_fwd", "const T* x, T* y, long long rows, int n, int log_out",
     "npf_softmax_fwd<T, A>(x, y, rows, n, log_out, buf)", "row"),
    ("softmax_bwd", "const T* dy, const T* y, T* dx, long long rows, int n, int log_out",
     "npf_softmax_bwd<T, A>(dy, y, dx, rows, n, log_out, buf)", "row"),
    ("layer_norm_fwd", "const T* x, const T* w, const T* b, T* y, A* mean, A* rstd, long long rows, "
     "int n, A eps, int has_w, int has_b",
     "npf_layer_norm_fwd<T, A>(x, w, b, y, mean, rstd, rows, n, eps, has_w, has_b, buf)", "row"),
    ("layer_norm_bwd", "const T* dy, const T* x, const A* mean, const A* rstd, const T* w, T* dx, long long rows, "
     "int n, int has_w", "npf_layer_norm_bwd<T, A>(dy, x, mean, rstd, w, dx, rows, n, has_w, buf)", "row"),
    ("ln_param_grads", "const T* dy, const T* x, const A* mean, const A* rstd, A* part_dw, A* part_db, "
     "long long rows, int n, long long chunk",
     "npf_ln_param_grads<T, A>(dy, x, mean, rstd, part_dw, part_db, rows, n, chunk, s1, s2)", "col"),
    ("bias_grad", "const T* dy, A* part_db, long long rows, int n, long long chunk",
     "npf_bias_grad<T, A>(dy, part_db, rows, n, chunk, s1, s2)", "col"),
    ("bias_gelu_bwd", "const T* dy, const bool* keep, const double* draws, int keep_min, A scale, const T* h, "
     "T* dh, A* part_db, long long rows, int n, long long chunk, int tanh_form, int drop",
     "npf_bias_gelu_bwd<T, A>(dy, keep, draws, keep_min, scale, h, dh, part_db, rows, n, chunk, tanh_form, drop, "
     "s1, s2)", "col"),
    ("gelu_fwd", "const T* x, T* y, long long total, int tanh_form",
     "npf_gelu_fwd<T, A>(x, y, total, tanh_form)", ""),
    ("gelu_bwd", "const T* dy, const T* x, T* dx, long long total, int tanh_form",
     "npf_gelu_bwd<T, A>(dy, x, dx, total, tanh_form)", ""),
    ("bias_gelu_fwd", "const T* z, const T* b, const double* draws, T* h, T* y, "
     "long long total, int n, int tanh_form, int keep_min, A scale, int drop",
     "npf_bias_gelu_fwd<T, A>(z, b, draws, h, y, total, n, tanh_form, keep_min, scale, drop)", ""),
    ("bias_add", "const T* x, const T* b, T* y, long long total, int n",
     "npf_bias_add<T, A>(x, b, y, total, n)", ""),
    ("dropout_fwd", "const T* x, const double* draws, T* y, bool* keep, long long total, int keep_min, "
     "A scale", "npf_dropout_fwd<T, A>(x, draws, y, keep, total, keep_min, scale)", ""),
    ("dropout_bwd", "const T* dy, const bool* keep, const double* draws, T* dx, long long total, int keep_min, "
     "A scale, int drop", "npf_dropout_bwd<T, A>(dy, keep, draws, dx, total, keep_min, scale, drop)", ""),
) + FUSED_ENTRY_POINTS
_SHARED = {"row": "    __shared__ A buf[NPF_MAX_THREADS];\n",
           "col": "    __shared__ A s1[NPF_COL_X * NPF_COL_Y];\n    __shared__ A s2[NPF_COL_X * NPF_COL_Y];\n",
           "": ""}


def _entry_points() -> str:
    out = []
    for storage, acc, suffix in TYPES.values():
        for name, params, call, shared in _ENTRY_POINTS:
            text = (f'extern "C" __global__ void npf_{name}_{suffix}({params}) {{\n'
                    f"{_SHARED[shared]}    {call};\n}}\n")
            out.append(re.sub(r"\bA\b", acc, re.sub(r"\bT\b", storage, text)))
    return "\n".join(out)


def _constants(text: str) -> str:
    values = {"MAX_THREADS": MAX_THREADS, "COL_X": COL_X, "COL_Y": COL_Y,
              "SQRT_2_OVER_PI": repr(SQRT_2_OVER_PI), "INV_SQRT_2": repr(INV_SQRT_2),
              "INV_SQRT_2PI": repr(INV_SQRT_2PI), "C": repr(TANH_CUBIC), "C3": repr(3.0 * TANH_CUBIC)}
    return re.sub(r"@(\w+)@", lambda m: str(values[m.group(1)]), text)


KERNELS_SOURCE = (_constants(_COMMON) + "\n" + FUSED_KERNELS + "\n" + _entry_points()
                  + OPTIM_SOURCE)     # optimisers: optim_source.py
CUDA_SOURCE = HALF_CONVERSIONS + KERNELS_SOURCE
# NVRTC options: no contraction of a*b+c into one FMA, so the elementwise kernels round each
# operation as the reference ops' separate CuPy kernels do.
NVRTC_OPTIONS = ("--fmad=false",)
