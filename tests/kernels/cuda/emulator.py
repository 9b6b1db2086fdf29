"""Runs the fused kernels' CUDA C on the CPU, so their logic is tested where no GPU is present.

The kernel source (npformer.kernels.cuda.source.KERNELS_SOURCE, everything but the two PTX float16
conversions) is compiled by g++ with a small shim: ``__global__``/``__device__`` vanish,
``__shared__`` becomes ``static`` (one block runs at a time), float16 conversions use ``_Float16``
(round to nearest even, as ``cvt.rn``; bfloat16's are prelude.cuh's own C, compiled as they are),
and every CUDA thread of a block is a fiber (``ucontext``). The fibers run one after another up to
each ``__syncthreads``, a legal CUDA schedule with the largest skew between threads, so a missing
barrier changes results here; a barrier that not every thread of the block reaches is reported as an
error instead of hanging. They run in the threads' order, or last first within
:func:`reversed_schedule` (the blocks too), which shows a race the forward order hides. Shared memory (every
``__shared__`` variable, and a flash kernel's ``NPF_FA_SHARED`` buffer) holds 0xff bytes (NaN in every
float type) at each block's start, where a GPU's holds what an earlier block left: a read of bytes the
block never wrote gives NaN, not zeros by luck. Likewise a thread's local variables (a GPU's
registers) start as 0xfe bytes (g++'s ``-ftrivial-auto-var-init=pattern``, GCC 12 or later: -1.7e38
as a float), so an accumulator array the kernel forgets to zero does not start from a fiber's stale
stack; a scalar read before its first write is undefined in C++ too, and the compiler may fold it.
And the tests' ``numpy.empty`` (:func:`stale_empty`, what the CUDA wrappers allocate their outputs
with here) gives 0xff bytes, as CuPy's pool gives an earlier array's: an element no thread writes is NaN.

Warp collectives (:mod:`npformer.kernels.cuda.warp_source`): ``__shfl_xor_sync``, ``npf_mma_16816``
and ``npf_mma_16816_bf16`` (m16n8k16, float16 or bfloat16 in, float32 accumulate, the PTX ISA's
fragment layouts, one for both types; a bfloat16 is decoded bit for bit as the upper half of a float32:
the products are exact in float32 (11 or 8 significant bits a factor; a bfloat16 product beyond
float32's range, or below its normals, is rounded as float32 rounds it) and added in order, each
addition rounded to float32; a GPU's tensor cores add them otherwise, with more bits and truncation by
Fasi et al.'s measurements (2021), so the last bits differ and a test compares within a stated bound,
never bit for bit with a GPU), ``npf_mma_1688_tf32``
(m16n8k8, TF32 in: an operand's 13 low mantissa bits are not read; ``npf_tf32`` rounds to TF32 as
``cvt.rna`` does) and ``npf_ldmatrix_x4`` (``_trans``). A lane posts its operands and waits; the
block runs warp by warp, and once every live lane of a warp waits at the same collective the
scheduler computes the results from all 32 lanes' operands and the lanes go on. Lanes of one warp at
different collectives, or some at a barrier, are an error, as are a collective after some lanes of
the warp ended and a matrix instruction in a partial warp.

``cp.async`` copies land at the latest point CUDA allows: when a ``cp.async.wait_group`` lets their
group finish (their source read then too). From the issue to then, their destination reads as 0xff
bytes (NaN in every float type), where a GPU may show old bytes or new: a read before the wait, or a
copy issued over a tile that some thread has yet to read (a missing barrier), gives NaN here rather
than the right values by luck. A copy a thread never waits for, or whose destination some thread
writes before it lands, is an error.

Hopper's warpgroup collectives (:mod:`npformer.kernels.cuda.warp_source`, ``warpgroup.cuh``: wgmma's
fence, mma_async, commit and wait) are resolved once all 128 threads of a warpgroup (warps 4 j to
4 j + 3) wait at the same one; a warp that reaches one waits for the group's other warps. An issued
wgmma is computed when a ``wgmma.wait_group`` lets it finish, the latest point CUDA allows: its
shared-memory tiles are read then (a kernel that overwrites a tile before the wait gets another
result, as it may on a GPU) and its accumulators written then. The tiles' 128-byte swizzle is applied
to the host address, so the emulated shared arrays are aligned as on the GPU (``__align__(1024)``).
A descriptor is the emulator's handle of (tile, lbo, sbo), made by ``npf_wgmma_desc``; a collective
reached by only some threads of a warpgroup, operands that differ between its threads, a wgmma
never waited for, and a thread that writes a wgmma's accumulators or A registers between its issue and
its wait (on a GPU the wgmma reads and writes them meanwhile) are errors.

:class:`EmulatedModule` stands in for ``cupy.RawModule``: ``get_function(name)`` (an ``extern "C"``
kernel's name, or one of the module's ``name_expressions``, a template's instantiation such as
``npf_fa_fwd<NpfFaTcFwd<NpfHalfOps, 64>>``) returns a callable with ``RawKernel``'s signature
``(grid, block, args)``. Arguments reach the kernel as CUDA's launch passes them (a pointer to each
argument's bytes, copied into a parameter of its type): a NumPy array for a pointer, a NumPy scalar,
or a size-1 NumPy structured array for a struct passed by value (as CuPy takes it). The call checks
what a GPU would not: each argument's size is its parameter's (``sizeof``, from the compiled
kernel), a struct is a size-1 structured array, the launch shape is legal; and for an ``extern "C"``
kernel (its parameter list read from the source) every array is C-contiguous of the pointer's
element type and every scalar of the parameter's exact type.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from npformer.kernels.cuda.source import KERNELS_SOURCE, MAX_THREADS

SHIM = r"""
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <type_traits>
#include <utility>
#include <vector>
#include <ucontext.h>

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static __attribute__((section("npf_shared")))   // every one filled at a block's start
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)
#define __noinline__ __attribute__((noinline))

struct npf_uint3 { unsigned x, y, z; };
npf_uint3 threadIdx, blockIdx, blockDim, gridDim;      // external linkage: reloaded after every switch

static inline float npf_load(unsigned short h) { _Float16 f; std::memcpy(&f, &h, 2); return (float)f; }
static inline void npf_store(unsigned short* p, float v) { _Float16 f = (_Float16)v; std::memcpy(p, &f, 2); }

