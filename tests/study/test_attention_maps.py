"""``npformer study attention``: the recorder, fresh and trained models, the files, the errors."""
import csv
import importlib.util
import json
import math

import numpy as np
import pytest

from npformer.cli import main
from npformer.models.decoding import eval_mode
from npformer.models.seq2seq import Seq2Seq, Seq2SeqConfig
from npformer.nn.attention import MultiheadAttention
from npformer.study.attention_maps import head_summaries, record_attention
from npformer.training.checkpoint import save_checkpoint

TINY = ["--d-model", "8", "--heads", "2", "--layers", "1", "--ff", "8"]
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None   # the plot extra: PNGs only with it


def _check_maps(data, layers, heads):
    """Every map: (H, Tq, Tk) matching its labels, rows summing to 1 (JSON keeps 6 decimals), causal
    maps zero above the diagonal; each group has one map per layer."""
    by_group = {}
    for m in data["maps"]:
        w = np.asarray(m["weights"])
        assert w.shape == (heads, len(m["queries"]), len(m["keys"]))
        assert (w >= 0).all()
        np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-5)
        if "causal" in m["label"]:
            assert np.triu(w, k=1).max() == 0.0
        by_group.setdefault(m["group"], []).append(m["layer"])
    assert all(sorted(v) == list(range(layers)) for v in by_group.values())
    return by_group


