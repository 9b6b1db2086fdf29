"""Nsight Compute on the flash attention kernels (issue 42): one command on a GPU machine gives each kernel's
time, registers, occupancy, issue-slot use and the instructions it executed per HMMA, the figure that
``benchmarks/cuda_kernels.py`` predicts from the SASS without a GPU (its "instructions per HMMA" column counts
the main loop's instructions once each; the executed count here includes every branch taken and the work
outside the loop, so it is the figure the prediction is checked against). The table gives that prediction
beside each launch ("SASS loop per HMMA", for the device's compute capability, from the report as committed
in ``benchmarks/results``).

    python benchmarks/flash_profile.py OUT_FILE [--ncu PATH] [--timeout SECONDS]
    python benchmarks/flash_profile.py --probe [--backend numpy] [--small]

The first form runs ``ncu`` over the second (the probe) and writes OUT_FILE: a table, a row per kernel
launch, then Nsight Compute's own report of the sections below. The probe runs each case of :data:`CASES`
(float16, B4 H16 T4096: head size 64 causal and not, 128 causal, the dense kernels' common cases and the
shapes of the first H200 profile) forward and backward once to compile and warm, then once more between
``cudaProfilerStart`` and ``cudaProfilerStop``, which is what ncu profiles (``--profile-from-start off``);
on compute capability 9.0 it runs each case again on the Hopper (wgmma) kernels. ``--backend numpy --small``
runs the probe's cases on the CPU at a small shape (what the tests do: a probe broken by an API change is
found before a GPU lease is spent on it).

Times are at the clock ncu locks the GPU to (its base clock, ``--clock-control base``): compare them with
each other, and the sweep's TFLOP/s with SDPA's. The metrics asked for beyond the sections are the ones
this ncu knows (``ncu --query-metrics``), so an older or newer ncu that lacks one still profiles; a column
whose metric is missing reads "-". ``benchmarks/gpu_check.sh`` runs this as its ncu stage.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import os
import re
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

__all__ = ["Case", "CASES", "SECTIONS", "WANTED_METRICS", "probe", "known_metrics", "ncu_command",
           "read_raw_csv", "sass_per_hmma", "table", "main"]


@dataclasses.dataclass(frozen=True)
class Case:
    dtype: str
    B: int
    H: int
    T: int
    D: int
    causal: bool

    def label(self) -> str:
        return f"{self.dtype} B{self.B} H{self.H} T{self.T} D{self.D}" + (" causal" if self.causal else "")


CASES = (Case("float16", 4, 16, 4096, 64, True), Case("float16", 4, 16, 4096, 64, False),
         Case("float16", 4, 16, 4096, 128, True))
SMALL = dict(B=1, H=2, T=80)            # --small: a ragged last tile at every tile size

SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "ComputeWorkloadAnalysis", "SchedulerStats",
            "WarpStateStats", "InstructionStats")
# The table's columns: (heading, the raw metrics that can give it, first known wins)
COLUMNS = (
    ("time us", ("gpu__time_duration.sum",)),
    ("registers", ("launch__registers_per_thread",)),
    ("occupancy %", ("sm__maximum_warps_per_active_cycle_pct",)),
    ("achieved %", ("sm__warps_active.avg.pct_of_peak_sustained_active",)),
    ("issue busy %", ("smsp__issue_active.avg.pct_of_peak_sustained_active",)),
    ("tensor pipe %", ("sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
                       "sm__inst_executed_pipe_tensor_op_hmma.avg.pct_of_peak_sustained_active")),
    ("instructions", ("smsp__inst_executed.sum", "sm__inst_executed.sum")),
    ("HMMA", ("sm__inst_executed_pipe_tensor_op_hmma.sum", "smsp__inst_executed_pipe_tensor_op_hmma.sum")),
)
WANTED_METRICS = tuple(m for _, names in COLUMNS for m in names)
KERNELS = "regex:npf_fa_"               # every flash kernel (the forward, bwd_pre, dQ, dK dV)


# -- the probe: what ncu profiles ------------------------------------------------------------------------------

def probe(backend: str = "cupy", small: bool = False, log=print) -> int:
    """Run every case forward and backward, warm, then again inside the profiler's range; the number of
    cases run. On CuPy with compute capability 9.0 every case runs again on the Hopper kernels, after the
    dense ones, so a failure there leaves the dense kernels' launches profiled."""
    import numpy
    from npformer.backend import get_backend
    xp = get_backend(backend)
    on_gpu = backend == "cupy"
    hopper = False
    if on_gpu:
        from npformer.kernels.cuda import flash_attention as cuda_flash
        from npformer.kernels.cuda import runtime
        hopper = runtime.compute_capability() == 90
    rng = numpy.random.default_rng(0)
    ran = 0
    for wgmma in (False, True) if hopper else (False,):
        if on_gpu:
            cuda_flash.use_wgmma(wgmma)
        try:
            ran += _run_cases(xp, rng, small, on_gpu, wgmma, log)
        finally:
            if on_gpu:
                cuda_flash.use_wgmma(False)
    return ran


