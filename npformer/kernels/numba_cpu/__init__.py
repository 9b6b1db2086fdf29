"""CPU fast paths compiled by numba (the optional ``fast`` extra: ``pip install "npformer[fast]"``).

The NumPy fast paths (:mod:`npformer.kernels.cpu`) still make one pass over memory per ufunc; a GELU
is about 25 of them. Here each op is one loop over its rows, compiled to machine code, that reads
its inputs once and writes its outputs once, every intermediate in registers:

* :mod:`~npformer.kernels.numba_cpu.vector_math`: exp, sigmoid and the float32 erf as plain
  arithmetic, so the compiler vectorises the loops that call them;
* :mod:`~npformer.kernels.numba_cpu.activations`: GELU (exact and tanh) forward and backward;
* :mod:`~npformer.kernels.numba_cpu.softmax`: softmax and log-softmax rows, forward and backward;
* :mod:`~npformer.kernels.numba_cpu.layernorm`: layer norm, the row statistics and the update in
  one pass over each row;
* :mod:`~npformer.kernels.numba_cpu.cross_entropy`: the loss and its gradient, one pass over each
  row of logits each, no (N, V) temporary;
* :mod:`~npformer.kernels.numba_cpu.dropout`: dropout's counter-based keep-mask hashed, compared
  and written in one loop (the masks of the dropout and attention paths here), and its product
  ``x * keep * scale``, each way;
* :mod:`~npformer.kernels.numba_cpu.attention`: the NumPy attention fast path's blocks with these
  softmax loops inside;
* :mod:`~npformer.kernels.numba_cpu.optim`: Adam's update in one pass over the flat buffers, and the
  float64 sum of squares.

Each has its reference op's signature and cache type, is registered before the NumPy fast path in
:mod:`npformer.kernels` when numba is installed, and is held to the reference by
``tests/kernels/numba_cpu``. ``with npformer.kernels.disabled("numba"):`` runs the NumPy fast
paths instead. Rows are shared out between :mod:`~npformer.kernels.cpu.threads`' threads (the
compiled loops release the GIL) in parts that depend only on the shape and thread count.
Float32 and float64 arrays only (16-bit floats take the NumPy fast paths), but for the
cross-entropy, which reads 16-bit logits through a float32 copy as the reference does.

The loops are compiled on first use and cached on disk beside their modules (numba's
``cache=True``: later processes load them in milliseconds). Numba keys that cache on the file of
each loop's own module only: after editing :mod:`~npformer.kernels.numba_cpu.vector_math` (inlined
into the others), delete ``npformer/kernels/numba_cpu/__pycache__/*.nb[ic]``.
"""
from __future__ import annotations

import importlib.util
from typing import Any

import numpy

__all__ = ["AVAILABLE", "numba_floats", "accepts_adam"]

AVAILABLE = importlib.util.find_spec("numba") is not None
FLOATS = (numpy.dtype(numpy.float32), numpy.dtype(numpy.float64))


def numba_floats(*arrays: Any) -> bool:
    """True when numba is installed and every argument that is not None is a NumPy float32/float64
    array (anything else goes to the next implementation, which gives the errors)."""
    if not AVAILABLE:
        return False
    # exactly ndarray: a subclass (numpy.matrix, a masked array) may give * and @ other meanings
    return all(a is None or type(a) is numpy.ndarray and a.dtype in FLOATS for a in arrays)


def accepts_adam(param, grad, exp_avg, exp_avg_sq, *, param_copy=None, **hyperparameters) -> bool:
    """float32/float64 C-contiguous buffers of one dtype, and no 16-bit copy to write."""
    arrays = (param, grad, exp_avg, exp_avg_sq)
    return (param_copy is None and numba_floats(*arrays) and all(a.flags.c_contiguous for a in arrays)
            and len({a.dtype for a in arrays}) == 1)
