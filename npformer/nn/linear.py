"""``Linear(in_features, out_features, bias=True)``: ``y = x W^T + b``, as ``torch.nn.Linear``."""
from __future__ import annotations

from npformer.checks import positive_int
from npformer.errors import ShapeError
from npformer.nn import init
from npformer.nn.module import Module, Parameter
from npformer.ops.linear import linear_backward, linear_forward

__all__ = ["Linear"]


class Linear(Module):
    """Parameters ``weight`` (out, in) and ``bias`` (out,), PyTorch's default initialisation."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, dtype=None,
                 backend=None, rng=None, zero_bias: bool = False, weight: Parameter | None = None):
        """``zero_bias``: the bias starts at zero instead of PyTorch's uniform draw (as
        ``nn.MultiheadAttention`` sets its ``out_proj.bias``), and nothing is drawn for it.
        ``weight``: a Parameter of shape (out, in) to use as the weight (shared, or drawn by the
        caller's own scheme) instead of drawing one."""
        super().__init__()
        rng = init.host_generator(rng)   # one stream for all of this module's draws
        self.in_features = positive_int(in_features, "in_features")
        self.out_features = positive_int(out_features, "out_features")
        kw = dict(rng=rng, dtype=dtype, backend=backend)
        if weight is not None and weight.shape != (out_features, in_features):
            raise ShapeError(f"weight: expected shape (out, in)=({out_features}, {in_features}), got {weight.shape}")
        self.weight = weight if weight is not None else Parameter(
            init.linear_uniform((out_features, in_features), in_features, **kw))
        if not bias:
            self.bias = None
        elif zero_bias:
            self.bias = Parameter(init.zeros((out_features,), dtype=dtype, backend=backend), decay=False)
        else:
            self.bias = Parameter(init.linear_uniform((out_features,), in_features, **kw), decay=False)

    def arrays(self):
        """``(weight, bias or None)``: the arrays an op takes (modules that run one op over several
        layers' parameters, such as the feed-forward block, use this)."""
        return self.weight.data, None if self.bias is None else self.bias.data

    def accumulate(self, dweight, dbias) -> None:
        """Add an op's gradients of ``weight`` and ``bias`` into theirs (``dbias`` ignored without a bias)."""
        self.weight.accumulate(dweight)
        if self.bias is not None:
            self.bias.accumulate(dbias)

    def forward(self, x):
        out, cache = linear_forward(x, *self.arrays())
        self._push(cache)
        return out                                       # (..., out)

    def backward(self, dout):
        dx, dweight, dbias = linear_backward(dout, self._pop())
        self.accumulate(dweight, dbias)
        return dx                                        # (..., in)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.bias is not None}"
