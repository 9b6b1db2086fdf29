"""Bad input to the public API (ops, modules, models) gets npformer's own exception, naming what was
expected and what came: wrong ranks, shapes and dtypes, empty axes, zero or negative sizes,
out-of-range ids, non-finite scalars, and every backward's upstream gradient. Never a NumPy-internal
error, never silent acceptance. ``test_tally`` counts the table's cases by outcome (run with -s)."""
import collections
import math
import sys
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, strategies as st

from npformer import nn
from npformer.backend import bfloat16, default_rng
from npformer.errors import InputTypeError, MissingExtraError, NpformerError, RangeError, ShapeError
from npformer.models.bert import BERT, BERTConfig
from npformer.models.gpt import GPT, GPTConfig
from npformer.models.seq2seq import Seq2Seq, Seq2SeqConfig
from npformer.models.transformer_xl import TransformerXL, TransformerXLConfig
from npformer.ops import (activations, attention, batchnorm, cross_entropy, dropout, embedding, feedforward,
                          flash_attention, layernorm, linear, multihead, relative_attention, rnn, softmax)
from npformer.training.amp import DynamicLossScaler, MixedPrecision

F32 = np.float32
R = np.random.default_rng(0)


def a(*shape, dtype=F32):
    return R.standard_normal(shape).astype(dtype)


def ids(*shape, high=5):
    return R.integers(0, high, shape)


NON_FINITE = (math.nan, math.inf, -math.inf)

# -- every backward checks its upstream gradient -----------------------------------------------------
# name -> () -> (output, backward(dout)), float32 throughout
BACKWARDS = {
    "linear": lambda: _pair(linear.linear_forward(a(2, 3, 4), a(5, 4), a(5)), linear.linear_backward),
    "embedding": lambda: _pair(embedding.embedding_forward(ids(2, 3), a(5, 4)), embedding.embedding_backward),
    "softmax": lambda: _pair(softmax.softmax_forward(a(2, 5)), softmax.softmax_backward),
    "log_softmax": lambda: _pair(softmax.log_softmax_forward(a(2, 5)), softmax.log_softmax_backward),
    "layer_norm": lambda: _pair(layernorm.layer_norm_forward(a(2, 5), a(5), a(5)), layernorm.layer_norm_backward),
    "relu": lambda: _pair(activations.relu_forward(a(2, 5)), activations.relu_backward),
    "gelu": lambda: _pair(activations.gelu_forward(a(2, 5)), activations.gelu_backward),
    "dropout": lambda: _pair(dropout.dropout_forward(a(2, 6), 0.5, rng=default_rng(0, "numpy")),
                             dropout.dropout_backward),
    "dropout (identity)": lambda: _pair(dropout.dropout_forward(a(2, 6), 0.5, training=False),
                                        dropout.dropout_backward),
    "cross_entropy": lambda: _pair(cross_entropy.cross_entropy_forward(a(2, 3, 5), ids(2, 3)),
                                   cross_entropy.cross_entropy_backward),
    "attention": lambda: _pair(attention.scaled_dot_product_attention_forward(a(1, 2, 3, 4), a(1, 2, 5, 4),
                                                                              a(1, 2, 5, 4))[::2],
                               attention.scaled_dot_product_attention_backward),
    "flash_attention": lambda: _pair(flash_attention.flash_attention_forward(a(1, 2, 3, 4), a(1, 2, 5, 4),
                                                                           a(1, 2, 5, 4)),
                                     flash_attention.flash_attention_backward),
    "self_attention": lambda: _pair(multihead.self_attention_forward(a(2, 3, 4), 2, a(12, 4), a(12), a(4, 4),
                                                                     a(4))[::2], multihead.self_attention_backward),
    "feed_forward": lambda: _pair(feedforward.feed_forward_forward(a(2, 3, 4), a(8, 4), a(8), a(4, 8), a(4)),
                                  feedforward.feed_forward_backward),
    "batch_norm": lambda: _pair(batchnorm.batch_norm_forward(a(6, 4), a(4), a(4))[::2], batchnorm.batch_norm_backward),
    "rel_shift": lambda: _pair(relative_attention.rel_shift_forward(a(2, 3, 5)), relative_attention.rel_shift_backward),
    "rnn": lambda: _pair(rnn.rnn_forward(a(2, 3, 4), a(2, 5), a(5, 4), a(5, 5)), rnn.rnn_backward),
    "lstm": lambda: _pair(rnn.lstm_forward(a(2, 3, 4), a(2, 5), a(2, 5), a(20, 4), a(20, 5))[::2], rnn.lstm_backward),
}


