"""The Seq2Seq training loop: the loss falls, checkpoints resume exactly, writes are atomic."""
import numpy as np
import pytest

from npformer.errors import CheckpointError
from npformer.training import checkpoint as ckpt
from npformer.training.config import CharLMTrainConfig, Seq2SeqTrainConfig
from npformer.training.registry import make_trainer
from npformer.training.seq2seq_trainer import Seq2SeqTrainer

SMALL = dict(task="copy", n_train=300, n_valid=40, d_model=16, heads=2, layers=1, ff=32,
             batch_size=16, steps=40, warmup=5, lr=3e-3, eval_every=0, log_every=10)


def _quiet(config):
    return Seq2SeqTrainer(config, log=lambda _: None)


def test_loss_falls():
    trainer = _quiet(Seq2SeqTrainConfig(**SMALL))
    losses = [trainer.train_step().loss for _ in range(40)]
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5]), losses


def test_a_step_returns_its_loss_tokens_and_gradient_norm():
    """train_step's result: the loss, the tokens read, the gradient norm before clipping (the one the
    optimiser's clip saw), whether the ids were checked; the same figures fit() records."""
    from npformer.training.loop import StepResult
    from npformer.training.optim import clip_grad_norm
    trainer = _quiet(Seq2SeqTrainConfig(**SMALL))
    seen = []
    real_clip = clip_grad_norm
    import npformer.training.loop as loop
    loop.clip_grad_norm = lambda params, max_norm: seen.append(real_clip(params, max_norm)) or seen[-1]
    try:
        result = trainer.train_step()
    finally:
        loop.clip_grad_norm = real_clip
    assert isinstance(result, StepResult) and result.values_checked
    assert type(result.loss) is float and np.isfinite(result.loss) and result.loss > 0
    assert type(result.tokens) is int and result.tokens > 0
    assert result.grad_norm == float(seen[0]) and result.grad_norm > 0


def test_resume_repeats_the_uninterrupted_losses_exactly(tmp_path):
    cfg = Seq2SeqTrainConfig(**{**SMALL, "steps": 12, "dropout": 0.1})
    straight = _quiet(cfg)
    expected = [straight.train_step().loss for _ in range(12)]
    first = _quiet(cfg)
    got = [first.train_step().loss for _ in range(6)]
    first.save(tmp_path / "run.npz")
    resumed = _quiet(cfg)
    resumed.load(tmp_path / "run.npz")
    assert resumed.step == 6
    got += [resumed.train_step().loss for _ in range(6)]
    assert got == expected                                  # bit for bit, not approximately


def test_checkpoint_has_no_pickle_and_holds_config_and_optimizer(tmp_path):
    trainer = _quiet(Seq2SeqTrainConfig(**{**SMALL, "steps": 2, "warmup": 1}))
    trainer.train_step()
    path = trainer.save(tmp_path / "c.npz")
    with np.load(path, allow_pickle=False) as data:      # would raise on any pickled object
        names = data.files
    assert "meta" in names and any(n.startswith("optim/state.") for n in names)
    loaded = ckpt.load_checkpoint(path)
    assert loaded.meta["step"] == 1 and loaded.meta["model_config"]["d_model"] == 16
    assert "transformer.encoder.layers.0.self_attn.in_proj_weight" in loaded.model


