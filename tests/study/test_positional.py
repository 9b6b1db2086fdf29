"""``npformer study positional``: the data it writes, and the offset-only property it reports."""
import csv
import json

import numpy as np

from npformer.cli import main
from npformer.study.positional import measure


def test_dot_product_depends_only_on_the_offset():
    m = measure(40, 16)
    assert m["max_shift_error"] < 1e-12
    # sum_i cos(k w_i) over the d/2 frequencies: d/2 at offset 0, and less at every other offset
    np.testing.assert_allclose(m["profile"][0], 8.0, rtol=0, atol=1e-12)
    assert (m["profile"][1:] < 8.0).all()


def test_cli_writes_csv_and_json(tmp_path, capsys):
    assert main(["study", "positional", "--positions", "12", "--d-model", "6", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(tmp_path / "positional_similarity.csv")))
    assert [int(r["offset"]) for r in rows] == list(range(12))
    data = json.load(open(tmp_path / "positional.json"))
    assert data["positions"] == 12 and len(data["dot_product_by_offset"]) == 12
    assert "depends only on k" in capsys.readouterr().out


def test_cli_rejects_a_bad_size(capsys):
    assert main(["study", "positional", "--positions", "1"]) == 2
    assert "--positions" in capsys.readouterr().err


def test_without_matplotlib_the_data_files_are_still_written(tmp_path, capsys, monkeypatch):
    """matplotlib is an optional extra (plot): without it an experiment writes CSV/JSON and says so."""
    import sys
    monkeypatch.setitem(sys.modules, "matplotlib", None)          # import matplotlib -> ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    assert main(["study", "positional", "--positions", "8", "--d-model", "4", "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["positional.json", "positional_similarity.csv"]
    assert "matplotlib is not installed" in capsys.readouterr().out
