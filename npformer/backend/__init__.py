"""The array backend: one place that decides between NumPy (CPU) and CuPy (GPU).

Compute code never imports numpy or cupy for math. It asks for the array module of its inputs::

    xp = get_array_module(x, weight)     # numpy or cupy, never a mix
    y = xp.tanh(x)

Rules (the same as CuPy's ``get_array_module`` and array-api-compat's ``array_namespace``):

* arrays of one backend give that backend's module; NumPy arrays, Python scalars and ``None``
  give ``numpy``;
* a NumPy array mixed with a CuPy array raises :class:`TypeError` naming both types. Transfers
  are always explicit: :func:`to_device` and :func:`to_numpy`;
* modules built without a ``backend`` use :func:`default_backend_name`: this thread's
  :func:`set_default_backend` (or the :func:`default_backend` block), else ``$NPFORMER_BACKEND`` as
  it was when npformer was imported (read once; compute code never reads the environment), else numpy;
* ``import npformer`` never imports CuPy. CuPy is imported only when a backend is asked for by
  name (:func:`get_backend`), and a missing CuPy or GPU is reported by
  :class:`BackendUnavailableError`.

Dtype policy: float32 is the default (:data:`DEFAULT_DTYPE`); float64 works everywhere and is
what the gradient checks use. float16 and bfloat16 are accepted by the ops; reductions (softmax
sums, layer-norm statistics, losses) and matrix products then accumulate in float32 and the result
is cast back to the input dtype. Every op returns the dtype it was given. bfloat16 is ml_dtypes'
dtype (:func:`bfloat16`, the optional extra ``npformer[bfloat16]``): NumPy has none of its own,
and CuPy's dtypes are NumPy's. Its NumPy kind is "V", so a floating dtype is tested with
:func:`is_float_dtype`, never ``dtype.kind == "f"``.
"""
from npformer.backend.array_module import (BACKENDS, BFLOAT16_EXTRA, DEFAULT_DTYPE, ENV_VAR, accumulated_sum,
                                           accumulation_dtype,
                                           backend_name, bfloat16, cupy_available, default_backend,
                                           default_backend_name, default_rng, get_array_module, get_backend,
                                           is_array, is_cupy_array, is_float_dtype, matmul, resolve_dtype, scatter_add,
                                           set_default_backend, to_device, to_numpy)
from npformer.backend.matmul_precision import (FLOAT32_MATMUL_PRECISIONS, float32_matmul_precision,
                                               set_float32_matmul_precision)
from npformer.backend.special import erf
from npformer.errors import BackendUnavailableError

__all__ = [
    "BACKENDS", "DEFAULT_DTYPE", "ENV_VAR", "BackendUnavailableError",
    "default_backend_name", "set_default_backend", "default_backend", "get_backend", "backend_name",
    "get_array_module",
    "is_cupy_array", "is_array", "cupy_available", "to_numpy", "to_device", "default_rng",
    "scatter_add", "erf", "accumulation_dtype", "FLOAT32_MATMUL_PRECISIONS", "set_float32_matmul_precision",
    "float32_matmul_precision", "BFLOAT16_EXTRA", "bfloat16", "resolve_dtype", "is_float_dtype", "matmul",
    "accumulated_sum",
]
