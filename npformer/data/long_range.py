"""A built-in task whose dependencies reach further back than one training segment: ``recall``.

Each sequence repeats a random block of ``period`` symbols (drawn independently, uniformly from
``n_symbols``) until it holds ``length + 1`` tokens, so from position ``period`` on every token
equals the one ``period`` steps back:

    seq[t] = block[t mod period]           inputs x = seq[:-1], targets y = seq[1:]   (N, length)
    y[t] = x[t + 1 - period]   for t + 1 >= period   (recallable: a copy from period - 1 back)
    y[t] is a fresh uniform draw for t + 1 < period  (no model can do better than ln n_symbols)

A language model trained on segments of T < period tokens never sees a token and its copy in the
same segment: without memory its best loss is ln(n_symbols) on every target; with memory reaching
``period - 1`` back it can recall the copies, down to :meth:`RecallTask.floor_loss` (only the first
``period - 1`` targets stay unknowable). Sequences are drawn once from ``seed``: validation first,
then training, every block distinct, so no validation block is in training and changing
``n_train`` leaves the validation set as it was.
"""
from __future__ import annotations

import math

import numpy as np

from npformer.data.corpus import SPLITS, check_int

__all__ = ["RecallTask"]


class RecallTask:
    """Fixed ``train`` and ``valid`` sequences (N, length + 1) of int64 ids in [0, n_symbols), read-only."""

    name = "recall"
    DEFAULT_SIZES = (2000, 200)          # training and validation sequences when not given

    def __init__(self, *, period: int, length: int, n_symbols: int = 16, n_train: int = DEFAULT_SIZES[0],
                 n_valid: int = DEFAULT_SIZES[1], seed: int = 0):
        self.period = check_int(period, "period", 2)
        self.length = check_int(length, "length", 1)
        self.n_symbols = check_int(n_symbols, "n_symbols", 2)
        n_train, n_valid = check_int(n_train, "n_train", 1), check_int(n_valid, "n_valid", 1)
        self.seed = check_int(seed, "seed", 0)
        if self.length + 1 <= self.period:
            raise ValueError(f"length + 1 = {self.length + 1} must exceed period = {self.period}: "
                             "otherwise no token is ever repeated")
        if n_train + n_valid > 0.5 * float(self.n_symbols) ** self.period:
            raise ValueError(f"{n_train + n_valid} distinct blocks cannot be drawn from {self.n_symbols}^"
                             f"{self.period} possible ones; use a longer period or more symbols")
        rng = np.random.default_rng(self.seed)
        blocks, seen = [], set()
        while len(blocks) < n_valid + n_train:
            for block in rng.integers(0, self.n_symbols, size=(n_valid + n_train - len(blocks), self.period)):
                key = block.tobytes()
                if key not in seen:
                    seen.add(key)
                    blocks.append(block)
        reps = np.arange(self.length + 1) % self.period                                     # (length + 1,)
        seqs = np.stack(blocks)[:, reps].astype(np.int64)                                   # (N, length + 1)
        self.valid, self.train = seqs[:n_valid], seqs[n_valid:]
        for a in (self.train, self.valid):
            a.flags.writeable = False

    @property
    def vocab_size(self) -> int:
        return self.n_symbols

    def split(self, split: str) -> np.ndarray:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        return self.train if split == "train" else self.valid

    def inputs_targets(self, split: str, rows=None) -> tuple[np.ndarray, np.ndarray]:
        """``(x, y)`` (N, length) each: the inputs and the next tokens of the chosen rows (all by default)."""
        seqs = self.split(split) if rows is None else self.split(split)[np.asarray(rows)]
        return seqs[:, :-1].copy(), seqs[:, 1:].copy()

    def recallable(self) -> np.ndarray:
        """Bool (length,): True where the target repeats a token ``period - 1`` positions back."""
        return np.arange(1, self.length + 1) >= self.period

    def floor_loss(self) -> float:
        """Mean cross-entropy (nats) of the best possible model: exact on the recallable targets,
        uniform on the rest."""
        return float((~self.recallable()).mean() * math.log(self.n_symbols))

    def describe(self) -> str:
        return (f"recall: {len(self.train)} train / {len(self.valid)} valid sequences of {self.length} tokens, "
                f"a random block of {self.period} symbols (of {self.n_symbols}) repeated")
