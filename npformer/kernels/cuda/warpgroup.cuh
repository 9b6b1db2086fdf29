// Hopper's warpgroup-level primitives (wgmma, sm_90a) over inline PTX; npformer/kernels/cuda/warp_source.py
// documents each, the shared-memory layouts their descriptors name and their register fragments.
#ifdef __CUDACC__
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define NPF_SM90A(instructions) instructions
#else
#define NPF_SM90A(instructions) asm volatile("trap;");    // wgmma exists on sm_90a only
#endif
// The matrix descriptor of a 128-byte-swizzled operand tile in shared memory that starts at `tile`: lbo and
// sbo are the PTX ISA's leading and stride dimension byte offsets (in bytes; multiples of 16); base offset
// 0, so every swizzle pattern the tile holds starts on a 1024-byte boundary. A kernel makes each
// descriptor here (a tile's sub-tile: its own start address), never by arithmetic on a descriptor.
__device__ __forceinline__ unsigned long long npf_wgmma_desc(const void* tile, unsigned lbo, unsigned sbo) {
    unsigned long long address = (unsigned)__cvta_generic_to_shared(tile);
    return ((address & 0x3ffffu) >> 4) | ((unsigned long long)((lbo & 0x3ffffu) >> 4) << 16)
           | ((unsigned long long)((sbo & 0x3ffffu) >> 4) << 32) | (1ull << 62);
}
// Orders this thread's earlier writes of shared memory (stores, cp.async once waited for) before the reads
// of the async proxy, which wgmma's operands in shared memory are
__device__ __forceinline__ void npf_fence_async_shared() {
    NPF_SM90A(asm volatile("fence.proxy.async.shared::cta;" ::: "memory");)
}
// The first 1024-byte boundary of shared memory at or after p (a swizzle pattern's start)
__device__ __forceinline__ unsigned char* npf_align_1024(unsigned char* p) {
    const unsigned offset = (unsigned)__cvta_generic_to_shared(p);
    return p + (1024u - offset % 1024u) % 1024u;
}
__device__ __forceinline__ void npf_wgmma_fence() { NPF_SM90A(asm volatile("wgmma.fence.sync.aligned;" ::: "memory");) }
__device__ __forceinline__ void npf_wgmma_commit() {
    NPF_SM90A(asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");)
}
template <int N>
__device__ __forceinline__ void npf_wgmma_wait() {
    NPF_SM90A(asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");)
}
// After npf_wgmma_wait: the compiler learns that the R accumulators d changed there (the wgmma's asm wrote
// them when it was issued, as far as the compiler knows), so no read of them moves above the wait; and that
// A's registers a are read there, so none is reused while a wgmma that reads it is in flight.
template <int R>
__device__ __forceinline__ void npf_wgmma_hold(float* d) {
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}
template <int R>
__device__ __forceinline__ void npf_wgmma_hold(unsigned* a) {
    for (int i = 0; i < R; ++i) asm volatile("" : "+r"(a[i]) :: "memory");
}
// the accumulators' operand lists: D's N / 2 registers a thread
#define NPF_WG_REGS32 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define NPF_WG_REGS64 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define NPF_WG_ACC32(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define NPF_WG_ACC64(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// D (64 x N, float32) = A (64 x 16) B (16 x N) + (accumulate ? D : 0), one warpgroup of 128 threads, TYPE
// f16 or bf16. _ss: A and B from shared memory, both K-major (desc_a's rows are A's, desc_b's rows are B's
// columns). _rs<TRANS_B>: A from each thread's 4 registers; B K-major (TRANS_B 0) or N-major (1: its rows
// are B's rows).
#define NPF_WGMMA_SS(NAME, SHAPE, REGS, ACC, IA, IB, IP)                                                   \
    __device__ __forceinline__ void NAME(float* d, unsigned long long desc_a, unsigned long long desc_b,    \
                                         int accumulate) {                                                  \
        NPF_SM90A(asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" IP ", 0;\n"                              \
                               "wgmma.mma_async.sync.aligned." SHAPE " " REGS ", %" IA ", %" IB         \
                               ", p, 1, 1, 0, 0;\n}\n"                                                      \
                               : ACC(d) : "l"(desc_a), "l"(desc_b), "r"(accumulate));)                     \
    }
#define NPF_WGMMA_RS(NAME, SHAPE, REGS, ACC, IA, IB, IP, IT)                                               \
    template <int TRANS_B>                                                                                  \
    __device__ __forceinline__ void NAME(float* d, const unsigned* a, unsigned long long desc_b, int accumulate) { \
        NPF_SM90A(asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" IP ", 0;\n"                              \
                               "wgmma.mma_async.sync.aligned." SHAPE " " REGS ", " IA ", %" IB          \
                               ", p, 1, 1, %" IT ";\n}\n"                                                  \
                               : ACC(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate), \
                                 "n"(TRANS_B));)                                                            \
    }
NPF_WGMMA_SS(npf_wgmma_m64n64k16_ss, "m64n64k16.f32.f16.f16", NPF_WG_REGS32, NPF_WG_ACC32, "32", "33", "34")
NPF_WGMMA_SS(npf_wgmma_m64n64k16_ss_bf16, "m64n64k16.f32.bf16.bf16", NPF_WG_REGS32, NPF_WG_ACC32, "32", "33", "34")
NPF_WGMMA_SS(npf_wgmma_m64n128k16_ss, "m64n128k16.f32.f16.f16", NPF_WG_REGS64, NPF_WG_ACC64, "64", "65", "66")
NPF_WGMMA_SS(npf_wgmma_m64n128k16_ss_bf16, "m64n128k16.f32.bf16.bf16", NPF_WG_REGS64, NPF_WG_ACC64, "64", "65", "66")
NPF_WGMMA_RS(npf_wgmma_m64n64k16_rs, "m64n64k16.f32.f16.f16", NPF_WG_REGS32, NPF_WG_ACC32,
             "{%32, %33, %34, %35}", "36", "37", "38")
NPF_WGMMA_RS(npf_wgmma_m64n64k16_rs_bf16, "m64n64k16.f32.bf16.bf16", NPF_WG_REGS32, NPF_WG_ACC32,
             "{%32, %33, %34, %35}", "36", "37", "38")
NPF_WGMMA_RS(npf_wgmma_m64n128k16_rs, "m64n128k16.f32.f16.f16", NPF_WG_REGS64, NPF_WG_ACC64,
             "{%64, %65, %66, %67}", "68", "69", "70")
NPF_WGMMA_RS(npf_wgmma_m64n128k16_rs_bf16, "m64n128k16.f32.bf16.bf16", NPF_WG_REGS64, NPF_WG_ACC64,
             "{%64, %65, %66, %67}", "68", "69", "70")
#endif
// NpfWgmma<N, BF16>::ss / ::rs<TRANS_B>: the m64nNk16 wgmma (N 64 or 128) of a kernel templated on its shape
// and its 16-bit type (float16, or bfloat16 when BF16)
template <int N, bool BF16> struct NpfWgmma;
#define NPF_WGMMA_SHAPE(N, BF16, SUFFIX)                                                                      \
    template <> struct NpfWgmma<N, BF16> {                                                                     \
        static __device__ __forceinline__ void ss(float* d, unsigned long long a, unsigned long long b, int acc) { \
            npf_wgmma_m64n##N##k16_ss##SUFFIX(d, a, b, acc);                                                  \
        }                                                                                                      \
        template <int TRANS_B>                                                                                 \
        static __device__ __forceinline__ void rs(float* d, const unsigned* a, unsigned long long b, int acc) { \
            npf_wgmma_m64n##N##k16_rs##SUFFIX<TRANS_B>(d, a, b, acc);                                         \
        }                                                                                                      \
    };
NPF_WGMMA_SHAPE(64, false, )
NPF_WGMMA_SHAPE(64, true, _bf16)
NPF_WGMMA_SHAPE(128, false, )
NPF_WGMMA_SHAPE(128, true, _bf16)
