"""The CUDA C of flash attention (:mod:`npformer.kernels.cuda.flash_attention`), its own NVRTC module.

Three kernels and a pre-pass, FlashAttention-2 (Dao 2023, Algorithms 1 and 2) in SIMT arithmetic:
every tile product is a loop of multiply-adds, in the accumulation type ``A`` (float for float16 and
float32, double for float64); and the same three on tensor cores (``_tc`` kernels, one template over an
operand policy: float16 and bfloat16 with ``NpfHalfOps<T>``, float32 under the TF32 opt-in with
``NpfTf32Ops``). Each maps to lines of the reference, :mod:`npformer.ops.flash_attention` (names below are the reference's):

==================================  ===============================================================
CUDA C                              reference
==================================  ===============================================================
``npf_keep`` (prelude.cuh)          ``_keep``: the dropout op's ``keep_bits`` at the flat index
                                    ((b H + h) Tq + i) Tk + j, kept when the top 24 bits reach
                                    ``keep_min`` (``keep_threshold(p)``)
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
``npf_fa_forward_simt_dense``,      float32's dense kernels (no mask, padding or dropout; causal or
``npf_fa_bwd_dq_simt_dense``,       not; without the TF32 opt-in, sm_80 and later): the SIMT kernels'
``npf_fa_bwd_dkdv_simt_dense``      tile products and inner step, P in base 2 (``exp2(s c - m c)``,
                                    dQ and dK scaled once at the end), the masks only on the tiles
                                    across the diagonal or the ragged end, the forward's row max and
                                    sum by shuffles, every tile copied by cp.async during the
                                    products (dQ's next K into a second buffer up to D 64)
``npf_fa_forward_wgmma``,           the dense kernels (no mask, padding or dropout) on Hopper's
``npf_fa_bwd_dq_wgmma``,            warpgroup MMAs (sm_90a, opt-in: ``flash_attention.use_wgmma``):
``npf_fa_bwd_dkdv_wgmma``           a warpgroup per 64 query rows (dk, dv: keys), ``S = q k^T``,
                                    ``acc += P v`` (dq: ``S``, ``dP = dO v^T``, ``dq += ds k``; dk,
                                    dv: their transposes, ``dv += P^T dO``, ``dk += ds^T q``) as
                                    wgmmas over 128-byte-swizzled tiles in shared memory, the
                                    element-wise work (softmax, dS) in registers; the forward, dq
                                    and (head size 64) dk, dv run a tile's element-wise work
                                    beside the previous tile's ``P v`` (``ds k``; ``P^T dO``,
                                    ``ds^T q``)
==================================  ===============================================================

Layout. A block has 128 threads seen as 16 row lanes x 8 column lanes; a tile product X Y^T of
(NR, D) by (NC, D) gives thread (tr, tc) the rows tr + 16 a and columns tc + 8 b (a register
micro-tile), and a product P W of (NR, N) by (N, D) gives it rows tr + 16 a and head columns
32 (c / 4) + 4 tc + c % 4 (runs of 4: 16-byte loads and stores). So a thread owns the same query rows in the score tile and in the output accumulator, and
the row max and sum need one exchange among the 8 threads of a row (through shared memory).
Tiles are (BR queries, BC keys) with the head size padded to D in {32, 64, 128} (zeros: they add
nothing to a dot product); rows are D + 4 values apart in shared memory (16-byte aligned, and the 4
or 8 rows read at once fall in distinct banks). Shared memory is dynamic: each kernel's traits in
flash.cu give its bytes (``SHARED``), which the kernel carves out.

Masks. A bool mask is read as bytes by the SIMT kernels and as bits by the tensor-core kernels
(:func:`~npformer.kernels.cuda.flash_attention.pack_bits`: 32 keys a word, so a lane's two columns
of a key tile cost one 4-byte load a row, the quad's lanes the same word); a float mask is read as
values (a quad's 8 consecutive columns: 32 bytes, one memory sector). A bool key-padding mask also
comes as lengths (``key_end``: one past each batch's last visible key): every kernel skips the key
tiles past it whole, as it skips the causal future (keys in the skipped tiles are never read).
Every kernel has ``__launch_bounds__`` (its traits' ``THREADS`` and ``MIN_BLOCKS``, the measured reason
beside them in flash.cu).

Strides. q, k, v, out, dout, dq, dk, dv are (B, H, T, D) arrays with a contiguous last axis and any
other strides (``NpfFaLayout``: element (b, h, t, d) at ``b sb + h sh + t st + d``): the heads of a
packed (B, T, 3E) projection are read in place, and (B, T, H, hs) outputs merge into (B, T, E) as
views. lse and D stay (B, H, T) contiguous.

Configuration in C++ (flash.cu's last section, FlashAttention-2's ``Flash_fwd_kernel_traits`` and
``run_mha_fwd_hdim64`` the model): one ``__global__`` template, ``npf_fa_kernel<K>``, over kernel traits
K (``NpfFaFwd<T, D>``, ``NpfFaFwdTc<T, D>``, ``NpfFaFwdDense<T, D, CAUSAL>`` (float's: the SIMT dense
kernels), ``NpfFaDq...``, ``NpfFaDkdv...``, ``NpfFaPre<T>``: tiles, block, launch bounds, shared memory),
taking one struct by value (``NpfFaParams<T, A>``, filled from Python by field name through
:func:`params_dtype`). Python names an
instantiation (:func:`name_expression`) and CuPy's ``RawModule(name_expressions=...)`` compiles it; no
source text is written here. The host needs two numbers of each instantiation to launch it, the rows a
block takes (the grid) and its shared memory: :data:`GEOMETRY` holds them, checked against the
compiled traits by a test.

Modules. Each (dtype, D) pair is its own small NVRTC module (the same source, :data:`FLASH_SOURCE`; the
instantiations :func:`module_kernels` names), compiled on first use: a run compiles the kernels it needs
(seconds), not all of them (about a minute). A module is self-contained: ``half.cuh``
(:data:`~npformer.kernels.cuda.source.HALF_CONVERSIONS`), then ``prelude.cuh`` (the file the common
source starts with too), ``warp.cuh``, then ``flash.cu`` (the CUDA C files:
:mod:`npformer.kernels.cuda.files`). Only the infinity constant and the dynamic shared-memory
declaration differ between the GPU and the CPU emulator (tests/kernels/cuda/emulator.py, where
``__CUDACC__`` is undefined), which compiles :data:`FLASH_EMULATED_SOURCE` with every pair's
instantiations in one library.
"""
from __future__ import annotations

