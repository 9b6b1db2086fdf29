"""``npformer train --precision float16``: a 16-bit model with float32 master weights and loss scaling,
through the same trainers; checked against float32 training on the same seed."""
import numpy as np
import pytest

from npformer.cli import main
from npformer.training.config import Seq2SeqTrainConfig, XLTrainConfig, make_config
from npformer.training.registry import make_trainer

TINY_LM = dict(task="charlm", model="gpt2", d_model=16, heads=2, layers=1, ff=32, block_size=16,
               batch_size=8, steps=30, warmup=3, lr=3e-3, eval_every=0, log_every=10, dropout=0.0)


def _trainer(**kw):
    return make_trainer(make_config({**TINY_LM, **kw}), log=lambda _: None)


def test_float16_tracks_float32_training_on_the_same_seed():
    full, half = _trainer(), _trainer(precision="float16")
    assert half.model.dtype == np.float16
    assert all(p.dtype == np.float32 for _, p in half.amp.named_parameters())
    a = [full.train_step().loss for _ in range(20)]
    b = [half.train_step().loss for _ in range(20)]
    assert np.mean(b[-5:]) < 0.9 * np.mean(b[:3])                 # it learns
    # float16 rounds activations to 11 significant bits; measured gap 9e-5 per step, bound 2e-3
    np.testing.assert_allclose(b, a, rtol=0, atol=2e-3)
    assert half.amp.scaler.skipped == 0


def test_float16_resume_is_exact_and_checkpoints_keep_float32_masters(tmp_path):
    from npformer.training.checkpoint import load_checkpoint
    straight = _trainer(precision="float16", steps=8)
    expected = [straight.train_step().loss for _ in range(8)]
    first = _trainer(precision="float16", steps=8)
    got = [first.train_step().loss for _ in range(4)]
    path = first.save(tmp_path / "half.npz")
    ck = load_checkpoint(path)
    assert all(v.dtype == np.float32 for v in ck.model.values())          # the masters, not the 16-bit copy
    assert ck.meta["loss_scaler"] == first.amp.scaler.state_dict()
    resumed = _trainer(precision="float16", steps=8)
    resumed.load(path)
    assert resumed.amp.scaler.state_dict() == first.amp.scaler.state_dict()
    got += [resumed.train_step().loss for _ in range(4)]
    assert got == expected                                                # bit for bit


def test_seq2seq_mlm_and_transformer_xl_trainers_run_in_float16():
    s2s = make_trainer(Seq2SeqTrainConfig(task="copy", n_train=60, n_valid=10, d_model=16, heads=2, layers=1,
                                          ff=32, batch_size=8, steps=5, warmup=1, eval_every=0,
                                          precision="float16"), log=lambda _: None)
    mlm = _trainer(model="bert", precision="float16", steps=5, warmup=1)
    xl = make_trainer(XLTrainConfig(task="recall", block_size=4, d_model=16, heads=2, layers=1, ff=32,
                                    batch_size=8, steps=5, warmup=1, eval_every=0, precision="float16"),
                      log=lambda _: None)
    for t in (s2s, mlm, xl):
        losses = [t.train_step().loss for _ in range(3)]
        assert all(np.isfinite(losses)) and t.model.dtype == np.float16


def test_bad_precision_options_are_clear_errors(capsys):
    with pytest.raises(ValueError, match="precision: expected one of 'float32', 'float16', 'bfloat16', got 'float8'"):
        _trainer(precision="float8")
    with pytest.raises(ValueError, match="use --dtype float32"):
        _trainer(precision="float16", dtype="float64")
    with pytest.raises(TypeError, match="bfloat16"):
        _trainer(precision="bfloat16")                             # NumPy has no bfloat16
    assert main(["train", "--task", "charlm", "--precision", "float16", "--dtype", "float64",
                 "--steps", "2", "--warmup", "0"]) == 2
    assert "use --dtype float32" in capsys.readouterr().err
