"""Hopper's warpgroup primitives (npformer/kernels/cuda/warpgroup.cuh) against NumPy: one warpgroup's wgmma of
m64n64k16 and m64n128k16, A from shared memory or from registers, B K-major or N-major, float16 and
bfloat16, one to four steps along K chained in one group, with and without the accumulator. The operands
sit in 128-byte-swizzled tiles whose descriptors npf_wgmma_desc makes, so a wrong layout, swizzle, lbo or
sbo moves values and fails the exact comparison.

The same test kernel (tests/kernels/cuda/warpgroup_test.cu) runs on the CPU emulator and, on a GPU of
compute capability 9.0, on the device: the emulator encodes this project's reading of the PTX ISA's
layouts, so only the device run confirms that reading. The emulator's own strictness (a wgmma runs at
the wait that lets it finish; a collective that not all 128 threads reach, a wgmma never waited for, or
its accumulators or A registers written before its wait, is an error) is tested at the end."""

import numpy as np
import pytest

from npformer.backend import cupy_available, get_backend
from npformer.kernels.cuda import runtime
from npformer.kernels.cuda.source import PRELUDE
from npformer.kernels.cuda.warp_source import WARP_PRIMITIVES, WARPGROUP_PRIMITIVES
from tests.kernels.cuda import emulator
from tests.kernels.cuda.sources import WARPGROUP_TEST_KERNELS, WARPGROUP_TEST_OPTIONS, WARPGROUP_TEST_SOURCE

NO_ML_DTYPES = "ml_dtypes not installed: it names NumPy's bfloat16 dtype (pip install ml_dtypes)"


