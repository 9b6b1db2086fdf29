"""Every CPU fast path against its reference op (npformer.kernels.cpu vs npformer.ops).

For each: outputs and gradients in float64, float32 and float16 within ``TOL`` (tests/helpers.py),
either backward on either forward's cache, a float64 gradient check through the fast path, the
same errors for bad input; dropout's mask equal bit for bit. A last test fails when a CPU fast path
is registered without a case here.
"""
import contextlib
import itertools
import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

from npformer import kernels
from npformer.backend import accumulation_dtype, default_rng, resolve_dtype
from npformer.kernels.cpu.activations import erf_float32
from npformer.kernels.cpu import activations as cpu_activations
from npformer.kernels.cpu import dropout as cpu_dropout
from npformer.kernels.cpu import linear as cpu_linear
from npformer.kernels.cpu import threads
from npformer.ops import activations, attention, dropout, embedding, layernorm, linear, multihead, optim, softmax
from npformer.errors import InputTypeError
from npformer.tools.gradcheck import gradcheck
from tests.helpers import (assert_blocked_attention, assert_close, assert_fast_path_pair, assert_future_keys_unread,
                           assert_gradcheck, assert_packed_self_attention, assert_same_bits, padding_masks, randn,
                           seeds)

DTYPES = ("float64", "float32", "float16")
SHIPPED_MIN_BLOCKED_ELEMENTS = cpu_dropout.MIN_BLOCKED_ELEMENTS     # (read before conftest's fixture lowers it)
shapes = st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple)


def _both(fn):
    """fn() on the fast path, then on the reference path."""
    got = fn()
    with kernels.disabled():
        ref = fn()
    return got, ref


def _pair_case(fwd, bwd, x, dy, dtype, what, **kw):
    """The forward and backward of one op on its NumPy fast path: fast against reference, and each
    backward on both caches."""
    assert getattr(fwd, "fast_paths", None) is None or kernels.implementation(fwd, x, **kw) == "cpu"
    assert_fast_path_pair(fwd, bwd, x, dy, dtype, what, **kw)


@given(shape=shapes, seed=seeds, dtype=st.sampled_from(DTYPES), masked=st.booleans())
def test_softmax_and_log_softmax(shape, seed, dtype, masked):
    x = randn(np, shape, seed, dtype, scale=3.0)
    if masked:                                           # -inf entries and, with one column, whole rows
        x[..., 0] = -np.inf
    dy = randn(np, shape, seed + 1, dtype)
    _pair_case(softmax.softmax_forward, softmax.softmax_backward, x, dy, dtype, "softmax")
    if not masked:                                       # log-softmax of a fully masked row is -inf: no dy
        _pair_case(softmax.log_softmax_forward, softmax.log_softmax_backward, x, dy, dtype, "log_softmax")


@given(shape=shapes, seed=seeds, dtype=st.sampled_from(DTYPES), form=st.sampled_from(["none", "tanh"]))
def test_gelu(shape, seed, dtype, form):
    x, dy = randn(np, shape, seed, dtype, scale=3.0), randn(np, shape, seed + 1, dtype)
    _pair_case(activations.gelu_forward, activations.gelu_backward, x, dy, dtype, f"gelu {form}", approximate=form)


@given(shape=shapes, seed=seeds, dtype=st.sampled_from(DTYPES), affine=st.booleans())
def test_layer_norm(shape, seed, dtype, affine):
    x, dy = randn(np, shape, seed, dtype, scale=2.0), randn(np, shape, seed + 1, dtype)
    w = randn(np, shape[-1:], seed + 2, dtype) if affine else None
    b = randn(np, shape[-1:], seed + 3, dtype) if affine else None
    fwd = lambda x: layernorm.layer_norm_forward(x, w, b)   # noqa: E731
    assert kernels.implementation(layernorm.layer_norm_forward, x, w, b) == "cpu"
    _pair_case(fwd, layernorm.layer_norm_backward, x, dy, dtype, "layer norm")


@given(shape=shapes, seed=seeds, dtype=st.sampled_from(DTYPES), p=st.sampled_from([0.1, 0.5, 0.9, 1.0]))
def test_dropout_masks_are_the_reference_bit_for_bit(shape, seed, dtype, p):
    x = randn(np, shape, seed, dtype)
    rng_fast, rng_ref = default_rng(seed, "numpy"), default_rng(seed, "numpy")
    assert kernels.implementation(dropout.dropout_forward, x, p, rng=rng_fast) == "cpu"
    out, cache = dropout.dropout_forward(x, p, rng=rng_fast)
    with kernels.disabled():
        out_ref, cache_ref = dropout.dropout_forward(x, p, rng=rng_ref)
    np.testing.assert_array_equal(out, out_ref)
    np.testing.assert_array_equal(cache.keep, cache_ref.keep)
    assert out.dtype == x.dtype and cache.keep.dtype == bool and cache.scale == cache_ref.scale
    assert cache.scale.dtype == accumulation_dtype(x.dtype)   # float32 for float16 (ops.dropout.keep_scale)
    np.testing.assert_array_equal(rng_fast.random(7), rng_ref.random(7))   # the same draws consumed


