"""``npformer study gradient-flow``: why Transformers do not suffer the vanishing gradients of RNNs.

Three models of about the same size read a sequence x_1..x_T (T = 100 by default) and predict from
their output at the last step only; the loss L_T is the squared error there. For every step t we
measure each model's own gradient with its own hand-written backward (BPTT for the recurrent ones):

    g_t = mean over held-out sequences of || dL_T / dx_t ||_2

An Elman RNN multiplies that gradient by W_hh^T diag(1 - h^2) once per step back, so g_t shrinks
geometrically with the distance T - t; an LSTM does the same through its forget gate (about 1/2 at
initialisation); self-attention reaches every position in one step, so the Transformer's curve is
flat. The summary is the decay ratio r = g_1 / g_T (1: flat; 1e-20: the first input has no say).
x_T also reaches the Transformer's read-out directly through the residual stream, so its g_T can
stand above the flat rest of the curve; g_1 / g_{T-1}, printed beside r, leaves that step out.

Task (the same for every model, fresh random data each step): x_t ~ N(0, I) in R^8 and the target
is sum_t x_t / sqrt(T), so every step counts equally and predicting 0 gives a loss of 1. Training is
Adam (lr 1e-3 by default, gradients clipped to norm 1), 300 steps of 32 sequences per model. What
training does to a recurrent curve depends on whether the model learns the task: to predict the
sum it must carry x_1 all the way to step T, and its curve flattens; a model that fails to learn
keeps its decay (the Elman RNN is sensitive to the learning rate here: compare --lr 3e-3).

Models: ``RNN(8, 128)``, ``LSTM(8, 64)`` and a 2-layer pre-norm ``TransformerEncoder`` (d_model 32,
4 heads, ff 64, sinusoidal positions, final LayerNorm), each with a linear read-out (about 18-20k
parameters each). The encoder is causal: its output at step t sees x_1..x_t only, the function
class the RNNs compute, so the models differ only in how far the gradient has to travel (at the
last step, which is all the loss reads, causal and bidirectional attention see the same inputs).
Everything runs in float64, so that gradients which shrink by a constant factor per step stay
representable for long sequences.

Speed: each recurrent pass is T small (B, H) x (H, H) products. On a machine whose cores are busy
with other work, OpenBLAS's worker threads turn each of them from microseconds into milliseconds
(measured: 20 s -> 390 s for the RNN's 300 steps on 2 shared cores); ``OPENBLAS_NUM_THREADS=1``
(or ``OMP_NUM_THREADS=1``) before starting avoids that.
"""
from __future__ import annotations

import argparse
import math
import time

import numpy

from npformer.backend import get_array_module
from npformer.checks import non_negative_int, positive_int, real
from npformer.nn import (LSTM, RNN, LayerNorm, Linear, Module, PositionalEncoding, TransformerEncoder,
                         TransformerEncoderLayer)
from npformer.progress import Progress
from npformer.study.output import legend_below, out_dir, pyplot, save_figure, write_csv, write_json
from npformer.training.optim import Adam, clip_grad_norm

MODELS = ("rnn", "lstm", "transformer")
NAMES = {"rnn": "Elman RNN", "lstm": "LSTM", "transformer": "Transformer encoder"}   # in plots


class RecurrentRegressor(Module):
    """``RNN`` or ``LSTM`` over (B, T, I), then ``head`` on the last hidden state: y (B, O)."""

    def __init__(self, kind: str, input_size: int, hidden_size: int, out_size: int, *, rng=None):
        super().__init__()
        cls = {"rnn": RNN, "lstm": LSTM}[kind]
        self.rnn = cls(input_size, hidden_size, rng=rng, dtype="float64")
        self.head = Linear(hidden_size, out_size, rng=rng, dtype="float64")

    def forward(self, x):
        out, _ = self.rnn(x)                             # (B, T, H)
        return self.head(out[:, -1])                     # (B, O)

    def backward(self, dy):
        # fwd: y = head(h_T)  ->  dh_T, which reaches the RNN as the gradient of its last step
        dh = self.head.backward(dy)                      # (B, H)
        dx, _ = self.rnn.backward(None, dh[None])
        return dx                                        # (B, T, I)


class TransformerRegressor(Module):
    """Linear input projection, sinusoidal positions, causal pre-norm encoder, head on the last step."""

    def __init__(self, input_size: int, out_size: int, max_len: int, *, d_model: int = 32, nhead: int = 4,
                 num_layers: int = 2, dim_feedforward: int = 64, rng=None):
        super().__init__()
        kw = dict(rng=rng, dtype="float64")
        self.proj = Linear(input_size, d_model, **kw)
        self.pos = PositionalEncoding(d_model, max_len)
        layer = TransformerEncoderLayer(d_model, nhead, dim_feedforward, dropout=0.0, norm_first=True, **kw)
        self.encoder = TransformerEncoder(layer, num_layers, norm=LayerNorm(d_model, dtype="float64"))
        self.head = Linear(d_model, out_size, **kw)

    def forward(self, x):
        h = self.encoder(self.pos(self.proj(x)), is_causal=True)    # (B, T, C)
        self._push(h.shape)
        return self.head(h[:, -1])                       # (B, O)

    def backward(self, dy):
        xp = get_array_module(dy)
        dh = xp.zeros(self._pop(), dtype=dy.dtype)       # (B, T, C): only the last step was read
        dh[:, -1] = self.head.backward(dy)
        return self.proj.backward(self.pos.backward(self.encoder.backward(dh)))    # (B, T, I)


