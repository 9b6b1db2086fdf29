"""``npformer train --precision float16`` and ``bfloat16``: a 16-bit model with float32 master weights
(and, float16 alone, loss scaling), through the same trainers; checked against float32 training on the
same seed. bfloat16 is ml_dtypes' dtype on NumPy (the extra npformer[bfloat16])."""
import importlib.util

import numpy as np
import pytest

from npformer.cli import main
from npformer.training.config import Seq2SeqTrainConfig, XLTrainConfig, make_config
from npformer.training.registry import make_trainer

TINY_LM = dict(task="charlm", model="gpt2", d_model=16, heads=2, layers=1, ff=32, block_size=16,
               batch_size=8, steps=30, warmup=3, lr=3e-3, eval_every=0, log_every=10, dropout=0.0)


# The 16-bit precisions, each with its unit roundoff u (float16 2^-11, bfloat16 2^-8)
PRECISIONS = [pytest.param("float16", id="float16"),
              pytest.param("bfloat16", id="bfloat16", marks=pytest.mark.skipif(
                  importlib.util.find_spec("ml_dtypes") is None,
                  reason="bfloat16 needs ml_dtypes (pip install 'npformer[bfloat16]')"))]
ROUNDOFF = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}
# float16's loss curve: measured gap 9e-5 per step over 20 steps, bound 2e-3 (2e-3 / u = 4.1); the
# gap scales with u, so each precision's bound is 4.1 u (bfloat16: 1.6e-2; measured 8.6e-4)
CURVE_TOL = 2e-3 / ROUNDOFF["float16"]


def _trainer(**kw):
    return make_trainer(make_config({**TINY_LM, **kw}), log=lambda _: None)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_16_bit_training_tracks_float32_training_on_the_same_seed(precision):
    full, half = _trainer(), _trainer(precision=precision)
    assert half.model.dtype.name == precision
    assert all(p.dtype == np.float32 for _, p in half.amp.named_parameters())
    a = [full.train_step().loss for _ in range(20)]
    b = [half.train_step().loss for _ in range(20)]
    assert np.mean(b[-5:]) < 0.9 * np.mean(b[:3])                 # it learns
    np.testing.assert_allclose(b, a, rtol=0, atol=CURVE_TOL * ROUNDOFF[precision])
    if precision == "float16":
        assert half.amp.scaler.skipped == 0
    else:
        assert half.amp.scaler is None                            # bfloat16 trains without loss scaling


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_a_skipped_float16_step_is_counted_and_the_run_goes_on(tmp_path):
    """float16 steps whose scaled gradients overflow are skipped (the scale halves) and the run goes
    on: each one's step result carries its non-finite norm, and the training lines count them
    (``skipped``) and average the norm over the other steps, so one overflow does not hide the
    window's norm. (Until 2026-11-30 the trainer stopped at the first skipped step with a TypeError:
    its norm was None; `npformer train --task charlm --precision float16` met one at its defaults.)
    NumPy's overflow warnings are off in the step (MixedPrecision.overflows_expected): an error here."""
    import json

    from npformer.training.amp import DynamicLossScaler
    logged = []
    trainer = make_trainer(make_config({**TINY_LM, "precision": "float16", "log_every": 3,
                                        "out_dir": str(tmp_path / "run")}), log=logged.append)
    trainer.amp.scaler = DynamicLossScaler(init_scale=2.0 ** 40)        # overflows float16's gradients
    trainer.fit()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"]
    skipped = trainer.amp.scaler.skipped
    assert 3 < skipped < 30 and trainer.amp.scaler.scale == 2.0 ** (40 - skipped)
    assert sum(r["skipped"] for r in train) == skipped and train[0]["skipped"] == 3
    for r in train:                      # the norm of the window's finite steps; NaN when all were skipped
        assert np.isfinite(r["grad_norm"]) == (r["skipped"] < 3), r
    lines = [line for line in logged if line.startswith("step")]
    assert "grad norm nan (3 skipped)" in lines[0] and "skipped" not in lines[-1], lines


