"""The training-step cases: one AdamW step of a GPT or an encoder-decoder, npformer beside PyTorch.

A step is: zero the gradients, forward, cross-entropy, backward, AdamW (lr 3e-4), with dropout
0.1, float32 (or mixed precision: the ``-fp16`` and ``-bf16`` cases), no padding tokens; the GPT's targets
are its inputs reversed, the seq2seq's source and target are the same ids and their reverse (S = T).
npformer's GPT step is the trainers': the head and the loss together, in chunks of rows
(:mod:`npformer.ops.linear_cross_entropy`), so it never holds the (B, T, V) logits.

Parity (``outputs``): the same model with dropout 0 and npformer's weights (rng 0) on both sides
(the reference's ``model_outputs`` loads them by name, strictly), one forward and backward (the optimizer update is not
compared): the logits and the loss element by element, and the gradients by their norms, each
parameter's and all together. Gradients are not compared element by element because ReLU's
derivative jumps at 0: where float32 rounding puts a pre-activation on the other side of 0 in one
library, a few gradient elements differ by O(1) of their own size (seen: seq2seq-base at full size,
one row of the source embedding's gradient 1e-3 of its largest element off, between PyTorch in float32
and in float64), while the forward, continuous, and the norms move by a few float32 epsilons.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy

from npformer.bench.cases import FULL, Case

__all__ = ["ModelSpec", "MODELS", "DROPOUT", "train_flops", "model_batch", "model_cases"]

DROPOUT = 0.1           # every model's but those that say their own


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A benchmark model: its kind, sizes and how the suite runs it (a misspelt field is a TypeError
    where the table is written, on every machine, not a key missed on a GPU)."""

    kind: str                   # "gpt" or "seq2seq"
    d: int                      # model width
    H: int                      # heads
    L: int                      # layers (per stack for seq2seq)
    F: int                      # feed-forward width
    V: int                      # vocabulary
    B: int | None = None        # full mode's batch and length (None: the suite's model_B, model_T)
    T: int | None = None
    dropout: float = DROPOUT
    cpu_size: bool = False      # B and T also in quick mode
    gpu: bool = False           # a GPU case, skipped on the CPU
    graph: bool = False         # npformer's forward and backward replayed from one CUDA graph
    precision: str = "float32"  # "float16": mixed precision (PyTorch: autocast + GradScaler); "bfloat16"
                                # (autocast, no scaler)


MODELS = {
    # nanoGPT's documented CPU recipe for character-level Shakespeare: 4 layers, 4 heads, d 128, context
    # 64, batch 12, MLP 512, exact GELU, no dropout; V 65 (the play's characters); quick mode: its B, T
    "gpt-tiny": ModelSpec("gpt", d=128, H=4, L=4, F=512, V=65, B=12, T=64, dropout=0.0, cpu_size=True),
    "gpt-small": ModelSpec("gpt", d=256, H=8, L=4, F=1024, V=512),
    "gpt-medium": ModelSpec("gpt", d=512, H=8, L=6, F=2048, V=1024),
    "seq2seq-base": ModelSpec("seq2seq", d=256, H=8, L=3, F=1024, V=1024),  # base 512/8/6+6/2048, halved
    # GPU sizes (issue 13), skipped on the CPU; B and T are their full-mode sizes (quick mode: the
    # suite's small ones); PyTorch eager beside the CUDA graph.
    "gpt-medium-graph": ModelSpec("gpt", d=512, H=8, L=6, F=2048, V=1024, gpu=True, graph=True),
    "gpt-d768-t512": ModelSpec("gpt", d=768, H=12, L=12, F=3072, V=8192, B=8, T=512, gpu=True),
    # GPT-2 124M as nanoGPT pretrains it (issue 43's anchor, nanoGPT's model.py on the same GPU): dropout 0
    # (until 2026-12-01 these cases ran dropout 0.1 on both sides, the anchor 0)
    "gpt2-124m": ModelSpec("gpt", d=768, H=12, L=12, F=3072, V=50257, B=8, T=1024, dropout=0.0, gpu=True),
    "gpt2-124m-fp16": ModelSpec("gpt", d=768, H=12, L=12, F=3072, V=50257, B=8, T=1024, dropout=0.0, gpu=True,
                                precision="float16"),
    "gpt2-124m-bf16": ModelSpec("gpt", d=768, H=12, L=12, F=3072, V=50257, B=8, T=1024, dropout=0.0, gpu=True,
                                precision="bfloat16"),
    "gpt2-124m-fp16-graph": ModelSpec("gpt", d=768, H=12, L=12, F=3072, V=50257, B=8, T=1024, dropout=0.0,
                                      gpu=True, precision="float16", graph=True),
    "seq2seq-d512": ModelSpec("seq2seq", d=512, H=8, L=6, F=2048, V=8192, B=16, T=128, gpu=True),
}
HALF_PARITY = ("skipped: mixed precision (16-bit model, float32 masters); the float32 case of the same model "
               "is checked")


