"""Character vocabularies with four fixed special tokens, for the built-in tasks and the char-level LM.

    id 0 = <pad>,  id 1 = <bos>,  id 2 = <eos>,  id 3 = <unk>,  ids 4.. = the symbols, in order
    encode(text)  = [id(c) for c in text]            (a character not in the vocabulary -> <unk>)
    check_text(text, what)                            (raises RangeError naming the unknown characters)
    decode(ids)   = "".join(token(i) for i in ids)   (strip_special: drop <pad>/<bos>, stop at <eos>)

Every symbol is a single character, so the specials (written with angle brackets, five or more
characters long) can never be produced by ``encode``. ``<unk>`` is kept visible by ``decode`` in both
modes: it stands for a character of the input, not for structure. Host-side code: ids are Python
ints or NumPy integer arrays; move device arrays with ``npformer.backend.to_numpy`` first.
"""
from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from npformer.errors import InputTypeError, RangeError, ShapeError

__all__ = ["SPECIALS", "PAD_ID", "BOS_ID", "EOS_ID", "UNK_ID", "CharVocab"]

SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
_KIND = "char"


def _symbols_from(symbols: Any) -> tuple[str, ...]:
    if isinstance(symbols, str):
        items = list(symbols)
    else:
        try:
            items = list(symbols)
        except TypeError:
            raise InputTypeError(f"symbols: expected a string or an iterable of 1-character strings, "
                                 f"got {type(symbols).__name__}") from None
    for s in items:
        if not isinstance(s, str):
            raise InputTypeError(f"symbols: every symbol must be a 1-character str, got {type(s).__name__} {s!r}")
        if len(s) != 1:
            raise RangeError(f"symbols: every symbol must be exactly 1 character, got {s!r} "
                             f"({len(s)} characters)")
    return tuple(dict.fromkeys(items))     # first occurrence wins; later duplicates are dropped


