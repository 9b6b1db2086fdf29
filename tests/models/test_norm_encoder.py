"""NormEncoder: whole-model gradcheck for each norm, where padding reaches the loss, state dicts with
running statistics."""
import numpy as np
import pytest
from hypothesis import strategies as st

from npformer.models.norm_encoder import NORMS, NormEncoder, NormEncoderConfig
from npformer.nn.module import no_grad
from npformer.ops.cross_entropy import cross_entropy_backward, cross_entropy_forward
from npformer.tools.gradcheck import gradcheck_module
from npformer.training.checkpoint import load_checkpoint, save_checkpoint
from tests.helpers import assert_gradcheck, given_per_backend, host, model_check, seeds

PAD = 0


def _batch(xp, b, t, seed, vocab=7, classes=5):
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, vocab, size=(b, t))
    ids[0, t // 2 + 1:] = PAD                             # the first row is padded
    targets = np.where(ids == PAD, -100, rng.integers(0, classes, size=(b, t)))
    return xp.asarray(ids), xp.asarray(targets)


def _model(xp, norm, norm_first, seed, dropout=0.1):
    cfg = NormEncoderConfig(vocab_size=7, num_classes=5, d_model=4, nhead=2, num_layers=2, dim_feedforward=6,
                            dropout=dropout, activation="gelu", norm=norm, norm_first=norm_first, max_len=8)
    return NormEncoder(cfg, dtype="float64", backend=xp.__name__, rng=seed)


def _loss(targets):
    saved = {}

    def forward(m, ids):
        loss, saved["cache"] = cross_entropy_forward(m(ids), targets)
        return loss

    def backward(m, dloss):
        m.backward(cross_entropy_backward(dloss, saved["cache"]))
        return ()
    return forward, backward


@given_per_backend(norm=st.sampled_from(sorted(NORMS)), norm_first=st.booleans(), t=st.integers(2, 6),
                   seed=seeds)
def test_norm_encoder_gradcheck(xp, norm, norm_first, t, seed):
    model = _model(xp, norm, norm_first, seed)
    ids, targets = _batch(xp, 3, t, seed)
    fwd, bwd = _loss(targets)
    report = gradcheck_module(model, {"ids": ids}, forward=fwd, backward=bwd, dropout_seed=seed,
                              seed=seed, **model_check(xp, 6))
    assert_gradcheck(report)


@pytest.mark.parametrize("norm", sorted(NORMS))
def test_padding_reaches_the_loss_only_through_batch_statistics(xp, norm):
    """The padding token's embedding row gets a gradient exactly when padding can change a valid
    output: under "batch" (padding is in the statistics), never under "layer" or "batch_masked"."""
    model = _model(xp, norm, False, 0, dropout=0.0)
    ids, targets = _batch(xp, 3, 6, 1)
    loss, cache = cross_entropy_forward(model(ids), targets)       # padding positions are ignored
    model.backward(cross_entropy_backward(xp.ones(()), cache))
    pad_grad = np.abs(host(model.embed.weight.grad)[PAD]).max()
    if norm == "batch":
        assert pad_grad > 1e-6
    else:
        assert pad_grad == 0.0


def test_state_dict_keeps_the_running_statistics(xp, tmp_path):
    model = _model(xp, "batch", True, 0, dropout=0.0)
    ids, _ = _batch(xp, 3, 6, 1)
    with no_grad():
        model(ids)
    sd = model.state_dict()
    assert "layers.0.norm1.running_mean" in sd and "norm.num_batches_tracked" in sd
    assert list(sd)[:2] == ["embed.weight", "layers.0.self_attn.in_proj_weight"]
    path = save_checkpoint(tmp_path / "bn.npz", sd, {"kind": "norm_encoder"})
    other = _model(xp, "batch", True, 1, dropout=0.0).load_state_dict(load_checkpoint(path, require_meta={}).model)
    model.eval(), other.eval()
    with no_grad():
        np.testing.assert_array_equal(host(model(ids)), host(other(ids)))


def test_bad_norm_and_ids(xp):
    with pytest.raises(ValueError, match="norm: expected one of 'layer', 'batch', 'batch_masked'"):
        _model(xp, "group", False, 0)
    with pytest.raises(TypeError, match="ids: expected an integer array"):
        _model(xp, "layer", False, 0)(xp.zeros((2, 3)))
