"""The CUDA C of flash attention (:mod:`npformer.kernels.cuda.flash_attention`), its own NVRTC module.

Three kernels and a pre-pass, FlashAttention-2 (Dao 2023, Algorithms 1 and 2) in SIMT arithmetic:
every tile product is a loop of multiply-adds, in the accumulation type ``A`` (float for float16 and
float32, double for float64); and the same three on tensor cores (``_tc`` kernels, one template over an
operand policy: float16 with ``NpfHalfOps``, float32 under the TF32 opt-in with ``NpfTf32Ops``). Each
maps to lines of the reference, :mod:`npformer.ops.flash_attention` (names below are the reference's):

==================================  ===============================================================
CUDA C                              reference
==================================  ===============================================================
``npf_fa_keep``                     ``_keep``: splitmix64 of ``seed + n * golden``, n the flat index
                                    ((b H + h) Tq + i) Tk + j, kept when the top 24 bits reach
                                    ``keep_min`` (the least value ``_keep``'s ``u >= p`` keeps,
                                    computed on the host by its own expression)
``npf_fa_score``                    ``_scores``: ``s = q_i k_j^T``; ``s *= scale``; ``s += attn bias``;
                                    ``s += padding bias``; ``s += -inf`` in the causal future; a
                                    key past Tk (a ragged last tile) is -inf
``npf_fa_forward``                  the forward's loops: ``for i0`` is the block (one query tile of
                                    one head), ``for j0`` its key-tile loop, ``break`` at the first
                                    tile wholly in the future (``_visible``); ``m_new``, ``shift``,
                                    ``pt``, ``alpha``, ``l``, dropout, ``acc``, then ``out`` and
                                    ``lse`` (+inf where ``l == 0``) as written there
``npf_fa_bwd_pre``                  ``d = (do * out).sum(-1)``  (D_i = rowsum(dO_i O_i)), a warp per
                                    row: lanes read consecutive values (coalesced), shuffles add
``npf_fa_bwd_dkdv``                 the backward's ``for j0`` loop as a block (one key tile) over
                                    every visible query tile: ``pt = exp(s - lse)``, ``dv += P_drop^T
                                    dO``, ``ds = dO v^T``, ``ds *= keep``, ``ds -= d``, ``ds *= pt``,
                                    ``ds *= scale``, ``dk += ds^T q``
``npf_fa_bwd_dq``                   the same inner step for one query tile over its key tiles, kept
                                    only for ``dq += ds k``: dq gets its own pass so that no two
                                    blocks add into one element (no atomics: the result does not
                                    depend on scheduling)
``npf_fa_forward_tc``               the forward on tensor cores (sm_80 and later; float16, or
                                    float32 as TF32 under the opt-in, m16n8k8, the keys of the second
                                    product taken in the order the scores' registers hold them): the
                                    same loop per warp of 16 query rows, ``S = q k^T`` and
                                    ``acc += P_drop v`` on mma.sync m16n8k16 with float32
                                    accumulators, the row max and sum by shuffles in registers,
                                    ``P_drop`` rounded to float16 for the second product; K and V
                                    double-buffered: the next tile's cp.async copies land while
                                    the current one is computed
``npf_fa_bwd_dq_tc``,               the backward's two kernels for float16 on tensor cores: a warp per
``npf_fa_bwd_dkdv_tc``              16 query rows (dq) or 16 keys (dk, dv); ``S``, ``dP`` (and their
                                    transposes) by mma.sync, the inner step per element in
                                    registers, ``dS`` and ``P_drop`` rounded to float16 for
                                    ``dq += ds k``, ``dv += P_drop^T dO``, ``dk += ds^T q``; the
                                    next K, V (dq) or Q, dO (dk, dv) tile's cp.async copies land
                                    during the current one (dq at D 128: after it). Seven
                                    tile products a (query, key) tile pair against the forward's
                                    two: 3.5 times the forward's work (FlashAttention-2: 2.5, adding
                                    dq with atomics; here dq's own pass recomputes S and dP, so no
                                    result depends on the order blocks finish in)
==================================  ===============================================================

Layout. A block has 128 threads seen as 16 row lanes x 8 column lanes; a tile product X Y^T of
(NR, D) by (NC, D) gives thread (tr, tc) the rows tr + 16 a and columns tc + 8 b (a register
micro-tile), and a product P W of (NR, N) by (N, D) gives it rows tr + 16 a and head columns
32 (c / 4) + 4 tc + c % 4 (runs of 4: 16-byte loads and stores). So a thread owns the same query rows in the score tile and in the output accumulator, and
the row max and sum need one exchange among the 8 threads of a row (through shared memory).
Tiles are (BR queries, BC keys) with the head size padded to D in {32, 64, 128} (zeros: they add
nothing to a dot product); rows are D + 4 values apart in shared memory (16-byte aligned, and the 4
or 8 rows read at once fall in distinct banks). Shared memory is dynamic: :data:`SHARED` gives each
kernel's bytes, which the kernel also carves out (a test checks the two agree).

Masks. A bool mask is read as bytes by the SIMT kernels and as bits by the tensor-core kernels
(:func:`~npformer.kernels.cuda.flash_attention.pack_bits`: 32 keys a word, so a lane's two columns
of a key tile cost one 4-byte load a row, the quad's lanes the same word); a float mask is read as
values (a quad's 8 consecutive columns: 32 bytes, one memory sector). A bool key-padding mask also
comes as lengths (``key_end``: one past each batch's last visible key): every kernel skips the key
tiles past it whole, as it skips the causal future (keys in the skipped tiles are never read).
Every kernel has ``__launch_bounds__`` (:data:`MIN_BLOCKS`, ``TC_MIN_BLOCKS``).

Strides. q, k, v, out, dout, dq, dk, dv are (B, H, T, D) arrays with a contiguous last axis and any
other strides (``NpfFaLayout``: element (b, h, t, d) at ``b sb + h sh + t st + d``): the heads of a
packed (B, T, 3E) projection are read in place, and (B, T, H, hs) outputs merge into (B, T, E) as
views. lse and D stay (B, H, T) contiguous.

Modules. Each (dtype, D) pair is its own small NVRTC module (:func:`module_source`), compiled on
first use: a run compiles the three kernels it needs (seconds), not all 27 instantiations (about a
minute). A module is self-contained: :data:`~npformer.kernels.cuda.source.HALF_CONVERSIONS`, then the
few loads, stores and math helpers of the common source's prelude (same names and meaning), then the
kernels. Only the infinity constant and the dynamic shared-memory declaration differ between the GPU
and the CPU emulator (tests/kernels/cuda/emulator.py, where ``__CUDACC__`` is undefined), which
compiles :data:`FLASH_EMULATED_SOURCE`, every entry point in one library.
"""
from __future__ import annotations

import re

import numpy

from npformer.kernels.cuda.source import HALF_CONVERSIONS, TYPES
from npformer.kernels.cuda.warp_source import WARP_PRIMITIVES
from npformer.ops.flash_attention import SPLITMIX64

__all__ = ["THREADS", "HEAD_SIZES", "MAX_HEAD_SIZE", "TILES", "SHARED", "TC_VARIANTS", "TC_VARIANT_OF", "TC_BR",
           "TC_BC", "TC_BQ", "TC_DQ_BUFFERS", "TC_MIN_BLOCKS", "TC_SHARED", "tc_shared", "OCCUPANCY_FLOORS",
           "MIN_BLOCKS", "PRE_THREADS", "STRIDED", "shared_bytes",
           "entry_name", "module_source", "MODULE_SOURCES", "TEST_SOURCE", "FLASH_EMULATED_SOURCE",
           "FLASH_NVRTC_OPTIONS"]

THREADS = 128                      # per block: 16 row lanes x 8 column lanes
HEAD_SIZES = (32, 64, 128)         # the head-size buckets D (one instantiation each)
MAX_HEAD_SIZE = HEAD_SIZES[-1]

# (BR, BC) query x key tile per accumulation type and D: 64 x 64 for float up to D = 64; 32 x 32 at
# D = 128 (registers: a thread holds 2 rows x 16 columns of each accumulator) and for double (so that
# every kernel's shared memory stays under an A100's 163 KiB, see SHARED).
TILES = {("float", 32): (64, 64), ("float", 64): (64, 64), ("float", 128): (32, 32),
         ("double", 32): (32, 32), ("double", 64): (32, 32), ("double", 128): (32, 32)}


def shared_bytes(kernel: str, acc: str, d: int) -> int:
    """Dynamic shared memory of one block of ``kernel`` ("fwd", "dq", "dkdv"), as the kernel carves it."""
    br, bc = TILES[acc, d]
    dp, size = d + 4, 4 if acc == "float" else 8
    elements = {"fwd": (br + 2 * bc) * dp + br * (bc + 4) + 2 * br * 8,    # Q, K, V, P, row max and sum
                "dq": (2 * br + 2 * bc) * dp + br * (bc + 4),               # Q, dO, K, V, dS
                "dkdv": (2 * bc + 2 * br) * dp + 2 * bc * (br + 4) + 2 * br}   # K, V, Q, dO, P^T, dS^T, lse, D
    return elements[kernel] * size


SHARED = {(kernel, acc, d): shared_bytes(kernel, acc, d) for kernel in ("fwd", "dq", "dkdv") for acc, d in TILES}
# Tensor cores (npf_fa_forward_tc, npf_fa_bwd_dq_tc, npf_fa_bwd_dkdv_tc), per variant: "tc" float16
# (NpfHalfOps), "tf32" float32 under the TF32 opt-in (NpfTf32Ops). BR = 64 query rows (4 warps x 16), BC
# keys a tile; tiles in shared memory as rows of D values and 16 bytes (aligned rows, no bank conflicts).
TC_VARIANTS = {"tc": ("NpfHalfOps", 2), "tf32": ("NpfTf32Ops", 4)}      # the Ops policy, bytes a value
TC_VARIANT_OF = {numpy.dtype(numpy.float16): "tc", numpy.dtype(numpy.float32): "tf32"}
TC_BR = 64
TC_BC = {("tc", 32): 32, ("tc", 64): 32, ("tc", 128): 32,
         ("tf32", 32): 32, ("tf32", 64): 32, ("tf32", 128): 16}            # float32 tiles: twice the bytes
# backward: dq takes 64 query rows over key tiles of TC_BC keys; dkdv 64 keys over query tiles of TC_BQ
# queries (its dK and dV accumulators take D registers a lane: a smaller tile at D = 128)
TC_BQ = {("tc", 32): 32, ("tc", 64): 32, ("tc", 128): 16, ("tf32", 32): 32, ("tf32", 64): 32, ("tf32", 128): 16}
# K and V buffers of dq (2: the next tile's copies overlap this one's work; 1 for float16 at D = 128, where
# a second would hold sm_80 to 2 blocks an SM by shared memory, below the registers' 3)
TC_DQ_BUFFERS = {("tc", 32): 2, ("tc", 64): 2, ("tc", 128): 1, ("tf32", 32): 2, ("tf32", 64): 2, ("tf32", 128): 2}
# __launch_bounds__ blocks of 128 threads an SM, per kernel and D: 4 holds a kernel to 128 registers
TC_MIN_BLOCKS = {("fwd_tc", 32): 4, ("fwd_tc", 64): 4, ("fwd_tc", 128): 4, ("bwd_dq_tc", 32): 4,
                 ("bwd_dq_tc", 64): 4, ("bwd_dq_tc", 128): 3, ("bwd_dkdv_tc", 32): 4, ("bwd_dkdv_tc", 64): 3,
                 ("bwd_dkdv_tc", 128): 2,
                 ("fwd_tf32", 32): 3, ("fwd_tf32", 64): 3, ("fwd_tf32", 128): 3, ("bwd_dq_tf32", 32): 3,
                 ("bwd_dq_tf32", 64): 3, ("bwd_dq_tf32", 128): 2, ("bwd_dkdv_tf32", 32): 3, ("bwd_dkdv_tf32", 64): 3,
                 ("bwd_dkdv_tf32", 128): 2}


