"""Built-in seq2seq tasks: labels checked independently (datetime, a words parser), splits, batches."""
import re
from datetime import date, datetime

import numpy as np
import pytest
from hypothesis import given, strategies as st

from npformer.data import (DATE_FORMATS, TASKS, CharVocab, Seq2SeqTask, exact_match, format_date,
                           get_task, number_to_words)

# ---- an independent reading of every date format, with Python's own parser
STRPTIME = {"D Month YYYY": "%d %B %Y", "Month D, YYYY": "%B %d, %Y", "DD/MM/YY": "%d/%m/%y",
            "Weekday, Dth of Month YYYY": "%A, %d of %B %Y", "YYYY.M.D": "%Y.%m.%d",
            "D Mon YY": "%d %b %y", "DD.MM.YYYY": "%d.%m.%Y", "D-Mon-YYYY": "%d-%b-%Y",
            "YYYYMMDD": "%Y%m%d", "YYYY-MM-DD": "%Y-%m-%d"}
SUFFIX = {1: "st", 2: "nd", 3: "rd", 21: "st", 22: "nd", 23: "rd", 31: "st"}   # every other day: th


def parse_date(text):
    """{format name: date} for every pattern that reads ``text`` (ordinals and weekdays checked)."""
    found = {}
    m = re.search(r"(\d+)(st|nd|rd|th)\b", text, flags=re.I)
    if m:
        assert m.group(2).lower() == SUFFIX.get(int(m.group(1)), "th"), text
        text = text[:m.end(1)] + text[m.end():]
    for name, pattern in STRPTIME.items():
        try:
            t = datetime.strptime(text, pattern)
        except ValueError:
            continue
        if "%y" in pattern and t.year > 2049:          # the task's pivot: 50..99 -> 19yy
            t = t.replace(year=t.year - 100)
        if "%A" in pattern:
            assert text.split(",")[0].lower() == t.strftime("%A").lower(), text
        found[name] = t.date()
    return found


def test_formats_cover_the_examples():
    assert len(DATE_FORMATS) >= 8 and set(DATE_FORMATS) == set(STRPTIME)
    d = date(1997, 3, 3)
    written = {format_date(d, f) for f in DATE_FORMATS}
    assert {"3 March 1997", "March 3, 1997", "03/03/97", "Monday, 3rd of March 1997", "1997.3.3"} <= written
    assert "3 mar 97" in {w.lower() for w in written}


@pytest.mark.parametrize("fmt", DATE_FORMATS)
def test_every_format_parses_back_to_the_same_date_in_every_case(fmt):
    days = [date(1950, 1, 1), date(1968, 12, 31), date(1969, 1, 1), date(1999, 12, 31), date(2000, 2, 29),
            date(2001, 11, 11), date(2012, 9, 22), date(2023, 1, 23), date(2049, 12, 31)]
    for d in days:
        for text in (format_date(d, fmt), format_date(d, fmt).lower(), format_date(d, fmt).upper()):
            assert parse_date(text) == {fmt: d}, text


def test_dates_task_labels_are_iso_dates_of_their_sources():
    task = get_task("dates", seed=5, n_train=1500, n_valid=200)
    used, cases = set(), set()
    for src, tgt in task.train + task.valid:
        found = parse_date(src)
        assert len(set(found.values())) == 1, (src, found)          # unambiguous
        d = next(iter(found.values()))
        assert tgt == datetime(d.year, d.month, d.day).isoformat()[:10] and 1950 <= d.year <= 2049
        assert len(src) <= 33
        used |= set(found)
        if any(c.isalpha() for c in src):
            cases.add("lower" if src == src.lower() else "upper" if src == src.upper() else "mixed")
    assert used == set(DATE_FORMATS) and cases == {"lower", "upper", "mixed"}


# ---- numbers: hand-written cases and an independent words -> int reader
WORDS = {0: "zero", 7: "seven", 15: "fifteen", 40: "forty", 100: "one hundred",
         101: "one hundred and one", 1000: "one thousand", 1100: "one thousand, one hundred",
         20017: "twenty thousand and seventeen", 110000: "one hundred and ten thousand",
         412305: "four hundred and twelve thousand, three hundred and five",
         999999: "nine hundred and ninety-nine thousand, nine hundred and ninety-nine"}
SMALL = dict(zip("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
                 "fifteen sixteen seventeen eighteen nineteen".split(), range(20)))
SMALL.update(zip("twenty thirty forty fifty sixty seventy eighty ninety".split(), range(20, 100, 10)))


def read_words(text):
    total = part = 0
    for w in text.replace(",", " ").replace("-", " ").split():
        if w == "thousand":
            total, part = part * 1000, 0
        elif w == "hundred":
            part *= 100
        elif w != "and":
            part += SMALL[w]
    return total + part


@pytest.mark.parametrize("n, words", sorted(WORDS.items()))
def test_number_words_hand_written(n, words):
    assert number_to_words(n) == words and read_words(words) == n


