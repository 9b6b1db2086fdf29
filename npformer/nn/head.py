"""``OutputHead``: the pre-softmax projection ``logits = x W^T (+ b)`` onto the vocabulary, with its
weight optionally tied to a token embedding (the paper, section 3.4; GPT-2; llm.c's ``wte``).

Tied, the head holds the embedding's very :class:`Parameter` object, so both uses accumulate into
one gradient: ``dW = d_embedding_lookup + dlogits^T x``, and ``state_dict`` lists it under both
names as PyTorch does for tied weights.
"""
from __future__ import annotations

from npformer.nn import init
from npformer.nn.module import Module, Parameter
from npformer.ops.linear import linear_backward, linear_forward

__all__ = ["OutputHead"]


class OutputHead(Module):
    def __init__(self, d_model: int, vocab_size: int, bias: bool = False, *, tied: Parameter | None = None,
                 dtype=None, backend=None, rng=None):
        super().__init__()
        rng = init.host_generator(rng)   # one stream for all of this module's draws
        if tied is not None and tied.shape != (vocab_size, d_model):
            raise ValueError(f"tied weight: expected shape (V, C)=({vocab_size}, {d_model}), got {tied.shape}")
        self.tied = tied is not None
        self.weight = tied if tied is not None else Parameter(
            init.normal((vocab_size, d_model), d_model ** -0.5, rng=rng, dtype=dtype, backend=backend))
        self.bias = Parameter(init.zeros((vocab_size,), dtype=dtype, backend=backend), decay=False) \
            if bias else None

    def forward(self, x):
        logits, cache = linear_forward(x, self.weight.data, None if self.bias is None else self.bias.data)
        self._push(cache)
        return logits                                    # (..., V)

    def backward(self, dlogits):
        dx, dweight, dbias = linear_backward(dlogits, self._pop())
        self.weight.accumulate(dweight)
        if self.bias is not None:
            self.bias.accumulate(dbias)
        return dx                                        # (..., C)

    def extra_repr(self) -> str:
        v, c = self.weight.shape
        return f"d_model={c}, vocab_size={v}, tied={self.tied}, bias={self.bias is not None}"
