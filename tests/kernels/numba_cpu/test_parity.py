"""Every numba-compiled CPU fast path (npformer.kernels.numba_cpu) against its reference op.

For each: outputs and gradients in float64 and float32 (the cross-entropy's of 16-bit logits too)
within ``TOL`` (tests/helpers.py) over hypothesis-drawn shapes, -inf masks and ignored targets; either
backward on either forward's cache; a float64 central-difference gradient check through the compiled
path; the reference's errors for bad input; the same bits whatever the thread count; NaN and
infinities as the reference gives them, and its answers at extreme magnitudes (a row maximum far from
zero, a variance that overflows or is subnormal). The last test fails when a compiled path is registered
without a case here. Skipped without numba.
"""
import importlib
import importlib.util

import numpy as np
import pytest
from hypothesis import given, strategies as st

pytest.importorskip("numba", reason="numba is not installed (the optional fast extra: pip install -e '.[fast]')")

from npformer import kernels  # noqa: E402
from npformer.kernels.cpu import threads  # noqa: E402
from npformer.kernels.numba_cpu import vector_math  # noqa: E402
from npformer.backend import accumulation_dtype, default_rng  # noqa: E402
from npformer.errors import NpformerError  # noqa: E402
from npformer.ops import activations, attention, cross_entropy, dropout, layernorm, optim, softmax  # noqa: E402
from npformer.tools.gradcheck import gradcheck  # noqa: E402
from tests.helpers import (assert_blocked_attention, assert_close, assert_fast_path_pair,  # noqa: E402
                           assert_future_keys_unread, assert_gradcheck, assert_packed_self_attention, padding_masks,
                           randn, seeds)

DTYPES = ("float64", "float32")
# the cross-entropy takes 16-bit logits too; bfloat16 where ml_dtypes (an optional extra) is installed:
# importing it names numpy.dtype("bfloat16")
SIXTEEN_BIT = ("float16",) + (("bfloat16",) if importlib.util.find_spec("ml_dtypes") else ())
if "bfloat16" in SIXTEEN_BIT:
    importlib.import_module("ml_dtypes")
shapes = st.lists(st.integers(1, 7), min_size=1, max_size=3).map(tuple)


@given(shape=shapes, seed=seeds, dtype=st.sampled_from(DTYPES), masked=st.booleans())
def test_softmax_and_log_softmax(shape, seed, dtype, masked):
    x = randn(np, shape, seed, dtype, scale=3.0)
    if masked:                                           # -inf entries and, with one column, whole rows
        x[..., 0] = -np.inf
    dy = randn(np, shape, seed + 1, dtype)
    assert kernels.implementation(softmax.softmax_forward, x) == "numba"
    assert_fast_path_pair(softmax.softmax_forward, softmax.softmax_backward, x, dy, dtype, "softmax")
    if not masked:                                       # log-softmax of a fully masked row is -inf: no dy
        assert_fast_path_pair(softmax.log_softmax_forward, softmax.log_softmax_backward, x, dy, dtype, "log_softmax")


@given(shape=shapes, seed=seeds, dtype=st.sampled_from(DTYPES), form=st.sampled_from(["none", "tanh"]),
       scale=st.sampled_from([1.0, 3.0, 30.0]))
def test_gelu(shape, seed, dtype, form, scale):
    x, dy = randn(np, shape, seed, dtype, scale=scale), randn(np, shape, seed + 1, dtype)
    assert kernels.implementation(activations.gelu_forward, x, approximate=form) == "numba"
    assert_fast_path_pair(activations.gelu_forward, activations.gelu_backward, x, dy, dtype, f"gelu {form}", approximate=form)


@given(shape=shapes, seed=seeds, dtype=st.sampled_from(DTYPES), weight=st.booleans(), bias=st.booleans())
def test_layer_norm(shape, seed, dtype, weight, bias):
    x, dy = randn(np, shape, seed, dtype, scale=2.0), randn(np, shape, seed + 1, dtype)
    w = randn(np, shape[-1:], seed + 2, dtype) if weight else None
    b = randn(np, shape[-1:], seed + 3, dtype) if bias else None
    assert kernels.implementation(layernorm.layer_norm_forward, x, w, b) == "numba"
    assert_fast_path_pair(lambda x: layernorm.layer_norm_forward(x, w, b), layernorm.layer_norm_backward, x, dy, dtype,
               "layer norm")


