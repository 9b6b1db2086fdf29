// What every npformer CUDA module starts with (source.py and flash_source.py put it first):
// loads and stores of the storage type T as the arithmetic type A (float16's come from half.cuh,
// or from the CPU emulator; bfloat16's are below), exp and log in A, a max that keeps a NaN (as
// numpy's max does), the grid-stride loop of the elementwise kernels over `total` contiguous
// elements, and dropout's keep bit.
__device__ __forceinline__ float npf_load(float v) { return v; }
__device__ __forceinline__ double npf_load(double v) { return v; }
__device__ __forceinline__ void npf_store(float* p, float v) { *p = v; }
__device__ __forceinline__ void npf_store(double* p, double v) { *p = v; }

// bfloat16: npf_bf16 holds the 16 bits of a __nv_bfloat16 (what a CuPy array of ml_dtypes.bfloat16
// holds: the upper half of a float32), a type of its own so that loads and stores overload on it (NVRTC
// compiles without cuda_bf16.h, as half.cuh does for float16). A load widens exactly; a store rounds to
// nearest even: cvt.rn.bf16.f32 on sm_80 and later, elsewhere (and in the CPU emulator, which compiles
// this file) the same bits by integer arithmetic, a NaN kept a quiet NaN of its sign.
struct __align__(2) npf_bf16 { unsigned short bits; };
__device__ __forceinline__ float npf_bf16_float(unsigned short bits) {
    union { unsigned u; float f; } v;
    v.u = (unsigned)bits << 16;
    return v.f;
}
__device__ __forceinline__ unsigned short npf_bf16_bits(float x) {
#if defined(__CUDACC__) && __CUDA_ARCH__ >= 800
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
#else
    union { float f; unsigned u; } v;
    v.f = x;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((v.u >> 16) | 0x40u);    // NaN: quiet
    return (unsigned short)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);        // ties to the even half
#endif
}
__device__ __forceinline__ float npf_load(npf_bf16 h) { return npf_bf16_float(h.bits); }
__device__ __forceinline__ void npf_store(npf_bf16* p, float v) { p->bits = npf_bf16_bits(v); }

__device__ __forceinline__ float npf_exp(float v) { return expf(v); }
__device__ __forceinline__ double npf_exp(double v) { return exp(v); }
__device__ __forceinline__ float npf_log(float v) { return logf(v); }
__device__ __forceinline__ double npf_log(double v) { return log(v); }
template <typename A> __device__ __forceinline__ A npf_max(A a, A b) { return (a > b || a != a) ? a : b; }
// Dropout's seed from its two float64 draws (npformer.ops.dropout.seed_of): floor(u0 2^32) is the high
// half, floor(u1 2^32) the low one (a conversion to an integer truncates, as numpy's astype does)
__device__ __forceinline__ unsigned long long npf_seed(const double* draws) {
    return ((unsigned long long)(draws[0] * 4294967296.0) << 32) | (unsigned long long)(draws[1] * 4294967296.0);
}
// Dropout's keep bit of flat index n (npformer.ops.dropout.keep_bits): splitmix64 of seed + n golden,
// kept when its top 24 bits reach keep_min (keep_threshold(p)); the last xor-shift leaves them as they are
__device__ __forceinline__ bool npf_keep(unsigned long long seed, unsigned long long n, int keep_min) {
    unsigned long long z = n * @GOLDEN@ULL + seed;
    z ^= z >> 30;
    z *= @MIX1@ULL;
    z ^= z >> 27;
    z *= @MIX2@ULL;
    return (long long)(z >> 40) >= (long long)keep_min;
}
// Where a backward finds the forward's keep bits (npformer.ops.dropout.DropoutCache's two forms;
// npformer.kernels.cuda.dropout.keep_arguments passes them; the values: source.py's DROP_FLAGS):
// nothing was dropped, the booleans the forward stored, or the seed, each bit hashed again as the
// forward hashed it
#define NPF_DROP_NONE @DROP_NONE@
#define NPF_DROP_STORED @DROP_STORED@
#define NPF_DROP_HASHED @DROP_HASHED@
__device__ __forceinline__ bool npf_kept(const bool* keep, unsigned long long seed, long long k, int keep_min,
                                         int drop) {
    return drop == NPF_DROP_HASHED ? npf_keep(seed, (unsigned long long)k, keep_min) : keep[k];
}
__device__ __forceinline__ unsigned long long npf_backward_seed(const double* draws, int drop) {
    return drop == NPF_DROP_HASHED ? npf_seed(draws) : 0ULL;
}
#define NPF_FOR_EACH(k, total) \
    for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < (total); \
         k += (long long)gridDim.x * blockDim.x)