def train_flops(m: ModelSpec, B: int, T: int) -> int:
    """Matmul FLOPs of one step (forward + backward = 3 x forward); see cases.FLOPS["train_step"]."""
    d, L, F, V = m.d, m.L, m.F, m.V
    N = B * T
    if m.kind == "gpt":
        return 6 * N * (L * (4 * d * d + 2 * d * F) + V * d) + 12 * L * B * T * T * d
    return 6 * (2 * N * L * (6 * d * d + 2 * d * F) + N * V * d) + 36 * L * B * T * T * d


def _npformer_model(backend: str, m: ModelSpec, T: int, dropout: float):
    from npformer.models.gpt import GPT, GPTConfig
    from npformer.models.seq2seq import Seq2Seq, Seq2SeqConfig
    d, H, L, F, V = m.d, m.H, m.L, m.F, m.V
    if m.kind == "gpt":
        return GPT(GPTConfig(V, T, L, H, d, F, dropout, "gelu", norm_first=True, tie_embeddings=True),
                   dtype=numpy.float32, backend=backend, rng=0)
    return Seq2Seq(Seq2SeqConfig(V, V, d, H, L, L, F, dropout, "relu", norm_first=False, max_len=T),
                   dtype=numpy.float32, backend=backend, rng=0)


def _train_forward_backward(model, kind: str, src, tgt, dloss=1.0) -> None:
    """A training step's forward, mean cross-entropy and backward (gradients accumulate), as the trainers
    run it: a GPT takes its head and loss together in chunks of rows (no (B, T, V) logits)."""
    if kind != "gpt":
        from npformer.backend import accumulation_dtype, get_array_module
        from npformer.ops.cross_entropy import cross_entropy_backward, cross_entropy_forward
        logits = model(src, tgt)                                                  # (B, T, V)
        xp = get_array_module(logits)
        _, cache = cross_entropy_forward(logits, tgt, loss_dtype=accumulation_dtype(logits.dtype))   # () float32
        model.backward(cross_entropy_backward(xp.asarray(dloss, dtype=cache.loss_dtype), cache))  # (B, T, V)
        return
    model.backward_hidden(model.head.cross_entropy(model.hidden(src), tgt, dloss=dloss).dx)


def _forward_backward(model, kind: str, src, tgt) -> tuple:
    """Forward, mean cross-entropy, backward (gradients accumulate); returns (logits, loss): the
    parity check's step, which compares the logits."""
    from npformer.backend import get_array_module
    from npformer.ops.cross_entropy import cross_entropy_backward, cross_entropy_forward
    logits = model(src) if kind == "gpt" else model(src, tgt)                  # (B, T, V)
    loss, cache = cross_entropy_forward(logits, tgt)
    model.backward(cross_entropy_backward(get_array_module(logits).ones((), logits.dtype), cache))
    return logits, loss


def _npformer_step(b, m: ModelSpec, src_ids, tgt_ids) -> Callable[[], Any]:
    """zero_grad, forward, cross-entropy, backward, AdamW over the flat buffers (as the trainers
    do); under float16 through MixedPrecision (the loss in float32 from the 16-bit logits, the scaled
    gradient, unscale, check, step, round down); with ``graph`` the forward and backward replayed from a CUDA
    graph and AdamW run after it."""
    from npformer.nn.flat import flatten_parameters
    from npformer.training.amp import MixedPrecision
    from npformer.training.optim import AdamW
    model = _npformer_model(b.name, m, src_ids.shape[1], m.dropout)
    flatten_parameters(model)                    # as the trainers do: AdamW over whole runs of one buffer
    src, tgt = b.asarray(src_ids), b.asarray(tgt_ids)
    if m.precision != "float32":                 # bfloat16 without a loss scaler (MixedPrecision's default)
        amp = MixedPrecision(model, m.precision)
        opt = AdamW(amp.named_parameters(), lr=3e-4)

        def update():                                # unscale, check, update the masters, round, zero grads
            amp.step(opt)
    else:
        amp, opt = None, AdamW(model.parameters(), lr=3e-4)

        def update():
            opt.step()
            model.zero_grad()
    if m.graph:
        return _npformer_graph_step(model, amp, update, m.kind, src, tgt)

    def step():                                      # under mixed precision the gradient is that of S * loss
        _train_forward_backward(model, m.kind, src, tgt, dloss=1.0 if amp is None else amp.scaled_dloss())
        update()
    return step


