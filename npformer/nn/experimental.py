"""An encoder layer for studies: the residual connections can be switched off and the norm chosen.

``ConfigurableEncoderLayer(..., norm_first, residual, norm)`` has the sub-modules, parameter names and
state dict of ``TransformerEncoderLayer``, written here from the modules themselves (attention,
feed-forward, norm, dropout) instead of the fused residual ops, so each switch is one line::

    residual=True,  post:  x = N1(x + D1(SA(x)));   y = N2(x + D2(FF(x)))      (the paper)
    residual=True,  pre:   x = x + D1(SA(N1(x)));   y = x + D2(FF(N2(x)))      (GPT-2)
    residual=False, post:  x = N1(D1(SA(x)));       y = N2(D2(FF(x)))
    residual=False, pre:   x = D1(SA(N1(x)));       y = D2(FF(N2(x)))
    FF(h) = linear2(dropout(act(linear1(h)))),   D1, D2 = dropout1, dropout2

Without the residual connection the gradient has only the path through the sub-layer,
``dx = f'(x)^T dy`` instead of ``dy + f'(x)^T dy`` (:meth:`ConfigurableEncoderLayer._add` serves
forward and backward). N is ``norm`` (:data:`NORMS`): LayerNorm, or BatchNorm1d over every (B*T)
position, or over the non-padding ones only (``npformer study norms``).
"""
from __future__ import annotations

from npformer.checks import one_of
from npformer.nn import init
from npformer.nn.attention import MultiheadAttention
from npformer.nn.dropout import Dropout
from npformer.nn.module import Module
from npformer.nn.normalization import LayerNorm
from npformer.nn.normalization_batch import BatchNorm1d
from npformer.nn.transformer import FeedForwardParts

__all__ = ["NORMS", "make_norm", "ConfigurableEncoderLayer"]

NORMS = {
    "layer": "LayerNorm: per position, over its C features",
    "batch": "BatchNorm1d: per feature, over all B*T positions, padding included (torch's behaviour)",
    "batch_masked": "BatchNorm1d: per feature, over the non-padding positions only",
}


def make_norm(kind: str, d_model: int, eps: float = 1e-5, bias: bool = True, *, dtype=None, backend=None) -> Module:
    """The norm module of one of the :data:`NORMS` kinds."""
    one_of(kind, "norm", tuple(NORMS))
    if kind == "layer":
        return LayerNorm(d_model, eps=eps, bias=bias, dtype=dtype, backend=backend)
    return BatchNorm1d(d_model, eps=eps, dtype=dtype, backend=backend)


class ConfigurableEncoderLayer(FeedForwardParts):
    """Self-attention and feed-forward, post- or pre-norm, with or without residuals, with a chosen norm."""

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int = 2048, dropout: float = 0.1,
                 activation: str = "relu", layer_norm_eps: float = 1e-5, norm_first: bool = False,
                 residual: bool = True, bias: bool = True, *, norm: str = "layer", dtype=None, backend=None,
                 rng=None):
        super().__init__()
        self.norm_kind = one_of(norm, "norm", tuple(NORMS))
        self.norm_first, self.residual = bool(norm_first), bool(residual)
        rng = init.host_generator(rng)
        kw = dict(dtype=dtype, backend=backend)
        # PyTorch's registration order (and TransformerEncoderLayer's): the same state dict, the same draws
        self.self_attn = MultiheadAttention(d_model, nhead, dropout=dropout, bias=bias, rng=rng, **kw)
        self._init_feed_forward(d_model, dim_feedforward, dropout, activation, bias, dict(rng=rng, **kw))
        self.norm1 = make_norm(norm, d_model, layer_norm_eps, bias, **kw)
        self.norm2 = make_norm(norm, d_model, layer_norm_eps, bias, **kw)
        self.dropout1, self.dropout2 = Dropout(dropout), Dropout(dropout)
        self.manual_seed(init.stream_seed(rng))          # this layer's dropout stream

    def _add(self, skip, branch):
        """The residual connection: ``skip + branch`` with it, ``branch`` alone without it (forward
        and backward alike: the gradient of a sum reaches both terms)."""
        return skip + branch if self.residual else branch

    def _norm(self, norm, x, padding):
        """``norm(x)``; the masked BatchNorm leaves the padding positions out of its statistics."""
        return norm(x, padding) if self.norm_kind == "batch_masked" else norm(x)   # (B, T, C)

    def forward(self, src, src_mask=None, src_key_padding_mask=None, is_causal: bool = False):
        x, pad = src, src_key_padding_mask                                       # (B, T, C), (B, T)

        def sa(h):
            return self.self_attn(h, attn_mask=src_mask, key_padding_mask=pad, need_weights=False,
                                  is_causal=is_causal)[0]                         # (B, T, C)
        if self.norm_first:
            x = self._add(x, self.dropout1(sa(self._norm(self.norm1, x, pad))))
            return self._add(x, self.dropout2(self._feed_forward(self._norm(self.norm2, x, pad))))
        x = self._norm(self.norm1, self._add(x, self.dropout1(sa(x))), pad)
        return self._norm(self.norm2, self._add(x, self.dropout2(self._feed_forward(x))), pad)

    def backward(self, dout):
        """Returns ``dsrc``; parameter gradients accumulate."""
        if self.norm_first:
            # fwd: y = x1 + D2(FF(N2(x1)))  ->  dx1 = dy + N2'(FF'(D2'(dy)))
            dx1 = self._add(dout, self.norm2.backward(self._feed_forward_backward(self.dropout2.backward(dout))))
            # fwd: x1 = x + D1(SA(N1(x)))  ->  dx = dx1 + N1'(SA'(D1'(dx1)))
            return self._add(dx1, self.norm1.backward(self.self_attn.backward(self.dropout1.backward(dx1))[0]))
        # fwd: y = N2(x1 + D2(FF(x1)))  ->  d = N2'(dy);  dx1 = d + FF'(D2'(d))
        d = self.norm2.backward(dout)
        dx1 = self._add(d, self._feed_forward_backward(self.dropout2.backward(d)))
        # fwd: x1 = N1(x + D1(SA(x)))  ->  d = N1'(dx1);  dx = d + SA'(D1'(d))
        d = self.norm1.backward(dx1)
        return self._add(d, self.self_attn.backward(self.dropout1.backward(d))[0])

    def extra_repr(self) -> str:
        return f"norm_first={self.norm_first}, residual={self.residual}, norm={self.norm_kind!r}, " \
               f"activation={self.activation!r}"
