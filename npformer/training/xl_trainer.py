"""Training a ``TransformerXL`` with segment-level recurrence:
``npformer train --model transformer-xl --task recall [--block-size T] [--mem-len M]``.

Each recall sequence (``data.long_range``) is cut into ``SEGMENTS`` consecutive segments of T tokens
(``--block-size``), and the steps walk through them in order: step s trains segment j = (s-1) mod
SEGMENTS of the batch of sequences k = (s-1) // SEGMENTS (drawn from (seed, k)), carrying the memory
that segment j-1 left behind (none at j = 0). The period of the task is T + T // 2, longer than a
segment, so only the memory lets the model recall. M = 0 trains the same model without memory.

The memory is part of the run's state: a checkpoint stores it (``mems.<layer>`` beside the
weights), so a run resumed in the middle of a sequence repeats an uninterrupted run's losses exactly.
Validation walks every validation sequence segment by segment with a memory of ``mem_len`` positions
(the training M by default; longer for a longer effective context than training had).
"""
from __future__ import annotations

import math
from pathlib import Path

from npformer.backend import default_rng, to_device, to_numpy
from npformer.data.long_range import RecallTask
from npformer.distributed import gather_rows
from npformer.errors import RangeError
from npformer.models.decoding import eval_mode
from npformer.models.transformer_xl import TransformerXL, TransformerXLConfig
from npformer.ops.cross_entropy import cross_entropy_forward
from npformer.training.checkpoint import load_checkpoint, save_checkpoint
from npformer.training.config import XLTrainConfig
from npformer.training.loop import StepLoss, Trainer

__all__ = ["XLTrainer", "SEGMENTS", "N_SYMBOLS", "recall_period"]

SEGMENTS = 8          # segments per recall sequence
N_SYMBOLS = 16        # the recall task's alphabet


