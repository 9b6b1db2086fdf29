"""The training loop every trainer shares (:class:`Trainer`), the loop behind ``npformer train``.

One step: reseed dropout from (seed, step); draw the batch from (seed, step); forward; fused
cross-entropy; backward; clip by global norm; AdamW with warm-up + cosine learning rate (under mixed
precision: a 16-bit model, float32 master weights, dynamic loss scaling). The model's parameters and
gradients live in flat buffers (:mod:`npformer.nn.flat`), so zeroing, clipping and AdamW are a few
whole-buffer operations. Because the batch and the
dropout masks are functions of (seed, step) alone, a run resumed from a checkpoint repeats an
uninterrupted run's losses exactly. Given a communicator (``mpirun -n N npformer train``), the loop
trains data-parallel (:mod:`npformer.distributed`): ``--batch-size`` is the global batch, each rank
takes its rows of it, the gradients are summed over the ranks before clipping, and rank 0 alone logs,
evaluates and writes checkpoints. Each task's trainer (:mod:`~npformer.training.seq2seq_trainer`,
:mod:`~npformer.training.lm_trainer`, :mod:`~npformer.training.mlm_trainer`,
:mod:`~npformer.training.xl_trainer`) builds its model and says how to draw a batch, compute the loss
and evaluate; :mod:`npformer.training.registry` picks one by model name.
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from npformer.backend import get_backend, set_float32_matmul_precision
from npformer.checks import non_negative_int, one_of, positive_int
from npformer.distributed import Communicator, DataParallel, shard_rows, take_shard
from npformer.errors import DistributedError, InputTypeError, RangeError
from npformer.nn.flat import flatten_parameters
from npformer.ops.cross_entropy import cross_entropy_backward, cross_entropy_forward
from npformer.training.amp import MixedPrecision
from npformer.training.checkpoint import check_checkpoint_path, load_checkpoint, save_checkpoint
from npformer.training.config import CONFIGS, PRECISIONS, TrainConfig
from npformer.training.optim import AdamW, clip_grad_norm
from npformer.training.schedules import cosine_with_warmup

__all__ = ["Trainer"]


class Trainer:
    """The loop shared by every model: seeded steps, AdamW with warm-up + cosine, clipping,
    periodic validation, atomic checkpoints and exact resume. Subclasses build the model and say
    how to draw a batch, compute the loss, evaluate and describe themselves."""

    kind = ""          # the model name (a key of config.CONFIGS), also the checkpoint's kind
    graph_capable = False   # batch() and forward_backward() given, every batch one shape (--cuda-graph)

    def __init__(self, config: TrainConfig, log: Callable[[str], None] = print, comm: Communicator | None = None):
        expected = CONFIGS[self.kind]
        if type(config) is not expected:
            raise InputTypeError(f"config: the {self.kind} trainer trains from a {expected.__name__}, "
                                 f"got a {type(config).__name__}")
        if config.model not in (None, self.kind):
            raise RangeError(f"config.model: expected {self.kind!r} or None for the {self.kind} trainer, "
                             f"got {config.model!r}")
        self.cfg, self.log = config, log
        c = config
        if non_negative_int(c.warmup, "warmup") >= positive_int(c.steps, "steps"):
            raise RangeError(f"steps ({c.steps}) must be greater than warmup ({c.warmup})")
        one_of(c.precision, "precision", PRECISIONS)
        if c.precision != "float32" and c.dtype != "float32":
            raise RangeError(f"--precision {c.precision} keeps float32 master weights: use --dtype float32, "
                             f"not {c.dtype}")
        if c.cuda_graph and not self.graph_capable:
            raise RangeError(f"--cuda-graph: the {self.kind} trainer's batches change shape or carry state from step "
                             "to step; it runs with the GPT models (gpt, gpt1, gpt2)")
        self.xp = get_backend(c.backend)
        if c.backend == "cupy":       # process-wide: float16 accumulates in float32; float32 exact unless --tf32
            set_float32_matmul_precision("tf32" if c.tf32 else "highest", c.backend)
        # data parallel (npformer.distributed): rank 0 logs; the ranks check they run the same model and
        # config and take rank 0's weights (before mixed precision copies them into its masters)
        self.comm, self.rank0 = comm, comm is None or comm.rank == 0
        if comm is not None:
            shard_rows(c.batch_size, comm.rank, comm.size)          # the batch splits evenly, or a RangeError
            self.log = log if self.rank0 else _silent
        self.model = self.build()
        flatten_parameters(self.model)      # one buffer per dtype: the optimiser updates whole runs of it
        self.data_parallel = None if comm is None else DataParallel(self.model, comm, config=asdict(c))
        # mixed precision: the model is rounded to 16 bits, the optimiser updates float32 masters
        self.amp = None if c.precision == "float32" else MixedPrecision(self.model, c.precision)
        params = self.amp.named_parameters() if self.amp else self.model.named_parameters()
        self.opt = AdamW(params, lr=c.lr, weight_decay=c.weight_decay)
        self.step = 0
        self.history: list[dict] = []
        self._graph = None      # the CudaGraphStep of --cuda-graph, made on the first step

    # -- to be provided ------------------------------------------------------------------------------
    def build(self):
        raise NotImplementedError

    def loss_and_backward(self, step: int) -> tuple[float, int]:
        """Draw the batch of ``step``, run forward and backward; returns (loss, tokens)."""
        raise NotImplementedError

    def evaluate(self, limit: int | None = None) -> dict:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def report(self, result: dict, quick: bool) -> str:
        raise NotImplementedError

    def meta(self) -> dict:
        meta = {"kind": self.kind, "step": self.step, "train_config": asdict(self.cfg),
                "model_config": self.model.config.to_dict(), "ranks": self.ranks}
        if self.amp:
            meta["loss_scaler"] = self.amp.scaler.state_dict()
        return meta

    def cross_entropy(self, logits, targets, **kwargs):
        """``(loss, dlogits)``: the cross-entropy of ``logits`` and its gradient, to start the backward.

        Under mixed precision the loss is computed from float32 logits and the gradient is that of
        ``S * loss`` (S the loss scale), rounded to the model's 16-bit dtype; ``amp.step`` divides
        by S again in float32.
        """
        if self.amp is None:
            loss, cache = cross_entropy_forward(logits, targets, **kwargs)
            self._loss_valid = cache.valid     # the targets the mean is over (weights of a data-parallel step)
            return loss, cross_entropy_backward(self.xp.ones((), dtype=logits.dtype), cache)
        loss, cache = cross_entropy_forward(logits.astype(self.xp.float32), targets, **kwargs)
        self._loss_valid = cache.valid
        return loss, cross_entropy_backward(self.amp.scaled_dloss(), cache).astype(self.amp.dtype)

    # -- data parallel (npformer.distributed) -----------------------------------------------------------
    @property
    def ranks(self) -> int:
        return 1 if self.comm is None else self.comm.size

    def local(self, *arrays):
        """This rank's rows of the step's global batch (``arrays`` as drawn for ``--batch-size``
        rows); the arrays themselves in a one-process run."""
        return arrays if self.comm is None else take_shard(arrays, self.comm.rank, self.comm.size)

    def dropout_seed(self, step: int) -> tuple:
        """This step's dropout stream: (seed, step), and the rank's own in a data-parallel run."""
        dp = self.data_parallel
        return dp.dropout_seed(self.cfg.seed, step) if dp else (self.cfg.seed, step)

    def check_ranks(self, meta: dict, path) -> None:
        """A checkpoint resumes on the number of ranks that wrote it (each rank's dropout stream is its own)."""
        saved = int(meta.get("ranks", 1))
        if saved != self.ranks:
            raise DistributedError(f"{path} was written by a run on {saved} rank(s); resume it on {saved} "
                                   f"(mpirun -n {saved}), not {self.ranks}, so it continues exactly")

    def model_state(self) -> dict:
        """The weights a checkpoint keeps: the float32 masters under mixed precision."""
        return self.amp.master_state_dict() if self.amp else self.model.state_dict()

    def load_model_state(self, state, meta: dict) -> None:
        if self.amp:
            self.amp.load_master_state_dict(state)
            if "loss_scaler" in meta:
                self.amp.scaler.load_state_dict(meta["loss_scaler"])
        else:
            self.model.load_state_dict(state)

    # -- one step ----------------------------------------------------------------------------------
    def _lr(self, step: int) -> float:
        c = self.cfg
        return cosine_with_warmup(step, c.lr, c.warmup, c.steps, min_lr=c.min_lr)

    def train_step(self) -> float:
        c, step = self.cfg, self.step + 1
        self.model.train()
        if c.cuda_graph:
            loss, self._tokens = self._graph_step(step)
        else:
            self.model.manual_seed(self.dropout_seed(step))
            loss, self._tokens = self.loss_and_backward(step)
        if self.data_parallel:     # the global batch's gradients on every rank, its loss and token count
            count = int(self._loss_valid.sum())      # read here, not in cross_entropy: a CUDA graph captures that
            loss, _, self._tokens = self.data_parallel.reduce_gradients(loss, count, self._tokens)
        self.opt.lr = self._lr(step)
        if self.amp is None:
            self._grad_norm = clip_grad_norm(self.model.parameters(), c.clip)
            self.opt.step()
            self.model.zero_grad()
        else:            # unscale, skip on inf/NaN (the scale halves), clip, step, round down, zero
            self._grad_norm = self.amp.step(self.opt, max_norm=c.clip).grad_norm
        self.step = step
        return loss

    def _graph_step(self, step: int) -> tuple[float, int]:
        """Forward and backward replayed from a CUDA graph (:mod:`npformer.training.cuda_graph`), the
        loss read after it; the same losses as the eager step. The dropout stream of (seed, step) is
        written into the generator the graph draws from, and the gradients are the arrays the
        capture made, rewritten by every replay (so they are not zeroed between steps)."""
        from npformer.training.cuda_graph import CudaGraphStep, reseed_in_place
        params = self.model.parameters()
        if self._graph is None:
            def forward_backward(x, y):
                self.model.zero_grad()               # the capture's first accumulate makes each gradient
                return self.forward_backward(x, y), tuple(p.grad for p in params)
            self._graph = CudaGraphStep(forward_backward, warmup=2)
        if self._graph.captured:
            reseed_in_place(self.model.generator(self.cfg.backend), self.dropout_seed(step), self.cfg.backend)
        else:                                        # eager warm-up, or the capture: a fresh stream made now
            self.model.manual_seed(self.dropout_seed(step))
            self.model.generator(self.cfg.backend)  # outside the capture (seeding is host work)
        x, y = self.batch(step)
        loss, grads = self._graph(x, y)
        for p, g in zip(params, grads):
            p.grad = g
        return float(loss), int(x.size)

    # -- checkpoints -------------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write a checkpoint (rank 0 alone in a data-parallel run: the ranks' weights are equal)."""
        if self.rank0:
            save_checkpoint(path, self.model_state(), self.meta(), self.opt.state_dict())
        return Path(path)

    def load(self, path: str | Path) -> None:
        # the kind, then names, shapes and dtypes are checked before any tensor is read
        ck = load_checkpoint(path, kind=self.kind, expected=self.model_state())
        self.check_ranks(ck.meta, path)
        self.load_model_state(ck.model, ck.meta)
        self.opt.load_state_dict(ck.optim)
        self.step = int(ck.meta["step"])

    # -- the whole run -----------------------------------------------------------------------------
    def fit(self) -> dict:
        c, log = self.cfg, self.log
        if c.checkpoint and self.rank0:   # a path that cannot be written fails now, not after the training
            check_checkpoint_path(c.checkpoint)
        log(self.describe())
        tty = sys.stdout.isatty() and self.rank0
        start, tokens, window = time.perf_counter(), 0, []
        while self.step < c.steps:
            loss = self.train_step()
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss became {loss} at step {self.step}")
            tokens += self._tokens
            window.append(loss)
            elapsed = time.perf_counter() - start
            if self.step % c.log_every == 0 or self.step == c.steps:
                line = (f"step {self.step:5d}/{c.steps} {_bar(self.step / c.steps)} loss "
                        f"{sum(window) / len(window):.4f}  lr {self.opt.lr:.2e}  "
                        f"{tokens / elapsed:,.0f} tok/s  {elapsed:.0f}s")
                window = []
                self.history.append({"step": self.step, "loss": loss, "time": elapsed})
                if tty:
                    print("\r" + line, end="", flush=True)
                else:
                    log(line)
            if c.eval_every and self.step % c.eval_every == 0 and self.step < c.steps and self.rank0:
                if tty:
                    print()
                log("  " + self.report(self.evaluate(limit=300), quick=True))
            if c.checkpoint and c.checkpoint_every and self.step % c.checkpoint_every == 0:
                self.save(c.checkpoint)
        if tty:
            print()
        if c.checkpoint:
            self.save(c.checkpoint)
        if not self.rank0:       # data parallel: rank 0 evaluates
            return {}
        result = self.evaluate()
        log(self.report(result, quick=False) + f"  ({time.perf_counter() - start:.0f}s)")
        return result


def _silent(_: str) -> None:
    """The log of a data-parallel rank other than 0."""


def _bar(frac: float, width: int = 20) -> str:
    n = int(round(frac * width))
    return "[" + "#" * n + "." * (width - n) + "]"
