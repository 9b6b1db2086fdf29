"""The reference ops reach the CUDA paths through the dispatcher (on CuPy arrays; here the CPU emulation
makes NumPy arrays count as device arrays): every registered op, and a whole GPT training step's
gradients, equal the reference path (``npformer.kernels.disabled()``)."""
import numpy as np
import pytest

from npformer.backend import default_rng
from npformer.dispatch import FastPath
from npformer.kernels import FAST_PATHS, disabled
from npformer.ops import activations, attention, dropout, flash_attention, layernorm, linear, multihead, softmax
from tests.helpers import host, randn
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
    got, ref = _both(lambda: dropout.dropout_forward(x, 0.3, rng=default_rng(7, backend))[0])
    np.testing.assert_array_equal(host(got), host(ref))       # the same draws: the same mask
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
    assert {"layer_norm_forward", "layer_norm_backward", "gelu_forward", "gelu_backward", "softmax_forward",
            "softmax_backward", "dropout_forward", "linear_backward"} <= set(seen)
    for g, r in zip(got, ref):
        assert_close(g, r, "float64")
