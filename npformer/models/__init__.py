"""Whole models built from :mod:`npformer.nn`, each with a config dataclass and a hand-written backward.

``Seq2Seq`` (the paper's encoder-decoder, tied output head), ``GPT`` (decoder-only, pre- or post-norm),
``BERT`` (encoder, pooler, masked-LM head), ``ALBERT`` (factorised embedding, cross-layer sharing),
``TransformerXL`` (segment recurrence, relative positions) and ``NormEncoder`` (an encoder with LayerNorm
or BatchNorm, for the norms study); decoding (greedy, beam search, sampling) is in
:mod:`npformer.models.decoding`.
"""
from npformer.models.albert import ALBERT, ALBERTConfig
from npformer.models.bert import BERT, BERTConfig
from npformer.models.gpt import GPT, GPTConfig
from npformer.models.norm_encoder import NormEncoder, NormEncoderConfig
from npformer.models.seq2seq import Seq2Seq, Seq2SeqConfig
from npformer.models.transformer_xl import TransformerXL, TransformerXLConfig

__all__ = ["GPT", "GPTConfig", "Seq2Seq", "Seq2SeqConfig", "BERT", "BERTConfig", "ALBERT", "ALBERTConfig",
           "TransformerXL", "TransformerXLConfig", "NormEncoder", "NormEncoderConfig"]
