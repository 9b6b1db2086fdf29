"""Character-level language-model data: one text, one CharVocab, a train/valid split by position.

    ids   = vocab.encode(text)                                   (N,)
    train = ids[:n_train],  valid = ids[n_train:],  n_train = floor(N * (1 - valid_fraction))
    x[b]  = ids[i_b : i_b + T],   y[b] = ids[i_b + 1 : i_b + T + 1]   (B, T) int64, T = block_size

The vocabulary is built from the whole text (so validation has no unknown characters); ids 0..3
are the unused special tokens. ``load_corpus()`` returns the original text shipped in the package.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Iterator

import numpy as np

from npformer.data.vocab import CharVocab
from npformer.errors import InputTypeError, RangeError

__all__ = ["CharLMData", "load_corpus", "check_corpus", "SAMPLE_PROMPT"]
SPLITS = ("train", "valid")
SAMPLE_PROMPT = "The "      # what a character model's samples continue (npformer train, npformer generate)


def check_int(value, name: str, low: int, high: int | None = None) -> int:
    """``value`` as an int in [``low``, ``high``], else npformer's InputTypeError (not an int; bools are
    not) or RangeError, worded as :mod:`npformer.checks` words them. The data sit below that module in
    the package's layers (tests/test_imports.py), so they keep this one check of their own."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InputTypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value > high):
        span = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise RangeError(f"{name}: expected an int {span}, got {value}")
    return int(value)


class CharLMData:
    """Next-character prediction data over ``text`` in blocks of ``block_size`` characters.

    ``seed`` seeds the object's own generator ``self.rng``, used by :meth:`random_batch` when no
    ``rng`` is given (a fresh object with the same seed gives the same batches). Each split must
    hold at least ``block_size + 1`` characters (ValueError otherwise).
    """

    def __init__(self, text: str, *, block_size: int, valid_fraction: float = 0.1, seed: int = 0):
        if not isinstance(text, str):
            raise TypeError(f"text: expected a str, got {type(text).__name__}")
        self.block_size = check_int(block_size, "block_size", 1)
        if isinstance(valid_fraction, bool) or not isinstance(valid_fraction, (int, float)) \
                or not 0.0 < valid_fraction < 1.0:
            raise ValueError(f"valid_fraction: expected a number strictly between 0 and 1, got {valid_fraction!r}")
        self.valid_fraction = float(valid_fraction)
        self.vocab = CharVocab.from_texts(text)
        ids = np.asarray(self.vocab.encode(text), dtype=np.int64)                         # (N,)
        n_train = int(len(ids) * (1.0 - self.valid_fraction))
        self.train_ids, self.valid_ids = ids[:n_train], ids[n_train:]                     # (N_train,), (N_valid,)
        for split in SPLITS:
            got = len(self.ids(split))
            if got < self.block_size + 1:
                raise ValueError(f"the {split} split has {got} characters but block_size + 1 = "
                                 f"{self.block_size + 1} are needed ({len(ids)} in the text, "
                                 f"valid_fraction={self.valid_fraction}); use a longer text or a smaller block_size")
            self.ids(split).flags.writeable = False
        self.rng = np.random.default_rng(check_int(seed, "seed", 0))

    def ids(self, split: str) -> np.ndarray:
        """The read-only int64 ids of ``"train"`` or ``"valid"``."""
        if split not in SPLITS:
            raise ValueError(f"split: expected one of {SPLITS}, got {split!r}")
        return self.train_ids if split == "train" else self.valid_ids

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def _windows(self, ids: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        idx = starts[:, None] + np.arange(self.block_size)[None, :]                       # (B, T)
        return ids[idx], ids[idx + 1]                                                     # (B, T), (B, T)

    @staticmethod
    def _generator(rng, default):
        if rng is None:
            return default
        if not isinstance(rng, np.random.Generator):
            raise TypeError(f"rng: expected a numpy Generator (np.random.default_rng(seed)), "
                            f"got {type(rng).__name__}")
        return rng

    def num_windows(self, split: str) -> int:
        """How many distinct (x, y) blocks :meth:`random_batch` draws from (their start positions)."""
        return len(self.ids(split)) - self.block_size

    def num_blocks(self, split: str) -> int:
        """How many non-overlapping (x, y) blocks one pass of :meth:`batches` without rng yields."""
        return (len(self.ids(split)) - 1) // self.block_size

    def batches(self, split: str, batch_size: int, rng=None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """One pass over a split in non-overlapping blocks, batched (the last batch may be smaller).

        ``rng=None``: blocks start at 0, T, 2T, ... in order (deterministic, for evaluation). With
        an ``rng``: the first block starts at a random offset in [0, T) and the blocks are shuffled.
        """
        ids, T = self.ids(split), self.block_size
        batch_size = check_int(batch_size, "batch_size", 1)
        rng = self._generator(rng, None)
        offset = 0 if rng is None else int(rng.integers(0, min(T, len(ids) - T)))
        starts = offset + T * np.arange((len(ids) - 1 - offset) // T)                     # (n_blocks,)
        if rng is not None:
            starts = starts[rng.permutation(len(starts))]                                 # (n_blocks,)
        return (self._windows(ids, starts[k:k + batch_size]) for k in range(0, len(starts), batch_size))

    def random_batch(self, split: str, batch_size: int, rng=None) -> tuple[np.ndarray, np.ndarray]:
        """``batch_size`` blocks starting at uniform random positions (``self.rng`` when rng is None)."""
        ids = self.ids(split)
        batch_size = check_int(batch_size, "batch_size", 1)
        rng = self._generator(rng, self.rng)
        starts = rng.integers(0, len(ids) - self.block_size, size=batch_size)             # (B,)
        return self._windows(ids, starts)


def load_corpus(path: str | Path | None = None) -> str:
    """The text shipped with npformer (``path=None``) or the UTF-8 text of the file at ``path``.

    ValueError naming the path when it does not exist, is not a file, is not UTF-8 or is empty; the
    OSError of a file that cannot be read.
    """
    if path is None:
        return resources.files("npformer.data").joinpath("corpus.txt").read_text(encoding="utf-8")
    if not isinstance(path, (str, Path)):
        raise TypeError(f"path: expected a str or pathlib.Path, got {type(path).__name__}")
    p = Path(path)
    if not p.exists():
        raise ValueError(f"corpus file {str(p)!r} does not exist")
    if not p.is_file():
        raise ValueError(f"corpus path {str(p)!r} is not a file")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"corpus file {str(p)!r} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    return check_corpus(text, f"corpus file {str(p)!r}")


def check_corpus(text: str, where: str) -> str:
    """``text`` if it holds something to train on, else a ValueError saying that ``where`` (the file)
    is empty. ``npformer train --text FILE`` reads the file through :func:`npformer.files.read_text`
    (its errors name --text), then checks it here."""
    if not text.strip():
        raise ValueError(f"{where} is empty (or only whitespace)")
    return text
