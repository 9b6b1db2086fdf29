"""``BatchNorm1d(num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True)``, as
``torch.nn.BatchNorm1d`` but channels last: inputs are (N, C) or (B, T, C) (torch's 3-d layout is
(N, C, L)). Training normalises with the batch statistics and updates the running ones; eval uses
the running ones. ``forward(x, padding_mask=None)`` can leave padding positions (True) out of the
batch statistics, an option torch does not have (see :mod:`npformer.ops.batchnorm`).

Running statistics are *buffers* (:meth:`Module.register_buffer`): state that is saved, loaded
and moved but never trained, so the optimiser and ``grads()`` never see them. ``state_dict`` holds
torch's keys in torch's order (``weight, bias, running_mean, running_var, num_batches_tracked``),
so a torch state dict copies across unchanged, in this module or in any model that holds it.
"""
from __future__ import annotations

from npformer.backend import get_array_module
from npformer.checks import positive_int, probability, real
from npformer.nn import init
from npformer.nn.module import Module, Parameter
from npformer.ops.batchnorm import RunningStats, batch_norm_backward, batch_norm_forward

__all__ = ["BatchNorm1d"]


class BatchNorm1d(Module):
    """``y = (x - mean) / sqrt(var + eps) * weight + bias`` per feature, statistics over the batch."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, *, dtype=None, backend=None):
        super().__init__()
        self.num_features = positive_int(num_features, "num_features")
        self.eps = real(eps, "eps", 0.0, low_open=True)
        self.momentum = None if momentum is None else probability(momentum, "momentum (None: cumulative average)")
        self.track_running_stats = bool(track_running_stats)
        kw = dict(dtype=dtype, backend=backend)
        c = num_features
        self.weight = Parameter(init.ones((c,), **kw), decay=False) if affine else None
        self.bias = Parameter(init.zeros((c,), **kw), decay=False) if affine else None
        mean = var = count = None
        if self.track_running_stats:
            mean, var = init.zeros((c,), **kw), init.ones((c,), **kw)                 # (C,) each
            xp = get_array_module(mean)
            count = xp.zeros((), dtype=xp.int64)
        self.register_buffer("running_mean", mean)
        self.register_buffer("running_var", var)
        self.register_buffer("num_batches_tracked", count)

    def forward(self, x, padding_mask=None):
        """x (N, C) or (B, T, C); ``padding_mask`` (B, T) bool, True = left out of the statistics."""
        use_batch = self.training or self.running_mean is None
        update = self.training and self.running_mean is not None
        momentum = 0.0
        if update:     # momentum None: the cumulative average, weight 1 / (batches seen, this one included)
            momentum = 1.0 / (int(self.num_batches_tracked) + 1) if self.momentum is None else self.momentum
        running = None if self.running_mean is None else RunningStats(self.running_mean, self.running_var)
        out, new_running, cache = batch_norm_forward(
            x, None if self.weight is None else self.weight.data, None if self.bias is None else self.bias.data,
            running, training=use_batch, momentum=momentum, eps=self.eps,
            padding_mask=padding_mask if use_batch else None)
        if update:     # new arrays, assigned only after the op succeeded
            self.running_mean, self.running_var = new_running
            self.num_batches_tracked = self.num_batches_tracked + 1
        self._push(cache)
        return out

    def backward(self, dout):
        dx, dweight, dbias = batch_norm_backward(dout, self._pop())
        if self.weight is not None:
            self.weight.accumulate(dweight)
        if self.bias is not None:
            self.bias.accumulate(dbias)
        return dx

    def reset_running_stats(self) -> None:
        if self.running_mean is not None:
            self.running_mean = self.running_mean * 0
            self.running_var = self.running_var * 0 + 1
            self.num_batches_tracked = self.num_batches_tracked * 0

    def extra_repr(self) -> str:
        return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.weight is not None}, "
                f"track_running_stats={self.track_running_stats}")
