"""GPT-2 checkpoints in the Hugging Face layout (``GPT2LMHeadModel.save_pretrained``: ``config.json``
and ``model.safetensors``) loaded into npformer's :class:`~npformer.models.gpt.GPT`, their tokenizer,
and sampling from them (``npformer generate --model DIR``).

GPT-2 is npformer's GPT with ``norm_first=True``: pre-norm blocks, causal self-attention scaled by
1/sqrt(hs), GELU (HF ``gelu_new`` is the tanh approximation), a final layer norm, and the output head
tied to the token embedding. The names, shapes and transposes of the two layouts are in one place,
:mod:`npformer.models.hf_gpt` (which also maps post-norm GPTs to OpenAI GPT); the model's
``GPT.from_pretrained``/``save_pretrained`` use it, and so do the functions here.
"""
from __future__ import annotations

import numpy as np   # host side only: token ids handed to and from the tokenizer
from npformer.backend import default_rng, to_device, to_numpy
from npformer.checks import non_negative_int, positive_int, probability, real
from npformer.errors import RangeError
from npformer.interop import check_directory, read_config
from npformer.models import hf_gpt
from npformer.models.decoding import generate
from npformer.models.gpt import GPT, GPTConfig
from npformer.pretrained.tokenizer import encode_known, load_tokenizer

__all__ = ["load_gpt2", "load_gpt2_tokenizer", "gpt2_config_from_hf", "hf_gpt2_state_dict",
           "gpt2_to_hf_state_dict", "complete", "GPT2_REQUIRED_FILES"]

GPT2_REQUIRED_FILES = ("config.json", "model.safetensors")


def gpt2_config_from_hf(cfg: dict) -> GPTConfig:
    """A :class:`GPTConfig` (pre-norm, biases, GPT-2's eps and activation) from a Hugging Face GPT-2
    ``config.json`` dictionary. Variants npformer does not implement are refused, naming the field."""
    if cfg.get("model_type", "gpt2") != "gpt2":
        raise RangeError(f"config.json: expected model_type 'gpt2', got {cfg['model_type']!r}")
    return GPTConfig(**hf_gpt.config_fields_from_hf(cfg))


def hf_gpt2_state_dict(tensors: dict, config: GPTConfig) -> dict:
    """Rename (and transpose) a Hugging Face GPT-2 state to npformer's GPT names
    (:func:`npformer.models.hf_gpt.state_from_hf`)."""
    return hf_gpt.state_from_hf(tensors, config)


def gpt2_to_hf_state_dict(state: dict, config: GPTConfig, prefix: str = "transformer.") -> dict:
    """npformer GPT arrays (a ``state_dict``, or gradients by the same names) -> Hugging Face
    ``GPT2LMHeadModel`` names and layouts, as host NumPy arrays (``lm_head.weight`` included)."""
    if not config.norm_first or not config.bias:
        raise ValueError("GPT-2's layout has pre-norm blocks with biases: the config needs norm_first=True "
                         f"and bias=True, got norm_first={config.norm_first}, bias={config.bias}")
    return hf_gpt.state_to_hf(state, config, prefix)


def load_gpt2(path, *, dtype="float32", backend=None) -> GPT:
    """Load a local Hugging Face GPT-2 directory into a :class:`GPT` in eval mode."""
    gpt2_config_from_hf(read_config(check_directory(path, GPT2_REQUIRED_FILES)))   # GPT-2, not OpenAI GPT
    return GPT.from_pretrained(path, dtype=dtype, backend=backend)


def load_gpt2_tokenizer(path):
    """The ``tokenizers.Tokenizer`` of a model directory (its ``tokenizer.json``), checked against the
    ``vocab_size`` of its config.json (:func:`npformer.pretrained.tokenizer.load_tokenizer`)."""
    config = read_config(check_directory(path, ("config.json",)))
    return load_tokenizer(path, gpt2_config_from_hf(config).vocab_size)


def complete(model: GPT, tokenizer, prompt: str, n: int, *, seed: int = 0, temperature: float = 0.8,
             top_k: int | None = None, top_p: float | None = 0.95) -> tuple[list[int], str]:
    """``prompt`` continued by ``n`` sampled tokens: (the new token ids, the decoded new text).
    ``temperature=0`` is greedy decoding. A part of the prompt the tokenizer can only read as its
    unknown token is an error naming it."""
    non_negative_int(n, "n (the number of tokens to sample)")
    non_negative_int(seed, "seed")
    real(temperature, "temperature", 0)
    if top_k is not None:
        positive_int(top_k, "top_k")
    if top_p is not None and probability(top_p, "top_p") == 0:
        raise RangeError("top_p: expected a probability mass in (0, 1], got 0")
    ids = encode_known(tokenizer, prompt, "the prompt").ids
    if not ids:
        raise RangeError(f"the prompt {prompt!r} encodes to no tokens; give a non-empty prompt")
    backend = model.backend
    out = generate(model, to_device(np.array([ids], dtype=np.int64), backend), n,
                   default_rng(seed, backend), temperature=temperature, top_k=top_k, top_p=top_p)
    new = to_numpy(out)[0, len(ids):].tolist()
    return new, tokenizer.decode(new)
