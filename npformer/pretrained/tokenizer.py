"""The tokenizer of a model directory (``tokenizer.json``, read by the ``tokenizers`` package), checked
against its model when it is read, and text refused where the tokenizer could only guess.

    tok = load_tokenizer(root, vocab_size)      # parses, and holds the model's vocabulary size
    enc = encode_known(tok, text, "prompt")     # no part of text read as the unknown token

A directory's files are trusted only once checked: a ``tokenizer.json`` that is damaged, not JSON or
not a tokenizer is one error naming the file (the ``tokenizers`` package raises a bare ``Exception``
with its parser's words, ``expected ident``); one whose vocabulary is not the size of the model's
(another model's tokenizer) is refused with both sizes. A character the vocabulary lacks would be
read as the unknown token (``<unk>`` in npformer's exports, ``[UNK]`` in BERT's) and the model would
continue a text it never saw, so :func:`encode_known` refuses it by name, as a checkpoint's
vocabulary does (:meth:`npformer.data.vocab.CharVocab.check_text`). Byte-level tokenizers (GPT-2's)
have no unknown token and read every text.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from npformer.errors import MissingExtraError, RangeError
from npformer.files import read_json
from npformer.pretrained._files import INSTALL

__all__ = ["load_tokenizer", "encode_known", "TOKENIZER_FILE"]

TOKENIZER_FILE = "tokenizer.json"


def load_tokenizer(root: str | Path, vocab_size: int) -> Any:
    """The ``tokenizers.Tokenizer`` of the model directory ``root``, whose model has ``vocab_size``
    token embeddings: the file must parse as a tokenizer and hold exactly that many tokens."""
    file = Path(root) / TOKENIZER_FILE
    if not file.is_file():
        raise FileNotFoundError(f"model directory {str(root)!r} has no {TOKENIZER_FILE} (needed to turn text into "
                                "token ids and back)")
    read_json(file, str(file))                      # damaged, not UTF-8, not JSON: named before the package
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise MissingExtraError(f"reading a model's tokenizer needs tokenizers: {INSTALL}") from exc
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as exc:                         # tokenizers raises Exception itself for a bad file
        raise RangeError(f"{file}: not a tokenizer the tokenizers package can read ({exc})") from None
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size != vocab_size:
        raise RangeError(f"{file}: a vocabulary of {size} tokens, but the model in {root} has {vocab_size} (vocab_size "
                         "in its config.json): a tokenizer of another model?")
    return tokenizer


def encode_known(tokenizer: Any, text: str, what: str) -> Any:
    """``tokenizer.encode(text)`` after checking that no part of ``text`` is read as the unknown token;
    otherwise a :class:`RangeError` naming ``what`` (``"prompt"``) and the parts."""
    encoding = tokenizer.encode(text)
    unknown = getattr(tokenizer.model, "unk_token", None)
    unknown_id = tokenizer.token_to_id(unknown) if unknown else None
    if unknown_id is None:
        return encoding
    parts = [text[a:b] for i, (a, b) in zip(encoding.ids, encoding.offsets) if i == unknown_id and text[a:b] != unknown]
    if parts:
        parts = list(dict.fromkeys(parts))
        shown = ", ".join(repr(p) for p in parts)
        it = "it" if len(parts) == 1 else "them"
        raise RangeError(f"{what} {text!r}: {shown} {'is' if len(parts) == 1 else 'are'} not in the model's vocabulary "
                         f"(its tokenizer reads {it} as {unknown!r})")
    return encoding
