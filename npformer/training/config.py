"""What ``npformer train`` runs: the loop's settings and the model size every kind shares
(:class:`TrainConfig`), and one config per model kind that adds only that kind's fields.

    config               adds                                        trains --model
    -------------------  ------------------------------------------  -----------------------
    TrainConfig          (the loop, the shared model size)           -
    Seq2SeqTrainConfig   label_smoothing, n_train, n_valid           seq2seq
    CharLMTrainConfig    text, block_size                            gpt, gpt1, gpt2, bert
    ALBERTTrainConfig    embedding_size, share (and CharLM's)        albert
    XLTrainConfig        block_size, mem_len, n_train, n_valid       transformer-xl

Every field is named as its flag (``--heads`` is ``heads``, ``--ff`` is ``ff``), in flags, config files,
config.json and the printed config alike; earlier names (:data:`RENAMED`) still load. The model configs
keep the names of the code they mirror (``GPTConfig``: nanoGPT's ``n_layer``/``n_head``; ``Seq2SeqConfig``:
``torch.nn.Transformer``'s ``nhead``/``dim_feedforward``; the BERT configs: Hugging Face's
``num_hidden_layers``), so that code, its checkpoints and its users' habits carry over; the trainers
translate. Every field has one home (``block_size`` and ``n_train``/``n_valid`` belong to two kinds each, so they
live in the small :class:`BlockSize` and :class:`ExampleCounts` that those kinds both extend) and its
help text in ``metadata["help"]``; the command line builds the flags of ``npformer train`` from these
fields, each :func:`option` holding the field's default, help, check and flag together, and
:func:`options_from_file` reads the same options from a JSON or TOML file (``--config``,
flags winning). :func:`make_config` builds the config of the chosen model and refuses an option that
model does not have; :data:`MODELS` says what each model is.

Every config checks its fields when it is made (:meth:`TrainConfig.__post_init__`), each message naming
the field's command-line flag (``--heads``, not ``nhead``), what was expected and what came: sizes and
counts are ints >= 1, rates finite numbers in their ranges (``--lr inf`` or ``nan`` is refused), the
choices one of theirs; ``--eval-every`` and ``--checkpoint-every`` may be 0 (only at the end), never
negative. Without ``--warmup`` the warm-up is :data:`DEFAULT_WARMUP` steps, or ``--steps // 10`` for a
run of :data:`DEFAULT_WARMUP` steps or fewer (so ``--steps 50`` alone runs); an explicit ``--warmup``
must be smaller than ``--steps``. A checkpoint keeps its config as a dict (``meta["train_config"]``);
:func:`config_from_dict` reads it back as the config of its kind, ignoring other kinds' fields, so a
checkpoint written before the configs were split (one flat dict of every kind's fields) loads too.

This module imports no model and no trainer, so the command line reads it when it builds its parser;
the trainers of these model names are in :mod:`npformer.training.registry`.

(No ``from __future__ import annotations`` here: the command line reads each field's type.)
"""
import difflib
import json
import math
import warnings
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Mapping

from npformer.backend import BACKENDS
from npformer.checks import describe, non_negative_int, one_of, positive_int, real
from npformer.data.corpus import check_corpus, load_corpus
from npformer.data.long_range import RecallTask
from npformer.data.tasks import TASKS as SEQ2SEQ_TASKS
from npformer.data.tasks import default_sizes
from npformer.errors import InputTypeError, RangeError, ShapeError
from npformer.files import read_text

__all__ = ["TrainConfig", "Seq2SeqTrainConfig", "CharLMTrainConfig", "ALBERTTrainConfig", "XLTrainConfig",
           "BlockSize", "ExampleCounts", "CONFIGS", "MODELS", "DEFAULT_MODELS", "DEFAULT_TASK", "DEFAULT_WARMUP", "PRECISIONS",
           "FIELDS",
           "option", "check_option", "flag", "choices", "RENAMED", "models_with", "default_model", "config_type",
           "make_config", "config_from_dict", "options_from_file", "SYNONYMS", "NOT_SETTINGS", "synonym_value",
           "setting_name", "unknown_setting"]

DEFAULT_TASK = "dates"
# earlier names of fields -> their names now (a field is named as its flag: --heads is ``heads``); a
# config file or a checkpoint that uses an earlier name still loads (a file with a FutureWarning)
RENAMED = {"nhead": "heads", "dim_feedforward": "ff"}
DEFAULT_WARMUP = 100        # warm-up steps of a run longer than this; a shorter one warms up for steps // 10
PRECISIONS = ("float32", "float16", "bfloat16")