def test_numbers_task_words_read_back_to_the_digits():
    task = get_task("numbers", seed=2, n_train=2000, n_valid=200)
    values = [int(t) for _, t in task.train]
    assert all(read_words(s) == int(t) and t == str(int(t)) for s, t in task.train + task.valid)
    assert min(values) < 10 and max(values) > 100_000         # every digit count is drawn
    small = get_task("numbers", seed=0, n_train=8, n_valid=3, max_value=10)
    assert {int(t) for _, t in small.train + small.valid} <= set(range(11))


@pytest.mark.parametrize("name", ["copy", "reverse"])
def test_copy_and_reverse_targets(name):
    task = get_task(name, seed=1, n_train=300, n_valid=50, alphabet="xyz#", min_len=2, max_len=6)
    assert task.src_vocab is task.tgt_vocab and task.src_vocab.symbols == tuple("xyz#")
    for s, t in task.train + task.valid:
        assert 2 <= len(s) <= 6 and set(s) <= set("xyz#")
        assert t == (s if name == "copy" else "".join(reversed(s)))


def test_an_exhausted_source_space_is_drawn_completely():
    task = get_task("copy", seed=0, n_train=4, n_valid=2, alphabet="ab", max_len=2)
    assert sorted(s for s, _ in task.train + task.valid) == ["a", "aa", "ab", "b", "ba", "bb"]


@pytest.mark.parametrize("name", sorted(TASKS))
def test_determinism_and_disjoint_splits(name):
    a, b, c = (get_task(name, seed=s, n_train=120, n_valid=40) for s in (7, 7, 8))
    assert a.train == b.train and a.valid == b.valid and a.train != c.train and a.valid != c.valid
    sources = [s for s, _ in a.train + a.valid]
    assert len(set(sources)) == len(sources) == 160
    assert not {s for s, _ in a.train} & {s for s, _ in a.valid}
    assert get_task(name, seed=7, n_train=60, n_valid=40).valid == a.valid   # valid ignores n_train
    assert a.config == {**a.config, "name": name, "seed": 7, "n_train": 120, "n_valid": 40}
    assert get_task(**a.config).train == a.train


def test_default_sizes_of_the_dates_task():
    task = get_task("dates")
    assert (len(task.train), len(task.valid)) == (20_000, 1_000) and task.max_tgt_len == 11
    assert task.max_src_len <= 33 and task.tgt_vocab.symbols == tuple("0123456789-")


# ---- batches: layout checked against a plain loop
TASK = get_task("reverse", seed=3, n_train=61, n_valid=9, max_len=7)
NUMBERS = get_task("numbers", seed=3, n_train=30, n_valid=5)


def expected_batch(task, pairs):
    sv, tv = task.src_vocab, task.tgt_vocab
    S, T = max(len(s) for s, _ in pairs), max(len(t) for _, t in pairs) + 1
    src, tin, tout = (np.zeros((len(pairs), n), np.int64) for n in (S, T, T))   # pad id is 0
    for b, (s, t) in enumerate(pairs):
        src[b, :len(s)] = [4 + sv.symbols.index(c) for c in s]
        ids = [4 + tv.symbols.index(c) for c in t]
        tin[b, :len(t) + 1] = [1] + ids
        tout[b, :len(t) + 1] = ids + [2]
    return src, src == 0, tin, tout, tin == 0


@given(batch_size=st.integers(1, 7), shuffle=st.booleans(), seed=st.integers(0, 2**16),
       task=st.sampled_from([TASK, NUMBERS]), split=st.sampled_from(["train", "valid"]))
