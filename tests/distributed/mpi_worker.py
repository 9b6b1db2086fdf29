"""Run by ``mpirun -n 2 python -m tests.distributed.mpi_worker OUT``: every check the data-parallel tests
need from two real MPI ranks, in one launch (about 3 s of work a rank). Rank r writes ``OUT/rank{r}.npz`` (arrays) and
``OUT/rank{r}.json`` (the interface checks and error messages); the tests compare them with one process."""
import json
import sys
from pathlib import Path

import numpy as np

from npformer.distributed import MPICommunicator, check_same_config
from npformer.errors import DistributedError
from tests.distributed.cases import CLIPS, MODELS, float32_run, gradients_after_one_step, resumed_run
from tests.distributed.interface_checks import run_interface_checks


def main(out: Path) -> None:
    comm = MPICommunicator()
    report = {"interface": run_interface_checks(comm, expected_size=2)}
    try:       # rank 1 was "started" with another --lr than rank 0
        check_same_config(comm, {"lr": 0.001 * (comm.rank + 1), "layers": 2}, np)
        report["config mismatch"] = "no error"
    except DistributedError as exc:
        report["config mismatch"] = str(exc)
    arrays = {}
    for model in MODELS:
        for clip_name, clip in CLIPS.items():
            got = gradients_after_one_step(model, clip, comm)
            arrays.update({f"{model}/{clip_name}/{k}": v for k, v in got.items()})
        arrays.update({f"{model}/float32/{k}": v for k, v in float32_run(model, comm).items()})
    arrays.update({f"xl/{k}": v for k, v in resumed_run(out / "xl.npz", comm).items()})
    np.savez(out / f"rank{comm.rank}.npz", **arrays)
    (out / f"rank{comm.rank}.json").write_text(json.dumps(report))
    comm.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