# every task `npformer train` knows -> the model it trains unless --model says otherwise
DEFAULT_MODELS: dict[str, str] = {**dict.fromkeys(SEQ2SEQ_TASKS, "seq2seq"), "charlm": "gpt",
                                  "recall": "transformer-xl"}


# --preset NAME: the paper's sizes (npformer.models.seq2seq.PAPER_SIZES, imported when one is used:
# npformer --help imports no model)
SEQ2SEQ_PRESETS = ("paper-base", "paper-big")


def preset_options(name: str) -> dict[str, Any]:
    """The options ``--preset NAME`` sets (each given flag wins over its preset value)."""
    from npformer.models.seq2seq import PAPER_SIZES
    p = PAPER_SIZES[name.removeprefix("paper-")]
    return {"d_model": p["d_model"], "heads": p["nhead"], "layers": p["num_encoder_layers"],
            "ff": p["dim_feedforward"], "dropout": p["dropout"], "share_vocab": True}


def option(default: Any, help: str, check: Callable[[Any, str], Any] | None = None, *, flag: str | None = None,
           choices: tuple | None = None, metavar: str | None = None, off: tuple[str, str] | None = None) -> Any:
    """A config field, everything about it in one place: its default, help text and ``check(value,
    flag)`` (None for a field with ``choices``, checked against them), and how the command line
    spells it: ``flag`` (default ``--`` and the name with dashes), ``choices``, ``metavar``, and for a
    bool ``off``, the (flag, help) that sets it to False. The relations between fields (warm-up and
    steps, width and heads) are checked in :meth:`TrainConfig.__post_init__`."""
    return field(default=default, metadata={"help": help, "check": check, "flag": flag, "choices": choices,
                                            "metavar": metavar, "off": off})


def _of_type(kind: type, what: str) -> Callable[[Any, str], Any]:
    """The check that a value is a ``kind`` (a path is a str, a switch a bool); npformer.checks has
    checks of numbers, arrays and choices, none of a type alone."""
    def check(value: Any, name: str) -> Any:
        if not isinstance(value, kind):
            raise InputTypeError(f"{name}: expected {what}, got {describe(value)}")
        return value
    return check


