"""The ``summarise`` task's text and its scores: sentences of the shipped corpus compressed to their
content words, exact match and token F1.

The summary of a piece of text is its *content words in order*: every word whose lower-cased form,
punctuation stripped from its ends, is not in :data:`STOP_WORDS` (articles, pronouns, prepositions,
conjunctions, auxiliaries; negations such as "not" and "never" are kept, as they carry meaning), with
its punctuation dropped and its case kept::

    source  'He said that a clock was only a promise about time,'
    target  'said clock promise time'

It is compression a model must learn from examples: which words carry the content is never told,
only shown (the list is closed and frequent, so it is learnable), and content words never seen in
training (names, rare nouns in held-out sentences) must be copied character by character through
the encoder-decoder attention. The same rule is the "telegraphic" summary of headline writing.

The corpus holds 188 sentences (titles included), far too few examples on their own, so an example
is a window of ``min_words``..``max_words`` consecutive words of one sentence (every window that
holds a content word). The sentences are split first, with ``seed``: ``valid_fraction`` of them for validation, the
rest for training, so **no sentence gives windows to both splits**; a training window whose text also
occurs in a validation sentence (a common phrase such as "in the lower town") is dropped too, so no
source is in both splits.

Scores (:func:`token_f1`): a prediction and its target as bags of words (split at spaces),
precision = matched / predicted words, recall = matched / target words, F1 = 2PR / (P + R) (SQuAD's
token F1, without its normalisation: the words are compared exactly); both empty is 1, one empty 0.
:func:`mean_token_f1` averages it over examples; exact match is :func:`npformer.data.tasks.exact_match`.
"""
from __future__ import annotations

import re
from collections import Counter
from typing import Sequence

import numpy as np

from npformer.data.corpus import check_int, load_corpus

__all__ = ["STOP_WORDS", "sentences", "content_words", "windows", "summarise_pairs", "token_f1",
           "mean_token_f1", "DEFAULT_OPTIONS"]

STOP_WORDS = frozenset("""
a an the
and or but nor so yet if then than as because while though although whether
of in on at to from by with about into onto over under for up down out off through between after
before during without within upon along across against among around
i me my we us our you your he him his she her it its they them their this that these those there here
myself yourself himself herself itself ourselves themselves
is am are was were be been being have has had do does did will would shall should can could may might
must
who whom whose which what how why when where
all any each every some such both either neither also just very too
""".split())

# a sentence ends at . ! or ?, with any closing quotes, before a space (or the end of its paragraph)
_SENTENCE = re.compile(r"[^.!?]*[.!?]+[\"']*(?=\s|$)|[^.!?]+$")
_EDGE_PUNCTUATION = "\"',-.:;?!()"
DEFAULT_OPTIONS = {"min_words": 3, "max_words": 8, "valid_fraction": 0.1}


def sentences(text: str) -> list[str]:
    """The sentences of ``text`` in order, each on one line with single spaces: paragraphs are split at
    blank lines (so a title is a sentence of its own), then after ``.``, ``!`` or ``?``."""
    out = []
    for paragraph in re.split(r"\n\s*\n", text):
        flat = " ".join(paragraph.split())
        out += [s.strip() for s in _SENTENCE.findall(flat) if s.strip()]
    return out


def content_words(text: str) -> str:
    """The summary of ``text``: its words that are not stop words, in order, edge punctuation
    removed, joined by single spaces ('' when every word is a stop word)."""
    kept = (w.strip(_EDGE_PUNCTUATION) for w in text.split())
    return " ".join(w for w in kept if w and w.lower() not in STOP_WORDS)


def windows(sentence: str, min_words: int, max_words: int) -> list[str]:
    """Every run of ``min_words``..``max_words`` consecutive words of ``sentence`` (the whole sentence
    when it is shorter than ``min_words``)."""
    words = sentence.split()
    if len(words) <= min_words:
        return [" ".join(words)]
    return [" ".join(words[i:i + n]) for n in range(min_words, max_words + 1)
            for i in range(len(words) - n + 1)]