struct NpfFiber { ucontext_t ctx; unsigned tx, ty; bool done, at_barrier, at_warp; };
static ucontext_t npf_scheduler;
static std::vector<NpfFiber> npf_fibers;
static std::vector<std::vector<char>> npf_stacks;
static size_t npf_current;
static const std::function<void()>* npf_body;
static int npf_error;
// 1: blocks, warps and the lanes of each run last first (the threads' order reversed), so that a race the
// forward order hides (a thread reading what a later one writes before a barrier, a block reading what a later
// block writes) shows; set by reversed_schedule
extern "C" { int npf_reversed = 0; }

// Shared memory holds 0xff bytes (NaN in every float type) at each block's start, where a GPU's holds what
// an earlier block left: a kernel that reads bytes it never wrote (a tile's padding, rows past the end it did
// not zero) gets NaN, not zeros or an earlier block's values by luck. The __shared__ variables are in section
// npf_shared (the linker marks its ends), filled by the scheduler; a flash kernel's NPF_FA_SHARED buffer, a
// static array of the kernel's, by npf_shared_at_block_start, which every thread of the block calls at the
// kernel's start (the first one fills).
static unsigned long long npf_block_serial;          // counts the blocks run
extern "C" unsigned char __start_npf_shared[] __attribute__((weak)), __stop_npf_shared[] __attribute__((weak));
static void npf_shared_variables_at_block_start() {
    if (__start_npf_shared != nullptr) std::memset(__start_npf_shared, 0xff, __stop_npf_shared - __start_npf_shared);
}
static void npf_shared_at_block_start(unsigned char* smem, size_t bytes) {
    static const unsigned char* filled;
    static unsigned long long filled_in;
    if (filled == smem && filled_in == npf_block_serial) return;
    std::memset(smem, 0xff, bytes);
    filled = smem;
    filled_in = npf_block_serial;
}

static void __syncthreads() {
    NpfFiber& f = npf_fibers[npf_current];
    f.at_barrier = true;
    swapcontext(&f.ctx, &npf_scheduler);
}

// warp collectives: a lane's operands (in), results (out) and the collective it waits at (op)
enum { NPF_WARP_SHFL_XOR = 1, NPF_WARP_MMA = 2, NPF_WARP_LDSM = 3, NPF_WARP_LDSM_TRANS = 4, NPF_WARP_MMA_TF32 = 5,
       NPF_WARP_MMA_BF16 = 6 };
struct NpfLane { unsigned in[10]; unsigned out[4]; int op; };
static std::vector<NpfLane> npf_lanes;

static void npf_warp_wait(int op) {
    NpfFiber& f = npf_fibers[npf_current];
    npf_lanes[npf_current].op = op;
    f.at_warp = true;
    swapcontext(&f.ctx, &npf_scheduler);
}

static unsigned npf_shfl_xor_bits(unsigned v, int mask) {
    NpfLane& l = npf_lanes[npf_current];
    l.in[0] = v;
    l.in[1] = (unsigned)mask;
    npf_warp_wait(NPF_WARP_SHFL_XOR);
    return l.out[0];
}
static float __shfl_xor_sync(unsigned, float v, int mask, int = 32) {
    unsigned b; std::memcpy(&b, &v, 4); b = npf_shfl_xor_bits(b, mask); std::memcpy(&v, &b, 4); return v;
}
static double __shfl_xor_sync(unsigned, double v, int mask, int = 32) {
    unsigned b[2]; std::memcpy(b, &v, 8);
    b[0] = npf_shfl_xor_bits(b[0], mask); b[1] = npf_shfl_xor_bits(b[1], mask);
    std::memcpy(&v, b, 8); return v;
}
static int __shfl_xor_sync(unsigned, int v, int mask, int = 32) { return (int)npf_shfl_xor_bits((unsigned)v, mask); }
static unsigned __shfl_xor_sync(unsigned, unsigned v, int mask, int = 32) { return npf_shfl_xor_bits(v, mask); }

