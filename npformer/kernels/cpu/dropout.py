"""Dropout's mask for NumPy's default bit generator (PCG64) from its raw bits, in parts drawn side by
side (reference: :mod:`npformer.ops.dropout`).

Drawing the float32 uniforms is most of dropout's cost. NumPy builds a float32 uniform as
(b >> 8) * 2^-24 from each 32-bit half b of a 64-bit draw (low half first), so u >= p exactly when
b >= ceil(p * 2^24) * 2^8: one integer comparison per element skips the float conversion.

The reference draws one uniform per element in C order. Element e comes from 64-bit draw e // 2, so
the mask of elements [a, b), a even, is the comparison of draws a/2 onwards: a copy of the
generator advanced by a/2 (``PCG64.advance``, a jump, not a loop) draws it. :class:`KeepMask` hands
out such parts, to the threads of the dropout here and to the attention kernel's blocks; at the end
the caller's generator is advanced past all of them. The mask is the reference's bit for bit and the
generator ends in the same state, whatever the number of parts (tested). Other generators, odd
sizes, or a PCG64 holding a spare 32-bit half run the reference.

The mask is kept as booleans with the scale 1 / (1 - p) beside it, as the reference keeps it; the
forward's ``x * keep * scale`` runs block by block, each block right after its mask, over the
threads. ``forward_with`` takes that product as an argument, so the compiled CPU path
(:mod:`npformer.kernels.numba_cpu.dropout`) reuses the rest. The backward has no NumPy fast path:
the reference's ``dout * keep * scale`` was faster than any blocking of it measured here.
"""
from __future__ import annotations

import math
import threading

import numpy

from npformer.kernels.cpu import numpy_floats
from npformer.kernels.cpu.blocks import BLOCK_ELEMENTS, MIN_THREAD_ELEMENTS
from npformer.kernels.cpu.threads import run_parallel, split, threads_for
from npformer.ops.dropout import DropoutCache, dropout_active, dropout_mask, keep_scale

__all__ = ["MIN_STREAM_ELEMENTS", "accepts", "streamable", "apply_keep", "KeepMask", "draw_keep", "forward_with",
           "dropout_forward"]

# Below this many elements the reference's one ``rng.random`` call is the faster: this path's fixed
# cost (the generator's state copied and advanced per part, the mask's parts) is about 40 us, and
# the two met at 16-24K elements (1024: 60 against 21 us; 16384: 95-109 against 92; 32768: 117-138
# against 194, numba and NumPy paths, float32, p 0.1, one core of the development VM). The choice
# follows the size alone, and both give the same bits.
MIN_STREAM_ELEMENTS = 1 << 14

_scratch = threading.local()        # .pcg64: the thread's generator for KeepMask.draws_from


def streamable(rng, size: int) -> bool:
    """Whether :class:`KeepMask` reproduces ``rng``'s next ``size`` float32 uniforms."""
    bitgen = getattr(rng, "bit_generator", None)
    return type(bitgen) is numpy.random.PCG64 and size % 2 == 0 and not bitgen.state["has_uint32"]


def accepts(x, rng) -> bool:
    """A NumPy float array of at least :data:`MIN_STREAM_ELEMENTS`, with a PCG64 generator whose next
    draws this path reproduces (the dropout op's ``x`` and ``rng``)."""
    return numpy_floats(x) and x.size >= MIN_STREAM_ELEMENTS and streamable(rng, x.size)


def apply_keep(out, x, keep, scale) -> None:
    """``out = x * keep * scale`` (keep booleans, scale a scalar of x's dtype), in ``out``."""
    numpy.multiply(x, keep, out=out)
    out *= scale