def _examples(sentence_list: list[str], min_words: int, max_words: int) -> list[tuple[str, str]]:
    """(window, its content words) for every window holding a content word, each text once, in order."""
    pairs = {}
    for s in sentence_list:
        for w in windows(s, min_words, max_words):
            summary = content_words(w)
            if summary:
                pairs.setdefault(w, summary)
    return list(pairs.items())


def summarise_pairs(seed: int, n_train: int | None, n_valid: int | None, *, min_words: int, max_words: int,
                    valid_fraction: float, text: str | None = None) -> tuple[list, list]:
    """(train, valid) lists of (window, summary) pairs from ``text`` (default: the shipped corpus),
    split by sentence as the module docstring says; ``n_train``/``n_valid`` (None: all of the split)
    are drawn from each split's windows with ``seed``. ValueError when a split has fewer."""
    seed = check_int(seed, "seed", 0)
    min_words = check_int(min_words, "min_words", 1)
    max_words = check_int(max_words, "max_words", min_words)
    if isinstance(valid_fraction, bool) or not isinstance(valid_fraction, (int, float)) \
            or not 0.0 < valid_fraction < 1.0:
        raise ValueError(f"valid_fraction: expected a number strictly between 0 and 1, got {valid_fraction!r}")
    unique = list(dict.fromkeys(sentences(load_corpus() if text is None else text)))
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(unique)).tolist()
    n_valid_sentences = max(1, round(valid_fraction * len(unique)))
    if n_valid_sentences >= len(unique):
        raise ValueError(f"the text has {len(unique)} distinct sentences: too few to split "
                         f"{valid_fraction} of them off for validation and train on the rest")
    valid_sentences = [unique[i] for i in sorted(order[:n_valid_sentences])]
    train_sentences = [unique[i] for i in sorted(order[n_valid_sentences:])]
    valid = _examples(valid_sentences, min_words, max_words)
    held_out = {src for src, _ in valid}
    train = [p for p in _examples(train_sentences, min_words, max_words) if p[0] not in held_out]
    picked = []
    for split, pairs, n in (("valid", valid, n_valid), ("train", train, n_train)):
        if n is None:
            n = len(pairs)
        elif check_int(n, f"n_{split}", 1) > len(pairs):
            raise ValueError(f"task 'summarise' has {len(pairs)} {split} windows with these options, but "
                             f"n_{split} = {n} were asked for")
        picked.append([pairs[i] for i in rng.permutation(len(pairs))[:n].tolist()])
    valid, train = picked
    return train, valid


def token_f1(prediction: str, target: str) -> float:
    """F1 of the words of ``prediction`` against those of ``target``, as bags (a word predicted twice
    matches twice only if the target holds it twice); 1.0 when both are empty, 0.0 when one is."""
    for name, s in (("prediction", prediction), ("target", target)):
        if not isinstance(s, str):
            raise TypeError(f"token_f1: {name} must be a str, got {type(s).__name__} {s!r}"[:120])
    predicted, wanted = prediction.split(), target.split()
    if not predicted or not wanted:
        return float(predicted == wanted)
    matched = sum((Counter(predicted) & Counter(wanted)).values())
    if matched == 0:
        return 0.0
    precision, recall = matched / len(predicted), matched / len(wanted)
    return 2 * precision * recall / (precision + recall)


def mean_token_f1(predictions: Sequence[str], targets: Sequence[str]) -> float:
    """The mean of :func:`token_f1` over pairs of predictions and targets (equal, non-zero counts)."""
    predictions, targets = list(predictions), list(targets)
    if len(predictions) != len(targets):
        raise ValueError(f"mean_token_f1: {len(predictions)} predictions but {len(targets)} targets")
    if not targets:
        raise ValueError("mean_token_f1: no predictions to score (the mean of an empty set is undefined)")
    return sum(token_f1(p, t) for p, t in zip(predictions, targets)) / len(targets)