// mma.sync (op: NPF_WARP_MMA, m16n8k16 float16; NPF_WARP_MMA_BF16, bfloat16; NPF_WARP_MMA_TF32, m16n8k8): 4 A
// registers, 2 B, 4 C floats
static void npf_mma(float* d, const unsigned* a, const unsigned* b, const float* c, int op) {
    NpfLane& l = npf_lanes[npf_current];
    for (int i = 0; i < 4; ++i) { l.in[i] = a[i]; std::memcpy(&l.in[6 + i], &c[i], 4); }
    l.in[4] = b[0];
    l.in[5] = b[1];
    npf_warp_wait(op);
    for (int i = 0; i < 4; ++i) std::memcpy(&d[i], &l.out[i], 4);
}
static void npf_mma_16816(float* d, const unsigned* a, const unsigned* b, const float* c) {
    npf_mma(d, a, b, c, NPF_WARP_MMA);
}
static void npf_mma_16816_bf16(float* d, const unsigned* a, const unsigned* b, const float* c) {
    npf_mma(d, a, b, c, NPF_WARP_MMA_BF16);
}
static void npf_mma_1688_tf32(float* d, const unsigned* a, const unsigned* b, const float* c) {
    npf_mma(d, a, b, c, NPF_WARP_MMA_TF32);
}
// cvt.rna.tf32.f32: the 13 low mantissa bits rounded off, to nearest, ties away from zero (adding half a
// unit to the magnitude's bits); infinities and NaN as they are
static unsigned npf_tf32(float x) {
    unsigned b; std::memcpy(&b, &x, 4);
    if ((b & 0x7f800000u) == 0x7f800000u) return b;
    return (b + 0x1000u) & 0xffffe000u;
}
static void npf_ldmatrix(unsigned* r, const void* row, int op) {
    NpfLane& l = npf_lanes[npf_current];
    unsigned long long p = (unsigned long long)(size_t)row;
    l.in[0] = (unsigned)p;
    l.in[1] = (unsigned)(p >> 32);
    npf_warp_wait(op);
    for (int j = 0; j < 4; ++j) r[j] = l.out[j];
}
static void npf_ldmatrix_x4(unsigned* r, const void* row) { npf_ldmatrix(r, row, NPF_WARP_LDSM); }
static void npf_ldmatrix_x4_trans(unsigned* r, const void* row) { npf_ldmatrix(r, row, NPF_WARP_LDSM_TRANS); }
// cp.async: a thread's copies wait in its open group until a commit closes it, and land when a wait lets
// their group finish, the latest point CUDA allows (its source read then too; groups finishing at one wait
// land newest first). Their destination's 16 bytes read 0xff (NaN in every float type) from the issue to
// the landing: a GPU may show old bytes or new there, and a kernel that reads them, or issues a copy over
// a tile that other threads have not yet read (a missing barrier), gets NaN here; a destination no longer
// all 0xff when its copy lands was written meanwhile, an error. Both addresses must be 16-byte aligned, as
// the PTX ISA asks of a 16-byte cp.async (a GPU faults: misaligned address), the source even where none of
// its bytes are read.
struct NpfCopy { void* dst; const void* src; int bytes; };
struct NpfCopies { std::vector<NpfCopy> open; std::vector<std::vector<NpfCopy>> committed; };
static std::vector<NpfCopies> npf_copies;            // one a thread of the running block
static bool npf_copy_misaligned;                     // a copy's source or destination was not 16-byte aligned
static void npf_cp_async_16_zfill(void* dst, const void* src, int bytes) {
    if ((((size_t)dst | (size_t)src) & 15) && !npf_copy_misaligned) {
        std::fprintf(stderr, "emulator: thread %zu's cp.async from %p to %p, not 16-byte aligned\n", npf_current,
                     src, dst);
        npf_copy_misaligned = true;
    }
    std::memset(dst, 0xff, 16);
    npf_copies[npf_current].open.push_back({dst, src, bytes});
}
static void npf_cp_async_16(void* dst, const void* src) { npf_cp_async_16_zfill(dst, src, 16); }
static void npf_cp_async_commit() {
    NpfCopies& c = npf_copies[npf_current];
    c.committed.push_back(std::move(c.open));
    c.open.clear();
}
static bool npf_copy_race;                          // a copy's destination was written before it landed
template <int N> static void npf_cp_async_wait() {
    std::vector<std::vector<NpfCopy>>& groups = npf_copies[npf_current].committed;
    while (groups.size() > (size_t)N) {
        for (size_t i = groups.front().size(); i-- > 0;) {
            const NpfCopy& copy = groups.front()[i];
            const unsigned char* bytes = (const unsigned char*)copy.dst;
            bool untouched = true;
            for (int b = 0; b < 16; ++b) untouched = untouched && bytes[b] == 0xff;
            if (!untouched && !npf_copy_race) {
                std::fprintf(stderr, "emulator: a thread wrote a cp.async copy's destination between its issue "
                             "and its wait (thread %zu's copy)\n", npf_current);
                npf_copy_race = true;
            }
            if (copy.bytes > 0) std::memcpy(copy.dst, copy.src, (size_t)copy.bytes);
            std::memset((char*)copy.dst + copy.bytes, 0, (size_t)(16 - copy.bytes));
        }
        groups.erase(groups.begin());
    }
}

// wgmma (sm_90a): collectives of a warpgroup, the 128 threads of warps 4 j .. 4 j + 3. Each thread posts
// its part; an issued wgmma runs when a wgmma.wait_group lets it finish (the latest point CUDA allows), so
// its shared memory is read then and a kernel that overwrites a tile, or reads an accumulator, before the
// wait gets another result here; a thread that writes its accumulators or A registers before the wait is
// an error. A descriptor is the emulator's handle of (tile, lbo, sbo): a host address
// does not fit its 14-bit field, so a kernel makes every descriptor through npf_wgmma_desc.
enum { NPF_WG_FENCE = 16, NPF_WG_MMA = 17, NPF_WG_COMMIT = 18, NPF_WG_WAIT = 19 };
struct NpfWgDesc { const unsigned char* start; unsigned lbo, sbo; };
// areg, dreg: the A registers and accumulators as they were at the issue, which the thread may not write
// before the wait (on a GPU the wgmma reads and writes them meanwhile)
struct NpfWgPost {
    int n, bf16, rs, trans_b, accumulate, wait;
    unsigned long long a, b;
    const unsigned* aptr;
    unsigned areg[4];
    float* d;
    float dreg[64];
};
struct NpfWgOp { NpfWgPost lane[128]; bool first_on_d; };     // first_on_d: no earlier wgmma pending on d
struct NpfWgState { std::vector<NpfWgOp> open; std::vector<std::vector<NpfWgOp>> committed; };
static std::vector<NpfWgDesc> npf_wg_descs;
static std::vector<NpfWgPost> npf_wg_posts;          // one a thread
static std::vector<NpfWgState> npf_wg;              // one a warpgroup of the running block

static unsigned long long npf_wgmma_desc(const void* tile, unsigned lbo, unsigned sbo) {
    const unsigned char* start = (const unsigned char*)tile;
    if ((((size_t)start | lbo | sbo) & 15u) || lbo >= (1u << 18) || sbo >= (1u << 18)) {
        std::fprintf(stderr, "emulator: a wgmma descriptor needs a 16-byte aligned tile and offsets under 2^18 "
                     "in multiples of 16, got offset %zu in a 1024-byte line, lbo %u, sbo %u\n",
                     (size_t)start % 1024, lbo, sbo);
        npf_error = 3;
    }
    for (size_t i = 0; i < npf_wg_descs.size(); ++i) {
        const NpfWgDesc& e = npf_wg_descs[i];
        if (e.start == start && e.lbo == lbo && e.sbo == sbo) return i;
    }
    npf_wg_descs.push_back({start, lbo, sbo});
    return npf_wg_descs.size() - 1;
}
static void npf_fence_async_shared() {}
static unsigned char* npf_align_1024(unsigned char* p) { return p + (1024 - (size_t)p % 1024) % 1024; }
static void npf_wgmma_fence() { npf_warp_wait(NPF_WG_FENCE); }
static void npf_wgmma_commit() { npf_warp_wait(NPF_WG_COMMIT); }
template <int N> static void npf_wgmma_wait() { npf_wg_posts[npf_current].wait = N; npf_warp_wait(NPF_WG_WAIT); }
template <int R> static void npf_wgmma_hold(float*) {}
template <int R> static void npf_wgmma_hold(unsigned*) {}
static void npf_wgmma(float* d, const unsigned* a, unsigned long long desc_a, unsigned long long desc_b, int n,
                      int bf16, int trans_b, int accumulate) {
    NpfWgPost& p = npf_wg_posts[npf_current];
    p = NpfWgPost{n, bf16, a != nullptr, trans_b, accumulate != 0, 0, desc_a, desc_b, a, {0u, 0u, 0u, 0u}, d, {}};
    for (int i = 0; a != nullptr && i < 4; ++i) p.areg[i] = a[i];
    std::memcpy(p.dreg, d, sizeof(float) * n / 2);
    npf_warp_wait(NPF_WG_MMA);
}
#define NPF_WGMMA_EMULATED(N, SUFFIX, BF16)                                                                     \
    static void npf_wgmma_m64n##N##k16_ss##SUFFIX(float* d, unsigned long long a, unsigned long long b, int acc) { \
        npf_wgmma(d, nullptr, a, b, N, BF16, 0, acc);                                                          \
    }                                                                                                          \
    template <int TRANS_B>                                                                                     \
    static void npf_wgmma_m64n##N##k16_rs##SUFFIX(float* d, const unsigned* a, unsigned long long b, int acc) { \
        npf_wgmma(d, a, 0, b, N, BF16, TRANS_B, acc);                                                          \
    }
