"""Whole-model gradient checks (float64) for Seq2Seq, GPT and BERT over their options, through the
real loss (cross-entropy with padding ignored), plus the key/value cache against the uncached forward."""
import numpy as np
import pytest
from hypothesis import strategies as st

from npformer.backend import get_backend
from npformer.errors import CallOrderError, InputTypeError, RangeError
from npformer.models.bert import BERT, BERTConfig
from npformer.models.decoding import beam_search, eval_mode, greedy_decode
from npformer.models.gpt import GPT, GPTConfig
from npformer.models.seq2seq import Seq2Seq, Seq2SeqConfig
from npformer.ops.cross_entropy import cross_entropy_backward, cross_entropy_forward
from npformer.tools.gradcheck import gradcheck_module
from tests.helpers import assert_gradcheck, given_per_backend, host, model_check, randn, seeds

PAD = 0


def _ids(xp, shape, vocab, seed, pad_tail=0):
    a = np.random.default_rng(seed).integers(1, vocab, size=shape)
    if pad_tail:
        a[-1, -pad_tail:] = PAD                            # padding at the end of the last row
    return xp.asarray(a)


def _unit_scale_embeddings(model, seed):
    """Redraw every embedding table N(0, 1). GPT/BERT start them at std 0.02, which puts a layer norm
    right after inputs of that scale: the function then bends on a length scale of ~1e-3, where
    eps = 1e-4 is no longer small (measured: the stencil's h^4 error gave rel 1e-6 at eps 1e-4 and
    1e-10 at 1e-5 on BERT's token-type table). The gradient's correctness does not depend on the scale."""
    rng = np.random.default_rng(seed)
    xp = get_backend(model.backend)
    for name, p in model.named_parameters():              # tied tables are one Parameter: drawn once
        if "embeddings" in name or name.startswith(("wte", "wpe")):
            p.data = xp.asarray(rng.standard_normal(p.shape))
    return model


def _loss_forward(logits_fn, targets):
    """A forward that returns the mean cross-entropy (padding ignored), and the matching backward."""
    saved = {}

    def forward(m, **inputs):
        loss, cache = cross_entropy_forward(logits_fn(m, **inputs), targets, ignore_index=PAD,
                                            label_smoothing=0.1)
        saved["cache"] = cache
        return loss

    def backward(m, dloss):
        m.backward(cross_entropy_backward(dloss, saved["cache"]))
        return ()
    return forward, backward


@given_per_backend(seed=seeds, norm_first=st.booleans(), tie=st.booleans(),
                   activation=st.sampled_from(["gelu_tanh", "gelu"]), s=st.integers(2, 5), t=st.integers(2, 5),
                   positional=st.sampled_from(["sinusoidal", "learned"]), share=st.booleans())
def test_seq2seq_gradcheck(xp, seed, norm_first, tie, activation, s, t, positional, share):
    # smooth activations only: see test_full_transformer_gradcheck_with_float_mask on ReLU kinks
    v = 7 if share else 6                                # share: one vocabulary, one embedding for both sides
    cfg = Seq2SeqConfig(src_vocab_size=7, tgt_vocab_size=v, d_model=4, nhead=2, num_encoder_layers=1,
                        num_decoder_layers=2, dim_feedforward=6, dropout=0.1, activation=activation,
                        norm_first=norm_first, max_len=8, tie_embeddings=tie, positional=positional,
                        share_embeddings=share)
    model = Seq2Seq(cfg, dtype="float64", backend=xp.__name__, rng=seed)
    src, tgt_in = _ids(xp, (2, s), 7, seed, pad_tail=1), _ids(xp, (2, t), v, seed + 1, pad_tail=1)
    tgt_out = _ids(xp, (2, t), v, seed + 2, pad_tail=1)
    fwd, bwd = _loss_forward(lambda m, src, tgt_in: m(src, tgt_in), tgt_out)
    report = gradcheck_module(model, {"src": src, "tgt_in": tgt_in}, forward=fwd, backward=bwd,
                              dropout_seed=seed, seed=seed, **model_check(xp, v))
    assert_gradcheck(report)


