"""Dropout's ``x * keep * scale`` as one compiled loop (reference: :mod:`npformer.ops.dropout`).

The mask is drawn as the NumPy fast path draws it (:mod:`npformer.kernels.cpu.dropout`: raw PCG64
bits, parts side by side, the reference's mask bit for bit); NumPy's ``x * keep`` casts the booleans
through a buffer and then scales in a second pass, here both are one loop that reads x and the mask
once. The product is the reference's exactly: a kept entry is ``x * scale``, a dropped one ``x * 0``
(so inf or NaN there still gives NaN, as in the reference and PyTorch). No fast-math: bit for bit.
"""
from __future__ import annotations

from numba import njit

from npformer.kernels.cpu import dropout as cpu_dropout

__all__ = ["apply_keep", "dropout_forward", "dropout_backward"]


@njit(nogil=True, error_model="numpy", cache=True)
def _apply_keep(out, x, keep, scale, zero):
    for i in range(x.size):
        out[i] = x[i] * (scale if keep[i] else zero)


def apply_keep(out, x, keep, scale) -> None:
    """``out = x * keep * scale`` in ``out`` (may be x): arrays of one shape, float32/float64 (the
    NumPy version runs for arrays that are not all C-contiguous)."""
    if not (out.flags.c_contiguous and x.flags.c_contiguous and keep.flags.c_contiguous):
        cpu_dropout.apply_keep(out, x, keep, scale)
        return
    _apply_keep(out.reshape(-1), x.reshape(-1), keep.reshape(-1), scale, x.dtype.type(0))


def dropout_forward(x, p: float, rng=None, training: bool = True):
    return cpu_dropout.forward_with(apply_keep, x, p, rng, training)


def dropout_backward(dout, cache):
    return cpu_dropout.backward_with(apply_keep, dout, cache)
