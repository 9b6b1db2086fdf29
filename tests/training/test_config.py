"""The train configs: one per model kind, each field in one home with its help text; an option of
another model is a clear error; checkpoints written before the split (one flat dict) still load."""
from dataclasses import asdict, fields, replace

import pytest

from npformer.cli import main
from npformer.training import checkpoint as ckpt
from npformer.training.config import (CONFIGS, FIELDS, ALBERTTrainConfig, CharLMTrainConfig, Seq2SeqTrainConfig,
                                      TrainConfig, XLTrainConfig, config_from_dict, flag, make_config,
                                      options_from_file)
from npformer.training.registry import make_trainer

# meta["train_config"] as npformer wrote it before the configs were split: every kind's fields in one
# dict, the other kinds' at their defaults (here a GPT-2 run on charlm), heads and ff by their earlier
# names (RENAMED)
OLD_FLAT = {"task": "charlm", "model": "gpt2", "seed": 0, "backend": "numpy", "dtype": "float32", "steps": 8,
            "batch_size": 8, "lr": 3e-3, "warmup": 2, "min_lr": 1e-4, "weight_decay": 0.01, "clip": 1.0,
            "label_smoothing": 0.1, "d_model": 16, "nhead": 2, "layers": 1, "dim_feedforward": 32,
            "dropout": 0.1, "activation": None, "norm_first": None, "n_train": None, "n_valid": None,
            "eval_every": 0, "log_every": 4, "checkpoint": None, "checkpoint_every": 200, "text": None,
            "block_size": 16, "mem_len": None, "embedding_size": None, "share": None, "precision": "float32"}


def test_each_kind_has_the_loop_fields_and_only_its_own():
    loop = {f.name for f in fields(TrainConfig)}
    own = {cls: {f.name for f in fields(cls)} - loop for cls in set(CONFIGS.values())}
    assert own == {Seq2SeqTrainConfig: {"label_smoothing", "n_train", "n_valid", "share_vocab", "preset"},
                   CharLMTrainConfig: {"text", "block_size"},
                   ALBERTTrainConfig: {"text", "block_size", "embedding_size", "share"},
                   XLTrainConfig: {"block_size", "mem_len", "n_train", "n_valid"}}
    assert set(FIELDS) == loop | set().union(*own.values())


def test_every_field_has_one_home_and_help_text():
    homes = {}
    for cls in (TrainConfig, *CONFIGS.values()):
        for klass in cls.__mro__:
            for name in vars(klass).get("__annotations__", {}):
                homes.setdefault(name, set()).add(klass)
    assert {name: len(where) for name, where in homes.items() if len(where) != 1} == {}
    for name, f in FIELDS.items():
        assert f.metadata["help"].strip(), name
    assert flag("heads") == "--heads" and flag("ff") == "--ff" and flag("mem_len") == "--mem-len"


def test_the_example_count_help_gives_each_tasks_default(capsys):
    """--n-train/--n-valid say what "default" means for every task that draws examples."""
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert ("--n-train N_TRAIN training examples the task draws (default: dates and numbers 20,000; copy and "
            "reverse 10,000; summarise every window; recall 2,000)") in text
    assert ("--n-valid N_VALID validation examples the task draws (default: dates, numbers, copy and reverse "
            "1,000; summarise every window; recall 200)") in text


@pytest.mark.parametrize("options,message", [
    ({"model": "gpt", "share": "all"}, "--share does not apply to --model gpt; it is an option of --model albert"),
    ({"task": "copy", "mem_len": 4}, "--mem-len does not apply to --model seq2seq (the default for --task copy); "
                                     "it is an option of --model transformer-xl"),
    ({"task": "copy", "text": "a.txt"}, "--text does not apply to --model seq2seq (the default for --task copy); "
                                        "it is an option of --model gpt, gpt1, gpt2, bert, albert"),
    ({"model": "transformer-xl", "label_smoothing": 0.0}, "--label-smoothing does not apply to --model "
                                                          "transformer-xl; it is an option of --model seq2seq"),
])
def test_an_option_of_another_model_is_refused(options, message):
    with pytest.raises(ValueError) as exc:
        make_config(options)
    assert str(exc.value) == message


