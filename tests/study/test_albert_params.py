"""``npformer study albert``: the files it writes, and counts equal to the closed form and to built models."""
import csv
import importlib.util
import json

import pytest

from npformer.cli import main
from npformer.study.albert_params import PARTS, SHAPES, measure
from tests.models.test_albert import _closed_form


def _expected(shape, share, factorised):
    v, h, n, _, f, p, e = SHAPES[shape]
    return _closed_form(v, p, 2, e, h, f, n, share, factorised, mlm=False)


def test_cli_writes_well_formed_files_with_the_closed_form_counts(tmp_path, capsys):
    assert main(["study", "albert", "--shapes", "char", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(tmp_path / "albert_params.csv")))
    assert len(rows) == 9 and {r["shape"] for r in rows} == {"char"}
    assert [r["model"] for r in rows][:3] == ["BERT", "ALBERT E=H share=none", "ALBERT E=H share=all"]
    for r in rows:
        factorised = r["factorised"] == "True"
        want = _expected("char", r["share"], factorised)
        assert int(r["total"]) == want == int(r["built"]) == sum(int(r[k]) for k in PARTS)
        assert int(r["embedding"]) == (SHAPES["char"][6] if factorised else SHAPES["char"][1])
    bert = int(rows[0]["total"])
    for r in rows:
        assert float(r["fraction_of_bert"]) == pytest.approx(int(r["total"]) / bert, rel=1e-12)
    data = json.load(open(tmp_path / "albert_params.json"))
    assert data["shapes"]["char"]["hidden"] == 128 and len(data["rows"]) == 9
    assert data["rows"][0]["total"] == bert
    out = capsys.readouterr().out
    assert "= closed form" in out and "ALBERT E=32 share=all" in out
    if importlib.util.find_spec("matplotlib") is None:     # the plot extra is optional: data only, and a note
        assert not (tmp_path / "albert_params.png").exists() and "matplotlib is not installed" in out
    else:
        assert (tmp_path / "albert_params.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_base_shape_counts_without_building():
    rows = measure(["base"], build_limit=0)
    assert all(r["built"] == "" for r in rows)
    by = {(r["share"], r["factorised"]): r["total"] for r in rows[1:]}
    assert rows[0]["total"] == _expected("base", "none", False) == by[("none", False)]
    for (share, factorised), total in by.items():
        assert total == _expected("base", share, factorised)
    # the two reductions together: ALBERT-base is about a ninth of BERT-base (Table 1: 12M against 108M)
    assert 0.10 < by[("all", True)] / rows[0]["total"] < 0.11


def test_bad_build_limit_is_a_clear_error(tmp_path, capsys):
    assert main(["study", "albert", "--build-limit", "-1", "--out", str(tmp_path)]) == 2
    assert "--build-limit: expected a finite number >= 0, got -1" in capsys.readouterr().err
