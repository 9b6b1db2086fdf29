"""An encoder layer whose residual connections can be switched off, for studying why they matter.

``ConfigurableEncoderLayer(..., norm_first, residual)`` is ``TransformerEncoderLayer`` (same
sub-modules, same parameter names, so state dicts copy across) with one more switch::

    residual=True,  post:  x = norm1(x + SA(x));   y = norm2(x + FF(x))      (the paper)
    residual=True,  pre:   x = x + SA(norm1(x));   y = x + FF(norm2(x))      (GPT-2)
    residual=False, post:  x = norm1(SA(x));       y = norm2(FF(x))
    residual=False, pre:   x = SA(norm1(x));       y = FF(norm2(x))
    SA(h) = dropout1(self_attn(h, h, h)),   FF(h) = dropout2(linear2(dropout(act(linear1(h)))))

Built only from the public blocks (MultiheadAttention, LayerNorm, Linear, Dropout and the activation
ops), so it does not depend on the internals of :mod:`npformer.nn.transformer`. With
``residual=True`` it computes exactly what ``TransformerEncoderLayer`` computes (a test holds them
side by side). Backward runs the forward's lines in reverse; without a residual the gradient has
only the path through the sub-layer, ``dx = f'(x)^T dy`` instead of ``dy + f'(x)^T dy``.
"""
from __future__ import annotations

from npformer.nn import init
from npformer.nn.attention import MultiheadAttention
from npformer.nn.dropout import Dropout
from npformer.nn.linear import Linear
from npformer.nn.module import Module
from npformer.nn.normalization import LayerNorm
from npformer.ops.feedforward import ACTIVATIONS

__all__ = ["ConfigurableEncoderLayer"]


class ConfigurableEncoderLayer(Module):
    """Self-attention and feed-forward with layer norm, post- or pre-norm, with or without residuals."""

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int = 2048, dropout: float = 0.1,
                 activation: str = "relu", layer_norm_eps: float = 1e-5, norm_first: bool = False,
                 residual: bool = True, bias: bool = True, *, dtype=None, backend=None, rng=None):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        self.norm_first, self.residual, self.activation = bool(norm_first), bool(residual), activation
        self._act_fwd, self._act_kw, self._act_bwd = ACTIVATIONS[activation]
        kw = dict(dtype=dtype, backend=backend, rng=init.host_generator(rng))
        # registration order = TransformerEncoderLayer's (and PyTorch's) state_dict order
        self.self_attn = MultiheadAttention(d_model, nhead, dropout=dropout, bias=bias, **kw)
        self.linear1 = Linear(d_model, dim_feedforward, bias=bias, **kw)
        self.dropout = Dropout(dropout)
        self.linear2 = Linear(dim_feedforward, d_model, bias=bias, **kw)
        nkw = dict(eps=layer_norm_eps, bias=bias, dtype=dtype, backend=backend)
        self.norm1, self.norm2 = LayerNorm(d_model, **nkw), LayerNorm(d_model, **nkw)
        self.dropout1, self.dropout2 = Dropout(dropout), Dropout(dropout)
        self.manual_seed(init.stream_seed(kw["rng"]))    # this layer's dropout stream

    def _sa(self, h, mask, padding, is_causal):
        a, _ = self.self_attn(h, h, h, attn_mask=mask, key_padding_mask=padding, need_weights=False,
                              is_causal=is_causal)
        return self.dropout1(a)                                                   # (B, T, C)

    def _sa_backward(self, d):
        return self.self_attn.backward(self.dropout1.backward(d))[0]              # (B, T, C)

    def _ff(self, h):
        a, act_cache = self._act_fwd(self.linear1(h), **self._act_kw)             # (B, T, F)
        self._push(act_cache)
        return self.dropout2(self.linear2(self.dropout(a)))                       # (B, T, C)

    def _ff_backward(self, d):
        # fwd: y = drop2(linear2(drop(act(linear1(h)))))  ->  back through each, newest first
        da = self.dropout.backward(self.linear2.backward(self.dropout2.backward(d)))   # (B, T, F)
        return self.linear1.backward(self._act_bwd(da, self._pop()))              # (B, T, C)

    def _add(self, x, f):
        return x + f if self.residual else f

    def forward(self, src, src_mask=None, src_key_padding_mask=None, is_causal: bool = False):
        x = src                                                                   # (B, T, C)
        if self.norm_first:
            x = self._add(x, self._sa(self.norm1(x), src_mask, src_key_padding_mask, is_causal))
            return self._add(x, self._ff(self.norm2(x)))
        x = self.norm1(self._add(x, self._sa(x, src_mask, src_key_padding_mask, is_causal)))
        return self.norm2(self._add(x, self._ff(x)))

    def backward(self, dout):
        """Returns ``dsrc``; parameter gradients accumulate."""
        if self.norm_first:
            # fwd: y = [x1 +] FF(norm2(x1))  ->  dx1 = [dy +] norm2'(FF'(dy))
            dx1 = self._add(dout, self.norm2.backward(self._ff_backward(dout)))
            # fwd: x1 = [x +] SA(norm1(x))  ->  dx = [dx1 +] norm1'(SA'(dx1))
            return self._add(dx1, self.norm1.backward(self._sa_backward(dx1)))
        # fwd: y = norm2([x1 +] FF(x1))  ->  d = norm2'(dy);  dx1 = [d +] FF'(d)
        d = self.norm2.backward(dout)
        dx1 = self._add(d, self._ff_backward(d))
        # fwd: x1 = norm1([x +] SA(x))  ->  d = norm1'(dx1);  dx = [d +] SA'(d)
        d = self.norm1.backward(dx1)
        return self._add(d, self._sa_backward(d))

    def extra_repr(self) -> str:
        return f"norm_first={self.norm_first}, residual={self.residual}, activation={self.activation!r}"
