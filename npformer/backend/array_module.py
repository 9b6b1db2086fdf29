"""Which array module runs a computation: the choice of backend, arrays' modules, transfers and
seeded generators (re-exported by :mod:`npformer.backend`, whose docstring gives the rules)."""
from __future__ import annotations

import contextlib
import contextvars
import importlib
import os
import sys
from types import ModuleType
from typing import Any, Iterator

import numpy

from npformer.errors import BackendMismatchError, BackendUnavailableError, MissingExtraError, RangeError

BACKENDS = ("numpy", "cupy")
DEFAULT_DTYPE = numpy.float32
ENV_VAR = "NPFORMER_BACKEND"

__all__ = [
    "BACKENDS", "DEFAULT_DTYPE", "ENV_VAR", "BackendUnavailableError",
    "default_backend_name", "set_default_backend", "default_backend", "get_backend", "backend_name",
    "get_array_module",
    "is_cupy_array", "is_array", "cupy_available", "to_numpy", "to_device", "default_rng",
    "scatter_add", "accumulation_dtype", "BFLOAT16_EXTRA", "bfloat16", "resolve_dtype", "is_float_dtype",
    "matmul", "accumulated_sum",
]


# The backend of modules built without one: this thread's choice (set_default_backend, default_backend),
# else the process's starting value, $NPFORMER_BACKEND as it was when npformer was imported ("numpy"
# unset). Read once, here, not at each call: changing os.environ later changes nothing.
_STARTING_BACKEND = os.environ.get(ENV_VAR, "")
_DEFAULT_BACKEND: contextvars.ContextVar[str | None] = contextvars.ContextVar("npformer_default_backend",
                                                                              default=None)


def default_backend_name() -> str:
    """The backend of modules built without one: :func:`set_default_backend`'s on this thread, else
    ``$NPFORMER_BACKEND`` as it was when npformer was imported, else ``"numpy"``."""
    chosen = _DEFAULT_BACKEND.get()
    if chosen is not None:
        return chosen
    name = _STARTING_BACKEND.strip().lower() or "numpy"
    if name not in BACKENDS:
        raise RangeError(f"{ENV_VAR}={name!r} is not a backend; expected one of {BACKENDS}")
    return name


def set_default_backend(name: str | None) -> None:
    """Build modules without a ``backend`` on ``name`` ("numpy" or "cupy") from now on, on this thread
    (per thread, as npformer's other switches); None: back to the starting value."""
    if name is not None and (not isinstance(name, str) or name.lower() not in BACKENDS):
        raise RangeError(f"unknown backend {name!r}; expected one of {BACKENDS}")
    _DEFAULT_BACKEND.set(None if name is None else name.lower())


@contextlib.contextmanager
def default_backend(name: str) -> Iterator[None]:
    """:func:`set_default_backend` for a block, restored after (exceptions included)."""
    if not isinstance(name, str) or name.lower() not in BACKENDS:
        raise RangeError(f"unknown backend {name!r}; expected one of {BACKENDS}")
    token = _DEFAULT_BACKEND.set(name.lower())
    try:
        yield
    finally:
        _DEFAULT_BACKEND.reset(token)


def _import_cupy() -> ModuleType:
    try:
        cupy = importlib.import_module("cupy")
    except Exception as exc:  # ImportError, or a broken CUDA install raising at import
        raise BackendUnavailableError(
            "backend 'cupy' was requested but CuPy cannot be imported "
            f"({type(exc).__name__}: {exc}); install the GPU extra for your driver's CUDA version (nvidia-smi "
            "shows it): pip install 'npformer[gpu-cuda12]' for CUDA 12.x, 'npformer[gpu-cuda13]' for 13.x"
        ) from exc
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        raise BackendUnavailableError(
            f"backend 'cupy' was requested but no CUDA device is visible ({type(exc).__name__}: {exc})"
        ) from exc
    if count < 1:
        raise BackendUnavailableError("backend 'cupy' was requested but no CUDA device is visible")
    return cupy


