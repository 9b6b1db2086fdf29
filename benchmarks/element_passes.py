"""What one element-wise pass costs at a layer's shape, in NumPy and in PyTorch, by how its second
operand broadcasts.

    taskset -c 0 python benchmarks/element_passes.py [--shapes 768x128,768x512,3072x64,1024x768] [--repeats 400]

A pass is one ufunc call over an (N, C) float32 array, in place (``out=``: no allocation), the kind
the NumPy fast paths chain (layer norm, softmax, GELU, AdamW); its second operand is

* flat: another (N, C) array (a residual, GELU's ``x * cdf``);
* a row vector: (C,), repeated for every row (a layer norm's weight or bias, a linear's bias);
* a column: (N, 1), one value a row (a row statistic: layer norm's mean and 1/std, softmax's
  maximum and sum);

and, beside them, the row maximum (N, C) -> (N, 1), softmax's first pass, and ``exp`` (flat, one
transcendental function: softmax's second pass; its cost differs most between CPUs). NumPy runs a broadcast
pass as one inner loop per row: at C = 128 that is 768 loops of 128 elements, each with its own
set-up. PyTorch's element-wise kernels (TensorIterator) are timed on the same arrays, one thread,
when it is installed. Medians of ``--repeats`` calls after warm-up (the suite's
:func:`npformer.bench.harness.time_call`), the widest interquartile range printed under the table;
the operands are ones, so the in-place products never leave the normal range (no subnormals to slow
a repeat).
"""
from __future__ import annotations

import argparse
import importlib.util
from typing import Callable

import numpy

from npformer.bench.harness import time_call

CASES = ("flat", "a row vector (C,)", "a column (N, 1)", "row maximum", "exp")


def _timed(fn: Callable[[], object], repeats: int) -> dict:
    """time_call's summary of ``repeats`` calls after a tenth as many (at least 3) untimed."""
    return time_call(fn, lambda: None, warmup=max(3, repeats // 10), repeats=repeats, budget_s=60.0)


def numpy_passes(n: int, c: int) -> dict[str, Callable[[], object]]:
    y, z = numpy.ones((n, c), numpy.float32), numpy.ones((n, c), numpy.float32)
    w, r = numpy.ones(c, numpy.float32), numpy.ones((n, 1), numpy.float32)
    x = numpy.random.default_rng(0).standard_normal((n, c), dtype=numpy.float32)
    m, e = numpy.empty((n, 1), numpy.float32), numpy.empty((n, c), numpy.float32)
    return {"flat": lambda: numpy.multiply(y, z, out=y),
            "a row vector (C,)": lambda: numpy.multiply(y, w, out=y),
            "a column (N, 1)": lambda: numpy.multiply(y, r, out=y),
            "row maximum": lambda: numpy.max(x, axis=-1, keepdims=True, out=m),
            "exp": lambda: numpy.exp(x, out=e)}


def torch_passes(n: int, c: int) -> dict[str, Callable[[], object]]:
    import torch
    y, z = torch.ones((n, c)), torch.ones((n, c))
    w, r = torch.ones(c), torch.ones((n, 1))
    x = torch.from_numpy(numpy.random.default_rng(0).standard_normal((n, c), dtype=numpy.float32))
    e = torch.empty((n, c))
    return {"flat": lambda: y.mul_(z),
            "a row vector (C,)": lambda: y.mul_(w),
            "a column (N, 1)": lambda: y.mul_(r),
            "row maximum": lambda: torch.amax(x, dim=-1, keepdim=True),
            "exp": lambda: torch.exp(x, out=e)}


def measure(shapes: list[tuple[int, int]], repeats: int, with_torch: bool) -> list[dict]:
    """A row per shape and case: microseconds a call for NumPy (and PyTorch), the median and the
    interquartile range's share of it ("numpy_iqr", "torch_iqr")."""
    if with_torch:
        import torch
        torch.set_num_threads(1)
    rows = []
    for n, c in shapes:
        ours = numpy_passes(n, c)
        theirs = torch_passes(n, c) if with_torch else {}
        for case in CASES:
            row = {"shape": (n, c), "case": case, "torch_us": None, "torch_iqr": None}
            for name, passes in (("numpy", ours), ("torch", theirs)):
                if case in passes:
                    t = _timed(passes[case], repeats)
                    row[f"{name}_us"], row[f"{name}_iqr"] = 1e3 * t["ms"], (t["q3_ms"] - t["q1_ms"]) / t["ms"]
            rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    with_torch = rows[0]["torch_us"] is not None
    head = "| shape | pass (its second operand) | NumPy us | NumPy ns an element | NumPy / its flat pass |"
    rule = "|---|---|---|---|---|"
    if with_torch:
        head += " PyTorch us | NumPy / PyTorch |"
        rule += "---|---|"
    lines = [head, rule]
    flat = {r["shape"]: r["numpy_us"] for r in rows if r["case"] == "flat"}
    for r in rows:
        n, c = r["shape"]
        line = (f"| {n} x {c} | {r['case']} | {r['numpy_us']:.1f} | {1e3 * r['numpy_us'] / (n * c):.2f} "
                f"| {r['numpy_us'] / flat[r['shape']]:.2f}x |")
        if with_torch:
            line += f" {r['torch_us']:.1f} | {r['numpy_us'] / r['torch_us']:.2f}x |"
        lines.append(line)
    iqr, who, (n, c), case = max(((row[f"{name}_iqr"], label, row["shape"], row["case"]) for row in rows
                                  for name, label in (("numpy", "NumPy"), ("torch", "PyTorch"))
                                  if row[f"{name}_iqr"] is not None), key=lambda spread: spread[0])
    lines.append(f"\nWidest interquartile range: {100 * iqr:.0f}% of its median ({who}, {n} x {c}, {case}).")
    return "\n".join(lines)


def _shapes(text: str) -> list[tuple[int, int]]:
    """"768x128,768x512" -> [(768, 128), (768, 512)]."""
    shapes = []
    for item in text.split(","):
        try:
            n, c = (int(v) for v in item.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected shapes NxC such as 768x128, got {item!r}") from None
        if n < 1 or c < 1:
            raise argparse.ArgumentTypeError(f"expected a shape of positive sizes, got {item!r}")
        shapes.append((n, c))
    return shapes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/element_passes.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", type=_shapes, default="768x128,768x512,3072x64,1024x768",
                    help="comma list of NxC (default: gpt-tiny's layer norm, its GELU, its attention scores "
                         "(B H T rows of T keys), and gpt-small's width)")
    ap.add_argument("--repeats", type=int, default=400)
    ap.add_argument("--no-torch", action="store_true", help="NumPy's column alone")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats: expected at least 1, got {args.repeats}")
    with_torch = not args.no_torch and importlib.util.find_spec("torch") is not None
    print(markdown(measure(args.shapes, args.repeats, with_torch)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
