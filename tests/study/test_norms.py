"""``npformer study norms``: the task, batch-independence of LayerNorm (and its absence for BatchNorm),
the files a tiny run writes."""
import csv
import importlib.util
import json

import numpy as np
import pytest

from npformer.cli import main
from npformer.models.norm_encoder import NormEncoder, NormEncoderConfig
from npformer.nn.module import no_grad
from npformer.study.norms import IGNORE, Histogram, batch_statistics, running_statistics

ROUNDING = 1e-12      # float64: anything below is rounding, the outputs are the same


def test_histogram_task_encodes_counts():
    task = Histogram(alphabet="ab", min_len=2, max_len=4)
    a, b = task.vocab.encode("a")[0], task.vocab.encode("b")[0]
    ids, targets = task.encode([np.array([a, b, a]), np.array([b, b])], width=6)
    np.testing.assert_array_equal(ids, [[1, a, b, a, 0, 0], [1, b, b, 0, 0, 0]])
    np.testing.assert_array_equal(targets, [[IGNORE, 2, 1, 2, IGNORE, IGNORE], [IGNORE, 2, 2, IGNORE, IGNORE, IGNORE]])
    seqs = task.sample(np.random.default_rng(0), 50)
    assert all(2 <= len(s) <= 4 and set(s.tolist()) <= {a, b} for s in seqs)
    with pytest.raises(ValueError, match="width 3 is shorter"):
        task.encode([np.array([a, b, a])], width=3)
    with pytest.raises(ValueError, match="min_len <= max_len"):
        Histogram(min_len=5, max_len=2)


def _fresh(norm, seed=0):
    task = Histogram(max_len=8)
    cfg = NormEncoderConfig(vocab_size=len(task.vocab), num_classes=task.num_classes, d_model=8, nhead=2,
                            num_layers=2, dim_feedforward=16, norm=norm, max_len=24)
    return task, NormEncoder(cfg, dtype="float64", rng=seed)


def _outputs_of_probe(model, task, probe, neighbours, width=None):
    """Logits of ``probe`` (its symbol positions) when batched first among ``neighbours``."""
    ids, _ = task.encode([probe, *neighbours], width)
    return model(ids)[0, 1:len(probe) + 1]


def _changes(model, task):
    """Largest logit change of one sequence: alone vs with neighbours, short vs long neighbours,
    and the same batch with extra padding columns."""
    rng = np.random.default_rng(1)
    probe = task.sample(rng, 1, length=5)[0]
    short, long_ = task.sample(rng, 7, length=2), task.sample(rng, 7, length=8)
    alone = _outputs_of_probe(model, task, probe, [])
    with_short = _outputs_of_probe(model, task, probe, short)
    with_long = _outputs_of_probe(model, task, probe, long_)
    padded = _outputs_of_probe(model, task, probe, short, width=20)
    return {"neighbours": np.abs(with_short - with_long).max(), "alone": np.abs(alone - with_long).max(),
            "padding": np.abs(with_short - padded).max()}


def test_layernorm_outputs_do_not_depend_on_the_batch():
    task, model = _fresh("layer")
    for ctx in (batch_statistics, running_statistics):
        with ctx(model):
            ch = _changes(model, task)
        assert max(ch.values()) < ROUNDING, ch


@pytest.mark.parametrize("norm", ["batch", "batch_masked"])
def test_batchnorm_outputs_depend_on_the_batch_unless_running_statistics_are_used(norm):
    task, model = _fresh(norm)
    with batch_statistics(model):
        ch = _changes(model, task)
    assert ch["neighbours"] > 1e-3 and ch["alone"] > 1e-3, ch
    if norm == "batch":
        assert ch["padding"] > 1e-3, ch                   # padding is part of the statistics
    else:
        assert ch["padding"] < ROUNDING, ch               # left out of them
    with running_statistics(model):
        ch = _changes(model, task)
    assert max(ch.values()) < ROUNDING, ch


def test_batch_statistics_leave_the_running_statistics_and_modes_alone():
    task, model = _fresh("batch")
    ids, _ = task.encode(task.sample(np.random.default_rng(0), 4))
    with no_grad():
        model(ids)                                        # one training-mode step of statistics
    before = {k: v.copy() for k, v in model.state_dict().items()}
    with batch_statistics(model):
        assert model.layers[0].norm1.training and not model.layers[0].dropout1.training
        model(ids)
    assert model.training
    after = model.state_dict()
    for k, v in before.items():
        np.testing.assert_array_equal(after[k], v)


def test_cli_tiny_run_writes_well_formed_files(tmp_path, capsys):
    argv = ["study", "norms", "--steps", "3", "--batch-size", "4", "--d-model", "8", "--ff", "8", "--max-len", "6",
            "--n-valid", "8", "--eval-batch", "8", "--probes", "2", "--extra-pad", "4", "--out", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "batch stats B=1" in out and "wrote" in out
    assert (tmp_path / "norms.png").exists() == (importlib.util.find_spec("matplotlib") is not None)
    rows = list(csv.DictReader(open(tmp_path / "norms.csv")))
    assert {r["norm"] for r in rows} == {"layer", "batch", "batch_masked"}
    assert {r["experiment"] for r in rows} == {"eval", "batch_size", "padding", "neighbours"}
    assert all(0.0 <= float(r["accuracy"]) <= 1.0 for r in rows)
    data = json.load(open(tmp_path / "norms.json"))
    res = data["results"]
    assert data["config"]["steps"] == 3 and data["task"]["max_len"] == 6
    assert len(data["train_loss"]["layer"]) == 3
    assert [int(b) for b in res["layer"]["by_batch_size"]] == [1, 2, 4, 8, 16, 64]
    # LayerNorm: nothing a batch does changes a sequence's outputs; BatchNorm: padding does
    lay = res["layer"]
    assert lay["by_batch_size"]["1"]["change"][0] < ROUNDING
    assert lay["by_padding"][-1]["change"][0] < ROUNDING and lay["neighbours"]["change"][0] < ROUNDING
    assert res["batch"]["by_padding"][-1]["change"][0] > 1e-6
    assert res["batch_masked"]["by_padding"][-1]["change"][0] < ROUNDING
    fractions = [v["padding_fraction"] for v in res["batch"]["by_padding"]]
    assert fractions == sorted(fractions) and fractions[-1] > fractions[0]


def test_cli_rejects_bad_options(capsys):
    assert main(["study", "norms", "--norms", "layer,group"]) == 2
    assert "--norms" in capsys.readouterr().err
    assert main(["study", "norms", "--batch-size", "1"]) == 2
    assert "BatchNorm needs more than one" in capsys.readouterr().err