def test_small_masks_take_the_reference(monkeypatch):
    """Under MIN_BLOCKED_ELEMENTS the reference's whole-array pass is the faster (kernels/cpu/dropout.py),
    at and above it the blocked path runs: the size alone decides."""
    monkeypatch.setattr(cpu_dropout, "MIN_BLOCKED_ELEMENTS", SHIPPED_MIN_BLOCKED_ELEMENTS)
    for size, want in ((SHIPPED_MIN_BLOCKED_ELEMENTS - 1, "reference"), (SHIPPED_MIN_BLOCKED_ELEMENTS, "cpu")):
        x = np.zeros(size, np.float32)
        assert kernels.implementation(dropout.dropout_forward, x, 0.5, rng=default_rng(0, "numpy")) == want


def test_dropout_takes_any_size_and_any_numpy_generator():
    """The mask is made from one seed, so no size or bit generator needs the reference; without a
    generator the reference runs and raises its error."""
    for x, rng in ((np.zeros(3, np.float32), default_rng(0, "numpy")),
                   (np.zeros(2, np.float32), np.random.Generator(np.random.MT19937(0)))):
        assert kernels.implementation(dropout.dropout_forward, x, 0.5, rng=rng) == "cpu"
    assert kernels.implementation(dropout.dropout_forward, np.zeros(2), 0.5, rng=None) == "reference"


@given(b=st.integers(1, 2), h=st.integers(1, 2), tq=st.integers(1, 5), tk=st.integers(1, 5),
       hs=st.integers(1, 4), seed=seeds, dtype=st.sampled_from(DTYPES), causal=st.booleans(),
       p=st.sampled_from([0.0, 0.3]), data=st.data())
def test_attention(b, h, tq, tk, hs, seed, dtype, causal, p, data):
    q, k, v = (randn(np, (b, h, t, hs), seed + i, dtype) for i, t in enumerate((tq, tk, tk)))
    dout = randn(np, (b, h, tq, hs), seed + 3, dtype)
    pad = data.draw(padding_masks(b, tk))
    kw = dict(key_padding_mask=pad, is_causal=causal, dropout_p=p, need_weights=True)

    def run():
        out, weights, cache = attention.scaled_dot_product_attention_forward(
            q, k, v, rng=default_rng(seed, "numpy"), **kw)
        return (out, weights, *attention.scaled_dot_product_attention_backward(dout, cache)), cache
    assert kernels.implementation(attention.scaled_dot_product_attention_forward, q, k, v, **kw) == "cpu"
    (got, cache), (ref, cache_ref) = _both(run)
    for name, g, r in zip(("out", "weights", "dq", "dk", "dv"), got, ref):
        assert_close(g, r, dtype, what=f"attention {name}")
    crossed = attention.scaled_dot_product_attention_backward(dout, cache_ref)    # fast backward, reference cache
    for g, r in zip(crossed, ref[2:]):
        assert_close(g, r, dtype, what="attention backward on the reference cache")


@pytest.mark.parametrize("name", ["softmax", "log_softmax", "gelu", "gelu_tanh", "layer_norm", "attention"])
def test_gradcheck_through_the_fast_path(name):
    """float64 central differences through the CPU fast paths (they take float64 NumPy arrays)."""
    x = randn(np, (2, 3, 5), 1)
    cases = {
        "softmax": (softmax.softmax_forward, softmax.softmax_backward, {"x": x}, {}),
        "log_softmax": (softmax.log_softmax_forward, softmax.log_softmax_backward, {"x": x}, {}),
        "gelu": (activations.gelu_forward, activations.gelu_backward, {"x": x}, {"approximate": "none"}),
        "gelu_tanh": (activations.gelu_forward, activations.gelu_backward, {"x": x}, {"approximate": "tanh"}),
        "layer_norm": (layernorm.layer_norm_forward, layernorm.layer_norm_backward,
                       {"x": x, "weight": randn(np, (5,), 2), "bias": randn(np, (5,), 3)}, {}),
        "attention": (attention.scaled_dot_product_attention_forward,
                      attention.scaled_dot_product_attention_backward,
                      {"q": randn(np, (2, 2, 3, 4), 4), "k": randn(np, (2, 2, 5, 4), 5), "v": randn(np, (2, 2, 5, 4), 6)},
                      {"is_causal": True, "causal_alignment": "bottom_right"}),
    }
    fwd, bwd, inputs, kw = cases[name]
    assert kernels.implementation(fwd, *inputs.values(), **kw) == "cpu"
    assert_gradcheck(gradcheck(fwd, bwd, inputs, kwargs=kw, label=f"{name} (cpu fast path)"))


