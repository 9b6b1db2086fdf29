"""Fast paths: faster implementations of reference ops, kept apart from the math they stand in for.

The reference ops (:mod:`npformer.ops`) are what a reader reads: plain, backend-neutral, composed
of each other. A fast path has its reference op's signature and cache type and gives the same
results (to rounding; parity tests hold each to its reference, outputs and gradients):

* :mod:`npformer.kernels.cpu`: NumPy arrays: element-wise chains over cache-sized blocks, softmax
  in the score buffer, a float32 erf, dropout masks hashed in small buffers;
* :mod:`npformer.kernels.numba_cpu`: NumPy float32/float64 arrays, when numba is installed (the
  ``fast`` extra): each op one compiled, vectorised loop over its rows, tried before the NumPy ones;
* :mod:`npformer.kernels.cuda`: CuPy arrays: fused CUDA kernels, one launch where the reference
  runs several (flash attention: one forward launch where the reference runs thousands).

:data:`FAST_PATHS` below is the whole table: which fast path stands in for which op, on which
inputs. A call of a reference op runs the first entry whose test accepts the arguments, or the
reference itself (:mod:`npformer.dispatch`). Everything runs on the reference path inside::

    with npformer.kernels.disabled():
        ...

and ``disabled("numba")`` switches off only the compiled paths (the NumPy fast paths run).

``npformer.kernels.implementation(op, *args)`` names what a call would run.
"""
from __future__ import annotations

from npformer.dispatch import FastPath, disabled, enabled, implementation, register, registered, set_enabled, takes
from npformer.kernels.cpu import activations as cpu_activations
from npformer.kernels.cpu import attention as cpu_attention
from npformer.kernels.cpu import dropout as cpu_dropout
from npformer.kernels.cpu import embedding as cpu_embedding
from npformer.kernels.cpu import layernorm as cpu_layernorm
from npformer.kernels.cpu import linear as cpu_linear
from npformer.kernels.cpu import numpy_floats
from npformer.kernels.cpu import optim as cpu_optim
from npformer.kernels.cpu import softmax as cpu_softmax
from npformer.kernels import numba_cpu
from npformer.kernels import cuda
from npformer.kernels.cuda import device_floats
from npformer.kernels.cuda import feedforward as cuda_feedforward
from npformer.kernels.cuda import flash_attention as cuda_flash
from npformer.kernels.cuda import multihead as cuda_multihead
from npformer.kernels.cuda import optim as cuda_optim
from npformer.kernels.cuda import residual as cuda_residual
from npformer.ops import (activations, attention, cross_entropy, dropout, embedding, feedforward, flash_attention,
                          layernorm, linear, multihead, optim, residual, softmax)

__all__ = ["FAST_PATHS", "FastPath", "disabled", "enabled", "set_enabled", "implementation", "registered"]


