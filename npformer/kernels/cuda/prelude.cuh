// What every npformer CUDA module starts with (source.py and flash_source.py put it first):
// loads and stores of the storage type T as the arithmetic type A (float16's come from half.cuh,
// or from the CPU emulator), exp and log in A, a max that keeps a NaN (as numpy's max does), and
// the grid-stride loop of the elementwise kernels over `total` contiguous elements.
__device__ __forceinline__ float npf_load(float v) { return v; }
__device__ __forceinline__ double npf_load(double v) { return v; }
__device__ __forceinline__ void npf_store(float* p, float v) { *p = v; }
__device__ __forceinline__ void npf_store(double* p, double v) { *p = v; }

__device__ __forceinline__ float npf_exp(float v) { return expf(v); }
__device__ __forceinline__ double npf_exp(double v) { return exp(v); }
__device__ __forceinline__ float npf_log(float v) { return logf(v); }
__device__ __forceinline__ double npf_log(double v) { return log(v); }
template <typename A> __device__ __forceinline__ A npf_max(A a, A b) { return (a > b || a != a) ? a : b; }
#define NPF_FOR_EACH(k, total) \
    for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < (total); \
         k += (long long)gridDim.x * blockDim.x)