def tc_shared(name: str, d: int) -> int:
    """Dynamic shared memory of one block of tensor-core kernel ``name`` ("fwd_tc", "bwd_dq_tf32", ...)."""
    kernel, variant = name.rsplit("_", 1)
    size = TC_VARIANTS[variant][1]
    ld = d + 16 // size
    bc, bq, buffers = TC_BC[variant, d], TC_BQ[variant, d], TC_DQ_BUFFERS[variant, d]
    return {"fwd": (TC_BR + 4 * bc) * ld * size,                         # Q; K, V double-buffered
            "bwd_dq": (2 * TC_BR + 2 * buffers * bc) * ld * size,         # Q, dO; K, V in `buffers`
            "bwd_dkdv": (2 * TC_BR + 4 * bq) * ld * size + 4 * bq * 4}[kernel]   # K, V; Q, dO, lse, D doubled


TC_SHARED = {(f"{kernel}_{variant}", d): tc_shared(f"{kernel}_{variant}", d)
             for kernel in ("fwd", "bwd_dq", "bwd_dkdv") for variant in TC_VARIANTS for d in HEAD_SIZES}
# The theoretical occupancy (resident warps per SM / 64) each kernel keeps at THREADS threads, on
# (sm_80, sm_90), float16 and float32 sharing the float row: measured by benchmarks/cuda_kernels.py on
# 2026-11-27, held by tests/kernels/cuda/test_compile.py. Registers limit most (bwd_dq at D 32/64: 254
# a thread), shared memory the rest; the tensor-core kernels are to raise them.
OCCUPANCY_FLOORS = {
    ("fwd", "float", 32): (0.1875, 0.1875), ("fwd", "float", 64): (0.125, 0.1875),
    ("fwd", "float", 128): (0.125, 0.25), ("fwd", "double", 32): (0.25, 0.25),
    ("fwd", "double", 64): (0.125, 0.1875), ("fwd", "double", 128): (0.0625, 0.125),
    ("dq", "float", 32): (0.125, 0.125), ("dq", "float", 64): (0.0625, 0.125),
    ("dq", "float", 128): (0.125, 0.1875), ("dq", "double", 32): (0.1875, 0.1875),
    ("dq", "double", 64): (0.125, 0.125), ("dq", "double", 128): (0.0625, 0.0625),
    ("dkdv", "float", 32): (0.125, 0.1875), ("dkdv", "float", 64): (0.0625, 0.125),
    ("dkdv", "float", 128): (0.125, 0.125), ("dkdv", "double", 32): (0.125, 0.1875),
    ("dkdv", "double", 64): (0.0625, 0.125), ("dkdv", "double", 128): (0.0625, 0.0625),
    ("pre", "float", None): (0.75, 0.75), ("pre", "double", None): (0.75, 0.75),
    ("fwd_tc", "float", 32): (0.25, 0.25), ("fwd_tc", "float", 64): (0.25, 0.25),     # TC_MIN_BLOCKS
    ("fwd_tc", "float", 128): (0.1875, 0.25), ("dq_tc", "float", 32): (0.25, 0.25),
    ("dq_tc", "float", 64): (0.25, 0.25), ("dq_tc", "float", 128): (0.1875, 0.1875),
    ("dkdv_tc", "float", 32): (0.25, 0.25), ("dkdv_tc", "float", 64): (0.1875, 0.1875),
    ("dkdv_tc", "float", 128): (0.125, 0.125),           # dK and dV: 128 registers of accumulators a lane
    ("fwd_tf32", "float", 32): (0.1875, 0.1875), ("fwd_tf32", "float", 64): (0.1875, 0.1875),   # float32 tiles:
    ("fwd_tf32", "float", 128): (0.125, 0.1875), ("dq_tf32", "float", 32): (0.25, 0.1875),     # twice the shared
    ("dq_tf32", "float", 64): (0.125, 0.1875), ("dq_tf32", "float", 128): (0.0625, 0.125),    # memory of float16
    ("dkdv_tf32", "float", 32): (0.25, 0.25), ("dkdv_tf32", "float", 64): (0.125, 0.1875),
    ("dkdv_tf32", "float", 128): (0.0625, 0.125),
}
# __launch_bounds__ of the SIMT kernels: blocks of 128 threads an SM (the register cap that keeps each
# at its sm_90 occupancy floor: floor x 64 warps / 4 warps a block), and bwd_pre's block (a warp a row)
MIN_BLOCKS = {(name, acc, d): max(1, round(OCCUPANCY_FLOORS[floor, acc, d][1] * 16))
              for name, floor in (("fwd", "fwd"), ("bwd_dq", "dq"), ("bwd_dkdv", "dkdv")) for acc, d in TILES}
PRE_THREADS = 256           # runtime.ELEMENT_THREADS, the launch's block

