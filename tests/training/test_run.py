"""The run directory and the metrics of a training run (npformer.training.run, Trainer.fit): written,
read back, trimmed on resume, the best checkpoint kept; the progress on a terminal and in a log."""
import csv
import fcntl
import io
import json
import pty
import signal
import struct
import sys
import termios
from dataclasses import asdict

import numpy as np
import pytest

from npformer.errors import RangeError
from npformer.training.checkpoint import load_checkpoint
from npformer.training.config import Seq2SeqTrainConfig
from npformer.training.loop import TrainingInterrupted
from npformer.training.run import PLOTTED, RunDirectory, checkpoint_file, plot_metrics, read_metrics
from npformer.training.schedules import cosine_with_warmup
from npformer.training.seq2seq_trainer import Seq2SeqTrainer
from tests.helpers import NO_MATPLOTLIB

SMALL = dict(task="copy", n_train=300, n_valid=40, d_model=16, heads=2, layers=1, ff=32,
             batch_size=16, steps=8, warmup=2, lr=3e-3, eval_every=4, log_every=2, checkpoint_every=4)
TRAIN_KEYS = {"split", "step", "loss", "lr", "grad_norm", "skipped", "tokens_per_s", "time_s"}


def _fit(config, lines=None):
    trainer = Seq2SeqTrainer(config, log=(lines.append if lines is not None else lambda _: None))
    return trainer, trainer.fit()


def test_fit_writes_the_run_directory_and_the_metrics_read_back(tmp_path):
    config = Seq2SeqTrainConfig(**SMALL, out_dir=str(tmp_path / "run"))
    trainer, result = _fit(config)
    run = RunDirectory(tmp_path / "run")
    assert sorted(p.name for p in run.path.iterdir()) == ["best.npz", "config.json", "last.npz", "metrics.jsonl"]
    assert json.loads(run.config.read_text()) == {**asdict(config), "model": "seq2seq"}     # the model named
    records = read_metrics(run.path)
    assert records == trainer.history == read_metrics(run.metrics)
    train = [r for r in records if r["split"] == "train"]
    valid = [r for r in records if r["split"] == "valid"]
    assert [r["step"] for r in train] == [2, 4, 6, 8] and all(set(r) == TRAIN_KEYS for r in train)
    for r in train:
        assert r["lr"] == cosine_with_warmup(r["step"], 3e-3, 2, 8, min_lr=1e-4)
        assert r["tokens_per_s"] > 0 and r["grad_norm"] > 0 and np.isfinite(r["loss"])
    assert [(r["step"], r["final"]) for r in valid] == [(4, False), (8, True)]
    assert valid[-1]["loss"] == result["loss"] and valid[-1]["exact_match"] == result["exact_match"]
    assert "predictions" not in valid[-1]                         # numbers only
    best_loss = min(r["loss"] for r in valid)
    best_step = [r["step"] for r in valid if r["best"]][-1]
    assert [r["best"] for r in valid] == [True, valid[1]["loss"] < valid[0]["loss"]]
    best, last = load_checkpoint(run.best).meta, load_checkpoint(run.last).meta
    assert best["step"] == best_step and best["best_valid_loss"] == best_loss
    assert last["step"] == 8 and last["best_valid_loss"] == best_loss


def test_the_metrics_hold_each_steps_loss_and_gradient_norm(tmp_path):
    """With --log-every 1 a training line is one step: the loss and the norm before clipping of an
    uninterrupted run of train_step, exactly."""
    config = Seq2SeqTrainConfig(**{**SMALL, "log_every": 1, "eval_every": 0, "clip": 0.5})
    straight = Seq2SeqTrainer(config, log=lambda _: None)
    expected = []
    for _ in range(8):
        result = straight.train_step()
        expected.append((result.loss, result.grad_norm))
    trainer, _ = _fit(config)
    got = [(r["loss"], r["grad_norm"]) for r in trainer.history if r["split"] == "train"]
    assert got == expected
    assert any(norm > 0.5 for _, norm in got)                      # the norm before clipping is what is kept


