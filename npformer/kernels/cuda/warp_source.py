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
"""
from __future__ import annotations

from npformer.kernels.cuda.files import read_source

__all__ = ["WARP_PRIMITIVES"]

WARP_PRIMITIVES = read_source("warp.cuh")
