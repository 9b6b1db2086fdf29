"""Where a small model's CPU training step goes: the part that grows with the batch (NumPy, BLAS and
numba doing arithmetic) against the fixed part around it (Python, and each call's own overhead), and the
Python calls per step and per op.

    python benchmarks/cpu_profile.py [--model gpt-tiny] [--steps 20] [--threads N] [--reference | --no-numba]
                                     [--torch] [--dropout P]

The step is the benchmark suite's (npformer/bench/steps.py: forward, cross-entropy, backward, AdamW over the
flat buffers), timed at the model's batch and again at one token (B = T = 1, the same widths): the
one-token step makes every call the full step makes, on arrays too small for their arithmetic to
count, so its time is the step's fixed cost (Python, the calls into NumPy, and the optimiser's pass
over the weights, which no batch size changes) and the rest is the arithmetic the batch brings.
(cProfile cannot split them itself: ``x @ w`` and ``a + b`` run BLAS and NumPy from inside the Python
function that wrote them, with no call of their own to time.) Calls are counted over one step
(``benchmarks/call_count.count_calls``). Medians of ``--steps``; ``--reference`` runs with the fast paths off,
``--no-numba`` with the NumPy fast paths alone (the README's install).

Time per op: each fast path's calls are timed in the step (exclusive of the fast paths they call), so
the table says where the arithmetic goes: the matrix products are the linear layers' rows (attention's
own products are inside its rows). ``--torch`` times PyTorch's step of the same model, at its batch
and at one token (its fixed part, as npformer's), profiles it (``torch.profiler``, self time per ATen
op) and prints the share of it spent in matrix products (``aten::mm``, ``addmm``, ``bmm``,
``baddbmm``): a step can be no faster than its products, so that share bounds what any
implementation with the same BLAS speed can reach against PyTorch. npformer's own products are timed
in the step too (:func:`timed_products`), so the next line compares what each library spends outside
its matrix products: the part of the step that is npformer's own work, not BLAS's. The profiler's
bookkeeping inflates PyTorch's product times too, by a varying amount, so the last line brackets it
from the other side: both libraries' products timed alone (:func:`products_alone`), each step less them.
Both libraries run the model's dropout rate (the suite's: 0.1 but where a model says its own), or
``--dropout P`` in both.
The pool's regions (on more than one thread): how many a step, and how their time divides between
setting up (until the calling thread starts its own part), the caller's own part, and waiting
after it for the pool's parts (:func:`timed_regions`): what the second core costs in hand-offs.
Like ``npformer train`` and the benchmark suite, it keeps freed memory for reuse
(:func:`npformer.backend.host_memory.retain_freed_memory`), so no step pays page faults.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import sys
import threading
import time
from collections import Counter
from typing import Callable

import numpy

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import npformer                                                       # noqa: E402
from npformer import dispatch, kernels                                # noqa: E402
from npformer.kernels.cpu import threads                              # noqa: E402
from npformer.backend.host_memory import retain_freed_memory          # noqa: E402
from npformer.bench.backends import Backend                          # noqa: E402
from npformer.bench.steps import MODELS, _npformer_step, model_batch  # noqa: E402
from benchmarks.call_count import count_calls                         # noqa: E402

def _median_ms(step: Callable[[], None], steps: int) -> float:
    """Median ms of ``steps`` timed calls of ``step``, after 3 untimed ones."""
    for _ in range(3):
        step()                                                         # warm: caches, numba's compilation
    walls = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        walls.append(time.perf_counter() - t)
    return 1e3 * statistics.median(walls)


def _step_ms(m, B: int, T: int, steps: int) -> tuple[float, Callable[[], None]]:
    """(median ms of ``steps`` timed steps at batch B x T, the step itself)."""
    ids = numpy.random.default_rng(1).integers(1, m.V, (B, T))
    step = _npformer_step(Backend("numpy", npformer.get_num_threads()), m, ids, ids[:, ::-1].copy())
    return _median_ms(step, steps), step


@contextlib.contextmanager
def timed_fast_paths(total: Counter, running: list | None = None):
    """Inside the block, every fast path's run adds its seconds to ``total[op/path]``, less the time
    of the fast paths it calls itself (each second counted once); ``running``, when given, holds the
    names of those running on the calling thread, innermost last."""
    stack: list[float] = []
    names = running if running is not None else []

    def timed(name: str, run: Callable) -> Callable:
        def run_timed(*args, **kwargs):
            start = time.perf_counter()
            stack.append(0.0)
            names.append(name)
            try:
                return run(*args, **kwargs)
            finally:
                names.pop()
                seconds, inner = time.perf_counter() - start, stack.pop()
                total[name] += seconds - inner
                if stack:
                    stack[-1] += seconds
        return run_timed

    saved = {name: list(op.fast_paths) for name, op in dispatch.dispatched_ops().items()}
    try:
        for name, op in dispatch.dispatched_ops().items():
            op.fast_paths[:] = [p._replace(run=timed(f"{name.rsplit('.', 1)[1]} ({p.name})", p.run))
                                for p in op.fast_paths]
        yield total
    finally:
        for name, op in dispatch.dispatched_ops().items():
            op.fast_paths[:] = saved[name]


@contextlib.contextmanager
def timed_regions(total: Counter, running: list | None = None):
    """Inside the block, each region of the CPU pool (``threads.run_parallel`` with more than one
    part) adds to ``total``: "regions", and the seconds of "region" (from BLAS's switch to one
    thread until every part has finished), "before" (until the calling thread starts its own part:
    the switch, the hand-off to the pool), "own" (the caller's part) and "after" (the caller
    waiting for the pool's parts, or running those the pool had not started: "stolen" counts
    them); with ``running`` (:func:`timed_fast_paths`' names) the same again under "name/field" for
    the fast path that made the region. It wraps the module's own helpers, which ``run_parallel``
    looks up at each call."""
    state: dict = {}
    blas_at_one, run_part, part_class = threads._blas_at_one_thread, threads._run_part, threads._Part

    @contextlib.contextmanager
    def region():
        outer = dict(state)
        state.update(start=time.perf_counter(), parts=0, caller=threading.get_ident(), own=None,
                     op=running[-1] if running else None)
        try:
            with blas_at_one():
                yield
        finally:
            if state["parts"] and state["own"] is not None:
                now = time.perf_counter()
                times = {"regions": 1, "region": now - state["start"], "before": state["own"][0] - state["start"],
                         "own": state["own"][1] - state["own"][0], "after": now - state["own"][1]}
                for field, value in times.items():
                    total[field] += value
                    if state["op"]:
                        total[f"{state['op']}/{field}"] += value
            state.clear()
            state.update(outer)

    def counted_part(fn):
        if state:
            state["parts"] += 1
        return part_class(fn)

    def timed_run_part(fn):
        mine = bool(state) and threading.get_ident() == state["caller"]
        if not mine:
            return run_part(fn)
        if state["own"] is not None:
            total["stolen"] += 1
            return run_part(fn)
        start = time.perf_counter()
        try:
            return run_part(fn)
        finally:
            state["own"] = (start, time.perf_counter())

    threads._blas_at_one_thread, threads._run_part, threads._Part = region, timed_run_part, counted_part
    try:
        yield total
    finally:
        threads._blas_at_one_thread, threads._run_part, threads._Part = blas_at_one, run_part, part_class


@contextlib.contextmanager
def timed_products(total: Counter):
    """Inside the block, the linear layers' matrix products (each BLAS call of the CPU fast path,
    :func:`npformer.kernels.cpu.linear._product`, and the reference's ``matmul`` in
    :mod:`npformer.ops.linear`; the head's included) add to ``total``: "calls", and "seconds", the
    wall time during which at least one of them runs on any thread, so two threads' halves of one
    product count once. They are timed where the step runs them, on the operands the step has just
    written or read, which is what a step pays for them (a product timed alone, its operands in the
    cache, takes less). Attention's own products stay in its rows: PyTorch's fused attention keeps
    them out of its ``aten::mm`` too."""
    from npformer.kernels.cpu import linear as fast_linear
    from npformer.ops import linear as reference_linear
    lock, state = threading.Lock(), {"running": 0, "since": 0.0}

    def timed(product: Callable) -> Callable:
        def run_timed(*args, **kwargs):
            with lock:
                if not state["running"]:
                    state["since"] = time.perf_counter()
                state["running"] += 1
            try:
                return product(*args, **kwargs)
            finally:
                with lock:
                    state["running"] -= 1
                    total["calls"] += 1
                    if not state["running"]:
                        total["seconds"] += time.perf_counter() - state["since"]
        return run_timed

    saved = fast_linear._product, reference_linear.matmul
    fast_linear._product, reference_linear.matmul = timed(saved[0]), timed(saved[1])
    try:
        yield total
    finally:
        fast_linear._product, reference_linear.matmul = saved


def model_spec(model: str, dropout: float | None = None):
    """The suite's spec of ``model`` (a ModelSpec), with ``dropout`` in place of its own rate when given."""
    return MODELS[model] if dropout is None else dataclasses.replace(MODELS[model], dropout=dropout)


def profile(model: str, steps: int, dropout: float | None = None) -> dict:
    m = model_spec(model, dropout)
    B, T = model_batch(m)
    full, step = _step_ms(m, B, T, steps)
    fixed, _ = _step_ms(m, 1, 1, steps)
    calls = count_calls(step)
    ops = Counter({name: n for name, n in calls.items() if name.startswith("ops/") and name.split(":")[1][0] != "_"})
    outside = []                                                      # a pass of its own: no other timers
    with timed_products(Counter()) as products:
        for _ in range(steps):
            before, start = products["seconds"], time.perf_counter()
            step()
            outside.append(time.perf_counter() - start - (products["seconds"] - before))
    running: list = []
    with timed_fast_paths(Counter(), running) as seconds, timed_regions(Counter(), running) as regions:
        for _ in range(steps):
            step()
    op_ms = [(name, 1e3 * s / steps) for name, s in seconds.most_common()]
    return {"model": model, "dropout": m.dropout,
            "shape": f"B={B} T={T} d={m.d} H={m.H} L={m.L} F={m.F} V={m.V}",
            "threads": npformer.get_num_threads(), "step_ms": full, "fixed_ms": fixed,
            "products_ms": 1e3 * products["seconds"] / steps, "product_calls": products["calls"] / steps,
            "outside_ms": 1e3 * statistics.median(outside),
            "python_calls": sum(calls.values()), "top": calls.most_common(12), "op_calls": ops.most_common(14),
            "op_ms": op_ms, "regions": {k: v / steps for k, v in regions.items()}}


MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def torch_profile(model: str, steps: int, dropout: float | None = None) -> dict:
    """PyTorch's step of ``model`` (the suite's, benchmarks/torch_reference.py): its median time and
    the self time of each ATen op under torch.profiler, the matrix products' share among them."""
    import torch
    from torch.profiler import ProfilerActivity, profile as torch_profiler
    import benchmarks.torch_reference                                 # noqa: F401 - registers "torch"
    from npformer.bench.backends import reference_backend
    m = model_spec(model, dropout)
    B, T = model_batch(m)
    ids = numpy.random.default_rng(1).integers(1, m.V, (B, T))
    torch_cpu = reference_backend("torch", "cpu", npformer.get_num_threads())
    step = torch_cpu.train_step(m, ids, ids[:, ::-1].copy(), m.dropout)         # npformer's rate
    step_ms = _median_ms(step, steps)
    one = numpy.ones((1, 1), dtype=ids.dtype)
    fixed_ms = _median_ms(torch_cpu.train_step(m, one, one.copy(), m.dropout), steps)   # at one token
    with torch_profiler(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    self_ms = Counter({e.key: e.self_cpu_time_total / 1e3 / steps for e in prof.key_averages()})
    total, matmul_ms = sum(self_ms.values()), sum(self_ms[k] for k in MATMUL_OPS)
    return {"torch": torch.__version__, "threads": torch.get_num_threads(), "step_ms": step_ms, "fixed_ms": fixed_ms,
            "profiled_ms": total, "matmul_ms": matmul_ms, "top": self_ms.most_common(10),
            "outside_ms": step_ms - matmul_ms}


def products_alone(model: str, threads: int) -> dict | None:
    """A step's worth of ``model``'s linear-layer products timed alone through NumPy's BLAS and PyTorch's
    (:func:`benchmarks.blas_products.step_ms`), in ms; None for the seq2seq model (its products are not
    in that list).

    The two "outside the products" figures bracket the truth. The first times npformer's products in its
    step (their operands just written: what the step pays) but takes PyTorch's from its profile, whose
    per-op bookkeeping inflates every op's self time (the profiled ops add up to 20-40% more than the
    step takes), the products' too, so it understates PyTorch's time outside them. Timed alone, with
    their operands in the cache, both libraries' products take less than in a step, so this one
    overstates both libraries' time outside them, alike."""
    import torch
    from benchmarks import blas_products
    if MODELS[model].kind != "gpt":
        return None
    return {"numpy": blas_products.step_ms(blas_products.NumpyBlas(), threads, model),
            "torch": blas_products.step_ms(blas_products.TorchBlas(torch), threads, model)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/cpu_profile.py", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt-tiny", choices=[n for n, m in MODELS.items() if not m.gpu])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None, help="npformer.set_num_threads (BLAS and the pool)")
    paths = ap.add_mutually_exclusive_group()
    paths.add_argument("--reference", action="store_true", help="the fast paths off")
    paths.add_argument("--no-numba", action="store_true", help="the NumPy fast paths alone (numba's off)")
    ap.add_argument("--torch", action="store_true", help="also PyTorch's step, and its matrix products' share")
    ap.add_argument("--dropout", type=float, default=None,
                    help="dropout rate in both libraries' models (default: the model's own, as the suite runs it)")
    args = ap.parse_args(argv)
    if args.dropout is not None and not 0.0 <= args.dropout < 1.0:
        ap.error(f"--dropout: expected a rate in [0, 1), got {args.dropout}")
    retain_freed_memory()
    if args.threads:
        npformer.set_num_threads(args.threads)
    switch = kernels.disabled() if args.reference else kernels.disabled("numba") if args.no_numba else None
    with switch or contextlib.nullcontext():
        r = profile(args.model, args.steps, args.dropout)
    which = "off" if args.reference else "on without numba's" if args.no_numba else "on"
    print(f"{r['model']} ({r['shape']}, dropout {r['dropout']}), {r['threads']} thread(s), fast paths {which}:")
    print(f"  step {r['step_ms']:.1f} ms (median of {args.steps}); at one token {r['fixed_ms']:.1f} ms: the fixed part "
          f"{100 * r['fixed_ms'] / r['step_ms']:.0f}%, the batch's arithmetic {r['step_ms'] - r['fixed_ms']:.1f} ms; "
          f"{r['python_calls']} calls into npformer a step")
    print(f"  matrix products (the linear layers' BLAS calls, the head's included; wall time while any runs): "
          f"{r['products_ms']:.1f} ms a step in {r['product_calls']:.0f} calls; outside them "
          f"{r['outside_ms']:.1f} ms (median of each step's time less its products')")
    print("  most called npformer functions a step:")
    for name, n in r["top"]:
        print(f"    {n:5d}  {name}")
    print("  op functions a step:")
    for name, n in r["op_calls"]:
        print(f"    {n:5d}  {name}")
    if r["op_ms"]:
        print("  time in each fast path a step (the rest: reference ops, Python, the optimiser's bookkeeping):")
        for name, ms in r["op_ms"]:
            print(f"    {ms:7.2f} ms  {name}")
        print(f"    {sum(ms for _, ms in r['op_ms']):7.2f} ms  in all")
    g = r["regions"]
    if g.get("regions"):
        print(f"  the pool's regions a step: {g['regions']:.0f}, {1e3 * g['region']:.2f} ms in all: "
              f"{1e3 * g['before']:.2f} ms before the calling thread starts its own part, "
              f"{1e3 * g['own']:.2f} ms in it, {1e3 * g['after']:.2f} ms after it (waiting for the pool's parts, "
              f"or running the {g.get('stolen', 0):.1f} a step the pool had not started); per region, in us:")
        ops = sorted({k.rsplit("/", 1)[0] for k in g if "/" in k}, key=lambda op: -g[f"{op}/regions"])
        for op in ops:
            n = g[f"{op}/regions"]
            print(f"    {n:4.0f} a step  {op + ':':48s} {1e6 * g[f'{op}/region'] / n:6.0f} in all, "
                  + ", ".join(f"{1e6 * g[f'{op}/{field}'] / n:.0f} {field}" for field in ("before", "own", "after")))
    if args.torch:
        t = torch_profile(args.model, args.steps, args.dropout)
        print(f"PyTorch {t['torch']}, {t['threads']} thread(s): step {t['step_ms']:.1f} ms (median of {args.steps}); "
              f"at one token {t['fixed_ms']:.1f} ms; "
              f"profiled, {t['profiled_ms']:.1f} ms a step of ATen ops' self time, {t['matmul_ms']:.1f} ms "
              f"({100 * t['matmul_ms'] / t['profiled_ms']:.0f}%) in matrix products ({', '.join(MATMUL_OPS)})")
        for name, ms in t["top"]:
            print(f"    {ms:7.2f} ms  {name}")
        ours, theirs = r["outside_ms"], t["outside_ms"]
        print(f"Outside the matrix products (the step less their time): npformer {ours:.1f} ms, PyTorch "
              f"{theirs:.1f} ms (its step less their profiled self time): {ours / theirs:.2f}x")
        alone = products_alone(args.model, r["threads"])
        if alone:
            ours, theirs = r["step_ms"] - alone["numpy"], t["step_ms"] - alone["torch"]
            print(f"The same products timed alone (benchmarks/blas_products.py: {alone['numpy']:.1f} ms a step through "
                  f"NumPy's BLAS, {alone['torch']:.1f} through PyTorch's), each step less them: npformer "
                  f"{ours:.1f} ms, PyTorch {theirs:.1f} ms: {ours / theirs:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