def _run_cases(xp, rng, small: bool, on_gpu: bool, wgmma: bool, log) -> int:
    """:func:`probe`'s loop over the cases, on the kernels now chosen (dense or Hopper); the cases run."""
    from npformer.ops.flash_attention import flash_attention_backward, flash_attention_forward
    ran = 0
    for case in CASES:
        case = dataclasses.replace(case, **(SMALL if small else {}))
        q, k, v, dout = (xp.asarray(rng.standard_normal((case.B, case.H, case.T, case.D)).astype(case.dtype))
                         for _ in range(4))

        def once():
            out, cache = flash_attention_forward(q, k, v, is_causal=case.causal)
            return (out, *flash_attention_backward(dout, cache))

        once()                                         # compile (NVRTC) and warm
        if on_gpu:
            xp.cuda.Device().synchronize()
            xp.cuda.runtime.profilerStart()
        results = once()
        if on_gpu:
            xp.cuda.Device().synchronize()
            xp.cuda.runtime.profilerStop()
        if not all(bool(xp.isfinite(r).all()) for r in results):
            raise RuntimeError(f"flash attention gave a non-finite result for {case.label()}")
        log(f"profiled: {case.label()}{' (wgmma)' if wgmma else ''}")
        ran += 1
    return ran


# -- ncu ---------------------------------------------------------------------------------------------------------

def known_metrics(query_output: str) -> set:
    """The base metric names in ``ncu --query-metrics``'s listing (a name, then its description, a line each)."""
    names = set()
    for line in query_output.splitlines():
        word = line.split(maxsplit=1)[0] if line.strip() else ""
        if "__" in word:
            names.add(word)
    return names


def ncu_command(ncu: str, report: str, known: set | None) -> list:
    """The ncu argv profiling the probe into ``report`` (.ncu-rep): the sections, and the wanted metrics
    that ``known`` has (all of them when ``known`` is None: the query failed)."""
    metrics = [m for m in WANTED_METRICS if known is None or m.split(".")[0] in known]
    argv = [ncu, "--profile-from-start", "off", "--kernel-name", KERNELS, "--export", report, "--force-overwrite"]
    for section in SECTIONS:
        argv += ["--section", section]
    if metrics:
        argv += ["--metrics", ",".join(metrics)]
    return argv + [sys.executable, os.path.abspath(__file__), "--probe"]