def test_fit_refuses_a_checkpoint_that_is_a_file_of_its_own_run_directory(tmp_path):
    """Trainer.fit, called from Python, refuses before its first step (and before it writes anything) a
    checkpoint path that would replace the run's config, metrics or best.npz, as the command line does."""
    for name in ("config.json", "metrics.jsonl", "best.npz"):
        config = Seq2SeqTrainConfig(**SMALL, out_dir=str(tmp_path / "run"), checkpoint=str(tmp_path / "run" / name))
        trainer = Seq2SeqTrainer(config, log=lambda _: None)
        trainer.train_step = lambda: pytest.fail("trained before checking the checkpoint path")
        with pytest.raises(RangeError, match=f"--checkpoint .*run/{name} is the {name} of the run directory"):
            trainer.fit()
        assert not (tmp_path / "run").exists()


def test_a_resumed_run_keeps_the_metrics_up_to_its_checkpoint_and_its_best_loss(tmp_path):
    out = str(tmp_path / "run")
    first, _ = _fit(Seq2SeqTrainConfig(**SMALL, out_dir=out))
    before = read_metrics(out)
    run = RunDirectory(out)
    run.record({"split": "train", "step": 99, "loss": 0.0})        # a line past the checkpoint: dropped on resume
    resumed = Seq2SeqTrainer(Seq2SeqTrainConfig(**{**SMALL, "steps": 12}, out_dir=out), log=lambda _: None)
    resumed.load(run.last)
    assert resumed.step == 8 and resumed.best_loss == first.best_loss
    resumed.fit()
    after = read_metrics(out)
    assert after[:len(before)] == before
    assert [r["step"] for r in after[len(before):] if r["split"] == "train"] == [10, 12]
    assert json.loads(run.config.read_text())["steps"] == 12
    valid = [r for r in after if r["split"] == "valid"]
    assert load_checkpoint(run.best).meta["best_valid_loss"] == min(r["loss"] for r in valid)


def _ctrl_c_in_step(trainer, *steps):
    """A Ctrl-C (a real SIGINT, to this process) while ``trainer`` runs each step of ``steps``."""
    real = trainer.train_step

    def train_step():
        if trainer.step + 1 in steps:
            signal.raise_signal(signal.SIGINT)
        return real()
    trainer.train_step = train_step


def _weights(path):
    ck = load_checkpoint(path)
    return {**{f"model/{k}": v for k, v in ck.model.items()}, **{f"optim/{k}": v for k, v in ck.optim.items()}}


def test_ctrl_c_saves_the_steps_done_and_the_run_resumes_to_the_uninterrupted_weights(tmp_path):
    """Ctrl-C in step 7 (the last checkpoint was at 4): the step ends, last.npz and --checkpoint get step 7
    (a record of the steps since the last line too), TrainingInterrupted says so, and SIGINT's handler is
    Python's again. Resumed from last.npz, the run ends with the weights and optimiser state of one that
    was never interrupted, bit for bit."""
    straight, _ = _fit(Seq2SeqTrainConfig(**SMALL, dropout=0.1, out_dir=str(tmp_path / "straight")))
    out, copy = tmp_path / "run", tmp_path / "copy.npz"
    config = Seq2SeqTrainConfig(**SMALL, dropout=0.1, out_dir=str(out), checkpoint=str(copy))
    trainer = Seq2SeqTrainer(config, log=lambda _: None)
    _ctrl_c_in_step(trainer, 7)
    with pytest.raises(TrainingInterrupted) as info:
        trainer.fit()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert (info.value.step, info.value.saved, info.value.at_once) == (7, [out / "last.npz", copy], False)
    assert str(info.value) == f"interrupted at step 7 of 8; saved {out / 'last.npz'}, {copy}"
    assert load_checkpoint(out / "last.npz").meta["step"] == load_checkpoint(copy).meta["step"] == 7
    assert [r["step"] for r in read_metrics(out) if r["split"] == "train"] == [2, 4, 6, 7]
    resumed = Seq2SeqTrainer(config, log=lambda _: None)
    resumed.load(out / "last.npz")
    resumed.fit()
    got, expected = _weights(out / "last.npz"), _weights(tmp_path / "straight" / "last.npz")
    assert got.keys() == expected.keys() and all(np.array_equal(got[k], expected[k]) for k in got)
    assert [r["step"] for r in read_metrics(out) if r["split"] == "train"] == [2, 4, 6, 7, 8]


