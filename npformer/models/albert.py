"""``ALBERT``: BERT with a factorised embedding and cross-layer parameter sharing (Lan et al. 2019,
sections 3.1 and 3.2).

    e = LayerNorm(word[ids] + position[0..T-1] + token_type[segments])    (B, T, E)   tables V x E
    x = dropout(e) W_in^T + b_in                                           (B, T, H)   E -> H
    h = layer_L(... layer_1(x, key padding) ...)                           (B, T, H)   post-norm, as BERT
    pooled = tanh(h[:, 0] W_p^T + b_p)                                     (B, H)
    mlm logits = LayerNorm(gelu(h W_t^T + b_t)) word^T + b_v               (B, T, V)   W_t: H -> E, tied decoder

Factorisation turns the V x H table into V x E plus E x H (``embedding_size=E``); with
``embedding_size=None`` the tables are V x H and there is no mapping, and ``ALBERT(share="none")`` is
then BERT, with BERT's parameter names (a state dict copies across).

Sharing (``share``): ``"none"`` (L layers of their own), ``"all"`` (one layer applied L times: the
paper's default), ``"attention"`` (one self-attention module in every layer; feed-forward and norms per
layer), ``"ffn"`` (one ``linear1``/``linear2`` pair in every layer; attention and norms per layer).
Sharing is real: one module object is registered under every layer's name
(``model.layers[3].self_attn is model.layers[0].self_attn``). Each use pushes its cache on that
module's stack and the reversed backward pops them newest first, so a weight used by L layers gets
``dW = sum_l dW_l`` accumulated in its one ``grad``. ``named_parameters`` (and the optimiser, and
``num_parameters``) list a shared parameter once, under layer 0; ``state_dict`` lists it under every
name, as PyTorch does for shared modules.

Parameter counts in closed form (V vocabulary, P positions, S segment types, E embedding, H hidden,
F feed-forward, L layers; :func:`parameter_count`)::

    tables(D) = (V + P + S) D + 2 D                  word, position, type tables and their LayerNorm
    attention = 4 H^2 + 4 H,  ffn = 2 H F + F + H,  norms = 4 H          one layer's parts
    BERT      = tables(H) + L (attention + ffn + norms) + (H^2 + H)      (+ pooler)
    ALBERT    = tables(E) + (E H + H) + n_a attention + n_f ffn + n_n norms + (H^2 + H)
                n_a = 1 if the attention is shared else L, likewise n_f; n_n = 1 only for share="all"
    MLM head  = (H D + D) + 2 D + V,  D = E (ALBERT) or H          (its decoder weight is the word table)
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from npformer.checks import one_of, positive_int
from npformer.errors import ShapeError
from npformer.models.bert import BERTConfig, BertEmbeddings, EncoderModel, MaskedLMHead, Pooler
from npformer.nn import init
from npformer.nn.linear import Linear
from npformer.nn.module import ModuleList
from npformer.nn.transformer import TransformerEncoderLayer

__all__ = ["SHARE_MODES", "ALBERTConfig", "ALBERT", "AlbertMLMHead", "parameter_count"]

SHARE_MODES = ("none", "all", "attention", "ffn")
# which submodules of a TransformerEncoderLayer each mode shares across the layers
_SHARED_PARTS = {"none": (), "attention": ("self_attn",), "ffn": ("linear1", "linear2")}


@dataclass(frozen=True)
class ALBERTConfig(BERTConfig):
    """BERT's fields plus ALBERT's two: the table width E and the cross-layer sharing."""

    embedding_size: int | None = 128     # E; None: no factorisation (tables V x H, no mapping)
    share: str = "all"                   # one of SHARE_MODES

    def __post_init__(self):
        super().__post_init__()
        if self.hidden_size % self.num_attention_heads:
            raise ShapeError(f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                             f"{self.num_attention_heads}")
        one_of(self.share, "share", SHARE_MODES)
        if self.embedding_size is not None:
            positive_int(self.embedding_size, "embedding_size (None: no factorisation)")

    @property
    def factorised(self) -> bool:
        return self.embedding_size is not None

    @property
    def embedding_dim(self) -> int:
        """E: the width of the tables (H when not factorised)."""
        return self.embedding_size if self.factorised else self.hidden_size

    def as_bert(self, **changes) -> BERTConfig:
        """The BERT of the same shape (no factorisation, no sharing), with ``changes`` applied."""
        d = {k: v for k, v in asdict(self).items() if k not in ("embedding_size", "share")}
        return BERTConfig(**{**d, **changes})


# ALBERT's masked-LM head is BERT's, mapping H to the table width E (its decoder is the V x E table)
AlbertMLMHead = MaskedLMHead


class ALBERT(EncoderModel):
    def __init__(self, config: ALBERTConfig, *, dtype=None, backend=None, rng=None):
        super().__init__()
        c = self.config = config
        rng = init.host_generator(rng)
        kw = dict(dtype=dtype, backend=backend)
        self.embeddings = BertEmbeddings(c.as_bert(hidden_size=c.embedding_dim), rng, kw)
        self.embedding_hidden_mapping_in = Linear(c.embedding_size, c.hidden_size, rng=rng, **kw) \
            if c.factorised else None

        def layer():
            return TransformerEncoderLayer(c.hidden_size, c.num_attention_heads, c.intermediate_size,
                                           c.dropout, c.activation, c.layer_norm_eps, norm_first=False,
                                           rng=rng, **kw)
        if c.share == "all":
            first = layer()
            layers = [first] * c.num_hidden_layers           # one module object, L uses
        else:
            layers = [layer() for _ in range(c.num_hidden_layers)]
            for later in layers[1:]:
                for part in _SHARED_PARTS[c.share]:          # the same object in every layer
                    setattr(later, part, getattr(layers[0], part))
        self.layers = ModuleList(layers)
        self.pooler = Pooler(c.hidden_size, rng, kw)
        self.mlm = MaskedLMHead(c, self.embeddings.word_embeddings, rng, kw) if c.mlm_head else None
        self.manual_seed(init.stream_seed(rng))          # the model's dropout stream

    def embed(self, input_ids, token_type_ids):
        x = self.embeddings(input_ids, token_type_ids)                            # (B, T, E)
        if self.embedding_hidden_mapping_in is not None:
            x = self.embedding_hidden_mapping_in(x)                               # (B, T, H)
        return x

    def embed_backward(self, d):
        # fwd: x = mapping(embeddings(ids))  ->  back through the E -> H mapping, then the tables
        if self.embedding_hidden_mapping_in is not None:
            d = self.embedding_hidden_mapping_in.backward(d)                      # (B, T, E)
        self.embeddings.backward(d)


def parameter_count(config: ALBERTConfig | BERTConfig) -> dict:
    """The closed-form parameter counts of a BERT or ALBERT of ``config``, by part:
    ``tables``, ``mapping``, ``attention``, ``ffn``, ``norms`` (the layers' LayerNorms), ``pooler``,
    ``mlm_head`` (0 without one) and ``total``. The models' ``num_parameters()`` equals ``total``."""
    c = config
    v, p, s, h, f, n = (c.vocab_size, c.max_position_embeddings, c.type_vocab_size, c.hidden_size,
                        c.intermediate_size, c.num_hidden_layers)
    albert = isinstance(c, ALBERTConfig)
    e = c.embedding_dim if albert else h
    share = c.share if albert else "none"
    uses_a = 1 if share in ("all", "attention") else n
    uses_f = 1 if share in ("all", "ffn") else n
    uses_n = 1 if share == "all" else n
    counts = {
        "tables": (v + p + s) * e + 2 * e,
        "mapping": e * h + h if albert and c.factorised else 0,
        "attention": uses_a * (4 * h * h + 4 * h),
        "ffn": uses_f * (2 * h * f + f + h),
        "norms": uses_n * 4 * h,
        "pooler": h * h + h,
        "mlm_head": (h * e + e) + 2 * e + v if c.mlm_head else 0,
    }
    counts["total"] = sum(counts.values())
    return counts