NPF_WGMMA_EMULATED(64, , 0)
NPF_WGMMA_EMULATED(64, _bf16, 1)
NPF_WGMMA_EMULATED(128, , 0)
NPF_WGMMA_EMULATED(128, _bf16, 1)

static float npf_half_bits(unsigned h) { return npf_load((unsigned short)(h & 0xffffu)); }
static float npf_bf16_value(unsigned h) { unsigned u = (h & 0xffffu) << 16; float f; std::memcpy(&f, &u, 4); return f; }
static float npf_tf32_bits(unsigned b) { b &= 0xffffe000u; float f; std::memcpy(&f, &b, 4); return f; }   // TF32's 19 bits

// The collective ``op`` of the lanes [base, base + count) of one warp (every one waiting at it).
static void npf_resolve(int op, size_t base, size_t count) {
    NpfLane* L = &npf_lanes[base];
    if (op == NPF_WARP_SHFL_XOR) {
        for (size_t i = 0; i < count; ++i) {
            size_t src = i ^ (size_t)L[i].in[1];
            L[i].out[0] = L[src < count ? src : i].in[0];
        }
        return;
    }
    if (op == NPF_WARP_MMA || op == NPF_WARP_MMA_BF16 || op == NPF_WARP_MMA_TF32) {
        // each lane's fragments into A (16 x K), B (K x 8) and C (16 x 8) by the PTX ISA's layouts
        const bool tf32 = op == NPF_WARP_MMA_TF32;
        float (*const half)(unsigned) = op == NPF_WARP_MMA_BF16 ? npf_bf16_value : npf_half_bits;
        const int K = tf32 ? 8 : 16;
        float A[16][16], B[16][8], C[16][8];
        for (unsigned lane = 0; lane < 32; ++lane) {
            unsigned g = lane / 4, t = lane % 4;
            for (unsigned i = 0; i < 4; ++i) {
                if (tf32) {                                  // a value a register: (g, t), (g+8, t), (g, t+4), ...
                    A[g + 8 * (i % 2)][t + 4 * (i / 2)] = npf_tf32_bits(L[lane].in[i]);
                } else {                                     // two halves: (g, 2t, 2t+1), (g+8, ...), (g, 2t+8, ...)
                    unsigned row = g + 8 * (i % 2), col = 2 * t + 8 * (i / 2);
                    A[row][col] = half(L[lane].in[i]);
                    A[row][col + 1] = half(L[lane].in[i] >> 16);
                }
                float cv; std::memcpy(&cv, &L[lane].in[6 + i], 4);
                C[g + 8 * (i / 2)][2 * t + i % 2] = cv;
            }
            for (unsigned i = 0; i < 2; ++i) {
                if (tf32) {
                    B[t + 4 * i][g] = npf_tf32_bits(L[lane].in[4 + i]);
                } else {
                    B[2 * t + 8 * i][g] = half(L[lane].in[4 + i]);
                    B[2 * t + 8 * i + 1][g] = half(L[lane].in[4 + i] >> 16);
                }
            }
        }
        for (unsigned lane = 0; lane < 32; ++lane) {
            unsigned g = lane / 4, t = lane % 4;
            for (unsigned i = 0; i < 4; ++i) {
                unsigned row = g + 8 * (i / 2), col = 2 * t + i % 2;
                float acc = C[row][col];
                for (int k = 0; k < K; ++k) acc += A[row][k] * B[k][col];   // 16-bit, TF32 products: exact in float
                std::memcpy(&L[lane].out[i], &acc, 4);
            }
        }
        return;
    }
    // ldmatrix: lane 8 j + i gave the address of row i of matrix j
    for (unsigned lane = 0; lane < 32; ++lane) {
        for (unsigned j = 0; j < 4; ++j) {
            unsigned r0, c0, r1, c1;
            if (op == NPF_WARP_LDSM) { r0 = r1 = lane / 4; c0 = 2 * (lane % 4); c1 = c0 + 1; }
            else { c0 = c1 = lane / 4; r0 = 2 * (lane % 4); r1 = r0 + 1; }
            const NpfLane& p0 = L[8 * j + r0];
            const NpfLane& p1 = L[8 * j + r1];
            const unsigned short* row0 = (const unsigned short*)(size_t)(p0.in[0] | ((unsigned long long)p0.in[1] << 32));
            const unsigned short* row1 = (const unsigned short*)(size_t)(p1.in[0] | ((unsigned long long)p1.in[1] << 32));
            L[lane].out[j] = (unsigned)row0[c0] | ((unsigned)row1[c1] << 16);
        }
    }
}