def test_a_second_ctrl_c_while_saving_stops_at_once_and_leaves_no_half_written_file(tmp_path, monkeypatch):
    """Ctrl-C in step 6, then again while last.npz is written: the write stops, its temporary is removed,
    the last.npz of step 4 is kept whole, and the error says the step was not saved."""
    from npformer.training import checkpoint as ckpt
    out = tmp_path / "run"
    trainer = Seq2SeqTrainer(Seq2SeqTrainConfig(**SMALL, out_dir=str(out)), log=lambda _: None)
    _ctrl_c_in_step(trainer, 6)
    savez = ckpt.np.savez

    def interrupted_savez(f, **arrays):
        if trainer.step == 6:
            f.write(b"half a checkpoint")
            signal.raise_signal(signal.SIGINT)
        savez(f, **arrays)
    monkeypatch.setattr(ckpt.np, "savez", interrupted_savez)
    with pytest.raises(TrainingInterrupted) as info:
        trainer.fit()
    assert (info.value.step, info.value.saved, info.value.written, info.value.at_once) == (6, [], 4, True)
    assert str(info.value) == ("stopped at once (a second Ctrl-C) at step 6 of 8, without saving it; the latest "
                               "checkpoint it wrote is of step 4")
    assert load_checkpoint(out / "last.npz").meta["step"] == 4
    assert sorted(p.name for p in out.iterdir()) == ["best.npz", "config.json", "last.npz", "metrics.jsonl"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ctrl_c_while_the_run_directory_is_made_saves_step_0_which_resumes(tmp_path):
    """A Ctrl-C after config.json is written but before the first step leaves a run that --resume continues
    (its last.npz of step 0), not a directory that holds a run without a checkpoint to continue."""
    out = tmp_path / "run"
    trainer = Seq2SeqTrainer(Seq2SeqTrainConfig(**SMALL, out_dir=str(out)), log=lambda _: None)
    describe = trainer.describe
    trainer.describe = lambda: signal.raise_signal(signal.SIGINT) or describe()
    with pytest.raises(TrainingInterrupted) as info:
        trainer.fit()
    assert (info.value.step, info.value.saved) == (0, [out / "last.npz"])
    resumed = Seq2SeqTrainer(Seq2SeqTrainConfig(**SMALL, out_dir=str(out)), log=lambda _: None)
    resumed.load(out / "last.npz")
    resumed.fit()
    straight, _ = _fit(Seq2SeqTrainConfig(**SMALL, out_dir=str(tmp_path / "straight")))
    got, expected = _weights(out / "last.npz"), _weights(tmp_path / "straight" / "last.npz")
    assert got.keys() == expected.keys() and all(np.array_equal(got[k], expected[k]) for k in got)


def test_ctrl_c_without_a_checkpoint_path_still_stops_between_two_steps():
    """Called from Python with no out_dir nor checkpoint: the loop stops after the step in progress, the
    trainer whole (its step counted, its weights those of that step: trainer.save(path) keeps them)."""
    trainer = Seq2SeqTrainer(Seq2SeqTrainConfig(**SMALL), log=lambda _: None)
    _ctrl_c_in_step(trainer, 3)
    with pytest.raises(TrainingInterrupted) as info:
        trainer.fit()
    assert str(info.value) == "interrupted at step 3 of 8; no checkpoint path to save to" and trainer.step == 3


def test_ctrl_c_in_the_final_evaluation_stops_it_with_the_trained_weights_saved(tmp_path):
    """After the last step the checkpoints are written first; a Ctrl-C in the final evaluation (Python's
    handler again there: it stops at once) loses its figures alone."""
    out = tmp_path / "run"
    trainer = Seq2SeqTrainer(Seq2SeqTrainConfig(**SMALL, out_dir=str(out)), log=lambda _: None)
    evaluate = trainer.evaluate

    def interrupted(limit=None):
        if limit is None:                                        # the final evaluation, on the whole set
            signal.raise_signal(signal.SIGINT)
        return evaluate(limit=limit)
    trainer.evaluate = interrupted
    with pytest.raises(TrainingInterrupted) as info:
        trainer.fit()
    assert str(info.value) == f"interrupted after the last step (8), without the final evaluation; saved {out}/last.npz"
    assert load_checkpoint(out / "last.npz").meta["step"] == 8


def test_log_to_csv_writes_each_splits_records_and_keeps_them_on_resume(tmp_path):
    out = str(tmp_path / "run")
    _fit(Seq2SeqTrainConfig(**SMALL, out_dir=out, log_to="csv"))
    records = read_metrics(out)
    for split in ("train", "valid"):
        with open(tmp_path / "run" / f"{split}.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        want = [{k: v for k, v in r.items() if k != "split"} for r in records if r["split"] == split]
        assert [{k: json.loads(v.lower()) if v in ("True", "False") else float(v) for k, v in row.items()}
                for row in rows] == [{k: (v if isinstance(v, bool) else float(v)) for k, v in r.items()} for r in want]
    resumed = Seq2SeqTrainer(Seq2SeqTrainConfig(**{**SMALL, "steps": 12}, out_dir=out, log_to="csv"), log=lambda _: None)
    resumed.load(RunDirectory(out).last)
    resumed.fit()
    with open(tmp_path / "run" / "train.csv", newline="") as f:
        assert [int(float(row["step"])) for row in csv.DictReader(f)] == [2, 4, 6, 8, 10, 12]


def test_log_to_tensorboard_writes_the_scalars_tensorboard_reads(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard not installed (the tensorboard extra)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out = tmp_path / "run"
    _fit(Seq2SeqTrainConfig(**SMALL, out_dir=str(out), log_to="tensorboard"))
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    records = read_metrics(out)
    for split, name in (("train", "loss"), ("train", "grad_norm"), ("valid", "loss"), ("valid", "exact_match")):
        got = [(e.step, e.value) for e in events.Scalars(f"{split}/{name}")]
        want = [(r["step"], r[name]) for r in records if r["split"] == split]
        assert [s for s, _ in got] == [s for s, _ in want]
        np.testing.assert_allclose([v for _, v in got], [v for _, v in want], rtol=1e-6)   # float32 in the file


def test_log_to_without_its_package_or_a_run_directory_is_one_clear_error(tmp_path, monkeypatch):
    for name in ("tensorboard", "tensorboard.compat.proto.event_pb2", "tensorboard.compat.proto.summary_pb2",
                 "tensorboard.summary.writer.event_file_writer"):
        monkeypatch.setitem(sys.modules, name, None)         # each import of it fails, as when not installed
    with pytest.raises(RangeError, match=r'--log-to tensorboard needs the tensorboard package: pip install "npformer\[tensorboard\]"'):
        _fit(Seq2SeqTrainConfig(**SMALL, out_dir=str(tmp_path / "run"), log_to="tensorboard"))
    with pytest.raises(RangeError, match="--log-to csv writes into the run directory; give --out-dir"):
        _fit(Seq2SeqTrainConfig(**SMALL, log_to="csv"))


def test_start_keeps_the_lines_up_to_the_step(tmp_path):
    run = RunDirectory(tmp_path / "run")
    config = Seq2SeqTrainConfig(**SMALL)
    run.start(config, 0)
    for step in (2, 4, 6):
        run.record({"split": "train", "step": step})
    run.start(config, 4)
    assert [r["step"] for r in read_metrics(run.path)] == [2, 4]
    run.start(config, 0)                                            # a new run starts afresh
    assert read_metrics(run.path) == []


@pytest.mark.parametrize("file", ["metrics.jsonl", "train.csv"])
def test_a_record_that_fails_part_way_is_cut_off_again(tmp_path, monkeypatch, file):
    """A full disk during an append left half a line in metrics.jsonl: once space was freed, --resume
    and plot refused the run for good. The file is cut back to what it held, the error names the run,
    and the next record appends as if nothing had happened (train.csv of --log-to csv alike)."""
    import errno
    import os
    from npformer.errors import WriteError
    run = RunDirectory(tmp_path / "run", log_to="csv")
    run.start(Seq2SeqTrainConfig(**SMALL), 0)
    for step in (2, 4):
        run.record({"split": "train", "step": step, "loss": 1.5})
    path = run.path / file
    before = path.read_bytes()
    real = os.write

    def full_after_3_bytes(fd, data):             # the disk fills up in the middle of the record
        if not os.readlink(f"/proc/self/fd/{fd}").endswith(file):
            return real(fd, data)
        if path.stat().st_size == len(before):
            return real(fd, data[:3])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "write", full_after_3_bytes)
    with pytest.raises(WriteError, match=f"could not write the run's metrics in {run.path}: the disk is full"):
        run.record({"split": "train", "step": 6, "loss": 1.25})
    assert path.read_bytes() == before
    monkeypatch.undo()                                    # space freed
    run.record({"split": "train", "step": 8, "loss": 1.0})
    with open(run.path / "train.csv", newline="") as f:
        in_csv = [int(row["step"]) for row in csv.DictReader(f)]
    in_metrics = [r["step"] for r in read_metrics(run.path)]        # (metrics.jsonl is written before the sinks)
    assert (in_metrics, in_csv) == ([2, 4, 6, 8] if file == "train.csv" else [2, 4, 8], [2, 4, 8])


def test_checkpoint_file_finds_a_run_directorys_checkpoints(tmp_path):
    run = RunDirectory(tmp_path / "run")
    run.path.mkdir()
    with pytest.raises(FileNotFoundError, match="without best.npz or last.npz"):
        checkpoint_file(run.path)
    run.last.write_bytes(b"x")
    assert checkpoint_file(run.path) == run.last                    # no evaluation wrote best.npz yet
    run.best.write_bytes(b"x")
    assert checkpoint_file(run.path) == run.best and checkpoint_file(run.path, "last") == run.last
    assert checkpoint_file(run.last) == run.last and checkpoint_file("none.npz").name == "none.npz"


def test_bad_metrics_files_are_named_with_the_line(tmp_path):
    with pytest.raises(FileNotFoundError, match="no metrics file"):
        read_metrics(tmp_path)
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n[1, 2]\n')
    with pytest.raises(RangeError, match="not a metrics file .*; line 2 has no integer 'step'"):
        read_metrics(path)
    path.write_text('{"step": 1}\n{"step": \n')
    with pytest.raises(RangeError, match="not a metrics file .*; line 2 is not a JSON record"):
        read_metrics(path)
    config = tmp_path / "config.json"                   # a run's config.json, given to plot by mistake
    config.write_text('{\n  "steps": 3\n}\n')
    with pytest.raises(RangeError, match=r"config.json: not a metrics file .*give the run directory or its "
                                         r"metrics.jsonl\); line 1 is not a JSON record"):
        read_metrics(config)


@pytest.mark.parametrize("line, number, said", [
    ('{"step": 1, "split": "train"}', 2, "line 2, a train record, has no 'loss'"),
    ('{"step": 1, "split": "train", "loss": 1, "lr": 0.1, "grad_norm": null}', 2,
     "line 2, a train record, has 'grad_norm' null"),
    ('{"step": 1, "split": "train", "loss": "1.5", "lr": 0.1, "grad_norm": 1}', 2,
     "line 2, a train record, has 'loss' \"1.5\""),
    ('{"step": 1, "split": "valid", "loss": [1]}', 3, "line 3, a valid record, has 'loss' [1]"),
    ('{"step": 1, "split": "train", "loss": 1, "lr": true, "grad_norm": 1}', 2,
     "line 2, a train record, has 'lr' true")])
def test_plot_names_the_line_and_field_of_a_record_it_cannot_draw(tmp_path, line, number, said):
    """plot read only 'step' of each record: a training line without its loss, or with a null
    grad_norm, ended in a KeyError or TypeError (a string loss was even drawn, as a category). Each
    field plot draws is a number, or an error naming the file, the line and the field."""
    path = tmp_path / "metrics.jsonl"
    good = '{"step": 1, "split": "train", "loss": 1.5, "lr": 0.1, "grad_norm": NaN, "skipped": 1}'
    path.write_text("\n".join([good, line] if number == 2 else [good, "", line]) + "\n")
    assert [r["step"] for r in read_metrics(path)] == [1, 1]                       # what resume reads: a step
    with pytest.raises(RangeError) as exc:
        plot_metrics(path)
    assert str(exc.value) == f"{path}: {said}; expected a number there, as npformer train writes it"
    path.write_text(good + "\n")                                                  # NaN is a number (a skipped step)
    assert read_metrics(path, numbers=PLOTTED)[0]["loss"] == 1.5


def test_plot_draws_a_png_of_the_curves(tmp_path):
    pytest.importorskip("matplotlib", reason=NO_MATPLOTLIB)
    out = str(tmp_path / "run")
    _fit(Seq2SeqTrainConfig(**SMALL, out_dir=out))
    png = plot_metrics(out)
    assert png == RunDirectory(out).path / "metrics.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    other = plot_metrics(RunDirectory(out).metrics, tmp_path / "curves.png")
    assert other.is_file()


def test_the_metrics_plot_keeps_every_label_inside_and_apart(tmp_path, monkeypatch):
    """The figure as plot_metrics saves it (caught at savefig): no label cut off by the canvas edge (the
    loss panel's y label was), none running into another."""
    pytest.importorskip("matplotlib", reason=NO_MATPLOTLIB)
    from matplotlib.figure import Figure
    from tests.figure_checks import assert_texts_inside_and_apart
    saved = []
    savefig = Figure.savefig

    def keep(fig, *args, **kwargs):
        saved.append((fig, kwargs))
        return savefig(fig, *args, **kwargs)
    monkeypatch.setattr(Figure, "savefig", keep)
    out = str(tmp_path / "run")
    _fit(Seq2SeqTrainConfig(**SMALL, out_dir=out))
    plot_metrics(out)
    (fig, kwargs), = saved
    assert "bbox_inches" not in kwargs                  # the canvas is the figure's own
    fig.set_dpi(kwargs["dpi"])
    assert_texts_inside_and_apart(fig, "npformer plot")


def test_plot_without_matplotlib_says_what_to_install(tmp_path, monkeypatch):
    run = RunDirectory(tmp_path)
    run.record({"split": "train", "step": 1, "loss": 1.0, "lr": 0.1, "grad_norm": 1.0})
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)      # as if it were not installed
    with pytest.raises(ImportError, match=r'pip install "npformer\[plot\]"'):
        plot_metrics(tmp_path)


def test_a_log_gets_a_line_a_record_with_the_gradient_norm_and_the_eta():
    lines = []
    _fit(Seq2SeqTrainConfig(**SMALL), lines)
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == 4 and steps[-1].startswith("step     8/8  loss ")
    assert all("grad norm " in line and " tok/s " in line and "elapsed, ETA " in line for line in steps)
    assert lines[0].startswith("config: model=seq2seq task=copy ")


class _Terminal(io.StringIO):
    """What is written, kept; a terminal of 80 columns to whoever asks (a pseudo-terminal's size)."""

    def __init__(self):
        super().__init__()
        self.leader, self.follower = pty.openpty()
        fcntl.ioctl(self.follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))

    def isatty(self):
        return True

    def fileno(self):
        return self.follower


