"""The Transformer-XL trainer: the memory is carried across a sequence's segments and reset between
sequences, the loss falls, a run resumed mid-sequence (memory in the checkpoint) repeats the
uninterrupted losses exactly, evaluation with other memory lengths, the CLI, and bad settings."""
import math

import numpy as np
import pytest

from npformer.cli import main
from npformer.training.checkpoint import load_checkpoint
from npformer.training.config import Seq2SeqTrainConfig, XLTrainConfig
from npformer.training.registry import make_trainer
from npformer.training.xl_trainer import SEGMENTS, XLTrainer, recall_period

TINY = dict(model="transformer-xl", task="recall", block_size=4, mem_len=4, d_model=16, heads=2, layers=2,
            ff=32, batch_size=8, steps=40, warmup=4, lr=3e-3, dropout=0.1, n_train=64,
            n_valid=8, eval_every=0, log_every=10)


def _trainer(**kw):
    return make_trainer(XLTrainConfig(**{**TINY, **kw}), log=lambda _: None)


def test_memory_is_carried_within_a_sequence_and_reset_between_sequences():
    trainer = _trainer(mem_len=8)
    assert isinstance(trainer, XLTrainer) and trainer.task.period == recall_period(4) == 6 > 4
    lengths = []
    for _ in range(SEGMENTS + 2):
        trainer.train_step()
        lengths.append(trainer.mems[0].shape[1])
    # 4 after the first segment, 8 (= mem_len) from then on, 4 again when the next batch starts
    assert lengths == [4] + [8] * (SEGMENTS - 1) + [4, 8]
    assert all(m.shape == (8, 8, 16) for m in trainer.mems)


def test_loss_falls():
    trainer = _trainer(steps=80)
    losses = [trainer.train_step().loss for _ in range(80)]
    assert np.mean(losses[-8:]) < np.mean(losses[:8]) - 0.3, losses


def test_resume_in_the_middle_of_a_sequence_is_exact(tmp_path):
    cfg = dict(steps=12)
    straight = _trainer(**cfg)
    expected = [straight.train_step().loss for _ in range(12)]
    first = _trainer(**cfg)
    got = [first.train_step().loss for _ in range(5)]                    # step 5: segment 5 of 8, memory held
    first.save(tmp_path / "xl.npz")
    resumed = _trainer(**cfg)
    resumed.load(tmp_path / "xl.npz")
    assert resumed.step == 5 and len(resumed.mems) == 2
    got += [resumed.train_step().loss for _ in range(7)]
    assert got == expected                                          # bit for bit
    forgetful = _trainer(**cfg)                                     # the memory is what makes it exact:
    forgetful.load(tmp_path / "xl.npz")
    forgetful.mems = None                                           # without it the next loss differs
    assert forgetful.train_step().loss != expected[5]


def test_checkpoint_holds_memory_config_and_no_pickle(tmp_path):
    trainer = _trainer(steps=3, warmup=1)
    trainer.train_step()
    path = trainer.save(tmp_path / "c.npz")
    with np.load(path, allow_pickle=False) as data:
        names = data.files
    assert {"model/mems.0", "model/mems.1"} <= set(names)
    ck = load_checkpoint(path)
    assert ck.meta["kind"] == "transformer-xl" and ck.meta["model_config"]["mem_len"] == 4
    assert ck.meta["train_config"]["mem_len"] == 4
    np.testing.assert_array_equal(ck.model["mems.1"], trainer.mems[1])
    fresh = _trainer(steps=3, warmup=1)
    fresh.train_step()
    fresh.train_step()
    fresh.save(tmp_path / "d.npz")                                  # a checkpoint without memory loads too
    fresh.mems = None
    fresh.save(tmp_path / "e.npz")
    other = _trainer(steps=3, warmup=1)
    other.load(tmp_path / "e.npz")
    assert other.mems is None and other.step == 2


def test_evaluate_reports_loss_recall_and_takes_a_longer_memory():
    trainer = _trainer()
    result = trainer.evaluate()
    assert result["mem_len"] == 4 and len(result["loss_by_segment"]) == SEGMENTS
    assert result["uniform"] == pytest.approx(math.log(16)) and 0 < result["floor"] < result["uniform"]
    assert np.isfinite(result["loss"]) and 0.0 <= result["recall_accuracy"] <= 1.0
    mean_of_segments = np.mean(result["loss_by_segment"])
    assert mean_of_segments == pytest.approx(result["loss"])
    longer = trainer.evaluate(mem_len=16, limit=4)
    assert longer["mem_len"] == 16 and longer["loss"] != result["loss"]
    assert "recall accuracy" in trainer.report(result, quick=True)


def test_default_memory_is_the_segment_and_zero_means_none():
    assert _trainer(mem_len=None, block_size=6).mem_len == 6
    trainer = _trainer(mem_len=0)
    trainer.train_step()
    assert trainer.mems is None and trainer.model.config.mem_len == 0


def test_the_task_draws_its_default_sizes_unless_given():
    trainer = _trainer(n_train=None, n_valid=None)
    assert (len(trainer.task.train), len(trainer.task.valid)) == (2000, 200)
    trainer = _trainer(n_train=16, n_valid=None)
    assert (len(trainer.task.train), len(trainer.task.valid)) == (16, 200)


def test_bad_settings(tmp_path):
    with pytest.raises(ValueError, match="transformer-xl trains on the task 'recall'"):
        _trainer(task="dates")
    with pytest.raises(ValueError, match="post-norm"):
        _trainer(norm_first=True)
    with pytest.raises(ValueError, match=r"--batch-size 100 exceeds the 64 training sequences \(--n-train\)"):
        _trainer(batch_size=100)
    with pytest.raises(ValueError, match="--mem-len: expected an int >= 0"):
        _trainer(mem_len=-1)
    s2s = make_trainer(Seq2SeqTrainConfig(task="copy", n_train=50, n_valid=10, batch_size=8, d_model=8, heads=2,
                                          layers=1, ff=8, steps=2, warmup=1), log=lambda _: None)
    with pytest.raises(ValueError, match="holds a 'seq2seq' checkpoint, not a transformer-xl one"):
        _trainer().load(s2s.save(tmp_path / "s2s.npz"))


def test_cli_trains_and_resumes(tmp_path, capsys):
    path = str(tmp_path / "xl.npz")
    args = ["train", "--model", "transformer-xl", "--task", "recall", "--block-size", "4", "--mem-len", "4",
            "--d-model", "16", "--heads", "2", "--layers", "1", "--ff", "16", "--batch-size", "4",
            "--n-train", "16", "--steps", "6", "--warmup", "1", "--eval-every", "0", "--log-every", "3",
            "--checkpoint", path]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "Transformer-XL" in out and "memory 4" in out and "final validation" in out
    assert main(["train", "--resume", "--checkpoint", path, "--steps", "9"]) == 0
    assert "resumed from" in capsys.readouterr().out and load_checkpoint(path).meta["step"] == 9