def _pair(result, backward):
    out, cache = result
    return out, lambda d: backward(d, cache)


@pytest.mark.parametrize("name", sorted(BACKWARDS))
@given(axis=st.integers(0, 3), delta=st.sampled_from([-1, 1, 2]))
def test_every_backward_refuses_a_gradient_of_another_shape(name, axis, delta):
    out, backward = BACKWARDS[name]()
    shape = list(out.shape)
    if not shape:                                        # a 0-d loss: any extra axis is wrong
        bad = (2,)
    else:
        axis %= len(shape)
        shape[axis] = max(0, shape[axis] + delta) if shape[axis] + delta != shape[axis] else shape[axis] + 1
        bad = tuple(shape) if tuple(shape) != out.shape else tuple(shape) + (1,)
    with pytest.raises(ShapeError, match="expected the shape of"):
        backward(np.ones(bad, out.dtype))


@pytest.mark.parametrize("name", sorted(BACKWARDS))
def test_every_backward_refuses_another_dtype_or_a_non_array(name):
    out, backward = BACKWARDS[name]()
    with pytest.raises(InputTypeError, match=r"expected the dtype of .*, float32, got numpy float64"):
        backward(np.ones(out.shape, np.float64))          # no silent promotion to float64
    with pytest.raises(InputTypeError, match="expected a numpy or cupy array"):
        backward(np.ones(out.shape).tolist())
    backward(np.ones(out.shape, out.dtype))               # the right gradient is taken


# -- ops, modules and models: a table of (call, exception, message) ----------------------------------
def _gpt(**kw):
    return GPT(GPTConfig(vocab_size=7, block_size=6, n_layer=1, n_head=2, d_model=4, **kw), rng=0)


def _seq2seq():
    return Seq2Seq(Seq2SeqConfig(src_vocab_size=7, tgt_vocab_size=6, d_model=4, nhead=2, num_encoder_layers=1,
                                 num_decoder_layers=1, dim_feedforward=8, max_len=6), rng=0)


def _bert():
    return BERT(BERTConfig(vocab_size=9, hidden_size=4, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=8, max_position_embeddings=6), rng=0)


def _without_ml_dtypes(call):
    """``call()`` as if ml_dtypes were not installed (its import fails)."""
    with mock.patch.dict(sys.modules, {"ml_dtypes": None}):
        return call()


NO_ML_DTYPES = (r"bfloat16 needs the ml_dtypes package, which gives NumPy and CuPy the dtype: "
                r'pip install "npformer\[bfloat16\]"')


def _gpt_cache_of_batch_two():
    model = _gpt().eval()
    cache = model.new_cache()
    with nn.no_grad():
        model(ids(2, 2, high=7), kv_cache=cache)
        model(ids(3, 1, high=7), kv_cache=cache)


