"""Dropout's mask in parts side by side, each made in a small reused buffer (reference:
:mod:`npformer.ops.dropout`).

The mask is a function of (seed, n) alone: splitmix64 of seed + n * golden, kept when its top 24
bits reach ``keep_threshold(p)``. :class:`KeepMask` draws the seed once and then makes any run of
elements on its own, in any order, from any thread: the threads of the dropout here, the attention
kernel's blocks. It runs the reference's arithmetic over :data:`MASK_BLOCK` elements at a time in
two uint64 buffers kept per thread, where the reference makes several whole-size uint64
temporaries: 2.4-2.7 ns an element against 3.2-3.8 for the reference's own :func:`keep_bits` called
block by block, and 34 once glibc's thresholds put each block's temporaries in fresh pages
(``npformer.bench.harness.fix_malloc_thresholds``; 2M elements, one core of the development VM).
The mask is the reference's bit for bit, and the caller's generator advances by the seed's two
draws, whatever the number of parts (tested).

The mask is kept as booleans with the scale 1 / (1 - p) beside it (a scalar of the accumulation
dtype), as the reference keeps it; the forward's ``x * keep * scale`` runs block by block, each block
right after its mask, over the threads. ``forward_with`` takes that product as an argument, so the
compiled CPU path (:mod:`npformer.kernels.numba_cpu.dropout`) reuses the rest. The backward has no
NumPy fast path: the reference's ``dout * keep * scale`` was faster than any blocking of it measured
here.
"""
from __future__ import annotations

import functools
import threading

import numpy

from npformer.kernels.cpu import numpy_floats
from npformer.kernels.cpu.blocks import BLOCK_ELEMENTS, MIN_THREAD_ELEMENTS
from npformer.kernels.cpu.threads import run_parallel, split, threads_for
from npformer.ops.dropout import (SPLITMIX64, DropoutCache, dropout_active, dropout_mask, draw_seed, keep_scale,
                                  keep_scaled, keep_threshold)

__all__ = ["MIN_BLOCKED_ELEMENTS", "MASK_BLOCK", "numpy_generator", "accepts", "apply_keep", "KeepMask", "draw_keep",
           "forward_with", "dropout_forward"]

# Below this many elements the reference's whole-array pass is as fast or faster: this path's fixed
# cost (the parts, the thread hand-off, the buffers) is about 50 us, and the two met between 16K and
# 32K elements (16384: 94-150 against 80-136 us; 32768: 139-290 against 518-824, float32, p 0.1,
# medians of alternating runs on one core of the development VM). numba's compiled loop is the faster
# at every size and takes them all.
MIN_BLOCKED_ELEMENTS = 1 << 15
MASK_BLOCK = 1 << 14                # elements a buffer holds: 128 KB of uint64, two per thread in L2
_GOLDEN, _MIX1, _MIX2 = (numpy.uint64(c) for c in SPLITMIX64)
_scratch = threading.local()        # .buffers: the thread's two uint64 buffers for KeepMask.stream


def numpy_generator(rng) -> bool:
    """Whether ``rng`` is a NumPy Generator (the seed is drawn on the host)."""
    return isinstance(rng, numpy.random.Generator)


def accepts(x, rng) -> bool:
    """A NumPy float array of at least :data:`MIN_BLOCKED_ELEMENTS` and a NumPy Generator (the
    dropout op's ``x`` and ``rng``)."""
    return numpy_floats(x) and x.size >= MIN_BLOCKED_ELEMENTS and numpy_generator(rng)


def apply_keep(out, x, keep, scale) -> None:
    """``out = x * keep * scale`` (keep booleans, scale a scalar of x's accumulation dtype), in ``out``:
    the reference's :func:`~npformer.ops.dropout.keep_scaled`, the product in the scale's dtype and
    rounded to out's."""
    numpy.multiply(x, keep, out=out)
    numpy.multiply(out, scale, out=out, dtype=scale.dtype)


@functools.cache
def _golden_steps(size: int):
    """n * golden (mod 2^64) for n = 0 .. size - 1: a block's hash inputs less its first."""
    return numpy.arange(size, dtype=numpy.uint64) * _GOLDEN