@given(lead=st.lists(st.integers(1, 5), min_size=0, max_size=2).map(tuple), v=st.integers(1, 9), seed=seeds,
       dtype=st.sampled_from(DTYPES + SIXTEEN_BIT), reduction=st.sampled_from(["mean", "sum", "none"]),
       smoothing=st.sampled_from([0.0, 0.1]), accumulated_loss=st.booleans(), data=st.data())
def test_cross_entropy(lead, v, seed, dtype, reduction, smoothing, accumulated_loss, data):
    """16-bit logits too, read through a float32 copy: the loss in their dtype or (``loss_dtype``) in
    float32, the gradient in their dtype; the cache keeps the logits themselves."""
    logits = randn(np, lead + (v,), seed, dtype, scale=3.0)
    targets = np.asarray(data.draw(st.lists(st.integers(-1, v - 1), min_size=int(np.prod(lead, dtype=int)),
                                            max_size=int(np.prod(lead, dtype=int))))).reshape(lead)
    loss_dtype = accumulation_dtype(logits.dtype) if accumulated_loss else logits.dtype
    kw = dict(reduction=reduction, ignore_index=-1, label_smoothing=smoothing, loss_dtype=loss_dtype)
    assert kernels.implementation(cross_entropy.cross_entropy_forward, logits, targets, **kw) == "numba"
    loss, cache = cross_entropy.cross_entropy_forward(logits, targets, **kw)
    with kernels.disabled():
        loss_ref, cache_ref = cross_entropy.cross_entropy_forward(logits, targets, **kw)
    assert loss.dtype == loss_ref.dtype == loss_dtype and cache.logits is logits
    assert_close(loss, loss_ref, str(loss_dtype), scale=max(1.0, float(np.abs(loss_ref.astype(np.float64)).sum())),
                 what="cross-entropy loss")
    dloss = randn(np, loss.shape, seed + 1, str(loss_dtype)) if reduction == "none" else np.asarray(1.5, loss_dtype)
    with kernels.disabled():
        ref = cross_entropy.cross_entropy_backward(dloss, cache_ref)
        ref_on_fast = cross_entropy.cross_entropy_backward(dloss, cache)
    for label, g in (("compiled", cross_entropy.cross_entropy_backward(dloss, cache)),
                     ("compiled on the reference cache", cross_entropy.cross_entropy_backward(dloss, cache_ref)),
                     ("reference on the compiled cache", ref_on_fast)):
        assert g.dtype == dtype
        assert_close(g, ref, dtype, scale=max(1.0, float(np.abs(dloss.astype(np.float64)).max())),
                     what=f"cross-entropy grad, {label}")


@given(b=st.integers(1, 2), h=st.integers(1, 2), tq=st.integers(1, 5), tk=st.integers(1, 6),
       hs=st.integers(1, 4), seed=seeds, dtype=st.sampled_from(DTYPES), causal=st.booleans(),
       p=st.sampled_from([0.0, 0.3]), data=st.data())
def test_attention(b, h, tq, tk, hs, seed, dtype, causal, p, data):
    q, k, v = (randn(np, (b, h, t, hs), seed + i, dtype) for i, t in enumerate((tq, tk, tk)))
    dout = randn(np, (b, h, tq, hs), seed + 3, dtype)
    kw = dict(key_padding_mask=data.draw(padding_masks(b, tk)), is_causal=causal, dropout_p=p, need_weights=True)

    def run():
        out, weights, cache = attention.scaled_dot_product_attention_forward(
            q, k, v, rng=default_rng(seed, "numpy"), **kw)
        return (out, weights, *attention.scaled_dot_product_attention_backward(dout, cache)), cache
    assert kernels.implementation(attention.scaled_dot_product_attention_forward, q, k, v, **kw) == "numba"
    got, cache = run()
    with kernels.disabled():
        ref, cache_ref = run()
    for name, g, r in zip(("out", "weights", "dq", "dk", "dv"), got, ref):
        assert_close(g, r, dtype, what=f"attention {name}")
    for g, r in zip(attention.scaled_dot_product_attention_backward(dout, cache_ref), ref[2:]):
        assert_close(g, r, dtype, what="attention backward on the reference cache")


