"""Training the paper's encoder-decoder (``Seq2Seq``) on a built-in task:
``npformer train [--task dates|numbers|copy|reverse|summarise]``, the default job.

A step draws ``batch_size`` pairs of the task's training set from (seed, step) and minimises the
label-smoothed cross-entropy of the target tokens, padding ignored. Validation reports the loss
without smoothing and the task's scores of the greedy decoder's outputs on the held-out pairs: exact
match, and token F1 for summarise (``Seq2SeqTask.metrics``).
"""
from __future__ import annotations

from npformer.backend import default_rng, to_device
from npformer.checks import positive_int
from npformer.data.tasks import METRICS, TASKS, get_task
from npformer.data.vocab import BOS_ID, EOS_ID, PAD_ID
from npformer.errors import RangeError
from npformer.models.decoding import beam_search, eval_mode, greedy_decode
from npformer.models.seq2seq import Seq2Seq, Seq2SeqConfig
from npformer.ops.cross_entropy import cross_entropy_forward
from npformer.training.config import Seq2SeqTrainConfig
from npformer.training.loop import StepLoss, Trainer

__all__ = ["Seq2SeqTrainer"]


class Seq2SeqTrainer(Trainer):
    """The paper's encoder-decoder on a built-in translation-like task, scored by the task's metrics."""

    kind = "seq2seq"
    cfg: Seq2SeqTrainConfig

    def build(self):
        c = self.cfg
        if c.task not in TASKS:
            raise ValueError(f"task {c.task!r} is not a seq2seq task; expected one of {sorted(TASKS)}")
        self.task = get_task(c.task, seed=c.seed, n_train=c.n_train, n_valid=c.n_valid)
        if c.share_vocab:
            self.task = self.task.with_shared_vocabulary()
        if c.batch_size > len(self.task.train):       # a batch draws distinct pairs
            raise RangeError(f"--batch-size {c.batch_size} exceeds the {len(self.task.train)} training pairs of "
                             f"--task {c.task} (--n-train); give a smaller --batch-size or a larger --n-train")
        max_len = max(self.task.max_src_len, self.task.max_tgt_len) + 8
        self.model_config = Seq2SeqConfig(
            src_vocab_size=len(self.task.src_vocab), tgt_vocab_size=len(self.task.tgt_vocab),
            d_model=c.d_model, nhead=c.heads, num_encoder_layers=c.layers, num_decoder_layers=c.layers,
            dim_feedforward=c.ff, dropout=c.dropout, activation=c.activation or "relu",
            norm_first=bool(c.norm_first), max_len=max_len, pad_id=PAD_ID,
            tie_embeddings=True, share_embeddings=c.share_vocab)
        return Seq2Seq(self.model_config, dtype=c.dtype, backend=c.backend, rng=c.seed)

    def resolved(self):
        m = self.model_config
        return {"activation": m.activation, "norm_first": m.norm_first, "n_train": len(self.task.train),
                "n_valid": len(self.task.valid)}

    def _batch(self, pairs):
        b = self.task.encode_batch(pairs)
        return (to_device(b.src, self.cfg.backend), to_device(b.tgt_in, self.cfg.backend),
                to_device(b.tgt_out, self.cfg.backend), int((b.tgt_out != PAD_ID).sum()) + b.src.size)

    def loss_and_backward(self, step):
        c = self.cfg
        pick = default_rng((c.seed, step), "numpy").choice(len(self.task.train), c.batch_size, replace=False)
        (pick,) = self.local(pick)                    # data parallel: this rank's rows of the batch
        src, tgt_in, tgt_out, tokens = self._batch([self.task.train[i] for i in pick.tolist()])
        logits = self.model(src, tgt_in)                                          # (B, T, V)
        loss = self.cross_entropy(logits, tgt_out, ignore_index=PAD_ID, label_smoothing=c.label_smoothing)
        self.model.backward(loss.grad)
        return StepLoss(float(loss.value), tokens, loss.valid)

    # -- evaluation --------------------------------------------------------------------------------
    def evaluate(self, limit: int | None = None, batch_size: int = 250) -> dict:
        """Validation loss (no smoothing) and the task's scores of the greedy decoder's outputs."""
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
        return {"loss": total_loss / max(total_tokens, 1), **self.task.score(preds, [t for _, t in pairs]),
                "predictions": preds, "targets": [t for _, t in pairs], "sources": [s for s, _ in pairs]}

    def translate(self, sources: list[str], beam: int = 1, length_penalty: float = 0.6) -> list[str]:
        """Each source decoded greedily (``beam=1``) or by beam search with ``beam`` hypotheses (at most
        the target vocabulary's size) and the GNMT length penalty. A character outside the source
        vocabulary is an error naming it."""
        for s in sources:
            self.task.src_vocab.check_text(s, "source")
        src, _ = self.task.encode_sources(sources)
        src, max_len = to_device(src, self.cfg.backend), self.task.max_tgt_len + 2
        if positive_int(beam, "beam") == 1:
            ids = greedy_decode(self.model, src, bos_id=BOS_ID, eos_id=EOS_ID, max_len=max_len)
        else:
            ids = beam_search(self.model, src, bos_id=BOS_ID, eos_id=EOS_ID, max_len=max_len, beam_size=beam,
                              length_penalty=length_penalty)
        return [self.task.tgt_vocab.decode(r) for r in ids]

    def vocabularies(self):
        return {"src_vocab": self.task.src_vocab, "tgt_vocab": self.task.tgt_vocab}

    def describe(self) -> str:
        c = self.cfg
        return (f"task {c.task}: {len(self.task.train)} train / {len(self.task.valid)} valid pairs; "
                f"Seq2Seq {self.model.num_parameters():,} parameters (d_model={c.d_model}, heads={c.heads}, "
                f"layers={c.layers}+{c.layers}, ff={c.ff}) on {c.arithmetic()}")

    def report(self, result: dict, quick: bool) -> str:
        n = len(result["targets"])
        what = f"valid ({n} examples)" if quick else f"final validation ({n} held-out examples)"
        scores = "  ".join(f"{METRICS[m][0]} {result[m]:.1%}" for m in self.task.metrics)
        return f"{what}: loss {result['loss']:.4f}  {scores}"
