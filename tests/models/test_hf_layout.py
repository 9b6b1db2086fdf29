"""``save_pretrained``/``from_pretrained`` on GPT and BERT: the Hugging Face directory round-trips
exactly through npformer, loads into transformers' model of that layout (GPT2LMHeadModel for pre-norm,
OpenAIGPTLMHeadModel for post-norm, BertForMaskedLM/BertModel) with the same logits in float64, and
a config no Hugging Face model computes exactly is refused, saying why."""
import json
from dataclasses import replace

import numpy as np
import pytest

from npformer.errors import InputTypeError, RangeError, StateDictError
from npformer.models import BERT, GPT, BERTConfig, GPTConfig
from npformer.models.hf_gpt import config_fields_from_hf, hf_model_type

ATOL64 = 1e-9
GPTS = [  # (norm_first, activation, tie_embeddings, dim_feedforward) -> the HF class
    ((True, "gelu_tanh", True, None), "GPT2LMHeadModel"), ((True, "gelu", False, 20), "GPT2LMHeadModel"),
    ((True, "relu", True, 12), "GPT2LMHeadModel"), ((False, "gelu_tanh", True, 32), "OpenAIGPTLMHeadModel"),
    ((False, "relu", False, None), "OpenAIGPTLMHeadModel")]


def _perturbed(model, seed):
    """Every parameter moved off its initial value (zero biases, unit gains), so each tensor matters."""
    rng = np.random.default_rng(seed)
    for p in model.parameters():
        p.data = p.data + 0.3 * rng.standard_normal(p.shape)
    return model.eval()


def _gpt(norm_first, activation, tie, ff, seed=0):
    cfg = GPTConfig(vocab_size=13, block_size=10, n_layer=2, n_head=2, d_model=8, dim_feedforward=ff,
                    activation=activation, norm_first=norm_first, tie_embeddings=tie, layer_norm_eps=1e-3)
    return _perturbed(GPT(cfg, dtype="float64", rng=seed), seed)


def _bert(mlm_head, activation="gelu_tanh", seed=0):
    cfg = BERTConfig(vocab_size=15, hidden_size=8, num_hidden_layers=2, num_attention_heads=2, intermediate_size=12,
                     max_position_embeddings=12, activation=activation, mlm_head=mlm_head)
    return _perturbed(BERT(cfg, dtype="float64", rng=seed), seed)


IDS = np.array([[1, 5, 7, 2, 12, 3], [4, 4, 9, 11, 6, 8]])


@pytest.mark.parametrize("spec, _", GPTS)
def test_gpt_round_trip_is_exact(tmp_path, spec, _):
    ours = _gpt(*spec)
    ours.save_pretrained(tmp_path)
    back = GPT.from_pretrained(tmp_path, dtype="float64")
    # the same config, written out (F = 4 C); the init-only scaled_residual_init follows the layout
    assert back.config == replace(ours.config, dim_feedforward=ours.config.dim_feedforward or 32,
                                  scaled_residual_init=ours.config.norm_first)
    assert not back.training
    np.testing.assert_array_equal(back(IDS), ours(IDS))
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["dtype"] == "float64" and cfg["model_type"] == hf_model_type(ours.config)


@pytest.mark.parametrize("mlm_head", [True, False])
def test_bert_round_trip_is_exact(tmp_path, mlm_head):
    ours = _bert(mlm_head)
    ours.save_pretrained(tmp_path)
    back = BERT.from_pretrained(tmp_path, dtype="float64")
    assert back.config == ours.config
    h, pooled = ours(IDS)
    h2, pooled2 = back(IDS)
    np.testing.assert_array_equal(h2, h)
    if mlm_head:             # BertForMaskedLM has no pooler: written without one, read back as zeros
        np.testing.assert_array_equal(back.mlm_logits(h2), ours.mlm_logits(h))
        assert not back.pooler.dense.weight.data.any()
    else:
        np.testing.assert_array_equal(pooled2, pooled)


