"""Fused CUDA kernels for the GPU path: one kernel where a plain op runs several CuPy kernels.

Each function has exactly the contract of the plain op it stands in for (arguments, cache
NamedTuple, dtypes, edge cases), so an op switches with one line, and either backward accepts
either forward's cache::

    from npformer.ops import fused
    def softmax_forward(x):
        if fused.use_fused(x):
            return fused.softmax_forward(x)
        ...

=========================  ===============================================================
softmax, log-softmax       one block per row (max, sum of exp, write); backward likewise
layer norm                 one block per row; backward: a row pass for dx, a column pass
                           for dweight and dbias
GELU (erf and tanh)        one elementwise kernel forward, one backward
dropout                    uniforms from the Generator passed in (the plain op's mask for
                           a seed), then one kernel for compare, scale and multiply
bias-add, bias gradient    one kernel; the bias gradient is a coalesced column sum
bias-add + GELU            forward one kernel (h = z + b, a = gelu(h)); backward one kernel
                           (dz = da gelu'(h) and the partial sums of dbias)
=========================  ===============================================================

Precision is the plain ops': float16 is computed in float32 and rounded once at the end,
float32 in float32, float64 in float64; only the order of a reduction's additions differs.
The kernels (npformer/ops/fused/source.py) are compiled once by NVRTC through ``cupy.RawModule``
on first use. Importing this package never imports CuPy. ``NPFORMER_FUSED=0`` turns the fused
path off (:func:`use_fused` is then False), to compare with the plain ops.
"""
from npformer.ops.fused.activations import (bias_add_forward, bias_gelu_backward, bias_gelu_forward,
                                            bias_grad, gelu_backward, gelu_forward)
from npformer.ops.fused.dropout import dropout_forward
from npformer.ops.fused.layernorm import layer_norm_backward, layer_norm_forward
from npformer.ops.fused.runtime import ENV_VAR, fused_available, fused_enabled, use_fused
from npformer.ops.fused.softmax import (log_softmax_backward, log_softmax_forward, softmax_backward,
                                        softmax_forward)

__all__ = [
    "ENV_VAR", "fused_enabled", "fused_available", "use_fused",
    "softmax_forward", "softmax_backward", "log_softmax_forward", "log_softmax_backward",
    "layer_norm_forward", "layer_norm_backward", "gelu_forward", "gelu_backward",
    "dropout_forward", "bias_add_forward", "bias_grad", "bias_gelu_forward", "bias_gelu_backward",
]
