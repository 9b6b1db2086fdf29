"""``mpirun -n 2 npformer train`` end to end, and the documentation's data-parallel loop
(docs/pages/data-parallel.md) on 2 ranks: rank 0 alone logs and writes, the checkpoint holds the
global batch's Transformer-XL memory (gathered from the ranks) and resumes on 2 ranks, and the errors of
a batch the ranks do not divide and of a checkpoint of another rank count. (That a resumed run repeats
the uninterrupted one exactly is tested in test_data_parallel.py.)"""
import re
import shutil
import sys

import numpy as np
import pytest

from npformer.cli import main
from tests.distributed.launcher import ROOT, mpirun

XL = ["--model", "transformer-xl", "--task", "recall", "--block-size", "8", "--d-model", "16", "--heads", "2",
      "--layers", "1", "--ff", "32", "--batch-size", "4", "--n-train", "40", "--n-valid", "4", "--eval-every", "0",
      "--log-every", "1", "--warmup", "1"]


def _train(*args, cwd):
    """``mpirun -n 2 npformer train`` in ``cwd``, where its default run directory goes (never the
    checkout's: a later run there would meet this one's files)."""
    return mpirun(2, sys.executable, "-m", "npformer", "train", *XL, *args, cwd=cwd)


def _arrays(path):
    with np.load(path, allow_pickle=False) as data:
        return {k: data[k] for k in data.files}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A 2-rank run of 3 steps (mid-sequence: the memory is in the checkpoint) and the same run resumed
    to step 5."""
    d = tmp_path_factory.mktemp("cli")
    first = _train("--steps", "3", "--checkpoint", str(d / "first.npz"), cwd=d)
    shutil.copy(d / "first.npz", d / "resumed.npz")
    resumed = _train("--steps", "5", "--checkpoint", str(d / "resumed.npz"), "--resume", cwd=d)
    for run in (first, resumed):
        assert run.returncode == 0, f"{run.args}: exit {run.returncode}\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    return d, first, resumed


def test_rank_0_alone_logs(runs):
    _, first, resumed = runs
    assert [line.split()[1] for line in first.stdout.splitlines() if line.startswith("step ")] == \
        ["1/3", "2/3", "3/3"]
    assert first.stdout.count("final validation") == 1
    assert resumed.stdout.count("resumed from") == 1 and "at step 3" in resumed.stdout
    assert [line.split()[1] for line in resumed.stdout.splitlines() if line.startswith("step ")] == ["4/5", "5/5"]


def test_the_checkpoint_holds_the_global_batchs_memory(runs):
    d = runs[0]
    first = _arrays(d / "first.npz")
    mems = [k for k in first if k.startswith("model/mems.")]
    assert mems and all(first[k].shape[0] == 4 for k in mems)     # both ranks' 2 rows each


def test_a_batch_the_ranks_do_not_divide_is_a_usage_error(tmp_path):
    run = _train("--steps", "2", "--batch-size", "5", cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    assert "npformer train: error: batch size (--batch-size) 5 is not divisible by the 2 ranks" in run.stderr
    assert run.stderr.count("error:") == 1, run.stderr           # once for all ranks


def test_a_usage_error_is_printed_once_for_all_ranks(tmp_path):
    run = _train("--steps", "2", "--lrr", "0.1", cwd=tmp_path)
    assert run.returncode == 2
    assert [line for line in run.stderr.splitlines() if "error:" in line] == [
        "npformer train: error: unrecognized arguments: --lrr 0.1; did you mean --lr? (see npformer train --help)"]


def test_a_two_rank_checkpoint_does_not_resume_in_one_process(runs, capsys, tmp_path):
    path = tmp_path / "c.npz"
    shutil.copy(runs[0] / "first.npz", path)
    assert main(["train", *XL, "--steps", "6", "--checkpoint", str(path), "--resume"]) == 2
    assert ("was written by a run on 2 rank(s); resume it on 2 (--processes 2 or mpirun -n 2), not 1, so it "
            "continues exactly"
            in capsys.readouterr().err)


def test_the_docs_data_parallel_loop_runs_on_two_ranks_and_learns(tmp_path):
    page = ROOT / "docs" / "pages" / "data-parallel.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
    (loop,) = [b for b in blocks if "DataParallel(" in b]
    (tmp_path / "loop.py").write_text(loop)
    run = mpirun(2, sys.executable, str(tmp_path / "loop.py"))
    assert run.returncode == 0, run.stderr[-4000:]
    (line,) = run.stdout.splitlines()                          # rank 0 alone prints
    assert line.startswith("2 ranks, global batch 8, loss after 60 steps ")
    assert float(line.split()[-6]) < 0.1, line


def test_another_runs_directory_is_refused_once_and_replaced_by_rank_0_with_overwrite(runs):
    """Every rank checks the run directory; the refusal is one line, and under --overwrite rank 0
    alone removes the earlier run's files (and says so once)."""
    d = runs[0]
    refused = _train("--steps", "2", cwd=d)               # the default run directory holds the 5-step run
    assert refused.returncode == 2, refused.stderr
    (line,) = [line for line in refused.stderr.splitlines() if "error:" in line]
    assert "holds a run (config.json, metrics.jsonl, last.npz, best.npz), which a new run would replace" in line
    replaced = _train("--steps", "2", "--overwrite", cwd=d)
    assert replaced.returncode == 0, replaced.stderr[-4000:]
    assert replaced.stdout.count("--overwrite: removed the earlier run's") == 1
    assert replaced.stdout.count("final validation") == 1
