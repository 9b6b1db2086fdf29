"""The PyTorch side of every case: the computation npformer's side runs, written with torch.

It is both the reference the parity checks compare with and the ``torch-*`` columns that are timed:
:class:`TorchBackend`, the :class:`npformer.bench.ReferenceBackend` of PyTorch, registered as
``--backends torch`` when this module is imported (``benchmarks/run.py`` does; the installed package
never imports torch).

The models mirror npformer's with npformer's parameter names, so that npformer's weights load
strictly (``load_state_dict``) for the parity check:

* :class:`GPT`: the strongest eager PyTorch a user writes, nanoGPT's structure (Karpathy's
  ``model.py``): pre-norm blocks whose attention is one fused QKV product and
  ``scaled_dot_product_attention(is_causal=True)``, a GELU MLP, learned positions, a final LayerNorm,
  the head tied to the token embedding; AdamW fused on a GPU. The dropouts are npformer's (attention
  weights, both residual branches, after the GELU), so both sides do the same work;
* :class:`LayersGPT`: the same model from ``nn.TransformerEncoderLayer`` blocks with a causal mask
  (the ``torch-layers`` column: what ``torch.nn``'s own layers give);
* :class:`Seq2Seq`: ``nn.Transformer`` (post-norm, ReLU) with sinusoidal positions, embeddings
  scaled by sqrt(d), padding masks and the head tied to the target embedding.

Three columns are registered: ``torch`` (every case; the parity reference), ``torch-layers`` and
``torch-compile`` (the GPT training steps only: :class:`GPT` under ``torch.compile``, whose first
step, the compilation, is timed apart as the row's ``compile_s``).
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable

import numpy
import torch
import torch.nn.functional as F
from torch import nn

from npformer.bench.backends import ReferenceBackend, register_reference
from npformer.bench.cases import upstream_gradient

__all__ = ["TorchBackend", "LayersBackend", "CompiledBackend", "OPS", "GPT", "LayersGPT", "Seq2Seq", "make_model"]


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


def attention_causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def ffn(x, w1, b1, w2, b2):
    return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)


def cross_entropy(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# the names npformer.bench.cases asks for
OPS = {"linear": linear, "softmax": softmax, "layer_norm": layer_norm, "gelu": gelu, "attention": attention,
       "attention_causal": attention_causal, "ffn": ffn, "cross_entropy": cross_entropy}


def _autograd_calls(b, fn: Callable, host_inputs: list, n_grad: int, params=(), dtype: str | None = None) -> dict:
    """``fn(*inputs)`` under autograd, the inputs cast to ``dtype`` on the device when given; ``bwd``:
    the gradients of the first ``n_grad`` inputs, then of ``params``, for the same upstream gradient
    npformer's backward gets."""
    xs = [b.asarray(h, dtype) for h in host_inputs]
    for x in xs[:n_grad]:
        x.requires_grad_(True)
    wrt = xs[:n_grad] + list(params)
    y = fn(*xs)
    dy = b.asarray(upstream_gradient(tuple(y.shape))).to(y.dtype)           # (float16: the output's)
    return {"fwd": lambda: fn(*xs), "bwd": lambda: torch.autograd.grad(y, wrt, dy, retain_graph=True)}


# -- models ------------------------------------------------------------------------------------------
class CausalSelfAttention(nn.Module):
    """nanoGPT's attention: one (3d, d) product for q, k and v, flash attention through SDPA."""

    def __init__(self, d, H, dropout):
        super().__init__()
        self.H, self.p = H, dropout
        self.in_proj_weight = nn.Parameter(torch.empty(3 * d, d))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * d))
        nn.init.xavier_uniform_(self.in_proj_weight)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (a.view(B, T, self.H, C // self.H).transpose(1, 2)                       # (B, H, T, D)
                   for a in F.linear(x, self.in_proj_weight, self.in_proj_bias).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0, is_causal=True)
        return self.out_proj(y.transpose(1, 2).reshape(B, T, C))                             # (B, T, C)


class Block(nn.Module):
    """A pre-norm block, x + attn(LN(x)) then x + mlp(LN(x)), with npformer's names and dropouts."""

    def __init__(self, d, H, F_, dropout):
        super().__init__()
        self.norm1, self.self_attn, self.dropout1 = nn.LayerNorm(d), CausalSelfAttention(d, H, dropout), nn.Dropout(dropout)
        self.norm2, self.linear1, self.linear2 = nn.LayerNorm(d), nn.Linear(d, F_), nn.Linear(F_, d)
        self.dropout, self.dropout2 = nn.Dropout(dropout), nn.Dropout(dropout)

    def forward(self, x):
        x = x + self.dropout1(self.self_attn(self.norm1(x)))
        return x + self.dropout2(self.linear2(self.dropout(F.gelu(self.linear1(self.norm2(x))))))


class GPT(nn.Module):
    def __init__(self, d, H, L, F_, V, T, dropout):
        super().__init__()
        self.wte, self.wpe, self.drop = nn.Embedding(V, d), nn.Embedding(T, d), nn.Dropout(dropout)
        self.layers = nn.ModuleList(Block(d, H, F_, dropout) for _ in range(L))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, V, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx):
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device)))
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln_f(x))                                          # (B, T, V)


