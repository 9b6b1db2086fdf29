"""Built-in sequence-to-sequence tasks: seeded (source, target) pairs and padded int64 NumPy batches.

Pairs are drawn once from ``seed``: validation first, then training, every source distinct, so no
source is in both splits and changing ``n_train`` leaves the validation set as it was. A batch:

    src     (B, S)  source ids, padded with pad_id         src_mask (B, S)  True = padding
    tgt_in  (B, T)  <bos> + target, padded with pad_id     tgt_mask (B, T)  True = padding
    tgt_out (B, T)  target + <eos>, padded with pad_id     (so the loss uses ignore_index=pad_id)

S is the longest source and T the longest target + 1 in that batch (not in the whole split).
"""
from __future__ import annotations

import string
from datetime import date
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import numpy as np

from npformer.data.corpus import check_int as _check_int
from npformer.data.summarise import DEFAULT_OPTIONS as _SUMMARISE_OPTIONS, mean_token_f1, summarise_pairs
from npformer.data.vocab import CharVocab

__all__ = ["Seq2SeqBatch", "Seq2SeqTask", "get_task", "exact_match", "TASKS", "METRICS", "DATE_FORMATS",
           "format_date", "number_to_words"]
SPLITS = ("train", "valid")
TASKS = {
    "dates": "a date in one of 10 written forms ('Monday, 3rd of March 1997', '03/03/97', ...) -> ISO 1997-03-03",
    "numbers": "an integer 0..999999 in English words ('twenty thousand and seventeen') -> digits (20017)",
    "copy": "a random symbol string of length min_len..max_len -> the same string",
    "reverse": "a random symbol string of length min_len..max_len -> the string reversed",
    "summarise": "a run of 3..8 words of a sentence of the shipped corpus -> its content words in order "
                 "('He said that a clock was' -> 'said clock'); sentences split between train and valid",
}


class Seq2SeqBatch(NamedTuple):
    """One batch: fresh int64 id arrays, bool masks (True = padding), and the texts for reporting."""

    src: np.ndarray          # (B, S)
    src_mask: np.ndarray     # (B, S)
    tgt_in: np.ndarray       # (B, T)  <bos> + target
    tgt_out: np.ndarray      # (B, T)  target + <eos>
    tgt_mask: np.ndarray     # (B, T)  padding only: the causal mask is the model's job
    src_text: tuple          # (B,) str
    tgt_text: tuple          # (B,) str


