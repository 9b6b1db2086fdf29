"""``npformer study xl-memory``: does Transformer-XL's memory let a model use context beyond its
training segment (Dai et al. 2019)?

The same Transformer-XL is trained twice on the recall task (``data.long_range``: a random block of
``period`` = 1.5 T symbols repeated, so every token after the first block repeats the one
``period`` - 1 back, further than a segment of T tokens): once without memory (M = 0), once with a
memory of M positions carried from segment to segment. Without memory the copy is never in view and
the best validation loss is ln(n_symbols); with it the model can recall. Both trained models are
then evaluated with memories longer than training had (2M, 4M): relative positions let attention
learned at one distance work at positions that only a longer memory brings into view.
"""
from __future__ import annotations

import argparse
import math
import time

from npformer.checks import non_negative_int, positive_int, real
from npformer.errors import RangeError
from npformer.progress import Progress
from npformer.study.output import legend_below, out_dir, pyplot, save_figure, write_csv, write_json
from npformer.training.config import XLTrainConfig
from npformer.training.xl_trainer import XLTrainer, recall_period


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=1000, help="training steps per model (default 1000)")
    p.add_argument("--segment", type=int, default=16, help="training segment length T (default 16; "
                   "the task's period is T + T // 2)")
    p.add_argument("--mem-len", type=int, default=None, dest="mem_len",
                   help="memory of the model with memory (default: the segment length)")
    p.add_argument("--eval-mem", default=None, dest="eval_mem", metavar="M1,M2,...",
                   help="memory lengths to evaluate both models with (default 0, M, 2M, 4M)")
    p.add_argument("--d-model", type=int, default=64, dest="d_model")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--ff", type=int, default=128, help="feed-forward width (default 128)")
    p.add_argument("--batch-size", type=int, default=32, dest="batch_size")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--n-train", type=int, default=2000, dest="n_train", help="training sequences (default 2000)")
    p.add_argument("--n-valid", type=int, default=200, dest="n_valid", help="validation sequences (default 200)")
    p.add_argument("--eval-every", type=int, default=100, dest="eval_every")
    p.add_argument("--seed", type=int, default=0)