@pytest.mark.parametrize("precision", PRECISIONS)
def test_16_bit_resume_is_exact_and_checkpoints_keep_float32_masters(tmp_path, precision):
    from npformer.training.checkpoint import load_checkpoint
    straight = _trainer(precision=precision, steps=8)
    expected = [straight.train_step().loss for _ in range(8)]
    first = _trainer(precision=precision, steps=8)
    got = [first.train_step().loss for _ in range(4)]
    path = first.save(tmp_path / "half.npz")
    ck = load_checkpoint(path)
    assert all(v.dtype == np.float32 for v in ck.model.values())          # the masters, not the 16-bit copy
    if precision == "float16":
        assert ck.meta["loss_scaler"] == first.amp.scaler.state_dict()
    else:
        assert "loss_scaler" not in ck.meta
    resumed = _trainer(precision=precision, steps=8)
    resumed.load(path)
    assert resumed.model.dtype.name == precision
    if precision == "float16":
        assert resumed.amp.scaler.state_dict() == first.amp.scaler.state_dict()
    got += [resumed.train_step().loss for _ in range(4)]
    assert got == expected                                                # bit for bit


@pytest.mark.parametrize("precision", PRECISIONS)
def test_seq2seq_mlm_albert_and_transformer_xl_trainers_run_in_16_bits(precision):
    s2s = make_trainer(Seq2SeqTrainConfig(task="copy", n_train=60, n_valid=10, d_model=16, heads=2, layers=1,
                                          ff=32, batch_size=8, steps=5, warmup=1, eval_every=0,
                                          precision=precision), log=lambda _: None)
    mlm = _trainer(model="bert", precision=precision, steps=5, warmup=1)
    albert = _trainer(model="albert", precision=precision, steps=5, warmup=1)
    xl = make_trainer(XLTrainConfig(task="recall", block_size=4, d_model=16, heads=2, layers=1, ff=32,
                                    batch_size=8, steps=5, warmup=1, eval_every=0, precision=precision),
                      log=lambda _: None)
    for t in (s2s, mlm, albert, xl):
        losses = [t.train_step().loss for _ in range(3)]
        assert all(np.isfinite(losses)) and t.model.dtype.name == precision
        # the run's first lines say what the model computes in, not the masters' dtype alone
        assert t.describe().endswith(f" on numpy {precision} (mixed precision, float32 masters)")
    assert _trainer().describe().endswith(" on numpy float32")


def test_bad_precision_options_are_clear_errors(capsys):
    with pytest.raises(ValueError, match="precision: expected one of 'float32', 'float16', 'bfloat16', got 'float8'"):
        _trainer(precision="float8")
    with pytest.raises(ValueError, match="use --dtype float32"):
        _trainer(precision="float16", dtype="float64")
    assert main(["train", "--task", "charlm", "--precision", "float16", "--dtype", "float64",
                 "--steps", "2", "--warmup", "0"]) == 2
    assert "use --dtype float32" in capsys.readouterr().err


@pytest.mark.parametrize("precision", PRECISIONS)
def test_npformer_train_precision_runs_resumes_and_keeps_float32_masters(tmp_path, monkeypatch, capsys, precision):
    """``npformer train --precision float16|bfloat16`` on NumPy: a short run with its final evaluation,
    float32 masters in its checkpoints, then ``--resume`` continuing it from its checkpoint (bit for bit
    resumption is test_16_bit_resume_is_exact_and_checkpoints_keep_float32_masters's)."""
    from npformer.training.checkpoint import load_checkpoint
    from npformer.training.run import RunDirectory, read_metrics
    monkeypatch.chdir(tmp_path)
    lm = ["train", "--task", "charlm", "--precision", precision, "--d-model", "16", "--heads", "2", "--layers", "1",
          "--ff", "32", "--block-size", "16", "--batch-size", "4", "--warmup", "1", "--eval-every", "0",
          "--eval-limit", "4", "--log-every", "2"]
    assert main([*lm, "--steps", "4", "--out-dir", "split"]) == 0
    ck = load_checkpoint(RunDirectory("split").last)
    assert ck.meta["train_config"]["precision"] == precision and ck.meta["step"] == 4
    assert all(v.dtype == np.float32 for v in ck.model.values())
    assert ("loss_scaler" in ck.meta) == (precision == "float16")
    assert main(["train", "--resume", "--checkpoint", "split", "--steps", "6"]) == 0
    assert "resumed from split/last.npz at step 4" in capsys.readouterr().out
    train = [r for r in read_metrics("split") if r["split"] == "train"]
    assert [r["step"] for r in train] == [2, 4, 6] and all(np.isfinite([r["loss"] for r in train]))
    assert load_checkpoint(RunDirectory("split").last).meta["step"] == 6