def _max_norm(value: Any, name: str) -> float:
    """``--clip``: a finite number > 0, or inf for no clipping (clip_grad_norm's meaning)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == math.inf:
        return math.inf
    return real(value, name, 0, low_open=True, what="inf (no clipping) or a finite number")


def _dropout_rate(v: Any, n: str) -> float:
    return real(v, n, 0, 1, high_open=True, what="a dropout rate")


def _below_one(v: Any, n: str) -> float:
    return real(v, n, 0, 1, high_open=True)


def _positive(v: Any, n: str) -> float:
    return real(v, n, 0, low_open=True)


def _non_negative(v: Any, n: str) -> float:
    return real(v, n, 0)


def _path(value: Any, name: str) -> str:
    """A path: a non-empty str (``--out-dir ''`` names no directory: the run would save nothing)."""
    if not isinstance(value, str):
        raise InputTypeError(f"{name}: expected a path (str), got {describe(value)}")
    if not value:
        raise RangeError(f"{name}: expected a path, got an empty string")
    return value


_SWITCH = _of_type(bool, "True or False")


@dataclass(kw_only=True, frozen=True)
class TrainConfig:
    """The loop's settings and the model size every kind shares. Not trained itself: each model
    kind trains from its own config below. Frozen: another setting is another config
    (``dataclasses.replace``), checked again as a new one is."""

    model: str | None = option(None, "the model to train (default: the task's, see --task)")
    task: str = option(DEFAULT_TASK, "dates, numbers, copy, reverse, summarise: a Seq2Seq task; charlm: a character "
                       "language model on a text (--model gpt by default); recall: the long-range copy task "
                       "(--model transformer-xl by default)")
    seed: int = option(0, "seed of the weights, the batches and the dropout masks", non_negative_int)
    backend: str = option("numpy", "the array library", choices=BACKENDS)
    dtype: str = option("float32", "the model's floating-point type", choices=("float32", "float64"))
    precision: str = option("float32", "float16/bfloat16: mixed precision, a 16-bit model with float32 master "
                            "weights and dynamic loss scaling (meant for the GPU: NumPy has no 16-bit matmul "
                            "kernels)", choices=PRECISIONS)
    threads: int | None = option(None, "CPU threads for BLAS and npformer's own pool together "
                                 "(npformer.set_num_threads; default: the CPUs this process may use, or "
                                 "fewer when BLAS was set to fewer, e.g. by OMP_NUM_THREADS)", positive_int)
    steps: int = option(700, "optimiser steps", positive_int)
    batch_size: int = option(64, "examples a step", positive_int)
    lr: float = option(2e-3, "AdamW's peak learning rate, reached after the warm-up (a finite number > 0)", _positive)
    warmup: int | None = option(None, f"steps of linear warm-up from 0 to --lr, then a cosine down to --min-lr; "
                                f"fewer than --steps (default {DEFAULT_WARMUP}, or --steps // 10 when --steps is "
                                f"{DEFAULT_WARMUP} or fewer)", non_negative_int)
    min_lr: float = option(1e-4, "the learning rate at the last step (0 to --lr)", _non_negative)
    weight_decay: float = option(0.01, "AdamW's decoupled weight decay", _non_negative)
    decay: str = option("weights", "which parameters the weight decay applies to: weights (the layers' weight "
                        "matrices; not biases, norms or embeddings), matrices (every 2-d parameter, the "
                        "embeddings too, as nanoGPT and GPT-2), all", choices=("weights", "matrices", "all"))
    beta1: float = option(0.9, "AdamW's beta1, the first moment's decay, in [0, 1)", _below_one)
    beta2: float = option(0.999, "AdamW's beta2, the second moment's decay, in [0, 1) (nanoGPT's small "
                          "models: 0.99)", _below_one)
    clip: float = option(1.0, "clip the gradients' global norm to this (> 0; inf: no clipping)", _max_norm)
    d_model: int = option(128, "the model width", positive_int)
    heads: int = option(4, "attention heads", positive_int)
    layers: int = option(2, "layers (the Seq2Seq: encoder and decoder layers, each)", positive_int)
    ff: int = option(256, "feed-forward width", positive_int)
    dropout: float = option(0.1, "dropout rate, in [0, 1)", _dropout_rate)
    bias: bool = option(True, "biases in the linear layers and layer norms (the GPT models)", _SWITCH,
                        off=("--no-bias", "no biases in the linear layers and layer norms, as nanoGPT's bias=False"))
    activation: str | None = option(None, "the feed-forward activation (default: the model's: relu for "
                                    "seq2seq and transformer-xl, gelu_tanh for the others)",
                                    choices=("relu", "gelu", "gelu_tanh"))
    norm_first: bool | None = option(None, "pre-norm layers (GPT-2); default post-norm for seq2seq, "
                                     "pre-norm for gpt", _SWITCH, off=("--post-norm", "post-norm layers (the paper, "
                                                              "GPT-1)"))
    eval_every: int = option(350, "validate every this many steps (0: only at the end)", non_negative_int)
    eval_limit: int = option(300, "examples (Seq2Seq, recall) or blocks (the language models) each periodic "
                             "validation reads", positive_int)
    final_eval: bool = option(True, "end with a validation on the whole held-out split", _SWITCH,
                              off=("--no-final-eval", "end with a validation of --eval-limit examples or blocks, "
                                   "as the periodic ones"))
    log_every: int = option(25, "print the training loss every this many steps (>= 1; the last step is always "
                            "printed)", positive_int)
    out_dir: str | None = option(None, "the run directory: config.json, metrics.jsonl, last.npz and best.npz (the "
                                 "lowest validation loss) (default runs/TASK-MODEL, e.g. runs/dates-seq2seq)", _path,
                                 metavar="DIR")
    log_to: str | None = option(None, "also write the metrics as csv (train.csv, valid.csv) or tensorboard (event "
                                "files in tensorboard/; pip install \"npformer[tensorboard]\") in the run directory "
                                "(default: metrics.jsonl alone)", choices=("csv", "tensorboard"))
    checkpoint: str | None = option(None, "also write the latest checkpoint here (.npz), as last.npz in --out-dir "
                                    "(default: only there)", _path, metavar="PATH")
    checkpoint_every: int = option(200, "steps between checkpoints (0: only at the end)", non_negative_int)
    tf32: bool = option(False, "float32 matrix products on TF32 tensor cores (CuPy, compute capability >= 8.0): "
                        "faster, inputs rounded to 10 mantissa bits; see npformer.backend.matmul_precision", _SWITCH,
                        off=("--no-tf32", "exact float32 matrix products (the default)"))
    cuda_graph: bool = option(False, "replay each step's forward and backward from one CUDA graph (CuPy, the GPT "
                              "models: fixed-size batches; any --precision); see npformer.training.cuda_graph",
                              _SWITCH,
                              off=("--no-cuda-graph", "launch every kernel of a step from Python (the default)"))

    def __post_init__(self):
        """Check every field (the kind's own included) and fill in the default warm-up; see the module
        docstring for the rules. Messages name the command-line flags."""
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.default is None:       # an optional field left to its default
                continue
            check_option(f.name, value, flag(f.name))
        if self.d_model % self.heads:
            raise ShapeError(f"{flag('d_model')} {self.d_model} is not divisible by {flag('heads')} {self.heads}")
        if self.warmup is None:
            # (a frozen dataclass's own __post_init__ fills a field through object.__setattr__)
            object.__setattr__(self, "warmup", DEFAULT_WARMUP if self.steps > DEFAULT_WARMUP else self.steps // 10)
        elif self.warmup >= self.steps:
            raise RangeError(f"--warmup: expected fewer warm-up steps than --steps {self.steps}, got {self.warmup} "
                             f"(leave --warmup out for the default, which fits the run)")
        real(self.min_lr, "--min-lr", 0, self.lr)
        if self.precision != "float32" and self.dtype != "float32":
            raise RangeError(f"--precision {self.precision} keeps float32 master weights: use --dtype float32, "
                             f"not {self.dtype}")
        if self.tf32 and self.backend != "cupy":
            raise RangeError(f"--tf32 is a tensor-core mode of NVIDIA GPUs: it needs --backend cupy, got --backend "
                             f"{self.backend}")
        if self.cuda_graph and self.backend != "cupy":
            raise RangeError(f"--cuda-graph replays CUDA kernels: it needs --backend cupy, got --backend {self.backend}")

    def arithmetic(self) -> str:
        """Where and in what the model computes, as a run's first lines say it: "numpy float32", or
        "cupy float16 (mixed precision, float32 masters)"."""
        if self.precision == "float32":
            return f"{self.backend} {self.dtype}"
        return f"{self.backend} {self.precision} (mixed precision, {self.dtype} masters)"

    def data_source(self) -> str:
        """Where the run's examples and vocabularies come from, for a message: "--task dates"."""
        return f"--task {self.task}"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TrainConfig":
        """The config of ``cls`` from a dict such as ``asdict(config)``; keys that are not fields of
        ``cls`` are ignored."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def _sizes_help(what: str, split: int) -> str:
    """``what`` the task draws, and each task's default count of them (``split`` 0: training, 1:
    validation), tasks with the same count named together."""
    counts: dict[str, list[str]] = {}
    for name, sizes in {**default_sizes(), "recall": RecallTask.DEFAULT_SIZES}.items():
        counts.setdefault("every window" if sizes is None else f"{sizes[split]:,}", []).append(name)
    said = "; ".join(", ".join(names[:-1]) + " and " * (len(names) > 1) + names[-1] + " " + count
                     for count, names in counts.items())
    return f"{what} the task draws (default: {said})"


@dataclass(kw_only=True, frozen=True)
class ExampleCounts:
    """The fields of a kind whose task draws its examples: the Seq2Seq tasks, recall."""

    n_train: int | None = option(None, _sizes_help("training examples", 0), positive_int)
    n_valid: int | None = option(None, _sizes_help("validation examples", 1), positive_int)


@dataclass(kw_only=True, frozen=True)
class BlockSize:
    """The field of a kind that trains on fixed-length blocks of tokens: the character LMs, Transformer-XL."""

    block_size: int = option(64, "tokens a training sequence: a character LM's context, Transformer-XL's "
                             "segment", positive_int)


@dataclass(kw_only=True, frozen=True)
class Seq2SeqTrainConfig(ExampleCounts, TrainConfig):
    """The paper's encoder-decoder on a built-in task (:mod:`npformer.training.seq2seq_trainer`)."""

    label_smoothing: float = option(0.1, "label smoothing of the training loss, in [0, 1)", _below_one)
    share_vocab: bool = option(False, "one vocabulary for source and target, and one embedding for both sides "
                               "and the output projection (the paper's three-way sharing, section 3.4)", _SWITCH,
                               off=("--no-share-vocab", "a vocabulary and an embedding per side"))
    preset: str | None = option(None, "the paper's base or big model (Table 3): sets --d-model, --heads, --layers, "
                                "--ff, --dropout and --share-vocab where they are not given (default: none, each at its own default)",
                                choices=SEQ2SEQ_PRESETS)


