"""nanoGPT's CPU recipe as flags: Adam's betas, biases on or off, which parameters weight decay
applies to, how much the validations read and whether the last reads the whole split, a training-loss
estimate beside each validation, and a printed config with no None for what the model fixed."""
import numpy as np
import pytest

from npformer.errors import RangeError
from npformer.nn import Embedding, Linear
from npformer.training.config import make_config
from npformer.training.optim import AdamW
from npformer.training.registry import make_trainer

LM = dict(task="charlm", model="gpt2", d_model=16, heads=2, layers=1, ff=32, block_size=16, batch_size=4,
          steps=6, warmup=1, eval_every=3, log_every=3, eval_limit=2, dropout=0.0)


def _trainer(lines=None, **options):
    return make_trainer(make_config({**LM, **options}), log=(lines.append if lines is not None else lambda _: None))


def test_betas_and_the_decay_rule_reach_the_optimiser():
    t = _trainer(beta1=0.8, beta2=0.99, decay="matrices")
    assert t.opt.param_groups[0]["betas"] == (0.8, 0.99) and t.opt.decay_filter == "matrices"
    assert _trainer().opt.param_groups[0]["betas"] == (0.9, 0.999)


@pytest.mark.parametrize("rule, decayed", [("auto", {"lin.weight"}), ("matrices", {"lin.weight", "emb.weight"}),
                                           (None, {"lin.weight", "lin.bias", "emb.weight"})])
def test_which_parameters_decay(rule, decayed):
    """With zero gradients AdamW's step is the decay alone: p <- p (1 - lr wd) where it applies."""
    lin, emb = Linear(3, 2, rng=0, dtype="float64"), Embedding(5, 2, rng=1, dtype="float64")
    params = [("lin.weight", lin.weight), ("lin.bias", lin.bias), ("emb.weight", emb.weight)]
    before = {n: p.data.copy() for n, p in params}
    for _, p in params:
        p.grad = np.zeros_like(p.data)
    AdamW(params, lr=0.1, weight_decay=0.5, decay_filter=rule).step()
    for n, p in params:
        np.testing.assert_allclose(p.data, before[n] * (0.95 if n in decayed else 1.0), rtol=1e-15, err_msg=n)


def test_no_bias_drops_the_gpt_biases_and_is_refused_where_there_is_no_switch():
    names = list(_trainer(bias=False).model.state_dict())
    assert names and not any(n.endswith("bias") for n in names)
    assert any(n.endswith("bias") for n in _trainer().model.state_dict())
    with pytest.raises(RangeError, match="--no-bias: the bert model has no switch for its biases"):
        _trainer(model="bert", bias=False)


def test_validations_read_eval_limit_and_say_the_training_loss_beside():
    lines = []
    t = _trainer(lines, final_eval=False)
    t.fit()
    valid = [r for r in t.history if r["split"] == "valid"]
    assert [r["step"] for r in valid] == [3, 6] and not any(r["final"] for r in valid)
    said = [line for line in lines if line.lstrip().startswith("valid")]
    assert len(said) == 2 and all("| train loss" in line and "(mean of the last 3 steps)" in line for line in said)
    train = [r["loss"] for r in t.history if r["split"] == "train"]
    assert f"| train loss {train[0]:.4f} " in said[0]            # log_every 3: the same 3 steps' mean


def test_the_final_validation_reads_the_whole_split_by_default():
    t = _trainer(steps=3, eval_every=0)
    t.fit()
    assert [r["final"] for r in t.history if r["split"] == "valid"] == [True]


def test_the_printed_config_says_what_the_model_fixed():
    lines = []
    _trainer(lines, steps=2, eval_every=0, final_eval=False).fit()
    config = " ".join(line for line in lines if line.startswith("config:") or line.startswith("  "))
    optional = ("checkpoint=None", "out_dir=None", "text=None", "log_to=None")     # outputs and inputs left out
    for setting in optional:
        config = config.replace(setting, "")
    assert "norm_first=True" in config and "activation=gelu_tanh" in config and "=None" not in config