// A 16-bit operand of a 128-byte-swizzled tile: the PTX ISA's canonical layouts, with (r, k) the row along M
// or N and the column along K (K-major: rows of 128 bytes, 8-row groups sbo apart), or (k, c) the row along
// K and the column along N (N-major: 64-value rows of 128 bytes, 8-row groups sbo apart, 64-column groups
// lbo apart); then the swizzle on the address: its 16-byte chunk (bits 4-6) xor its row in a 1024-byte
// pattern (bits 7-9).
static float npf_wg_value(const NpfWgDesc& s, size_t byte, int bf16) {
    size_t address = (size_t)s.start + byte;
    address ^= ((address >> 7) & 7u) << 4;
    unsigned short h; std::memcpy(&h, (const void*)address, 2);
    return bf16 ? npf_bf16_value(h) : npf_half_bits(h);
}
static size_t npf_wg_k_major(const NpfWgDesc& s, unsigned r, unsigned k) {
    return (r % 8) * 128 + (r / 8) * s.sbo + 2 * k;
}
static size_t npf_wg_n_major(const NpfWgDesc& s, unsigned k, unsigned c) {
    return (k % 8) * 128 + (k / 8) * s.sbo + (c / 64) * s.lbo + 2 * (c % 64);
}

// D (64 x N) = A (64 x 16) B (16 x N) + D or 0, every thread's accumulators by the PTX ISA's fragments (warp
// w of the group holds rows 16 w .. 16 w + 15 as mma.sync's m16n8 tiles side by side; A's registers as
// mma.sync's m16n8k16 A); products exact in float32, added in order (as npf_resolve's mma.sync)
static int npf_wg_execute(const NpfWgOp& op) {
    const NpfWgPost& u = op.lane[0];
    const unsigned N = (unsigned)u.n;
    if (u.b >= npf_wg_descs.size() || (!u.rs && u.a >= npf_wg_descs.size())) return 0;
    const NpfWgDesc& db = npf_wg_descs[u.b];
    if ((!u.trans_b && (size_t)db.start % 128 + 32 > 128) ||
        (!u.rs && (size_t)npf_wg_descs[u.a].start % 128 + 32 > 128)) return 0;    // K's 32 bytes cross a row
    std::vector<float> A(64 * 16), B(16 * N);
    for (unsigned k = 0; k < 16; ++k) {
        for (unsigned c = 0; c < N; ++c)
            B[k * N + c] = npf_wg_value(db, u.trans_b ? npf_wg_n_major(db, k, c) : npf_wg_k_major(db, c, k), u.bf16);
    }
    for (unsigned thread = 0; thread < 128; ++thread) {
        unsigned w = thread / 32, g = thread % 32 / 4, t = thread % 4;
        for (unsigned i = 0; i < 4; ++i) {
            unsigned row = 16 * w + g + 8 * (i % 2), col = 2 * t + 8 * (i / 2);
            if (u.rs) {
                unsigned r = op.lane[thread].areg[i];
                A[row * 16 + col] = u.bf16 ? npf_bf16_value(r) : npf_half_bits(r);
                A[row * 16 + col + 1] = u.bf16 ? npf_bf16_value(r >> 16) : npf_half_bits(r >> 16);
            } else {
                const NpfWgDesc& da = npf_wg_descs[u.a];
                A[row * 16 + col] = npf_wg_value(da, npf_wg_k_major(da, row, col), u.bf16);
                A[row * 16 + col + 1] = npf_wg_value(da, npf_wg_k_major(da, row, col + 1), u.bf16);
            }
        }
    }
    for (unsigned thread = 0; thread < 128; ++thread) {
        unsigned w = thread / 32, g = thread % 32 / 4, t = thread % 4;
        float* d = op.lane[thread].d;
        for (unsigned j = 0; j < N / 2; ++j) {
            unsigned row = 16 * w + g + 8 * (j % 4 / 2), col = 8 * (j / 4) + 2 * t + j % 2;
            float acc = u.accumulate ? d[j] : 0.0f;
            for (unsigned k = 0; k < 16; ++k) acc += A[row * 16 + k] * B[k * N + col];
            d[j] = acc;
        }
    }
    return 1;
}

// Whether every thread left a wgmma's A registers (rs) and, unless an earlier pending wgmma writes them
// first, its accumulators as they were when it was issued.
static bool npf_wg_untouched(const NpfWgOp& op) {
    for (const NpfWgPost& p : op.lane) {
        if (p.rs && std::memcmp(p.areg, p.aptr, sizeof(p.areg)) != 0) return false;
        if (op.first_on_d && std::memcmp(p.dreg, p.d, sizeof(float) * p.n / 2) != 0) return false;
    }
    return true;
}

// The warpgroup collective op of the threads [base, base + 128), every one waiting at it; 0 when they
// disagree on what every thread of a warpgroup must give alike, or a wgmma's tiles are not what it reads.
static int npf_resolve_warpgroup(int op, size_t base) {
    NpfWgState& state = npf_wg[base / 128];
    const NpfWgPost* P = &npf_wg_posts[base];
    for (size_t i = 1; i < 128; ++i) {
        bool same = true;
        if (op == NPF_WG_WAIT) same = P[i].wait == P[0].wait;
        if (op == NPF_WG_MMA) {
            same = P[i].n == P[0].n && P[i].bf16 == P[0].bf16 && P[i].rs == P[0].rs && P[i].a == P[0].a &&
                   P[i].b == P[0].b && P[i].trans_b == P[0].trans_b && P[i].accumulate == P[0].accumulate;
        }
        if (!same) {
            std::fprintf(stderr, "emulator: a warpgroup's threads gave different operands to a wgmma collective\n");
            return 0;
        }
    }
    if (op == NPF_WG_MMA) {
        bool first = true;
        for (const NpfWgOp& o : state.open) first = first && o.lane[0].d != P[0].d;
        for (const std::vector<NpfWgOp>& group : state.committed)
            for (const NpfWgOp& o : group) first = first && o.lane[0].d != P[0].d;
        state.open.emplace_back();
        std::memcpy(state.open.back().lane, P, sizeof(state.open.back().lane));
        state.open.back().first_on_d = first;
    } else if (op == NPF_WG_COMMIT) {
        state.committed.push_back(std::move(state.open));
        state.open.clear();
    } else if (op == NPF_WG_WAIT) {
        while (state.committed.size() > (size_t)P[0].wait) {
            for (const NpfWgOp& mma : state.committed.front()) {
                if (!npf_wg_untouched(mma)) {
                    std::fprintf(stderr, "emulator: a thread wrote a wgmma's %s between its issue and its wait\n",
                                 mma.first_on_d ? "accumulators or A registers" : "A registers");
                    return 0;
                }
                if (!npf_wg_execute(mma)) {
                    std::fprintf(stderr, "emulator: a wgmma's descriptor is not one npf_wgmma_desc made, or its K "
                                 "columns cross a 128-byte row\n");
                    return 0;
                }
            }
            state.committed.erase(state.committed.begin());
        }
    }
    return 1;
}