@pytest.mark.parametrize("call, error", [
    (lambda: softmax.softmax_forward(np.zeros((2, 0), np.float32)), "x: expected rows"),
    (lambda: softmax.log_softmax_forward(np.asarray(1.0, np.float32)), "x: expected rows"),
    (lambda: activations.gelu_forward(np.zeros(3, np.float32), approximate="erf"), "approximate: expected one of"),
    (lambda: layernorm.layer_norm_forward(np.zeros((2, 3), np.float32), np.ones(4, np.float32)),
     r"weight: expected shape \(3,\)"),
    (lambda: dropout.dropout_forward(np.zeros(4, np.float32), 1.5, rng=default_rng(0, "numpy")),
     r"p: expected a probability in \[0, 1\]"),
    (lambda: linear.linear_forward(np.zeros((2, 3), np.float32), np.zeros((4, 5), np.float32)),
     r"x: expected last axis of size C_in=5"),
    (lambda: linear.linear_forward(np.zeros((2, 3), np.float32), np.zeros((4, 3), np.float32), np.zeros(3, np.float32)),
     r"bias: expected shape \(4,\)"),
    (lambda: attention.scaled_dot_product_attention_forward(*(np.zeros((1, 1, 2, 3), np.float32),) * 3,
                                                            dropout_p=-0.1), "dropout_p: expected a probability"),
])
def test_bad_input_gets_the_reference_error_on_both_paths(call, error):
    with pytest.raises(ValueError, match=error):
        call()
    with kernels.disabled(), pytest.raises(ValueError, match=error):
        call()


# -- the optimiser's update and sum of squares (npformer.ops.optim) ----------------------------------

ADAM_CASES = [dict(weight_decay=0.0, decoupled=False), dict(weight_decay=0.1, decoupled=False),
              dict(weight_decay=0.1, decoupled=True)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ADAM_CASES, ids=["no-decay", "adam-l2", "adamw"])
@pytest.mark.parametrize("n", [1, 7, 3 * (1 << 16) + 5])      # one block, a partial one, several blocks
def test_adam_update_blocks_give_the_reference_bits(dtype, case, n):
    """The same operations in the same order per element: every output bit for bit, the float16
    copy of a float32 parameter included."""
    p, g, m, v = (randn(np, (n,), s, dtype) for s in range(4))
    copy_dtype = "float16" if dtype == "float32" else None
    kw = dict(step=7, lr=3e-3, beta1=0.9, beta2=0.98, eps=1e-6, **case)

    def run():
        arrays = [a.copy() for a in (p, g, m, v * v)]
        copy = np.zeros(n, copy_dtype) if copy_dtype else None
        assert kernels.implementation(optim.adam_update, *arrays, param_copy=copy, **kw) == \
            ("cpu" if kernels.enabled() else "reference")
        optim.adam_update(*arrays, param_copy=copy, **kw)
        return arrays + ([copy] if copy_dtype else [])
    got, ref = _both(run)
    for name, a, b in zip(("param", "grad", "exp_avg", "exp_avg_sq", "param_copy"), got, ref):
        np.testing.assert_array_equal(a, b, err_msg=name)
    assert not np.array_equal(got[0], p)                              # it did step


@pytest.mark.parametrize("half", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", ADAM_CASES, ids=["no-decay", "adam-l2", "adamw"])
@pytest.mark.parametrize("scale", [1.0, 2.0 ** -12, 0.37 * 2.0 ** -12])
def test_adam_update_reads_16_bit_gradients_with_their_scale(half, case, scale):
    """Mixed precision's float32 masters step with the model's 16-bit gradients times grad_scale: the blocks
    and the reference give the bits of the float32 gradient made first, ``float32(g) * float32(scale)``."""
    if half == "bfloat16":
        pytest.importorskip("ml_dtypes", reason="bfloat16 is ml_dtypes' dtype (the bfloat16 extra)")
    half = resolve_dtype(np, half)
    n = 3 * (1 << 16) + 5
    p, g, m, v = (randn(np, (n,), s, "float32") for s in range(4))
    g16 = (g * 4096).astype(half)
    kw = dict(step=7, lr=3e-3, beta1=0.9, beta2=0.98, eps=1e-6, **case)

    def run(grad, grad_scale, copy_dtype=half):
        arrays = [a.copy() for a in (p, grad, m, v * v)]
        copy = np.zeros(n, copy_dtype)
        optim.adam_update(*arrays, param_copy=copy, grad_scale=grad_scale, **kw)
        return [arrays[0], arrays[2], arrays[3], copy]
    got, ref = _both(lambda: run(g16, scale))
    expected = "cpu" if half == np.float16 else "reference"        # ml_dtypes' bfloat16: the reference's
    assert kernels.implementation(optim.adam_update, p, g16, m, v, param_copy=np.zeros(n, half), grad_scale=scale,
                                  **kw) == expected
    made_first = run(g16.astype(np.float32) * np.float32(scale), 1.0)
    for name, a, b, c in zip(("param", "exp_avg", "exp_avg_sq", "param_copy"), got, ref, made_first):
        assert_same_bits(a, b, name)
        assert_same_bits(a, c, name)


def test_adam_update_takes_no_other_gradient_dtype_than_16_bits_for_a_wider_parameter():
    kw = dict(step=1, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8)
    for path in (contextlib.nullcontext, kernels.disabled):
        for param, grad in ((np.float32, np.float64), (np.float64, np.float32)):
            p, m, v = np.ones(3, param), np.zeros(3, param), np.zeros(3, param)
            with path(), pytest.raises(InputTypeError, match=rf"grad: expected {np.dtype(param)} \(the parameter's\), "
                                                           "or float16 or bfloat16 for a wider parameter"):
                optim.adam_update(p, np.ones(3, grad), m, v, **kw)
            assert np.array_equal(p, np.ones(3, param))


def test_adam_update_takes_views_in_place_and_rejects_bad_shapes():
    base = randn(np, (4, 6), 0, "float32")
    p = base[1:3]                                                     # a contiguous view: updated in place
    g, m, v = randn(np, (2, 6), 1, "float32"), np.zeros((2, 6), np.float32), np.zeros((2, 6), np.float32)
    before = p.copy()
    optim.adam_update(p, g, m, v, step=1, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8)
    assert not np.array_equal(base[1:3], before) and np.array_equal(base[0], randn(np, (4, 6), 0, "float32")[0])
    for path in (contextlib.nullcontext(), kernels.disabled()):
        with path, pytest.raises(ValueError, match=r"exp_avg: expected shape \(2, 6\)"):
            optim.adam_update(p, g, m[:1], v, step=1, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (3, 5), (1 << 16, 3), (0,)])
