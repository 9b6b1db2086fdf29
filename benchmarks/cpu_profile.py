"""Where a small model's CPU training step goes: the part that grows with the batch (NumPy, BLAS and
numba doing arithmetic) against the fixed part around it (Python, and each call's own overhead), and the
Python calls per step and per op.

    python benchmarks/cpu_profile.py [--model gpt-tiny] [--steps 20] [--threads N] [--reference]

The step is the benchmark suite's (npformer/bench/steps.py: forward, cross-entropy, backward, AdamW over the
flat buffers), timed at the model's batch and again at one token (B = T = 1, the same widths): the
one-token step makes every call the full step makes, on arrays too small for their arithmetic to
count, so its time is the step's fixed cost (Python, the calls into NumPy, and the optimiser's pass
over the weights, which no batch size changes) and the rest is the arithmetic the batch brings.
(cProfile cannot split them itself: ``x @ w`` and ``a + b`` run BLAS and NumPy from inside the Python
function that wrote them, with no call of their own to time.) Calls are counted over one step
(``benchmarks/call_count.count_calls``). Medians of ``--steps``; ``--reference`` runs with the fast paths off.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections import Counter
from typing import Callable

import numpy

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import npformer                                                       # noqa: E402
from npformer import kernels                                          # noqa: E402
from npformer.bench.backends import Backend                          # noqa: E402
from npformer.bench.steps import MODELS, _npformer_step              # noqa: E402
from benchmarks.call_count import count_calls                         # noqa: E402

def _step_ms(m: dict, B: int, T: int, steps: int) -> tuple[float, Callable[[], None]]:
    """(median ms of ``steps`` timed steps at batch B x T, the step itself)."""
    ids = numpy.random.default_rng(1).integers(1, m["V"], (B, T))
    step = _npformer_step(Backend("numpy", npformer.get_num_threads()), m, ids, ids[:, ::-1].copy())
    for _ in range(3):
        step()                                                         # warm: caches, numba's compilation
    walls = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        walls.append(time.perf_counter() - t)
    return 1e3 * statistics.median(walls), step


def profile(model: str, steps: int) -> dict:
    m = MODELS[model]
    B, T = m.get("B", 8), m.get("T", 128)
    full, step = _step_ms(m, B, T, steps)
    fixed, _ = _step_ms(m, 1, 1, steps)
    calls = count_calls(step)
    ops = Counter({name: n for name, n in calls.items() if name.startswith("ops/") and name.split(":")[1][0] != "_"})
    return {"model": model, "shape": f"B={B} T={T} d={m['d']} H={m['H']} L={m['L']} F={m['F']} V={m['V']}",
            "threads": npformer.get_num_threads(), "step_ms": full, "fixed_ms": fixed,
            "python_calls": sum(calls.values()), "top": calls.most_common(12), "op_calls": ops.most_common(14)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/cpu_profile.py", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt-tiny", choices=[n for n, m in MODELS.items() if not m.get("gpu")])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None, help="npformer.set_num_threads (BLAS and the pool)")
    ap.add_argument("--reference", action="store_true", help="the fast paths off")
    args = ap.parse_args(argv)
    if args.threads:
        npformer.set_num_threads(args.threads)
    with kernels.disabled() if args.reference else contextlib.nullcontext():
        r = profile(args.model, args.steps)
    print(f"{r['model']} ({r['shape']}), {r['threads']} thread(s), fast paths {'off' if args.reference else 'on'}:")
    print(f"  step {r['step_ms']:.1f} ms (median of {args.steps}); at one token {r['fixed_ms']:.1f} ms: the fixed part "
          f"{100 * r['fixed_ms'] / r['step_ms']:.0f}%, the batch's arithmetic {r['step_ms'] - r['fixed_ms']:.1f} ms; "
          f"{r['python_calls']} calls into npformer a step")
    print("  most called npformer functions a step:")
    for name, n in r["top"]:
        print(f"    {n:5d}  {name}")
    print("  op functions a step:")
    for name, n in r["op_calls"]:
        print(f"    {n:5d}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
