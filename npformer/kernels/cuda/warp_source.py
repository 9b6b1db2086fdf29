"""Warp-level primitives for tensor-core kernels, as CUDA C helpers over inline PTX, and the tiny
kernels that test each one (on a GPU, and on the CPU through tests/kernels/cuda/emulator.py).

=============================  ===================================================================
helper                         PTX (sm_80 and later)
=============================  ===================================================================
``npf_mma_16816(d, a, b, c)``  ``mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32``: D (16 x 8,
                               float32) = A (16 x 16, float16) B (16 x 8, float16) + C, one warp,
                               each lane holding its fragment registers (below)
``npf_mma_1688_tf32``          ``mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32``: D (16 x 8,
``(d, a, b, c)``               float32) = A (16 x 8, TF32) B (8 x 8, TF32) + C, one warp
``npf_tf32(x)``                ``cvt.rna.tf32.f32``: float32 x rounded to TF32 (10 mantissa bits,
                               to nearest, ties away from zero), as the 32 bits of an operand
``npf_ldmatrix_x4(r, row)``    ``ldmatrix.sync.aligned.m8n8.x4.shared.b16``: four 8 x 8 16-bit
``npf_ldmatrix_x4_trans``      matrices from shared memory; lane 8 j + i gives the address of row
                               i of matrix j; ``_trans`` loads each transposed
``npf_cp_async_16(dst, src)``  ``cp.async.cg.shared.global``, 16 bytes from global to shared memory
``npf_cp_async_16_zfill``      without the registers in between (``_zfill(dst, src, n)``: the first n
``(dst, src, n)``              bytes, zeros after them: n = 0 reads nothing);
``npf_cp_async_commit()``      ``commit_group`` closes a group, ``wait_group N`` waits until at most
``npf_cp_async_wait<N>()``     N groups are still in flight
``__shfl_xor_sync``            CUDA's own (the emulator provides it): a value from lane ``l ^ m``
=============================  ===================================================================

Fragment layouts (the PTX ISA's tables for m16n8k16 with .f16 inputs and .f32 accumulators), with
``g = lane / 4`` and ``t = lane % 4``; a register of two halves holds the lower column (or row) in
its low 16 bits:

* A, 4 registers: ``a[0]`` (row g, columns 2t, 2t+1), ``a[1]`` (row g+8, the same columns),
  ``a[2]`` (row g, columns 2t+8, 2t+9), ``a[3]`` (row g+8, columns 2t+8, 2t+9);
* B, 2 registers: ``b[0]`` (rows k = 2t, 2t+1 of column n = g), ``b[1]`` (rows 2t+8, 2t+9);
* C and D, 4 floats: ``c[0], c[1]`` (row g, columns 2t, 2t+1), ``c[2], c[3]`` (row g+8);
* m16n8k8 with .tf32 inputs (a value a register): A ``a[0]`` (row g, column t), ``a[1]`` (row g+8,
  column t), ``a[2]`` (row g, column t+4), ``a[3]`` (row g+8, column t+4); B ``b[0]`` (row k = t of
  column n = g), ``b[1]`` (row t+4); C and D as above;
* ldmatrix: register j of lane l holds row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1 of matrix j
  (transposed: column l / 4, rows 2 (l % 4) and 2 (l % 4) + 1).

So a 16 x 16 tile of A in shared memory, as four 8 x 8 matrices (rows 0-7 / 8-15, columns 0-7 / 8-15,
in the order of ``a``), is one ``npf_ldmatrix_x4``. On the GPU (``__CUDACC__`` defined) the helpers
are the PTX instructions, for sm_80 and later (compiled for an older GPU they trap; the launchers use
them from compute capability 8.0 on); the emulator supplies its own with the same meaning.
"""
from __future__ import annotations

__all__ = ["WARP_PRIMITIVES", "PRIMITIVES_TEST_SOURCE", "PRIMITIVES_NVRTC_OPTIONS"]

