"""Training a ``Seq2Seq`` on a built-in task: the loop behind ``npformer train``.

One step: reseed dropout from (seed, step); draw the batch from (seed, step); forward; fused
cross-entropy (ignore the padding, label smoothing); backward; clip by global norm; AdamW with
warm-up + cosine learning rate. Because the batch and the dropout masks are functions of
(seed, step) alone, a run resumed from a checkpoint repeats an uninterrupted run's losses exactly.
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable

from npformer.backend import default_rng, get_backend, to_device
from npformer.data.tasks import TASKS, exact_match, get_task
from npformer.data.vocab import BOS_ID, EOS_ID, PAD_ID
from npformer.models.decoding import eval_mode, greedy_decode
from npformer.models.seq2seq import Seq2Seq, Seq2SeqConfig
from npformer.ops.cross_entropy import cross_entropy_backward, cross_entropy_forward
from npformer.training.amp import MixedPrecision
from npformer.training.checkpoint import load_checkpoint, save_checkpoint
from npformer.training.optim import AdamW, clip_grad_norm
from npformer.training.schedules import cosine_with_warmup

__all__ = ["TrainConfig", "Trainer", "Seq2SeqTrainer", "make_trainer"]


@dataclass
class TrainConfig:
    task: str = "dates"
    model: str | None = None         # a key of TRAINERS; None: gpt for charlm, seq2seq otherwise
    seed: int = 0
    backend: str = "numpy"
    dtype: str = "float32"
    steps: int = 700
    batch_size: int = 64
    lr: float = 2e-3
    warmup: int = 100
    min_lr: float = 1e-4
    weight_decay: float = 0.01
    clip: float = 1.0
    label_smoothing: float = 0.1
    d_model: int = 128
    nhead: int = 4
    layers: int = 2
    dim_feedforward: int = 256
    dropout: float = 0.1
    activation: str | None = None    # None: the model's default (Seq2Seq relu, GPT gelu_tanh)
    norm_first: bool | None = None   # None: the model's default (Seq2Seq post-norm, GPT pre-norm)
    n_train: int | None = None
    n_valid: int | None = None
    eval_every: int = 350
    log_every: int = 25
    checkpoint: str | None = None
    checkpoint_every: int = 200
    text: str | None = None          # charlm: a text file (default: the shipped corpus)
    block_size: int = 64             # charlm: context length
    mem_len: int | None = None       # transformer-xl: memory (None: block_size, its segment length; 0: none)
    embedding_size: int | None = None  # albert: E of the factorised embedding (None or 0: not factorised)
    share: str | None = None         # albert: cross-layer sharing, all|attention|ffn|none (None: all)
    precision: str = "float32"       # float16/bfloat16: a 16-bit model, float32 master weights, loss scaling

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


class Trainer:
    """The loop shared by every model: seeded steps, AdamW with warm-up + cosine, clipping,
    periodic validation, atomic checkpoints and exact resume. Subclasses build the model and say
    how to draw a batch, compute the loss, evaluate and describe themselves."""

    kind = ""

    def __init__(self, config: TrainConfig, log: Callable[[str], None] = print):
        self.cfg, self.log = config, log
        c = config
        if not 0 <= c.warmup < c.steps:
            raise ValueError(f"steps ({c.steps}) must be greater than warmup ({c.warmup}), and warmup >= 0")
        if c.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {c.precision!r}")
        if c.precision != "float32" and c.dtype != "float32":
            raise ValueError(f"--precision {c.precision} keeps float32 master weights: use --dtype float32, "
                             f"not {c.dtype}")
        self.xp = get_backend(c.backend)
        self.model = self.build()
        # mixed precision: the model is rounded to 16 bits, the optimiser updates float32 masters
        self.amp = None if c.precision == "float32" else MixedPrecision(self.model, c.precision)
        params = self.amp.named_parameters() if self.amp else self.model.named_parameters()
        self.opt = AdamW(params, lr=c.lr, weight_decay=c.weight_decay)
        self.step = 0
        self.history: list[dict] = []

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
                "model_config": self.model.config.to_dict()}
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
            return loss, cross_entropy_backward(self.xp.ones((), dtype=logits.dtype), cache)
        loss, cache = cross_entropy_forward(logits.astype(self.xp.float32), targets, **kwargs)
        return loss, cross_entropy_backward(self.amp.scaled_dloss(), cache).astype(self.amp.dtype)

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
        self.model.manual_seed((c.seed, step))   # this step's dropout masks: a function of (seed, step)
        self.model.train()
        loss, self._tokens = self.loss_and_backward(step)
        self.opt.lr = self._lr(step)
        if self.amp is None:
            self._grad_norm = clip_grad_norm(self.model.parameters(), c.clip)
            self.opt.step()
            self.model.zero_grad()
        else:            # unscale, skip on inf/NaN (the scale halves), clip, step, round down, zero
            self._grad_norm = self.amp.step(self.opt, max_norm=c.clip).grad_norm
        self.step = step
        return loss

    # -- checkpoints -------------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        return save_checkpoint(path, self.model_state(), self.meta(), self.opt.state_dict())

    def load(self, path: str | Path) -> None:
        ck = load_checkpoint(path)
        if ck.meta.get("kind") != self.kind:
            raise ValueError(f"{path} holds a {ck.meta.get('kind')!r} checkpoint, not a {self.kind} one")
        self.load_model_state(ck.model, ck.meta)
        self.opt.load_state_dict(ck.optim)
        self.step = int(ck.meta["step"])

    # -- the whole run -----------------------------------------------------------------------------
    def fit(self) -> dict:
        c, log = self.cfg, self.log
        log(self.describe())
        tty = sys.stdout.isatty()
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
            if c.eval_every and self.step % c.eval_every == 0 and self.step < c.steps:
                if tty:
                    print()
                log("  " + self.report(self.evaluate(limit=300), quick=True))
            if c.checkpoint and c.checkpoint_every and self.step % c.checkpoint_every == 0:
                self.save(c.checkpoint)
        if tty:
            print()
        if c.checkpoint:
            self.save(c.checkpoint)
        result = self.evaluate()
        log(self.report(result, quick=False) + f"  ({time.perf_counter() - start:.0f}s)")
        return result


class Seq2SeqTrainer(Trainer):
    """The paper's encoder-decoder on a built-in translation-like task, scored by exact match."""

    kind = "seq2seq"

    def build(self):
        c = self.cfg
        if c.task not in TASKS:
            raise ValueError(f"task {c.task!r} is not a seq2seq task; expected one of {sorted(TASKS)}")
        self.task = get_task(c.task, seed=c.seed, n_train=c.n_train, n_valid=c.n_valid)
        max_len = max(self.task.max_src_len, self.task.max_tgt_len) + 8
        self.model_config = Seq2SeqConfig(
            src_vocab_size=len(self.task.src_vocab), tgt_vocab_size=len(self.task.tgt_vocab),
            d_model=c.d_model, nhead=c.nhead, num_encoder_layers=c.layers, num_decoder_layers=c.layers,
            dim_feedforward=c.dim_feedforward, dropout=c.dropout, activation=c.activation or "relu",
            norm_first=bool(c.norm_first), max_len=max_len, pad_id=PAD_ID,
            tie_embeddings=True)
        return Seq2Seq(self.model_config, dtype=c.dtype, backend=c.backend, rng=c.seed)

    def _batch(self, pairs):
        b = self.task.encode_batch(pairs)
        return (to_device(b.src, self.cfg.backend), to_device(b.tgt_in, self.cfg.backend),
                to_device(b.tgt_out, self.cfg.backend), int((b.tgt_out != PAD_ID).sum()) + b.src.size)

    def loss_and_backward(self, step):
        c = self.cfg
        pick = default_rng((c.seed, step), "numpy").choice(len(self.task.train), c.batch_size, replace=False)
        src, tgt_in, tgt_out, tokens = self._batch([self.task.train[i] for i in pick.tolist()])
        logits = self.model(src, tgt_in)                                          # (B, T, V)
        loss, dlogits = self.cross_entropy(logits, tgt_out, ignore_index=PAD_ID,
                                           label_smoothing=c.label_smoothing)
        self.model.backward(dlogits)
        return float(loss), tokens

    # -- evaluation --------------------------------------------------------------------------------
    def evaluate(self, limit: int | None = None, batch_size: int = 250) -> dict:
        """Validation loss (no smoothing) and greedy exact-match accuracy."""
        pairs = self.task.valid[:limit] if limit else self.task.valid
        total_loss, total_tokens, preds = 0.0, 0, []
        max_len = self.task.max_tgt_len + 2
        with eval_mode(self.model):
            for i in range(0, len(pairs), batch_size):
                chunk = pairs[i:i + batch_size]
                src, tgt_in, tgt_out, _ = self._batch(chunk)
                loss, _ = cross_entropy_forward(self.model(src, tgt_in), tgt_out, ignore_index=PAD_ID,
                                                reduction="sum")
                total_loss += float(loss)
                total_tokens += int((tgt_out != PAD_ID).sum())
                ids = greedy_decode(self.model, src, bos_id=BOS_ID, eos_id=EOS_ID, max_len=max_len)
                preds += [self.task.tgt_vocab.decode(r) for r in ids]
        return {"loss": total_loss / max(total_tokens, 1),
                "exact_match": exact_match(preds, [t for _, t in pairs]),
                "predictions": preds, "targets": [t for _, t in pairs], "sources": [s for s, _ in pairs]}

    def translate(self, sources: list[str]) -> list[str]:
        src, _ = self.task.encode_sources(sources)
        ids = greedy_decode(self.model, to_device(src, self.cfg.backend), bos_id=BOS_ID, eos_id=EOS_ID,
                            max_len=self.task.max_tgt_len + 2)
        return [self.task.tgt_vocab.decode(r) for r in ids]

    def meta(self) -> dict:
        return {**super().meta(), "src_vocab": self.task.src_vocab.to_dict(),
                "tgt_vocab": self.task.tgt_vocab.to_dict()}

    def describe(self) -> str:
        c = self.cfg
        return (f"task {c.task}: {len(self.task.train)} train / {len(self.task.valid)} valid pairs; "
                f"Seq2Seq {self.model.num_parameters():,} parameters (d_model={c.d_model}, heads={c.nhead}, "
                f"layers={c.layers}+{c.layers}, ff={c.dim_feedforward}) on {c.backend} {c.dtype}")

    def report(self, result: dict, quick: bool) -> str:
        n = len(result["targets"])
        what = f"valid ({n} examples)" if quick else f"final validation ({n} held-out examples)"
        return f"{what}: loss {result['loss']:.4f}  exact match {result['exact_match']:.1%}"


