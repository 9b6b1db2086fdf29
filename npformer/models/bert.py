"""``BERT``: an encoder-only Transformer (Devlin et al. 2019) with token, position and segment
embeddings, post-norm GELU layers, a pooled [CLS] output and an optional masked-LM head.

    e = LayerNorm(word[ids] + position[0..T-1] + token_type[segments]);  x = dropout(e)
    h = layer_L(... layer_1(x, key padding) ...)                          (B, T, C) post-norm
    pooled = tanh(h[:, 0] W_p^T + b_p)                                    (B, C)
    mlm logits = LayerNorm(act(h W_t^T + b_t)) word^T + b_v               (B, T, V) tied decoder

``act`` is the layers' activation, as in the released BERT code and Hugging Face's
``BertPredictionHeadTransform`` (``hidden_act`` for both). ``fill_mask`` ranks the candidates for each
masked position; ``save_pretrained``/``from_pretrained`` write and read the Hugging Face layout
(``BertForMaskedLM`` with the head, ``BertModel`` without: :mod:`npformer.models.hf_bert`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import NamedTuple

import numpy   # host side only: the candidates fill_mask hands back

from npformer.backend import accumulated_sum, get_array_module, to_device, to_numpy
from npformer.checks import non_negative_int, one_of, positive_int, probability, real, token_ids
from npformer.errors import CallOrderError, RangeError, ShapeError, StateDictError
from npformer.interop import check_directory, load_weights, read_config, save_directory
from npformer.models import hf_bert
from npformer.nn import init
from npformer.nn.dropout import Dropout
from npformer.nn.embedding import Embedding
from npformer.nn.head import OutputHead
from npformer.nn.linear import Linear
from npformer.nn.module import Module, ModuleList
from npformer.nn.normalization import LayerNorm
from npformer.nn.transformer import TransformerEncoderLayer
from npformer.models.decoding import eval_mode, excluded_ids
from npformer.ops.feedforward import ACTIVATIONS
from npformer.ops.softmax import softmax_forward

__all__ = ["BERTConfig", "BERT", "EncoderModel", "MaskFill", "BertEmbeddings", "Pooler", "MaskedLMHead"]


@dataclass(frozen=True)
class BERTConfig:
    vocab_size: int
    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    intermediate_size: int = 512
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    dropout: float = 0.1
    layer_norm_eps: float = 1e-12
    activation: str = "gelu"
    pad_token_id: int = 0
    mlm_head: bool = False

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                     "max_position_embeddings", "type_vocab_size"):
            positive_int(getattr(self, name), name)
        # hidden_size % num_attention_heads is not checked here: ALBERT describes its embedding tables (width
        # E, no attention) with a BERTConfig (ALBERTConfig.as_bert(hidden_size=E)); the layers'
        # MultiheadAttention refuses a width its heads do not divide (ShapeError) and ALBERTConfig checks H
        probability(self.dropout, "dropout")
        real(self.layer_norm_eps, "layer_norm_eps", 0, low_open=True)
        one_of(self.activation, "activation", tuple(ACTIVATIONS))
        if non_negative_int(self.pad_token_id, "pad_token_id") >= self.vocab_size:
            raise RangeError(f"pad_token_id: expected an id in [0, {self.vocab_size}), got {self.pad_token_id}")

    def to_dict(self) -> dict:
        return asdict(self)


class BertEmbeddings(Module):
    def __init__(self, c: BERTConfig, rng, kw):
        super().__init__()
        self.word_embeddings = Embedding(c.vocab_size, c.hidden_size, padding_idx=c.pad_token_id,
                                         std=0.02, rng=rng, **kw)
        self.position_embeddings = Embedding(c.max_position_embeddings, c.hidden_size, std=0.02, rng=rng, **kw)
        self.token_type_embeddings = Embedding(c.type_vocab_size, c.hidden_size, std=0.02, rng=rng, **kw)
        self.LayerNorm = LayerNorm(c.hidden_size, c.layer_norm_eps, **kw)
        self.dropout = Dropout(c.dropout)

    def forward(self, input_ids, token_type_ids):
        xp = get_array_module(input_ids)
        pos = xp.arange(input_ids.shape[1])                                       # (T,)
        e = self.word_embeddings(input_ids) + self.position_embeddings(pos) \
            + self.token_type_embeddings(token_type_ids)                          # (B, T, C)
        return self.dropout(self.LayerNorm(e))

    def backward(self, dout):
        de = self.LayerNorm.backward(self.dropout.backward(dout))                # (B, T, C)
        # fwd: e = word[ids] + position[pos] + type[seg]  ->  each table gets de (position: summed over B)
        self.token_type_embeddings.backward(de)
        self.position_embeddings.backward(accumulated_sum(de, axis=0))
        self.word_embeddings.backward(de)


class Pooler(Module):
    """``pooled = tanh(h[:, 0] W^T + b)``: the [CLS] position through a dense layer and tanh."""

    def __init__(self, hidden, rng, kw):
        super().__init__()
        self.dense = Linear(hidden, hidden, rng=rng, **kw)

    def forward(self, h):
        xp = get_array_module(h)
        y = xp.tanh(self.dense(h[:, 0]))                                          # (B, C)
        self._push((y, h.shape))
        return y

    def backward(self, dpooled):
        y, shape = self._pop()
        xp = get_array_module(y)
        # fwd: y = tanh(z)  ->  dz = dy * (1 - y^2)
        dcls = self.dense.backward(dpooled * (1 - y * y))                         # (B, C)
        dh = xp.zeros(shape, dtype=y.dtype)                                       # (B, T, C)
        dh[:, 0] = dcls
        return dh


class MaskedLMHead(Module):
    """``logits = LayerNorm(act(h W_t^T + b_t)) word^T + b`` with the decoder tied to the word embeddings;
    ``act`` is the config's activation (the layers').

    ``W_t`` maps the hidden width H to the word table's width D (H for BERT, E for ALBERT's
    factorised tables)."""

    def __init__(self, c: BERTConfig, word_embeddings: Embedding, rng, kw):
        super().__init__()
        d = word_embeddings.embedding_dim
        self.act_forward, self.act_kwargs, self.act_backward = ACTIVATIONS[c.activation]
        self.dense = Linear(c.hidden_size, d, rng=rng, **kw)
        self.LayerNorm = LayerNorm(d, c.layer_norm_eps, **kw)
        self.decoder = OutputHead(d, c.vocab_size, bias=True, tied=word_embeddings.weight, **kw)

    def forward(self, h):
        a, cache = self.act_forward(self.dense(h), **self.act_kwargs)             # (B, T, D)
        self._push(cache)
        return self.decoder(self.LayerNorm(a))                                    # (B, T, V)

    def backward(self, dlogits):
        # fwd: logits = decoder(LayerNorm(act(dense(h))))  ->  back through each, newest first
        da = self.LayerNorm.backward(self.decoder.backward(dlogits))              # (B, T, D)
        return self.dense.backward(self.act_backward(da, self._pop()))            # (B, T, H)


class MaskFill(NamedTuple):
    """One masked position's candidates: ``row`` and ``position`` in the input, the ``ids`` (k,) from
    the most likely down and their probabilities ``probs`` (k,)."""
    row: int
    position: int
    ids: numpy.ndarray
    probs: numpy.ndarray


class EncoderModel(Module):
    """What BERT and ALBERT share: ids -> embeddings -> post-norm layers -> (hidden, pooled), the
    masked-LM logits, and the backward of all three outputs. Subclasses build ``embeddings``,
    ``layers``, ``pooler`` and ``mlm`` and may extend :meth:`embed` (ALBERT maps E to H there)."""

    config: BERTConfig

    def embed(self, input_ids, token_type_ids):
        return self.embeddings(input_ids, token_type_ids)                          # (B, T, C)

    def embed_backward(self, d):
        self.embeddings.backward(d)

    def forward(self, input_ids, token_type_ids=None, key_padding_mask=None):
        """input_ids (B, T); token_type_ids (B, T) (default zeros); key_padding_mask (B, T) bool,
        True = padding (default: ``input_ids == pad_token_id``). Returns (hidden (B, T, C), pooled (B, C))."""
        xp = get_array_module(input_ids)
        token_ids(input_ids, "input_ids", self.config.vocab_size)
        if input_ids.shape[1] > self.config.max_position_embeddings:
            raise RangeError(f"sequence length {input_ids.shape[1]} exceeds max_position_embeddings="
                             f"{self.config.max_position_embeddings}")
        if token_type_ids is None:
            token_type_ids = xp.zeros_like(input_ids)
        token_ids(token_type_ids, "token_type_ids", self.config.type_vocab_size)
        if token_type_ids.shape != input_ids.shape:     # no broadcasting: (B, 1) would fail only in backward
            raise ShapeError(f"token_type_ids: expected the shape of input_ids {tuple(input_ids.shape)}, "
                             f"got {tuple(token_type_ids.shape)}")
        if key_padding_mask is None:
            key_padding_mask = input_ids == self.config.pad_token_id
        x = self.embed(input_ids, token_type_ids)                                 # (B, T, C)
        for layer in self.layers:                            # a shared layer pushes one cache a use
            x = layer(x, src_key_padding_mask=key_padding_mask)
        return x, self.pooler(x)

    def mlm_logits(self, hidden):
        if self.mlm is None:
            raise RangeError(f"this {type(self).__name__} has no masked-LM head: build it with "
                             f"{type(self.config).__name__}(mlm_head=True)")
        return self.mlm(hidden)

    def fill_mask(self, input_ids, mask_id: int, *, top_k: int = 5, exclude=(), token_type_ids=None,
                  key_padding_mask=None) -> list[MaskFill]:
        """The ``top_k`` most likely tokens for every position of ``input_ids`` (B, T) that holds
        ``mask_id``, by the masked-LM head's softmax over the vocabulary without the ids in
        ``exclude`` (special tokens, the mask itself). Returns one :class:`MaskFill` per masked
        position, in row-major order, as host arrays. Runs in eval mode under ``no_grad``."""
        top_k = positive_int(top_k, "top_k")
        token_ids(input_ids, "input_ids", self.config.vocab_size)
        never = excluded_ids(exclude, self.config.vocab_size)
        xp = get_array_module(input_ids)
        rows, cols = (to_numpy(a) for a in xp.nonzero(input_ids == mask_id))
        if rows.size == 0:
            raise RangeError(f"input_ids: no position holds the mask id {mask_id}; nothing to fill")
        with eval_mode(self):
            hidden, _ = self(input_ids, token_type_ids, key_padding_mask)                # (B, T, C)
            logits = self.mlm_logits(hidden[to_device(rows, self.backend), to_device(cols, self.backend)])  # (N, V)
        logits = to_numpy(logits).astype(numpy.float64)                                  # (N, V)
        logits[:, never] = -numpy.inf
        p, _ = softmax_forward(logits)                                                   # (N, V)
        best = numpy.argsort(-p, axis=-1, kind="stable")[:, :min(top_k, p.shape[-1] - len(never))]
        return [MaskFill(int(r), int(c), ids, p[i, ids]) for i, (r, c, ids) in enumerate(zip(rows, cols, best))]

    def backward(self, dhidden=None, dpooled=None, dmlm_logits=None):
        """Back-propagate any of the three outputs' gradients (each call of forward once, and
        ``mlm_logits`` once if it was called); accumulates every parameter gradient (a shared
        one summed over its uses)."""
        given = [a for a in (dhidden, dpooled, dmlm_logits) if a is not None]
        if not given:
            raise RangeError("backward needs at least one of dhidden, dpooled, dmlm_logits")
        # checked before anything is popped, so that the pooler's cache stays for a correct call
        if dmlm_logits is not None and self.mlm is None:
            raise RangeError(f"dmlm_logits: this {type(self).__name__} has no masked-LM head to back-propagate "
                             f"through (build it with {type(self.config).__name__}(mlm_head=True))")
        if dmlm_logits is not None and not self.mlm._saved:
            raise CallOrderError(f"{type(self).__name__}.backward: dmlm_logits given, but mlm_logits has no "
                                 "call left to back-propagate (call it on forward's hidden states first)")
        xp = get_array_module(*given)
        if dpooled is None:                                  # the pooler ran: pop its cache with zeros
            dpooled = xp.zeros((given[0].shape[0], self.config.hidden_size), dtype=given[0].dtype)
        # fwd: outputs = (h, pooler(h), mlm(h))  ->  dh = dhidden + pooler'(dpooled) + mlm'(dlogits)
        d = self.pooler.backward(dpooled)                                         # (B, T, C)
        if dhidden is not None:
            d = d + dhidden
        if dmlm_logits is not None:
            d = d + self.mlm.backward(dmlm_logits)
        for layer in reversed(list(self.layers)):            # newest use first: the stacks' order
            d = layer.backward(d)
        self.embed_backward(d)


class BERT(EncoderModel):
    def __init__(self, config: BERTConfig, *, dtype=None, backend=None, rng=None):
        super().__init__()
        c = self.config = config
        rng = init.host_generator(rng)
        kw = dict(dtype=dtype, backend=backend)
        self.embeddings = BertEmbeddings(c, rng, kw)
        self.layers = ModuleList(
            TransformerEncoderLayer(c.hidden_size, c.num_attention_heads, c.intermediate_size, c.dropout,
                                    c.activation, c.layer_norm_eps, norm_first=False, rng=rng, **kw)
            for _ in range(c.num_hidden_layers))
        self.pooler = Pooler(c.hidden_size, rng, kw)
        self.mlm = MaskedLMHead(c, self.embeddings.word_embeddings, rng, kw) if c.mlm_head else None
        self.manual_seed(init.stream_seed(rng))          # the model's dropout stream

    def save_pretrained(self, path) -> None:
        """Write the model as a Hugging Face directory, ``config.json`` and ``model.safetensors``:
        ``BertForMaskedLM``'s layout with a masked-LM head (no pooler: that class has none),
        ``BertModel``'s without (:mod:`npformer.models.hf_bert`)."""
        config = {**hf_bert.hf_config(self.config), "dtype": str(self.dtype)}
        save_directory(path, config, hf_bert.state_to_hf(self.state_dict(), self.config))

    @classmethod
    def from_pretrained(cls, path, *, dtype="float32", backend=None, require_pooler: bool = False,
                        mlm_head: bool | None = None) -> "BERT":
        """A BERT in eval mode from a Hugging Face BERT directory (``config.json``, ``model.safetensors``
        or its shards), read with NumPy alone. ``mlm_head``: load the masked-LM head (None: when
        the file has one). Without a pooler in the file (and ``require_pooler=False``) the pooler is
        zeros, so ``pooled`` is zero; the hidden states and masked-LM logits are exact."""
        root = check_directory(path, ("config.json", "model.safetensors"))
        tensors = load_weights(root)
        if mlm_head and not hf_bert.has_mlm_head(tensors):
            raise StateDictError(f"{str(path)!r} holds no masked-LM head (no cls.predictions.* tensors): it was "
                                 "saved as a BertModel; filling masks needs a BertForMaskedLM directory")
        mlm_head = hf_bert.has_mlm_head(tensors) if mlm_head is None else mlm_head
        config = BERTConfig(**hf_bert.config_fields_from_hf(read_config(root)), mlm_head=mlm_head)
        state = hf_bert.state_from_hf(tensors, config.num_hidden_layers, require_pooler=require_pooler,
                                      mlm_head=mlm_head)
        model = cls(config, dtype=dtype, backend=backend, rng=0)
        if "pooler.dense.weight" not in state:
            for name, value in model.state_dict().items():
                if name.startswith("pooler."):
                    state[name] = value * 0
        return model.load_state_dict(state, strict=True).eval()
