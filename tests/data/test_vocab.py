"""CharVocab (ids, encode/decode, checkpoint dicts) and the char-level LM data (CharLMData, load_corpus)."""
import json

import numpy as np
import pytest
from hypothesis import given, strategies as st

from npformer.data import BOS_ID, EOS_ID, PAD_ID, SPECIALS, UNK_ID, CharLMData, CharVocab, load_corpus
from npformer.errors import InputTypeError, RangeError, ShapeError

ALPHABET = "abcxyz .,é日"


def test_special_ids_are_fixed_and_symbols_follow_in_order():
    v = CharVocab("cab")
    assert (v.pad_id, v.bos_id, v.eos_id, v.unk_id) == (PAD_ID, BOS_ID, EOS_ID, UNK_ID) == (0, 1, 2, 3)
    assert len(v) == 7 and v.symbols == ("c", "a", "b")
    assert v.encode("abc") == [5, 6, 4]
    assert v.encode("ab", add_bos=True, add_eos=True) == [1, 5, 6, 2]
    assert v.decode([0, 1, 2, 3], strip_special=False) == "".join(SPECIALS) == "<pad><bos><eos><unk>"


def test_duplicates_keep_their_first_id_and_from_texts_sorts():
    assert CharVocab("abca").symbols == ("a", "b", "c")
    assert CharVocab.from_texts(["ba", "ca", ""]).symbols == ("a", "b", "c")
    assert CharVocab.from_texts("hello") == CharVocab("ehlo")
    assert CharVocab("") == CharVocab([]) and len(CharVocab()) == 4
    assert CharVocab("ab") == CharVocab(["a", "b"]) != CharVocab("ba")
    assert hash(CharVocab("ab")) == hash(CharVocab(("a", "b"))) and "a" in CharVocab("ab")


@given(text=st.text(alphabet=ALPHABET + "QZ€\n", max_size=30))
def test_round_trip_with_unknown_characters(text):
    v = CharVocab(ALPHABET)
    ids = v.encode(text)
    expected_ids = [4 + ALPHABET.index(c) if c in ALPHABET else 3 for c in text]   # reference loop
    assert ids == expected_ids
    assert v.decode(ids) == "".join(c if c in ALPHABET else "<unk>" for c in text)
    assert v.decode(v.encode(text, add_bos=True, add_eos=True)) == v.decode(ids)


def test_decode_strips_pad_bos_and_stops_at_the_first_eos():
    v = CharVocab("abc")
    ids = [1, 4, 0, 5, 2, 6, 2, 0]
    assert v.decode(ids) == "ab"
    assert v.decode(ids, strip_special=False) == "<bos>a<pad>b<eos>c<eos><pad>"
    assert v.decode([3, 4]) == "<unk>a" and v.decode([]) == "" and v.decode([2, 4]) == ""


def test_decode_takes_numpy_arrays_including_non_contiguous_views_and_does_not_mutate():
    v = CharVocab("abc")
    grid = np.array([[4, 1], [5, 1], [6, 2]], dtype=np.int32)   # column 0 is a strided view
    before = grid.copy()
    assert not grid.T[0].flags.c_contiguous and v.decode(grid.T[0]) == "abc"
    assert v.decode(np.array([4, 5], dtype=np.uint8)) == "ab" and v.decode(np.array([], np.int64)) == ""
    np.testing.assert_array_equal(grid, before)
    ids = [4, 5]
    v.decode(ids)
    assert ids == [4, 5]


def test_to_dict_is_json_and_round_trips():
    v = CharVocab("zé日 ab")
    d = json.loads(json.dumps(v.to_dict()))
    assert d == {"kind": "char", "specials": list(SPECIALS), "symbols": list("zé日 ab")}
    w = CharVocab.from_dict(d)
    assert w == v and w.encode("ab日?") == v.encode("ab日?")


