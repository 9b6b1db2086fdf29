"""Progress where the output goes: a bar on a user's terminal, plain lines with the ETA on a pipe, a
terminal that reports no width, or under an MPI launcher (Open MPI forwards a pseudo-terminal even into
a file); and the launcher's rank, read before MPI starts, so that a usage error is printed once."""
import fcntl
import io
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from npformer.launcher import LAUNCHER_VARIABLES, RANK_VARIABLES, launched_by_mpi, launcher_rank
from npformer.progress import Progress, interactive

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = LAUNCHER_VARIABLES + RANK_VARIABLES


@pytest.fixture
def no_launcher(monkeypatch):
    for name in LAUNCHER:
        monkeypatch.delenv(name, raising=False)


def _terminal(columns: int):
    """A pseudo-terminal's two ends, the terminal reporting ``columns`` columns."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    return leader, follower


@pytest.mark.parametrize("columns, drawn", [(80, True), (0, False)])
def test_a_bar_needs_a_terminal_that_reports_a_width(no_launcher, columns, drawn):
    leader, follower = _terminal(columns)
    with os.fdopen(follower, "w") as stream:
        assert interactive(stream) is drawn
    os.close(leader)
    assert not interactive(io.StringIO())                 # a pipe, a file, a notebook's stream


def test_no_bar_under_an_mpi_launcher(monkeypatch, no_launcher):
    leader, follower = _terminal(80)
    with os.fdopen(follower, "w") as stream:
        monkeypatch.setenv("PMIX_RANK", "0")              # as Open MPI 5's mpirun starts rank 0, on a pty
        assert launched_by_mpi() and not interactive(stream)
    os.close(leader)


@pytest.mark.parametrize("env, rank", [({}, 0), ({"PMI_RANK": "1"}, 1), ({"PMIX_RANK": "3"}, 3),
                                       ({"OMPI_COMM_WORLD_RANK": "2"}, 2), ({"PMI_RANK": "x"}, 0)])
def test_the_launcher_rank(env, rank):
    assert launcher_rank(env) == rank


def test_plain_lines_give_the_count_and_the_eta_at_each_quarter():
    lines = []
    with Progress(10, "layers post-norm", unit="step", log=lines.append) as progress:
        for _ in range(10):
            progress.update()
        progress.write("a result line")
    assert [line.split("  ")[1] for line in lines[:4]] == ["layers post-norm: step 3/10", "layers post-norm: step 5/10",
                                                          "layers post-norm: step 8/10", "layers post-norm: step 10/10"]
    assert all("elapsed, ETA" in line for line in lines[:4]) and lines[4] == "a result line"


def _train_on_a_terminal(columns: int, cwd: Path) -> str:
    """``npformer train`` (tiny, 4 steps) with its output on a pseudo-terminal of ``columns`` columns."""
    leader, follower = _terminal(columns)
    argv = [sys.executable, "-m", "npformer", "train", "--task", "copy", "--n-train", "100", "--n-valid", "10",
            "--steps", "4", "--warmup", "1", "--d-model", "8", "--heads", "2", "--layers", "1", "--ff", "16",
            "--batch-size", "8", "--eval-every", "0", "--log-every", "2"]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER} | {"PYTHONPATH": str(ROOT)}
    with subprocess.Popen(argv, stdout=follower, stderr=follower, cwd=cwd, env=env) as proc:
        os.close(follower)
        out = b""
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:                                # the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
        assert proc.wait(timeout=120) == 0, out.decode(errors="replace")
    os.close(leader)
    return out.decode(errors="replace")


def test_train_draws_a_bar_on_a_terminal_and_step_lines_where_it_cannot(tmp_path):
    for name in ("wide", "none"):                           # a working directory (and run directory) each
        (tmp_path / name).mkdir()
    drawn = _train_on_a_terminal(80, tmp_path / "wide")
    assert "step 4/4" in drawn and "\r" in drawn and "step     2/4  loss" not in drawn    # the bar's redraws
    zero = _train_on_a_terminal(0, tmp_path / "none")     # a terminal that reports no width: step lines
    assert "step     2/4  loss" in zero and "step     4/4  loss" in zero