def test_whole_model_checks_run_every_example_on_numpy_and_fewer_on_cupy():
    """given_per_backend: the profile's examples on NumPy, CUPY_MODEL_EXAMPLES on CuPy (a stand-in
    module named cupy: the count, not the GPU, is what is tested)."""
    from types import SimpleNamespace

    from hypothesis import settings
    from tests.helpers import CUPY_MODEL_EXAMPLES
    seen = []

    @given_per_backend(n=st.integers(0, 10**6))
    def check(xp, n):
        seen.append(xp.__name__)
    for name in ("numpy", "cupy"):
        check(SimpleNamespace(__name__=name))
    assert seen.count("numpy") == settings.default.max_examples > CUPY_MODEL_EXAMPLES == seen.count("cupy")


def test_a_shared_embedding_gets_the_sum_of_the_source_and_target_gradients(xp):
    """Three-way sharing (section 3.4): the one embedding's gradient is the sum of what an unshared
    model with the same weights gives its source embedding and its target embedding (with the tied
    head's part inside the latter)."""
    kw = dict(src_vocab_size=9, tgt_vocab_size=9, d_model=8, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
              dim_feedforward=16, dropout=0.0, max_len=8)
    shared = Seq2Seq(Seq2SeqConfig(**kw, share_embeddings=True), dtype="float64", backend=xp.__name__, rng=0)
    apart = Seq2Seq(Seq2SeqConfig(**kw), dtype="float64", backend=xp.__name__, rng=0)
    assert shared.src_embed is shared.tgt_embed and shared.generator.weight is shared.tgt_embed.weight
    assert shared.num_parameters() == apart.num_parameters() - 9 * 8
    state = {k: v for k, v in shared.state_dict().items()}
    apart.load_state_dict(state)                          # both of its embeddings get the shared table
    src, tgt = _ids(xp, (2, 5), 9, 1, pad_tail=1), _ids(xp, (2, 4), 9, 2, pad_tail=1)
    for m in (shared, apart):
        m.zero_grad()
        logits = m(src, tgt)
        m.backward(xp.ones_like(logits) / logits.size)
    np.testing.assert_allclose(host(shared.tgt_embed.weight.grad),
                               host(apart.src_embed.weight.grad + apart.tgt_embed.weight.grad), rtol=1e-12, atol=1e-15)
    np.testing.assert_array_equal(host(shared(src, tgt)), host(apart(src, tgt)))


def _transformer_parameters(v: int, d: int, ff: int, layers: int) -> int:
    """Parameters of Table 3's architecture with one shared V x d embedding (the output projection
    tied to it), biases everywhere, and torch.nn.Transformer's final norm on each stack: per encoder
    layer attention (4 d^2 + 4 d), feed-forward (2 d ff + ff + d), two norms (4 d); per decoder layer
    two attentions, the feed-forward and three norms."""
    encoder = 4 * d * d + 4 * d + 2 * d * ff + ff + d + 4 * d
    decoder = 8 * d * d + 8 * d + 2 * d * ff + ff + d + 6 * d
    return v * d + layers * (encoder + decoder) + 4 * d