def test_sum_of_squares_in_float64(dtype, shape):
    """Float64 sums over cache-sized blocks in the reference's order of additions: its bits."""
    x = randn(np, shape, 3, dtype, scale=100.0)
    got, ref = _both(lambda: optim.sum_of_squares(x))
    assert got.dtype == ref.dtype == np.float64 and got.shape == ref.shape == ()
    assert got.tobytes() == ref.tobytes()
    big = np.full(10, 60000.0, np.float16)                             # squares beyond float16 and exact
    assert float(optim.sum_of_squares(big)) == 10 * 60000.0 ** 2


@given(lead=st.lists(st.integers(1, 5), min_size=0, max_size=2).map(tuple), c_in=st.integers(1, 6),
       c_out=st.integers(1, 6), seed=seeds, dtype=st.sampled_from(DTYPES), bias=st.booleans(),
       thread_count=st.integers(1, 3))
def test_linear(lead, c_in, c_out, seed, dtype, bias, thread_count):
    """Products cut between 1-3 threads (every product split: MIN_PARALLEL_FLOPS 1) against the reference."""
    x, dy = randn(np, lead + (c_in,), seed, dtype), randn(np, lead + (c_out,), seed + 1, dtype)
    w = randn(np, (c_out, c_in), seed + 2, dtype)
    b = randn(np, (c_out,), seed + 3, dtype) if bias else None
    assert kernels.implementation(linear.linear_forward, x, w, b) == "cpu"
    before = threads.get_num_threads()
    threads.set_num_threads(thread_count, blas=False)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(cpu_linear, "MIN_PARALLEL_FLOPS", 1)
            _pair_case(lambda x: linear.linear_forward(x, w, b), linear.linear_backward, x, dy, dtype, "linear")
    finally:
        threads.set_num_threads(before, blas=False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_bias_gradient_is_the_reference_bit_for_bit(monkeypatch, thread_count, dtype):
    """db summed per part of output features, beside that part's dW: the reference's sum, bit for bit,
    for C-ordered and transposed gradients and any thread count."""
    monkeypatch.setattr(cpu_linear, "MIN_PARALLEL_FLOPS", 1)
    x, w, b = randn(np, (2, 45, 24), 0, dtype), randn(np, (70, 24), 1, dtype), randn(np, (70,), 2, dtype)
    _, cache = linear.linear_forward(x, w, b)
    for dy in (randn(np, (2, 45, 70), 3, dtype), randn(np, (70, 45, 2), 4, dtype).transpose(2, 1, 0)):
        with kernels.disabled():
            want = linear.linear_backward(dy, cache)[2]
        for n in (1, 2, 3):
            thread_count(n)
            np.testing.assert_array_equal(linear.linear_backward(dy, cache)[2], want, err_msg=f"{n} threads")


def test_gradcheck_through_the_linear_fast_path(monkeypatch):
    monkeypatch.setattr(cpu_linear, "MIN_PARALLEL_FLOPS", 1)                  # cut into parts even here
    inputs = {"x": randn(np, (2, 3, 5), 1), "weight": randn(np, (4, 5), 2), "bias": randn(np, (4,), 3)}
    assert kernels.implementation(linear.linear_forward, *inputs.values()) == "cpu"
    assert_gradcheck(gradcheck(linear.linear_forward, linear.linear_backward, inputs, label="linear (cpu fast path)"))


def test_float16_linear_is_the_references_float32_products_rounded_once(thread_count):
    """float16 on one thread: the reference's products (npformer.backend.matmul: float32 BLAS sums,
    one rounding) bit for bit, forward and backward, never NumPy's float16 product (no BLAS)."""
    thread_count(1)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 24, 40)).astype(np.float16)
    w, b = (rng.standard_normal(s).astype(np.float16) * 0.2 for s in ((72, 40), (72,)))
    dy = rng.standard_normal((4, 24, 72)).astype(np.float16)
    assert kernels.implementation(linear.linear_forward, x, w, b) == "cpu"
    (y, cache), (y_ref, _) = _both(lambda: linear.linear_forward(x, w, b))
    np.testing.assert_array_equal(y, y_ref)
    grads, grads_ref = _both(lambda: linear.linear_backward(dy, cache))
    for name, got, want in zip(("dx", "dweight", "dbias"), grads, grads_ref):
        assert got.dtype == np.float16
        np.testing.assert_array_equal(got, want, err_msg=name)


