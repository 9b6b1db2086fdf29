"""Decoding: greedy and beam search (with the GNMT length penalty) for ``Seq2Seq``; sampling with
temperature, top-k and top-p for ``GPT`` (with its key/value cache) and ``TransformerXL`` (with its
memory); ``GPT.generate`` and ``TransformerXL.generate`` call them.

Both encode the source once and run the decoder on the growing prefix under ``no_grad`` in eval
mode. A generated prefix has no padding: a ``pad_id`` the model emits (or a ``bos_id`` equal to it)
is a key like any token, with the cache or without (``Seq2Seq.decode(..., tgt_padded=False)``), so
the two paths decode alike. Both return, per source row, the tokens before the first ``eos_id``
with the ``pad_id`` tokens left out (:func:`strip_after_eos`): padding is never part of an
output. Beam search scores a finished hypothesis by ``log p(y | x) / lp(|y|)`` with
``lp(n) = ((5 + n) / 6) ** alpha`` (Wu et al. 2016); ``alpha = 0`` is the plain log-probability.
Any finite ``alpha`` works: scores are compared in log space (:func:`_normalised`).
"""
from __future__ import annotations

import math
from contextlib import contextmanager

from npformer.backend import get_array_module
from npformer.checks import describe, expect_float, expect_ndim, non_negative_int, positive_int, real
from npformer.errors import InputTypeError, RangeError
from npformer.nn.module import no_grad
from npformer.ops.softmax import log_softmax_forward, softmax_forward

__all__ = ["greedy_decode", "beam_search", "eval_mode", "strip_after_eos", "sample_next", "excluded_ids", "generate",
           "generate_with_memory"]


@contextmanager
def eval_mode(model):
    """Eval mode and no saved caches for the block; the model's mode is restored after."""
    was_training = model.training
    model.eval()
    try:
        with no_grad():
            yield model
    finally:
        model.train(was_training)


def strip_after_eos(ids: list[int], eos_id: int, pad_id: int) -> list[int]:
    """The tokens before the first ``eos_id``, without padding."""
    out = []
    for t in ids:
        if t == eos_id:
            break
        if t != pad_id:
            out.append(t)
    return out


def greedy_decode(model, src, *, bos_id: int, eos_id: int, max_len: int,
                  use_cache: bool = True) -> list[list[int]]:
    """The arg-max token at each step until ``eos_id`` (or ``max_len`` tokens), per source row: the
    tokens before ``eos_id``, without ``pad_id``s (module docstring).

    With ``use_cache`` each step feeds only the newest token through the decoder (key/value cache);
    without, it reruns the decoder on the whole prefix (the reference the cache is tested against).
    """
    max_len = positive_int(max_len, "max_len")
    xp = get_array_module(src)
    pad = model.config.pad_id
    with eval_mode(model):
        memory, src_pad = model.encode(src)                                       # (B, S, C)
        ys = xp.full((src.shape[0], 1), bos_id, dtype=src.dtype)                  # (B, 1)
        done = xp.zeros((src.shape[0],), dtype=bool)                              # (B,)
        cache = model.new_cache() if use_cache else None
        for _ in range(max_len):
            if use_cache:
                logits = model.decode(ys[:, -1:], memory, src_pad, kv_cache=cache)[:, -1]   # (B, V)
            else:
                logits = model.decode(ys, memory, src_pad, tgt_padded=False)[:, -1]   # (B, V)
            nxt = xp.where(done, pad, logits.argmax(axis=-1)).astype(ys.dtype)    # (B,)
            ys = xp.concatenate([ys, nxt[:, None]], axis=1)                       # (B, t + 1)
            done |= nxt == eos_id
            if bool(done.all()):
                break
    rows = ys[:, 1:].tolist()
    return [strip_after_eos(r, eos_id, pad) for r in rows]


