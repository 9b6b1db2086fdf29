"""The CUDA C of the optimiser kernels (:mod:`npformer.kernels.cuda.optim`), appended to the one
kernel source (:mod:`npformer.kernels.cuda.source`, whose helpers it uses: ``NPF_FOR_EACH``,
``npf_sqrt``, ``npf_load``/``npf_store``, ``npf_block_sum``).

Adam runs in the parameter's own type (float or double; float16 parameters take the reference op,
which computes in float16), each operation written as its own statement in the reference's order,
and the module is compiled with ``--fmad=false``, so every element is rounded exactly as the
reference op's sequence of NumPy/CuPy operations rounds it: the same bits.
"""
from __future__ import annotations

from npformer.kernels.cuda.files import read_source

__all__ = ["OPTIM_SOURCE", "SQUARES_THREADS"]

SQUARES_THREADS = 256   # threads per block of the sum-of-squares kernel (a power of two)

OPTIM_SOURCE = read_source("optim.cu")