static void npf_fiber_main() {
    (*npf_body)();
    npf_fibers[npf_current].done = true;      // returning resumes uc_link, the scheduler
}

// Runs the threads [w0, w1) of one warp until each is at a barrier, at its end, or (all 32) at a warpgroup
// collective, resolving their warp collectives on the way; 2 when they disagree on one.
static int npf_run_warp(size_t w0, size_t w1, unsigned i, unsigned j) {
    for (;;) {
        for (size_t lane = 0; lane < w1 - w0; ++lane) {
            const size_t k = npf_reversed ? w1 - 1 - lane : w0 + lane;
            NpfFiber& f = npf_fibers[k];
            if (f.done || f.at_barrier || f.at_warp) continue;
            npf_current = k;
            threadIdx = {f.tx, f.ty, 0};
            swapcontext(&npf_scheduler, &f.ctx);
        }
        size_t live = 0, waiting = 0;
        int op = 0;
        bool same = true;
        for (size_t k = w0; k < w1; ++k) {
            if (npf_fibers[k].done) continue;
            ++live;
            if (!npf_fibers[k].at_warp) continue;
            ++waiting;
            if (op == 0) op = npf_lanes[k].op;
            else same = same && npf_lanes[k].op == op;
        }
        if (waiting == 0) return 0;
        if (waiting != live || !same || live != w1 - w0 || (op != NPF_WARP_SHFL_XOR && live != 32)) {
            std::fprintf(stderr, "emulator: a warp collective reached by %zu of %zu live lanes of warp "
                         "%zu of block (%u, %u)%s\n", waiting, live, w0 / 32, i, j,
                         same ? "" : ", at different collectives");
            return 2;
        }
        if (op >= NPF_WG_FENCE) return 0;            // the warpgroup's other warps decide
        npf_resolve(op, w0, w1 - w0);
        for (size_t k = w0; k < w1; ++k) npf_fibers[k].at_warp = false;
    }
}

// Resolves every warpgroup whose 128 threads all wait at one warpgroup collective; the number resolved, or
// -1 when some threads of a warpgroup wait at one and the others are elsewhere (at a barrier, at their end).
static int npf_resolve_warpgroups(size_t n, unsigned i, unsigned j) {
    int resolved = 0;
    for (size_t base = 0; base < n; base += 128) {
        size_t waiting = 0, end = base + 128 < n ? base + 128 : n;
        for (size_t k = base; k < end; ++k) {
            if (npf_fibers[k].at_warp && npf_lanes[k].op >= NPF_WG_FENCE && npf_lanes[k].op == npf_lanes[base].op)
                ++waiting;
        }
        if (waiting == 0) continue;
        if (waiting != 128) {
            std::fprintf(stderr, "emulator: a warpgroup collective reached by %zu of the 128 threads of warpgroup %zu "
                         "of block (%u, %u)\n", waiting, base / 128, i, j);
            return -1;
        }
        if (!npf_resolve_warpgroup(npf_lanes[base].op, base)) return -1;
        for (size_t k = base; k < end; ++k) npf_fibers[k].at_warp = false;
        ++resolved;
    }
    return resolved;
}

// Runs the grid block by block; returns 0, or 1 when a block's threads disagreed on a barrier, 2 on a warp
// collective, 3 on a warpgroup's (or a wgmma issued and never waited for), 4 on a cp.async never waited for
// or whose destination was written before its wait, 5 on a cp.async not 16-byte aligned.
static int npf_run_grid(unsigned gx, unsigned gy, unsigned bx, unsigned by, const std::function<void()>& body) {
    gridDim = {gx, gy, 1};
    blockDim = {bx, by, 1};
    npf_body = &body;
    size_t n = (size_t)bx * by;
    npf_fibers.assign(n, NpfFiber());
    npf_lanes.assign(n, NpfLane());
    npf_wg_posts.assign(n, NpfWgPost());
    npf_wg_descs.clear();
    npf_error = 0;
    npf_copy_race = false;
    npf_copy_misaligned = false;
    if (npf_stacks.size() < n) npf_stacks.resize(n, std::vector<char>(1 << 16));
    for (unsigned jj = 0; jj < gy; ++jj) {
        for (unsigned ii = 0; ii < gx; ++ii) {
            const unsigned i = npf_reversed ? gx - 1 - ii : ii, j = npf_reversed ? gy - 1 - jj : jj;
            blockIdx = {i, j, 0};
            ++npf_block_serial;
            npf_shared_variables_at_block_start();
            npf_wg.assign((n + 127) / 128, NpfWgState());
            npf_copies.assign(n, NpfCopies());
            for (size_t k = 0; k < n; ++k) {
                NpfFiber& f = npf_fibers[k];
                f.tx = (unsigned)(k % bx);
                f.ty = (unsigned)(k / bx);
                f.done = f.at_barrier = f.at_warp = false;
                getcontext(&f.ctx);
                f.ctx.uc_stack.ss_sp = npf_stacks[k].data();
                f.ctx.uc_stack.ss_size = npf_stacks[k].size();
                f.ctx.uc_link = &npf_scheduler;
                makecontext(&f.ctx, npf_fiber_main, 0);
            }
            for (;;) {                        // one round: every live thread runs to a barrier or its end
                for (size_t k = 0; k < n; ++k) npf_fibers[k].at_barrier = false;
                for (;;) {                    // warp by warp, then the warpgroups' collectives, while any resolves
                    for (size_t w = 0; w < n; w += 32) {
                        const size_t w0 = npf_reversed ? (n - 1) / 32 * 32 - w : w;
                        int rc = npf_run_warp(w0, w0 + 32 < n ? w0 + 32 : n, i, j);
                        if (rc) return rc;
                    }
                    if (npf_copy_race) return 4;
                    if (npf_copy_misaligned) return 5;
                    int resolved = npf_resolve_warpgroups(n, i, j);
                    if (resolved < 0 || npf_error) return 3;
                    if (resolved == 0) break;
                }
                size_t done = 0;
                for (size_t k = 0; k < n; ++k) done += npf_fibers[k].done;
                if (done == n) break;
                if (done != 0) {
                    std::fprintf(stderr, "emulator: __syncthreads reached by %zu of %zu threads of block (%u, %u)\n",
                                 n - done, n, i, j);
                    return 1;
                }
            }
            for (const NpfWgState& state : npf_wg) {
                if (!state.open.empty() || !state.committed.empty()) {
                    std::fprintf(stderr, "emulator: block (%u, %u) ended with a wgmma not waited for\n", i, j);
                    return 3;
                }
            }
            for (size_t k = 0; k < n; ++k) {
                bool pending = !npf_copies[k].open.empty();
                for (const std::vector<NpfCopy>& group : npf_copies[k].committed) pending = pending || !group.empty();
                if (pending) {
                    std::fprintf(stderr, "emulator: thread %zu of block (%u, %u) ended with a cp.async not waited "
                                 "for\n", k, i, j);
                    return 4;
                }
            }
            if (npf_copy_misaligned) return 5;
        }
    }
    return 0;
}

