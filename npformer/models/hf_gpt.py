"""npformer's ``GPT`` in the two Hugging Face layouts that compute exactly what it computes, and back.

=============================  ================================  ======================================
npformer ``GPTConfig``         Hugging Face                      what has to agree
=============================  ================================  ======================================
``norm_first=True`` (GPT-2)    ``gpt2``, ``GPT2LMHeadModel``     pre-norm blocks ``x + f(LN(x))``, a
                                                                 final ``ln_f``; any feed-forward width
                                                                 (``n_inner``); GELU (tanh or erf) or ReLU
``norm_first=False`` (GPT-1)   ``openai-gpt``,                   post-norm blocks ``LN(x + f(x))``, no
                               ``OpenAIGPTLMHeadModel``          final norm; feed-forward width 4C; its
                                                                 ``afn`` "gelu" is the tanh form, so the
                                                                 erf GELU has no match
=============================  ================================  ======================================

Both: learned positions added to the token embeddings, causal self-attention scaled by 1/sqrt(hs),
biases everywhere (``bias=False`` has no match), an output head tied to the token embedding or not
(``tie_word_embeddings``). A config with no match is refused, naming what differs, rather than
written as a model that would compute something else. Hugging Face keeps the projections as
``Conv1D`` modules, ``y = x W + b`` with W stored (in, out): the transpose of the (out, in) of
``torch.nn.Linear`` that npformer uses, so each Conv1D weight is transposed both ways::

    Hugging Face (``transformer.`` prefix or none)   npformer GPT                            weight
    wte / tokens_embed.weight (V, C)                 wte.weight
    wpe / positions_embed.weight (P, C)              wpe.weight
    h.i.ln_1.weight/bias (C,)                        layers.i.norm1.weight/bias
    h.i.attn.c_attn.weight (C, 3C), bias (3C,)       layers.i.self_attn.in_proj_weight/bias  W^T
    h.i.attn.c_proj.weight (C, C), bias (C,)         layers.i.self_attn.out_proj.weight/bias W^T
    h.i.ln_2.weight/bias (C,)                        layers.i.norm2.weight/bias
    h.i.mlp.c_fc.weight (C, F), bias (F,)            layers.i.linear1.weight/bias            W^T
    h.i.mlp.c_proj.weight (F, C), bias (C,)          layers.i.linear2.weight/bias            W^T
    ln_f.weight/bias (C,)   (GPT-2 only)             ln_f.weight/bias
    lm_head.weight (V, C)                            head.weight (= wte.weight when tied)

``c_attn``'s output columns are [query | key | value], the row order of torch's ``in_proj_weight``,
so the packed matrix needs no reordering. The causal-mask buffers ``h.i.attn.bias`` and
``h.i.attn.masked_bias`` of older checkpoints are ignored. Hugging Face's three dropout rates
become npformer's one ``dropout`` (``resid_pdrop``); on the way out all three are npformer's rate.

This module works on config dictionaries and state dictionaries only (it imports no model), so
``GPT.save_pretrained``/``from_pretrained`` and :mod:`npformer.pretrained.gpt2` share it.
"""
from __future__ import annotations

import re
from typing import Any

import numpy as np   # host side only: arrays read from and written to files

from npformer.backend import to_numpy
from npformer.checks import boolean, describe, positive_int, probability, real
from npformer.errors import InputTypeError, RangeError, StateDictError

__all__ = ["MODEL_TYPES", "config_fields_from_hf", "hf_config", "hf_model_type", "state_from_hf", "state_to_hf"]