def _config(args, mem_len: int) -> XLTrainConfig:
    return XLTrainConfig(model="transformer-xl", task="recall", seed=args.seed, steps=args.steps,
                         batch_size=args.batch_size, lr=args.lr, warmup=min(50, args.steps // 10),
                         d_model=args.d_model, heads=args.heads, layers=args.layers, ff=args.ff,
                         dropout=0.0, n_train=args.n_train, n_valid=args.n_valid, eval_every=0,
                         block_size=args.segment, mem_len=mem_len)


def train(args, mem_len: int) -> tuple[XLTrainer, list[dict]]:
    """Train one model; the validation loss every ``eval_every`` steps (and at the end)."""
    trainer = XLTrainer(_config(args, mem_len), log=lambda _: None)
    curve, window, start = [], [], time.perf_counter()
    progress = Progress(args.steps, f"mem_len {mem_len}")
    while trainer.step < args.steps:
        window.append(trainer.train_step().loss)
        progress.update(note=lambda: f"loss {window[-1]:.4f}")
        if trainer.step % args.eval_every == 0 or trainer.step == args.steps:
            result = trainer.evaluate()
            curve.append({"mem_len": mem_len, "step": trainer.step, "train_loss": sum(window) / len(window),
                          "valid_loss": result["loss"], "recall_accuracy": result["recall_accuracy"],
                          "seconds": time.perf_counter() - start})
            window = []
    progress.close()
    return trainer, curve


def _check(args) -> list[int]:
    for name in ("steps", "segment", "d_model", "heads", "layers", "ff", "batch_size", "n_train", "n_valid",
                 "eval_every"):
        positive_int(getattr(args, name), "--" + name.replace("_", "-"))
    if args.mem_len is not None:               # the model without memory is trained anyway
        positive_int(args.mem_len, "--mem-len")
    real(args.lr, "--lr", 0, low_open=True)
    non_negative_int(args.seed, "--seed")
    m = args.mem_len or args.segment
    if args.eval_mem is None:
        return [0, m, 2 * m, 4 * m]
    try:
        lens = [int(s) for s in args.eval_mem.split(",") if s.strip()]
    except ValueError:
        raise RangeError(f"--eval-mem: expected comma-separated ints such as 0,16,32, got {args.eval_mem!r}") from None
    if not lens or min(lens) < 0:
        raise RangeError(f"--eval-mem: expected memory lengths >= 0, got {args.eval_mem!r}")
    return lens


def run(args: argparse.Namespace) -> int:
    eval_lens = _check(args)
    m = args.mem_len or args.segment
    start = time.perf_counter()
    runs = {mem: train(args, mem) for mem in (0, m)}
    evals = []
    for mem, (trainer, _) in runs.items():
        for e in eval_lens:
            r = trainer.evaluate(mem_len=e)
            evals.append({"trained_mem_len": mem, "eval_mem_len": e, "valid_loss": r["loss"],
                          "recall_accuracy": r["recall_accuracy"],
                          "reach_of_first_query": args.layers * e})
    task = runs[0][0].task
    final = {mem: curve[-1]["valid_loss"] for mem, (_, curve) in runs.items()}
    summary = {"segment": args.segment, "period": recall_period(args.segment), "mem_len": m,
               "n_symbols": task.n_symbols, "uniform_loss": math.log(task.n_symbols),
               "floor_loss": task.floor_loss(), "steps": args.steps, "seed": args.seed,
               "model": {"d_model": args.d_model, "heads": args.heads, "layers": args.layers, "ff": args.ff,
                         "parameters": runs[0][0].model.num_parameters()},
               "final_valid_loss": {"without_memory": final[0], "with_memory": final[m]},
               "memory_lowers_valid_loss": final[m] < final[0],
               "evaluation": evals, "seconds": time.perf_counter() - start}
    out = out_dir(args.out)
    files = [write_csv(out / "xl_memory_curves.csv", [row for _, curve in runs.values() for row in curve]),
             write_csv(out / "xl_memory_eval.csv", evals),
             write_json(out / "xl_memory.json", summary)]
    plt = pyplot()
    if plt is not None:
        fig, (a, b, c) = plt.subplots(1, 3, figsize=(17, 5), layout="constrained")
        for mem, (_, curve) in runs.items():
            a.plot([r["step"] for r in curve], [r["valid_loss"] for r in curve], marker="o", ms=3,
                   label=f"memory M={mem}" if mem else "no memory (M=0)")
        for y, text, ls in ((summary["uniform_loss"], "best without memory: ln(symbols)", "--"),
                            (summary["floor_loss"], "perfect recall", "-.")):
            for ax in (a, b):
                ax.axhline(y, color="gray", ls=ls, lw=0.8, label=text)
        a.set(title=f"recall, period {summary['period']} > segment {args.segment}", xlabel="training step",
              ylabel="validation loss (nats)")
        for mem in runs:
            rows = [r for r in evals if r["trained_mem_len"] == mem]
            b.plot([r["eval_mem_len"] for r in rows], [r["valid_loss"] for r in rows], marker="o",
                   label=f"trained with M={mem}")
            c.plot([r["eval_mem_len"] for r in rows], [100 * r["recall_accuracy"] for r in rows], marker="o",
                   label=f"trained with M={mem}")
        for ax in (b, c):
            ax.axvline(m, color="gray", ls=":", lw=0.8, label=f"training memory M={m}")
        b.set(title="evaluation with other memory lengths", xlabel="memory at evaluation",
              ylabel="validation loss (nats)")
        c.set(title="recall accuracy with other memory lengths", xlabel="memory at evaluation",
              ylabel="recall accuracy (% of recallable symbols)", ylim=(-3, 103))
        for ax in (a, b, c):
            legend_below(ax, ncol=2)
        files.append(save_figure(fig, out / "xl_memory.png"))
    print(f"Transformer-XL ({summary['model']['parameters']:,} parameters, {args.layers} layers) on recall: "
          f"period {summary['period']} > segment {args.segment}, {args.steps} steps per model")
    print(f"  validation loss without memory (M=0): {final[0]:.4f}   with memory (M={m}): {final[m]:.4f}")
    print(f"  (best possible without memory {summary['uniform_loss']:.4f}; perfect recall {summary['floor_loss']:.4f})")
    print("  evaluated with a memory of:   " + "  ".join(f"{e:>6d}" for e in eval_lens))
    for mem in runs:
        rows = [r for r in evals if r["trained_mem_len"] == mem]
        print(f"    trained with M={mem:<3d} loss  " + "  ".join(f"{r['valid_loss']:6.3f}" for r in rows)
              + "\n" + " " * 20 + "recall  " + "  ".join(f"{r['recall_accuracy']:6.1%}" for r in rows))
    verdict = "lowers" if summary["memory_lowers_valid_loss"] else "does NOT lower"
    print(f"  memory {verdict} the validation loss ({time.perf_counter() - start:.0f}s)")
    for f in files:
        print(f"  wrote {f}")
    return 0