def test_linear_parts_cover_the_products_whatever_the_thread_count(monkeypatch):
    """Big enough to be cut (rows and output features), with ragged ends; the same within rounding
    for 1-3 threads, and bit for bit from run to run at one thread count."""
    x, w, b = randn(np, (3, 37, 40), 0, "float32"), randn(np, (50, 40), 1, "float32"), randn(np, (50,), 2, "float32")
    dy = randn(np, (3, 37, 50), 3, "float32")
    monkeypatch.setattr(cpu_linear, "MIN_PARALLEL_FLOPS", 1)
    with kernels.disabled():
        y_ref, c_ref = linear.linear_forward(x, w, b)
        g_ref = linear.linear_backward(dy, c_ref)
    before = threads.get_num_threads()
    try:
        for n in (1, 2, 3):
            threads.set_num_threads(n, blas=False)
            y, cache = linear.linear_forward(x, w, b)
            grads = linear.linear_backward(dy, cache)
            assert_close(y, y_ref, "float32", what=f"{n} threads forward")
            for g, r in zip(grads, g_ref):
                assert_close(g, r, "float32", scale=float(np.abs(r).max()), what=f"{n} threads backward")
            again = linear.linear_backward(dy, linear.linear_forward(x, w, b)[1])
            for g, r in zip(again, grads):
                np.testing.assert_array_equal(g, r)
            empty, cache = linear.linear_forward(x[:, :0], w, b)          # no rows: zero weight gradient
            dx, dw, db = linear.linear_backward(empty, cache)
            assert empty.shape == (3, 0, 50) and dx.shape == (3, 0, 40) and not dw.any() and not db.any()
    finally:
        threads.set_num_threads(before, blas=False)


@given(lead=st.lists(st.integers(1, 7), min_size=0, max_size=2).map(tuple), v=st.integers(1, 9),
       c=st.integers(1, 5), seed=seeds, dtype=st.sampled_from(DTYPES), pad=st.booleans())
def test_embedding_backward(lead, v, c, seed, dtype, pad):
    """Repeated ids (few distinct ones), a padding row or none, any id order: the reference's
    gradient to rounding, an unused row exactly zero."""
    ids = np.random.default_rng(seed).integers(0, v, lead)
    w = randn(np, (v, c), seed, dtype)
    padding_idx = int(seed % v) if pad else None
    out, cache = embedding.embedding_forward(ids, w, padding_idx=padding_idx)
    dout = randn(np, out.shape, seed + 1, dtype)
    assert kernels.implementation(embedding.embedding_backward, dout, cache) == "cpu"
    got, ref = _both(lambda: embedding.embedding_backward(dout, cache))
    assert got.dtype == ref.dtype == np.dtype(dtype)
    assert_close(got, ref, dtype, scale=max(1.0, float(np.abs(dout.astype(np.float64)).sum())), what="dW")
    unused = np.setdiff1d(np.arange(v), ids)
    assert not np.any(got[unused]) and (padding_idx is None or not np.any(got[padding_idx]))


def test_gradcheck_through_the_embedding_fast_path():
    ids = np.array([[3, 1, 3, 0], [1, 1, 4, 3]])                       # padding row 2 unused: its gradient is 0
    w = randn(np, (5, 3), 0)
    assert_gradcheck(gradcheck(embedding.embedding_forward, embedding.embedding_backward, {"ids": ids, "weight": w},
                               kwargs={"padding_idx": 2}, label="embedding (cpu fast path)"))


def test_every_cpu_fast_path_has_a_parity_case_here():
    tested = {"adam_update", "sum_of_squares", "linear_forward", "linear_backward", "embedding_backward",
              "softmax_forward", "softmax_backward", "log_softmax_forward", "log_softmax_backward",
              "gelu_forward", "gelu_backward", "layer_norm_forward", "layer_norm_backward", "dropout_forward",
              "scaled_dot_product_attention_forward", "scaled_dot_product_attention_backward",
              "self_attention_backward"}
    registered = {op.__name__ for op, name, _, _ in kernels.FAST_PATHS if name == "cpu"}
    assert registered <= tested, f"CPU fast paths without a parity case: {sorted(registered - tested)}"


# -- the float32 erf of the GELU fast path ------------------------------------------------------

