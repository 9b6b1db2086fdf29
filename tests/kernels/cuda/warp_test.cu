// m16n8k16 through npf_mma_16816 (float16) or npf_mma_16816_bf16 (bfloat16): T's 16 bits a value, the PTX
// ISA's fragments built value by value from row-major A (16, 16), B (16, 8), C and D (16, 8)
template <typename T>
__device__ void npf_test_mma_16(const T* A, const T* B, const float* C, float* D, bool bf16) {
    const unsigned short* a16 = reinterpret_cast<const unsigned short*>(A);
    const unsigned short* b16 = reinterpret_cast<const unsigned short*>(B);
    unsigned lane = threadIdx.x, g = lane / 4, t = lane % 4;
    unsigned a[4], b[2];
    float c[4], d[4];
    for (int i = 0; i < 4; ++i) {
        unsigned row = g + 8 * (i % 2), col = 2 * t + 8 * (i / 2);
        a[i] = (unsigned)a16[row * 16 + col] | ((unsigned)a16[row * 16 + col + 1] << 16);
    }
    for (int i = 0; i < 2; ++i) {
        unsigned k = 2 * t + 8 * i;
        b[i] = (unsigned)b16[k * 8 + g] | ((unsigned)b16[(k + 1) * 8 + g] << 16);
    }
    for (int i = 0; i < 4; ++i) c[i] = C[(g + 8 * (i / 2)) * 8 + 2 * t + i % 2];
    if (bf16) npf_mma_16816_bf16(d, a, b, c);
    else npf_mma_16816(d, a, b, c);
    for (int i = 0; i < 4; ++i) D[(g + 8 * (i / 2)) * 8 + 2 * t + i % 2] = d[i];
}

extern "C" __global__ void npf_test_mma(const unsigned short* A, const unsigned short* B, const float* C, float* D) {
    npf_test_mma_16(A, B, C, D, false);
}

extern "C" __global__ void npf_test_mma_bf16(const npf_bf16* A, const npf_bf16* B, const float* C, float* D) {
    npf_test_mma_16(A, B, C, D, true);
}

// bfloat16's conversions (prelude.cuh): x rounded to bfloat16 (npf_store), and those values read back (npf_load)
extern "C" __global__ void npf_test_bf16(const float* x, npf_bf16* h, float* back, int n) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        npf_store(h + i, x[i]);
        back[i] = npf_load(h[i]);
    }
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
