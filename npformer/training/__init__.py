"""Training: optimisers, learning-rate schedules, gradient clipping, mixed precision, checkpoints,
and the trainers behind ``npformer train``.

The trainers' modules, bottom-up (each imports only those above it in this list):
``config`` (a config per model kind, the model names), ``loop`` (the ``Trainer`` every model shares),
``seq2seq_trainer``, ``lm_trainer``, ``mlm_trainer``, ``xl_trainer`` (one per task), ``registry``
(``TRAINERS``: model name -> trainer class, ``make_trainer``). Beside them: ``run`` (the run directory)
and ``resume`` (which checkpoint ``--resume`` continues, with which config).
"""
from npformer.training.optim import SGD, Adam, AdamW, Optimizer, clip_grad_norm
from npformer.training.schedules import LRScheduler, constant_lr, cosine_with_warmup, noam_lr

__all__ = [
    "Optimizer", "SGD", "Adam", "AdamW", "clip_grad_norm",
    "LRScheduler", "noam_lr", "cosine_with_warmup", "constant_lr",
]