import functools

import numpy

from npformer.kernels.cuda.files import read_source
from npformer.kernels.cuda.source import HALF_CONVERSIONS, PRELUDE, TYPES, cuda_type, dtype_name
from npformer.kernels.cuda.warp_source import WARP_PRIMITIVES, WARPGROUP_NVRTC_OPTIONS, WARPGROUP_PRIMITIVES

__all__ = ["THREADS", "PRE_THREADS", "WGMMA_THREADS", "HEAD_SIZES", "WGMMA_HEAD_SIZES", "WGMMA_DTYPES",
           "MAX_HEAD_SIZE", "TC_VARIANT_OF", "GEOMETRY", "OCCUPANCY_FLOORS", "TENSORS", "params_dtype", "layout_field",
           "kernels", "wgmma_kernels", "name_expression", "entry_name", "geometry", "module_kernels",
           "wgmma_module_kernels", "MODULE_KERNELS", "WGMMA_MODULE_KERNELS", "FLASH_SOURCE", "FLASH_EMULATED_SOURCE",
           "FLASH_NVRTC_OPTIONS", "FLASH_WGMMA_NVRTC_OPTIONS"]

THREADS = 128                      # per block of the tile kernels (NPF_FA_THREADS: 16 row lanes x 8 column lanes)
PRE_THREADS = 256                  # bwd_pre's block (NpfFaPre::THREADS: a warp a row)
WGMMA_THREADS = 256                # the Hopper kernels' block (NpfFaWgmma*Traits::THREADS: two warpgroups)
HEAD_SIZES = (32, 64, 128)         # the head-size buckets D (one instantiation each)
# The Hopper kernels (npf_fa_forward_wgmma, npf_fa_bwd_dq_wgmma, npf_fa_bwd_dkdv_wgmma; sm_90a): float16 and
# bfloat16 at D 64 and 128, dense, causal or not, in modules of their own (compiled for sm_90a, which runs on
# compute capability 9.0 only)
WGMMA_HEAD_SIZES = (64, 128)
WGMMA_DTYPES = ("float16", "bfloat16")
MAX_HEAD_SIZE = HEAD_SIZES[-1]
# Which tensor-core kernels a dtype runs, by its name (flash_attention.tensor_core_variant): float16 and
# bfloat16 "tc" (NpfHalfOps<T>: m16n8k16 .f16 or .bf16), float32 "tf32" under the TF32 opt-in (NpfTf32Ops);
# all are flash.cu's NpfFa*Tc<T, D> traits.
TC_VARIANT_OF = {"float16": "tc", "bfloat16": "tc", "float32": "tf32"}