def _ulps(got, ref):
    """|got - ref| in units of the float32 spacing at ref (float64 ref, float32 got)."""
    spacing = np.maximum(np.spacing(np.abs(ref).astype(np.float32)).astype(np.float64), 2.0 ** -149)
    return np.abs(got.astype(np.float64) - ref) / spacing


def test_erf_float32_is_within_a_few_float32_ulp():
    """The branch-free float32 formula against math.erf of the same float32 inputs."""
    rng = np.random.default_rng(0)
    x = np.concatenate([np.linspace(-6, 6, 600_001), rng.standard_normal(100_000) * 2,
                        np.linspace(-1e-3, 1e-3, 2001), [1e-30, -1e-38, 4.25, -4.25, 30.0]]).astype(np.float32)
    ref = np.array([math.erf(v) for v in x.astype(np.float64)])
    got = erf_float32(x)
    assert got.dtype == np.float32
    u = _ulps(got, ref)
    assert u.max() <= 6, f"worst {u.max():.2f} ulp at x={x[np.argmax(u)]!r}"
    assert np.mean(u <= 1) > 0.9                          # typically within one ulp
    assert np.array_equal(erf_float32(-x), -got)          # odd, exactly


def test_gelu_backward_from_the_kept_cdf():
    """The forward keeps y / x; the backward from it is the recomputing backward's bits for the erf
    form, and within 16.4 (measured) of 24 float32 epsilons of the float64 derivative for the tanh
    form (1 - t^2 as 4 cdf (1 - cdf)), against 10.3 recomputed."""
    x = np.linspace(-12, 12, 200_001).astype(np.float32)
    dy = np.ones_like(x)
    eps = np.finfo(np.float32).eps
    for form in ("none", "tanh"):
        _, cache = activations.gelu_forward(x, approximate=form)
        assert cache.cdf is not None and cache.cdf.shape == x.shape
        np.testing.assert_array_equal(cache.cdf * x, activations.gelu_forward(x, approximate=form)[0])
        kept, recomputed = (activations.gelu_backward(dy, c) for c in (cache, cache._replace(cdf=None)))
        if form == "none":
            np.testing.assert_array_equal(kept, recomputed)
        with kernels.disabled():
            _, c64 = activations.gelu_forward(x.astype(np.float64), approximate=form)
            exact = activations.gelu_backward(dy.astype(np.float64), c64)
        assert np.max(np.abs(kept - exact)) <= 24 * eps, form


def test_float32_gelu_cdf_is_within_3e_7_and_exact_in_the_tails():
    """The float32 GELU's Phi (the rational erf, no tanh): within 3e-7 of the CDF everywhere, as the
    compiled GELU's; exactly 0 and 1 in the tails (so GELU(-1e30) is 0, not -1e30 times a residue),
    NaN through, and the GELU built on it is the reference's x Phi(x)."""
    from npformer.kernels.cpu.activations import _phi_float32_block
    x = np.concatenate([np.linspace(-12, 12, 1_200_001), [1e30, -1e30, 3.4e38, -3.4e38, np.inf, -np.inf, np.nan]])
    x = x.astype(np.float32)
    phi = np.empty_like(x)
    _phi_float32_block(phi, x)
    ref = np.array([0.5 * math.erfc(-v / math.sqrt(2.0)) for v in x.astype(np.float64)])
    finite = np.isfinite(x)
    assert np.abs(phi[finite] - ref[finite]).max() <= 3e-7
    assert (phi[x <= -6.4] == 0).all() and (phi[x >= 6.4] == 1).all() and np.isnan(phi[-1])
    y, _ = cpu_activations.gelu_forward(x[finite])
    np.testing.assert_array_equal(y[x[finite] < -6.4], 0.0)


def test_erf_float32_edges():
    got = erf_float32(np.float32([np.inf, -np.inf, np.nan, 0.0, 4.25, 1e30, -3.4e38]))
    assert got.dtype == np.float32 and np.isnan(got[2])
    np.testing.assert_array_equal(got[[0, 1, 3, 4, 5, 6]], [1, -1, 0, 1, 1, -1])


# -- the threaded, blocked attention and dropout: cut points, threads and the streamed mask -----------

@pytest.mark.parametrize("tq, tk", [(1, 1), (1, 2), (3, 2), (5, 4), (6, 6), (7, 3)])   # 7x3: odd Tk
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_blocks_and_threads_give_the_reference(tiny_blocks, thread_count, tq, tk, alignment, dtype):
    assert_blocked_attention("cpu", thread_count, tq, tk, dtype, alignment)


@pytest.mark.parametrize("alignment, tq, tk", [("top_left", 9, 9), ("top_left", 4, 10), ("bottom_right", 12, 9),
                                               ("bottom_right", 3, 10), (None, 5, 9)])