_KERNELS = r"""
// The common source's prelude, as there: loads and stores of T as A, exp, log, a NaN-keeping max and
// the grid-stride loop (float16's npf_load/npf_store come from HALF_CONVERSIONS or the emulator).
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

#define NPF_FA_THREADS 128
#define NPF_FA_TR 16
#define NPF_FA_TC 8

#ifdef __CUDACC__
#define NPF_FA_SHARED(name, bytes) extern __shared__ __align__(16) unsigned char name[]
__device__ __forceinline__ float npf_fa_inf(float) { return __int_as_float(0x7f800000); }
__device__ __forceinline__ double npf_fa_inf(double) { return __longlong_as_double(0x7ff0000000000000LL); }
#else
// the CPU emulator runs one block at a time: a static buffer of the kernel's size is its shared memory
// (its size kept where the emulator checks it against the launch's dynamic shared memory)
extern "C" { long long npf_fa_shared_declared = 0; }
#define NPF_FA_SHARED(name, bytes) alignas(16) static unsigned char name[bytes]; npf_fa_shared_declared = (bytes)
inline float npf_fa_inf(float) { return __builtin_huge_valf(); }
inline double npf_fa_inf(double) { return __builtin_huge_val(); }
#endif

template <typename A> __device__ __forceinline__ bool npf_fa_isinf(A x) {
    return x == npf_fa_inf(x) || x == -npf_fa_inf(x);
}
__device__ __forceinline__ int npf_fa_min(int a, int b) { return a < b ? a : b; }

// Shared-memory carving per kernel (elements of A; shared_bytes() in flash_source.py says the same).
template <typename A, int D, int BR, int BC> struct NpfFaShape {
    static constexpr int DP = D + 4;                        // row stride of a (rows, D) tile
    static constexpr int FWD = (BR + 2 * BC) * DP + BR * (BC + 4) + 2 * BR * NPF_FA_TC;
    static constexpr int DQ = (2 * BR + 2 * BC) * DP + BR * (BC + 4);
    static constexpr int DKDV = (2 * BC + 2 * BR) * DP + 2 * BC * (BR + 4) + 2 * BR;
};

// Everything but q, k, v a kernel reads (one struct built from the entry point's flat arguments).
template <typename A> struct NpfFaArgs {
    // attn_mask: kind 0 none, 1 bool, 2 float. A bool mask comes as bytes (mask_b: the SIMT kernels) or as
    // bits (mask_bits, 32 keys a word: the tensor-core kernels), the other pointer a placeholder. A row of
    // the mask is mask_ld elements (Tk bytes or floats, or ceil(Tk / 32) words), a head's mask_bh (0 for a
    // (Tq, Tk) mask, Tq mask_ld for (B, H, Tq, Tk)).
    const bool* mask_b; const unsigned* mask_bits; const A* mask_f; long long mask_bh; int mask_ld; int mask_kind;
    // key_padding_mask (B, Tk), kinds and forms as above, pad_ld elements a row; for bool padding key_end[b]
    // is one past batch b's last key that is not padding (0 if none): key tiles at and past it are skipped
    const bool* pad_b; const unsigned* pad_bits; const A* pad_f; const int* key_end; int pad_ld; int pad_kind;
    const unsigned long long* seed; int keep_min; A keep_scale;              // dropout (keep_min 0: none), 1 / (1 - p)
    long long bh_count; int H, Tq, Tk, hs, hv; A scale; int causal, shift;   // causal: key j visible to i when j <= i + shift
};

// Where one tensor's (B, H, T, D) elements are: element (b, h, t, d) at b sb + h sh + t st + d (a strided
// view: the heads of a packed (B, T, 3, H, hs) projection, or (B, T, H, hs) merged heads, need no copy).
struct NpfFaLayout { long long sb, sh, st; };

// The offset of head bh = b H + h
__device__ __forceinline__ long long npf_fa_head(const NpfFaLayout& l, long long bh, int H) {
    return (bh / H) * l.sb + (bh % H) * l.sh;
}

// _keep: splitmix64 of seed + n * golden; kept when the top 24 bits >= keep_min
__device__ __forceinline__ bool npf_fa_keep(unsigned long long seed, unsigned long long n, int keep_min) {
    unsigned long long z = n * @GOLDEN@ULL + seed;
    z ^= z >> 30;
    z *= @MIX1@ULL;
    z ^= z >> 27;
    z *= @MIX2@ULL;
    z ^= z >> 31;
    return (long long)(z >> 40) >= (long long)keep_min;
}

// _keep's scaled mask value at (bh, i, j): 1 / (1 - p) or 0
template <typename A>
__device__ __forceinline__ A npf_fa_keep_value(const NpfFaArgs<A>& a, unsigned long long seed, long long bh, int i, int j) {
    unsigned long long n = ((unsigned long long)bh * (unsigned long long)a.Tq + (unsigned long long)i)
                           * (unsigned long long)a.Tk + (unsigned long long)j;
    return npf_fa_keep(seed, n, a.keep_min) ? a.keep_scale : A(0);
}

// Where row i of head bh's attn mask starts, and head bh's padding row (in the masks' elements)
template <typename A> __device__ __forceinline__ long long npf_fa_mask_row(const NpfFaArgs<A>& a, long long bh, int i) {
    return bh * a.mask_bh + (long long)i * a.mask_ld;
}
template <typename A> __device__ __forceinline__ long long npf_fa_pad_row(const NpfFaArgs<A>& a, long long bh) {
    return (bh / a.H) * a.pad_ld;
}

// One past the last key of head bh that bool padding leaves visible (Tk without it)
template <typename A> __device__ __forceinline__ int npf_fa_key_end(const NpfFaArgs<A>& a, long long bh) {
    return a.pad_kind == 1 ? a.key_end[bh / a.H] : a.Tk;
}

// Bit j of a packed bool mask row (32 keys a word, key j at bit j % 32 of word j / 32)
__device__ __forceinline__ bool npf_fa_bit(const unsigned* row, int j) {
    return (row[j >> 5] >> (j & 31)) & 1u;
}

// _scores for one element, from dot = q_i . k_j:  s = dot * scale; s += attn bias; s += padding bias;
// s += -inf where j > i + shift (causal). A key past Tk is -inf; a query row past Tq (the ragged end of
// the last tile) is never stored and gets no mask. BITS: bool masks as bits (the tensor-core kernels)
// or as bytes (the SIMT kernels: a bit test there costs them 30-70 registers in ptxas 12.9, below their
// occupancy).
// (mask_row = npf_fa_mask_row(a, bh, i) and pad_row = npf_fa_pad_row(a, bh): where row i's attn mask and
// head bh's padding start, which a caller scoring many elements of one row computes once)
template <typename A, bool BITS = false>
__device__ __forceinline__ A npf_fa_score_at(A dot, const NpfFaArgs<A>& a, int i, int j, long long mask_row,
                                             long long pad_row) {
    const A inf = npf_fa_inf(dot);
    if (j >= a.Tk) return -inf;
    A s = dot * a.scale;
    if (i >= a.Tq) return s;
    if (a.mask_kind) {
        const bool blocked = BITS ? npf_fa_bit(a.mask_bits + mask_row, j) : a.mask_b[mask_row + j];
        s += a.mask_kind == 1 ? (blocked ? -inf : A(0)) : a.mask_f[mask_row + j];
    }
    if (a.pad_kind) {
        const bool blocked = BITS ? npf_fa_bit(a.pad_bits + pad_row, j) : a.pad_b[pad_row + j];
        s += a.pad_kind == 1 ? (blocked ? -inf : A(0)) : a.pad_f[pad_row + j];
    }
    if (a.causal && j > i + a.shift) s += -inf;
    return s;
}
template <typename A>
__device__ __forceinline__ A npf_fa_score(A dot, const NpfFaArgs<A>& a, long long bh, int i, int j) {
    return npf_fa_score_at(dot, a, i, j, npf_fa_mask_row(a, bh, i), npf_fa_pad_row(a, bh));
}

// Rows [r0, r0 + N) of one head's (rows, width) matrix x (rows `stride` apart) into s (N, D + 4), zeros
// past rows and width.
template <typename T, typename A, int N, int D>
__device__ __forceinline__ void npf_fa_load(const T* x, int r0, int rows, int width, long long stride, A* s) {
    for (int e = threadIdx.x; e < N * D; e += NPF_FA_THREADS) {
        int r = e / D, d = e % D;
        A value = A(0);
        if (r0 + r < rows && d < width) value = npf_load(x[(long long)(r0 + r) * stride + d]);
        s[r * (D + 4) + d] = value;
    }
}

// s[a][b] = X[tr + 16 a] . Y[tc + 8 b] over D (X, Y: (.., D + 4) tiles)
template <typename A, int R, int C, int D>
__device__ __forceinline__ void npf_fa_dot(const A* X, const A* Y, A (&s)[R][C]) {
    const int tr = threadIdx.x / NPF_FA_TC, tc = threadIdx.x % NPF_FA_TC;
#pragma unroll
    for (int a = 0; a < R; ++a)
#pragma unroll
        for (int b = 0; b < C; ++b) s[a][b] = A(0);
#pragma unroll 4
    for (int d = 0; d < D; ++d) {
        A x[R], y[C];
#pragma unroll
        for (int a = 0; a < R; ++a) x[a] = X[(tr + NPF_FA_TR * a) * (D + 4) + d];
#pragma unroll
        for (int b = 0; b < C; ++b) y[b] = Y[(tc + NPF_FA_TC * b) * (D + 4) + d];
#pragma unroll
        for (int a = 0; a < R; ++a)
#pragma unroll
            for (int b = 0; b < C; ++b) s[a][b] += x[a] * y[b];
    }
}

// The head column of a thread's accumulator column c: runs of 4 (one 16-byte load), the 8 column lanes'
// runs side by side: (c / 4) 32 + 4 tc + c % 4
__device__ __forceinline__ int npf_fa_col(int tc, int c) { return (c >> 2) * (4 * NPF_FA_TC) + tc * 4 + (c & 3); }

// acc[a][c] += sum_j P[tr + 16 a][j] W[j][npf_fa_col(tc, c)] over N (P: (.., PS) with row stride PS,
// W: (N, D + 4))
template <typename A, int R, int DC, int N, int PS, int D>
__device__ __forceinline__ void npf_fa_acc(const A* P, const A* W, A (&acc)[R][DC]) {
    const int tr = threadIdx.x / NPF_FA_TC, tc = threadIdx.x % NPF_FA_TC;
#pragma unroll 4
    for (int j = 0; j < N; ++j) {
        A p[R], w[DC];
#pragma unroll
        for (int a = 0; a < R; ++a) p[a] = P[(tr + NPF_FA_TR * a) * PS + j];
#pragma unroll
        for (int c = 0; c < DC; ++c) w[c] = W[j * (D + 4) + npf_fa_col(tc, c)];
#pragma unroll
        for (int a = 0; a < R; ++a)
#pragma unroll
            for (int c = 0; c < DC; ++c) acc[a][c] += p[a] * w[c];
    }
}

// The number of key tiles query rows [i0, i1) see: all, or up to the last one holding a key
// j <= i1 - 1 + shift (_visible); 0 when even that is negative.
template <int BC>
__device__ __forceinline__ int npf_fa_key_tiles(int i1, int Tk, int causal, int shift) {
    int n = (Tk + BC - 1) / BC;
    if (!causal) return n;
    int last = i1 - 1 + shift;
    return last < 0 ? 0 : npf_fa_min(n, last / BC + 1);
}

// npf_fa_key_tiles for head bh: none at or past its padding's key end (those tiles are all -inf)
template <int BC, typename A>
__device__ __forceinline__ int npf_fa_head_key_tiles(const NpfFaArgs<A>& a, long long bh, int n_kt) {
    return npf_fa_min(n_kt, (npf_fa_key_end(a, bh) + BC - 1) / BC);
}

// Forward: block (x: query tile, last first so the longest causal rows start first; y: b H + h).
//   per key tile:  S = score(q_i k_j^T);  m_new = max(m, rowmax S);  shift = m_new, or 0 if infinite
//                  P = exp(S - shift);  alpha = exp(m - shift);  l = alpha l + rowsum P
//                  acc = alpha acc + dropout(P) v_j;  m = m_new
//   then  out = acc / l (l = 0 -> 1: zeros),  lse = m + log l (l = 0 -> +inf)
template <typename T, typename A, int D, int BR, int BC>
__device__ void npf_fa_forward(const T* q, const T* k, const T* v, T* out, A* lse, const NpfFaArgs<A>& a,
                               NpfFaLayout ql, NpfFaLayout kl, NpfFaLayout vl, NpfFaLayout ol) {
    typedef NpfFaShape<A, D, BR, BC> S;
    constexpr int R = BR / NPF_FA_TR, C = BC / NPF_FA_TC, DC = D / NPF_FA_TC, CP = BC + 4;
    NPF_FA_SHARED(smem, S::FWD * sizeof(A));
    A* Qs = reinterpret_cast<A*>(smem);      // (BR, DP)
    A* Ks = Qs + BR * S::DP;                 // (BC, DP)
    A* Vs = Ks + BC * S::DP;                 // (BC, DP)
    A* Ps = Vs + BC * S::DP;                 // (BR, CP) dropout(P)
    A* red_m = Ps + BR * CP;                 // (BR, 8) the row lanes' partial max
    A* red_l = red_m + BR * NPF_FA_TC;       // (BR, 8) and partial sums
    const int tr = threadIdx.x / NPF_FA_TC, tc = threadIdx.x % NPF_FA_TC;
    const int i0 = ((int)gridDim.x - 1 - (int)blockIdx.x) * BR;
    const int n_kt_all = npf_fa_key_tiles<BC>(npf_fa_min(i0 + BR, a.Tq), a.Tk, a.causal, a.shift);
    const unsigned long long seed = a.keep_min ? *a.seed : 0ULL;
    const A inf = npf_fa_inf(A(0));
    for (long long bh = blockIdx.y; bh < a.bh_count; bh += gridDim.y) {
        const int n_kt = npf_fa_head_key_tiles<BC>(a, bh, n_kt_all);
        __syncthreads();                                     // the previous head's readers are done
        npf_fa_load<T, A, BR, D>(q + npf_fa_head(ql, bh, a.H), i0, a.Tq, a.hs, ql.st, Qs);
        A m[R], l[R], acc[R][DC];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            m[r] = -inf;
            l[r] = A(0);
#pragma unroll
            for (int c = 0; c < DC; ++c) acc[r][c] = A(0);
        }
        for (int kt = 0; kt < n_kt; ++kt) {
            const int j0 = kt * BC;
            __syncthreads();                                 // done with the last tile's K, V, P
            npf_fa_load<T, A, BC, D>(k + npf_fa_head(kl, bh, a.H), j0, a.Tk, a.hs, kl.st, Ks);
            npf_fa_load<T, A, BC, D>(v + npf_fa_head(vl, bh, a.H), j0, a.Tk, a.hv, vl.st, Vs);
            __syncthreads();
            A s[R][C];
            npf_fa_dot<A, R, C, D>(Qs, Ks, s);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const int row = tr + NPF_FA_TR * r;
                A mx = -inf;
#pragma unroll
                for (int c = 0; c < C; ++c) {
                    s[r][c] = npf_fa_score(s[r][c], a, bh, i0 + row, j0 + tc + NPF_FA_TC * c);
                    mx = npf_max(mx, s[r][c]);
                }
                red_m[row * NPF_FA_TC + tc] = mx;
            }
            __syncthreads();
            A alpha[R];
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const int row = tr + NPF_FA_TR * r;
                A m_new = m[r];
#pragma unroll
                for (int t = 0; t < NPF_FA_TC; ++t) m_new = npf_max(m_new, red_m[row * NPF_FA_TC + t]);
                const A shift = npf_fa_isinf(m_new) ? A(0) : m_new;   // all -inf so far: no inf - inf
                alpha[r] = npf_exp(m[r] - shift);
                A sum = A(0);
#pragma unroll
                for (int c = 0; c < C; ++c) {
                    A p = npf_exp(s[r][c] - shift);
                    sum += p;
                    if (a.keep_min) p *= npf_fa_keep_value(a, seed, bh, i0 + row, j0 + tc + NPF_FA_TC * c);
                    Ps[row * CP + tc + NPF_FA_TC * c] = p;
                }
                red_l[row * NPF_FA_TC + tc] = sum;
                m[r] = m_new;
            }
            __syncthreads();
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const int row = tr + NPF_FA_TR * r;
                A sum = A(0);
#pragma unroll
                for (int t = 0; t < NPF_FA_TC; ++t) sum += red_l[row * NPF_FA_TC + t];
                l[r] = l[r] * alpha[r] + sum;
#pragma unroll
                for (int c = 0; c < DC; ++c) acc[r][c] *= alpha[r];
            }
            npf_fa_acc<A, R, DC, BC, CP, D>(Ps, Vs, acc);
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int i = i0 + tr + NPF_FA_TR * r;
            if (i >= a.Tq) continue;
            const bool empty = l[r] == A(0);                 // a fully masked row: zeros, lse +inf
            const A den = empty ? A(1) : l[r];
            const long long at = bh * a.Tq + i;
            T* out_row = out + npf_fa_head(ol, bh, a.H) + i * ol.st;
#pragma unroll
            for (int c = 0; c < DC; ++c) {
                const int d = npf_fa_col(tc, c);
                if (d < a.hv) npf_store(out_row + d, acc[r][c] / den);
            }
            if (tc == 0) lse[at] = empty ? inf : m[r] + npf_log(l[r]);
        }
    }
}

// D_i = rowsum(dO_i * O_i) for each of `rows` = B H Tq rows of hv values (row = bh Tq + i): a warp per row
// (blockDim.x a multiple of 32), lane l adding the values l, l + 32, ... (a warp's loads are consecutive:
// coalesced), then the 32 partial sums by a butterfly of shuffles
template <typename T, typename A>
__device__ void npf_fa_bwd_pre(const T* dout, const T* out, A* dvec, long long rows, int hv, int Tq, int H,
                               NpfFaLayout gl, NpfFaLayout ol) {
    const long long warps = (long long)gridDim.x * blockDim.x / 32;
    const int lane = threadIdx.x % 32;
    for (long long row = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32; row < rows; row += warps) {
        const long long bh = row / Tq, i = row % Tq;
        const T* g = dout + npf_fa_head(gl, bh, H) + i * gl.st;
        const T* o = out + npf_fa_head(ol, bh, H) + i * ol.st;
        A s = A(0);
        for (int d = lane; d < hv; d += 32) s += npf_load(g[d]) * npf_load(o[d]);
#pragma unroll
        for (int offset = 16; offset > 0; offset /= 2) s += __shfl_xor_sync(0xffffffffu, s, offset);
        if (lane == 0) dvec[row] = s;
    }
}

// The recomputed probability and score gradient of one element (the backward's inner step):
//   P = exp(S - lse_i);  g = dP (= dO_i . v_j) * keep;  dS = ((g - D_i) P) scale;  P_drop = P keep
template <typename A>
__device__ __forceinline__ void npf_fa_grad(A dot, A dp, A lse_i, A d_i, const NpfFaArgs<A>& a,
                                            unsigned long long seed, long long bh, int i, int j, A& p_drop, A& ds) {
    const A p = npf_exp(npf_fa_score(dot, a, bh, i, j) - lse_i);
    A g = dp;
    p_drop = p;
    if (a.keep_min) {
        const A keep = npf_fa_keep_value(a, seed, bh, i, j);
        p_drop = p * keep;
        g *= keep;
    }
    g -= d_i;
    g *= p;
    ds = g * a.scale;
}

// dK, dV: block (x: key tile, y: b H + h), looping over the query tiles that see the key tile.
// Thread rows are keys, columns queries:  dv_j += P_drop^T dO_i,  dk_j += dS^T q_i
template <typename T, typename A, int D, int BR, int BC>
__device__ void npf_fa_bwd_dkdv(const T* q, const T* k, const T* v, const T* dout, const A* lse, const A* dvec,
                                T* dk, T* dv, const NpfFaArgs<A>& a, NpfFaLayout ql, NpfFaLayout kl,
                                NpfFaLayout vl, NpfFaLayout gl, NpfFaLayout dkl, NpfFaLayout dvl) {
    typedef NpfFaShape<A, D, BR, BC> S;
    constexpr int R = BC / NPF_FA_TR, C = BR / NPF_FA_TC, DC = D / NPF_FA_TC, RP = BR + 4;
    NPF_FA_SHARED(smem, S::DKDV * sizeof(A));
    A* Ks = reinterpret_cast<A*>(smem);      // (BC, DP)
    A* Vs = Ks + BC * S::DP;                 // (BC, DP)
    A* Qs = Vs + BC * S::DP;                 // (BR, DP)
    A* dOs = Qs + BR * S::DP;                // (BR, DP)
    A* Pt = dOs + BR * S::DP;                // (BC, RP) P_drop^T
    A* St = Pt + BC * RP;                    // (BC, RP) dS^T
    A* lse_s = St + BC * RP;                 // (BR)
    A* d_s = lse_s + BR;                     // (BR)
    const int tr = threadIdx.x / NPF_FA_TC, tc = threadIdx.x % NPF_FA_TC;
    const int j0 = blockIdx.x * BC;
    const int n_qt = (a.Tq + BR - 1) / BR;
    const unsigned long long seed = a.keep_min ? *a.seed : 0ULL;
    const A inf = npf_fa_inf(A(0));
    for (long long bh = blockIdx.y; bh < a.bh_count; bh += gridDim.y) {
        const int n_qt_head = j0 < npf_fa_key_end(a, bh) ? n_qt : 0;   // keys all padding: zeros
        __syncthreads();
        npf_fa_load<T, A, BC, D>(k + npf_fa_head(kl, bh, a.H), j0, a.Tk, a.hs, kl.st, Ks);
        npf_fa_load<T, A, BC, D>(v + npf_fa_head(vl, bh, a.H), j0, a.Tk, a.hv, vl.st, Vs);
        A dka[R][DC], dva[R][DC];
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int c = 0; c < DC; ++c) dka[r][c] = dva[r][c] = A(0);
        for (int qt = 0; qt < n_qt_head; ++qt) {
            const int i0 = qt * BR;
            if (a.causal && j0 > npf_fa_min(i0 + BR, a.Tq) - 1 + a.shift) continue;   // wholly in the future
            __syncthreads();                                 // done with the last query tile
            npf_fa_load<T, A, BR, D>(q + npf_fa_head(ql, bh, a.H), i0, a.Tq, a.hs, ql.st, Qs);
            npf_fa_load<T, A, BR, D>(dout + npf_fa_head(gl, bh, a.H), i0, a.Tq, a.hv, gl.st, dOs);
            for (int e = threadIdx.x; e < BR; e += NPF_FA_THREADS) {
                const bool in = i0 + e < a.Tq;               // rows past Tq: P = exp(S - inf) = 0
                lse_s[e] = in ? lse[bh * a.Tq + i0 + e] : inf;
                d_s[e] = in ? dvec[bh * a.Tq + i0 + e] : A(0);
            }
            __syncthreads();
            A st[R][C], dpt[R][C];
            npf_fa_dot<A, R, C, D>(Ks, Qs, st);              // S^T: keys x queries
            npf_fa_dot<A, R, C, D>(Vs, dOs, dpt);            // dP^T = (dO v^T)^T
            A lse_c[C], d_c[C];                              // this thread's queries' lse and D
#pragma unroll
            for (int c = 0; c < C; ++c) {
                lse_c[c] = lse_s[tc + NPF_FA_TC * c];
                d_c[c] = d_s[tc + NPF_FA_TC * c];
            }
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const int row = tr + NPF_FA_TR * r;
#pragma unroll
                for (int c = 0; c < C; ++c) {
                    const int col = tc + NPF_FA_TC * c;
                    A p_drop, ds;
                    npf_fa_grad(st[r][c], dpt[r][c], lse_c[c], d_c[c], a, seed, bh, i0 + col, j0 + row, p_drop, ds);
                    Pt[row * RP + col] = p_drop;
                    St[row * RP + col] = ds;
                }
            }
            __syncthreads();
            npf_fa_acc<A, R, DC, BR, RP, D>(Pt, dOs, dva);   // dv_j += P_drop^T dO_i
            npf_fa_acc<A, R, DC, BR, RP, D>(St, Qs, dka);    // dk_j += dS^T q_i
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int j = j0 + tr + NPF_FA_TR * r;
            if (j >= a.Tk) continue;
            T* dk_row = dk + npf_fa_head(dkl, bh, a.H) + j * dkl.st;
            T* dv_row = dv + npf_fa_head(dvl, bh, a.H) + j * dvl.st;
#pragma unroll
            for (int c = 0; c < DC; ++c) {
                const int d = npf_fa_col(tc, c);
                if (d < a.hs) npf_store(dk_row + d, dka[r][c]);
                if (d < a.hv) npf_store(dv_row + d, dva[r][c]);
            }
        }
    }
}

// dQ: block (x: query tile, last first; y: b H + h) over its visible key tiles:  dq_i += dS k_j
template <typename T, typename A, int D, int BR, int BC>
__device__ void npf_fa_bwd_dq(const T* q, const T* k, const T* v, const T* dout, const A* lse, const A* dvec,
                              T* dq, const NpfFaArgs<A>& a, NpfFaLayout ql, NpfFaLayout kl, NpfFaLayout vl,
                              NpfFaLayout gl, NpfFaLayout dql) {
    typedef NpfFaShape<A, D, BR, BC> S;
    constexpr int R = BR / NPF_FA_TR, C = BC / NPF_FA_TC, DC = D / NPF_FA_TC, CP = BC + 4;
    NPF_FA_SHARED(smem, S::DQ * sizeof(A));
    A* Qs = reinterpret_cast<A*>(smem);      // (BR, DP)
    A* dOs = Qs + BR * S::DP;                // (BR, DP)
    A* Ks = dOs + BR * S::DP;                // (BC, DP)
    A* Vs = Ks + BC * S::DP;                 // (BC, DP)
    A* Ss = Vs + BC * S::DP;                 // (BR, CP) dS
    const int tr = threadIdx.x / NPF_FA_TC, tc = threadIdx.x % NPF_FA_TC;
    const int i0 = ((int)gridDim.x - 1 - (int)blockIdx.x) * BR;
    const int n_kt_all = npf_fa_key_tiles<BC>(npf_fa_min(i0 + BR, a.Tq), a.Tk, a.causal, a.shift);
    const unsigned long long seed = a.keep_min ? *a.seed : 0ULL;
    const A inf = npf_fa_inf(A(0));
    for (long long bh = blockIdx.y; bh < a.bh_count; bh += gridDim.y) {
        const int n_kt = npf_fa_head_key_tiles<BC>(a, bh, n_kt_all);
        __syncthreads();
        npf_fa_load<T, A, BR, D>(q + npf_fa_head(ql, bh, a.H), i0, a.Tq, a.hs, ql.st, Qs);
        npf_fa_load<T, A, BR, D>(dout + npf_fa_head(gl, bh, a.H), i0, a.Tq, a.hv, gl.st, dOs);
        A lse_r[R], d_r[R], dqa[R][DC];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int i = i0 + tr + NPF_FA_TR * r;
            lse_r[r] = i < a.Tq ? lse[bh * a.Tq + i] : inf;
            d_r[r] = i < a.Tq ? dvec[bh * a.Tq + i] : A(0);
#pragma unroll
            for (int c = 0; c < DC; ++c) dqa[r][c] = A(0);
        }
        for (int kt = 0; kt < n_kt; ++kt) {
            const int j0 = kt * BC;
            __syncthreads();
            npf_fa_load<T, A, BC, D>(k + npf_fa_head(kl, bh, a.H), j0, a.Tk, a.hs, kl.st, Ks);
            npf_fa_load<T, A, BC, D>(v + npf_fa_head(vl, bh, a.H), j0, a.Tk, a.hv, vl.st, Vs);
            __syncthreads();
            A s[R][C], dp[R][C];
            npf_fa_dot<A, R, C, D>(Qs, Ks, s);
            npf_fa_dot<A, R, C, D>(dOs, Vs, dp);             // dP = dO v^T
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const int row = tr + NPF_FA_TR * r;
#pragma unroll
                for (int c = 0; c < C; ++c) {
                    const int col = tc + NPF_FA_TC * c;
                    A p_drop, ds;
                    npf_fa_grad(s[r][c], dp[r][c], lse_r[r], d_r[r], a, seed, bh, i0 + row, j0 + col, p_drop, ds);
                    Ss[row * CP + col] = ds;
                }
            }
            __syncthreads();
            npf_fa_acc<A, R, DC, BC, CP, D>(Ss, Ks, dqa);    // dq_i += dS k_j
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int i = i0 + tr + NPF_FA_TR * r;
            if (i >= a.Tq) continue;
#pragma unroll
            for (int c = 0; c < DC; ++c) {
                const int d = npf_fa_col(tc, c);
                if (d < a.hs) npf_store(dq + npf_fa_head(dql, bh, a.H) + i * dql.st + d, dqa[r][c]);
            }
        }
    }
}

// ---- tensor cores (warp_source.py's primitives): FlashAttention-2's work split ----
// A block of 4 warps takes BR = 64 query rows, a warp its own 16; per key tile of BC keys (K and V in
// shared memory) the warp computes S = Q K^T with mma.sync, scores and the online softmax in registers
// (a row lives in the 4 lanes of a quad: its max and sum are two shuffles), P rounded to the operand type
// as the A fragments of O += P V. The same arithmetic as npf_fa_forward, with the products on tensor
// cores (float32 accumulators); masks, causal tiles, dropout and the outputs are its. The operands come
// through an Ops policy: NpfHalfOps (float16 tiles, m16n8k16, ldmatrix) or NpfTf32Ops (float32 tiles,
// TF32 m16n8k8: each operand rounded by cvt.rna as it is read, the float32 opt-in).
#define NPF_FA_TC_BR 64

// Rows [r0, r0 + N) of one head's (rows, width) matrix x of T into s (N, D + E), E = 16 / sizeof(T) (rows
// 16 bytes longer: 16-byte aligned, no bank conflicts), zeros past rows and width: 16 bytes (E values) a
// load when every row starts 16-byte aligned and width is a multiple of E (the heads of a packed
// projection with hs % E == 0), else a value a load
struct __align__(16) NpfU4 { unsigned x, y, z, w; };
template <typename T, int N, int D>
__device__ __noinline__ void npf_fa_load_tile(const T* x, int r0, int rows, int width, long long stride, T* s) {
    constexpr int E = 16 / sizeof(T), LD = D + E;       // (not inlined: fewer registers in the loops)
    if (width % E == 0 && stride % E == 0 && ((unsigned long long)(size_t)x & 15) == 0) {
        constexpr int C = D / E;
        for (int e = threadIdx.x; e < N * C; e += NPF_FA_THREADS) {
            int r = e / C, c = e % C;
            NpfU4 value = {0u, 0u, 0u, 0u};
            if (r0 + r < rows && c * E < width)
                value = *reinterpret_cast<const NpfU4*>(x + (long long)(r0 + r) * stride + c * E);
            *reinterpret_cast<NpfU4*>(s + r * LD + c * E) = value;
        }
        return;
    }
    for (int e = threadIdx.x; e < N * D; e += NPF_FA_THREADS) {
        int r = e / D, d = e % D;
        T value = T(0);
        if (r0 + r < rows && d < width) value = x[(long long)(r0 + r) * stride + d];
        s[r * LD + d] = value;
    }
}

// npf_fa_load_tile through cp.async (16 bytes a copy, zeros past rows and width) where rows are 16-byte
// aligned and width a multiple of E: the copies land while the block computes (npf_cp_async_wait before
// the tile is read); elsewhere the synchronous loads
template <typename T, int N, int D>
__device__ __noinline__ void npf_fa_load_tile_async(const T* x, int r0, int rows, int width, long long stride, T* s) {
    constexpr int E = 16 / sizeof(T), LD = D + E, C = D / E;
    if (!(width % E == 0 && stride % E == 0 && ((unsigned long long)(size_t)x & 15) == 0)) {
        npf_fa_load_tile<T, N, D>(x, r0, rows, width, stride, s);
        return;
    }
    for (int e = threadIdx.x; e < N * C; e += NPF_FA_THREADS) {
        int r = e / C, c = e % C;
        const bool in = r0 + r < rows && c * E < width;
        npf_cp_async_16_zfill(s + r * LD + c * E, in ? x + (long long)(r0 + r) * stride + c * E : x, in ? 16 : 0);
    }
}

// Key tile [j0, j0 + BC) of K and of V into one buffer, (BC, LD) K then (BC, LD) V, through cp.async
template <typename T, int BC, int D>
__device__ __forceinline__ void npf_fa_load_kv_async(const T* k_head, const T* v_head, int j0,
                                                     const NpfFaArgs<float>& a, long long k_st, long long v_st, T* kv) {
    npf_fa_load_tile_async<T, BC, D>(k_head, j0, a.Tk, a.hs, k_st, kv);
    npf_fa_load_tile_async<T, BC, D>(v_head, j0, a.Tk, a.hv, v_st, kv + BC * (D + 16 / (int)sizeof(T)));
}

__device__ __forceinline__ unsigned npf_pack_half2(float lo, float hi) {
    unsigned short l, h;
    npf_store(&l, lo);
    npf_store(&h, hi);
    return (unsigned)l | ((unsigned)h << 16);
}

// The operands of a warp's tile products, by type. Tiles are (rows, LD) in shared memory, LD = D + PAD.
//   a_rows: the A fragment of rows r0 .. r0 + 15 and columns k0 .. k0 + K - 1 of X (for X Y^T)
//   b_rows: the B fragments of two 8-column blocks of Y^T: rows n0 .. n0 + 15 of Y (b[0..1] the first
//           block, b[2..3] the second), columns k0 .. k0 + K - 1 (for X Y^T)
//   b_cols: the B fragments of rows k0 .. k0 + K - 1 of Y and two 8-column blocks from n0 (for C Y)
//   a_from_c: the A fragment of keys k0 .. k0 + K - 1 from the C fragments c[0], ... of those keys (the
//           scores' registers, rounded: P and dS as operands of the second product)
//   mma: D = A B + C over K
struct NpfHalfOps {
    typedef unsigned short T;
    static constexpr int K = 16, PAD = 16 / sizeof(T);  // npf_fa_load_tile's rows: D + 16 bytes
    static __device__ __forceinline__ void a_rows(unsigned* a, const T* X, int LD, int r0, int k0, int lane) {
        npf_ldmatrix_x4(a, X + (r0 + (lane / 8) % 2 * 8 + lane % 8) * LD + k0 + lane / 16 * 8);
    }
    static __device__ __forceinline__ void b_rows(unsigned* b, const T* Y, int LD, int n0, int k0, int lane) {
        npf_ldmatrix_x4(b, Y + (n0 + lane / 16 * 8 + lane % 8) * LD + k0 + (lane / 8) % 2 * 8);
    }
    static __device__ __forceinline__ void b_cols(unsigned* b, const T* Y, int LD, int k0, int n0, int lane) {
        npf_ldmatrix_x4_trans(b, Y + (k0 + (lane / 8) % 2 * 8 + lane % 8) * LD + n0 + lane / 16 * 8);
    }
    // the C fragments of key blocks 2 ks and 2 ks + 1 are the A fragment's registers (rows g and g + 8,
    // columns 2 t and 2 t + 1 of each), as float16 pairs
    static __device__ __forceinline__ void a_from_c(unsigned* a, const float (*c)[4]) {
        a[0] = npf_pack_half2(c[0][0], c[0][1]);
        a[1] = npf_pack_half2(c[0][2], c[0][3]);
        a[2] = npf_pack_half2(c[1][0], c[1][1]);
        a[3] = npf_pack_half2(c[1][2], c[1][3]);
    }
    static __device__ __forceinline__ void mma(float* d, const unsigned* a, const unsigned* b, const float* c) {
        npf_mma_16816(d, a, b, c);
    }
};

// TF32 (m16n8k8): A (row g, columns t and t + 4; rows g + 8), B (rows t and t + 4 of column g). The
// lane holds scores of keys 2 t and 2 t + 1 of a block, so the second product takes the keys of a block in
// the order 0, 2, 4, 6, 1, 3, 5, 7 (A's column t is key 2 t, column t + 4 key 2 t + 1) and b_cols reads
// V's (or K's, dO's, Q's) rows in the same order: a sum over keys, in another order, and no shuffles.
// Rows D + 4 floats apart: the 32 lanes' reads fall in 32 distinct banks in each function.
struct NpfTf32Ops {
    typedef float T;
    static constexpr int K = 8, PAD = 16 / sizeof(T);   // npf_fa_load_tile's rows: D + 16 bytes
    static __device__ __forceinline__ void a_rows(unsigned* a, const T* X, int LD, int r0, int k0, int lane) {
        const T* x = X + (r0 + lane / 4) * LD + k0 + lane % 4;
        a[0] = npf_tf32(x[0]);
        a[1] = npf_tf32(x[8 * LD]);
        a[2] = npf_tf32(x[4]);
        a[3] = npf_tf32(x[8 * LD + 4]);
    }
    static __device__ __forceinline__ void b_rows(unsigned* b, const T* Y, int LD, int n0, int k0, int lane) {
        const T* y = Y + (n0 + lane / 4) * LD + k0 + lane % 4;
        b[0] = npf_tf32(y[0]);
        b[1] = npf_tf32(y[4]);
        b[2] = npf_tf32(y[8 * LD]);
        b[3] = npf_tf32(y[8 * LD + 4]);
    }
    static __device__ __forceinline__ void b_cols(unsigned* b, const T* Y, int LD, int k0, int n0, int lane) {
        const T* y = Y + (k0 + 2 * (lane % 4)) * LD + n0 + lane / 4;
        b[0] = npf_tf32(y[0]);
        b[1] = npf_tf32(y[LD]);
        b[2] = npf_tf32(y[8]);
        b[3] = npf_tf32(y[LD + 8]);
    }
    static __device__ __forceinline__ void a_from_c(unsigned* a, const float (*c)[4]) {
        a[0] = npf_tf32(c[0][0]);
        a[1] = npf_tf32(c[0][2]);
        a[2] = npf_tf32(c[0][1]);
        a[3] = npf_tf32(c[0][3]);
    }
    static __device__ __forceinline__ void mma(float* d, const unsigned* a, const unsigned* b, const float* c) {
        npf_mma_1688_tf32(d, a, b, c);
    }
};

template <typename Ops, int D, int BC>
__device__ void npf_fa_forward_tc(const typename Ops::T* q, const typename Ops::T* k, const typename Ops::T* v,
                                  typename Ops::T* out, float* lse, const NpfFaArgs<float>& a, NpfFaLayout ql,
                                  NpfFaLayout kl, NpfFaLayout vl, NpfFaLayout ol) {
    typedef typename Ops::T T;
    constexpr int BR = NPF_FA_TC_BR, LD = D + Ops::PAD, NB = BC / 8, DN = D / 8, KD = D / Ops::K, KB = BC / Ops::K;
    NPF_FA_SHARED(smem, (BR + 4 * BC) * LD * sizeof(T));
    T* Qs = reinterpret_cast<T*>(smem);                  // (BR, LD)
    T* KVs = Qs + BR * LD;                               // 2 x ((BC, LD) K, (BC, LD) V): double buffer
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int i0 = ((int)gridDim.x - 1 - (int)blockIdx.x) * BR;
    const int n_kt_all = npf_fa_key_tiles<BC>(npf_fa_min(i0 + BR, a.Tq), a.Tk, a.causal, a.shift);
    const unsigned long long seed = a.keep_min ? *a.seed : 0ULL;
    const float inf = npf_fa_inf(0.0f);
    for (long long bh = blockIdx.y; bh < a.bh_count; bh += gridDim.y) {
        const int n_kt = npf_fa_head_key_tiles<BC>(a, bh, n_kt_all);
        __syncthreads();                                     // the previous head's readers are done
        npf_fa_load_tile<T, BR, D>(q + npf_fa_head(ql, bh, a.H), i0, a.Tq, a.hs, ql.st, Qs);
        const long long pad_row = npf_fa_pad_row(a, bh);
        int row[2];                                          // this lane's two query rows
        long long mask_row[2];
        unsigned long long keep_row[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            row[r] = i0 + warp * 16 + g + 8 * r;
            mask_row[r] = npf_fa_mask_row(a, bh, row[r]);
            keep_row[r] = ((unsigned long long)bh * (unsigned long long)a.Tq + (unsigned long long)row[r])
                          * (unsigned long long)a.Tk;
        }
        float o[DN][4], m[2] = {-inf, -inf}, l[2] = {0.0f, 0.0f};
#pragma unroll
        for (int dn = 0; dn < DN; ++dn)
#pragma unroll
            for (int c = 0; c < 4; ++c) o[dn][c] = 0.0f;
        const T* k_head = k + npf_fa_head(kl, bh, a.H);
        const T* v_head = v + npf_fa_head(vl, bh, a.H);
        if (n_kt > 0)                                        // tile 0's copies: in flight from here
            npf_fa_load_kv_async<T, BC, D>(k_head, v_head, 0, a, kl.st, vl.st, KVs);
        npf_cp_async_commit();
        for (int kt = 0; kt < n_kt; ++kt) {
            const int j0 = kt * BC;
            T* Ks = KVs + (kt % 2) * 2 * BC * LD;
            T* Vs = Ks + BC * LD;
            if (kt + 1 < n_kt)                               // the next tile into the other buffer, meanwhile
                npf_fa_load_kv_async<T, BC, D>(k_head, v_head, j0 + BC, a, kl.st, vl.st,
                                               KVs + (kt + 1) % 2 * 2 * BC * LD);
            npf_cp_async_commit();
            npf_cp_async_wait<1>();                          // this tile's copies have landed
            __syncthreads();                                 // (everyone's), and Q's
            float s[NB][4];                                  // S: rows g, g + 8; columns 8 nb + 2 t, + 1
#pragma unroll
            for (int nb = 0; nb < NB; ++nb)
#pragma unroll
                for (int c = 0; c < 4; ++c) s[nb][c] = 0.0f;
#pragma unroll
            for (int kd = 0; kd < KD; ++kd) {
                unsigned aq[4];                              // this warp's 16 rows of Q, as an A fragment
                Ops::a_rows(aq, Qs, LD, warp * 16, kd * Ops::K, lane);
#pragma unroll
                for (int nb2 = 0; nb2 < NB / 2; ++nb2) {
                    unsigned bk[4];                          // K rows as B fragments of two key blocks
                    Ops::b_rows(bk, Ks, LD, nb2 * 16, kd * Ops::K, lane);
                    Ops::mma(s[2 * nb2], aq, bk, s[2 * nb2]);
                    Ops::mma(s[2 * nb2 + 1], aq, bk + 2, s[2 * nb2 + 1]);
                }
            }
            float mx[2] = {-inf, -inf};
#pragma unroll
            for (int r = 0; r < 2; ++r)
#pragma unroll
                for (int nb = 0; nb < NB; ++nb)
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        float& x = s[nb][2 * r + c];
                        x = npf_fa_score_at<float, true>(x, a, row[r], j0 + nb * 8 + 2 * t + c, mask_row[r], pad_row);
                        mx[r] = npf_max(mx[r], x);
                    }
            float shift[2], alpha[2], sum[2] = {0.0f, 0.0f};
#pragma unroll
            for (int r = 0; r < 2; ++r) {                    // the row's max over its quad, then m_new
                mx[r] = npf_max(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
                mx[r] = npf_max(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
                const float m_new = npf_max(m[r], mx[r]);
                shift[r] = npf_fa_isinf(m_new) ? 0.0f : m_new;    // all -inf so far: no inf - inf
                alpha[r] = npf_exp(m[r] - shift[r]);
                m[r] = m_new;
            }
#pragma unroll
            for (int nb = 0; nb < NB; ++nb)                  // s becomes dropout(P)
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    float p = npf_exp(s[nb][c] - shift[c / 2]);
                    sum[c / 2] += p;
                    if (a.keep_min)                          // _keep at n = (bh Tq + i) Tk + j
                        p = npf_fa_keep(seed, keep_row[c / 2] + (unsigned long long)(j0 + nb * 8 + 2 * t + c % 2),
                                        a.keep_min) ? p * a.keep_scale : 0.0f;
                    s[nb][c] = p;
                }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 1);
                sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 2);
                l[r] = l[r] * alpha[r] + sum[r];
            }
#pragma unroll
            for (int dn = 0; dn < DN; ++dn)
#pragma unroll
                for (int c = 0; c < 4; ++c) o[dn][c] *= alpha[c / 2];
#pragma unroll
            for (int kb = 0; kb < KB; ++kb) {
                unsigned ap[4];                              // keys K kb .. of dropout(P) as an A fragment
                Ops::a_from_c(ap, s + kb * Ops::K / 8);
#pragma unroll
                for (int dn2 = 0; dn2 < DN / 2; ++dn2) {
                    unsigned bv[4];                          // V rows as B fragments of two column blocks
                    Ops::b_cols(bv, Vs, LD, kb * Ops::K, dn2 * 16, lane);
                    Ops::mma(o[2 * dn2], ap, bv, o[2 * dn2]);
                    Ops::mma(o[2 * dn2 + 1], ap, bv + 2, o[2 * dn2 + 1]);
                }
            }
            __syncthreads();                                 // done with this buffer before it is refilled
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int i = row[r];
            if (i >= a.Tq) continue;
            const bool empty = l[r] == 0.0f;                 // a fully masked row: zeros, lse +inf
            const float den = empty ? 1.0f : l[r];
            T* out_row = out + npf_fa_head(ol, bh, a.H) + i * ol.st;
#pragma unroll
            for (int dn = 0; dn < DN; ++dn)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int d = dn * 8 + 2 * t + c;
                    if (d < a.hv) npf_store(out_row + d, o[dn][2 * r + c] / den);
                }
            if (t == 0) lse[bh * a.Tq + i] = empty ? inf : m[r] + npf_log(l[r]);
        }
    }
}

// The backward's inner step on one C-fragment element (npf_fa_grad's arithmetic, with the row bases
// hoisted): the score of query i and key j from its dot product, P = exp(S - lse_i), g = dP keep,
// dS = ((g - D_i) P) scale, P_drop = P keep.
__device__ __forceinline__ void npf_fa_grad_tc(float dot, float dp, float lse_i, float d_i, const NpfFaArgs<float>& a,
                                               unsigned long long seed, long long bh, int i, int j, long long mask_row,
                                               long long pad_row, float& p_drop, float& ds) {
    const float p = npf_exp(npf_fa_score_at<float, true>(dot, a, i, j, mask_row, pad_row) - lse_i);
    float g = dp;
    p_drop = p;
    if (a.keep_min) {
        const unsigned long long n = ((unsigned long long)bh * (unsigned long long)a.Tq + (unsigned long long)i)
                                     * (unsigned long long)a.Tk + (unsigned long long)j;
        const float keep = npf_fa_keep(seed, n, a.keep_min) ? a.keep_scale : 0.0f;
        p_drop = p * keep;
        g *= keep;
    }
    g -= d_i;
    g *= p;
    ds = g * a.scale;
}

// dQ on tensor cores: a block of 4 warps takes 64 query rows (a warp its 16) over the visible key tiles:
//   S = Q K^T, dP = dO V^T (A fragments of Q and dO by ldmatrix, B of K and V by ldmatrix),
//   dS per element (npf_fa_grad_tc), dQ += dS K (dS as float16 A fragments, K by ldmatrix.trans).
// K and V through cp.async into NBUF buffers: with 2, the next tile's copies land while this one is
// computed (the forward's pipeline); with 1 (where 2 would cost occupancy) they are issued after it.
template <typename Ops, int D, int BC, int NBUF>
__device__ void npf_fa_bwd_dq_tc(const typename Ops::T* q, const typename Ops::T* k, const typename Ops::T* v,
                                 const typename Ops::T* dout, const float* lse, const float* dvec, typename Ops::T* dq,
                                 const NpfFaArgs<float>& a, NpfFaLayout ql, NpfFaLayout kl, NpfFaLayout vl,
                                 NpfFaLayout gl, NpfFaLayout dql) {
    typedef typename Ops::T T;
    constexpr int BR = NPF_FA_TC_BR, LD = D + Ops::PAD, NB = BC / 8, DN = D / 8, KD = D / Ops::K, KB = BC / Ops::K;
    NPF_FA_SHARED(smem, (2 * BR + 2 * NBUF * BC) * LD * sizeof(T));
    T* Qs = reinterpret_cast<T*>(smem);                  // (BR, LD)
    T* dOs = Qs + BR * LD;                               // (BR, LD)
    T* KVs = dOs + BR * LD;                              // NBUF x ((BC, LD) K, (BC, LD) V)
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int i0 = ((int)gridDim.x - 1 - (int)blockIdx.x) * BR;
    const int n_kt_all = npf_fa_key_tiles<BC>(npf_fa_min(i0 + BR, a.Tq), a.Tk, a.causal, a.shift);
    const unsigned long long seed = a.keep_min ? *a.seed : 0ULL;
    const float inf = npf_fa_inf(0.0f);
    for (long long bh = blockIdx.y; bh < a.bh_count; bh += gridDim.y) {
        const int n_kt = npf_fa_head_key_tiles<BC>(a, bh, n_kt_all);
        __syncthreads();
        npf_fa_load_tile<T, BR, D>(q + npf_fa_head(ql, bh, a.H), i0, a.Tq, a.hs, ql.st, Qs);
        npf_fa_load_tile<T, BR, D>(dout + npf_fa_head(gl, bh, a.H), i0, a.Tq, a.hv, gl.st, dOs);
        const long long pad_row = npf_fa_pad_row(a, bh);
        int row[2];
        long long mask_row[2];
        float lse_r[2], d_r[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            row[r] = i0 + warp * 16 + g + 8 * r;
            mask_row[r] = npf_fa_mask_row(a, bh, row[r]);
            lse_r[r] = row[r] < a.Tq ? lse[bh * a.Tq + row[r]] : inf;      // rows past Tq: P = 0
            d_r[r] = row[r] < a.Tq ? dvec[bh * a.Tq + row[r]] : 0.0f;
        }
        float dqa[DN][4];
#pragma unroll
        for (int dn = 0; dn < DN; ++dn)
#pragma unroll
            for (int c = 0; c < 4; ++c) dqa[dn][c] = 0.0f;
        const T* k_head = k + npf_fa_head(kl, bh, a.H);
        const T* v_head = v + npf_fa_head(vl, bh, a.H);
        if (n_kt > 0)                                        // tile 0's copies: in flight from here
            npf_fa_load_kv_async<T, BC, D>(k_head, v_head, 0, a, kl.st, vl.st, KVs);
        npf_cp_async_commit();
        for (int kt = 0; kt < n_kt; ++kt) {
            const int j0 = kt * BC;
            T* Ks = KVs + (kt % NBUF) * 2 * BC * LD;
            T* Vs = Ks + BC * LD;
            if (NBUF == 2 && kt + 1 < n_kt)                  // the next tile into the other buffer, meanwhile
                npf_fa_load_kv_async<T, BC, D>(k_head, v_head, j0 + BC, a, kl.st, vl.st,
                                               KVs + (kt + 1) % 2 * 2 * BC * LD);
            npf_cp_async_commit();
            npf_cp_async_wait<NBUF - 1>();                   // this tile's copies have landed (1: the next's
            __syncthreads();                                 // may be in flight), everyone's; Q's and dO's
            float s[NB][4], dp[NB][4];
#pragma unroll
            for (int nb = 0; nb < NB; ++nb)
#pragma unroll
                for (int c = 0; c < 4; ++c) s[nb][c] = dp[nb][c] = 0.0f;
#pragma unroll
            for (int kd = 0; kd < KD; ++kd) {
                unsigned aq[4], ag[4];                       // 16 rows of Q and of dO, d block kd
                Ops::a_rows(aq, Qs, LD, warp * 16, kd * Ops::K, lane);
                Ops::a_rows(ag, dOs, LD, warp * 16, kd * Ops::K, lane);
#pragma unroll
                for (int nb2 = 0; nb2 < NB / 2; ++nb2) {
                    unsigned bk[4], bv[4];
                    Ops::b_rows(bk, Ks, LD, nb2 * 16, kd * Ops::K, lane);
                    Ops::b_rows(bv, Vs, LD, nb2 * 16, kd * Ops::K, lane);
                    Ops::mma(s[2 * nb2], aq, bk, s[2 * nb2]);
                    Ops::mma(s[2 * nb2 + 1], aq, bk + 2, s[2 * nb2 + 1]);
                    Ops::mma(dp[2 * nb2], ag, bv, dp[2 * nb2]);
                    Ops::mma(dp[2 * nb2 + 1], ag, bv + 2, dp[2 * nb2 + 1]);
                }
            }
#pragma unroll
            for (int nb = 0; nb < NB; ++nb)                  // s becomes dS
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    float p_drop, ds;
                    npf_fa_grad_tc(s[nb][c], dp[nb][c], lse_r[c / 2], d_r[c / 2], a, seed, bh, row[c / 2],
                                   j0 + nb * 8 + 2 * t + c % 2, mask_row[c / 2], pad_row, p_drop, ds);
                    s[nb][c] = ds;
                }
#pragma unroll
            for (int kb = 0; kb < KB; ++kb) {
                unsigned as[4];                              // keys K kb .. of dS as an A fragment
                Ops::a_from_c(as, s + kb * Ops::K / 8);
#pragma unroll
                for (int dn2 = 0; dn2 < DN / 2; ++dn2) {
                    unsigned bk[4];                          // K rows, transposed: keys are the k axis here
                    Ops::b_cols(bk, Ks, LD, kb * Ops::K, dn2 * 16, lane);
                    Ops::mma(dqa[2 * dn2], as, bk, dqa[2 * dn2]);
                    Ops::mma(dqa[2 * dn2 + 1], as, bk + 2, dqa[2 * dn2 + 1]);
                }
            }
            __syncthreads();                                 // done with this buffer before it is refilled
            if (NBUF == 1 && kt + 1 < n_kt)                  // one buffer: the next tile's copies now
                npf_fa_load_kv_async<T, BC, D>(k_head, v_head, j0 + BC, a, kl.st, vl.st, KVs);
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            if (row[r] >= a.Tq) continue;
            T* dq_row = dq + npf_fa_head(dql, bh, a.H) + row[r] * dql.st;
#pragma unroll
            for (int dn = 0; dn < DN; ++dn)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int d = dn * 8 + 2 * t + c;
                    if (d < a.hs) npf_store(dq_row + d, dqa[dn][2 * r + c]);
                }
        }
    }
}

// One query tile of npf_fa_bwd_dkdv_tc into a buffer: Q and dO rows [i0, i0 + BR) through cp.async (or
// synchronous loads, npf_fa_load_tile_async), then lse and D (rows past Tq: lse +inf, so that P =
// exp(S - inf) = 0, and D 0)
template <typename T, int D, int BR>
__device__ __forceinline__ void npf_fa_bwd_query_tile(const T* q_head, const T* g_head, const float* lse,
                                                      const float* dvec, long long bh, int i0,
                                                      const NpfFaArgs<float>& a, long long q_st, long long g_st,
                                                      T* qg_s, float* ld_s) {
    npf_fa_load_tile_async<T, BR, D>(q_head, i0, a.Tq, a.hs, q_st, qg_s);
    npf_fa_load_tile_async<T, BR, D>(g_head, i0, a.Tq, a.hv, g_st, qg_s + BR * (D + 16 / (int)sizeof(T)));
    for (int e = threadIdx.x; e < BR; e += NPF_FA_THREADS) {
        const bool in = i0 + e < a.Tq;
        ld_s[e] = in ? lse[bh * a.Tq + i0 + e] : npf_fa_inf(0.0f);
        ld_s[BR + e] = in ? dvec[bh * a.Tq + i0 + e] : 0.0f;
    }
}

// dK, dV on tensor cores: a block of 4 warps takes 64 keys (a warp its 16) over the query tiles that
// see them: S^T = K Q^T, dP^T = V dO^T, the inner step per element (rows keys, columns queries), then
// dV += P_drop^T dO and dK += dS^T Q (P_drop^T and dS^T as float16 A fragments; dO and Q by
// ldmatrix.trans). lse and D of the query tile are in shared memory (a lane's columns change per element).
// Q, dO, lse and D double-buffered: the next query tile's copies (cp.async) land while this one is computed;
// the query tiles wholly in the causal future (the first ones) are never visited.
template <typename Ops, int D, int BR>
__device__ void npf_fa_bwd_dkdv_tc(const typename Ops::T* q, const typename Ops::T* k, const typename Ops::T* v,
                                   const typename Ops::T* dout, const float* lse, const float* dvec,
                                   typename Ops::T* dk, typename Ops::T* dv, const NpfFaArgs<float>& a,
                                   NpfFaLayout ql, NpfFaLayout kl, NpfFaLayout vl, NpfFaLayout gl, NpfFaLayout dkl,
                                   NpfFaLayout dvl) {
    typedef typename Ops::T T;
    constexpr int BC = NPF_FA_TC_BR, LD = D + Ops::PAD, NB = BR / 8, DN = D / 8, KD = D / Ops::K, KB = BR / Ops::K;
    NPF_FA_SHARED(smem, (2 * BC + 4 * BR) * LD * sizeof(T) + 4 * BR * 4);
    T* Ks = reinterpret_cast<T*>(smem);                  // (BC, LD)
    T* Vs = Ks + BC * LD;                                // (BC, LD)
    T* QGs = Vs + BC * LD;                               // 2 x ((BR, LD) Q, (BR, LD) dO)
    float* LDs = reinterpret_cast<float*>(QGs + 4 * BR * LD);         // 2 x ((BR) lse, (BR) D)
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int j0 = blockIdx.x * BC;
    const int n_qt = (a.Tq + BR - 1) / BR;
    const unsigned long long seed = a.keep_min ? *a.seed : 0ULL;
    for (long long bh = blockIdx.y; bh < a.bh_count; bh += gridDim.y) {
        const int n_qt_head = j0 < npf_fa_key_end(a, bh) ? n_qt : 0;   // keys all padding: zeros
        __syncthreads();
        npf_fa_load_tile<T, BC, D>(k + npf_fa_head(kl, bh, a.H), j0, a.Tk, a.hs, kl.st, Ks);
        npf_fa_load_tile<T, BC, D>(v + npf_fa_head(vl, bh, a.H), j0, a.Tk, a.hv, vl.st, Vs);
        const long long pad_row = npf_fa_pad_row(a, bh);
        int key[2];                                          // this lane's two keys (rows of dK, dV)
#pragma unroll
        for (int r = 0; r < 2; ++r) key[r] = j0 + warp * 16 + g + 8 * r;
        float dka[DN][4], dva[DN][4];
#pragma unroll
        for (int dn = 0; dn < DN; ++dn)
#pragma unroll
            for (int c = 0; c < 4; ++c) dka[dn][c] = dva[dn][c] = 0.0f;
        int qt0 = 0;                                         // the first query tile that sees one of the keys
        if (a.causal)
            while (qt0 < n_qt_head && j0 > npf_fa_min(qt0 * BR + BR, a.Tq) - 1 + a.shift) ++qt0;
        const T* q_head = q + npf_fa_head(ql, bh, a.H);
        const T* g_head = dout + npf_fa_head(gl, bh, a.H);
        if (qt0 < n_qt_head)                                 // its copies: in flight from here
            npf_fa_bwd_query_tile<T, D, BR>(q_head, g_head, lse, dvec, bh, qt0 * BR, a, ql.st, gl.st, QGs, LDs);
        npf_cp_async_commit();
        for (int qt = qt0; qt < n_qt_head; ++qt) {
            const int i0 = qt * BR, buf = (qt - qt0) % 2;
            T* Qs = QGs + buf * 2 * BR * LD;
            T* dOs = Qs + BR * LD;
            const float* lse_s = LDs + buf * 2 * BR;
            const float* d_s = lse_s + BR;
            if (qt + 1 < n_qt_head)                          // the next tile into the other buffer, meanwhile
                npf_fa_bwd_query_tile<T, D, BR>(q_head, g_head, lse, dvec, bh, i0 + BR, a, ql.st, gl.st,
                                             QGs + (1 - buf) * 2 * BR * LD, LDs + (1 - buf) * 2 * BR);
            npf_cp_async_commit();
            npf_cp_async_wait<1>();                          // this tile's copies have landed
            __syncthreads();                                 // (everyone's, and its lse and D), and K's and V's
            float st[NB][4], dpt[NB][4];                     // S^T, dP^T: rows keys g, g + 8; columns queries
#pragma unroll
            for (int nb = 0; nb < NB; ++nb)
#pragma unroll
                for (int c = 0; c < 4; ++c) st[nb][c] = dpt[nb][c] = 0.0f;
#pragma unroll
            for (int kd = 0; kd < KD; ++kd) {
                unsigned ak[4], av[4];                       // this warp's 16 keys of K and of V, d block kd
                Ops::a_rows(ak, Ks, LD, warp * 16, kd * Ops::K, lane);
                Ops::a_rows(av, Vs, LD, warp * 16, kd * Ops::K, lane);
#pragma unroll
                for (int nb2 = 0; nb2 < NB / 2; ++nb2) {
                    unsigned bq[4], bg[4];                   // Q rows and dO rows as B fragments (n: queries)
                    Ops::b_rows(bq, Qs, LD, nb2 * 16, kd * Ops::K, lane);
                    Ops::b_rows(bg, dOs, LD, nb2 * 16, kd * Ops::K, lane);
                    Ops::mma(st[2 * nb2], ak, bq, st[2 * nb2]);
                    Ops::mma(st[2 * nb2 + 1], ak, bq + 2, st[2 * nb2 + 1]);
                    Ops::mma(dpt[2 * nb2], av, bg, dpt[2 * nb2]);
                    Ops::mma(dpt[2 * nb2 + 1], av, bg + 2, dpt[2 * nb2 + 1]);
                }
            }
#pragma unroll
            for (int nb = 0; nb < NB; ++nb)                  // st becomes P_drop^T, dpt dS^T
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const int col = nb * 8 + 2 * t + c % 2, i = i0 + col;
                    float p_drop, ds;
                    npf_fa_grad_tc(st[nb][c], dpt[nb][c], lse_s[col], d_s[col], a, seed, bh, i, key[c / 2],
                                   npf_fa_mask_row(a, bh, i), pad_row, p_drop, ds);
                    st[nb][c] = p_drop;
                    dpt[nb][c] = ds;
                }
#pragma unroll
            for (int kb = 0; kb < KB; ++kb) {
                unsigned ap[4], as[4];                       // queries K kb .. of P_drop^T and dS^T as A fragments
                Ops::a_from_c(ap, st + kb * Ops::K / 8);
                Ops::a_from_c(as, dpt + kb * Ops::K / 8);
#pragma unroll
                for (int dn2 = 0; dn2 < DN / 2; ++dn2) {
                    unsigned bg[4], bq[4];                   // dO and Q rows, transposed (k: queries, n: d)
                    Ops::b_cols(bg, dOs, LD, kb * Ops::K, dn2 * 16, lane);
                    Ops::b_cols(bq, Qs, LD, kb * Ops::K, dn2 * 16, lane);
                    Ops::mma(dva[2 * dn2], ap, bg, dva[2 * dn2]);
                    Ops::mma(dva[2 * dn2 + 1], ap, bg + 2, dva[2 * dn2 + 1]);
                    Ops::mma(dka[2 * dn2], as, bq, dka[2 * dn2]);
                    Ops::mma(dka[2 * dn2 + 1], as, bq + 2, dka[2 * dn2 + 1]);
                }
            }
            __syncthreads();                                 // done with this buffer before it is refilled
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            if (key[r] >= a.Tk) continue;
            T* dk_row = dk + npf_fa_head(dkl, bh, a.H) + key[r] * dkl.st;
            T* dv_row = dv + npf_fa_head(dvl, bh, a.H) + key[r] * dvl.st;
#pragma unroll
            for (int dn = 0; dn < DN; ++dn)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int d = dn * 8 + 2 * t + c;
                    if (d < a.hs) npf_store(dk_row + d, dka[dn][2 * r + c]);
                    if (d < a.hv) npf_store(dv_row + d, dva[dn][2 * r + c]);
                }
        }
    }
}
"""

