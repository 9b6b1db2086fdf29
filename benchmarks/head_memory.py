"""The memory and time of a language model's last step, its head and loss, two ways on NumPy: the
separate ops (the (N, V) logits, the cross-entropy, its gradient, the head's backward) and
``linear_cross_entropy`` in chunks of rows (what the GPT trainers run). No PyTorch.

    python benchmarks/head_memory.py [--rows 1024] [--vocab 50257] [--d 768] [--dtype float32]
                                     [--chunk-bytes N] [--repeats 3] [--out FILE.json]

Each way runs once to check that they agree (loss, dx, dW), then its peak of NumPy's allocations is
read by tracemalloc (NumPy reports every array it allocates; BLAS's own buffers are not counted),
then it is timed (warm-up, the median of ``--repeats``, quartiles). The defaults are GPT-2's head
(V 50257, d 768) over 1024 rows; a GPT-2 step has 8192 (B 8, T 1024), whose logits alone take 1.6 GB
in float32, and the same again for their gradient.
"""
from __future__ import annotations

import argparse
import json
import sys
import tracemalloc
from pathlib import Path

import numpy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from npformer.bench.harness import time_call  # noqa: E402
from npformer.ops import linear_cross_entropy as lce  # noqa: E402
from npformer.ops.cross_entropy import cross_entropy_backward, cross_entropy_forward  # noqa: E402
from npformer.ops.linear import linear_backward, linear_forward  # noqa: E402

MIB = 1 << 20


def unfused(x, w, t):
    """The head and the loss as separate ops: the whole (N, V) logits and their gradient."""
    z, lin = linear_forward(x, w)
    acc = numpy.float32 if x.dtype.itemsize < 4 else x.dtype
    loss, ce = cross_entropy_forward(z.astype(acc, copy=False), t)
    dz = cross_entropy_backward(numpy.ones((), acc), ce).astype(x.dtype, copy=False)
    dx, dw, _ = linear_backward(dz, lin)
    return loss, dx, dw


def chunked(x, w, t, rows: int):
    r = lce.linear_cross_entropy(x, w, t, chunk_rows=rows)
    return r.loss, r.dx, r.dweight


def peak_bytes(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--d", type=int, default=768)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--chunk-bytes", type=int, default=lce.LOGITS_CHUNK_BYTES,
                   help="a chunk's logits at most this many bytes (default %(default)s)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    rng = numpy.random.default_rng(0)
    x = rng.standard_normal((a.rows, a.d)).astype(a.dtype)
    w = (0.02 * rng.standard_normal((a.vocab, a.d))).astype(a.dtype)
    t = rng.integers(0, a.vocab, a.rows)
    rows = lce.chunk_rows_for(a.rows, a.vocab, numpy.dtype(a.dtype).itemsize, budget=a.chunk_bytes)
    want, got = unfused(x, w, t), chunked(x, w, t, rows)
    for name, g, r in zip(("loss", "dx", "dW"), got, want):
        scale = float(numpy.abs(r).max()) or 1.0
        err = float(numpy.abs(g.astype(numpy.float64) - r.astype(numpy.float64)).max()) / scale
        print(f"{name}: largest difference {err:.1e} of the largest element")
    print(f"N {a.rows} rows, V {a.vocab}, d {a.d}, {a.dtype}; chunks of {rows} rows "
          f"({-(-a.rows // rows)} chunks); logits {a.rows * a.vocab * numpy.dtype(a.dtype).itemsize / MIB:.0f} MiB")
    report = {"rows": a.rows, "vocab": a.vocab, "d": a.d, "dtype": a.dtype, "chunk_rows": rows}
    for name, fn in (("unfused", unfused), ("chunked", lambda x, w, t: chunked(x, w, t, rows))):
        peak = peak_bytes(lambda: fn(x, w, t))
        timing = time_call(lambda: fn(x, w, t), lambda: None, warmup=1, repeats=a.repeats, budget_s=60)
        report[name] = {"peak_mib": peak / MIB, **timing}
        print(f"{name:8s} peak {peak / MIB:8.1f} MiB   {timing['ms']:9.1f} ms "
              f"(quartiles {timing['q1_ms']:.1f}-{timing['q3_ms']:.1f})")
    if a.out:
        a.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
