"""Warp-level primitives for tensor-core kernels, as CUDA C helpers over inline PTX (the tiny kernels
that test each one, on a GPU and on the CPU through tests/kernels/cuda/emulator.py, are the tests':
tests/kernels/cuda/warp_test.cu).

=============================  ===================================================================
helper                         PTX (sm_80 and later)
=============================  ===================================================================
``npf_mma_16816(d, a, b, c)``  ``mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32``: D (16 x 8,
                               float32) = A (16 x 16, float16) B (16 x 8, float16) + C, one warp,
                               each lane holding its fragment registers (below)
``npf_mma_16816_bf16``         ``mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32``: the same
``(d, a, b, c)``               with A and B bfloat16, in the same fragment layouts
``npf_mma_1688_tf32``          ``mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32``: D (16 x 8,
``(d, a, b, c)``               float32) = A (16 x 8, TF32) B (8 x 8, TF32) + C, one warp
``npf_tf32(x)``                ``cvt.rna.tf32.f32``: float32 x rounded to TF32 (10 mantissa bits,
                               to nearest, ties away from zero), as the 32 bits of an operand
``npf_ldmatrix_x4(r, row)``    ``ldmatrix.sync.aligned.m8n8.x4.shared.b16``: four 8 x 8 16-bit
``npf_ldmatrix_x4_trans``      matrices from shared memory; lane 8 j + i gives the address of row
                               i of matrix j; ``_trans`` loads each transposed
``npf_cp_async_16(dst, src)``  ``cp.async.cg.shared.global``, 16 bytes from global to shared memory
``npf_cp_async_16_zfill``      without the registers in between (``_zfill(dst, src, n)``: the first n
``(dst, src, n)``              bytes, zeros after them: n = 0 reads nothing);
``npf_cp_async_commit()``      ``commit_group`` closes a group, ``wait_group N`` waits until at most
``npf_cp_async_wait<N>()``     N groups are still in flight
``__shfl_xor_sync``            CUDA's own (the emulator provides it): a value from lane ``l ^ m``
=============================  ===================================================================

Fragment layouts (the PTX ISA's tables for m16n8k16 with .f16 or .bf16 inputs, one for both, and .f32
accumulators), with
``g = lane / 4`` and ``t = lane % 4``; a register of two halves holds the lower column (or row) in
its low 16 bits:

* A, 4 registers: ``a[0]`` (row g, columns 2t, 2t+1), ``a[1]`` (row g+8, the same columns),
  ``a[2]`` (row g, columns 2t+8, 2t+9), ``a[3]`` (row g+8, columns 2t+8, 2t+9);
* B, 2 registers: ``b[0]`` (rows k = 2t, 2t+1 of column n = g), ``b[1]`` (rows 2t+8, 2t+9);
* C and D, 4 floats: ``c[0], c[1]`` (row g, columns 2t, 2t+1), ``c[2], c[3]`` (row g+8);
* m16n8k8 with .tf32 inputs (a value a register): A ``a[0]`` (row g, column t), ``a[1]`` (row g+8,
  column t), ``a[2]`` (row g, column t+4), ``a[3]`` (row g+8, column t+4); B ``b[0]`` (row k = t of
  column n = g), ``b[1]`` (row t+4); C and D as above;
* ldmatrix: register j of lane l holds row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1 of matrix j
  (transposed: column l / 4, rows 2 (l % 4) and 2 (l % 4) + 1).

So a 16 x 16 tile of A in shared memory, as four 8 x 8 matrices (rows 0-7 / 8-15, columns 0-7 / 8-15,
in the order of ``a``), is one ``npf_ldmatrix_x4``. On the GPU (``__CUDACC__`` defined) the helpers
are the PTX instructions, for sm_80 and later (compiled for an older GPU they trap; the launchers use
them from compute capability 8.0 on); the emulator supplies its own with the same meaning.

Hopper's warpgroup primitives (``warpgroup.cuh``, :data:`WARPGROUP_PRIMITIVES`; PTX for sm_90a only, which
a module asks for with :data:`WARPGROUP_NVRTC_OPTIONS`; elsewhere they trap):

=======================================  ========================================================
helper                                   PTX (sm_90a)
=======================================  ========================================================
``npf_wgmma_m64n{64,128}k16_ss``         ``wgmma.mma_async.sync.aligned.m64nNk16.f32.f16.f16``
``(d, desc_a, desc_b, accumulate)``      (``_bf16``: ``.bf16``): D (64 x N, float32) = A (64 x 16)
                                         B (16 x N) + D, or without D when ``accumulate`` is 0; one
                                         warpgroup (4 warps, 128 threads); A and B in shared
                                         memory, both K-major, named by descriptors
``npf_wgmma_m64n{64,128}k16_rs<T>``      the same with A in 4 registers a thread; B K-major
``(d, a, desc_b, accumulate)``           (``T`` 0) or N-major (``T`` 1: ``imm-trans-b``)
``NpfWgmma<N, BF16>::ss``, ``::rs<T>``   those, for a kernel templated on N and its type
``npf_wgmma_desc(tile, lbo, sbo)``       the descriptor of a 128-byte-swizzled tile at ``tile``
``npf_wgmma_fence()``                    ``wgmma.fence``: before the first wgmma, and after
                                         registers a wgmma reads were written
``npf_wgmma_commit()``                   ``wgmma.commit_group``: the wgmmas issued so far, a group
``npf_wgmma_wait<N>()``                  ``wgmma.wait_group N``: until at most N groups run
``npf_wgmma_hold<R>(d or a)``            no instruction: after a wait, keeps the compiler from
                                         reading D early or reusing A's registers before it
``npf_fence_async_shared()``             ``fence.proxy.async.shared::cta``: this thread's stores to
                                         shared memory, before a wgmma reads them (then a barrier)
=======================================  ========================================================

Tiles, with the 128-byte swizzle (the PTX ISA's canonical layouts, in bytes from the tile's start, then
the 16-byte chunk's index, bits 4-6 of the shared-memory address, xor its row's, bits 7-9; every
pattern starts on a 1024-byte boundary): K-major (A, and B with ``T`` 0): the value in row r along M or
N and column k along K at ``(r % 8) * 128 + (r / 8) * sbo + 2 k``, so 64 values (128 bytes) a row; a
step of 16 along K is a descriptor 32 bytes further (lbo unused: 16). N-major (B with ``T`` 1): row k
along K, column c along N at ``(k % 8) * 128 + (k / 8) * sbo + (c / 64) * lbo + 2 (c % 64)``; a step
of 16 along K is 16 rows further. With rows of 128 bytes one after another, sbo is 1024.

Fragments: warp w of the warpgroup holds rows 16 w .. 16 w + 15 of D, as mma.sync's m16n8 accumulators
side by side: ``d[4 i + j]`` is m16n8's ``c[j]`` of columns 8 i .. 8 i + 7 (N / 2 floats a thread); A's
registers are m16n8k16's ``a`` of the warp's 16 rows.
"""
from __future__ import annotations

from npformer.kernels.cuda.files import read_source

__all__ = ["WARP_PRIMITIVES", "WARPGROUP_PRIMITIVES", "WARPGROUP_NVRTC_OPTIONS"]

WARP_PRIMITIVES = read_source("warp.cuh")
WARPGROUP_PRIMITIVES = read_source("warpgroup.cuh")
WARPGROUP_NVRTC_OPTIONS = ("-arch=sm_90a",)
"""A module with wgmma is compiled for sm_90a (the architecture-specific target that holds it; CuPy adds its
own ``-arch`` for the device, and NVRTC keeps sm_90a); it runs on compute capability 9.0 only."""
