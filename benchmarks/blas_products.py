"""Which BLAS multiplies a small model's matrices fastest on this CPU: NumPy's, PyTorch's, and any other
CBLAS library a user can install (Intel's MKL, a newer OpenBLAS), on gpt-tiny's products.

    python benchmarks/blas_products.py [--threads 1 2] [--rounds 5] [--cblas LIBRARY.so ...] [--out FILE.md]

The products are those of gpt-tiny's linear layers (nanoGPT's CPU recipe: 768 rows, d 128, MLP 512,
V 65), each the three a training step makes, in the layouts :mod:`npformer.kernels.cpu.linear` gives
BLAS: forward ``x @ W^T``, backward ``dout @ W`` and ``dout^T @ x`` (the transposes are views, as
there). Per library and thread count: microseconds for each layer's three products (one call each),
and a step's worth (the four per-layer products times the layers, and the head once), with the ratio
to PyTorch's. Each round times every library once per thread count (the median of 20 calls after 5
untimed ones), the libraries in turn, so a noisy machine weighs on all alike, with a pause after a
library's threads have run (their workers spin a while, on the cores the next library wants); the
table gives the median over the rounds and the quartiles of the step's total across them.

* NumPy: ``numpy.matmul`` into ``out``, its BLAS (the one ``threadpoolctl`` names, with its version
  and the kernels it chose for this CPU) at the thread count;
* PyTorch: ``torch.mm`` into ``out`` (its BLAS: MKL in the x86 wheels), ``torch.set_num_threads``;
  skipped without torch;
* ``--cblas``: a shared library's ``cblas_sgemm`` (or ``scipy_cblas_sgemm``, scipy-openblas's name)
  called through ctypes on the same arrays, its threads set through ``threadpoolctl`` (which knows
  MKL, OpenBLAS and BLIS). MKL from ``pip install mkl`` is
  ``<venv>/lib/libmkl_rt.so.2`` (or ``.so.3``); with ``MKL_THREADING_LAYER=GNU`` it uses the GNU
  OpenMP runtime, without it Intel's (``pip install intel-openmp``).

Every library's products are checked against NumPy's first (float32, relative to the product's
scale); the script refuses a library whose results differ.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time

import numpy
from threadpoolctl import ThreadpoolController

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from npformer.bench.harness import time_call                           # noqa: E402
from npformer.bench.steps import MODELS, model_batch                    # noqa: E402

CBLAS_ROW_MAJOR, CBLAS_NO_TRANS, CBLAS_TRANS = 101, 111, 112
SGEMM_SYMBOLS = ("cblas_sgemm", "scipy_cblas_sgemm")
SETTLE_SECONDS = 0.3      # after a library's threads ran: OpenBLAS's workers spin for about 0.1 s


def layers(model: str = "gpt-tiny") -> list[tuple[str, int, int, int, int]]:
    """(name, rows, in, out, times a step) of each linear layer's products in ``model`` (a GPT), at the
    B * T rows the suite runs it at."""
    m = MODELS[model]
    B, T = model_batch(m)
    rows = B * T
    return [("attention in", rows, m.d, 3 * m.d, m.L), ("attention out", rows, m.d, m.d, m.L),
            ("MLP up", rows, m.d, m.F, m.L), ("MLP down", rows, m.F, m.d, m.L), ("head", rows, m.d, m.V, 1)]


class Operands:
    """One layer's arrays: x (rows, in), W (out, in), dout (rows, out), and the three outputs."""

    def __init__(self, rng, rows: int, c_in: int, c_out: int) -> None:
        self.x = rng.standard_normal((rows, c_in), dtype=numpy.float32)
        self.w = rng.standard_normal((c_out, c_in), dtype=numpy.float32)
        self.dout = rng.standard_normal((rows, c_out), dtype=numpy.float32)
        self.out = numpy.empty((rows, c_out), numpy.float32)       # x @ W^T
        self.dx = numpy.empty((rows, c_in), numpy.float32)         # dout @ W
        self.dw = numpy.empty((c_out, c_in), numpy.float32)        # dout^T @ x

    def expected(self) -> list:
        return [self.x @ self.w.T, self.dout @ self.w, self.dout.T @ self.x]


def limited(filepath: str | None, n: int):
    """A context holding the BLAS library loaded from ``filepath`` (threadpoolctl's controllers) at
    ``n`` threads; ``threadpool_limits`` would set every BLAS loaded, the ones under test included."""
    controller = ThreadpoolController()
    return controller.select(filepath=filepath).limit(limits=n)


