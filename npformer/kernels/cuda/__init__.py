"""Fused CUDA kernels for CuPy arrays: one kernel where the reference op runs several CuPy kernels.

=========================  ===============================================================
softmax, log-softmax       one block per row (max, sum of exp, write); backward likewise
layer norm                 one block per row; backward: a row pass for dx, a column pass
                           for dweight and dbias
GELU (erf and tanh)        one elementwise kernel forward, one backward
dropout                    one kernel: each element's keep bit hashed from the seed drawn
                           from the Generator and its index (the reference's mask), then
                           scale and multiply (the mask kept as booleans, which the plain
                           attention reads); backward one kernel (a stored or a hashed mask)
linear                     the reference's products, also inside a CUDA graph capture
                           (gemm.py: cuBLAS called directly there, CuPy refuses it); the
                           bias gradient as one coalesced column sum
flash attention            forward: a block per query tile and head, online softmax over
                           key tiles; backward: D = rowsum(dO O), a block per key tile (dk,
                           dv), a block per query tile (dq); float16 and bfloat16 from sm_80 on tensor
                           cores (a warp per 16 rows, warp_source.py's mma.sync and
                           ldmatrix); own module (flash_source.py); heads read and written
                           through their strides (no copies)
self-attention backward    dq, dk, dv written by the flash kernels into the packed (B, T,
                           3E) gradient: no copy to merge heads (multihead.py)
bias-add, bias + GELU      forward one kernel (h = z + b, a = gelu(h), and the feed-forward
                           block's dropout, its mask kept as the seed); backward one kernel
                           (the mask hashed again, dz = da gelu'(h), partial sums of dbias)
feed-forward (GELU)        x W1^T, the bias + GELU + dropout kernel, the second linear;
                           backward through the fused bias + GELU backward (own module)
residual + dropout (+ LN)  s = x + dropout(branch) in one elementwise kernel; with the layer
                           norm that follows, one block per row (s, y, mu, rstd; the mask
                           kept as the seed); backward: dx = ds + LN'(dy), dbranch = dx m in
                           one row pass, m hashed again
cross-entropy              one block per row, one read of the logits: running max and sum of
                           exponentials, the row's loss; backward writes dlogits directly
Adam / AdamW               one elementwise kernel over a whole flat buffer: m, v, p and, in
                           mixed precision, the float16 copy of p (optim.py, optim_source.py)
sum of squares             float64 block partials, then their sum (clipping's norm)
=========================  ===============================================================

Each function has exactly the contract of the reference op it stands in for (arguments, cache
NamedTuple, dtypes, edge cases), so either backward accepts either forward's cache. Precision is
the reference's: float16 and bfloat16 (ml_dtypes' dtype; compute capability 8.0 and later) are computed
in float32 and rounded once at the end, float32 in float32,
float64 in float64; only the order of a reduction's additions differs. The kernels (``source.py``)
are compiled once by NVRTC through ``cupy.RawModule`` on first use. Importing this package never
imports CuPy; :func:`~npformer.kernels.cuda.runtime.device_floats` says which arrays they take.
"""
from npformer.kernels.cuda.activations import (bias_add_forward, bias_gelu_backward, bias_gelu_dropout_backward,
                                               bias_gelu_dropout_forward, bias_gelu_forward, bias_grad,
                                               gelu_backward, gelu_forward)
from npformer.kernels.cuda.cross_entropy import cross_entropy_backward, cross_entropy_forward
from npformer.kernels.cuda.dropout import dropout_backward, dropout_forward
from npformer.kernels.cuda.feedforward import feed_forward_backward, feed_forward_forward
from npformer.kernels.cuda.flash_attention import flash_attention_backward, flash_attention_forward
from npformer.kernels.cuda.layernorm import layer_norm_backward, layer_norm_forward
from npformer.kernels.cuda.linear import linear_backward, linear_forward
from npformer.kernels.cuda.optim import adam_update, sum_of_squares
from npformer.kernels.cuda.residual import (residual_dropout_forward, residual_dropout_layer_norm_backward,
                                            residual_dropout_layer_norm_forward)
from npformer.kernels.cuda.runtime import device_floats
from npformer.kernels.cuda.softmax import (log_softmax_backward, log_softmax_forward, softmax_backward,
                                           softmax_forward)

__all__ = [
    "device_floats", "softmax_forward", "softmax_backward", "log_softmax_forward", "log_softmax_backward",
    "layer_norm_forward", "layer_norm_backward", "gelu_forward", "gelu_backward", "dropout_forward",
    "dropout_backward",
    "linear_forward", "linear_backward", "flash_attention_forward", "flash_attention_backward", "bias_add_forward", "bias_grad",
    "bias_gelu_forward", "bias_gelu_backward", "bias_gelu_dropout_forward", "bias_gelu_dropout_backward",
    "feed_forward_forward", "feed_forward_backward", "residual_dropout_forward",
    "residual_dropout_layer_norm_forward", "residual_dropout_layer_norm_backward", "cross_entropy_forward",
    "cross_entropy_backward",
    "adam_update", "sum_of_squares",
]
