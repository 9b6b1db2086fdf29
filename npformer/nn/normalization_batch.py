"""``BatchNorm1d(num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True)``, as
``torch.nn.BatchNorm1d`` but channels last: inputs are (N, C) or (B, T, C) (torch's 3-d layout is
(N, C, L)). Training normalises with the batch statistics and updates the running ones; eval uses
the running ones. ``forward(x, padding_mask=None)`` can leave padding positions (True) out of the
batch statistics, an option torch does not have (see :mod:`npformer.ops.batchnorm`).

Running statistics are *buffers*: state that is saved and loaded but never trained, so they are
not parameters (the optimiser and ``grads()`` never see them). :class:`Module` knows only
parameters, so buffers are handled here by :class:`BufferMixin`: ``state_dict`` holds torch's keys
in torch's order (``weight, bias, running_mean, running_var, num_batches_tracked``, so a torch
state dict, transposed nowhere, copies across unchanged), ``load_state_dict`` loads them and
``to`` moves them. A model holding BatchNorm1d layers must inherit the mixin too (as
:class:`npformer.models.norm_encoder.NormEncoder` does): plain ``Module.state_dict`` would save
the parameters and drop the running statistics.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Iterator, Mapping

from npformer.backend import backend_name, get_array_module, to_device
from npformer.nn import init
from npformer.nn.module import Module, Parameter, StateDictError
from npformer.ops.batchnorm import RunningStats, batch_norm_backward, batch_norm_forward

__all__ = ["BatchNorm1d", "BufferMixin", "named_buffers"]


def named_buffers(module: Module, prefix: str = "") -> Iterator[tuple[str, Module, str]]:
    """(dotted name, owning module, attribute) of every buffer below ``module`` that is not None."""
    for mod_name, mod in module.named_modules(prefix):
        for name in getattr(mod, "_buffer_names", ()):
            if getattr(mod, name) is not None:
                yield (f"{mod_name}.{name}" if mod_name else name), mod, name


class BufferMixin:
    """``state_dict``/``load_state_dict``/``to`` that include the buffers of every submodule.

    Put it before :class:`Module` in the bases: ``class Model(BufferMixin, Module)``.
    """

    def state_dict(self) -> "OrderedDict[str, Any]":
        """Per module, in module order, its parameters then its buffers (torch's order)."""
        out: OrderedDict[str, Any] = OrderedDict()
        for mod_name, mod in self.named_modules():
            dot = f"{mod_name}." if mod_name else ""
            for name, p in mod._parameters.items():
                out[dot + name] = p.data
            for name in getattr(mod, "_buffer_names", ()):
                if getattr(mod, name) is not None:
                    out[dot + name] = getattr(mod, name)
        return out

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True):
        """Parameters as :meth:`Module.load_state_dict`, buffers converted to each buffer's backend and
        dtype; every problem is reported and nothing is written unless everything fits."""
        buffers = {k: (mod, name) for k, mod, name in named_buffers(self)}
        staged, problems = {}, []
        for k, (mod, name) in buffers.items():
            if k not in state:
                if strict:
                    problems.append(f"missing buffer {k}")
                continue
            old = getattr(mod, name)
            xp = get_array_module(old)
            v = xp.asarray(to_device(state[k], backend_name(old)), dtype=old.dtype)
            if v.shape != old.shape:
                problems.append(f"{k}: expected shape {tuple(old.shape)}, got {tuple(v.shape)}")
            staged[k] = v.copy()
        if problems:
            raise StateDictError(f"cannot load state dict into {type(self).__name__}: " + "; ".join(problems))
        Module.load_state_dict(self, {k: v for k, v in state.items() if k not in buffers}, strict)
        for k, v in staged.items():
            mod, name = buffers[k]
            object.__setattr__(mod, name, v)
        return self

    def to(self, backend: str | None = None, dtype: Any = None):
        """Moves parameters and buffers; the running statistics take ``dtype``, the step counter
        stays an integer."""
        Module.to(self, backend, dtype)
        for _, mod, name in list(named_buffers(self)):
            v = getattr(mod, name)
            v = v if backend is None else to_device(v, backend)
            if dtype is not None and v.dtype.kind == "f":
                v = v.astype(get_array_module(v).dtype(dtype), copy=False)
            object.__setattr__(mod, name, v)
        return self


class BatchNorm1d(BufferMixin, Module):
    """``y = (x - mean) / sqrt(var + eps) * weight + bias`` per feature, statistics over the batch."""

    _buffer_names = ("running_mean", "running_var", "num_batches_tracked")

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, *, dtype=None, backend=None):
        super().__init__()
        if isinstance(num_features, bool) or not isinstance(num_features, int) or num_features < 1:
            raise ValueError(f"num_features must be a positive int, got {num_features!r}")
        if not float(eps) > 0:
            raise ValueError(f"BatchNorm1d eps must be > 0, got {eps!r}")
        if momentum is not None and not 0.0 <= float(momentum) <= 1.0:
            raise ValueError(f"BatchNorm1d momentum must be in [0, 1] or None (cumulative average), got {momentum!r}")
        self.num_features, self.eps = num_features, float(eps)
        self.momentum = None if momentum is None else float(momentum)
        self.track_running_stats = bool(track_running_stats)
        kw = dict(dtype=dtype, backend=backend)
        c = num_features
        self.weight = Parameter(init.ones((c,), **kw), decay=False) if affine else None
        self.bias = Parameter(init.zeros((c,), **kw), decay=False) if affine else None
        if self.track_running_stats:
            self.running_mean = init.zeros((c,), **kw)                           # (C,)
            self.running_var = init.ones((c,), **kw)                             # (C,)
            xp = get_array_module(self.running_mean)
            self.num_batches_tracked = xp.zeros((), dtype=xp.int64)
        else:
            self.running_mean = self.running_var = self.num_batches_tracked = None

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