WARP_PRIMITIVES = r"""
#ifdef __CUDACC__
#if __CUDA_ARCH__ >= 800
#define NPF_SM80(instructions) instructions
#else
#define NPF_SM80(instructions) asm volatile("trap;");     // the launchers use these on sm_80 and later only
#endif
__device__ __forceinline__ void npf_mma_16816(float* d, const unsigned* a, const unsigned* b, const float* c) {
    NPF_SM80(asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                          "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};"
                          : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
                            "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));)
}
__device__ __forceinline__ void npf_mma_1688_tf32(float* d, const unsigned* a, const unsigned* b, const float* c) {
    NPF_SM80(asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
                          "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};"
                          : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
                            "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));)
}
__device__ __forceinline__ unsigned npf_tf32(float x) {
    unsigned r = 0u;
    NPF_SM80(asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));)
    return r;
}
__device__ __forceinline__ void npf_ldmatrix_x4(unsigned* r, const void* row) {
    NPF_SM80(unsigned address = (unsigned)__cvta_generic_to_shared(row);
             asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                          : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));)
}
__device__ __forceinline__ void npf_ldmatrix_x4_trans(unsigned* r, const void* row) {
    NPF_SM80(unsigned address = (unsigned)__cvta_generic_to_shared(row);
             asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                          : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));)
}
__device__ __forceinline__ void npf_cp_async_16(void* dst, const void* src) {
    NPF_SM80(unsigned address = (unsigned)__cvta_generic_to_shared(dst);
             asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(address), "l"(src));)
}
__device__ __forceinline__ void npf_cp_async_16_zfill(void* dst, const void* src, int bytes) {
    NPF_SM80(unsigned address = (unsigned)__cvta_generic_to_shared(dst);
             asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(address), "l"(src), "r"(bytes));)
}
__device__ __forceinline__ void npf_cp_async_commit() { NPF_SM80(asm volatile("cp.async.commit_group;");) }
template <int N>
__device__ __forceinline__ void npf_cp_async_wait() { NPF_SM80(asm volatile("cp.async.wait_group %0;" :: "n"(N));) }
#endif
"""