# Launch geometry, the one table of it on the host: per kernel traits (flash.cu), the rows a block takes on
# the grid's x axis (queries; keys for dK, dV) and its dynamic shared memory in bytes: copies of the traits'
# ROWS and SHARED, which tests/kernels/cuda/test_flash_attention.py compares with the compiled traits (the
# dense kernels' causal and plain instantiations share theirs, and bfloat16's float16's: _GEOMETRY_STORAGE).
# The block is THREADS (PRE_THREADS for NpfFaPre, whose ROWS is a block's 8 rows and SHARED 0), also checked.
GEOMETRY = {
    # SIMT (BR x BC tiles: 64 x 64 in float up to D 64, else 32 x 32), by the accumulator's type: float16 and
    # bfloat16 compute in float and take float's rows (_SIMT_ACCUMULATOR)
    "NpfFaFwd<float, 32>": (64, 49152), "NpfFaFwd<float, 64>": (64, 73728), "NpfFaFwd<float, 128>": (32, 57344),
    "NpfFaDq<float, 32>": (64, 54272), "NpfFaDq<float, 64>": (64, 87040), "NpfFaDq<float, 128>": (32, 72192),
    "NpfFaDkdv<float, 32>": (64, 72192), "NpfFaDkdv<float, 64>": (64, 104960), "NpfFaDkdv<float, 128>": (32, 77056),
    "NpfFaFwd<double, 32>": (32, 40960), "NpfFaFwd<double, 64>": (32, 65536), "NpfFaFwd<double, 128>": (32, 114688),
    "NpfFaDq<double, 32>": (32, 46080), "NpfFaDq<double, 64>": (32, 78848), "NpfFaDq<double, 128>": (32, 144384),
    "NpfFaDkdv<double, 32>": (32, 55808), "NpfFaDkdv<double, 64>": (32, 88576),
    "NpfFaDkdv<double, 128>": (32, 154112),
    # tensor cores: 64 rows a block; float16 ("tc"), float32 under TF32 (twice the bytes a tile)
    "NpfFaFwdTc<unsigned short, 32>": (64, 15360), "NpfFaFwdTc<unsigned short, 64>": (64, 27648),
    "NpfFaFwdTc<unsigned short, 128>": (64, 34816), "NpfFaDqTc<unsigned short, 32>": (64, 20480),
    "NpfFaDqTc<unsigned short, 64>": (64, 36864), "NpfFaDqTc<unsigned short, 128>": (64, 52224),
    "NpfFaDkdvTc<unsigned short, 32>": (64, 20992), "NpfFaDkdvTc<unsigned short, 64>": (64, 37376),
    "NpfFaDkdvTc<unsigned short, 128>": (64, 52480),
    "NpfFaFwdTc<float, 32>": (64, 27648), "NpfFaFwdTc<float, 64>": (64, 52224), "NpfFaFwdTc<float, 128>": (64, 67584),
    "NpfFaDqTc<float, 32>": (64, 36864), "NpfFaDqTc<float, 64>": (64, 69632), "NpfFaDqTc<float, 128>": (64, 101376),
    "NpfFaDkdvTc<float, 32>": (64, 37376), "NpfFaDkdvTc<float, 64>": (64, 70144),
    "NpfFaDkdvTc<float, 128>": (64, 101632),
    # the dense kernels (float16, bfloat16): FRAGS 16-row fragments a warp
    "NpfFaFwdDense<32>": (128, 30720), "NpfFaFwdDense<64>": (128, 55296), "NpfFaFwdDense<128>": (64, 52224),
    "NpfFaDqDense<32>": (128, 40960), "NpfFaDqDense<64>": (128, 55296), "NpfFaDqDense<128>": (64, 69632),
    "NpfFaDkdvDense<32>": (128, 31232), "NpfFaDkdvDense<64>": (64, 56320), "NpfFaDkdvDense<128>": (64, 70144),
    # float32's dense kernels, SIMT: 64 x 64 tiles up to D 64, 32 x 32 at D 128
    "NpfFaFwdDense<float, 32>": (64, 45056), "NpfFaFwdDense<float, 64>": (64, 69632),
    "NpfFaFwdDense<float, 128>": (32, 55296),
    "NpfFaDqDense<float, 32>": (64, 63488), "NpfFaDqDense<float, 64>": (64, 104448),
    "NpfFaDqDense<float, 128>": (32, 72192),
    "NpfFaDkdvDense<float, 32>": (64, 72192), "NpfFaDkdvDense<float, 64>": (64, 104960),
    "NpfFaDkdvDense<float, 128>": (32, 77056),
    # the Hopper kernels (WGMMA_THREADS threads): 128 rows (dK, dV: keys), tiles of 128 keys (dQ: 64; dK, dV: 64
    # queries), 1 KiB to align the tiles
    "NpfFaFwdWgmma<64>": (128, 82944), "NpfFaFwdWgmma<128>": (128, 164864),
    "NpfFaDqWgmma<64>": (128, 74752), "NpfFaDqWgmma<128>": (128, 148480),
    "NpfFaDkdvWgmma<64>": (128, 83968), "NpfFaDkdvWgmma<128>": (128, 133120),
}
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
    ("fwd_tc", "float", 32): (0.25, 0.25), ("fwd_tc", "float", 64): (0.25, 0.25),     # (flash.cu: MIN_BLOCKS)
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
    # float32's dense kernels (SIMT; "_simt" keeps them apart from the tensor-core dense ones): at least the
    # general SIMT kernels' occupancy (benchmarks/cuda_kernels.py, 2026-12-01)
    ("fwd_dense_simt", "float", 32): (0.1875, 0.25), ("fwd_dense_simt", "float", 64): (0.125, 0.1875),
    ("fwd_dense_simt", "float", 128): (0.125, 0.25),
    ("dq_dense_simt", "float", 32): (0.125, 0.1875), ("dq_dense_simt", "float", 64): (0.0625, 0.125),
    ("dq_dense_simt", "float", 128): (0.125, 0.1875),
    ("dkdv_dense_simt", "float", 32): (0.125, 0.1875), ("dkdv_dense_simt", "float", 64): (0.0625, 0.125),
    ("dkdv_dense_simt", "float", 128): (0.125, 0.125),
    # the Hopper kernels, sm_90 only: one block of 8 warps an SM (their launch bounds)
    ("fwd_wgmma", "float", 64): (0.125, 0.125), ("fwd_wgmma", "float", 128): (0.125, 0.125),
    ("dq_wgmma", "float", 64): (0.125, 0.125), ("dq_wgmma", "float", 128): (0.125, 0.125),
    ("dkdv_wgmma", "float", 64): (0.125, 0.125), ("dkdv_wgmma", "float", 128): (0.125, 0.125),
}
_TRAITS = {"fwd": "NpfFaFwd", "bwd_dq": "NpfFaDq", "bwd_dkdv": "NpfFaDkdv"}
# bfloat16's tensor-core tiles take float16's bytes (two a value), so its instantiations share float16's
# GEOMETRY rows; the SIMT kernels' tiles are their accumulator's, float for both 16-bit types (the test
# compares every compiled instantiation with its row)
_GEOMETRY_STORAGE = {"npf_bf16": "unsigned short"}
_SIMT_ACCUMULATOR = {"unsigned short": "float", "npf_bf16": "float"}