MODEL_TYPES = {"gpt2": "GPT2LMHeadModel", "openai-gpt": "OpenAIGPTLMHeadModel"}
# Hugging Face activation name -> npformer activation, per model type. GPT-2's activation_function:
# "gelu_new", "gelu_fast" and "gelu_pytorch_tanh" spell the tanh approximation, "gelu" the erf form.
# OpenAI GPT's afn: "gelu" is the tanh approximation there (gelu_new), and there is no erf form.
_FROM_HF_ACT = {"gpt2": {"gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                         "gelu": "gelu", "relu": "relu"},
                "openai-gpt": {"gelu": "gelu_tanh", "relu": "relu"}}
_TO_HF_ACT = {"gpt2": {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"},
              "openai-gpt": {"gelu_tanh": "gelu", "relu": "relu"}}
_ACT_FIELD = {"gpt2": "activation_function", "openai-gpt": "afn"}
_EMBEDDINGS = {"gpt2": ("wte", "wpe"), "openai-gpt": ("tokens_embed", "positions_embed")}
# config.json names, with the generic aliases a config may use instead
_SIZES = {"vocab_size": "vocab_size", "n_embd": "hidden_size", "n_layer": "num_hidden_layers",
          "n_head": "num_attention_heads", "n_positions": "max_position_embeddings"}
# per block: HF name, npformer name, HF shape in symbols, Conv1D weight (transposed); the same names in both
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


def config_fields_from_hf(cfg: dict) -> dict[str, Any]:
    """``GPTConfig`` keyword arguments from a Hugging Face ``config.json`` dictionary of model type
    ``gpt2`` or ``openai-gpt``. Each field's type is checked strictly, as JSON spells it (a size is an
    int, not 8.9 or true; a flag is true or false, not "false"; a rate or an eps is a number), and
    variants npformer does not implement are refused: an :class:`InputTypeError` or
    :class:`RangeError` naming config.json and the field."""
    if not isinstance(cfg, dict):
        raise InputTypeError(f"config.json: expected a JSON object, got {describe(cfg)}")
    kind = cfg.get("model_type", "gpt2")
    if kind not in MODEL_TYPES:
        raise RangeError(f"config.json: expected model_type {' or '.join(map(repr, MODEL_TYPES))}, got {kind!r}")
    names = {ours: ours if ours in cfg else alias for ours, alias in _SIZES.items()}  # the field each size is in
    absent = [ours for ours, name in names.items() if cfg.get(name) is None]
    if absent:
        raise RangeError(f"config.json: expected the {kind} fields {list(_SIZES)}, missing {absent}")
    size = {ours: positive_int(cfg[name], f"config.json: {name}") for ours, name in names.items()}
    field, acts = _ACT_FIELD[kind], _FROM_HF_ACT[kind]
    act = cfg.get(field, "gelu_new" if kind == "gpt2" else "gelu")
    if not isinstance(act, str) or act not in acts:
        raise RangeError(f"config.json: {field} must be one of {sorted(acts)}, got {act!r}")
    if kind == "gpt2":
        for name, want in [("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                           ("add_cross_attention", False)]:
            if boolean(cfg.get(name, want), f"config.json: {name}") != want:
                raise RangeError(f"config.json: npformer's GPT needs {name}={str(want).lower()}, got {cfg[name]!r}")
    c, h = size["n_embd"], size["n_head"]
    if c % h:
        raise RangeError(f"config.json: n_embd={c} must be a multiple of n_head={h}")
    gpt2 = kind == "gpt2"
    inner = cfg.get("n_inner") if gpt2 else None          # null (or absent): 4 * n_embd
    ff = 4 * c if inner is None else positive_int(inner, "config.json: n_inner")
    return dict(vocab_size=size["vocab_size"], block_size=size["n_positions"], n_layer=size["n_layer"],
                n_head=h, d_model=c, dim_feedforward=ff,
                dropout=probability(cfg.get("resid_pdrop", 0.1), "config.json: resid_pdrop"), activation=acts[act],
                norm_first=gpt2, bias=True,
                layer_norm_eps=real(cfg.get("layer_norm_epsilon", 1e-5), "config.json: layer_norm_epsilon", 0.0,
                                    low_open=True),
                tie_embeddings=boolean(cfg.get("tie_word_embeddings", True), "config.json: tie_word_embeddings"),
                scaled_residual_init=gpt2)


def hf_model_type(config) -> str:
    """``"gpt2"`` or ``"openai-gpt"``: the Hugging Face model type that computes what a GPT of
    ``config`` computes. A config with no exact match raises :class:`RangeError` naming why."""
    c = config
    kind = "gpt2" if c.norm_first else "openai-gpt"
    why = []
    if not c.bias:
        why.append("bias=False (both Hugging Face GPTs have biases in every projection and norm)")
    if c.activation not in _TO_HF_ACT[kind]:
        why.append(f"activation {c.activation!r} ({kind}'s {_ACT_FIELD[kind]} has "
                   f"{', '.join(sorted(_TO_HF_ACT[kind]))}; its 'gelu' is the tanh approximation)")
    if kind == "openai-gpt" and (c.dim_feedforward or 4 * c.d_model) != 4 * c.d_model:
        why.append(f"dim_feedforward {c.dim_feedforward} (openai-gpt's is 4 * n_embd = {4 * c.d_model}; "
                   f"npformer train --ff {4 * c.d_model} trains one that has it)")
    if why:
        norm = "pre-norm, matched by gpt2" if c.norm_first else "post-norm, matched by openai-gpt"
        raise RangeError(f"this GPT ({norm}) has no exact Hugging Face counterpart: " + "; ".join(why))
    return kind


def hf_config(config) -> dict[str, Any]:
    """The ``config.json`` dictionary of a GPT of ``config`` (see :func:`hf_model_type`)."""
    c = config
    kind = hf_model_type(c)
    out = {"model_type": kind, "architectures": [MODEL_TYPES[kind]], "vocab_size": c.vocab_size,
           "n_positions": c.block_size, "n_embd": c.d_model, "n_layer": c.n_layer, "n_head": c.n_head,
           _ACT_FIELD[kind]: _TO_HF_ACT[kind][c.activation], "layer_norm_epsilon": c.layer_norm_eps,
           "resid_pdrop": c.dropout, "embd_pdrop": c.dropout, "attn_pdrop": c.dropout,
           "tie_word_embeddings": c.tie_embeddings, "bos_token_id": None, "eos_token_id": None}
    if kind == "gpt2":
        out.update(n_inner=c.dim_feedforward or 4 * c.d_model, scale_attn_weights=True)
    return out


def _plan(config) -> dict[str, tuple[str, tuple[int, ...], bool]]:
    """npformer name -> (HF name without prefix, HF shape, transposed)."""
    c, v, p = config.d_model, config.vocab_size, config.block_size
    dims = {"C": c, "3C": 3 * c, "F": config.dim_feedforward or 4 * c}
    tok, pos = _EMBEDDINGS["gpt2" if config.norm_first else "openai-gpt"]
    plan = {"wte.weight": (f"{tok}.weight", (v, c), False), "wpe.weight": (f"{pos}.weight", (p, c), False)}
    for i in range(config.n_layer):
        for hf, ours, shape, conv in _BLOCK:
            plan[f"layers.{i}.{ours}"] = (f"h.{i}.{hf}", tuple(dims[s] for s in shape), conv)
    if config.norm_first:
        plan["ln_f.weight"], plan["ln_f.bias"] = ("ln_f.weight", (c,), False), ("ln_f.bias", (c,), False)
    if not config.tie_embeddings:
        plan["head.weight"] = ("lm_head.weight", (v, c), False)
    return plan


def state_from_hf(tensors: dict, config) -> dict:
    """Rename (and transpose) a Hugging Face GPT state to npformer's GPT names. Raises
    :class:`StateDictError` naming, at once, every missing HF tensor, every unexpected one and every
    tensor whose shape does not fit ``config`` (in HF names and HF's (in, out) Conv1D layout)."""
    src, twice = {}, []
    for k, val in tensors.items():
        name = k[len("transformer."):] if k.startswith("transformer.") else k
        if name in src:
            twice.append(name)
        src[name] = val
    plan = _plan(config)
    tok = plan["wte.weight"][0]
    used = {hf for hf, _, _ in plan.values()}
    missing = sorted(hf for hf in used if hf not in src)
    ignored = [k for k in src if _BUFFER.match(k)] + (["lm_head.weight"] if config.tie_embeddings else [])
    unexpected = sorted(k for k in src if k not in used and k not in ignored)
    bad = [f"{hf}: expected shape {shape}, got {tuple(np.shape(src[hf]))}"
           for hf, shape, _ in plan.values() if hf in src and tuple(np.shape(src[hf])) != shape]
    if config.tie_embeddings and "lm_head.weight" in src and tok in src and not bad \
            and not np.array_equal(src["lm_head.weight"], src[tok]):
        bad.append(f"lm_head.weight: differs from {tok}, but config.json ties them (tie_word_embeddings is true)")
    if twice:
        bad.append(f"given both with and without the 'transformer.' prefix: {sorted(twice)}")
    if missing or unexpected or bad:
        sizes = (f"n_embd={config.d_model}, n_layer={config.n_layer}, n_inner={config.dim_feedforward}, "
                 f"n_positions={config.block_size}, vocab_size={config.vocab_size}")
        raise StateDictError(f"the Hugging Face {hf_model_type(config)} weights do not fit config.json ({sizes}): "
                             + "; ".join(([f"missing tensors: {missing}"] if missing else [])
                                         + ([f"unexpected tensors: {unexpected}"] if unexpected else [])
                                         + ([f"mismatched tensors: {bad}"] if bad else [])))
    out = {ours: np.ascontiguousarray(np.asarray(src[hf]).T if conv else np.asarray(src[hf]))
           for ours, (hf, _, conv) in plan.items()}
    if config.tie_embeddings:
        out["head.weight"] = out["wte.weight"]          # one Parameter, listed under both names
    return out


def state_to_hf(state: dict, config, prefix: str = "transformer.", *, with_tied: bool = True) -> dict:
    """npformer GPT arrays (a ``state_dict``, or gradients by the same names) -> the Hugging Face
    names and layouts of :func:`hf_model_type`, as host NumPy arrays. ``with_tied=False`` leaves out
    a tied ``lm_head.weight`` (a file holds it once, as ``save_pretrained`` writes it)."""
    hf_model_type(config)
    out = {}
    for ours, (hf, _, conv) in _plan(config).items():
        a = to_numpy(state[ours])
        out[("" if hf == "lm_head.weight" else prefix) + hf] = np.ascontiguousarray(a.T if conv else a)
    if config.tie_embeddings and with_tied:
        out["lm_head.weight"] = out[prefix + _plan(config)["wte.weight"][0]]
    return out