@pytest.mark.parametrize("bad, exc, match", [
    (lambda: CharVocab(["ab"]), RangeError, "exactly 1 character"),
    (lambda: CharVocab([1]), InputTypeError, "1-character str"),
    (lambda: CharVocab(5), InputTypeError, "iterable of 1-character"),
    (lambda: CharVocab.from_texts(["a", 1]), InputTypeError, "expected strings"),
    (lambda: CharVocab("a").encode(b"a"), InputTypeError, "expected a str"),
    (lambda: CharVocab("a").decode([5]), RangeError, "id 5 is out of range .* size 5"),
    (lambda: CharVocab("a").decode([-1]), RangeError, "out of range"),
    (lambda: CharVocab("a").decode([1.0]), InputTypeError, "integer ids"),
    (lambda: CharVocab("a").decode(np.array([True])), InputTypeError, "integer ids"),
    (lambda: CharVocab("a").decode([[1]]), ShapeError, "1-d"),
    (lambda: CharVocab("a").decode([1, 10**30]), RangeError, r"id 10{30} is out of range .* size 5"),
    (lambda: CharVocab("a").decode([True, False]), InputTypeError, "integer ids"),
    (lambda: CharVocab("a").decode(None), InputTypeError, "expected a list of ints .* got NoneType"),
    (lambda: CharVocab("a").decode("ab"), InputTypeError, "expected a list of ints .* got str"),
    (lambda: CharVocab.from_dict([]), InputTypeError, "expected a dict"),
    (lambda: CharVocab.from_dict({"kind": "bpe", "specials": list(SPECIALS), "symbols": []}), RangeError, "kind"),
    (lambda: CharVocab.from_dict({"kind": "char", "specials": ["<pad>"], "symbols": []}), RangeError, "specials"),
    (lambda: CharVocab.from_dict({"kind": "char", "specials": list(SPECIALS)}), RangeError, "no 'symbols'"),
    (lambda: CharVocab.from_dict({"kind": "char", "specials": list(SPECIALS), "symbols": ["a", "a"]}),
     RangeError, "duplicate"),
])
def test_bad_inputs_raise_clear_errors(bad, exc, match):
    """npformer's own classes (an id beyond the vocabulary is a RangeError, a float id an
    InputTypeError); each is also the built-in ValueError or TypeError that callers catch."""
    with pytest.raises(exc, match=match) as info:
        bad()
    assert isinstance(info.value, ValueError if exc in (RangeError, ShapeError) else TypeError)


# ---- CharLMData / load_corpus
TEXT = "".join(np.random.default_rng(0).choice(list("abcdefghijklmnop \n"), size=600))


def test_split_by_position_and_vocab_from_the_whole_text():
    d = CharLMData(TEXT, block_size=8, valid_fraction=0.25)
    assert d.vocab == CharVocab.from_texts(TEXT) and d.vocab_size == len(set(TEXT)) + 4
    assert len(d.train_ids) == int(600 * 0.75) == 450 and len(d.valid_ids) == 150
    np.testing.assert_array_equal(np.concatenate([d.train_ids, d.valid_ids]), d.vocab.encode(TEXT))
    assert d.train_ids.dtype == np.int64 and not d.train_ids.flags.writeable


@pytest.mark.parametrize("split", ["train", "valid"])
def test_random_batch_y_is_x_shifted_by_one_and_windows_come_from_the_split(split):
    d = CharLMData(TEXT, block_size=8, valid_fraction=0.25, seed=1)
    x, y = d.random_batch(split, 16)
    assert x.shape == y.shape == (16, 8) and x.dtype == y.dtype == np.int64
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    part = TEXT[:450] if split == "train" else TEXT[450:]
    for row_x, row_y in zip(x, y):
        assert d.vocab.decode(row_x) + d.vocab.decode(row_y)[-1] in part
    assert not np.shares_memory(x, y) and not np.shares_memory(x, d.ids(split))


def test_random_batch_determinism():
    a, b, c = (CharLMData(TEXT, block_size=8, seed=s) for s in (3, 3, 4))
    xa, xb, xc = a.random_batch("train", 8)[0], b.random_batch("train", 8)[0], c.random_batch("train", 8)[0]
    assert np.array_equal(xa, xb) and not np.array_equal(xa, xc)
    x1, _ = a.random_batch("train", 8, np.random.default_rng(9))
    x2, _ = c.random_batch("train", 8, np.random.default_rng(9))
    assert np.array_equal(x1, x2)