def kernels(dtype) -> tuple:
    """The kernels ``dtype`` has, by npformer's name: "fwd", "bwd_dq", "bwd_dkdv" (SIMT), "bwd_pre", the
    tensor-core ones ("fwd_tc", ... for float16 and bfloat16; "fwd_tf32", ... for float32), and the dense ones
    ("fwd_dense", "fwd_dense_causal", ...: on tensor cores for float16 and bfloat16, SIMT for float32)."""
    variant = TC_VARIANT_OF.get(dtype_name(dtype))
    names = tuple(_TRAITS) + ("bwd_pre",)
    if variant:
        names += tuple(f"{k}_{variant}" for k in _TRAITS)
    if variant:                                 # the dense kernels (float32's in SIMT arithmetic)
        names += tuple(f"{k}_dense{causal}" for k in _TRAITS for causal in ("", "_causal"))
    return names


def wgmma_kernels(dtype) -> tuple:
    """The Hopper kernels ``dtype`` has: "fwd_wgmma", "bwd_dq_wgmma", "bwd_dkdv_wgmma", each also "_causal",
    for float16 and bfloat16; else none."""
    if dtype_name(dtype) not in WGMMA_DTYPES:
        return ()
    return tuple(f"{k}_wgmma{causal}" for k in _TRAITS for causal in ("", "_causal"))


