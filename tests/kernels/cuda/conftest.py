"""Fixtures for the fused kernels: the ``fx`` backend (CPU emulation of the CUDA C, or CuPy on a GPU).

* ``emulated``: the kernels' CUDA C compiled by g++ and run on NumPy arrays (tests/kernels/cuda/
  emulator.py), with the CUDA package's array module and kernel loader swapped for the test (so
  NumPy arrays count as device arrays: the dispatcher sends them to the CUDA paths) and
  ``numpy.empty`` giving 0xff bytes (NaN), as CuPy's pool gives an earlier array's bytes; the flash
  attention module is built apart, on first use;
* ``cuda``: the real thing, marked ``gpu`` and skipped when CuPy or a device is absent.

Tolerances, stated once: the fused kernels compute in the reference ops' precision and differ from
them only in the order of a reduction's additions (and, emulated, in libm's exp/erf/tanh against
NumPy's), a few units in the last place of the magnitudes involved; float16 and bfloat16 additionally
round once where the plain op rounds up to three times (e.g. softmax backward: ``dot``, ``dy - dot``,
the product). So ``max |fused - reference| <= TOL[dtype] * scale``, ``scale`` the largest magnitude
in play (at least 1): 1e-12 for float64, 1e-5 for float32 (about 80 ulp), 4e-3 for float16
(4 ulp at 1), 2^-6 for bfloat16 (4 ulp at 1: eps 2^-8). ``TOL`` and ``assert_close`` live in tests/helpers.py (the CPU fast paths use them too).
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import pytest

from npformer.backend import cupy_available, get_backend
from npformer.dispatch import disabled
from npformer import kernels
from npformer.kernels import numba_cpu
from npformer.kernels import cpu as kernels_cpu
from npformer.kernels.cpu import attention as cpu_attention
from npformer.kernels.cpu import dropout as cpu_dropout
from npformer.kernels.cpu import optim as cpu_optim
from npformer.kernels.cuda import flash_source, runtime
from npformer.kernels.cuda import linear as cuda_linear
from tests.helpers import TOL, assert_close  # noqa: F401  (the tests import them from here)
from tests.kernels.cuda import emulator, sources

# bfloat16 where ml_dtypes (an optional extra) is installed: importing it names numpy.dtype("bfloat16"), what
# CuPy allocates; test_bf16_conversions_are_round_to_nearest_even (test_warp_primitives.py) skips, saying so,
# without it
BFLOAT16 = importlib.util.find_spec("ml_dtypes") is not None
if BFLOAT16:
    importlib.import_module("ml_dtypes")
DTYPES = ("float64", "float32", "float16") + (("bfloat16",) if BFLOAT16 else ())
# each emulated by the one flash library
_FLASH_SOURCES = frozenset({flash_source.FLASH_SOURCE, sources.FLASH_TEST_SOURCE})


@dataclass(frozen=True)
class Backend:
    name: str          # "emulated" or "cuda"
    xp: ModuleType     # the array module of the fused path's arrays


@pytest.fixture(scope="session")
def emulated_module(tmp_path_factory):
    return emulator.emulated_module(tmp_path_factory.mktemp("npf_emulator"))


@pytest.fixture(scope="session")
def emulated_flash_module(tmp_path_factory):
    """Every flash attention instantiation and test kernel (on a GPU, one NVRTC module per dtype and
    head-size bucket, and the tests' own)."""
    return emulator.emulated_module(tmp_path_factory.mktemp("npf_flash_emulator"), sources.FLASH_EMULATED_SOURCE,
                                    sources.FLASH_EMULATED_KERNELS)


@pytest.fixture(params=["emulated", pytest.param("cuda", marks=pytest.mark.gpu)])
def fx(request, monkeypatch):
    """The backend the fused kernels run on (see the module docstring)."""
    if request.param == "cuda":
        if not cupy_available():
            pytest.skip("CuPy is not installed or no CUDA device is visible")
        return Backend("cuda", get_backend("cupy"))
    module = request.getfixturevalue("emulated_module")
    monkeypatch.setattr(runtime, "is_device_array", lambda a: isinstance(a, np.ndarray))
    # NumPy arrays pose as device arrays: not the CPU's (the CPU fast paths off for the test, and the
    # CPU kernels' own tests of their inputs say no)
    cpu_paths_off = disabled("cpu", "numba")
    cpu_paths_off.__enter__()
    request.addfinalizer(lambda: cpu_paths_off.__exit__(None, None, None))
    for home in (kernels, kernels_cpu, cpu_attention, cpu_dropout, cpu_optim):
        monkeypatch.setattr(home, "numpy_floats", lambda *arrays: False)
    monkeypatch.setattr(numba_cpu, "AVAILABLE", False)                # nor the compiled CPU paths' (numba installed)
    monkeypatch.setattr(runtime, "array_module", lambda: np)
    monkeypatch.setattr(np, "empty", emulator.stale_empty)            # as CuPy's pool: old bytes (here NaN), not zeros
    monkeypatch.setattr(runtime, "address", lambda a: a.ctypes.data)
    monkeypatch.setattr(runtime, "compute_capability", lambda: 90)     # an H100: float16 on tensor cores
    monkeypatch.setattr(runtime, "float32_on_tf32", lambda: False)     # float32 exact unless a test opts in
    monkeypatch.setattr(runtime, "compile_module", lambda source, options, name_expressions=(): (
        request.getfixturevalue("emulated_flash_module") if source in _FLASH_SOURCES else module))
    monkeypatch.setattr(runtime, "_cache", {})
    # NumPy's bfloat16 product (ml_dtypes) is float32, CuPy's bfloat16 (cuBLAS: float32 accumulation, one
    # rounding): the emulation rounds NumPy's so (a no-op for the other dtypes)
    monkeypatch.setattr(cuda_linear, "matmul", lambda a, b: (a @ b).astype(a.dtype, copy=False))
    return Backend("emulated", np)