// A kernel's arguments as CUDA's launch takes them (cuLaunchKernel's kernelParams): args[i] points to
// the bytes of argument i, copied into a parameter of its type; and each parameter's size
template <typename... P, size_t... I>
static void npf_invoke_each(void (*kernel)(P...), void** args, std::index_sequence<I...>) {
    kernel(*static_cast<typename std::decay<P>::type*>(args[I])...);
}
template <typename... P> static void npf_invoke(void (*kernel)(P...), void** args) {
    npf_invoke_each(kernel, args, std::index_sequence_for<P...>{});
}
template <typename... P> static int npf_param_sizes(void (*)(P...), long long* sizes) {
    int n = 0;
    ((sizes[n++] = (long long)sizeof(typename std::decay<P>::type)), ...);
    return n;
}
"""

_ENTRY = re.compile(r'extern "C" __global__ void (?:__launch_bounds__\([^)]*\) )?(npf_\w+)\(([^)]*)\)')
# a pointer parameter's element type -> its array's dtype, by name (bfloat16: ml_dtypes', not imported here)
_POINTEE = {"unsigned short": "float16", "npf_bf16": "bfloat16", "float": "float32", "double": "float64",
            "bool": "bool", "long long": "int64", "unsigned long long": "uint64", "unsigned": "uint32", "int": "int32"}
_SCALAR = {"long long": np.int64, "int": np.int32, "float": np.float32, "double": np.float64}
_ROW_KERNELS = ("npf_softmax_", "npf_layer_norm_", "npf_add_dropout_ln_", "npf_cross_entropy_")
_MAX_PARAMS = 64


def _parse(params: str):
    """[(c type, is_pointer, name)] of a kernel's parameter list (commas inside a template's <> kept)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(params):
        depth += (ch == "<") - (ch == ">")
        if ch == "," and depth == 0:
            parts.append(params[start:i])
            start = i + 1
    parts.append(params[start:])
    out = []
    for p in parts:
        m = re.fullmatch(r"\s*(?:const\s+)?([\w <>,]+?)\s*(\*?)\s*(\w+)\s*", p)
        out.append((m.group(1), bool(m.group(2)), m.group(3)))
    return out


def _kernels(source: str, name_expressions) -> list:
    """[(name, parameters or None)]: the source's extern "C" kernels (their parameter lists parsed), then
    the name expressions (templates' instantiations: their parameters known only as sizes)."""
    return [(name, _parse(params)) for name, params in _ENTRY.findall(source)] + [(e, None) for e in name_expressions]


def _trampolines(kernels) -> str:
    text = []
    for i, (name, _) in enumerate(kernels):
        launch = f"npf_run_grid(gx, gy, bx, by, [&]() {{ npf_invoke(&{name}, args); }})"
        text.append(f'extern "C" int npf_launch_{i}(unsigned gx, unsigned gy, unsigned bx, unsigned by, '
                    f"void** args) {{\n    return {launch};\n}}\n"
                    f'extern "C" int npf_sizes_{i}(long long* sizes) {{ return npf_param_sizes(&{name}, sizes); }}\n')
    return "\n".join(text)


_NUMPY_EMPTY = np.empty


def stale_empty(shape, dtype=float, order="C", **kwargs):
    """``numpy.empty`` for the emulated tests, where NumPy stands in for CuPy (the CUDA wrappers allocate
    their outputs through it): an array of 0xff bytes (NaN in every float type). CuPy's memory pool hands
    out blocks that still hold an earlier array's bytes, so a kernel that leaves part of its output
    unwritten fails here as it could on a GPU, instead of finding the zeros of fresh host pages."""
    out = _NUMPY_EMPTY(shape, dtype=dtype, order=order, **kwargs)
    out.reshape(-1, order="A").view(np.uint8).fill(0xFF)
    return out


@functools.lru_cache(maxsize=None)
def locals_pattern() -> tuple[str, ...]:
    """g++'s option that starts every local variable as 0xfe bytes, where this g++ has it (GCC 12 on)."""
    flag = "-ftrivial-auto-var-init=pattern"
    probe = subprocess.run(["g++", flag, "-x", "c++", "-fsyntax-only", "-"], input="", capture_output=True, text=True)
    return (flag,) if probe.returncode == 0 else ()


def build(directory: Path, kernels_source: str = KERNELS_SOURCE, name_expressions=()) -> Path:
    """Compiles the kernels with the shim into a shared library in ``directory`` (cached by hash): every
    ``extern "C"`` kernel of the source and each of ``name_expressions`` (as CuPy's RawModule takes them)."""
    source = SHIM + kernels_source + "\n" + _trampolines(_kernels(kernels_source, name_expressions))
    options = ["-std=c++17", "-O1", "-ffp-contract=off", *locals_pattern(), "-shared", "-fPIC"]
    key = hashlib.sha256((" ".join(options) + "\n" + source).encode()).hexdigest()[:16]
    lib = Path(directory) / f"npf_emulated_{key}.so"
    if not lib.exists():
        src = lib.with_suffix(".cpp")
        src.write_text(source)
        cmd = ["g++", *options, "-o", str(lib), str(src)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"g++ failed on the emulated kernels:\n{res.stderr[-4000:]}")
    return lib