def _normalised(score: float, n: int, alpha: float) -> float:
    """A key that orders hypotheses as ``score / lp(n)`` does (``score <= 0``, a log-probability),
    for any finite ``alpha``, in log space: ``score / lp(n) = -exp(log(-score) - log lp(n))`` rises
    with ``log lp(n) - log(-score)``, and ``log lp(n) = alpha * log((5 + n) / 6)`` is a float where
    ``lp(n)`` itself overflowed (``alpha = 1e6``) or divided by 0 (``alpha = -1e6``). Where even the
    log passes the float range it is +-inf, and the length alone decides, as it does in the limit."""
    log_lp = alpha * math.log((5.0 + n) / 6.0)                                    # n >= 1: log >= 0
    if score >= 0:          # probability 1: the best score of its length whatever lp is
        return math.inf
    return log_lp - math.log(-score)


def beam_search(model, src, *, bos_id: int, eos_id: int, max_len: int, beam_size: int = 4,
                length_penalty: float = 0.6) -> list[list[int]]:
    """The best hypothesis per source row by length-normalised log-probability (its tokens before
    ``eos_id``, without ``pad_id``s, as :func:`greedy_decode` returns them). A ``beam_size`` above
    the target vocabulary's size V keeps V hypotheses, as top-k sampling keeps at most V tokens (the
    candidates of k beams are k V, so a beam without that bound grew V-fold at every step)."""
    beam_size = positive_int(beam_size, "beam_size")
    length_penalty = real(length_penalty, "length_penalty")
    max_len = positive_int(max_len, "max_len")
    xp = get_array_module(src)
    pad_id = model.config.pad_id
    results = []
    with eval_mode(model):
        for i in range(src.shape[0]):
            memory, src_pad = model.encode(src[i:i + 1])                          # (1, S, C)
            beams = xp.full((1, 1), bos_id, dtype=src.dtype)                      # (k, t)
            scores = xp.zeros((1,), dtype=memory.dtype)                           # (k,)
            finished: list[tuple[float, list[int]]] = []
            for step in range(1, max_len + 1):
                k = beams.shape[0]
                mem = xp.broadcast_to(memory, (k,) + memory.shape[1:])            # (k, S, C)
                pad = xp.broadcast_to(src_pad, (k,) + src_pad.shape[1:])          # (k, S)
                logits = model.decode(beams, mem, pad, tgt_padded=False)[:, -1]   # (k, V)
                logp, _ = log_softmax_forward(logits)                             # (k, V)
                total = (scores[:, None] + logp).ravel()                          # (k * V,)
                vocab = logp.shape[1]
                width = min(beam_size, vocab)
                n_best = min(width * 2, total.size)
                top = xp.argsort(-total)[:n_best]                                 # (n,)
                keep_beams, keep_scores = [], []
                for flat in top.tolist():
                    b, tok = divmod(flat, vocab)
                    s = float(total[flat])
                    seq = beams[b].tolist()[1:] + [tok]
                    if tok == eos_id:
                        finished.append((_normalised(s, len(seq), length_penalty),
                                         strip_after_eos(seq, eos_id, pad_id)))
                    else:
                        keep_beams.append(beams[b].tolist() + [tok])
                        keep_scores.append(s)
                    if len(keep_beams) == width:
                        break
                if not keep_beams:
                    break
                # an open beam's score only falls; it ends with eos at a length in (step, max_len], the
                # most favourable being max_len for alpha >= 0 and step + 1 for alpha < 0
                most = max_len if length_penalty >= 0 else min(step + 1, max_len)
                if len(finished) >= width and \
                        max(f[0] for f in finished) >= _normalised(max(keep_scores), most, length_penalty):
                    break   # no open beam can still beat the best finished one
                beams = xp.asarray(keep_beams, dtype=src.dtype)                   # (k', t + 1)
                scores = xp.asarray(keep_scores, dtype=memory.dtype)              # (k',)
            if not finished:   # nothing reached eos within max_len: take the best open beam
                finished = [(_normalised(float(s), max_len, length_penalty),
                             strip_after_eos(b[1:], eos_id, pad_id))
                            for s, b in zip(scores.tolist(), beams.tolist())]
            results.append(max(finished, key=lambda f: f[0])[1])
    return results


