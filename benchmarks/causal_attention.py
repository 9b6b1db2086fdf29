"""Causal attention on the CPU: what computing only the keys a block's rows may attend saves, with
PyTorch's causal attention beside it.

    taskset -c 0 python benchmarks/causal_attention.py [--lengths 64,256,512,1024,2048] [--batch 1]
        [--heads 8] [--head-size 64] [--threads 1] [--no-numba] [--repeats 5] [--rounds 4] [--no-torch]

For each length T, npformer's ``scaled_dot_product_attention_forward`` and its backward on (B, H, T, hs)
float32 arrays, on the CPU fast path, timed two ways in the same run:

* ``is_causal=True``: each block of query rows computes its scores, softmax and products over the keys
  its last row may attend and no further (:func:`npformer.kernels.cpu.attention.keys_seen`); below
  T = 257 a block holds whole heads, so only the rows' common keys (all of them) are computed;
* the same mask given as ``attn_mask`` (the bool ``causal_mask(T, T)``, ``is_causal=False``): every key
  computed and masked, as ``is_causal`` did before 2026-12-02. The results are the same to rounding.

and PyTorch's ``scaled_dot_product_attention(..., is_causal=True)`` forward and backward on the same
arrays (``--threads`` threads too), when it is installed. Each is timed in ``--rounds`` rounds of
``--repeats`` calls after warm-up (:func:`npformer.bench.harness.time_call`), the three in turn and the
order reversed every other round, so that the machine's drift reaches each alike; the table gives the
median of the rounds' medians and their range.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import statistics
from typing import Callable

import numpy

import npformer
from npformer import kernels
from npformer.bench.harness import time_call
from npformer.ops import attention
from npformer.ops.masks import causal_mask


def _alternated(steps: dict[str, Callable[[], object]], repeats: int, rounds: int) -> dict[str, dict]:
    """Each of ``steps`` timed in ``rounds`` rounds of ``repeats`` calls (time_call: warm-up first), the
    order reversed every other round so that a drift of the machine's speed reaches each alike:
    ``{name: {"ms": median of the rounds' medians, "low": the lowest, "high": the highest}}``."""
    medians: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            medians[name].append(time_call(steps[name], lambda: None, warmup=2, repeats=repeats, budget_s=120.0)["ms"])
    return {name: {"ms": statistics.median(m), "low": min(m), "high": max(m)} for name, m in medians.items()}


def npformer_step(q, k, v, dout, **mask) -> Callable[[], object]:
    """One forward and backward of npformer's attention with ``mask`` (is_causal or attn_mask)."""
    def step():
        _, _, cache = attention.scaled_dot_product_attention_forward(q, k, v, **mask)
        return attention.scaled_dot_product_attention_backward(dout, cache)
    return step


def torch_step(q, k, v, dout) -> Callable[[], object]:
    """PyTorch's causal attention forward and backward on the same arrays."""
    import torch
    qt, kt, vt = (torch.from_numpy(a).requires_grad_() for a in (q, k, v))
    g = torch.from_numpy(dout)

    def step():
        out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        return torch.autograd.grad(out, (qt, kt, vt), g)
    return step


def measure(t: int, b: int, h: int, hs: int, repeats: int, rounds: int, with_torch: bool) -> dict:
    rng = numpy.random.default_rng(t)
    q, k, v, dout = (rng.standard_normal((b, h, t, hs), dtype=numpy.float32) for _ in range(4))
    steps = {"masked": npformer_step(q, k, v, dout, attn_mask=causal_mask(t, t)),
             "causal": npformer_step(q, k, v, dout, is_causal=True)}
    for got, want in zip(steps["causal"](), steps["masked"]()):         # the same results, to rounding
        numpy.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    if with_torch:
        steps["torch"] = torch_step(q, k, v, dout)
    return _alternated(steps, repeats, rounds)


def _ms(r: dict) -> str:
    return f"{r['ms']:.2f} ({r['low']:.2f}-{r['high']:.2f})"


def _lengths(text: str) -> list[int]:
    """'64,512' -> [64, 512]; anything else is argparse's error."""
    try:
        lengths = [int(item) for item in text.split(",")]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        raise argparse.ArgumentTypeError(f"expected lengths T >= 1 such as 64,512, got {text!r}")
    return lengths


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=_lengths, default="64,256,512,1024,2048", help="comma-separated T")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="npformer.set_num_threads (and PyTorch's)")
    parser.add_argument("--no-numba", action="store_true", help="the NumPy fast path alone (numba's off)")
    parser.add_argument("--repeats", type=int, default=5, help="calls a round")
    parser.add_argument("--rounds", type=int, default=4, help="rounds, the order reversed every other")
    parser.add_argument("--no-torch", action="store_true", help="npformer's columns alone")
    args = parser.parse_args(argv)
    npformer.set_num_threads(args.threads)
    with_torch = not args.no_torch and importlib.util.find_spec("torch") is not None
    if with_torch:
        import torch
        torch.set_num_threads(args.threads)
    path = "NumPy alone" if args.no_numba else "numba's row loops where installed"
    print(f"causal attention forward + backward, float32, B={args.batch} H={args.heads} hs={args.head_size}, "
          f"{args.threads} thread(s), npformer's CPU fast path ({path}); ms: the median of {args.rounds} "
          f"rounds' medians of {args.repeats} calls (the lowest-highest), the ways alternated")
    print()
    print("| T | every key, masked (attn_mask) | is_causal: a block's keys only | masked / is_causal |"
          + (" PyTorch SDPA is_causal | npformer / PyTorch |" if with_torch else ""))
    print("|---|---|---|---|" + ("---|---|" if with_torch else ""))
    switch = kernels.disabled("numba") if args.no_numba else contextlib.nullcontext()
    with switch:
        for t in args.lengths:
            r = measure(t, args.batch, args.heads, args.head_size, args.repeats, args.rounds, with_torch)
            line = (f"| {t} | {_ms(r['masked'])} | {_ms(r['causal'])} | "
                    f"{r['masked']['ms'] / r['causal']['ms']:.2f}x |")
            if with_torch:
                line += f" {_ms(r['torch'])} | {r['causal']['ms'] / r['torch']['ms']:.2f}x |"
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
