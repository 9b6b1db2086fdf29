"""``LayerNorm(normalized_shape, eps=1e-5, elementwise_affine=True, bias=True)``, as ``torch.nn.LayerNorm``
(normalisation over the last axis only)."""
from __future__ import annotations

from npformer.checks import positive_int, real
from npformer.errors import ShapeError
from npformer.nn import init
from npformer.nn.module import Module, Parameter
from npformer.ops.layernorm import layer_norm_backward, layer_norm_forward

__all__ = ["LayerNorm"]


class LayerNorm(Module):
    """``y = (x - mean) / sqrt(var + eps) * weight + bias`` over the last axis of size C."""

    def __init__(self, normalized_shape: int, eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, *, dtype=None, backend=None):
        super().__init__()
        if isinstance(normalized_shape, (tuple, list)):
            if len(normalized_shape) != 1:
                raise ShapeError("LayerNorm normalises over the last axis only: normalized_shape must "
                                 f"be an int or a 1-tuple, got {normalized_shape!r}")
            normalized_shape = normalized_shape[0]
        self.normalized_shape = positive_int(normalized_shape, "normalized_shape")
        self.eps = real(eps, "eps", 0.0, low_open=True)           # > 0 keeps a constant row finite
        kw = dict(dtype=dtype, backend=backend)
        c = self.normalized_shape
        self.weight = Parameter(init.ones((c,), **kw), decay=False) if elementwise_affine else None
        self.bias = Parameter(init.zeros((c,), **kw), decay=False) if elementwise_affine and bias else None

    def forward(self, x):
        out, cache = layer_norm_forward(x, None if self.weight is None else self.weight.data,
                                        None if self.bias is None else self.bias.data, eps=self.eps)
        self._push(cache)
        return out

    def backward(self, dout):
        dx, dweight, dbias = layer_norm_backward(dout, self._pop())
        if self.weight is not None:
            self.weight.accumulate(dweight)
        if self.bias is not None:
            self.bias.accumulate(dbias)
        return dx

    def extra_repr(self) -> str:
        return f"({self.normalized_shape},), eps={self.eps}, elementwise_affine={self.weight is not None}"
