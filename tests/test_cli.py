"""The command line: exit codes and messages for the main jobs and for bad input."""
import subprocess
import sys

import pytest

from npformer.cli import main

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


def test_bad_input_ends_with_a_message_and_nonzero_exit(tmp_path, capsys):
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
    assert "must be greater than warmup" in capsys.readouterr().err
    assert main(["train", "--resume"]) == 2
    assert "--resume needs --checkpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:                                # argparse: unknown task
        main(["train", "--task", "nope"])
    assert exc.value.code == 2


def test_python_dash_m_runs_the_same_cli():
    done = subprocess.run([sys.executable, "-m", "npformer", "gradcheck", "--only", "relu"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "relu" in done.stdout