@given(shape=shapes, seed=seeds, dtype=st.sampled_from(DTYPES), p=st.sampled_from([0.1, 0.5, 0.9, 1.0]))
def test_dropout(shape, seed, dtype, p):
    """The mask, output and gradient bit for bit (a product, no rounding choices), the generator left
    where the reference leaves it; inf and NaN in dropped entries give NaN as in the reference."""
    x = randn(np, shape + (2,), seed, dtype)             # an even size: the raw-bits mask applies
    x.reshape(-1)[:2] = [np.inf, np.nan]
    dout = randn(np, x.shape, seed + 1, dtype)
    dout.reshape(-1)[-1:] = -np.inf
    rng, rng_ref = default_rng(seed, "numpy"), default_rng(seed, "numpy")
    assert kernels.implementation(dropout.dropout_forward, x, p, rng=rng) == "numba"
    with np.errstate(invalid="ignore"):
        out, cache = dropout.dropout_forward(x, p, rng=rng)
        assert kernels.implementation(dropout.dropout_backward, dout, cache) == "numba"
        with kernels.disabled():
            out_ref, cache_ref = dropout.dropout_forward(x, p, rng=rng_ref)
            dx_ref = dropout.dropout_backward(dout, cache_ref)
        dx, dx_on_ref = dropout.dropout_backward(dout, cache), dropout.dropout_backward(dout, cache_ref)
    np.testing.assert_array_equal(cache.keep, cache_ref.keep)
    assert cache.scale == cache_ref.scale and cache.scale.dtype == accumulation_dtype(x.dtype)
    for got, ref in ((out, out_ref), (dx, dx_ref), (dx_on_ref, dx_ref)):
        assert got.dtype == x.dtype
        np.testing.assert_array_equal(got.view(f"i{got.itemsize}"), ref.view(f"i{ref.itemsize}"))   # -0 too
    np.testing.assert_array_equal(rng.random(5), rng_ref.random(5))


@given(seed=seeds, n=st.integers(1, 300), start=st.one_of(st.integers(0, 80), st.integers(0, 2 ** 62)),
       cuts=st.lists(st.integers(1, 60), max_size=4), p=st.sampled_from([1e-9, 0.1, 0.5, 0.999999]))
def test_compiled_mask_is_the_numpy_paths_bit_for_bit(seed, n, start, cuts, p):
    """The compiled loop (write_keep) hashes as the NumPy fast path's buffers do: a part from any
    start (past 2^64 / golden too, where seed + n golden wraps), written over several calls of any
    size, is the same mask, for any seed."""
    from npformer.kernels.cpu.dropout import KeepMask
    from npformer.kernels.numba_cpu.dropout import CompiledKeepMask
    sizes = cuts + [n]
    want, got = np.empty(sum(sizes), bool), np.empty(sum(sizes), bool)
    for mask_type, out in ((KeepMask, want), (CompiledKeepMask, got)):
        write = mask_type(default_rng(seed, "numpy"), p).stream(start)
        at = 0
        for size in sizes:
            write(out[at:at + size])
            at += size
    np.testing.assert_array_equal(got, want)