def test_batches_in_order_cover_the_split_in_blocks():
    d = CharLMData(TEXT, block_size=7)
    out = list(d.batches("valid", 4))
    n = d.num_blocks("valid")
    assert n == (60 - 1) // 7 == 8 and [len(x) for x, _ in out] == [4, 4]
    x = np.concatenate([b[0] for b in out])
    y = np.concatenate([b[1] for b in out])
    np.testing.assert_array_equal(x.ravel(), d.valid_ids[:n * 7])
    np.testing.assert_array_equal(y.ravel(), d.valid_ids[1:n * 7 + 1])
    assert [len(x) for x, _ in d.batches("train", 5)][-1] == (539 // 7) % 5   # a smaller last batch


@given(seed=st.integers(0, 2**16), batch=st.integers(1, 9))
def test_shuffled_batches_are_one_offset_tiling_in_random_order(seed, batch):
    d = CharLMData(TEXT, block_size=6)
    ids = d.ids("train")
    rows = np.concatenate([x for x, _ in d.batches("train", batch, np.random.default_rng(seed))])
    tilings = [np.stack([ids[s:s + 6] for s in range(o, len(ids) - 6, 6)]) for o in range(6)]
    key = lambda a: sorted(map(tuple, a))   # noqa: E731
    assert any(len(t) == len(rows) and key(t) == key(rows) for t in tilings)


def test_load_corpus_shipped_and_from_a_file(tmp_path):
    text = load_corpus()
    assert isinstance(text, str) and 1000 < len(text.encode("utf-8")) < 100_000
    assert CharLMData(text, block_size=128).vocab_size > 30
    p = tmp_path / "mine.txt"
    p.write_text("ünïcode text\n", encoding="utf-8")
    assert load_corpus(p) == load_corpus(str(p)) == "ünïcode text\n"


def test_load_corpus_errors_name_the_path(tmp_path):
    with pytest.raises(ValueError, match="nope.txt.*does not exist"):
        load_corpus(tmp_path / "nope.txt")
    with pytest.raises(ValueError, match="is not a file"):
        load_corpus(tmp_path)
    (tmp_path / "empty.txt").write_text(" \n", encoding="utf-8")
    with pytest.raises(ValueError, match="empty.txt.*is empty"):
        load_corpus(tmp_path / "empty.txt")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="bin.txt.*not UTF-8"):
        load_corpus(tmp_path / "bin.txt")
    with pytest.raises(TypeError, match="str or pathlib.Path"):
        load_corpus(3)


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"text": b"abc", "block_size": 2}, TypeError, "expected a str"),
    ({"text": TEXT, "block_size": 0}, ValueError, "block_size: expected an int >= 1"),
    ({"text": TEXT, "block_size": 2.0}, TypeError, "block_size: expected an int"),
    ({"text": TEXT, "block_size": 4, "valid_fraction": 0.0}, ValueError, "strictly between 0 and 1"),
    ({"text": TEXT, "block_size": 4, "valid_fraction": 1}, ValueError, "strictly between 0 and 1"),
    ({"text": TEXT, "block_size": 60}, ValueError, r"valid split has 60 .* block_size \+ 1 = 61"),
    ({"text": "", "block_size": 1}, ValueError, "train split has 0 characters"),
    ({"text": TEXT, "block_size": 4, "seed": -1}, ValueError, "seed"),
])
def test_char_lm_data_bad_arguments(kwargs, exc, match):
    text = kwargs.pop("text")
    with pytest.raises(exc, match=match):
        CharLMData(text, **kwargs)


def test_char_lm_data_bad_call_arguments():
    d = CharLMData(TEXT, block_size=4)
    with pytest.raises(ValueError, match="split: expected one of"):
        d.batches("test", 2)
    with pytest.raises(ValueError, match="batch_size"):
        d.random_batch("train", 0)
    with pytest.raises(TypeError, match="numpy Generator"):
        d.batches("train", 2, rng=3)
