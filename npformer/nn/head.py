"""``OutputHead``: the pre-softmax projection ``logits = x W^T (+ b)`` onto the vocabulary, with its
weight optionally tied to a token embedding (the paper, section 3.4; GPT-2; llm.c's ``wte``).

It is a :class:`Linear` whose weight may be another module's :class:`Parameter` object: tied, both
uses accumulate into one gradient, ``dW = d_embedding_lookup + dlogits^T x``, and ``state_dict``
lists it under both names as PyTorch does for tied weights. Untied, it starts N(0, 1/d) and has no
bias by default.

A training step may take the head and its loss together (:meth:`cross_entropy`), a chunk of rows at
a time, so the (..., V) logits never exist whole.
"""
from __future__ import annotations

from npformer.checks import describe, positive_int
from npformer.errors import InputTypeError, ShapeError
from npformer.nn import init
from npformer.nn.linear import Linear
from npformer.nn.module import Parameter
from npformer.ops.linear_cross_entropy import LinearCrossEntropy, linear_cross_entropy

__all__ = ["OutputHead"]


class OutputHead(Linear):
    def __init__(self, d_model: int, vocab_size: int, bias: bool = False, *, tied: Parameter | None = None,
                 dtype=None, backend=None, rng=None):
        d_model, vocab_size = positive_int(d_model, "d_model"), positive_int(vocab_size, "vocab_size")
        if tied is not None and not isinstance(tied, Parameter):    # a bare array: never trained nor saved
            raise InputTypeError(f"tied: expected the Parameter of the weight to share (an embedding's "
                                 f".weight), got {describe(tied)}")
        if tied is not None and tied.shape != (vocab_size, d_model):
            raise ShapeError(f"tied weight: expected shape (V, C)=({vocab_size}, {d_model}), got {tied.shape}")
        weight = tied if tied is not None else Parameter(
            init.normal((vocab_size, d_model), d_model ** -0.5, rng=rng, dtype=dtype, backend=backend))
        super().__init__(d_model, vocab_size, bias=bias, dtype=dtype, backend=backend, rng=rng, zero_bias=True,
                         weight=weight)
        self.tied = tied is not None

    def cross_entropy(self, x, targets, *, dloss=1.0, **kwargs) -> LinearCrossEntropy:
        """The cross-entropy of this head's logits of ``x`` (..., C) with ``targets`` (...), and the
        gradients times ``dloss``, in one pass over chunks of rows
        (:func:`~npformer.ops.linear_cross_entropy.linear_cross_entropy`, whose keywords ``kwargs``
        are). The weight's (and bias's) gradients are accumulated here, as :meth:`backward` would;
        the result's ``dx`` is where the backward goes on from. Nothing is kept for :meth:`backward`."""
        weight, bias = self.arrays()
        result = linear_cross_entropy(x, weight, targets, bias, dloss=dloss, **kwargs)
        self.accumulate(result.dweight, result.dbias)
        return result

    def extra_repr(self) -> str:
        return super().extra_repr() + f", tied={self.tied}"
