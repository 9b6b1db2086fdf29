"""The backend module: choosing numpy/cupy, mixing rules, transfers, seeded generators, shims."""
import math
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from npformer import backend
from npformer.backend import (BackendUnavailableError, accumulated_sum, accumulation_dtype, bfloat16,
                              default_backend_name,
                              default_rng, erf, get_array_module, get_backend, is_float_dtype, matmul,
                              resolve_dtype, scatter_add, to_device, to_numpy)
from npformer.errors import MissingExtraError
from tests.helpers import posing_as_cupy


def _starting_backend(value: str) -> subprocess.CompletedProcess:
    code = ("import os; from npformer.backend import default_backend_name as d; a = d(); "
            "os.environ['NPFORMER_BACKEND'] = 'cupy'; print(a, d())")   # a later change: no effect
    env = {k: v for k, v in __import__("os").environ.items() if k != "NPFORMER_BACKEND"}
    return subprocess.run([sys.executable, "-c", code], env={**env, "NPFORMER_BACKEND": value},
                          capture_output=True, text=True)


def test_default_backend_is_numpy():
    run = _starting_backend("")
    assert run.returncode == 0 and run.stdout.split() == ["numpy", "numpy"], run.stderr
    with backend.default_backend("numpy"):
        assert get_backend() is np


def test_env_var_gives_the_starting_backend_read_once_at_import():
    run = _starting_backend("NumPy")
    assert run.returncode == 0 and run.stdout.split() == ["numpy", "numpy"], run.stderr
    run = _starting_backend("jax")
    assert run.returncode != 0
    assert "NPFORMER_BACKEND='jax' is not a backend; expected one of ('numpy', 'cupy')" in run.stderr


def test_default_backend_is_set_per_thread_and_for_a_block():
    import threading
    from npformer.backend import default_backend, set_default_backend
    from npformer.nn import Linear
    with default_backend("NumPy"):
        assert default_backend_name() == "numpy"
        assert isinstance(Linear(2, 2, rng=0).weight.data, np.ndarray)
    set_default_backend("cupy")
    try:
        seen = []
        t = threading.Thread(target=lambda: seen.append(default_backend_name()))
        t.start()
        t.join()
        assert default_backend_name() == "cupy" and seen == ["numpy"]     # another thread: its own
        with pytest.raises(ZeroDivisionError), default_backend("numpy"):
            1 / 0
        assert default_backend_name() == "cupy"
    finally:
        set_default_backend(None)
    assert default_backend_name() == "numpy"
    with pytest.raises(ValueError, match=r"unknown backend 'jax'; expected one of \('numpy', 'cupy'\)"):
        set_default_backend("jax")
    with pytest.raises(ValueError, match=r"unknown backend 'torch'"):
        with default_backend("torch"):
            pass


def test_unknown_backend_name():
    with pytest.raises(ValueError, match=r"unknown backend 'torch'; expected one of"):
        get_backend("torch")


def test_cupy_unavailable_is_one_clear_error(monkeypatch):
    # Make 'import cupy' fail the way it does on a machine without CuPy, whatever this one has.
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(BackendUnavailableError, match=r"backend 'cupy' was requested but CuPy cannot be imported.*nvidia-smi.*"
                                                      r"'npformer\[gpu-cuda12\]' for CUDA 12\.x, 'npformer\[gpu-cuda13\]'"):
        get_backend("cupy")
    assert backend.cupy_available() is False


def test_cupy_without_device_is_reported(monkeypatch):
    fake = types.ModuleType("cupy")
    runtime = types.SimpleNamespace(getDeviceCount=lambda: 0)
    fake.cuda = types.SimpleNamespace(runtime=runtime)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    with pytest.raises(BackendUnavailableError, match="no CUDA device is visible"):
        get_backend("cupy")


def test_array_module_of_numpy_scalars_and_none():
    a = np.zeros(3)
    assert get_array_module(a, None, 2.0, 3) is np
    assert get_array_module() is np
    assert get_array_module(np.float32(1)) is np


def test_mixing_backends_raises_naming_both(monkeypatch):
    class FakeCupyArray:
        shape, dtype, ndim = (3,), np.dtype("float32"), 1
    FakeCupyArray.__module__ = "cupy"
    FakeCupyArray.__name__ = "ndarray"
    fake = types.ModuleType("cupy")
    fake.ndarray = FakeCupyArray
    monkeypatch.setitem(sys.modules, "cupy", fake)
    gpu = FakeCupyArray()
    assert get_array_module(gpu) is fake
    with pytest.raises(TypeError, match=r"two backends were mixed in one call: numpy\.ndarray and cupy\.ndarray"):
        get_array_module(np.zeros(3), gpu)


