"""The summarise task: the summary rule and the sentence split on hand-made text, token F1 on
hand-worked cases, the built-in task's splits (no sentence in both), and a few training steps."""
import re

import pytest

from npformer.data import get_task
from npformer.data.corpus import load_corpus
from npformer.data.summarise import (STOP_WORDS, content_words, mean_token_f1, sentences, summarise_pairs,
                                     token_f1, windows)
from npformer.errors import InputTypeError, RangeError


# ---- the summary rule
@pytest.mark.parametrize("text, summary", [
    ("He said that a clock was only a promise about time,", "said clock only promise time"),
    ("THE CLOCKMAKER OF THE LOWER TOWN", "CLOCKMAKER LOWER TOWN"),             # case kept, matched folded
    ("Ansel did not mind that his clocks disagreed.", "Ansel not mind clocks disagreed"),   # negation kept
    ('"Because the bell-ringer looks at the sun," said Mira.', "bell-ringer looks sun said Mira"),
    ("and it was the", ""),                                                      # stop words alone
    ("  the   river  ", "river"),
])
def test_content_words_by_hand(text, summary):
    assert content_words(text) == summary


def test_stop_words_are_lower_case_function_words_without_negations():
    assert all(w == w.lower() and w.isalpha() for w in STOP_WORDS)
    assert {"the", "a", "of", "and", "he", "was", "which"} <= STOP_WORDS
    assert not {"not", "no", "never", "nobody", "clock"} & STOP_WORDS


def test_sentences_split_at_paragraphs_and_sentence_ends():
    text = 'A TITLE\n\nOne sentence here. "A quoted one?" he asked! Last\nline wraps.\n\nNew paragraph'
    assert sentences(text) == ["A TITLE", "One sentence here.", '"A quoted one?"', "he asked!",
                               "Last line wraps.", "New paragraph"]


def test_windows_are_every_run_of_words_within_bounds():
    assert windows("a b c d", 2, 3) == ["a b", "b c", "c d", "a b c", "b c d"]
    assert windows("a b", 3, 5) == ["a b"]                                 # shorter than min_words: whole
    assert windows("a b c", 3, 5) == ["a b c"]


# ---- token F1
@pytest.mark.parametrize("prediction, target, f1", [
    ("said clock promise", "said clock promise", 1.0),
    ("clock said promise", "said clock promise", 1.0),             # bags of words: order is not scored
    ("said clock", "said clock promise time", 2 * (1.0 * 0.5) / 1.5),   # P 1, R 1/2 -> 2/3
    ("said bell", "said clock", 0.5),                              # P 1/2, R 1/2
    ("clock clock", "clock", 2 * (0.5 * 1.0) / 1.5),              # the repeat matches once: P 1/2, R 1
    ("bell", "clock", 0.0),
    ("", "", 1.0),
    ("", "clock", 0.0),
    ("clock", "", 0.0),
    ("Clock", "clock", 0.0),                                       # compared exactly
])
def test_token_f1_by_hand(prediction, target, f1):
    assert token_f1(prediction, target) == pytest.approx(f1, abs=1e-15)


def test_mean_token_f1_and_its_bad_input():
    assert mean_token_f1(["a b", "c"], ["a b", "d"]) == 0.5
    with pytest.raises(ValueError, match="2 predictions but 1 targets"):
        mean_token_f1(["a", "b"], ["a"])
    with pytest.raises(ValueError, match="no predictions"):
        mean_token_f1([], [])
    with pytest.raises(TypeError, match="prediction must be a str"):
        token_f1(None, "a")


# ---- the split: no sentence gives windows to both sides
def test_no_sentence_is_in_both_splits():
    # every sentence has words of its own, so a window names its sentence
    text = " ".join(f"Alpha{i} beta{i} the gamma{i} of delta{i} and epsilon{i}." for i in range(40))
    train, valid = summarise_pairs(3, None, None, min_words=2, max_words=4, valid_fraction=0.25, text=text)
    def sentence_of(window):
        return set(re.findall(r"\d+", window))
    train_sentences = set().union(*(sentence_of(s) for s, _ in train))
    valid_sentences = set().union(*(sentence_of(s) for s, _ in valid))
    assert len(valid_sentences) == 10 and len(train_sentences) == 30
    assert not train_sentences & valid_sentences
    assert all(t == content_words(s) and t for s, t in train + valid)


def test_the_shipped_task_splits_by_sentence_and_scores_two_ways():
    task = get_task("summarise")
    assert task.metrics == ("exact_match", "token_f1")
    assert len(task.train) > 10_000 and len(task.valid) > 500
    assert not {s for s, _ in task.train} & {s for s, _ in task.valid}
    valid_sentences = [s for s in sentences(load_corpus()) if any(v in s for v, _ in task.valid[:50])]
    for src, _ in task.train[:2000]:             # no training window is a run of words of a held-out sentence
        assert not any(f" {src} " in f" {s} " for s in valid_sentences), src
    assert all(3 <= len(s.split()) <= 8 or s in sentences(load_corpus()) for s, _ in task.train + task.valid)
    preds = [t for _, t in task.valid[:3]] + ["nothing"]
    scores = task.score(preds, [t for _, t in task.valid[:4]])
    assert scores["exact_match"] == 0.75 and 0.75 <= scores["token_f1"] < 1.0


def test_bad_options_are_refused():
    with pytest.raises(TypeError, match="unexpected option"):
        get_task("summarise", max_len=3)
    with pytest.raises(ValueError, match="valid windows"):
        get_task("summarise", n_valid=10**6)
    with pytest.raises(RangeError, match="max_words"):
        get_task("summarise", min_words=5, max_words=4)
    with pytest.raises(InputTypeError, match="min_words"):
        get_task("summarise", min_words=2.5)


# ---- trained through the registry, as `npformer train --task summarise` does
def test_summarise_trains_and_reports_exact_match_and_token_f1():
    from npformer.training.config import make_config
    from npformer.training.registry import make_trainer
    lines = []
    config = make_config({"task": "summarise", "d_model": 32, "heads": 2, "layers": 1, "ff": 64,
                          "steps": 12, "batch_size": 16, "n_train": 200, "n_valid": 12, "eval_every": 0})
    trainer = make_trainer(config, log=lines.append)
    assert type(trainer).__name__ == "Seq2SeqTrainer"
    first = trainer.train_step().loss
    result = trainer.fit()
    assert trainer.history[-1]["loss"] < first
    assert 0.0 <= result["exact_match"] <= result["token_f1"] <= 1.0
    assert re.search(r"final validation \(12 held-out examples\): loss \d+\.\d+  exact match \d+\.\d%  "
                     r"token F1 \d+\.\d%", lines[-1]), lines[-1]