class NumpyBlas:
    def __init__(self) -> None:
        blas = [c for c in ThreadpoolController().lib_controllers if c.user_api == "blas"]
        b = blas[0].info() if blas else {}
        self.filepath = b.get("filepath")
        self.name = f"NumPy {numpy.__version__} ({b.get('internal_api', '?')} {b.get('version') or ''}"
        self.name += f", {b['architecture']} kernels)" if b.get("architecture") else ")"

    def calls(self, o: Operands) -> list:
        return [lambda: numpy.matmul(o.x, o.w.T, out=o.out), lambda: numpy.matmul(o.dout, o.w, out=o.dx),
                lambda: numpy.matmul(o.dout.T, o.x, out=o.dw)]

    def results(self, o: Operands) -> list:
        return [o.out, o.dx, o.dw]

    def threads(self, n: int):
        return limited(self.filepath, n)


class TorchBlas:
    def __init__(self, torch) -> None:
        self.torch = torch
        blas = "MKL" if torch.backends.mkl.is_available() else "its BLAS"
        self.name = f"PyTorch {torch.__version__} ({blas})"
        self._t: dict[int, tuple] = {}

    def _tensors(self, o: Operands) -> tuple:
        if id(o) not in self._t:
            f = self.torch.from_numpy
            self._t[id(o)] = (f(o.x), f(o.w), f(o.dout), f(o.out.copy()), f(o.dx.copy()), f(o.dw.copy()))
        return self._t[id(o)]

    def calls(self, o: Operands) -> list:
        x, w, d, out, dx, dw = self._tensors(o)
        mm = self.torch.mm
        return [lambda: mm(x, w.t(), out=out), lambda: mm(d, w, out=dx), lambda: mm(d.t(), x, out=dw)]

    def results(self, o: Operands) -> list:
        return [t.numpy() for t in self._tensors(o)[3:]]

    def threads(self, n: int):
        torch = self.torch

        class _Threads:
            def __enter__(self):
                self.before = torch.get_num_threads()
                torch.set_num_threads(n)

            def __exit__(self, *exc):
                torch.set_num_threads(self.before)
        return _Threads()


class CBlas:
    """A shared library's single-precision GEMM through ctypes (row-major, the transposes as flags)."""

    def __init__(self, path: str) -> None:
        self.lib, self.filepath = ctypes.CDLL(path), path
        found = [s for s in SGEMM_SYMBOLS if hasattr(self.lib, s)]
        if not found:
            raise SystemExit(f"--cblas {path}: expected a library exporting one of {', '.join(SGEMM_SYMBOLS)}")
        self.sgemm = getattr(self.lib, found[0])
        i, f, p = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
        self.sgemm.argtypes = [i, i, i, i, i, i, f, p, i, p, i, f, p, i]
        self.sgemm.restype = None
        known = [c.info() for c in ThreadpoolController().lib_controllers if c.filepath == path]
        if not known:
            raise SystemExit(f"--cblas {path}: threadpoolctl does not know this library, so its threads "
                             "cannot be set (expected MKL, OpenBLAS or BLIS)")
        version = known[0].get("version") or ""
        self.name = f"{os.path.basename(path)} ({known[0]['internal_api']} {version}, {found[0]})"

    def _gemm(self, trans_a: bool, trans_b: bool, a, b, c) -> None:
        """c = op(a) @ op(b) for C-contiguous a, b, c (op: transposed when asked)."""
        m, n = c.shape
        k = a.shape[0] if trans_a else a.shape[1]
        flag = {False: CBLAS_NO_TRANS, True: CBLAS_TRANS}
        self.sgemm(CBLAS_ROW_MAJOR, flag[trans_a], flag[trans_b], m, n, k, 1.0, a.ctypes.data, a.shape[1],
                   b.ctypes.data, b.shape[1], 0.0, c.ctypes.data, n)

    def calls(self, o: Operands) -> list:
        self._out = getattr(self, "_out", {})
        if id(o) not in self._out:
            self._out[id(o)] = (numpy.empty_like(o.out), numpy.empty_like(o.dx), numpy.empty_like(o.dw))
        out, dx, dw = self._out[id(o)]
        return [lambda: self._gemm(False, True, o.x, o.w, out), lambda: self._gemm(False, False, o.dout, o.w, dx),
                lambda: self._gemm(True, False, o.dout, o.x, dw)]

    def results(self, o: Operands) -> list:
        return list(self._out[id(o)])

    def threads(self, n: int):
        return limited(self.filepath, n)


def time_us(fn) -> float:
    """The median of 20 calls after 5 untimed ones (the suite's clock), in microseconds."""
    return 1e3 * time_call(fn, lambda: None, warmup=5, repeats=20, budget_s=1.0)["ms"]


