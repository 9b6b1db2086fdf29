"""Using trained models from the command line: ``translate --beam``, ``fill-mask``, ``export`` (read back
by transformers where installed), ``study attention`` on every GPT kind, BERT and ALBERT, and text
with characters outside the model's vocabulary refused by name everywhere."""
import json

import numpy as np
import pytest

from npformer.cli import main
from npformer.data.vocab import SPECIALS
from npformer.interop import load_safetensors_file
from npformer.training.trained_models import MASK_TOKEN, fill_mask_text, load_trained

COMMON = ["--steps", "3", "--warmup", "1", "--d-model", "8", "--heads", "2", "--eval-every", "0", "--layers", "2"]
LM = ["--task", "charlm", "--batch-size", "2", "--block-size", "16"]


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    """Checkpoints trained for 3 steps: a dates Seq2Seq, gpt1 (F = 4C, as OpenAI GPT), gpt2, bert, albert."""
    d = tmp_path_factory.mktemp("ck")
    runs = {"dates": ["--task", "dates", "--ff", "8", "--n-train", "32", "--batch-size", "4"],
            "gpt1": [*LM, "--model", "gpt1", "--ff", "32"], "gpt2": [*LM, "--model", "gpt2", "--ff", "8"],
            "bert": [*LM, "--model", "bert", "--ff", "8"], "albert": [*LM, "--model", "albert", "--ff", "8"]}
    for name, argv in runs.items():
        assert main(["train", *COMMON, *argv, "--checkpoint", str(d / f"{name}.npz")]) == 0
    return d


def _err(capsys, argv):
    capsys.readouterr()
    assert main(argv) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("model", ["gpt1", "gpt2"])
def test_generate_gives_as_many_characters_as_asked_and_no_special_token(ck, capsys, model):
    """A GPT trained 3 steps still spreads its probability over the four specials, which no training
    text holds: `generate --tokens 300` printed as few as 8 characters when it drew an <eos> (the text
    ends there), and <pad> or <bos> vanished from it. They are never drawn now, at any seed."""
    for seed in range(4):
        capsys.readouterr()
        assert main(["generate", "--checkpoint", str(ck / f"{model}.npz"), "--prompt", "The ", "--tokens", "300",
                     "--temperature", "1.5", "--top-p", "1", "--seed", str(seed)]) == 0
        text = capsys.readouterr().out[:-1]                          # print's newline
        assert len(text) == 4 + 300 and text.startswith("The ") and "<unk>" not in text


