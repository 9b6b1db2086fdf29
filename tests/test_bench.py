"""The benchmark suite (npformer.bench, with the PyTorch reference of benchmarks/): the quick mode runs
on numpy (and torch when it imports), checks parity before timing, times both npformer paths, and
writes well-formed markdown, JSON and, with matplotlib, a PNG. No timing is asserted. Without the
PyTorch plug-in (the installed package) it runs npformer's columns and says why torch's are missing."""
import dataclasses
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import npformer
from npformer.bench import backends, harness, parity, paths, report, suite
from npformer.bench.backends import Backend
from npformer.bench.cases import QUICK, op_cases
from npformer.bench.steps import ModelSpec
from npformer.kernels import numba_cpu

ROOT = Path(__file__).resolve().parents[1]
HAS_TORCH = importlib.util.find_spec("torch") is not None
if HAS_TORCH:
    import benchmarks.torch_reference  # noqa: F401 - registers the "torch" reference, as benchmarks/run.py does
OPS = ["linear", "softmax", "layer_norm", "gelu", "attention", "multi_head", "ffn", "cross_entropy"]
# gpt-medium is left out of the quick run below to keep this file fast (its 19M-parameter steps cost
# more than everything else together and run the same code as gpt-small).
MODELS = ["gpt-small", "seq2seq-base"]
TIMING = ("ms", "q1_ms", "q3_ms", "min_ms", "max_ms", "tokens_per_s", "gflops", "peak_share")
ROW_KEYS = {"group", "name", "pass", "shape", "precision", "T", "flash", "backend", "framework", "device", "path",
            "impl", "fast_paths", "parity", "parity_error", "parity_detail", "ms", "q1_ms", "q3_ms", "min_ms", "max_ms",
            "repeats", "warmup", "flops", "tokens", "tokens_per_s", "gflops", "peak_share", "vs_torch", "fast_speedup",
            "peak_mb", "compile_s", "load_1min", "noisy"}
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="parity is checked against PyTorch")


def _run(out, *args):
    backends = "numpy,torch" if HAS_TORCH else "numpy"
    assert suite.main(["--quick", "--backends", backends, "--out", str(out), *args]) == 0
    return backends.replace("torch", "torch-cpu").split(",")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    return out, _run(out, "--only", ",".join(OPS + MODELS + ["sweep"]))


def _one(out, suffix):
    files = sorted(out.glob("*" + suffix))
    assert len(files) == 1, files
    assert re.fullmatch(r"[a-z0-9-]+_\d{4}-\d{2}-\d{2}_quick" + re.escape(suffix), files[0].name)
    return files[0]


def _rows(out):
    return json.loads(_one(out, ".json").read_text())["rows"]


def _tables(text):
    tables, current = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append(current)
            current = []
    return tables


def test_source_commit_names_the_checkout(tmp_path):
    """The run records which code ran: a git checkout's commit, "+changes" once a tracked file
    differs from it, and None outside a checkout, also inside another repository (the first H200
    check's copy of the tree reported the enclosing repository's commit)."""
    assert suite.source_commit(str(tmp_path)) is None

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                       check=True, capture_output=True)
    try:
        git("init", "-q")
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"git is not usable here ({e}): the commit is then recorded as None, tested above")
    (tmp_path / "f.txt").write_text("a")
    git("add", "f.txt")
    git("commit", "-q", "-m", "one")
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "--short=7", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert suite.source_commit(str(tmp_path)) == head
    (tmp_path / "f.txt").write_text("b")
    assert suite.source_commit(str(tmp_path)) == head + "+changes"
    (tmp_path / "copy").mkdir()            # a tree without .git inside the repository: not its commit
    assert suite.source_commit(str(tmp_path / "copy")) is None


def test_json_rows_and_columns(quick_run):
    out, backends = quick_run
    result = json.loads(_one(out, ".json").read_text())
    meta = result["meta"]
    assert meta["mode"] == "quick" and meta["backends"] == backends and meta["paths"] == ["fast", "reference"]
    assert set(result["matmul_peak_gflops"]) == set(backends)
    assert set(meta["flop_counts"]) >= {"linear", "attention", "train_step"}
    assert meta["versions"]["npformer"] == npformer.__version__ and meta["commit"] == suite.source_commit()
    assert set(meta["load"]) == {"start", "end", "cpus"} and meta["load"]["cpus"] >= 1
    rows = result["rows"]
    for r in rows:
        assert set(r) == ROW_KEYS, set(r) ^ ROW_KEYS
        for k in TIMING:
            assert isinstance(r[k], float) and math.isfinite(r[k]) and r[k] >= 0, (r["name"], k, r[k])
        assert r["min_ms"] <= r["q1_ms"] <= r["ms"] <= r["q3_ms"] <= r["max_ms"]
        assert r["repeats"] >= 3 and r["flops"] > 0 and r["tokens"] > 0
        assert r["peak_mb"] is None or r["peak_mb"] >= 0
        assert r["noisy"] == harness.repeats_disagree(r) and (r["load_1min"] is None or r["load_1min"] >= 0)
        npformer_parity = "pass" if HAS_TORCH else "unchecked"
        assert r["parity"] == ("reference" if r["framework"] == "torch" else npformer_parity)
    got = {(r["name"], r["pass"], r["backend"], r["path"]) for r in rows}
    cols = [("numpy", p) for p in ("fast", "reference")] + [("torch-cpu", None)] * HAS_TORCH
    want = {(op, p) + c for op in OPS for p in ("fwd", "bwd") for c in cols}
    want |= {(m, "step") + c for m in MODELS for c in cols}
    want |= {("attention T=128", p) + c for p in ("fwd", "bwd") for c in cols if c[1] != "reference"}
    assert want <= got, want - got
    for r in rows:                                   # the ratio exists exactly when torch ran too
        assert (r["vs_torch"] is not None) == (HAS_TORCH and r["framework"] == "npformer")


@needs_torch
def test_every_npformer_row_passed_parity_within_the_stated_tolerance(quick_run):
    out, _ = quick_run
    meta = json.loads(_one(out, ".json").read_text())["meta"]
    assert meta["parity"] == {"rtol": parity.RTOL, "reference": "torch-cpu float32", "status": "checked"}
    for r in _rows(out):
        if r["framework"] == "npformer":
            assert r["parity"] == "pass" and 0 <= r["parity_error"] <= parity.RTOL, r


def test_both_paths_are_timed_and_labelled(quick_run):
    out, _ = quick_run
    rows = {(r["name"], r["pass"], r["path"]): r for r in _rows(out) if r["backend"] == "numpy"}
    for (name, pas, path), r in rows.items():
        if r["group"] == "sweep":
            assert path == "fast"
            continue
        fast, ref = rows[(name, pas, "fast")], rows[(name, pas, "reference")]
        assert ref["impl"] == "reference" and ref["fast_paths"] == []
        assert fast["impl"] == paths.label(fast["fast_paths"])
        assert fast["fast_speedup"] == ref["fast_speedup"] == pytest.approx(ref["ms"] / fast["ms"])
    compiled = numba_cpu.AVAILABLE                  # numba installed: its paths run first where they exist
    one = "numba" if compiled else "cpu"
    impls = {"softmax": one, "layer_norm": one, "gelu": one, "attention": one, "ffn": "cpu+numba" if compiled else "cpu",
             "cross_entropy": "numba" if compiled else "reference", **{m: "cpu+numba" if compiled else "cpu" for m in MODELS}}
    for name, impl in impls.items():                # CPU fast paths inside
        assert rows[(name, "fwd" if name not in MODELS else "step", "fast")]["impl"] == impl, name
    assert rows[("linear", "fwd", "fast")]["impl"] == "cpu"                  # products split between threads


def test_fast_paths_run_agrees_with_kernels_implementation():
    """The trace that labels rows names what npformer.kernels.implementation says would run."""
    import npformer.kernels as kernels
    from npformer.ops import activations, softmax
    b = Backend("numpy", 1)
    x = b.asarray(np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32))
    for op in (softmax.softmax_forward, activations.gelu_forward):
        for path in paths.PATHS:
            with paths.switch(path):
                ran = paths.fast_paths_run(lambda: op(x))
                assert paths.label(ran) == kernels.implementation(op, x)
                name = "numba" if numba_cpu.AVAILABLE else "cpu"
                assert ran == ([f"{name}:{op.__name__}"] if path == "fast" else [])


def test_quick_rows_come_after_warm_up(quick_run):
    out, _ = quick_run
    assert QUICK["warmup"] >= 1 and QUICK["warmup_s"] > 0
    for r in _rows(out):                             # torch rows too
        assert r["warmup"] >= QUICK["warmup"], r