def _pad(rows: list[list[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.array([len(r) for r in rows], dtype=np.int64)                          # (N,)
    out = np.full((len(rows), int(lengths.max())), pad_id, dtype=np.int64)              # (N, L)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out, lengths


def _as_pairs(pairs: Any, what: str) -> list[tuple[str, str]]:
    if isinstance(pairs, str) or not hasattr(pairs, "__iter__"):
        raise TypeError(f"{what}: expected a list of (source, target) pairs, got {type(pairs).__name__}")
    out = [tuple(p) if isinstance(p, (tuple, list)) else p for p in pairs]
    if not out:
        raise ValueError(f"{what}: expected at least one (source, target) pair, got none")
    for p in out:
        if not (isinstance(p, tuple) and len(p) == 2 and all(isinstance(s, str) for s in p)):
            raise TypeError(f"{what}: expected (source str, target str) pairs, got {p!r}"[:160])
        if not p[0]:
            raise ValueError(f"{what}: empty source string (its attention row would be all padding)")
    return out


class Seq2SeqTask:
    """Fixed (source, target) string pairs in ``train`` and ``valid`` with the vocabularies to encode them.

    The splits are encoded once, here (treat the lists as read-only). ValueError when a split is
    empty, a source is empty or in both splits, or a character is missing from its vocabulary.
    ``tgt_vocab`` defaults to ``src_vocab`` (shared, as in copy and reverse). ``metrics`` names the
    scores of its predictions, keys of :data:`METRICS` (default: exact match alone).
    """

    def __init__(self, name: str, train: Sequence[tuple[str, str]], valid: Sequence[tuple[str, str]],
                 src_vocab: CharVocab, tgt_vocab: CharVocab | None = None, *,
                 description: str = "", config: dict | None = None, metrics: Sequence[str] = ("exact_match",)):
        self.name, self.description, self.config = name, description, dict(config or {})
        self.metrics = tuple(metrics)
        unknown = [m for m in self.metrics if m not in METRICS]
        if unknown or not self.metrics:
            raise ValueError(f"metrics: expected one or more of {sorted(METRICS)}, got {list(metrics)}")
        self.src_vocab, self.tgt_vocab = src_vocab, (src_vocab if tgt_vocab is None else tgt_vocab)
        for role, vocab in (("src_vocab", self.src_vocab), ("tgt_vocab", self.tgt_vocab)):
            if not isinstance(vocab, CharVocab):
                raise TypeError(f"{role}: expected a CharVocab, got {type(vocab).__name__}")
        self.train, self.valid = _as_pairs(train, "train"), _as_pairs(valid, "valid")
        self._encoded = {}
        for split in SPLITS:
            self._encoded[split] = self._encode(getattr(self, split), split, strict=True)
        both = {s for s, _ in self.train} & {s for s, _ in self.valid}
        if both:
            raise ValueError(f"task {name!r}: {len(both)} source(s) are in both train and valid, "
                             f"e.g. {sorted(both)[0]!r}")

    def _encode(self, pairs: list, what: str, strict: bool) -> tuple:
        for side, vocab in enumerate((self.src_vocab, self.tgt_vocab) if strict else ()):
            missing = set().union(*(set(p[side]) for p in pairs)) - set(vocab.symbols)
            if missing:
                raise ValueError(f"{what}: {('source', 'target')[side]} characters "
                                 f"{''.join(sorted(missing))!r} are not in its vocabulary {vocab!r}")
        sv, tv = self.src_vocab, self.tgt_vocab
        src, src_len = _pad([sv.encode(s) for s, _ in pairs], sv.pad_id)                  # (N, S)
        tgt_in, tgt_len = _pad([tv.encode(t, add_bos=True) for _, t in pairs], tv.pad_id)  # (N, T)
        tgt_out, _ = _pad([tv.encode(t, add_eos=True) for _, t in pairs], tv.pad_id)      # (N, T)
        return src, src_len, tgt_in, tgt_out, tgt_len, tuple(pairs)

    @staticmethod
    def _take(encoded: tuple, idx: np.ndarray) -> Seq2SeqBatch:
        src, src_len, tgt_in, tgt_out, tgt_len, pairs = encoded
        sl, tl = src_len[idx], tgt_len[idx]                                                # (B,)
        S, T = int(sl.max()), int(tl.max())
        picked = [pairs[i] for i in idx.tolist()]
        return Seq2SeqBatch(src[idx, :S], np.arange(S)[None, :] >= sl[:, None],           # (B, S)
                            tgt_in[idx, :T], tgt_out[idx, :T],                             # (B, T)
                            np.arange(T)[None, :] >= tl[:, None],                          # (B, T)
                            tuple(p[0] for p in picked), tuple(p[1] for p in picked))

    def with_shared_vocabulary(self) -> "Seq2SeqTask":
        """The same pairs over one vocabulary, the source's and the target's characters together (for
        one embedding of both sides, section 3.4); this task itself when they already share one."""
        if self.src_vocab is self.tgt_vocab:
            return self
        vocab = CharVocab(sorted(set(self.src_vocab.symbols) | set(self.tgt_vocab.symbols)))
        return Seq2SeqTask(self.name, self.train, self.valid, vocab, description=self.description,
                           config=self.config, metrics=self.metrics)

    def split(self, split: str) -> list[tuple[str, str]]:
        """The pairs of ``"train"`` or ``"valid"``."""
        if split not in SPLITS:
            raise ValueError(f"split: expected one of {SPLITS}, got {split!r}")
        return getattr(self, split)

    @property
    def max_src_len(self) -> int:
        """The longest source over both splits, in tokens (the S of a batch holding it)."""
        return max(int(e[1].max()) for e in self._encoded.values())

    @property
    def max_tgt_len(self) -> int:
        """The longest target + 1 over both splits (the T of a batch holding it: bos/eos included)."""
        return max(int(e[4].max()) for e in self._encoded.values())

    def encode_batch(self, pairs: Sequence[tuple[str, str]]) -> Seq2SeqBatch:
        """A batch of any pairs, in the order given; unknown characters become ``<unk>``."""
        pairs = _as_pairs(pairs, "encode_batch")
        return self._take(self._encode(pairs, "encode_batch", strict=False), np.arange(len(pairs)))

    def encode_sources(self, sources: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """``(src, src_mask)`` of source strings alone, for decoding new inputs."""
        if isinstance(sources, str):
            raise TypeError("encode_sources: expected a list of strings, got one str")
        return self.encode_batch([(s, "") for s in sources])[:2]

    def num_batches(self, split: str, batch_size: int, drop_last: bool = False) -> int:
        n, size = len(self.split(split)), _check_int(batch_size, "batch_size", 1)
        return n // size if drop_last else -(-n // size)

    def batches(self, split: str, batch_size: int, *, shuffle: bool = False, rng=None,
                drop_last: bool = False) -> Iterator[Seq2SeqBatch]:
        """One pass over a split, in stored order, or in ``rng``'s order when ``shuffle`` (then ``rng``,
        a ``np.random.Generator``, is required; it is unused otherwise). The last batch is smaller
        unless ``drop_last``."""
        n_batches = self.num_batches(split, batch_size, drop_last)
        n = len(self.split(split))
        if shuffle and not isinstance(rng, np.random.Generator):
            raise TypeError("batches(shuffle=True) needs rng, a numpy Generator "
                            f"(np.random.default_rng(seed)), got {type(rng).__name__}")
        order = rng.permutation(n) if shuffle else np.arange(n)                             # (N,)
        return (self._take(self._encoded[split], order[k * batch_size:(k + 1) * batch_size])
                for k in range(n_batches))

    def score(self, predictions: Sequence[str], targets: Sequence[str]) -> dict[str, float]:
        """Each of the task's metrics of ``predictions`` against ``targets``: {name: value in [0, 1]}."""
        return {name: METRICS[name][1](predictions, targets) for name in self.metrics}

    def __repr__(self) -> str:
        return (f"Seq2SeqTask({self.name!r}, train={len(self.train)}, valid={len(self.valid)}, "
                f"src_vocab={len(self.src_vocab)}, tgt_vocab={len(self.tgt_vocab)})")


# ---- dates: 1950-01-01 .. 2049-12-31, so a 2-digit year is unambiguous (50..99 -> 19yy, 00..49 -> 20yy)
_MONTHS = "January February March April May June July August September October November December".split()
_WEEKDAYS = "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()
_FIRST_DAY, _LAST_DAY = date(1950, 1, 1).toordinal(), date(2049, 12, 31).toordinal()


def _nth(d: int) -> str:
    return f"{d}{'th' if 10 < d % 100 < 14 else {1: 'st', 2: 'nd', 3: 'rd'}.get(d % 10, 'th')}"


_FORMATS: dict[str, Callable[[date, str, str], str]] = {   # (day, Month name, Weekday name) -> text
    "D Month YYYY": lambda t, m, w: f"{t.day} {m} {t.year}",
    "Month D, YYYY": lambda t, m, w: f"{m} {t.day}, {t.year}",
    "DD/MM/YY": lambda t, m, w: f"{t.day:02d}/{t.month:02d}/{t.year % 100:02d}",
    "Weekday, Dth of Month YYYY": lambda t, m, w: f"{w}, {_nth(t.day)} of {m} {t.year}",
    "YYYY.M.D": lambda t, m, w: f"{t.year}.{t.month}.{t.day}",
    "D Mon YY": lambda t, m, w: f"{t.day} {m[:3]} {t.year % 100:02d}",
    "DD.MM.YYYY": lambda t, m, w: f"{t.day:02d}.{t.month:02d}.{t.year}",
    "D-Mon-YYYY": lambda t, m, w: f"{t.day}-{m[:3]}-{t.year}",
    "YYYYMMDD": lambda t, m, w: f"{t.year}{t.month:02d}{t.day:02d}",
    "YYYY-MM-DD": lambda t, m, w: t.isoformat(),
}
DATE_FORMATS = tuple(_FORMATS)
_CASES = (str, str.lower, str.upper)      # each source is written as-is, in lower or in upper case


def format_date(day: date, fmt: str) -> str:
    """``day`` written in the form ``fmt`` (one of ``DATE_FORMATS``), before any case change."""
    if fmt not in _FORMATS:
        raise ValueError(f"unknown date format {fmt!r}; expected one of {DATE_FORMATS}")
    return _FORMATS[fmt](day, _MONTHS[day.month - 1], _WEEKDAYS[day.weekday()])


def _sample_dates(rng, k, opts):
    days, fmts, cases = (rng.integers(0, n, size=k).tolist() for n in
                         (_LAST_DAY - _FIRST_DAY + 1, len(DATE_FORMATS), len(_CASES)))
    out = []
    for o, f, c in zip(days, fmts, cases):
        t = date.fromordinal(_FIRST_DAY + o)
        out.append((_CASES[c](format_date(t, DATE_FORMATS[f])), t.isoformat()))
    return out


# ---- numbers: British usage, "and" before the last part under a hundred, a comma after "thousand"
_ONES = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
         "fifteen sixteen seventeen eighteen nineteen").split()
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()


def _words_999(n: int) -> str:   # 1 <= n <= 999
    h, r = divmod(n, 100)
    tail = _ONES[r] if r < 20 else _TENS[r // 10] + (f"-{_ONES[r % 10]}" if r % 10 else "")
    return " and ".join(filter(None, [f"{_ONES[h]} hundred" if h else "", tail if r else ""]))


def number_to_words(n: int) -> str:
    """0 -> "zero", 101 -> "one hundred and one", 20017 -> "twenty thousand and seventeen",
    412305 -> "four hundred and twelve thousand, three hundred and five" (0 <= n <= 999999)."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise TypeError(f"number_to_words: expected an int, got {type(n).__name__} {n!r}")
    if not 0 <= n <= 999_999:
        raise ValueError(f"number_to_words: expected 0 <= n <= 999999, got {n}")
    th, r = divmod(int(n), 1000)
    if th == 0:
        return _words_999(r) if r else "zero"
    return f"{_words_999(th)} thousand" + ("" if r == 0 else (" and " if r < 100 else ", ") + _words_999(r))


def _sample_numbers(rng, k, opts):   # the digit count is uniform, then the value within it
    top = opts["max_value"]
    digits = rng.integers(1, len(str(top)) + 1, size=k)                            # (k,)
    low = np.where(digits == 1, 0, 10 ** (digits - 1))                             # (k,)
    values = rng.integers(low, np.minimum(10 ** digits - 1, top) + 1)              # (k,)
    return [(number_to_words(v), str(v)) for v in values.tolist()]


def _sample_strings(rng, k, opts, flip=False):   # the length is uniform, then each symbol
    alphabet, lo, hi = opts["alphabet"], opts["min_len"], opts["max_len"]
    lengths = rng.integers(lo, hi + 1, size=k).tolist()
    symbols = rng.integers(0, len(alphabet), size=(k, hi)).tolist()
    texts = ["".join(alphabet[j] for j in row[:n]) for row, n in zip(symbols, lengths)]
    return [(s, s[::-1] if flip else s) for s in texts]


def _check_options(name: str, opts: dict) -> int:
    """Validates a task's options; returns how many distinct sources it can produce."""
    if name == "numbers":
        return _check_int(opts["max_value"], "max_value", 0, 999_999) + 1
    if name in ("copy", "reverse"):
        a = opts["alphabet"]
        if not isinstance(a, str) or not a or len(set(a)) != len(a):
            raise ValueError(f"alphabet: expected a non-empty str of distinct characters, got {a!r}")
        lo = _check_int(opts["min_len"], "min_len", 1)
        hi = _check_int(opts["max_len"], "max_len", lo)
        return sum(len(a) ** n for n in range(lo, hi + 1))
    variants = sum(len({c(format_date(date(1997, 3, 3), f)) for c in _CASES}) for f in DATE_FORMATS)
    return (_LAST_DAY - _FIRST_DAY + 1) * variants


class _Spec(NamedTuple):
    sample: Callable; sizes: tuple; defaults: dict; src: str; tgt: str | None   # noqa: E702


_COPY_OPTS = {"alphabet": "abcdefghij", "min_len": 1, "max_len": 10}
_SPECS = {
    "dates": _Spec(_sample_dates, (20_000, 1_000), {}, string.ascii_letters + string.digits + " ,./-",
                   string.digits + "-"),
    "numbers": _Spec(_sample_numbers, (20_000, 1_000), {"max_value": 999_999},
                     string.ascii_lowercase + " ,-", string.digits),
    "copy": _Spec(_sample_strings, (10_000, 1_000), _COPY_OPTS, "", None),
    "reverse": _Spec(lambda rng, k, o: _sample_strings(rng, k, o, flip=True), (10_000, 1_000),
                     _COPY_OPTS, "", None),
}


def _draw_unique(sample, rng, n, opts, seen: set) -> list:
    """``n`` pairs whose sources are new to ``seen`` (which grows); gives up after ~100 draws a pair."""
    pairs, budget = [], 100 * n + 10_000
    while len(pairs) < n and budget > 0:
        chunk = max(64, 2 * (n - len(pairs)))
        budget -= chunk
        for src, tgt in sample(rng, chunk, opts):
            if src not in seen and len(pairs) < n:
                seen.add(src)
                pairs.append((src, tgt))
    if len(pairs) < n:
        raise ValueError(f"could draw only {len(pairs)} of {n} distinct sources; ask for fewer pairs "
                         "or widen the task's options")
    return pairs


def default_sizes() -> dict[str, tuple[int, int] | None]:
    """Each task's (n_train, n_valid) when they are not given; None for summarise, which takes
    every window of each split."""
    return {**{name: spec.sizes for name, spec in _SPECS.items()}, "summarise": None}


def get_task(name: str, *, seed: int = 0, n_train: int | None = None, n_valid: int | None = None,
             **options: Any) -> "Seq2SeqTask":
    """A built-in task (``TASKS``). Options: copy/reverse ``alphabet="abcdefghij", min_len=1,
    max_len=10``; numbers ``max_value=999999``; summarise ``min_words=3, max_words=8,
    valid_fraction=0.1``; dates none. Sizes default to :func:`default_sizes` (summarise: every window
    of each split, 13,486/728 with seed 0).
    ``task.config`` holds every argument used."""
    if name == "summarise":
        return _summarise_task(seed, n_train, n_valid, options)
    if name not in _SPECS:
        raise ValueError(f"unknown task {name!r}; expected one of {sorted(TASKS)}")
    spec = _SPECS[name]
    unknown = sorted(set(options) - set(spec.defaults))
    if unknown:
        raise TypeError(f"task {name!r} got unexpected option(s) {unknown}; it accepts "
                        f"{sorted(spec.defaults) or 'no options'}")
    seed = _check_int(seed, "seed", 0)
    n_train = spec.sizes[0] if n_train is None else _check_int(n_train, "n_train", 1)
    n_valid = spec.sizes[1] if n_valid is None else _check_int(n_valid, "n_valid", 1)
    opts = {**spec.defaults, **options}
    space = _check_options(name, opts)
    if n_train + n_valid > space:
        raise ValueError(f"task {name!r} has only {space} distinct sources with these options, but "
                         f"n_train + n_valid = {n_train + n_valid} were asked for")
    rng, seen = np.random.default_rng(seed), set()
    valid = _draw_unique(spec.sample, rng, n_valid, opts, seen)
    train = _draw_unique(spec.sample, rng, n_train, opts, seen)
    src = CharVocab(spec.src or opts["alphabet"])
    tgt = CharVocab(spec.tgt) if spec.tgt is not None else None
    config = {"name": name, "seed": seed, "n_train": n_train, "n_valid": n_valid, **opts}
    return Seq2SeqTask(name, train, valid, src, tgt, description=TASKS[name], config=config)


def exact_match(predictions: Sequence[str], targets: Sequence[str]) -> float:
    """The fraction of predictions equal to their target, compared exactly (no case or space folding)."""
    predictions, targets = list(predictions), list(targets)
    if len(predictions) != len(targets):
        raise ValueError(f"exact_match: {len(predictions)} predictions but {len(targets)} targets")
    if not targets:
        raise ValueError("exact_match: no predictions to score (the rate of an empty set is undefined)")
    for s in predictions + targets:
        if not isinstance(s, str):
            raise TypeError(f"exact_match: expected strings, got {type(s).__name__} {s!r}"[:120])
    return sum(p == t for p, t in zip(predictions, targets)) / len(targets)


def _summarise_task(seed: int, n_train: int | None, n_valid: int | None, options: dict) -> Seq2SeqTask:
    """The summarise task (:mod:`npformer.data.summarise`), scored by exact match and token F1; one
    vocabulary, the characters of its pairs, serves both sides (a summary copies its source's words)."""
    unknown = sorted(set(options) - set(_SUMMARISE_OPTIONS))
    if unknown:
        raise TypeError(f"task 'summarise' got unexpected option(s) {unknown}; it accepts {sorted(_SUMMARISE_OPTIONS)}")
    opts = {**_SUMMARISE_OPTIONS, **options}
    train, valid = summarise_pairs(seed, n_train, n_valid, **opts)
    vocab = CharVocab.from_texts(src for src, _ in train + valid)
    config = {"name": "summarise", "seed": seed, "n_train": len(train), "n_valid": len(valid), **opts}
    return Seq2SeqTask("summarise", train, valid, vocab, description=TASKS["summarise"], config=config,
                       metrics=("exact_match", "token_f1"))


# metric name -> (how a report names it, function(predictions, targets) -> a fraction)
METRICS = {"exact_match": ("exact match", exact_match), "token_f1": ("token F1", mean_token_f1)}