@pytest.fixture(scope="module", params=["emulated", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request, tmp_path_factory):
    """(module with the test kernel's instantiations, to_device, to_host) on the emulator or a GPU."""
    if request.param == "cuda":
        if not cupy_available():
            pytest.skip("CuPy is not installed or no CUDA device is visible")
        cp = get_backend("cupy")
        capability = cp.cuda.Device().compute_capability
        if capability != "90":
            pytest.skip(f"wgmma needs compute capability 9.0 (sm_90a); this GPU's is {capability}")
        return (runtime.compile_module(WARPGROUP_TEST_SOURCE, WARPGROUP_TEST_OPTIONS, WARPGROUP_TEST_KERNELS),
                cp.asarray, cp.asnumpy)
    return (emulator.emulated_module(tmp_path_factory.mktemp("npf_warpgroup"), WARPGROUP_TEST_SOURCE,
                                     WARPGROUP_TEST_KERNELS), np.asarray, np.asarray)


def _dtype(bf16: bool):
    if not bf16:
        return np.dtype(np.float16)
    return np.dtype(pytest.importorskip("ml_dtypes", reason=NO_ML_DTYPES).bfloat16)


FORMS = {"ss": ("false", 0), "rs": ("true", 0), "rs_trans": ("true", 1)}


def _run(device, n, k, form, bf16, accumulate, seed=0):
    """(D the kernel wrote, A @ B + C or A @ B): small multiples of 1/8, so every sum is exact in float32."""
    module, to_device, to_host = device
    dtype, r = _dtype(bf16), np.random.default_rng(seed)
    a = (r.integers(-16, 17, (64, k)) / 8).astype(dtype)
    b = (r.integers(-16, 17, (k, n)) / 8).astype(dtype)
    c = (r.integers(-64, 65, (64, n)) / 4).astype(np.float32)
    rs, trans_b = FORMS[form]
    b_given = b if trans_b else np.ascontiguousarray(b.T)         # N-major: B itself; K-major: its transpose
    d = to_device(np.zeros((64, n), np.float32))
    kernel = module.get_function(f"npf_test_wgmma<{n}, {k}, {rs}, {trans_b}, {'true' if bf16 else 'false'}>")
    kernel((1,), (128,), (to_device(a.view(np.uint16)), to_device(b_given.view(np.uint16)), to_device(c), d,
                          np.int32(accumulate)))
    want = a.astype(np.float32) @ b.astype(np.float32) + (c if accumulate else 0)
    return to_host(d), want


@pytest.mark.parametrize("bf16", [False, True], ids=["f16", "bf16"])
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("k", [16, 64])
@pytest.mark.parametrize("n", [64, 128])
def test_wgmma_is_a_times_b_plus_c(device, n, k, form, bf16):
    got, want = _run(device, n, k, form, bf16, accumulate=1, seed=n + k)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("form", list(FORMS))
def test_wgmma_without_the_accumulator_ignores_it(device, form):
    """scale-d 0 on the first step: D = A B, whatever the accumulators held (the kernel fills them with 1e6)."""
    got, want = _run(device, 128, 64, form, False, accumulate=0, seed=7)
    np.testing.assert_array_equal(got, want)


_STRICT = r"""
// one 64 x 64 x 16 wgmma from tiles of ones (A) and twos (B): 32 in every entry of D
__device__ void npf_strict_tiles(unsigned char* a, unsigned char* b) {
    for (unsigned i = threadIdx.x; i < 64 * 64; i += blockDim.x) {
        ((unsigned short*)a)[i] = 0x3c00;                     // float16 1
        ((unsigned short*)b)[i] = 0x4000;                     // float16 2
    }
    npf_fence_async_shared();
    __syncthreads();
}
// that wgmma, issued and committed (not waited for) into d
#define NPF_STRICT_ISSUE(d)                                                                          \
    __shared__ __align__(1024) unsigned char a[64 * 128];                                            \
    __shared__ __align__(1024) unsigned char b[64 * 128];                                            \
    npf_strict_tiles(a, b);                                                                          \
    float d[32];                                                                                     \
    npf_wgmma_fence();                                                                               \
    npf_wgmma_m64n64k16_ss(d, npf_wgmma_desc(a, 16, 1024), npf_wgmma_desc(b, 16, 1024), 0);          \
    npf_wgmma_commit();
extern "C" __global__ void npf_strict_overwrite_before_wait(float* out) {
    NPF_STRICT_ISSUE(d)
    for (unsigned i = threadIdx.x; i < 64 * 64; i += blockDim.x) ((unsigned short*)b)[i] = 0;   // too early
    __syncthreads();
    npf_wgmma_wait<0>();
    npf_wgmma_hold<32>(d);
    out[threadIdx.x] = d[0];
}
extern "C" __global__ void npf_strict_three_warps(float* out) {
    __shared__ __align__(1024) unsigned char a[64 * 128];
    __shared__ __align__(1024) unsigned char b[64 * 128];
    npf_strict_tiles(a, b);
    float d[32];
    if (threadIdx.x < 96) {                                   // a warpgroup's 4th warp never comes
        npf_wgmma_fence();
        npf_wgmma_m64n64k16_ss(d, npf_wgmma_desc(a, 16, 1024), npf_wgmma_desc(b, 16, 1024), 0);
        npf_wgmma_commit();
        npf_wgmma_wait<0>();
        out[threadIdx.x] = d[0];
    }
}
extern "C" __global__ void npf_strict_accumulator_written_before_wait(float* out) {
    NPF_STRICT_ISSUE(d)
    d[0] = 5.0f;                                              // the wgmma writes d meanwhile
    npf_wgmma_wait<0>();
    npf_wgmma_hold<32>(d);
    out[threadIdx.x] = d[0];
}
extern "C" __global__ void npf_strict_a_registers_written_before_wait(float* out) {
    __shared__ __align__(1024) unsigned char a[64 * 128];
    __shared__ __align__(1024) unsigned char b[64 * 128];
    npf_strict_tiles(a, b);
    float d[32];
    unsigned ra[4] = {0x3c003c00u, 0x3c003c00u, 0x3c003c00u, 0x3c003c00u};   // float16 ones
    npf_wgmma_fence();
    npf_wgmma_m64n64k16_rs<0>(d, ra, npf_wgmma_desc(b, 16, 1024), 0);
    npf_wgmma_commit();
    ra[2] = 0u;                                               // the wgmma reads ra meanwhile
    npf_wgmma_wait<0>();
    npf_wgmma_hold<32>(d);
    npf_wgmma_hold<4>(ra);
    out[threadIdx.x] = d[0];
}
extern "C" __global__ void npf_strict_never_waited(float* out) {
    NPF_STRICT_ISSUE(d)
    out[threadIdx.x] = 1.0f;
}
"""


@pytest.fixture(scope="module")
def strict(tmp_path_factory):
    return emulator.emulated_module(tmp_path_factory.mktemp("npf_strict"),
                                    WARP_PRIMITIVES + WARPGROUP_PRIMITIVES + PRELUDE + _STRICT)


def test_the_emulator_runs_a_wgmma_at_its_wait(strict):
    """B overwritten with zeros between the commit and the wait: CUDA leaves the result undefined; the
    emulator reads the tiles at the wait, so the mistake shows (0, not 32)."""
    out = np.full(128, -1.0, np.float32)
    strict.get_function("npf_strict_overwrite_before_wait")((1,), (128,), (out,))
    np.testing.assert_array_equal(out, np.zeros(128, np.float32))


@pytest.mark.parametrize("kernel", ["npf_strict_three_warps", "npf_strict_never_waited",
                                    "npf_strict_accumulator_written_before_wait",
                                    "npf_strict_a_registers_written_before_wait"])
def test_the_emulator_refuses_a_wgmma_misused(strict, kernel):
    """A wgmma that not all 128 threads reach or that nothing waits for; a thread that writes the
    accumulators or A registers of a wgmma in flight (on a GPU the wgmma reads and writes them then)."""
    with pytest.raises(AssertionError, match="disagreed on a __syncthreads or a warp"):
        strict.get_function(kernel)((1,), (128,), (np.zeros(128, np.float32),))