def test_mixing_backends_inside_an_op_leaves_inputs_untouched(monkeypatch):
    from npformer.ops.linear import linear_forward
    x = np.ones((2, 3))
    w = posing_as_cupy(monkeypatch, np.ones((4, 3)))
    with pytest.raises(TypeError, match="two backends were mixed"):
        linear_forward(x, w)
    assert (x == 1).all() and (np.asarray(w) == 1).all()


def test_transfers_roundtrip_on_host():
    a = np.arange(6.0).reshape(2, 3)
    assert to_numpy(a) is a
    b = to_device(a, "numpy")
    np.testing.assert_array_equal(b, a)
    assert to_numpy([1, 2]).tolist() == [1, 2]


def test_seeded_generators_repeat():
    a = default_rng(3, "numpy").random(5)
    b = default_rng(3, "numpy").random(5)
    c = default_rng(4, "numpy").random(5)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_scatter_add_sums_repeated_indices():
    t = np.zeros((4, 2))
    scatter_add(t, np.array([1, 1, 3]), np.ones((3, 2)))
    np.testing.assert_array_equal(t, [[0, 0], [2, 2], [0, 0], [1, 1]])


def test_accumulation_dtype():
    assert accumulation_dtype(np.float16) == np.float32
    assert accumulation_dtype(np.float32) == np.float32
    assert accumulation_dtype(np.float64) == np.float64


def test_bfloat16_is_ml_dtypes_dtype_a_float_accumulated_in_float32():
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 needs ml_dtypes (pip install 'npformer[bfloat16]')")
    bf16 = np.dtype(ml_dtypes.bfloat16)
    assert bfloat16() == bf16 and bf16.kind == "V" and bf16.itemsize == 2      # not kind "f": is_float_dtype
    for name in ("bfloat16", ml_dtypes.bfloat16, bf16):
        assert resolve_dtype(np, name) == bf16
    assert resolve_dtype(np, "float16") == np.float16 and resolve_dtype(np, None) == np.float64
    assert all(is_float_dtype(d) for d in (bf16, np.float16, np.float32, np.float64))
    assert not any(is_float_dtype(d) for d in (np.int32, np.bool_, np.complex64, np.dtype("V2"), object))
    assert accumulation_dtype(bf16) == np.float32
    assert erf(np.asarray([0.5, -2.0], bf16)).dtype == bf16


def test_accumulated_sum_adds_16_bit_values_in_float32():
    """4096 ones down a column: float16 and bfloat16 running sums would stall at 2048 and 256."""
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 needs ml_dtypes (pip install 'npformer[bfloat16]')")
    for dtype in (np.float16, np.dtype(ml_dtypes.bfloat16)):
        ones = np.ones((4096, 3), dtype)
        got = accumulated_sum(ones, axis=0)
        assert got.dtype == dtype and np.array_equal(got.astype(np.float32), [4096.0] * 3)
        assert accumulated_sum(ones[:, 0], keepdims=True).shape == (1,)
    assert float(np.ones(4096, ml_dtypes.bfloat16).sum()) == 256.0        # what ml_dtypes' own sum gives
    x = np.random.default_rng(0).standard_normal((50, 7)).astype(np.float32)
    assert np.array_equal(accumulated_sum(x, axis=0), x.sum(axis=0))     # float32: the plain sum, bit for bit


def test_matmul_keeps_the_operands_dtype_rounding_numpys_float32_bfloat16_products():
    """NumPy's bfloat16 product (ml_dtypes) returns its float32 sums; matmul rounds them once, as
    cuBLAS and PyTorch do. Other dtypes: ``a @ b`` itself."""
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 needs ml_dtypes (pip install 'npformer[bfloat16]')")
    bf16 = np.dtype(ml_dtypes.bfloat16)
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((5, 33)).astype(bf16), rng.standard_normal((33, 4)).astype(bf16)
    assert (a @ b).dtype == np.float32                                  # what NumPy gives
    got = matmul(a, b)
    assert got.dtype == bf16
    np.testing.assert_array_equal(got.astype(np.float32), (a.astype(np.float32) @ b.astype(np.float32)).astype(bf16)
                                  .astype(np.float32))                  # exact products, float32 sums, one rounding
    for dtype in (np.float32, np.float64):
        x, y = a.astype(dtype), b.astype(dtype)
        assert matmul(x, y).dtype == dtype and np.array_equal(matmul(x, y), x @ y)


@pytest.mark.parametrize("shapes", [((5, 33), (33, 4)), ((3, 2, 7, 64), (3, 2, 64, 5)), ((2, 9, 16), (16, 3)),
                                    ((4, 0), (0, 6)), ((0, 8), (8, 2))])
