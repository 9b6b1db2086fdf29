"""Masked-language-model training of BERT and ALBERT on characters:
``npformer train --task charlm --model bert|albert``.

Masking (Devlin et al. 2019, section 3.1): in every block of T characters, ``k = max(1, round(0.15 T))``
positions, drawn uniformly without replacement, are to be predicted. Of those, 80% are replaced by
``[MASK]``, 10% by a random character and 10% are left unchanged (so the model cannot tell which
visible characters to check). The loss is the cross-entropy at those k positions only, and only
their hidden states go through the masked-LM head::

    loss = -1/(B k) sum_{b, t in picked} log p(x[b, t] | corrupted x[b])

``[MASK]`` is an extra id after the character vocabulary (the model's vocabulary is ``len(vocab) + 1``).
Validation masks the validation blocks with a generator fixed by the seed (the same masks at every
evaluation) and reports the loss and the masked-token accuracy (arg-max = the original character),
beside the accuracy of always answering the most frequent training character. As for every
trainer, the batch and masks of step s are drawn from (seed, s), so a run resumes exactly.

The layers' GELU is the tanh approximation by default, as in the released BERT and ALBERT code
(google-research/bert ``modeling.py``); ``--activation gelu`` gives the exact erf form.
"""
from __future__ import annotations

import math

import numpy as np

from npformer.backend import default_rng, to_device, to_numpy
from npformer.data.corpus import CharLMData
from npformer.data.vocab import PAD_ID, SPECIALS
from npformer.errors import RangeError
from npformer.models.albert import ALBERT, ALBERTConfig
from npformer.models.bert import BERT, BERTConfig
from npformer.models.decoding import eval_mode
from npformer.ops.cross_entropy import cross_entropy_forward
from npformer.training.config import ALBERTTrainConfig, CharLMTrainConfig
from npformer.training.loop import StepLoss, Trainer

__all__ = ["MASK_RATE", "IGNORE", "mask_tokens", "MLMTrainer", "BERTTrainer", "ALBERTTrainer"]

MASK_RATE = 0.15
IGNORE = -100                 # target of the positions not to be predicted
_VALID_MASK_SEED = 7411       # the validation masks: a generator of (seed, this) only
_VALID_MIN_PICKED = 2000      # validation repeats the masking until this many positions are scored


def mask_tokens(ids, rng, *, mask_id: int, low: int, high: int, rate: float = MASK_RATE,
                split=(0.8, 0.1)):
    """BERT's corruption of ``ids`` (B, T) (host integers): returns ``(inputs, targets)``, both (B, T).

    ``k = max(1, round(rate T))`` positions a row are picked; ``targets`` holds their original ids
    and ``IGNORE`` elsewhere. A picked position becomes ``mask_id`` with probability ``split[0]``,
    a uniform random id in ``[low, high)`` with probability ``split[1]``, and stays as it was otherwise.
    """
    ids = np.asarray(ids)
    if ids.ndim != 2 or ids.dtype.kind not in "iu":
        raise TypeError(f"ids: expected a 2-d integer array (B, T), got {ids.dtype} {ids.shape}")
    if not 0.0 < rate <= 1.0:
        raise ValueError(f"rate: expected a fraction in (0, 1], got {rate!r}")
    if not low < high:
        raise ValueError(f"random ids are drawn from [low, high): expected low < high, got [{low}, {high})")
    b, t = ids.shape
    k = max(1, int(round(rate * t)))
    picked = np.argsort(rng.random((b, t)), axis=1)[:, :k]                    # (B, k) distinct positions
    rows = np.arange(b)[:, None]                                              # (B, 1)
    original = ids[rows, picked]                                              # (B, k)
    u = rng.random((b, k))                                                    # (B, k)
    randoms = rng.integers(low, high, size=(b, k))                            # (B, k)
    new = np.where(u < split[0], mask_id, np.where(u < split[0] + split[1], randoms, original))
    inputs = ids.copy()
    inputs[rows, picked] = new
    targets = np.full_like(ids, IGNORE)                                       # (B, T)
    targets[rows, picked] = original
    return inputs, targets