def _traits(name: str, dtype, d: int) -> tuple[str, str]:
    """(the traits type of kernel ``name``'s instantiation, its key in GEOMETRY)."""
    storage = cuda_type(dtype)[0]
    if name == "bwd_pre":
        return f"NpfFaPre<{storage}>", ""
    base = next(k for k in sorted(_TRAITS, key=len, reverse=True) if name.startswith(k))
    variant = name[len(base) + 1:]
    if variant.startswith(("dense", "wgmma")):
        kind = variant.split("_")[0].capitalize()
        causal = "true" if variant.endswith("_causal") else "false"
        row = f"{_TRAITS[base]}{kind}<{d}>" if storage in ("unsigned short", "npf_bf16") else \
            f"{_TRAITS[base]}{kind}<{storage}, {d}>"        # float32's: SIMT, GEOMETRY rows of their own
        return f"{_TRAITS[base]}{kind}<{storage}, {d}, {causal}>", row
    traits = f"{_TRAITS[base]}{'Tc' if variant else ''}<{{}}, {d}>"
    row = _GEOMETRY_STORAGE.get(storage, storage) if variant else _SIMT_ACCUMULATOR.get(storage, storage)
    return traits.format(storage), traits.format(row)


def name_expression(name: str, dtype, d: int) -> str:
    """The instantiation CuPy's RawModule compiles for kernel ``name`` of ``dtype`` and head-size bucket D
    (``npf_fa_kernel<NpfFaFwdTc<unsigned short, 64>>``); get_function takes it."""
    return f"npf_fa_kernel<{_traits(name, dtype, d)[0]}>"


def geometry(name: str, dtype, d: int) -> tuple[int, int, int]:
    """(threads a block, rows a block takes on the grid's x axis, dynamic shared bytes) of kernel ``name``."""
    if name == "bwd_pre":
        return PRE_THREADS, PRE_THREADS // 32, 0
    return (WGMMA_THREADS if "_wgmma" in name else THREADS,) + GEOMETRY[_traits(name, dtype, d)[1]]


def entry_name(kernel: str, dtype, d: int | None = None) -> str:
    """``npf_fa_<kernel>[_d<D>]_<f16|bf16|f32|f64>``: the name tables and reports give kernel ``kernel`` of
    ``dtype`` and bucket D (benchmarks/cuda_kernels.py's rows, the occupancy floors)."""
    suffix = cuda_type(dtype)[2]
    return f"npf_fa_{kernel}_{suffix}" if d is None else f"npf_fa_{kernel}_d{d}_{suffix}"


def module_kernels(dtype, d: int) -> dict[str, str]:
    """The (dtype, D) module's instantiations: ``{entry_name: name_expression}`` (bwd_pre's without D)."""
    return {entry_name(n, dtype, None if n == "bwd_pre" else d): name_expression(n, dtype, d) for n in kernels(dtype)}