def test_dropout_backward_of_transposed_gradients_identities_and_bad_gradients():
    x = randn(np, (300, 8), 0, "float32")
    _, cache = dropout.dropout_forward(x, 0.3, rng=default_rng(0, "numpy"))
    dout = randn(np, (8, 300), 1, "float32").T                       # not C-contiguous
    assert kernels.implementation(dropout.dropout_backward, dout, cache) == "numba"
    with kernels.disabled():
        ref = dropout.dropout_backward(dout, cache)
    np.testing.assert_array_equal(dropout.dropout_backward(dout, cache), ref)
    identity = dropout.dropout_forward(x, 0.3, training=False)[1]
    dx = dropout.dropout_backward(dout, identity)
    np.testing.assert_array_equal(dx, dout)
    assert dx is not dout
    for bad in (np.zeros((300, 7), np.float32), np.zeros((300, 8), np.float64)):
        with pytest.raises(NpformerError, match="dout: expected the"):
            dropout.dropout_backward(bad, cache)
        with kernels.disabled(), pytest.raises(NpformerError, match="dout: expected the"):
            dropout.dropout_backward(bad, cache)


def test_cross_entropy_of_masked_logits_and_all_ignored_targets():
    logits = randn(np, (3, 4), 0, "float32")
    logits[0, 1:] = -np.inf                              # one class left in row 0
    for targets in (np.array([0, 2, 3]), np.array([-100, -100, -100])):
        for s in (0.0, 0.2):
            got, cache = cross_entropy.cross_entropy_forward(logits, targets, label_smoothing=s)
            with kernels.disabled():
                ref, cache_ref = cross_entropy.cross_entropy_forward(logits, targets, label_smoothing=s)
                g_ref = cross_entropy.cross_entropy_backward(np.asarray(1.0, np.float32), cache_ref)
            assert_close(got, ref, "float32", what=f"loss, targets {targets}, smoothing {s}")
            assert_close(cross_entropy.cross_entropy_backward(np.asarray(1.0, np.float32), cache), g_ref,
                         "float32", what="gradient")


def test_non_finite_inputs_come_out_as_the_reference_gives_them():
    x = np.array([[np.nan, 1.0, 2.0], [np.inf, 1.0, 2.0], [-np.inf, -np.inf, -np.inf], [1.0, -np.inf, 3.0]],
                 np.float32)
    for fwd in (softmax.softmax_forward, softmax.log_softmax_forward):
        got = fwd(x)[0]
        with kernels.disabled(), np.errstate(invalid="ignore"):   # the reference's inf - inf
            ref = fwd(x)[0]
        np.testing.assert_array_equal(np.isnan(got), np.isnan(ref), err_msg=fwd.__name__)
        assert_close(got, ref, "float32", what=fwd.__name__)
    g = np.array([np.nan, np.inf, -3e38, 0.0, 3e38], np.float32)
    got = activations.gelu_forward(g)[0]
    with kernels.disabled():
        ref = activations.gelu_forward(g)[0]
    assert np.isnan(got[0]) and np.isnan(ref[0]) and got[1] == ref[1] == np.inf and got[3] == 0
    assert abs(got[2]) < 1e-6 and got[4] == ref[4]


def _fast_and_reference(fwd, bwd, x, dy, **kw):
    """``(y, cache, dx)`` on the compiled path and on the reference path, each backward on its own cache."""
    y, cache = fwd(x, **kw)
    with kernels.disabled():
        y_ref, cache_ref = fwd(x, **kw)
        dx_ref = bwd(dy, cache_ref)
    return (y, cache, bwd(dy, cache)), (y_ref, cache_ref, dx_ref)


@pytest.mark.parametrize("dtype, big", [("float32", -1e4), ("float32", 1e8), ("float32", -3e38),
                                        ("float64", 1e20), ("float64", -1e300)])
@pytest.mark.parametrize("n", [2, 65])                  # 65: a vectorised loop and its remainder
def test_log_softmax_keeps_the_log_sum_beside_a_large_maximum(dtype, big, n):
    """log p = (x - max) - log sum exp(x - max), in the reference's order: max + log sum rounded the
    log sum away beside a large max (float32 -1e4: -log 2 came out 2e-4 off; 1e8 and float64 1e20: 0).
    A third of each row is one spacing (at least 1) below the max, so every x - max is exact and
    log sum >= log 2."""
    x = np.full((2, n), big, dtype)
    x[:, 2::3] -= max(1.0, abs(float(np.spacing(x.dtype.type(big)))))
    x[1] = x[1, ::-1]
    dy = randn(np, x.shape, 0, dtype)
    (y, _, dx), (y_ref, _, dx_ref) = _fast_and_reference(softmax.log_softmax_forward, softmax.log_softmax_backward,
                                                         x, dy)
    assert_close(y, y_ref, dtype, what="log-softmax")
    # dx = dy - p sum(dy): the magnitudes in play are dy's and its row sums'
    assert_close(dx, dx_ref, dtype, scale=max(1.0, float(np.abs(dy).sum(-1).max())), what="log-softmax grad")