def test_matmul_multiplies_numpys_float16_as_float32_by_blas_rounding_once(shapes):
    """NumPy float16 operands: widened, multiplied in float32 (BLAS) and rounded once, bit for bit; within
    an ulp of the exact product (NumPy's own float16 product, the same arithmetic in loops without
    BLAS, took 300 times as long)."""
    rng = np.random.default_rng(1)
    a, b = (rng.standard_normal(s).astype(np.float16) for s in shapes)
    got = matmul(a, b)
    assert got.dtype == np.float16 and got.shape == (a @ b).shape
    np.testing.assert_array_equal(got, (a.astype(np.float32) @ b.astype(np.float32)).astype(np.float16))
    exact = a.astype(np.float64) @ b.astype(np.float64)
    ulp = np.spacing(np.abs(exact).astype(np.float16)).astype(np.float64)
    assert (np.abs(got - exact) <= ulp).all()


def test_bfloat16_without_ml_dtypes_is_a_missing_extra_naming_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)                 # its import fails
    with pytest.raises(MissingExtraError, match=r'bfloat16 needs the ml_dtypes package.*"npformer\[bfloat16\]"'):
        bfloat16()
    with pytest.raises(ImportError):                                    # MissingExtraError is an ImportError too
        resolve_dtype(np, "bfloat16")
    assert resolve_dtype(np, "float16") == np.float16                   # the other dtypes need nothing


def test_erf_matches_math_erf_to_float64_precision():
    x = np.concatenate([np.linspace(-7, 7, 20001), [0.0, 0.46875, -0.46875, 4.0, -4.0, 1e-300, 27.0]])
    ref = np.array([math.erf(v) for v in x])
    got = erf(x)
    assert got.dtype == np.float64
    assert np.max(np.abs(got - ref) / np.maximum(np.abs(ref), 1e-300)) < 1e-15


def test_erf_edges_and_dtypes():
    got = erf(np.array([np.inf, -np.inf, np.nan, 0.0]))
    assert got[0] == 1.0 and got[1] == -1.0 and np.isnan(got[2]) and got[3] == 0.0
    assert erf(np.float32([0.5])).dtype == np.float32
    assert erf(np.float16([0.5])).dtype == np.float16


