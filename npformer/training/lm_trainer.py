"""Training a ``GPT`` as a character-level language model: ``npformer train --task charlm``.

The text is the corpus shipped with npformer or any UTF-8 file (``--text PATH``); validation is
the last 10% of it. The batch of step s is drawn from (seed, s), as for every trainer, so runs
resume exactly. Reports the validation loss in nats and bits per character and a sample.

Three configurations of the same ``GPT`` (``--model``):

* ``gpt``: pre-norm, tanh-GELU, scaled residual initialisation; ``--post-norm``/``--activation``
  change it;
* ``gpt1`` (Radford et al. 2018): post-norm blocks ``x = LN(x + f(x))``, no final layer norm, GELU
  (the tanh form, as in OpenAI's released finetune-transformer-lm code), every weight matrix
  N(0, 0.02^2) with no depth scaling, learned positions, tied output;
* ``gpt2`` (Radford et al. 2019): pre-norm blocks ``x = x + f(LN(x))``, a final layer norm, tanh-GELU,
  the residual projections (``out_proj``, ``linear2``) at N(0, (0.02 / sqrt(2 L))^2).
"""
from __future__ import annotations

import math

from npformer.backend import default_rng, to_device, to_numpy
from npformer.data.corpus import SAMPLE_PROMPT, CharLMData
from npformer.data.vocab import SPECIALS, CharVocab
from npformer.errors import RangeError
from npformer.models.decoding import eval_mode, generate
from npformer.models.gpt import GPT, GPTConfig
from npformer.ops.cross_entropy import cross_entropy_forward
from npformer.training.config import CharLMTrainConfig
from npformer.training.loop import StepLoss, Trainer

__all__ = ["LMTrainer", "GPT1Trainer", "GPT2Trainer", "LM_KINDS", "default_prompt", "sample_text"]

LM_KINDS = ("gpt", "gpt1", "gpt2")    # checkpoint kinds that npformer generate samples from


class LMTrainer(Trainer):
    """A decoder-only GPT (pre-norm, GELU, tied embeddings) predicting the next character."""

    kind = "gpt"
    cfg: CharLMTrainConfig
    label = "GPT"
    preset: dict = {}      # the GPTConfig fields a named configuration fixes (gpt1, gpt2)

    def build(self):
        c, p = self.cfg, self.preset
        if c.task != "charlm":
            raise ValueError(f"the {self.kind} trainer is a character language model: use --task charlm "
                             f"[--text FILE] (got --task {c.task})")
        if "norm_first" in p and c.norm_first is not None and c.norm_first != p["norm_first"]:
            raise ValueError(f"--model {self.kind} is {'pre' if p['norm_first'] else 'post'}-norm by "
                             "definition; use --model gpt to choose the norm placement")
        self.data = CharLMData(c.corpus(), block_size=c.block_size, seed=c.seed)
        blocks = self.data.num_windows("train")        # a larger batch only repeats blocks (10**8 fills the memory)
        if c.batch_size > blocks:
            raise RangeError(f"--batch-size {c.batch_size} exceeds the {blocks:,} distinct blocks of --block-size "
                             f"{c.block_size} in the training text; give a smaller --batch-size or a longer --text")
        self.vocab = self.data.vocab
        config = GPTConfig(vocab_size=len(self.vocab), block_size=c.block_size, n_layer=c.layers,
                           n_head=c.heads, d_model=c.d_model, dim_feedforward=c.ff,
                           dropout=c.dropout, activation=c.activation or p.get("activation", "gelu_tanh"),
                           norm_first=p.get("norm_first", True if c.norm_first is None else c.norm_first),
                           scaled_residual_init=p.get("scaled_residual_init", True), bias=c.bias)
        return GPT(config, dtype=c.dtype, backend=c.backend, rng=c.seed)

    bias_switch = True        # GPTConfig.bias: nanoGPT's bias=False

    def resolved(self):
        m = self.model.config
        return {"activation": m.activation, "norm_first": m.norm_first}

    graph_capable = True      # fixed-size batches: the step can be replayed from a CUDA graph

    def batch(self, step):
        """The (inputs, targets) of ``step`` on the model's device, (B, T) each."""
        c = self.cfg
        x, y = self.data.random_batch("train", c.batch_size, rng=default_rng((c.seed, step), "numpy"))
        x, y = self.local(x, y)                       # data parallel: this rank's rows of the batch
        return to_device(x, c.backend), to_device(y, c.backend)

    def forward_backward(self, x, y):
        """Forward, cross-entropy, backward of one batch; returns ``(loss, valid)`` (device arrays).
        The head and the loss run together, a chunk of rows at a time: no (B, T, V) logits."""
        h = self.model.hidden(x)                                                  # (B, T, C)
        loss = self.head_cross_entropy(self.model.head, h, y)                     # (), dh (B, T, C)
        self.model.backward_hidden(loss.grad)
        return loss.value, loss.valid

    def loss_and_backward(self, step):
        x, y = self.batch(step)
        loss, valid = self.forward_backward(x, y)
        return StepLoss(float(loss), int(x.size), valid)

    def evaluate(self, limit: int | None = None, batch_size: int = 32) -> dict:
        """Mean validation loss over non-overlapping blocks (the first ``limit`` blocks if given)."""
        total, count = 0.0, 0
        with eval_mode(self.model):
            for x, y in self.data.batches("valid", batch_size):
                loss, _ = cross_entropy_forward(self.model(to_device(x, self.cfg.backend)),
                                                to_device(y, self.cfg.backend), reduction="sum")
                total, count = total + float(loss), count + int(y.size)
                if limit and count >= limit * self.cfg.block_size:
                    break
        loss = total / max(count, 1)
        return {"loss": loss, "bits_per_char": loss / math.log(2),
                "sample": sample_text(self.model, self.vocab, self.sample_prompt(), 120, seed=self.cfg.seed,
                                      backend=self.cfg.backend)}

    def sample_prompt(self) -> str:
        """What the evaluation's sample continues: "The " where the vocabulary has its characters,
        else the first characters of the training text (always in the vocabulary)."""
        if all(ch in self.vocab for ch in SAMPLE_PROMPT):
            return SAMPLE_PROMPT
        return self.vocab.decode(self.data.train_ids[:len(SAMPLE_PROMPT)])

    def vocabularies(self):
        return {"vocab": self.vocab}

    def meta(self) -> dict:
        return {**super().meta(), "sample_prompt": self.sample_prompt()}    # npformer generate's default prompt

    def describe(self) -> str:
        c = self.cfg
        return (f"task charlm: {len(self.data.train_ids):,} train / {len(self.data.valid_ids):,} valid "
                f"characters, vocabulary {len(self.vocab)}; {self.label} "
                f"{self.model.num_parameters():,} parameters "
                f"(d_model={c.d_model}, heads={c.heads}, layers={c.layers}, block={c.block_size}) "
                f"on {c.arithmetic()}")

    def report(self, result: dict, quick: bool) -> str:
        what = "valid" if quick else "final validation"
        text = f"{what}: loss {result['loss']:.4f}  ({result['bits_per_char']:.3f} bits/char)"
        return text if quick else text + f"\nsample: {result['sample']!r}"