@pytest.mark.parametrize("dtype, row", [("float32", [1e4, 1e4 + 1, 1e4]), ("float32", [3e38, 3e38, 0.0]),
                                        ("float32", [-1e8, -1e8 + 8, -1e8]), ("float64", [1e20, 1e20]),
                                        ("float64", [1e15, 1e15 + 1, 1e15]), ("float64", [1.7e308, 1.7e308, 0.0])])
@pytest.mark.parametrize("smoothing", [0.0, 0.5])
def test_cross_entropy_of_logits_far_from_zero(dtype, row, smoothing):
    """sum_j log p_j = sum_j (z_j - max) - V log_sum, every term <= 0 as in the reference's sum of
    log p: sum z - V (max + log_sum) cancelled (float32 [1e4, 1e4 + 1, 1e4]: 1e-4 off) or overflowed
    (float32 [3e38, 3e38, 0]: -inf for 5e37; float64 [1e20, 1e20]: log 2 / 2 for log 2). log p_t =
    (z_t - max) - log_sum too, never z_t - (max + log_sum)."""
    z = np.array([row, row[::-1]], dtype)
    targets, dloss = np.array([0, 1]), np.array([1.5, -0.5], dtype)
    kw = dict(targets=targets, reduction="none", label_smoothing=smoothing)
    (loss, _, dz), (loss_ref, _, dz_ref) = _fast_and_reference(cross_entropy.cross_entropy_forward,
                                                               cross_entropy.cross_entropy_backward, z, dloss, **kw)
    for i in range(2):                                  # each row's loss on its own scale
        assert_close(loss[i], loss_ref[i], dtype, what=f"cross-entropy loss, row {i}")
    # dz = (p - q) dloss, p and q in [0, 1]
    assert_close(dz, dz_ref, dtype, scale=max(1.0, float(np.abs(dloss).max())), what="cross-entropy grad")


@pytest.mark.parametrize("dtype, x, eps", [
    ("float32", [[1e20, -1e20, 0.0], [3e38, -3e38, 1.0]], 1e-5),       # var overflows: rstd 0, y = b
    ("float32", [[1e-20, -1e-20], [-3e-20, 3e-20]], 1e-45),            # var + eps subnormal
    ("float64", [[1e160, -1e160, 0.0], [1.7e308, -1.7e308, 1.0]], 1e-5),
    ("float64", [[1e-160, -1e-160], [-3e-160, 3e-160]], 5e-324)])
def test_layer_norm_of_a_variance_that_overflows_or_is_subnormal(dtype, x, eps):
    """rstd = 1 / sqrt(var + eps) correctly rounded, as the reference: FASTMATH's reciprocal square
    root estimate (float32) gave NaN for var = inf (the reference's rstd is 0, y = b) and -inf for a
    subnormal var + eps (the reference's xhat is +-0.99999565)."""
    x = np.array(x, dtype)
    w, b = randn(np, x.shape[-1:], 1, dtype), randn(np, x.shape[-1:], 2, dtype)
    dy = randn(np, x.shape, 3, dtype)
    with np.errstate(over="ignore"):                    # the reference's (x - mu)^2 overflows
        (y, cache, grads), (y_ref, cache_ref, grads_ref) = _fast_and_reference(
            lambda x: layernorm.layer_norm_forward(x, w, b, eps=eps), layernorm.layer_norm_backward, x, dy)
    assert_close(cache.rstd, cache_ref.rstd, dtype, what="layer norm rstd")
    assert_close(y, y_ref, dtype, what="layer norm forward")
    # dx = rstd (g - mean(g) - xhat mean(g xhat)), g = dy w: the terms in play are rstd |g|
    in_play = max(1.0, float((cache_ref.rstd * np.abs(dy * w)).max()))
    assert_close(grads[0], grads_ref[0], dtype, scale=in_play, what="layer norm dx")
    for name, g, r in zip(("dweight", "dbias"), grads[1:], grads_ref[1:]):
        assert_close(g, r, dtype, what=f"layer norm {name}")


