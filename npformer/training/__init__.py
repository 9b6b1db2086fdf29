"""Training utilities: optimisers, gradient clipping and learning-rate schedules."""
from npformer.training.optim import SGD, Adam, AdamW, Optimizer, clip_grad_norm
from npformer.training.schedules import LRScheduler, constant_lr, cosine_with_warmup, noam_lr

__all__ = [
    "Optimizer", "SGD", "Adam", "AdamW", "clip_grad_norm",
    "LRScheduler", "noam_lr", "cosine_with_warmup", "constant_lr",
]
