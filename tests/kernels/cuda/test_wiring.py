"""The reference ops reach the CUDA paths through the dispatcher (on CuPy arrays; here the CPU emulation
makes NumPy arrays count as device arrays): every registered op, and a whole GPT or encoder-decoder
training step's gradients, equal the reference path (``npformer.kernels.disabled()``); emulated, a GPT
step with its optimiser gives the same bits with the kernels' threads run last first; and the layers,
models and training loss call the fused blocks' reference ops (a NumPy test, no emulator)."""
import contextlib

import numpy as np
import pytest

from npformer.backend import default_rng
from npformer.dispatch import FastPath
from npformer.kernels import FAST_PATHS, disabled
from npformer.ops import (activations, attention, cross_entropy, dropout, feedforward, flash_attention, layernorm,
                          linear, multihead, optim, residual, softmax)
from tests.helpers import assert_same_bits, host, randn
from tests.kernels.cuda import emulator
from tests.kernels.cuda.conftest import assert_close


def _both(fn):
    """fn() through the dispatcher, then with the fast paths off."""
    got = fn()
    with disabled():
        ref = fn()
    return got, ref


@pytest.fixture
def seen():
    """The names of the reference ops whose CUDA path ran, in order (the registry is restored after)."""
    calls, saved = [], []
    for op, name, _, _ in FAST_PATHS:
        if name == "cuda":
            i = [p.name for p in op.fast_paths].index("cuda")
            path = op.fast_paths[i]
            saved.append((op, i, path))
            op.fast_paths[i] = FastPath(name, lambda *a, _r=path.run, _n=op.__name__, **k:
                                        (calls.append(_n), _r(*a, **k))[1], path.accepts)
    yield calls
    for op, i, path in saved:
        op.fast_paths[i] = path


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_each_wired_op_takes_the_fused_path_and_matches(fx, seen, dtype):
    xp = fx.xp
    backend = "numpy" if fx.name == "emulated" else "cupy"
    x, dy = randn(xp, (3, 4, 6), 0, dtype), randn(xp, (3, 4, 6), 1, dtype)
    w, b = randn(xp, (6,), 2, dtype), randn(xp, (6,), 3, dtype)
    for fwd, bwd in ((softmax.softmax_forward, softmax.softmax_backward),
                     (softmax.log_softmax_forward, softmax.log_softmax_backward),
                     (lambda x: activations.gelu_forward(x, "none"), activations.gelu_backward),
                     (lambda x: activations.gelu_forward(x, "tanh"), activations.gelu_backward)):
        got, ref = _both(lambda: (lambda y, c: (y, bwd(dy, c)))(*fwd(x)))
        for g, r in zip(got, ref):
            assert_close(g, r, dtype)
    got, ref = _both(lambda: (lambda y, c: (y, *layernorm.layer_norm_backward(dy, c)))(
        *layernorm.layer_norm_forward(x, w, b)))
    for g, r in zip(got, ref):
        assert_close(g, r, dtype)
    wl, bl = randn(xp, (5, 6), 4, dtype), randn(xp, (5,), 5, dtype)
    got, ref = _both(lambda: linear.linear_backward(randn(xp, (3, 4, 5), 6, dtype),
                                                    linear.linear_forward(x, wl, bl)[1]))
    for g, r in zip(got, ref):
        assert_close(g, r, dtype)
    got, ref = _both(lambda: (lambda o, c: (o, dropout.dropout_backward(dy, c)))(
        *dropout.dropout_forward(x, 0.3, rng=default_rng(7, backend))))
    for g, r in zip(got, ref):
        np.testing.assert_array_equal(host(g), host(r))       # the same draws: the same mask
    q, k, v = (randn(xp, (2, 2, 5, 3), s, dtype) for s in (7, 8, 9))
    pad = xp.asarray(np.array([[False] * 4 + [True], [False] * 5]))
    got, ref = _both(lambda: (lambda o, c: (o, *flash_attention.flash_attention_backward(
        randn(xp, o.shape, 10, dtype), c)))(*flash_attention.flash_attention_forward(
            q, k, v, key_padding_mask=pad, is_causal=True, dropout_p=0.2, rng=default_rng(4, backend))))
    for g, r in zip(got, ref):
        assert_close(g, r, dtype)
    xe = randn(xp, (2, 5, 6), 11, dtype)                   # self-attention, 2 heads: the packed backward
    ws = (randn(xp, (18, 6), 12, dtype), randn(xp, (18,), 13, dtype), randn(xp, (6, 6), 14, dtype),
          randn(xp, (6,), 15, dtype))
    got, ref = _both(lambda: (lambda o, _, c: (o, *multihead.self_attention_backward(
        randn(xp, o.shape, 16, dtype), c)))(*multihead.self_attention_forward(
            xe, 2, *ws, is_causal=True, need_weights=False, attention="flash")))
    for g, r in zip(got, ref):
        assert_close(g, r, dtype)
    w1, b1, w2, b2 = randn(xp, (7, 6), 11, dtype), randn(xp, (7,), 12, dtype), randn(xp, (6, 7), 13, dtype), b
    got, ref = _both(lambda: (lambda o, c: (o, *feedforward.feed_forward_backward(dy, c)))(
        *feedforward.feed_forward_forward(x, w1, b1, w2, b2, activation="gelu_tanh", dropout_p=0.2,
                                          rng=default_rng(5, backend))))
    for g, r in zip(got, ref):
        assert_close(g, r, dtype)
    got, ref = _both(lambda: residual.residual_dropout_forward(x, dy, p=0.3, rng=default_rng(6, backend))[0])
    np.testing.assert_array_equal(host(got), host(ref))
    got, ref = _both(lambda: (lambda s, y, c: (s, y, *residual.residual_dropout_layer_norm_backward(dy, x, c)))(
        *residual.residual_dropout_layer_norm_forward(x, dy, w, b, p=0.3, rng=default_rng(6, backend))))
    for g, r in zip(got, ref):
        assert_close(g, r, dtype, scale=10.0)
    tgt = xp.asarray(np.array([[0, 5, -100, 2], [1, 1, 3, 4], [5, -100, 0, 0]]))
    got, ref = _both(lambda: (lambda l, c: (l, cross_entropy.cross_entropy_backward(xp.ones((), dtype), c)))(
        *cross_entropy.cross_entropy_forward(x, tgt, label_smoothing=0.1)))
    for g, r in zip(got, ref):
        assert_close(g, r, dtype)
    p, g, m, v = (randn(xp, (3, 5), s, dtype) for s in (11, 12, 13, 14))

    def adam():
        arrays = [a.copy() for a in (p, g, m, v * v)]
        optim.adam_update(*arrays, step=3, lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                          decoupled=True)
        return arrays
    got, ref = _both(adam)
    for a, b in zip(got, ref):
        np.testing.assert_array_equal(host(a), host(b))        # the same operations: the same bits
    got, ref = _both(lambda: optim.sum_of_squares(x))
    assert_close(got, ref, "float64")
    registered = {op.__name__ for op, name, _, _ in FAST_PATHS if name == "cuda"}
    assert registered <= set(seen), f"CUDA fast paths without a parity case: {sorted(registered - set(seen))}"