class MLMTrainer(Trainer):
    """A BERT-style encoder with a masked-LM head, predicting masked characters of a text."""

    kind = ""
    cfg: CharLMTrainConfig

    def resolved(self):
        return {"activation": self.model.config.activation, "norm_first": False}     # post-norm, as BERT

    def model_for(self, vocab_size: int):
        raise NotImplementedError

    def build(self):
        c = self.cfg
        if c.task != "charlm":
            raise ValueError(f"the {self.kind} trainer learns masked characters of a text: use --task charlm "
                             f"[--text FILE] (got --task {c.task})")
        if c.norm_first:
            raise ValueError(f"{self.kind} layers are post-norm (as the paper's); --norm-first does not apply")
        self.data = CharLMData(c.corpus(), block_size=c.block_size, seed=c.seed)
        blocks = self.data.num_windows("train")        # a larger batch only repeats blocks (10**8 fills the memory)
        if c.batch_size > blocks:
            raise RangeError(f"--batch-size {c.batch_size} exceeds the {blocks:,} distinct blocks of --block-size "
                             f"{c.block_size} in the training text; give a smaller --batch-size or a longer --text")
        self.vocab = self.data.vocab
        self.mask_id = len(self.vocab)                 # [MASK]: one id after the characters
        counts = np.bincount(self.data.train_ids, minlength=len(self.vocab))
        self.most_frequent = int(counts.argmax())
        return self.model_for(len(self.vocab) + 1)

    def _mask(self, ids, rng):
        return mask_tokens(ids, rng, mask_id=self.mask_id, low=len(SPECIALS), high=len(self.vocab))

    def _loss(self, inputs, targets, reduction="mean"):
        """Cross-entropy at the picked positions only. Returns (loss, cross-entropy cache, logits
        (B, k, V + 1), picked positions (B, k), the picked positions' targets (B, k))."""
        logits, cols, answers = self._picked_logits(inputs, targets)
        loss, cache = cross_entropy_forward(logits, to_device(answers, self.cfg.backend), reduction=reduction)
        return loss, cache, logits, cols, answers

    def _picked_logits(self, inputs, targets):
        """The MLM logits of the picked positions only. Their hidden states are gathered before the
        MLM head (as BERT's pre-training code does), so the head runs on B k positions, not B T."""
        backend = self.cfg.backend
        hidden, _ = self.model(to_device(inputs, backend))                       # (B, T, H)
        b = targets.shape[0]
        cols = np.nonzero(targets != IGNORE)[1].reshape(b, -1)                   # (B, k) k a row, in order
        rows = np.arange(b)[:, None]                                             # (B, 1)
        picked = hidden[to_device(rows, backend), to_device(cols, backend)]     # (B, k, H)
        logits = self.model.mlm_logits(picked)                                   # (B, k, V + 1)
        answers = targets[rows, cols]                                            # (B, k)
        return logits, cols, answers

    def loss_and_backward(self, step):
        c = self.cfg
        rng = default_rng((c.seed, step), "numpy")
        x, _ = self.data.random_batch("train", c.batch_size, rng=rng)
        inputs, targets = self.local(*self._mask(x, rng))     # data parallel: this rank's rows of the batch
        logits, cols, answers = self._picked_logits(inputs, targets)
        loss = self.cross_entropy(logits, to_device(answers, c.backend))
        dpicked = self.model.mlm.backward(loss.grad)                             # (B, k, H)
        # fwd: picked = hidden[rows, cols] (distinct cols in a row)  ->  dhidden[rows, cols] = dpicked
        dhidden = self.xp.zeros(inputs.shape + dpicked.shape[-1:], dtype=dpicked.dtype)   # (B, T, H)
        dhidden[to_device(np.arange(len(cols))[:, None], c.backend), to_device(cols, c.backend)] = dpicked
        self.model.backward(dhidden=dhidden)
        return StepLoss(float(loss.value), int(inputs.size), loss.valid)

    def evaluate(self, limit: int | None = None, batch_size: int = 64) -> dict:
        """Loss and accuracy at the masked positions of the validation blocks (the first ``limit``
        blocks if given), masked again with new draws until ``_VALID_MIN_PICKED`` positions are scored."""
        blocks = np.concatenate([x for x, _ in self.data.batches("valid", batch_size)])   # (N, T)
        blocks = blocks[:limit] if limit else blocks
        k = max(1, int(round(MASK_RATE * blocks.shape[1])))
        passes = max(1, math.ceil(_VALID_MIN_PICKED / (len(blocks) * k)))
        rng = default_rng((self.cfg.seed, _VALID_MASK_SEED), "numpy")
        total, right, baseline, count = 0.0, 0, 0, 0
        with eval_mode(self.model):
            for _ in range(passes):
                for i in range(0, len(blocks), batch_size):
                    loss, _, logits, _, answers = self._loss(*self._mask(blocks[i:i + batch_size], rng),
                                                             reduction="sum")
                    total += float(loss)
                    right += int((to_numpy(logits.argmax(axis=-1)) == answers).sum())
                    baseline += int((answers == self.most_frequent).sum())
                    count += int(answers.size)
        return {"loss": total / count, "accuracy": right / count, "baseline_accuracy": baseline / count,
                "masked": count, "example": self.fill_in(self.data.ids("valid")[:self.cfg.block_size])}

    def fill_in(self, ids, every: int = 7) -> tuple[str, str]:
        """Every ``every``-th character of ``ids`` replaced by [MASK], and the model's answer, the most
        likely character at each: (the text with '_' at the masked places, the text with the answers)."""
        ids = np.asarray(ids)[None]                                               # (1, T)
        inputs = ids.copy()
        inputs[:, 3::every] = self.mask_id
        with eval_mode(self.model):
            hidden, _ = self.model(to_device(inputs, self.cfg.backend))
            logits = self.model.mlm_logits(hidden)[..., len(SPECIALS):len(self.vocab)]   # characters only
            guess = to_numpy(logits.argmax(axis=-1)) + len(SPECIALS)              # (1, T)
        filled = np.where(inputs == self.mask_id, guess, ids)[0]
        shown = "".join("_" if i == self.mask_id else self.vocab.decode([int(i)]) for i in inputs[0])
        return shown, self.vocab.decode(filled)

    def vocabularies(self):
        return {"vocab": self.vocab}

    def meta(self) -> dict:
        return {**super().meta(), "mask_id": self.mask_id}

    def describe(self) -> str:
        c = self.cfg
        return (f"task charlm (masked): {len(self.data.train_ids):,} train / {len(self.data.valid_ids):,} "
                f"valid characters, vocabulary {len(self.vocab)} + [MASK]; {self.name()} "
                f"{self.model.num_parameters():,} parameters (d_model={c.d_model}, heads={c.heads}, "
                f"layers={c.layers}, block={c.block_size}{self.extra()}) on {c.arithmetic()}")

    def name(self) -> str:
        return type(self.model).__name__

    def extra(self) -> str:
        return ""

    def report(self, result: dict, quick: bool) -> str:
        what = "valid" if quick else "final validation"
        text = (f"{what} ({result['masked']} masked characters): loss {result['loss']:.4f}  masked-token "
                f"accuracy {result['accuracy']:.1%} "
                f"(most frequent character: {result['baseline_accuracy']:.1%})")
        if quick:
            return text
        shown, filled = result["example"]
        return text + f"\nmasked: {shown!r}\nfilled: {filled!r}"


