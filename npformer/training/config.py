"""What ``npformer train`` runs: the loop's settings and the model size every kind shares
(:class:`TrainConfig`), and one config per model kind that adds only that kind's fields.

    config               adds                                        trains --model
    -------------------  ------------------------------------------  -----------------------
    TrainConfig          (the loop, the shared model size)           -
    Seq2SeqTrainConfig   label_smoothing, n_train, n_valid           seq2seq
    CharLMTrainConfig    text, block_size                            gpt, gpt1, gpt2, bert
    ALBERTTrainConfig    embedding_size, share (and CharLM's)        albert
    XLTrainConfig        block_size, mem_len, n_train, n_valid       transformer-xl

Every field has one home (``block_size`` and ``n_train``/``n_valid`` belong to two kinds each, so they
live in the small :class:`BlockSize` and :class:`ExampleCounts` that those kinds both extend) and its
help text in ``metadata["help"]``; the command line builds the flags of ``npformer train`` from these
fields. :func:`make_config` builds the config of the chosen model and refuses an option that model
does not have. A checkpoint keeps its config as a dict (``meta["train_config"]``);
:func:`config_from_dict` reads it back as the config of its kind, ignoring other kinds' fields, so a
checkpoint written before the configs were split (one flat dict of every kind's fields) loads too.

This module imports no model and no trainer, so the command line reads it when it builds its parser;
the trainers of these model names are in :mod:`npformer.training.registry`.

(No ``from __future__ import annotations`` here: the command line reads each field's type.)
"""
from dataclasses import Field, dataclass, field, fields
from typing import Any, Mapping

from npformer.backend import BACKENDS
from npformer.checks import one_of
from npformer.data.tasks import TASKS as SEQ2SEQ_TASKS
from npformer.errors import RangeError

__all__ = ["TrainConfig", "Seq2SeqTrainConfig", "CharLMTrainConfig", "ALBERTTrainConfig", "XLTrainConfig",
           "BlockSize", "ExampleCounts", "CONFIGS", "DEFAULT_MODELS", "DEFAULT_TASK", "PRECISIONS", "FIELDS",
           "option", "flag", "choices", "models_with", "default_model", "config_type", "make_config",
           "config_from_dict"]

DEFAULT_TASK = "dates"
PRECISIONS = ("float32", "float16", "bfloat16")

# every task `npformer train` knows -> the model it trains unless --model says otherwise
DEFAULT_MODELS: dict[str, str] = {**dict.fromkeys(SEQ2SEQ_TASKS, "seq2seq"), "charlm": "gpt",
                                  "recall": "transformer-xl"}


def option(default: Any, help: str, *, flag: str | None = None, choices: tuple | None = None,
           metavar: str | None = None, off: tuple[str, str] | None = None) -> Any:
    """A config field with its default and help text, and how the command line spells it: ``flag``
    (default ``--`` and the name with dashes), ``choices``, ``metavar``, and for a bool ``off``, the
    (flag, help) that sets it to False."""
    return field(default=default, metadata={"help": help, "flag": flag, "choices": choices,
                                            "metavar": metavar, "off": off})


@dataclass(kw_only=True)
class TrainConfig:
    """The loop's settings and the model size every kind shares. Not trained itself: each model
    kind trains from its own config below."""

    model: str | None = option(None, "the model to train (default: the task's, see --task)")
    task: str = option(DEFAULT_TASK, "dates, numbers, copy, reverse: a Seq2Seq task; charlm: a character "
                       "language model on a text (--model gpt by default); recall: the long-range copy task "
                       "(--model transformer-xl by default)")
    seed: int = option(0, "seed of the weights, the batches and the dropout masks")
    backend: str = option("numpy", "the array library", choices=BACKENDS)
    dtype: str = option("float32", "the model's floating-point type", choices=("float32", "float64"))
    precision: str = option("float32", "float16/bfloat16: mixed precision, a 16-bit model with float32 master "
                            "weights and dynamic loss scaling (meant for the GPU: NumPy has no 16-bit matmul "
                            "kernels)", choices=PRECISIONS)
    steps: int = option(700, "optimiser steps")
    batch_size: int = option(64, "examples a step")
    lr: float = option(2e-3, "AdamW's peak learning rate, reached after the warm-up")
    warmup: int = option(100, "steps of linear warm-up from 0 to --lr; then a cosine down to --min-lr")
    min_lr: float = option(1e-4, "the learning rate at the last step")
    weight_decay: float = option(0.01, "AdamW's decoupled weight decay")
    clip: float = option(1.0, "clip the gradients' global norm to this")
    d_model: int = option(128, "the model width")
    nhead: int = option(4, "attention heads", flag="--heads")
    layers: int = option(2, "layers (the Seq2Seq: encoder and decoder layers, each)")
    dim_feedforward: int = option(256, "feed-forward width", flag="--ff")
    dropout: float = option(0.1, "dropout rate")
    activation: str | None = option(None, "the feed-forward activation (default: the model's: relu for "
                                    "seq2seq and transformer-xl, gelu_tanh for the others)",
                                    choices=("relu", "gelu", "gelu_tanh"))
    norm_first: bool | None = option(None, "pre-norm layers (GPT-2); default post-norm for seq2seq, "
                                     "pre-norm for gpt", off=("--post-norm", "post-norm layers (the paper, "
                                                              "GPT-1)"))
    eval_every: int = option(350, "validate every this many steps (0: only at the end)")
    log_every: int = option(25, "print the training loss every this many steps")
    checkpoint: str | None = option(None, "write a checkpoint here (.npz)", metavar="PATH")
    checkpoint_every: int = option(200, "steps between checkpoints")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TrainConfig":
        """The config of ``cls`` from a dict such as ``asdict(config)``; keys that are not fields of
        ``cls`` are ignored."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass(kw_only=True)
class ExampleCounts:
    """The fields of a kind whose task draws its examples: the Seq2Seq tasks, recall."""

    n_train: int | None = option(None, "training examples the task draws (default: the task's own)")
    n_valid: int | None = option(None, "validation examples the task draws (default: the task's own)")


@dataclass(kw_only=True)
class BlockSize:
    """The field of a kind that trains on fixed-length blocks of tokens: the character LMs, Transformer-XL."""

    block_size: int = option(64, "tokens a training sequence: a character LM's context, Transformer-XL's "
                             "segment")


@dataclass(kw_only=True)
class Seq2SeqTrainConfig(ExampleCounts, TrainConfig):
    """The paper's encoder-decoder on a built-in task (:mod:`npformer.training.seq2seq_trainer`)."""

    label_smoothing: float = option(0.1, "label smoothing of the training loss")


