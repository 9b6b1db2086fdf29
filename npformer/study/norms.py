"""``npformer study norms``: why Transformers normalise with LayerNorm and not BatchNorm.

The same small encoder (:class:`~npformer.models.norm_encoder.NormEncoder`, post-norm, identical
initial weights and batches) is trained three times, with

* ``layer``: LayerNorm, statistics over the C features of one position;
* ``batch``: BatchNorm1d over every position of the padded batch, padding included (what
  ``torch.nn.BatchNorm1d`` does to a padded batch);
* ``batch_masked``: BatchNorm1d with the padding left out of the statistics,

on a task that needs attention over variable-length sequences: *histogram* (Weiss et al. 2021,
"Thinking like Transformers"): ``<bos> c1 .. cn`` -> at every ci, how many times ci occurs in the
sequence. Then, in float64, it measures what a normalisation's statistics do to one sequence's
outputs when nothing about that sequence changes:

1. **padding**: the same batch, padded with extra columns (the padding fraction grows);
2. **neighbours**: the same sequences batched with short neighbours, then with long ones;
3. **batch size**: batch statistics ("training-mode") at batch sizes 1 .. 64, and the running
   statistics ("eval mode") that BatchNorm keeps for inference.

LayerNorm's outputs are the same in every case (the differences are float64 rounding, ~1e-15);
BatchNorm's are not: its statistics belong to the batch, so padding, neighbours and batch size
change what it computes for a sequence, and at batch size 1 a sequence is normalised by its own
few positions. Running statistics repair inference, but they average training batches (padding
included, for ``batch``).

The matrices are small (32 sequences of <= 17 tokens, d_model 32): on a busy machine OpenBLAS's
threads wait for each other, and ``OPENBLAS_NUM_THREADS=1 npformer study norms`` can run several
times faster (measured on the 2-core development machine under load: 0.014 s against 0.2 s a step).
"""
from __future__ import annotations

import argparse
import time
from contextlib import contextmanager

import numpy

from npformer.backend import to_numpy
from npformer.checks import non_negative_int, positive_int, real
from npformer.data.vocab import BOS_ID, PAD_ID, CharVocab
from npformer.errors import RangeError, ShapeError
from npformer.models.decoding import eval_mode
from npformer.models.norm_encoder import NORMS, NormEncoder, NormEncoderConfig
from npformer.nn.module import no_grad
from npformer.nn.normalization_batch import BatchNorm1d
from npformer.ops.cross_entropy import cross_entropy_backward, cross_entropy_forward
from npformer.progress import Progress
from npformer.study.output import legend_below, out_dir, pyplot, save_figure, write_csv, write_json
from npformer.training.optim import AdamW, clip_grad_norm
from npformer.training.schedules import cosine_with_warmup

IGNORE = -100
BATCH_SIZES = (1, 2, 4, 8, 16, 64)


# -- the task ------------------------------------------------------------------------------------
class Histogram:
    """``<bos> c1 .. cn`` (n uniform in min_len..max_len over ``alphabet``) -> count of ci in the
    sequence at each ci (classes 0..max_len); <bos> and padding are not scored."""

    def __init__(self, alphabet: str = "abcdef", min_len: int = 2, max_len: int = 16):
        if not 1 <= min_len <= max_len:
            raise ValueError(f"lengths: expected 1 <= min_len <= max_len, got {min_len} and {max_len}")
        self.vocab = CharVocab(alphabet)
        self.alphabet, self.min_len, self.max_len = alphabet, min_len, max_len
        self.num_classes = max_len + 1

    def sample(self, rng: numpy.random.Generator, k: int, length: int | None = None) -> list[numpy.ndarray]:
        """``k`` sequences of symbol ids (without <bos>), of ``length`` or random lengths."""
        lengths = rng.integers(self.min_len, self.max_len + 1, size=k) if length is None else [length] * k
        first = len(self.vocab) - len(self.alphabet)
        return [rng.integers(first, len(self.vocab), size=int(n)) for n in lengths]

    @staticmethod
    def encode(seqs: list[numpy.ndarray], width: int | None = None) -> tuple[numpy.ndarray, numpy.ndarray]:
        """ids (B, T) with <bos> first and padding after, targets (B, T) with IGNORE where unscored;
        T = the longest sequence + 1, or ``width`` (extra padding columns)."""
        t = max(len(s) for s in seqs) + 1
        width = t if width is None else width
        if width < t:
            raise ValueError(f"width {width} is shorter than the longest sequence + <bos> ({t})")
        ids = numpy.full((len(seqs), width), PAD_ID, dtype=numpy.int64)               # (B, T)
        targets = numpy.full((len(seqs), width), IGNORE, dtype=numpy.int64)           # (B, T)
        for i, s in enumerate(seqs):
            ids[i, 0], ids[i, 1:len(s) + 1] = BOS_ID, s
            counts = numpy.bincount(s)
            targets[i, 1:len(s) + 1] = counts[s]
        return ids, targets


