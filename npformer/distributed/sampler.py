"""The rank's share of a global batch: N ranks with b rows each see exactly the N b rows one process
would draw.

Every rank draws the *whole* global batch of a step from the same seeded generator (the trainers use
``default_rng((seed, step))``, passed in), exactly as a single process with batch N b does, and keeps
rows ``[rank b, (rank + 1) b)`` of it. Drawing indices or a few thousand token ids is cheap next to a
forward pass, and it makes the sharding exact: concatenating the ranks' shards in rank order gives
the one-process batch row for row, whatever the sampler does (sampling without replacement, masking
BERT's tokens, Transformer-XL's segments).
"""
from __future__ import annotations

from typing import Any

from npformer.checks import non_negative_int, positive_int
from npformer.errors import RangeError

__all__ = ["shard_rows", "take_shard"]


def shard_rows(global_batch: int, rank: int, size: int) -> slice:
    """Rows ``[rank b, (rank + 1) b)`` with ``b = global_batch / size``; a RangeError when ``size`` does
    not divide ``global_batch`` (every rank must hold the same number of rows)."""
    positive_int(global_batch, "global batch")
    positive_int(size, "size")
    if non_negative_int(rank, "rank") >= size:
        raise RangeError(f"rank: expected 0 .. {size - 1} for {size} ranks, got {rank}")
    if global_batch % size:
        raise RangeError(f"batch size (--batch-size) {global_batch} is not divisible by the {size} ranks: each "
                         f"rank takes batch / ranks rows of every batch; give a multiple of {size}, such as "
                         f"{global_batch - global_batch % size or size}")
    b = global_batch // size
    return slice(rank * b, (rank + 1) * b)


def take_shard(arrays: tuple[Any, ...], rank: int, size: int) -> tuple[Any, ...]:
    """This rank's rows (first axis) of each of ``arrays``, the global batch's arrays of equal length."""
    rows = shard_rows(len(arrays[0]), rank, size)
    return tuple(a[rows] for a in arrays)