@dataclass(kw_only=True)
class CharLMTrainConfig(BlockSize, TrainConfig):
    """A character model of a text: the GPTs (next character), BERT (masked characters)."""

    text: str | None = option(None, "train on this UTF-8 text (default: the shipped corpus)", metavar="FILE")


@dataclass(kw_only=True)
class ALBERTTrainConfig(CharLMTrainConfig):
    """ALBERT: BERT's masked characters, with a factorised embedding and layers that share parameters."""

    embedding_size: int | None = option(None, "factorise the embedding, V x E then E x H (default: not "
                                        "factorised, tables V x H)")
    share: str | None = option(None, "which parameters every layer shares (default all)",
                               choices=("all", "attention", "ffn", "none"))


@dataclass(kw_only=True)
class XLTrainConfig(BlockSize, ExampleCounts, TrainConfig):
    """Transformer-XL on the recall task, its memory carried from segment to segment."""

    mem_len: int | None = option(None, "memory length (default: the segment length --block-size; 0: no memory)")


# model name (--model) -> the config of its kind: the one list of the model names;
# registry.TRAINERS gives each its trainer
CONFIGS: dict[str, type[TrainConfig]] = {
    "seq2seq": Seq2SeqTrainConfig, "gpt": CharLMTrainConfig, "gpt1": CharLMTrainConfig, "gpt2": CharLMTrainConfig,
    "bert": CharLMTrainConfig, "albert": ALBERTTrainConfig, "transformer-xl": XLTrainConfig,
}



def _every_field() -> dict[str, Field]:
    every: dict[str, Field] = {}
    for cls in (TrainConfig, *CONFIGS.values()):
        for f in fields(cls):
            every.setdefault(f.name, f)
    return every


# field name -> field, every config's once: the loop's first, then each kind's
FIELDS: dict[str, Field] = _every_field()


def flag(name: str) -> str:
    """The command-line flag of the field ``name`` (``nhead`` -> ``--heads``)."""
    return FIELDS[name].metadata["flag"] or "--" + name.replace("_", "-")


def choices(name: str) -> tuple | None:
    """The values the field ``name`` may take, None for any: the model names for ``model``, the
    tasks for ``task``, the field's own list otherwise."""
    return {"model": tuple(CONFIGS), "task": tuple(DEFAULT_MODELS)}.get(name, FIELDS[name].metadata["choices"])


def models_with(name: str) -> list[str]:
    """The models whose config has the field ``name``."""
    return [m for m, cls in CONFIGS.items() if any(f.name == name for f in fields(cls))]


def default_model(task: str) -> str:
    """The model ``task`` trains unless one is chosen: gpt for charlm, transformer-xl for recall,
    seq2seq for the Seq2Seq tasks."""
    return DEFAULT_MODELS[one_of(task, "task", tuple(DEFAULT_MODELS))]


def config_type(model: str) -> type[TrainConfig]:
    """The config class of ``model``."""
    return CONFIGS[one_of(model, "model", tuple(CONFIGS))]


def make_config(options: Mapping[str, Any]) -> TrainConfig:
    """The config of the model ``options`` choose (``model``, else the default of ``task``) with
    ``options`` (field name -> value) set and every other field at its default.

    An option the chosen model does not have is an error naming the option, the model and the models
    that have it (``--share`` belongs to albert alone), never silently ignored.
    """
    task = options.get("task", DEFAULT_TASK)
    model = options.get("model") or default_model(task)
    cls = config_type(model)
    own = {f.name for f in fields(cls)}
    for name in options:
        if name in own:
            continue
        if name not in FIELDS:
            raise RangeError(f"{name!r} is not an option of npformer train; expected one of {sorted(FIELDS)}")
        chosen = f"--model {model}" + ("" if options.get("model") else f" (the default for --task {task})")
        raise RangeError(f"{flag(name)} does not apply to {chosen}; it is an option of --model "
                         f"{', '.join(models_with(name))}")
    return cls(**options)


def config_from_dict(d: Mapping[str, Any], model: str | None = None) -> TrainConfig:
    """The config a checkpoint keeps (``meta["train_config"]``), as the config of its model's kind,
    with ``model`` set.

    The model is ``d["model"]``, else ``model`` (a checkpoint's ``meta["kind"]``), else the task's
    default. Keys that are not fields of that kind are ignored: a checkpoint written before the
    configs were split holds every kind's fields (``mem_len`` for a GPT, ``share`` for a Seq2Seq, ...).
    """
    name = d.get("model") or model or default_model(d.get("task", DEFAULT_TASK))
    return config_type(name).from_dict({**d, "model": name})
