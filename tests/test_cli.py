"""The command line: exit codes and messages for the main jobs and for bad input."""
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from npformer import cli
from npformer.cli import main
from npformer.study import EXPERIMENTS

TINY = ["--task", "copy", "--n-train", "200", "--steps", "6", "--warmup", "1", "--d-model", "16",
        "--heads", "2", "--layers", "1", "--ff", "32", "--batch-size", "8", "--eval-every", "0",
        "--log-every", "3"]


def test_gradcheck_command_prints_the_table_and_passes(capsys):
    assert main(["gradcheck", "--only", "layer_norm"]) == 0
    out = capsys.readouterr().out
    assert "worst rel err" in out and "layer_norm" in out and "PASS" in out and "all passed" in out


def test_gradcheck_unknown_op_is_a_clear_error(capsys):
    assert main(["gradcheck", "--only", "no_such_op"]) == 2
    assert "matches no op" in capsys.readouterr().err


def test_train_translate_and_resume(tmp_path, capsys):
    ckpt = str(tmp_path / "m.npz")
    assert main(["train", *TINY, "--checkpoint", ckpt]) == 0
    out = capsys.readouterr().out
    assert "final validation" in out and "examples from the held-out set" in out
    assert main(["train", "--checkpoint", ckpt, "--resume", "--steps", "8"]) == 0
    assert "resumed from" in capsys.readouterr().out
    assert main(["translate", "--checkpoint", ckpt, "abc", "jj"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split("\t")[0] for line in lines] == ["abc", "jj"]


def test_embed_and_translate_print_each_text_on_one_line(monkeypatch, capsys):
    """A newline in a sentence broke the one line per sentence (text TAB vector), and a tab in it was
    taken for the one before the vector: both are escaped, and a backslash, so the text reads back."""
    class Encoder:                                           # the model's numbers are not the point here
        def __init__(self, *args, **kwargs):
            pass

        def encode(self, texts):
            return np.eye(len(texts), 2)
    monkeypatch.setattr("npformer.pretrained.SentenceEncoder", Encoder)
    texts = ["a\nb", "c\td", "e\\nf", "g\rh"]
    assert main(["embed", *texts]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["a\\nb\t1.000000 0.000000", "c\\td\t0.000000 1.000000", "e\\\\nf\t0.000000 0.000000",
                     "g\\rh\t0.000000 0.000000"]
    escapes = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}
    unescape = lambda s: re.sub(r"\\(.)", lambda m: escapes[m.group(1)], s)      # noqa: E731
    assert [unescape(line.split("\t")[0]) for line in lines] == texts
    assert main(["embed", "--similarity", *texts]) == 0
    assert capsys.readouterr().out.splitlines()[-4:] == ["[0] a\\nb", "[1] c\\td", "[2] e\\\\nf", "[3] g\\rh"]
    assert cli.one_line("x\ty") == "x\\ty"              # translate prints source and output through it
    for command in ("embed", "translate"):                 # and both say so in their help
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "newline or tab in a text is printed as \\\\, \\n or \\t" in " ".join(capsys.readouterr().out.split())


def test_bad_input_ends_with_a_message_and_nonzero_exit(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)                  # no runs/ of other tests: --resume has nothing to continue
    missing = str(tmp_path / "none.npz")
    assert main(["translate", "--checkpoint", missing, "x"]) == 2
    assert "does not exist" in capsys.readouterr().err
    ckpt = str(tmp_path / "m.npz")
    assert main(["train", *TINY, "--checkpoint", ckpt]) == 0
    capsys.readouterr()
    assert main(["generate", "--checkpoint", ckpt]) == 2                 # a seq2seq checkpoint
    assert "needs a GPT checkpoint" in capsys.readouterr().err
    assert main(["translate", "--checkpoint", ckpt, "a" * 500]) == 2      # longer than the positions
    assert "exceeds max_len" in capsys.readouterr().err
    assert main(["train", "--steps", "5", "--warmup", "10"]) == 2
    assert "--warmup: expected fewer warm-up steps than --steps 5, got 10" in capsys.readouterr().err
    assert main(["train", "--resume"]) == 2                              # no runs/dates-seq2seq here
    assert "--resume: no checkpoint to continue, runs/dates-seq2seq/last.npz" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:                                # argparse: unknown task
        main(["train", "--task", "nope"])
    assert exc.value.code == 2


def test_python_dash_m_runs_the_same_cli():
    done = subprocess.run([sys.executable, "-m", "npformer", "gradcheck", "--only", "relu"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "relu" in done.stdout


def test_a_closed_reader_stops_the_command_quietly():
    """``npformer gradcheck | head``: once the reader has gone, the command stops with SIGPIPE's
    status (141) and no traceback, its results written or not."""
    proc = subprocess.Popen([sys.executable, "-m", "npformer", "gradcheck", "--only", "relu"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()                                   # the reader goes before the first line
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141, err
    assert err == ""


ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("npformer.models", "npformer.pretrained", "npformer.training.loop", "npformer.training.registry",
         "npformer.training.seq2seq_trainer", "npformer.training.lm_trainer", "npformer.training.mlm_trainer",
         "npformer.training.xl_trainer", "cupy", "torch", "matplotlib")


def _python(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter on this checkout's npformer."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=env)


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["study", "--help"]])
def test_help_imports_no_trainer_model_or_experiment(argv):
    done = _python(f"""
import contextlib, io, sys
from npformer.cli import main
from npformer.study import EXPERIMENTS
with contextlib.redirect_stdout(io.StringIO()) as out:
    try:
        main({argv!r})
    except SystemExit as exc:
        assert exc.code == 0, exc.code
heavy = {HEAVY!r} + tuple(e.module for e in EXPERIMENTS.values())
loaded = sorted(m for m in sys.modules if m.startswith(heavy))
print(loaded)
print(len(out.getvalue()))
""")
    assert done.returncode == 0, done.stderr
    loaded, printed = done.stdout.splitlines()
    assert loaded == "[]" and int(printed) > 200


def test_study_name_help_imports_that_experiment_alone():
    done = _python("""
import contextlib, io, sys
from npformer.cli import main
from npformer.study import EXPERIMENTS
with contextlib.redirect_stdout(io.StringIO()) as out:
    try:
        main(["study", "positional", "--help"])
    except SystemExit as exc:
        assert exc.code == 0, exc.code
print(sorted(name for name, e in EXPERIMENTS.items() if e.module in sys.modules))
print("--positions" in out.getvalue() and "--out DIR" in out.getvalue())
""")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["['positional']", "True"]


def test_study_help_lists_every_experiment_with_its_description(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["study", "--help"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for name, experiment in EXPERIMENTS.items():
        assert name in out and " ".join(experiment.description.split()[:4]) in out


@pytest.mark.parametrize("argv,message", [
    (["--model", "gpt", "--task", "charlm", "--share", "all"],
     "--share does not apply to --model gpt; it is an option of --model albert"),
    (["--task", "copy", "--mem-len", "8"],
     "--mem-len does not apply to --model seq2seq (the default for --task copy); it is an option of "
     "--model transformer-xl"),
    (["--task", "copy", "--text", "book.txt"],
     "--text does not apply to --model seq2seq (the default for --task copy); it is an option of --model gpt, "
     "gpt1, gpt2, bert, albert"),
    (["--task", "charlm", "--n-train", "100"],
     "--n-train does not apply to --model gpt (the default for --task charlm); it is an option of --model "
     "seq2seq, transformer-xl"),
])
def test_an_option_of_another_model_is_a_one_line_error(capsys, argv, message):
    assert main(["train", *argv, "--steps", "2", "--warmup", "0"]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"npformer train: error: {message}\n" and captured.out == ""


def test_an_option_of_another_model_exits_2_from_the_shell():
    done = subprocess.run([sys.executable, "-m", "npformer", "train", "--model", "gpt", "--share", "all"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == ["npformer train: error: --share does not apply to --model gpt; it is an "
                                        "option of --model albert"]


def test_an_internal_error_is_not_turned_into_a_usage_message(monkeypatch):
    def broken(options):
        raise KeyError("a bug, not a mistake of the user")
    monkeypatch.setattr(cli, "make_config", broken)
    with pytest.raises(KeyError, match="a bug"):
        main(["train", "--steps", "2"])


def test_reference_flag_runs_the_command_with_the_fast_paths_off(monkeypatch):
    from npformer import cli, dispatch
    seen = []
    monkeypatch.setattr(cli, "cmd_gradcheck", lambda args: seen.append(dispatch.enabled()) or 0)
    assert cli.main(["gradcheck", "--reference"]) == 0
    assert cli.main(["gradcheck"]) == 0
    assert seen == [False, True] and dispatch.enabled()