class CharVocab:
    """A character vocabulary: ``CharVocab("abc")`` has ids a=4, b=5, c=6 after the four specials.

    Duplicated symbols are ignored (the first occurrence keeps its id). ``from_texts`` builds one from
    the sorted set of characters in some texts. Two vocabularies are equal when their symbols are.
    """

    pad_id, bos_id, eos_id, unk_id = PAD_ID, BOS_ID, EOS_ID, UNK_ID

    def __init__(self, symbols: str | Iterable[str] = ""):
        self._symbols = _symbols_from(symbols)
        self._tokens = SPECIALS + self._symbols
        self._ids = {ch: i for i, ch in enumerate(self._symbols, start=len(SPECIALS))}

    @classmethod
    def from_texts(cls, texts: str | Iterable[str]) -> "CharVocab":
        """The sorted set of characters in ``texts`` (one string, or an iterable of strings)."""
        texts = [texts] if isinstance(texts, str) else list(texts)
        for t in texts:
            if not isinstance(t, str):
                raise InputTypeError(f"texts: expected strings, got {type(t).__name__} {t!r}"[:120])
        return cls(sorted(set().union(*map(set, texts))))

    @property
    def symbols(self) -> tuple[str, ...]:
        """The non-special symbols in id order (ids 4, 5, ...)."""
        return self._symbols

    def __len__(self) -> int:
        return len(self._tokens)

    def __contains__(self, ch: object) -> bool:
        return ch in self._ids

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CharVocab) and other._symbols == self._symbols

    def __hash__(self) -> int:
        return hash(self._symbols)

    def __repr__(self) -> str:
        return f"CharVocab({''.join(self._symbols)!r}, size={len(self)})"

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Ids of the characters of ``text`` (unknown ones -> ``<unk>``), optionally framed by bos/eos."""
        if not isinstance(text, str):
            raise InputTypeError(f"encode: expected a str, got {type(text).__name__}")
        get = self._ids.get
        ids = [get(ch, UNK_ID) for ch in text]
        return ([BOS_ID] if add_bos else []) + ids + ([EOS_ID] if add_eos else [])

    def check_text(self, text: str, what: str = "text") -> str:
        """``text`` after checking that every character is in the vocabulary; otherwise a
        :class:`RangeError` naming ``what``, the characters it does not know and the ones it does.
        For text a user gives a trained model (a prompt, a source), where ``<unk>`` would hide a typo."""
        if not isinstance(text, str):
            raise InputTypeError(f"{what}: expected a str, got {type(text).__name__}")
        unknown = "".join(sorted(set(text) - set(self._ids)))
        if unknown:
            raise RangeError(f"{what} {text!r}: the characters {unknown!r} are not in the model's vocabulary "
                             f"of {len(self._symbols)} characters {''.join(self._symbols)!r}")
        return text

    def decode(self, ids: Any, strip_special: bool = True) -> str:
        """The text of ``ids`` (a sequence of ints or a 1-d NumPy integer array).

        ``strip_special=True`` drops ``<pad>`` and ``<bos>`` and ends the text at the first ``<eos>``
        (what follows it in a batched decode is padding or garbage); ``<unk>`` is always written as
        ``"<unk>"``. ``strip_special=False`` writes every id, specials by their names.
        """
        if hasattr(ids, "dtype") and not isinstance(ids, np.ndarray):
            raise InputTypeError(f"decode: expected a list of ints or a numpy array, got {type(ids).__name__}; "
                                 "move device arrays to the host first (npformer.backend.to_numpy)")
        arr = np.asarray(ids)                                             # (n,)
        if arr.ndim == 0:                      # None, a str, a single id: not a sequence of ids
            raise InputTypeError(f"decode: expected a list of ints or a 1-d numpy array, got {type(ids).__name__}")
        if arr.ndim != 1:
            raise ShapeError(f"decode: expected a 1-d sequence of ids, got shape {arr.shape}")
        if arr.size == 0:
            return ""
        if arr.dtype == object and all(isinstance(i, int) and not isinstance(i, bool) for i in arr.tolist()):
            big = next(i for i in arr.tolist() if not 0 <= i < len(self))   # ints beyond int64: out of range
            raise RangeError(f"decode: id {big} is out of range for a vocabulary of "
                             f"size {len(self)} (valid ids are 0..{len(self) - 1})")
        if arr.dtype.kind not in "iu":
            raise InputTypeError(f"decode: expected integer ids, got dtype {arr.dtype}")
        bad = (arr < 0) | (arr >= len(self))
        if bad.any():
            raise RangeError(f"decode: id {int(arr[bad][0])} is out of range for a vocabulary of "
                             f"size {len(self)} (valid ids are 0..{len(self) - 1})")
        out = []
        for i in arr.tolist():
            if strip_special and i == EOS_ID:
                break
            if strip_special and i in (PAD_ID, BOS_ID):
                continue
            out.append(self._tokens[i])
        return "".join(out)

    def to_dict(self) -> dict:
        """A JSON-able description: ``{"kind": "char", "specials": [...], "symbols": [...]}``."""
        return {"kind": _KIND, "specials": list(SPECIALS), "symbols": list(self._symbols)}

    def tokenizer_json(self, mask_token: str | None = None, mask_id: int | None = None) -> dict:
        """This vocabulary as a Hugging Face ``tokenizers`` model, the content of a ``tokenizer.json``
        (``json.dumps`` it): the same ids, every character one token (a ``Split`` on each character),
        a character not in the vocabulary ``<unk>``, the specials (and ``mask_token`` at ``mask_id``,
        a masked LM's) as special added tokens, and a decoder that joins the characters back.
        ``tokenizers.Tokenizer.from_file`` and ``transformers.AutoTokenizer`` read it."""
        if (mask_token is None) != (mask_id is None):
            raise RangeError("tokenizer_json: give mask_token and mask_id together, or neither")
        if mask_id is not None and mask_id < len(self):
            raise RangeError(f"tokenizer_json: mask_id {mask_id} is a character's id; expected >= {len(self)}")
        specials = list(enumerate(SPECIALS)) + ([(mask_id, mask_token)] if mask_token is not None else [])
        return {
            "version": "1.0", "truncation": None, "padding": None,
            "added_tokens": [{"id": i, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": False, "special": True} for i, token in specials],
            "normalizer": None,
            "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "[\\s\\S]"}, "behavior": "Isolated",
                              "invert": False},                       # every character (newlines too) alone
            "post_processor": None,
            "decoder": {"type": "Fuse"},                                # the characters joined, no spaces
            "model": {"type": "WordLevel", "vocab": {t: i for i, t in enumerate(self._tokens)},
                      "unk_token": SPECIALS[UNK_ID]},
        }

    @classmethod
    def from_dict(cls, d: Any) -> "CharVocab":
        """Inverse of :meth:`to_dict` (checks the kind and the special tokens)."""
        if not isinstance(d, dict):
            raise InputTypeError(f"from_dict: expected a dict from CharVocab.to_dict(), got {type(d).__name__}")
        if d.get("kind") != _KIND:
            raise RangeError(f"from_dict: expected kind {_KIND!r}, got {d.get('kind')!r}")
        if list(d.get("specials", [])) != list(SPECIALS):
            raise RangeError(f"from_dict: expected specials {list(SPECIALS)}, got {d.get('specials')!r}")
        if "symbols" not in d:
            raise RangeError("from_dict: the dict has no 'symbols' entry")
        vocab = cls(d["symbols"])
        if len(vocab.symbols) != len(d["symbols"]):     # a duplicate would shift every later id
            raise RangeError("from_dict: 'symbols' holds a duplicate, so the ids would not match")
        return vocab