def test_translate_with_beam_search(ck, capsys):
    capsys.readouterr()
    assert main(["translate", "--checkpoint", str(ck / "dates.npz"), "--beam", "3", "3 March 1997", "4 July"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("\t")[0] for line in lines] == ["3 March 1997", "4 July"]
    assert "--beam: expected an int >= 1, got 0" in _err(capsys, ["translate", "--checkpoint", str(ck / "dates.npz"),
                                                                  "--beam", "0", "x"])
    vocab = len(load_trained(ck / "dates.npz").vocabs[1])               # (--beam 99999999999 never returned)
    assert main(["translate", "--checkpoint", str(ck / "dates.npz"), "--beam", str(vocab), "3 March 1997"]) == 0
    widest = capsys.readouterr().out
    assert main(["translate", "--checkpoint", str(ck / "dates.npz"), "--beam", "99999999999", "3 March 1997"]) == 0
    said = capsys.readouterr()
    assert said.out == widest and said.err == (f"npformer translate: note: --beam 99999999999 is more than the {vocab} "
                                               f"tokens of the target vocabulary; using {vocab}\n")


def test_characters_outside_the_vocabulary_are_named(ck, capsys):
    msg = _err(capsys, ["translate", "--checkpoint", str(ck / "dates.npz"), "3 Märch 1997"])
    assert "source '3 Märch 1997': the characters 'ä' are not in the model's vocabulary" in msg
    msg = _err(capsys, ["generate", "--checkpoint", str(ck / "gpt2.npz"), "--prompt", "Thé river€"])
    assert "prompt 'Thé river€': the characters 'é€' are not in the model's vocabulary of" in msg
    msg = _err(capsys, ["fill-mask", "--checkpoint", str(ck / "bert.npz"), "Thé riv[MASK]r"])
    assert "the characters 'é' are not in the model's vocabulary" in msg
    msg = _err(capsys, ["study", "attention", "--checkpoint", str(ck / "gpt1.npz"), "--input", "Thé",
                        "--out", str(ck / "att")])
    assert "the characters 'é' are not in the model's vocabulary" in msg


@pytest.mark.parametrize("name", ["bert", "albert"])
def test_fill_mask(ck, capsys, name):
    capsys.readouterr()
    assert main(["fill-mask", "--checkpoint", str(ck / f"{name}.npz"), "--top-k", "3", "The riv[MASK]r [MASK]an"]) == 0
    out = capsys.readouterr().out.splitlines()
    trained = load_trained(ck / f"{name}.npz")
    filled, candidates = fill_mask_text(trained, "The riv[MASK]r [MASK]an", top_k=3)
    assert out[0] == filled and len(filled) == len("The river ran") and filled.startswith("The riv")
    assert len(out) == 3 and out[1].startswith("  [MASK] 1: ") and out[2].startswith("  [MASK] 2: ")
    for pairs in candidates:
        assert len(pairs) == 3 and all(len(t) == 1 and t in trained.vocabs[0] for t, _ in pairs)
        probs = [p for _, p in pairs]
        assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1
    assert filled[7] == candidates[0][0][0] and filled[10] == candidates[1][0][0]
    assert "no [MASK] to fill" in _err(capsys, ["fill-mask", "--checkpoint", str(ck / f"{name}.npz"), "The river"])


def test_fill_mask_needs_a_masked_model(ck, capsys):
    msg = _err(capsys, ["fill-mask", "--checkpoint", str(ck / "gpt2.npz"), "a[MASK]"])
    assert "holds a 'gpt2' model; fill-mask needs a bert or albert checkpoint" in msg


@pytest.mark.parametrize("name", ["gpt1", "gpt2", "bert", "albert"])
def test_study_attention_reads_every_gpt_kind_and_the_encoders(ck, capsys, name):
    out = ck / f"att_{name}"
    capsys.readouterr()
    text = "The r[MASK]ver" if name in ("bert", "albert") else "The river"
    assert main(["study", "attention", "--checkpoint", str(ck / f"{name}.npz"), "--input", text,
                 "--out", str(out)]) == 0
    data = json.load(open(out / "attention.json"))
    assert data["model"] == ("gpt" if name.startswith("gpt") else "encoder")
    assert len(data["tokens"]) == 9 and (name.startswith("gpt") or data["tokens"][5] == "[MASK]")
    assert sorted(m["layer"] for m in data["maps"]) == [0, 1]          # ALBERT: its one layer, once per use
    for m in data["maps"]:
        w = np.asarray(m["weights"])
        np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-5)
        assert (np.triu(w, k=1).max() == 0) == name.startswith("gpt")   # causal only in a GPT


def test_export_refuses_what_it_cannot_write(ck, capsys):
    for name in ("albert", "dates"):
        assert "Seq2Seq, ALBERT and Transformer-XL have no exporter" in \
            _err(capsys, ["export", "--checkpoint", str(ck / f"{name}.npz"), "--to", str(ck / "x")])
    assert "--to " in _err(capsys, ["export", "--checkpoint", str(ck / "gpt2.npz"), "--to", str(ck / "bert.npz")])


@pytest.mark.parametrize("name, cls", [("gpt1", "OpenAIGPTLMHeadModel"), ("gpt2", "GPT2LMHeadModel"),
                                       ("bert", "BertForMaskedLM")])
