"""The products made inside a CUDA graph capture (npformer.kernels.cuda.gemm): the column-major
cuBLAS call's arguments, read back by a NumPy model of cublasGemmEx, give ``a @ b`` for every layout
of the operands (on the CPU); npformer's own cuBLAS handle and workspace, on a stand-in for cuBLAS
and CuPy (tests/kernels/cuda/fake_cublas.py): one handle per device, bound to the current stream at
each product, CuPy's handle never asked for; on a GPU, a captured and replayed product gives eager's
bits and leaves CuPy's handle as it was."""
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from npformer.backend import cupy_available, get_backend
from npformer.backend.matmul_precision import (CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32,
                                               CUBLAS_COMPUTE_64F)
from npformer.kernels.cuda import gemm
from tests.kernels.cuda.fake_cublas import FakeCublas, fake_cupy

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


def test_the_module_imports_and_multiplies_without_cupy():
    code = ("import sys; sys.modules['cupy'] = None; import numpy as np; "
            "from npformer.kernels.cuda import gemm; "
            "a = np.arange(6.0).reshape(2, 3); assert (gemm.matmul(a, a.T) == a @ a.T).all(); "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('cupy', 'cupyx', 'cupy_backends') "
            "and sys.modules[m] is not None); print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.fixture
def fake(monkeypatch):
    """gemm on the stand-ins: a fresh FakeCublas as the library, no handles yet, NumPy arrays' host
    addresses as device addresses, an H100's compute capability, CuPy's default compute types."""
    lib = FakeCublas()
    monkeypatch.setattr(gemm, "_state", {"lib": lib, "devices": {}})
    monkeypatch.setattr(gemm, "_address", lambda x: x.ctypes.data)
    monkeypatch.setattr(gemm, "compute_capability", lambda: 90)
    monkeypatch.setattr(gemm, "cupy_cublas_compute_type",
                        lambda dtype: CUBLAS_COMPUTE_64F if np.dtype(dtype) == np.float64 else CUBLAS_COMPUTE_32F)
    return lib


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("a_layout,b_layout", [("c", "c"), ("c", "f"), ("f", "c"), ("strided", "f")])
def test_a_captured_product_on_a_fake_cublas_is_a_at_b(fake, dtype, a_layout, b_layout):
    """The whole cuBLAS call (handle, stream, workspace, then cublasGemmEx's 19 arguments through
    ctypes, bfloat16 as CUDA_R_16BF) computes ``a @ b`` into a fresh C-ordered array, of ``a``'s dtype."""
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes", reason="bfloat16 is ml_dtypes' (the bfloat16 extra)").bfloat16
    xp = fake_cupy()
    r = np.random.default_rng(0)
    a = _laid_out(r.standard_normal((5, 3)).astype(dtype), a_layout)
    b = _laid_out(r.standard_normal((3, 4)).astype(dtype), b_layout)
    own = gemm.prepare_capture(xp)
    out = gemm._gemm_in_capture(a, b, xp)
    assert out.dtype == np.dtype(dtype) and out.shape == (5, 4) and out.flags.c_contiguous
    want = (a.astype(np.float64) @ b.astype(np.float64)).astype(dtype)
    rtol = {"float16": 2e-3, "bfloat16": 2.0 ** -7}.get(np.dtype(dtype).name, 1e-6)   # bfloat16: one ulp
    np.testing.assert_allclose(out.astype(np.float64), want.astype(np.float64), rtol=rtol)
    compute = CUBLAS_COMPUTE_64F if dtype == "float64" else CUBLAS_COMPUTE_32F
    assert fake.on(own.handle) == [("create",), ("stream", xp.stream), ("workspace", own.workspace.ctypes.data,
                                   gemm.WORKSPACE_BYTES), ("math", 0), ("gemm", compute, 99)]
    assert xp.cupys_handle_asked == 0


def test_one_handle_per_device_made_once_and_bound_to_the_current_stream_at_each_product(fake):
    allocations = []
    xp = fake_cupy(allocations)
    a, b = np.ones((2, 3), np.float32), np.ones((3, 2), np.float32)
    first = gemm.prepare_capture(xp)
    assert gemm.prepare_capture(xp) is first                             # once per device
    assert allocations == [("empty", gemm.WORKSPACE_BYTES, "uint8")]
    gemm._gemm_in_capture(a, b, xp)
    xp.stream = 0x6000                                                   # another stream, same device
    gemm._gemm_in_capture(a, b, xp)
    xp.device, xp.stream = 1, 0x7000                                     # another device
    second = gemm.prepare_capture(xp)
    gemm._gemm_in_capture(a, b, xp)
    assert fake.created == [first.handle, second.handle] and first.handle != second.handle
    assert [c for c in fake.on(first.handle) if c[0] == "stream"] == [("stream", 0x5000), ("stream", 0x6000)]
    assert [c for c in fake.on(second.handle) if c[0] == "stream"] == [("stream", 0x7000)]
    for own in (first, second):                                          # each product: its workspace again
        names = [c[0] for c in fake.on(own.handle)]
        assert names.count("workspace") == names.count("stream") == names.count("gemm")
        assert all(c[1] == own.workspace.ctypes.data for c in fake.on(own.handle) if c[0] == "workspace")
    # the workspaces are kept (one per device) and no call went to another handle (CuPy's)
    assert gemm._state["devices"] == {0: first, 1: second}
    assert {call[1] for call in fake.calls} == {first.handle, second.handle}
    assert xp.cupys_handle_asked == 0


def test_the_tf32_switch_gives_the_handle_tf32_math_as_it_gives_cupys(fake, monkeypatch):
    monkeypatch.setattr(gemm, "cupy_cublas_compute_type", lambda dtype: CUBLAS_COMPUTE_32F_FAST_TF32)
    xp = fake_cupy()
    own = gemm.prepare_capture(xp)
    gemm._gemm_in_capture(np.ones((2, 3), np.float32), np.ones((3, 2), np.float32), xp)
    assert fake.on(own.handle)[-2:] == [("math", 3), ("gemm", CUBLAS_COMPUTE_32F_FAST_TF32, 99)]


def test_a_product_captured_before_the_handle_is_made_says_what_to_call(fake):
    xp = fake_cupy()
    with pytest.raises(RuntimeError, match=r"handle for device 0 is made before a capture begins: call "
                                           r"npformer.kernels.cuda.gemm.prepare_capture\(cupy\) first"):
        gemm._gemm_in_capture(np.ones((2, 3)), np.ones((3, 2)), xp)
    assert fake.calls == []


def test_the_library_is_the_copy_cupy_loaded_never_a_second_one(monkeypatch):
    """``_library`` opens ``libcublas.so.<CUDA major>`` only if it is already loaded (here it is not:
    CuPy is a stand-in claiming CUDA 99), and says so."""
    import types
    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(cublas=object(), runtime=types.SimpleNamespace(runtimeGetVersion=lambda: 99010))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(gemm, "_state", {"lib": None, "devices": {}})
    with pytest.raises(RuntimeError, match=r"libcublas.so.99, the cuBLAS of CuPy's CUDA version, is not loaded"):
        gemm._library()
    assert gemm._state["lib"] is None


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
    cupys = cp.cuda.get_cublas_handle()
    cupys_stream = cp.cuda.cublas.getStream(cupys)
    gemm.prepare_capture(cp)
    with stream:
        stream.begin_capture()
        outs = [gemm.matmul(a, b) for a, b, _ in cases]
        graph = stream.end_capture()
        graph.launch(stream)
    stream.synchronize()
    for (a, b, want), got in zip(cases, outs):
        assert got.tobytes() == want.tobytes(), (a.shape, b.shape, a.flags.f_contiguous, b.flags.f_contiguous)
    assert cp.cuda.get_cublas_handle() == cupys and cp.cuda.cublas.getStream(cupys) == cupys_stream
    assert gemm._state["devices"][cp.cuda.Device().id].handle != cupys


def test_a_bfloat16_product_computes_in_float32_as_cublas_requires():
    """cuBLAS multiplies bfloat16 with float32 accumulation only (CUBLAS_COMPUTE_32F, never TF32):
    the compute type a captured bfloat16 product passes, decided without CuPy."""
    from npformer.backend import bfloat16
    from npformer.backend.matmul_precision import cupy_cublas_compute_type
    pytest.importorskip("ml_dtypes", reason="bfloat16 is ml_dtypes' (the bfloat16 extra)")
    assert cupy_cublas_compute_type(bfloat16()) == CUBLAS_COMPUTE_32F
