"""``Dropout`` as a module: ``torch.nn.Dropout``, its masks drawn from the module's own random
stream (:meth:`npformer.nn.Module.manual_seed`; a model shares one stream among all its modules).

When it drops nothing (eval mode, or p = 0) the module hands back its input itself, and its backward
the gradient itself, as PyTorch's does: no copy (the ops, :mod:`npformer.ops.dropout`, return fresh
arrays; this is :func:`~npformer.ops.dropout.dropout_term`, the module's view of them)."""
from __future__ import annotations

from npformer.checks import probability
from npformer.nn import init
from npformer.nn.module import Module
from npformer.ops.dropout import dropout_term, dropout_term_backward

__all__ = ["Dropout"]


class Dropout(Module):
    """Zeroes each element with probability ``p`` in training and scales the rest by 1 / (1 - p)."""

    def __init__(self, p: float = 0.5, *, rng=None):
        super().__init__()
        self.p = probability(p, "dropout probability p")
        self.manual_seed(init.stream_seed(rng))

    def forward(self, x):
        active = self.training and self.p > 0
        out, cache = dropout_term(x, self.p, rng=self.generator(x) if active else None, training=active)
        self._push(cache)
        return out

    def backward(self, dout):
        return dropout_term_backward(dout, self._pop())

    def extra_repr(self) -> str:
        return f"p={self.p}"
