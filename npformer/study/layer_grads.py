"""``npformer study layers``: per-layer gradient norms during training, post-norm vs pre-norm, with
and without residual connections (why deep Transformers need both).

Four stacks of ``ConfigurableEncoderLayer`` (:mod:`npformer.nn.experimental`), identical except for
where the layer norm sits and whether the residual connections are there:

    post + residual:  x = norm(x + f(x))      pre + residual:  x = x + f(norm(x))   (+ final norm)
    post, none:       x = norm(f(x))          pre, none:       x = f(norm(x))       (+ final norm)

Each is a causal character-level language model on the corpus shipped with npformer
(``npformer.data.CharLMData``): embedding + sinusoidal positions, L layers, a linear read-out, the
same initial weights and the same batches for all four, trained with Adam for a fixed number of
steps. At every step we record, per layer l, the norm of the gradient of the loss with respect to

* the layer's parameters, ||dL/dtheta_l|| (all of the layer's weights and biases together), and
* the layer's input, ||dL/dx_{l-1}|| (the activation gradient the layer below receives),

and the training loss. Without residuals the only way back to layer 1 is through every layer's
Jacobian, so the gradient reaching the first layers is scaled by a product of L factors; with a
residual each layer adds to an identity path. Post-norm with residuals still divides the gradient
by the norms' scale on the way down; pre-norm keeps a clean identity path from the loss to layer 1.
"""
from __future__ import annotations

import argparse
import math
import time

import numpy

from npformer.backend import get_array_module
from npformer.checks import non_negative_int, positive_int, real
from npformer.data import CharLMData, load_corpus
from npformer.errors import ShapeError
from npformer.nn import Embedding, LayerNorm, Linear, Module, ModuleList, PositionalEncoding, no_grad
from npformer.nn.experimental import ConfigurableEncoderLayer
from npformer.ops.cross_entropy import cross_entropy_backward, cross_entropy_forward
from npformer.progress import Progress
from npformer.study.output import out_dir, pyplot, save_figure, write_csv, write_json
from npformer.training.optim import Adam

# name -> (norm_first, residual)
CONFIGS = {"post-norm + residual": (False, True), "pre-norm + residual": (True, True),
           "post-norm, no residual": (False, False), "pre-norm, no residual": (True, False)}


class LayerStackLM(Module):
    """Embedding, sinusoidal positions, ``num_layers`` causal ``ConfigurableEncoderLayer``s, a final
    LayerNorm for pre-norm stacks (as GPT-2; a post-norm stack already ends in one), a linear head."""

    def __init__(self, vocab_size: int, d_model: int, nhead: int, num_layers: int, dim_feedforward: int,
                 max_len: int, *, norm_first: bool, residual: bool, dtype=None, rng=None):
        super().__init__()
        kw = dict(dtype=dtype, rng=rng)
        self.embed = Embedding(vocab_size, d_model, **kw)
        self.pos = PositionalEncoding(d_model, max_len)
        self.layers = ModuleList(ConfigurableEncoderLayer(d_model, nhead, dim_feedforward, dropout=0.0,
                                                          norm_first=norm_first, residual=residual, **kw)
                                 for _ in range(num_layers))
        self.norm = LayerNorm(d_model, dtype=dtype) if norm_first else None
        self.head = Linear(d_model, vocab_size, **kw)

    def embed_positions(self, ids):
        return self.pos(self.embed(ids))                 # (B, T, C)

    def forward_embedded(self, x):
        for layer in self.layers:
            x = layer(x, is_causal=True)                 # (B, T, C)
        if self.norm is not None:
            x = self.norm(x)
        return self.head(x)                              # (B, T, V)

    def forward(self, ids):
        return self.forward_embedded(self.embed_positions(ids))

    def backward_embedded(self, dlogits):
        """Back to the embedded input; returns (dx0, [||dL/dx_{l-1}|| for l = 1..L])."""
        d = self.head.backward(dlogits)                  # (B, T, C)
        if self.norm is not None:
            d = self.norm.backward(d)
        norms = []
        for layer in reversed(list(self.layers)):
            d = layer.backward(d)                        # (B, T, C) gradient at this layer's input
            norms.append(float(math.sqrt(float((d * d).sum()))))
        return d, norms[::-1]

    def backward(self, dlogits):
        """Parameter gradients accumulate; returns the input-gradient norm of each layer (list)."""
        d, norms = self.backward_embedded(dlogits)
        self.embed.backward(self.pos.backward(d))
        return norms


