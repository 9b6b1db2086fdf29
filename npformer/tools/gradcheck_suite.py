"""The gradient checks behind ``npformer gradcheck``: every op and the attention and Transformer layers
on small float64 inputs with masks and dropout, checked element by element (the layers on sampled
elements of every parameter).

Each case is a function ``build(xp, seed) -> GradcheckReport``. The shapes are small but not
trivial (Tq != Tk, several heads, padding that leaves one free key per row) so the table covers
the same ground as the test suite in a few seconds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from npformer import nn
from npformer.backend import backend_name, default_rng, get_backend, to_device
from npformer.ops import (activations, attention, batchnorm, cross_entropy, dropout, embedding,
                          feedforward, flash_attention, layernorm, linear, multihead,
                          relative_attention, rnn, softmax)
from npformer.tools.gradcheck import GradcheckReport, gradcheck, gradcheck_module

__all__ = ["Case", "CASES", "run_suite"]


@dataclass(frozen=True)
class Case:
    op: str
    build: Callable[..., GradcheckReport]


def _randn(xp, seed, *shape, scale=1.0):
    host = default_rng(seed, "numpy").standard_normal(shape) * scale
    return to_device(host, backend_name(xp))


def _away_from_zero(xp, seed, *shape):
    a = _randn(xp, seed, *shape)
    return a + xp.where(a >= 0, 0.05, -0.05)             # keeps ReLU's kink out of reach of eps


def _padding(xp, b, tk, seed):
    """Bool (B, Tk), True = padding, at least one free key per row."""
    mask = default_rng(seed, "numpy").random((b, tk)) < 0.4
    mask[:, 0] = False
    return to_device(mask, backend_name(xp))


def _seeded(forward, seed, xp, **fixed):
    """``forward`` with a fresh dropout generator per call, so every evaluation draws the same mask."""
    name = backend_name(xp)

    def run(**inputs):
        return forward(**inputs, **fixed, rng=default_rng(seed, name))
    run.__name__ = forward.__name__
    return run


def _linear(xp, s):
    inputs = {"x": _randn(xp, s, 2, 3, 4), "weight": _randn(xp, s + 1, 5, 4), "bias": _randn(xp, s + 2, 5)}
    return gradcheck(linear.linear_forward, linear.linear_backward, inputs, seed=s, label="linear")


def _embedding(xp, s):
    # ids avoid the padding row: it is used by the forward but by definition gets no gradient
    # (as in PyTorch), which the unit tests check on their own
    ids = to_device(default_rng(s, "numpy").integers(1, 6, size=(2, 5)), backend_name(xp))
    ids[0, :2] = 3                                       # repeated ids must add up
    inputs = {"ids": ids, "weight": _randn(xp, s, 6, 4)}
    return gradcheck(embedding.embedding_forward, embedding.embedding_backward, inputs,
                     kwargs={"padding_idx": 0}, seed=s, label="embedding")


def _softmax(xp, s):
    return gradcheck(softmax.softmax_forward, softmax.softmax_backward,
                     {"x": _randn(xp, s, 3, 5, scale=2.0)}, seed=s, label="softmax")


def _log_softmax(xp, s):
    return gradcheck(softmax.log_softmax_forward, softmax.log_softmax_backward,
                     {"x": _randn(xp, s, 3, 5, scale=2.0)}, seed=s, label="log_softmax")


def _cross_entropy(reduction):
    def build(xp, s):
        targets = to_device(default_rng(s, "numpy").integers(0, 7, size=(2, 4)), backend_name(xp))
        targets[1, 3] = -100                             # an ignored position
        return gradcheck(cross_entropy.cross_entropy_forward, cross_entropy.cross_entropy_backward,
                         {"logits": _randn(xp, s, 2, 4, 7, scale=2.0), "targets": targets},
                         kwargs={"reduction": reduction, "label_smoothing": 0.1}, seed=s,
                         label=f"cross_entropy[{reduction}, smoothing, ignore_index]")
    return build


def _layer_norm(xp, s):
    inputs = {"x": _randn(xp, s, 2, 3, 6), "weight": _randn(xp, s + 1, 6), "bias": _randn(xp, s + 2, 6)}
    return gradcheck(layernorm.layer_norm_forward, layernorm.layer_norm_backward, inputs, seed=s,
                     label="layer_norm")


def _relu(xp, s):
    return gradcheck(activations.relu_forward, activations.relu_backward,
                     {"x": _away_from_zero(xp, s, 3, 7)}, seed=s, label="relu")


def _gelu(approximate):
    def build(xp, s):
        return gradcheck(activations.gelu_forward, activations.gelu_backward,
                         {"x": _randn(xp, s, 3, 7, scale=2.0)}, kwargs={"approximate": approximate},
                         seed=s, label=f"gelu[{approximate}]")
    return build


def _dropout(xp, s):
    return gradcheck(_seeded(dropout.dropout_forward, s, xp, p=0.3), dropout.dropout_backward,
                     {"x": _randn(xp, s, 4, 5)}, seed=s, label="dropout[p=0.3]")


def _feed_forward(activation):
    def build(xp, s):
        c, f = 4, 6
        inputs = {"x": _away_from_zero(xp, s, 2, 3, c), "w1": _randn(xp, s + 1, f, c),
                  "b1": _randn(xp, s + 2, f), "w2": _randn(xp, s + 3, c, f), "b2": _randn(xp, s + 4, c)}
        fwd = _seeded(feedforward.feed_forward_forward, s, xp, activation=activation, dropout_p=0.25)
        return gradcheck(fwd, feedforward.feed_forward_backward, inputs, seed=s,
                         label=f"feed_forward[{activation}, dropout]")
    return build


def _attention(label, tq, tk, **options):
    def build(xp, s):
        b, h, hs = 2, 2, 3
        kwargs = dict(options)
        if kwargs.pop("padding", False):
            kwargs["key_padding_mask"] = _padding(xp, b, tk, s)
        if kwargs.pop("float_mask", False):
            kwargs["attn_mask"] = _randn(xp, s + 9, tq, tk)
        inputs = {"q": _randn(xp, s, b, h, tq, hs), "k": _randn(xp, s + 1, b, h, tk, hs),
                  "v": _randn(xp, s + 2, b, h, tk, hs)}
        fwd = _seeded(attention.scaled_dot_product_attention_forward, s, xp, **kwargs)
        return gradcheck(fwd, attention.scaled_dot_product_attention_backward, inputs, seed=s,
                         label=f"attention[{label}]")
    return build


def _multi_head(label, tq, tk, self_attention, **options):
    def build(xp, s):
        b, e, heads = 2, 6, 3
        kwargs = {"num_heads": heads, **options}
        if kwargs.pop("padding", False):
            kwargs["key_padding_mask"] = _padding(xp, b, tk, s)
        params = {"in_proj_weight": _randn(xp, s + 3, 3 * e, e, scale=0.5),
                  "in_proj_bias": _randn(xp, s + 4, 3 * e), "out_proj_weight": _randn(xp, s + 5, e, e),
                  "out_proj_bias": _randn(xp, s + 6, e)}
        if self_attention:                               # one input, the packed projection
            fwd = _seeded(multihead.self_attention_forward, s, xp, **kwargs)
            return gradcheck(fwd, multihead.self_attention_backward, {"x": _randn(xp, s, b, tq, e), **params},
                             seed=s, label=f"self_attention[{label}]")
        fwd = _seeded(multihead.multi_head_attention_forward, s, xp, **kwargs)
        inputs = {"query": _randn(xp, s, b, tq, e), "key": _randn(xp, s + 1, b, tk, e),
                  "value": _randn(xp, s + 2, b, tk, e), **params}
        return gradcheck(fwd, multihead.multi_head_attention_backward, inputs, seed=s,
                         label=f"multi_head_attention[{label}]")
    return build


def _recurrent(gates):
    def build(xp, s):
        b, t, i, h = 2, 4, 3, 3
        inputs = {"x": _randn(xp, s, b, t, i), "h0": _randn(xp, s + 1, b, h)}
        if gates == 4:
            inputs["c0"] = _randn(xp, s + 2, b, h)
        inputs.update(weight_ih=_randn(xp, s + 3, gates * h, i, scale=0.7),
                      weight_hh=_randn(xp, s + 4, gates * h, h, scale=0.7),
                      bias_ih=_randn(xp, s + 5, gates * h), bias_hh=_randn(xp, s + 6, gates * h))
        if gates == 1:
            return gradcheck(rnn.rnn_forward, rnn.rnn_backward, inputs, seed=s, label="rnn[tanh, BPTT]")

        def run(**kw):                                   # c_n appended as a step: its gradient is checked too
            out, c_n, cache = rnn.lstm_forward(**kw)
            return get_backend(backend_name(out)).concatenate([out, c_n[:, None]], axis=1), cache

        def back(dout, cache):
            return rnn.lstm_backward(dout[:, :-1], cache, dout[:, -1])
        return gradcheck(run, back, inputs, seed=s, label="lstm[BPTT, with c_n]")
    return build


def _flash(label, tq, tk, **options):
    """The tiled attention with small tiles (2 x 3), so several tiles and a ragged edge are crossed."""
    def build(xp, s):
        b, h, hs = 2, 2, 3
        kwargs = dict(options, block_q=2, block_k=3)
        if kwargs.pop("padding", False):
            kwargs["key_padding_mask"] = _padding(xp, b, tk, s)
        inputs = {"q": _randn(xp, s, b, h, tq, hs), "k": _randn(xp, s + 1, b, h, tk, hs),
                  "v": _randn(xp, s + 2, b, h, tk, hs)}
        fwd = _seeded(flash_attention.flash_attention_forward, s, xp, **kwargs)
        return gradcheck(fwd, flash_attention.flash_attention_backward, inputs, seed=s,
                         label=f"flash_attention[{label}]")
    return build


def _rel_shift(xp, s):
    return gradcheck(relative_attention.rel_shift_forward, relative_attention.rel_shift_backward,
                     {"x": _randn(xp, s, 2, 3, 5)}, seed=s, label="rel_shift")


def _relative(xp, s):
    b, h, tq, m, hs, c = 2, 2, 3, 2, 3, 4                # a memory of 2 before a segment of 3
    tk = m + tq
    inputs = {"q": _randn(xp, s, b, h, tq, hs), "k": _randn(xp, s + 1, b, h, tk, hs),
              "v": _randn(xp, s + 2, b, h, tk, hs), "r": _randn(xp, s + 3, tk, c),
              "r_weight": _randn(xp, s + 4, h * hs, c, scale=0.5), "bias_u": _randn(xp, s + 5, h, hs),
              "bias_v": _randn(xp, s + 6, h, hs)}
    fwd = _seeded(relative_attention.relative_attention_forward, s, xp,
                  key_padding_mask=_padding(xp, b, tk, s), dropout_p=0.2)
    return gradcheck(fwd, relative_attention.relative_attention_backward, inputs, seed=s,
                     label="relative_attention[memory 2, padding, dropout]")


def _batch_norm(xp, s):
    inputs = {"x": _randn(xp, s, 3, 4, 5), "weight": _randn(xp, s + 1, 5), "bias": _randn(xp, s + 2, 5)}
    running = batchnorm.RunningStats(xp.zeros(5), xp.ones(5))
    return gradcheck(batchnorm.batch_norm_forward, batchnorm.batch_norm_backward, inputs,
                     kwargs={"running": running, "padding_mask": _padding(xp, 3, 4, s)}, seed=s,
                     label="batch_norm[training, padding left out of the statistics]")


CASES: list[Case] = [
    Case("linear", _linear),
    Case("embedding", _embedding),
    Case("softmax", _softmax),
    Case("log_softmax", _log_softmax),
    Case("cross_entropy", _cross_entropy("mean")),
    Case("cross_entropy", _cross_entropy("sum")),
    Case("cross_entropy", _cross_entropy("none")),
    Case("layer_norm", _layer_norm),
    Case("relu", _relu),
    Case("gelu", _gelu("none")),
    Case("gelu", _gelu("tanh")),
    Case("dropout", _dropout),
    Case("feed_forward", _feed_forward("relu")),
    Case("feed_forward", _feed_forward("gelu")),
    Case("attention", _attention("padding, causal", 4, 4, padding=True, is_causal=True)),
    Case("attention", _attention("Tq!=Tk, bottom-right causal", 3, 5, is_causal=True,
                                 causal_alignment="bottom_right")),
    Case("attention", _attention("float mask, dropout, scale", 3, 4, float_mask=True,
                                 dropout_p=0.3, scale=0.7)),
    Case("self_attention", _multi_head("padding, causal", 4, 4, True, padding=True, is_causal=True)),
    Case("multi_head_attention", _multi_head("cross, Tq!=Tk, dropout", 3, 5, False, padding=True,
                                             dropout_p=0.2)),
    Case("flash_attention", _flash("padding, causal", 5, 5, padding=True, is_causal=True)),
    Case("flash_attention", _flash("Tq!=Tk, bottom-right causal, dropout", 3, 7, is_causal=True,
                                   causal_alignment="bottom_right", dropout_p=0.3)),
    Case("rel_shift", _rel_shift),
    Case("relative_attention", _relative),
    Case("batch_norm", _batch_norm),
    Case("rnn", _recurrent(1)),
    Case("lstm", _recurrent(4)),
]


def run_suite(backend: str = "numpy", seed: int = 0, only: str | None = None,
              extra: list[Case] | None = None) -> list[GradcheckReport]:
    """Run every case (or those whose op name contains ``only``) in float64 on ``backend``."""
    xp = get_backend(backend)
    cases = CASES + list(extra or [])
    if only:
        cases = [c for c in cases if only in c.op]
        if not cases:
            names = sorted({c.op for c in CASES + list(extra or [])})
            raise ValueError(f"--only {only!r} matches no op; the ops are {names}")
    return [c.build(xp, seed) for c in cases]


# -- layers and models: every parameter, sampled elements, dropout on with a fixed seed -----------

def _module_case(label, build_module, make_inputs, forward, max_elements=4):
    def build(xp, s):
        module = build_module(xp, s).to(dtype="float64")
        return gradcheck_module(module, make_inputs(xp, s), forward=forward, dropout_seed=s, seed=s,
                                max_elements=max_elements, label=label)
    return build


def _layer_cases():
    def enc(xp, s):
        return nn.TransformerEncoderLayer(6, 2, 8, dropout=0.1, activation="gelu", rng=s, backend=xp.__name__)

    def dec(xp, s):
        return nn.TransformerDecoderLayer(6, 2, 8, dropout=0.1, norm_first=True, rng=s, backend=xp.__name__)

    def mha(xp, s):
        return nn.MultiheadAttention(6, 3, dropout=0.1, rng=s, backend=xp.__name__)
    return [
        Case("MultiheadAttention", _module_case(
            "MultiheadAttention[cross, padding]", mha,
            lambda xp, s: {"query": _randn(xp, s, 2, 3, 6), "key": _randn(xp, s + 1, 2, 4, 6),
                           "value": _randn(xp, s + 2, 2, 4, 6)},
            lambda m, query, key, value: m(query, key, value,
                                           key_padding_mask=_padding(backend_of(query), 2, 4, 1))[0])),
        Case("TransformerEncoderLayer", _module_case(
            "TransformerEncoderLayer[post-norm, gelu, causal]", enc,
            lambda xp, s: {"src": _randn(xp, s, 2, 4, 6)},
            lambda m, src: m(src, is_causal=True))),
        Case("TransformerDecoderLayer", _module_case(
            "TransformerDecoderLayer[pre-norm, relu, memory padding]", dec,
            lambda xp, s: {"tgt": _randn(xp, s, 2, 3, 6), "memory": _randn(xp, s + 1, 2, 5, 6)},
            lambda m, tgt, memory: m(tgt, memory, tgt_is_causal=True,
                                     memory_key_padding_mask=_padding(backend_of(tgt), 2, 5, 2)))),
    ]


def backend_of(a):
    return get_backend(backend_name(a))


CASES.extend(_layer_cases())