# The shared arguments of the three tile kernels, in NpfFaArgs's order.
_ARGS = ("const bool* mask_b, const unsigned* mask_bits, const A* mask_f, long long mask_bh, int mask_ld, "
         "int mask_kind, const bool* pad_b, const unsigned* pad_bits, const A* pad_f, const int* key_end, int pad_ld, "
         "int pad_kind, "
         "const unsigned long long* seed, int keep_min, A keep_scale, "
         "long long bh_count, int H, int Tq, int Tk, int hs, int hv, A scale, int causal, int shift")
_STRUCT = ("const NpfFaArgs<A> args = {mask_b, mask_bits, mask_f, mask_bh, mask_ld, mask_kind, pad_b, pad_bits, "
           "pad_f, key_end, pad_ld, pad_kind, seed, "
           "keep_min, keep_scale, bh_count, H, Tq, Tk, hs, hv, scale, causal, shift};")

# The strided tensors of each entry point, in the order of their layouts (element strides over B, H and T
# after the kernel's other arguments; the last axis is contiguous). STRIDED: every such parameter name.
_LAYOUTS = {"fwd": ("q", "k", "v", "out"), "bwd_dkdv": ("q", "k", "v", "dout", "dk", "dv"),
            "bwd_dq": ("q", "k", "v", "dout", "dq"), "bwd_pre": ("dout", "out")}
