"""GPT-2 checkpoints in the Hugging Face layout (``GPT2LMHeadModel.save_pretrained``: ``config.json``
and ``model.safetensors``) loaded into npformer's :class:`~npformer.models.gpt.GPT`, and GPT weights
renamed back to that layout.

GPT-2 is npformer's GPT with ``norm_first=True``: pre-norm blocks, causal self-attention scaled by
1/sqrt(hs), GELU (HF ``gelu_new`` is the tanh approximation), a final layer norm, and the output head
tied to the token embedding. Hugging Face keeps GPT-2's projections as ``Conv1D`` modules,
``y = x W + b`` with W stored (in, out): the transpose of ``torch.nn.Linear``'s (out, in) that
npformer uses, so each Conv1D weight is transposed on the way in and on the way out::

    Hugging Face (``transformer.`` prefix or none)  npformer GPT                            weight
    wte.weight (V, C), wpe.weight (P, C)            wte.weight, wpe.weight
    h.i.ln_1.weight/bias (C,)                       layers.i.norm1.weight/bias
    h.i.attn.c_attn.weight (C, 3C), bias (3C,)      layers.i.self_attn.in_proj_weight/bias  W^T
    h.i.attn.c_proj.weight (C, C), bias (C,)        layers.i.self_attn.out_proj.weight/bias W^T
    h.i.ln_2.weight/bias (C,)                       layers.i.norm2.weight/bias
    h.i.mlp.c_fc.weight (C, F), bias (F,)           layers.i.linear1.weight/bias            W^T
    h.i.mlp.c_proj.weight (F, C), bias (C,)         layers.i.linear2.weight/bias            W^T
    ln_f.weight/bias (C,)                           ln_f.weight/bias
    lm_head.weight (V, C)                           head.weight (= wte.weight when tied)

``c_attn``'s output columns are [query | key | value], the row order of torch's ``in_proj_weight``,
so the packed matrix needs no reordering. The causal-mask buffers ``h.i.attn.bias`` and
``h.i.attn.masked_bias`` of older checkpoints are ignored. HF's three dropout rates
(``embd_pdrop``, ``attn_pdrop``, ``resid_pdrop``) become npformer's one ``dropout`` (``resid_pdrop``);
a loaded model is in eval mode, where none applies.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np   # host side only: arrays read from files, token ids handed back
from npformer.backend import default_rng, to_device, to_numpy
from npformer.checks import non_negative_int, positive_int, probability, real
from npformer.errors import RangeError
from npformer.models.decoding import generate
from npformer.models.gpt import GPT, GPTConfig
from npformer.nn.module import StateDictError
from npformer.pretrained._files import INSTALL, check_directory, load_safetensors, read_config

__all__ = ["load_gpt2", "load_gpt2_tokenizer", "gpt2_config_from_hf", "hf_gpt2_state_dict",
           "gpt2_to_hf_state_dict", "complete", "GPT2_REQUIRED_FILES"]

GPT2_REQUIRED_FILES = ("config.json", "model.safetensors")
# Hugging Face ``activation_function`` -> npformer activation ("gelu_new", "gelu_fast" and
# "gelu_pytorch_tanh" are three spellings of the tanh approximation; "gelu" is the exact erf form).
_HF_ACT = {"gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
           "gelu": "gelu", "relu": "relu"}
# config.json names, with the generic aliases a config may use instead
_SIZES = {"vocab_size": "vocab_size", "n_embd": "hidden_size", "n_layer": "num_hidden_layers",
          "n_head": "num_attention_heads", "n_positions": "max_position_embeddings"}
# per block: HF name, npformer name, HF shape in symbols, Conv1D weight (transposed)
_BLOCK = [("ln_1.weight", "norm1.weight", ("C",), False), ("ln_1.bias", "norm1.bias", ("C",), False),
          ("attn.c_attn.weight", "self_attn.in_proj_weight", ("C", "3C"), True),
          ("attn.c_attn.bias", "self_attn.in_proj_bias", ("3C",), False),
          ("attn.c_proj.weight", "self_attn.out_proj.weight", ("C", "C"), True),
          ("attn.c_proj.bias", "self_attn.out_proj.bias", ("C",), False),
          ("ln_2.weight", "norm2.weight", ("C",), False), ("ln_2.bias", "norm2.bias", ("C",), False),
          ("mlp.c_fc.weight", "linear1.weight", ("C", "F"), True), ("mlp.c_fc.bias", "linear1.bias", ("F",), False),
          ("mlp.c_proj.weight", "linear2.weight", ("F", "C"), True),
          ("mlp.c_proj.bias", "linear2.bias", ("C",), False)]
_BUFFER = re.compile(r"^h\.\d+\.attn\.(bias|masked_bias)$")   # causal-mask buffers of older checkpoints


def gpt2_config_from_hf(cfg: dict) -> GPTConfig:
    """A :class:`GPTConfig` (pre-norm, biases, GPT-2's eps and activation) from a Hugging Face GPT-2
    ``config.json`` dictionary. Variants npformer does not implement are refused, naming the field."""
    if cfg.get("model_type", "gpt2") != "gpt2":
        raise ValueError(f"config.json: expected model_type 'gpt2', got {cfg['model_type']!r}")
    size = {ours: cfg.get(ours, cfg.get(alias)) for ours, alias in _SIZES.items()}
    absent = [k for k, v in size.items() if v is None]
    if absent:
        raise ValueError(f"config.json: expected the GPT-2 fields {list(_SIZES)}, missing {absent}")
    act = cfg.get("activation_function", "gelu_new")
    if act not in _HF_ACT:
        raise ValueError(f"config.json: activation_function must be one of {sorted(_HF_ACT)}, got {act!r}")
    for field, want in [("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                        ("add_cross_attention", False)]:
        if bool(cfg.get(field, want)) != want:
            raise ValueError(f"config.json: npformer's GPT needs {field}={str(want).lower()}, got "
                             f"{cfg[field]!r}")
    c, h = int(size["n_embd"]), int(size["n_head"])
    if h < 1 or c % h:
        raise ValueError(f"config.json: n_embd={c} must be a multiple of n_head={h}")
    return GPTConfig(vocab_size=int(size["vocab_size"]), block_size=int(size["n_positions"]),
                     n_layer=int(size["n_layer"]), n_head=h, d_model=c,
                     dim_feedforward=int(cfg.get("n_inner") or 4 * c), dropout=float(cfg.get("resid_pdrop", 0.1)),
                     activation=_HF_ACT[act], norm_first=True,
                     layer_norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)), bias=True,
                     tie_embeddings=bool(cfg.get("tie_word_embeddings", True)))


def _plan(config: GPTConfig) -> dict[str, tuple[str, tuple[int, ...], bool]]:
    """npformer name -> (HF name without prefix, HF shape, transposed)."""
    c, v, p = config.d_model, config.vocab_size, config.block_size
    dims = {"C": c, "3C": 3 * c, "F": config.dim_feedforward or 4 * c}
    plan = {"wte.weight": ("wte.weight", (v, c), False), "wpe.weight": ("wpe.weight", (p, c), False)}
    for i in range(config.n_layer):
        for hf, ours, shape, conv in _BLOCK:
            plan[f"layers.{i}.{ours}"] = (f"h.{i}.{hf}", tuple(dims[s] for s in shape), conv)
    plan["ln_f.weight"], plan["ln_f.bias"] = ("ln_f.weight", (c,), False), ("ln_f.bias", (c,), False)
    if not config.tie_embeddings:
        plan["head.weight"] = ("lm_head.weight", (v, c), False)
    return plan


def hf_gpt2_state_dict(tensors: dict, config: GPTConfig) -> dict:
    """Rename (and transpose) a Hugging Face GPT-2 state to npformer's GPT names. Raises
    :class:`StateDictError` naming, at once, every missing HF tensor, every unexpected one and every
    tensor whose shape does not fit ``config`` (in HF names and HF's (in, out) Conv1D layout)."""
    src, twice = {}, []
    for k, val in tensors.items():
        name = k[len("transformer."):] if k.startswith("transformer.") else k
        if name in src:
            twice.append(name)
        src[name] = val
    plan = _plan(config)
    used = {hf for hf, _, _ in plan.values()}
    missing = sorted(hf for hf in used if hf not in src)
    ignored = [k for k in src if _BUFFER.match(k)] + (["lm_head.weight"] if config.tie_embeddings else [])
    unexpected = sorted(k for k in src if k not in used and k not in ignored)
    bad = [f"{hf}: expected shape {shape}, got {tuple(np.shape(src[hf]))}"
           for hf, shape, _ in plan.values() if hf in src and tuple(np.shape(src[hf])) != shape]
    if config.tie_embeddings and "lm_head.weight" in src and "wte.weight" in src and not bad \
            and not np.array_equal(src["lm_head.weight"], src["wte.weight"]):
        bad.append("lm_head.weight: differs from wte.weight, but config.json ties them "
                   "(tie_word_embeddings is true)")
    if twice:
        bad.append(f"given both with and without the 'transformer.' prefix: {sorted(twice)}")
    if missing or unexpected or bad:
        sizes = (f"n_embd={config.d_model}, n_layer={config.n_layer}, n_inner={config.dim_feedforward}, "
                 f"n_positions={config.block_size}, vocab_size={config.vocab_size}")
        raise StateDictError(f"the Hugging Face GPT-2 weights do not fit config.json ({sizes}): "
                             + "; ".join(([f"missing tensors: {missing}"] if missing else [])
                                         + ([f"unexpected tensors: {unexpected}"] if unexpected else [])
                                         + ([f"mismatched tensors: {bad}"] if bad else [])))
    out = {ours: np.ascontiguousarray(np.asarray(src[hf]).T if conv else np.asarray(src[hf]))
           for ours, (hf, _, conv) in plan.items()}
    if config.tie_embeddings:
        out["head.weight"] = out["wte.weight"]          # one Parameter, listed under both names
    return out


def gpt2_to_hf_state_dict(state: dict, config: GPTConfig, prefix: str = "transformer.") -> dict:
    """npformer GPT arrays (a ``state_dict``, or gradients by the same names) -> Hugging Face
    ``GPT2LMHeadModel`` names and layouts, as host NumPy arrays (``lm_head.weight`` included)."""
    if not config.norm_first or not config.bias:
        raise ValueError("GPT-2's layout has pre-norm blocks with biases: the config needs norm_first=True "
                         f"and bias=True, got norm_first={config.norm_first}, bias={config.bias}")
    out = {}
    for ours, (hf, _, conv) in _plan(config).items():
        a = to_numpy(state[ours])
        out[("" if hf == "lm_head.weight" else prefix) + hf] = np.ascontiguousarray(a.T if conv else a)
    if config.tie_embeddings:
        out["lm_head.weight"] = out[prefix + "wte.weight"]
    return out


def load_gpt2(path, *, dtype="float32", backend=None) -> GPT:
    """Load a local Hugging Face GPT-2 directory into a :class:`GPT` in eval mode."""
    root = check_directory(path, GPT2_REQUIRED_FILES)
    config = gpt2_config_from_hf(read_config(root))
    state = hf_gpt2_state_dict(load_safetensors(root), config)
    model = GPT(config, dtype=dtype, backend=backend, rng=0)
    return model.load_state_dict(state, strict=True).eval()


def load_gpt2_tokenizer(path):
    """The ``tokenizers.Tokenizer`` of a model directory (its ``tokenizer.json``)."""
    file = Path(path) / "tokenizer.json"            # a missing file is named before a missing package
    if not file.is_file():
        raise FileNotFoundError(f"model directory {str(path)!r} has no tokenizer.json (needed to turn the "
                                "prompt into token ids and back)")
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise ImportError(f"tokenizing needs the tokenizers package: {INSTALL}") from exc
    return Tokenizer.from_file(str(file))


def complete(model: GPT, tokenizer, prompt: str, n: int, *, seed: int = 0, temperature: float = 0.8,
             top_k: int | None = None, top_p: float | None = 0.95) -> tuple[list[int], str]:
    """``prompt`` continued by ``n`` sampled tokens: (the new token ids, the decoded new text).
    ``temperature=0`` is greedy decoding."""
    non_negative_int(n, "n (the number of tokens to sample)")
    non_negative_int(seed, "seed")
    real(temperature, "temperature", 0)
    if top_k is not None:
        positive_int(top_k, "top_k")
    if top_p is not None and probability(top_p, "top_p") == 0:
        raise RangeError("top_p: expected a probability mass in (0, 1], got 0")
    ids = tokenizer.encode(prompt).ids
    if not ids:
        raise RangeError(f"the prompt {prompt!r} encodes to no tokens; give a non-empty prompt")
    backend = model.backend
    out = generate(model, to_device(np.array([ids], dtype=np.int64), backend), n,
                   default_rng(seed, backend), temperature=temperature, top_k=top_k, top_p=top_p)
    new = to_numpy(out)[0, len(ids):].tolist()
    return new, tokenizer.decode(new)