def test_time_call_reports_no_warm_up_call():
    """Calls take 125 ms for the first 0.5 s of a fake clock, then 1/1024 s; with a 0.5 s warm-up,
    every reported call is a fast one, though one warm-up call was asked for."""
    now, calls = [0.0], []

    def fn():
        calls.append(1)
        now[0] += 0.125 if now[0] < 0.5 else 2.0 ** -10
    s = harness.time_call(fn, lambda: None, warmup=1, repeats=5, budget_s=100, warmup_s=0.5,
                          clock=lambda: now[0])
    assert s["warmup"] == 4 and s["repeats"] == 5 and len(calls) == 9
    assert s["max_ms"] == pytest.approx(1000 * 2.0 ** -10)


def test_quick_mode_warms_up_past_a_slow_start():
    """Quick mode with its own settings: calls slow (8 ms) for the first 0.15 s of a fake clock, as
    PyTorch's first calls were right after NumPy ran, then fast: no slow call is reported (before the
    quick warm-up lasted 0.2 s, PyTorch's first linear forward made npformer look 20x faster)."""
    now = [0.0]

    def fn():
        now[0] += 0.008 if now[0] < 0.15 else 5e-5
    s = harness.time_call(fn, lambda: None, QUICK["warmup"], QUICK["repeats"], QUICK["budget_s"],
                          QUICK["warmup_s"], clock=lambda: now[0])
    assert s["max_ms"] == pytest.approx(0.05) and s["warmup"] > QUICK["warmup"]


def test_time_call_warms_up_then_repeats():
    calls, syncs = [], []
    s = harness.time_call(lambda: calls.append(1), lambda: syncs.append(1), warmup=2, repeats=5, budget_s=10)
    assert len(calls) == len(syncs) == 7 and s["repeats"] == 5 and s["warmup"] == 2


@needs_torch
def test_a_parity_failure_is_reported_and_not_timed(tmp_path, monkeypatch):
    """npformer's GELU made 0.1% wrong: its rows fail parity on both paths, carry no timing, and
    the table says so; PyTorch's rows are still timed. --skip-parity times the same wrong op."""
    from npformer.ops import activations
    gelu = activations.gelu_forward

    def wrong_gelu(x, **kw):
        y, cache = gelu(x, **kw)
        return y * 1.001, cache
    monkeypatch.setattr(activations, "gelu_forward", wrong_gelu)
    timed = []
    monkeypatch.setattr(suite, "time_call", lambda fn, *a: timed.append(fn) or harness.time_call(fn, *a))
    _run(tmp_path, "--only", "gelu")
    rows = _rows(tmp_path)
    npf = [r for r in rows if r["framework"] == "npformer"]
    assert {(r["path"], r["pass"]) for r in npf} == {(p, s) for p in paths.PATHS for s in ("fwd", "bwd")}
    for r in npf:
        assert r["parity"] == "fail" and r["parity_error"] > parity.RTOL
        assert r["parity_detail"].startswith("out:")                        # dx comes from the same cache
        assert all(r[k] is None for k in TIMING + ("repeats", "warmup", "vs_torch", "peak_mb"))
    assert len(timed) == 2 and all(r["ms"] > 0 for r in rows if r["framework"] == "torch")
    summary = _tables(_one(tmp_path, ".md").read_text())[0]
    assert all(line.count("FAILED parity") == 2 for line in summary[2:])   # numpy and numpy ref

    skipped = tmp_path / "skipped"
    _run(skipped, "--only", "gelu", "--skip-parity", "--paths", "fast")
    npf = [r for r in _rows(skipped) if r["framework"] == "npformer"]
    assert len(npf) == 2 and all(r["parity"] == "skipped" and r["ms"] > 0 for r in npf)


def test_parity_compare_rule():
    ref = {"out": np.array([1.0, -4.0, 2.0], np.float32), "loss": np.asarray(np.float32(3.0))}
    ok = parity.compare({"out": ref["out"] + 3.9 * parity.RTOL, "loss": ref["loss"]}, ref)
    assert ok.status == "pass" and ok.error == pytest.approx(3.9 * parity.RTOL / 4, rel=1e-3)
    bad = parity.compare({"out": ref["out"] + 4.1 * parity.RTOL, "loss": ref["loss"]}, ref)
    assert bad.failed and "out" in bad.detail and "tolerance" in bad.detail
    assert parity.compare({"out": ref["out"][:2], "loss": ref["loss"]}, ref).failed          # shape
    assert parity.compare({"out": ref["out"] * np.nan, "loss": ref["loss"]}, ref).failed     # not finite
    assert parity.compare({"out": ref["out"]}, ref).failed                                    # missing


def test_op_cases_compare_the_gradients_npformer_returns():
    """Each op case names as many gradients as npformer's backward returns (None dropped)."""
    b = Backend("numpy", 1)
    cfg = dict(QUICK, B=1, T=4, d=16, H=2, F=8, V=6)
    for case in op_cases(cfg):
        outputs = case.outputs(b)
        assert set(case.build(b)) == {"fwd", "bwd"}, case.name
        if case.name == "dropout":                # generators differ: what the mask's law fixes
            assert set(outputs) == {"kept_fraction", "scale", "grad_scale"}
            assert outputs["scale"] == pytest.approx(1 / 0.9) and outputs["grad_scale"] == pytest.approx(1 / 0.9)
            continue
        assert "out" in outputs and len(outputs) >= 2, case.name


def test_markdown_tables_are_well_formed(quick_run):
    out, backends = quick_run
    text = _one(out, ".md").read_text()
    tables = _tables(text)
    assert len(tables) == 4                          # summary, parity, sweep, every row
    for t in tables:
        widths = {len(line.strip("|").split("|")) for line in t}
        assert len(widths) == 1, t[:3]
        assert re.fullmatch(r"\|(---\|)+", t[1])
    summary, checks, sweep, detail = tables
    columns = ("numpy impl", "numpy ms", "numpy ref ms", "numpy fast speed-up") + ("torch-cpu ms",) * HAS_TORCH
    for col in columns:
        assert f" {col} |" in summary[0], col
    assert ("numpy/torch-cpu" in summary[0]) == HAS_TORCH
    assert {line.split("|")[1].strip() for line in summary[2:]} == set(OPS + MODELS)
    assert {line.split("|")[1].strip() for line in checks[2:]} >= set(OPS + MODELS)
    assert [line.split("|")[1].strip() for line in sweep[2:]] == ["64", "128", "flash 64", "flash 128"]
    for col in ("path", "impl", "parity", "ms", "IQR", "warm-up", "tokens/s", "GFLOP/s", "% peak", "vs torch",
                "fast speed-up", "peak MB"):
        assert f" {col} |" in detail[0], col
    assert len(detail) - 2 == len(json.loads(_one(out, ".json").read_text())["rows"])
    assert "FLOP counts used" in text


def test_each_npformer_path_has_its_own_column_title():
    """fast, numpy (the fast paths without numba's) and reference: three columns, three names."""
    from npformer.bench.report import _title, columns
    cols = columns({"backends": ["numpy", "torch-cpu"], "paths": ["fast", "numpy", "reference"]})
    assert [_title(*c) for c in cols] == ["numpy", "numpy no-numba", "numpy ref", "torch-cpu"]


