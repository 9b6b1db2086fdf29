"""Fast paths: faster implementations of reference ops, kept apart from the math they stand in for.

The reference ops (:mod:`npformer.ops`) are what a reader reads: plain, backend-neutral, composed
of each other. A fast path has its reference op's signature and cache type and gives the same
results (to rounding; parity tests hold each to its reference, outputs and gradients):

* :mod:`npformer.kernels.cpu`: NumPy arrays: element-wise chains over cache-sized blocks, softmax
  in the score buffer, a float32 erf, dropout masks from raw PCG64 bits;
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

from npformer.dispatch import FastPath, disabled, enabled, implementation, register, registered, set_enabled
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


def _y(cache):
    return getattr(cache, "y", None)


def _x(cache):
    return getattr(cache, "x", None)


# (reference op, name, fast path, which arguments it takes), tried in this order
FAST_PATHS = (
    (softmax.softmax_forward, "cuda", cuda.softmax_forward, lambda x: device_floats(x)),
    (softmax.softmax_forward, "cpu", cpu_softmax.softmax_forward, lambda x: numpy_floats(x)),
    (softmax.softmax_backward, "cuda", cuda.softmax_backward, lambda dy, cache: device_floats(dy, _y(cache))),
    (softmax.softmax_backward, "cpu", cpu_softmax.softmax_backward, lambda dy, cache: numpy_floats(dy, _y(cache))),
    (softmax.log_softmax_forward, "cuda", cuda.log_softmax_forward, lambda x: device_floats(x)),
    (softmax.log_softmax_forward, "cpu", cpu_softmax.log_softmax_forward, lambda x: numpy_floats(x)),
    (softmax.log_softmax_backward, "cuda", cuda.log_softmax_backward,
     lambda dy, cache: device_floats(dy, _y(cache))),
    (softmax.log_softmax_backward, "cpu", cpu_softmax.log_softmax_backward,
     lambda dy, cache: numpy_floats(dy, _y(cache))),
    (activations.gelu_forward, "cuda", cuda.gelu_forward, lambda x, approximate="none": device_floats(x)),
    (activations.gelu_forward, "cpu", cpu_activations.gelu_forward,
     lambda x, approximate="none": numpy_floats(x)),
    (activations.gelu_backward, "cuda", cuda.gelu_backward, lambda dy, cache: device_floats(dy, _x(cache))),
    (activations.gelu_backward, "cpu", cpu_activations.gelu_backward,
     lambda dy, cache: numpy_floats(dy, _x(cache))),
    (layernorm.layer_norm_forward, "cuda", cuda.layer_norm_forward,
     lambda x, weight=None, bias=None, eps=1e-5: device_floats(x, weight, bias)),
    (layernorm.layer_norm_forward, "cpu", cpu_layernorm.layer_norm_forward,
     lambda x, weight=None, bias=None, eps=1e-5: numpy_floats(x, weight, bias)),
    (layernorm.layer_norm_backward, "cuda", cuda.layer_norm_backward,
     lambda dy, cache: device_floats(dy, getattr(cache, "weight", None), dtype=getattr(cache, "dtype", None))),
    (layernorm.layer_norm_backward, "cpu", cpu_layernorm.layer_norm_backward,
     lambda dy, cache: numpy_floats(dy, getattr(cache, "weight", None))),
    (dropout.dropout_forward, "cuda", cuda.dropout_forward,
     lambda x, p=0.0, rng=None, training=True: device_floats(x)),
    (dropout.dropout_forward, "cpu", cpu_dropout.dropout_forward, cpu_dropout.accepts),
    (dropout.dropout_backward, "cuda", cuda.dropout_backward, lambda dout, cache: device_floats(dout)),
    (embedding.embedding_backward, "cpu", cpu_embedding.embedding_backward, cpu_embedding.accepts_backward),
    (linear.linear_forward, "cpu", cpu_linear.linear_forward, lambda x, weight, bias=None: numpy_floats(x, weight, bias)),
    (linear.linear_forward, "cuda", cuda.linear_forward, lambda x, weight, bias=None: device_floats(x, weight, bias)),
    (linear.linear_backward, "cuda", cuda.linear_backward, lambda dout, cache: device_floats(dout)),
    (linear.linear_backward, "cpu", cpu_linear.linear_backward,
     lambda dout, cache: numpy_floats(dout, getattr(cache, "x", None), getattr(cache, "weight", None))),
    (feedforward.feed_forward_forward, "cuda", cuda.feed_forward_forward, cuda_feedforward.accepts_forward),
    (feedforward.feed_forward_backward, "cuda", cuda.feed_forward_backward, cuda_feedforward.accepts_backward),
    (residual.residual_dropout_forward, "cuda", cuda.residual_dropout_forward,
     lambda x, branch, **options: device_floats(x, branch)),
    (residual.residual_dropout_layer_norm_forward, "cuda", cuda.residual_dropout_layer_norm_forward,
     lambda x, branch, weight=None, bias=None, **options: device_floats(x, branch, weight, bias)),
    (residual.residual_dropout_layer_norm_backward, "cuda", cuda.residual_dropout_layer_norm_backward,
     cuda_residual.accepts_norm_backward),
    (cross_entropy.cross_entropy_forward, "cuda", cuda.cross_entropy_forward,
     lambda logits, targets, **options: device_floats(logits)),
    (cross_entropy.cross_entropy_backward, "cuda", cuda.cross_entropy_backward,
     lambda dloss, cache: device_floats(dloss, getattr(cache, "logits", None))),
    (flash_attention.flash_attention_forward, "cuda", cuda.flash_attention_forward, cuda_flash.accepts_forward),
    (flash_attention.flash_attention_backward, "cuda", cuda.flash_attention_backward, cuda_flash.accepts_backward),
    (multihead.self_attention_backward, "cuda", cuda_multihead.self_attention_backward,
     cuda_multihead.accepts_self_attention_backward),
    (optim.adam_update, "cuda", cuda.adam_update, cuda_optim.accepts_adam),
    (optim.adam_update, "cpu", cpu_optim.adam_update, cpu_optim.accepts_adam),
    (optim.sum_of_squares, "cuda", cuda.sum_of_squares, lambda x: device_floats(x)),
    (optim.sum_of_squares, "cpu", cpu_optim.sum_of_squares, lambda x: numpy_floats(x)),
    (attention.scaled_dot_product_attention_forward, "cpu", cpu_attention.scaled_dot_product_attention_forward,
     lambda q, k, v, **options: numpy_floats(q, k, v)),
    (attention.scaled_dot_product_attention_backward, "cpu", cpu_attention.scaled_dot_product_attention_backward,
     lambda dout, cache: numpy_floats(dout, getattr(cache, "p", None))),
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
        (softmax.softmax_forward, "numba", nb_softmax.softmax_forward, lambda x: floats(x)),
        (softmax.softmax_backward, "numba", nb_softmax.softmax_backward, lambda dy, cache: floats(dy, _y(cache))),
        (softmax.log_softmax_forward, "numba", nb_softmax.log_softmax_forward, lambda x: floats(x)),
        (softmax.log_softmax_backward, "numba", nb_softmax.log_softmax_backward,
         lambda dy, cache: floats(dy, _y(cache))),
        (activations.gelu_forward, "numba", nb_activations.gelu_forward, lambda x, approximate="none": floats(x)),
        (activations.gelu_backward, "numba", nb_activations.gelu_backward, lambda dy, cache: floats(dy, _x(cache))),
        (layernorm.layer_norm_forward, "numba", nb_layernorm.layer_norm_forward,
         lambda x, weight=None, bias=None, eps=1e-5: floats(x, weight, bias)),
        (layernorm.layer_norm_backward, "numba", nb_layernorm.layer_norm_backward,
         lambda dy, cache: floats(dy, getattr(cache, "xhat", None), getattr(cache, "weight", None))),
        (cross_entropy.cross_entropy_forward, "numba", nb_cross_entropy.cross_entropy_forward,
         lambda logits, targets, **options: floats(logits)),
        (cross_entropy.cross_entropy_backward, "numba", nb_cross_entropy.cross_entropy_backward,
         lambda dloss, cache: floats(dloss, getattr(cache, "logits", None))),
        (dropout.dropout_forward, "numba", nb_dropout.dropout_forward,
         lambda x, p=0.0, rng=None, training=True: floats(x) and cpu_dropout.accepts(x, p, rng, training)),
        (dropout.dropout_backward, "numba", nb_dropout.dropout_backward,
         nb_dropout.accepts_backward),
        (attention.scaled_dot_product_attention_forward, "numba", nb_attention.scaled_dot_product_attention_forward,
         lambda q, k, v, **options: floats(q, k, v)),
        (attention.scaled_dot_product_attention_backward, "numba",
         nb_attention.scaled_dot_product_attention_backward,
         lambda dout, cache: floats(dout, getattr(cache, "p", None))),
        (multihead.self_attention_backward, "numba", nb_attention.self_attention_backward,
         nb_attention.accepts_self_attention_backward),
        (optim.adam_update, "numba", nb_optim.adam_update, numba_cpu.accepts_adam),
        (optim.sum_of_squares, "numba", nb_optim.sum_of_squares, lambda x: floats(x)),
    )


if numba_cpu.AVAILABLE:          # first: they take NumPy arrays only, so they never shadow the CUDA paths
    FAST_PATHS = _numba_paths() + FAST_PATHS

for _op, _name, _run, _accepts in FAST_PATHS:
    register(_op, _name, _run, _accepts)