@dataclass(kw_only=True, frozen=True)
class CharLMTrainConfig(BlockSize, TrainConfig):
    """A character model of a text: the GPTs (next character), BERT (masked characters)."""

    text: str | None = option(None, "train on this UTF-8 text (default: the shipped corpus)", _path, metavar="FILE")

    def data_source(self) -> str:
        return f"its text, --text {self.text}," if self.text else "the shipped corpus"

    def corpus(self) -> str:
        """The text to train on: the shipped corpus, or the file --text names, read as --config is (a
        missing, unreadable or non-UTF-8 file is one error naming --text) and not empty."""
        if self.text is None:
            return load_corpus()
        where = f"--text {self.text}"
        return check_corpus(read_text(self.text, where), where)


@dataclass(kw_only=True, frozen=True)
class ALBERTTrainConfig(CharLMTrainConfig):
    """ALBERT: BERT's masked characters, with a factorised embedding and layers that share parameters."""

    embedding_size: int | None = option(None, "factorise the embedding, V x E then E x H (default or 0: not "
                                        "factorised, tables V x H)", non_negative_int)
    share: str | None = option(None, "which parameters every layer shares (default all)",
                               choices=("all", "attention", "ffn", "none"))


@dataclass(kw_only=True, frozen=True)
class XLTrainConfig(BlockSize, ExampleCounts, TrainConfig):
    """Transformer-XL on the recall task, its memory carried from segment to segment."""

    mem_len: int | None = option(None, "memory length (default: the segment length --block-size; 0: no memory)",
                                 non_negative_int)