def emulated_module(directory: Path, kernels_source: str = KERNELS_SOURCE, name_expressions=()) -> "EmulatedModule":
    """:func:`build` and :class:`EmulatedModule` together, for a test: skipped, saying why, without g++."""
    if shutil.which("g++") is None:
        pytest.skip("g++ is not installed: it compiles the kernels' CUDA C for the CPU emulation")
    return EmulatedModule(build(directory, kernels_source, name_expressions), kernels_source, name_expressions)


@contextlib.contextmanager
def reversed_schedule(module: "EmulatedModule"):
    """Within it, ``module``'s kernels run their blocks, each block's warps and each warp's lanes last
    first: a kernel whose results depend on its threads' order (a missing barrier, a race between lanes,
    a block reading what another block writes) gives others than in the forward order, which every
    other test runs."""
    flag = ctypes.c_int.in_dll(module.lib, "npf_reversed")
    flag.value = 1
    try:
        yield module
    finally:
        flag.value = 0


def _shared_declared(lib):
    """The flash kernels' record of the shared memory the last one carved (None in a library without them)."""
    try:
        return ctypes.c_longlong.in_dll(lib, "npf_fa_shared_declared")
    except ValueError:
        return None


class EmulatedKernel:
    def __init__(self, lib, name: str, index: int, params):
        self.lib = lib
        self.name, self.params = name, params
        self.fn = getattr(lib, f"npf_launch_{index}")
        self.fn.restype = ctypes.c_int
        self.fn.argtypes = [ctypes.c_uint] * 4 + [ctypes.c_void_p]
        sizes = (ctypes.c_longlong * _MAX_PARAMS)()
        self.sizes = list(sizes[:getattr(lib, f"npf_sizes_{index}")(sizes)])

    def _argument(self, i: int, a, size: int):
        """(what holds argument i's bytes, their address), after the checks."""
        ctype, ptr, pname = self.params[i] if self.params is not None else (None, None, f"argument {i}")
        where = f"{self.name}.{pname}"
        if isinstance(a, np.ndarray) and a.dtype.names is not None:      # a struct by value
            assert not ptr and a.size == 1 and a.flags.c_contiguous, f"{where}: a struct is a size-1 structured array"
            assert a.itemsize == size, f"{where}: {a.itemsize} bytes for a {size}-byte struct"
            return a, a.ctypes.data
        if isinstance(a, np.ndarray):                                    # a pointer to its first element
            assert size == ctypes.sizeof(ctypes.c_void_p), f"{where}: an array for a {size}-byte parameter"
            if self.params is not None:
                assert ptr, f"{where}: an array for a {ctype}"
                assert a.flags.c_contiguous, f"{where}: array is not C-contiguous"
                assert a.dtype.name == _POINTEE[ctype], f"{where}: {a.dtype} for a {ctype}*"
            holder = ctypes.c_void_p(a.ctypes.data)
            return holder, ctypes.addressof(holder)
        if self.params is not None:
            assert not ptr, f"{where}: expected an array, got {type(a)}"
            want = _SCALAR[ctype]
            assert type(a) is want, f"{where}: {type(a).__name__} for a {ctype} (pass {want.__name__})"
        holder = np.array(a)
        assert isinstance(a, np.generic) and holder.itemsize == size, \
            f"{where}: {type(a).__name__} for a {size}-byte parameter (pass a NumPy scalar of its size)"
        return holder, holder.ctypes.data

    def __call__(self, grid, block, args, shared_mem=0):
        grid, block = tuple(grid) + (1,) * (3 - len(grid)), tuple(block) + (1,) * (3 - len(block))
        assert grid[2] == 1 and block[2] == 1, f"{self.name}: 3-d launches are not used"
        assert 1 <= grid[0] < 2 ** 31 and 1 <= grid[1] <= 65535, f"{self.name}: illegal grid {grid}"
        assert all(b >= 1 for b in block) and block[0] * block[1] <= 1024, f"{self.name}: illegal block {block}"
        if self.name.startswith(_ROW_KERNELS):
            bx = block[0]
            assert bx & (bx - 1) == 0 and bx <= MAX_THREADS and block[1] == 1, \
                f"{self.name}: row kernels need a power-of-two block <= {MAX_THREADS}, got {block}"
        assert len(args) == len(self.sizes), f"{self.name}: {len(args)} arguments for {len(self.sizes)} parameters"
        held = [self._argument(i, a, size) for i, (a, size) in enumerate(zip(args, self.sizes))]
        pointers = (ctypes.c_void_p * max(1, len(held)))(*[address for _, address in held])
        declared = _shared_declared(self.lib)
        if declared is not None:
            declared.value = 0
        rc = self.fn(grid[0], grid[1], block[0], block[1], pointers)
        assert rc != 4, (f"{self.name}: a thread ended with a cp.async copy it never waited for, or a copy's "
                         "destination was written before its wait (see stderr)")
        assert rc != 5, f"{self.name}: a cp.async copy from or to an address not 16-byte aligned (see stderr)"
        assert rc == 0, (f"{self.name}: threads of one block disagreed on a __syncthreads or a warp(group) "
                         "collective (see stderr)")
        if declared is not None and declared.value:       # a flash kernel: its shared memory is what the launch gave
            assert declared.value == shared_mem, \
                f"{self.name}: the kernel carves {declared.value} bytes of shared memory, the launch gives {shared_mem}"


class EmulatedModule:
    """``cupy.RawModule`` for the emulated kernels (``name_expressions`` as the library was built with)."""

    def __init__(self, lib_path: Path, kernels_source: str = KERNELS_SOURCE, name_expressions=()):
        self.lib = ctypes.CDLL(str(lib_path))
        kernels = _kernels(kernels_source, name_expressions)
        self.kernels = {name: (i, params) for i, (name, params) in enumerate(kernels)}

    def get_function(self, name: str) -> EmulatedKernel:
        return EmulatedKernel(self.lib, name, *self.kernels[name])
