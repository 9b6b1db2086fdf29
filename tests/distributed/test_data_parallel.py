"""Two MPI ranks against one process: ``mpirun -n 2`` runs tests/distributed/mpi_worker.py once (the
interface checks, a config mismatch, float64 gradients and float32 runs) and these tests compare what
each rank wrote with a one-process run of the same global batch, computed here."""
import json
import sys

import numpy as np
import pytest

from tests.distributed.cases import (CLIPS, MODELS, STEPS_FLOAT32, comparable_parts, float32_run,
                                     gradients_after_one_step)
from tests.distributed.launcher import mpirun

GRAD_TOL = 1e-12        # float64: the all-reduced sum of weighted shares against the joined batch
FLOAT32_RTOL = 1e-5     # float32, 20 AdamW steps: the same sums in another order


def _rel_err(a, b) -> float:
    """max |a - b| / max(|a| + |b|), over a whole tensor (CS231n's relative error, floored at 1e-30)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / max(float((np.abs(a) + np.abs(b)).max()), 1e-30))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """What ranks 0 and 1 wrote: [(arrays, report), (arrays, report)]."""
    out = tmp_path_factory.mktemp("mpi")
    run = mpirun(2, sys.executable, "-m", "tests.distributed.mpi_worker", str(out))
    assert run.returncode == 0, f"mpirun failed ({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-5000:]}"
    found = []
    for r in range(2):
        with np.load(out / f"rank{r}.npz") as data:
            arrays = dict(data)
        found.append((arrays, json.loads((out / f"rank{r}.json").read_text())))
    return found


def test_the_mpi_communicator_does_what_the_interface_says(ranks):
    for r, (_, report) in enumerate(ranks):
        failed = [name for name, ok in report["interface"].items() if not ok]
        assert not failed, f"rank {r}: {failed}"
        assert len(report["interface"]) == 13


def test_ranks_started_with_different_configs_fail_at_the_start(ranks):
    rank0, rank1 = ranks[0][1]["config mismatch"], ranks[1][1]["config mismatch"]
    assert "rank 1 holds another model or config than rank 0: lr: rank 0 has 0.001, rank 1 has 0.002" in rank1
    assert "ranks [1] were started with another model or config than rank 0" in rank0


@pytest.mark.parametrize("clip_name", CLIPS)
@pytest.mark.parametrize("model", MODELS)
def test_float64_gradients_of_two_ranks_equal_one_process_on_the_joined_batch(ranks, model, clip_name):
    one = gradients_after_one_step(model, CLIPS[clip_name])
    (r0, _), (r1, _) = ranks
    prefix = f"{model}/{clip_name}/"
    names = [k for k in one if k.startswith("grad/")]
    assert len(names) > 5 and all(prefix + k in r0 for k in names)
    if clip_name == "clipped":
        assert one["norm"] > 2 * CLIPS[clip_name]          # the clipping did scale the gradients
    for k in names:                 # why the float32 test leaves the key biases out: their gradient is 0
        if k.endswith("in_proj_bias"):
            d = one[k].shape[0] // 3
            assert np.abs(one[k][d:2 * d]).max() < GRAD_TOL * np.abs(one[k]).max(), k
    for k in names + ["loss", "norm"]:
        np.testing.assert_array_equal(r0[prefix + k], r1[prefix + k], err_msg=f"{k}: ranks differ")
        err = _rel_err(r0[prefix + k], one[k])
        assert err < GRAD_TOL, f"{model} {clip_name} {k}: relative error {err:.2e} (tolerance {GRAD_TOL:g})"


@pytest.mark.parametrize("model", MODELS)
def test_float32_two_ranks_of_b_train_as_one_process_of_2b(ranks, model):
    one = float32_run(model)
    (r0, _), (r1, _) = ranks
    prefix = f"{model}/float32/"
    assert r0[prefix + "losses"].shape == (STEPS_FLOAT32,)
    np.testing.assert_allclose(r0[prefix + "losses"], one["losses"], rtol=FLOAT32_RTOL, atol=0)
    assert one["losses"][-1] < one["losses"][0] - 0.3      # it trained (20 steps of a tiny model)
    weights = [k for k in one if k.startswith("weight/")]
    for k in weights:
        np.testing.assert_array_equal(r0[prefix + k], r1[prefix + k], err_msg=f"{k}: ranks differ")
        for part, (got, expected) in comparable_parts(k, r0[prefix + k], one[k]):
            err = _rel_err(got, expected)
            assert err < FLOAT32_RTOL, f"{model} {part}: relative error {err:.2e} after {STEPS_FLOAT32} steps"


def test_a_two_rank_run_resumes_exactly_from_a_checkpoint_mid_sequence(ranks):
    (r0, _), (r1, _) = ranks
    np.testing.assert_array_equal(r0["xl/resumed/losses"], r0["xl/straight/losses"])    # bit for bit
    weights = [k for k in r0 if k.startswith("xl/straight/weight/")]
    assert weights
    for k in weights:
        np.testing.assert_array_equal(r0[k.replace("straight", "resumed")], r0[k], err_msg=k)
        np.testing.assert_array_equal(r1[k], r0[k], err_msg=k)