def test_make_config_picks_the_kind_and_rejects_unknown_names():
    assert type(make_config({"task": "charlm"})) is CharLMTrainConfig
    assert type(make_config({"task": "recall", "mem_len": 0})) is XLTrainConfig
    assert type(make_config({})) is Seq2SeqTrainConfig
    albert = make_config({"task": "charlm", "model": "albert", "share": "ffn", "steps": 3})
    assert type(albert) is ALBERTTrainConfig and albert.share == "ffn" and albert.steps == 3
    with pytest.raises(ValueError, match="'nheads' is not an option of npformer train; did you mean 'heads'?"):
        make_config({"nheads": 4})
    with pytest.raises(ValueError, match="model: expected one of 'seq2seq', .*, got 'gpt5'"):
        make_config({"model": "gpt5"})
    with pytest.raises(ValueError, match="task: expected one of 'dates', .*, got 'poems'"):
        make_config({"task": "poems"})


def test_a_trainer_refuses_the_config_of_another_kind():
    from npformer.training.seq2seq_trainer import Seq2SeqTrainer
    with pytest.raises(TypeError, match="the seq2seq trainer trains from a Seq2SeqTrainConfig, got a "
                                        "CharLMTrainConfig"):
        Seq2SeqTrainer(CharLMTrainConfig(task="charlm"))
    with pytest.raises(TypeError, match="the bert trainer trains from a CharLMTrainConfig, got a ALBERTTrainConfig"):
        make_trainer(ALBERTTrainConfig(task="charlm", model="bert"))
    with pytest.raises(ValueError, match="config.model: expected 'seq2seq' or None for the seq2seq trainer"):
        Seq2SeqTrainer(Seq2SeqTrainConfig(model="gpt"))


def test_old_flat_train_configs_load_as_their_kind():
    gpt2 = config_from_dict(OLD_FLAT)
    assert type(gpt2) is CharLMTrainConfig and gpt2.model == "gpt2" and gpt2.block_size == 16
    seq2seq = config_from_dict({**OLD_FLAT, "task": "copy", "model": None, "n_train": 50}, model="seq2seq")
    assert type(seq2seq) is Seq2SeqTrainConfig and seq2seq.n_train == 50 and seq2seq.model == "seq2seq"
    recall = config_from_dict({**OLD_FLAT, "task": "recall", "model": None, "mem_len": 0})
    assert type(recall) is XLTrainConfig and recall.mem_len == 0 and recall.model == "transformer-xl"
    albert = config_from_dict({**OLD_FLAT, "model": "albert", "share": "ffn"})
    assert type(albert) is ALBERTTrainConfig and albert.share == "ffn"
    assert config_from_dict(asdict(albert)) == albert                    # the new format round-trips


