"""npformer's ``BERT`` in the Hugging Face BERT layout (``BertModel``, ``BertForMaskedLM``), and back.

The two compute the same: token + position + segment embeddings and their LayerNorm, post-norm
layers, the [CLS] pooler, and the masked-LM head ``LayerNorm(act(h W + b)) word^T + bias`` with the
layers' activation (Hugging Face's ``hidden_act`` serves both). Names, in Hugging Face's (with the
``bert.`` prefix of the task models, or none) and npformer's::

    embeddings.{word,position,token_type}_embeddings.weight, embeddings.LayerNorm.*    the same
    encoder.layer.i.attention.self.{query,key,value}.*    layers.i.self_attn.in_proj_*  (stacked q, k, v)
    encoder.layer.i.attention.output.dense.*              layers.i.self_attn.out_proj.*
    encoder.layer.i.attention.output.LayerNorm.*          layers.i.norm1.*
    encoder.layer.i.intermediate.dense.*                  layers.i.linear1.*
    encoder.layer.i.output.dense.*                        layers.i.linear2.*
    encoder.layer.i.output.LayerNorm.*                    layers.i.norm2.*
    pooler.dense.*                                        pooler.dense.*
    cls.predictions.transform.dense.*                     mlm.dense.*
    cls.predictions.transform.LayerNorm.*                 mlm.LayerNorm.*
    cls.predictions.bias (V,)                             mlm.decoder.bias
    cls.predictions.decoder.weight (tied)                 mlm.decoder.weight (= the word table)

``BertForMaskedLM`` has no pooler, so a model with a masked-LM head is written without one (its
pooled output is no part of masked-LM training); a model read without one gets a zero pooler. The
activations map as ``gelu`` (erf) <-> "gelu", ``gelu_tanh`` <-> "gelu_pytorch_tanh" (also read:
"gelu_new"), ``relu`` <-> "relu". Dictionaries only: this module imports no model, so
``BERT.save_pretrained``/``from_pretrained`` and :mod:`npformer.pretrained.bert` share it.
"""
from __future__ import annotations

from typing import Any

import numpy as np   # host side only: arrays read from and written to files

from npformer.backend import to_numpy
from npformer.errors import RangeError, StateDictError

__all__ = ["config_fields_from_hf", "hf_config", "has_mlm_head", "state_from_hf", "state_to_hf"]

