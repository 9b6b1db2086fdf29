"""GPT-2 in the Hugging Face layout: transformers' GPT2LMHeadModel built from small random configs
(hypothesis chooses the sizes, the activation, eps and tying), saved locally with safetensors (no
download), loaded into npformer's GPT. Logits match in float32 (max abs diff < 1e-5 of the largest
logit) and float64 (< 1e-9), every parameter gradient in float64; greedy generation with the key/value
cache matches transformers' ``generate``; broken directories name what is wrong."""
import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, strategies as st

for _mod, _why in [("safetensors", "pip install safetensors (transformers installs it): the files' cross-check"),
                   ("tokenizers", 'pip install "npformer[pretrained]"'),
                   ("torch", "pip install torch==2.13.0"), ("transformers", "pip install transformers")]:
    pytest.importorskip(_mod, reason=f"{_mod} not installed: the GPT-2 parity tests need it ({_why})")

import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from npformer.backend import to_numpy  # noqa: E402
from npformer.cli import main  # noqa: E402
from npformer.data.corpus import load_corpus  # noqa: E402
from npformer.nn.module import StateDictError  # noqa: E402
from npformer.pretrained import (GPT2_REQUIRED_FILES, complete, gpt2_config_from_hf,  # noqa: E402
                                 gpt2_to_hf_state_dict, load_gpt2, load_gpt2_tokenizer)
from tests.helpers import seeds  # noqa: E402

pytestmark = pytest.mark.torch
transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()
ATOL64, RTOL32 = 1e-9, 1e-5


def hf_gpt2(seed=0, **cfg):
    """A GPT2LMHeadModel with every parameter drawn at random (not HF's small init, so that every
    tensor matters): N(0, 0.3^2) weights and biases, layer-norm gains 1 + N(0, 0.3^2)."""
    base = dict(vocab_size=23, n_positions=8, n_embd=8, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0,
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**base, **cfg}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            gain = name.endswith("weight") and ".ln_" in name
            p.copy_(torch.randn(p.shape, dtype=p.dtype) * 0.3 + (1.0 if gain else 0.0))
    return model.eval()


def save(model, path):
    model.save_pretrained(str(path), safe_serialization=True)
    return Path(path)


def hf_logits(model, ids, dtype, attention_mask=None):
    model = model.to(dtype)
    with torch.no_grad():
        return model(torch.tensor(ids), attention_mask=attention_mask).logits.numpy()


gpt2_configs = st.fixed_dictionaries({
    "dims": st.sampled_from([(8, 1), (8, 2), (12, 3), (16, 4), (24, 2)]),
    "n_layer": st.integers(1, 3), "n_positions": st.integers(3, 12), "vocab_size": st.integers(5, 40),
    "n_inner": st.one_of(st.none(), st.integers(4, 40)),
    "activation_function": st.sampled_from(["gelu_new", "gelu", "relu", "gelu_pytorch_tanh"]),
    "layer_norm_epsilon": st.sampled_from([1e-5, 1e-3]), "tie_word_embeddings": st.booleans()})


def _hf_config(c):
    (n_embd, n_head), rest = c["dims"], {k: v for k, v in c.items() if k != "dims"}
    return dict(n_embd=n_embd, n_head=n_head, **rest)


@given(cfg=gpt2_configs, b=st.integers(1, 3), data=st.data(), seed=seeds)
def test_logits_match_transformers_float32_and_float64(cfg, b, data, seed):
    t = data.draw(st.integers(1, cfg["n_positions"]))
    theirs = hf_gpt2(seed, **_hf_config(cfg))
    ids = np.random.default_rng(seed).integers(0, cfg["vocab_size"], (b, t))
    with tempfile.TemporaryDirectory() as d:
        path = save(theirs, d)
        ours32, ours64 = load_gpt2(path), load_gpt2(path, dtype="float64")
    assert ours32.config.tie_embeddings == cfg["tie_word_embeddings"] and not ours32.training
    ref32 = hf_logits(theirs, ids, torch.float32)
    got32 = ours32(ids)
    assert got32.dtype == np.float32 and got32.shape == (b, t, cfg["vocab_size"])
    assert np.abs(got32 - ref32).max() <= RTOL32 * np.abs(ref32).max(), np.abs(got32 - ref32).max()
    np.testing.assert_allclose(ours64(ids), hf_logits(theirs, ids, torch.float64), rtol=0, atol=ATOL64)


