"""Masked-LM training of BERT and ALBERT: BERT's 80/10/10 masking, the loss falls, exact resume,
checkpoints, the command line and its errors."""
import numpy as np
import pytest

from npformer.cli import main
from npformer.data.vocab import SPECIALS
from npformer.training import checkpoint as ckpt
from npformer.training.mlm_trainer import IGNORE, mask_tokens
from npformer.training.config import make_config
from npformer.training.registry import make_trainer

MLM = dict(task="charlm", d_model=16, heads=2, layers=2, ff=32, block_size=16,
           batch_size=8, steps=30, warmup=3, lr=3e-3, eval_every=0, log_every=10)


def _quiet(**kw):
    return make_trainer(make_config({**MLM, **kw}), log=lambda _: None)


def test_masking_picks_fifteen_percent_and_follows_the_80_10_10_rule():
    rng = np.random.default_rng(0)
    ids = rng.integers(4, 60, size=(4000, 20))
    inputs, targets = mask_tokens(ids, np.random.default_rng(1), mask_id=60, low=4, high=60)
    picked = targets != IGNORE
    assert (picked.sum(axis=1) == 3).all()                       # round(0.15 * 20) in every row
    np.testing.assert_array_equal(targets[picked], ids[picked])  # the originals are the targets
    np.testing.assert_array_equal(inputs[~picked], ids[~picked])  # nothing else is touched
    n = picked.sum()
    masked = (inputs[picked] == 60).sum() / n
    kept = (inputs[picked] == ids[picked]).sum() / n
    other = 1 - masked - kept
    # 12,000 draws: standard errors 0.4% (80%) and 0.3% (10%); a random id equals the original 1/56 of the time
    assert abs(masked - 0.8) < 0.02
    assert abs(kept - (0.1 + 0.1 / 56)) < 0.015
    assert abs(other - 0.1 * 55 / 56) < 0.015
    assert inputs[picked].min() >= 4 and inputs.max() <= 60       # random ids are characters, never specials


def test_masking_of_short_rows_and_bad_input():
    inputs, targets = mask_tokens(np.array([[5, 6]]), np.random.default_rng(0), mask_id=9, low=4, high=9)
    assert (targets != IGNORE).sum() == 1                         # at least one position a row
    with pytest.raises(TypeError, match=r"2-d integer array \(B, T\)"):
        mask_tokens(np.zeros((2, 3)), np.random.default_rng(0), mask_id=9, low=4, high=9)
    with pytest.raises(ValueError, match=r"expected low < high, got \[9, 9\)"):
        mask_tokens(np.ones((2, 3), dtype=np.int64), np.random.default_rng(0), mask_id=9, low=9, high=9)


@pytest.mark.parametrize("model,extra", [("bert", {}), ("albert", {}),
                                         ("albert", {"share": "ffn", "embedding_size": 8})])
def test_masked_lm_loss_falls(model, extra):
    # 16 blocks of 32 characters: 80 masked positions a step (2 a step at the tiny MLM size)
    trainer = _quiet(model=model, block_size=32, batch_size=16, steps=40, lr=1e-2, **extra)
    v = len(trainer.vocab) + 1                                     # characters + [MASK]
    losses = [trainer.train_step().loss for _ in range(40)]
    assert abs(losses[0] - np.log(v)) < 0.3, losses[0]             # the loss of knowing nothing
    assert np.mean(losses[-5:]) < np.log(v) - 0.6, losses
    result = trainer.evaluate(limit=8)
    assert 0.0 <= result["accuracy"] <= 1.0 and np.isfinite(result["loss"]) and result["masked"] >= 2000
    shown, filled = result["example"]
    assert len(shown) == len(filled) == 32 and "_" in shown


@pytest.mark.parametrize("model", ["bert", "albert"])
def test_gathering_the_masked_positions_equals_the_full_head_with_ignored_targets(model):
    """The trainer runs the MLM head on the k picked positions only and scatters their gradient back;
    the reference runs it on all T positions with the rest ignored. Same loss, same gradients."""
    from npformer.backend import default_rng
    from npformer.ops.cross_entropy import cross_entropy_backward, cross_entropy_forward
    trainer = _quiet(model=model, dtype="float64")
    trainer.model.manual_seed((0, 1))
    loss = trainer.loss_and_backward(1).loss
    got = {k: g.copy() for k, g in trainer.model.grads().items()}
    trainer.model.zero_grad()
    rng = default_rng((0, 1), "numpy")                       # the batch and masks of step 1, again
    x, _ = trainer.data.random_batch("train", MLM["batch_size"], rng=rng)
    inputs, targets = trainer._mask(x, rng)
    trainer.model.manual_seed((0, 1))
    hidden, _ = trainer.model(inputs)
    ref, cache = cross_entropy_forward(trainer.model.mlm_logits(hidden), targets, ignore_index=IGNORE)
    trainer.model.backward(dmlm_logits=cross_entropy_backward(np.ones(()), cache))
    assert loss == pytest.approx(float(ref), rel=1e-12)
    for name, g in trainer.model.grads().items():
        np.testing.assert_allclose(got[name], g, rtol=1e-10, atol=1e-13, err_msg=name)
    assert np.abs(got["embeddings.word_embeddings.weight"]).max() > 0