def test_attention_softmax_takes_the_fused_path(fx, seen):
    xp = fx.xp
    q, k, v = (randn(xp, (2, 2, 3, 4), s) for s in (0, 1, 2))
    pad = xp.asarray(np.array([[False, False, True], [False, True, True]]))

    def run():
        out, _, cache = attention.scaled_dot_product_attention_forward(q, k, v, key_padding_mask=pad,
                                                                       is_causal=True)
        return (out, *attention.scaled_dot_product_attention_backward(randn(xp, out.shape, 3), cache))
    got, ref = _both(run)
    for g, r in zip(got, ref):
        assert_close(g, r, "float64")
    assert seen.count("softmax_forward") == 1 and seen.count("softmax_backward") == 1


def test_a_gpt_training_step_through_the_fused_kernels_equals_the_plain_one(fx, seen):
    from npformer.models.gpt import GPT, GPTConfig
    from npformer.ops.cross_entropy import cross_entropy_backward, cross_entropy_forward
    xp = fx.xp
    backend = "numpy" if fx.name == "emulated" else "cupy"     # the model lives where the kernels run
    idx = xp.asarray(np.random.default_rng(0).integers(0, 11, (2, 5)))
    tgt = xp.asarray(np.random.default_rng(1).integers(0, 11, (2, 5)))

    def step():
        model = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, d_model=8, dropout=0.1,
                              activation="gelu"), dtype="float64", backend=backend, rng=0)
        model.manual_seed(3)
        loss, cache = cross_entropy_forward(model(idx), tgt)
        model.backward(cross_entropy_backward(xp.ones(()), cache))
        return [loss] + [p.grad for _, p in model.named_parameters()]
    got, ref = _both(step)
    # attention: "auto" picks the flash kernels for CuPy arrays and the plain op (softmax kernels) for
    # the emulation's NumPy arrays (npformer.nn.attention)
    attention = ({"flash_attention_forward", "self_attention_backward"} if fx.name == "cuda"
                 else {"softmax_forward", "softmax_backward"})
    assert {"layer_norm_forward", "layer_norm_backward", "dropout_forward", "linear_backward", "feed_forward_forward",
            "feed_forward_backward", "residual_dropout_forward", "residual_dropout_layer_norm_forward",
            "residual_dropout_layer_norm_backward", "cross_entropy_forward", "cross_entropy_backward",
            *attention} <= set(seen)
    for g, r in zip(got, ref):
        assert_close(g, r, "float64")


