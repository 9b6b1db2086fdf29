"""The products made inside a CUDA graph capture (npformer.kernels.cuda.gemm): the column-major
cuBLAS call's arguments, read back by a NumPy model of cublasGemmEx, give ``a @ b`` for every layout
of the operands (on the CPU); on a GPU, a captured and replayed product gives eager's bits."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from npformer.backend import cupy_available, get_backend
from npformer.kernels.cuda import gemm

LAYOUTS = ("c", "f", "strided")


def _laid_out(x: np.ndarray, layout: str) -> np.ndarray:
    """``x``'s values in C order, Fortran order (a transposed view), or a non-contiguous slice."""
    if layout == "c":
        return np.ascontiguousarray(x)
    if layout == "f":
        return np.ascontiguousarray(x.T).T
    wide = np.zeros((x.shape[0], 2 * x.shape[1]), x.dtype)
    wide[:, ::2] = x
    return wide[:, ::2]


def _column_major(x: np.ndarray, op: int, rows: int, cols: int, ld: int) -> np.ndarray:
    """op(X) of cublasGemmEx: X's memory from its first element read as a column-major matrix with
    leading dimension ``ld``, (rows, cols) after the op."""
    stored = (rows, cols) if op == 0 else (cols, rows)
    assert ld >= max(1, stored[0])
    size = x.dtype.itemsize
    matrix = np.lib.stride_tricks.as_strided(x, shape=stored, strides=(size, ld * size))
    return matrix if op == 0 else matrix.T


def _run(call: gemm.GemmArguments, dtype) -> np.ndarray:
    """C = op(first) op(second), (m, n) column-major with ldc, returned as the row-major (n, m) array."""
    first = _column_major(call.first, call.trans_first, call.m, call.k, call.ld_first)
    second = _column_major(call.second, call.trans_second, call.k, call.n, call.ld_second)
    out = np.zeros(call.ldc * call.n, dtype)
    column_major = np.lib.stride_tricks.as_strided(out, shape=(call.m, call.n),
                                                   strides=(out.itemsize, call.ldc * out.itemsize))
    column_major[...] = first @ second
    return out.reshape(call.n, call.ldc)[:, :call.m]


@given(m=st.integers(1, 6), k=st.integers(1, 6), n=st.integers(1, 6), a_layout=st.sampled_from(LAYOUTS),
       b_layout=st.sampled_from(LAYOUTS), seed=st.integers(0, 2**16))
def test_the_cublas_arguments_compute_a_at_b_for_every_layout(m, k, n, a_layout, b_layout, seed):
    r = np.random.default_rng(seed)
    a = _laid_out(r.standard_normal((m, k)), a_layout)
    b = _laid_out(r.standard_normal((k, n)), b_layout)
    call = gemm.gemm_arguments(a, b)
    assert (call.m, call.n, call.k, call.ldc) == (n, m, k, n)
    np.testing.assert_allclose(_run(call, a.dtype), a @ b, rtol=1e-12, atol=1e-12)


def test_outside_a_capture_and_for_numpy_it_is_the_plain_product():
    a, b = np.arange(6.0).reshape(2, 3), np.arange(12.0).reshape(3, 4)
    assert not gemm.capturing(a)
    np.testing.assert_array_equal(gemm.matmul(a, b), a @ b)


def _on_device(cp, x: np.ndarray, layout: str):
    """As :func:`_laid_out`, made on the device (a copy to the device would be C-ordered)."""
    if layout == "c":
        return cp.ascontiguousarray(cp.asarray(x))
    if layout == "f":
        return cp.asfortranarray(cp.asarray(x))
    wide = cp.zeros((x.shape[0], 2 * x.shape[1]), x.dtype)
    wide[:, ::2] = cp.asarray(x)
    return wide[:, ::2]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_a_captured_product_replays_eager_bits(dtype):
    if not cupy_available():
        pytest.skip("CuPy is not installed or no CUDA device is visible")
    cp = get_backend("cupy")
    r = np.random.default_rng(0)
    cases = []
    for (m, k, n) in ((64, 48, 80), (1, 33, 7), (130, 1, 3), (256, 512, 1024)):
        for a_layout, b_layout in (("c", "c"), ("c", "f"), ("f", "c"), ("strided", "f")):
            a = _on_device(cp, r.standard_normal((m, k)).astype(dtype), a_layout)
            b = _on_device(cp, r.standard_normal((k, n)).astype(dtype), b_layout)
            cases.append((a, b, a @ b))
    stream = cp.cuda.Stream(non_blocking=True)
    gemm.reserve_workspace(cp)
    with stream:
        stream.begin_capture()
        outs = [gemm.matmul(a, b) for a, b, _ in cases]
        graph = stream.end_capture()
        graph.launch(stream)
    stream.synchronize()
    for (a, b, want), got in zip(cases, outs):
        assert got.tobytes() == want.tobytes(), (a.shape, b.shape, a.flags.f_contiguous, b.flags.f_contiguous)