# Hugging Face ``hidden_act`` -> npformer activation (HF "gelu" is the exact erf form), and back.
_FROM_HF_ACT = {"gelu": "gelu", "relu": "relu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
_TO_HF_ACT = {"gelu": "gelu", "relu": "relu", "gelu_tanh": "gelu_pytorch_tanh"}
# HF per-layer names -> npformer per-layer names (q/k/v are packed separately)
_LAYER = {"attention.output.dense": "self_attn.out_proj", "attention.output.LayerNorm": "norm1",
          "intermediate.dense": "linear1", "output.dense": "linear2", "output.LayerNorm": "norm2"}
_QKV = ("query", "key", "value")   # packed in this order into in_proj_weight, as torch's MHA
_MLM = {"cls.predictions.transform.dense": "mlm.dense", "cls.predictions.transform.LayerNorm": "mlm.LayerNorm"}
_MLM_TIED = ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias")   # copies some files hold
_IGNORED_PREFIXES = ("embeddings.position_ids", "cls.")   # buffers and pre-training heads npformer omits


def config_fields_from_hf(cfg: dict) -> dict[str, Any]:
    """``BERTConfig`` keyword arguments from a Hugging Face BERT ``config.json`` dictionary."""
    need = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"]
    absent = [k for k in need if k not in cfg]
    if absent:
        raise RangeError(f"config.json: expected the BERT fields {need}, missing {absent}")
    act = cfg.get("hidden_act", "gelu")
    if act not in _FROM_HF_ACT:
        raise RangeError(f"config.json: hidden_act must be one of {sorted(_FROM_HF_ACT)}, got {act!r}")
    if cfg.get("position_embedding_type", "absolute") != "absolute":
        raise RangeError("config.json: only position_embedding_type 'absolute' is supported, got "
                         f"{cfg['position_embedding_type']!r}")
    opt = {"max_position_embeddings": 512, "type_vocab_size": 2, "layer_norm_eps": 1e-12}
    return {**{k: cfg[k] for k in need}, **{k: cfg.get(k, d) for k, d in opt.items()},
            "activation": _FROM_HF_ACT[act], "dropout": cfg.get("hidden_dropout_prob", 0.1),
            "pad_token_id": cfg.get("pad_token_id") or 0}


def hf_config(config) -> dict[str, Any]:
    """The ``config.json`` dictionary of a BERT of ``config`` (``BertForMaskedLM`` with a masked-LM
    head, ``BertModel`` without)."""
    c = config
    return {"model_type": "bert", "architectures": ["BertForMaskedLM" if c.mlm_head else "BertModel"],
            "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "num_hidden_layers": c.num_hidden_layers,
            "num_attention_heads": c.num_attention_heads, "intermediate_size": c.intermediate_size,
            "max_position_embeddings": c.max_position_embeddings, "type_vocab_size": c.type_vocab_size,
            "layer_norm_eps": c.layer_norm_eps, "hidden_act": _TO_HF_ACT[c.activation],
            "hidden_dropout_prob": c.dropout, "attention_probs_dropout_prob": c.dropout,
            "pad_token_id": c.pad_token_id, "position_embedding_type": "absolute", "tie_word_embeddings": True}


def has_mlm_head(tensors: dict) -> bool:
    """Whether a Hugging Face BERT state holds a masked-LM head (``cls.predictions.*``)."""
    return any(k.startswith("cls.predictions.") for k in tensors)


def _names(num_layers: int, pooler: bool, mlm_head: bool) -> dict[str, list[str]]:
    """npformer name -> the HF names (without prefix) it is made of."""
    same = [f"embeddings.{e}_embeddings.weight" for e in ("word", "position", "token_type")] \
        + [f"embeddings.LayerNorm.{p}" for p in ("weight", "bias")] \
        + ([f"pooler.dense.{p}" for p in ("weight", "bias")] if pooler else [])
    plan = {n: [n] for n in same}
    for p in ("weight", "bias"):
        for i in range(num_layers):
            hf, ours = f"encoder.layer.{i}.", f"layers.{i}."
            plan[ours + f"self_attn.in_proj_{p}"] = [hf + f"attention.self.{n}.{p}" for n in _QKV]
            for h, o in _LAYER.items():
                plan[ours + f"{o}.{p}"] = [hf + f"{h}.{p}"]
        if mlm_head:
            for h, o in _MLM.items():
                plan[f"{o}.{p}"] = [f"{h}.{p}"]
    if mlm_head:
        plan["mlm.decoder.bias"] = ["cls.predictions.bias"]
    return plan


def state_from_hf(tensors: dict, num_layers: int, *, require_pooler: bool = True, mlm_head: bool = False) -> dict:
    """Rename a Hugging Face BERT state (prefix ``bert.`` or none) to npformer's names, packing
    query/key/value into ``in_proj_weight``/``in_proj_bias``. Raises :class:`StateDictError` naming
    every missing HF tensor and every unexpected one (position_ids and other ``cls.*`` heads are
    ignored). With ``require_pooler=False`` a checkpoint without ``pooler.dense.*`` (HF
    ``BertForMaskedLM``) is accepted and the result lacks those two keys; with ``mlm_head`` the
    ``cls.predictions.*`` head is read too (its decoder tied to the word table)."""
    src = {}
    for k, v in tensors.items():
        k = k[len("bert."):] if k.startswith("bert.") else k
        k = k.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
        src[k] = v
    if mlm_head and "cls.predictions.bias" not in src and "cls.predictions.decoder.bias" in src:
        src["cls.predictions.bias"] = src.pop("cls.predictions.decoder.bias")
    pooler = require_pooler or any(k.startswith("pooler.") for k in src)
    plan = _names(num_layers, pooler, mlm_head)
    used = {n for names in plan.values() for n in names}
    missing = sorted(n for n in used if n not in src)
    unexpected = sorted(k for k in src if k not in used and not k.startswith(_IGNORED_PREFIXES))
    if missing or unexpected:
        raise StateDictError("the Hugging Face BERT weights do not fit the config: "
                             + "; ".join(([f"missing tensors: {missing}"] if missing else [])
                                         + ([f"unexpected tensors: {unexpected}"] if unexpected else [])))
    out, bad = {}, []
    for ours, names in plan.items():
        parts = [np.asarray(src[n]) for n in names]
        if len({p.shape for p in parts}) > 1:
            bad.append(f"{ours}: query/key/value shapes differ: {[p.shape for p in parts]}")
            continue
        out[ours] = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
    for name in _MLM_TIED[:1] if mlm_head else ():
        if name in src and not np.array_equal(src[name], src["embeddings.word_embeddings.weight"]):
            bad.append(f"{name}: differs from the word embeddings it is tied to")
    if bad:
        raise StateDictError("mismatched tensors: " + "; ".join(bad))
    if mlm_head:
        out["mlm.decoder.weight"] = out["embeddings.word_embeddings.weight"]   # one Parameter, two names
    return out


def state_to_hf(state: dict, config) -> dict:
    """npformer BERT arrays -> Hugging Face names, as host NumPy arrays: ``BertForMaskedLM``'s
    (``bert.`` prefix, the head, no pooler) for a model with a masked-LM head, else ``BertModel``'s."""
    prefix = "bert." if config.mlm_head else ""
    out = {}
    for ours, names in _names(config.num_hidden_layers, not config.mlm_head, config.mlm_head).items():
        parts = np.split(to_numpy(state[ours]), len(names), axis=0)
        for hf, part in zip(names, parts):
            out[("" if hf.startswith("cls.") else prefix) + hf] = np.ascontiguousarray(part)
    return out