# model name (--model) -> the config of its kind: the one list of the model names;
# registry.TRAINERS gives each its trainer
CONFIGS: dict[str, type[TrainConfig]] = {
    "seq2seq": Seq2SeqTrainConfig, "gpt": CharLMTrainConfig, "gpt1": CharLMTrainConfig, "gpt2": CharLMTrainConfig,
    "bert": CharLMTrainConfig, "albert": ALBERTTrainConfig, "transformer-xl": XLTrainConfig,
}

# model name -> what it is, for ``npformer train --help``
MODELS: dict[str, str] = {
    "seq2seq": "the paper's encoder-decoder (Vaswani et al. 2017), post-norm, ReLU, tied output head; on a "
               "Seq2Seq task (dates, numbers, copy, reverse)",
    "gpt": "a decoder-only character language model (--task charlm), pre-norm and tanh-GELU unless --post-norm "
           "or --activation say otherwise",
    "gpt1": "GPT-1 (Radford et al. 2018): post-norm blocks, no final layer norm, N(0, 0.02^2) weights",
    "gpt2": "GPT-2 (Radford et al. 2019): pre-norm blocks, a final layer norm, residual projections scaled by "
            "1/sqrt(2 layers)",
    "bert": "BERT (Devlin et al. 2019): an encoder predicting masked characters of the text",
    "albert": "ALBERT (Lan et al. 2020): BERT with a factorised embedding (--embedding-size) and layers that "
              "share parameters (--share)",
    "transformer-xl": "Transformer-XL (Dai et al. 2019): segment recurrence with a memory (--mem-len) and "
                      "relative positions, on --task recall",
}



def _every_field() -> dict[str, Field]:
    every: dict[str, Field] = {}
    for cls in (TrainConfig, *CONFIGS.values()):
        for f in fields(cls):
            every.setdefault(f.name, f)
    return every


# field name -> field, every config's once: the loop's first, then each kind's
FIELDS: dict[str, Field] = _every_field()


# Other tools' names for npformer's settings, accepted in a config file and as flags (``n_embd = 128``,
# ``--n-embd 128``, ``--n_embd=128``): nanoGPT's train.py, Hugging Face's Trainer, PyTorch's examples.
# Only where the meaning is the same (nanoGPT's --device takes its values through synonym_value).
SYNONYMS = {"learning_rate": "lr", "max_steps": "steps", "max_iters": "steps", "n_layer": "layers",
            "n_head": "heads", "n_embd": "d_model", "output_dir": "out_dir", "eval_interval": "eval_every",
            "log_interval": "log_every", "warmup_iters": "warmup", "warmup_steps": "warmup", "device": "backend"}