# (reference op, name, fast path, which arguments it takes), tried in this order. takes(check, names):
# check of the op's arguments by name ("cache.y": the cache's field y), looked up in the op's signature
# once at registration (npformer.dispatch.takes); the named functions test more than dtypes.
FAST_PATHS = (
    (softmax.softmax_forward, "cuda", cuda.softmax_forward, takes(device_floats, "x")),
    (softmax.softmax_forward, "cpu", cpu_softmax.softmax_forward, takes(numpy_floats, "x")),
    (softmax.softmax_backward, "cuda", cuda.softmax_backward, takes(device_floats, "dy", "cache.y")),
    (softmax.softmax_backward, "cpu", cpu_softmax.softmax_backward, takes(numpy_floats, "dy", "cache.y")),
    (softmax.log_softmax_forward, "cuda", cuda.log_softmax_forward, takes(device_floats, "x")),
    (softmax.log_softmax_forward, "cpu", cpu_softmax.log_softmax_forward, takes(numpy_floats, "x")),
    (softmax.log_softmax_backward, "cuda", cuda.log_softmax_backward, takes(device_floats, "dy", "cache.y")),
    (softmax.log_softmax_backward, "cpu", cpu_softmax.log_softmax_backward, takes(numpy_floats, "dy", "cache.y")),
    (activations.gelu_forward, "cuda", cuda.gelu_forward, takes(device_floats, "x")),
    (activations.gelu_forward, "cpu", cpu_activations.gelu_forward, takes(numpy_floats, "x")),
    (activations.gelu_backward, "cuda", cuda.gelu_backward, takes(device_floats, "dy", "cache.x")),
    (activations.gelu_backward, "cpu", cpu_activations.gelu_backward, takes(numpy_floats, "dy", "cache.x")),
    (layernorm.layer_norm_forward, "cuda", cuda.layer_norm_forward, takes(device_floats, "x", "weight", "bias")),
    (layernorm.layer_norm_forward, "cpu", cpu_layernorm.layer_norm_forward,
     takes(numpy_floats, "x", "weight", "bias")),
    (layernorm.layer_norm_backward, "cuda", cuda.layer_norm_backward,
     takes(lambda dy, weight, dtype: device_floats(dy, weight, dtype=dtype), "dy", "cache.weight", "cache.dtype")),
    (layernorm.layer_norm_backward, "cpu", cpu_layernorm.layer_norm_backward,
     takes(numpy_floats, "dy", "cache.weight")),
    (dropout.dropout_forward, "cuda", cuda.dropout_forward, takes(device_floats, "x")),
    (dropout.dropout_forward, "cpu", cpu_dropout.dropout_forward, takes(cpu_dropout.accepts, "x", "rng")),
    (dropout.dropout_backward, "cuda", cuda.dropout_backward, takes(device_floats, "dout")),
    (embedding.embedding_backward, "cpu", cpu_embedding.embedding_backward, cpu_embedding.accepts_backward),
    (linear.linear_forward, "cpu", cpu_linear.linear_forward, takes(numpy_floats, "x", "weight", "bias")),
    (linear.linear_forward, "cuda", cuda.linear_forward, takes(device_floats, "x", "weight", "bias")),
    (linear.linear_backward, "cuda", cuda.linear_backward, takes(device_floats, "dout")),
    (linear.linear_backward, "cpu", cpu_linear.linear_backward,
     takes(numpy_floats, "dout", "cache.x", "cache.weight")),
    (feedforward.feed_forward_forward, "cuda", cuda.feed_forward_forward,
     takes(cuda_feedforward.accepts_forward, "x", "w1", "b1", "w2", "b2", "activation")),
    (feedforward.feed_forward_backward, "cuda", cuda.feed_forward_backward, cuda_feedforward.accepts_backward),
    (residual.residual_dropout_forward, "cuda", cuda.residual_dropout_forward, takes(device_floats, "x", "branch")),
    (residual.residual_dropout_layer_norm_forward, "cuda", cuda.residual_dropout_layer_norm_forward,
     takes(device_floats, "x", "branch", "weight", "bias")),
    (residual.residual_dropout_layer_norm_backward, "cuda", cuda.residual_dropout_layer_norm_backward,
     cuda_residual.accepts_norm_backward),
    (cross_entropy.cross_entropy_forward, "cuda", cuda.cross_entropy_forward, takes(device_floats, "logits")),
    (cross_entropy.cross_entropy_backward, "cuda", cuda.cross_entropy_backward,
     takes(device_floats, "dloss", "cache.logits")),
    (flash_attention.flash_attention_forward, "cuda", cuda.flash_attention_forward, cuda_flash.accepts_forward),
    (flash_attention.flash_attention_backward, "cuda", cuda.flash_attention_backward, cuda_flash.accepts_backward),
    (multihead.self_attention_backward, "cuda", cuda_multihead.self_attention_backward,
     cuda_multihead.accepts_self_attention_backward),
    (optim.adam_update, "cuda", cuda.adam_update, cuda_optim.accepts_adam),
    (optim.adam_update, "cpu", cpu_optim.adam_update, cpu_optim.accepts_adam),
    (optim.sum_of_squares, "cuda", cuda.sum_of_squares, takes(device_floats, "x")),
    (optim.sum_of_squares, "cpu", cpu_optim.sum_of_squares, takes(numpy_floats, "x")),
    (attention.scaled_dot_product_attention_forward, "cpu", cpu_attention.scaled_dot_product_attention_forward,
     takes(numpy_floats, "q", "k", "v")),
    (attention.scaled_dot_product_attention_backward, "cpu", cpu_attention.scaled_dot_product_attention_backward,
     takes(numpy_floats, "dout", "cache.p")),
    (multihead.self_attention_backward, "cpu", cpu_attention.self_attention_backward,
     cpu_attention.accepts_self_attention_backward),
)