def recall_period(seg_len: int) -> int:
    """The recall task's period for segments of ``seg_len`` tokens: half a segment longer."""
    return seg_len + max(1, seg_len // 2)


class XLTrainer(Trainer):
    """A post-norm Transformer-XL on the recall task, its memory carried across the segments."""

    kind = "transformer-xl"
    cfg: XLTrainConfig

    def build(self):
        c = self.cfg
        if c.task != "recall":
            raise ValueError(f"transformer-xl trains on the task 'recall' (dependencies longer than a segment), "
                             f"got task {c.task!r}")
        if c.norm_first:
            raise ValueError("transformer-xl is post-norm, as in the paper; leave out --norm-first")
        self.seg_len = c.block_size
        self.mem_len = c.block_size if c.mem_len is None else c.mem_len      # >= 0: the config checks it
        sizes = {k: v for k, v in (("n_train", c.n_train), ("n_valid", c.n_valid)) if v is not None}
        self.task = RecallTask(period=recall_period(self.seg_len), length=SEGMENTS * self.seg_len,
                               n_symbols=N_SYMBOLS, seed=c.seed, **sizes)   # the task's own sizes otherwise
        if c.batch_size > len(self.task.train):       # a batch draws distinct sequences
            raise RangeError(f"--batch-size {c.batch_size} exceeds the {len(self.task.train)} training sequences "
                             f"(--n-train); give a smaller --batch-size or a larger --n-train")
        self.mems = None
        config = TransformerXLConfig(vocab_size=self.task.vocab_size, n_layer=c.layers, n_head=c.heads,
                                     d_model=c.d_model, dim_feedforward=c.ff, dropout=c.dropout,
                                     activation=c.activation or "relu", mem_len=self.mem_len)
        return TransformerXL(config, dtype=c.dtype, backend=c.backend, rng=c.seed)

    def resolved(self):
        return {"activation": self.model.config.activation, "mem_len": self.mem_len,
                "n_train": len(self.task.train), "n_valid": len(self.task.valid)}

    def _segment(self, seqs, j):
        t = self.seg_len
        x, y = seqs[:, j * t:(j + 1) * t], seqs[:, j * t + 1:(j + 1) * t + 1]        # (B, T) each
        return to_device(x, self.cfg.backend), to_device(y, self.cfg.backend)

    def loss_and_backward(self, step):
        c = self.cfg
        k, j = divmod(step - 1, SEGMENTS)
        if j == 0:
            self.mems = None                              # a new batch of sequences: nothing to remember
        rows = default_rng((c.seed, k), "numpy").choice(len(self.task.train), c.batch_size, replace=False)
        (rows,) = self.local(rows)                    # data parallel: this rank's rows of the batch
        x, y = self._segment(self.task.train[rows], j)
        logits, self.mems = self.model(x, self.mems)                              # (B, T, V)
        loss = self.cross_entropy(logits, y)
        self.model.backward(loss.grad)
        return StepLoss(float(loss.value), int(x.size), loss.valid)

    # -- evaluation --------------------------------------------------------------------------------
    def evaluate(self, limit: int | None = None, mem_len: int | None = None, batch_size: int = 100) -> dict:
        """Validation loss over whole sequences read segment by segment with a memory of ``mem_len``
        (default: the training M), and the accuracy on the recallable targets."""
        mem_len = self.mem_len if mem_len is None else mem_len
        seqs = self.task.valid[:limit] if limit else self.task.valid
        recallable = self.task.recallable()                                       # (length,)
        seg_loss = [0.0] * SEGMENTS
        total, hits, count = 0.0, 0, 0
        with eval_mode(self.model):
            for i in range(0, len(seqs), batch_size):
                chunk, mems = seqs[i:i + batch_size], None
                for j in range(SEGMENTS):
                    x, y = self._segment(chunk, j)
                    logits, mems = self.model(x, mems, mem_len=mem_len)
                    loss, _ = cross_entropy_forward(logits, y, reduction="sum")
                    seg_loss[j] += float(loss)
                    total += float(loss)
                    right = to_numpy(logits.argmax(axis=-1) == y)                # (B, T)
                    hits += int(right[:, recallable[j * self.seg_len:(j + 1) * self.seg_len]].sum())
                count += chunk.shape[0]
        n_tokens = count * self.task.length
        return {"loss": total / n_tokens, "mem_len": mem_len,
                "recall_accuracy": hits / max(count * int(recallable.sum()), 1),
                "floor": self.task.floor_loss(), "uniform": math.log(self.task.n_symbols),
                "loss_by_segment": [v / (count * self.seg_len) for v in seg_loss]}

    def describe(self) -> str:
        c = self.cfg
        return (f"task {self.task.describe()}; segments of {self.seg_len} tokens, memory {self.mem_len}; "
                f"Transformer-XL {self.model.num_parameters():,} parameters (d_model={c.d_model}, "
                f"heads={c.heads}, layers={c.layers}, ff={c.ff}) on {c.arithmetic()}")

    def report(self, result: dict, quick: bool) -> str:
        what = "valid" if quick else f"final validation ({len(self.task.valid)} sequences)"
        return (f"{what}: loss {result['loss']:.4f} (no memory can do {result['uniform']:.4f}, perfect recall "
                f"{result['floor']:.4f})  recall accuracy {result['recall_accuracy']:.1%}  "
                f"[memory {result['mem_len']}]")

    # -- checkpoints: the memory travels with the weights ---------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Weights, optimiser and memory; in a data-parallel run the ranks' memories are gathered (the
        rows of the global batch, as one process would hold them) and rank 0 writes."""
        mems = [m if self.comm is None else gather_rows(self.comm, m) for m in self.mems or []]
        if self.rank0:
            state = dict(self.model_state())
            state.update({f"mems.{i}": m for i, m in enumerate(mems)})
            save_checkpoint(path, state, self.meta(), self.opt.state_dict())
        return Path(path)

    def load(self, path: str | Path, resume: bool = True) -> None:
        """As :meth:`Trainer.load`, the memory too (this rank's rows of it)."""
        ck = load_checkpoint(path)
        if ck.meta.get("kind") != self.kind:
            raise ValueError(f"{path} holds a {ck.meta.get('kind')!r} checkpoint, not a {self.kind} one")
        if resume:
            self.check_ranks(ck.meta, path)
        mems = {k: v for k, v in ck.model.items() if k.startswith("mems.")}
        self.load_model_state({k: v for k, v in ck.model.items() if k not in mems}, ck.meta)
        self.opt.load_state_dict(ck.optim)
        self.step = int(ck.meta["step"])
        rows = [self.local(mems[f"mems.{i}"])[0] for i in range(len(mems))]   # this rank's (data parallel)
        self.mems = [to_device(m, self.cfg.backend).astype(self.model.dtype, copy=False) for m in rows] or None
