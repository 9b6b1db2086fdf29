"""The reports of a run: JSON (every row), markdown (summary, parity, sweep, every row), PNG plot.

A report column is a backend and, for npformer, a path: ``numpy`` (fast paths on), ``numpy ref``
(the reference ops alone), ``torch-cpu``. A row that failed parity shows ``FAILED parity``
instead of a time. Host-side only; matplotlib is optional.
"""
from __future__ import annotations

import json
import os
from typing import Callable

from npformer.bench.backends import NPFORMER, TORCH_BESIDE
from npformer.errors import WriteError
from npformer.files import os_reason, write_text_atomically, written_atomically

__all__ = ["columns", "markdown", "plot", "write_reports", "sweep_label"]

FAILED = "FAILED parity"


def _f(v, fmt="{:.2f}"):
    return "-" if v is None else fmt.format(v)


PATH_TITLES = {"reference": " ref", "numpy": " no-numba"}     # "fast" (and a reference's column): none


def _title(backend: str, path: str | None) -> str:
    """A column's name: the backend, and the npformer path unless it is the fast one."""
    return backend + PATH_TITLES.get(path, "")


def columns(meta: dict) -> list[tuple[str, str | None]]:
    """(backend, path) of every report column, in order: npformer's per path, a reference's one."""
    return [(b, p) for b in meta["backends"] for p in (meta["paths"] if b in NPFORMER else [None])]


def _table(spec: list[tuple[str, Callable]], items) -> list[str]:
    """A markdown table from (title, cell function) pairs, one line per item."""
    return (["| " + " | ".join(t for t, _ in spec) + " |", "|" + "---|" * len(spec)]
            + ["| " + " | ".join(str(cell(it)) for _, cell in spec) + " |" for it in items])


def _summary(result, by) -> list[str]:
    meta, rows = result["meta"], result["rows"]
    cols, names, first = columns(meta), meta["backends"], meta["paths"][0]
    npf = [n for n in names if n in NPFORMER]

    def ms(col):
        def cell(key):
            r = by.get(key[:2] + col)
            return "-" if r is None else FAILED if r["ms"] is None else \
                f"{r['ms']:.2f} [{r['q1_ms']:.2f}, {r['q3_ms']:.2f}]" + ("~" if r.get("noisy") else "")
        return cell

    def field(n, path, name, fmt):
        return lambda key: _f((by.get(key[:2] + (n, path)) or {}).get(name), fmt)
    spec = [("case", lambda k: k[0]), ("pass", lambda k: k[1]), ("shape", lambda k: k[2]),
            ("GFLOP", lambda k: f"{k[3] / 1e9:.3f}")]
    spec += [(f"{n} impl", field(n, "fast", "impl", "{}")) for n in npf if "fast" in meta["paths"]]
    spec += [(f"{_title(*c)} ms", ms(c)) for c in cols]
    if set(meta["paths"]) == {"fast", "reference"}:
        spec += [(f"{n} fast speed-up", field(n, "fast", "fast_speedup", "{:.2f}x")) for n in npf]
    spec += [(f"{_title(n, first)}/{TORCH_BESIDE[n]}", field(n, first, "vs_torch", "{:.2f}x"))
             for n in npf if TORCH_BESIDE[n] in names]
    spec += [(f"{_title(*c)} MFU", _mfu(by, c)) for c in cols]
    if "numpy" in names and "cupy" in names:
        def gpu(key):
            cpu, dev = by.get(key[:2] + ("numpy", first)), by.get(key[:2] + ("cupy", first))
            return f"{cpu['ms'] / dev['ms']:.1f}x" if cpu and dev and cpu["ms"] and dev["ms"] else "-"
        spec.append(("GPU speed-up", gpu))
    keys = dict.fromkeys((r["name"], r["pass"], r["shape"], r["flops"]) for r in rows if r["group"] != "sweep")
    return ["## Summary: median ms [IQR] per column", ""] + _table(spec, keys)


def _mfu(by, col) -> Callable:
    """A training step's model FLOPs per second over the same column's measured matmul peak of the
    step's precision (both from this run); ops show "-" (their share is in the detail table)."""
    def cell(key):
        r = by.get(key[:2] + col)
        return "-" if r is None or r["group"] != "model" or r["peak_share"] is None else f"{100 * r['peak_share']:.1f}%"
    return cell


def _parity(result) -> list[str]:
    fields = ("name", "backend", "path", "parity", "parity_error", "parity_detail")
    checks = dict.fromkeys(tuple(r[k] for k in fields) for r in result["rows"] if r["framework"] == "npformer")
    spec = [("case", lambda c: c[0]), ("backend", lambda c: c[1]), ("path", lambda c: c[2]),
            ("parity", lambda c: c[3]), ("worst error", lambda c: _f(c[4], "{:.1e}")),
            ("worst output", lambda c: c[5] or "-")]
    p = result["meta"]["parity"]
    rule = (f"npformer's outputs and gradients against {p['reference']} on the same inputs and weights, "
            f"before timing: max abs diff <= {p['rtol']:.2g} x max abs reference, per array"
            if p["reference"] else f"parity {p['status']}")
    return ["## Parity", "", rule + ".", ""] + _table(spec, checks)


