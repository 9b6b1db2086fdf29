"""Data parallelism for a model with hand-written gradients: every rank holds the whole model, takes
its rows of each batch, and the ranks sum their weighted gradients before the same optimiser step.

Why it is exact. A mean loss over the global batch is ``L = (1/N) sum_i l_i`` over its N counted
targets (tokens not ignored). Rank r computes the mean over its own ``n_r`` targets,
``L_r = (1/n_r) sum_{i in r} l_i``, and its gradient ``g_r``. Then

    L = sum_r (n_r / N) L_r        and        g = sum_r (n_r / N) g_r

so each rank scales its gradient by ``w_r = n_r / N`` while packing it (:mod:`.buckets`) and the
all-reduce *sums*. With equal counts (a GPT's blocks, BERT's masked positions) ``w_r = 1 / ranks``,
the plain average; with padding (a Seq2Seq's targets) the weights differ, and the result is still
the one-process gradient of the joined batch, not an average of per-rank means. ``N`` comes from a
small all-reduce of ``(n_r, n_r L_r, tokens_r, ...)`` just before the gradients'.

A step, on every rank::

    batch = its rows of the global batch                  sampler.take_shard
    forward, loss, backward                                the model's own code, unchanged
    loss, tokens = dp.reduce_gradients(loss, n_r, tokens)  stats, then the gradient buckets
    clip, optimiser step, zero the grads                   identical on every rank: same grads in

Communicated per step: the gradients once (every parameter's, in its dtype, tied weights once),
plus 5 float64 numbers. An all-reduce of B bytes over a ring sends and receives about
``2 (ranks - 1) / ranks * B`` per rank.

At the start (:class:`DataParallel`): the ranks check that they hold the same model, the same
parameter names, shapes and dtypes and the same ``config`` (the JSON of rank 0 is broadcast and
compared, :func:`check_same_config`), then rank 0's parameters are broadcast to every rank.

Dropout: each rank draws its masks from its own stream, ``(seed, step, rank)``
(:meth:`DataParallel.dropout_seed`); with one rank the stream is ``(seed, step)``, as in a
one-process run.
"""
from __future__ import annotations

import json
from typing import Any, NamedTuple

import numpy

from npformer.backend import get_backend, to_device, to_numpy
from npformer.distributed.buckets import DEFAULT_BUCKET_BYTES, Buckets
from npformer.distributed.communicator import Communicator
from npformer.distributed.sampler import take_shard
from npformer.errors import DistributedError, InputTypeError
from npformer.nn.flat import flat_parameters
from npformer.nn.module import Module

__all__ = ["DataParallel", "ReducedStep", "check_same_config", "gather_rows"]


class ReducedStep(NamedTuple):
    """A step's numbers over every rank: the global mean ``loss``, the ``count`` of targets it
    averaged and the ``tokens`` processed."""

    loss: float
    count: int
    tokens: int


def check_same_config(comm: Communicator, config: dict, xp: Any) -> None:
    """Every rank must pass an equal ``config`` (a JSON-able dict); otherwise every rank raises a
    DistributedError, a differing rank naming the keys and both values. Collective."""
    mine = json.dumps(config, sort_keys=True, default=str).encode()
    length = comm.broadcast(xp.asarray([len(mine)], dtype=xp.int64))
    root = xp.zeros(int(length[0]), dtype=xp.uint8)                 # rank 0's JSON, as bytes
    if comm.rank == 0:
        root[...] = to_device(numpy.frombuffer(mine, dtype=numpy.uint8), comm.backend)
    theirs = to_numpy(comm.broadcast(root)).tobytes()
    differs = xp.zeros(comm.size, dtype=xp.int64)
    differs[comm.rank] = theirs != mine
    comm.all_reduce(differs)
    ranks = [r for r, d in enumerate(differs.tolist()) if d]
    if not ranks:
        return
    if comm.rank not in ranks:
        raise DistributedError(f"ranks {ranks} were started with another model or config than rank 0 (their "
                               f"messages name the settings); every rank must run the same command")
    root_config, own = json.loads(theirs.decode()), json.loads(mine.decode())
    diffs = [f"{k}: rank 0 has {_short(root_config.get(k))}, rank {comm.rank} has {_short(own.get(k))}"
             for k in sorted(set(own) | set(root_config)) if root_config.get(k) != own.get(k)]
    raise DistributedError(f"rank {comm.rank} holds another model or config than rank 0: " + "; ".join(diffs)
                           + "; every rank must run the same command")


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def gather_rows(comm: Communicator, local: Any) -> Any:
    """The ranks' ``local`` arrays (equal shapes) stacked along the first axis in rank order, on every
    rank: each writes its rows into a zero array of the global shape and an all-reduce sums them
    (``ranks`` times the bytes of an all-gather, for rare calls such as a checkpoint). Collective."""
    xp = get_backend(comm.backend)
    b = local.shape[0]
    out = xp.zeros((comm.size * b,) + tuple(local.shape[1:]), dtype=local.dtype)
    out[comm.rank * b:(comm.rank + 1) * b] = local
    return comm.all_reduce(out)