@pytest.mark.parametrize("name", ["softmax", "log_softmax", "gelu", "gelu_tanh", "layer_norm", "cross_entropy",
                                  "attention", "dropout"])
def test_gradcheck_through_the_compiled_path(name):
    """float64 central differences through the compiled paths (they take float64 arrays)."""
    x = randn(np, (2, 3, 5), 1)
    cases = {
        "softmax": (softmax.softmax_forward, softmax.softmax_backward, {"x": x}, {}),
        "log_softmax": (softmax.log_softmax_forward, softmax.log_softmax_backward, {"x": x}, {}),
        "gelu": (activations.gelu_forward, activations.gelu_backward, {"x": x}, {"approximate": "none"}),
        "gelu_tanh": (activations.gelu_forward, activations.gelu_backward, {"x": x}, {"approximate": "tanh"}),
        "layer_norm": (layernorm.layer_norm_forward, layernorm.layer_norm_backward,
                       {"x": x, "weight": randn(np, (5,), 2), "bias": randn(np, (5,), 3)}, {}),
        "cross_entropy": (cross_entropy.cross_entropy_forward, cross_entropy.cross_entropy_backward,
                          {"logits": x}, {"targets": np.array([[0, 4, -100], [2, 1, 3]]), "label_smoothing": 0.1}),
        "attention": (attention.scaled_dot_product_attention_forward,
                      attention.scaled_dot_product_attention_backward,
                      {"q": randn(np, (2, 2, 3, 4), 4), "k": randn(np, (2, 2, 5, 4), 5), "v": randn(np, (2, 2, 5, 4), 6)},
                      {"is_causal": True, "causal_alignment": "bottom_right"}),
        "dropout": (lambda x: dropout.dropout_forward(x, 0.4, rng=default_rng(3, "numpy")),   # one mask each call
                    dropout.dropout_backward, {"x": x}, {}),
    }
    fwd, bwd, inputs, kw = cases[name]
    if name == "dropout":
        assert kernels.implementation(dropout.dropout_forward, x, 0.4, rng=default_rng(3, "numpy")) == "numba"
    else:
        assert kernels.implementation(fwd, *inputs.values(), **kw) == "numba"
    assert_gradcheck(gradcheck(fwd, bwd, inputs, kwargs=kw, label=f"{name} (numba)"))


@pytest.mark.parametrize("call, error", [
    (lambda: softmax.softmax_forward(np.zeros((2, 0), np.float32)), "x: expected rows"),
    (lambda: activations.gelu_forward(np.zeros(3, np.float32), approximate="erf"), "approximate: expected one of"),
    (lambda: layernorm.layer_norm_forward(np.zeros((2, 3), np.float32), np.ones(4, np.float32)),
     r"weight: expected shape \(3,\)"),
    (lambda: cross_entropy.cross_entropy_forward(np.zeros((2, 3), np.float32), np.array([0, 3])),
     r"targets: class ids must be in \[0, 3\)"),
    (lambda: softmax.softmax_backward(np.zeros((2, 4), np.float32), softmax.softmax_forward(np.zeros((2, 3), np.float32))[1]),
     "dy: expected"),
])
def test_bad_input_gets_the_reference_error_on_both_paths(call, error):
    with pytest.raises(ValueError, match=error):
        call()
    with kernels.disabled(), pytest.raises(ValueError, match=error):
        call()


