"""``benchmarks/distributed.py``: the three set-ups (one rank on one thread, one rank on two, two ranks on
one each) timed under mpirun, with the fast paths on or the NumPy ones alone."""
import json
import subprocess
import sys

from tests.distributed.launcher import ROOT, TIMEOUT_S, mpirun_path


def test_the_data_parallel_benchmark_times_three_set_ups_with_the_numpy_paths_alone(tmp_path):
    mpirun_path()                                          # skips without mpi4py or mpirun
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "distributed.py"), "--models", "gpt-tiny",
                          "--batch", "4", "--seq", "8", "--steps", "2", "--warmup", "1", "--no-numba",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(next(tmp_path.glob("distributed_*_numpy-alone.json")).read_text())
    assert [(r["ranks"], r["threads"], r["rows_per_rank"]) for r in rows] == [(1, 1, 4), (1, 2, 4), (2, 1, 2)]
    assert all(r["model"] == "gpt-tiny" and r["numba"] is False and r["step_ms"] > 0 for r in rows)
    table = next(tmp_path.glob("distributed_*_numpy-alone.md")).read_text().splitlines()
    assert sum("| gpt-tiny | NumPy alone |" in line for line in table) == 3