def sample_next(logits, rng, *, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None):
    """One token id per row of ``logits`` (B, V): softmax(logits / temperature), restricted to the
    ``top_k`` most likely tokens and/or the smallest set whose probability reaches ``top_p``
    (nucleus sampling, Holtzman et al. 2020). ``temperature = 0`` is the arg-max; a tiny temperature
    draws among the row's largest logits alone, as its limit. Logits may hold -inf (a token that may
    not come) but no NaN or +inf, and every row needs a possible token."""
    expect_float(logits, "logits")
    expect_ndim(logits, "logits", 2, "(B, V)")
    xp = get_array_module(logits)
    temperature = real(temperature, "temperature", 0.0)
    top_k = None if top_k is None else positive_int(top_k, "top_k")
    top_p = None if top_p is None else real(top_p, "top_p", 0.0, 1.0, low_open=True)
    if bool(xp.isnan(logits).any() | xp.isposinf(logits).any()):
        raise RangeError("logits: NaN or +inf, no distribution to sample from (npformer.detect_anomaly() names "
                         "the op that made them)")
    if bool(xp.isneginf(logits).all(axis=-1).any()):
        raise RangeError("logits: a row whose every token is -inf has no token to sample")
    if temperature == 0:
        return logits.argmax(axis=-1)                                             # (B,)
    # the row max subtracted first (softmax does not change it): the largest scaled logit is 0, where
    # logits / temperature overflowed to inf for a tiny temperature (1e-308); the gaps floored at 800
    # temperatures, beyond which exp is 0 all the same (-inf logits too), so no division overflows
    z = logits.astype(xp.float64)                                                 # (B, V)
    z = xp.maximum(z - z.max(axis=-1, keepdims=True), -800.0 * temperature) / temperature   # (B, V) in [-800, 0]
    if top_k is not None:
        k = min(top_k, z.shape[-1])
        kth = xp.sort(z, axis=-1)[:, -k][:, None]                                 # (B, 1)
        z = xp.where(z < kth, -xp.inf, z)
    p, _ = softmax_forward(z)                                                     # (B, V)
    if top_p is not None:
        sorted_p = -xp.sort(-p, axis=-1)                                          # (B, V) descending
        before = xp.cumsum(sorted_p, axis=-1) - sorted_p     # mass of the more likely tokens
        n_keep = (before < top_p).sum(axis=-1, keepdims=True)   # >= 1: the first is always kept
        smallest_kept = xp.take_along_axis(sorted_p, n_keep - 1, axis=-1)        # (B, 1)
        p = xp.where(p < smallest_kept, 0.0, p)                                   # ties are kept
        p /= p.sum(axis=-1, keepdims=True)
    u = rng.random((p.shape[0], 1))                                               # (B, 1)
    idx = (xp.cumsum(p, axis=-1) < u).sum(axis=-1)                                # inverse CDF
    return xp.minimum(idx, p.shape[-1] - 1)                                       # (B,)


def _sampling_args(max_new_tokens, rng, temperature):
    """``max_new_tokens`` checked, and a generator required whenever tokens are drawn at random
    (``temperature > 0``): sampling is seeded only by a generator the caller passes."""
    max_new_tokens = non_negative_int(max_new_tokens, "max_new_tokens")
    if real(temperature, "temperature", 0.0) > 0 and rng is None:
        raise RangeError("rng: sampling (temperature > 0) needs a seeded generator, e.g. "
                         "rng=npformer.backend.default_rng(0, model.backend); temperature=0 is greedy and needs none")
    return max_new_tokens


