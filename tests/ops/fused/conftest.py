"""Fixtures for the fused kernels: the ``fx`` backend (CPU emulation of the CUDA C, or CuPy on a GPU).

* ``emulated``: the kernels' CUDA C compiled by g++ and run on NumPy arrays (tests/ops/fused/
  emulator.py), with the fused package's array module and kernel loader swapped for the test;
* ``cuda``: the real thing, marked ``gpu`` and skipped when CuPy or a device is absent.

Tolerances, stated once: the fused kernels compute in the plain ops' precision and differ from
them only in the order of a reduction's additions (and, emulated, in libm's exp/erf/tanh against
NumPy's), a few units in the last place of the magnitudes involved; float16 additionally rounds
once where the plain op rounds up to three times (e.g. softmax backward: ``dot``, ``dy - dot``,
the product). So ``max |fused - plain| <= TOL[dtype] * scale``, ``scale`` the largest magnitude
in play (at least 1): 1e-12 for float64, 1e-5 for float32 (about 80 ulp), 4e-3 for float16
(4 ulp at 1).
"""
from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import pytest

from npformer.backend import cupy_available, get_backend, to_numpy
from npformer.ops.fused import ENV_VAR, runtime
from tests.ops.fused import emulator

TOL = {"float64": 1e-12, "float32": 1e-5, "float16": 4e-3}
DTYPES = ("float64", "float32", "float16")


@dataclass(frozen=True)
class Backend:
    name: str          # "emulated" or "cuda"
    xp: ModuleType     # the array module of the fused path's arrays


@contextlib.contextmanager
def plain_path():
    """Run the plain ops even where they dispatch to the fused kernels (NPFORMER_FUSED=0)."""
    old = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ[ENV_VAR]
        else:
            os.environ[ENV_VAR] = old


def assert_close(got, ref, dtype, scale=None, what=""):
    """``max |got - ref| <= TOL[dtype] * scale`` (see the module docstring), NaN where NaN, dtype kept."""
    got64, ref64 = to_numpy(got).astype(np.float64), to_numpy(ref).astype(np.float64)
    assert str(got.dtype) == str(ref.dtype) == dtype, f"{what}: dtype {got.dtype} vs {ref.dtype}, expected {dtype}"
    assert got64.shape == ref64.shape, f"{what}: shape {got64.shape} vs {ref64.shape}"
    np.testing.assert_array_equal(np.isnan(got64), np.isnan(ref64), err_msg=f"{what}: NaN positions differ")
    np.testing.assert_array_equal(np.where(np.isinf(got64), got64, 0), np.where(np.isinf(ref64), ref64, 0),
                                  err_msg=f"{what}: infinities differ")
    finite = np.isfinite(ref64)
    if scale is None:
        scale = max(1.0, float(np.abs(ref64[finite]).max(initial=0.0)))
    err = np.abs(got64[finite] - ref64[finite]).max(initial=0.0)
    assert err <= TOL[dtype] * scale, f"{what}: max error {err:.3g} > {TOL[dtype]:g} * {scale:.3g} ({dtype})"


@pytest.fixture(scope="session")
def emulated_module(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("g++ is not installed: it compiles the kernels' CUDA C for the CPU emulation")
    return emulator.EmulatedModule(emulator.build(tmp_path_factory.mktemp("npf_emulator")))


@pytest.fixture(params=["emulated", pytest.param("cuda", marks=pytest.mark.gpu)])
def fx(request, monkeypatch):
    """The backend the fused kernels run on (see the module docstring)."""
    if request.param == "cuda":
        if not cupy_available():
            pytest.skip("CuPy is not installed or no CUDA device is visible")
        return Backend("cuda", get_backend("cupy"))
    module = request.getfixturevalue("emulated_module")
    monkeypatch.setattr(runtime, "is_device_array", lambda a: isinstance(a, np.ndarray))
    monkeypatch.setattr(runtime, "array_module", lambda: np)
    monkeypatch.setattr(runtime, "compile_module", lambda source, options: module)
    monkeypatch.setattr(runtime, "_cache", {})
    monkeypatch.delenv(ENV_VAR, raising=False)
    return Backend("emulated", np)