class LayersGPT(nn.Module):
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


def make_model(b, m, T: int, dropout: float, state: dict[str, numpy.ndarray] | None = None,
               gpt: type = GPT) -> nn.Module:
    """The model of spec ``m`` on ``b``'s device in training mode (a GPT of class ``gpt``); with
    npformer's weights when ``state`` is given (strict: every name must match), else torch's own
    initialisation (seed 0)."""
    torch.manual_seed(0)
    cls = gpt if m.kind == "gpt" else Seq2Seq
    model = cls(m.d, m.H, m.L, m.F, m.V, T, dropout)
    if state is not None:
        model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=True)
    return model.to(b.device).train()


def _logits_loss(model: nn.Module, kind: str, src, tgt):
    logits = model(src) if kind == "gpt" else model(src, tgt)                   # (B, T, V)
    return logits, F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))


# -- the backend ---------------------------------------------------------------------------------------
class TorchBackend(ReferenceBackend):
    """PyTorch on ``"cpu"`` or ``"cuda"`` (the ``torch-cpu`` and ``torch-cuda`` columns), with
    ``torch.set_num_threads(threads)``."""
    framework = "torch"
    gpt: type = GPT            # the GPT model class of the training steps

    def __init__(self, device: str, threads: int):
        super().__init__(f"{self.framework}-{device}", device, threads)
        torch.set_num_threads(threads)
        # The suite is float32 throughout; a caller (a test session) may have changed torch's
        # default dtype, which would build float64 modules beside float32 inputs.
        torch.set_default_dtype(torch.float32)

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def asarray(self, host: numpy.ndarray, dtype: str | None = None):
        a = torch.from_numpy(numpy.array(host, order="C")).to(self.device)           # 0-d stays 0-d
        return a if dtype is None else a.to(getattr(torch, dtype))

    def to_host(self, a) -> numpy.ndarray:
        return a.detach().cpu().numpy()

    def versions(self) -> dict[str, str]:
        return {"torch": torch.__version__}

    def gpu_name(self) -> str:
        return torch.cuda.get_device_name(0)

    def allow_tf32(self) -> None:
        torch.backends.cuda.matmul.allow_tf32 = True

    def free_bytes(self) -> int:
        return torch.cuda.mem_get_info()[0] if self.device == "cuda" else super().free_bytes()

    def peak_mb(self, fn: Callable[[], Any], min_s: float = 0.2) -> float | None:
        if self.device == "cpu":
            return super().peak_mb(fn, min_s)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20

    # -- the cases (npformer.bench.ReferenceBackend says what each returns) --------------------------
    def op_calls(self, op: str, host_inputs: list, n_grad: int, dtype: str | None = None) -> dict:
        return _autograd_calls(self, OPS[op], host_inputs, n_grad, dtype=dtype)

    def multi_head_calls(self, host_x, num_heads: int, weights: list) -> dict:
        """``nn.MultiheadAttention`` self-attention with the given (in_proj_weight, in_proj_bias,
        out_proj.weight, out_proj.bias); gradients of x, then of those four."""
        m = nn.MultiheadAttention(host_x.shape[-1], num_heads, batch_first=True).to(self.device)
        params = [m.in_proj_weight, m.in_proj_bias, m.out_proj.weight, m.out_proj.bias]
        with torch.no_grad():
            for p, w in zip(params, weights):
                p.copy_(self.asarray(w))
        return _autograd_calls(self, lambda x: m(x, x, x, need_weights=False)[0], [host_x], 1, params)

    def dropout_calls(self, host_x, p: float) -> dict:
        x = self.asarray(host_x).requires_grad_(True)
        y = F.dropout(x, p)
        dy = self.asarray(upstream_gradient(tuple(y.shape)))
        return {"fwd": lambda: F.dropout(x, p), "bwd": lambda: torch.autograd.grad(y, x, dy, retain_graph=True)[0],
                "_probe": (x, y, dy)}

    def model_outputs(self, m, src_ids, tgt_ids, state: dict[str, numpy.ndarray]) -> tuple:
        """Host logits, loss and ``{name: gradient}`` of one forward and backward with dropout 0 and
        npformer's weights."""
        model = make_model(self, m, src_ids.shape[1], 0.0, state, gpt=self.gpt)
        logits, loss = _logits_loss(model, m.kind, self.asarray(src_ids), self.asarray(tgt_ids))
        loss.backward()
        return self.to_host(logits), self.to_host(loss), {k: self.to_host(p.grad) for k, p in model.named_parameters()}

    def train_step(self, m, src_ids, tgt_ids, dropout: float, precision: str = "float32") -> Callable[[], Any]:
        """One timed training step: zero the gradients, forward, cross-entropy, backward, AdamW; under
        ``precision="float16"`` the forward and loss under ``torch.autocast(float16)`` and the update
        through a ``GradScaler`` (PyTorch's mixed-precision recipe; float32 weights); under
        ``"bfloat16"`` the same autocast in bfloat16 and no scaler (nanoGPT's recipe on an A100 or later)."""
        model = self.prepare(make_model(self, m, src_ids.shape[1], dropout, gpt=self.gpt))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=self.device == "cuda")   # (nanoGPT's)
        src, tgt = self.asarray(src_ids), self.asarray(tgt_ids)
        if precision == "float16":
            scaler = torch.amp.GradScaler(self.device)

            def mixed_step():
                opt.zero_grad(set_to_none=True)
                with torch.autocast(self.device, dtype=torch.float16):
                    loss = _logits_loss(model, m.kind, src, tgt)[1]
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            return mixed_step

        def step():
            opt.zero_grad(set_to_none=True)
            with torch.autocast(self.device, dtype=torch.bfloat16, enabled=precision == "bfloat16"):
                loss = _logits_loss(model, m.kind, src, tgt)[1]
            loss.backward()
            opt.step()
        return step

    def prepare(self, model: nn.Module) -> nn.Module:
        """The model a training step runs (a subclass compiles it)."""
        return model