def _buffers(size: int) -> tuple:
    """This thread's two uint64 buffers of at least ``size`` entries (made once, kept)."""
    buffers = getattr(_scratch, "buffers", None)
    if buffers is None or buffers[0].size < size:
        buffers = _scratch.buffers = (numpy.empty(size, numpy.uint64), numpy.empty(size, numpy.uint64))
    return buffers


class KeepMask:
    """The keep-mask m = [u >= p] for one seed drawn from ``rng``, written part by part.

    ``stream(start)`` returns a function that writes the mask of the next ``out.size`` elements into
    the flat, contiguous bool array ``out`` at each call, from element ``start`` on (a subclass may
    write them another way: the compiled CPU path's does). Parts may be written in any order, from
    any thread.
    """

    def __init__(self, rng, p: float):
        self.seed = int(draw_seed(rng, numpy.empty(0), numpy))
        self.threshold = numpy.uint64(keep_threshold(p))

    def first_counter(self, start: int) -> int:
        """seed + start * golden (mod 2^64): the hash's input at element ``start``."""
        return (self.seed + start * SPLITMIX64[0]) % (1 << 64)

    def stream(self, start: int):
        position = [start]

        def write(out) -> None:
            block = MASK_BLOCK
            z_all, t_all = _buffers(block)
            for i in range(0, out.size, block):
                part = out[i:i + block]
                z, t = z_all[:part.size], t_all[:part.size]
                # z = seed + n golden for n = position ..., then ops.dropout.keep_bits's mixing, in place
                numpy.add(_golden_steps(block)[:part.size], numpy.uint64(self.first_counter(position[0])), out=z)
                numpy.right_shift(z, 30, out=t)
                z ^= t
                z *= _MIX1
                numpy.right_shift(z, 27, out=t)
                z ^= t
                z *= _MIX2
                z >>= numpy.uint64(40)
                numpy.greater_equal(z, self.threshold, out=part)
                position[0] += part.size
        return write


def _parts(size: int) -> list[tuple[int, int]]:
    """One run of elements per thread (each at least MIN_THREAD_ELEMENTS long)."""
    return split(size, threads_for(size, MIN_THREAD_ELEMENTS))


def draw_keep(mask: KeepMask, keep) -> None:
    """The whole mask into the C-contiguous bool array ``keep``, in one part per thread."""
    flat = keep.reshape(-1)
    run_parallel([lambda a=a, b=b: mask.stream(a)(flat[a:b]) for a, b in _parts(flat.size)])


def forward_with(apply, mask_type: type, x, p: float, rng, training: bool):
    """The forward below with ``apply(out, x, keep, scale)`` for ``out = x * keep * scale`` and the
    mask drawn by ``mask_type`` (:class:`KeepMask` or a subclass; the compiled CPU path passes its own)."""
    if not dropout_active(x, p, rng, training):
        return x.copy(), DropoutCache.identity(x)
    if p == 1.0:                                         # nothing kept, nothing drawn: the reference's mask
        keep, scale = dropout_mask(x, p, rng)
        return keep_scaled(x, keep, scale), DropoutCache(keep, scale, x.shape, x.dtype)
    scale = keep_scale(p, x.dtype)
    mask = mask_type(rng, p)
    keep = numpy.empty(x.shape, dtype=bool)              # (same as x)
    out = numpy.empty(x.shape, dtype=x.dtype)            # (same as x)
    flat_x, flat_k, flat_o = x.reshape(-1), keep.reshape(-1), out.reshape(-1)

    def run(a: int, b: int) -> None:                     # elements [a, b)
        write = mask.stream(a)
        for i in range(a, b, BLOCK_ELEMENTS):
            j = min(i + BLOCK_ELEMENTS, b)
            write(flat_k[i:j])
            apply(flat_o[i:j], flat_x[i:j], flat_k[i:j], scale)

    run_parallel([lambda a=a, b=b: run(a, b) for a, b in _parts(x.size)])
    return out, DropoutCache(keep, scale, x.shape, x.dtype)


def dropout_forward(x, p: float, rng=None, training: bool = True):
    return forward_with(apply_keep, KeepMask, x, p, rng, training)

