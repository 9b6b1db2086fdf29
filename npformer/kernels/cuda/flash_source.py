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
minute). A module is self-contained: ``half.cuh`` (:data:`~npformer.kernels.cuda.source.HALF_CONVERSIONS`),
then ``prelude.cuh`` (the file the common source starts with too), then the kernels of ``flash.cu``
(the CUDA C files: :mod:`npformer.kernels.cuda.files`). Only the infinity constant and the dynamic
shared-memory declaration differ between the GPU and the CPU emulator (tests/kernels/cuda/emulator.py,
where ``__CUDACC__`` is undefined), which compiles :data:`FLASH_EMULATED_SOURCE`, every entry point in
one library.
"""
from __future__ import annotations

import re

import numpy

from npformer.kernels.cuda.files import read_source
from npformer.kernels.cuda.source import HALF_CONVERSIONS, TYPES
from npformer.kernels.cuda.warp_source import WARP_PRIMITIVES
from npformer.ops.flash_attention import SPLITMIX64

__all__ = ["THREADS", "HEAD_SIZES", "MAX_HEAD_SIZE", "TILES", "SHARED", "TC_VARIANTS", "TC_VARIANT_OF", "TC_BR",
           "TC_BC", "TC_BQ", "TC_DQ_BUFFERS", "TC_MIN_BLOCKS", "TC_SHARED", "tc_shared", "OCCUPANCY_FLOORS",
           "MIN_BLOCKS", "PRE_THREADS", "STRIDED", "shared_bytes", "DENSE_TILES", "DENSE_TRAITS", "DENSE_KERNELS",
           "DENSE_SHARED", "dense_shared",
           "entry_name", "module_source", "MODULE_SOURCES", "FLASH_KERNELS", "FLASH_EMULATED_SOURCE",
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
                 ("bwd_dq_tf32", 64): 3, ("bwd_dq_tf32", 128): 2, ("bwd_dkdv_tf32", 32): 4, ("bwd_dkdv_tf32", 64): 3,
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
# The dense kernels (npf_fa_forward_dense, npf_fa_bwd_dq_dense, npf_fa_bwd_dkdv_dense: no attention mask,
# no key padding, no dropout; causal or not), float16 on tensor cores, for the common case. Their tiles
# and launch bounds are their traits' in flash.cu (NpfFaDenseTraits, NpfFaDenseDqTraits,
# NpfFaDenseDkdvTraits); the launcher's grid and shared memory take these copies, which a test compares
# with the traits (npf_fa_shared_sizes). Per kernel and D: (the rows a block takes: query rows, or keys
# for dk/dv; the tile it loops over: keys, or query rows for dk/dv).
DENSE_TILES = {"fwd": {32: (128, 64), 64: (128, 64), 128: (64, 32)},
               "bwd_dq": {32: (128, 64), 64: (128, 32), 128: (64, 32)},
               "bwd_dkdv": {32: (128, 32), 64: (64, 64), 128: (64, 32)}}
DENSE_TRAITS = {"fwd": "NpfFaDenseTraits", "bwd_dq": "NpfFaDenseDqTraits", "bwd_dkdv": "NpfFaDenseDkdvTraits"}
DENSE_KERNELS = tuple(f"{kernel}_dense{causal}" for kernel in DENSE_TILES for causal in ("", "_causal"))


def dense_shared(kernel: str, d: int) -> int:
    """Dynamic shared memory of one block of dense ``kernel`` ("fwd", "bwd_dq", "bwd_dkdv") at head-size
    bucket ``d``: rows of d + 8 halves; the tile looped over double-buffered."""
    block, tile = DENSE_TILES[kernel][d]
    rows = {"fwd": block + 4 * tile,                     # Q; K, V double-buffered
            "bwd_dq": 2 * block + 4 * tile,              # Q, dO; K, V double-buffered
            "bwd_dkdv": 2 * block + 4 * tile}[kernel]    # K, V; Q, dO double-buffered (and lse, D)
    return rows * (d + 8) * 2 + (4 * tile * 4 if kernel == "bwd_dkdv" else 0)


DENSE_SHARED = {(kernel, d): dense_shared(kernel, d) for kernel in DENSE_TILES for d in HEAD_SIZES}
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
    # the dense kernels: what their launch bounds allow (benchmarks/cuda_kernels.py, 2026-11-29)
    ("fwd_dense", "float", 32): (0.1875, 0.1875), ("fwd_dense", "float", 64): (0.125, 0.125),
    ("fwd_dense", "float", 128): (0.1875, 0.1875),
    ("dq_dense", "float", 32): (0.125, 0.125), ("dq_dense", "float", 64): (0.125, 0.125),
    ("dq_dense", "float", 128): (0.125, 0.1875),            # (an A100's shared memory: 2 blocks)
    ("dkdv_dense", "float", 32): (0.125, 0.125), ("dkdv_dense", "float", 64): (0.125, 0.125),
    ("dkdv_dense", "float", 128): (0.125, 0.125),           # (3 blocks an SM spilled the causal ones)
}
# __launch_bounds__ of the SIMT kernels: blocks of 128 threads an SM (the register cap that keeps each
# at its sm_90 occupancy floor: floor x 64 warps / 4 warps a block), and bwd_pre's block (a warp a row)
MIN_BLOCKS = {(name, acc, d): max(1, round(OCCUPANCY_FLOORS[floor, acc, d][1] * 16))
              for name, floor in (("fwd", "fwd"), ("bwd_dq", "dq"), ("bwd_dkdv", "dkdv")) for acc, d in TILES}
PRE_THREADS = 256           # runtime.ELEMENT_THREADS, the launch's block

_KERNELS = read_source("prelude.cuh") + read_source("flash.cu")

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
        if numpy.dtype(dtype) == numpy.float16:                         # the dense kernels: float16 only
            for kernel, function in (("fwd", "npf_fa_forward"), ("bwd_dq", "npf_fa_bwd_dq"),
                                     ("bwd_dkdv", "npf_fa_bwd_dkdv")):
                params, body = next((p, b) for n, p, b in _ENTRY_POINTS if n == kernel)
                traits = f"{DENSE_TRAITS[kernel]}<{d}>"
                for causal in ("", "_causal"):
                    call = f"{function}_dense<{d}, {'true' if causal else 'false'}>"
                    text = (f'extern "C" __global__ void __launch_bounds__({traits}::THREADS, {traits}::MIN_BLOCKS) '
                            f'{entry_name(f"{kernel}_dense{causal}", dtype, d)}({params}) {{\n'
                            f'    {re.sub(function + r"<T, A, D, BR, BC>", call, body)}\n}}\n')
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


def _constants(text: str) -> str:
    golden, mix1, mix2 = SPLITMIX64
    values = {"GOLDEN": f"0x{golden:016X}", "MIX1": f"0x{mix1:016X}", "MIX2": f"0x{mix2:016X}"}
    return re.sub(r"@(\w+)@", lambda m: values[m.group(1)], text)


_PAIRS = tuple((numpy.dtype(dtype), d) for dtype in TYPES for d in HEAD_SIZES)


FLASH_KERNELS = HALF_CONVERSIONS + WARP_PRIMITIVES + _constants(_KERNELS)    # every module's kernels, before its entry points


def module_source(dtype, d: int) -> str:
    """The NVRTC source of the module for ``dtype`` and head-size bucket ``d``: its fwd, bwd_dkdv,
    bwd_dq and bwd_pre entry points (and the tensor-core ones)."""
    return FLASH_KERNELS + "\n" + _entry_points([(numpy.dtype(dtype), d)])


MODULE_SOURCES = {pair: module_source(*pair) for pair in _PAIRS}
# What the CPU emulator compiles (tests/kernels/cuda/emulator.py gives float16's conversions itself, and
# tests/kernels/cuda/sources.py adds the test kernels): every pair's entry points in one library.
FLASH_EMULATED_SOURCE = _constants(_KERNELS) + "\n" + _entry_points(_PAIRS)
# Multiply-adds may fuse here (unlike the common module's element-wise kernels, whose roundings follow
# the reference's separate CuPy kernels): a tile product is a reduction whose order differs from the
# reference's matmul anyway, and FMA halves its instruction count.
FLASH_NVRTC_OPTIONS = ("--fmad=true",)
