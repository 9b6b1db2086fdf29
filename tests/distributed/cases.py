"""The training runs the data-parallel tests compare: each config is run by 2 ranks (in the MPI worker)
and by one process with the same global batch (in the test), and both results are read the same way."""
import numpy as np

from npformer.training.config import make_config
from npformer.training.optim import clip_grad_norm
from npformer.training.registry import make_trainer

TINY = dict(d_model=16, heads=2, layers=1, ff=32, dropout=0.0, warmup=2, lr=3e-3, eval_every=0)
MODELS = {   # the global batch is 8: 2 ranks x 4 rows, or one process with 8
    "gpt": dict(task="charlm", model="gpt", block_size=16, batch_size=8, **TINY),
    # dates pairs have different lengths, so the ranks' shares of the targets differ (padding ignored)
    "seq2seq": dict(task="dates", model="seq2seq", n_train=200, n_valid=10, batch_size=8, **TINY),
}
# Transformer-XL with dropout: each rank's own masks, and a memory that a checkpoint must gather
XL = dict(task="recall", model="transformer-xl", block_size=8, n_train=40, n_valid=4, batch_size=4, steps=6,
          **{**TINY, "dropout": 0.1})
CLIPS = {"no clipping": float("inf"), "clipped": 0.05}
STEPS_FLOAT32 = 20


def trainer_for(model: str, comm=None, **options):
    config = make_config({**MODELS[model], "steps": STEPS_FLOAT32, **options})
    return make_trainer(config, log=lambda _: None, comm=comm)


def gradients_after_one_step(model: str, clip: float, comm=None) -> dict:
    """Float64, the first step's batch: forward, backward, (2 ranks: the gradients' all-reduce), clip.
    Returns the gradients by parameter name, the loss and the norm before clipping."""
    trainer = trainer_for(model, comm, dtype="float64", clip=clip)
    trainer.model.train()
    loss, tokens, valid = trainer.loss_and_backward(1)
    if comm is not None:
        loss = trainer.data_parallel.reduce_gradients(loss, int(valid.sum()), tokens).loss
    norm = clip_grad_norm(trainer.model.parameters(), clip)
    out = {f"grad/{name}": p.grad.copy() for name, p in trainer.model.named_parameters()}
    return {**out, "loss": np.float64(loss), "norm": np.float64(norm)}


def float32_run(model: str, comm=None) -> dict:
    """Float32, dropout off: the losses of STEPS_FLOAT32 steps and the final weights."""
    trainer = trainer_for(model, comm)
    losses = [trainer.train_step().loss for _ in range(STEPS_FLOAT32)]
    weights = {f"weight/{name}": p.data.copy() for name, p in trainer.model.named_parameters()}
    return {**weights, "losses": np.asarray(losses, dtype=np.float64)}


def resumed_run(path, comm=None) -> dict:
    """Transformer-XL, 6 steps straight and 3 + 3 through a checkpoint at ``path`` (mid-sequence):
    both runs' losses and final weights."""
    def trainer():
        return make_trainer(make_config(XL), log=lambda _: None, comm=comm)

    straight = trainer()
    out = {"straight/losses": np.asarray([straight.train_step().loss for _ in range(6)])}
    first = trainer()
    losses = [first.train_step().loss for _ in range(3)]
    first.save(path)
    if comm is not None:
        comm.barrier()                           # rank 0 has written it
    resumed = trainer()
    resumed.load(path)
    out["resumed/losses"] = np.asarray(losses + [resumed.train_step().loss for _ in range(3)])
    for name, t in (("straight", straight), ("resumed", resumed)):
        out.update({f"{name}/weight/{k}": p.data.copy() for k, p in t.model.named_parameters()})
    return out


def comparable_parts(name, got, expected):
    """(label, (got, expected)) pairs to compare. The key third of an attention's ``in_proj_bias`` is
    left out: its exact gradient is 0 (q . b_k adds the same number to every score of a row, which the
    softmax removes; the float64 test checks it), so in float32 it receives only rounding noise, which
    Adam's m / sqrt(v) turns into steps of up to lr whatever the noise's size: its value is noise in
    both runs, not a result that could agree."""
    if not name.endswith("in_proj_bias"):
        return [(name, (got, expected))]
    d = got.shape[0] // 3
    return [(f"{name}[q]", (got[:d], expected[:d])), (f"{name}[v]", (got[2 * d:], expected[2 * d:]))]