def test_a_checkpoint_with_an_old_flat_config_resumes_exactly_and_samples(tmp_path, capsys):
    config = config_from_dict(OLD_FLAT)
    straight = make_trainer(config, log=lambda _: None)
    expected = [straight.train_step().loss for _ in range(8)]
    first = make_trainer(config, log=lambda _: None)
    got = [first.train_step().loss for _ in range(4)]
    path = first.save(tmp_path / "old.npz")
    saved = ckpt.load_checkpoint(path)
    old_meta = {**saved.meta, "train_config": OLD_FLAT}                   # as the code before the split wrote it
    ckpt.save_checkpoint(path, saved.model, old_meta, saved.optim)
    meta = ckpt.load_checkpoint(path).meta
    resumed = make_trainer(config_from_dict(meta["train_config"], meta["kind"]), log=lambda _: None)
    resumed.load(path)
    got += [resumed.train_step().loss for _ in range(4)]
    assert got == expected                                                # bit for bit
    assert main(["generate", "--checkpoint", str(path), "--tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("The ")
    assert main(["translate", "--checkpoint", str(path), "abc"]) == 2
    assert "holds a 'gpt2' model; translate needs a Seq2Seq checkpoint" in capsys.readouterr().err
    assert main(["train", "--resume", "--checkpoint", str(path), "--steps", "6"]) == 0
    assert "resumed from" in capsys.readouterr().out
    rewritten = ckpt.load_checkpoint(path).meta["train_config"]               # in the new format now
    assert rewritten == asdict(replace(config, steps=6, checkpoint=str(path), out_dir="runs/charlm-gpt2"))


def test_earlier_field_names_still_load_and_files_are_told_the_new_ones(tmp_path):
    """Fields are named as their flags (``heads`` for --heads, ``ff`` for --ff). A checkpoint's config
    with the earlier names loads as it is; a config file or make_config with them works and says the
    new name in a FutureWarning; a file giving both names of one field is refused."""
    import json
    import warnings
    loaded = config_from_dict(OLD_FLAT)
    assert (loaded.heads, loaded.ff) == (2, 32) and "nhead" not in asdict(loaded)
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"task": "charlm", "nhead": 2, "dim_feedforward": 48}))
    with pytest.warns(FutureWarning) as said:
        options = options_from_file(path)
    assert [str(w.message).split(": ", 1)[1] for w in said] == [
        "'nhead' is the earlier name of 'heads' (--heads); it will stop being read, write 'heads'",
        "'dim_feedforward' is the earlier name of 'ff' (--ff); it will stop being read, write 'ff'"]
    assert options == {"task": "charlm", "heads": 2, "ff": 48}
    with pytest.warns(FutureWarning, match="'dim_feedforward' is the earlier name of 'ff'"):
        assert make_config({"task": "charlm", "dim_feedforward": 48}).ff == 48
    path.write_text(json.dumps({"heads": 2, "nhead": 4}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with pytest.raises(ValueError, match="'nhead' sets --heads a second time"):
            options_from_file(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                   # the current names: no warning
        assert make_config({"task": "charlm", "heads": 2, "ff": 48}).heads == 2


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_a_config_file_takes_the_command_line_s_names_and_suggests_as_it_does(tmp_path, suffix):
    """A config file reads every name the command line does: the field (d_model), its flag's spelling
    (d-model), and other tools' names for it (nanoGPT's n_embd, eval_interval, device with its
    values); a misspelt key gets the closest setting, another tool's setting without a counterpart
    what to use instead, as the flags do."""
    import json
    path = tmp_path / f"c{suffix}"

    def write(table: dict) -> None:
        path.write_text(json.dumps(table) if suffix == ".json" else
                        "".join(f"{k} = {json.dumps(v)}\n" for k, v in table.items()))
    write({"n_embd": 32, "n_layer": 2, "eval_interval": 5, "log_interval": 2, "learning_rate": 0.01,
           "max_iters": 9, "device": "cpu", "batch-size": 3})
    assert options_from_file(path) == {"d_model": 32, "layers": 2, "eval_every": 5, "log_every": 2, "lr": 0.01,
                                       "steps": 9, "backend": "numpy", "batch_size": 3}
    write({"device": "cuda"})
    assert options_from_file(path) == {"backend": "cupy"}
    write({"stepz": 3})
    with pytest.raises(ValueError, match=r"'stepz' is not an option of npformer train; did you mean 'steps'\?"):
        options_from_file(path)
    write({"eval_iters": 20})
    with pytest.raises(ValueError, match="'eval_iters' is not an option of npformer train; npformer train has no "
                                         "such setting: a validation reads --eval-limit"):
        options_from_file(path)
    write({"frobnicate": 1})
    with pytest.raises(ValueError, match="'frobnicate' is not an option of npformer train; not a setting"):
        options_from_file(path)


def test_a_config_is_frozen_and_replace_checks_the_new_one():
    """A setting changed after the checks ran would skip them: another setting is another config."""
    import dataclasses
    from npformer.errors import RangeError
    from npformer.training.config import CharLMTrainConfig
    config = CharLMTrainConfig(task="charlm", steps=20)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.steps = 0
    assert config.warmup == 2 and dataclasses.replace(config, steps=40).steps == 40
    with pytest.raises(RangeError, match="--steps"):
        dataclasses.replace(config, steps=0)
