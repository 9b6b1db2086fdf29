"""``GPT``: a decoder-only Transformer language model (Radford et al. 2018, 2019).

    x = dropout(wte[idx] + wpe[0..T-1])                (B, T, C)
    x = block_l(x, causal)  for l = 1..L               pre-norm (GPT-2) or post-norm (GPT-1)
    logits = ln_f(x) wte^T                             tied head (ln_f only in pre-norm)

A block is ``TransformerEncoderLayer`` with a causal mask: self-attention and a GELU feed-forward,
each in a residual branch. GPT-2's initialisation: every weight matrix N(0, 0.02^2), biases zero,
and the two projections that write into the residual stream (``self_attn.out_proj.weight``,
``linear2.weight``) N(0, (0.02 / sqrt(2 L))^2) so the stream's variance does not grow with depth
(``scaled_residual_init=False`` keeps them at 0.02, as GPT-1).

``generate`` samples a continuation (greedy, temperature, top-k, top-p; the key/value cache), and
``save_pretrained``/``from_pretrained`` write and read the Hugging Face layout that computes the same
(GPT-2 for pre-norm, OpenAI GPT for post-norm: :mod:`npformer.models.hf_gpt`).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from npformer.backend import accumulated_sum, get_array_module
from npformer.checks import describe, one_of, positive_int, probability, real, token_ids
from npformer.errors import InputTypeError, RangeError, ShapeError
from npformer.interop import check_directory, load_weights, read_config, save_directory
from npformer.models import hf_gpt
from npformer.models.decoding import generate
from npformer.nn import init
from npformer.nn.attention import KVCache, MultiheadAttention
from npformer.nn.dropout import Dropout
from npformer.nn.embedding import Embedding
from npformer.nn.head import OutputHead
from npformer.nn.linear import Linear
from npformer.nn.module import Module, ModuleList
from npformer.nn.normalization import LayerNorm
from npformer.nn.transformer import TransformerEncoderLayer
from npformer.ops.feedforward import ACTIVATIONS

__all__ = ["GPTConfig", "GPT"]


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    block_size: int = 128            # the longest context (learned positions)
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    dim_feedforward: int | None = None   # default 4 * d_model
    dropout: float = 0.1
    activation: str = "gelu_tanh"    # GPT-2's GELU approximation
    norm_first: bool = True          # GPT-2 (pre-norm); False gives GPT-1's post-norm blocks
    layer_norm_eps: float = 1e-5
    bias: bool = True
    tie_embeddings: bool = True
    scaled_residual_init: bool = True  # GPT-2's 0.02 / sqrt(2 L) on the residual projections; False: 0.02

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "d_model"):
            positive_int(getattr(self, name), name)
        if self.dim_feedforward is not None:
            positive_int(self.dim_feedforward, "dim_feedforward")
        if self.d_model % self.n_head:
            raise ShapeError(f"d_model {self.d_model} is not divisible by n_head {self.n_head}")
        probability(self.dropout, "dropout")
        one_of(self.activation, "activation", tuple(ACTIVATIONS))
        real(self.layer_norm_eps, "layer_norm_eps", 0, low_open=True)

    def to_dict(self) -> dict:
        return asdict(self)


class GPT(Module):
    def __init__(self, config: GPTConfig, *, dtype=None, backend=None, rng=None):
        super().__init__()
        c = self.config = config
        rng = init.host_generator(rng)
        kw = dict(dtype=dtype, backend=backend)
        ff = c.dim_feedforward or 4 * c.d_model
        self.wte = Embedding(c.vocab_size, c.d_model, std=0.02, rng=rng, **kw)
        self.wpe = Embedding(c.block_size, c.d_model, std=0.02, rng=rng, **kw)
        self.drop = Dropout(c.dropout)
        self.layers = ModuleList(                        # drawn by _init_weights, GPT-2's scheme
            TransformerEncoderLayer(c.d_model, c.n_head, ff, c.dropout, c.activation, c.layer_norm_eps,
                                    norm_first=c.norm_first, bias=c.bias, rng=init.DEFERRED, **kw)
            for _ in range(c.n_layer))
        self.ln_f = LayerNorm(c.d_model, c.layer_norm_eps, bias=c.bias, **kw) if c.norm_first else None
        self.head = OutputHead(c.d_model, c.vocab_size, tied=self.wte.weight if c.tie_embeddings else None,
                               rng=rng, **kw)
        self._init_weights(rng, backend)
        self.manual_seed(init.stream_seed(rng))          # the model's dropout stream

    def _init_weights(self, rng, backend):
        """GPT-2's initialisation, by module type: every projection matrix of the layers N(0, 0.02^2)
        and their biases zero; the two that write into the residual stream (attention's out_proj,
        the feed-forward's linear2) N(0, residual_std^2). Embeddings and the head keep their own."""
        c = self.config
        residual_std = 0.02 / math.sqrt(2 * c.n_layer) if c.scaled_residual_init else 0.02
        for layer in self.layers:
            for m in layer.modules():
                if isinstance(m, MultiheadAttention):
                    m.in_proj_weight.data = init.normal(m.in_proj_weight.shape, 0.02, rng=rng,
                                                        dtype=m.in_proj_weight.dtype, backend=backend)
                    if m.in_proj_bias is not None:
                        m.in_proj_bias.data[...] = 0
                elif isinstance(m, Linear):
                    std = residual_std if m is layer.self_attn.out_proj or m is layer.linear2 else 0.02
                    m.weight.data = init.normal(m.weight.shape, std, rng=rng, dtype=m.weight.dtype, backend=backend)
                    if m.bias is not None:
                        m.bias.data[...] = 0

    def _check(self, idx, offset=0):
        token_ids(idx, "idx", self.config.vocab_size)
        if offset + idx.shape[1] > self.config.block_size:
            raise RangeError(f"sequence of length {offset + idx.shape[1]} exceeds block_size="
                             f"{self.config.block_size}")

    def forward(self, idx, kv_cache: list[KVCache] | None = None):
        """idx (B, T) -> logits (B, T, V) of the next token at every position.

        With ``kv_cache`` (:meth:`new_cache`; inference, under ``no_grad``) ``idx`` holds only the
        new tokens, at the positions after those already in the cache."""
        return self.head(self.hidden(idx, kv_cache))                              # (B, T, V)

    def hidden(self, idx, kv_cache: list[KVCache] | None = None):
        """idx (B, T) -> the hidden states (B, T, C) the head reads (after ln_f): the forward without
        the head, for a step that takes the head and the loss together
        (:func:`~npformer.ops.linear_cross_entropy.linear_cross_entropy`); :meth:`backward_hidden`
        is its backward."""
        if kv_cache is not None and (not isinstance(kv_cache, (list, tuple)) or len(kv_cache) != len(self.layers)
                                     or not all(isinstance(c, KVCache) for c in kv_cache)):
            raise InputTypeError(f"kv_cache: expected a list of {len(self.layers)} KVCache, one per layer "
                                 f"(model.new_cache()), got {describe(kv_cache)}")
        offset = 0 if kv_cache is None else len(kv_cache[0])
        self._check(idx, offset)
        xp = get_array_module(idx)
        pos = xp.arange(offset, offset + idx.shape[1])                           # (T,)
        x = self.drop(self.wte(idx) + self.wpe(pos))                              # (B, T, C)
        for i, layer in enumerate(self.layers):
            x = layer(x, is_causal=True, kv_cache=None if kv_cache is None else kv_cache[i])
        if self.ln_f is not None:
            x = self.ln_f(x)
        return x                                                                  # (B, T, C)

    def backward(self, dlogits):
        """Accumulates every parameter gradient (the ids have none); returns None."""
        # fwd: logits = head(h)  (the head's weight is wte when tied: both uses accumulate)
        self.backward_hidden(self.head.backward(dlogits))

    def backward_hidden(self, dx):
        """The backward of :meth:`hidden` from the gradient of its output (B, T, C); accumulates
        the gradients of every parameter but the head's own; returns None."""
        # fwd: h = ln_f(x_L)
        if self.ln_f is not None:
            dx = self.ln_f.backward(dx)
        # fwd: x_l = layer_l(x_{l-1})  ->  back through the layers, newest first
        for layer in reversed(list(self.layers)):
            dx = layer.backward(dx)
        # fwd: x_0 = drop(wte[idx] + wpe[pos])  ->  both tables receive drop'(dx) (wpe summed over the batch)
        dx = self.drop.backward(dx)
        self.wpe.backward(accumulated_sum(dx, axis=0))
        self.wte.backward(dx)

    def new_cache(self) -> list[KVCache]:
        """An empty key/value cache per layer, for :meth:`forward` in incremental decoding."""
        return [KVCache() for _ in self.layers]

    def generate(self, idx, max_new_tokens: int, *, rng=None, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, use_cache: bool = True, exclude=None):
        """``idx`` (B, T) followed by ``max_new_tokens`` new tokens: (B, T + max_new_tokens).

        Each token is drawn from softmax(logits / temperature), restricted to the ``top_k`` most
        likely and/or the smallest set whose probability reaches ``top_p``; ``temperature=0`` is
        greedy (the arg-max, no generator needed). ``rng`` is the seeded generator that draws them,
        ``npformer.backend.default_rng(seed, model.backend)``: the same seed gives the same tokens.
        ``exclude``: token ids never drawn (a character model's special tokens, which its training
        text never holds). With ``use_cache`` the prompt runs once and each new token alone
        (key/value cache); past ``block_size`` the context slides. Runs in eval mode under ``no_grad``."""
        return generate(self, idx, max_new_tokens, rng, temperature=temperature, top_k=top_k, top_p=top_p,
                        use_cache=use_cache, exclude=exclude)

    def save_pretrained(self, path) -> None:
        """Write the model as a Hugging Face directory: ``config.json`` and ``model.safetensors`` in the
        layout of ``GPT2LMHeadModel`` (pre-norm) or ``OpenAIGPTLMHeadModel`` (post-norm); a GPT that
        neither computes exactly is refused (:func:`npformer.models.hf_gpt.hf_model_type` says why)."""
        config = {**hf_gpt.hf_config(self.config), "dtype": str(self.dtype)}
        save_directory(path, config, hf_gpt.state_to_hf(self.state_dict(), self.config, with_tied=False))

    @classmethod
    def from_pretrained(cls, path, *, dtype="float32", backend=None) -> "GPT":
        """A GPT in eval mode from a Hugging Face ``gpt2`` or ``openai-gpt`` directory
        (``config.json``, ``model.safetensors`` or its shards), read with NumPy alone."""
        root = check_directory(path, ("config.json", "model.safetensors"))
        config = GPTConfig(**hf_gpt.config_fields_from_hf(read_config(root)))
        state = hf_gpt.state_from_hf(load_weights(root), config)
        return cls(config, dtype=dtype, backend=backend, rng=0).load_state_dict(state, strict=True).eval()
