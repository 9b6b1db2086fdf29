"""``Dropout`` as a module, and the dropout generator every module draws its masks from.

The generator is one per backend, reset by :func:`seed_dropout` (as ``torch.manual_seed`` resets
torch's). The trainer reseeds it from ``(seed, step)`` before every step, so a run resumed from a
checkpoint draws exactly the masks an uninterrupted run would have drawn.
"""
from __future__ import annotations

from typing import Any

from npformer.backend import backend_name, default_rng
from npformer.nn.module import Module
from npformer.ops.dropout import dropout_backward, dropout_forward

__all__ = ["Dropout", "seed_dropout", "dropout_generator"]

_GENERATORS: dict[str, Any] = {}
_SEEDS: dict[str, Any] = {}


def seed_dropout(seed: Any, backend: str | None = None) -> None:
    """Reset the dropout generator of ``backend`` (all backends when None) to ``seed``
    (an int or a sequence of ints such as ``(seed, step)``)."""
    names = [backend] if backend else ["numpy", "cupy"]
    for name in names:
        _SEEDS[name] = seed
        _GENERATORS.pop(name, None)


def dropout_generator(backend: str):
    """The shared dropout generator of ``backend`` (created from the last seed, default 0)."""
    if backend not in _GENERATORS:
        _GENERATORS[backend] = default_rng(_SEEDS.get(backend, 0), backend)
    return _GENERATORS[backend]


class Dropout(Module):
    """Zeroes each element with probability ``p`` in training and scales the rest by 1 / (1 - p)."""

    def __init__(self, p: float = 0.5):
        super().__init__()
        if not 0.0 <= float(p) <= 1.0:
            raise ValueError(f"dropout probability p must be in [0, 1], got {p!r}")
        self.p = float(p)

    def forward(self, x):
        active = self.training and self.p > 0
        rng = dropout_generator(backend_name(x)) if active else None
        out, cache = dropout_forward(x, self.p, rng=rng, training=active)
        self._push(cache)
        return out

    def backward(self, dout):
        return dropout_backward(dout, self._pop())

    def extra_repr(self) -> str:
        return f"p={self.p}"