@pytest.mark.parametrize("norm_first", [False, True])
def test_an_encoder_decoder_step_through_the_fused_kernels_equals_the_plain_one(fx, seen, norm_first):
    """The paper's post-norm layers and pre-norm ones, encoder and decoder, with dropout everywhere."""
    from npformer.nn.transformer import Transformer
    xp = fx.xp
    backend = "numpy" if fx.name == "emulated" else "cupy"
    src, tgt, dy = randn(xp, (2, 5, 8), 0), randn(xp, (2, 4, 8), 1), randn(xp, (2, 4, 8), 2)

    def step():
        model = Transformer(d_model=8, nhead=2, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=16,
                            dropout=0.2, activation="gelu", norm_first=norm_first, dtype="float64", backend=backend,
                            rng=1)
        model.manual_seed(5)
        y = model(src, tgt, tgt_is_causal=True)
        return [y, *model.backward(dy)] + [p.grad for _, p in model.named_parameters()]
    got, ref = _both(step)
    fused = {"residual_dropout_layer_norm_forward", "residual_dropout_layer_norm_backward", "feed_forward_forward",
             "feed_forward_backward"} | ({"residual_dropout_forward"} if norm_first else set())
    assert fused <= set(seen)
    for g, r in zip(got, ref):
        assert_close(g, r, "float64")


@pytest.fixture
def called():
    """The names of the listed reference ops as they are called (a probe that runs the reference
    itself, put first among each op's fast paths; the registry is restored after)."""
    calls = []
    ops = (residual.residual_dropout_layer_norm_forward, residual.residual_dropout_layer_norm_backward,
           residual.residual_dropout_forward, feedforward.feed_forward_forward, feedforward.feed_forward_backward,
           cross_entropy.cross_entropy_forward, cross_entropy.cross_entropy_backward)
    for op in ops:
        op.fast_paths.insert(0, FastPath("probe", lambda *a, _op=op, **k: (calls.append(_op.__name__),
                                                                            _op.reference(*a, **k))[1],
                                         lambda *a, **k: True))
    yield calls
    for op in ops:
        del op.fast_paths[0]