_SYNONYM_VALUES = {"device": {"cpu": "numpy", "cuda": "cupy"}}     # nanoGPT's device -> npformer's backend

# Other tools' settings npformer has no counterpart of, and what to do instead.
NOT_SETTINGS = {
    "eval_iters": "a validation reads --eval-limit examples or blocks (nanoGPT's eval_iters x batch_size blocks)",
    "lr_decay_iters": "the cosine reaches --min-lr at the last step, --steps (nanoGPT's usual lr_decay_iters = max_iters)",
    "gradient_accumulation_steps": "a step is one batch of --batch-size; for a larger batch raise --batch-size, "
                                   "or train over several processes (mpirun, the data-parallel page)",
    "decay_lr": "the learning rate always warms up then follows a cosine; --min-lr equal to --lr keeps it constant",
    "grad_clip": "--clip sets the gradients' global norm limit (inf: none; nanoGPT's grad_clip 0 is --clip inf)",
    "init_from": "to continue a run: npformer train --resume --checkpoint RUN_DIR; GPT-2's weights: "
                 "npformer generate --model",
    "eval_only": "npformer eval --checkpoint RUN_DIR validates a trained model",
    "always_save_checkpoint": "every run writes last.npz (and every --checkpoint-every steps) and best.npz",
    "compile": "npformer compiles nothing; its fast paths are on unless --reference",
    "dataset": "--task picks a built-in task; --text FILE trains a character model on a text",
    "wandb_log": "metrics go to metrics.jsonl in the run directory, and to csv or tensorboard with --log-to",
}
NOT_SETTINGS.update(wandb_project=NOT_SETTINGS["wandb_log"], wandb_run_name=NOT_SETTINGS["wandb_log"])


def synonym_value(key: str, value: Any) -> Any:
    """``value`` as npformer's setting takes it, for a setting given by the synonym ``key``
    (``device="cuda"`` -> ``"cupy"``); a value with no translation comes back as it is."""
    table = _SYNONYM_VALUES.get(key.replace("-", "_"), {})
    return table.get(value.split(":")[0], value) if isinstance(value, str) else value     # cuda:0 -> cupy


def setting_name(key: str) -> str | None:
    """The field a config-file key or a flag without its dashes names: the field itself (``batch_size``),
    its flag's spelling (``batch-size``), a synonym (``n_embd``) or an earlier name (:data:`RENAMED`,
    said in a FutureWarning by :func:`options_from_file`); None for anything else."""
    snake = key.replace("-", "_")
    if snake in FIELDS:
        return snake
    by_flag = {flag(n)[2:]: n for n in FIELDS}
    return by_flag.get(key) or by_flag.get(key.replace("_", "-")) or SYNONYMS.get(snake)


def unknown_setting(key: str, spell: Callable[[str], str]) -> str:
    """Why ``key`` is no setting of npformer train: what to use instead where another tool has it
    (:data:`NOT_SETTINGS`), else the closest setting when one is close (``stepz`` -> steps), each
    written by ``spell`` (a field name -> a flag, or the name itself for a config file)."""
    snake = key.lstrip("-").replace("-", "_")
    if snake in NOT_SETTINGS:
        return f"npformer train has no such setting: {NOT_SETTINGS[snake]}"
    names = {**{n: n for n in FIELDS}, **SYNONYMS}                   # spellings -> their fields
    close = difflib.get_close_matches(snake, list(names), n=1, cutoff=0.7)
    return f"did you mean {spell(names[close[0]])}?" if close else "not a setting of npformer train"


def _current_name(name: str, where: str) -> str | None:
    """The field an earlier name (:data:`RENAMED`) stands for, said in a FutureWarning; None for others."""
    new = RENAMED.get(name)
    if new is not None:
        warnings.warn(f"{where}: {name!r} is the earlier name of {new!r} ({flag(new)}); it will stop being read, "
                      f"write {new!r}", FutureWarning, stacklevel=3)
    return new