def test_albert_trainer_defaults_and_options():
    default = _quiet(model="albert", steps=2, warmup=1).model
    assert default.config.embedding_size is None and default.embedding_hidden_mapping_in is None
    assert default.config.share == "all" and default.layers[1] is default.layers[0]
    plain = _quiet(model="albert", steps=2, warmup=1, embedding_size=0, share="attention").model
    assert plain.config.embedding_size is None and plain.embedding_hidden_mapping_in is None
    assert plain.layers[1].self_attn is plain.layers[0].self_attn and plain.layers[1] is not plain.layers[0]
    factorised = _quiet(model="albert", steps=2, warmup=1, embedding_size=4).model
    assert factorised.embeddings.word_embeddings.weight.shape[1] == 4
    assert factorised.embedding_hidden_mapping_in.weight.shape == (16, 4)


@pytest.mark.parametrize("model,extra", [("bert", {}), ("albert", {"share": "attention"})])
def test_resume_repeats_the_uninterrupted_losses_exactly(tmp_path, model, extra):
    cfg = dict(model=model, steps=8, **extra)
    straight = _quiet(**cfg)
    expected = [straight.train_step().loss for _ in range(8)]
    first = _quiet(**cfg)
    got = [first.train_step().loss for _ in range(4)]
    first.save(tmp_path / "m.npz")
    resumed = _quiet(**cfg)
    resumed.load(tmp_path / "m.npz")
    assert resumed.step == 4
    got += [resumed.train_step().loss for _ in range(4)]
    assert got == expected                                         # bit for bit
    with np.load(tmp_path / "m.npz", allow_pickle=False) as data:  # no pickle inside
        assert "meta" in data.files
    meta = ckpt.load_checkpoint(tmp_path / "m.npz").meta
    assert meta["kind"] == model and meta["mask_id"] == len(resumed.vocab)


def test_a_checkpoint_of_the_other_encoder_is_refused(tmp_path):
    _quiet(model="bert", steps=2, warmup=1).save(tmp_path / "b.npz")
    with pytest.raises(ValueError, match="holds a 'bert' checkpoint, not a albert one"):
        _quiet(model="albert", steps=2, warmup=1).load(tmp_path / "b.npz")


def test_trainer_option_errors():
    with pytest.raises(ValueError, match="use --task charlm"):
        _quiet(model="bert", task="dates")
    with pytest.raises(ValueError, match="post-norm"):
        _quiet(model="albert", norm_first=True)
    with pytest.raises(ValueError, match="--share does not apply to --model bert; it is an option of --model albert$"):
        _quiet(model="bert", share="all")
    with pytest.raises(ValueError, match="--embedding-size: expected an int >= 0, got -2"):
        _quiet(model="albert", embedding_size=-2)


TINY = ["--task", "charlm", "--d-model", "16", "--heads", "2", "--layers", "2", "--ff", "32",
        "--block-size", "16", "--batch-size", "8", "--warmup", "2", "--eval-every", "0", "--log-every", "3"]


def test_cli_trains_resumes_and_rejects_generate(tmp_path, capsys):
    path = str(tmp_path / "a.npz")
    assert main(["train", "--model", "albert", "--share", "ffn", "--embedding-size", "8", "--steps", "6",
                 *TINY, "--checkpoint", path]) == 0
    out = capsys.readouterr().out
    assert "ALBERT" in out and "embedding=8, share=ffn" in out and "masked-token accuracy" in out
    assert "masked: '" in out and "filled: '" in out
    assert main(["train", "--checkpoint", path, "--resume", "--steps", "9"]) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "step     9/9" in out and "share=ffn" in out
    assert main(["generate", "--checkpoint", path]) == 2
    assert "needs a GPT checkpoint" in capsys.readouterr().err
    assert main(["train", "--model", "bert", "--embedding-size", "8", *TINY, "--steps", "4"]) == 2
    assert "--embedding-size does not apply to --model bert; it is an option of --model albert" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--model", "albert", "--share", "most", *TINY])


def test_specials_are_not_drawn_as_random_characters():
    trainer = _quiet(model="bert", steps=2, warmup=1)
    x, _ = trainer.data.random_batch("train", 64, rng=np.random.default_rng(0))
    inputs, _ = trainer._mask(x, np.random.default_rng(1))
    assert inputs.min() >= len(SPECIALS) and inputs.max() <= trainer.mask_id
