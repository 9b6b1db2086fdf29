"""The CPU-vs-GPU benchmark suite: parity first, then timing, memory, FLOP counts and reports.

``npformer bench`` and ``python benchmarks/run.py`` call :func:`main`. For every case, on every
backend, and for npformer on each path (fast paths on, and the reference ops alone): check parity
with the reference framework (:mod:`npformer.bench.parity`), then time each pass
(:mod:`npformer.bench.harness`); after all timings, measure each row's peak memory. The columns are
explained in the source checkout's ``benchmarks/README.md``.

Layout: harness (clock, memory), backends (the columns, and the registry of references), paths
(fast/reference switch and what ran), cases and steps (what is measured, FLOP counts), parity (the
checks), report (markdown, JSON, plot). Host-side code; cupy is imported only when its backend is
asked for. PyTorch's side is a plug-in that this package never imports:
``benchmarks/torch_reference.py`` of the source checkout registers it, and ``benchmarks/run.py``
imports it before calling :func:`main`.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import gc
import os
import platform
import subprocess
from collections import Counter
from typing import Callable

import numpy
from threadpoolctl import threadpool_limits

from npformer.backend.host_memory import retain_freed_memory
from npformer.bench.backends import REFERENCE, UNREGISTERED, Device, device_name, make_backends, reference_backend
from npformer.bench.cases import (FLASH_TRAIN, FLOPS, FULL, QUICK, fits_memory, flash_sweep_case, flash_train_cases,
                                  op_cases, sweep_case)
from npformer.bench.harness import (SPREAD_LIMIT, busy_machine, fix_malloc_thresholds, load_average, repeats_disagree,
                                    settle, time_call)
from npformer.bench.parity import RTOL, Parity, check, skipped
from npformer.bench.paths import KNOWN, PATHS, fast_paths_run, label, switch
from npformer.bench.report import markdown, write_reports
from npformer.bench.steps import MODELS, model_cases
from npformer.kernels import numba_cpu
from npformer.errors import WriteError
from npformer.files import check_output_dir
from npformer.kernels.cpu.threads import set_num_threads, usable_cpus, within_cpus
from npformer.progress import Progress
from npformer.version import __version__

__all__ = ["run_suite", "main", "build_parser", "source_commit", "cpu_model", "DEFAULT_OUT"]

DEFAULT_OUT = os.path.join("runs", "bench")      # results meant to be kept are written with --out

GPU_ONLY_REASON = "sizes made for a GPU, minutes a step on a CPU"
TIMING_KEYS = ("ms", "q1_ms", "q3_ms", "min_ms", "max_ms", "repeats", "warmup")
MEASURED_KEYS = ("tokens_per_s", "gflops", "peak_share", "peak_mb", "vs_torch", "fast_speedup", "compile_s",
                 "load_1min", "noisy")


def _parity_reference(parity: bool, threads: int) -> Device | Parity:
    """The backend the checks compare with (the reference on the CPU), or the status every npformer
    row gets when there is none."""
    if not parity:
        return skipped("not checked (--skip-parity)")
    reference = reference_backend(REFERENCE, "cpu", threads)
    return skipped(f"unchecked: {UNREGISTERED}", "unchecked") if reference is None else reference


def _peak(case, b, peaks: dict) -> float:
    """The matmul peak a row is a share of (its MFU): the float16 rate for a mixed-precision case."""
    precision = case.precision
    return peaks[precision].get(b.name) or peaks["float32"][b.name]


def _row(case, pas, b, path, parity: Parity, timing: dict | None, ran: list[str] | None, peak: float) -> dict:
    """One JSON row; without ``timing`` (a failed parity check) every measured field is None."""
    row = {"group": case.group, "name": case.name, "pass": pas, "shape": case.shape,
           "precision": case.precision, "T": case.T, "flash": case.flash,
           "backend": b.name, "framework": b.framework, "device": b.device, "path": path,
           "impl": label(ran) if b.framework == "npformer" else b.framework,
           "fast_paths": ran, "parity": parity.status, "parity_error": parity.error,
           "parity_detail": parity.detail, "flops": case.flops[pas], "tokens": case.tokens,
           **dict.fromkeys(TIMING_KEYS + MEASURED_KEYS)}
    if timing is not None:
        sec = timing["ms"] * 1e-3
        row.update(timing, tokens_per_s=case.tokens / sec, gflops=row["flops"] / sec / 1e9,
                   peak_share=row["flops"] / sec / 1e9 / peak, load_1min=load_average(),
                   noisy=repeats_disagree(timing))
    return row


def _parity(case, b, reference: Device | Parity, expected: Callable[[], dict]) -> Parity:
    """``case`` on ``b`` in the current path against the reference's outputs (``expected()``)."""
    if b.framework != "npformer":
        return Parity("reference", None, "")
    if case.parity_skipped:                        # mixed precision: the float32 case is checked
        return skipped(case.parity_skipped)
    if isinstance(reference, Parity):
        return reference
    return check(case, b, expected())