def _sweep(result, by) -> list[str]:
    sweep = [r for r in result["rows"] if r["group"] == "sweep"]
    cols = list(dict.fromkeys((r["backend"], r["path"]) for r in sweep))

    def cells(col):
        def pair(name, fmt, key):
            f, b = by.get((name, "fwd") + col), by.get((name, "bwd") + col)
            if f is None or b is None:
                return "-"
            return FAILED if f["ms"] is None else f"{_f(f[key], fmt)} / {_f(b[key], fmt)}"
        return [(f"{_title(*col)} ms", lambda n: pair(n, "{:.1f}", "ms")),
                (f"{_title(*col)} MB", lambda n: pair(n, "{:.0f}", "peak_mb"))]
    label = {r["name"]: sweep_label(r) for r in sweep}
    spec = [("T", lambda n: label[n])] + [c for col in cols for c in cells(col)]
    return ["## Attention sweep: ms (fwd / bwd) and peak MB (fwd / bwd)", ""] + _table(spec, label)


def sweep_label(row: dict) -> str:
    """A sweep row's line, from its fields: ``1024``, ``flash 1024``, ``flash 1024 float16``."""
    precision = "" if row["precision"] == "float32" else f" {row['precision']}"
    return ("flash " if row["flash"] else "") + f"{row['T']}{precision}"


def _detail(result) -> list[str]:
    def col(title, key, fmt="{:.2f}", scale=1):
        return title, lambda r: _f(None if r[key] is None else r[key] * scale, fmt)

    def spread(lo, hi):
        return lambda r: "-" if r["ms"] is None else f"{r[lo]:.3f}-{r[hi]:.3f}"
    spec = [col("case", "name", "{}")] + [col(k, k, "{}") for k in ("pass", "backend", "path", "impl", "parity")]
    spec += [col("ms", "ms", "{:.3f}"), ("IQR", spread("q1_ms", "q3_ms")), ("min-max", spread("min_ms", "max_ms")),
             col("n", "repeats", "{}"), col("warm-up", "warmup", "{}"), col("tokens/s", "tokens_per_s", "{:.0f}"),
             col("GFLOP/s", "gflops", "{:.1f}"), col("% peak", "peak_share", "{:.1f}", 100),
             col("vs torch", "vs_torch"), col("fast speed-up", "fast_speedup"),
             col("peak MB", "peak_mb", "{:.1f}"), col("compile s", "compile_s", "{:.1f}")]
    return ["## Every row", ""] + _table(spec, result["rows"])


def markdown(result: dict) -> str:
    """The summary table (columns per backend and path), parity, the sweep, and every row."""
    meta, rows, peaks = result["meta"], result["rows"], result["matmul_peak_gflops"]
    by = {(r["name"], r["pass"], r["backend"], r["path"]): r for r in rows}
    lines = [f"# npformer benchmarks: {meta['device']}, {meta['date']} ({meta['mode']} mode)", "",
             f"Threads: {meta['threads']} of {meta['cpu_count']} CPUs; versions: "
             + ", ".join(f"{k} {v}" for k, v in meta["versions"].items())
             + (f"; commit {meta['commit']}" if meta.get("commit") else "") + ".",
             "Float32 matmul peak (GFLOP/s, same run): "
             + ", ".join(f"{k} {v:.1f}" for k, v in peaks.items()) + "."]
    for half in ("float16", "bfloat16"):
        if result.get(f"matmul_peak_gflops_{half}"):
            lines.append(f"{half.capitalize()} matmul peak (tensor cores, float32 accumulation; the {half} rows' MFU): "
                         + ", ".join(f"{k} {v:.1f}" for k, v in result[f"matmul_peak_gflops_{half}"].items()) + ".")
    load = meta.get("load")
    if load:
        said = lambda v: "unknown" if v is None else f"{v:.1f}"             # noqa: E731
        lines.append(f"Load average (1 min): {said(load['start'])} before the run, {said(load['end'])} after; "
                     f"{load['cpus']} usable CPUs. A row marked ~ had repeats that disagree (see the notes).")
    lines += ["MFU: a training step's matmul FLOPs per second over the matmul peak measured above.", ""]
    lines += [f"Note: {n}" for n in meta.get("notes", [])] + [""] * bool(meta.get("notes"))
    lines += _summary(result, by) + [""] + _parity(result) + [""]
    if any(r["group"] == "sweep" for r in rows):
        lines += _sweep(result, by) + [""]
    lines += _detail(result)
    lines += ["", "FLOP counts used:", ""] + [f"- {k}: {v}" for k, v in meta["flop_counts"].items()]
    return "\n".join(lines) + "\n"