def build(kind: str, input_size: int, seq_len: int, seed: int) -> Module:
    """The study's models, sized to about the same parameter count (18-20k at input_size 8)."""
    if kind == "rnn":
        return RecurrentRegressor("rnn", input_size, 128, input_size, rng=seed)
    if kind == "lstm":
        return RecurrentRegressor("lstm", input_size, 64, input_size, rng=seed)
    if kind == "transformer":
        return TransformerRegressor(input_size, input_size, seq_len, rng=seed)
    raise ValueError(f"model must be one of {MODELS}, got {kind!r}")


def make_batch(rng, batch: int, seq_len: int, input_size: int):
    """x (B, T, I) standard normal; target (B, I) = sum over t of x_t / sqrt(T) (unit variance)."""
    x = rng.standard_normal((batch, seq_len, input_size))                     # (B, T, I)
    return x, x.sum(axis=1) / math.sqrt(seq_len)                              # (B, I)


def loss_and_grad(y, target):
    """Per-sequence squared error L_b = mean_k (y - target)^2 (B,), and dL_b/dy (B, O)."""
    diff = y - target                                                         # (B, O)
    return (diff * diff).mean(axis=1), diff * (2.0 / diff.shape[1])


def input_gradients(model: Module, x, target):
    """dL_b/dx_b for each sequence b (B, T, I) through the model's own backward; grads left zero."""
    model.zero_grad()
    y = model(x)
    _, dy = loss_and_grad(y, target)
    dx = model.backward(dy)
    model.zero_grad()
    return dx


def gradient_norms(model: Module, x, target):
    """g_t = mean over sequences of ||dL_b/dx_{b,t}|| (T,)."""
    dx = input_gradients(model, x, target)
    return numpy.sqrt((dx * dx).sum(axis=2)).mean(axis=0)                     # (T,)


def train(model: Module, steps: int, batch: int, seq_len: int, input_size: int, lr: float, seed: int,
          clip: float = 1.0, what: str = "training") -> list[float]:
    """Adam on fresh batches with gradient clipping; returns the training loss per step."""
    rng = numpy.random.default_rng(seed)
    opt = Adam(model.named_parameters(), lr=lr)
    losses = []
    progress = Progress(steps, what)
    for _ in range(steps):
        x, target = make_batch(rng, batch, seq_len, input_size)
        y = model(x)
        per_seq, dy = loss_and_grad(y, target)
        model.backward(dy / batch)                       # the mean over the batch
        clip_grad_norm(model.named_parameters(), clip)
        opt.step()
        model.zero_grad()
        losses.append(float(per_seq.mean()))
        progress.update(note=lambda: f"loss {losses[-1]:.4f}")
    progress.close()
    return losses


def decay_ratio(g, last: int = -1) -> float:
    """g_1 / g_T (``last=-1``; -2 for g_1 / g_{T-1}): 1 for a flat curve, tiny when the first
    input's gradient has vanished."""
    return float(g[0] / g[last]) if g[last] > 0 else float("nan")