def test_fresh_seq2seq_writes_maps_summary_and_plots(tmp_path, capsys):
    assert main(["study", "attention", *TINY, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "decoder cross-attention" in out and "layer 0 head 1" in out
    data = json.load(open(tmp_path / "attention.json"))
    assert data["model"] == "seq2seq" and data["checkpoint"] is None and data["task"] == "dates"
    assert data["source_tokens"][:4] == ["3", "r", "d", "␣"] and data["target"] == "1997-03-03"
    assert data["target_tokens"] == ["<bos>", *"1997-03-03"]
    groups = _check_maps(data, layers=1, heads=2)
    assert set(groups) == {"encoder_self", "decoder_self", "decoder_cross"}
    cross = next(m for m in data["maps"] if m["group"] == "decoder_cross")
    assert cross["queries"] == data["target_tokens"] and cross["keys"] == data["source_tokens"]
    rows = list(csv.DictReader(open(tmp_path / "attention_summary.csv")))
    assert len(rows) == 2 * (17 + 11 + 11)
    for r in rows:
        assert 0.0 <= float(r["entropy_bits"]) <= float(r["uniform_bits"]) + 1e-9
    for name in ("encoder_self", "decoder_self", "decoder_cross"):
        assert (tmp_path / f"attention_{name}.png").exists() == HAS_MATPLOTLIB
    assert ("matplotlib is not installed" in out) != HAS_MATPLOTLIB


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A Seq2Seq (dates) and a GPT (charlm) trained for 3 steps through 'npformer train'."""
    d = tmp_path_factory.mktemp("ck")
    common = ["--steps", "3", "--warmup", "1", "--d-model", "8", "--heads", "2", "--ff", "8", "--eval-every", "0"]
    assert main(["train", "--task", "dates", *common, "--layers", "1", "--n-train", "32", "--batch-size", "4",
                 "--checkpoint", str(d / "dates.npz")]) == 0
    assert main(["train", "--task", "charlm", *common, "--layers", "2", "--batch-size", "2", "--block-size", "16",
                 "--checkpoint", str(d / "gpt.npz")]) == 0
    return d


def test_trained_seq2seq_checkpoint(checkpoints, tmp_path, capsys):
    capsys.readouterr()
    assert main(["study", "attention", "--checkpoint", str(checkpoints / "dates.npz"), "--input", "4 July 1976",
                 "--target", "1976-07-04", "--out", str(tmp_path)]) == 0
    data = json.load(open(tmp_path / "attention.json"))
    assert data["checkpoint"].endswith("dates.npz") and data["input"] == "4 July 1976"
    assert set(_check_maps(data, layers=1, heads=2)) == {"encoder_self", "decoder_self", "decoder_cross"}
    # without --target the decoder reads the model's own greedy output
    assert main(["study", "attention", "--checkpoint", str(checkpoints / "dates.npz"), "--out", str(tmp_path)]) == 0
    data = json.load(open(tmp_path / "attention.json"))
    assert data["target_tokens"] == ["<bos>", *data["target"]]


def test_trained_gpt_checkpoint(checkpoints, tmp_path):
    assert main(["study", "attention", "--checkpoint", str(checkpoints / "gpt.npz"), "--input", "The sea",
                 "--out", str(tmp_path)]) == 0
    data = json.load(open(tmp_path / "attention.json"))
    assert data["model"] == "gpt" and data["tokens"] == ["T", "h", "e", "␣", "s", "e", "a"]
    assert set(_check_maps(data, layers=2, heads=2)) == {"self"}
    assert (tmp_path / "attention_self.png").exists() == HAS_MATPLOTLIB


def test_recording_leaves_outputs_and_modules_unchanged():
    cfg = Seq2SeqConfig(src_vocab_size=9, tgt_vocab_size=9, d_model=8, nhead=2, dim_feedforward=8,
                        num_encoder_layers=1, num_decoder_layers=1, max_len=16, dropout=0.0)
    model = Seq2Seq(cfg, dtype="float64", rng=0)
    src = np.array([[4, 5, 6, 7], [0, 0, 0, 0]])                   # the second source is all padding
    tgt = np.array([[1, 4, 5], [1, 6, 0]])
    with eval_mode(model):
        plain = model(src, tgt)
        with record_attention(model) as rec:
            recorded = model(src, tgt)
        with pytest.raises(RuntimeError), record_attention(model):
            raise RuntimeError("inside the block")
    np.testing.assert_array_equal(plain, recorded)
    assert all("forward" not in vars(m) for m in model.modules() if isinstance(m, MultiheadAttention))
    names = [n for n, _ in rec]
    assert names == ["transformer.encoder.layers.0.self_attn", "transformer.decoder.layers.0.self_attn",
                     "transformer.decoder.layers.0.multihead_attn"]
    enc, dec_self, cross = (w for _, w in rec)
    assert enc.shape == (2, 2, 4, 4) and cross.shape == (2, 2, 3, 4)
    np.testing.assert_allclose(enc[0].sum(-1), 1.0, rtol=1e-12)
    assert (enc[1] == 0).all() and (cross[1] == 0).all()            # every key masked: rows of 0
    np.testing.assert_allclose(dec_self[1, :, :, :2].sum(-1), 1.0, rtol=1e-12)   # padding key gets 0
    assert (dec_self[1, :, :, 2] == 0).all()


def test_head_summaries_entropy():
    w = np.zeros((1, 3, 4))
    w[0, 0] = 0.25                                                  # uniform over 4 keys: 2 bits
    w[0, 1, 2] = 1.0                                                # one key: 0 bits
    maps = [{"group": "self", "layer": 0, "queries": list("abc"), "keys": list("wxyz"), "weights": w}]
    rows = head_summaries(maps)
    assert len(rows) == 2                                           # the all-zero row is skipped
    assert math.isclose(rows[0]["entropy_bits"], 2.0) and math.isclose(rows[0]["uniform_bits"], 2.0)
    assert rows[1]["entropy_bits"] == 0.0 and rows[1]["top_key_token"] == "y" and rows[1]["top_weight"] == 1.0


def test_errors(tmp_path, capsys, checkpoints):
    def err(argv):
        assert main(["study", "attention", *argv, "--out", str(tmp_path)]) == 2
        return capsys.readouterr().err

    assert "does not exist" in err(["--checkpoint", str(tmp_path / "missing.npz")])
    (tmp_path / "notes.npz").write_text("not a checkpoint")
    assert "not an npformer checkpoint" in err(["--checkpoint", str(tmp_path / "notes.npz")])
    save_checkpoint(tmp_path / "xl.npz", {"w": np.zeros(2)},
                    {"kind": "transformer-xl", "step": 0, "train_config": {}, "model_config": {}})
    assert "attention maps need a checkpoint of seq2seq, gpt, gpt1, gpt2, bert, albert" in \
        err(["--checkpoint", str(tmp_path / "xl.npz")])
    save_checkpoint(tmp_path / "bert.npz", {"w": np.zeros(2)},
                    {"kind": "bert", "step": 0, "train_config": {}, "model_config": {"hidden": 3}})
    assert "has fields ['hidden'] that BERTConfig does not know and lacks ['vocab_size']" in \
        err(["--checkpoint", str(tmp_path / "bert.npz")])
    msg = err([*TINY, "--input", "3 März 1997"])
    assert "'ä' are not in the model's vocabulary" in msg
    assert "not in the model's vocabulary" in err(["--checkpoint", str(checkpoints / "dates.npz"),
                                                   "--input", "4 July 1976", "--target", "1976/07/04"])
    assert "--target is for Seq2Seq" in err(["--checkpoint", str(checkpoints / "gpt.npz"), "--target", "x"])
    assert "block_size=16" in err(["--checkpoint", str(checkpoints / "gpt.npz"), "--input", "The " * 5])
    assert "non-empty" in err([*TINY, "--input", ""])
    msg = err([*TINY, "--block-size", "1", "--input", "3"])     # was: "max_len: expected an int >= 1, got 0"
    assert "the model's max_len is 1, which leaves the decoder no position after <bos> to write its output in: " \
           "give --target TEXT, or a model with max_len >= 2 (--block-size 2 or more for a fresh one)" in msg
    assert "max_len: expected" not in msg
