"""Smoke test of the benchmark suite (issue 5): the quick mode runs on numpy (and torch when it
imports) and writes well-formed markdown, JSON and, with matplotlib, a PNG. No timing is asserted."""
import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks import bench

ROOT = Path(__file__).resolve().parents[1]
HAS_TORCH = importlib.util.find_spec("torch") is not None
OPS = ["linear", "softmax", "layer_norm", "gelu", "attention", "multi_head", "ffn", "cross_entropy"]
MODELS = ["gpt-small", "gpt-medium", "seq2seq-base"]
ROW_KEYS = {"group", "name", "pass", "shape", "backend", "framework", "device", "ms", "q1_ms", "q3_ms",
            "min_ms", "max_ms", "repeats", "flops", "tokens", "tokens_per_s", "gflops", "peak_share",
            "vs_torch", "peak_mb"}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    backends = "numpy,torch" if HAS_TORCH else "numpy"
    assert bench.main(["--quick", "--backends", backends, "--out", str(out)]) == 0
    return out, backends.replace("torch", "torch-cpu").split(",")


def _one(out, suffix):
    files = sorted(out.glob("*" + suffix))
    assert len(files) == 1, files
    assert re.fullmatch(r"[a-z0-9-]+_\d{4}-\d{2}-\d{2}_quick" + re.escape(suffix), files[0].name)
    return files[0]


def test_json_rows_and_columns(quick_run):
    out, backends = quick_run
    result = json.loads(_one(out, ".json").read_text())
    meta = result["meta"]
    assert meta["mode"] == "quick" and meta["backends"] == backends
    assert set(result["matmul_peak_gflops"]) == set(backends)
    assert set(meta["flop_counts"]) >= {"linear", "attention", "train_step"}
    rows = result["rows"]
    for r in rows:
        assert set(r) == ROW_KEYS, set(r) ^ ROW_KEYS
        for k in ("ms", "q1_ms", "q3_ms", "min_ms", "max_ms", "tokens_per_s", "gflops", "peak_share"):
            assert isinstance(r[k], float) and math.isfinite(r[k]) and r[k] >= 0, (r["name"], k, r[k])
        assert r["min_ms"] <= r["q1_ms"] <= r["ms"] <= r["q3_ms"] <= r["max_ms"]
        assert r["repeats"] >= 3 and r["flops"] > 0 and r["tokens"] > 0
        assert r["peak_mb"] is None or r["peak_mb"] >= 0
    got = {(r["name"], r["pass"], r["backend"]) for r in rows}
    want = {(op, p, b) for op in OPS for p in ("fwd", "bwd") for b in backends}
    want |= {(m, "step", b) for m in MODELS for b in backends}
    want |= {("attention T=128", p, b) for p in ("fwd", "bwd") for b in backends}
    assert want <= got, want - got
    for r in rows:                                   # the ratio exists exactly when torch ran too
        assert (r["vs_torch"] is not None) == (HAS_TORCH and r["framework"] == "npformer")


def test_markdown_tables_are_well_formed(quick_run):
    out, backends = quick_run
    text = _one(out, ".md").read_text()
    tables, current = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append(current)
            current = []
    assert len(tables) == 3                          # summary, sweep, every row
    for t in tables:
        widths = {len(line.strip("|").split("|")) for line in t}
        assert len(widths) == 1, t[:3]
        assert re.fullmatch(r"\|(---\|)+", t[1])
    summary, sweep, detail = tables
    assert all(f"{b} ms" in summary[0] for b in backends)
    assert ("numpy/torch-cpu" in summary[0]) == HAS_TORCH
    assert {line.split("|")[1].strip() for line in summary[2:]} == set(OPS + MODELS)
    assert sweep[2].startswith("| 128 |")
    for col in ("ms", "IQR", "tokens/s", "GFLOP/s", "% peak", "vs torch", "peak MB"):
        assert f" {col} |" in detail[0]
    assert len(detail) - 2 == len(json.loads(_one(out, ".json").read_text())["rows"])
    assert "FLOP counts used" in text


def test_png_written_when_matplotlib_is_present(quick_run):
    out, _ = quick_run
    if importlib.util.find_spec("matplotlib") is None:
        assert not list(out.glob("*.png"))
    else:
        assert _one(out, ".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_summarize_against_numpy_percentiles():
    times = [0.003, 0.001, 0.002, 0.010, 0.004]
    s = bench.summarize(times)
    ms = np.array(times) * 1e3
    assert s["ms"] == pytest.approx(np.median(ms))
    assert (s["q1_ms"], s["q3_ms"]) == pytest.approx(tuple(np.percentile(ms, [25, 75])))
    assert (s["min_ms"], s["max_ms"], s["repeats"]) == (pytest.approx(1.0), pytest.approx(10.0), 5)


def test_time_call_warms_up_then_repeats():
    calls, syncs = [], []
    s = bench.time_call(lambda: calls.append(1), lambda: syncs.append(1), warmup=2, repeats=5, budget_s=10)
    assert len(calls) == len(syncs) == 7 and s["repeats"] == 5


def test_bad_backend_names():
    with pytest.raises(ValueError, match="unknown backend 'jax'"):
        bench.make_backends(["numpy", "jax"], 1)
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--backends", "tensorflow"])


def test_import_pulls_in_neither_torch_nor_cupy():
    code = ("import sys, benchmarks.bench; "
            "assert 'torch' not in sys.modules and 'cupy' not in sys.modules, 'imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_the_package_never_imports_torch():
    """torch is a reference for tests/ and benchmarks/ only: no module of npformer imports it."""
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "npformer").rglob("*.py")
                 if re.search(r"^\s*(import torch|from torch)\b", p.read_text(), flags=re.M)]
    assert offenders == []


def test_npformer_bench_hands_its_options_to_the_suite(capsys):
    from npformer.cli import main
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--help"])
    assert exc.value.code == 0 and "--backends" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["bench", "--backends", "tensorflow"])
    assert "unknown backend" in capsys.readouterr().err
