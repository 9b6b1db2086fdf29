// Warp-level primitives of the tensor-core kernels over inline PTX (npformer/kernels/cuda/warp_source.py
// documents each and its fragment layouts).
#ifdef __CUDACC__
#if __CUDA_ARCH__ >= 800
#define NPF_SM80(instructions) instructions
#else
#define NPF_SM80(instructions) asm volatile("trap;");     // the launchers use these on sm_80 and later only
#endif
// m16n8k16 with 16-bit operands of PTX type TYPE, f16 (npf_mma_16816) or bf16 (npf_mma_16816_bf16): one
// fragment layout for both, float32 accumulators
#define NPF_MMA_16816(NAME, TYPE)                                                                          \
    __device__ __forceinline__ void NAME(float* d, const unsigned* a, const unsigned* b, const float* c) {   \
        NPF_SM80(asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE ".f32 "                   \
                              "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};"           \
                              : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])                                \
                              : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),             \
                                "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));)                                 \
    }
NPF_MMA_16816(npf_mma_16816, "f16")
NPF_MMA_16816(npf_mma_16816_bf16, "bf16")
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