def figure(result: dict):
    """The report's figure (matplotlib, Agg): each case's speed-up of every column over the first
    (the first itself left out: it would be 1.0 against itself; its times in ms when it is the only
    column), and the sweep's time and memory against T with a tick at every measured T."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, NullLocator
    rows, cols = result["rows"], columns(result["meta"])
    ms = {(r["name"], r["pass"], r["backend"], r["path"]): r["ms"] for r in rows if r["ms"] is not None}
    base, others = cols[0], cols[1:]
    keys = list(dict.fromkeys((r["name"], r["pass"]) for r in rows if r["group"] != "sweep"))
    fig = Figure(figsize=(18, 6), layout="constrained")
    axes = fig.subplots(1, 3)
    width = 0.8 / max(len(others), 1)
    drawn = False
    for i, col in enumerate(others):                      # no bar where either time is missing
        js = [j for j, k in enumerate(keys) if k + col in ms and k + base in ms]
        drawn |= bool(js)
        axes[0].bar([j + i * width for j in js], [ms[keys[j] + base] / ms[keys[j] + col] for j in js], width,
                    label=_title(*col))
    if others:
        axes[0].set(ylabel=f"speed-up over {_title(*base)} (x)")
        axes[0].axhline(1, color="gray", lw=0.5)
        axes[0].set_title(f"Speed per case, relative to {_title(*base)} (higher is faster)", fontsize=10)
    else:                                                 # one column: its times
        js = [j for j, k in enumerate(keys) if k + base in ms]
        drawn = bool(js)
        axes[0].bar(js, [ms[keys[j] + base] for j in js], width, label=_title(*base))
        axes[0].set(ylabel="time (ms)")
        axes[0].set_title(f"Time per case, {_title(*base)}", fontsize=10)
    axes[0].set_xticks([j + (len(others) - 1) * width / 2 if others else j for j in range(len(keys))])
    axes[0].set_xticklabels([f"{a} {b}" for a, b in keys], rotation=90, fontsize=7)   # upright boxes: apart
    axes[0].set_yscale("log" if drawn else "linear")
    sweep = [r for r in rows if r["group"] == "sweep" and r["pass"] == "fwd" and r["ms"] is not None]
    measured: set[int] = set()
    for col in dict.fromkeys((r["backend"], r["path"]) for r in sweep):
        mine = [r for r in sweep if (r["backend"], r["path"]) == col]
        for flash, precision in dict.fromkeys((r["flash"], r["precision"]) for r in mine):   # a line each
            if flash and col[0] not in NPFORMER:
                continue                               # a reference runs the same call in both sweeps
            pts = sorted((r for r in mine if (r["flash"], r["precision"]) == (flash, precision)), key=lambda r: r["T"])
            ts = [r["T"] for r in pts]
            lab = _title(*col) + " flash" * flash + ("" if precision == "float32" else f" {precision}")
            measured.update(ts)
            axes[1].plot(ts, [r["ms"] + ms[(r["name"], "bwd") + col] for r in pts], "o-", label=lab)
            axes[2].plot(ts, [max(r["peak_mb"] or 0, 1e-3) for r in pts], "o-", label=lab)
    for ax, ylabel in ((axes[1], "attention fwd+bwd ms"), (axes[2], "attention fwd peak MB")):
        ax.set(xscale="log", yscale="log", xlabel="T", ylabel=ylabel)
        if measured:                                   # a labelled tick at every measured T, no others
            ax.xaxis.set_major_locator(FixedLocator(sorted(measured)))
            ax.xaxis.set_minor_locator(NullLocator())
            ax.set_xticklabels([str(t) for t in sorted(measured)])
    axes[1].set_title("Attention forward + backward time against T (B=1, H=8, hs=32)", fontsize=10)
    axes[2].set_title("Attention forward peak memory against T", fontsize=10)
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    meta = result["meta"]
    fig.suptitle(f"npformer benchmarks, {meta['device']}, {meta['date']} ({meta['mode']})")
    return fig


def plot(result: dict, path: str, log: Callable[[str], None] = print) -> bool:
    """:func:`figure` written to ``path`` (whole or not at all); False (with a note) without matplotlib."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        log('note: matplotlib is not installed; no PNG plot written (pip install "npformer[plot]")')
        return False
    with written_atomically(path, "plot") as f:
        figure(result).savefig(f, format="png", dpi=90)
    return True


def write_reports(result: dict, out_dir: str, log: Callable[[str], None] = print) -> dict:
    """Markdown, JSON and (with matplotlib) PNG named ``<device>_<date>[_quick]``, each written whole
    or not at all (:mod:`npformer.files`); returns the paths."""
    meta = result["meta"]
    stem = f"{meta['device']}_{meta['date']}" + ("_quick" if meta["mode"] == "quick" else "")
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as exc:
        raise WriteError(f"could not create the report folder {out_dir}: {os_reason(exc)}") from exc
    paths = {"json": os.path.join(out_dir, stem + ".json"), "md": os.path.join(out_dir, stem + ".md")}
    write_text_atomically(paths["json"], json.dumps(result, indent=1), "report")
    write_text_atomically(paths["md"], markdown(result), "report")
    png = os.path.join(out_dir, stem + ".png")
    if plot(result, png, log):
        paths["png"] = png
    return paths