def _time(case, b, path, parity, cfg, peak, log) -> list[dict]:
    """One row per pass of ``case`` on ``b``: what ran (npformer), then the timing."""
    calls, rows = case.build(b), []
    settle(cfg["settle_s"])
    for pas, fn in calls.items():
        ran = fast_paths_run(fn) if b.framework == "npformer" else None     # also a first call
        t = time_call(fn, b.sync, cfg["warmup"], cfg["repeats"], cfg["budget_s"], cfg["warmup_s"])
        rows.append(_row(case, pas, b, path, parity, t, ran, peak))
        rows[-1]["compile_s"] = getattr(fn, "compile_s", None)     # a compiling column's first call
        log(f"  {case.name:<18} {pas:<5} {b.name:<17} {path or '':<9} {rows[-1]['impl'] or '?':<13} "
            f"{t['ms']:9.2f} ms [{t['q1_ms']:.2f}, {t['q3_ms']:.2f}]  {rows[-1]['gflops']:7.1f} GFLOP/s"
            + ("  (repeats disagree)" if rows[-1]["noisy"] else ""))
    return rows


def _measure(case, backends, paths, cfg, peaks, reference, done, log, say_gpu_skips: bool = True) -> list[dict]:
    """Parity, then timing, of ``case`` on each backend (npformer: on each path). A GPU case on a CPU
    backend is skipped, with a line of its own if ``say_gpu_skips``."""
    rows = []
    expected = functools.cache(lambda: case.outputs(reference))        # once per case, when needed
    for b in backends:
        if not b.takes(case):
            continue
        if case.gpu_only and b.device == "cpu":
            if say_gpu_skips:
                log(f"  {case.name} {b.name}: skipped (a GPU case: {GPU_ONLY_REASON})")
            continue
        if case.group == "sweep" and not fits_memory(case, b):
            log(f"  {case.name} {b.name}: skipped (predicted memory over the budget)")
            continue
        for path in paths if b.framework == "npformer" else (None,):
            with switch(path or "fast"):
                parity = _parity(case, b, reference, expected)
                if parity.failed:
                    rows += [_row(case, pas, b, path, parity, None, None, _peak(case, b, peaks))
                             for pas in case.flops]
                    log(f"  {case.name:<18} {b.name:<17} {path}: FAILED parity, not timed: {parity.detail}")
                    continue
                rows += _time(case, b, path, parity, cfg, _peak(case, b, peaks), log)
                done.append((case, b, path))
    return rows


def _sweep(cfg, backends, path, peaks, reference, done, log) -> list[dict]:
    """Attention at growing T, plain, flash, then flash in float16 (GPU backends only); a backend stops
    growing T once fwd+bwd takes ``sweep_stop_s`` or more, or a case is skipped or fails parity."""
    rows = []
    half_flash = functools.partial(flash_sweep_case, dtype="float16")       # GPU backends only
    for b in backends:
        for make in (sweep_case, flash_sweep_case, half_flash):
            for t in cfg["sweep_T"]:
                new = _measure(make(cfg, t), [b], [path], cfg, peaks, reference, done, log)
                rows += new
                timed = [r["ms"] for r in new if r["ms"] is not None]
                if not new or len(timed) < len(new) or sum(timed) / 1e3 >= cfg["sweep_stop_s"]:
                    break
    return rows


