// float16 is read and written as its 16 bits and converted with the PTX instructions cuda_fp16.h
// uses itself (round to nearest even on the way down), so no header is needed under NVRTC.
__device__ __forceinline__ float npf_load(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ void npf_store(unsigned short* p, float v) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    *p = h;
}
