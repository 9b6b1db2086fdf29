"""The models' config dataclasses refuse bad settings when they are made, with npformer's own error
naming the field, what was expected and what came (never a ZeroDivisionError or a math domain error
from deep inside the model, and never a negative layer count that silently means none)."""
import pytest

from npformer.errors import InputTypeError, RangeError, ShapeError
from npformer.models.albert import ALBERTConfig
from npformer.models.bert import BERT, BERTConfig
from npformer.models.gpt import GPT, GPTConfig
from npformer.models.norm_encoder import NormEncoderConfig
from npformer.models.seq2seq import Seq2SeqConfig
from npformer.models.transformer_xl import TransformerXLConfig

# config class -> the fields every instance needs
REQUIRED = {GPTConfig: {"vocab_size": 11}, Seq2SeqConfig: {"src_vocab_size": 11, "tgt_vocab_size": 9},
            BERTConfig: {"vocab_size": 11}, ALBERTConfig: {"vocab_size": 11},
            NormEncoderConfig: {"vocab_size": 11, "num_classes": 3}, TransformerXLConfig: {"vocab_size": 11}}

SIZES = {GPTConfig: ("vocab_size", "block_size", "n_layer", "n_head", "d_model", "dim_feedforward"),
         Seq2SeqConfig: ("src_vocab_size", "tgt_vocab_size", "d_model", "nhead", "num_encoder_layers",
                         "num_decoder_layers", "dim_feedforward", "max_len"),
         BERTConfig: ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                      "max_position_embeddings", "type_vocab_size"),
         ALBERTConfig: ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                        "intermediate_size", "max_position_embeddings", "type_vocab_size", "embedding_size"),
         NormEncoderConfig: ("vocab_size", "num_classes", "d_model", "nhead", "num_layers", "dim_feedforward",
                             "max_len"),
         TransformerXLConfig: ("vocab_size", "n_layer", "n_head", "d_model", "dim_feedforward", "d_head")}

HEADS = {GPTConfig: ("d_model", "n_head"), Seq2SeqConfig: ("d_model", "nhead"),
         ALBERTConfig: ("hidden_size", "num_attention_heads"), NormEncoderConfig: ("d_model", "nhead"),
         TransformerXLConfig: ("d_model", "n_head")}

PAD = {Seq2SeqConfig: "pad_id", BERTConfig: "pad_token_id", ALBERTConfig: "pad_token_id", NormEncoderConfig: "pad_id"}


def _make(cls, **changes):
    return cls(**{**REQUIRED[cls], **changes})


@pytest.mark.parametrize("cls", list(REQUIRED), ids=lambda c: c.__name__)
def test_the_defaults_are_valid(cls):
    _make(cls)


@pytest.mark.parametrize("cls,name", [(c, n) for c, names in SIZES.items() for n in names],
                         ids=lambda v: v if isinstance(v, str) else v.__name__)
@pytest.mark.parametrize("value", [0, -1])
def test_a_size_below_one_is_a_range_error_naming_the_field(cls, name, value):
    with pytest.raises(RangeError, match=rf"^{name}\b.*: expected an int >= 1, got {value}$"):
        _make(cls, **{name: value})


@pytest.mark.parametrize("cls", [GPTConfig, Seq2SeqConfig, BERTConfig, NormEncoderConfig, TransformerXLConfig],
                         ids=lambda c: c.__name__)
@pytest.mark.parametrize("value", [2.0, "2", True])
def test_a_size_that_is_not_an_int_is_a_type_error(cls, value):
    name = SIZES[cls][2]
    with pytest.raises(InputTypeError, match=rf"^{name}: expected an int, got"):
        _make(cls, **{name: value})


@pytest.mark.parametrize("cls", list(HEADS), ids=lambda c: c.__name__)
def test_a_width_the_heads_do_not_divide_is_a_shape_error(cls):
    width, heads = HEADS[cls]
    with pytest.raises(ShapeError, match=rf"^{width} 10 is not divisible by {heads} 4"):
        _make(cls, **{width: 10, heads: 4})


def test_transformer_xl_accepts_any_width_with_an_explicit_head_size():
    assert _make(TransformerXLConfig, d_model=10, n_head=4, d_head=3).head_size == 3


def test_bert_leaves_the_heads_to_its_attention():
    """A BERTConfig also describes ALBERT's embedding tables (width E, no attention), so the heads are
    checked where the layers are built."""
    config = _make(BERTConfig, hidden_size=10, num_attention_heads=4)
    with pytest.raises(ShapeError, match="embed_dim 10 is not divisible by num_heads 4"):
        BERT(config, rng=0)


@pytest.mark.parametrize("cls", list(REQUIRED), ids=lambda c: c.__name__)
@pytest.mark.parametrize("value", [-0.1, 1.5, float("nan"), float("inf")])
def test_dropout_is_a_probability(cls, value):
    with pytest.raises(RangeError, match=r"^dropout: expected a probability in \[0, 1\], got"):
        _make(cls, dropout=value)


@pytest.mark.parametrize("cls", list(REQUIRED), ids=lambda c: c.__name__)
def test_the_activation_is_one_of_the_known_names(cls):
    with pytest.raises(RangeError, match=r"^activation: expected one of 'relu', 'gelu', 'gelu_tanh', got 'tanh'"):
        _make(cls, activation="tanh")


@pytest.mark.parametrize("cls", [GPTConfig, BERTConfig, ALBERTConfig, TransformerXLConfig], ids=lambda c: c.__name__)
@pytest.mark.parametrize("value", [0.0, -1e-5, float("nan"), float("inf")])
def test_layer_norm_eps_is_a_finite_number_above_zero(cls, value):
    with pytest.raises(RangeError, match=r"^layer_norm_eps: expected a finite number > 0, got"):
        _make(cls, layer_norm_eps=value)


@pytest.mark.parametrize("cls", list(PAD), ids=lambda c: c.__name__)
def test_the_pad_id_is_an_id_of_the_vocabulary(cls):
    name = PAD[cls]
    with pytest.raises(RangeError, match=rf"^{name}: expected an int >= 0, got -1"):
        _make(cls, **{name: -1})
    with pytest.raises(RangeError, match=rf"^{name}: expected an id in \[0, \d+\)"):
        _make(cls, **{name: 11})


def test_choices_of_one_model():
    with pytest.raises(RangeError, match="^positional: expected one of 'sinusoidal', 'learned', got 'rotary'"):
        _make(Seq2SeqConfig, positional="rotary")
    with pytest.raises(RangeError, match="^norm: expected one of 'layer', 'batch', 'batch_masked', got 'group'"):
        _make(NormEncoderConfig, norm="group")
    with pytest.raises(RangeError, match="^share: expected one of 'none', 'all', 'attention', 'ffn', got 'some'"):
        _make(ALBERTConfig, share="some")
    with pytest.raises(RangeError, match="^mem_len: expected an int >= 0, got -1"):
        _make(TransformerXLConfig, mem_len=-1)
    assert _make(ALBERTConfig, embedding_size=None).embedding_dim == 128


@pytest.mark.parametrize("n_layer", [0, -1])
def test_gpt_with_no_layers_is_refused_before_any_weight_is_drawn(n_layer):
    """Was a ZeroDivisionError (0) or a math domain error (-1) from the residual initialisation."""
    with pytest.raises(RangeError, match=f"n_layer: expected an int >= 1, got {n_layer}"):
        GPT(GPTConfig(vocab_size=5, n_layer=n_layer), rng=0)