def _memory_pass(rows, done, cfg, log) -> None:
    """Peak memory of every timed row, measured after all timings (it takes more calls), with
    glibc's thresholds fixed first so that the allocator the timings saw is left as it was."""
    if any(b.device == "cpu" for _, b, _ in done) and not fix_malloc_thresholds():
        log("note: glibc mallopt unavailable; host peak memory may read low")
    gc.collect()
    gc.freeze()                                           # what is left is long-lived: skip it from now on
    by = {(r["name"], r["pass"], r["backend"], r["path"]): r for r in rows}
    for case, b, path in done:
        with switch(path or "fast"):
            calls = case.build(b)
            for pas, fn in calls.items():
                if case.group == "model":
                    fn()                                  # the first step allocates AdamW's moments
                by[(case.name, pas, b.name, path)]["peak_mb"] = b.peak_mb(fn, cfg["mem_min_s"])
            del calls
    log("peak memory measured")


def _ratios(rows: list[dict]) -> None:
    """vs_torch: npformer time / the reference's (PyTorch's) time of the same case, pass and device;
    fast_speedup: reference-path time / fast-path time of the same case, pass and backend (on both rows)."""
    torch_ms = {(r["name"], r["pass"], r["device"]): r["ms"] for r in rows if r["framework"] == REFERENCE}
    path_ms = {(r["name"], r["pass"], r["backend"], r["path"]): r["ms"] for r in rows}
    for r in rows:
        if r["framework"] != "npformer" or r["ms"] is None:
            continue
        t = torch_ms.get((r["name"], r["pass"], r["device"]))
        r["vs_torch"] = r["ms"] / t if t else None
        fast, ref = (path_ms.get((r["name"], r["pass"], r["backend"], p)) for p in ("fast", "reference"))
        r["fast_speedup"] = ref / fast if fast and ref else None


def _git(root: str, *args: str) -> str:
    return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, timeout=10,
                          check=True).stdout.strip()


def source_commit(root: str | None = None) -> str | None:
    """The git commit of the checkout at ``root`` (default: the one npformer is imported from), with
    "+changes" when its tracked files differ from it; None outside a git checkout or without git. The
    repository must be ``root`` itself: a tree without ``.git`` inside another repository (a copy of
    the checkout, an installed package) has no commit of its own, not its enclosing one's."""
    root = root or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        if os.path.realpath(_git(root, "rev-parse", "--show-toplevel")) != os.path.realpath(root):
            return None
        commit = _git(root, "rev-parse", "--short=7", "HEAD")
        changed = _git(root, "status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+changes" if changed else "")


def cpu_model() -> dict:
    """The CPU's model name and the vector extensions it has of those that decide NumPy's and BLAS's
    speed (from /proc/cpuinfo; empty where there is none): results say which CPU gave them."""
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return {"model": platform.processor() or "unknown", "vector_extensions": []}
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    wanted = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile")
    return {"model": fields.get("model name", "unknown"), "vector_extensions": [f for f in wanted if f in flags]}


def _meta(backends, quick, cfg, paths, reference) -> dict:
    checked = isinstance(reference, Device)
    versions = {"npformer": __version__, "numpy": numpy.__version__, "python": platform.python_version()}
    if numba_cpu.AVAILABLE:
        import numba                                      # the compiled CPU paths' version
        versions["numba"] = numba.__version__
    for b in backends:
        versions.update(b.versions())
    return {"device": device_name(backends), "date": datetime.date.today().isoformat(),
            "mode": "quick" if quick else "full", "threads": backends[0].threads if backends else 0,
            "cpu_count": len(os.sched_getaffinity(0)), "platform": platform.platform(), "cpu": cpu_model(),
            "commit": source_commit(),
            "versions": versions, "backends": [b.name for b in backends], "paths": list(paths),
            "parity": {"rtol": RTOL, "reference": f"{reference.name} float32" if checked else None,
                       "status": "checked" if checked else reference.status},
            "config": {k: v for k, v in cfg.items() if k != "budget_s"}, "flop_counts": FLOPS, "notes": []}