def _npformer_graph_step(model, amp, update, kind: str, src, tgt) -> Callable[[], Any]:
    """The gradients are made inside the graph (each replay rewrites the arrays the capture allocated),
    so they are never zeroed between steps: a parameter's first contribution is a copy. Under mixed
    precision the loss scale is read from ``amp``'s array, refreshed before each call, as the trainer does."""
    from npformer.training.cuda_graph import CudaGraphStep
    params = list(model.parameters())

    def forward_backward(src, tgt):
        model.zero_grad()                            # at the capture: the first accumulate allocates
        _train_forward_backward(model, kind, src, tgt, dloss=1.0 if amp is None else amp.scaled_dloss())
        return tuple(p.grad for p in params)
    captured = CudaGraphStep(forward_backward, warmup=2)

    def step():
        if amp is not None:
            amp.scaled_dloss()                       # the scale of this step, into the array the graph reads
        for p, g in zip(params, captured(src, tgt)):
            p.grad = g                               # the replay's gradients (the capture's arrays)
        update()
    return step


def _compared(logits, loss, grads: dict[str, numpy.ndarray]) -> dict[str, numpy.ndarray]:
    """What a step's parity compares (module docstring): logits, loss, gradient norms."""
    norms = {f"|d {k}|": numpy.linalg.norm(g.astype(numpy.float64)) for k, g in grads.items()}
    total = numpy.sqrt(sum(n ** 2 for n in norms.values()))
    return {"logits": logits, "loss": loss, "|grad|": numpy.asarray(total),
            **{k: numpy.asarray(n) for k, n in norms.items()}}


def _outputs(b, m: ModelSpec, src_ids, tgt_ids) -> dict[str, numpy.ndarray]:
    T = src_ids.shape[1]
    if b.framework != "npformer":
        from npformer.interop import to_numpy_state_dict
        weights = to_numpy_state_dict(_npformer_model("numpy", m, T, 0.0))
        return _compared(*b.model_outputs(m, src_ids, tgt_ids, weights))
    model = _npformer_model(b.name, m, T, 0.0)
    logits, loss = _forward_backward(model, m.kind, b.asarray(src_ids), b.asarray(tgt_ids))
    return _compared(b.to_host(logits), b.to_host(loss), {k: b.to_host(g) for k, g in model.grads().items()})


def model_batch(m: ModelSpec, c: dict | None = None, quick: bool = False) -> tuple[int, int]:
    """(B, T) the suite runs ``m`` at: its own in full mode (in quick mode only where ``cpu_size``), else the
    mode's ``model_B`` and ``model_T`` (``c``: the full mode's settings by default)."""
    c = FULL if c is None else c
    return (m.B, m.T) if m.B is not None and (m.cpu_size or not quick) else (c["model_B"], c["model_T"])


def model_cases(c: dict, quick: bool = False) -> list[Case]:
    """Every model case; a GPU case (``gpu_only``) takes its own B and T in full mode."""
    out = []
    for name, m in MODELS.items():
        B, T = model_batch(m, c, quick)
        src = numpy.random.default_rng(1).integers(1, m.V, (B, T))          # no padding tokens
        tgt = src[:, ::-1].copy()
        layers = f"{m.L}+{m.L}" if m.kind == "seq2seq" else str(m.L)
        shape = f"B={B} T={T} d={m.d} H={m.H} L={layers} F={m.F} V={m.V}"
        shape += (f", {m.precision} mixed" if m.precision != "float32" else "") + (", CUDA graph" if m.graph else "")

        def build(b, m=m, src=src, tgt=tgt):
            if b.framework == "npformer":
                return {"step": _npformer_step(b, m, src, tgt)}
            return {"step": b.train_step(m, src, tgt, m.dropout, m.precision)}
        out.append(Case(name, "model", shape, B * T * (2 if m.kind == "seq2seq" else 1),
                        {"step": train_flops(m, B, T)}, build,
                        lambda b, m=m, src=src, tgt=tgt: _outputs(b, m, src, tgt), kind=m.kind, gpu_only=m.gpu,
                        precision=m.precision, parity_skipped=HALF_PARITY if m.precision != "float32" else None,
                        graph=m.graph))
    return out
