"""The PyTorch side of every case: the computation npformer's side runs, written with torch.

It is both the reference the parity checks compare with and the ``torch-*`` columns that are timed.
Imported only when PyTorch is wanted (``import benchmarks.bench`` does not import torch).

The models mirror npformer's with npformer's parameter names, so that npformer's weights load
strictly (``load_state_dict``) for the parity check:

* :class:`GPT`: pre-norm ``TransformerEncoderLayer`` blocks (GELU) with a causal mask, learned
  positions, a final LayerNorm and the head tied to the token embedding;
* :class:`Seq2Seq`: ``nn.Transformer`` (post-norm, ReLU) with sinusoidal positions, embeddings
  scaled by sqrt(d), padding masks and the head tied to the target embedding.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.cases import upstream_gradient

__all__ = ["linear", "softmax", "layer_norm", "gelu", "attention", "ffn", "cross_entropy", "op_calls",
           "multi_head_calls", "GPT", "Seq2Seq", "make_model", "model_outputs", "train_step"]


# -- ops: each takes the case's inputs in the order npformer's forward takes them ----------------------
def linear(x, w, b):
    return F.linear(x, w, b)


def softmax(s):
    return torch.softmax(s, -1)


def layer_norm(x, g, b):
    return F.layer_norm(x, (x.shape[-1],), g, b)


def gelu(h):
    return F.gelu(h)


def attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


def ffn(x, w1, b1, w2, b2):
    return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)


def cross_entropy(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def op_calls(b, fn: Callable, host_inputs: list, n_grad: int, params=()) -> dict:
    """``fn(*inputs)`` under autograd; ``bwd``: the gradients of the first ``n_grad`` inputs, then of
    ``params``, for the same upstream gradient npformer's backward gets."""
    xs = [b.asarray(h) for h in host_inputs]
    for x in xs[:n_grad]:
        x.requires_grad_(True)
    wrt = xs[:n_grad] + list(params)
    y = fn(*xs)
    dy = b.asarray(upstream_gradient(tuple(y.shape))).to(y.dtype)           # (float16: the output's)
    return {"fwd": lambda: fn(*xs), "bwd": lambda: torch.autograd.grad(y, wrt, dy, retain_graph=True)}


def multi_head_calls(b, host_x, num_heads: int, weights: list) -> dict:
    """``nn.MultiheadAttention`` self-attention with the given (in_proj_weight, in_proj_bias,
    out_proj.weight, out_proj.bias); gradients of x, then of those four."""
    d = host_x.shape[-1]
    m = nn.MultiheadAttention(d, num_heads, batch_first=True).to(b.device)
    params = [m.in_proj_weight, m.in_proj_bias, m.out_proj.weight, m.out_proj.bias]
    with torch.no_grad():
        for p, w in zip(params, weights):
            p.copy_(b.asarray(w))
    return op_calls(b, lambda x: m(x, x, x, need_weights=False)[0], [host_x], 1, params)


# -- models ------------------------------------------------------------------------------------------
class GPT(nn.Module):
    def __init__(self, d, H, L, F_, V, T, dropout):
        super().__init__()
        self.wte, self.wpe, self.drop = nn.Embedding(V, d), nn.Embedding(T, d), nn.Dropout(dropout)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(d, H, F_, dropout, activation="gelu",
                                                               batch_first=True, norm_first=True)
                                    for _ in range(L))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, V, bias=False)
        self.head.weight = self.wte.weight
        self.register_buffer("causal", torch.ones(T, T, dtype=torch.bool).triu(1), persistent=False)

    def forward(self, idx):
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device)))
        for layer in self.layers:
            x = layer(x, src_mask=self.causal, is_causal=True)
        return self.head(self.ln_f(x))                                          # (B, T, V)