@pytest.mark.parametrize("norm_first", [False, True])
def test_the_layers_and_the_training_loss_call_the_fused_ops(called, norm_first):
    """On NumPy (no GPU, no emulator): the layers and models call the ops the CUDA kernels stand in for,
    so on CuPy arrays they take the fast paths: GPT (pre- or post-norm), BERT, the encoder-decoder."""
    from npformer.models.bert import BERT, BERTConfig
    from npformer.models.gpt import GPT, GPTConfig
    from npformer.nn.transformer import Transformer
    idx = np.random.default_rng(0).integers(0, 11, (2, 5))
    gpt = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, d_model=8, dropout=0.1,
                        activation="gelu_tanh", norm_first=norm_first), rng=0)
    loss, cache = cross_entropy.cross_entropy_forward(gpt(idx), idx)
    gpt.backward(cross_entropy.cross_entropy_backward(np.ones((), loss.dtype), cache))
    norm_f, norm_b = "residual_dropout_layer_norm_forward", "residual_dropout_layer_norm_backward"
    if norm_first:   # x1, h = x + drop1(SA(norm1 x)), norm2(x1);  x1 + drop2(FF(h))  (its backward: dropout's)
        forward, backward = [norm_f, "feed_forward_forward", "residual_dropout_forward"], ["feed_forward_backward", norm_b]
    else:            # norm1(x + drop1(SA(x)));  norm2(x1 + drop2(FF(x1)))
        forward, backward = [norm_f, "feed_forward_forward", norm_f], [norm_b, "feed_forward_backward", norm_b]
    assert called == 2 * forward + ["cross_entropy_forward", "cross_entropy_backward"] + 2 * backward
    called.clear()
    bert = BERT(BERTConfig(vocab_size=11, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=16, max_position_embeddings=8), rng=0)
    bert(idx)
    assert called.count("residual_dropout_layer_norm_forward") == 4 and called.count("feed_forward_forward") == 2
    called.clear()
    model = Transformer(d_model=8, nhead=2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=16,
                        norm_first=norm_first, rng=0)
    model.backward(model(randn(np, (2, 5, 8), 0, "float32"), randn(np, (2, 4, 8), 1, "float32")))
    assert called.count("residual_dropout_layer_norm_forward") == (3 if norm_first else 5)
    assert called.count("residual_dropout_layer_norm_backward") == (3 if norm_first else 5)
    assert called.count("feed_forward_forward") == called.count("feed_forward_backward") == 2


def test_a_training_step_gives_the_same_bits_with_its_threads_reversed(fx, request, seen):
    """Emulated: a float32 GPT step (dropout, GELU, layer norms, the attention softmax, cross-entropy, the
    gradient norm and AdamW: the fused kernels on the way) run again with its blocks, each block's warps and
    each warp's lanes last first (emulator.reversed_schedule) gives the loss, the norm, every gradient and every updated
    weight bit for bit, so no kernel's result hangs on the order its threads run in, which a GPU does not
    keep (the flash kernels: test_flash_attention's test of their threads' order)."""
    if fx.name != "emulated":
        pytest.skip("the emulator's schedules; a GPU keeps its own")
    from npformer.models.gpt import GPT, GPTConfig
    from npformer.ops.cross_entropy import cross_entropy_backward, cross_entropy_forward
    from npformer.training.optim import AdamW, clip_grad_norm
    idx = np.random.default_rng(0).integers(0, 11, (2, 7))
    tgt = np.random.default_rng(1).integers(0, 11, (2, 7))

    def step():
        model = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, d_model=16, dropout=0.1,
                              activation="gelu"), dtype="float32", backend="numpy", rng=0)
        model.manual_seed(3)
        loss, cache = cross_entropy_forward(model(idx), tgt)
        model.backward(cross_entropy_backward(np.ones((), np.float32), cache))
        norm = clip_grad_norm(model.parameters(), 0.5)
        params = list(model.parameters())
        grads = [p.grad.copy() for p in params]
        AdamW(params, lr=1e-2).step()
        return [np.asarray(loss), np.asarray(norm)] + grads + [p.data for p in params]
    first = step()
    assert {"adam_update", "sum_of_squares", "cross_entropy_forward", "cross_entropy_backward", "dropout_forward",
            "feed_forward_forward", "feed_forward_backward", "layer_norm_forward", "layer_norm_backward",
            "residual_dropout_layer_norm_forward", "residual_dropout_layer_norm_backward", "softmax_forward",
            "softmax_backward"} <= set(seen)
    with contextlib.ExitStack() as stack:
        for module in ("emulated_module", "emulated_flash_module"):
            stack.enter_context(emulator.reversed_schedule(request.getfixturevalue(module)))
        again = step()
    assert len(first) == len(again) > 2 and all(np.isfinite(a).all() for a in first)
    for a, b in zip(first, again):
        assert_same_bits(b, a)
