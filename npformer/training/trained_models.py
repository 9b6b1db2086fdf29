"""Using what ``npformer train`` saved, without its trainer or its data: the model rebuilt from a
checkpoint (its config and vocabularies are in the checkpoint's meta), and masked-character filling.

    trained = load_trained("bert.npz")            # kind, model (eval mode), vocabularies, meta
    fill_mask_text(trained, "The riv[MASK]r")     # the candidates for each [MASK]

``npformer generate``, ``npformer export``, ``npformer fill-mask`` and ``npformer study attention``
read checkpoints this way, never the training text. Text given to a trained model is checked against
its vocabulary (:meth:`CharVocab.check_text`): a character the model never saw is an error naming
it, never a silent ``<unk>``.
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, fields

import numpy as np   # host side only: ids built from text, candidates handed back

from npformer.backend import get_backend, to_device
from npformer.checks import positive_int
from npformer.data.vocab import SPECIALS, CharVocab
from npformer.errors import CheckpointError, RangeError
from npformer.models.albert import ALBERT, ALBERTConfig
from npformer.models.bert import BERT, BERTConfig
from npformer.models.gpt import GPT, GPTConfig
from npformer.models.seq2seq import Seq2Seq, Seq2SeqConfig
from npformer.models.transformer_xl import TransformerXL, TransformerXLConfig
from npformer.training.checkpoint import check_model_state, load_checkpoint

__all__ = ["MODELS", "MASK_TOKEN", "Trained", "load_trained", "encode_masked", "fill_mask_text", "tokenizer_files"]

# checkpoint kind -> (model class, its config class)
MODELS = {"seq2seq": (Seq2Seq, Seq2SeqConfig), "gpt": (GPT, GPTConfig), "gpt1": (GPT, GPTConfig),
          "gpt2": (GPT, GPTConfig), "bert": (BERT, BERTConfig), "albert": (ALBERT, ALBERTConfig),
          "transformer-xl": (TransformerXL, TransformerXLConfig)}
VOCABULARIES = {"seq2seq": ("src_vocab", "tgt_vocab"), "transformer-xl": ()}    # the meta keys; others: "vocab"
MASK_TOKEN = "[MASK]"      # how a masked position is written in the text given to fill-mask


@dataclass
class Trained:
    """A model rebuilt from a checkpoint: ``kind`` (the trainer's: ``gpt2``, ``bert``, ...), the model in
    eval mode, its vocabularies (``(vocab,)``, or ``(source, target)`` for Seq2Seq) and the meta."""
    kind: str
    model: object
    vocabs: tuple[CharVocab, ...]
    meta: dict

    @property
    def mask_id(self) -> int:
        """The [MASK] id of a BERT or ALBERT trained by ``npformer train`` (one after the characters)."""
        if "mask_id" not in self.meta:
            raise RangeError(f"a {self.kind!r} model has no [MASK] token; fill-mask needs a bert or albert "
                             "checkpoint from 'npformer train --task charlm --model bert|albert'")
        return int(self.meta["mask_id"])


def _config(cls, d: dict):
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - names)
    absent = sorted(f.name for f in fields(cls) if f.name not in d and f.default is MISSING)
    if unknown or absent:
        raise ValueError(f"the checkpoint's model config has fields {unknown} that {cls.__name__} does not know "
                         f"and lacks {absent}: it was written by another version of npformer")
    return cls(**d)


def load_trained(path, *, backend: str | None = None, kinds: tuple[str, ...] | None = None,
                 need: str = "") -> Trained:
    """The model saved in ``path`` (weights checked by name, shape and dtype as they load), in eval
    mode on ``backend`` (default numpy). ``kinds`` limits the kinds accepted; another is an error
    saying what ``need`` (e.g. "fill-mask needs a bert or albert checkpoint")."""
    get_backend(backend or "numpy")
    ck = load_checkpoint(path)
    meta = ck.meta
    kind = meta.get("kind")
    if kind not in MODELS or (kinds is not None and kind not in kinds):
        raise RangeError(f"{path} holds a {kind!r} model; {need or 'expected one of ' + ', '.join(MODELS)}")
    model_cls, config_cls = MODELS[kind]
    dtype = meta.get("train_config", {}).get("dtype", "float32")
    model = model_cls(_config(config_cls, meta["model_config"]), dtype=dtype, backend=backend or "numpy", rng=0)
    check_model_state(path, ck.model, model.state_dict())      # names, shapes, dtypes: as a trainer's load
    model.load_state_dict(ck.model)
    vocabs = tuple(_vocab(meta, key, path) for key in VOCABULARIES.get(kind, ("vocab",)))
    return Trained(kind, model.eval(), vocabs, meta)


def _vocab(meta: dict, key: str, path) -> CharVocab:
    """The vocabulary ``meta[key]`` of the checkpoint ``path``; a missing or damaged one is a
    CheckpointError naming the file."""
    if key not in meta:
        raise CheckpointError(f"checkpoint {str(path)!r}: meta lacks {key!r}, the vocabulary of its model, which "
                              "every checkpoint of npformer train holds")
    try:
        return CharVocab.from_dict(meta[key])
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {str(path)!r}: meta[{key!r}] is not a vocabulary ({exc})") from None


def encode_masked(vocab: CharVocab, text: str, mask_id: int) -> list[int]:
    """The ids of ``text`` with every ``[MASK]`` as ``mask_id``; any other character must be in
    ``vocab`` (an error names those that are not)."""
    pieces = text.split(MASK_TOKEN)
    if len(pieces) == 1:
        raise RangeError(f"text {text!r}: no {MASK_TOKEN} to fill; write {MASK_TOKEN} where a character is "
                         f"missing, e.g. 'The riv{MASK_TOKEN}r'")
    vocab.check_text("".join(pieces), f"text {text!r} without its {MASK_TOKEN}s:")
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        ids += vocab.encode(piece)
        if i < len(pieces) - 1:
            ids.append(mask_id)
    return ids


def fill_mask_text(trained: Trained, text: str, top_k: int = 5) -> tuple[str, list[list[tuple[str, float]]]]:
    """Every ``[MASK]`` of ``text`` (one character each) filled by a trained BERT or ALBERT: ``(the
    text with each mask replaced by its most likely character, per mask the top_k (character,
    probability) pairs)``. Candidates are characters only (no special token, no [MASK])."""
    positive_int(top_k, "top_k")
    (vocab,) = trained.vocabs
    ids = encode_masked(vocab, text, trained.mask_id)
    limit = trained.model.config.max_position_embeddings
    if len(ids) > limit:
        raise RangeError(f"text {text!r}: {len(ids)} characters, but the model reads at most {limit}")
    exclude = list(range(len(SPECIALS))) + [trained.mask_id]
    fills = trained.model.fill_mask(to_device(np.asarray([ids]), trained.model.backend), trained.mask_id,
                                    top_k=top_k, exclude=exclude)
    out = list(ids)
    for f in fills:
        out[f.position] = int(f.ids[0])
    return vocab.decode(out), [[(vocab.decode([int(i)]), float(p)) for i, p in zip(f.ids, f.probs)] for f in fills]


def tokenizer_files(trained: Trained, config: dict) -> dict[str, dict]:
    """``tokenizer.json`` (the checkpoint's characters as a Hugging Face tokenizers model, with the
    specials and a BERT's [MASK]) and ``tokenizer_config.json`` (which tokenizer class and special
    tokens ``transformers.AutoTokenizer`` makes of it) for an exported model directory."""
    masked = trained.kind == "bert"
    vocab = trained.vocabs[0]
    tokenizer = vocab.tokenizer_json(*((MASK_TOKEN, trained.mask_id) if masked else ()))
    length = config.get("n_positions", config.get("max_position_embeddings"))
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": length,
                "clean_up_tokenization_spaces": False,
                **dict(zip(("pad_token", "bos_token", "eos_token", "unk_token"), SPECIALS)),
                **({"mask_token": MASK_TOKEN} if masked else {})}
    return {"tokenizer.json": tokenizer, "tokenizer_config.json": settings}