def test_import_npformer_never_imports_cupy():
    code = ("import sys, npformer, npformer.ops, npformer.tools; "
            "import npformer.cli; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('cupy', 'cupyx', 'torch', 'ml_dtypes')); "
            "print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_npformer_works_without_ml_dtypes_until_bfloat16_is_asked_for():
    """ml_dtypes is the optional extra npformer[bfloat16]: float16/32/64 models and training need none."""
    code = ("import sys; sys.modules['ml_dtypes'] = None; import numpy as np; import npformer; "
            "from npformer.models.gpt import GPT, GPTConfig; from npformer.training.amp import MixedPrecision; "
            "m = GPT(GPTConfig(vocab_size=5, block_size=4, n_layer=1, n_head=1, d_model=4), rng=0); "
            "MixedPrecision(m, 'float16'); print(m(np.zeros((1, 3), int)).dtype)\n"
            "try:\n    GPT(GPTConfig(vocab_size=5, block_size=4, n_layer=1, n_head=1, d_model=4), dtype='bfloat16')\n"
            "except npformer.errors.MissingExtraError as exc:\n    print(exc)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                         cwd=Path(__file__).resolve().parents[2])      # this checkout's npformer
    assert res.returncode == 0, res.stderr
    missing = ("bfloat16 needs the ml_dtypes package, which gives NumPy and CuPy the dtype: "
               'pip install "npformer[bfloat16]"')
    assert res.stdout.splitlines() == ["float16", missing], res.stdout


def test_import_npformer_works_when_cupy_is_broken():
    code = "import sys; sys.modules['cupy'] = None; import npformer; print(npformer.backend.get_backend().__name__)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip() == "numpy", res.stderr


def test_erf_float32_and_float16_are_the_float64_values_rounded_once():
    """The reference erf evaluates every dtype in float64 (Cody) and rounds once."""
    x = np.concatenate([np.linspace(-6, 6, 20_001), [np.inf, -np.inf, np.nan, 0.0, 1e-30]])
    for dtype in (np.float32, np.float16):
        xs = x.astype(dtype)
        got = erf(xs)
        assert got.dtype == dtype
        np.testing.assert_array_equal(got, erf(xs.astype(np.float64)).astype(dtype))
    y = np.linspace(-3, 3, 1001, dtype=np.float32)
    want = erf(y)
    out = np.empty_like(y)
    assert erf(y, out=out) is out and np.array_equal(out, want)
    assert erf(y, out=y) is y and np.array_equal(y, want)   # in place


def test_scatter_add_rows_matches_add_at():
    """The sorted row path against np.add.at: the same sums up to float32 reordering."""
    rng = np.random.default_rng(4)
    for n, v in ((1, 3), (1000, 7), (4096, 500)):
        ids = rng.integers(-v, v, n)                     # negative indices count from the end
        vals = rng.standard_normal((n, 6)).astype(np.float32)
        start = rng.standard_normal((v, 6)).astype(np.float32)
        want, got = start.astype(np.float64), start.copy()
        np.add.at(want, ids, vals.astype(np.float64))
        scatter_add(got, ids, vals)
        count = np.bincount(ids % v, minlength=v)[:, None]  # rows summed into each target row
        size = np.abs(start).astype(np.float64)             # the classic bound: n eps sum |terms|
        np.add.at(size, ids, np.abs(vals).astype(np.float64))
        assert np.all(np.abs(got - want) <= (count + 1) * np.finfo(np.float32).eps * size)
    with pytest.raises(IndexError):
        scatter_add(np.zeros((3, 2)), np.array([0, 3]), np.ones((2, 2)))


def test_scatter_add_rows_are_summed_in_a_fixed_order_to_float32_precision():
    """The row path (sorted runs, float64 sums of each run) against np.add.at in float64: skewed id
    frequencies (one id takes half the rows), negative ids counting from the end; every call the
    same bits (no order-dependent atomics)."""
    rng = np.random.default_rng(5)
    n, v, c = 4000, 300, 8
    ids = np.where(rng.random(n) < 0.5, 7, rng.integers(-v, v, n))
    vals = (rng.standard_normal((n, c)) * 1e-2).astype(np.float32)
    exact = np.zeros((v, c))
    np.add.at(exact, np.where(ids < 0, ids + v, ids), vals.astype(np.float64))
    got = [np.zeros((v, c), np.float32) for _ in range(2)]
    for g in got:
        scatter_add(g, ids, vals)
    np.testing.assert_array_equal(got[0], got[1])
    np.testing.assert_allclose(got[0], exact.astype(np.float32), rtol=2e-7, atol=1e-9)


def test_scatter_add_run_ends_gives_numpys_totals_bit_for_bit():
    """CuPy's half of the row path (no data-dependent shape: capturable in a CUDA graph), run on NumPy
    arrays, against NumPy's half: the same bits, skewed and negative ids, a non-zero start."""
    from npformer.backend.array_module import run_sums, scatter_add_run_ends
    rng = np.random.default_rng(6)
    for n, v in ((1, 3), (1000, 7), (3000, 400)):
        ids = np.where(rng.random(n) < 0.3, 2, rng.integers(-v, v, n))
        vals = rng.standard_normal((n, 5)).astype(np.float32)
        start = rng.standard_normal((v, 5)).astype(np.float32)
        want, got = start.copy(), start.copy()
        scatter_add(want, ids, vals)                                         # NumPy's half
        sorted_ids = np.sort(np.where(ids < 0, ids + v, ids), kind="stable")
        order = np.argsort(np.where(ids < 0, ids + v, ids), kind="stable")
        last = np.concatenate([sorted_ids[1:] != sorted_ids[:-1], [True]])
        sums = run_sums(vals[order], np.searchsorted(sorted_ids, sorted_ids, side="left"))
        scatter_add_run_ends(got, sorted_ids, last, sums)
        np.testing.assert_array_equal(got, want)


def test_run_sums_adds_each_run_alone():
    """Every row's sum from its run's first row, against a plain loop in float64, for runs of every
    length up to past a power of two (each pass of the scan's distance met)."""
    from npformer.backend.array_module import run_sums
    rng = np.random.default_rng(7)
    lengths = [1, 2, 3, 4, 5, 8, 9, 16, 17, 1]
    starts = np.repeat(np.cumsum([0] + lengths[:-1]), lengths)              # (N,)
    rows = rng.standard_normal((starts.size, 3))
    want = rows.copy()
    for i in range(1, starts.size):
        if starts[i] == starts[i - 1]:
            want[i] += want[i - 1]
    np.testing.assert_allclose(run_sums(rows, starts), want, rtol=1e-15, atol=1e-15)
    assert run_sums(rows[:1], starts[:1]).tolist() == rows[:1].tolist()


def test_scatter_add_totals_do_not_depend_on_the_other_ids_rows():
    """A huge or infinite row of one id must not reach another id's total (a difference of running
    sums over all rows gave id 1 [0, 2] for [3, 2] beside a 1e17, and NaN beside an inf)."""
    ids = np.array([0, 1, 1, 2])
    for dtype, big in ((np.float64, 1e17), (np.float32, np.inf)):
        rows = np.array([[big, 1.0], [1.0, 1.0], [2.0, 1.0], [3.0, 1.0]], dtype)
        got = np.zeros((3, 2), dtype)
        scatter_add(got, ids, rows)
        assert got.tolist() == [[big, 1.0], [3.0, 2.0], [3.0, 1.0]]