def test_the_paper_sizes_have_table_3s_parameter_counts():
    """Base: 63,084,544 parameters against the paper's rounded 65M; big: 214,249,472 against 213M.
    The architecture's count (below) is exact; the paper does not say how it counted, and no one
    vocabulary size closes both gaps (base would need about 40,700 tokens, big about 35,800), so the
    difference is the paper's rounding and counting, not a missing piece: without the three-way
    sharing, base would have 82.0M."""
    base = Seq2SeqConfig.paper("base")
    assert (base.d_model, base.nhead, base.num_encoder_layers, base.dim_feedforward) == (512, 8, 6, 2048)
    assert base.share_embeddings and base.tie_embeddings and base.src_vocab_size == base.tgt_vocab_size == 37000
    assert Seq2Seq(base, dtype="float32", rng=0).num_parameters() == _transformer_parameters(37000, 512, 2048, 6) \
        == 63_084_544
    small = Seq2SeqConfig.paper("big", vocab_size=50, d_model=32, nhead=4, dim_feedforward=64, num_encoder_layers=2,
                                num_decoder_layers=2)
    assert Seq2Seq(small, rng=0).num_parameters() == _transformer_parameters(50, 32, 64, 2)
    big = Seq2SeqConfig.paper("big")
    assert (big.d_model, big.nhead, big.dim_feedforward, big.dropout) == (1024, 16, 4096, 0.3)
    assert _transformer_parameters(37000, 1024, 4096, 6) == 214_249_472      # (not built here: 860 MB)
    assert abs(63_084_544 - 65e6) / 65e6 < 0.03 and abs(214_249_472 - 213e6) / 213e6 < 0.01
    with pytest.raises(RangeError, match="share_embeddings: one embedding for source and target needs one vocab"):
        Seq2SeqConfig(src_vocab_size=5, tgt_vocab_size=6, share_embeddings=True)


@given_per_backend(seed=seeds, norm_first=st.booleans(), tie=st.booleans(), t=st.integers(1, 6))
def test_gpt_gradcheck(xp, seed, norm_first, tie, t):
    cfg = GPTConfig(vocab_size=7, block_size=8, n_layer=2, n_head=2, d_model=4, dropout=0.1,
                    norm_first=norm_first, tie_embeddings=tie)
    model = _unit_scale_embeddings(GPT(cfg, dtype="float64", backend=xp.__name__, rng=seed), seed)
    idx, targets = _ids(xp, (2, t), 7, seed), _ids(xp, (2, t), 7, seed + 1)
    fwd, bwd = _loss_forward(lambda m, idx: m(idx), targets)
    report = gradcheck_module(model, {"idx": idx}, forward=fwd, backward=bwd, dropout_seed=seed,
                              seed=seed, **model_check(xp, 6))
    assert_gradcheck(report)