def _gpt_steps(case: dict) -> bool:
    """The cases of the torch-layers and torch-compile columns: the GPT training steps, but not those
    whose npformer step replays a CUDA graph (PyTorch's side of those is the case without the graph's:
    measuring it again would compile the same model twice)."""
    return case.group == "model" and case.kind == "gpt" and not case.graph


class LayersBackend(TorchBackend):
    """The GPT training steps with ``nn.TransformerEncoderLayer`` blocks (``torch-layers-*``)."""
    framework = "torch-layers"
    gpt = LayersGPT

    def takes(self, case: dict) -> bool:
        return _gpt_steps(case)


class CompiledBackend(TorchBackend):
    """The GPT training steps of :class:`GPT` under ``torch.compile`` (``torch-compile-*``): the
    compilation happens in the first step, which ``train_step`` runs and times (``compile_s`` of the
    step it returns, reported apart); the timed steps come after it."""
    framework = "torch-compile"

    def takes(self, case: dict) -> bool:
        return _gpt_steps(case)

    def prepare(self, model: nn.Module) -> nn.Module:
        return torch.compile(model)

    def train_step(self, m, src_ids, tgt_ids, dropout: float, precision: str = "float32") -> Callable[[], Any]:
        step = super().train_step(m, src_ids, tgt_ids, dropout, precision)
        start = time.perf_counter()
        step()
        self.sync()
        step.compile_s = time.perf_counter() - start
        return step


def _factory(cls: type) -> Callable[[str, int], TorchBackend | None]:
    def make(device: str, threads: int) -> TorchBackend | None:
        """``cls`` on ``device``: None for "cuda" where PyTorch sees no GPU."""
        return None if device == "cuda" and not torch.cuda.is_available() else cls(device, threads)
    return make


for _cls in (TorchBackend, LayersBackend, CompiledBackend):
    register_reference(_cls.framework, _factory(_cls))
