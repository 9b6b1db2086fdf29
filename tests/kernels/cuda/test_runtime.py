"""The CUDA package on the CPU: no CuPy import, which arrays it takes, refusal of NumPy arrays, the
CUDA C compiling under nvcc, and the emulator catching barrier mistakes."""
import shutil
import subprocess
import sys

import numpy as np
import pytest

from npformer.backend import cupy_available, get_backend
from npformer import kernels
from npformer.kernels import cuda
from npformer.ops import activations, softmax
from npformer.kernels.cuda import runtime, source
from tests.helpers import host, randn
from tests.kernels.cuda import emulator
from tests.kernels.cuda.conftest import BFLOAT16


def test_importing_the_package_never_imports_cupy():
    code = ("import sys, numpy, npformer.kernels.cuda as f; "
            "assert not f.device_floats(numpy.zeros(3)); "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('cupy', 'cupyx')); "
            "print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_device_floats_is_false_for_numpy_and_non_arrays():
    assert not cuda.device_floats(np.zeros(3, np.float32))
    assert not cuda.device_floats(None)
    assert not cuda.device_floats()
    assert not cuda.device_floats([1.0, 2.0])


def test_device_floats_rules(monkeypatch):
    """As the dispatcher sees it with device arrays (here NumPy arrays posing as them)."""
    monkeypatch.setattr(runtime, "is_device_array", lambda a: isinstance(a, np.ndarray))
    f32, f16 = np.zeros((2, 3), np.float32), np.zeros((2, 3), np.float16)
    assert cuda.device_floats(f32) and cuda.device_floats(f16, None) and cuda.device_floats(f32, np.ones(3, np.float32))
    assert cuda.device_floats(f32, dtype="float32") and not cuda.device_floats(f32, dtype="float16")
    assert not cuda.device_floats(f32, f16)                          # mixed dtypes: the reference op decides
    if BFLOAT16:                                                     # ml_dtypes' bfloat16, by its name
        bf16 = f32.astype("bfloat16")
        assert cuda.device_floats(bf16, dtype="bfloat16") and not cuda.device_floats(bf16, f16)
    assert not cuda.device_floats(np.zeros((0, 3), np.float32))      # empty: nothing to launch
    assert not cuda.device_floats(np.zeros(3, np.int64))             # not a float: the reference op raises
    with kernels.disabled("numba"):                                  # (NumPy arrays: the compiled CPU path would come first)
        assert kernels.implementation(softmax.softmax_forward, f32) == "cuda"
    with kernels.disabled():                                         # the one switch turns it off
        assert kernels.implementation(softmax.softmax_forward, f32) == "reference"


@pytest.mark.parametrize("call", [
    lambda x: cuda.softmax_forward(x), lambda x: cuda.log_softmax_forward(x),
    lambda x: cuda.layer_norm_forward(x), lambda x: cuda.gelu_forward(x),
    lambda x: cuda.bias_add_forward(x, x[0]), lambda x: cuda.bias_grad(x),
    lambda x: cuda.bias_gelu_forward(x, x[0]),
    lambda x: cuda.dropout_forward(x, 0.5, rng=np.random.default_rng(0)), lambda x: cuda.sum_of_squares(x),
    lambda x: cuda.adam_update(x, x, x, x, step=1, lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8)])
def test_numpy_arrays_are_refused_with_a_clear_error(call):
    with pytest.raises(TypeError, match=r"the fused CUDA kernels take CuPy arrays; got numpy\.ndarray"):
        call(np.ones((2, 3), np.float32))


def test_gelu_constants_are_the_reference_ops():
    for name in ("SQRT_2_OVER_PI", "INV_SQRT_2", "INV_SQRT_2PI"):
        assert f"{getattr(activations, name)!r}" in source.KERNELS_SOURCE, name


def test_every_entry_point_exists_for_every_dtype():
    names = {name for name, _ in emulator._ENTRY.findall(source.CUDA_SOURCE)}
    kernels = {e[0] for e in source._ENTRY_POINTS}
    optimisers = {"npf_adam_update_f32", "npf_adam_update_f64",        # 16-bit parameters: the reference
                  "npf_adam_bf16_copy_update_f32",                      # float32 masters, a bfloat16 model
                  "npf_adam_f16_grad_update_f32", "npf_adam_bf16_grad_update_f32",   # ... reading its gradients
                  "npf_sum_squares_f16", "npf_sum_squares_bf16", "npf_sum_squares_f32", "npf_sum_squares_f64"}
    assert names == {f"npf_{k}_{s}" for k in kernels for s in ("f16", "bf16", "f32", "f64")} | optimisers
    assert "@" not in source.CUDA_SOURCE                             # every constant substituted


def _sources(which: str) -> list[tuple[str, str, tuple]]:
    """(name, CUDA source, NVRTC options) of each module: the common one, or flash's (one per dtype and
    head-size bucket), its template instantiations named by taking their addresses (what NVRTC's name
    expressions do)."""
    return [(name, m.source + "".join(f"\nvoid* npf_instance_{i} = (void*)&{e};" for i, e in
                                       enumerate(m.kernels.values())), m.options)
            for name, m in runtime.shipped_modules().items() if (name == runtime.COMMON_MODULE) == (which == "common")]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc (CUDA toolkit) is not installed")
