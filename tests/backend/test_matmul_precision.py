"""TF32 as an opt-in for float32 products, float16 accumulating in float32 (npformer.backend.matmul_precision)."""

import numpy as np
import pytest

from npformer.backend import cupy_available, float32_matmul_precision, get_backend, set_float32_matmul_precision
from npformer.backend.matmul_precision import apply_matmul_precision
from npformer.errors import RangeError
from npformer.training.config import CharLMTrainConfig


def test_numpy_refuses_tf32_and_accepts_highest():
    with pytest.raises(RangeError, match="TF32 is a tensor-core mode .* use backend 'cupy'"):
        set_float32_matmul_precision("tf32", "numpy")
    set_float32_matmul_precision("highest", "numpy")
    assert float32_matmul_precision("numpy") == "highest"


def test_unknown_precision_is_named():
    with pytest.raises(RangeError, match="expected one of 'highest', 'tf32', got 'high'"):
        set_float32_matmul_precision("high", "numpy")


class _Recorder:
    """Stand-ins for CuPy's matmul module and cuBLAS bindings, recording what is set. Like CuPy 14's
    bindings (seen on an H100, 2026-11-26) they name no math modes: npformer passes cuBLAS's values."""

    COMPUTE_TYPE_DEFAULT, COMPUTE_TYPE_FP32, COMPUTE_TYPE_TF32 = 1, 4, 7

    def __init__(self):
        self.compute, self.math = {}, {}

    def set_compute_type(self, dtype, compute_type):
        self.compute[np.dtype(dtype).name] = compute_type

    def setMathMode(self, handle, mode):  # noqa: N802 (cuBLAS's name)
        self.math[handle] = mode


@pytest.mark.parametrize("tf32", [True, False])
def test_compute_types_set_explicitly(tf32):
    r = _Recorder()
    apply_matmul_precision(r, r, "handle", tf32)
    assert r.compute["float16"] == r.COMPUTE_TYPE_FP32                  # float16 products, float32 sums
    assert r.compute["float32"] == (r.COMPUTE_TYPE_TF32 if tf32 else r.COMPUTE_TYPE_DEFAULT)
    assert r.math == {"handle": 3 if tf32 else 0}          # CUBLAS_TF32_TENSOR_OP_MATH, CUBLAS_DEFAULT_MATH


def test_cupy_cublas_compute_type_is_cupys_mapping(monkeypatch):
    """What npformer's captured products pass to cublasGemmEx (a stand-in for CuPy's matmul module):
    float32 on FAST_TF32 only while CuPy's float32 compute type is TF32, float16 never, float64 on
    64F, PEDANTIC kept."""
    import sys
    import types
    from npformer.backend import matmul_precision as mp
    linalg = types.SimpleNamespace(COMPUTE_TYPE_DEFAULT=1, COMPUTE_TYPE_PEDANTIC=2, COMPUTE_TYPE_FP32=4,
                                   COMPUTE_TYPE_TF32=7, chosen={})
    linalg.get_compute_type = lambda dtype: linalg.chosen.get(np.dtype(dtype).name, 1)
    monkeypatch.setitem(sys.modules, "cupy._core._routines_linalg", linalg)
    assert [mp.cupy_cublas_compute_type(d) for d in ("float16", "float32", "float64")] == [68, 68, 70]
    linalg.chosen = {"float16": 4, "float32": 7, "float64": 7}
    assert [mp.cupy_cublas_compute_type(d) for d in ("float16", "float32", "float64")] == [68, 77, 70]
    linalg.chosen = {"float16": 2, "float32": 2, "float64": 2}
    assert [mp.cupy_cublas_compute_type(d) for d in ("float16", "float32", "float64")] == [69, 69, 71]


def test_train_config_refuses_tf32_on_numpy():
    with pytest.raises(RangeError, match="--tf32 .* needs --backend cupy, got --backend numpy"):
        CharLMTrainConfig(task="charlm", tf32=True)
    assert CharLMTrainConfig(task="charlm", backend="numpy").tf32 is False


@pytest.mark.gpu
def test_cupy_tf32_rounds_float32_products_and_switches_back():
    if not cupy_available():
        pytest.skip("CuPy is not installed or no CUDA device is visible")
    cp = get_backend("cupy")
    if int(cp.cuda.Device().compute_capability) < 80:
        pytest.skip("TF32 needs compute capability 8.0 or later")
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((256, 256)).astype(np.float32) for _ in range(2))
    exact = a.astype(np.float64) @ b.astype(np.float64)
    try:
        set_float32_matmul_precision("tf32", "cupy")
        assert float32_matmul_precision("cupy") == "tf32"
        tf32_err = np.abs(cp.asnumpy(cp.asarray(a) @ cp.asarray(b)) - exact).max()
    finally:
        set_float32_matmul_precision("highest", "cupy")
    assert float32_matmul_precision("cupy") == "highest"
    fp32_err = np.abs(cp.asnumpy(cp.asarray(a) @ cp.asarray(b)) - exact).max()
    # TF32 keeps 10 mantissa bits (unit roundoff 2^-11): errors near 16 * 2^-11 * |a||b| for K = 256,
    # float32 (2^-24) about a thousand times smaller
    assert fp32_err < 1e-3 < tf32_err < 0.5, (fp32_err, tf32_err)


@pytest.mark.gpu
def test_cupy_float16_products_accumulate_in_float32():
    if not cupy_available():
        pytest.skip("CuPy is not installed or no CUDA device is visible")
    cp = get_backend("cupy")
    set_float32_matmul_precision("highest", "cupy")
    # 4096 ones times ones: 4096 is exact in float16 as a float32 sum rounded once; a float16 running
    # sum would stop at 2048 (2048 + 1 rounds back to 2048)
    a = cp.ones((1, 4096), dtype=cp.float16)
    assert float((a @ a.T)[0, 0]) == 4096.0