def test_png_written_when_matplotlib_is_present(quick_run):
    out, _ = quick_run
    if importlib.util.find_spec("matplotlib") is None:
        assert not list(out.glob("*.png"))
    else:
        assert _one(out, ".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_report_figure_reads_well(quick_run):
    """Every text inside the canvas and clear of the others; no bar of the first column against itself
    (it would be 1.0); a labelled tick at every measured T of the sweep and no other."""
    pytest.importorskip("matplotlib", reason="matplotlib not installed (the plot extra)")
    from npformer.bench.report import columns, figure, _title
    from tests.figure_checks import assert_texts_inside_and_apart
    out, _ = quick_run
    result = json.loads(_one(out, ".json").read_text())
    fig = figure(result)
    assert_texts_inside_and_apart(fig, "bench report")
    speed, times, memory = fig.axes[:3]
    base = _title(*columns(result["meta"])[0])
    assert base not in speed.get_legend_handles_labels()[1]
    measured = sorted({r["T"] for r in result["rows"] if r["group"] == "sweep"})
    assert len(measured) >= 2
    for ax in (times, memory):
        assert list(ax.get_xticks()) == measured and [t.get_text() for t in ax.get_xticklabels()] == \
            [str(t) for t in measured]


def test_the_report_draws_and_tables_the_gpus_float16_sweep_rows(quick_run):
    """The float16 flash rows exist only on a GPU (the first H200 check's report crashed on them):
    here the CPU run's float32 flash rows are copied as float16 ones, and the figure draws them as a
    line of their own and the sweep table lists them, each from the row's T and precision fields."""
    from npformer.bench.report import figure, markdown
    out, _ = quick_run
    result = json.loads(_one(out, ".json").read_text())
    half = [dict(r, name=r["name"] + " float16", precision="float16") for r in result["rows"]
            if r["group"] == "sweep" and r["flash"] and r["backend"] == "numpy"]
    assert half and all(isinstance(r["T"], int) for r in half)
    result["rows"] += half
    sweep = _tables(markdown(result))[2]
    assert [line.split("|")[1].strip() for line in sweep[2:]] == \
        ["64", "128", "flash 64", "flash 128", "flash 64 float16", "flash 128 float16"]
    if importlib.util.find_spec("matplotlib") is None:
        return
    times = figure(result).axes[1]
    assert "numpy flash float16" in times.get_legend_handles_labels()[1]
    line = times.get_lines()[times.get_legend_handles_labels()[1].index("numpy flash float16")]
    assert list(line.get_xdata()) == sorted(r["T"] for r in half if r["pass"] == "fwd")


def test_summarize_against_numpy_percentiles():
    times = [0.003, 0.001, 0.002, 0.010, 0.004]
    s = harness.summarize(times)
    ms = np.array(times) * 1e3
    assert s["ms"] == pytest.approx(np.median(ms))
    assert (s["q1_ms"], s["q3_ms"]) == pytest.approx(tuple(np.percentile(ms, [25, 75])))
    assert (s["min_ms"], s["max_ms"], s["repeats"]) == (pytest.approx(1.0), pytest.approx(10.0), 5)


def test_bad_options():
    from npformer.bench.backends import make_backends
    with pytest.raises(ValueError, match="unknown backend 'jax'"):
        make_backends(["numpy", "jax"], 1)
    for argv in (["--backends", "tensorflow"], ["--paths", "fast,turbo"], ["--only", "lstm"]):
        with pytest.raises(SystemExit):
            suite.main(["--quick", *argv])


def test_import_pulls_in_neither_torch_nor_cupy():
    """``import npformer`` leaves the suite out; importing the suite brings neither torch nor cupy."""
    code = ("import sys, npformer; assert 'npformer.bench' not in sys.modules, 'npformer imports its bench'; "
            "import npformer.bench; assert 'torch' not in sys.modules and 'cupy' not in sys.modules, 'imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_the_package_never_imports_torch():
    """torch is a reference for tests/ and benchmarks/ only: no module of npformer imports it, and none
    reaches the checkout's benchmarks/ as a module (absent from an installed package)."""
    rules = r"^\s*(import torch|from torch)\b", r"\bbenchmarks\.\w"
    offenders = [(str(p.relative_to(ROOT)), rule) for p in (ROOT / "npformer").rglob("*.py") for rule in rules
                 if re.search(rule, p.read_text(), flags=re.M)]
    assert offenders == []


def test_the_default_out_is_outside_the_tracked_results():
    """Without --out a run writes under runs/ (ignored by git), not into benchmarks/results/."""
    assert suite.build_parser().parse_args([]).out == os.path.join("runs", "bench") == suite.DEFAULT_OUT
    assert "/runs/" in (ROOT / ".gitignore").read_text().split()


def test_npformer_bench_runs_without_the_checkout_and_without_torch(tmp_path):
    """As from an installed wheel: only the package importable (benchmarks/ is not, checked in the
    subprocess), npformer bench runs the cheap case, writes its reports under --out, imports no torch."""
    site, cwd, out = tmp_path / "site", tmp_path / "elsewhere", tmp_path / "out"
    site.mkdir()
    cwd.mkdir()
    (site / "npformer").symlink_to(ROOT / "npformer", target_is_directory=True)
    argv = ["bench", "--quick", "--only", "gelu", "--backends", "numpy", "--paths", "fast", "--skip-parity",
            "--out", str(out)]
    code = ("import importlib.util, sys\n"
            "assert importlib.util.find_spec('benchmarks') is None, 'benchmarks/ is importable'\n"
            "from npformer.cli import main\n"
            f"assert main({argv!r}) == 0\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=cwd, env={**os.environ, "PYTHONPATH": str(site)},
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert {p.suffix for p in out.iterdir()} >= {".md", ".json"} and not list(cwd.iterdir())
    assert {r["backend"] for r in _rows(out)} == {"numpy"}


def test_torch_without_its_plug_in_is_a_note_and_the_rest_runs(tmp_path, monkeypatch, capsys):
    """--backends numpy,torch where the PyTorch reference is not registered (npformer bench from the
    installed package): a note says where it lives, numpy's columns run, parity is unchecked with the reason."""
    from npformer.cli import main
    monkeypatch.delitem(backends.REFERENCES, "torch", raising=False)
    assert main(["bench", "--quick", "--only", "gelu", "--backends", "numpy,torch", "--paths", "fast",
                 "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert f"note: torch: {backends.UNREGISTERED}" in printed and "benchmarks/torch_reference.py" in printed
    rows = _rows(tmp_path)
    assert {r["backend"] for r in rows} == {"numpy"} and len(rows) == 2
    for r in rows:
        assert r["parity"] == "unchecked" and r["parity_detail"] == f"unchecked: {backends.UNREGISTERED}"
        assert r["ms"] > 0
    meta = json.loads(_one(tmp_path, ".json").read_text())["meta"]
    assert meta["parity"]["status"] == "unchecked" and meta["parity"]["reference"] is None
    assert any(n.startswith("torch: the PyTorch reference") for n in meta["notes"])


def test_npformer_bench_hands_its_options_to_the_suite(capsys):
    from npformer.cli import main
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--help"])
    help_text = capsys.readouterr().out
    assert exc.value.code == 0
    assert all(option in help_text for option in ("--backends", "--paths", "--only", "--skip-parity"))
    with pytest.raises(SystemExit):
        main(["bench", "--backends", "tensorflow"])
    assert "unknown backend" in capsys.readouterr().err


def test_gpu_check_script_parses_and_the_profiler_refuses_cleanly_without_a_gpu():
    """benchmarks/gpu_check.sh is bash that parses; profile_step.py says in one line why it cannot run
    where CuPy or a GPU is missing (it runs for real only on a GPU machine)."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    assert subprocess.run(["bash", "-n", str(root / "benchmarks" / "gpu_check.sh")]).returncode == 0
    from npformer.backend import cupy_available
    if cupy_available():
        return                                                       # on a GPU the script runs for real
    res = subprocess.run([sys.executable, str(root / "benchmarks" / "profile_step.py"), "--model", "gpt-small"],
                         capture_output=True, text=True)
    assert res.returncode == 2 and "profile_step: backend 'cupy' was requested" in res.stderr, res.stderr
    assert shutil.which("bash")


def test_the_step_profile_builds_the_suites_steps_for_both_sides_on_the_cpu():
    """profile_step.py --device cpu: the steps the GPU run profiles (the suite's npformer step, PyTorch's
    nanoGPT-structured one), built and run through the profiler on the CPU, where no kernel is counted; a
    model that is not one of the suite's GPTs is refused by name."""
    pytest.importorskip("torch", reason="PyTorch is the other side of the profile")
    from benchmarks import profile_step
    report = profile_step.profile("gpt-tiny", batch=2, seq=8, device="cpu")
    lines = report.splitlines()
    assert lines[0] == "training step, gpt-tiny B=2 T=8, float32, dropout 0; the CPU (no kernels to count)"
    rows = [line.split(" | ") for line in lines if line.startswith(("| npformer", "| PyTorch"))]
    assert [r[0] for r in rows] == ["| npformer", "| PyTorch, nanoGPT's structure"]      # no --compile
    assert all(float(r[1]) > 0 and r[2:] == ["0", "0", "0.0 |"] for r in rows)
    with pytest.raises(SystemExit):
        profile_step.main(["--model", "seq2seq-base", "--device", "cpu"])


TINY = ModelSpec("gpt", d=16, H=2, L=1, F=32, V=20)


def test_gpu_cases_are_skipped_on_the_cpu_with_the_reason(monkeypatch):
    from npformer.bench.steps import MODELS
    gpu = {n for n, m in MODELS.items() if m.gpu}
    assert {"gpt-medium-graph", "gpt-d768-t512", "gpt2-124m", "gpt2-124m-fp16", "gpt2-124m-bf16",
            "gpt2-124m-fp16-graph", "seq2seq-d512"} <= gpu
    logs = []
    result = suite.run_suite([Backend("numpy", 1)], quick=True, parity=False, only=gpu, log=logs.append)
    assert result["rows"] == []
    assert any(n.startswith("GPU cases skipped on the CPU backends (sizes made for a GPU") and "gpt2-124m" in n
               for n in result["meta"]["notes"])
    assert sum("skipped (a GPU case" in line for line in logs) == len(gpu)


def test_the_whole_suite_on_the_cpu_names_its_gpu_cases_in_one_line(monkeypatch):
    """Without --only, the GPU cases a CPU backend skips get one line (the flash cases at training shapes
    counted, not listed), not a line each: on the CPU they were 27 of `npformer bench --quick`'s lines."""
    from npformer.bench.cases import FLASH_TRAIN, flash_train_cases
    from npformer.bench.steps import MODELS
    flash = flash_train_cases()
    gpu_models = [c for c in suite.model_cases(suite.QUICK, True) if c.gpu_only]
    monkeypatch.setattr(suite, "op_cases", lambda cfg: [])
    monkeypatch.setattr(suite, "model_cases", lambda cfg, quick: gpu_models)
    monkeypatch.setattr(suite, "flash_train_cases", lambda: flash)
    monkeypatch.setattr(suite, "_sweep", lambda *a: [])
    logs = []
    result = suite.run_suite([Backend("numpy", 1)], quick=True, parity=False, log=logs.append)
    assert result["rows"] == []
    said = [line for line in logs if "GPU case" in line]
    names = ", ".join(c.name for c in gpu_models)
    assert said == [f"skipped on numpy: the GPU cases {names} and {len(flash)} {FLASH_TRAIN} cases "
                    f"({suite.GPU_ONLY_REASON}; --only NAME runs one where a GPU is)"]
    assert {c.name for c in gpu_models} == {n for n, m in MODELS.items() if m.gpu}
    assert any(n.startswith("GPU cases skipped on the CPU backends") and flash[0].name in n
               for n in result["meta"]["notes"])          # the report's notes keep every name


def test_gpu_case_sizes_are_the_issue_s():
    from npformer.bench.steps import MODELS, train_flops
    m = MODELS["gpt2-124m"]
    assert (m.d, m.L, m.H, m.V, m.B, m.T) == (768, 12, 12, 50257, 8, 1024)
    assert 6.9e12 < train_flops(m, 8, 1024) < 7.1e12              # "the step is 7.0 TFLOP of matrix products"
    assert MODELS["gpt2-124m-fp16"].precision == "float16" and MODELS["gpt2-124m-bf16"].precision == "bfloat16"
    gpt2 = ("gpt2-124m", "gpt2-124m-fp16", "gpt2-124m-bf16", "gpt2-124m-fp16-graph")
    assert {MODELS[n].d for n in gpt2} == {768}
    assert {MODELS[n].dropout for n in gpt2} == {0.0}             # nanoGPT's GPT-2 pretraining, the anchor's
    graphed = MODELS["gpt2-124m-fp16-graph"]
    assert graphed.graph and graphed.precision == "float16" and (graphed.B, graphed.T) == (8, 1024)
    assert (MODELS["seq2seq-d512"].B, MODELS["seq2seq-d512"].T, MODELS["seq2seq-d512"].V) == (16, 128, 8192)


@pytest.mark.parametrize("precision", ["float16", "bfloat16"])
def test_mixed_precision_step_builders_run_at_tiny_sizes(precision):
    """npformer's 16-bit step (MixedPrecision) and PyTorch's (autocast, with a GradScaler for float16)
    on the CPU at a tiny size: two steps run (the GPU rows run the same builders)."""
    from npformer.bench.steps import _npformer_step
    if precision == "bfloat16":
        pytest.importorskip("ml_dtypes", reason="NumPy's bfloat16 comes from ml_dtypes (the bfloat16 extra)")
    src = np.random.default_rng(0).integers(1, 20, (2, 8))
    tgt = src[:, ::-1].copy()
    step = _npformer_step(Backend("numpy", 1), dataclasses.replace(TINY, precision=precision), src, tgt)
    step()
    step()
    if HAS_TORCH:
        from benchmarks.torch_reference import TorchBackend
        torch_step = TorchBackend("cpu", 1).train_step(TINY, src, tgt, 0.0, precision)
        torch_step()
        torch_step()


@pytest.mark.parametrize("precision", ["float32", "float16"])
def test_graph_step_refuses_the_cpu_backend(precision):
    from npformer.bench.steps import _npformer_step
    from npformer.errors import InputTypeError
    src = np.random.default_rng(0).integers(1, 20, (2, 8))
    spec = dataclasses.replace(TINY, graph=True, precision=precision)
    step = _npformer_step(Backend("numpy", 1), spec, src, src[:, ::-1].copy())
    with pytest.raises(InputTypeError, match="On the NumPy backend there is no graph"):
        step()


def test_mixed_precision_parity_is_skipped_with_the_reason():
    from npformer.bench.steps import HALF_PARITY, model_cases
    for name in ("gpt2-124m-fp16", "gpt2-124m-bf16"):
        case = next(c for c in model_cases(QUICK, quick=True) if c.name == name)
        p = suite._parity(case, Backend("numpy", 1), Backend("numpy", 1), lambda: {})
        assert p.status == "skipped" and p.detail == HALF_PARITY and case.precision in case.shape


def test_summary_has_an_mfu_column_for_training_steps(quick_run):
    """A training step's row has its MFU as a positive percentage, the op rows "-". (Not bounded by
    100%: the step and the matmul peak are timed apart, and on a loaded machine, CI's with another job
    beside it, a slowed peak measurement put a quick step above it: a timing, which tests do not assert.)"""
    out, cols = quick_run
    summary = _tables(_one(out, ".md").read_text())[0]
    head = [c.strip() for c in summary[0].strip("|").split("|")]
    mfu = head.index("numpy MFU")
    for line in summary[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        is_model = cells[0] in MODELS
        assert (cells[mfu].endswith("%") and 0 < float(cells[mfu][:-1])) if is_model else cells[mfu] == "-"


def test_tf32_needs_a_gpu_backend(capsys):
    with pytest.raises(SystemExit):
        suite.main(["--quick", "--backends", "numpy", "--tf32", "--only", "linear"])
    assert "--tf32: TF32 is a tensor-core mode of NVIDIA GPUs; no GPU backend runs here" in capsys.readouterr().err


def test_train_pair_runs_both_installs_and_reports_equal_losses(tmp_path, capsys):
    """benchmarks/train_pair.py with this interpreter on both sides: one round of a few steps, a
    report with both speeds, their ratio and the same loss (the same seeds and code)."""
    from benchmarks import train_pair
    out = tmp_path / "pair.md"
    train_pair.main(["--other", sys.executable, "--rounds", "1", "--steps", "7", "--out", str(out)])
    text = out.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| 1 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert float(cells[1].replace(",", "")) > 0 and float(cells[2].replace(",", "")) > 0
    assert cells[3].endswith("x") and cells[4] == cells[5]
    assert re.search(r"Medians: this [\d,]+ tok/s, other [\d,]+ tok/s: this at \d+\.\d\dx", text)
    with pytest.raises(SystemExit):
        train_pair.main(["--other", sys.executable, "--steps", "3"])


class _FakeClock:
    """A clock that only moves when a fake stage runs."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def _fake_execute(clock, durations: dict, calls: list, out: str):
    """Stand-in for running a stage: takes ``durations[name]`` seconds (or its timeout, then times out),
    and writes what the real stage would (the bench's three reports in its folder, a log)."""
    import os

    def execute(argv, timeout, log_path):
        name = argv[-1]                                 # _gpu_check_stages ends each command with its name
        calls.append((name, timeout, argv))
        took = durations[name]
        clock.now += min(took, timeout)
        if name in ("steps", "sweep", "cpu-vs-gpu"):
            folder = os.path.join(out, name.replace("-", "_"))
            os.makedirs(folder, exist_ok=True)
            for ext in ("md", "json", "png"):
                open(os.path.join(folder, f"device_2026-11-27.{ext}"), "w").close()
        if name == "ncu":                               # flash_profile.py writes its report itself
            with open(os.path.join(out, "profile.txt"), "w") as f:
                f.write("ncu report\n")
        if log_path:
            with open(log_path, "a") as f:
                f.write(f"{name} log\n" if "tests" in name or name == "profile" else "")
        if took > timeout:
            return None, "line\n" * 30 + "still running"
        return (1, "Traceback\nboom") if name == "profile" else (0, "fine")
    return execute


def _gpu_check_stages():
    from benchmarks import gpu_check
    stages = gpu_check.stages(python="python3", jobs=16)
    # the fake tells the stages apart by their name, put at the end of each command
    return [gpu_check.Stage(s.name, s.minimum_s, s.cap_s, s.command + (s.name,), s.log, s.keep) for s in stages]


STAGE_SECONDS = {"device": 5, "primitives": 15, "kernel-tests": 100, "steps": 100, "sweep": 60, "ncu": 40,
                 "other-tests": 120, "cpu-vs-gpu": 90, "profile": 20}


def test_gpu_check_runs_its_stages_in_order_within_the_budget_and_skips_what_no_longer_fits(tmp_path):
    """A fake clock: a 480 s budget; the first six stages (what the GPU issues need first) fit, the
    other tests run out their timeout (what is left of the budget), so NumPy beside CuPy and the
    profile are skipped, saying so; the timeouts shrink with the budget, and the ncu stage is told its own."""
    from benchmarks import gpu_check
    clock, calls, lines = _FakeClock(), [], []
    durations = dict(STAGE_SECONDS, **{"other-tests": 10_000})
    outcomes = gpu_check.run_stages(str(tmp_path), _gpu_check_stages(), 480, clock=clock,
                                    execute=_fake_execute(clock, durations, calls, str(tmp_path)), log=lines.append)
    first = ["device", "primitives", "kernel-tests", "steps", "sweep", "ncu"]
    assert [c[0] for c in calls] == first + ["other-tests"]
    used = sum(STAGE_SECONDS[n] for n in first)
    margin = gpu_check.MARGIN_S
    left_for_steps = 480 - 120 - margin                      # (its cap, 360 s, is more than is left)
    assert [c[1] for c in calls] == [60, 60, 240, left_for_steps, 240, 180, 480 - used - margin]
    assert calls[5][2][2:5] == [f"{tmp_path}/profile.txt", "--timeout", str(180 - margin)]   # ncu's own time
    assert [(o.name, o.status) for o in outcomes][:7] == [(n, "ok") for n in first] + [("other-tests", "timed out")]
    assert [o.status for o in outcomes[7:]] == [f"skipped: needs {60 + margin} s, {margin} s left",
                                                f"skipped: needs {20 + margin} s, {margin} s left"]
    assert "still running" in outcomes[6].tail and len(outcomes[6].tail.splitlines()) == gpu_check.TAIL_LINES
    per_test = next(a for a in calls[6][2] if a.startswith("--timeout="))
    assert per_test == f"--timeout={max(30, min(300, int(calls[6][1] / 3)))}"
    assert clock.now - 1000.0 <= 480                                   # nothing ran past the budget
    # the files: at most 8, directly in OUT (the bench folders moved up and removed); both test stages
    # write one log
    assert sorted(p.name for p in tmp_path.iterdir()) == ["device.txt", "gpu_tests.log", "profile.txt", "steps.json",
                                                          "steps.md", "sweep.json", "sweep.md"]
    assert (tmp_path / "gpu_tests.log").read_text() == "kernel-tests log\nother-tests log\n"
    text = gpu_check.summary(outcomes, 480)
    assert text.splitlines()[0].startswith("gpu_check: budget 480 s") and "profile      skipped" in text


def test_gpu_check_names_every_failing_test_and_puts_the_device_facts_first(tmp_path, monkeypatch, capsys):
    """main(): the summary starts with the device facts (device.txt folded in, so eight files come
    back at most) and lists each FAILED or ERROR line of pytest's short summary under its stage."""
    from benchmarks import gpu_check
    clock, calls = _FakeClock(), []
    execute = _fake_execute(clock, STAGE_SECONDS, calls, str(tmp_path))

    def failing(argv, timeout, log_path):
        code, output = execute(argv, timeout, log_path)
        if argv[-1] == "device":
            with open(log_path, "a") as f:
                f.write("GPU: NVIDIA H200 | compute capability 9.0\n")
        if argv[-1] == "kernel-tests":
            return 1, ("....F.E\nFAILED tests/training/test_cuda_graph.py::test_a - AssertionError: step 4\n"
                       "ERROR tests/kernels/cuda/test_gemm.py::test_b - RuntimeError\n1 failed, 1 error in 9s")
        return code, output
    plan = _gpu_check_stages()
    monkeypatch.setattr(gpu_check, "_execute", failing)
    monkeypatch.setattr(gpu_check, "stages", lambda jobs=None: plan)
    monkeypatch.setattr(gpu_check.time, "monotonic", clock)
    assert gpu_check.main([str(tmp_path), "--budget", "480"]) == 1
    text = (tmp_path / "summary.txt").read_text()
    assert text.startswith("GPU: NVIDIA H200 | compute capability 9.0\n\ngpu_check: budget 480 s")
    lines = text.splitlines()
    i = next(k for k, line in enumerate(lines) if line.startswith("kernel-tests failed (exit 1)"))
    assert lines[i + 1:i + 3] == ["    FAILED tests/training/test_cuda_graph.py::test_a - AssertionError: step 4",
                                  "    ERROR tests/kernels/cuda/test_gemm.py::test_b - RuntimeError"]
    assert not (tmp_path / "device.txt").exists() and len(list(tmp_path.iterdir())) <= 8
    assert capsys.readouterr().out.rstrip().endswith(text.rstrip())


def test_gpu_check_without_a_budget_gives_each_stage_its_cap_and_reports_a_failure(tmp_path):
    from benchmarks import gpu_check
    clock, calls = _FakeClock(), []
    outcomes = gpu_check.run_stages(str(tmp_path), _gpu_check_stages(), None, clock=clock,
                                    execute=_fake_execute(clock, STAGE_SECONDS, calls, str(tmp_path)),
                                    log=lambda _: None)
    assert [c[1] for c in calls] == [s.cap_s for s in gpu_check.stages()]
    assert [o.status for o in outcomes] == ["ok"] * 8 + ["failed (exit 1)"]
    assert outcomes[-1].tail == "Traceback\nboom"
    # eight with summary.txt (main writes it); the step profile appended to the ncu report
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cpu_vs_gpu.md", "device.txt", "gpu_tests.log", "profile.txt",
                                                          "steps.json", "steps.md", "sweep.json", "sweep.md"]
    assert (tmp_path / "profile.txt").read_text() == "ncu report\nprofile log\n"
    assert "    boom" in gpu_check.summary(outcomes, None)


def test_gpu_check_only_runs_the_stages_named_after_the_device_facts(tmp_path, monkeypatch, capsys):
    """--only: a second call of a lease runs the stages the first skipped, in their order, the device facts
    first; a stage not in the plan is refused by name."""
    from benchmarks import gpu_check
    clock, calls = _FakeClock(), []
    monkeypatch.setattr(gpu_check, "_execute", _fake_execute(clock, STAGE_SECONDS, calls, str(tmp_path)))
    plan = _gpu_check_stages()
    monkeypatch.setattr(gpu_check, "stages", lambda jobs=None: plan)
    monkeypatch.setattr(gpu_check.time, "monotonic", clock)
    assert gpu_check.main([str(tmp_path), "--budget", "240", "--only", "profile,sweep,ncu"]) == 1  # profile fails
    assert [c[0] for c in calls] == ["device", "sweep", "ncu", "profile"]
    with pytest.raises(SystemExit):
        gpu_check.main([str(tmp_path), "--only", "sweep,flash"])
    assert "--only: unknown stage flash; the stages are device, primitives," in capsys.readouterr().err


def test_gpu_check_refuses_a_bad_budget_and_says_how_to_call_it(capsys):
    from benchmarks import gpu_check
    with pytest.raises(SystemExit):
        gpu_check.main(["out", "--budget", "0"])
    assert "--budget: expected a positive number of seconds, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu_check.main(["--help"])
    assert "--budget SECONDS" in capsys.readouterr().out


def test_the_sweep_has_a_float16_flash_row_for_the_gpu():
    """float16 flash attention at each T (the GPU's tensor cores beside SDPA's flash kernel): float16
    inputs, skipped on the CPU backends, its parity left to tests/kernels/cuda; the float32 rows as before."""
    from npformer.bench.cases import QUICK, flash_sweep_case
    half, single = flash_sweep_case(QUICK, 64, "float16"), flash_sweep_case(QUICK, 64)
    assert half.name == "flash attention T=64 float16" and half.gpu_only and half.precision == "float16"
    assert "float16" in half.parity_skipped and not single.gpu_only and single.precision == "float32"


def test_the_numpy_path_runs_the_fast_paths_without_numbas(tmp_path):
    """--paths numpy: the README's install (NumPy alone) on a machine with numba: no numba path runs."""
    _run(tmp_path, "--only", "gelu", "--skip-parity", "--paths", "fast,numpy")
    rows = {r["path"]: r for r in _rows(tmp_path) if r["framework"] == "npformer" and r["pass"] == "fwd"}
    assert set(rows) == {"fast", "numpy"} and "numba" not in (rows["numpy"]["impl"] or "")
    meta = json.loads(_one(tmp_path, ".json").read_text())["meta"]
    assert meta["cpu"]["model"] and isinstance(meta["cpu"]["vector_extensions"], list)


def test_cpu_profile_splits_a_small_models_step():
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, str(root / "benchmarks" / "cpu_profile.py"), "--steps", "2", "--threads", "1"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    first = res.stdout.splitlines()[1]
    assert "at one token" in first and "the fixed part" in first and "calls into npformer a step" in first
    assert "ops/linear.py:check_linear_inputs" in res.stdout
    timed = res.stdout.split("time in each fast path a step")[1].splitlines()[1:]
    assert any("linear_backward (" in line for line in timed) and timed[-1].endswith("in all")
    assert float(timed[-1].split()[0]) > 0
    products = next(line for line in res.stdout.splitlines() if line.startswith("  matrix products ("))
    step, in_products, calls = (float(v) for v in re.search(r"step ([\d.]+) ms", res.stdout).groups()
                                + re.search(r"([\d.]+) ms a step in (\d+) calls", products).groups())
    assert 0 < in_products < step and calls == 51     # gpt-tiny: 4 layers x 12 products (3 a linear), the head's 3


def test_cpu_profile_times_the_products_once_however_many_threads_run_them(monkeypatch):
    """timed_products: the wall time while any product runs, so two threads' halves of a product count
    once; every call counted, the fast path's and the reference's; both are their own again after."""
    import threading
    import time
    from collections import Counter
    from benchmarks import cpu_profile
    from npformer.kernels.cpu import linear as fast_linear
    from npformer.ops import linear as reference_linear
    monkeypatch.setattr(fast_linear, "_product", lambda a, b, out: time.sleep(0.05))
    before = (fast_linear._product, reference_linear.matmul)
    with cpu_profile.timed_products(Counter()) as total:
        halves = [threading.Thread(target=fast_linear._product, args=(None, None, None)) for _ in range(2)]
        start = time.perf_counter()
        for half in halves:
            half.start()
        for half in halves:
            half.join()
        wall = time.perf_counter() - start
        product = reference_linear.matmul(np.ones((2, 3), np.float32), np.ones((3, 4), np.float32))
    assert total["calls"] == 3 and (product == 3).all()
    assert 0.05 <= total["seconds"] <= wall + 0.01            # the two halves' 0.1 s of sleep, 0.05 s of wall time
    assert (fast_linear._product, reference_linear.matmul) == before


def test_busy_machine_times_both_thread_counts_quiet_and_busy(tmp_path):
    """benchmarks/busy_machine.py: a row per thread count and machine state, each with its ratio to
    one thread in the same state, written as markdown and JSON; npformer says how often it judged
    the machine busy."""
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, str(root / "benchmarks" / "busy_machine.py"), "--rounds", "1", "--steps", "1",
                          "--settle", "0", "--threads", "2", "--no-numba", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    (md,), (js,) = sorted(tmp_path.glob("*_busy-machine_numpy-alone.md")), sorted(tmp_path.glob("*.json"))
    report = json.loads(js.read_text())
    rows = {(r["threads"], r["state"]): r for r in report["rows"]}
    assert set(rows) == {(n, state) for n in (1, 2) for state in ("quiet", "busy")}
    assert all(r["median_ms"] > 0 for r in rows.values())
    assert rows[(1, "quiet")]["vs_one_thread"] == rows[(1, "busy")]["vs_one_thread"] == 1.0
    assert set(report["judged_busy"]) == {"quiet", "busy"} and "| npformer | 2 | busy |" in res.stdout
    assert md.read_text().startswith("# gpt-tiny (B 12, T 64) on a busy machine")


def test_gil_scaling_prints_a_row_per_size():
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, str(root / "benchmarks" / "gil_scaling.py"), "--sizes", "4096,8192",
                          "--elements", "3e6"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    rows = [line for line in res.stdout.splitlines() if line.startswith("| 4,096") or line.startswith("| 8,192")]
    assert len(rows) == 2 and all(line.rstrip(" |").endswith("x") for line in rows)


def test_handoff_times_the_region_and_each_product_three_ways():
    """benchmarks/handoff.py: the empty region's three times (back to back and after an idle pause),
    and for each of gpt-tiny's four products the pool's cut beside one thread, then BLAS's own threads."""
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, str(root / "benchmarks" / "handoff.py"), "--rounds", "4"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    if "one CPU available" in out:
        pytest.skip("one CPU: handoff.py has no second thread to measure (it says so and exits 0)")
    assert out.count("pool's task starts") == 2 and out.count("call returns") == 2
    assert out.count("cut in two on the pool") == 8 and out.count("whole, BLAS's 2 threads") == 4
    assert all(line.rstrip().endswith("]") for line in out.splitlines() if " us [" in line)

def test_saved_memory_counts_what_each_library_keeps_for_the_backward():
    """benchmarks/saved_memory.py on gpt-tiny's widths (768 tokens of d 128): npformer's layer norm keeps
    its float16 input and per-row statistics (no float32 x-hat), its training state is 16 bytes a parameter (no
    float32 copy of the gradients: the masters read the model's), and with dropout the fused kernels'
    masks are counted as a GPU keeps them (their seeds, no booleans); with PyTorch installed, its side is
    counted too."""
    import importlib.util
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    with_torch = importlib.util.find_spec("torch") is not None
    res = subprocess.run([sys.executable, str(root / "benchmarks" / "saved_memory.py"), "--model", "gpt-tiny",
                          "--seq", "8", "--dropout", "0.1"] + ([] if with_torch else ["--no-torch"]),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "| norm1.x | float16 | 0.2 |" in out and "| norm1.mean | float32 | 0.0 |" in out   # no float32 xhat
    assert "| float32 masters | float32 | 4.00 |" in out
    assert ".keep |" not in out and "dropout 0.1" in out   # residual and feed-forward dropouts: their seeds alone
    assert "in all 16.00 bytes a parameter" in out and "masters' gradients" not in out
    assert ("### PyTorch: kept for the backward" in out) == with_torch
    assert "### In all, kept for the backward: npformer " in out


def test_cpu_profile_runs_pytorch_at_npformers_dropout(monkeypatch):
    """PyTorch's step gets the model's own rate (the suite's 0.1 for gpt-small, 0 for gpt-tiny), or
    --dropout's in both libraries: a profile never compares a step with dropout against one without."""
    import sys
    from pathlib import Path
    pytest.importorskip("torch", reason="PyTorch is the reference the profile compares with")
    from npformer.bench import backends
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    try:
        from benchmarks import cpu_profile
    finally:
        sys.path.pop(0)
    rates = []

    class Recorder:
        def train_step(self, m, src, tgt, dropout):
            rates.append((m.dropout, dropout, src.shape))
            return lambda: None
    monkeypatch.setattr(backends, "reference_backend", lambda *args: Recorder())
    for model, given, want in (("gpt-small", None, 0.1), ("gpt-tiny", None, 0.0), ("gpt-small", 0.0, 0.0),
                               ("gpt-tiny", 0.25, 0.25)):
        cpu_profile.torch_profile(model, 1, given)
        m = cpu_profile.model_spec(model, given)
        # the step at the model's batch, then at one token (the fixed part), both at the same rate
        assert rates[-2:] == [(want, want, (m.B or 8, m.T or 128)), (want, want, (1, 1))], model
        assert cpu_profile.model_spec(model, given).dropout == want


def test_cpu_profile_gives_pytorchs_matmul_share():
    import sys
    from pathlib import Path
    pytest.importorskip("torch", reason="PyTorch is the reference the profile compares with")
    root = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, str(root / "benchmarks" / "cpu_profile.py"), "--steps", "2", "--threads", "1",
                          "--no-numba", "--torch"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "fast paths on without numba's" in res.stdout and "(numba)" not in res.stdout
    line = next(s for s in res.stdout.splitlines() if s.startswith("PyTorch"))
    share = float(re.search(r"\((\d+)%\) in matrix products", line).group(1))
    assert 0 < share < 100 and "in matrix products (aten::mm" in line
    assert float(re.search(r"at one token ([\d.]+) ms", line).group(1)) > 0
    ours, theirs, ratio = re.search(r"^Outside the matrix products \(the step less their time\): npformer ([\d.]+) ms, "
                                    r"PyTorch ([\d.]+) ms .*: ([\d.]+)x$", res.stdout, re.M).groups()
    ours, theirs, ratio = float(ours), float(theirs), float(ratio)
    assert ours > 0 and theirs > 0
    # the ratio is of the unrounded times: within the range their printed values (to 0.05 ms) allow, itself
    # printed to 0.005
    low, high = (ours - 0.05) / (theirs + 0.05), (ours + 0.05) / (theirs - 0.05)
    assert low - 0.005 <= ratio <= high + 0.005, (ours, theirs, ratio)
    # the other bracket: both libraries' products timed alone (blas_products), each step less them
    alone = re.search(r"^The same products timed alone \(benchmarks/blas_products.py: ([\d.]+) ms a step through "
                      r"NumPy's BLAS, ([\d.]+) through PyTorch's\), each step less them: npformer ([\d.]+) ms, "
                      r"PyTorch ([\d.]+) ms: ([\d.]+)x$", res.stdout, re.M)
    assert alone, res.stdout
    numpy_ms, torch_ms, ours, theirs, ratio = (float(v) for v in alone.groups())
    steps = [float(v) for v in re.findall(r"step ([\d.]+) ms \(median of 2\)", res.stdout)]
    assert len(steps) == 2 and numpy_ms > 0 and torch_ms > 0
    assert abs(ours - (steps[0] - numpy_ms)) <= 0.11 and abs(theirs - (steps[1] - torch_ms)) <= 0.11


def test_flash_at_training_shapes_counts_flops_as_flashattention_does(capsys):
    """The flash cases at training shapes: B H >= 32, T 1024 to 8192, D 64 and 128, causal or not, float16,
    bfloat16 and float32; FLOPs as FlashAttention's tables count them (forward 4 B H T^2 D, halved when causal;
    backward 2.5 times); GPU only, so that on the CPU `--only flash-train` skips them by name and says why."""
    from npformer.bench.cases import FLASH_TRAIN, FLASH_TRAIN_SHAPES, flash_train_cases
    cases = flash_train_cases()
    assert len(cases) == 4 * len(FLASH_TRAIN_SHAPES)            # float16, bfloat16, float32; float16 on wgmma
    assert [c.name.endswith(" float16 wgmma") for c in cases[:4]] == [False, False, False, True]
    for (b, h, t, d, causal), case in zip([s for s in FLASH_TRAIN_SHAPES for _ in range(4)], cases):
        assert b * h >= 32 and 1024 <= t <= 8192 and d in (64, 128) and case.family == FLASH_TRAIN
        forward = 4 * b * h * t * t * d / (1 + causal)
        assert case.flops == {"fwd": forward, "bwd": 2.5 * forward}
        assert case.gpu_only and ("causal" in case.name) == causal and case.precision in case.name
    assert {c.precision for c in cases} == {"float16", "bfloat16", "float32"} and any(not s[4] for s in FLASH_TRAIN_SHAPES)
    assert suite.main(["--quick", "--only", "flash-train", "--backends", "numpy", "--paths", "fast", "--skip-parity",
                       "--out", str(Path.cwd() / "ft")]) == 0
    out = capsys.readouterr().out
    assert all(f"{c.name} numpy: skipped (a GPU case" in out for c in cases)


def test_the_torch_reference_has_causal_attention():
    """The reference beside the causal flash cases: SDPA with is_causal, equal to npformer's causal
    attention (the float64 reference op)."""
    torch = pytest.importorskip("torch", reason="torch not installed: the reference's op is PyTorch's")
    from benchmarks import torch_reference
    from npformer.kernels import disabled
    from npformer.ops.attention import scaled_dot_product_attention_forward
    q, k, v = (np.random.default_rng(s).standard_normal((1, 2, 5, 4)) for s in range(3))
    theirs = torch_reference.OPS["attention_causal"](*(torch.from_numpy(a) for a in (q, k, v))).numpy()
    with disabled():
        ours = scaled_dot_product_attention_forward(q, k, v, is_causal=True)[0]
    np.testing.assert_allclose(theirs, ours, rtol=1e-12, atol=1e-12)


def test_the_torch_gpt_is_nanogpt_s_structure_and_computes_the_layers_model():
    """The torch column's GPT (one fused QKV product, SDPA with is_causal) and the torch-layers column's
    (nn.TransformerEncoderLayer) load npformer's weights by name, strictly, and give the same logits,
    loss and gradients."""
    pytest.importorskip("torch", reason="the reference models are PyTorch's")
    from benchmarks import torch_reference as tr
    from npformer.bench.steps import _npformer_model
    from npformer.interop import to_numpy_state_dict
    m = dataclasses.replace(TINY, F=32)
    src = np.random.default_rng(0).integers(1, 20, (2, 8))
    tgt = src[:, ::-1].copy()
    state = to_numpy_state_dict(_npformer_model("numpy", m, 8, 0.0))
    nano = tr.TorchBackend("cpu", 1).model_outputs(m, src, tgt, state)
    layers = tr.LayersBackend("cpu", 1).model_outputs(m, src, tgt, state)
    np.testing.assert_allclose(nano[0], layers[0], rtol=0, atol=1e-6)
    np.testing.assert_allclose(nano[1], layers[1], rtol=1e-6)
    assert nano[2].keys() == layers[2].keys() == state.keys() - {"head.weight"}
    for k in nano[2]:
        np.testing.assert_allclose(nano[2][k], layers[2][k], rtol=0, atol=1e-6, err_msg=k)
    sources = {type(mod).__name__ for mod in tr.make_model(tr.TorchBackend("cpu", 1), m, 8, 0.0).modules()}
    assert "CausalSelfAttention" in sources and "TransformerEncoderLayer" not in sources


def test_the_layers_and_compile_columns_take_the_gpt_steps_only():
    """... and not the CUDA graph cases, whose PyTorch side is the same model's as the case without it."""
    pytest.importorskip("torch", reason="the columns are PyTorch's")
    from benchmarks import torch_reference as tr
    from npformer.bench.steps import model_cases
    cases = op_cases(QUICK) + model_cases(QUICK, quick=True)
    graphs = {c.name for c in cases if c.graph}
    assert graphs == {"gpt-medium-graph", "gpt2-124m-fp16-graph"}
    for cls in (tr.LayersBackend, tr.CompiledBackend):
        taken = {c.name for c in cases if cls("cpu", 1).takes(c)}
        assert taken == {c.name for c in cases if c.group == "model" and c.kind == "gpt"} - graphs
    assert all(tr.TorchBackend("cpu", 1).takes(c) for c in cases)
    assert {tr.LayersBackend("cpu", 1).name, tr.CompiledBackend("cuda", 1).name} == {"torch-layers-cpu",
                                                                                      "torch-compile-cuda"}


def test_the_compile_column_reports_its_compile_time_apart(tmp_path):
    """torch.compile on the CPU (a C++ compiler builds its kernels): gpt-tiny's row has the first
    step's time as compile_s, the timed steps after it; the other cases have no torch-compile row."""
    pytest.importorskip("torch", reason="the column is PyTorch's")
    import shutil
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler: torch.compile's CPU kernels are C++")
    assert suite.main(["--quick", "--backends", "numpy,torch-compile", "--paths", "fast", "--skip-parity",
                       "--only", "gpt-tiny,linear", "--out", str(tmp_path)]) == 0
    rows = _rows(tmp_path)
    compiled = [r for r in rows if r["backend"] == "torch-compile-cpu"]
    assert [r["name"] for r in compiled] == ["gpt-tiny"]
    assert compiled[0]["compile_s"] > 0 and compiled[0]["ms"] > 0 and compiled[0]["framework"] == "torch-compile"
    assert all(r["compile_s"] is None for r in rows if r["backend"] == "numpy")
    assert "| compile s |" in _one(tmp_path, ".md").read_text()


def test_a_busy_machine_and_disagreeing_repeats_are_said_beside_the_results(monkeypatch):
    """The load average before the run and the usable CPUs are recorded; a run that starts on a
    machine whose other work leaves fewer idle CPUs than its threads says so in a warning and a
    note, and so does a row whose repeats disagree (its median marked ~ in the report)."""
    assert harness.busy_machine(None, 2, 2) is None and harness.busy_machine(0.3, 2, 2) is None
    assert harness.busy_machine(0.4, 1, 2) is None
    busy = harness.busy_machine(2.5, 2, 2)
    assert busy.startswith("busy machine: load average 2.5 before the run, 2 usable CPUs, 2 threads")
    quiet = dict(ms=10.0, q1_ms=9.5, q3_ms=10.5)
    assert not harness.repeats_disagree(quiet) and harness.repeats_disagree(dict(ms=10.0, q1_ms=8.0, q3_ms=16.0))
    monkeypatch.setattr(suite, "load_average", lambda: 7.5)
    monkeypatch.setattr(suite, "repeats_disagree", lambda timing: True)
    logs = []
    result = suite.run_suite([Backend("numpy", 1)], quick=True, parity=False, only={"gelu"}, log=logs.append)
    notes = result["meta"]["notes"]
    assert result["meta"]["load"]["start"] == 7.5 and any(n.startswith("busy machine: load average 7.5") for n in notes)
    assert any(line.startswith("warning: busy machine") for line in logs)
    assert all(r["noisy"] for r in result["rows"]) and all(r["load_1min"] == 7.5 for r in result["rows"])
    assert any(n.startswith("repeats disagree (interquartile range over 50% of the median) in 4 of 4 rows: gelu fwd "
                            "numpy fast, gelu bwd numpy fast")
               for n in notes)
    text = report.markdown(result)
    assert "Load average (1 min): 7.5 before the run" in text and "]~" in text


def test_cpu_profile_times_the_pools_regions():
    """timed_regions: a region of the pool adds its count and its time, split into the set-up, the
    calling thread's own part and the wait after it, in all and under the fast path running; a
    single task adds nothing; the pool's helpers are its own again after the block."""
    import time
    from collections import Counter
    from benchmarks import cpu_profile
    from npformer.kernels.cpu import threads
    before = (threads.get_num_threads(), threads._blas_at_one_thread, threads._run_part, threads._Part)
    threads.set_num_threads(2, blas=False)
    try:
        running = ["gelu_forward (cpu)"]                                 # as timed_fast_paths names it
        with cpu_profile.timed_regions(Counter(), running) as total:
            threads.run_parallel([lambda: time.sleep(0.02), lambda: time.sleep(0.06)])
            threads.run_parallel([lambda: time.sleep(0.01)], blas_one_thread=True)
        assert total["regions"] == total["gelu_forward (cpu)/regions"] == 1
        assert total["gelu_forward (cpu)/after"] == total["after"]
        assert 0.015 < total["own"] < 0.05 and total["after"] > 0.02       # it waited for the longer part
        assert abs(total["before"] + total["own"] + total["after"] - total["region"]) < 1e-9
        assert (threads._blas_at_one_thread, threads._run_part, threads._Part) == before[1:]
    finally:
        threads.set_num_threads(before[0], blas=False)


def test_blas_products_times_each_library_and_refuses_one_without_sgemm():
    """benchmarks/blas_products.py: a row per library and thread count (NumPy's, and PyTorch's when
    installed, with the ratio to it), every cell three products; a --cblas library that exports no
    cblas_sgemm is refused with the name of what was expected."""
    import ctypes.util
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "blas_products.py"
    res = subprocess.run([sys.executable, str(script), "--threads", "1", "--rounds", "2"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    rows = [line for line in res.stdout.splitlines() if line.startswith("| NumPy") or line.startswith("| PyTorch")]
    assert rows and rows[0].startswith("| NumPy ") and "| 1 |" in rows[0]
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert all(len(c.split(" / ")) == 3 for c in cells[2:7]), row
    if any(r.startswith("| PyTorch") for r in rows):
        assert rows[1].rstrip(" |").endswith("1.00x") and rows[0].rstrip(" |").endswith("x")
    libc = ctypes.util.find_library("c")
    if libc is None:
        pytest.skip("no C library found to offer as a --cblas library without sgemm")
    res = subprocess.run([sys.executable, str(script), "--rounds", "2", "--cblas", libc],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode != 0 and "expected a library exporting one of cblas_sgemm" in res.stderr


def test_element_passes_gives_each_operands_pass_beside_numpys_flat_one():
    """benchmarks/element_passes.py: a row per shape and pass (flat, a row vector, a column, the row
    maximum, exp), each with NumPy's time, its time an element and its ratio to NumPy's flat pass
    (1.00x for the flat pass itself); PyTorch's column where it is installed and not refused; a bad
    shape is refused with what was expected."""
    root = Path(__file__).resolve().parents[1]
    script = str(root / "benchmarks" / "element_passes.py")
    with_torch = importlib.util.find_spec("torch") is not None
    for extra, torch_column in (([], with_torch), (["--no-torch"], False)):
        res = subprocess.run([sys.executable, script, "--shapes", "64x32,16x8", "--repeats", "5"] + extra,
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        rows = [line for line in res.stdout.splitlines() if line.startswith(("| 64 x 32 |", "| 16 x 8 |"))]
        assert len(rows) == 10 and ("NumPy / PyTorch" in res.stdout) == torch_column
        cells = [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]
        assert [c[1] for c in cells[:5]] == ["flat", "a row vector (C,)", "a column (N, 1)", "row maximum", "exp"]
        assert cells[0][4] == "1.00x" and all(float(c[2]) > 0 for c in cells)
        assert all(len(c) == (7 if torch_column else 5) for c in cells)
    bad = subprocess.run([sys.executable, script, "--shapes", "64by32"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "expected shapes NxC such as 768x128, got '64by32'" in bad.stderr


def test_causal_attention_times_is_causal_beside_the_same_mask_given_and_pytorch():
    """benchmarks/causal_attention.py: a row per length with the masked and the is_causal times, their
    ratio (the script checks that both give the same results), and PyTorch's causal attention where it is
    installed and not refused; T = 300 has blocks of query rows, so is_causal computes fewer keys there;
    bad lengths are refused with what was expected."""
    root = Path(__file__).resolve().parents[1]
    script = str(root / "benchmarks" / "causal_attention.py")
    with_torch = importlib.util.find_spec("torch") is not None
    for extra, torch_column in (([], with_torch), (["--no-torch", "--no-numba"], False)):
        res = subprocess.run([sys.executable, script, "--lengths", "8,300", "--heads", "2", "--head-size", "4",
                              "--repeats", "3", "--rounds", "2"] + extra, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr
        rows = [line for line in res.stdout.splitlines() if line.startswith(("| 8 |", "| 300 |"))]
        cells = [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]
        assert [c[0] for c in cells] == ["8", "300"] and all(len(c) == (6 if torch_column else 4) for c in cells)
        assert all(c[3].endswith("x") and float(c[3][:-1]) > 0 for c in cells)
        assert ("PyTorch SDPA is_causal" in res.stdout) == torch_column
    bad = subprocess.run([sys.executable, script, "--lengths", "64,x"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "expected lengths T >= 1 such as 64,512, got '64,x'" in bad.stderr


def test_gpu_check_kills_a_stage_that_runs_past_its_time_with_every_process_it_started(tmp_path):
    """run_command: a command past its timeout is killed with its children (pytest's workers, the program ncu
    profiles), so none of them holds the GPU while the next stage runs."""
    import time
    from benchmarks import gpu_check
    pid_file = tmp_path / "child.pid"
    spawn = ("import subprocess, sys, time; "
             "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
             f"open({str(pid_file)!r}, 'w').write(str(child.pid)); print('started', flush=True); time.sleep(60)")
    t0 = time.monotonic()
    code, output = gpu_check.run_command([sys.executable, "-c", spawn], timeout=3)
    assert code is None and "started" in output and time.monotonic() - t0 < 30
    child = int(pid_file.read_text())
    for _ in range(50):                                        # the kill is delivered at once; reaping may lag
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        with open(f"/proc/{child}/stat") as f:
            assert f.read().split()[2] == "Z", "the stage's child outlived the stage"   # killed, not yet reaped
    assert gpu_check.run_command([sys.executable, "-c", "print('fine')"], timeout=30) == (0, "fine\n")


def test_gpu_check_returns_from_a_stage_whose_escaped_child_holds_its_output(tmp_path, monkeypatch):
    """A child that left the stage's process group (a session of its own) outlives the kill and keeps the
    output pipes open: run_command gives up on the rest of the output after REAP_S and returns what came."""
    import signal
    import time
    from benchmarks import gpu_check
    monkeypatch.setattr(gpu_check, "REAP_S", 1)
    pid_file = tmp_path / "escaped.pid"
    spawn = ("import subprocess, sys, time; "
             "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'], start_new_session=True); "
             f"open({str(pid_file)!r}, 'w').write(str(child.pid)); print('started', flush=True); time.sleep(30)")
    t0 = time.monotonic()
    try:
        code, output = gpu_check.run_command([sys.executable, "-c", spawn], timeout=3)
        assert code is None and "started" in output and time.monotonic() - t0 < 15
    finally:
        if pid_file.exists():
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