def wgmma_module_kernels(dtype, d: int) -> dict[str, str]:
    """The Hopper (dtype, D) module's instantiations, as :func:`module_kernels`."""
    return {entry_name(n, dtype, d): name_expression(n, dtype, d) for n in wgmma_kernels(dtype)}


_POINTER = numpy.dtype(numpy.uint64)          # a device address
_I32, _I64 = numpy.dtype(numpy.int32), numpy.dtype(numpy.int64)
_LAYOUT = numpy.dtype([("sb", _I64), ("sh", _I64), ("st", _I64)])
TENSORS = ("q", "k", "v", "out", "dout", "dq", "dk", "dv")     # NpfFaParams's tensors; each has a layout


@functools.lru_cache(maxsize=None)
def params_dtype(acc) -> numpy.dtype:
    """flash.cu's ``NpfFaParams<T, A>`` as a NumPy structured dtype, A = ``acc`` (float32 or float64), with C's
    alignment: a 1-element array of it is the kernels' one argument (CuPy passes a size-1 NumPy array by
    value, its bytes). Pointers are device addresses (uint64). tests/kernels/cuda/test_flash_attention.py
    compares its offsets and size with the compiled struct's."""
    a = numpy.dtype(acc)
    args = numpy.dtype([("mask_b", _POINTER), ("mask_bits", _POINTER), ("mask_f", _POINTER), ("mask_bh", _I64),
                        ("mask_ld", _I32), ("mask_kind", _I32), ("pad_b", _POINTER), ("pad_bits", _POINTER),
                        ("pad_f", _POINTER), ("key_end", _POINTER), ("pad_ld", _I32), ("pad_kind", _I32),
                        ("seed_draws", _POINTER), ("keep_min", _I32), ("keep_scale", a), ("bh_count", _I64),
                        ("H", _I32), ("Tq", _I32), ("Tk", _I32), ("hs", _I32), ("hv", _I32), ("scale", a),
                        ("causal", _I32), ("shift", _I32)], align=True)
    return numpy.dtype([(name, _POINTER) for name in TENSORS + ("lse", "dvec")]
                       + [(layout_field(name), _LAYOUT) for name in TENSORS]
                       + [("a", args)], align=True)


def layout_field(tensor: str) -> str:
    """The field of ``tensor``'s layout in NpfFaParams: ql, kl, vl, ol, gl (dout), dql, dkl, dvl."""
    return {"out": "ol", "dout": "gl"}.get(tensor, tensor + "l")


_PAIRS = tuple((name, d) for name in TYPES for d in HEAD_SIZES)      # dtypes by name (ml_dtypes not imported)

# The flash attention modules' one source (each (dtype, D) module compiles its own instantiations of it).
FLASH_SOURCE = HALF_CONVERSIONS + WARP_PRIMITIVES + WARPGROUP_PRIMITIVES + PRELUDE + read_source("flash.cu")
MODULE_KERNELS = {pair: module_kernels(*pair) for pair in _PAIRS}
WGMMA_MODULE_KERNELS = {(dtype, d): wgmma_module_kernels(dtype, d) for dtype in WGMMA_DTYPES for d in WGMMA_HEAD_SIZES}
# What the CPU emulator compiles (tests/kernels/cuda/emulator.py gives float16's conversions and the warp and
# warpgroup primitives itself; warpgroup.cuh's NpfWgmma is written over them), with every pair's
# instantiations: one library.
FLASH_EMULATED_SOURCE = WARPGROUP_PRIMITIVES + PRELUDE + read_source("flash.cu")
# Multiply-adds may fuse here (unlike the common module's element-wise kernels, whose roundings follow
# the reference's separate CuPy kernels): a tile product is a reduction whose order differs from the
# reference's matmul anyway, and FMA halves its instruction count.
FLASH_NVRTC_OPTIONS = ("--fmad=true",)
FLASH_WGMMA_NVRTC_OPTIONS = FLASH_NVRTC_OPTIONS + WARPGROUP_NVRTC_OPTIONS
