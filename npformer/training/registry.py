"""Every trainer of ``npformer train``, by model name: the top of :mod:`npformer.training`.

The layers read bottom-up, each importing only those below it::

    config                 TrainConfig and one config per model kind; the model names; no model imported
    loop                   Trainer: seeded steps, AdamW, clipping, mixed precision, checkpoints, resume
    seq2seq_trainer, lm_trainer, mlm_trainer, xl_trainer       one trainer per task, each a Trainer
    registry               TRAINERS and make_trainer (this module)

The model names and the config each trains from are :data:`npformer.training.config.CONFIGS`, which
the command line reads without importing a trainer; here each name gets its trainer class.
"""
from __future__ import annotations

from typing import Callable

from npformer.checks import one_of
from npformer.distributed import Communicator
from npformer.training.config import TrainConfig, default_model
from npformer.training.lm_trainer import GPT1Trainer, GPT2Trainer, LMTrainer
from npformer.training.loop import Trainer
from npformer.training.mlm_trainer import ALBERTTrainer, BERTTrainer
from npformer.training.seq2seq_trainer import Seq2SeqTrainer
from npformer.training.xl_trainer import XLTrainer

__all__ = ["TRAINERS", "make_trainer", "default_model"]

# model name -> its trainer; each trainer's kind is its model name, a key of config.CONFIGS
TRAINERS: dict[str, type[Trainer]] = {
    trainer.kind: trainer
    for trainer in (Seq2SeqTrainer, LMTrainer, GPT1Trainer, GPT2Trainer, BERTTrainer, ALBERTTrainer, XLTrainer)
}


def make_trainer(config: TrainConfig, log: Callable[[str], None] = print,
                 comm: Communicator | None = None) -> Trainer:
    """The trainer of ``config.model`` (default: the task's, :func:`default_model`: a GPT for
    ``charlm``, Transformer-XL for ``recall``, a Seq2Seq for the other tasks); data-parallel over the
    ranks of ``comm`` when one is given (:mod:`npformer.distributed`)."""
    name = config.model or default_model(config.task)
    return TRAINERS[one_of(name, "model", tuple(TRAINERS))](config, log, comm)