@given_per_backend(seed=seeds, mlm=st.booleans(), t=st.integers(2, 6))
def test_bert_gradcheck_all_outputs(xp, seed, mlm, t):
    cfg = BERTConfig(vocab_size=9, hidden_size=4, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=6, max_position_embeddings=8, dropout=0.1, mlm_head=mlm)
    model = _unit_scale_embeddings(BERT(cfg, dtype="float64", backend=xp.__name__, rng=seed), seed)
    ids = _ids(xp, (2, t), 9, seed, pad_tail=1)
    segments = xp.asarray((np.arange(t) >= t // 2).astype(np.int64)[None].repeat(2, 0))
    # padded positions are left out of the scalar: the padding row of the word table gets no
    # gradient by definition (as torch), so its influence must not reach the checked output
    keep = (ids != PAD)[..., None].astype(xp.float64)                            # (B, T, 1)
    w_h, w_p = randn(xp, (2, t, 4), seed + 3) * keep, randn(xp, (2, 4), seed + 4)

    # a scalar mixing all three outputs, so every path is checked
    def fwd2(m, ids):
        h, pooled = m(ids, segments)
        parts = [(h * w_h).sum(), (pooled * w_p).sum()]
        if mlm:
            logits = m.mlm_logits(h)
            fwd2.logits = logits
            parts.append((logits * logits * keep).sum() * 0.1)
        return sum(parts)

    def bwd2(m, d):
        dml = 0.2 * fwd2.logits * keep * d if mlm else None
        m.backward(dhidden=w_h * d, dpooled=w_p * d, dmlm_logits=dml)
        return ()
    report = gradcheck_module(model, {"ids": ids}, forward=fwd2, backward=bwd2, dropout_seed=seed,
                              seed=seed, **model_check(xp, 6))
    assert_gradcheck(report)


def test_seq2seq_kv_cache_matches_uncached_decoder(xp):
    cfg = Seq2SeqConfig(src_vocab_size=9, tgt_vocab_size=9, d_model=8, nhead=2, dim_feedforward=16,
                        num_encoder_layers=2, num_decoder_layers=2, max_len=16)
    for norm_first in (False, True):
        model = Seq2Seq(Seq2SeqConfig(**{**cfg.to_dict(), "norm_first": norm_first}),
                        backend=xp.__name__, rng=0)
        src, tgt = _ids(xp, (3, 6), 9, 1, pad_tail=2), _ids(xp, (3, 7), 9, 2)
        with eval_mode(model):
            memory, src_pad = model.encode(src)
            full = model.decode(tgt, memory, src_pad)                     # (B, T, V)
            cache = model.new_cache()
            steps = [model.decode(tgt[:, i:i + 1], memory, src_pad, kv_cache=cache) for i in range(7)]
        np.testing.assert_allclose(host(xp.concatenate(steps, axis=1)), host(full),
                                   rtol=0, atol=1e-6)
        a = greedy_decode(model, src, bos_id=1, eos_id=2, max_len=6)
        b = greedy_decode(model, src, bos_id=1, eos_id=2, max_len=6, use_cache=False)
        assert a == b


def test_seq2seq_decoding_sees_the_same_prefix_with_and_without_the_cache(xp):
    """A generated prefix has no padding: the whole-prefix decode masked every pad_id token (one the
    model emitted, or bos_id == pad_id) while the cached one masked none, so greedy decoding gave
    [[], []] with the cache and [[], [1, 1, 1, 1]] without; beam search decoded the whole prefix."""
    cfg = Seq2SeqConfig(src_vocab_size=6, tgt_vocab_size=5, d_model=8, nhead=2, num_encoder_layers=1,
                        num_decoder_layers=1, dim_feedforward=16, dropout=0.0, max_len=6)
    model = Seq2Seq(cfg, backend=xp.__name__, rng=0)
    src = xp.asarray([[1, 2, 3], [4, 5, 0]])
    tgt = xp.asarray([[0, 3, 0, 1], [2, 0, 0, 3]])                       # pad_id 0 inside the prefix
    with eval_mode(model):
        memory, src_pad = model.encode(src)
        full = model.decode(tgt, memory, src_pad, tgt_padded=False)      # (B, T, V)
        cache = model.new_cache()
        steps = [model.decode(tgt[:, i:i + 1], memory, src_pad, kv_cache=cache) for i in range(4)]
    np.testing.assert_allclose(host(xp.concatenate(steps, axis=1)), host(full), rtol=0, atol=1e-6)
    for bos in (0, 1, 2, 3):
        cached = greedy_decode(model, src, bos_id=bos, eos_id=4, max_len=5)
        assert cached == greedy_decode(model, src, bos_id=bos, eos_id=4, max_len=5, use_cache=False)
        assert cached == beam_search(model, src, bos_id=bos, eos_id=4, max_len=5, beam_size=1, length_penalty=0.0)
        assert all(0 not in row for row in cached)                       # no pad_id in an output


def test_gpt_kv_cache_matches_uncached_forward(xp):
    for norm_first in (True, False):
        model = GPT(GPTConfig(vocab_size=11, block_size=16, n_layer=2, n_head=2, d_model=8,
                              norm_first=norm_first), backend=xp.__name__, rng=0)
        idx = _ids(xp, (2, 9), 11, 3)
        with eval_mode(model):
            full = model(idx)
            cache = model.new_cache()
            parts = [model(idx[:, :4], kv_cache=cache)]                   # a prompt, then one by one
            parts += [model(idx[:, i:i + 1], kv_cache=cache) for i in range(4, 9)]
        np.testing.assert_allclose(host(xp.concatenate(parts, axis=1)), host(full),
                                   rtol=0, atol=1e-6)


def test_beam_search_with_one_beam_equals_greedy(xp):
    model = Seq2Seq(Seq2SeqConfig(src_vocab_size=9, tgt_vocab_size=9, d_model=8, nhead=2,
                                  dim_feedforward=16, max_len=16), backend=xp.__name__, rng=0)
    src = _ids(xp, (3, 5), 9, 1)
    assert beam_search(model, src, bos_id=1, eos_id=2, max_len=6, beam_size=1, length_penalty=0.0) == \
        greedy_decode(model, src, bos_id=1, eos_id=2, max_len=6)
    wide = beam_search(model, src, bos_id=1, eos_id=2, max_len=6, beam_size=4)
    assert len(wide) == 3 and all(isinstance(r, list) for r in wide)


def test_beam_search_takes_any_finite_length_penalty(xp):
    """length_penalty=1e6 raised a bare OverflowError ((5 + n) / 6) ** alpha, -1e6 a ZeroDivisionError:
    the scores are compared in log space, which orders them as score / lp(n) does."""
    from npformer.models.decoding import _normalised
    hyps = [(-0.5, 1), (-2.0, 4), (-3.0, 6), (-1.2, 2), (0.0, 3), (-7.0, 9)]     # (log p, length)
    for alpha in (-2.0, -0.6, 0.0, 0.6, 1.0, 3.0):
        by_ratio = sorted(hyps, key=lambda h: h[0] / ((5 + h[1]) / 6) ** alpha)
        assert sorted(hyps, key=lambda h: _normalised(h[0], h[1], alpha)) == by_ratio
    assert _normalised(-1.0, 9, 1e6) > _normalised(-1e-3, 2, 1e6)              # the longer wins
    assert _normalised(-1e-3, 9, -1e6) < _normalised(-1.0, 2, -1e6)            # the shorter wins
    model = Seq2Seq(Seq2SeqConfig(src_vocab_size=6, tgt_vocab_size=5, d_model=8, nhead=2, num_encoder_layers=1,
                                  num_decoder_layers=1, dim_feedforward=16, dropout=0.0, max_len=6),
                    backend=xp.__name__, rng=0)
    src = xp.asarray([[1, 2, 3], [4, 5, 0]])
    for alpha in (1e6, -1e6, 1.7e308, -1.7e308):
        out = beam_search(model, src, bos_id=1, eos_id=4, max_len=3, length_penalty=alpha)
        assert len(out) == 2 and all(isinstance(t, int) for row in out for t in row)


def test_a_beam_wider_than_the_vocabulary_keeps_as_many_hypotheses_as_tokens(xp):
    """npformer translate --beam 99999999999 never returned: every step kept every candidate, V times
    the last step's. The beam is capped at V, as top-k sampling is: the same as beam_size=V."""
    model = Seq2Seq(Seq2SeqConfig(src_vocab_size=9, tgt_vocab_size=9, d_model=8, nhead=2,
                                  dim_feedforward=16, max_len=16), backend=xp.__name__, rng=0)
    src = _ids(xp, (2, 5), 9, 1)
    widths = []
    decode = model.decode

    def counted(tgt, *args, **kwargs):
        widths.append(tgt.shape[0])
        return decode(tgt, *args, **kwargs)
    model.decode = counted
    huge = beam_search(model, src, bos_id=1, eos_id=2, max_len=4, beam_size=99999999999)
    assert max(widths) <= 9
    assert huge == beam_search(model, src, bos_id=1, eos_id=2, max_len=4, beam_size=9)


def test_fill_mask_refuses_a_single_excluded_id(xp):
    """fill_mask(x, 3, exclude=3) raised a bare TypeError ('int' object is not iterable): exclude is a
    collection of ids, as its docstring says, and a single id is an InputTypeError naming it."""
    model = BERT(BERTConfig(vocab_size=9, hidden_size=4, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=8, mlm_head=True), backend=xp.__name__, rng=0)
    ids = xp.asarray([[1, 3, 2]])
    assert len(model.fill_mask(ids, 3, top_k=2, exclude=[3])) == 1
    with pytest.raises(InputTypeError, match=r"exclude: expected an iterable of token ids .* got int 3"):
        model.fill_mask(ids, 3, exclude=3)


def test_bert_backward_of_mlm_logits_never_called_is_refused_before_anything_is_popped(xp):
    """backward(dmlm_logits=...) when mlm_logits was never called popped the pooler's cache, then
    raised a plain RuntimeError: the model could no longer back-propagate its forward call."""
    model = BERT(BERTConfig(vocab_size=9, hidden_size=4, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=8, dropout=0.0, mlm_head=True), backend=xp.__name__, rng=0)
    ids = xp.asarray([[1, 3, 2]])
    hidden, pooled = model(ids)
    with pytest.raises(CallOrderError, match="dmlm_logits given, but mlm_logits has no call left"):
        model.backward(dmlm_logits=xp.ones((1, 3, 9), dtype=hidden.dtype))
    model.backward(dpooled=xp.ones_like(pooled))                        # the forward call is intact
    assert all(not mod._saved for mod in model.modules())
    with pytest.raises(CallOrderError, match="backward called more times than forward"):
        model.backward(dpooled=xp.ones_like(pooled))
    plain = BERT(BERTConfig(vocab_size=9, hidden_size=4, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=8), backend=xp.__name__, rng=0)
    hidden, pooled = plain(ids)
    with pytest.raises(RangeError, match="dmlm_logits: this BERT has no masked-LM head"):
        plain.backward(dmlm_logits=xp.ones((1, 3, 9), dtype=hidden.dtype))
    plain.backward(dhidden=xp.ones_like(hidden))


def test_model_input_errors(xp):
    model = GPT(GPTConfig(vocab_size=5, block_size=4, n_layer=1, n_head=1, d_model=4), backend=xp.__name__)
    with pytest.raises(ValueError, match="exceeds block_size=4"):
        model(xp.zeros((1, 5), dtype=xp.int64))
    with pytest.raises(TypeError, match="idx: expected an integer array"):
        model(xp.zeros((1, 3)))
    with pytest.raises(ValueError, match=r"idx: expected a 2-d array \(B, T\) of token ids"):
        model(xp.zeros((3,), dtype=xp.int64))
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 5\) .* got values from 7 to 7"):
        model(xp.full((1, 3), 7))


def test_sampling_temperature_top_k_top_p(xp):
    from npformer.backend import default_rng
    from npformer.models.decoding import sample_next
    logits = xp.log(xp.asarray([[0.5, 0.3, 0.15, 0.05]] * 4000))
    rng = default_rng(0, xp.__name__)
    freq = lambda ids: np.bincount(host(ids), minlength=4) / 4000   # noqa: E731
    np.testing.assert_allclose(freq(sample_next(logits, rng)), [0.5, 0.3, 0.15, 0.05], atol=0.03)
    assert (host(sample_next(logits, rng, temperature=0)) == 0).all()          # arg-max
    top2 = freq(sample_next(logits, rng, top_k=2))
    assert top2[2:].sum() == 0 and abs(top2[0] - 0.5 / 0.8) < 0.03
    nucleus = freq(sample_next(logits, rng, top_p=0.7))        # 0.5 + 0.3 reaches 0.7: two tokens
    assert nucleus[2:].sum() == 0 and abs(nucleus[0] - 0.625) < 0.03
    sharp = freq(sample_next(logits, rng, temperature=0.25))
    assert sharp[0] > 0.85
    with pytest.raises(ValueError, match=r"top_p: expected a finite number in \(0, 1\], got 0.0"):
        sample_next(logits, rng, top_p=0.0)
    with pytest.raises(ValueError, match="top_p: expected a finite number"):
        sample_next(logits, rng, temperature=0, top_p=1.5)     # checked even where it would not be used
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match="temperature: expected a finite number >= 0"):
            sample_next(logits, rng, temperature=bad)
    with pytest.raises(ValueError, match="logits: NaN or \\+inf"):
        sample_next(xp.full((2, 4), xp.nan), rng)              # no silent token 0
    with pytest.raises(ValueError, match="every token is -inf"):
        sample_next(xp.full((2, 4), -xp.inf), rng)