def _current_names(options: Mapping[str, Any], where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in options.items():
        name = _current_name(key, where) or key
        if name in out:
            raise RangeError(f"{where}: {key!r} sets {flag(name)} a second time")
        out[name] = value
    return out


def check_option(name: str, value: Any, label: str) -> Any:
    """``value`` checked as the field ``name`` takes it (its choices, or its check), errors naming ``label``."""
    if choices(name) is not None:
        return one_of(value, label, choices(name))
    check = FIELDS[name].metadata["check"]
    return value if check is None else check(value, label)


def flag(name: str) -> str:
    """The command-line flag of the field ``name`` (``batch_size`` -> ``--batch-size``)."""
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
    that have it (``--share`` belongs to albert alone), never silently ignored. The config names its
    model even when the task chose it, so a run's config.json says which model it trained.
    """
    options = _current_names(options, "make_config")
    task = options.get("task", DEFAULT_TASK)
    model = options.get("model") or default_model(task)
    cls = config_type(model)
    own = {f.name for f in fields(cls)}
    if "preset" in own and options.get("preset") in SEQ2SEQ_PRESETS:   # its sizes, under what was given
        options = {**preset_options(options["preset"]), **options}
    for name in options:
        if name in own:
            continue
        if name not in FIELDS:
            raise RangeError(f"{name!r} is not an option of npformer train; {unknown_setting(name, repr)}")
        chosen = f"--model {model}" + ("" if options.get("model") else f" (the default for --task {task})")
        raise RangeError(f"{flag(name)} does not apply to {chosen}; it is an option of --model "
                         f"{', '.join(models_with(name))}")
    return cls(**{**options, "model": model})


def config_from_dict(d: Mapping[str, Any], model: str | None = None) -> TrainConfig:
    """The config a checkpoint keeps (``meta["train_config"]``), as the config of its model's kind,
    with ``model`` set.

    The model is ``d["model"]``, else ``model`` (a checkpoint's ``meta["kind"]``), else the task's
    default. Keys that are not fields of that kind are ignored: a checkpoint written before the
    configs were split holds every kind's fields (``mem_len`` for a GPT, ``share`` for a Seq2Seq, ...).
    """
    name = d.get("model") or model or default_model(d.get("task", DEFAULT_TASK))
    d = {RENAMED.get(k, k): v for k, v in d.items() if not (k in RENAMED and RENAMED[k] in d)}
    return config_type(name).from_dict({**d, "model": name})     # (a checkpoint's earlier names: RENAMED)


def toml_reader(where: str):
    """The TOML reader: the standard library's ``tomllib`` (Python 3.11+), else ``tomli``, the same
    module as a package, which npformer's install requires on Python 3.10."""
    try:
        import tomllib
        return tomllib
    except ImportError:
        pass
    try:
        import tomli
        return tomli
    except ImportError:
        raise RangeError(f"{where}: reading TOML on Python 3.10 needs tomli (pip install tomli); "
                         "or give a JSON file") from None


def options_from_file(path: str | Path) -> dict[str, Any]:
    """The options (field name -> value) in the JSON or TOML file ``path`` (``npformer train --config
    FILE``; TOML when the name ends in ``.toml``): one table of settings, each named as its field
    (``batch_size``, ``nhead``) or its flag without the dashes (``batch-size``, ``heads``), such as a
    run's config.json. A null value (JSON) leaves the field at its default. Each value is checked here
    (the message names the file and the key); how they fit together, as the config is made."""
    where = f"--config {path}"
    text = read_text(path, where)            # missing, a directory, not UTF-8: an error naming the file
    if Path(path).suffix == ".toml":
        toml = toml_reader(where)
        try:
            data = toml.loads(text)
        except toml.TOMLDecodeError as exc:
            raise RangeError(f"{where}: not valid TOML ({exc})") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise RangeError(f"{where}: not valid JSON ({exc.msg}, line {exc.lineno}); a .toml name reads TOML") \
                from None
    if not isinstance(data, dict):
        raise RangeError(f"{where}: expected a table of settings (a JSON object), got {describe(data)}")
    options: dict[str, Any] = {}
    for key, value in data.items():
        name = setting_name(key) or _current_name(key, where)
        if name is None:
            raise RangeError(f"{where}: {key!r} is not an option of npformer train; {unknown_setting(key, repr)} "
                             "(the options are npformer train --help's, with underscores: batch_size)")
        if name in options:
            raise RangeError(f"{where}: {key!r} sets {flag(name)} a second time")
        if value is None:
            continue
        value = synonym_value(key, value)
        check_option(name, value, f"{where}: {key}")   # each value alone now, so the message names the file
        options[name] = value
    return options