class BERTTrainer(MLMTrainer):
    kind = "bert"

    def model_for(self, vocab_size):
        c = self.cfg
        config = BERTConfig(vocab_size=vocab_size, hidden_size=c.d_model, num_hidden_layers=c.layers,
                            num_attention_heads=c.heads, intermediate_size=c.ff,
                            max_position_embeddings=c.block_size, dropout=c.dropout,
                            activation=c.activation or "gelu_tanh", pad_token_id=PAD_ID, mlm_head=True)
        return BERT(config, dtype=c.dtype, backend=c.backend, rng=c.seed)


class ALBERTTrainer(MLMTrainer):
    """ALBERT: all layers shared unless ``share`` says otherwise; the embedding factorised only when
    ``embedding_size`` is given (None or 0: tables V x H).

    Why not factorised by default: the factorisation pays for a large vocabulary (V x H -> V x E + E x H,
    23M -> 4M parameters at BERT-base size); with about 64 characters E = 32 saves 8k of 166k, and the E-wide
    tables, which carry both the character and its position, slow learning. Measured on the shipped
    corpus at the default size (700 steps, all shared, before the masked-LM head took the layers'
    activation; 49.1% without the factorisation after it): masked-token accuracy 47.7% without the
    factorisation, 31.6% with E = 64, 26.0% with E = 32 (the unigram baseline is 19.2%); E = 32 gets
    to 39.7% in 1,400 steps.
    """

    kind = "albert"
    cfg: ALBERTTrainConfig

    def model_for(self, vocab_size):
        c = self.cfg
        e = c.embedding_size                  # None or >= 0 (the config checks it); 0: no factorisation
        config = ALBERTConfig(vocab_size=vocab_size, embedding_size=e or None, hidden_size=c.d_model,
                              num_hidden_layers=c.layers, num_attention_heads=c.heads,
                              intermediate_size=c.ff, max_position_embeddings=c.block_size,
                              dropout=c.dropout, activation=c.activation or "gelu_tanh", pad_token_id=PAD_ID,
                              share=c.share or "all", mlm_head=True)
        return ALBERT(config, dtype=c.dtype, backend=c.backend, rng=c.seed)

    def extra(self) -> str:
        m = self.model.config
        return f", embedding={m.embedding_size or 'none (E = H)'}, share={m.share}"

    def resolved(self):
        m = self.model.config
        return {**super().resolved(), "embedding_size": m.embedding_size or 0, "share": m.share}
