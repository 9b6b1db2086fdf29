"""``model.generate`` on the language models: GPT (key/value cache) and Transformer-XL (memory as the
cache). Greedy equals the arg-max of a full forward at each step; the cache and the memory give the
tokens a full rerun gives; sampling is seeded only by the generator passed in; bad arguments named."""
import numpy as np
import pytest

from npformer.backend import default_rng
from npformer.errors import InputTypeError, RangeError
from npformer.models import GPT, GPTConfig, TransformerXL, TransformerXLConfig

PROMPT = np.array([[4, 7, 1], [2, 2, 9]])


def _gpt(norm_first=True):
    cfg = GPTConfig(vocab_size=11, block_size=12, n_layer=2, n_head=2, d_model=8, norm_first=norm_first)
    return GPT(cfg, dtype="float64", rng=1)


def _xl(mem_len):
    cfg = TransformerXLConfig(vocab_size=11, n_layer=2, n_head=2, d_model=8, dim_feedforward=16, mem_len=mem_len)
    return TransformerXL(cfg, dtype="float64", rng=2)


def _greedy_by_hand(forward, idx, n):
    for _ in range(n):
        idx = np.concatenate([idx, forward(idx)[:, -1].argmax(-1)[:, None]], axis=1)
    return idx


@pytest.mark.parametrize("norm_first", [True, False])
def test_gpt_greedy_is_the_argmax_with_and_without_the_cache(norm_first):
    model = _gpt(norm_first)
    model.train()                                                # generate runs in eval mode and restores it
    cached = model.generate(PROMPT, 6, temperature=0)
    assert model.training and cached.shape == (2, 9) and (cached[:, :3] == PROMPT).all()
    np.testing.assert_array_equal(model.generate(PROMPT, 6, temperature=0, use_cache=False), cached)
    model.eval()
    np.testing.assert_array_equal(_greedy_by_hand(model, PROMPT, 6), cached)
    past = model.generate(PROMPT, 14, temperature=0)              # past block_size=12: the context slides
    np.testing.assert_array_equal(past[:, :9], cached)


def test_gpt_sampling_is_seeded_by_the_generator_passed():
    model = _gpt()
    a = model.generate(PROMPT, 8, rng=default_rng(5, "numpy"), temperature=1.0, top_k=5, top_p=0.9)
    b = model.generate(PROMPT, 8, rng=default_rng(5, "numpy"), temperature=1.0, top_k=5, top_p=0.9)
    c = model.generate(PROMPT, 8, rng=default_rng(6, "numpy"), temperature=1.0, top_k=5, top_p=0.9)
    np.testing.assert_array_equal(a, b)
    assert (a != c).any() and ((a >= 0) & (a < 11)).all()
    one = model.generate(PROMPT, 8, rng=default_rng(5, "numpy"), top_k=1)   # top-1 sampling is greedy
    np.testing.assert_array_equal(one, model.generate(PROMPT, 8, temperature=0))


def test_excluded_tokens_are_never_drawn():
    """``exclude``: those ids never come, sampled or greedy, with the cache or without; the draws of
    the others are seeded as before (the same generator gives the same tokens)."""
    model, rng = _gpt(), lambda: default_rng(3, "numpy")
    free = model.generate(PROMPT, 10, rng=rng(), temperature=2.0)
    assert np.isin(free[:, 3:], [0, 1, 2, 3]).any()             # an untrained model draws them freely
    for use_cache in (True, False):
        out = model.generate(PROMPT, 10, rng=rng(), temperature=2.0, exclude=range(4), use_cache=use_cache)
        assert not np.isin(out[:, 3:], [0, 1, 2, 3]).any()
        for same in ([3, 2, 1, 0], np.arange(4)):                # any iterable of ids, in any order
            np.testing.assert_array_equal(out, model.generate(PROMPT, 10, rng=rng(), temperature=2.0,
                                                              exclude=same, use_cache=use_cache))
    greedy = model.generate(PROMPT, 6, temperature=0)
    first = int(greedy[0, 3])
    assert model.generate(PROMPT, 6, temperature=0, exclude=[first])[0, 3] != first
    only = model.generate(PROMPT, 5, rng=rng(), temperature=1.0, exclude=[i for i in range(11) if i != 7])
    assert (only[:, 3:] == 7).all()
    with pytest.raises(RangeError, match=r"exclude: token id 11 is outside the vocabulary of 11 \(ids 0..10\)"):
        model.generate(PROMPT, 2, temperature=0, exclude=[11])
    with pytest.raises(RangeError, match="exclude: all 11 tokens of the vocabulary are excluded"):
        model.generate(PROMPT, 2, temperature=0, exclude=range(11))
    with pytest.raises(RangeError, match="exclude: a token id: expected an int >= 0, got -1"):
        model.generate(PROMPT, 2, temperature=0, exclude=[-1])
    # a single id, a string, a 0-d array: an InputTypeError (a TypeError), not "'int' object is not iterable"
    for one in (3, 3.0, "3", np.array(3)):
        with pytest.raises(InputTypeError, match=r"exclude: expected an iterable of token ids \(ints\), such as \[3\] "
                                                 r"or range\(4\), or None, got "):
            model.generate(PROMPT, 2, temperature=0, exclude=one)


def test_generate_names_bad_arguments():
    model = _gpt()
    with pytest.raises(RangeError, match="sampling .temperature > 0. needs a seeded generator"):
        model.generate(PROMPT, 3)
    with pytest.raises(RangeError, match="max_new_tokens: expected an int >= 0, got -1"):
        model.generate(PROMPT, -1, temperature=0)
    with pytest.raises(RangeError, match="temperature"):
        model.generate(PROMPT, 2, rng=default_rng(0, "numpy"), temperature=-1.0)
    with pytest.raises(RangeError, match="sampling .temperature > 0. needs a seeded generator"):
        _xl(4).generate(PROMPT, 3)
    np.testing.assert_array_equal(model.generate(PROMPT, 0, temperature=0), PROMPT)


def test_transformer_xl_memory_gives_the_full_reruns_tokens():
    """With a memory longer than the whole text, a new token reads every earlier position from the
    memory: the same tokens as rerunning the whole sequence (mem_len 0) at each step."""
    model = _xl(mem_len=32)
    by_memory = model.generate(PROMPT, 7, temperature=0)
    np.testing.assert_array_equal(by_memory, model.generate(PROMPT, 7, temperature=0, mem_len=0))
    model.eval()
    np.testing.assert_array_equal(by_memory, _greedy_by_hand(lambda i: model(i, mem_len=0)[0], PROMPT, 7))
    a = model.generate(PROMPT, 5, rng=default_rng(1, "numpy"), temperature=0.8)
    np.testing.assert_array_equal(a, model.generate(PROMPT, 5, rng=default_rng(1, "numpy"), temperature=0.8))
    short = _xl(mem_len=2).generate(PROMPT, 4, temperature=0)       # a short memory: a short context
    assert short.shape == (2, 7)