def test_causal_blocks_compute_only_the_keys_their_rows_attend(tiny_blocks, alignment, tq, tk):
    """FlashAttention's rule on the CPU: a block computes no score its rows may not attend. In blocks of
    one query row (the tiny blocks at Tk > 8), the softmax and its backward see exactly the (query, key)
    pairs the causal mask allows, in either alignment (rows that see no key: none); without the mask
    (alignment None) every pair. The results are the reference's."""
    from npformer.kernels.cpu.attention import NUMPY_ROWS, attention_backward, attention_forward
    from npformer.ops.masks import causal_mask
    seen = {"softmax": 0, "softmax_grad": 0}

    def counted(name, kernel):
        def run(*args):
            seen[name] += args[0].size
            return kernel(*args)
        return run
    rows_ = NUMPY_ROWS._replace(softmax=counted("softmax", NUMPY_ROWS.softmax),
                                softmax_grad=counted("softmax_grad", NUMPY_ROWS.softmax_grad))
    b, h, hs = 2, 3, 4
    q, k, v = (randn(np, (b, h, t, hs), i, "float64") for i, t in enumerate((tq, tk, tk)))
    dout = randn(np, (b, h, tq, hs), 3, "float64")
    causal = alignment is not None
    out, _, cache = attention_forward(rows_, q, k, v, None, None, causal, alignment or "top_left", 0.0, None, True,
                                      None, False)
    grads = attention_backward(rows_, dout, cache)
    allowed = int((~causal_mask(tq, tk, alignment=alignment)).sum()) if causal else tq * tk
    assert seen == {"softmax": b * h * allowed, "softmax_grad": b * h * allowed}
    assert allowed < tq * tk or not causal
    with kernels.disabled():
        ref_out, _, ref_cache = attention.scaled_dot_product_attention_forward(
            q, k, v, is_causal=causal, causal_alignment=alignment or "top_left")
        ref_grads = attention.scaled_dot_product_attention_backward(dout, ref_cache)
    for name, g, r in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads)):
        assert_close(g, r, "float64", what=f"attention {name}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_causal_attention_reads_no_key_in_every_rows_future(dtype):
    assert_future_keys_unread("cpu", dtype)


def test_attention_blocks_are_contiguous_runs_in_head_groups():
    from npformer.kernels.cpu.attention import blocks
    for shape, parts in itertools.product(((2, 3, 4, 4), (300, 4, 9, 9), (1, 8, 128, 128), (2, 2, 300, 300),
                                           (1, 1, 1, 70000), (12, 4, 64, 64), (5, 4, 64, 64)), (1, 2, 3)):
        groups = blocks(*shape, parts=parts)
        b, h, tq, tk = shape
        seen = np.zeros(shape, int)
        for group in groups:
            assert len({(i.start, hh.start) for i, hh, _ in group}) == 1    # a group: the same heads
            for i, heads, rows in group:
                part = seen[i, heads, rows]
                assert part.size and seen[i, heads, rows].base is seen      # a view: contiguous in C order
                assert np.shares_memory(part, seen) and part.flags.c_contiguous
                seen[i, heads, rows] += 1
        assert (seen == 1).all()



@pytest.mark.parametrize("shape", [(0, 4, 64, 32), (2, 0, 5, 4), (2, 3, 0, 4)])
def test_attention_of_nothing_gives_the_references_empty_results(thread_count, shape):
    """An empty batch, no heads or no queries: the fast path's outputs and gradients are the
    reference's empty arrays (NumPy gives an empty array zero strides, which are no rows to write)."""
    q = np.zeros(shape, np.float32)
    k = v = np.zeros(shape[:2] + (3, shape[3]), np.float32)
    for n in (1, 2):
        thread_count(n)
        out, _, cache = attention.scaled_dot_product_attention_forward(q, k, v)
        grads = attention.scaled_dot_product_attention_backward(np.zeros_like(out), cache)
        with kernels.disabled():
            ref_out, _, ref_cache = attention.scaled_dot_product_attention_forward(q, k, v)
            ref_grads = attention.scaled_dot_product_attention_backward(np.zeros_like(ref_out), ref_cache)
        for got, ref in zip((out, *grads), (ref_out, *ref_grads)):
            assert got.shape == ref.shape and got.dtype == ref.dtype


def test_attention_batch_blocks_are_shared_equally_between_threads(monkeypatch):
    """Runs of whole batch elements come in a multiple of the thread count where the batch allows:
    gpt-tiny's 12 elements of 4 x 64 x 64 scores in 3 blocks of 4 on one thread (64K scores a block),
    on two threads in 2 of 6 (a thread's share, under the threads' 256K), on three in 3 of 4; 5 elements
    in 2 blocks of 3 and 2 on two threads. With the threads' blocks as small as one thread's, 4 of 3
    on two (not 2 + 1 blocks)."""
    from npformer.kernels.cpu import blocks as cpu_blocks
    from npformer.kernels.cpu.attention import blocks

    def runs(b, parts):
        return [g[0][0].stop - g[0][0].start for g in blocks(b, 4, 64, 64, parts=parts)]
    assert runs(12, 1) == [4, 4, 4] and runs(12, 2) == [6, 6] and runs(12, 3) == [4, 4, 4]
    assert runs(5, 2) == [3, 2] and runs(1, 2) == [1] and runs(8, 2) == [4, 4]
    monkeypatch.setattr(cpu_blocks, "THREAD_BLOCK_ELEMENTS", cpu_blocks.BLOCK_ELEMENTS)
    assert runs(12, 2) == [3, 3, 3, 3] and runs(12, 3) == [4, 4, 4]


def test_attention_blocks_leave_no_thread_without_work_and_cut_rows_alike_for_any_thread_count():
    """Larger blocks on several threads, but never fewer groups than threads where the heads allow
    (one sequence of 8 heads of 128 x 128: 2 groups of 4 heads on two threads), and a head's runs of
    query rows (over which dk and dv are summed) the same on one thread as on two."""
    from npformer.kernels.cpu.attention import blocks
    assert [len(g) for g in blocks(1, 8, 128, 128, parts=2)] == [1, 1]
    assert [g[0][1] for g in blocks(1, 8, 128, 128, parts=2)] == [slice(0, 4), slice(4, 8)]
    for b, h, t in ((1, 2, 512), (3, 4, 300), (2, 1, 1024)):
        assert blocks(b, h, t, t, parts=1) == blocks(b, h, t, t, parts=2) == blocks(b, h, t, t, parts=3)


@pytest.mark.parametrize("n", [1, 2, 10, 65, 130])
def test_dropout_parts_on_threads_give_the_reference_mask(tiny_blocks, thread_count, n):
    x = randn(np, (n,), 0, "float32")
    rng_ref = default_rng(1, "numpy")
    with kernels.disabled():
        out_ref, cache_ref = dropout.dropout_forward(x, 0.4, rng=rng_ref)
    state_ref = rng_ref.bit_generator.state
    for n_threads in (1, 2, 3):
        thread_count(n_threads)
        rng = default_rng(1, "numpy")
        out, cache = dropout.dropout_forward(x, 0.4, rng=rng)
        np.testing.assert_array_equal(cache.keep, cache_ref.keep)
        np.testing.assert_array_equal(out, out_ref)
        assert rng.bit_generator.state == state_ref      # the one seed's draws, whatever the parts


def test_attention_fast_path_peak_memory_is_at_most_the_reference():
    import tracemalloc
    q, k, v = (randn(np, (2, 4, 256, 16), i, "float32") for i in range(3))

    def peak():
        tracemalloc.start()
        try:
            out, _, cache = attention.scaled_dot_product_attention_forward(
                q, k, v, is_causal=True, dropout_p=0.1, rng=default_rng(0, "numpy"))
            attention.scaled_dot_product_attention_backward(out, cache)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    fast = peak()
    with kernels.disabled():
        ref = peak()
    assert fast <= ref, (fast, ref)


# -- self-attention's backward into the packed gradient (npformer.kernels.multihead) -------------------

@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_self_attention_merges_heads_without_copies(dtype, p, thread_count):
    for n in (1, 2):
        thread_count(n)
        assert_packed_self_attention("cpu", dtype, p)


def test_gradcheck_through_the_packed_self_attention_backward():
    e, h = 6, 2
    inputs = {"x": randn(np, (2, 5, e), 1), "in_proj_weight": randn(np, (3 * e, e), 2, scale=0.4),
              "in_proj_bias": randn(np, (3 * e,), 3), "out_proj_weight": randn(np, (e, e), 4, scale=0.4),
              "out_proj_bias": randn(np, (e,), 5)}
    kw = dict(num_heads=h, is_causal=True, need_weights=False)
    _, _, cache = multihead.self_attention_forward(**inputs, **kw)
    assert kernels.implementation(multihead.self_attention_backward, np.ones((2, 5, e)), cache) == "cpu"
    assert_gradcheck(gradcheck(multihead.self_attention_forward, multihead.self_attention_backward, inputs,
                               kwargs=kw, label="self-attention (packed cpu backward)"))


def test_attention_backward_into_checks_what_it_writes_into():
    from npformer.kernels.cpu.attention import NUMPY_ROWS, attention_backward_into
    from npformer.errors import ShapeError
    q, k, v = (randn(np, (1, 2, 3, 4), i, "float32") for i in range(3))
    out, _, cache = attention.scaled_dot_product_attention_forward(q, k, v)
    dq, dk, dv = (np.zeros_like(a) for a in (q, k, v))
    attention_backward_into(NUMPY_ROWS, out, cache, dq, dk, dv)
    for got, want in zip((dq, dk, dv), attention.scaled_dot_product_attention_backward(out, cache)):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ShapeError, match=r"dk: expected the shape of k, \(1, 2, 3, 4\)"):
        attention_backward_into(NUMPY_ROWS, out, cache, dq, dk[:, :, :2], dv)
    with pytest.raises(TypeError, match="dv: expected the dtype of v, float32"):
        attention_backward_into(NUMPY_ROWS, out, cache, dq, dk, dv.astype(np.float64))
    with pytest.raises(ShapeError, match="dq: expected a contiguous last axis"):
        attention_backward_into(NUMPY_ROWS, out, cache, np.zeros((1, 2, 3, 8), np.float32)[..., ::2], dk, dv)