def test_gpt_configs_without_a_match_are_refused(tmp_path):
    cases = [(dict(norm_first=False, activation="gelu"), "activation 'gelu' .*its 'gelu' is the tanh approximation"),
             (dict(norm_first=False, dim_feedforward=12), r"dim_feedforward 12 \(openai-gpt's is 4 \* n_embd = 32"),
             (dict(bias=False), "bias=False")]
    for change, match in cases:
        model = GPT(GPTConfig(vocab_size=5, n_layer=1, d_model=8, n_head=2, **change), rng=0)
        with pytest.raises(RangeError, match="no exact Hugging Face counterpart: " + match):
            model.save_pretrained(tmp_path / "refused")
        assert not (tmp_path / "refused").exists()       # refused before anything is written



def test_config_json_fields_are_checked_strictly(tmp_path):
    # Found by fuzzing: n_embd 8.9 became 8 by int(), tie_word_embeddings "false" became True by bool(),
    # and "x" or null raised a bare ValueError or TypeError naming neither the file nor the field
    good = {"model_type": "gpt2", "vocab_size": 7, "n_embd": 8, "n_layer": 1, "n_head": 2, "n_positions": 5}
    assert config_fields_from_hf({**good, "tie_word_embeddings": False})["tie_embeddings"] is False
    assert config_fields_from_hf({**good, "n_inner": None})["dim_feedforward"] == 32
    for change, error, message in [
            ({"n_embd": 8.9}, InputTypeError, "n_embd: expected an int, got float 8.9"),
            ({"n_embd": "x"}, InputTypeError, "n_embd: expected an int, got str 'x'"),
            ({"n_head": True}, InputTypeError, "n_head: expected an int, got bool True"),
            ({"n_head": 0}, RangeError, "n_head: expected an int >= 1, got 0"),
            ({"tie_word_embeddings": "false"}, InputTypeError, "tie_word_embeddings: expected true or false, got str"),
            ({"scale_attn_weights": 1}, InputTypeError, "scale_attn_weights: expected true or false, got int 1"),
            ({"layer_norm_epsilon": None}, InputTypeError, "layer_norm_epsilon: expected a real number, got None"),
            ({"layer_norm_epsilon": -1}, RangeError, "layer_norm_epsilon: expected a finite number > 0, got -1"),
            ({"resid_pdrop": 2}, RangeError, r"resid_pdrop: expected a probability in \[0, 1\], got 2"),
            ({"n_inner": 2.5}, InputTypeError, "n_inner: expected an int, got float 2.5"),
            ({"model_type": "bert"}, RangeError, "expected model_type 'gpt2' or 'openai-gpt', got 'bert'"),
            ({"n_embd": None}, RangeError, r"expected the gpt2 fields .*, missing \['n_embd'\]")]:
        with pytest.raises(error, match="config.json: " + message):
            config_fields_from_hf({**good, **change})
    _gpt(True, "gelu_tanh", True, None).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "n_embd": 8.9}))
    with pytest.raises(InputTypeError, match="config.json: n_embd: expected an int, got float 8.9"):
        GPT.from_pretrained(tmp_path)

def test_from_pretrained_names_what_is_wrong(tmp_path):
    _bert(False).save_pretrained(tmp_path)
    with pytest.raises(StateDictError, match="holds no masked-LM head"):
        BERT.from_pretrained(tmp_path, mlm_head=True)
    with pytest.raises(ValueError, match="expected model_type 'gpt2' or 'openai-gpt', got 'bert'"):
        GPT.from_pretrained(tmp_path)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="is missing model.safetensors"):
        GPT.from_pretrained(tmp_path / "empty")


# -- transformers reads what npformer writes -------------------------------------------------------

@pytest.fixture(scope="module")
def hf():
    torch = pytest.importorskip("torch", reason="torch not installed: the transformers comparison needs it")
    transformers = pytest.importorskip("transformers", reason="transformers not installed (pip install transformers)")
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    return torch, transformers


@pytest.mark.torch
@pytest.mark.parametrize("spec, cls", GPTS)
def test_transformers_loads_the_gpt_with_the_same_logits(tmp_path, hf, spec, cls):
    torch, transformers = hf
    ours = _gpt(*spec, seed=3)
    ours.save_pretrained(tmp_path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float64).eval()
    assert type(theirs).__name__ == cls
    with torch.no_grad():
        logits = theirs(torch.tensor(IDS)).logits.numpy()
    np.testing.assert_allclose(ours(IDS), logits, rtol=0, atol=ATOL64)