@given(cfg=gpt2_configs, seed=seeds)
def test_every_parameter_gradient_matches_transformers(cfg, seed):
    """float64: the same upstream gradient dlogits through npformer's hand-written backward and
    through torch's autograd; each npformer gradient, renamed and transposed to HF's layout
    (``gpt2_to_hf_state_dict``), equals HF's (the tied wte gets both of its uses)."""
    theirs = hf_gpt2(seed, **_hf_config(cfg)).double()
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, cfg["vocab_size"], (2, cfg["n_positions"]))
    with tempfile.TemporaryDirectory() as d:
        ours = load_gpt2(save(theirs, d), dtype="float64")
    dlogits = rng.standard_normal((2, cfg["n_positions"], cfg["vocab_size"]))
    ours(ids)
    ours.backward(dlogits)
    theirs(torch.tensor(ids)).logits.backward(torch.tensor(dlogits))
    grads = gpt2_to_hf_state_dict({n: p.grad for n, p in ours.named_parameters(remove_duplicate=False)},
                                  ours.config)
    named = dict(theirs.named_parameters())
    assert set(named) <= set(grads)
    for name, p in named.items():
        np.testing.assert_allclose(grads[name], p.grad.numpy(), rtol=0, atol=ATOL64, err_msg=name)


def test_right_padding_needs_no_mask():
    """npformer's GPT takes no padding mask: causal attention never lets a real token see the padding
    after it, so HF's logits with an ``attention_mask`` over a right-padded batch equal npformer's
    unmasked logits at every real position (left padding would need one and is not supported)."""
    theirs = hf_gpt2(3, n_positions=10)
    ids = np.random.default_rng(3).integers(1, 23, (3, 10))
    lengths = [10, 4, 1]
    keep = np.array([[1] * n + [0] * (10 - n) for n in lengths])
    ids[keep == 0] = 0                                          # the pad id
    with tempfile.TemporaryDirectory() as d:
        ours = load_gpt2(save(theirs, d), dtype="float64")
    ref = hf_logits(theirs, ids, torch.float64, attention_mask=torch.tensor(keep))
    got = ours(ids)
    for row, n in enumerate(lengths):
        np.testing.assert_allclose(got[row, :n], ref[row, :n], rtol=0, atol=ATOL64)
        np.testing.assert_allclose(got[row, :n], ours(ids[row:row + 1, :n])[0], rtol=0, atol=1e-12)