STRIDED = frozenset(n for names in _LAYOUTS.values() for n in names)


def _layout_params(name: str) -> str:
    return "".join(f", long long {t}_sb, long long {t}_sh, long long {t}_st" for t in _LAYOUTS[name])


def _layout_args(name: str) -> str:
    return "".join(f", NpfFaLayout{{{t}_sb, {t}_sh, {t}_st}}" for t in _LAYOUTS[name])


# (name, parameters, body): per dtype, and per head-size bucket when the body names D, BR, BC
_ENTRY_POINTS = (
    ("fwd", "const T* q, const T* k, const T* v, T* out, A* lse, " + _ARGS + _layout_params("fwd"),
     _STRUCT + " npf_fa_forward<T, A, D, BR, BC>(q, k, v, out, lse, args" + _layout_args("fwd") + ");"),
    ("bwd_dkdv", "const T* q, const T* k, const T* v, const T* dout, const A* lse, const A* dvec, T* dk, T* dv, "
     + _ARGS + _layout_params("bwd_dkdv"),
     _STRUCT + " npf_fa_bwd_dkdv<T, A, D, BR, BC>(q, k, v, dout, lse, dvec, dk, dv, args"
     + _layout_args("bwd_dkdv") + ");"),
    ("bwd_dq", "const T* q, const T* k, const T* v, const T* dout, const A* lse, const A* dvec, T* dq, " + _ARGS
     + _layout_params("bwd_dq"),
     _STRUCT + " npf_fa_bwd_dq<T, A, D, BR, BC>(q, k, v, dout, lse, dvec, dq, args" + _layout_args("bwd_dq") + ");"),
    ("bwd_pre", "const T* dout, const T* out, A* dvec, long long rows, int hv, int Tq, int H"
     + _layout_params("bwd_pre"),
     "npf_fa_bwd_pre<T, A>(dout, out, dvec, rows, hv, Tq, H" + _layout_args("bwd_pre") + ");"),
)