@pytest.mark.torch
@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu"])
def test_transformers_loads_the_bert_with_the_same_logits(tmp_path, hf, activation):
    torch, transformers = hf
    ours = _bert(True, activation, seed=4)
    ours.save_pretrained(tmp_path / "mlm")
    theirs = transformers.AutoModelForMaskedLM.from_pretrained(str(tmp_path / "mlm"), dtype=torch.float64).eval()
    assert type(theirs).__name__ == "BertForMaskedLM"
    keep = np.ones_like(IDS)
    with torch.no_grad():
        logits = theirs(torch.tensor(IDS), attention_mask=torch.tensor(keep)).logits.numpy()
    h, _ = ours(IDS, key_padding_mask=keep == 0)
    np.testing.assert_allclose(ours.mlm_logits(h), logits, rtol=0, atol=ATOL64)

    plain = _bert(False, activation, seed=5)
    plain.save_pretrained(tmp_path / "plain")
    theirs = transformers.AutoModel.from_pretrained(str(tmp_path / "plain"), dtype=torch.float64).eval()
    with torch.no_grad():
        out = theirs(torch.tensor(IDS), attention_mask=torch.tensor(keep))
    h, pooled = plain(IDS, key_padding_mask=keep == 0)
    np.testing.assert_allclose(h, out.last_hidden_state.numpy(), rtol=0, atol=ATOL64)
    np.testing.assert_allclose(pooled, out.pooler_output.numpy(), rtol=0, atol=ATOL64)


@pytest.mark.torch
def test_a_transformers_bert_for_masked_lm_loads_with_its_head(tmp_path, hf):
    """The other way: BertForMaskedLM saved by transformers (decoder tied, cls.predictions.bias) into
    npformer's BERT with its masked-LM head; fill_mask ranks as transformers' softmax does."""
    torch, transformers = hf
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=15, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=12, max_position_embeddings=12)
    theirs = transformers.BertForMaskedLM(cfg).double().eval()
    theirs.save_pretrained(str(tmp_path))
    ours = BERT.from_pretrained(tmp_path, dtype="float64")
    assert ours.config.mlm_head and ours.mlm.decoder.weight is ours.embeddings.word_embeddings.weight
    with torch.no_grad():
        ref = theirs(torch.tensor(IDS), attention_mask=torch.ones(IDS.shape, dtype=torch.long)).logits.numpy()
    h, _ = ours(IDS, key_padding_mask=np.zeros(IDS.shape, bool))
    np.testing.assert_allclose(ours.mlm_logits(h), ref, rtol=0, atol=ATOL64)
    masked = IDS.copy()
    masked[1, 2] = 10                                           # the mask id (nowhere else in IDS)
    fills = ours.fill_mask(masked, 10, top_k=4, exclude=[0, 10])
    with torch.no_grad():
        p = torch.softmax(theirs(torch.tensor(masked)).logits[1, 2].index_fill(0, torch.tensor([0, 10]),
                                                                               -float("inf")), -1).numpy()
    assert [(f.row, f.position) for f in fills] == [(1, 2)]
    np.testing.assert_array_equal(fills[0].ids, np.argsort(-p)[:4])
    np.testing.assert_allclose(fills[0].probs, np.sort(p)[::-1][:4], rtol=1e-9)


def test_bert_config_json_is_refused_with_npformers_errors():
    """A BERT config.json npformer cannot build is a RangeError naming config.json (a plain ValueError
    before); its sizes' types and ranges are BERTConfig's checks, an npformer error each."""
    from npformer.models.hf_bert import config_fields_from_hf as bert_fields
    good = dict(vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16)
    assert BERTConfig(**bert_fields(good)).hidden_size == 8
    for change, message in (({"hidden_act": "swish"}, "config.json: hidden_act must be one of"),
                            ({"position_embedding_type": "relative_key"}, "only position_embedding_type"),
                            ({"hidden_size": None}, r"missing \['hidden_size'\]")):
        cfg = {k: v for k, v in {**good, **change}.items() if v is not None}
        with pytest.raises(RangeError, match=message):
            bert_fields(cfg)
    for change, error in (({"hidden_size": 8.9}, InputTypeError), ({"layer_norm_eps": None}, InputTypeError),
                          ({"pad_token_id": 99}, RangeError)):
        with pytest.raises(error):
            BERTConfig(**bert_fields({**good, **change}))
