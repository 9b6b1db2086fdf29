"""How large the NumPy fast paths' blocks should be: GELU, AdamW and attention at several block sizes,
alternated in one process.

    python benchmarks/thread_blocks.py [--threads 2] [--rounds 8] [--sizes 64 128 256 512]
                                       [--constant THREAD_BLOCK_ELEMENTS] [--step [--no-numba]] [--out FILE.md]

``--constant`` names the size that varies (``npformer.kernels.cpu.blocks``): THREAD_BLOCK_ELEMENTS,
the blocks of work cut between threads (``--threads`` 2 or more), or BLOCK_ELEMENTS, the blocks of
one thread (``--threads 1``; its attention's runs of query rows change with it too). ``--sizes`` in
K elements (1024). Each round times every op at every size (the 25th percentile of 20 calls after 3
untimed ones, wall time); the table gives each op's median over the rounds and the quartiles
across them. Freed memory is kept for reuse first (``retain_freed_memory``), as training does, so
that fresh pages do not weigh on the larger arrays. The ops are gpt-tiny's (nanoGPT's CPU recipe)
and gpt-medium's shapes, float32, the NumPy fast paths called directly (``npformer.kernels.cpu``).
``--step`` adds gpt-tiny's whole training step (the suite's, every fast path on, or the NumPy ones
alone with ``--no-numba``), timed the same way; its spread on a shared VM is the widest.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import numpy

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import npformer                                                       # noqa: E402
from npformer import kernels                                           # noqa: E402
from npformer.backend.host_memory import retain_freed_memory          # noqa: E402
from npformer.bench.backends import Backend                          # noqa: E402
from npformer.bench.steps import MODELS, _npformer_step               # noqa: E402
from npformer.kernels.cpu import activations, attention, blocks, optim  # noqa: E402

CONSTANTS = ("THREAD_BLOCK_ELEMENTS", "BLOCK_ELEMENTS")


def ops(rng) -> dict:
    """name -> a call of one NumPy fast path at one shape."""
    out = {}
    for shape in ((768, 512), (1024, 2048)):                           # gpt-tiny's and gpt-medium's MLP
        x, dy = (rng.standard_normal(shape, dtype=numpy.float32) for _ in range(2))
        _, cache = activations.gelu_forward(x)
        out[f"GELU forward {shape[0]} x {shape[1]}"] = lambda x=x: activations.gelu_forward(x)
        out[f"GELU backward {shape[0]} x {shape[1]}"] = lambda dy=dy, c=cache: activations.gelu_backward(dy, c)
    for n in (800_000, 19_000_000):                                   # gpt-tiny's and gpt-medium's parameters
        arrays = [rng.standard_normal(n, dtype=numpy.float32) for _ in range(2)]      # parameter, gradient
        arrays += [numpy.zeros(n, numpy.float32) for _ in range(2)]                   # the moments
        out[f"AdamW {n / 1e6:g}M"] = lambda a=arrays: optim.adam_update(
            *a, step=10, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, decoupled=True)
    for shape in ((12, 4, 64, 32), (8, 8, 128, 64)):                   # (B, H, T, head size), causal
        q, k, v, dout = (rng.standard_normal(shape, dtype=numpy.float32) for _ in range(4))
        _, _, cache = attention.scaled_dot_product_attention_forward(q, k, v, is_causal=True)
        name = "B{} H{} T{} hs{}".format(*shape)
        out[f"attention forward {name}"] = lambda q=q, k=k, v=v: attention.scaled_dot_product_attention_forward(
            q, k, v, is_causal=True)
        out[f"attention backward {name}"] = lambda d=dout, c=cache: (
            attention.scaled_dot_product_attention_backward(d, c))
    return out


def gpt_tiny_step(rng):
    """gpt-tiny's training step as the benchmark suite runs it (forward, loss, backward, AdamW)."""
    m = MODELS["gpt-tiny"]
    ids = rng.integers(1, m.V, (m.B, m.T))
    return _npformer_step(Backend("numpy", npformer.get_num_threads()), m, ids, ids[:, ::-1].copy())


def time_us(fn, calls: int = 20) -> float:
    for _ in range(3):
        fn()
    walls = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - start)
    return 1e6 * float(numpy.percentile(walls, 25))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--sizes", type=int, nargs="+", default=[64, 128, 256, 512], help="block sizes, K elements")
    p.add_argument("--constant", choices=CONSTANTS, default=CONSTANTS[0])
    p.add_argument("--step", action="store_true", help="also gpt-tiny's whole training step")
    p.add_argument("--no-numba", action="store_true", help="the step with the NumPy fast paths alone")
    p.add_argument("--out", default=None, help="also write the table here (markdown)")
    a = p.parse_args(argv)
    npformer.set_num_threads(a.threads)
    retain_freed_memory()
    rng = numpy.random.default_rng(0)
    calls = ops(rng)
    if a.step:
        calls["gpt-tiny step" + (", NumPy fast paths alone" if a.no_numba else "")] = gpt_tiny_step(rng)
    before = getattr(blocks, a.constant)
    times: dict[tuple, list] = {(name, size): [] for name in calls for size in a.sizes}
    paths = kernels.disabled("numba") if a.no_numba else contextlib.nullcontext()
    try:
        with paths:
            for _ in range(a.rounds):
                for size in a.sizes:
                    setattr(blocks, a.constant, size << 10)
                    for name, fn in calls.items():
                        times[(name, size)].append(time_us(fn))
    finally:
        setattr(blocks, a.constant, before)
    head = f"{a.constant} at {', '.join(f'{s}K' for s in a.sizes)}; {a.threads} thread(s), {a.rounds} rounds"
    flags = (" --step" if a.step else "") + (" --no-numba" if a.no_numba else "")
    lines = [f"# NumPy fast paths' block sizes: {head}", "",
             f"`python benchmarks/thread_blocks.py --threads {a.threads} --rounds {a.rounds} --sizes "
             f"{' '.join(map(str, a.sizes))} --constant {a.constant}{flags}`, npformer {npformer.__version__}; "
             "microseconds, median over the rounds of each round's 25th percentile (quartiles across the rounds).", "",
             "| op | " + " | ".join(f"{s}K" for s in a.sizes) + " |", "|---" * (len(a.sizes) + 1) + "|"]
    for name in calls:
        cells = []
        for size in a.sizes:
            t = times[(name, size)]
            q1, q3 = numpy.percentile(t, [25, 75])
            cells.append(f"{statistics.median(t):,.0f} ({q1:,.0f}-{q3:,.0f})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
