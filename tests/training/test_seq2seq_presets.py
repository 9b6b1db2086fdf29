"""The paper's sizes as presets of npformer train (--preset paper-base|paper-big) and the three-way
sharing of one vocabulary (--share-vocab): what the presets set, that given flags win, and a tiny run
that trains, saves and translates with one embedding for source, target and output."""
import pytest

from npformer.cli import main
from npformer.errors import RangeError
from npformer.models.seq2seq import PAPER_SIZES
from npformer.training.config import make_config
from npformer.training.registry import make_trainer
from npformer.training.trained_models import load_trained

TINY = dict(task="dates", n_train=200, n_valid=20, steps=3, warmup=1, d_model=16, heads=2, layers=1, ff=32,
            batch_size=8, eval_every=0)


@pytest.mark.parametrize("size", ["base", "big"])
def test_a_preset_sets_the_papers_sizes_and_given_options_win(size):
    paper = PAPER_SIZES[size]
    c = make_config({"preset": f"paper-{size}"})
    assert (c.model, c.d_model, c.heads, c.layers, c.ff, c.dropout, c.share_vocab) == \
        ("seq2seq", paper["d_model"], paper["nhead"], paper["num_encoder_layers"], paper["dim_feedforward"],
         paper["dropout"], True)
    c = make_config({"preset": f"paper-{size}", "d_model": 64, "share_vocab": False})
    assert (c.d_model, c.heads, c.share_vocab) == (64, paper["nhead"], False)


def test_a_preset_of_another_model_is_named_in_the_error():
    with pytest.raises(RangeError, match="--preset does not apply to --model gpt"):
        make_config({"model": "gpt", "task": "charlm", "preset": "paper-base"})


def test_shared_vocabulary_trains_saves_and_translates(tmp_path, capsys):
    trainer = make_trainer(make_config({**TINY, "share_vocab": True}), log=lambda _: None)
    model, task = trainer.model, trainer.task
    assert task.src_vocab is task.tgt_vocab and set("1976-12-23 DEC") <= set(task.src_vocab.symbols)
    assert model.src_embed is model.tgt_embed and model.generator.weight is model.tgt_embed.weight
    apart = make_trainer(make_config(TINY), log=lambda _: None).model
    assert model.num_parameters() < apart.num_parameters()
    run = tmp_path / "run"
    argv = ["train", *(f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()), "--share-vocab", "--out-dir", str(run)]
    assert main(argv) == 0
    trained = load_trained(run / "last.npz", backend="numpy")
    assert trained.model.src_embed is trained.model.tgt_embed and trained.vocabs[0] == trained.vocabs[1]
    capsys.readouterr()
    assert main(["translate", "--checkpoint", str(run), "23-DEC-1976"]) == 0
    assert "23-DEC-1976" in capsys.readouterr().out