def layer_param_grad_norms(model: LayerStackLM) -> list[float]:
    """||dL/dtheta_l|| per layer: the 2-norm over all of the layer's parameter gradients."""
    out = []
    for layer in model.layers:
        sq = 0.0
        for g in layer.grads().values():
            g64 = g.astype(get_array_module(g).float64)
            sq += float((g64 * g64).sum())
        out.append(math.sqrt(sq))
    return out


def gradient_step(model: LayerStackLM, ids, targets):
    """Forward, loss, backward (no update): (loss, parameter-gradient norms, input-gradient norms)."""
    model.zero_grad()
    logits = model(ids)                                  # (B, T, V)
    loss, cache = cross_entropy_forward(logits, targets)
    act = model.backward(cross_entropy_backward(get_array_module(loss).ones_like(loss), cache))
    return float(loss), layer_param_grad_norms(model), act


def train_config(name: str, data: CharLMData, *, layers: int, d_model: int, nhead: int, ff: int,
                 steps: int, batch: int, lr: float, seed: int, valid_batches: int, dtype="float32") -> dict:
    """Train one configuration from the shared seed; every step's loss and per-layer norms."""
    norm_first, residual = CONFIGS[name]
    model = LayerStackLM(data.vocab_size, d_model, nhead, layers, ff, data.block_size,
                         norm_first=norm_first, residual=residual, dtype=dtype, rng=seed)
    opt = Adam(model.named_parameters(), lr=lr)
    rng = numpy.random.default_rng(seed + 1)             # the same batches for every configuration
    losses, pnorms, anorms, start = [], [], [], time.perf_counter()
    progress = Progress(steps, name)
    for _ in range(steps):
        ids, targets = data.random_batch("train", batch, rng)
        loss, p, a = gradient_step(model, ids, targets)
        if not math.isfinite(loss):
            break
        losses.append(loss), pnorms.append(p), anorms.append(a)
        opt.step()
        progress.update(note=lambda: f"loss {losses[-1]:.3f}")
    progress.close()
    model.zero_grad()
    vl = []
    with no_grad():
        for k, (ids, targets) in enumerate(data.batches("valid", batch)):
            if k == valid_batches:
                break
            vl.append(float(cross_entropy_forward(model(ids), targets)[0]))
    return {"norm_first": norm_first, "residual": residual, "parameters": model.num_parameters(),
            "loss": losses, "param_grad_norms": pnorms, "input_grad_norms": anorms,
            "valid_loss": float(numpy.mean(vl)), "diverged": len(losses) < steps,
            "seconds": time.perf_counter() - start}