_TEST_ENTRY_POINTS = r"""
// _keep (unscaled) for flat indices n = ((bh Tq) + i) Tk + j of a (bh_count, Tq, Tk) block
extern "C" __global__ void npf_fa_keep_mask(const unsigned long long* seed, int keep_min, bool* keep, long long total) {
    NPF_FOR_EACH(n, total) keep[n] = npf_fa_keep(*seed, (unsigned long long)n, keep_min);
}

// The shared-memory bytes each kernel carves, in flash_source.SHARED's order
extern "C" __global__ void npf_fa_shared_sizes(long long* bytes) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    int n = 0;
@SIZES@}
"""


def entry_name(kernel: str, dtype, d: int | None = None) -> str:
    """``npf_fa_<kernel>[_d<D>]_<f16|f32|f64>``: the entry point of ``kernel`` for ``dtype`` and bucket D."""
    suffix = TYPES[numpy.dtype(dtype)][2]
    return f"npf_fa_{kernel}_{suffix}" if d is None else f"npf_fa_{kernel}_d{d}_{suffix}"


def _entry_points(pairs) -> str:
    """The entry points of the (dtype, D) pairs (bwd_pre once per dtype)."""
    out, dtypes = [], []
    for dtype, d in pairs:
        storage, acc, _ = TYPES[numpy.dtype(dtype)]
        for name, params, body in _ENTRY_POINTS:
            bucketed = "D, BR, BC" in body
            if not bucketed and dtype in dtypes:
                continue
            text = (f'extern "C" __global__ void {entry_name(name, dtype, d if bucketed else None)}({params}) {{\n'
                    f"    {body}\n}}\n")
            if bucketed:
                br, bc = TILES[acc, d]
                text = re.sub(r"\bD, BR, BC\b", f"{d}, {br}, {bc}", text)
                text = text.replace("__global__ void", f"__global__ void __launch_bounds__(NPF_FA_THREADS, "
                                                       f"{MIN_BLOCKS[name, acc, d]})", 1)
            else:
                text = text.replace("__global__ void", f"__global__ void __launch_bounds__({PRE_THREADS})", 1)
            out.append(re.sub(r"\bA\b", acc, re.sub(r"\bT\b", storage, text)))
        variant = TC_VARIANT_OF.get(numpy.dtype(dtype))                 # tensor cores: float16, float32 (TF32)
        if variant:
            ops, v = TC_VARIANTS[variant][0], (variant, d)
            for base, template in (("fwd", f"npf_fa_forward_tc<{ops}, {d}, {TC_BC[v]}>"),
                                   ("bwd_dq", f"npf_fa_bwd_dq_tc<{ops}, {d}, {TC_BC[v]}, {TC_DQ_BUFFERS[v]}>"),
                                   ("bwd_dkdv", f"npf_fa_bwd_dkdv_tc<{ops}, {d}, {TC_BQ[v]}>")):
                name = f"{base}_{variant}"
                params, body = next((p, b) for n, p, b in _ENTRY_POINTS if n == base)
                body = re.sub(r"npf_fa_\w+<T, A, D, BR, BC>", template, body)
                text = (f'extern "C" __global__ void __launch_bounds__(NPF_FA_THREADS, {TC_MIN_BLOCKS[name, d]}) '
                        f'{entry_name(name, dtype, d)}({params}) {{\n    {body}\n}}\n')
                out.append(re.sub(r"\bA\b", acc, re.sub(r"\bT\b", storage, text)))
        dtypes.append(dtype)
    return "\n".join(out)


