"""Data-parallel training steps over MPI: step time, the all-reduce's share, bytes communicated.

    python benchmarks/distributed.py [--models gpt-small,seq2seq-base] [--steps 12] [--warmup 3]
                                     [--batch 8] [--seq 128] [--no-numba] [--out benchmarks/results]

For each benchmark model (``npformer.bench.steps.MODELS``, float32, the suite's dropout for it: 0.1, gpt-tiny's
0 as nanoGPT's CPU recipe) and a global batch of
``--batch`` sequences of ``--seq`` tokens, it times one data-parallel AdamW step in three set-ups:

    1 rank, 1 BLAS thread     the baseline a rank of the 2-rank run is made of
    1 rank, 2 BLAS threads    what one process gets from this machine's 2 cores
    2 ranks, 1 thread each    mpirun -n 2: each rank takes half the batch

Each step is split, on every rank, into: compute (forward, cross-entropy, backward of the rank's rows),
wait (a barrier: the time the faster rank waits for the slower one), all-reduce (the 5 numbers of the
step and the gradient buckets, :meth:`npformer.distributed.DataParallel.reduce_gradients`, timed after
the barrier so that it is communication alone) and the optimiser (clip, AdamW, zero the grads).
Medians over ``--steps`` steps after ``--warmup``, with the quartiles of the step time; rank 0's clock.
Every process keeps freed memory for reuse as ``npformer train`` does (``retain_freed_memory``) and
runs the CPU fast paths (``--no-numba``: the NumPy ones alone, as ``pip install npformer`` gives).

Bytes communicated per step: the gradient buffer (every parameter once, float32) plus 40 bytes of
numbers. An all-reduce over a ring sends and receives ``2 (n - 1) / n`` times that per rank.

The driver (no ``--worker``) starts the set-ups with ``mpirun`` from this Python's environment
(``pip install -e ".[mpi]"``), prints a markdown table and writes JSON and markdown under ``--out``.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy

ROOT = Path(__file__).resolve().parents[1]
SETUPS = [(1, 1), (1, 2), (2, 1)]          # (ranks, BLAS threads a rank)
STATS_BYTES = 5 * 8                        # the step's numbers: 5 float64


def _model(m, T: int):
    from npformer.models.gpt import GPT, GPTConfig
    from npformer.models.seq2seq import Seq2Seq, Seq2SeqConfig
    if m.kind == "gpt":
        return GPT(GPTConfig(m.V, T, m.L, m.H, m.d, m.F, m.dropout, "gelu", norm_first=True),
                   dtype=numpy.float32, rng=0)
    return Seq2Seq(Seq2SeqConfig(m.V, m.V, m.d, m.H, m.L, m.L, m.F, m.dropout, "relu",
                                 norm_first=False, max_len=T), dtype=numpy.float32, rng=0)


def worker(args) -> None:
    """One set-up, under mpirun: every model's steps; rank 0 writes the rows as JSON to ``args.worker``."""
    from npformer import kernels
    from npformer.backend.host_memory import retain_freed_memory
    from npformer.bench.steps import MODELS
    from npformer.distributed import MPICommunicator

    comm = MPICommunicator()
    retain_freed_memory()
    with kernels.disabled("numba") if args.no_numba else contextlib.nullcontext():
        rows = [_steps(MODELS[name], name, comm, args) for name in args.models.split(",")]
    if comm.rank == 0:
        Path(args.worker).write_text(json.dumps(rows))


