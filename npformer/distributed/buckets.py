"""Gradient buckets: a list of arrays packed into a few contiguous buffers, each moved in one collective.

One all-reduce per parameter would pay a collective's latency a hundred times a step (a Transformer
has about 16 parameters a layer); one buffer for everything would hold a second copy of the whole
model. Buckets of at most ``bucket_bytes`` sit between (PyTorch's DistributedDataParallel does the
same, with 25 MiB buckets):

    plan:     arrays 0..n-1, in order, grouped into buckets of one dtype and at most bucket_bytes
              (an array larger than that gets a bucket of its own)
    pack:     flat[off_i : off_i + size_i] = scale * a_i.ravel()      for each array i of the bucket
    reduce:   comm.all_reduce(flat)                                     one call per bucket
    unpack:   a_i[...] = flat[off_i : off_i + size_i].reshape(a_i.shape)

**A flat gradient buffer.** A model flattened by :func:`npformer.nn.flatten_parameters` (the
trainers do it) keeps its gradients as views into one contiguous array per dtype; then
:class:`~npformer.distributed.DataParallel` skips this module: it scales that array in place and
all-reduces slices of it of at most ``bucket_bytes``, with no packing copy. The buckets here serve
models that are not flattened, and the broadcast of the parameters at start.

The buckets are reduced in parameter order after the whole backward: npformer's backward is one
synchronous call, so there is no computation left to overlap the communication with.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Sequence

from npformer.backend import get_array_module
from npformer.checks import positive_int
from npformer.distributed.communicator import Communicator
from npformer.errors import InputTypeError

__all__ = ["Bucket", "Buckets", "plan_buckets", "pack", "unpack", "DEFAULT_BUCKET_BYTES"]

DEFAULT_BUCKET_BYTES = 4 * 2 ** 20      # 4 MiB: a few buckets for the benchmark models, one for the small ones


class Bucket(NamedTuple):
    """Arrays ``members`` (indices into the list planned) of one ``dtype``, at ``offsets`` in a flat
    array of ``size`` elements."""

    dtype: str
    members: tuple[int, ...]
    offsets: tuple[int, ...]
    size: int


def plan_buckets(arrays: Sequence[Any], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[Bucket]:
    """Consecutive arrays of one dtype, up to ``bucket_bytes`` a bucket (see the module docstring)."""
    positive_int(bucket_bytes, "bucket_bytes")
    groups: list[list[int]] = []                      # indices of the arrays of each bucket
    for i, a in enumerate(arrays):
        last = groups[-1] if groups else []
        nbytes = sum(arrays[j].nbytes for j in last) + a.nbytes
        if not last or a.dtype != arrays[last[0]].dtype or nbytes > bucket_bytes:
            groups.append([i])
        else:
            last.append(i)
    buckets = []
    for members in groups:
        sizes = [arrays[i].size for i in members]
        offsets = [sum(sizes[:k]) for k in range(len(sizes))]
        buckets.append(Bucket(str(arrays[members[0]].dtype), tuple(members), tuple(offsets), sum(sizes)))
    return buckets


def pack(bucket: Bucket, arrays: Sequence[Any], flat: Any, scale: float = 1.0) -> Any:
    """``flat[off:off + n] = scale * array.ravel()`` for each member; returns ``flat`` (bucket.size,)."""
    xp = get_array_module(flat)
    for i, off in zip(bucket.members, bucket.offsets):
        a = arrays[i]
        segment = flat[off:off + a.size]                                     # (n,) view
        if scale == 1.0:
            segment[...] = a.reshape(-1)
        else:
            xp.multiply(a.reshape(-1), scale, out=segment)
    return flat


def unpack(bucket: Bucket, flat: Any, arrays: Sequence[Any]) -> None:
    """``array[...] = flat[off:off + n]`` for each member, in place (the arrays keep their identity)."""
    for i, off in zip(bucket.members, bucket.offsets):
        a = arrays[i]
        a[...] = flat[off:off + a.size].reshape(a.shape)


class Buckets:
    """The plan and the flat buffers for arrays of fixed shapes and dtypes, reused every step."""

    def __init__(self, arrays: Sequence[Any], bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.layout = [(tuple(a.shape), str(a.dtype)) for a in arrays]
        self.plan = plan_buckets(arrays, bucket_bytes)
        xp = get_array_module(*arrays)
        self.flats = [xp.empty(b.size, dtype=b.dtype) for b in self.plan]

    @property
    def nbytes(self) -> int:
        """Bytes moved by one all-reduce or broadcast of every bucket."""
        return sum(f.nbytes for f in self.flats)

    def _check(self, arrays: Sequence[Any]) -> None:
        layout = [(tuple(a.shape), str(a.dtype)) for a in arrays]
        if layout != self.layout:
            raise InputTypeError(f"buckets planned for {len(self.layout)} arrays got {len(layout)} arrays of "
                                 "other shapes or dtypes; plan new Buckets for them")

    def all_reduce(self, comm: Communicator, arrays: Sequence[Any], scale: float = 1.0, op: str = "sum") -> None:
        """Every array replaced in place by ``op`` over the ranks of ``scale * array``."""
        self._check(arrays)
        for bucket, flat in zip(self.plan, self.flats):
            comm.all_reduce(pack(bucket, arrays, flat, scale), op)
            unpack(bucket, flat, arrays)

    def broadcast(self, comm: Communicator, arrays: Sequence[Any], root: int = 0) -> None:
        """Every array replaced in place by rank ``root``'s."""
        self._check(arrays)
        for bucket, flat in zip(self.plan, self.flats):
            comm.broadcast(pack(bucket, arrays, flat), root)
            unpack(bucket, flat, arrays)