@pytest.mark.parametrize("op", ["gelu", "softmax", "layer_norm", "cross_entropy", "dropout"])
def test_results_do_not_depend_on_the_thread_count(op, monkeypatch):
    """Rows are handed out in chunks; every row's arithmetic is the same on any thread, and the
    layer norm's parameter gradients are summed in fixed blocks of rows. (The loops that take a
    thread per CHEAP elements are made to split here too.)"""
    from npformer.kernels.numba_cpu import cross_entropy as nb_ce, layernorm as nb_ln, softmax as nb_sm
    for module in (nb_ce, nb_ln, nb_sm):
        monkeypatch.setattr(module, "CHEAP", 1 << 15)
    x = randn(np, (600, 512), 0, "float32")               # 300K elements: two threads' worth
    dy = randn(np, x.shape, 1, "float32")
    w, b = randn(np, (512,), 2, "float32"), randn(np, (512,), 3, "float32")
    t = np.random.default_rng(4).integers(0, 512, 600)
    calls = {
        "gelu": lambda: (lambda y, c: (y, activations.gelu_backward(dy, c)))(*activations.gelu_forward(x)),
        "softmax": lambda: (lambda y, c: (y, softmax.softmax_backward(dy, c)))(*softmax.softmax_forward(x)),
        "layer_norm": lambda: (lambda y, c: (y, *layernorm.layer_norm_backward(dy, c)))(
            *layernorm.layer_norm_forward(x, w, b)),
        "cross_entropy": lambda: (lambda l, c: (l, cross_entropy.cross_entropy_backward(np.asarray(1.0, np.float32), c)))(
            *cross_entropy.cross_entropy_forward(x, t)),
        "dropout": lambda: (lambda y, c: (y, c.keep, dropout.dropout_backward(dy, c)))(
            *dropout.dropout_forward(x, 0.3, rng=default_rng(7, "numpy"))),
    }
    before = threads.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            threads.set_num_threads(n, blas=False)
            results.append(calls[op]())
    finally:
        threads.set_num_threads(before, blas=False)
    for other in results[1:]:
        for a, b_ in zip(results[0], other):
            np.testing.assert_array_equal(a, b_)


def test_exp32_erf32_and_phi32_accuracy():
    """exp32 within 2 float32 ulp on [-87, 21] (the callers' range), 0 below, NaN through; erf32
    within 7 ulp and 4.1e-7 absolute (benchmarks/fit_erf_float32.py), exactly +-1 beyond 3.92; the
    float32 CDF within 3e-7 absolute everywhere."""
    from numba import njit

    @njit(fastmath=vector_math.FASTMATH, error_model="numpy")     # as the kernels compile them
    def apply(f32, x):
        out = np.empty_like(x)
        for i in range(x.size):
            out[i] = f32(x[i])
        return out
    x = np.linspace(-87.0, 21.0, 200001).astype(np.float32)
    got, ref = apply(vector_math.exp32, x).astype(np.float64), np.exp(x.astype(np.float64))
    ulp = np.spacing(ref.astype(np.float32)).astype(np.float64)
    assert (np.abs(got - ref) / ulp).max() <= 2.0
    edges = apply(vector_math.exp32, np.array([-88.0, -np.inf, np.nan, 0.0], np.float32))
    assert edges[0] == edges[1] == 0 and np.isnan(edges[2]) and edges[3] == 1
    from math import erf, erfc
    z = np.linspace(-6, 6, 200001).astype(np.float32)
    erf_ref = np.array([erf(float(v)) for v in z])
    got = apply(vector_math.erf32, z).astype(np.float64)
    ulp = np.maximum(np.spacing(np.abs(erf_ref).astype(np.float32)).astype(np.float64), 2.0 ** -149)
    assert (np.abs(got - erf_ref) / ulp).max() <= 7 and np.abs(got - erf_ref).max() < 4.1e-7
    assert (got[np.abs(z) >= 3.92] == np.sign(z[np.abs(z) >= 3.92])).all()
    assert np.isnan(apply(vector_math.erf32, np.array([np.nan], np.float32))[0])
    z = np.linspace(-12, 12, 100001).astype(np.float32)
    phi_ref = np.array([0.5 * erfc(-float(v) / np.sqrt(2)) for v in z])
    assert np.abs(apply(vector_math.phi32, z).astype(np.float64) - phi_ref).max() < 3e-7


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", [dict(weight_decay=0.0), dict(weight_decay=0.1, decoupled=True),
                                  dict(weight_decay=0.1, decoupled=False)])
