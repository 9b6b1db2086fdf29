"""Modules with PyTorch's names and arguments, each with a hand-written ``backward``.

``forward`` keeps what ``backward`` needs on a per-module stack (one entry a call), ``backward``
returns the gradients of the forward's array inputs and accumulates parameter gradients into
``Parameter.grad``. See :mod:`npformer.nn.module` for the rules.
"""
from npformer.nn import init
from npformer.nn.attention import KVCache, MultiheadAttention
from npformer.nn.dropout import Dropout
from npformer.nn.flat import FlatParameters, flat_gradients, flat_parameters, flatten_parameters
from npformer.nn.embedding import Embedding, LearnedPositionalEncoding, PositionalEncoding, sinusoidal_table
from npformer.nn.head import OutputHead
from npformer.nn.linear import Linear
from npformer.nn.module import Module, ModuleList, Parameter, RandomStream, StateDictError, is_grad_enabled, no_grad
from npformer.nn.normalization import LayerNorm
from npformer.nn.normalization_batch import BatchNorm1d
from npformer.nn.rnn import LSTM, RNN
from npformer.nn.transformer import (FeedForwardBlock, Transformer, TransformerDecoder,
                                     TransformerDecoderLayer, TransformerEncoder,
                                     TransformerEncoderLayer)

__all__ = ["init", "Module", "ModuleList", "Parameter", "StateDictError", "Linear", "Embedding",
           "PositionalEncoding", "LearnedPositionalEncoding", "sinusoidal_table", "LayerNorm", "Dropout",
           "RandomStream",           "MultiheadAttention", "KVCache", "FeedForwardBlock", "TransformerEncoderLayer",
           "TransformerDecoderLayer", "TransformerEncoder", "TransformerDecoder", "Transformer",
           "OutputHead", "no_grad", "is_grad_enabled", "RNN", "LSTM", "BatchNorm1d", "FlatParameters",
           "flatten_parameters", "flat_parameters", "flat_gradients"]