CASES = [
    # ranks and shapes
    ("linear: weight 1-d", lambda: linear.linear_forward(a(2, 4), a(4)), ShapeError, "weight: expected a 2-d"),
    ("linear: x's last axis", lambda: linear.linear_forward(a(2, 3), a(5, 4)), ShapeError, "C_in=4"),
    ("linear: bias shape", lambda: linear.linear_forward(a(2, 4), a(5, 4), a(4)), ShapeError, r"bias: expected shape \(5,\)"),
    ("attention: q 3-d", lambda: attention.scaled_dot_product_attention_forward(a(2, 3, 4), a(1, 2, 3, 4), a(1, 2, 3, 4)),
     ShapeError, "q: expected a 4-d"),
    ("attention: head sizes differ", lambda: attention.scaled_dot_product_attention_forward(
        a(1, 2, 3, 4), a(1, 2, 3, 5), a(1, 2, 3, 4)), ShapeError, "k: expected shape"),
    ("attention: key padding shape", lambda: attention.scaled_dot_product_attention_forward(
        a(1, 2, 3, 4), a(1, 2, 3, 4), a(1, 2, 3, 4), key_padding_mask=np.zeros((1, 4), bool)),
     ShapeError, "key_padding_mask: expected shape"),
    ("self_attention: E not divisible by H", lambda: multihead.self_attention_forward(
        a(2, 3, 5), 2, a(15, 5), None, a(5, 5), None), ShapeError, "not divisible by num_heads"),
    ("self_attention: key padding shape", lambda: multihead.self_attention_forward(
        a(2, 3, 4), 2, a(12, 4), None, a(4, 4), None, key_padding_mask=np.zeros((2, 4), bool)),
     ShapeError, r"key_padding_mask: expected shape \(B, Tk\)=\(2, 3\)"),
    ("self_attention: past and new keys", lambda: multihead.self_attention_forward(
        a(2, 1, 4), 2, a(12, 4), None, a(4, 4), None, past_key=a(2, 2, 3, 2), past_value=a(2, 2, 3, 2),
        key_padding_mask=np.zeros((2, 3), bool)), ShapeError, r"key_padding_mask: expected shape \(B, Tk\)=\(2, 4\)"),
    ("multi_head_attention: attention 'fast'", lambda: multihead.multi_head_attention_forward(
        a(2, 3, 4), a(2, 5, 4), a(2, 5, 4), 2, a(12, 4), None, a(4, 4), None, attention="fast"),
     RangeError, "attention: expected one of"),
    ("layer_norm: weight shape", lambda: layernorm.layer_norm_forward(a(2, 4), a(5)), ShapeError, "weight: expected shape"),
    ("rnn: weight shape", lambda: rnn.rnn_forward(a(2, 3, 4), a(2, 5), a(5, 3), a(5, 5)), ShapeError, "weight_ih"),
    # empty axes and zero sizes
    ("softmax: empty last axis", lambda: softmax.softmax_forward(a(2, 0)), ShapeError, "expected rows"),
    ("softmax: 0-d", lambda: softmax.softmax_forward(np.asarray(1.0, F32)), ShapeError, "expected rows"),
    ("layer_norm: empty last axis", lambda: layernorm.layer_norm_forward(a(3, 0)), ShapeError, "expected rows"),
    ("cross_entropy: no classes", lambda: cross_entropy.cross_entropy_forward(a(2, 0), ids(2)), ShapeError,
     "logits: expected rows"),
    ("attention: no keys", lambda: attention.scaled_dot_product_attention_forward(a(1, 1, 2, 4), a(1, 1, 0, 4),
                                                                                 a(1, 1, 0, 4)), ShapeError, "Tk >= 1"),
    ("Linear(0, 3)", lambda: nn.Linear(0, 3), RangeError, "in_features: expected an int >= 1"),
    ("Embedding(4, 0)", lambda: nn.Embedding(4, 0), RangeError, "embedding_dim"),
    ("LayerNorm(0)", lambda: nn.LayerNorm(0), RangeError, "normalized_shape"),
    ("MultiheadAttention(0, 1)", lambda: nn.MultiheadAttention(0, 1), RangeError, "embed_dim"),
    ("MultiheadAttention(4, 3)", lambda: nn.MultiheadAttention(4, 3), ShapeError, "not divisible"),
    ("TransformerEncoder(layer, -1)", lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(4, 2, 8), -1),
     RangeError, "num_layers"),
    ("Transformer with 0 decoder layers", lambda: nn.Transformer(4, 2, 1, 0, 8), RangeError, "num_layers"),
    ("RNN(0, 3)", lambda: nn.RNN(0, 3), RangeError, "input_size"),
    ("BatchNorm1d(0)", lambda: nn.BatchNorm1d(0), RangeError, "num_features"),
    ("PositionalEncoding(4, -2)", lambda: nn.PositionalEncoding(4, -2), RangeError, "max_len"),
    ("OutputHead(0, 4)", lambda: nn.OutputHead(0, 4), RangeError, "d_model"),
    ("OutputHead tied to an array", lambda: nn.OutputHead(8, 10, tied=np.zeros((10, 8), F32)), InputTypeError,
     r"tied: expected the Parameter of the weight to share \(an embedding's \.weight\), got numpy float32 array"),
    # dtypes and types
    ("softmax: integer input", lambda: softmax.softmax_forward(ids(2, 3)), InputTypeError, "floating-point"),
    ("linear: mixed dtypes", lambda: linear.linear_forward(a(2, 4), a(5, 4, dtype=np.float64)), InputTypeError,
     "dtype mismatch"),
    ("linear: a list", lambda: linear.linear_forward([[1.0, 2.0]], a(3, 2)), InputTypeError, "numpy or cupy array"),
    ("embedding: float ids", lambda: embedding.embedding_forward(a(2, 3), a(5, 4)), InputTypeError, "integer array"),
    ("cross_entropy: float targets", lambda: cross_entropy.cross_entropy_forward(a(2, 5), a(2)), InputTypeError,
     "targets: expected an integer array"),
    ("cross_entropy: ignore_index 0.5", lambda: cross_entropy.cross_entropy_forward(a(2, 5), ids(2), ignore_index=0.5),
     InputTypeError, "ignore_index: expected an int"),
    ("cross_entropy: ignore_index None", lambda: cross_entropy.cross_entropy_forward(a(2, 5), ids(2), ignore_index=None),
     InputTypeError, "ignore_index: expected an int"),
    ("cross_entropy: label_smoothing 'x'", lambda: cross_entropy.cross_entropy_forward(a(2, 5), ids(2),
                                                                                      label_smoothing="x"),
     InputTypeError, "label_smoothing: expected a real number"),
    ("layer_norm: eps None", lambda: layernorm.layer_norm_forward(a(2, 4), eps=None), InputTypeError, "eps"),
    ("Linear(2.0, 3)", lambda: nn.Linear(2.0, 3), InputTypeError, "in_features: expected an int"),
    ("Embedding(True, 3)", lambda: nn.Embedding(True, 3), InputTypeError, "num_embeddings: expected an int"),
    ("attention: mask of ints", lambda: attention.scaled_dot_product_attention_forward(
        a(1, 1, 2, 4), a(1, 1, 2, 4), a(1, 1, 2, 4), attn_mask=np.zeros((2, 2), np.int8)), InputTypeError, "attn_mask"),
    ("self_attention: mask of ints", lambda: multihead.self_attention_forward(
        a(1, 2, 4), 2, a(12, 4), None, a(4, 4), None, attn_mask=np.zeros((2, 2), np.int8)), InputTypeError, "attn_mask"),
    ("multi_head_attention: padding mask of ints", lambda: multihead.multi_head_attention_forward(
        a(1, 2, 4), a(1, 3, 4), a(1, 3, 4), 2, a(12, 4), None, a(4, 4), None,
        key_padding_mask=np.zeros((1, 3), np.int64)), InputTypeError, "key_padding_mask"),
    # bfloat16 (ml_dtypes'): a bfloat16 model takes bfloat16 inputs, trains without a loss scaler, and
    # without ml_dtypes is refused naming the extra
    ("bfloat16 Linear: float16 x", lambda: nn.Linear(4, 3, dtype="bfloat16")(a(2, 4, dtype=np.float16)),
     InputTypeError, "dtype mismatch: x is float16 but weight is bfloat16"),
    ("bfloat16 encoder layer: float16 x", lambda: nn.TransformerEncoderLayer(4, 2, 8, dtype="bfloat16")(
        a(2, 3, 4, dtype=np.float16)), InputTypeError,
     "dtype mismatch: query is float16 but in_proj_weight is bfloat16"),
    ("linear: bfloat16 x, float16 weight", lambda: linear.linear_forward(a(2, 4, dtype=bfloat16()),
                                                                         a(5, 4, dtype=np.float16)),
     InputTypeError, "dtype mismatch: x is bfloat16 but weight is float16"),
    ("MixedPrecision bfloat16 with a loss scaler", lambda: MixedPrecision(_gpt(), "bfloat16", DynamicLossScaler()),
     RangeError, "scaler: bfloat16 keeps float32's exponent range and trains without loss scaling"),
    ("bfloat16 without ml_dtypes: Linear", lambda: _without_ml_dtypes(lambda: nn.Linear(4, 3, dtype="bfloat16")),
     MissingExtraError, NO_ML_DTYPES),
    ("bfloat16 without ml_dtypes: Module.to", lambda: _without_ml_dtypes(lambda: _gpt().to(dtype="bfloat16")),
     MissingExtraError, NO_ML_DTYPES),
    ("bfloat16 without ml_dtypes: MixedPrecision",
     lambda: _without_ml_dtypes(lambda: MixedPrecision(_gpt(), "bfloat16")),
     MissingExtraError, NO_ML_DTYPES),
    # values out of range
    ("embedding: id >= V", lambda: embedding.embedding_forward(np.array([[5]]), a(5, 4)), RangeError,
     r"token ids must be in \[0, 5\)"),
    ("embedding: negative id", lambda: embedding.embedding_forward(np.array([[-1]]), a(5, 4)), RangeError, "token ids"),
    ("cross_entropy: target >= V", lambda: cross_entropy.cross_entropy_forward(a(2, 5), np.array([1, 7])),
     RangeError, "class ids must be in"),
    ("dropout: p = 1.5", lambda: dropout.dropout_forward(a(4), 1.5, rng=default_rng(0, "numpy")), RangeError,
     "probability"),
    ("dropout: no generator", lambda: dropout.dropout_forward(a(4), 0.5), RangeError, "needs rng"),
    ("GPT: id >= V", lambda: _gpt()(np.array([[1, 7]])), RangeError, "token ids must be in"),
    ("GPT: longer than block_size", lambda: _gpt()(ids(1, 7, high=7)), RangeError, "exceeds block_size"),
    ("GPT: ids 1-d", lambda: _gpt()(ids(4, high=7)), ShapeError, "idx: expected a 2-d"),
    ("GPT: cache of another batch", _gpt_cache_of_batch_two, ShapeError, "kv_cache: holds 2 sequences"),
    ("GPT: kv_cache an empty list", lambda: _gpt()(ids(1, 2, high=7), kv_cache=[]), InputTypeError,
     r"kv_cache: expected a list of \d+ KVCache, one per layer \(model.new_cache\(\)\), got list \[\]"),
    ("MultiheadAttention: kv_cache a list", lambda: nn.MultiheadAttention(4, 2)(a(1, 2, 4), kv_cache=[]),
     InputTypeError, r"kv_cache: expected a KVCache \(npformer.nn.KVCache\(\), one per attention module; a model's "
     r"new_cache\(\) makes them\), got list \[\]"),
    ("Seq2Seq: target id >= V", lambda: _seq2seq()(ids(1, 3, high=7), np.array([[1, 6]])), RangeError, "tgt_in"),
    ("Seq2Seq: source too long", lambda: _seq2seq()(ids(1, 7, high=7), ids(1, 2)), RangeError, "max_len"),
    ("BERT: token types (2, 1)", lambda: _bert()(ids(2, 3, high=9), np.zeros((2, 1), np.int64)), ShapeError,
     "token_type_ids: expected the shape of input_ids"),
    ("BERT: token type 2 of 2", lambda: _bert()(ids(2, 3, high=9), np.full((2, 3), 2)), RangeError, "token_type_ids"),
    ("TransformerXL: mems of another batch", lambda: TransformerXL(TransformerXLConfig(vocab_size=5, d_model=4,
                                                                                       n_head=2, mem_len=2), rng=0)(
        ids(2, 3), [a(3, 2, 4), a(3, 2, 4)]), ShapeError, r"mems\[0\]"),
    # non-finite scalars
    ("attention: scale nan", lambda: attention.scaled_dot_product_attention_forward(
        a(1, 1, 2, 4), a(1, 1, 2, 4), a(1, 1, 2, 4), scale=math.nan), RangeError, "scale: expected a finite number"),
    ("layer_norm: eps inf", lambda: layernorm.layer_norm_forward(a(2, 4), eps=math.inf), RangeError, "eps"),
    ("LayerNorm(4, eps=nan)", lambda: nn.LayerNorm(4, eps=math.nan), RangeError, "eps"),
    ("Dropout(nan)", lambda: nn.Dropout(math.nan), RangeError, "probability"),
    ("cross_entropy: label_smoothing inf", lambda: cross_entropy.cross_entropy_forward(a(2, 5), ids(2),
                                                                                      label_smoothing=math.inf),
     RangeError, "label_smoothing"),
]