# One warp per test kernel (the cp.async one: a block of 64 threads). Each lane builds its fragments
# from plain row-major arrays by the layouts above and writes its results back by the same layouts,
# so the test compares whole matrices with NumPy.
_TESTS = r"""
extern "C" __global__ void npf_test_mma(const unsigned short* A, const unsigned short* B, const float* C, float* D) {
    // A (16, 16), B (16, 8), C and D (16, 8), row-major
    unsigned lane = threadIdx.x, g = lane / 4, t = lane % 4;
    unsigned a[4], b[2];
    float c[4], d[4];
    for (int i = 0; i < 4; ++i) {
        unsigned row = g + 8 * (i % 2), col = 2 * t + 8 * (i / 2);
        a[i] = (unsigned)A[row * 16 + col] | ((unsigned)A[row * 16 + col + 1] << 16);
    }
    for (int i = 0; i < 2; ++i) {
        unsigned k = 2 * t + 8 * i;
        b[i] = (unsigned)B[k * 8 + g] | ((unsigned)B[(k + 1) * 8 + g] << 16);
    }
    for (int i = 0; i < 4; ++i) c[i] = C[(g + 8 * (i / 2)) * 8 + 2 * t + i % 2];
    npf_mma_16816(d, a, b, c);
    for (int i = 0; i < 4; ++i) D[(g + 8 * (i / 2)) * 8 + 2 * t + i % 2] = d[i];
}

extern "C" __global__ void npf_test_mma_tf32(const float* A, const float* B, const float* C, float* D) {
    // A (16, 8), B (8, 8), C and D (16, 8), row-major; A and B rounded to TF32 by npf_tf32 first
    unsigned lane = threadIdx.x, g = lane / 4, t = lane % 4;
    unsigned a[4], b[2];
    float c[4], d[4];
    for (int i = 0; i < 4; ++i) a[i] = npf_tf32(A[(g + 8 * (i % 2)) * 8 + t + 4 * (i / 2)]);
    for (int i = 0; i < 2; ++i) b[i] = npf_tf32(B[(t + 4 * i) * 8 + g]);
    for (int i = 0; i < 4; ++i) c[i] = C[(g + 8 * (i / 2)) * 8 + 2 * t + i % 2];
    npf_mma_1688_tf32(d, a, b, c);
    for (int i = 0; i < 4; ++i) D[(g + 8 * (i / 2)) * 8 + 2 * t + i % 2] = d[i];
}

extern "C" __global__ void npf_test_tf32(const float* x, unsigned* out, int n) {
    for (int i = threadIdx.x; i < n; i += 32) out[i] = npf_tf32(x[i]);
}

extern "C" __global__ void npf_test_ldmatrix(const unsigned short* M, unsigned* out, int trans) {
    // M: four 8 x 8 matrices, row-major one after another; out (32 lanes, 4 registers)
    __shared__ __align__(16) unsigned short tile[4 * 64];
    unsigned lane = threadIdx.x;
    for (unsigned i = lane; i < 4 * 64; i += 32) tile[i] = M[i];
    __syncthreads();
    unsigned r[4];
    const unsigned short* row = tile + (lane / 8) * 64 + (lane % 8) * 8;     // lane 8 j + i: row i of matrix j
    if (trans) npf_ldmatrix_x4_trans(r, row); else npf_ldmatrix_x4(r, row);
    for (int j = 0; j < 4; ++j) out[lane * 4 + j] = r[j];
}

extern "C" __global__ void npf_test_shfl(const float* x, const double* y, float* xo, double* yo, int mask) {
    unsigned lane = threadIdx.x;
    xo[lane] = __shfl_xor_sync(0xffffffffu, x[lane], mask);
    yo[lane] = __shfl_xor_sync(0xffffffffu, y[lane], mask);
}

extern "C" __global__ void npf_test_cp_async_zfill(const float* src, float* dst, int bytes) {
    // 32 lanes x 16 bytes: lane l copies min(bytes, 16) bytes of its chunk, zeros after (bytes 0: all zeros)
    __shared__ __align__(16) float buf[32 * 4];
    for (int i = 0; i < 4; ++i) buf[threadIdx.x * 4 + i] = -1.0f;
    __syncthreads();
    npf_cp_async_16_zfill(&buf[threadIdx.x * 4], src + threadIdx.x * 4, bytes);
    npf_cp_async_commit();
    npf_cp_async_wait<0>();
    __syncthreads();
    for (int i = 0; i < 4; ++i) dst[threadIdx.x * 4 + i] = buf[threadIdx.x * 4 + i];
}

extern "C" __global__ void npf_test_cp_async(const float* src, float* dst, long long n) {
    // n floats (a multiple of 4 * 64) through shared memory in chunks of 64 x 16 bytes, two groups in flight
    __shared__ __align__(16) float buf[2][64 * 4];
    long long chunks = n / (64 * 4);
    if (chunks > 0) npf_cp_async_16(&buf[0][threadIdx.x * 4], src + threadIdx.x * 4);
    npf_cp_async_commit();
    for (long long c = 0; c < chunks; ++c) {
        if (c + 1 < chunks) npf_cp_async_16(&buf[(c + 1) % 2][threadIdx.x * 4], src + (c + 1) * 256 + threadIdx.x * 4);
        npf_cp_async_commit();
        npf_cp_async_wait<1>();                     // chunk c has landed (c + 1 may still be in flight)
        __syncthreads();
        for (int i = 0; i < 4; ++i) dst[c * 256 + threadIdx.x * 4 + i] = buf[c % 2][threadIdx.x * 4 + i];
        __syncthreads();                            // before chunk c + 2 overwrites this buffer
    }
}
"""

PRIMITIVES_TEST_SOURCE = WARP_PRIMITIVES + _TESTS
PRIMITIVES_NVRTC_OPTIONS = ("--fmad=true",)