def _test_entry_points() -> str:
    sizes = "".join(f"    bytes[n++] = (long long)(NpfFaShape<{acc}, {d}, {TILES[acc, d][0]}, {TILES[acc, d][1]}>"
                    f"::{kernel.upper()} * sizeof({acc}));\n" for kernel, acc, d in SHARED)
    return _TEST_ENTRY_POINTS.replace("@SIZES@", sizes)


def _constants(text: str) -> str:
    golden, mix1, mix2 = SPLITMIX64
    values = {"GOLDEN": f"0x{golden:016X}", "MIX1": f"0x{mix1:016X}", "MIX2": f"0x{mix2:016X}"}
    return re.sub(r"@(\w+)@", lambda m: values[m.group(1)], text)


_PAIRS = tuple((numpy.dtype(dtype), d) for dtype in TYPES for d in HEAD_SIZES)


def module_source(dtype, d: int) -> str:
    """The NVRTC source of the module for ``dtype`` and head-size bucket ``d``: its fwd, bwd_dkdv,
    bwd_dq and bwd_pre entry points (and the tensor-core ones)."""
    return HALF_CONVERSIONS + WARP_PRIMITIVES + _constants(_KERNELS) + "\n" + _entry_points([(numpy.dtype(dtype), d)])


MODULE_SOURCES = {pair: module_source(*pair) for pair in _PAIRS}
# The two kernels only the tests launch (the keep rule position by position, the shared memory each
# kernel carves), in a module of their own: never compiled into the shipped ones.
TEST_SOURCE = HALF_CONVERSIONS + WARP_PRIMITIVES + _constants(_KERNELS) + "\n" + _test_entry_points()
# What the CPU emulator compiles (tests/kernels/cuda/emulator.py gives float16's conversions itself):
# every pair's entry points and the test kernels in one library.
FLASH_EMULATED_SOURCE = _constants(_KERNELS) + "\n" + _entry_points(_PAIRS) + _test_entry_points()
# Multiply-adds may fuse here (unlike the common module's element-wise kernels, whose roundings follow
# the reference's separate CuPy kernels): a tile product is a reduction whose order differs from the
# reference's matmul anyway, and FMA halves its instruction count.
FLASH_NVRTC_OPTIONS = ("--fmad=true",)