@pytest.mark.parametrize("label, call, error, message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_npformers_own_clear_error(label, call, error, message):
    with pytest.raises(error, match=message):
        call()


@given(high=st.integers(5, 1000), low=st.integers(-1000, -1), dims=st.tuples(st.integers(1, 3), st.integers(1, 4)))
def test_out_of_range_ids_anywhere(high, low, dims):
    table = a(5, 3)
    for bad in (high, low):
        x = np.zeros(dims, np.int64)
        x.flat[-1] = bad
        with pytest.raises(RangeError, match=rf"got values from {x.min()} to {x.max()}"):
            embedding.embedding_forward(x, table)


@given(value=st.sampled_from(NON_FINITE + (-0.5, 1.5, "0.1", None, True)))
def test_a_probability_must_be_a_finite_number_in_0_1(value):
    with pytest.raises((InputTypeError, RangeError), match="p"):
        dropout.dropout_forward(a(4), value, rng=default_rng(0, "numpy"))
    with pytest.raises((InputTypeError, RangeError), match="dropout"):
        nn.MultiheadAttention(4, 2, dropout=value)


@given(size=st.sampled_from([0, -1, -7, 2.5, None, "4", True]))
def test_a_size_must_be_a_positive_int(size):
    for build in (lambda: nn.Linear(size, 3), lambda: nn.Embedding(size, 3), lambda: nn.LayerNorm(size),
                  lambda: nn.MultiheadAttention(size, 1), lambda: nn.RNN(size, 3)):
        with pytest.raises((InputTypeError, RangeError), match="expected an int"):
            build()


def test_tally():
    """Every table case ends in npformer's own error of the expected kind: the counts by outcome."""
    outcomes = collections.Counter()
    for label, call, error, message in CASES:
        try:
            call()
            outcomes["accepted silently"] += 1
        except NpformerError as exc:
            outcomes[type(exc).__name__ if isinstance(exc, error) else f"other npformer error ({label})"] += 1
        except Exception as exc:                         # noqa: BLE001  (what this test must never see)
            outcomes[f"raw {type(exc).__name__} ({label})"] += 1
    print(f"\nbad-input table: {len(CASES)} cases; " + ", ".join(f"{k}: {v}" for k, v in sorted(outcomes.items())))
    assert set(outcomes) <= {"InputTypeError", "ShapeError", "RangeError", "MissingExtraError"}, outcomes


def _dtype_builders() -> dict:
    """Every npformer module and model that takes a dtype, built small, with ``dtype`` as given."""
    from npformer.models import ALBERT, ALBERTConfig, NormEncoder, NormEncoderConfig
    return {
        "Linear": lambda d: nn.Linear(4, 3, dtype=d), "Embedding": lambda d: nn.Embedding(5, 4, dtype=d),
        "LayerNorm": lambda d: nn.LayerNorm(4, dtype=d), "BatchNorm1d": lambda d: nn.BatchNorm1d(4, dtype=d),
        "LearnedPositionalEncoding": lambda d: nn.LearnedPositionalEncoding(4, 6, dtype=d),
        "MultiheadAttention": lambda d: nn.MultiheadAttention(4, 2, dtype=d),
        "FeedForwardBlock": lambda d: nn.FeedForwardBlock(4, 8, dtype=d),
        "OutputHead": lambda d: nn.OutputHead(4, 5, dtype=d),
        "RNN": lambda d: nn.RNN(4, 3, dtype=d), "LSTM": lambda d: nn.LSTM(4, 3, dtype=d),
        "TransformerEncoderLayer": lambda d: nn.TransformerEncoderLayer(4, 2, 8, dtype=d),
        "TransformerDecoderLayer": lambda d: nn.TransformerDecoderLayer(4, 2, 8, dtype=d),
        "Transformer": lambda d: nn.Transformer(4, 2, 1, 1, 8, dtype=d),
        "GPT": lambda d: GPT(GPTConfig(vocab_size=7, block_size=6, n_layer=1, n_head=2, d_model=4), dtype=d),
        "BERT": lambda d: BERT(BERTConfig(vocab_size=9, hidden_size=4, num_hidden_layers=1, num_attention_heads=2,
                                          intermediate_size=8, max_position_embeddings=6), dtype=d),
        "ALBERT": lambda d: ALBERT(ALBERTConfig(vocab_size=9, embedding_size=2, hidden_size=4, num_hidden_layers=1,
                                                num_attention_heads=2, intermediate_size=8,
                                                max_position_embeddings=6), dtype=d),
        "Seq2Seq": lambda d: Seq2Seq(Seq2SeqConfig(src_vocab_size=7, tgt_vocab_size=6, d_model=4, nhead=2,
                                                   num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=8,
                                                   max_len=6), dtype=d),
        "TransformerXL": lambda d: TransformerXL(TransformerXLConfig(vocab_size=5, d_model=4, n_head=2), dtype=d),
        "NormEncoder": lambda d: NormEncoder(NormEncoderConfig(vocab_size=7, num_classes=3, d_model=4, nhead=2,
                                                               num_layers=1, dim_feedforward=8), dtype=d),
    }


@pytest.mark.parametrize("dtype", ["int32", "complex64", "bool", object])
def test_a_module_of_a_non_float_dtype_is_refused_when_it_is_built(dtype):
    """Not at its first forward: every module and model that takes a dtype, and Module.to."""
    builders = _dtype_builders()
    for name, build in builders.items():
        with pytest.raises(InputTypeError, match="dtype: expected a floating-point dtype"):
            build(dtype)
        assert build("float64").dtype == np.float64, name
    model = builders["GPT"](None)
    with pytest.raises(InputTypeError, match="dtype: expected a floating-point dtype"):
        model.to(dtype=dtype)
    assert all(p.data.dtype == np.float32 for p in model.parameters())          # nothing was cast


def test_every_module_builds_in_bfloat16_by_its_name_or_ml_dtypes_type():
    """bfloat16 (ml_dtypes', kind "V") is a floating dtype to every module and model, and Module.to."""
    pytest.importorskip("ml_dtypes", reason="bfloat16 needs ml_dtypes (pip install 'npformer[bfloat16]')")
    for name, build in _dtype_builders().items():
        for dtype in ("bfloat16", bfloat16().type, bfloat16()):
            model = build(dtype)
            assert model.dtype == bfloat16() and all(p.dtype == bfloat16() for p in model.parameters()), name
    model = _gpt()
    assert model.to(dtype="bfloat16").dtype == bfloat16()
    assert model.to(dtype="float32").dtype == np.float32


def test_every_module_that_takes_a_dtype_is_in_the_dtype_table():
    import inspect
    from npformer import models
    from npformer.nn.module import Module
    taking = {name for home in (nn, models) for name, obj in vars(home).items()
              if inspect.isclass(obj) and issubclass(obj, Module) and "dtype" in inspect.signature(obj).parameters}
    assert taking == set(_dtype_builders())