def check(lib, operands: list[Operands]) -> float:
    """The largest error of ``lib``'s products against NumPy's, relative to each product's largest entry."""
    worst = 0.0
    for o in operands:
        for call in lib.calls(o):
            call()
        for got, want in zip(lib.results(o), o.expected()):
            worst = max(worst, float(numpy.max(numpy.abs(got - want)) / numpy.max(numpy.abs(want))))
    return worst


def step_ms(lib, threads: int, model: str = "gpt-tiny", rounds: int = 3) -> float:
    """A step's worth of ``model``'s products (:func:`layers`) through ``lib`` at ``threads`` threads, timed
    alone (each product the median of 20 calls, its operands in the cache): the median over ``rounds``, in
    ms. What ``benchmarks/cpu_profile.py --torch`` sets beside the products timed in a step."""
    rng, shapes = numpy.random.default_rng(0), layers(model)
    operands = [Operands(rng, rows, c_in, c_out) for _, rows, c_in, c_out, _ in shapes]   # alive: TorchBlas keys by id
    layer_calls = [(lib.calls(o), count) for o, (*_, count) in zip(operands, shapes)]
    totals = []
    with lib.threads(threads):
        for _ in range(rounds):
            totals.append(sum(time_us(call) * count for calls, count in layer_calls for call in calls) / 1e3)
    if threads > 1:
        time.sleep(SETTLE_SECONDS)
    return statistics.median(totals)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/blas_products.py", description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cblas", nargs="*", default=[], metavar="LIBRARY", help="shared libraries exporting cblas_sgemm")
    ap.add_argument("--out", default=None, help="also write the table here (markdown)")
    args = ap.parse_args(argv)
    if args.rounds < 2:
        ap.error(f"--rounds: expected at least 2 (for the quartiles), got {args.rounds}")
    libs: list = [NumpyBlas()]
    try:
        import torch
        libs.append(TorchBlas(torch))
    except ImportError:
        print("PyTorch is not installed: its column is left out")
    libs += [CBlas(path) for path in args.cblas]
    rng = numpy.random.default_rng(0)
    shapes = layers()
    operands = [Operands(rng, rows, c_in, c_out) for _, rows, c_in, c_out, _ in shapes]
    for lib in libs[1:]:
        error = check(lib, operands)
        if error > 1e-5:
            raise SystemExit(f"{lib.name}: its products differ from NumPy's by {error:.2e} of their scale "
                             "(expected float32 rounding, under 1e-5)")
    times: dict[tuple, list[float]] = {}
    for _ in range(args.rounds):
        for n in args.threads:
            for lib in libs:
                with lib.threads(n):
                    for o, (name, *_) in zip(operands, shapes):
                        for k, call in enumerate(lib.calls(o)):
                            times.setdefault((lib.name, n, name, k), []).append(time_us(call))
                if n > 1:
                    time.sleep(SETTLE_SECONDS)
    command = f"python benchmarks/blas_products.py --threads {' '.join(map(str, args.threads))} --rounds {args.rounds}"
    if args.cblas:
        command += " --cblas " + " ".join(map(os.path.basename, args.cblas))
    layer = os.environ.get("MKL_THREADING_LAYER")
    lines = [f"# gpt-tiny's matrix products by BLAS library ({os.cpu_count()} CPUs)", "",
             f"`{command}`" + (f" (MKL_THREADING_LAYER={layer})" if layer else "") + ": "
             "us, the median over the rounds; each layer's cell is forward / dx / dW; a step is the layers' "
             "products times their count a step (the quartiles across the rounds in brackets).", "",
             "| library | threads | " + " | ".join(f"{name} ({c_in} -> {c_out})" for name, _, c_in, c_out, _ in shapes)
             + " | a step | against PyTorch |", "|---" * (len(shapes) + 4) + "|"]
    for n in args.threads:
        steps = {}
        for lib in libs:
            per_round = [sum(times[(lib.name, n, name, k)][r] * count for name, _, _, _, count in shapes
                             for k in range(3)) for r in range(args.rounds)]
            steps[lib.name] = per_round
        torch_libs = [lib for lib in libs if isinstance(lib, TorchBlas)]
        torch_step = statistics.median(steps[torch_libs[0].name]) if torch_libs else None
        for lib in libs:
            cells = [" / ".join(f"{statistics.median(times[(lib.name, n, name, k)]):.0f}" for k in range(3))
                     for name, *_ in shapes]
            q = statistics.quantiles(steps[lib.name], n=4)
            step = statistics.median(steps[lib.name])
            ratio = f"{step / torch_step:.2f}x" if torch_step else ""
            lines.append(f"| {lib.name} | {n} | " + " | ".join(cells)
                         + f" | {step:,.0f} [{q[0]:,.0f}, {q[2]:,.0f}] | {ratio} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
