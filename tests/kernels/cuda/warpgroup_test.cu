// The kernels that test Hopper's warpgroup primitives (npformer/kernels/cuda/warpgroup.cuh): one warpgroup
// (128 threads) computes D (64 x N) = A (64 x K) B (K x N) + C (or without C), K 16 to 64 in steps of 16, as
// K / 16 wgmmas of one group from 128-byte-swizzled tiles in shared memory; every matrix row-major.

// src (rows x cols 16-bit values, cols a multiple of 8) into a 128-byte-swizzled tile: row r's 16-byte chunk
// c at r * 128 bytes, chunk c % 8 xor r % 8; columns 64 and on in regions of rows * 128 bytes after it
__device__ void npf_test_store_tile(unsigned char* tile, const unsigned short* src, unsigned rows, unsigned cols) {
    for (unsigned e = threadIdx.x; e < rows * cols / 8; e += blockDim.x) {
        unsigned r = e / (cols / 8), c = e % (cols / 8);
        unsigned short* dst = (unsigned short*)(tile + (c / 8) * rows * 128 + r * 128 + ((c % 8) ^ (r % 8)) * 16);
        for (unsigned i = 0; i < 8; ++i) dst[i] = src[r * cols + 8 * c + i];
    }
}

// npf_test_wgmma<N, K, RS, TRANS_B, BF16>: A (64 x K) from shared memory, or from registers (RS); B (K x N) from
// shared memory K-major (B given as its transpose, N x K) or, with TRANS_B, N-major (B as it is); float16
// values, or bfloat16 (BF16), as their 16 bits
template <int N, int K, bool RS, int TRANS_B, bool BF16>
__global__ void npf_test_wgmma(const unsigned short* A, const unsigned short* B, const float* C, float* D,
                               int accumulate) {
    __shared__ __align__(1024) unsigned char a_tile[64 * 128];
    __shared__ __align__(1024) unsigned char b_tile[128 * 128];
    npf_test_store_tile(a_tile, A, 64, K);
    if (TRANS_B) npf_test_store_tile(b_tile, B, K, N);
    else npf_test_store_tile(b_tile, B, N, K);
    npf_fence_async_shared();
    __syncthreads();
    unsigned thread = threadIdx.x, w = thread / 32, g = thread % 32 / 4, t = thread % 4;
    float d[N / 2];
    for (int j = 0; j < N / 2; ++j) {           // C, or a value a wgmma without the accumulator must not read
        unsigned row = 16 * w + g + 8 * (j % 4 / 2), col = 8 * (j / 4) + 2 * t + j % 2;
        d[j] = accumulate ? C[row * N + col] : 1.0e6f;
    }
    unsigned a[4 * 4];                          // A's fragments of each step of 16 columns (_rs)
    for (int s = 0; RS && s < K / 16; ++s) {
        for (int i = 0; i < 4; ++i) {
            unsigned row = 16 * w + g + 8 * (i % 2), col = 16 * s + 2 * t + 8 * (i / 2);
            a[4 * s + i] = (unsigned)A[row * K + col] | ((unsigned)A[row * K + col + 1] << 16);
        }
    }
    npf_wgmma_fence();
    for (int s = 0; s < K / 16; ++s) {
        unsigned long long b = TRANS_B ? npf_wgmma_desc(b_tile + s * 16 * 128, K * 128, 1024)
                                       : npf_wgmma_desc(b_tile + s * 32, 16, 1024);
        if (RS) NpfWgmma<N, BF16>::template rs<TRANS_B>(d, a + 4 * s, b, s > 0 || accumulate);
        else NpfWgmma<N, BF16>::ss(d, npf_wgmma_desc(a_tile + s * 32, 16, 1024), b, s > 0 || accumulate);
    }
    npf_wgmma_commit();
    npf_wgmma_wait<0>();
    npf_wgmma_hold<N / 2>(d);
    npf_wgmma_hold<4 * 4>(a);
    for (int j = 0; j < N / 2; ++j) {
        unsigned row = 16 * w + g + 8 * (j % 4 / 2), col = 8 * (j / 4) + 2 * t + j % 2;
        D[row * N + col] = d[j];
    }
}
