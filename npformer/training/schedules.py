"""Learning-rate schedules as plain functions of the step, and a scheduler that applies one.

    noam:    lr(s) = factor * d_model^-0.5 * min(s^-0.5, s * warmup^-1.5),  s = max(step, 1)
             (Vaswani et al. 2017, section 5.3); rises linearly, peaks at s == warmup, then ~ 1/sqrt(s)
    cosine:  lr(s) = base_lr * s / warmup                                    for s < warmup
             lr(s) = min_lr + (base_lr - min_lr) * (1 + cos(pi * q)) / 2,   q = (s - warmup) /
                     (total_steps - warmup), for warmup <= s <= total_steps; min_lr after that
    constant: lr(s) = base_lr

Steps are counted as :class:`LRScheduler` counts them: the k-th optimiser step (k = 0, 1, ...)
runs with lr = fn(k), the convention of torch.optim.lr_scheduler.LambdaLR. Every schedule returns
a Python float.
"""
from __future__ import annotations

import math
from typing import Any, Callable

from npformer.checks import real
from npformer.training.optim import Optimizer

__all__ = ["noam_lr", "cosine_with_warmup", "constant_lr", "LRScheduler"]


def _step(step: Any) -> float:
    return real(step, "step", 0)


def noam_lr(step: Any, d_model: int, warmup: int, factor: float = 1.0) -> float:
    """The Transformer schedule; step 0 is treated as step 1 (its formula is undefined at 0)."""
    s = max(_step(step), 1.0)
    d_model = real(d_model, "d_model", 0, low_open=True)
    warmup = real(warmup, "warmup", 0, low_open=True)
    factor = real(factor, "factor", 0)
    return factor * d_model ** -0.5 * min(s ** -0.5, s * warmup ** -1.5)


def cosine_with_warmup(step: Any, base_lr: float, warmup: int, total_steps: int,
                       min_lr: float = 0.0) -> float:
    """Linear warm-up from 0 to ``base_lr`` over ``warmup`` steps, cosine to ``min_lr`` at
    ``total_steps``, ``min_lr`` after. ``warmup = 0`` starts at base_lr; needs total_steps > warmup
    and 0 <= min_lr <= base_lr."""
    s = _step(step)
    base_lr = real(base_lr, "base_lr", 0)
    warmup = real(warmup, "warmup", 0)
    total_steps = real(total_steps, "total_steps", warmup, low_open=True)
    min_lr = real(min_lr, "min_lr", 0, base_lr)
    if s < warmup:
        return base_lr * s / warmup
    if s >= total_steps:
        return min_lr
    q = (s - warmup) / (total_steps - warmup)
    return min_lr + (base_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * q))


def constant_lr(step: Any, base_lr: float) -> float:
    """``base_lr`` at every step."""
    _step(step)
    return real(base_lr, "base_lr", 0)


class LRScheduler:
    """Sets ``optimizer.lr`` (every param group's lr) to ``fn(k)`` for the k-th optimiser step.

    The lr for step 0 is set on construction; call :meth:`step` after each ``optimizer.step()``::

        sched = LRScheduler(opt, lambda s: noam_lr(s, d_model=512, warmup=4000))
        for batch in data:
            ...; opt.step(); sched.step()
    """

    def __init__(self, optimizer: Optimizer, fn: Callable[[int], float]):
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"optimizer must be an npformer Optimizer, got {type(optimizer).__name__}")
        if not callable(fn):
            raise TypeError(f"fn must be a callable step -> lr, got {type(fn).__name__}")
        self.optimizer, self.fn = optimizer, fn
        self.last_step = 0
        self.last_lr = self._apply(0)

    def _apply(self, step: int) -> float:
        lr = self.fn(step)
        try:
            lr = real(lr, "lr", 0)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"schedule fn({step}) gave an invalid learning rate: {exc}") from None
        self.optimizer.lr = lr
        return lr

    def step(self) -> float:
        """Advance one step and set the optimiser's lr to fn(step); returns that lr."""
        self.last_lr = self._apply(self.last_step + 1)
        self.last_step += 1
        return self.last_lr

    def state_dict(self) -> dict[str, Any]:
        """{"last_step": int, "last_lr": float}; the schedule itself is code, not state."""
        return {"last_step": self.last_step, "last_lr": self.last_lr}

    def load_state_dict(self, sd: dict[str, Any]) -> "LRScheduler":
        """Resume at ``sd["last_step"]`` and set the lr from fn (``last_lr`` is informational)."""
        unknown = sorted(set(sd) - {"last_step", "last_lr"})
        if "last_step" not in sd or unknown:
            raise ValueError(f"scheduler state dict needs key 'last_step' (and optionally "
                             f"'last_lr'); got keys {sorted(sd)}")
        step = real(sd["last_step"], "last_step", 0)
        if step != int(step):
            raise ValueError(f"last_step must be a whole number, got {sd['last_step']!r}")
        self.last_lr = self._apply(int(step))
        self.last_step = int(step)
        return self
