"""The reference ops: pure ``<op>_forward`` / ``<op>_backward`` pairs, written as the math reads.

    out, cache = layer_norm_forward(x, weight, bias)
    dx, dweight, dbias = layer_norm_backward(dout, cache)

Plain and backend-neutral (NumPy or CuPy, taken from the arrays), each composed of the others, no
state and no mutation of inputs or caches (except the optimiser updates in :mod:`~npformer.ops.optim`,
which rewrite the parameters and moments they are given). Where a faster implementation exists it stands in
through :mod:`npformer.dispatch` (see :mod:`npformer.kernels`); ``with npformer.kernels.disabled():``
runs these alone. Every op module is an attribute of this package (``npformer.ops.attention``).
"""
from npformer.ops import (activations, attention, batchnorm, cross_entropy, dropout, embedding, feedforward,
                          flash_attention, layernorm, linear, masks, multihead, optim, relative_attention,
                          residual, rnn, softmax)

__all__ = ["activations", "attention", "batchnorm", "cross_entropy", "dropout", "embedding", "feedforward",
           "flash_attention", "layernorm", "linear", "masks", "multihead", "optim", "relative_attention", "residual",
           "rnn", "softmax"]