@pytest.mark.parametrize("temperature", [1e-300, 1e-308, 1e-320])
def test_sampling_at_a_tiny_temperature_is_the_arg_max(xp, temperature):
    """logits / temperature overflowed to inf for a temperature below about 1e-308 / max|logit|, the
    softmax gave NaN and the inverse CDF the wrong token; the row max is subtracted first, so only the
    largest logits keep any probability: the arg-max (tied maxima share it), -inf logits never drawn,
    with top-k and top-p too."""
    from npformer.backend import default_rng
    from npformer.models.decoding import sample_next
    logits = xp.asarray([[0.0, 5.0, 10.0, 1.0], [-xp.inf, 3.0, -2.0, 3.0], [-1e4, -2e4, -3e4, -xp.inf]] * 50,
                        dtype=xp.float32)
    rng = default_rng(0, xp.__name__)
    for kw in ({}, {"top_k": 2}, {"top_p": 0.9}):
        with np.errstate(over="ignore"):                     # (logits - max) / temperature: -inf, wanted
            ids = host(sample_next(logits, rng, temperature=temperature, **kw)).reshape(50, 3)
        assert (ids[:, 0] == 2).all() and (ids[:, 2] == 0).all()
        assert set(ids[:, 1]) == {1, 3}                      # the two tied maxima, each about half the time