def excluded_ids(exclude, vocab_size: int) -> list[int]:
    """``exclude`` (an iterable of token ids never to draw or rank, or None) checked against a
    vocabulary of ``vocab_size``: each id in it, and at least one token left; sorted, each once.
    A single id is refused, not taken as a one-id list: the ids are a collection everywhere."""
    if isinstance(exclude, (str, bytes)) or exclude is not None and not _iterable(exclude):
        raise InputTypeError(f"exclude: expected an iterable of token ids (ints), such as [3] or range(4), "
                             f"or None, got {describe(exclude)}")
    ids = sorted({non_negative_int(i, "exclude: a token id") for i in (() if exclude is None else exclude)})
    if ids and ids[-1] >= vocab_size:
        raise RangeError(f"exclude: token id {ids[-1]} is outside the vocabulary of {vocab_size} "
                         f"(ids 0..{vocab_size - 1})")
    if len(ids) == vocab_size:
        raise RangeError(f"exclude: all {vocab_size} tokens of the vocabulary are excluded; none is left to sample")
    return ids


def _iterable(v) -> bool:
    try:
        iter(v)        # a 0-d array has __iter__ but refuses it
    except TypeError:
        return False
    return True


def _without(logits, ids: list[int]):
    """``logits`` (B, V) with the tokens ``ids`` made impossible: -inf, in a copy (or as they are)."""
    if not ids:
        return logits
    xp = get_array_module(logits)
    logits = logits.copy()
    logits[:, ids] = -xp.inf
    return logits


def generate(model, idx, max_new_tokens: int, rng, *, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, use_cache: bool = True, exclude=None):
    """Extend ``idx`` (B, T) by ``max_new_tokens`` sampled tokens with a decoder-only model (GPT).
    With ``use_cache`` the prompt is run once and each new token alone (key/value cache). The
    tokens of ``exclude`` (ids) are never drawn: their logits are -inf (the others renormalised)."""
    max_new_tokens = _sampling_args(max_new_tokens, rng, temperature)
    never = excluded_ids(exclude, model.config.vocab_size)
    xp = get_array_module(idx)
    block = model.config.block_size

    def draw(logits):                                                             # (B, V) -> (B,)
        return sample_next(_without(logits, never), rng, temperature=temperature, top_k=top_k, top_p=top_p)
    with eval_mode(model):
        if use_cache and idx.shape[1] + max_new_tokens <= block:
            cache = model.new_cache()
            logits = model(idx, kv_cache=cache)[:, -1]                            # (B, V)
            for _ in range(max_new_tokens):
                idx = xp.concatenate([idx, draw(logits)[:, None].astype(idx.dtype)], axis=1)
                if len(cache[0]) < block:
                    logits = model(idx[:, -1:], kv_cache=cache)[:, -1]
            return idx
        for _ in range(max_new_tokens):       # no cache, or past the context: a sliding window
            logits = model(idx[:, -block:])[:, -1]
            idx = xp.concatenate([idx, draw(logits)[:, None].astype(idx.dtype)], axis=1)
    return idx


def generate_with_memory(model, idx, max_new_tokens: int, rng, *, temperature: float = 1.0,
                         top_k: int | None = None, top_p: float | None = None, mem_len: int | None = None):
    """Extend ``idx`` (B, T) by ``max_new_tokens`` sampled tokens with a Transformer-XL. The prompt
    is one segment; each new token is the next segment, reading the last ``mem_len`` positions
    (default ``config.mem_len``) of every layer from the memory, as the paper evaluates. With a
    memory of 0 each step reruns the whole sequence (relative positions have no length limit)."""
    max_new_tokens = _sampling_args(max_new_tokens, rng, temperature)
    keep = non_negative_int(model.config.mem_len if mem_len is None else mem_len, "mem_len")
    xp = get_array_module(idx)
    with eval_mode(model):
        logits, mems = model(idx, mem_len=keep)                                   # (B, T, V)
        for _ in range(max_new_tokens):
            nxt = sample_next(logits[:, -1], rng, temperature=temperature, top_k=top_k, top_p=top_p)
            idx = xp.concatenate([idx, nxt[:, None].astype(idx.dtype)], axis=1)
            if keep:
                logits, mems = model(idx[:, -1:], mems, mem_len=keep)             # (B, 1, V)
            else:
                logits, _ = model(idx, mem_len=0)                                 # (B, t + 1, V)
    return idx
