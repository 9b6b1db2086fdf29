"""``Linear(in_features, out_features, bias=True)``: ``y = x W^T + b``, as ``torch.nn.Linear``."""
from __future__ import annotations

from npformer.nn import init
from npformer.nn.module import Module, Parameter
from npformer.ops.linear import linear_backward, linear_forward

__all__ = ["Linear"]


class Linear(Module):
    """Parameters ``weight`` (out, in) and ``bias`` (out,), PyTorch's default initialisation."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, dtype=None,
                 backend=None, rng=None):
        super().__init__()
        rng = init.host_generator(rng)   # one stream for all of this module's draws
        self.in_features, self.out_features = in_features, out_features
        kw = dict(rng=rng, dtype=dtype, backend=backend)
        self.weight = Parameter(init.linear_uniform((out_features, in_features), in_features, **kw))
        self.bias = Parameter(init.linear_uniform((out_features,), in_features, **kw), decay=False) \
            if bias else None

    def forward(self, x):
        out, cache = linear_forward(x, self.weight.data, None if self.bias is None else self.bias.data)
        self._push(cache)
        return out                                       # (..., out)

    def backward(self, dout):
        dx, dweight, dbias = linear_backward(dout, self._pop())
        self.weight.accumulate(dweight)
        if self.bias is not None:
            self.bias.accumulate(dbias)
        return dx                                        # (..., in)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.bias is not None}"