@pytest.mark.parametrize("n", [1, 1000, 300_001])       # one thread, and a buffer cut between threads
@pytest.mark.parametrize("scale", [1.0, 0.37 * 2.0 ** -12])
def test_adam_update_gives_the_reference_bits(dtype, case, n, scale):
    rng = np.random.default_rng(n)
    arrays = [rng.standard_normal(n).astype(dtype) for _ in range(3)] + [rng.random(n).astype(dtype)]
    fast, ref = [a.copy() for a in arrays], [a.copy() for a in arrays]
    hyper = dict(step=3, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, grad_scale=scale, **case)
    assert kernels.implementation(optim.adam_update, *fast, **hyper) == "numba"
    optim.adam_update(*fast, **hyper)
    with kernels.disabled():
        optim.adam_update(*ref, **hyper)
    for name, f, r in zip(("param", "grad", "exp_avg", "exp_avg_sq"), fast, ref):
        np.testing.assert_array_equal(f, r, err_msg=name)


def test_adam_update_leaves_mixed_precision_copies_and_bad_shapes_to_the_others():
    p, copy = np.ones(4, np.float32), np.ones(4, np.float16)
    hyper = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)
    assert kernels.implementation(optim.adam_update, p, p.copy(), p.copy(), p.copy(), param_copy=copy, **hyper) == "cpu"
    assert kernels.implementation(optim.adam_update, p, p.astype(np.float16), p.copy(), p.copy(), **hyper) == "cpu"
    with pytest.raises(ValueError, match="grad: expected shape"):
        optim.adam_update(p, np.ones(3, np.float32), p.copy(), p.copy(), **hyper)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_sum_of_squares_in_float64(dtype):
    x = randn(np, (301, 7), 3, dtype, scale=100.0)
    assert kernels.implementation(optim.sum_of_squares, x) == "numba"
    got = optim.sum_of_squares(x)
    with kernels.disabled():
        ref = optim.sum_of_squares(x)
    assert got.dtype == np.float64 and got.shape == ()
    assert got.tobytes() == ref.tobytes()                           # the reference's order of additions


def test_every_numba_fast_path_has_a_parity_case_here():
    tested = {"softmax_forward", "softmax_backward", "log_softmax_forward", "log_softmax_backward",
              "gelu_forward", "gelu_backward", "layer_norm_forward", "layer_norm_backward",
              "cross_entropy_forward", "cross_entropy_backward", "dropout_forward", "dropout_backward",
              "scaled_dot_product_attention_forward", "scaled_dot_product_attention_backward",
              "self_attention_backward", "adam_update", "sum_of_squares"}
    registered = {op.__name__ for op, name, _, _ in kernels.FAST_PATHS if name == "numba"}
    assert registered and registered <= tested, f"numba fast paths without a parity case: {sorted(registered - tested)}"


@pytest.mark.parametrize("tq, tk", [(1, 2), (3, 2), (5, 4), (6, 6), (7, 3)])
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_blocks_and_threads_give_the_reference(tiny_blocks, thread_count, tq, tk, alignment, dtype):
    """The compiled row loops on causal blocks of a row's first keys (strided rows, copied for the
    loops and back): :func:`tests.helpers.assert_blocked_attention`."""
    assert_blocked_attention("numba", thread_count, tq, tk, dtype, alignment)


@pytest.mark.parametrize("dtype", DTYPES)
def test_causal_attention_reads_no_key_in_every_rows_future(dtype):
    assert_future_keys_unread("numba", dtype)


@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_self_attention_merges_heads_without_copies(dtype, p):
    """The compiled attention's self-attention backward into the packed gradient (npformer.kernels.multihead)."""
    assert_packed_self_attention("numba", dtype, p)