def _flatten(config: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class DataParallel:
    """``DataParallel(model, comm, config=None, bucket_bytes=4 MiB)``: ``model`` trained over the ranks
    of ``comm`` (module docstring). Checks that every rank holds the same model and ``config``, then
    broadcasts rank 0's parameters. Collective, as is every method but :meth:`shard` and
    :meth:`dropout_seed`.

    A custom loop (launched with ``mpirun -n N python loop.py``)::

        comm = MPICommunicator()
        dp = DataParallel(model, comm)                     # same weights everywhere from here on
        for step in range(1, steps + 1):
            model.manual_seed(dp.dropout_seed(seed, step))
            x, y = dp.shard(*draw_global_batch(default_rng((seed, step))))
            loss, cache = cross_entropy_forward(model(x), y)
            model.backward(cross_entropy_backward(xp.ones((), x.dtype), cache))
            loss = dp.reduce_gradients(float(loss), y.size).loss    # the global batch's loss
            clip_grad_norm(model.parameters(), 1.0); opt.step(); model.zero_grad()
    """

    def __init__(self, model: Module, comm: Communicator, *, config: dict | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        if not isinstance(model, Module):
            raise InputTypeError(f"model: expected an npformer Module, got {type(model).__name__}")
        if comm.backend != model.backend:
            raise InputTypeError(f"the communicator moves {comm.backend} arrays but the model lives on "
                                 f"{model.backend}: use MPICommunicator for numpy, nccl_world for cupy")
        self.model, self.comm, self.bucket_bytes = model, comm, bucket_bytes
        self.xp = get_backend(model.backend)
        self.names, self.params = zip(*model.named_parameters())
        model_config = getattr(model, "config", None)
        check_same_config(comm, _flatten({
            "model": type(model).__name__,
            "model_config": model_config.to_dict() if hasattr(model_config, "to_dict") else None,
            "parameters": [f"{n} {p.shape} {p.dtype}" for n, p in zip(self.names, self.params)],
            "config": config or {}}), self.xp)
        data = [p.data for p in self.params]
        Buckets(data, bucket_bytes).broadcast(comm, data, root=0)
        self._grad_buckets: dict[tuple[int, ...], Buckets] = {}

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def size(self) -> int:
        return self.comm.size

    def shard(self, *arrays: Any) -> tuple[Any, ...]:
        """This rank's rows of the global batch's ``arrays`` (:func:`~.sampler.take_shard`)."""
        return take_shard(arrays, self.rank, self.size)

    def dropout_seed(self, seed: Any, step: int) -> tuple:
        """This rank's dropout stream at ``step``: ``(seed, step, rank)``; ``(seed, step)`` with one rank."""
        return (seed, step) if self.size == 1 else (seed, step, self.rank)

    def gradient_bytes(self) -> int:
        """Bytes of gradients one step all-reduces (every parameter's, tied ones once)."""
        return sum(p.data.nbytes for p in self.params)

    def _flat_gradients(self) -> list | None:
        """The model's flat gradient buffers (:mod:`npformer.nn.flat`) when every gradient present is
        its slot's view, so that reducing the buffers in place reduces the gradients without a packing
        copy (a slot without a gradient holds zeros after ``zero_grad``); None otherwise."""
        flat = flat_parameters(self.model)
        if flat is None:
            return None
        for b in flat.buffers:
            for p, slot in zip(b.params, b.slots):
                if p.grad is not None and p.grad is not slot.grad:
                    return None
        return [buf for _, buf in flat.gradients()]

    def reduce_gradients(self, loss: float = 0.0, count: int = 1, tokens: int = 0) -> ReducedStep:
        """Replace every gradient by the global batch's (``sum_r (n_r / N) g_r``) and return the step's
        global numbers. ``loss`` is this rank's mean loss over its ``count`` targets, ``tokens`` the
        tokens it processed. Every rank must have gradients for the same parameters."""
        present = tuple(i for i, p in enumerate(self.params) if p.grad is not None)
        k = len(present)
        stats = self.xp.asarray([count, loss * count, tokens, k, k * k], dtype=self.xp.float64)
        total, loss_sum, all_tokens, k_sum, k2_sum = (float(v) for v in self.comm.all_reduce(stats).tolist())
        if k2_sum * self.size != k_sum * k_sum:        # Cauchy-Schwarz: equal only when every k is equal
            raise DistributedError(f"rank {self.rank} has gradients for {k} parameters, other ranks for "
                                   "another number: every rank's backward must reach the same parameters")
        weight = count / total if total else 0.0
        flat = self._flat_gradients()
        if flat is not None:             # the gradients already lie in flat buffers: reduce slices of them
            for buf in flat:
                buf *= weight
                step = max(1, self.bucket_bytes // buf.itemsize)
                for start in range(0, buf.size, step):
                    self.comm.all_reduce(buf[start:start + step])
        else:                            # pack them into buckets, reduce, unpack
            grads = [self.params[i].grad for i in present]
            if present not in self._grad_buckets:
                self._grad_buckets[present] = Buckets(grads, self.bucket_bytes)
            self._grad_buckets[present].all_reduce(self.comm, grads, scale=weight)
        return ReducedStep(loss_sum / total if total else 0.0, int(total), int(all_tokens))