def get_backend(name: str | ModuleType | None = None) -> ModuleType:
    """The array module for ``name`` ("numpy" or "cupy"; default from :func:`default_backend_name`).

    A module that is already numpy or cupy is returned as it is.
    """
    if isinstance(name, ModuleType):
        if name.__name__ in BACKENDS:
            return name
        raise RangeError(f"expected the numpy or cupy module, got module {name.__name__!r}")
    if name is None:
        name = default_backend_name()
    if not isinstance(name, str) or name.lower() not in BACKENDS:
        raise RangeError(f"unknown backend {name!r}; expected one of {BACKENDS}")
    return numpy if name.lower() == "numpy" else _import_cupy()


def cupy_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device (never raises)."""
    try:
        _import_cupy()
    except BackendUnavailableError:
        return False
    return True


def is_cupy_array(a: Any) -> bool:
    """True for a CuPy ndarray; never imports CuPy (a CuPy array implies CuPy is loaded)."""
    cupy = sys.modules.get("cupy")
    return cupy is not None and isinstance(a, cupy.ndarray)


def is_array(a: Any) -> bool:
    """True for a NumPy or CuPy ndarray, or a NumPy scalar (a 0-d value); never imports CuPy."""
    return isinstance(a, (numpy.ndarray, numpy.generic)) or is_cupy_array(a)


def get_array_module(*arrays: Any) -> ModuleType:
    """numpy or cupy, from the arrays given; mixing the two raises ``TypeError``.

    ``None`` and Python scalars are ignored, so optional arguments can be passed straight in.
    """
    cupy = sys.modules.get("cupy")
    if cupy is None:                     # CuPy never imported: no CuPy array can exist
        return numpy
    found_numpy = found_cupy = None
    for a in arrays:
        if isinstance(a, cupy.ndarray):
            found_cupy = found_cupy if found_cupy is not None else a
        elif isinstance(a, (numpy.ndarray, numpy.generic)):
            found_numpy = found_numpy if found_numpy is not None else a
    if found_cupy is not None and found_numpy is not None:
        raise BackendMismatchError(
            "arrays from two backends were mixed in one call: "
            f"{type(found_numpy).__module__}.{type(found_numpy).__name__} and "
            f"{type(found_cupy).__module__}.{type(found_cupy).__name__}; "
            "move them to one backend first with npformer.backend.to_device(array, 'numpy' or 'cupy')"
        )
    return cupy if found_cupy is not None else numpy


def backend_name(xp_or_array: Any) -> str:
    """ "numpy" or "cupy" for a module or an array."""
    if isinstance(xp_or_array, ModuleType):
        return xp_or_array.__name__
    return get_array_module(xp_or_array).__name__


def to_numpy(a: Any) -> numpy.ndarray:
    """A host (NumPy) copy of ``a``; NumPy input is returned as it is (no copy)."""
    if is_cupy_array(a):
        return a.get()
    return numpy.asarray(a)


def to_device(a: Any, backend: str | ModuleType | None = None) -> Any:
    """``a`` as an array of ``backend`` ("numpy" or "cupy"); a no-op when it is there already."""
    xp = get_backend(backend)
    if xp is numpy:
        return to_numpy(a)
    return xp.asarray(a)


def default_rng(seed: int | None = None, backend: str | ModuleType | None = None):
    """A seeded random Generator of the backend (``numpy.random.default_rng`` / ``cupy.random.default_rng``).

    The same seed gives the same stream on a backend; NumPy and CuPy streams differ from each other.
    """
    xp = get_backend(backend)
    return xp.random.default_rng(seed)


def scatter_add(target: Any, indices: Any, values: Any) -> None:
    """``target[indices] += values`` with repeated indices summed, in the same order on every backend.

    Rows of a 2-d target indexed by a 1-d array (the embedding backward) are sorted by index (a
    stable sort), and each index's rows are added up in float64 by :func:`run_sums`, which adds only
    rows of the same index, in a fixed order of additions: where ``cupyx.scatter_add``'s atomics add
    in whatever order the threads arrive (a GPU gradient check once failed and then passed on the
    same example). Each index's total is rounded once to the target's dtype and added to its row.
    Other shapes use ``numpy.add.at`` / ``cupyx.scatter_add``.

    NumPy gathers the run ends (``flatnonzero``: as many as there are distinct indices). CuPy keeps
    the sums at the run ends, zeros elsewhere, and adds all N rows (adding 0.0 changes nothing, so the
    order of the atomics does not matter): the same totals with no data-dependent shape, so no host
    sync, and the op can be captured in a CUDA graph.
    """
    xp = get_array_module(target, indices, values)
    if not (target.ndim == 2 and getattr(indices, "ndim", 0) == 1 and indices.size
            and getattr(values, "shape", None) == (indices.size, target.shape[1])):
        if xp is numpy:
            numpy.add.at(target, indices, values)
        else:
            importlib.import_module("cupyx").scatter_add(target, indices, values)
        return
    ids = xp.where(indices < 0, indices + target.shape[0], indices)        # (N,) -1 and V-1 are one row
    order = xp.argsort(ids, kind="stable")                                  # (N,)
    ids = ids[order]                                                        # (N,) sorted
    last = xp.concatenate([ids[1:] != ids[:-1], xp.ones(1, dtype=bool)])    # (N,) the last row of its run
    sums = run_sums(values[order], xp.searchsorted(ids, ids, side="left"))  # (N, C) float64
    if xp is numpy:
        ends = xp.flatnonzero(last)                                         # (U,)
        target[ids[ends]] += sums[ends].astype(target.dtype, copy=False)    # (U, C), unique rows: no collisions
    else:
        scatter_add_run_ends(target, ids, last, sums)


def run_sums(rows: Any, starts: Any) -> Any:
    """The float64 sum of each run of rows up to each row: ``out[i] = rows[starts[i]] + ... + rows[i]``
    for (N, C) ``rows`` and ``starts`` (N,), the first row of row i's run (runs are contiguous).

    A segmented scan in ceil(log2 N) passes (Hillis and Steele's): after the pass of distance d, row i
    holds the sum of the last 2d rows of its run up to it, so the pass adds row i - d's partial sum
    where that row is in the same run. Only rows of one run are ever added together, so a run's
    error is bounded by its own terms (ceil(log2 N) roundings of float64 on the sum of their
    magnitudes), whatever the other runs hold: a large or infinite row elsewhere costs it nothing,
    where a difference of running sums over all rows would cancel. Elementwise passes of fixed
    shapes: the same bits on NumPy and CuPy, no host sync."""
    xp = get_array_module(rows, starts)
    sums = rows.astype(xp.float64)                                          # (N, C) a copy
    n = sums.shape[0]
    position = xp.arange(n)                                                 # (N,)
    d = 1
    while d < n:
        same_run = (position[d:] - d >= starts[d:])[:, None]                # (N - d, 1) row i - d in i's run
        xp.add(sums[d:], xp.where(same_run, sums[:-d], 0.0), out=sums[d:])  # where reads before the add writes
        d *= 2
    return sums


def scatter_add_run_ends(target: Any, ids: Any, last: Any, sums: Any) -> None:
    """The CuPy half of :func:`scatter_add` (any backend takes it: a test holds it to NumPy's half):
    ``ids`` (N,) sorted, ``last`` (N,) marking the end of each run, ``sums`` (N, C) float64 from
    :func:`run_sums`, whose row at a run's end is the run's total."""
    xp = get_array_module(target, ids, sums)
    totals = xp.where(last[:, None], sums, 0.0)                             # (N, C) a run's total at its end
    if xp is numpy:
        numpy.add.at(target, ids, totals.astype(target.dtype, copy=False))
    else:
        importlib.import_module("cupyx").scatter_add(target, ids, totals.astype(target.dtype, copy=False))


def accumulation_dtype(dtype: Any) -> Any:
    """The dtype reductions accumulate in: float32 for 16-bit floats (float16, bfloat16), the dtype
    itself otherwise."""
    dtype = numpy.dtype(dtype)
    return numpy.dtype(numpy.float32) if dtype.itemsize < 4 else dtype


def accumulated_sum(x: Any, axis: Any = None, keepdims: bool = False) -> Any:
    """``x.sum(axis)`` added up in :func:`accumulation_dtype` and returned in ``x``'s dtype. NumPy and
    CuPy sum float16 in float32 by themselves; ml_dtypes' bfloat16 sums in bfloat16 (4096 ones make
    256), so a sum over a batch of 16-bit gradients (a bias's, a position table's) goes through here."""
    return x.sum(axis=axis, keepdims=keepdims, dtype=accumulation_dtype(x.dtype)).astype(x.dtype, copy=False)


# -- bfloat16 ----------------------------------------------------------------------------------------
# NumPy and CuPy have no bfloat16 of their own: ml_dtypes registers one with NumPy (kind "V", 2 bytes),
# which NumPy computes with in software and CuPy 14 allocates, casts and multiplies (its dtypes are
# NumPy's). So the dtype is ml_dtypes', on either backend, and ml_dtypes is imported here alone, when
# bfloat16 is first asked for: npformer imports without it.
BFLOAT16_EXTRA = 'pip install "npformer[bfloat16]"'


def bfloat16() -> numpy.dtype:
    """The bfloat16 dtype (``numpy.dtype(ml_dtypes.bfloat16)``); MissingExtraError naming the extra
    when ml_dtypes is not installed."""
    try:
        ml_dtypes = importlib.import_module("ml_dtypes")
    except ImportError:
        raise MissingExtraError(f"bfloat16 needs the ml_dtypes package, which gives NumPy and CuPy the dtype: "
                                f"{BFLOAT16_EXTRA}") from None
    return numpy.dtype(ml_dtypes.bfloat16)


def resolve_dtype(xp: ModuleType, dtype: Any) -> Any:
    """``xp.dtype(dtype)``, with bfloat16 (the name, or ml_dtypes' type) resolved through :func:`bfloat16`."""
    if str(getattr(dtype, "__name__", dtype)) == "bfloat16":
        return bfloat16()
    return xp.dtype(dtype)


def is_float_dtype(dtype: Any) -> bool:
    """True for float16/32/64 and bfloat16 (whose NumPy kind is "V", not "f")."""
    dtype = numpy.dtype(dtype)
    return dtype.kind == "f" or dtype.name == "bfloat16"




def matmul(a: Any, b: Any) -> Any:
    """``a @ b`` in the operands' dtype, its sums in float32 (or wider) rounded once: the product shim
    16-bit operands need, as cuBLAS and PyTorch compute them.

    * bfloat16: NumPy's product (ml_dtypes) sums in float32 and returns the float32 sums; this rounds
      them to bfloat16.
    * float16 on NumPy: NumPy's own float16 product also sums in float32, but in loops of its own
      instead of BLAS: a (768, 128) @ (128, 512) product took 400 ms against 1.2 ms in float32 (2-core
      AMD VM, one thread). Here the operands are widened to float32, multiplied by BLAS and the sums
      rounded once: the same arithmetic (as close to the exact product rounded to float16: on 128K
      products of 512 terms 108 differed from it by an ulp, 120 of NumPy's own) at BLAS's speed.

    For every other dtype, and for float16 on CuPy (cuBLAS), it is ``a @ b`` itself (no copy)."""
    if a.dtype == numpy.float16 and b.dtype == numpy.float16 and not is_cupy_array(a):
        return (a.astype(numpy.float32) @ b.astype(numpy.float32)).astype(numpy.float16)
    out = a @ b
    return out if out.dtype == a.dtype else out.astype(a.dtype)