def _gpu_cases_in_brief(gpu_cases) -> str:
    """``gpu_cases`` by name, a family (the flash cases at training shapes) as its name and count: "the
    GPU cases gpt2-124m, seq2seq-d512 and 20 flash-train cases"."""
    families = Counter(c.family for c in gpu_cases if c.family)
    parts = [c.name for c in gpu_cases if not c.family] + [f"{n} {f} cases" for f, n in families.items()]
    listed = ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0]
    return f"the GPU case{'s' if len(gpu_cases) > 1 else ''} {listed}"


def run_suite(backends: list[Device], quick: bool, paths=PATHS, parity: bool = True, only=None,
              log: Callable[[str], None] = print) -> dict:
    """Check and time every case (or those named in ``only``; "sweep" for the attention sweep) on
    every backend, npformer on each of ``paths`` (the sweep on the first); the JSON-ready result."""
    cfg = QUICK if quick else FULL
    reference = _parity_reference(parity, backends[0].threads if backends else 1)
    peaks: dict = {"float32": {}, "float16": {}, "bfloat16": {}}   # measured here: the MFU's denominators
    for b in backends:
        for precision in ("float32", "float16", "bfloat16") if b.device == "cuda" else ("float32",):
            settle(cfg["settle_s"])
            peaks[precision][b.name] = b.matmul_gflops(cfg["matmul_n"], cfg["budget_s"], cfg["warmup_s"], precision)
            log(f"matmul peak {b.name} {precision}: {peaks[precision][b.name]:.1f} GFLOP/s")
    rows, done, notes = [], [], []                        # done: (case, backend, path) for the memory pass
    load = {"start": load_average(), "cpus": usable_cpus()}   # before any timing: the others' load
    busy = busy_machine(load["start"], backends[0].threads if backends else 1, load["cpus"])
    if busy:
        log(f"warning: {busy}")
        notes.append(busy)
    cases = [c for c in op_cases(cfg) + model_cases(cfg, quick) + flash_train_cases()
             if only is None or c.name in only or c.family in only]
    gpu_cases = [c for c in cases if c.gpu_only]
    cpus = [b.name for b in backends if b.device == "cpu"]
    if gpu_cases and cpus:
        notes.append(f"GPU cases skipped on the CPU backends ({GPU_ONLY_REASON}): "
                     f"{', '.join(c.name for c in gpu_cases)}")
        if only is None:                                  # one line for them all; a case named by --only has its own
            log(f"skipped on {', '.join(cpus)}: {_gpu_cases_in_brief(gpu_cases)} ({GPU_ONLY_REASON}; "
                f"--only NAME runs one where a GPU is)")
    sweep = only is None or "sweep" in only
    with Progress(len(cases) + sweep, "bench", unit="case", log=log) as progress:   # (the sweep: one more)
        for case in cases:
            rows += _measure(case, backends, paths, cfg, peaks, reference, done, progress.write,
                             say_gpu_skips=only is not None)
            progress.update(note=lambda: case.name)
        if sweep:
            rows += _sweep(cfg, backends, paths[0], peaks, reference, done, progress.write)
            progress.update(note=lambda: "sweep")
    _memory_pass(rows, done, cfg, log)
    _ratios(rows)
    noisy = [f"{r['name']} {r['pass']} {r['backend']}" + (f" {r['path']}" if r["path"] else "")
             for r in rows if r["noisy"]]
    if noisy:
        notes.append(f"repeats disagree (interquartile range over {SPREAD_LIMIT:.0%} of the median) in "
                     f"{len(noisy)} of {len(rows)} rows: " + ", ".join(noisy[:8]) + (", ..." if len(noisy) > 8 else "")
                     + "; their medians are not to be trusted")
        log(f"warning: {notes[-1]}")
    meta = _meta(backends, quick, cfg, paths, reference)
    meta["notes"] = notes
    meta["load"] = {**load, "end": load_average()}
    return {"meta": meta, "matmul_peak_gflops": peaks["float32"], "matmul_peak_gflops_float16": peaks["float16"],
            "matmul_peak_gflops_bfloat16": peaks["bfloat16"],
            "rows": rows}


