"""``npformer study xl-memory``: the files it writes, and the effect it reports.

The effect is asserted at a tiny size with a fixed seed where it is far from the edge: with segments
of 4 tokens and a period of 6, seeds 0-3 all gave a validation loss near 1.5 with memory against 2.8
without, and near 0.83 when evaluated with twice the training memory (measured when this test was
written); the test asserts half-unit margins. The data files and the summary are the assertions; the
PNG is checked when matplotlib (the plot extra) is installed, and the run without it is a test of its own."""
import csv
import importlib.util
import json
import sys

import pytest

from npformer.cli import main

TINY = ["--segment", "4", "--d-model", "32", "--heads", "2", "--ff", "64", "--batch-size", "16", "--lr", "3e-3",
        "--n-train", "500", "--n-valid", "50", "--seed", "0"]
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def test_memory_lowers_validation_loss_and_a_longer_memory_lowers_it_more(tmp_path, capsys):
    assert main(["study", "xl-memory", *TINY, "--steps", "640", "--eval-every", "320", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "memory lowers the validation loss" in out
    summary = json.load(open(tmp_path / "xl_memory.json"))
    assert summary["period"] == 6 and summary["mem_len"] == 4 and summary["memory_lowers_valid_loss"]
    final = summary["final_valid_loss"]
    assert final["with_memory"] < final["without_memory"] - 0.5
    assert final["without_memory"] > summary["uniform_loss"] - 0.05       # no memory, no recall
    evals = {(r["trained_mem_len"], r["eval_mem_len"]): r for r in summary["evaluation"]}
    assert set(evals) == {(m, e) for m in (0, 4) for e in (0, 4, 8, 16)}
    assert evals[(4, 8)]["valid_loss"] < evals[(4, 4)]["valid_loss"] - 0.5    # longer than training had
    assert evals[(4, 8)]["recall_accuracy"] > 0.9
    curves = list(csv.DictReader(open(tmp_path / "xl_memory_curves.csv")))
    assert [(int(r["mem_len"]), int(r["step"])) for r in curves] == [(0, 320), (0, 640), (4, 320), (4, 640)]
    assert float(curves[-1]["valid_loss"]) == pytest.approx(final["with_memory"])
    rows = list(csv.DictReader(open(tmp_path / "xl_memory_eval.csv")))
    assert len(rows) == 8 and {"valid_loss", "recall_accuracy", "reach_of_first_query"} <= set(rows[0])
    png = tmp_path / "xl_memory.png"
    if HAS_MATPLOTLIB:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:                                           # the plot extra is not installed: the data files only
        assert not png.exists() and "matplotlib is not installed" in out


def test_data_files_without_matplotlib(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)          # import matplotlib -> ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    assert main(["study", "xl-memory", *TINY, "--steps", "4", "--eval-every", "2", "--eval-mem", "0,8",
                 "--n-valid", "4", "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["xl_memory.json", "xl_memory_curves.csv",
                                                          "xl_memory_eval.csv"]
    assert [int(r["eval_mem_len"]) for r in csv.DictReader(open(tmp_path / "xl_memory_eval.csv"))] == [0, 8, 0, 8]
    out = capsys.readouterr().out
    assert "validation loss without memory (M=0)" in out and "matplotlib is not installed" in out


@pytest.mark.parametrize("bad, message", [(["--segment", "0"], "--segment: expected an int >= 1, got 0"),
                                          (["--mem-len", "0"], "--mem-len: expected an int >= 1, got 0"),
                                          (["--eval-mem", "4,x"], "--eval-mem: expected comma-separated ints"),
                                          (["--eval-mem", "-1"], "--eval-mem: expected memory lengths >= 0")])
def test_bad_arguments(tmp_path, capsys, bad, message):
    assert main(["study", "xl-memory", *bad, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