class KeepMask:
    """The keep-mask m = [u >= p] of the next ``size`` uniforms of ``rng`` as booleans, written part
    by part.

    ``stream(start)`` (``start`` even) returns a function that writes the mask of the next
    ``out.size`` elements into the flat, contiguous bool array ``out`` at each call, from element
    ``start`` on (a subclass may write them another way: the compiled CPU path's does).
    Parts may be written in any order, from any thread. ``finish()`` advances ``rng`` past the
    ``size`` uniforms, as drawing them would have.
    """

    def __init__(self, rng, size: int, p: float):
        # u = (b >> 8) 2^-24 >= float32(p)  <=>  b >= ceil(float32(p) 2^24) 2^8, b a 32-bit half of a draw
        self.threshold = numpy.uint32(math.ceil(float(numpy.float32(p)) * 2.0 ** 24) << 8)
        self.bitgen, self.size = rng.bit_generator, size
        self.state = self.bitgen.state

    def draws_from(self, start: int) -> numpy.random.PCG64:
        """A copy of the generator advanced to element ``start`` (even): draw ``start // 2`` on. The
        copy is this thread's scratch generator, given the state anew at each call (making one seeds
        it, 24 us, more than a small mask's draws): it holds until this thread's next call here."""
        draws = getattr(_scratch, "pcg64", None)
        if draws is None:
            draws = _scratch.pcg64 = numpy.random.PCG64(0)
        draws.state = self.state
        draws.advance(start // 2)
        return draws

    def stream(self, start: int):
        draws = self.draws_from(start)

        def write(out) -> None:                          # out.size even but for the mask's last part
            for i in range(0, out.size, BLOCK_ELEMENTS):
                part = out[i:i + BLOCK_ELEMENTS]
                halves = draws.random_raw(-(-part.size // 2)).view(numpy.uint32)[:part.size]
                numpy.greater_equal(halves, self.threshold, out=part)
        return write

    def finish(self) -> None:
        self.bitgen.advance(self.size // 2)


def _parts(size: int) -> list[tuple[int, int]]:
    """One run of elements per thread (each at least MIN_THREAD_ELEMENTS long), starting at even offsets."""
    return split(size, threads_for(size, MIN_THREAD_ELEMENTS), multiple=2)


def draw_keep(mask: KeepMask, keep) -> None:
    """The whole mask into the C-contiguous bool array ``keep`` (``mask.size`` entries), in one
    part per thread, then ``mask.finish()``."""
    flat = keep.reshape(-1)
    run_parallel([lambda a=a, b=b: mask.stream(a)(flat[a:b]) for a, b in _parts(flat.size)])
    mask.finish()


def forward_with(apply, mask_type: type, x, p: float, rng, training: bool):
    """The forward below with ``apply(out, x, keep, scale)`` for ``out = x * keep * scale`` and the
    mask drawn by ``mask_type`` (:class:`KeepMask` or a subclass; the compiled CPU path passes its own)."""
    if not dropout_active(x, p, rng, training):
        return x.copy(), DropoutCache.identity(x)
    if p == 1.0:                                         # nothing kept, nothing drawn: the reference's mask
        keep, scale = dropout_mask(x, p, rng)
        return x * keep * scale, DropoutCache(keep, scale, x.shape, x.dtype)
    scale = keep_scale(p, x.dtype)
    mask = mask_type(rng, x.size, p)
    keep = numpy.empty(x.shape, dtype=bool)              # (same as x)
    out = numpy.empty(x.shape, dtype=x.dtype)            # (same as x)
    flat_x, flat_k, flat_o = x.reshape(-1), keep.reshape(-1), out.reshape(-1)

    def run(a: int, b: int) -> None:                     # elements [a, b), a even
        write = mask.stream(a)
        for i in range(a, b, BLOCK_ELEMENTS):            # (blocks of even size)
            j = min(i + BLOCK_ELEMENTS, b)
            write(flat_k[i:j])
            apply(flat_o[i:j], flat_x[i:j], flat_k[i:j], scale)

    run_parallel([lambda a=a, b=b: run(a, b) for a, b in _parts(x.size)])
    mask.finish()
    return out, DropoutCache(keep, scale, x.shape, x.dtype)


def dropout_forward(x, p: float, rng=None, training: bool = True):
    return forward_with(apply_keep, KeepMask, x, p, rng, training)

