"""``npformer study layers``: the files it writes, that its per-layer gradient norms equal finite
differences of the loss on a tiny float64 model in all four configurations, whole-model gradchecks,
and what a short training run shows by a wide margin (residuals keep layer 1's gradient alive)."""
import csv
import json

import numpy as np
import pytest
from hypothesis import given, strategies as st

from npformer.cli import main
from npformer.data import CharLMData, load_corpus
from npformer.nn import no_grad
from npformer.ops.cross_entropy import cross_entropy_forward
from npformer.study.layer_grads import CONFIGS, LayerStackLM, gradient_step, train_config
from npformer.tools.gradcheck import EPS, gradcheck_module
from tests.helpers import assert_gradcheck, seeds


def _tiny(name, seed=0, vocab=7):
    norm_first, residual = CONFIGS[name]
    return LayerStackLM(vocab, 4, 2, 2, 5, 4, norm_first=norm_first, residual=residual, dtype="float64", rng=seed)


def _five_point(f, x, idx):
    saved = x[idx]
    vals = {}
    for k in (1, -1, 2, -2):
        x[idx] = saved + k * EPS
        vals[k] = f()
    x[idx] = saved
    return (8 * (vals[1] - vals[-1]) - (vals[2] - vals[-2])) / (12 * EPS)


def test_cli_writes_well_formed_files(tmp_path, capsys):
    args = ["study", "layers", "--layers", "2", "--d-model", "8", "--heads", "2", "--ff", "8",
            "--block-size", "6", "--steps", "3", "--batch-size", "2", "--valid-batches", "1", "--out", str(tmp_path)]
    assert main(args) == 0
    rows = list(csv.DictReader(open(tmp_path / "layers_grad_norms.csv")))
    assert len(rows) == 4 * 3 * 2
    assert set(rows[0]) == {"config", "step", "layer", "param_grad_norm", "input_grad_norm"}
    assert {r["config"] for r in rows} == set(CONFIGS)
    for k in ("param_grad_norm", "input_grad_norm"):
        assert all(float(r[k]) > 0 and np.isfinite(float(r[k])) for r in rows)
    losses = list(csv.DictReader(open(tmp_path / "layers_loss.csv")))
    assert len(losses) == 4 * 3 and all(np.isfinite(float(r["loss"])) for r in losses)
    data = json.load(open(tmp_path / "layers.json"))
    assert set(data["summary"]) == set(CONFIGS) and data["settings"]["layers"] == 2
    for name, s in data["summary"].items():
        p = data["param_grad_norms"][name]
        assert len(p) == 3 and len(p[0]) == 2
        assert s["ratio_init"] == pytest.approx(p[0][0] / p[0][1], rel=1e-12)
        assert np.isfinite(s["valid_loss"]) and not s["diverged"]
    try:
        import matplotlib  # noqa: F401
        assert (tmp_path / "layers.png").stat().st_size > 0
    except ImportError:
        assert not (tmp_path / "layers.png").exists()
    assert "layer 1 / layer L" in capsys.readouterr().out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_per_layer_norms_equal_finite_differences(name):
    """||dL/dtheta_l|| and layer 1's ||dL/dx_0|| from the experiment equal the norms of five-point
    central differences of the (scalar) loss, element by element, in float64."""
    model = _tiny(name)
    rng = np.random.default_rng(1)
    ids, targets = rng.integers(0, 7, (2, 4)), rng.integers(0, 7, (2, 4))
    loss, pnorms, anorms = gradient_step(model, ids, targets)
    model.zero_grad()

    def loss_of(run):
        with no_grad():
            return float(cross_entropy_forward(run(), targets)[0])
    for layer, got in zip(model.layers, pnorms):
        sq = 0.0
        for p in layer.parameters():
            for idx in np.ndindex(*p.shape):
                sq += _five_point(lambda: loss_of(lambda: model(ids)), p.data, idx) ** 2
        assert got == pytest.approx(np.sqrt(sq), rel=1e-7)
    with no_grad():
        x0 = model.embed_positions(ids)                               # (B, T, C)
    sq = sum(_five_point(lambda: loss_of(lambda: model.forward_embedded(x0)), x0, idx) ** 2
             for idx in np.ndindex(*x0.shape))
    assert anorms[0] == pytest.approx(np.sqrt(sq), rel=1e-7)
    assert loss == pytest.approx(loss_of(lambda: model(ids)), rel=1e-14)


@given(name=st.sampled_from(list(CONFIGS)), t=st.integers(1, 4), seed=seeds)
def test_model_gradcheck(name, t, seed):
    """A random direction per parameter tensor (the layer itself is checked element by element in
    tests/nn/test_experimental.py)."""
    model = _tiny(name, seed)
    ids = np.random.default_rng(seed).integers(0, 7, (2, t))
    assert_gradcheck(gradcheck_module(model, {"ids": ids}, mode="direction", seed=seed))


def test_short_training_shows_what_residuals_do():
    """6 layers, 40 steps, seed 0. Mean of the last 10 steps' layer-1 / layer-6 parameter-gradient
    norms, measured over seeds 0-4: without residuals 5e-4..1e-2 (both norm placements), pre-norm
    with residuals 0.55..1.5. The assertions leave a factor of 3 or more on each side."""
    data = CharLMData(load_corpus(), block_size=16, seed=0)
    ratio = {}
    for name in CONFIGS:
        r = train_config(name, data, layers=6, d_model=16, nhead=2, ff=32, steps=40, batch=8, lr=3e-3,
                         seed=0, valid_batches=1)
        p = np.asarray(r["param_grad_norms"])[-10:]
        assert len(r["loss"]) == 40 and r["loss"][-1] < r["loss"][0]
        ratio[name] = p[:, 0].mean() / p[:, -1].mean()
    assert ratio["post-norm, no residual"] < 0.05 and ratio["pre-norm, no residual"] < 0.05
    assert ratio["pre-norm + residual"] > 0.2