@pytest.mark.parametrize("which", ["common", "flash"])
def test_cuda_source_compiles_with_nvcc(tmp_path, which):
    """The device compiler itself, no GPU needed: warnings are errors, with each module's NVRTC options
    (the modules compile in parallel)."""
    runs = []
    for name, text, options in _sources(which):
        src = tmp_path / f"{name}.cu"
        src.write_text(text)
        arch = () if any(o.startswith("-arch") for o in options) else ("-arch=sm_80",)   # the Hopper modules': sm_90a
        cmd = ["nvcc", "-cubin", *arch, *options, "-Werror", "all-warnings",
               "-o", str(tmp_path / f"{name}.cubin"), str(src)]
        runs.append((name, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
    for name, proc in runs:
        _, err = proc.communicate()
        assert proc.returncode == 0, f"{name}: {err}"


_DIVERGENT = r"""
extern "C" __global__ void npf_divergent_f32(float* out) {
    if (threadIdx.x == 0) return;            // thread 0 never reaches the barrier
    __syncthreads();
    out[threadIdx.x] = 1.0f;
}
"""


def test_the_emulator_catches_a_missing_or_divergent_barrier(tmp_path, emulated_module):
    """The checker is tested too: drop the barrier that guards the reuse of the block-sum buffer
    (layer norm sums twice in a row: the mean, then the variance), and add a kernel whose barrier
    thread 0 skips; the first must give wrong rows, the second an error."""
    guard = "    A total = buf[0];\n    __syncthreads();                       // buf is reused by the next reduction\n"
    assert source.KERNELS_SOURCE.count(guard) == 1
    broken = source.KERNELS_SOURCE.replace(guard, "    A total = buf[0];\n") + _DIVERGENT
    module = emulator.EmulatedModule(emulator.build(tmp_path, broken), broken)
    x = randn(np, (4, 64), 0, dtype="float32")
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    ref = (x - mu) / np.sqrt(var + np.float32(1e-5))

    def run(mod):
        y, mean, rstd = np.empty_like(x), np.empty((4, 1), np.float32), np.empty((4, 1), np.float32)
        mod.get_function("npf_layer_norm_fwd_f32")((4,), (64,), (x, x, x, y, mean, rstd, np.int64(4), np.int32(64),
                                                                  np.float32(1e-5), np.int32(0), np.int32(0)))
        return y

    assert np.abs(run(module) - ref).max() > 1e-2
    with pytest.raises(AssertionError, match="disagreed on a __syncthreads"):
        module.get_function("npf_divergent_f32")((1,), (32,), (np.zeros(32, np.float32),))
    np.testing.assert_allclose(run(emulated_module), ref, atol=1e-5)   # the intact kernels are right


def test_the_emulator_refuses_what_a_gpu_would_misread(emulated_module):
    k = emulated_module.get_function("npf_softmax_fwd_f32")
    x = np.ones((2, 4), np.float32)
    with pytest.raises(AssertionError, match="not C-contiguous"):
        k((2,), (32,), (x.T, np.empty((4, 2), np.float32), np.int64(2), np.int32(4), np.int32(0)))
    with pytest.raises(AssertionError, match="float64 for a float"):
        k((2,), (32,), (x.astype(np.float64), x, np.int64(2), np.int32(4), np.int32(0)))
    with pytest.raises(AssertionError, match="int for a long long"):
        k((2,), (32,), (x, x.copy(), 2, np.int32(4), np.int32(0)))
    with pytest.raises(AssertionError, match="power-of-two block"):
        k((2,), (48,), (x, x.copy(), np.int64(2), np.int32(4), np.int32(0)))


@pytest.mark.gpu
def test_on_the_gpu_the_real_module_compiles_and_dispatches(monkeypatch):
    if not cupy_available():
        pytest.skip("CuPy is not installed or no CUDA device is visible")
    cp = get_backend("cupy")
    x = cp.asarray(randn(np, (3, 5), 0, dtype="float32"))
    assert cuda.device_floats(x) and kernels.implementation(softmax.softmax_forward, x) == "cuda"
    y, _ = cuda.softmax_forward(x)                      # NVRTC compiles the whole source here
    np.testing.assert_allclose(host(y).sum(-1), 1.0, rtol=1e-6)
    with pytest.raises(TypeError, match="two backends were mixed"):
        cuda.dropout_forward(x, 0.5, rng=np.random.default_rng(0))   # a NumPy Generator with CuPy data


def test_float32_on_tf32_reads_cupys_float32_compute_type(monkeypatch):
    """The flash kernels follow set_float32_matmul_precision: TF32 when CuPy's float32 products use
    COMPUTE_TYPE_TF32 (a stand-in for CuPy's matmul module here), exact float32 otherwise."""
    import types
    linalg = types.SimpleNamespace(COMPUTE_TYPE_TF32=7, compute=0)
    linalg.get_compute_type = lambda dtype: linalg.compute if np.dtype(dtype) == np.float32 else 0
    monkeypatch.setitem(sys.modules, "cupy._core._routines_linalg", linalg)
    assert runtime.float32_on_tf32() is False
    linalg.compute = 7
    assert runtime.float32_on_tf32() is True
