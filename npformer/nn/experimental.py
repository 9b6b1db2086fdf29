"""An encoder layer whose residual connections can be switched off, for studying why they matter.

``ConfigurableEncoderLayer(..., norm_first, residual)`` is ``TransformerEncoderLayer`` (the same
class underneath, so the same sub-modules, parameter names and state dicts) with one more switch::

    residual=True,  post:  x = norm1(x + SA(x));   y = norm2(x + FF(x))      (the paper)
    residual=True,  pre:   x = x + SA(norm1(x));   y = x + FF(norm2(x))      (GPT-2)
    residual=False, post:  x = norm1(SA(x));       y = norm2(FF(x))
    residual=False, pre:   x = SA(norm1(x));       y = FF(norm2(x))
    SA(h) = dropout1(self_attn(h)),   FF(h) = dropout2(linear2(dropout(act(linear1(h)))))

Only the residual connection changes: without it the gradient has only the path through the
sub-layer, ``dx = f'(x)^T dy`` instead of ``dy + f'(x)^T dy`` (the same hook serves forward and
backward; the residual blocks are composed from it, :class:`~npformer.nn.transformer.ComposedResiduals`).
"""
from __future__ import annotations

from npformer.nn.transformer import ComposedResiduals, TransformerEncoderLayer

__all__ = ["ConfigurableEncoderLayer"]


class ConfigurableEncoderLayer(ComposedResiduals, TransformerEncoderLayer):
    """Self-attention and feed-forward with layer norm, post- or pre-norm, with or without residuals."""

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int = 2048, dropout: float = 0.1,
                 activation: str = "relu", layer_norm_eps: float = 1e-5, norm_first: bool = False,
                 residual: bool = True, bias: bool = True, *, dtype=None, backend=None, rng=None):
        super().__init__(d_model, nhead, dim_feedforward, dropout, activation, layer_norm_eps,
                         norm_first=norm_first, bias=bias, dtype=dtype, backend=backend, rng=rng)
        self.residual = bool(residual)

    def _add(self, skip, branch):
        """``skip + branch`` with the residual connection, ``branch`` alone without it."""
        return skip + branch if self.residual else branch

    def extra_repr(self) -> str:
        return f"norm_first={self.norm_first}, residual={self.residual}, activation={self.activation!r}"