def test_batch_layout_padding_masks_bos_and_eos(batch_size, shuffle, seed, task, split):
    before = list(task.split(split))
    batches = list(task.batches(split, batch_size, shuffle=shuffle, rng=np.random.default_rng(seed)))
    assert len(batches) == task.num_batches(split, batch_size) == -(-len(before) // batch_size)
    seen = []
    for bt in batches:
        pairs = list(zip(bt.src_text, bt.tgt_text))
        for got, want in zip(bt[:5], expected_batch(task, pairs)):
            assert got.dtype == want.dtype and got.dtype in (np.int64, bool)
            np.testing.assert_array_equal(got, want)
        seen += pairs
    assert seen == before if not shuffle else sorted(seen) == sorted(before)
    assert task.split(split) == before                             # nothing was mutated


def test_shuffle_order_follows_the_rng_and_drop_last():
    def order(seed):
        return [b.src_text for b in TASK.batches("train", 8, shuffle=True, rng=np.random.default_rng(seed))]
    assert order(1) == order(1) != order(2)
    sizes = [len(b.src) for b in TASK.batches("train", 8, drop_last=True)]
    assert sizes == [8] * 7 and TASK.num_batches("train", 8, drop_last=True) == 7


def test_batches_are_fresh_arrays():
    first = next(TASK.batches("train", 4))
    first.src[:] = 99
    first.tgt_out[:] = 99
    again = next(TASK.batches("train", 4))
    np.testing.assert_array_equal(again.src, expected_batch(TASK, TASK.train[:4])[0])
    assert not (again.tgt_out == 99).any()


def test_encode_batch_and_sources_for_new_inputs():
    bt = TASK.encode_batch([("ab?", "x"), ("c", "")])
    np.testing.assert_array_equal(bt.src, [[4, 5, 3], [6, 0, 0]])          # ? -> <unk>
    np.testing.assert_array_equal(bt.tgt_in, [[1, 3], [1, 0]])
    np.testing.assert_array_equal(bt.tgt_out, [[3, 2], [2, 0]])
    src, mask = TASK.encode_sources(["abc", "a"])
    np.testing.assert_array_equal(mask, [[False] * 3, [False, True, True]])
    assert src.dtype == np.int64 and TASK.max_src_len == 7 and TASK.max_tgt_len == 8


def test_seq2seq_task_from_own_pairs_shares_the_vocab():
    v = CharVocab("ab")
    task = Seq2SeqTask("mine", [("a", "b"), ["ab", "ba"]], [("b", "")], v)
    assert task.tgt_vocab is v and task.train == [("a", "b"), ("ab", "ba")]
    assert repr(task) == "Seq2SeqTask('mine', train=2, valid=1, src_vocab=6, tgt_vocab=6)"


@pytest.mark.parametrize("args, exc, match", [
    (([("a", "b")], [("a", "a")]), ValueError, "1 source.* in both train and valid"),
    (([], [("a", "a")]), ValueError, "train: expected at least one"),
    (([("", "a")], [("a", "a")]), ValueError, "empty source"),
    (([("ac", "a")], [("a", "a")]), ValueError, "source characters 'c' are not in its vocabulary"),
    (([("a", "z")], [("b", "a")]), ValueError, "target characters 'z'"),
    ((["ab"], [("b", "a")]), TypeError, "pairs"),
    (([("a", 1)], [("b", "a")]), TypeError, "pairs"),
    (("ab", [("b", "a")]), TypeError, "list of .* pairs"),
])
def test_seq2seq_task_rejects_bad_pairs(args, exc, match):
    with pytest.raises(exc, match=match):
        Seq2SeqTask("bad", *args, CharVocab("ab"))
    with pytest.raises(TypeError, match="src_vocab: expected a CharVocab"):
        Seq2SeqTask("bad", [("a", "b")], [("b", "a")], "ab")


@pytest.mark.parametrize("call, exc, match", [
    (lambda: TASK.batches("test", 2), ValueError, "split: expected one of"),
    (lambda: TASK.batches("train", 0), ValueError, "batch_size: expected an int >= 1, got 0"),
    (lambda: TASK.batches("train", 2.0), TypeError, "batch_size: expected an int"),
    (lambda: TASK.batches("train", 2, shuffle=True), TypeError, "needs rng"),
    (lambda: TASK.batches("train", 2, shuffle=True, rng=3), TypeError, "numpy Generator"),
    (lambda: TASK.encode_sources("abc"), TypeError, "one str"),
    (lambda: TASK.encode_batch([]), ValueError, "at least one"),
    (lambda: get_task("sort"), ValueError, "unknown task 'sort'"),
    (lambda: get_task("dates", max_len=3), TypeError, r"unexpected option\(s\) \['max_len'\].*no options"),
    (lambda: get_task("copy", n_train=0), ValueError, "n_train: expected an int >= 1, got 0"),
    (lambda: get_task("copy", n_valid=True), TypeError, "n_valid: expected an int"),
    (lambda: get_task("copy", seed=-1), ValueError, "seed"),
    (lambda: get_task("copy", alphabet="aba"), ValueError, "distinct characters"),
    (lambda: get_task("copy", alphabet=""), ValueError, "non-empty"),
    (lambda: get_task("copy", min_len=3, max_len=2), ValueError, r"max_len: expected an int >= 3, got 2"),
    (lambda: get_task("copy", alphabet="ab", max_len=2, n_train=6, n_valid=1), ValueError,
     "only 6 distinct sources .* 7 were asked for"),
    (lambda: get_task("numbers", max_value=10**6), ValueError, "max_value"),
    (lambda: format_date(date(2000, 1, 1), "MM-DD"), ValueError, "unknown date format"),
    (lambda: number_to_words(1_000_000), ValueError, "0 <= n <= 999999"),
    (lambda: number_to_words(-1), ValueError, "0 <= n <= 999999"),
    (lambda: number_to_words(2.0), TypeError, "expected an int"),
    (lambda: number_to_words(True), TypeError, "expected an int"),
])
def test_bad_arguments_raise_clear_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_exact_match():
    assert exact_match(["2000-01-01", "1999-12-31"], ["2000-01-01", "1999-12-30"]) == 0.5
    assert exact_match(("a",), ["a"]) == 1.0 and exact_match(["A "], ["a"]) == 0.0
    with pytest.raises(ValueError, match="2 predictions but 1 targets"):
        exact_match(["a", "b"], ["a"])
    with pytest.raises(ValueError, match="no predictions"):
        exact_match([], [])
    with pytest.raises(TypeError, match="expected strings"):
        exact_match([1], ["1"])