def read_raw_csv(text: str) -> list:
    """The launches of ``ncu --import REPORT --page raw --csv --print-units base``: a dict per launch (column
    -> value), the units row and ncu's own lines before the header left out. The details page's long form
    (a row per metric: "Metric Name", "Metric Value") is read too, a launch's rows gathered by its ID."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if '"Kernel Name"' in line), None)
    if start is None:
        return []
    rows = [r for r in csv.DictReader(io.StringIO("\n".join(lines[start:])))
            if (r.get("ID") or "").strip().isdigit()]
    if not rows or "Metric Name" not in rows[0]:
        return rows
    launches: dict = {}
    for r in rows:
        launch = launches.setdefault(r["ID"], {k: v for k, v in r.items() if not k.startswith(("Metric", "Section"))})
        launch[r["Metric Name"]] = r["Metric Value"]
    return list(launches.values())


def _number(value):
    try:
        return float(str(value).replace(",", ""))
    except ValueError:
        return None


def _short_name(kernel: str) -> str:
    """``void npf_fa_kernel<NpfFaFwdDense<64, true>>(NpfFaParams<...>)`` -> ``NpfFaFwdDense<64, true>``."""
    found = re.search(r"npf_fa_kernel<(.*)>\s*\(", kernel)
    return found.group(1) if found else kernel.split("(")[0]


def sass_per_hmma(arch: int, results: str = os.path.join(ROOT, "benchmarks", "results")) -> dict:
    """The main loop's instructions per HMMA that ``benchmarks/cuda_kernels.py`` read from the SASS for
    ``sm_<arch>`` (its report in ``results``, as committed), by kernel as ncu names it (:func:`_short_name`,
    spaces dropped): ``{"NpfFaFwdDense<unsignedshort,64,true>": "5.3", ...}``; empty without the report."""
    from npformer.kernels.cuda.runtime import shipped_modules
    path = os.path.join(results, f"cuda-kernels-sm{arch}.md")
    if not os.path.exists(path):
        return {}
    traits = {name: re.sub(r"^npf_fa_kernel<(.*)>$", r"\1", expression).replace(" ", "")
              for module in shipped_modules().values() for name, expression in module.kernels.items()}
    found, column = {}, None
    with open(path) as f:
        for line in f:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if "per HMMA" in cells and "loop instructions" in cells:         # the main loops' table
                column = cells.index("per HMMA")
            elif column is None or not line.startswith("|"):
                column = None
            elif len(cells) > column and cells[1] in traits:
                found[traits[cells[1]]] = cells[column]
    return found


def table(rows: list, sass: dict | None = None) -> str:
    """A markdown table, a row per launch: the kernel (its traits), grid, then :data:`COLUMNS`, instructions
    per HMMA where both counts are there, and beside them what the SASS predicted (``sass``:
    :func:`sass_per_hmma`; the main loop's body counted once, every branch in it, where ncu counts what ran:
    the loop, the masked tiles and the work around them)."""
    def pick(row, names):
        return next((_number(row[n]) for n in names if n in row and _number(row[n]) is not None), None)

    sass = sass or {}
    heads = ["kernel", "grid x block"] + [h for h, _ in COLUMNS] + ["per HMMA", "SASS loop per HMMA"]
    out = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for row in rows:
        values = [pick(row, names) for _, names in COLUMNS]
        cells = [_short_name(row.get("Kernel Name", "")),
                 f"{row.get('Grid Size', '?')} x {row.get('Block Size', '?')}"]
        for (head, _), v in zip(COLUMNS, values):
            cells.append("-" if v is None else f"{v / 1e3:.1f}" if head == "time us" else
                         f"{v:.0f}" if head in ("registers", "instructions", "HMMA") else f"{v:.1f}")
        inst, hmma = values[-2], values[-1]
        cells.append(f"{inst / hmma:.2f}" if inst and hmma else "-")
        cells.append(sass.get(cells[0].replace(" ", ""), "-"))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def profile(out_file: str, ncu: str, timeout: float) -> int:
    """Profile the probe under ncu and write ``out_file`` within ``timeout`` seconds; the exit status (1 when
    ncu failed or profiled nothing)."""
    from benchmarks.gpu_check import run_command
    from npformer.bench.suite import source_commit
    deadline = time.monotonic() + timeout

    def run(argv, cap, keep_back=0.0):                 # within the deadline, ``keep_back`` seconds left after
        return run_command(argv, max(1.0, min(cap, deadline - time.monotonic() - keep_back)))

    code, query = run([ncu, "--query-metrics"], 30)
    known = known_metrics(query) if code == 0 else None
    _, version = run([ncu, "--version"], 30)
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "flash")
        argv = ncu_command(ncu, report, known)
        code, output = run(argv, timeout, keep_back=20)         # 20 s for the two imports below
        unknown = [m for m in WANTED_METRICS if known is not None and m.split(".")[0] not in known]
        header = [f"# Nsight Compute on npformer's flash attention kernels (npformer {source_commit(ROOT)})", "",
                  version.strip().splitlines()[-1] if version.strip() else "ncu: no version",
                  "command: " + " ".join(argv).replace(report, "REPORT"),
                  "ncu --query-metrics failed: every metric asked for" if known is None else
                  "metrics this ncu does not know (not asked for): " + (", ".join(unknown) or "none"), ""]
        status = "timed out" if code is None else f"failed (exit {code})"
        rep = report + ".ncu-rep"
        if not os.path.exists(rep):
            text = "\n".join(header + [f"ncu {status}, no report:", output])
            _write(out_file, text, text)
            return 1
        # a report is read even after a failure: the launches profiled before it (the dense kernels run
        # before the Hopper ones) are kept
        _, raw = run([ncu, "--import", rep, "--page", "raw", "--csv", "--print-units", "base"], 60)
        _, details = run([ncu, "--import", rep], 60)
    rows = read_raw_csv(raw)
    arch = _number(rows[0].get("CC")) if rows else None         # the device's compute capability, "9.0"
    try:
        sass, unread = (sass_per_hmma(round(arch * 10)) if arch else {}), []
    except Exception as error:                                   # the measurements are kept without it
        sass, unread = {}, [f"the SASS's figures could not be read: {type(error).__name__}: {error}"]
    probed = [line for line in output.splitlines() if line.startswith("profiled:")] + unread
    failed = [] if code == 0 else [f"ncu {status}; the launches below are those profiled before it. Its output's end:",
                                   *output.strip().splitlines()[-12:], ""]
    body = table(rows, sass) if rows else "no launches in ncu's raw page:\n" + raw
    summary = "\n".join(header + failed + probed + ["", body])
    _write(out_file, summary + "\n\n" + details, summary)
    return 0 if rows and code == 0 else 1


def _write(path: str, text: str, shown: str) -> None:
    """Write the report ``text`` and print ``shown`` (the table and what ran, not ncu's long report)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text + "\n")
    print(shown)


def main(argv: list | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/flash_profile.py", description=__doc__.split("\n")[0])
    ap.add_argument("out", nargs="?", metavar="OUT_FILE", help="the report (needs ncu and a GPU)")
    ap.add_argument("--ncu", default=None, help="ncu's path (default: ncu on the PATH)")
    ap.add_argument("--timeout", type=float, default=240, help="seconds for it all (default 240)")
    ap.add_argument("--probe", action="store_true", help="run the cases (what ncu profiles)")
    ap.add_argument("--backend", default="cupy", choices=("cupy", "numpy"), help="the probe's backend")
    ap.add_argument("--small", action="store_true", help="the probe at a small shape (B1 H2 T80)")
    args = ap.parse_args(argv)
    if args.probe:
        probe(args.backend, args.small)
        return 0
    if not args.out:
        ap.error("OUT_FILE is needed (or --probe)")
    ncu = args.ncu or shutil.which("ncu")
    if not ncu:
        print("flash_profile: ncu (Nsight Compute) is not on the PATH; give --ncu PATH", file=sys.stderr)
        return 2
    return profile(args.out, ncu, args.timeout)


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    sys.exit(main())