def test_a_terminal_gets_a_progress_bar(monkeypatch):
    from npformer.launcher import LAUNCHER_VARIABLES
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    screen = _Terminal()
    monkeypatch.setattr(sys, "stdout", screen)
    trainer = Seq2SeqTrainer(Seq2SeqTrainConfig(**SMALL), log=print)
    trainer.fit()
    text = screen.getvalue()
    assert "\r" in text and "step 8/8 " in text and "grad norm" in text     # the bar, redrawn in place
    assert "  valid (40 examples)" in text and "final validation" in text
    assert not any(line.startswith("step     2/8") for line in text.splitlines())   # no log lines


def _lowercase_charlm(tmp_path, model="gpt2"):
    """A character GPT on a text without 'T', 'h', 'e' nor a space (the old fixed prompt "The ")."""
    from npformer.training.config import make_config
    from npformer.training.registry import make_trainer
    text = tmp_path / "lower.txt"
    text.write_text("".join("abcdfgijklmnopqrsuvwxyz.,"[i * 7 % 25] for i in range(3000)))
    config = make_config(dict(model=model, task="charlm", text=str(text), d_model=16, heads=2, layers=1,
                              ff=32, block_size=16, batch_size=4, steps=4, warmup=1, eval_every=0,
                              out_dir=str(tmp_path / "run")))
    return text, make_trainer(config, log=lambda _: None)


@pytest.mark.parametrize("model", ["gpt", "gpt1", "gpt2"])
def test_a_text_without_the_default_prompt_trains_saves_and_samples_from_its_own_start(tmp_path, model):
    text, trainer = _lowercase_charlm(tmp_path, model)
    result = trainer.fit()
    start = text.read_text()[:4]
    assert result["sample"].startswith(start) and np.isfinite(result["loss"])
    assert load_checkpoint(tmp_path / "run" / "last.npz").meta["step"] == 4


def test_a_failure_after_training_does_not_cost_the_trained_weights(tmp_path, monkeypatch):
    _, trainer = _lowercase_charlm(tmp_path)

    def broken(*args, **kwargs):
        raise RuntimeError("the evaluation broke")
    monkeypatch.setattr(trainer, "evaluate", broken)
    with pytest.raises(RuntimeError, match="the evaluation broke"):
        trainer.fit()
    saved = load_checkpoint(tmp_path / "run" / "last.npz")
    assert saved.meta["step"] == 4
    for name, value in trainer.model.state_dict().items():
        np.testing.assert_array_equal(saved.model[name], value)