def _names(text: str) -> list[str]:
    return [n.strip().lower() for n in text.split(",") if n.strip()]


def build_parser(parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of ``npformer bench``, on a parser of ``parser_class`` (the command line's, whose
    usage errors are one line)."""
    ap = parser_class(prog="npformer bench", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, few repeats (about a minute on CPU)")
    ap.add_argument("--backends", default="numpy,cupy,torch",
                    help="comma list of numpy, cupy, torch (PyTorch's columns: a reference registered by the "
                         "source checkout's benchmarks/run.py)")
    ap.add_argument("--paths", default=",".join(PATHS),
                    help="npformer paths to time: fast (fast paths on), numpy (the fast paths without numba's: "
                         "NumPy alone), reference (the plain ops alone); default fast,reference; the attention "
                         "sweep runs on the first")
    ap.add_argument("--only", help="comma list of cases to run (e.g. linear,gpt-small,sweep,flash-train: the flash "
                    "cases at training shapes, GPU only); default all")
    ap.add_argument("--skip-parity", action="store_true", help="time without checking parity first")
    ap.add_argument("--tf32", action="store_true", help="float32 matmuls on TF32 tensor cores in both libraries "
                    "(CuPy: npformer.backend.set_float32_matmul_precision; PyTorch: allow_tf32); GPU only")
    ap.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    ap.add_argument("--threads", type=int, default=usable_cpus(),
                    help="CPU threads for PyTorch, and numpy's BLAS through threadpoolctl, at most the CPUs "
                         "this process may use (default: all of them)")
    return ap


def main(argv: list[str] | None = None,
         parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser) -> int:
    ap = build_parser(parser_class)
    args = ap.parse_args(argv)
    if args.threads < 1:
        ap.error(f"--threads: expected a positive count, got {args.threads}")
    try:
        check_output_dir(args.out, "--out")       # before the cases are measured, not after
    except ValueError as exc:
        ap.error(str(exc))
    args.threads, capped = within_cpus(args.threads, "--threads")
    paths = _names(args.paths)
    if not paths or set(paths) - set(KNOWN):
        ap.error(f"--paths: expected a comma list of {', '.join(KNOWN)}, got {args.paths!r}")
    only, known = None, {c.name for c in op_cases(QUICK)} | set(MODELS) | {"sweep", FLASH_TRAIN}
    if args.only is not None:
        only = set(_names(args.only))
        if not only or only - known:
            ap.error(f"--only: expected a comma list of {', '.join(sorted(known))}, got {args.only!r}")
    try:
        backends, notes = make_backends(_names(args.backends), args.threads)
    except ValueError as exc:
        ap.error(str(exc))
    threadpool_limits(args.threads)                       # numpy's BLAS threads to match torch's
    set_num_threads(args.threads)                         # and npformer's own pool
    if any(b.device == "cpu" for b in backends) and retain_freed_memory():
        notes.append("host allocator: glibc malloc keeps freed memory for reuse while timing "
                     "(npformer.backend.host_memory.retain_freed_memory, as npformer train does), for both libraries")
    notes += [capped] if capped else []
    for note in notes:
        print("note:", note)
    if not backends:
        ap.error("no backend can run here")
    if args.tf32:
        if not any(b.device == "cuda" for b in backends):
            ap.error("--tf32: TF32 is a tensor-core mode of NVIDIA GPUs; no GPU backend runs here")
        for b in backends:
            if b.device == "cuda":
                b.allow_tf32()
        notes.append("TF32: float32 matmuls on TF32 tensor cores (10-bit mantissa inputs) in both libraries")
    result = run_suite(backends, args.quick, paths, not args.skip_parity, only)
    result["meta"]["notes"] = notes + result["meta"]["notes"]
    try:
        written = write_reports(result, args.out)
    except WriteError:            # the measurements are not lost with the files: the table on stdout
        print(markdown(result))
        raise
    for kind, path in written.items():
        print(f"wrote {kind}: {path}")
    return 0
