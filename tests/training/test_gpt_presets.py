"""The GPT-1 and GPT-2 configurations behind ``npformer train --model gpt1|gpt2``: structure,
initialisation statistics, training, resuming and sampling through the command line."""
import numpy as np
import pytest

from npformer.cli import main
from npformer.models.gpt import GPT
from npformer.ops.cross_entropy import cross_entropy_backward, cross_entropy_forward
from npformer.tools.gradcheck import gradcheck_module
from npformer.training.config import make_config
from npformer.training.registry import make_trainer
from tests.helpers import assert_gradcheck

LM = dict(task="charlm", d_model=16, heads=2, layers=2, ff=32, block_size=16,
          batch_size=8, steps=40, warmup=5, lr=3e-3, eval_every=0, log_every=10)


def _quiet(**kw):
    return make_trainer(make_config({**LM, **kw}), log=lambda _: None)


def test_gpt1_is_post_norm_without_final_norm_and_gpt2_is_pre_norm_with_one():
    g1, g2 = _quiet(model="gpt1").model, _quiet(model="gpt2").model
    assert all(not layer.norm_first for layer in g1.layers) and g1.ln_f is None
    assert all(layer.norm_first for layer in g2.layers) and g2.ln_f is not None
    assert g1.config.activation == g2.config.activation == "gelu_tanh"   # both released codes: tanh form
    assert not g1.config.scaled_residual_init and g2.config.scaled_residual_init
    for m in (g1, g2):
        assert m.head.weight is m.wte.weight                       # tied output, learned positions
        assert m.wpe.weight.shape == (16, 16)
    assert "ln_f.weight" not in g1.state_dict() and "ln_f.weight" in g2.state_dict()


@pytest.mark.parametrize("model,residual_std", [("gpt1", 0.02), ("gpt2", 0.02 / np.sqrt(2 * 4))])
def test_initialisation_statistics(model, residual_std):
    m = _quiet(model=model, d_model=64, layers=4, ff=256, steps=2, warmup=1).model
    for name, p in m.named_parameters():
        w = p.data
        if name.endswith(("out_proj.weight", "linear2.weight")):   # 4,096 and 16,384 draws
            want = residual_std
        elif name.endswith(("in_proj_weight", "linear1.weight")) or name.startswith(("wte", "wpe")):
            want = 0.02
        elif name.endswith("bias") and "norm" not in name and not name.startswith("ln_f"):
            assert not w.any(), name                               # biases start at zero
            continue
        else:
            continue
        # the sample std of n >= 4,096 normal draws is within 3% of the true one (> 4 standard errors)
        assert abs(w.std() / want - 1) < 0.03, (name, w.std(), want)
        assert abs(w.mean()) < 4 * want / np.sqrt(w.size), name


@pytest.mark.parametrize("model", ["gpt1", "gpt2"])
def test_preset_loss_falls(model):
    trainer = _quiet(model=model)
    losses = [trainer.train_step().loss for _ in range(40)]
    uniform = np.log(len(trainer.vocab))
    assert losses[0] > uniform - 0.1 and np.mean(losses[-5:]) < uniform - 0.5, losses


def test_gpt1_configuration_gradcheck():
    """The GPT-1 configuration as the trainer builds it, through the real loss, float64."""
    cfg = _quiet(model="gpt1", steps=2, warmup=1).model.config
    from dataclasses import replace
    cfg = replace(cfg, vocab_size=7, block_size=6, d_model=4, n_head=2, dim_feedforward=6)
    model = GPT(cfg, dtype="float64", rng=3)
    rng = np.random.default_rng(3)
    model.wte.weight.data = rng.standard_normal(model.wte.weight.shape)   # unit-scale tables, as
    model.wpe.weight.data = rng.standard_normal(model.wpe.weight.shape)   # in tests/models/test_models.py
    idx, targets = rng.integers(0, 7, (2, 5)), rng.integers(0, 7, (2, 5))
    saved = {}

    def fwd(m, idx):
        loss, saved["c"] = cross_entropy_forward(m(idx), targets)
        return loss

    def bwd(m, d):
        m.backward(cross_entropy_backward(d, saved["c"]))
        return ()
    assert_gradcheck(gradcheck_module(model, {"idx": idx}, forward=fwd, backward=bwd, dropout_seed=3,
                                      seed=3, max_elements=6))


def test_preset_option_errors():
    with pytest.raises(ValueError, match="use --task charlm"):
        _quiet(model="gpt2", task="dates")
    with pytest.raises(ValueError, match="gpt1 is post-norm by definition"):
        _quiet(model="gpt1", norm_first=True)
    with pytest.raises(ValueError, match="gpt2 is pre-norm by definition"):
        _quiet(model="gpt2", norm_first=False)
    with pytest.raises(ValueError, match="--embedding-size does not apply to --model gpt2; it is an option of --model albert"):
        _quiet(model="gpt2", embedding_size=8)
    assert _quiet(model="gpt1", norm_first=False, activation="gelu").model.config.activation == "gelu"


TINY = ["--task", "charlm", "--d-model", "16", "--heads", "2", "--layers", "1", "--ff", "32",
        "--block-size", "16", "--batch-size", "8", "--warmup", "2", "--eval-every", "0", "--log-every", "3"]


@pytest.mark.parametrize("model,label", [("gpt1", "GPT-1 (post-norm)"), ("gpt2", "GPT-2 (pre-norm)"),
                                         ("gpt", "GPT ")])
def test_cli_trains_resumes_and_generates(tmp_path, capsys, model, label):
    path = str(tmp_path / f"{model}.npz")
    assert main(["train", "--model", model, *TINY, "--steps", "6", "--checkpoint", path]) == 0
    out = capsys.readouterr().out
    assert label in out and "final validation" in out and "bits/char" in out
    assert main(["train", "--checkpoint", path, "--resume", "--steps", "8"]) == 0
    assert "resumed from" in capsys.readouterr().out
    assert main(["generate", "--checkpoint", path, "--prompt", "The ", "--tokens", "20", "--seed", "1"]) == 0
    text = capsys.readouterr().out.rstrip("\n")
    assert text.startswith("The ") and len(text) > 4
    assert main(["generate", "--checkpoint", path, "--prompt", "The ", "--tokens", "20", "--seed", "1"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == text               # same seed, same sample
