"""npformer train's run directory from the command line, and what reads it: translate/eval with a run
directory, --resume of the default run, --config FILE (JSON, TOML, the flags winning), npformer plot,
npformer --version, and the help generated from the config dataclasses."""
import json
import signal
import sys
from dataclasses import MISSING
from pathlib import Path

import numpy as np
import pytest

from npformer.cli import build_parser, main
from npformer.training.config import CONFIGS, FIELDS, MODELS, flag
from npformer.training.run import RunDirectory, read_metrics
from npformer.version import __version__
from tests.helpers import NO_MATPLOTLIB

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--task", "copy", "--n-train", "200", "--n-valid", "30", "--steps", "6", "--warmup", "1", "--d-model", "16",
        "--heads", "2", "--layers", "1", "--ff", "32", "--batch-size", "8", "--eval-every", "0", "--log-every", "3"]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_train_writes_the_default_run_directory_that_the_next_commands_read(workdir, capsys):
    assert main(["train", *TINY]) == 0
    out = capsys.readouterr().out
    run = RunDirectory("runs/copy-seq2seq")
    assert out.startswith("run directory runs/copy-seq2seq: config.json, metrics.jsonl, last.npz, best.npz\n"
                          "config: model=seq2seq task=copy seed=0 ")
    assert run.best.is_file() and run.last.is_file()
    final = read_metrics(run.path)[-1]
    assert final["split"] == "valid" and final["final"] and final["step"] == 6
    assert main(["translate", "--checkpoint", "runs/copy-seq2seq", "abc"]) == 0
    said = capsys.readouterr()
    assert said.out.startswith("abc\t") and said.err == f"npformer translate: using {run.best}\n"   # which file
    assert main(["eval", "--checkpoint", "runs/copy-seq2seq", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["checkpoint"] == str(run.best) and figures["step"] == 6
    assert figures["loss"] == final["loss"] and figures["exact_match"] == final["exact_match"]   # the same model, data
    assert main(["eval", "--checkpoint", str(run.last)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{run.last}: --model seq2seq --task copy, step 6 of 6"
    assert lines[1].startswith(f"final validation (30 held-out examples): loss {final['loss']:.4f}")
    stopped = workdir / "runs" / "stopped"               # a run stopped before its first validation
    stopped.mkdir()
    (stopped / "last.npz").write_bytes(run.last.read_bytes())
    assert main(["eval", "--checkpoint", str(stopped), "--json"]) == 0
    said = capsys.readouterr()
    assert json.loads(said.out)["checkpoint"] == str(stopped / "last.npz")
    assert said.err == (f"npformer eval: using {stopped / 'last.npz'} (the run has no best.npz: it stopped "
                        "before its first validation)\n")


def test_resume_continues_the_default_run_and_checkpoint_still_writes_there_too(workdir, capsys):
    assert main(["train", *TINY, "--checkpoint", "mine.npz"]) == 0
    capsys.readouterr()
    assert (workdir / "mine.npz").is_file() and (workdir / "runs/copy-seq2seq/last.npz").is_file()
    assert main(["train", "--task", "copy", "--resume", "--steps", "9"]) == 0
    assert capsys.readouterr().out.startswith("resumed from runs/copy-seq2seq/last.npz at step 6\n")
    steps = [r["step"] for r in read_metrics("runs/copy-seq2seq") if r["split"] == "train"]
    assert steps == [3, 6, 9]
    assert main(["train", "--resume", "--checkpoint", "runs/copy-seq2seq", "--steps", "12"]) == 0
    assert "resumed from runs/copy-seq2seq/last.npz at step 9" in capsys.readouterr().out


def test_resume_with_a_larger_steps_recomputes_the_schedule_as_the_training_page_says(workdir, capsys):
    """docs/pages/training.md said --steps 700, then --steps 1500 --resume gave "the same losses as one
    run of 1500"; the cosine spans --steps, so the resumed steps take a run of 1500's learning rates, a
    jump up from --min-lr where the first run ended, after a first part on the shorter schedule."""
    from npformer.training.config import make_config
    from npformer.training.schedules import cosine_with_warmup
    each = ["--log-every", "1", "--warmup", "2"]
    assert main(["train", *TINY, *each, "--steps", "8", "--out-dir", "a"]) == 0
    assert main(["train", "--resume", "--out-dir", "a", "--task", "copy", "--steps", "16"]) == 0
    assert main(["train", *TINY, *each, "--steps", "16", "--out-dir", "b"]) == 0
    resumed, straight = ([r for r in read_metrics(d) if r["split"] == "train"] for d in ("a", "b"))
    assert [r["step"] for r in resumed] == [r["step"] for r in straight] == list(range(1, 17))
    min_lr = make_config({}).min_lr
    assert resumed[7]["lr"] == min_lr < resumed[8]["lr"] == straight[8]["lr"]          # steps 8 and 9
    assert [r["lr"] for r in resumed[8:]] == [r["lr"] for r in straight[8:]]
    assert resumed[8]["loss"] != straight[8]["loss"]
    c = make_config({"task": "charlm", "steps": 1500})
    assert (c.warmup, round(cosine_with_warmup(701, c.lr, c.warmup, 1500, c.min_lr) / c.lr, 1)) == (100, 0.6)
    page = " ".join((ROOT / "docs" / "pages" / "training.md").read_text().split())
    assert "(about 0.6 of `--lr` with the default warm-up, 100 steps)" in page
    assert "the same losses as one run of 1500" not in page



def _ctrl_c_in_step(monkeypatch, step):
    """A Ctrl-C (a real SIGINT, to this process) while npformer train runs step ``step``."""
    from npformer.training.loop import Trainer
    real = Trainer.train_step

    def train_step(self):
        if self.step + 1 == step:
            signal.raise_signal(signal.SIGINT)
        return real(self)
    monkeypatch.setattr(Trainer, "train_step", train_step)


def test_ctrl_c_saves_the_run_says_how_to_resume_in_one_line_and_exits_130(workdir, capsys, monkeypatch):
    """Ctrl-C in step 4 of 6: exit status 130, one line naming the checkpoints written and the command
    that continues the run (no traceback); that command ends with the weights of an uninterrupted run."""
    assert main(["train", *TINY, "--out-dir", "straight"]) == 0
    capsys.readouterr()
    with monkeypatch.context() as patch:
        _ctrl_c_in_step(patch, 4)
        assert main(["train", *TINY, "--out-dir", "run", "--checkpoint", "mine.npz"]) == 130
    said = capsys.readouterr()
    assert said.err == ("npformer train: interrupted at step 4 of 6; saved run/last.npz, mine.npz; continue with: "
                        "npformer train --resume --out-dir run\n")
    assert main(["train", "--resume", "--out-dir", "run"]) == 0
    assert capsys.readouterr().out.startswith("resumed from run/last.npz at step 4\n")
    with np.load("run/last.npz") as got, np.load("straight/last.npz") as expected:
        assert sorted(got.files) == sorted(expected.files)
        assert all(np.array_equal(got[k], expected[k]) for k in got.files if k != "meta")


@pytest.mark.parametrize("exc, line", [
    ((6, 6, ["run/last.npz"]), "interrupted after the last step (6), without the final evaluation; saved "
                               "run/last.npz; npformer eval --checkpoint run/last.npz gives its final figures"),
    ((4, 6, [], 2, True), "stopped at once (a second Ctrl-C) at step 4 of 6, without saving it; the latest checkpoint "
                          "it wrote is of step 2; continue from it with: npformer train --resume --out-dir run"),
    ((1, 6, [], None, True), "stopped at once (a second Ctrl-C) at step 1 of 6, without saving it; it wrote no "
                             "checkpoint")])
def test_ctrl_c_in_the_final_evaluation_or_twice_is_one_line_saying_what_is_left(workdir, capsys, monkeypatch, exc,
                                                                                line):
    from npformer.training.loop import Trainer, TrainingInterrupted

    def fit(self):
        raise TrainingInterrupted(*exc)
    monkeypatch.setattr(Trainer, "fit", fit)
    assert main(["train", *TINY, "--out-dir", "run"]) == 130
    assert capsys.readouterr().err == f"npformer train: {line}\n"


def test_ctrl_c_before_the_first_step_is_one_line_too(workdir, capsys, monkeypatch):
    from npformer.training import registry

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(registry, "make_trainer", interrupted)
    assert main(["train", *TINY]) == 130
    assert capsys.readouterr().err == "npformer train: interrupted before training began; nothing was trained\n"


def test_config_file_json_and_toml_with_the_flags_winning(workdir):
    (workdir / "c.json").write_text(json.dumps({"task": "copy", "n_train": 200, "n-valid": 30, "steps": 4,
                                                "warmup": 1, "d_model": 16, "heads": 2, "layers": 1, "ff": 32,
                                                "batch_size": 8, "eval_every": 0, "lr": 0.01, "activation": None}))
    assert main(["train", "--config", "c.json", "--steps", "6", "--out-dir", "a"]) == 0
    saved = json.loads((workdir / "a/config.json").read_text())
    assert saved["steps"] == 6 and saved["lr"] == 0.01 and saved["heads"] == 2 and saved["n_valid"] == 30
    (workdir / "c.toml").write_text('task = "copy"\nn_train = 200\nn_valid = 30\nsteps = 6\nwarmup = 1\n'
                                    'd_model = 16\nheads = 2\nlayers = 1\nff = 32\nbatch_size = 8\neval_every = 0\n'
                                    'lr = 0.02\n')
    assert main(["train", "--config", "c.toml", "--lr", "0.01", "--out-dir", "b"]) == 0
    assert json.loads((workdir / "b/config.json").read_text()) == {**saved, "out_dir": "b"}
    # a run's config.json runs it again: the same losses
    assert main(["train", "--config", "a/config.json", "--out-dir", "c"]) == 0
    losses = lambda d: [r["loss"] for r in read_metrics(d) if r["split"] == "train"]   # noqa: E731
    assert losses("c") == losses("a") == losses("b")


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out == f"npformer {__version__}\n"


def test_plot_command_writes_the_png(workdir, capsys):
    pytest.importorskip("matplotlib", reason=NO_MATPLOTLIB)
    assert main(["train", *TINY, "--out-dir", "r"]) == 0
    capsys.readouterr()
    assert main(["plot", "r"]) == 0
    assert capsys.readouterr().out == "wrote r/metrics.png\n" and (workdir / "r/metrics.png").is_file()
    assert main(["plot", "r", "--out", "r"]) == 2
    assert "--out r is a directory" in capsys.readouterr().err


def test_plot_command_without_matplotlib_says_what_to_install(workdir, capsys, monkeypatch):
    (workdir / "r").mkdir()
    RunDirectory("r").record({"split": "train", "step": 1, "loss": 1.0, "lr": 0.1, "grad_norm": 1.0})
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)      # as if it were not installed
    assert main(["plot", "r"]) == 2
    assert capsys.readouterr().err == 'npformer plot: error: npformer plot needs matplotlib: pip install "npformer[plot]"\n'


def _train_help(monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "10000")          # no line breaks inside the help texts
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return " ".join(sub.choices["train"].format_help().split())


def test_train_help_gives_every_field_a_flag_help_and_default_and_describes_every_model(monkeypatch):
    text = _train_help(monkeypatch)
    for name, f in FIELDS.items():
        assert flag(name) in text, name
        help_text = " ".join(f.metadata["help"].split())
        assert help_text in text, name
        if f.default is not None and f.default is not MISSING:
            assert f"{help_text} (default {f.default})" in text, name
        else:
            assert "default" in help_text, f"{name}: its help does not say what leaving it out means"
    assert set(MODELS) == set(CONFIGS)
    for name, description in MODELS.items():
        assert f"{name} {' '.join(description.split())}" in text, name
    assert "--config FILE" in text and "--out-dir DIR" in text


def test_toml_reads_through_tomli_where_the_standard_library_has_no_tomllib(tmp_path, monkeypatch):
    """Python 3.10 has no tomllib: the install requires tomli there (setup.cfg), and --config FILE.toml
    reads through it; without either, one clear error that says what to install."""
    import tomllib
    from npformer.errors import RangeError
    from npformer.training.config import options_from_file
    path = tmp_path / "c.toml"
    path.write_text('steps = 6\nlr = 0.02\n')
    monkeypatch.setitem(sys.modules, "tomllib", None)           # import tomllib now fails, as on 3.10
    monkeypatch.setitem(sys.modules, "tomli", tomllib)          # tomli: the same reader, as a package
    assert options_from_file(path) == {"steps": 6, "lr": 0.02}
    monkeypatch.setitem(sys.modules, "tomli", None)
    with pytest.raises(RangeError, match=r"needs tomli \(pip install tomli\)"):
        options_from_file(path)

