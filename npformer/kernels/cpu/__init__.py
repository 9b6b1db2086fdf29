"""CPU fast paths for NumPy arrays: the same results as the reference ops, computed with less memory
traffic.

* :mod:`~npformer.kernels.cpu.blocks`: element-wise chains run over cache-sized blocks (optionally on
  several threads) instead of full-size temporaries;
* :mod:`~npformer.kernels.cpu.softmax`: softmax and log-softmax rows in place, block by block;
* :mod:`~npformer.kernels.cpu.rows`: sums along the last axis as ``einsum`` contractions;
* :mod:`~npformer.kernels.cpu.activations`: GELU as one in-place chain per block, with a float32 erf;
* :mod:`~npformer.kernels.cpu.layernorm`: row statistics by ``einsum`` (no squared temporary);
* :mod:`~npformer.kernels.cpu.dropout`: the reference's counter-based mask, hashed in small buffers;
* :mod:`~npformer.kernels.cpu.embedding`: the backward as one segment sum over the rows sorted by id;
* :mod:`~npformer.kernels.cpu.attention`: the softmax and its backward in the score buffer itself;
* :mod:`~npformer.kernels.cpu.optim`: Adam's update and the sum of squares over a flat buffer, block by block.

Each function has its reference op's signature and cache type and is registered against it in
:mod:`npformer.kernels`; :func:`numpy_floats` is the test of which inputs they take.
"""
from __future__ import annotations

from typing import Any

import numpy

__all__ = ["numpy_floats"]

FLOATS = (numpy.dtype(numpy.float16), numpy.dtype(numpy.float32), numpy.dtype(numpy.float64))


def numpy_floats(*arrays: Any) -> bool:
    """True when every argument that is not None is a NumPy array of float16/32/64 (anything else,
    CuPy arrays and bad input included, goes to the reference op, which gives the errors)."""
    # exactly ndarray: a subclass (numpy.matrix, a masked array) may give * and @ other meanings
    return all(a is None or type(a) is numpy.ndarray and a.dtype in FLOATS for a in arrays)