def test_export_writes_the_hugging_face_layout(ck, capsys, tmp_path, name, cls):
    capsys.readouterr()
    assert main(["export", "--checkpoint", str(ck / f"{name}.npz"), "--to", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"wrote {tmp_path}: {cls}")
    trained = load_trained(ck / f"{name}.npz", backend="numpy")
    written = sum(a.size for a in load_safetensors_file(tmp_path / "model.safetensors").values())
    if name == "bert":           # BertForMaskedLM has no pooler: the summary counts what was written
        pooler = sum(p.data.size for p in trained.model.pooler.parameters())
        assert written == trained.model.num_parameters() - pooler > 0
        assert (f", {written:,} parameters of the model's {trained.model.num_parameters():,} (the rest has no "
                f"place in {cls})") in out
    else:
        assert written == trained.model.num_parameters() and f", {written:,} parameters, float32" in out
    vocab = trained.vocabs[0]
    tokenizer = json.loads((tmp_path / "tokenizer.json").read_text())
    assert tokenizer["model"]["vocab"] == {t: i for i, t in enumerate(SPECIALS + vocab.symbols)}
    masks = [t["id"] for t in tokenizer["added_tokens"] if t["content"] == MASK_TOKEN]
    assert masks == ([trained.mask_id] if name == "bert" else [])
    ids = np.array([vocab.encode("The river")])
    if name == "bert":
        ids[0, 3] = trained.mask_id
        h, _ = trained.model(ids)
        ours = trained.model.mlm_logits(h)
    else:
        ours = trained.model(ids)
    back = type(trained.model).from_pretrained(tmp_path)
    np.testing.assert_array_equal(back.mlm_logits(back(ids)[0]) if name == "bert" else back(ids), ours)

    torch = pytest.importorskip("torch", reason="torch not installed: reading the export with transformers needs it")
    transformers = pytest.importorskip("transformers", reason="transformers not installed")
    transformers.logging.set_verbosity_error()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert hf_tokenizer("The river", add_special_tokens=False)["input_ids"] == vocab.encode("The river")
    assert hf_tokenizer.decode(vocab.encode("The river")) == "The river"
    if name == "bert":
        assert (hf_tokenizer.mask_token, hf_tokenizer.mask_token_id) == (MASK_TOKEN, trained.mask_id)
    auto = transformers.AutoModelForMaskedLM if name == "bert" else transformers.AutoModelForCausalLM
    theirs = auto.from_pretrained(str(tmp_path)).eval()
    assert type(theirs).__name__ == cls
    with torch.no_grad():
        logits = theirs(torch.tensor(ids)).logits.numpy()
    assert np.abs(logits - ours).max() <= 1e-5 * np.abs(ours).max()     # float32


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_npformer_reads_its_own_exports(ck, capsys, tmp_path, name):
    """tokenizer.json round trip: the tokenizers library encodes text (characters, specials, [MASK],
    unknown characters) as the checkpoint's vocabulary does and decodes it back; fill-mask --model
    on a BERT export gives the checkpoint's candidates, generate --model runs on a GPT-2 export."""
    tokenizers = pytest.importorskip("tokenizers", reason="tokenizers not installed (the pretrained extra)")
    assert main(["export", "--checkpoint", str(ck / f"{name}.npz"), "--to", str(tmp_path)]) == 0
    trained = load_trained(ck / f"{name}.npz", backend="numpy")
    vocab = trained.vocabs[0]
    tok = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    text = "The river\nbank " + "\u2603"                             # a character no vocabulary has
    assert tok.encode(text).ids == vocab.encode(text) and vocab.encode(text)[-1] == vocab.unk_id
    assert tok.decode(vocab.encode("The river"), skip_special_tokens=True) == "The river"
    capsys.readouterr()
    if name == "bert":
        assert tok.encode("The riv[MASK]r").ids[7] == trained.mask_id
        assert main(["fill-mask", "--model", str(tmp_path), "The riv[MASK]r"]) == 0
        from_export = capsys.readouterr().out
        assert main(["fill-mask", "--checkpoint", str(ck / "bert.npz"), "The riv[MASK]r"]) == 0
        assert from_export == capsys.readouterr().out
    else:
        assert main(["generate", "--model", str(tmp_path), "--prompt", "The ", "--tokens", "20"]) == 0
        assert capsys.readouterr().out.startswith("The ")


def test_a_checkpoint_alone_samples_and_eval_or_resume_refuse_a_text_rewritten_since(tmp_path, monkeypatch, capsys):
    """generate rebuilt the vocabulary from the run's --text file: from another directory a relative
    path failed, and a text rewritten with other characters of the same count silently mapped the ids
    to other characters ("LINEEEE..."). It reads the checkpoint's vocabulary (and its default prompt)
    now; eval and --resume, which need the data, refuse a text whose vocabulary is not the checkpoint's."""
    monkeypatch.chdir(tmp_path)
    text = tmp_path / "texts" / "mine.txt"
    text.parent.mkdir()
    original = "LINE one, a line of my text.\n" * 30                      # no 'T': the default prompt is "LINE"
    text.write_text(original)
    assert main(["train", *COMMON, *LM, "--text", "texts/mine.txt", "--out-dir", "run"]) == 0
    greedy = ["--prompt", "LINE", "--temperature", "0", "--tokens", "20"]
    capsys.readouterr()
    assert main(["generate", "--checkpoint", "run", *greedy]) == 0
    sample = capsys.readouterr().out
    assert sample.startswith("LINE") and len(sample) == 25
    text.write_text(original.swapcase())              # as many characters, other ones: ids would mean others
    (tmp_path / "elsewhere").mkdir()
    for where in (tmp_path, tmp_path / "elsewhere"):
        monkeypatch.chdir(where)
        assert main(["generate", "--checkpoint", str(tmp_path / "run"), *greedy]) == 0
        assert capsys.readouterr().out == sample
        assert main(["generate", "--checkpoint", str(tmp_path / "run"), "--tokens", "0"]) == 0
        assert capsys.readouterr().out == "LINE\n"                    # the text's start, from the checkpoint
    msg = _err(capsys, ["eval", "--checkpoint", str(tmp_path / "run")])
    assert ("was trained on --text texts/mine.txt, which eval reads again for its held-out part: no such file "
            "(a relative path is read from the working directory") in msg
    monkeypatch.chdir(tmp_path)
    changed = ("was trained with another vocabulary than its text, --text texts/mine.txt, gives now (the characters "
               "'afmotxy' gone, 'AFMOTXY' new): the model's ids would stand for other characters")
    assert changed in _err(capsys, ["eval", "--checkpoint", "run"])
    assert changed in _err(capsys, ["train", "--resume", "--checkpoint", "run", "--steps", "5"])
    text.unlink()
    assert main(["generate", "--checkpoint", "run", *greedy]) == 0
    assert capsys.readouterr().out == sample
    text.write_text(original)
    assert main(["eval", "--checkpoint", "run", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 3


def test_a_checkpoint_of_a_data_parallel_run_is_used_in_one_process(ck, tmp_path, monkeypatch, capsys):
    """eval, translate and generate refused a checkpoint of --processes 2 ("written by a run on 2
    rank(s); resume it on 2"): the rank count binds a resumed run alone (each rank's dropout stream is
    its own). The same checkpoint with meta ranks 2, as a 2-rank run writes it, gives the same output;
    --resume still refuses it in one process."""
    from npformer.training.checkpoint import load_checkpoint, save_checkpoint
    monkeypatch.chdir(tmp_path)
    xl = ["--model", "transformer-xl", "--task", "recall", "--block-size", "8", "--n-train", "8", "--n-valid", "4",
          "--batch-size", "4", "--ff", "8"]
    assert main(["train", *COMMON, *xl, "--checkpoint", str(tmp_path / "xl.npz"), "--out-dir", "xl"]) == 0
    paths = {"xl": tmp_path / "xl.npz", **{name: ck / f"{name}.npz" for name in ("dates", "gpt2", "bert")}}
    commands = [("dates", ["translate", "3 March 1997", "--beam", "2"]), ("gpt2", ["generate", "--tokens", "10"]),
                ("gpt2", ["eval", "--json"]), ("xl", ["eval", "--json"]), ("bert", ["fill-mask", "a[MASK]c"])]
    for name, (command, *argv) in commands:
        ck_ = load_checkpoint(paths[name])
        assert ck_.meta["ranks"] == 1
        two = save_checkpoint(tmp_path / f"{name}-2.npz", ck_.model, {**ck_.meta, "ranks": 2}, ck_.optim)
        outputs = []
        for path in (paths[name], two):
            capsys.readouterr()
            assert main([command, "--checkpoint", str(path), *argv]) == 0, capsys.readouterr().err
            out = capsys.readouterr().out
            outputs.append({**json.loads(out), "checkpoint": None} if "--json" in argv else out)
        assert outputs[0] == outputs[1], (name, command)
    msg = _err(capsys, ["train", "--resume", "--checkpoint", str(tmp_path / "gpt2-2.npz"), "--steps", "5"])
    assert "gpt2-2.npz was written by a run on 2 rank(s); resume it on 2 (--processes 2 or mpirun -n 2), not 1" in msg


@pytest.mark.parametrize("name, key, value, argv", [
    ("gpt2", "best_valid_loss", "x", ["eval"]), ("gpt2", "ranks", "x", ["train", "--resume", "--steps", "5"]),
    ("bert", "mask_id", "x", ["fill-mask", "a[MASK]"]), ("gpt2", "sample_prompt", 3, ["generate"])])
def test_a_forged_meta_value_is_one_line_naming_the_checkpoint(ck, tmp_path, monkeypatch, capsys, name, key, value,
                                                               argv):
    """best_valid_loss "x" ended eval in a bare "could not convert string to float: 'x'"."""
    from npformer.training.checkpoint import load_checkpoint, save_checkpoint
    monkeypatch.chdir(tmp_path)
    good = load_checkpoint(ck / f"{name}.npz")
    path = save_checkpoint(tmp_path / "forged.npz", good.model, {**good.meta, key: value}, good.optim)
    msg = _err(capsys, [argv[0], "--checkpoint", str(path), *argv[1:]])
    assert msg.startswith(f"npformer {argv[0]}: error: checkpoint '{path}': meta[{key!r}] is {json.dumps(value)}; "
                          "expected ") and len(msg.splitlines()) == 1