# -- training ------------------------------------------------------------------------------------
def train_model(norm: str, task: Histogram, args: argparse.Namespace, log=print) -> tuple[NormEncoder, list]:
    cfg = NormEncoderConfig(vocab_size=len(task.vocab), num_classes=task.num_classes, d_model=args.d_model,
                            nhead=args.heads, num_layers=args.layers, dim_feedforward=args.ff,
                            dropout=args.dropout, norm=norm, norm_first=False,
                            max_len=task.max_len + 1 + args.extra_pad)
    model = NormEncoder(cfg, dtype="float32", rng=args.seed)
    opt = AdamW(model.named_parameters(), lr=args.lr, weight_decay=0.01)
    warmup = max(1, args.steps // 10)
    losses = []
    progress = Progress(args.steps, norm, log=log)
    for step in range(1, args.steps + 1):
        rng = numpy.random.default_rng((args.seed, step))                 # the same batches for each norm
        ids, targets = task.encode(task.sample(rng, args.batch_size))
        model.manual_seed((args.seed, step))
        model.train()
        loss, cache = cross_entropy_forward(model(ids), targets, ignore_index=IGNORE)
        model.backward(cross_entropy_backward(numpy.ones((), dtype=numpy.float32), cache))
        clip_grad_norm(model.parameters(), 1.0)
        opt.lr = cosine_with_warmup(step, args.lr, warmup, args.steps, min_lr=args.lr / 20)
        opt.step()
        model.zero_grad()
        losses.append(float(loss))
        progress.update(note=lambda: f"loss {numpy.mean(losses[-50:]):.4f}")
    progress.close()
    return model, losses


# -- measuring -----------------------------------------------------------------------------------
@contextmanager
def batch_statistics(model: NormEncoder):
    """Forward passes that normalise with the batch's statistics (BatchNorm in training mode, every
    other module in eval mode: no dropout) and leave the running statistics as they were."""
    saved = {k: v.copy() for k, v in model.state_dict().items()}
    was = model.training
    model.eval()
    for m in model.modules():
        if isinstance(m, BatchNorm1d):
            m.train()
    try:
        with no_grad():
            yield model
    finally:
        model.load_state_dict(saved, allow_nonfinite=True)     # its own weights back, as they were
        model.train(was)


# Eval mode without saved caches: BatchNorm normalises with its running statistics (what inference
# should use), dropout is off.
running_statistics = eval_mode


def _forward_rows(model, seqs, batch_size, width=None) -> list[numpy.ndarray]:
    """Per sequence, its logits (n, K) at its n symbols, from batches of ``batch_size`` (in order)."""
    out = []
    for i in range(0, len(seqs), batch_size):
        chunk = seqs[i:i + batch_size]
        ids, _ = Histogram.encode(chunk, width)
        logits = to_numpy(model(ids))                                                 # (B, T, K)
        out += [logits[j, 1:len(s) + 1] for j, s in enumerate(chunk)]
    return out


def _score(rows, seqs) -> float:
    right = total = 0
    for r, s in zip(rows, seqs):
        counts = numpy.bincount(s)[s]
        right += int((r.argmax(-1) == counts).sum())
        total += len(s)
    return right / total


def _diff(a_rows, b_rows) -> tuple[float, float]:
    """Largest |logit difference| and the fraction of predictions that changed."""
    big = max(float(numpy.abs(a - b).max()) for a, b in zip(a_rows, b_rows))
    flips = sum(int((a.argmax(-1) != b.argmax(-1)).sum()) for a, b in zip(a_rows, b_rows))
    return big, flips / sum(len(a) for a in a_rows)


def measure(model: NormEncoder, task: Histogram, valid: list, args: argparse.Namespace) -> dict:
    """Every measurement for one trained model (cast to float64 so that rounding is ~1e-15)."""
    model.to(dtype="float64")
    bs = args.eval_batch
    res: dict = {}
    with running_statistics(model):
        ref = _forward_rows(model, valid, bs)
        single = _forward_rows(model, valid, 1)
        res["eval_acc"] = _score(ref, valid)
        res["eval_b1_acc"] = _score(single, valid)
        res["eval_b1_change"] = _diff(ref, single)
    with batch_statistics(model):
        batch_rows = _forward_rows(model, valid, bs)
        res["batch_acc"] = _score(batch_rows, valid)
        res["batch_vs_eval_change"] = _diff(ref, batch_rows)
        # 3. batch size, with batch statistics
        res["by_batch_size"] = {}
        for b in BATCH_SIZES:
            rows = batch_rows if b == bs else _forward_rows(model, valid, b)
            res["by_batch_size"][b] = {"accuracy": _score(rows, valid), "change": _diff(ref, rows)}
        # 1. padding: the same batches with 0 .. extra_pad extra columns
        res["by_padding"] = []
        for extra in sorted({0, *range(0, args.extra_pad + 1, max(1, args.extra_pad // 4))}):
            width = task.max_len + 1 + extra
            rows = _forward_rows(model, valid, bs, width)
            pad_frac = 1 - sum(len(s) + 1 for s in valid) / (len(valid) * width)
            res["by_padding"].append({"extra_columns": extra, "padding_fraction": pad_frac,
                                      "accuracy": _score(rows, valid), "change": _diff(batch_rows, rows)})
        # 2. neighbours: probes of a middle length beside short, then long neighbours
        rng = numpy.random.default_rng((args.seed, 10**6))
        mid = (task.min_len + task.max_len) // 2
        probes = task.sample(rng, args.probes, length=mid)
        n_nb = max(bs - args.probes, 1)
        short = task.sample(rng, n_nb, length=task.min_len)
        long_ = task.sample(rng, n_nb, length=task.max_len)
        with_short = _forward_rows(model, probes + short, len(probes) + n_nb)[:len(probes)]
        with_long = _forward_rows(model, probes + long_, len(probes) + n_nb)[:len(probes)]
        res["neighbours"] = {"probe_length": mid, "probes": len(probes), "neighbours": n_nb,
                             "acc_short": _score(with_short, probes), "acc_long": _score(with_long, probes),
                             "change": _diff(with_short, with_long)}
    with running_statistics(model):
        res["neighbours"]["acc_eval"] = _score(_forward_rows(model, probes, 1), probes)
    return res


# -- the command ---------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=1000, help="training steps per model (default 1000)")
    p.add_argument("--batch-size", type=int, default=32, dest="batch_size", help="training batch (default 32)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--d-model", type=int, default=32, dest="d_model")
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--ff", type=int, default=64, help="feed-forward width (default 64)")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--max-len", type=int, default=16, dest="max_len", help="longest sequence (default 16)")
    p.add_argument("--min-len", type=int, default=2, dest="min_len", help="shortest sequence (default 2)")
    p.add_argument("--n-valid", type=int, default=512, dest="n_valid", help="validation sequences (default 512)")
    p.add_argument("--eval-batch", type=int, default=64, dest="eval_batch", help="evaluation batch (default 64)")
    p.add_argument("--extra-pad", type=int, default=32, dest="extra_pad",
                   help="most extra padding columns in the padding sweep (default 32)")
    p.add_argument("--probes", type=int, default=16, help="probe sequences beside the neighbours (default 16)")
    p.add_argument("--norms", default=",".join(NORMS), help=f"comma-separated subset of {','.join(NORMS)}")
    p.add_argument("--seed", type=int, default=0)


def _check(args) -> list[str]:
    norms = [n.strip() for n in args.norms.split(",") if n.strip()]
    bad = [n for n in norms if n not in NORMS]
    if bad or not norms:
        raise RangeError(f"--norms: expected a comma-separated subset of {sorted(NORMS)}, got {args.norms!r}")
    for name in ("steps", "batch_size", "d_model", "heads", "layers", "ff", "n_valid", "eval_batch", "probes",
                 "min_len", "max_len"):
        positive_int(getattr(args, name), "--" + name.replace("_", "-"))
    if args.batch_size < 2:
        raise RangeError(f"--batch-size: expected an int >= 2 (BatchNorm needs more than one sequence to train), "
                         f"got {args.batch_size}")
    if args.min_len > args.max_len:
        raise RangeError(f"--min-len {args.min_len} exceeds --max-len {args.max_len}")
    non_negative_int(args.extra_pad, "--extra-pad")
    if args.probes >= args.eval_batch:
        raise RangeError(f"--probes ({args.probes}) must be smaller than --eval-batch ({args.eval_batch})")
    if args.d_model % args.heads:
        raise ShapeError(f"--d-model {args.d_model} is not divisible by --heads {args.heads}")
    real(args.lr, "--lr", 0, low_open=True)
    real(args.dropout, "--dropout", 0, 1, high_open=True, what="a dropout rate")
    non_negative_int(args.seed, "--seed")
    return norms


def run(args: argparse.Namespace) -> int:
    norms = _check(args)
    task = Histogram(min_len=args.min_len, max_len=args.max_len)
    valid = task.sample(numpy.random.default_rng((args.seed, 0)), args.n_valid)
    start = time.perf_counter()
    print(f"norms: {len(norms)} encoders ({args.layers} post-norm layers, d_model={args.d_model}) on histogram, "
          f"lengths {task.min_len}..{task.max_len}, {args.steps} steps of {args.batch_size} sequences each")
    results, curves = {}, {}
    for norm in norms:
        model, losses = train_model(norm, task, args)
        curves[norm] = losses
        results[norm] = measure(model, task, valid, args)
    elapsed = time.perf_counter() - start
    rows = _rows(results)
    out = out_dir(args.out)
    files = [write_csv(out / "norms.csv", rows),
             write_json(out / "norms.json", {"config": {k: v for k, v in vars(args).items()
                                                         if k != "func"},
                                             "task": {"name": "histogram", "alphabet": task.alphabet,
                                                      "min_len": task.min_len, "max_len": task.max_len},
                                             "results": results, "train_loss": curves, "seconds": elapsed})]
    plt = pyplot()
    if plt is not None:
        files.append(_plot(plt, results, out / "norms.png", args))
    _print_summary(results, args)
    print(f"  ({elapsed:.0f}s)")
    for f in files:
        print(f"  wrote {f}")
    return 0


def _rows(results: dict) -> list[dict]:
    rows = []

    def add(norm, experiment, setting, acc, change):
        rows.append({"norm": norm, "experiment": experiment, "setting": setting, "accuracy": acc,
                     "max_abs_logit_change": change[0] if change else "",
                     "predictions_changed": change[1] if change else ""})
    for norm, r in results.items():
        add(norm, "eval", "running statistics, batch of eval_batch", r["eval_acc"], None)
        add(norm, "eval", "running statistics, batch size 1", r["eval_b1_acc"], r["eval_b1_change"])
        for b, v in r["by_batch_size"].items():
            add(norm, "batch_size", f"batch statistics, batch size {b}", v["accuracy"], v["change"])
        for v in r["by_padding"]:
            add(norm, "padding", f"batch statistics, padding fraction {v['padding_fraction']:.2f}",
                v["accuracy"], v["change"])
        nb = r["neighbours"]
        add(norm, "neighbours", "batch statistics, short neighbours", nb["acc_short"], None)
        add(norm, "neighbours", "batch statistics, long neighbours", nb["acc_long"], nb["change"])
    return rows


def _print_summary(results: dict, args) -> None:
    print(f"\naccuracy on {args.n_valid} held-out sequences (per symbol), and the largest change of one "
          "sequence's logits when nothing about it changes:")
    head = ("norm", "eval", "batch stats", "batch stats B=1", "Δ B=1", "Δ +padding", "Δ neighbours")
    lines = []
    for norm, r in results.items():
        pad = r["by_padding"][-1]
        lines.append((norm, f"{r['eval_acc']:.1%}", f"{r['batch_acc']:.1%}",
                      f"{r['by_batch_size'][1]['accuracy']:.1%}", f"{r['by_batch_size'][1]['change'][0]:.1e}",
                      f"{pad['change'][0]:.1e}", f"{r['neighbours']['change'][0]:.1e}"))
    widths = [max(len(x[i]) for x in [head, *lines]) for i in range(len(head))]
    for line in [head, tuple("-" * w for w in widths), *lines]:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip())
    print(f"  eval: running statistics, batches of {args.eval_batch} (the same at batch size 1); batch stats: "
          f"the statistics of batches of {args.eval_batch} (B=1: of the sequence alone);")
    print(f"  Δ: max |logit change| vs eval (B=1), vs the same batch with {args.extra_pad} more padding "
          f"columns (+padding), and for {args.probes} sequences beside short vs long neighbours;")
    print("  measured in float64, so a change below ~1e-12 is rounding: the outputs are the same.")
    for norm, r in results.items():
        nb, pad = r["neighbours"], r["by_padding"]
        print(f"  {norm:13} padding fraction {pad[0]['padding_fraction']:.2f} -> {pad[-1]['padding_fraction']:.2f}: "
              f"accuracy {pad[0]['accuracy']:.1%} -> {pad[-1]['accuracy']:.1%}; neighbours short/long: "
              f"{nb['acc_short']:.1%} / {nb['acc_long']:.1%} (eval {nb['acc_eval']:.1%}), "
              f"{nb['change'][1]:.1%} of predictions changed")


# each norm as the plots name it (--norms takes the short names)
NAMES = {"layer": "LayerNorm", "batch": "BatchNorm", "batch_masked": "masked BatchNorm"}


def _plot(plt, results: dict, path, args):
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 5), layout="constrained")
    colors = {"layer": "tab:blue", "batch": "tab:red", "batch_masked": "tab:orange"}
    for norm, r in results.items():
        col = colors.get(norm)
        pad = r["by_padding"]
        a.plot([v["padding_fraction"] for v in pad], [v["accuracy"] for v in pad], "o-", color=col,
               label=NAMES[norm])
        a.axhline(r["eval_acc"], color=col, ls=":", lw=1)
        sizes = list(r["by_batch_size"])
        b.plot(sizes, [r["by_batch_size"][s]["accuracy"] for s in sizes], "o-", color=col, label=NAMES[norm])
        b.axhline(r["eval_acc"], color=col, ls=":", lw=1)
    for ax in (a, b):
        ax.plot([], [], color="gray", ls=":", lw=1, label="running statistics (eval)")
    a.set(title="batch statistics: the same batches, more padding", xlabel="padding fraction of the batch",
          ylabel="accuracy")
    b.set(title="batch statistics vs batch size", xlabel="batch size", xscale="log", ylabel="accuracy")
    b.set_xticks(list(BATCH_SIZES), [str(s) for s in BATCH_SIZES])
    names = list(results)
    x = numpy.arange(len(names))
    for k, (key, label) in enumerate((("by_batch_size", "batch size 1 vs running statistics"),
                                      ("by_padding", f"+{args.extra_pad} padding columns"),
                                      ("neighbours", "short vs long neighbours"))):
        vals = []
        for n in names:
            r = results[n][key]
            ch = r[1]["change"] if key == "by_batch_size" else r[-1]["change"] if key == "by_padding" else r["change"]
            vals.append(max(ch[0], 1e-17))
        c.bar(x + (k - 1) * 0.22, vals, 0.22, label=label)
    c.axhspan(1e-17, 1e-12, color="0.9", zorder=0, label="float64 rounding: no change")
    c.set(title="largest logit change of an unchanged sequence", ylabel="max |logit change| (log)", yscale="log")
    c.set_xticks(x, [NAMES[n] for n in names])
    legend_below(a, ncol=2)
    legend_below(b, ncol=2)
    c.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2, fontsize=8, frameon=False)  # no x label
    fig.suptitle("LayerNorm vs BatchNorm in a Transformer encoder (histogram task; masked BatchNorm leaves "
                 "the padding out of its statistics)")
    return save_figure(fig, path)
