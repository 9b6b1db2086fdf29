"""``TransformerXL``: a decoder-only language model with segment-level recurrence and relative
positions (Dai et al. 2019, sec. 3.2-3.3), post-norm as in the paper.

    h^0 = dropout(E[idx] * sqrt(d))                                              (B, T, C)
    for each layer n:   cat = [SG(m^{n-1}); h^{n-1}]                             (B, M + T, C)
        a = RelAttn(q = h^{n-1} W_q,  k, v = cat W_kv,  R, W_r, u, v)            ops.relative_attention
        o = LayerNorm(h^{n-1} + dropout(a W_o));   h^n = LayerNorm(o + dropout(FF(o)))
    logits = dropout(h^L) E^T (tied) or W_out

The memory m^{n-1} of layer n holds the last ``mem_len`` inputs of that layer from the previous
segments: ``forward(idx, mems)`` returns ``(logits, new_mems)`` with ``new_mems[n] = [m^{n-1};
h^{n-1}][-mem_len:]``, fresh copies. SG is the stop-gradient: the memory is a constant of the
current segment, so ``backward`` sends nothing into it and never touches the forward caches of the
segment that produced it (the paper's "no gradient into the memory"). The reach grows with depth:
layer n sees n * mem_len positions back through the layers below, more than one segment.

R is the fixed sinusoidal table of ``nn.embedding`` read at distances M + T - 1 .. 0. Dropout acts on
the embeddings, the attention probabilities, both sublayer outputs, inside the feed-forward block and
before the head (the paper's code also drops R; here R stays fixed).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from npformer.backend import get_array_module
from npformer.nn import init
from npformer.nn.dropout import Dropout
from npformer.nn.embedding import Embedding, sinusoidal_table
from npformer.nn.head import OutputHead
from npformer.nn.linear import Linear
from npformer.nn.module import Module, ModuleList, Parameter
from npformer.nn.normalization import LayerNorm
from npformer.nn.transformer import FeedForwardBlock
from npformer.checks import (describe, expect_ndim, non_negative_int, one_of, positive_int, probability, real,
                             token_ids)
from npformer.errors import InputTypeError, ShapeError
from npformer.models.decoding import generate_with_memory
from npformer.ops.feedforward import ACTIVATIONS
from npformer.ops.multihead import merge_heads, split_heads
from npformer.ops.relative_attention import relative_attention_backward, relative_attention_forward

__all__ = ["TransformerXLConfig", "TransformerXL", "TransformerXLLayer", "RelativeMultiheadAttention"]


@dataclass(frozen=True)
class TransformerXLConfig:
    vocab_size: int
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 128
    d_head: int | None = None        # default d_model // n_head
    dim_feedforward: int = 256
    dropout: float = 0.1             # embeddings, attention probabilities, sublayer outputs, head input
    activation: str = "relu"
    layer_norm_eps: float = 1e-5
    mem_len: int = 0                 # positions kept as memory per layer (0: no recurrence)
    tie_embeddings: bool = True

    def __post_init__(self):
        for name in ("vocab_size", "n_layer", "n_head", "d_model", "dim_feedforward"):
            positive_int(getattr(self, name), name)
        if self.d_head is not None:
            positive_int(self.d_head, "d_head")
        elif self.d_model % self.n_head:
            raise ShapeError(f"d_model {self.d_model} is not divisible by n_head {self.n_head} (or give d_head)")
        non_negative_int(self.mem_len, "mem_len")
        probability(self.dropout, "dropout")
        one_of(self.activation, "activation", tuple(ACTIVATIONS))
        real(self.layer_norm_eps, "layer_norm_eps", 0, low_open=True)

    @property
    def head_size(self) -> int:
        return self.d_head or self.d_model // self.n_head

    def to_dict(self) -> dict:
        return asdict(self)


class RelativeMultiheadAttention(Module):
    """Queries from the segment, keys and values from [memory; segment], relative positions.

    Parameters (the paper's symbols): ``q_net.weight`` W_q, ``kv_net.weight`` [W_{k,E}; W_v],
    ``r_weight`` W_{k,R} (H*hs, C), ``r_w_bias`` u and ``r_r_bias`` v (H, hs), ``o_net.weight`` W_o.
    Each layer has its own u and v (the paper's code calls this ``untie_r``; by default it shares them).
    """

    def __init__(self, d_model, n_head, d_head, dropout=0.0, *, dtype=None, backend=None, rng=None):
        super().__init__()
        rng = init.host_generator(rng)
        kw = dict(dtype=dtype, backend=backend)
        self.n_head, self.d_head, self.dropout = n_head, d_head, float(dropout)
        inner = n_head * d_head
        self.q_net = Linear(d_model, inner, bias=False, rng=rng, **kw)
        self.kv_net = Linear(d_model, 2 * inner, bias=False, rng=rng, **kw)
        self.r_weight = Parameter(init.linear_uniform((inner, d_model), d_model, rng=rng, **kw))
        self.r_w_bias = Parameter(init.normal((n_head, d_head), 0.02, rng=rng, **kw), decay=False)
        self.r_r_bias = Parameter(init.normal((n_head, d_head), 0.02, rng=rng, **kw), decay=False)
        self.o_net = Linear(inner, d_model, bias=False, rng=rng, **kw)
        self.manual_seed(init.stream_seed(rng))          # the model's dropout stream

    def forward(self, x, cat, r):
        """x (B, T, C) the segment, cat (B, M + T, C) = [memory; x], r (M + T, C) -> (B, T, C)."""
        h, inner = self.n_head, self.n_head * self.d_head
        q = split_heads(self.q_net(x), h)                                         # (B, H, T, hs)
        kv = self.kv_net(cat)                                                     # (B, Tk, 2*H*hs)
        k, v = split_heads(kv[..., :inner], h), split_heads(kv[..., inner:], h)   # (B, H, Tk, hs)
        active = self.training and self.dropout > 0
        a, cache = relative_attention_forward(
            q, k, v, r, self.r_weight.data, self.r_w_bias.data, self.r_r_bias.data, dropout_p=self.dropout,
            rng=self.generator(x) if active else None, training=active)   # (B, H, T, hs)
        self._push(cache)
        return self.o_net(merge_heads(a))                                         # (B, T, C)

    def backward(self, dout):
        """Returns ``(dx, dcat)``; parameter gradients accumulate."""
        da = split_heads(self.o_net.backward(dout), self.n_head)                 # (B, H, T, hs)
        dq, dk, dv, _, dr_weight, du, dvb = relative_attention_backward(da, self._pop())   # R is fixed
        self.r_weight.accumulate(dr_weight)
        self.r_w_bias.accumulate(du)
        self.r_r_bias.accumulate(dvb)
        dx = self.q_net.backward(merge_heads(dq))                                 # (B, T, C)
        xp = get_array_module(dout)
        dcat = self.kv_net.backward(xp.concatenate([merge_heads(dk), merge_heads(dv)], axis=-1))   # (B, Tk, C)
        return dx, dcat

    def extra_repr(self) -> str:
        return f"n_head={self.n_head}, d_head={self.d_head}, dropout={self.dropout}"


class TransformerXLLayer(Module):
    """Relative attention over [SG(memory); x] and a feed-forward block, each residual + post-norm."""

    def __init__(self, d_model, n_head, d_head, dim_feedforward, dropout=0.1, activation="relu",
                 layer_norm_eps=1e-5, *, dtype=None, backend=None, rng=None):
        super().__init__()
        rng = init.host_generator(rng)
        kw = dict(dtype=dtype, backend=backend)
        self.attn = RelativeMultiheadAttention(d_model, n_head, d_head, dropout, rng=rng, **kw)
        self.dropout1 = Dropout(dropout)
        self.norm1 = LayerNorm(d_model, eps=layer_norm_eps, **kw)
        self.ff = FeedForwardBlock(d_model, dim_feedforward, dropout, activation, rng=rng, **kw)
        self.dropout2 = Dropout(dropout)
        self.norm2 = LayerNorm(d_model, eps=layer_norm_eps, **kw)
        self.manual_seed(init.stream_seed(rng))          # the model's dropout stream

    def forward(self, x, mem, r):
        """x (B, T, C), mem (B, M, C) or None, r (M + T, C) -> (B, T, C)."""
        xp = get_array_module(x)
        m = 0 if mem is None else mem.shape[1]
        cat = x if m == 0 else xp.concatenate([mem, x], axis=1)                   # (B, M + T, C)
        self._push(m)
        x1 = self.norm1(x + self.dropout1(self.attn(x, cat, r)))                  # (B, T, C)
        return self.norm2(x1 + self.dropout2(self.ff(x1)))                        # (B, T, C)

    def backward(self, dout):
        """Returns ``dx``: the memory is a constant, its share of the gradient is dropped."""
        m = self._pop()
        # fwd: y = norm2(x1 + drop2(FF(x1)))  ->  d = norm2'(dy);  dx1 = d + FF'(drop2'(d))
        d = self.norm2.backward(dout)
        dx1 = d + self.ff.backward(self.dropout2.backward(d))
        # fwd: x1 = norm1(x + drop1(attn(x, cat)))  ->  d = norm1'(dx1);  dx = d + dattn/dx + dattn/dcat[M:]
        d = self.norm1.backward(dx1)
        dx, dcat = self.attn.backward(self.dropout1.backward(d))
        # fwd: cat = [SG(mem); x]  ->  dx += dcat[:, M:]  (dcat[:, :M], the memory's, goes nowhere)
        return d + dx + dcat[:, m:]


class TransformerXL(Module):
    def __init__(self, config: TransformerXLConfig, *, dtype=None, backend=None, rng=None):
        super().__init__()
        c = self.config = config
        rng = init.host_generator(rng)
        kw = dict(dtype=dtype, backend=backend)
        self.wte = Embedding(c.vocab_size, c.d_model, std=c.d_model ** -0.5, rng=rng, **kw)
        self.drop = Dropout(c.dropout)
        self.layers = ModuleList(
            TransformerXLLayer(c.d_model, c.n_head, c.head_size, c.dim_feedforward, c.dropout, c.activation,
                               c.layer_norm_eps, rng=rng, **kw) for _ in range(c.n_layer))
        self.drop_out = Dropout(c.dropout)
        self.head = OutputHead(c.d_model, c.vocab_size, tied=self.wte.weight if c.tie_embeddings else None,
                               rng=rng, **kw)
        self.scale = math.sqrt(c.d_model)
        self._tables: dict = {}
        self.manual_seed(init.stream_seed(rng))          # the model's dropout stream

    def distances(self, tk: int, xp, dtype):
        """R at distances Tk-1, ..., 0: the rows ``ops.relative_attention`` expects (Tk, C)."""
        key = (xp.__name__, str(dtype), tk)
        if key not in self._tables:
            table = sinusoidal_table(tk, self.config.d_model, dtype=dtype, backend=xp.__name__)   # (Tk, C)
            self._tables[key] = xp.ascontiguousarray(table[::-1])                 # (Tk, C), reversed
        return self._tables[key]

    def _check(self, idx, mems):
        token_ids(idx, "idx", self.config.vocab_size)
        if idx.shape[1] < 1:
            raise ShapeError(f"idx: expected a segment of at least one token, got {describe(idx)}")
        if mems is None:
            return 0
        n, (b, c) = self.config.n_layer, (idx.shape[0], self.config.d_model)
        if not isinstance(mems, (list, tuple)) or len(mems) != n:
            raise ShapeError(f"mems: expected None or a list of {n} arrays (B, M, C), one per layer, got "
                             f"{type(mems).__name__} of length {len(mems) if hasattr(mems, '__len__') else '?'}")
        for i, mem in enumerate(mems):
            expect_ndim(mem, f"mems[{i}]", 3, "(B, M, C)")
        m = mems[0].shape[1]
        for i, mem in enumerate(mems):
            if tuple(mem.shape) != (b, m, c):
                raise ShapeError(f"mems[{i}]: expected shape (B, M, C)=({b}, {m}, {c}) (the batch of idx, "
                                 f"the same M in every layer), got {describe(mem)}")
            if mem.dtype != self.dtype:
                raise InputTypeError(f"mems[{i}]: expected the model's dtype {self.dtype}, got {describe(mem)}")
            get_array_module(idx, mem)
        return m

    def forward(self, idx, mems=None, *, mem_len: int | None = None):
        """idx (B, T) -> ``(logits (B, T, V), new_mems)``.

        ``mems``: None or the ``new_mems`` of the previous segment (one (B, M, C) array per layer).
        ``new_mems`` keeps the last ``mem_len`` positions (default ``config.mem_len``; a longer value
        at evaluation gives a longer context than training had); None when ``mem_len`` is 0.
        """
        m = self._check(idx, mems)
        keep = non_negative_int(self.config.mem_len if mem_len is None else mem_len, "mem_len")
        xp = get_array_module(idx)
        r = self.distances(m + idx.shape[1], xp, self.dtype)                     # (M + T, C)
        e = self.wte(idx)                                                         # (B, T, C)
        h = self.drop(e * e.dtype.type(self.scale))                               # (B, T, C), the scale in e's dtype
        hids = []
        for i, layer in enumerate(self.layers):
            hids.append(h)
            h = layer(h, None if mems is None else mems[i], r)                    # (B, T, C)
        logits = self.head(self.drop_out(h))                                      # (B, T, V)
        if keep == 0:
            return logits, None
        # fresh C-contiguous copies: nothing the caches hold is shared with the memory
        new_mems = [(hid if mems is None else xp.concatenate([mem, hid], axis=1))[:, -keep:].copy()
                    for hid, mem in zip(hids, mems or [None] * len(hids))]       # L x (B, min(M+T, keep), C)
        return logits, new_mems

    def backward(self, dlogits):
        """Accumulates every parameter gradient; returns None (ids and memory get none)."""
        dh = self.drop_out.backward(self.head.backward(dlogits))
        for layer in reversed(list(self.layers)):
            dh = layer.backward(dh)
        # fwd: h^0 = drop(E[idx] * sqrt(d))
        de = self.drop.backward(dh)                                               # (B, T, C)
        self.wte.backward(de * de.dtype.type(self.scale))

    def generate(self, idx, max_new_tokens: int, *, rng=None, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, mem_len: int | None = None):
        """``idx`` (B, T) followed by ``max_new_tokens`` sampled tokens, as :meth:`GPT.generate`
        (``temperature=0`` greedy; ``rng`` the seeded generator). The memory is the cache: each new
        token reads the last ``mem_len`` positions (default ``config.mem_len``) of every layer."""
        return generate_with_memory(self, idx, max_new_tokens, rng, temperature=temperature, top_k=top_k,
                                    top_p=top_p, mem_len=mem_len)
