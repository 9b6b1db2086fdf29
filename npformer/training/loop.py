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

What a run reports: every ``log_every`` steps a record of the mean loss, the learning rate, the mean
gradient norm before clipping and the tokens/s of those steps, and at each evaluation the trainer's
figures, into ``Trainer.history`` and, given ``out_dir``, the run directory's metrics.jsonl beside its
config and checkpoints (:mod:`npformer.training.run`). On a terminal the progress is a tqdm bar with
its ETA; in a log (a pipe, a file, a notebook) one line a record, the ETA formatted by tqdm.

Ctrl-C (SIGINT, in the main thread) stops :meth:`Trainer.fit` between two steps: the step in progress
ends, the checkpoints are written (last.npz and ``checkpoint``, which resume exactly) and
:class:`TrainingInterrupted` (a ``KeyboardInterrupt``) says which; the ranks of a data-parallel run
agree on the step. A second Ctrl-C stops at once; a checkpoint being written is then left as it was.
"""
from __future__ import annotations

import contextlib
import math
import signal
import sys
import textwrap
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Callable, NamedTuple

from tqdm import tqdm

from npformer.backend import get_backend, set_float32_matmul_precision
from npformer.data.vocab import CharVocab
from npformer.distributed import Communicator, DataParallel, shard_rows, take_shard
from npformer.errors import CheckpointError, DistributedError, InputTypeError, RangeError
from npformer.nn.flat import flatten_parameters
from npformer.ops.cross_entropy import cross_entropy_backward, cross_entropy_forward
from npformer.progress import TIMES, interactive
from npformer.training.amp import MixedPrecision
from npformer.training.checkpoint import check_checkpoint_path, load_checkpoint, save_checkpoint
from npformer.training.config import CONFIGS, TrainConfig
from npformer.kernels.cpu.threads import get_num_threads, set_num_threads, within_cpus
from npformer.training.optim import AdamW, clip_grad_norm
from npformer.training.run import RunDirectory, check_not_a_run_file, scalars
from npformer.training.schedules import cosine_with_warmup

__all__ = ["Trainer", "StepResult", "Loss", "StepLoss", "TrainingInterrupted"]


class Loss(NamedTuple):
    """A batch's cross-entropy, what its backward starts from, and the targets the mean is over."""

    value: Any          # () the mean loss (a device scalar)
    grad: Any           # dlogits (..., V), or dhidden (..., C) when the head ran with the loss
    valid: Any          # (...) bool: the targets counted (a data-parallel step weighs each rank by their sum)


class StepLoss(NamedTuple):
    """What a trainer's forward and backward of one step measured (:meth:`Trainer.loss_and_backward`)."""

    loss: float
    tokens: int         # the tokens the step read (throughput)
    valid: Any          # Loss.valid of the step's cross-entropy


class StepResult(NamedTuple):
    """What one :meth:`Trainer.train_step` did."""

    loss: float             # the step's mean loss (the global batch's in a data-parallel run)
    tokens: int             # the tokens the step read (the global batch's in a data-parallel run)
    grad_norm: float        # the gradients' global L2 norm before clipping (inf/NaN: a skipped fp16 step)
    values_checked: bool    # token ids checked against the vocabulary (False on a CUDA graph's replays)