def _steps(m, name: str, comm, args) -> dict:
    """One model's timed steps, run on every rank; the row holds this rank's clock."""
    from npformer.backend import default_rng
    from npformer.distributed import DataParallel
    from npformer.ops.cross_entropy import cross_entropy_backward, cross_entropy_forward
    from npformer.training.optim import AdamW, clip_grad_norm

    model = _model(m, args.seq)
    dp = DataParallel(model, comm)
    opt = AdamW(model.parameters(), lr=3e-4)
    parts: dict[str, list[float]] = {k: [] for k in ("step", "compute", "wait", "all_reduce", "optimizer")}
    for step in range(1, args.warmup + args.steps + 1):
        ids = default_rng((0, step), "numpy").integers(1, m.V, (args.batch, args.seq))   # the global batch
        (src,) = dp.shard(ids)
        tgt = src[:, ::-1].copy()
        comm.barrier()
        t0 = time.perf_counter()
        model.manual_seed(dp.dropout_seed(0, step))
        logits = model(src) if m.kind == "gpt" else model(src, tgt)                # (b, T, V)
        loss, cache = cross_entropy_forward(logits, tgt)
        model.backward(cross_entropy_backward(numpy.ones((), numpy.float32), cache))
        t1 = time.perf_counter()
        comm.barrier()
        t2 = time.perf_counter()
        dp.reduce_gradients(float(loss), tgt.size, tgt.size)
        t3 = time.perf_counter()
        clip_grad_norm(model.parameters(), 1.0)
        opt.step()
        model.zero_grad()
        t4 = time.perf_counter()
        if step > args.warmup:
            for k, v in zip(parts, (t4 - t0, t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                parts[k].append(v)
    grad_bytes = dp.gradient_bytes()
    n = comm.size
    q1, q3 = numpy.percentile(numpy.asarray(parts["step"]) * 1e3, [25, 75])
    numba = not args.no_numba and importlib.util.find_spec("numba") is not None     # its fast paths ran
    return {"model": name, "ranks": n, "threads": args.threads, "numba": numba, "batch": args.batch,
            "seq": args.seq, "rows_per_rank": args.batch // n, "parameters": sum(p.size for p in dp.params),
            "bytes_all_reduced": grad_bytes + STATS_BYTES,
            "ring_bytes_per_rank": round(2 * (n - 1) / n * (grad_bytes + STATS_BYTES)),
            **{f"{k}_ms": float(numpy.median(v) * 1e3) for k, v in parts.items()},
            "step_q1_ms": float(q1), "step_q3_ms": float(q3), "repeats": args.steps}


def _launch(ranks: int, threads: int, args, out: Path) -> list[dict]:
    mpirun = shutil.which("mpirun", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                          os.environ.get("PATH", "")]))
    if mpirun is None:
        sys.exit("benchmarks/distributed.py: error: no mpirun; pip install -e \".[mpi]\" (mpi4py and mpich)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OPENBLAS_NUM_THREADS": str(threads), "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    if hasattr(os, "geteuid") and os.geteuid() == 0:          # Open MPI refuses root without these
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    result = out / f"rows_{ranks}x{threads}.json"
    subprocess.run([mpirun, "-n", str(ranks), sys.executable, str(Path(__file__).resolve()), "--worker", str(result),
                    "--threads", str(threads), "--models", args.models, "--steps", str(args.steps),
                    "--warmup", str(args.warmup), "--batch", str(args.batch), "--seq", str(args.seq),
                    *(["--no-numba"] if args.no_numba else [])],
                   env=env, check=True)
    rows = json.loads(result.read_text())
    result.unlink()
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| model | fast paths | ranks x threads | rows a rank | step ms (q1-q3) | compute ms | wait ms "
             "| all-reduce ms | all-reduce share | optimizer ms | bytes all-reduced a step | ring bytes a rank |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        paths = "numba" if r.get("numba", True) else "NumPy alone"
        lines.append(f"| {r['model']} | {paths} | {r['ranks']} x {r['threads']} | {r['rows_per_rank']} "
                     f"| {r['step_ms']:.1f} "
                     f"({r['step_q1_ms']:.1f}-{r['step_q3_ms']:.1f}) | {r['compute_ms']:.1f} | {r['wait_ms']:.1f} "
                     f"| {r['all_reduce_ms']:.1f} | {r['all_reduce_ms'] / r['step_ms']:.1%} | {r['optimizer_ms']:.1f} "
                     f"| {r['bytes_all_reduced']:,} | {r['ring_bytes_per_rank']:,} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="gpt-small,seq2seq-base")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=8, help="the global batch (divisible by 2)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--no-numba", action="store_true", help="the NumPy fast paths alone (numba's off)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--worker", help=argparse.SUPPRESS)          # the JSON path a worker writes
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    rows = [row for ranks, threads in SETUPS for row in _launch(ranks, threads, args, out)]
    rows.sort(key=lambda r: (r["model"], r["ranks"], r["threads"]))
    stamp = datetime.date.today().isoformat() + ("_numpy-alone" if args.no_numba else "")
    text = table(rows)
    print(text)
    print(f"\n({time.perf_counter() - started:.0f} s; python {' '.join(['benchmarks/distributed.py', *argv])})")
    (out / f"distributed_{stamp}.json").write_text(json.dumps(rows, indent=1))
    (out / f"distributed_{stamp}.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main(sys.argv[1:]))