PRECISIONS = ("float32", "float16", "bfloat16")


def _bar(frac: float, width: int = 20) -> str:
    n = int(round(frac * width))
    return "[" + "#" * n + "." * (width - n) + "]"


# model name -> (module, trainer class), imported only when chosen. Each trainer's build() checks
# that it can run the task it was given.
TRAINERS: dict[str, tuple[str, str]] = {
    "seq2seq": ("npformer.training.trainer", "Seq2SeqTrainer"),
    "gpt": ("npformer.training.lm_trainer", "LMTrainer"),
    "transformer-xl": ("npformer.training.xl_trainer", "XLTrainer"),
    "gpt1": ("npformer.training.lm_trainer", "GPT1Trainer"),
    "gpt2": ("npformer.training.lm_trainer", "GPT2Trainer"),
    "bert": ("npformer.training.mlm_trainer", "BERTTrainer"),
    "albert": ("npformer.training.mlm_trainer", "ALBERTTrainer"),
}


# tasks whose default model is not the Seq2Seq
DEFAULT_MODELS = {"charlm": "gpt", "recall": "transformer-xl"}


def default_model(task: str) -> str:
    return DEFAULT_MODELS.get(task, "seq2seq")


def make_trainer(config: TrainConfig, log: Callable[[str], None] = print) -> Trainer:
    """The trainer for ``config.model`` (default: a GPT for ``charlm``, a Seq2Seq for the others)."""
    import importlib

    name = config.model or default_model(config.task)
    if name not in TRAINERS:
        raise ValueError(f"unknown model {name!r}; expected one of {sorted(TRAINERS)}")
    module, cls = TRAINERS[name]
    return getattr(importlib.import_module(module), cls)(config, log)