class Trainer:
    """The loop shared by every model: seeded steps, AdamW with warm-up + cosine, clipping,
    periodic validation, atomic checkpoints and exact resume. Subclasses build the model and say
    how to draw a batch, compute the loss, evaluate and describe themselves."""

    kind = ""          # the model name (a key of config.CONFIGS), also the checkpoint's kind
    graph_capable = False   # batch() and forward_backward() given, every batch one shape (--cuda-graph)
    bias_switch = False     # the model can drop its biases (--no-bias)

    def __init__(self, config: TrainConfig, log: Callable[[str], None] = print, comm: Communicator | None = None):
        expected = CONFIGS[self.kind]
        if type(config) is not expected:
            raise InputTypeError(f"config: the {self.kind} trainer trains from a {expected.__name__}, "
                                 f"got a {type(config).__name__}")
        if config.model not in (None, self.kind):
            raise RangeError(f"config.model: expected {self.kind!r} or None for the {self.kind} trainer, "
                             f"got {config.model!r}")
        # replace() builds the config anew: TrainConfig.__post_init__ checks every field and rule again
        # (even of a config changed field by field after it was made), the one home of those checks
        self.cfg, self.log = replace(config, model=self.kind), log     # the model named, in checkpoints and config.json
        c = self.cfg
        if not c.bias and not self.bias_switch:
            raise RangeError(f"--no-bias: the {self.kind} model has no switch for its biases; --no-bias applies to "
                             "--model gpt, gpt1, gpt2")
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
        if c.threads is not None:        # process-wide, as torch.set_num_threads: BLAS and npformer's pool
            threads, note = within_cpus(c.threads, "--threads")
            if note:
                self.log(f"note: {note}")
                self.cfg = c = replace(c, threads=threads)
            set_num_threads(threads)
        self.model = self.build()
        flatten_parameters(self.model)      # one buffer per dtype: the optimiser updates whole runs of it
        self.data_parallel = None if comm is None else DataParallel(self.model, comm, config=asdict(c))
        # mixed precision: the model is rounded to 16 bits, the optimiser updates float32 masters
        self.amp = None if c.precision == "float32" else MixedPrecision(self.model, c.precision)
        params = self.amp.named_parameters() if self.amp else self.model.named_parameters()
        self.opt = AdamW(params, lr=c.lr, betas=(c.beta1, c.beta2), weight_decay=c.weight_decay,
                         decay_filter={"weights": "auto", "matrices": "matrices", "all": None}[c.decay])
        self.step = 0
        self.best_loss = math.inf     # the lowest validation loss of the run so far (best.npz's)
        self.history: list[dict] = []     # the run's metrics records (see npformer.training.run)
        self._graph = None      # the CudaGraphStep of --cuda-graph, made on the first step

    # -- to be provided ------------------------------------------------------------------------------
    def build(self):
        raise NotImplementedError

    def loss_and_backward(self, step: int) -> StepLoss:
        """Draw the batch of ``step``, run forward and backward; returns the loss, the tokens read and
        the targets the loss averages over (from :meth:`cross_entropy`'s :class:`Loss`: the weight of
        this rank's loss in a data-parallel step)."""
        raise NotImplementedError

    # graph-capable trainers (graph_capable = True) give these two as well: --cuda-graph captures them
    def batch(self, step: int):
        """``(x, y)``: the inputs and targets of ``step``, the same shapes at every step."""
        raise NotImplementedError(f"the {self.kind} trainer has no batch(): --cuda-graph needs one")

    def forward_backward(self, x, y):
        """Forward and backward of ``(x, y)`` with no host synchronisation; returns ``(loss, valid)``
        as :meth:`cross_entropy` gives them (device arrays), the gradients accumulated."""
        raise NotImplementedError(f"the {self.kind} trainer has no forward_backward(): --cuda-graph needs one")

    def evaluate(self, limit: int | None = None) -> dict:
        raise NotImplementedError

    def resolved(self) -> dict:
        """The values the built model and task gave the options left to their default (None in the
        config: ``activation``, ``norm_first``, ``n_train``, ...), for the printed config."""
        return {}

    def describe(self) -> str:
        raise NotImplementedError

    def report(self, result: dict, quick: bool) -> str:
        raise NotImplementedError

    def vocabularies(self) -> dict[str, CharVocab]:
        """The vocabularies the trainer's data gave, by their checkpoint meta key (``vocab``, or
        ``src_vocab`` and ``tgt_vocab``): what turns the model's ids back into text."""
        return {}

    def meta(self) -> dict:
        meta = {"kind": self.kind, "step": self.step, "train_config": asdict(self.cfg),
                "model_config": self.model.config.to_dict(), "ranks": self.ranks,
                "best_valid_loss": self.best_loss if math.isfinite(self.best_loss) else None,
                **{key: vocab.to_dict() for key, vocab in self.vocabularies().items()}}
        if self.amp and self.amp.scaler is not None:       # float16's; bfloat16 has none
            meta["loss_scaler"] = self.amp.scaler.state_dict()
        return meta

    def cross_entropy(self, logits, targets, **kwargs) -> Loss:
        """The cross-entropy of ``logits`` and its gradient ``dlogits``, to start the backward.

        Under mixed precision the loss is computed in float32 from the 16-bit logits (``loss_dtype``)
        and the gradient is that of ``S * loss`` (S the loss scale), rounded to the model's 16-bit
        dtype; ``amp.step`` divides by S again in float32.
        """
        if self.amp is None:
            loss, cache = cross_entropy_forward(logits, targets, **kwargs)
            return Loss(loss, cross_entropy_backward(self.xp.ones((), dtype=logits.dtype), cache), cache.valid)
        loss, cache = cross_entropy_forward(logits, targets, loss_dtype=self.xp.float32, **kwargs)
        return Loss(loss, cross_entropy_backward(self.amp.scaled_dloss(), cache), cache.valid)

    def head_cross_entropy(self, head, hidden, targets, **kwargs) -> Loss:
        """The cross-entropy of ``head(hidden)`` with ``targets`` and the gradient
        of ``hidden``, the head's own gradients accumulated, without the (..., V) logits (a chunk of
        rows at a time: :meth:`npformer.nn.head.OutputHead.cross_entropy`). The loss is in float32
        under mixed precision and the gradients are those of ``S * loss``, as :meth:`cross_entropy`'s."""
        dloss = 1.0 if self.amp is None else self.amp.scaled_dloss()
        result = head.cross_entropy(hidden, targets, dloss=dloss, **kwargs)
        return Loss(result.loss, result.dx, result.valid)

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
                                   f"(--processes {saved} or mpirun -n {saved}), not {self.ranks}, so it continues "
                                   "exactly")

    def model_state(self) -> dict:
        """The weights a checkpoint keeps: the float32 masters under mixed precision."""
        return self.amp.master_state_dict() if self.amp else self.model.state_dict()

    def load_model_state(self, state, meta: dict) -> None:
        if self.amp:
            self.amp.load_master_state_dict(state)
            if "loss_scaler" in meta and self.amp.scaler is not None:
                self.amp.scaler.load_state_dict(meta["loss_scaler"])
        else:
            self.model.load_state_dict(state)

    # -- one step ----------------------------------------------------------------------------------
    def _lr(self, step: int) -> float:
        c = self.cfg
        return cosine_with_warmup(step, c.lr, c.warmup, c.steps, min_lr=c.min_lr)

    def train_step(self) -> StepResult:
        """One optimiser step: forward, backward, (data-parallel reduction), clipping, update."""
        c, step = self.cfg, self.step + 1
        self.model.train()
        with self.amp.overflows_expected() if self.amp else contextlib.nullcontext():
            if c.cuda_graph:
                loss, tokens, valid = self._graph_step(step)
            else:
                self.model.manual_seed(self.dropout_seed(step))
                loss, tokens, valid = self.loss_and_backward(step)
        if self.data_parallel:     # the global batch's gradients on every rank, its loss and token count
            if valid is None:
                raise DistributedError(f"the {self.kind} trainer's step gave no targets with its loss: a "
                                       "data-parallel step weighs each rank's loss by the targets it averages "
                                       "over (Loss.valid, from Trainer.cross_entropy or head_cross_entropy)")
            count = int(valid.sum())         # read here, not in cross_entropy: a CUDA graph captures that
            loss, _, tokens = self.data_parallel.reduce_gradients(loss, count, tokens)
        self.opt.lr = self._lr(step)
        if self.amp is None:
            grad_norm = clip_grad_norm(self.model.parameters(), c.clip)
            self.opt.step()
            self.model.zero_grad()
        else:            # unscale, skip on inf/NaN (the scale halves), clip, step, round down, zero
            grad_norm = self.amp.step(self.opt, max_norm=c.clip).grad_norm
        self.step = step
        # a replayed CUDA graph reads no ids back: their range was checked in the eager steps before it
        replayed = bool(c.cuda_graph and self._graph is not None and self._graph.captured)
        return StepResult(float(loss), int(tokens), float(grad_norm), values_checked=not replayed)

    def _graph_step(self, step: int) -> StepLoss:
        """Forward and backward replayed from a CUDA graph (:mod:`npformer.training.cuda_graph`), the
        loss read after it; the same losses as the eager step. The dropout stream of (seed, step) is
        written into the generator the graph draws from, the loss scale of mixed precision into the
        array the captured backward starts from, and the gradients are the arrays the capture made,
        rewritten by every replay (so they are not zeroed between steps). Mixed precision's check,
        skip and scale update run after the replay, on the host, as in an eager step."""
        from npformer.training.cuda_graph import CudaGraphStep, reseed_in_place
        params = list(self.model.parameters())     # a list: the capture's closure reads it at every call
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
        if self.amp is not None:
            self.amp.scaled_dloss()                  # this step's loss scale, into the array the graph reads
        x, y = self.batch(step)
        (loss, valid), grads = self._graph(x, y)      # (valid: rewritten in place by every replay)
        for p, g in zip(params, grads):
            p.grad = g
        return StepLoss(float(loss), int(x.size), valid)

    # -- checkpoints -------------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write a checkpoint (rank 0 alone in a data-parallel run: the ranks' weights are equal)."""
        if self.rank0:
            save_checkpoint(path, self.model_state(), self.meta(), self.opt.state_dict())
        return Path(path)

    def _save_all(self, paths: list[Path]) -> list[Path]:
        """Write the checkpoint to every path of ``paths`` (last.npz, ``--checkpoint``), each tried even
        when one before it failed: a full disk under one costs nothing on another. Returns the paths;
        after a failure, one :class:`CheckpointError` names every path that failed and those written."""
        written, failed = [], []
        for path in paths:
            try:
                written.append(self.save(path))
            except CheckpointError as exc:
                failed.append(exc)
        if failed:
            kept = ", ".join(repr(str(p)) for p in written)
            raise CheckpointError("; ".join(str(e) for e in failed) + (
                f"; the weights of step {self.step} were written to {kept}" if written else "")) from failed[0]
        return written

    def check_vocabularies(self, meta: dict, path) -> None:
        """The checkpoint's vocabularies are the ones this trainer's data give now: with others (a
        --text file rewritten since the run) the model's ids would stand for other characters."""
        for key, vocab in self.vocabularies().items():
            saved = meta.get(key)
            if saved is None or saved == vocab.to_dict():
                continue
            symbols = saved.get("symbols") if isinstance(saved, dict) else None
            if not isinstance(symbols, list) or not all(isinstance(c, str) for c in symbols):
                raise CheckpointError(f"checkpoint {str(path)!r}: meta[{key!r}] is not a vocabulary of npformer "
                                      f"train: {str(saved)[:60]}")
            gone = "".join(sorted(set(symbols) - set(vocab.symbols)))
            new = "".join(sorted(set(vocab.symbols) - set(symbols)))
            changes = ([f"the characters {gone!r} gone"] if gone else []) + ([f"{new!r} new"] if new else [])
            how = ", ".join(changes) or "the same characters in another order"
            raise CheckpointError(f"checkpoint {str(path)!r} was trained with another vocabulary than "
                                  f"{self.cfg.data_source()} gives now ({how}): the model's ids would stand for other "
                                  "characters; give it the data it was trained on")

    def load(self, path: str | Path, resume: bool = True) -> None:
        """The weights, optimiser state, step and best validation loss of the checkpoint ``path``.
        ``resume``: the run goes on from it (``npformer train --resume``), on the number of ranks that
        wrote it (:meth:`check_ranks`); False (eval, translate): the weights alone are used, from a run
        on any number of ranks."""
        # the kind, the vocabularies, then names, shapes and dtypes are checked before any tensor is read
        ck = load_checkpoint(path, kind=self.kind, expected=self.model_state(),
                             check_meta=lambda meta: self.check_vocabularies(meta, path))
        if resume:
            self.check_ranks(ck.meta, path)
        self.load_model_state(ck.model, ck.meta)
        self.opt.load_state_dict(ck.optim)
        self.step = int(ck.meta["step"])
        best = ck.meta.get("best_valid_loss")          # None: no evaluation yet, or a file from before it was kept
        self.best_loss = math.inf if best is None else float(best)

    # -- the whole run -----------------------------------------------------------------------------
    def fit(self) -> dict:
        """Train to ``steps``, validating every ``eval_every`` steps and at the end; returns the final
        evaluation. With ``out_dir`` the run directory (:mod:`npformer.training.run`) gets the config,
        the metrics, last.npz and best.npz; every record also goes to ``self.history``. On a terminal
        the progress is a tqdm bar; otherwise one line every ``log_every`` steps, with the ETA."""
        c, log = self.cfg, self.log
        # every rank knows the paths (saving is collective: Transformer-XL gathers its memory); rank 0 alone
        # checks them, writes the run directory and evaluates
        if c.log_to and not c.out_dir:
            raise RangeError(f"--log-to {c.log_to} writes into the run directory; give --out-dir")
        run = RunDirectory(c.out_dir, c.log_to) if c.out_dir else None
        saves: list[Path] = []                               # the latest checkpoint: last.npz, --checkpoint
        for path in (run and run.last, c.checkpoint):
            if path and Path(path).resolve() not in [s.resolve() for s in saves]:    # one file, written once
                saves.append(Path(path))
        if self.rank0:
            if c.checkpoint:
                check_not_a_run_file(c.checkpoint, run)       # not a run's config, metrics or best.npz
            for path in saves + ([run.best] if run else []):      # a path that cannot be written fails now
                check_checkpoint_path(path)
        tty = self.log is print and interactive() and self.rank0     # (npformer.progress: a user's terminal)
        say = tqdm.write if tty else log
        written = None                   # the step of the latest checkpoint this call wrote to every path
        # Ctrl-C (SIGINT) from here: the step in progress ends, the checkpoints of the steps done are written
        # and TrainingInterrupted says where; a second Ctrl-C stops at once, saving nothing more (every file
        # is written through a temporary renamed over it, so none is left half-written)
        with _Interrupts() as interrupts:
            try:
                if run and self.rank0:
                    run.start(c, self.step)
                    log(f"run directory {run.path}: config.json, metrics.jsonl, last.npz, best.npz")
                shown = {**asdict(c), "threads": c.threads or get_num_threads(),     # the count in use, not None
                         **{k: v for k, v in self.resolved().items() if getattr(c, k) is None}}  # what the model fixed
                log("config: " + textwrap.fill(" ".join(f"{k}={v}" for k, v in shown.items()), 110,
                                               subsequent_indent="  "))
                log(self.describe())
                first, start = self.step, time.perf_counter()
                window: dict = {"loss": [], "grad_norm": [], "tokens": 0, "seconds": 0.0}
                since_eval: list = []    # the training losses since the last validation (its estimate beside it)

                def report(window: dict, bar) -> None:
                    """The training line of the steps in ``window``: the metrics' record, the bar's or log's."""
                    record = self._train_record(window, time.perf_counter() - start)
                    self._record(run, record)
                    skipped = f" ({record['skipped']} skipped)" if record["skipped"] else ""
                    figures = (f"loss {record['loss']:.4f}  lr {record['lr']:.2e}  grad norm "
                               f"{record['grad_norm']:.3f}{skipped}  {record['tokens_per_s']:,.0f} tok/s")
                    bar.set_postfix_str(figures, refresh=False)
                    if not tty:
                        log(f"step {self.step:5d}/{c.steps}  {figures}  " + tqdm.format_meter(
                            self.step, c.steps, record["time_s"], initial=first, bar_format=TIMES))

                with tqdm(total=c.steps, initial=self.step, unit="step", file=sys.stdout, disable=not tty,
                          dynamic_ncols=True, bar_format=BAR) as bar:
                    while self.step < c.steps and not self._stop_requested(interrupts):
                        began = time.perf_counter()
                        result = self.train_step()
                        if not math.isfinite(result.loss):
                            raise FloatingPointError(f"loss became {result.loss} at step {self.step}")
                        window["seconds"] += time.perf_counter() - began
                        window["loss"].append(result.loss)
                        since_eval.append(result.loss)
                        window["grad_norm"].append(result.grad_norm)
                        window["tokens"] += result.tokens
                        bar.update(1)
                        if self.step % c.log_every == 0 or self.step == c.steps:
                            report(window, bar)
                            window = {"loss": [], "grad_norm": [], "tokens": 0, "seconds": 0.0}
                        if c.eval_every and self.step % c.eval_every == 0 and self.step < c.steps:
                            say("  " + self._evaluate(run, limit=c.eval_limit)[1] + self._train_estimate(since_eval))
                            since_eval = []
                        if c.checkpoint_every and self.step % c.checkpoint_every == 0 and self.step < c.steps:
                            self._save_all(saves)
                            written = self.step
                    if window["loss"]:            # stopped by Ctrl-C between two lines: the steps since the last
                        report(window, bar)
                if written != self.step:          # the trained weights first: nothing after costs them
                    self._save_all(saves)
                    written = self.step
            except KeyboardInterrupt:             # a second Ctrl-C (or one where no handler could be set)
                raise TrainingInterrupted(self.step, c.steps, [], written, at_once=True) from None
            stopped = self.step < c.steps or self._stop_requested(interrupts)
        if stopped:
            raise TrainingInterrupted(self.step, c.steps, saves, written)
        best_before = self.best_loss
        try:
            result, line = self._evaluate(run, limit=c.eval_limit, final=c.final_eval)
            if self.best_loss != best_before:                # last.npz records the best loss too
                self._save_all(saves)
        except KeyboardInterrupt:                 # Ctrl-C: the weights are saved, the final figures are lost
            raise TrainingInterrupted(self.step, c.steps, saves, written) from None
        line += self._train_estimate(since_eval)
        log(line + f"  ({time.perf_counter() - start:.0f}s)")
        return result

    def _stop_requested(self, interrupts: "_Interrupts") -> bool:
        """Whether a Ctrl-C asked the run to stop. In a data-parallel run every rank must stop after the
        same step (a rank that went on would wait for the others in its next collective, or pair its
        all-reduce with another's): the ranks' answers are all-reduced (max of one number), so that a
        Ctrl-C on any rank stops them all."""
        if self.comm is None:
            return interrupts.requested
        flag = self.comm.all_reduce(self.xp.asarray([float(interrupts.requested)], dtype=self.xp.float64), op="max")
        return bool(float(flag[0]) > 0)

    @staticmethod
    def _train_estimate(losses: list) -> str:
        """What a validation line says of the training loss: the mean over the steps since the last
        validation (no batch drawn for it, so no step's data or dropout stream changes)."""
        if not losses:
            return ""
        return f"  | train loss {sum(losses) / len(losses):.4f} (mean of the last {len(losses)} steps)"

    def _train_record(self, window: dict, elapsed: float) -> dict:
        """The window's training line: the mean loss, the mean gradient norm over the steps whose norm
        is finite (NaN when none is) and how many were not (``skipped``: mixed precision skips such a
        step and lowers its loss scale; in float32 the run stops at the next loss, which is not finite)."""
        n = len(window["loss"])
        finite = [g for g in window["grad_norm"] if math.isfinite(g)]
        return {"split": "train", "step": self.step, "loss": sum(window["loss"]) / n, "lr": self.opt.lr,
                "grad_norm": sum(finite) / len(finite) if finite else math.nan, "skipped": n - len(finite),
                "tokens_per_s": window["tokens"] / max(window["seconds"], 1e-9), "time_s": round(elapsed, 3)}

    def _evaluate(self, run: RunDirectory | None, limit: int | None = None, final: bool = False) -> tuple[dict, str]:
        """Evaluate (the first ``limit`` examples, or all when ``final``), record the figures, write
        best.npz when the validation loss is the lowest so far; ``(result, report line)``. In a
        data-parallel run rank 0 evaluates and tells the other ranks whether to save (saving is
        collective: Transformer-XL gathers its memory); they get ``({}, "")``."""
        result = self.evaluate(limit=None if final else limit) if self.rank0 else {}
        best, loss = (result["loss"] < self.best_loss, result["loss"]) if self.rank0 else (False, math.inf)
        if self.comm is not None:
            flag = self.comm.broadcast(self.xp.asarray([float(best), loss], dtype=self.xp.float64))
            best, loss = bool(flag[0] > 0), float(flag[1])
        if best:
            self.best_loss = loss
            if run:
                self.save(run.best)
        if not self.rank0:
            return {}, ""
        self._record(run, {"split": "valid", "step": self.step, **scalars(result), "final": final, "best": best})
        return result, self.report(result, quick=not final)

    def _record(self, run: RunDirectory | None, record: dict) -> None:
        self.history.append(record)
        if run and self.rank0:
            run.record(record)


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped :meth:`Trainer.fit` after ``step`` of ``steps``. ``saved``: the checkpoints written
    with that step, which ``--resume`` continues from exactly (at ``steps``: trained to the end, the final
    evaluation stopped). ``at_once``: a second Ctrl-C stopped the run without saving the step; ``written``
    is then the step of the latest checkpoint it wrote before (None: none)."""

    def __init__(self, step: int, steps: int, saved: list[Path], written: int | None = None, at_once: bool = False):
        super().__init__(step, steps, saved, written, at_once)
        self.step, self.steps, self.saved, self.written, self.at_once = step, steps, list(saved), written, at_once

    def __str__(self) -> str:
        if self.at_once:
            before = (f"the latest checkpoint it wrote is of step {self.written}" if self.written is not None else
                      "it wrote no checkpoint")
            return f"stopped at once (a second Ctrl-C) at step {self.step} of {self.steps}, without saving it; {before}"
        saved = f"saved {', '.join(str(p) for p in self.saved)}" if self.saved else "no checkpoint path to save to"
        if self.step < self.steps:
            return f"interrupted at step {self.step} of {self.steps}; {saved}"
        return f"interrupted after the last step ({self.step}), without the final evaluation; {saved}"


class _Interrupts:
    """``with _Interrupts() as interrupts``: while the block runs, a first Ctrl-C (SIGINT) sets
    ``interrupts.requested`` (the loop stops after its step in progress and saves); a second raises
    KeyboardInterrupt at once, as Python's own handler does. Set in the main thread alone, and only over
    Python's default handler: a program's own handler, or SIGINT ignored (a background job), is kept."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self) -> "_Interrupts":
        main = threading.current_thread() is threading.main_thread()
        if main and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True


# tqdm's fields of the progress bar on a terminal (the postfix, the figures, comes after a comma); the
# times that end the line every --log-every steps elsewhere are npformer.progress.TIMES (the ETA from
# the steps of this session)
BAR = "step {n_fmt}/{total_fmt} {bar} {elapsed}<{remaining}{postfix}"


def _silent(_: str) -> None:
    """The log of a data-parallel rank other than 0."""