def measure(seq_len: int = 100, steps: int = 300, batch: int = 32, lr: float = 1e-3, seed: int = 0,
            eval_batch: int = 64, input_size: int = 8, models=MODELS, log=print) -> dict:
    """Train each model and measure its gradient curve before and after; returns everything plotted."""
    x_eval, t_eval = make_batch(numpy.random.default_rng(seed + 1), eval_batch, seq_len, input_size)
    results = {}
    for kind in models:
        model = build(kind, input_size, seq_len, seed)
        start = time.perf_counter()
        init_norms = gradient_norms(model, x_eval, t_eval)
        init_loss = float(loss_and_grad(model(x_eval), t_eval)[0].mean())
        model.clear_saved()
        losses = train(model, steps, batch, seq_len, input_size, lr, seed + 2, what=kind)
        trained_norms = gradient_norms(model, x_eval, t_eval)
        final_loss = float(loss_and_grad(model(x_eval), t_eval)[0].mean())
        model.clear_saved()
        results[kind] = {"parameters": model.num_parameters(), "init": init_norms, "trained": trained_norms,
                         "ratio_init": decay_ratio(init_norms), "ratio_trained": decay_ratio(trained_norms),
                         "ratio_init_prev": decay_ratio(init_norms, -2) if seq_len > 1 else 1.0,
                         "ratio_trained_prev": decay_ratio(trained_norms, -2) if seq_len > 1 else 1.0,
                         "eval_loss_init": init_loss, "eval_loss_trained": final_loss, "train_loss": losses,
                         "seconds": time.perf_counter() - start}
        log(f"  {kind:11} {model.num_parameters():6,} parameters: g_1/g_T {results[kind]['ratio_init']:.2e} "
            f"at init, {results[kind]['ratio_trained']:.2e} after {steps} steps; held-out loss "
            f"{init_loss:.3f} -> {final_loss:.3f} ({results[kind]['seconds']:.0f} s)")
    return results


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seq-len", type=int, default=100, dest="seq_len", help="sequence length T (default 100)")
    p.add_argument("--steps", type=int, default=300, help="training steps per model (default 300)")
    p.add_argument("--batch-size", type=int, default=32, dest="batch_size", help="training batch (default 32)")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default 1e-3)")
    p.add_argument("--eval-batch", type=int, default=64, dest="eval_batch",
                   help="held-out sequences the gradient norms are averaged over (default 64)")
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    for name in ("seq_len", "eval_batch", "batch_size"):
        positive_int(getattr(args, name), "--" + name.replace("_", "-"))
    non_negative_int(args.steps, "--steps")                 # 0: the initialisation alone
    real(args.lr, "--lr", 0, low_open=True)
    non_negative_int(args.seed, "--seed")
    print(f"gradient flow over T={args.seq_len} steps: task 'sum', target = sum_t x_t / sqrt(T), x_t in R^8; "
          f"{args.steps} Adam steps (lr {args.lr:g}, batch {args.batch_size}) per model, float64")
    res = measure(args.seq_len, args.steps, args.batch_size, args.lr, args.seed, args.eval_batch)
    out = out_dir(args.out)
    rows = [{"model": k, "stage": stage, "t": t + 1, "grad_norm": float(v)}
            for k, r in res.items() for stage in ("init", "trained") for t, v in enumerate(r[stage])]
    summary = {k: {f: r[f] for f in ("parameters", "ratio_init", "ratio_trained", "ratio_init_prev",
                                      "ratio_trained_prev", "eval_loss_init", "eval_loss_trained", "seconds")}
               for k, r in res.items()}
    files = [write_csv(out / "gradient_flow.csv", rows),
             write_json(out / "gradient_flow.json", {
                 "seq_len": args.seq_len, "steps": args.steps, "batch_size": args.batch_size, "lr": args.lr,
                 "seed": args.seed, "eval_batch": args.eval_batch, "task": "sum_t x_t / sqrt(T), x_t ~ N(0, I_8)",
                 "decay_ratio": "g_1 / g_T, g_t = mean over held-out sequences of ||dL_T/dx_t||; "
                                "ratio_*_prev: g_1 / g_{T-1}",
                 "summary": summary, "curves": {k: {"init": r["init"], "trained": r["trained"]}
                                                for k, r in res.items()},
                 "train_loss": {k: r["train_loss"] for k, r in res.items()}})]
    plt = pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, 3, figsize=(16, 5), layout="constrained")
        t = numpy.arange(1, args.seq_len + 1)
        for ax, stage, title in ((axes[0], "init", "at initialisation"),
                                 (axes[1], "trained", f"after {args.steps} training steps")):
            for k, r in res.items():
                ax.semilogy(t, numpy.where(r[stage] > 0, r[stage], numpy.nan),
                            label=f"{NAMES[k]} (g_1/g_T = {r['ratio_' + stage]:.1e})")
            ax.set(title=f"||dL_T / dx_t|| {title}", xlabel="input step t", ylabel="gradient norm")
            legend_below(ax)
        for k, r in res.items():
            axes[2].plot(r["train_loss"], label=NAMES[k], lw=0.8)
        axes[2].axhline(1.0, color="grey", ls=":", lw=0.8, label="always predicting 0")
        axes[2].set(title="training loss", xlabel="step", ylabel="squared error", ylim=(0, 1.6))
        legend_below(axes[2], ncol=2)
        files.append(save_figure(fig, out / "gradient_flow.png"))
    print("\n  decay ratio g_1/g_T (g_t = mean ||dL_T/dx_t|| over held-out sequences; 1 = flat), and")
    print("  g_1/g_{T-1}, which leaves out x_T's own direct path to the output (the Transformer's residual)")
    print("  model        params   g_1/g_T: init   trained   g_1/g_{T-1}: init   trained   held-out loss")
    for k, s in summary.items():
        print(f"  {k:11} {s['parameters']:7,}  {s['ratio_init']:14.2e}  {s['ratio_trained']:8.2e}  "
              f"{s['ratio_init_prev']:18.2e}  {s['ratio_trained_prev']:8.2e}   "
              f"{s['eval_loss_init']:.3f} -> {s['eval_loss_trained']:.3f}")
    for f in files:
        print(f"  wrote {f}")
    return 0