class Seq2Seq(nn.Module):
    def __init__(self, d, H, L, F_, V, T, dropout):
        super().__init__()
        self.src_embed, self.tgt_embed = nn.Embedding(V, d, padding_idx=0), nn.Embedding(V, d, padding_idx=0)
        self.src_dropout, self.tgt_dropout = nn.Dropout(dropout), nn.Dropout(dropout)
        self.transformer = nn.Transformer(d, H, L, L, F_, dropout, activation="relu", batch_first=True)
        self.generator = nn.Linear(d, V, bias=False)
        self.generator.weight = self.tgt_embed.weight
        # in float64, then rounded once: float32 angles are off by up to 7e-6 at T = 128
        angle = torch.arange(T, dtype=torch.float64)[:, None] * torch.exp(
            torch.arange(0, d, 2, dtype=torch.float64) * (-math.log(1e4) / d))       # (T, d/2)
        pe = torch.stack([angle.sin(), angle.cos()], -1).reshape(T, d).float()      # (T, d)
        self.register_buffer("pe", pe, persistent=False)
        self.register_buffer("causal", torch.ones(T, T, dtype=torch.bool).triu(1), persistent=False)
        self.scale = math.sqrt(d)

    def forward(self, src, tgt):
        sp, tp = src == 0, tgt == 0
        x = self.src_dropout(self.src_embed(src) * self.scale + self.pe[:src.shape[1]])
        y = self.tgt_dropout(self.tgt_embed(tgt) * self.scale + self.pe[:tgt.shape[1]])
        h = self.transformer(x, y, tgt_mask=self.causal, src_key_padding_mask=sp, tgt_key_padding_mask=tp,
                             memory_key_padding_mask=sp, tgt_is_causal=True)
        return self.generator(h)                                                # (B, T, V)


def make_model(b, m: dict, T: int, dropout: float, state: dict[str, numpy.ndarray] | None = None) -> nn.Module:
    """The model of spec ``m`` on ``b``'s device in training mode; with npformer's weights when
    ``state`` is given (strict: every name must match), else torch's own initialisation (seed 0)."""
    torch.manual_seed(0)
    cls = GPT if m["kind"] == "gpt" else Seq2Seq
    model = cls(m["d"], m["H"], m["L"], m["F"], m["V"], T, dropout)
    if state is not None:
        model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=True)
    return model.to(b.device).train()


def _logits_loss(model: nn.Module, kind: str, src, tgt):
    logits = model(src) if kind == "gpt" else model(src, tgt)                   # (B, T, V)
    return logits, F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))


def model_outputs(b, m: dict, src_ids, tgt_ids, state: dict[str, numpy.ndarray]) -> tuple:
    """Host logits, loss and ``{name: gradient}`` of one forward and backward with dropout 0 and
    npformer's weights."""
    model = make_model(b, m, src_ids.shape[1], 0.0, state)
    logits, loss = _logits_loss(model, m["kind"], b.asarray(src_ids), b.asarray(tgt_ids))
    loss.backward()
    return b.to_host(logits), b.to_host(loss), {k: b.to_host(p.grad) for k, p in model.named_parameters()}


def train_step(b, m: dict, src_ids, tgt_ids, dropout: float, precision: str = "float32") -> Callable[[], Any]:
    """One timed training step: zero the gradients, forward, cross-entropy, backward, AdamW; under
    ``precision="float16"`` the forward and loss under ``torch.autocast(float16)`` and the update
    through a ``GradScaler`` (PyTorch's mixed-precision recipe; float32 weights)."""
    model = make_model(b, m, src_ids.shape[1], dropout)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    src, tgt = b.asarray(src_ids), b.asarray(tgt_ids)
    if precision == "float16":
        scaler = torch.amp.GradScaler(b.device)

        def mixed_step():
            opt.zero_grad(set_to_none=True)
            with torch.autocast(b.device, dtype=torch.float16):
                loss = _logits_loss(model, m["kind"], src, tgt)[1]
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        return mixed_step

    def step():
        opt.zero_grad(set_to_none=True)
        _logits_loss(model, m["kind"], src, tgt)[1].backward()
        opt.step()
    return step
