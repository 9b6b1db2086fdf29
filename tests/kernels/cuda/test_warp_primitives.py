"""The warp-level primitives of tensor-core kernels (npformer.kernels.cuda.warp_source) against NumPy,
fragment position by position: mma.sync m16n8k16 (float16 or bfloat16 in, float32 accumulate) and m16n8k8
(TF32 in), the TF32 rounding cvt.rna.tf32.f32, bfloat16's conversions (cvt.rn.bf16.f32 on the GPU), ldmatrix x4 and
its transpose, __shfl_xor_sync on float and double, cp.async through a double buffer. The same tiny
kernels run on the CPU emulator and, on a GPU, on the device (the GPU check runs this file first, so
a layout mistake shows before anything built on it)."""
import contextlib

import numpy as np
import pytest

from npformer.backend import cupy_available, get_backend
from npformer.kernels.cuda import runtime
from tests.kernels.cuda import emulator
from tests.kernels.cuda.sources import PRIMITIVES_NVRTC_OPTIONS, PRIMITIVES_SOURCE


@pytest.fixture(scope="module", params=["emulated", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request, tmp_path_factory):
    """(module with the test kernels, to_device, to_host) on the emulator or a GPU."""
    if request.param == "cuda":
        if not cupy_available():
            pytest.skip("CuPy is not installed or no CUDA device is visible")
        cp = get_backend("cupy")
        return runtime.compile_module(PRIMITIVES_SOURCE, PRIMITIVES_NVRTC_OPTIONS), cp.asarray, cp.asnumpy
    module = emulator.emulated_module(tmp_path_factory.mktemp("npf_primitives"), PRIMITIVES_SOURCE)
    return module, np.asarray, np.asarray


def _halves(rng, shape):
    """float16 values whose products and short sums are exact in float32 (small integers over 8)."""
    return (rng.integers(-16, 17, shape) / 8).astype(np.float16)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mma_m16n8k16_is_a_times_b_plus_c(device, seed):
    module, to_device, to_host = device
    r = np.random.default_rng(seed)
    a, b = _halves(r, (16, 16)), _halves(r, (16, 8))
    c = (r.integers(-64, 65, (16, 8)) / 4).astype(np.float32)
    d = to_device(np.zeros((16, 8), np.float32))
    module.get_function("npf_test_mma")((1,), (32,), (to_device(a), to_device(b), to_device(c), d))
    want = a.astype(np.float32) @ b.astype(np.float32) + c              # exact: small multiples of 1/64
    np.testing.assert_array_equal(to_host(d), want)


def test_mma_accumulates_in_float32(device):
    """Sixteen products of 2^-12 added to 1: float16 would keep 1, float32 keeps 1 + 2^-8."""
    module, to_device, to_host = device
    a = np.full((16, 16), 2.0 ** -6, np.float16)
    b = np.full((16, 8), 2.0 ** -6, np.float16)
    c = np.ones((16, 8), np.float32)
    d = to_device(np.zeros((16, 8), np.float32))
    module.get_function("npf_test_mma")((1,), (32,), (to_device(a), to_device(b), to_device(c), d))
    np.testing.assert_array_equal(to_host(d), np.full((16, 8), 1 + 2.0 ** -8, np.float32))


NO_ML_DTYPES = "ml_dtypes not installed: it names NumPy's bfloat16 dtype (pip install ml_dtypes)"


def _bfloat16():
    return np.dtype(pytest.importorskip("ml_dtypes", reason=NO_ML_DTYPES).bfloat16)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mma_m16n8k16_bf16_is_a_times_b_plus_c(device, seed):
    """bfloat16 operands in float16's fragment layouts: values beyond float16's range (2^100) too, exact
    products (8 significant bits each) and sums of powers of two apart by less than float32 keeps."""
    module, to_device, to_host = device
    bf16, r = _bfloat16(), np.random.default_rng(seed)
    a = (r.integers(-16, 17, (16, 16)) / 8 * 2.0 ** 100).astype(bf16)
    b = (r.integers(-16, 17, (16, 8)) / 8 * 2.0 ** -90).astype(bf16)
    c = (r.integers(-64, 65, (16, 8)) / 4 * 2.0 ** 10).astype(np.float32)
    d = to_device(np.zeros((16, 8), np.float32))
    module.get_function("npf_test_mma_bf16")((1,), (32,), (to_device(a), to_device(b), to_device(c), d))
    want = a.astype(np.float32) @ b.astype(np.float32) + c              # exact: small multiples of 2^4
    np.testing.assert_array_equal(to_host(d), want)


def test_bf16_conversions_are_round_to_nearest_even(device):
    """npf_store to bfloat16 gives ml_dtypes' bits (round to nearest even: ties both ways, the carry into
    the exponent, overflow to infinity, subnormals, signed zeros), a NaN stays a NaN; npf_load reads each
    back exactly (the upper half of a float32)."""
    module, to_device, to_host = device
    bf16 = _bfloat16()
    one = np.float32(1.0).view(np.uint32)
    bits = np.array([one + 0x8000, one + 0x18000, one + 0x7FFF, one + 0x8001, 0x3F7FFFFF, 0x7F7F8000, 0x7F7FFFFF,
                     0x00008000, 0x00018000, 0x00000001, 0x80000000, 0xBF808000, 0x7F800000, 0xFF800000],
                    np.uint32)
    x = np.concatenate([bits.view(np.float32), np.random.default_rng(0).standard_normal(200).astype(np.float32)
                        * np.float32(2.0) ** np.random.default_rng(1).integers(-140, 120, 200)]).astype(np.float32)
    x = np.concatenate([x, np.array([np.nan, -np.nan], np.float32)])
    h, back = to_device(np.zeros(x.size, bf16)), to_device(np.zeros(x.size, np.float32))
    module.get_function("npf_test_bf16")((1,), (64,), (to_device(x), h, back, np.int32(x.size)))
    got, want = to_host(h), x.astype(bf16)
    finite = ~np.isnan(x)
    np.testing.assert_array_equal(got[finite].view(np.uint16), want[finite].view(np.uint16))
    assert np.isnan(got[~finite].astype(np.float32)).all()
    np.testing.assert_array_equal(to_host(back)[finite].view(np.uint32), want[finite].astype(np.float32).view(np.uint32))


def _tf32(x):
    """NumPy's model of cvt.rna.tf32.f32 for finite float32 x: to 10 mantissa bits, ties away from zero."""
    bits = np.asarray(x, np.float32).view(np.uint32)
    return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mma_m16n8k8_tf32_is_a_times_b_plus_c(device, seed):
    module, to_device, to_host = device
    r = np.random.default_rng(seed)
    a = (r.integers(-16, 17, (16, 8)) / 8).astype(np.float32)           # TF32 values: npf_tf32 keeps them
    b = (r.integers(-16, 17, (8, 8)) / 8).astype(np.float32)
    c = (r.integers(-64, 65, (16, 8)) / 4).astype(np.float32)
    d = to_device(np.zeros((16, 8), np.float32))
    module.get_function("npf_test_mma_tf32")((1,), (32,), (to_device(a), to_device(b), to_device(c), d))
    np.testing.assert_array_equal(to_host(d), a @ b + c)                 # exact: small multiples of 1/64


def test_mma_tf32_multiplies_the_rounded_operands(device):
    """1 + 2^-11 is a tie between TF32's 1 and 1 + 2^-10: rounded away, so 8 products of it by 1 give
    8 + 2^-7 (float32 operands would give 8 + 2^-8; truncated ones 8)."""
    module, to_device, to_host = device
    a = np.full((16, 8), 1 + 2.0 ** -11, np.float32)
    b = np.ones((8, 8), np.float32)
    d = to_device(np.zeros((16, 8), np.float32))
    module.get_function("npf_test_mma_tf32")((1,), (32,), (to_device(a), to_device(b),
                                                           to_device(np.zeros((16, 8), np.float32)), d))
    np.testing.assert_array_equal(to_host(d), np.full((16, 8), 8 + 2.0 ** -7, np.float32))


def test_tf32_rounds_to_nearest_ties_away_from_zero(device):
    module, to_device, to_host = device
    one_ulp = 2.0 ** -10                                                 # TF32's step above 1
    x = np.array([1.0, 1 + one_ulp / 2, 1 + one_ulp / 4, 1 + 3 * one_ulp / 4, 1 + one_ulp / 2 + 2.0 ** -20,
                  -(1 + one_ulp / 2), -(1 + one_ulp / 4), 3.0e38, -2.5e-30, 1234.5678, -0.0, 0.1], np.float32)
    x = np.concatenate([x, np.random.default_rng(0).standard_normal(52).astype(np.float32) * 100])
    out = to_device(np.zeros(x.size, np.uint32))
    module.get_function("npf_test_tf32")((1,), (32,), (to_device(x), out, np.int32(x.size)))
    got = to_host(out).view(np.float32)
    np.testing.assert_array_equal(got, _tf32(x))
    assert got[1] == 1 + one_ulp and got[5] == -(1 + one_ulp) and got[2] == 1.0 and got[3] == 1 + one_ulp
    assert not (to_host(out) & np.uint32(0x1FFF)).any()                  # 13 low bits: zero


@pytest.mark.parametrize("trans", [0, 1])
def test_ldmatrix_x4_gives_each_lane_its_fragment(device, trans):
    """Register j of lane l: row l / 4, columns 2 (l % 4) and + 1 of matrix j (low half first);
    transposed: column l / 4, rows 2 (l % 4) and + 1."""
    module, to_device, to_host = device
    m = np.arange(4 * 64, dtype=np.uint16)                       # distinct bits: a position is its value
    out = to_device(np.zeros(32 * 4, np.uint32))
    module.get_function("npf_test_ldmatrix")((1,), (32,), (to_device(m.view(np.float16)), out, np.int32(trans)))
    mats = m.reshape(4, 8, 8)
    got = to_host(out).reshape(32, 4)
    for lane in range(32):
        for j in range(4):
            if trans:
                lo, hi = mats[j, 2 * (lane % 4), lane // 4], mats[j, 2 * (lane % 4) + 1, lane // 4]
            else:
                lo, hi = mats[j, lane // 4, 2 * (lane % 4)], mats[j, lane // 4, 2 * (lane % 4) + 1]
            assert got[lane, j] == int(lo) | (int(hi) << 16), (lane, j, hex(got[lane, j]))


@pytest.mark.parametrize("mask", [1, 2, 4, 8, 16, 31])
def test_shfl_xor_reads_lane_l_xor_mask(device, mask):
    module, to_device, to_host = device
    x = np.arange(32, dtype=np.float32) * 1.5
    y = np.arange(32, dtype=np.float64) * (1 + 2.0 ** -40)            # both halves of a double move
    xo, yo = to_device(np.zeros(32, np.float32)), to_device(np.zeros(32, np.float64))
    module.get_function("npf_test_shfl")((1,), (32,), (to_device(x), to_device(y), xo, yo, np.int32(mask)))
    lanes = np.arange(32) ^ mask
    np.testing.assert_array_equal(to_host(xo), x[lanes])
    np.testing.assert_array_equal(to_host(yo), y[lanes])


@pytest.mark.parametrize("nbytes", [16, 8, 4, 0])
def test_cp_async_zero_fill_copies_the_first_bytes_and_zeros_the_rest(device, nbytes):
    module, to_device, to_host = device
    src = np.arange(1, 32 * 4 + 1, dtype=np.float32)
    dst = to_device(np.full(32 * 4, 7.0, np.float32))
    module.get_function("npf_test_cp_async_zfill")((1,), (32,), (to_device(src), dst, np.int32(nbytes)))
    want = src.reshape(32, 4).copy()
    want[:, nbytes // 4:] = 0.0
    np.testing.assert_array_equal(to_host(dst).reshape(32, 4), want)


@pytest.mark.parametrize("chunks", [1, 2, 5])
def test_cp_async_double_buffer_copies_every_chunk(device, chunks):
    module, to_device, to_host = device
    src = np.random.default_rng(chunks).standard_normal(chunks * 256).astype(np.float32)
    dst = to_device(np.zeros_like(src))
    module.get_function("npf_test_cp_async")((1,), (64,), (to_device(src), dst, np.int64(src.size)))
    np.testing.assert_array_equal(to_host(dst), src)


_DIVERGENT = r"""
extern "C" __global__ void npf_test_half_warp_shuffles(float* x) {
    if (threadIdx.x < 16) x[threadIdx.x] = __shfl_xor_sync(0xffffffffu, x[threadIdx.x], 1);
}
extern "C" __global__ void npf_test_barrier_beside_a_shuffle(float* x) {
    if (threadIdx.x % 2) __syncthreads();
    else x[threadIdx.x] = __shfl_xor_sync(0xffffffffu, x[threadIdx.x], 2);
}
"""


@pytest.mark.parametrize("kernel", ["npf_test_half_warp_shuffles", "npf_test_barrier_beside_a_shuffle"])
def test_the_emulator_refuses_a_collective_that_not_every_lane_reaches(tmp_path, kernel):
    """CUDA leaves these undefined (or hangs); the emulator says so instead of inventing a result."""
    module = emulator.emulated_module(tmp_path, _DIVERGENT)
    with pytest.raises(AssertionError, match="disagreed on a __syncthreads or a warp"):
        module.get_function(kernel)((1,), (32,), (np.zeros(32, np.float32),))


_RACY_COPIES = r"""
extern "C" __global__ void npf_test_read_before_the_wait(const float* src, float* dst) {
    // reads its chunk between the copy's issue and its wait: a race on a GPU
    __shared__ __align__(16) float buf[32 * 4];
    npf_cp_async_16(&buf[threadIdx.x * 4], src + threadIdx.x * 4);
    npf_cp_async_commit();
    for (int i = 0; i < 4; ++i) dst[threadIdx.x * 4 + i] = buf[threadIdx.x * 4 + i];
    npf_cp_async_wait<0>();
}
extern "C" __global__ void npf_test_copy_over_a_tile_being_read(const float* src, float* dst, int barrier) {
    // each thread reads its neighbour's chunk of the first copy, then copies the second over its own chunk:
    // without the barrier between, a thread may overwrite a chunk its neighbour has yet to read
    __shared__ __align__(16) float buf[32 * 4];
    unsigned next = (threadIdx.x + 1) % 32;
    npf_cp_async_16(&buf[threadIdx.x * 4], src + threadIdx.x * 4);
    npf_cp_async_commit();
    npf_cp_async_wait<0>();
    __syncthreads();
    for (int i = 0; i < 4; ++i) dst[threadIdx.x * 4 + i] = buf[next * 4 + i];
    if (barrier) __syncthreads();
    npf_cp_async_16(&buf[threadIdx.x * 4], src + 128 + threadIdx.x * 4);   // in flight past the next barrier,
    npf_cp_async_commit();                                                  // as a pipeline's next tile
    __syncthreads();
    npf_cp_async_wait<0>();
}
extern "C" __global__ void npf_test_copy_never_waited_for(const float* src) {
    __shared__ __align__(16) float buf[32 * 4];
    npf_cp_async_16(&buf[threadIdx.x * 4], src + threadIdx.x * 4);
    npf_cp_async_commit();
}
extern "C" __global__ void npf_test_copy_not_aligned(const float* src, float* dst, int offset) {
    // 16 bytes from src + offset values: 16-byte aligned (src is) only where offset is a multiple of 4
    __shared__ __align__(16) float buf[32 * 4];
    npf_cp_async_16(&buf[threadIdx.x * 4], src + offset + threadIdx.x * 4);
    npf_cp_async_commit();
    npf_cp_async_wait<0>();
    for (int i = 0; i < 4; ++i) dst[threadIdx.x * 4 + i] = buf[threadIdx.x * 4 + i];
}
"""


@pytest.fixture(scope="module")
def racy_copies(tmp_path_factory):
    return emulator.emulated_module(tmp_path_factory.mktemp("npf_racy"), _RACY_COPIES)


def test_the_emulator_shows_a_cp_async_destination_read_before_its_wait_as_nan(racy_copies):
    """A GPU may show the old bytes or the new there; the emulator shows neither, so the race cannot pass."""
    dst = np.zeros(128, np.float32)
    racy_copies.get_function("npf_test_read_before_the_wait")((1,), (32,), (np.ones(128, np.float32), dst))
    assert np.isnan(dst).all()


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("barrier", [1, 0])
def test_the_emulator_shows_a_copy_issued_over_a_tile_not_yet_read(racy_copies, barrier, reverse):
    """With the barrier every thread reads its neighbour's first chunk; without it the last thread's neighbour
    (thread 0, which runs first) has already issued its second copy over that chunk; with the threads run
    last first (emulator.reversed_schedule), every thread's neighbour but thread 31's has."""
    src = np.arange(256, dtype=np.float32)
    dst = np.zeros(128, np.float32)
    with emulator.reversed_schedule(racy_copies) if reverse else contextlib.nullcontext():
        racy_copies.get_function("npf_test_copy_over_a_tile_being_read")((1,), (32,), (src, dst, np.int32(barrier)))
    got, want = dst.reshape(32, 4), np.roll(src[:128].reshape(32, 4), -1, axis=0)
    lanes = np.arange(32)
    raced = (lanes < 31 if reverse else lanes == 31) & (not barrier)
    np.testing.assert_array_equal(got[~raced], want[~raced])
    assert np.isnan(got[raced]).all()


def test_the_emulator_refuses_a_cp_async_never_waited_for(racy_copies):
    with pytest.raises(AssertionError, match="cp.async copy it never waited for"):
        racy_copies.get_function("npf_test_copy_never_waited_for")((1,), (32,), (np.ones(128, np.float32),))


def test_the_emulator_refuses_a_cp_async_not_16_byte_aligned(racy_copies):
    """A GPU faults on a 16-byte cp.async from an address not 16-byte aligned (the PTX ISA: its addresses aligned
    to its size); the emulator, whose memcpy would copy it, refuses it."""
    src = np.arange(256, dtype=np.float32)
    dst = np.zeros(128, np.float32)
    copy = racy_copies.get_function("npf_test_copy_not_aligned")
    copy((1,), (32,), (src, dst, np.int32(4)))
    np.testing.assert_array_equal(dst, src[4:132])
    with pytest.raises(AssertionError, match="not 16-byte aligned"):
        copy((1,), (32,), (src, dst, np.int32(1)))


_LEFTOVER_SHARED = r"""
extern "C" __global__ void npf_test_shared_left_by_the_last_block(float* out) {
    // block 0 writes its shared memory, block 1 reads it without writing (what a GPU leaves there is undefined)
    __shared__ float buf[32];
    if (blockIdx.x == 0) buf[threadIdx.x] = 1.0f;
    __syncthreads();
    out[blockIdx.x * 32 + threadIdx.x] = buf[threadIdx.x];
}
extern "C" __global__ void npf_test_flash_shared_left_by_the_last_block(float* out) {
    // the same through the flash kernels' shared memory (NPF_FA_SHARED: a static buffer, filled by this call)
    alignas(16) static unsigned char smem[32 * 4];
    npf_shared_at_block_start(smem, sizeof(smem));
    float* buf = reinterpret_cast<float*>(smem);
    if (blockIdx.x == 0) buf[threadIdx.x] = 1.0f;
    __syncthreads();
    out[blockIdx.x * 32 + threadIdx.x] = buf[threadIdx.x];
}
"""


@pytest.mark.parametrize("kernel", ["npf_test_shared_left_by_the_last_block",
                                    "npf_test_flash_shared_left_by_the_last_block"])
def test_the_emulator_starts_each_block_with_nan_in_shared_memory(tmp_path, kernel):
    """A block reads only what it wrote, never the zeros of a fresh static variable or an earlier block's
    values: every __shared__ variable, and a flash kernel's NPF_FA_SHARED buffer, holds 0xff bytes at each
    block's start."""
    module = emulator.emulated_module(tmp_path, _LEFTOVER_SHARED)
    out = np.zeros(64, np.float32)
    module.get_function(kernel)((2,), (32,), (out,))
    np.testing.assert_array_equal(out[:32], 1.0)
    assert np.isnan(out[32:]).all()


_WRITTEN_IN_FLIGHT = r"""
extern "C" __global__ void npf_test_write_before_the_wait(const float* src, float* dst) {
    // writes its chunk between the copy's issue and its wait: a race on a GPU (which bytes stay is undefined)
    __shared__ __align__(16) float buf[32 * 4];
    npf_cp_async_16(&buf[threadIdx.x * 4], src + threadIdx.x * 4);
    npf_cp_async_commit();
    buf[threadIdx.x * 4] = 0.0f;
    npf_cp_async_wait<0>();
    dst[threadIdx.x] = buf[threadIdx.x * 4];
}
"""


def test_the_emulator_refuses_a_write_to_a_cp_async_destination_before_its_wait(tmp_path):
    module = emulator.emulated_module(tmp_path, _WRITTEN_IN_FLIGHT)
    with pytest.raises(AssertionError, match="destination was written before its wait"):
        module.get_function("npf_test_write_before_the_wait")((1,), (32,), (np.ones(128, np.float32),
                                                                            np.zeros(32, np.float32)))


_UNINITIALISED_LOCALS = r"""
extern "C" __global__ void npf_test_accumulator_never_zeroed(const float* x, float* out, int zeroed) {
    // a register accumulator that the kernel forgets to zero: what it starts from is undefined on a GPU
    float acc[4];
    if (zeroed)
        for (int i = 0; i < 4; ++i) acc[i] = 0.0f;
    for (int i = 0; i < 4; ++i) acc[i] += x[threadIdx.x * 4 + i];
    for (int i = 0; i < 4; ++i) out[threadIdx.x * 4 + i] = acc[i];
}
"""


def test_the_emulator_starts_a_threads_local_arrays_with_a_pattern_not_zeros(tmp_path):
    """The kernels' local variables are compiled with -ftrivial-auto-var-init=pattern: an accumulator never
    zeroed starts from 0xfe bytes (-1.7e38 as a float), not from the zeros or the previous thread's values a
    fiber's stack may hold, so the forgotten initialisation cannot pass."""
    module = emulator.emulated_module(tmp_path, _UNINITIALISED_LOCALS)
    if not emulator.locals_pattern():
        pytest.skip("this g++ has no -ftrivial-auto-var-init=pattern (GCC 12 or later has it)")
    x = np.arange(128, dtype=np.float32)
    for zeroed in (1, 0):
        out = np.zeros(128, np.float32)
        module.get_function("npf_test_accumulator_never_zeroed")((1,), (32,), (x, out, np.int32(zeroed)))
        if zeroed:
            np.testing.assert_array_equal(out, x)
        else:
            assert (out < -1e38).all()


def test_the_emulated_cuda_paths_allocate_arrays_holding_old_bytes(fx):
    """Under the emulation the CUDA wrappers' outputs (NumPy's empty standing in for CuPy's) start as 0xff
    bytes, NaN in every float type, as a block from CuPy's pool holds an earlier array's bytes: an output
    element a kernel never writes shows as NaN (or 0xff), not as the zero a fresh host page holds."""
    if fx.name != "emulated":
        pytest.skip("on a GPU what CuPy's pool hands out is whatever an earlier array left")
    xp = runtime.array_module()
    assert np.isnan(xp.empty((64, 3), dtype=np.float32)).all() and np.isnan(xp.empty((), dtype=np.float64))
    assert (xp.empty(5, dtype=bool).view(np.uint8) == 0xFF).all()