def test_prefixless_sharded_checkpoint_with_mask_buffers(tmp_path):
    """The layout of the original GPT-2 files: no ``transformer.`` prefix, ``h.i.attn.bias`` causal
    masks stored as buffers (ignored), and a checkpoint split into shards with an index."""
    theirs = hf_gpt2(1)
    state = load_file(str(save(theirs, tmp_path / "hf") / "model.safetensors"))
    plain = {k.removeprefix("transformer."): v for k, v in state.items()}
    plain.update({f"h.{i}.attn.bias": np.tril(np.ones((1, 1, 8, 8), np.float32)) for i in range(2)})
    plain["h.0.attn.masked_bias"] = np.array(-1e4, np.float32)
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    save_file(plain, str(tmp_path / "plain" / "model.safetensors"))
    theirs.save_pretrained(str(tmp_path / "sharded"), safe_serialization=True, max_shard_size="2KB")
    assert not (tmp_path / "sharded" / "model.safetensors").exists()
    ids = np.arange(16).reshape(2, 8) % 23
    ref = load_gpt2(tmp_path / "hf", dtype="float64")(ids)
    np.testing.assert_array_equal(load_gpt2(tmp_path / "plain", dtype="float64")(ids), ref)
    np.testing.assert_array_equal(load_gpt2(tmp_path / "sharded", dtype="float64")(ids), ref)
    shards = sorted((tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    gone = f"lists shards that are not in the directory: \\['{shards[-1].name}'\\]"
    with pytest.raises(FileNotFoundError, match=gone):
        load_gpt2(tmp_path / "sharded")


def test_every_backend_matches_transformers(xp, gpt2_dir):
    """The same directory loaded on each backend (CuPy where a GPU is present): float64 logits
    against transformers, and greedy completion through the key/value cache on the device."""
    ours = load_gpt2(gpt2_dir, dtype="float64", backend=xp.__name__)
    ids = np.arange(20).reshape(2, 10) % ours.config.vocab_size
    logits = ours(xp.asarray(ids))
    assert type(logits) is xp.ndarray
    ref = hf_logits(transformers.GPT2LMHeadModel.from_pretrained(str(gpt2_dir)).eval(), ids, torch.float64)
    np.testing.assert_allclose(to_numpy(logits), ref, rtol=0, atol=ATOL64)
    tok = load_gpt2_tokenizer(gpt2_dir)
    assert complete(ours, tok, "The river", 5, temperature=0) == \
        complete(load_gpt2(gpt2_dir, dtype="float64"), tok, "The river", 5, temperature=0)


def test_export_loads_into_transformers(tmp_path):
    """npformer's weights, renamed to the HF layout, load strictly into GPT2LMHeadModel: same logits."""
    path = save(hf_gpt2(2, tie_word_embeddings=False), tmp_path)
    ours = load_gpt2(path, dtype="float64")
    for p in ours.parameters():                                # new weights, so nothing is inherited
        p.data = p.data + 0.1 * np.random.default_rng(p.data.size).standard_normal(p.shape)
    back = transformers.GPT2LMHeadModel(transformers.GPT2Config.from_pretrained(str(path))).double().eval()
    back.load_state_dict({k: torch.from_numpy(v) for k, v in
                          gpt2_to_hf_state_dict(ours.state_dict(), ours.config).items()}, strict=True)
    ids = np.arange(12).reshape(2, 6) % 23
    np.testing.assert_allclose(ours(ids), hf_logits(back, ids, torch.float64), rtol=0, atol=ATOL64)
    with pytest.raises(ValueError, match="norm_first=True and bias=True"):
        from npformer.models.gpt import GPT, GPTConfig
        post = GPT(GPTConfig(vocab_size=5, n_layer=1, d_model=4, n_head=1, norm_first=False))
        gpt2_to_hf_state_dict(post.state_dict(), post.config)


# -- generation: a byte-level BPE tokenizer trained here on npformer's corpus, and a random GPT-2 --

@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([load_corpus()], trainers.BpeTrainer(
        vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    path = tmp_path_factory.mktemp("gpt2")
    save(hf_gpt2(5, vocab_size=tok.get_vocab_size(), n_positions=32, n_embd=16, n_head=4), path)
    tok.save(str(path / "tokenizer.json"))
    return path


def test_greedy_generation_matches_transformers_generate(gpt2_dir):
    """``complete`` (the key/value cache path) picks the same tokens as HF's greedy ``generate``."""
    ours = load_gpt2(gpt2_dir, dtype="float64")
    tok = load_gpt2_tokenizer(gpt2_dir)
    prompt = "The river ran"
    ids = tok.encode(prompt).ids
    new, text = complete(ours, tok, prompt, 12, temperature=0)
    theirs = transformers.GPT2LMHeadModel.from_pretrained(str(gpt2_dir)).double().eval()
    ref = theirs.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert new == ref[0, len(ids):].tolist() and len(new) == 12
    assert text == tok.decode(new)


def test_generate_command_with_a_hf_directory(gpt2_dir, capsys):
    args = ["generate", "--model", str(gpt2_dir), "--prompt", "The river", "--tokens", "6", "--seed", "4"]
    assert main(args + ["--temperature", "0"]) == 0
    out = capsys.readouterr().out
    ours, tok = load_gpt2(gpt2_dir), load_gpt2_tokenizer(gpt2_dir)
    assert out == "The river" + complete(ours, tok, "The river", 6, temperature=0)[1] + "\n"
    assert main(args + ["--top-k", "5"]) == 0                  # sampled: the seed makes it repeatable
    sampled = capsys.readouterr().out
    assert sampled == "The river" + complete(ours, tok, "The river", 6, seed=4, temperature=0.8, top_k=5)[1] + "\n"
    (gpt2_dir / "tokenizer.json").rename(gpt2_dir / "tokenizer.bak")
    try:
        assert main(args) == 2
        assert "is missing tokenizer.json" in capsys.readouterr().err       # every missing file named
    finally:
        (gpt2_dir / "tokenizer.bak").rename(gpt2_dir / "tokenizer.json")
    assert main(["generate", "--model", str(gpt2_dir), "--prompt", ""]) == 2
    assert "encodes to no tokens" in capsys.readouterr().err
    assert main(["generate", "--model", str(gpt2_dir), "--tokens", "-1"]) == 2
    assert "--tokens: expected an int >= 0, got -1" in capsys.readouterr().err   # before the model is loaded
    with pytest.raises(ValueError, match=r"n \(the number of tokens to sample\): expected an int >= 0, got -1"):
        complete(ours, tok, "The river", -1)
    with pytest.raises(SystemExit):                           # --model and --checkpoint exclude each other
        main(["generate", "--model", str(gpt2_dir), "--checkpoint", "x.npz"])


# -- wrong or partial directories ------------------------------------------------------------------

@pytest.fixture
def tiny_dir(tmp_path):
    return save(hf_gpt2(0, n_inner=12), tmp_path)


def test_missing_files_are_listed(tiny_dir, tmp_path_factory):
    (tiny_dir / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="is missing model.safetensors"):
        load_gpt2(tiny_dir)
    empty = tmp_path_factory.mktemp("empty")
    with pytest.raises(FileNotFoundError, match=", ".join(GPT2_REQUIRED_FILES)):
        load_gpt2(empty)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_gpt2(empty / "nowhere")
    (empty / "config.json").write_text("{not json")
    (empty / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="config.json: not valid JSON"):
        load_gpt2(empty)


def test_missing_unexpected_and_mismatched_tensors_are_named(tiny_dir):
    state = load_file(str(tiny_dir / "model.safetensors"))
    del state["transformer.h.1.mlp.c_fc.weight"], state["transformer.ln_f.bias"]
    state["transformer.h.2.ln_1.weight"] = np.ones(8, np.float32)           # a third block
    state["transformer.h.0.attn.c_proj.bias"] = np.zeros(9, np.float32)
    save_file(state, str(tiny_dir / "model.safetensors"))
    with pytest.raises(StateDictError) as err:
        load_gpt2(tiny_dir)
    msg = str(err.value)
    assert "do not fit config.json (n_embd=8, n_layer=2, n_inner=12" in msg
    assert "missing tensors: ['h.1.mlp.c_fc.weight', 'ln_f.bias']" in msg
    assert "unexpected tensors: ['h.2.ln_1.weight']" in msg
    assert "h.0.attn.c_proj.bias: expected shape (8,), got (9,)" in msg


def test_config_that_does_not_fit_the_weights(tiny_dir):
    cfg = json.loads((tiny_dir / "config.json").read_text())
    (tiny_dir / "config.json").write_text(json.dumps({**cfg, "n_inner": 20}))
    with pytest.raises(StateDictError, match=r"h.0.mlp.c_fc.weight: expected shape \(8, 20\), got \(8, 12\)"):
        load_gpt2(tiny_dir)                                   # HF's (in, out) Conv1D layout in the message
    (tiny_dir / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": False}))
    with pytest.raises(StateDictError, match=r"missing tensors: \['lm_head.weight'\]"):
        load_gpt2(tiny_dir)


def test_a_tied_head_that_differs_from_wte(tiny_dir):
    state = load_file(str(tiny_dir / "model.safetensors"))
    state["lm_head.weight"] = state["transformer.wte.weight"].copy()
    save_file(state, str(tiny_dir / "model.safetensors"))
    load_gpt2(tiny_dir)                                       # an explicit copy of the tied weight is fine
    state["lm_head.weight"][0, 0] += 1
    save_file(state, str(tiny_dir / "model.safetensors"))
    with pytest.raises(StateDictError, match="lm_head.weight: differs from wte.weight"):
        load_gpt2(tiny_dir)
    state["h.0.ln_1.weight"] = state["transformer.h.0.ln_1.weight"]
    save_file(state, str(tiny_dir / "model.safetensors"))
    with pytest.raises(StateDictError, match=r"with and without the 'transformer.' prefix: \['h.0.ln_1.weight'\]"):
        load_gpt2(tiny_dir)


def test_config_errors(tiny_dir):
    good = json.loads((tiny_dir / "config.json").read_text())
    c = gpt2_config_from_hf(good)
    assert (c.d_model, c.n_head, c.n_layer, c.block_size, c.dim_feedforward, c.activation, c.norm_first) \
        == (8, 2, 2, 8, 12, "gelu_tanh", True)
    alias = {"hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 2, "max_position_embeddings": 8}
    plain = {k: v for k, v in good.items() if k not in ("n_embd", "n_head", "n_layer", "n_positions")}
    assert gpt2_config_from_hf({**plain, **alias}) == c
    assert gpt2_config_from_hf({**good, "n_inner": None}).dim_feedforward == 32
    for change, match in [({"model_type": "bert"}, "expected model_type 'gpt2', got 'bert'"),
                          ({"activation_function": "swish"}, "activation_function must be one of .* got 'swish'"),
                          ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=false"),
                          ({"scale_attn_weights": False}, "scale_attn_weights=true"),
                          ({"add_cross_attention": True}, "add_cross_attention=false"),
                          ({"n_head": 3}, "n_embd=8 must be a multiple of n_head=3")]:
        with pytest.raises(ValueError, match=match):
            gpt2_config_from_hf({**good, **change})
    with pytest.raises(ValueError, match=r"missing \['n_embd'\]"):
        gpt2_config_from_hf({k: v for k, v in good.items() if k != "n_embd"})