def test_gpt_generate_with_and_without_cache_agree(xp):
    from npformer.backend import default_rng
    from npformer.models.decoding import generate
    model = GPT(GPTConfig(vocab_size=11, block_size=16, n_layer=2, n_head=2, d_model=8), backend=xp.__name__, rng=0)
    prompt = _ids(xp, (2, 3), 11, 1)
    a = generate(model, prompt, 8, default_rng(5, xp.__name__), temperature=0.9, top_k=5)
    b = generate(model, prompt, 8, default_rng(5, xp.__name__), temperature=0.9, top_k=5, use_cache=False)
    assert a.shape == (2, 11) and np.array_equal(host(a), host(b))


def test_gpt_draws_each_weight_once(monkeypatch):
    """No weight is drawn and thrown away: the values drawn at construction are exactly the
    embeddings and the layers' projection matrices (norms start at ones/zeros, biases at zero, the
    head is tied)."""
    from npformer.nn import init
    drawn = []
    for name in ("normal", "uniform"):
        real = getattr(init, name)

        def counting(shape, *a, _real=real, rng=None, **k):
            if rng is not init.DEFERRED:
                drawn.append(int(np.prod(shape)))
            return _real(shape, *a, rng=rng, **k)
        monkeypatch.setattr(init, name, counting)
    c = GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, d_model=8)
    model = GPT(c, rng=0)
    ff = 4 * c.d_model
    per_layer = 3 * c.d_model ** 2 + c.d_model ** 2 + 2 * c.d_model * ff
    assert sum(drawn) == (c.vocab_size + c.block_size) * c.d_model + c.n_layer * per_layer
    assert model.layers[0].linear1.weight.data.std() > 0.01     # and they were drawn, not left at zero


@pytest.mark.parametrize("tie", [True, False])
def test_gpt_head_and_loss_in_chunks_give_the_unfused_gradients(xp, tie):
    """hidden, head.cross_entropy (in chunks of 4 rows), backward_hidden: the loss and every gradient of
    forward, cross_entropy, backward (a tied head's weight gets both of its uses, as unfused)."""
    cfg = GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, d_model=8, dropout=0.0, tie_embeddings=tie)
    idx, targets = _ids(xp, (3, 5), 11, 0), _ids(xp, (3, 5), 11, 1, pad_tail=2)
    unfused, fused = (GPT(cfg, dtype="float64", backend=xp.__name__, rng=0) for _ in range(2))
    loss, cache = cross_entropy_forward(unfused(idx), targets, ignore_index=PAD)
    unfused.backward(cross_entropy_backward(xp.ones(()), cache))
    result = fused.head.cross_entropy(fused.hidden(idx), targets, ignore_index=PAD, chunk_rows=4)
    fused.backward_hidden(result.dx)
    np.testing.assert_allclose(host(result.loss), host(loss), rtol=1e-14)
    want, got = unfused.grads(), fused.grads()
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_allclose(host(got[name]), host(want[name]), rtol=1e-12, atol=1e-15, err_msg=name)
