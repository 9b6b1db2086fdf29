"""A small model's training step on a busy machine: the default thread count against one thread,
with every core quiet and with a CPU hog on every core.

    python benchmarks/busy_machine.py [--model gpt-tiny] [--rounds 6] [--steps 6] [--threads N]
                                      [--no-numba] [--torch] [--out DIR]

A learner's laptop or a shared server often has other programs on every core. There the default
thread count must not make a step slower than ``--threads 1``: a thread that waits for work by
spinning, or a hand-off that waits for a thread the scheduler has set aside, can make it several
times slower. The step is the benchmark suite's (``npformer.bench.steps``: forward, cross-entropy,
backward, AdamW over the flat buffers), built once; each round times it at the default thread
count and at one thread (``npformer.set_num_threads``), so both see the same drift of the machine:
rounds on the quiet machine, then rounds beside one busy Python loop per CPU this process may use
(separate processes), started ``--settle`` seconds before, as a machine busy for a while is. Each
setting's first two steps after a switch are not timed. Reported: the median ms a
step with its quartiles, and each setting's ratio to one thread in the same state.
``--torch`` times PyTorch's step of the same model the same way (``torch.set_num_threads``);
``--no-numba`` runs the NumPy fast paths alone (the README's install). Uses only public calls that
older commits have too, so the same file measures a commit before a change.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import numpy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import npformer                                                       # noqa: E402
from npformer import kernels                                          # noqa: E402
from npformer.backend.host_memory import retain_freed_memory          # noqa: E402
from npformer.bench.backends import Backend, device_name             # noqa: E402
from npformer.bench.steps import MODELS, _npformer_step               # noqa: E402
from npformer.bench.suite import cpu_model, source_commit             # noqa: E402
from npformer.kernels.cpu import threads                              # noqa: E402


@contextlib.contextmanager
def hogs(count: int):
    """``count`` processes, each a busy loop, for the duration of the block."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        time.sleep(0.5)                                   # let them start and take their cores
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _quartiles(walls: list[float]) -> tuple[float, float, float]:
    q1, q2, q3 = numpy.percentile(numpy.asarray(walls) * 1e3, [25, 50, 75])
    return float(q1), float(q2), float(q3)


def measure(steps: dict[str, tuple[Callable[[], None], Callable[[int], None]]], counts: list[int],
            rounds: int, per_round: int, n_hogs: int, settle: float) -> tuple[dict, dict]:
    """({(library, threads, state): [seconds]}, {state: the share of npformer's steps after which
    npformer judged the machine busy}): quiet first, then with the hogs running, after ``settle``
    seconds; each round times every library at every count."""
    judged = getattr(threads, "machine_busy", None)              # (not in commits before 2026-11-29)
    walls: dict[tuple, list[float]] = {}
    busy: dict[str, list[bool]] = {}
    for state in ("quiet", "busy"):
        with hogs(n_hogs) if state == "busy" else contextlib.nullcontext():
            time.sleep(settle if state == "busy" else 0.0)
            for _ in range(rounds):
                for library, (step, set_threads) in steps.items():
                    for n in counts:
                        set_threads(n)
                        for _ in range(2):
                            step()
                        for _ in range(per_round):
                            start = time.perf_counter()
                            step()
                            walls.setdefault((library, n, state), []).append(time.perf_counter() - start)
                            if library == "npformer" and judged is not None:
                                busy.setdefault(state, []).append(judged())
    return walls, {state: sum(b) / len(b) for state, b in busy.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt-tiny", choices=sorted(MODELS))
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per setting and round")
    parser.add_argument("--threads", type=int, default=None, help="the default count (npformer's own default)")
    parser.add_argument("--no-numba", action="store_true", help="the NumPy fast paths alone")
    parser.add_argument("--torch", action="store_true", help="PyTorch's step too")
    parser.add_argument("--settle", type=float, default=5.0,
                        help="seconds the hogs run before the busy timings")
    parser.add_argument("--out", default=None, help="write <cpu>_<date>_busy-machine.md and .json here")
    args = parser.parse_args(argv)

    default = args.threads or npformer.get_num_threads()
    counts = sorted({default, 1}, reverse=True)
    m = MODELS[args.model]
    B, T = m.B or 8, m.T or 128
    ids = numpy.random.default_rng(1).integers(1, m.V, (B, T))
    retain_freed_memory()
    with kernels.disabled("numba") if args.no_numba else contextlib.nullcontext():
        steps = {"npformer": (_npformer_step(Backend("numpy", default), m, ids, ids[:, ::-1].copy()),
                              npformer.set_num_threads)}
        if args.torch:
            import torch
            import benchmarks.torch_reference                         # noqa: F401 - registers "torch"
            from npformer.bench.backends import reference_backend
            step = reference_backend("torch", "cpu", default).train_step(m, ids, ids[:, ::-1].copy(), m.dropout)
            steps["PyTorch"] = (step, torch.set_num_threads)
        walls, judged = measure(steps, counts, args.rounds, args.steps, len(os.sched_getaffinity(0)), args.settle)
    npformer.set_num_threads(default)

    cpu = cpu_model()
    paths = "NumPy fast paths alone" if args.no_numba else "fast paths (numba's too, if installed)"
    commit = source_commit()
    lines = [f"# {args.model} (B {B}, T {T}) on a busy machine, {datetime.date.today().isoformat()}"
             + (f", at {commit}" if commit else ""), "",
             f"CPU: {cpu['model']} ({', '.join(cpu['vector_extensions'])}), "
             f"{len(os.sched_getaffinity(0))} usable; npformer {paths}; "
             f"{args.rounds} rounds x {args.steps} steps a setting; busy: one Python busy loop per CPU, "
             f"timed after {args.settle:.0f} s. "
             + ("npformer judged the machine busy after "
                + ", ".join(f"{100 * share:.0f}% of its {state} steps" for state, share in judged.items())
                + " (`machine_busy()`: element-wise work kept whole)." if judged else
                "This npformer has no `machine_busy()` (a commit before 2026-11-29)."), "",
             f"    python benchmarks/busy_machine.py --model {args.model} --rounds {args.rounds} --steps {args.steps}"
             + (" --no-numba" if args.no_numba else "") + (" --torch" if args.torch else ""), "",
             "| library | threads | machine | ms a step (median) | quartiles | against 1 thread, same state |",
             "|---|---|---|---|---|---|"]
    rows = []
    for library in steps:
        for state in ("quiet", "busy"):
            one = _quartiles(walls[(library, 1, state)])[1]
            for n in counts:
                q1, q2, q3 = _quartiles(walls[(library, n, state)])
                rows.append({"library": library, "threads": n, "state": state, "median_ms": q2,
                             "q1_ms": q1, "q3_ms": q3, "vs_one_thread": q2 / one})
                lines.append(f"| {library} | {n} | {state} | {q2:.1f} | {q1:.1f}-{q3:.1f} | {q2 / one:.2f}x |")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        suffix = "_numpy-alone" if args.no_numba else ""
        stem = Path(args.out) / f"{device_name([])}_{datetime.date.today().isoformat()}_busy-machine{suffix}"
        stem.parent.mkdir(parents=True, exist_ok=True)
        stem.with_suffix(".md").write_text(report)
        stem.with_suffix(".json").write_text(json.dumps({"model": args.model, "cpu": cpu, "paths": paths,
                                                         "judged_busy": judged, "rows": rows}, indent=1))
        print(f"wrote {stem}.md and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