class GPT1Trainer(LMTrainer):
    """GPT-1: post-norm, GELU (tanh form), no final layer norm, N(0, 0.02^2) weights without depth scaling."""

    kind = "gpt1"
    label = "GPT-1 (post-norm)"
    preset = {"norm_first": False, "activation": "gelu_tanh", "scaled_residual_init": False}


class GPT2Trainer(LMTrainer):
    """GPT-2: pre-norm, final layer norm, tanh-GELU, residual projections at 0.02 / sqrt(2 L)."""

    kind = "gpt2"
    label = "GPT-2 (pre-norm)"
    preset = {"norm_first": True, "activation": "gelu_tanh", "scaled_residual_init": True}


def default_prompt(meta: dict, vocab: CharVocab, path) -> str:
    """What ``npformer generate --checkpoint path`` continues without ``--prompt``: the prompt the run's
    samples continued (:meth:`LMTrainer.sample_prompt`, kept in the checkpoint's meta), so the text is
    never read again. A checkpoint from before it was kept: "The ", where its vocabulary has those
    characters; else an error asking for --prompt."""
    if "sample_prompt" in meta:                   # a str: load_checkpoint checks it
        return meta["sample_prompt"]
    if all(ch in vocab for ch in SAMPLE_PROMPT):
        return SAMPLE_PROMPT
    raise RangeError(f"--prompt: the vocabulary of {path} lacks the characters of the default prompt "
                     f"{SAMPLE_PROMPT!r}, and the checkpoint does not say how its text starts (it was written before "
                     "checkpoints kept that); give --prompt")


def sample_text(model: GPT, vocab: CharVocab, prompt: str, n: int, *, seed: int = 0, backend: str = "numpy",
                temperature: float = 0.8, top_k: int | None = None, top_p: float | None = 0.95) -> str:
    """``prompt`` continued by ``n`` sampled characters (an empty prompt starts from ``<bos>``). A
    character the model's vocabulary lacks is an error naming it. The special tokens are never drawn:
    the training text holds none, and a drawn ``<eos>`` ended the text early (an untrained model's
    200 characters could come out as 8), a ``<pad>`` or ``<bos>`` vanished from it."""
    ids = vocab.encode(vocab.check_text(prompt, "prompt")) or [vocab.bos_id]
    idx = to_device([ids], backend)
    out = generate(model, idx, n, default_rng(seed, backend), temperature=temperature, top_k=top_k,
                   top_p=top_p, exclude=range(len(SPECIALS)))
    return vocab.decode(to_numpy(out)[0].tolist())