def test_a_crash_mid_write_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "c.npz"
    ckpt.save_checkpoint(path, {"w": np.ones(3)}, {"step": 1})

    def broken_savez(f, **arrays):
        f.write(b"half a file")
        raise OSError("disk full")
    monkeypatch.setattr(ckpt.np, "savez", broken_savez)
    with pytest.raises(CheckpointError, match="disk full; the previous checkpoint .* is intact"):
        ckpt.save_checkpoint(path, {"w": np.zeros(3)}, {"step": 2})
    back = ckpt.load_checkpoint(path, require_meta={})
    assert back.meta["step"] == 1 and back.model["w"].tolist() == [1, 1, 1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.npz"]      # no temporary left behind


def test_load_checkpoint_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ckpt.load_checkpoint(tmp_path / "missing.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="not an npformer checkpoint"):
        ckpt.load_checkpoint(tmp_path / "junk.npz")


def test_evaluate_and_translate_run():
    trainer = _quiet(Seq2SeqTrainConfig(**{**SMALL, "steps": 2, "warmup": 1}))
    result = trainer.evaluate(limit=8)
    assert 0.0 <= result["exact_match"] <= 1.0 and np.isfinite(result["loss"])
    assert len(trainer.translate(["abc", "j"])) == 2


LM = dict(task="charlm", d_model=16, heads=2, layers=1, ff=32, block_size=16,
          batch_size=8, steps=40, warmup=5, lr=3e-3, eval_every=0, log_every=10)


def test_charlm_gpt_loss_falls_and_resumes_exactly(tmp_path):
    trainer = make_trainer(CharLMTrainConfig(**LM), log=lambda _: None)
    assert trainer.model.config.norm_first                      # GPT-2 style by default
    losses = [trainer.train_step().loss for _ in range(40)]
    uniform = np.log(len(trainer.vocab))                        # the loss of knowing nothing
    assert losses[0] > uniform - 0.1 and np.mean(losses[-5:]) < uniform - 0.5, losses
    short = CharLMTrainConfig(**{**LM, "steps": 8})
    straight = make_trainer(short, log=lambda _: None)
    expected = [straight.train_step().loss for _ in range(8)]
    first = make_trainer(short, log=lambda _: None)
    got = [first.train_step().loss for _ in range(4)]
    first.save(tmp_path / "lm.npz")
    resumed = make_trainer(short, log=lambda _: None)
    resumed.load(tmp_path / "lm.npz")
    got += [resumed.train_step().loss for _ in range(4)]
    assert got == expected
    result = resumed.evaluate(limit=4)
    assert np.isfinite(result["loss"]) and result["sample"].startswith("The ")


def test_loading_a_checkpoint_of_another_kind_is_a_clear_error(tmp_path):
    lm = make_trainer(CharLMTrainConfig(**{**LM, "steps": 2, "warmup": 1}), log=lambda _: None)
    lm.save(tmp_path / "lm.npz")
    s2s = _quiet(Seq2SeqTrainConfig(**{**SMALL, "steps": 2, "warmup": 1}))
    with pytest.raises(ValueError, match="holds a 'gpt' checkpoint, not a seq2seq one"):
        s2s.load(tmp_path / "lm.npz")


def test_a_data_parallel_step_needs_the_targets_of_its_loss():
    """Each rank's loss is weighed by the targets it averages over, which Trainer.cross_entropy (and
    head_cross_entropy, the GPT trainers' way) return with the loss (Loss.valid) and the step returns
    with its loss (StepLoss.valid): a step that gives none gets a clear error, not silently wrong weights."""
    from npformer.training.loop import StepLoss
    from npformer.errors import DistributedError
    from npformer.ops.cross_entropy import cross_entropy_backward, cross_entropy_forward
    from npformer.training.config import make_config
    trainer = make_trainer(make_config(dict(task="charlm", model="gpt2", d_model=16, heads=2, layers=1,
                                            ff=32, block_size=16, batch_size=4, steps=3, warmup=1,
                                            eval_every=0)), log=lambda _: None)
    reduced = []

    class OneRank:                                          # the data-parallel step's reduction, on one rank
        def dropout_seed(self, seed, step):
            return (seed, step)

        def reduce_gradients(self, loss, count, tokens):
            reduced.append(count)
            return loss, count, tokens
    trainer.data_parallel = OneRank()
    trainer.train_step()                                    # the trainer's own step: through head_cross_entropy
    assert reduced == [4 * 16]
    x, y = trainer.batch(2)

    def bypass(step):
        loss, cache = cross_entropy_forward(trainer.model(x), y)
        trainer.model.backward(cross_entropy_backward(trainer.xp.ones((), dtype=loss.dtype), cache))
        return StepLoss(float(loss), int(x.size), None)
    trainer.loss_and_backward = bypass
    with pytest.raises(DistributedError, match="gave no targets with its loss"):
        trainer.train_step()


@pytest.mark.parametrize("precision", ["float32", "float16"])
def test_the_lm_step_takes_its_head_and_loss_in_chunks(monkeypatch, precision):
    """A budget of 4 rows' logits per chunk (8 x 16 rows: 32 chunks) trains as one chunk does, to the
    rounding of dW's sum over the chunks; the trainer's step never makes the (B, T, V) logits."""
    from npformer.ops import linear_cross_entropy as lce
    config = CharLMTrainConfig(**{**LM, "steps": 5, "warmup": 2, "precision": precision})
    whole = make_trainer(config, log=lambda _: None)
    expected = [whole.train_step().loss for _ in range(5)]
    chunked = make_trainer(config, log=lambda _: None)
    monkeypatch.setattr(lce, "LOGITS_CHUNK_BYTES", 4 * len(chunked.vocab) * 4)
    rows = []
    real = lce.linear_forward
    monkeypatch.setattr(lce, "linear_forward", lambda x, *a: rows.append(x.shape[0]) or real(x, *a))
    monkeypatch.setattr(chunked.model.head, "forward", lambda x: pytest.fail("the head's forward ran"))
    got = [chunked.train_step().loss for _ in range(5)]
    assert rows == [4] * 32 * 5
    np.testing.assert_allclose(got, expected, rtol={"float32": 1e-5, "float16": 2e-3}[precision])


def _forged(src, dst, **changes):
    """A copy of the checkpoint ``src`` at ``dst`` whose meta has ``changes`` (None: the key removed)."""
    ck = ckpt.load_checkpoint(src)
    meta = {**ck.meta, **changes}
    ckpt.save_checkpoint(dst, ck.model, {k: v for k, v in meta.items() if v is not None}, ck.optim)
    return dst


def test_a_checkpoint_of_another_vocabulary_than_the_data_give_is_refused_before_its_tensors(tmp_path):
    """Ids mean characters only under the vocabulary they were trained with: a trainer whose data
    give another (a rewritten --text, a task changed since) refuses the checkpoint, saying so, before
    its tensors are compared (a vocabulary of another size would show as tensors of other sizes)."""
    from npformer.training.trained_models import load_trained
    cfg = Seq2SeqTrainConfig(**{**SMALL, "steps": 2, "warmup": 1})
    trainer = _quiet(cfg)
    trainer.save(tmp_path / "run.npz")
    symbols = list(trainer.task.tgt_vocab.symbols)
    for name, tgt, how in [("swapped", symbols[1::-1] + symbols[2:], "the same characters in another order"),
                           ("fewer", symbols[1:], f"{symbols[0]!r} new")]:
        tgt_vocab = {**trainer.task.tgt_vocab.to_dict(), "symbols": tgt}
        path = _forged(tmp_path / "run.npz", tmp_path / f"{name}.npz", tgt_vocab=tgt_vocab)
        with pytest.raises(CheckpointError) as exc:
            _quiet(cfg).load(path)
        assert str(exc.value) == (f"checkpoint '{path}' was trained with another vocabulary than --task copy gives "
                                  f"now ({how}): the model's ids would stand for other characters; give it the data "
                                  "it was trained on")
    path = _forged(tmp_path / "run.npz", tmp_path / "novocab.npz", tgt_vocab=None)
    with pytest.raises(CheckpointError, match=f"checkpoint '{path}': meta lacks 'tgt_vocab', the vocabulary of"):
        load_trained(path)
    path = _forged(tmp_path / "run.npz", tmp_path / "badvocab.npz", tgt_vocab={"symbols": "abc"})
    with pytest.raises(CheckpointError, match=f"checkpoint '{path}': meta\\['tgt_vocab'\\] is not a vocabulary"):
        load_trained(path)


def test_load_trained_checks_the_tensors_against_the_model_as_a_trainer_does(tmp_path):
    """generate reads checkpoints through load_trained (no trainer, no data), as fill-mask and export
    do: a tensor of another dtype (int32 weights were cast and sampled from), a missing or an extra one
    is refused in the words of Trainer.load, naming the checkpoint."""
    from npformer.training.trained_models import load_trained
    trainer = _quiet(Seq2SeqTrainConfig(**{**SMALL, "steps": 2, "warmup": 1}))
    trainer.save(tmp_path / "run.npz")
    ck = ckpt.load_checkpoint(tmp_path / "run.npz")
    name = next(iter(ck.model))
    shape = ck.model[name].shape
    for tag, model, said in [
            ("int", {**ck.model, name: ck.model[name].astype(np.int32)},
             f"tensor 'model/{name}' is int32 {shape}; the model has float32 {shape}"),
            ("extra", {**ck.model, "zzz": np.zeros(3, np.float32)},
             "does not fit the model: unexpected tensors ['zzz']"),
            ("missing", {k: v for k, v in ck.model.items() if k != name},
             f"does not fit the model: missing tensors ['{name}']")]:
        path = ckpt.save_checkpoint(tmp_path / f"{tag}.npz", model, ck.meta, ck.optim)
        with pytest.raises(CheckpointError) as exc:
            load_trained(path)
        assert str(exc.value) == f"checkpoint '{path}': {said}"
        with pytest.raises(CheckpointError) as exc:
            _quiet(Seq2SeqTrainConfig(**{**SMALL, "steps": 2, "warmup": 1})).load(path)
        assert str(exc.value) == f"checkpoint '{path}': {said}"