def summarise(r: dict) -> dict:
    """First/last layer parameter-gradient norms at step 1 and over the last quarter of the steps."""
    p = numpy.asarray(r["param_grad_norms"])             # (steps, L)
    late = p[-max(1, len(p) // 4):].mean(axis=0)         # (L,)
    tail = r["loss"][-max(1, len(r["loss"]) // 10):]
    return {"first_layer_init": float(p[0, 0]), "last_layer_init": float(p[0, -1]),
            "first_layer_late": float(late[0]), "last_layer_late": float(late[-1]),
            "ratio_init": float(p[0, 0] / p[0, -1]), "ratio_late": float(late[0] / late[-1]),
            "final_train_loss": float(numpy.mean(tail)), "valid_loss": r["valid_loss"],
            "diverged": r["diverged"], "parameters": r["parameters"], "seconds": r["seconds"]}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=8, help="layers per model (default 8)")
    p.add_argument("--d-model", type=int, default=64, dest="d_model", help="model width (default 64)")
    p.add_argument("--heads", type=int, default=4, dest="nhead", help="attention heads (default 4)")
    p.add_argument("--ff", type=int, default=128, help="feed-forward width (default 128)")
    p.add_argument("--block-size", type=int, default=32, dest="block_size", help="context length (default 32)")
    p.add_argument("--steps", type=int, default=300, help="training steps per configuration (default 300)")
    p.add_argument("--batch-size", type=int, default=16, dest="batch_size", help="batch size (default 16)")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate, constant (default 1e-3)")
    p.add_argument("--valid-batches", type=int, default=8, dest="valid_batches",
                   help="validation batches for the final loss (default 8)")
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    for name in ("layers", "d_model", "nhead", "ff", "block_size", "steps", "batch_size", "valid_batches"):
        positive_int(getattr(args, name), "--heads" if name == "nhead" else "--" + name.replace("_", "-"))
    if args.d_model % args.nhead:
        raise ShapeError(f"--d-model {args.d_model} is not divisible by --heads {args.nhead}")
    real(args.lr, "--lr", 0, low_open=True)
    non_negative_int(args.seed, "--seed")
    data = CharLMData(load_corpus(), block_size=args.block_size, seed=args.seed)
    print(f"layers: {args.layers}-layer causal character LMs (d_model {args.d_model}, {args.nhead} heads, "
          f"ff {args.ff}, block {args.block_size}) on the shipped corpus, {args.steps} Adam steps "
          f"(lr {args.lr:g}, batch {args.batch_size}) per configuration, float32")
    res = {}
    for name in CONFIGS:
        res[name] = train_config(name, data, layers=args.layers, d_model=args.d_model, nhead=args.nhead,
                                 ff=args.ff, steps=args.steps, batch=args.batch_size, lr=args.lr,
                                 seed=args.seed, valid_batches=args.valid_batches)
        r = res[name]
        print(f"  {name:23} loss {r['loss'][0]:.3f} -> {r['loss'][-1]:.3f}"
              + (" (diverged)" if r["diverged"] else "") + f"  ({r['seconds']:.0f} s)")
    summary = {k: summarise(r) for k, r in res.items()}
    out = out_dir(args.out)
    grad_rows = [{"config": k, "step": s + 1, "layer": l + 1, "param_grad_norm": r["param_grad_norms"][s][l],
                  "input_grad_norm": r["input_grad_norms"][s][l]}
                 for k, r in res.items() for s in range(len(r["loss"])) for l in range(args.layers)]
    loss_rows = [{"config": k, "step": s + 1, "loss": v} for k, r in res.items() for s, v in enumerate(r["loss"])]
    files = [write_csv(out / "layers_grad_norms.csv", grad_rows), write_csv(out / "layers_loss.csv", loss_rows),
             write_json(out / "layers.json", {"settings": {k: getattr(args, k) for k in (
                 "layers", "d_model", "nhead", "ff", "block_size", "steps", "batch_size", "lr", "valid_batches",
                 "seed")}, "summary": summary,
                 "param_grad_norms": {k: r["param_grad_norms"] for k, r in res.items()},
                 "input_grad_norms": {k: r["input_grad_norms"] for k, r in res.items()},
                 "loss": {k: r["loss"] for k, r in res.items()}})]
    plt = pyplot()
    if plt is not None:
        files.append(_plot(plt, res, args, out / "layers.png"))
    print("\n  configuration            |g| layer 1 / layer L     |g| layer 1 / layer L        train    valid")
    print("                           at step 1                 mean of the last 25% steps   loss     loss")
    for k, s in summary.items():
        print(f"  {k:23}  {s['first_layer_init']:.2e} / {s['last_layer_init']:.2e}   "
              f"{s['first_layer_late']:.2e} / {s['last_layer_late']:.2e}        "
              f"{s['final_train_loss']:.3f}    {s['valid_loss']:.3f}" + ("  diverged" if s["diverged"] else ""))
    for f in files:
        print(f"  wrote {f}")
    return 0


def _plot(plt, res, args, path):
    fig, axes = plt.subplots(2, 2, figsize=(13, 9.5), layout="constrained")
    (a, b), (c, d) = axes
    layer_ids = numpy.arange(1, args.layers + 1)
    for n, (k, r) in enumerate(res.items()):
        color = f"C{n}"
        p = numpy.asarray(r["param_grad_norms"])         # (steps, L)
        steps = numpy.arange(1, len(p) + 1)
        a.semilogy(layer_ids, p[0], marker="o", color=color, label=k)
        b.semilogy(layer_ids, p[-max(1, len(p) // 4):].mean(axis=0), marker="o", color=color, label=k)
        c.semilogy(steps, p[:, 0], color=color, lw=0.8)
        c.semilogy(steps, p[:, -1], color=color, lw=0.8, ls=":")
        d.plot(steps, r["loss"], color=color, lw=0.8)
    a.set(title="||dL/dθ_layer|| at step 1", xlabel="layer", ylabel="gradient norm")
    b.set(title="||dL/dθ_layer||, mean of the last 25% of steps", xlabel="layer", ylabel="gradient norm")
    c.set(title=f"layer 1 (solid) and layer {args.layers} (dotted) during training", xlabel="step",
          ylabel="gradient norm")
    d.set(title="training loss", xlabel="step", ylabel="cross-entropy (nats)")
    # one legend for the four panels (the colours are the configurations), under them
    fig.legend(*a.get_legend_handles_labels(), loc="outside lower center", ncol=len(res), frameon=False)
    return save_figure(fig, path)
