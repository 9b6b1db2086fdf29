"""Dropout's ``x * keep * scale``, forward and backward, as one compiled loop (reference:
:mod:`npformer.ops.dropout`).

The mask is made in the NumPy fast path's parts (:mod:`npformer.kernels.cpu.dropout`: runs of the
counter-based mask side by side, the reference's bit for bit), each part by one compiled loop that
hashes, compares and writes an element at a time (:func:`write_keep`, no uint64 buffers); NumPy's
``x * keep`` casts the booleans
through a buffer and then scales in a second pass, here both are one loop that reads x and the mask
once (the backward 0.3-0.9x the reference's time from 256K to 2M elements, a thread per
:data:`~npformer.kernels.numba_cpu.rows.CHEAP` elements). The product is the reference's exactly: a
kept entry is ``x * scale``, a dropped one ``x * 0`` (so inf or NaN there still gives NaN, as in the
reference and PyTorch). No fast-math: bit for bit.
"""
from __future__ import annotations

import numpy
from numba import njit, uint64

from npformer.checks import expect_grad
from npformer.kernels.cpu import dropout as cpu_dropout
from npformer.kernels.numba_cpu import numba_floats
from npformer.kernels.numba_cpu.rows import CHEAP, over_rows
from npformer.ops.dropout import SPLITMIX64

__all__ = ["write_keep", "apply_keep", "CompiledKeepMask", "accepts_backward", "dropout_forward", "dropout_backward"]


_GOLDEN, _MIX1, _MIX2 = (numpy.uint64(c) for c in SPLITMIX64)


@njit(nogil=True, cache=True)
def write_keep(keep, counter, threshold) -> None:
    """``keep[i] = splitmix64(counter + i golden) >> 40 >= threshold`` (uint64 arithmetic wraps): the
    reference's :func:`~npformer.ops.dropout.keep_bits` for the elements whose first hash input is
    ``counter``."""
    z0 = uint64(counter)
    for i in range(keep.size):
        z = z0 + uint64(i) * _GOLDEN
        z ^= z >> uint64(30)
        z *= _MIX1
        z ^= z >> uint64(27)
        z *= _MIX2
        keep[i] = (z >> uint64(40)) >= threshold


class CompiledKeepMask(cpu_dropout.KeepMask):
    """:class:`~npformer.kernels.cpu.dropout.KeepMask` with each part made by :func:`write_keep`
    (the same booleans, the caller's generator advanced the same way)."""

    def stream(self, start: int):
        position = [start]

        def write(out) -> None:
            write_keep(out, numpy.uint64(self.first_counter(position[0])), self.threshold)
            position[0] += out.size
        return write


@njit(nogil=True, error_model="numpy", cache=True)
def _apply_keep(out, x, keep, scale, zero, start, stop):
    out, x, keep = out[start:stop], x[start:stop], keep[start:stop]
    for i in range(x.size):
        out[i] = x[i] * (scale if keep[i] else zero)


def apply_keep(out, x, keep, scale) -> None:
    """``out = x * keep * scale`` in ``out`` (may be x): arrays of one shape, float32/float64 (the
    NumPy version runs for arrays that are not all C-contiguous)."""
    if not (out.flags.c_contiguous and x.flags.c_contiguous and keep.flags.c_contiguous):
        cpu_dropout.apply_keep(out, x, keep, scale)
        return
    _apply_keep(out.reshape(-1), x.reshape(-1), keep.reshape(-1), scale, x.dtype.type(0), 0, x.size)


def accepts_backward(dout, cache) -> bool:
    """A float32/float64 NumPy gradient and a stored NumPy keep-mask (or the identity's cache)."""
    keep = getattr(cache, "keep", None)
    return numba_floats(dout) and (type(keep) is numpy.ndarray or not getattr(cache, "dropped", True))


def dropout_forward(x, p: float, rng=None, training: bool = True):
    return cpu_dropout.forward_with(apply_keep, CompiledKeepMask, x, p, rng, training)


def dropout_backward(dout, cache):
    expect_grad(dout, "dout", cache.x_shape, cache.x_dtype)
    if not cache.dropped:
        return dout.copy()
    # fwd: out = x * m / (1 - p)  ->  dx = dout * m / (1 - p); one loop, a thread per CHEAP elements
    g = numpy.ascontiguousarray(dout).reshape(-1)        # (n,)
    dx = numpy.empty_like(g)
    over_rows(_apply_keep, g.size, 1, dx, g, numpy.ascontiguousarray(cache.keep).reshape(-1), cache.scale,
              g.dtype.type(0), per_thread=CHEAP)
    return dx.reshape(dout.shape)