def _numba_paths() -> tuple:
    """The compiled CPU paths (numba installed): tried before the NumPy ones."""
    from npformer.kernels.numba_cpu import activations as nb_activations
    from npformer.kernels.numba_cpu import attention as nb_attention
    from npformer.kernels.numba_cpu import cross_entropy as nb_cross_entropy
    from npformer.kernels.numba_cpu import dropout as nb_dropout
    from npformer.kernels.numba_cpu import layernorm as nb_layernorm
    from npformer.kernels.numba_cpu import optim as nb_optim
    from npformer.kernels.numba_cpu import softmax as nb_softmax
    floats = numba_cpu.numba_floats
    return (
        (softmax.softmax_forward, "numba", nb_softmax.softmax_forward, takes(floats, "x")),
        (softmax.softmax_backward, "numba", nb_softmax.softmax_backward, takes(floats, "dy", "cache.y")),
        (softmax.log_softmax_forward, "numba", nb_softmax.log_softmax_forward, takes(floats, "x")),
        (softmax.log_softmax_backward, "numba", nb_softmax.log_softmax_backward, takes(floats, "dy", "cache.y")),
        (activations.gelu_forward, "numba", nb_activations.gelu_forward, takes(floats, "x")),
        (activations.gelu_backward, "numba", nb_activations.gelu_backward, takes(floats, "dy", "cache.x")),
        (layernorm.layer_norm_forward, "numba", nb_layernorm.layer_norm_forward,
         takes(floats, "x", "weight", "bias")),
        (layernorm.layer_norm_backward, "numba", nb_layernorm.layer_norm_backward,
         takes(floats, "dy", "cache.x", "cache.weight")),
        (cross_entropy.cross_entropy_forward, "numba", nb_cross_entropy.cross_entropy_forward,
         takes(nb_cross_entropy.accepts, "logits")),
        (cross_entropy.cross_entropy_backward, "numba", nb_cross_entropy.cross_entropy_backward,
         takes(nb_cross_entropy.accepts, "dloss", "cache.logits")),
        (dropout.dropout_forward, "numba", nb_dropout.dropout_forward,
         takes(lambda x, rng: floats(x) and cpu_dropout.numpy_generator(rng), "x", "rng")),
        (dropout.dropout_backward, "numba", nb_dropout.dropout_backward, nb_dropout.accepts_backward),
        (attention.scaled_dot_product_attention_forward, "numba", nb_attention.scaled_dot_product_attention_forward,
         takes(floats, "q", "k", "v")),
        (attention.scaled_dot_product_attention_backward, "numba",
         nb_attention.scaled_dot_product_attention_backward, takes(floats, "dout", "cache.p")),
        (multihead.self_attention_backward, "numba", nb_attention.self_attention_backward,
         nb_attention.accepts_self_attention_backward),
        (optim.adam_update, "numba", nb_optim.adam_update, numba_cpu.accepts_adam),
        (optim.sum_of_squares, "numba", nb_optim.sum_of_squares, takes(floats, "x")),
    )


if numba_cpu.AVAILABLE:          # first: they take NumPy arrays only, so they never shadow the CUDA paths
    FAST_PATHS = _numba_paths() + FAST_PATHS

for _op, _name, _run, _accepts in FAST_PATHS:
    register(_op, _name, _run, _accepts)
