"""Helpers shared by the tests: seeded arrays on a backend, hypothesis strategies, assertions."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

from npformer.backend import to_numpy

# Sizes the issue asks the op checks to cover.
batch = st.integers(1, 3)
seq = st.integers(1, 7)
heads = st.integers(1, 3)
head_size = st.integers(1, 4)
seeds = st.integers(0, 2**16)

# Why a test that needs an optional package skips without it (pytest.importorskip's reason).
NO_TORCH = "torch not installed: this PyTorch parity check needs it (pip install torch==2.13.0)"
NO_MATPLOTLIB = 'matplotlib not installed: this test draws a plot (pip install -e ".[plot]")'


def randn(xp, shape, seed=0, dtype="float64", scale=1.0):
    """Seeded standard-normal array on backend ``xp`` (drawn on the host, so equal across backends)."""
    a = np.random.default_rng(seed).standard_normal(shape) * scale
    return xp.asarray(a.astype(dtype))


def away_from_zero(xp, shape, seed=0, margin=1e-2, dtype="float64"):
    """Like :func:`randn` but every |value| >= margin (keeps ReLU-like kinks out of reach of eps)."""
    a = np.random.default_rng(seed).standard_normal(shape)
    a = np.where(np.abs(a) < margin, np.copysign(margin, a) + a, a)
    return xp.asarray(a.astype(dtype))


@st.composite
def padding_masks(draw, b, tk):
    """Bool (B, Tk) key-padding masks, True = padding, with at least one free key per row."""
    rows = []
    for _ in range(b):
        row = draw(st.lists(st.booleans(), min_size=tk, max_size=tk))
        row[draw(st.integers(0, tk - 1))] = False
        rows.append(row)
    return np.array(rows, dtype=bool).reshape(b, tk)


# Fast path against its reference: they compute in the same precision and differ only in the order
# of a reduction's additions and in libm's (or the float32 erf fit's) last bits, a few units in the
# last place of the magnitudes involved (float16 also rounds once where a reference rounds up to
# three times). So max |fast - reference| <= TOL[dtype] * scale, scale the largest magnitude in play:
# 4 ulp at 1 for the 16-bit types, float16's 2^-10 eps (4e-3) and bfloat16's 2^-8 (2^-6).
TOL = {"float64": 1e-12, "float32": 1e-5, "float16": 4e-3, "bfloat16": 2.0 ** -6}


def assert_close(got, ref, dtype, scale=None, what="", arithmetic=None):
    """``max |got - ref| <= TOL[arithmetic or dtype] * scale`` (see TOL), NaN where NaN, infinities equal,
    dtype kept. ``arithmetic``: the dtype whose precision the computation keeps, where it is not the
    arrays' (float32 arrays through TF32 products keep float16's 10 mantissa bits)."""
    got64, ref64 = to_numpy(got).astype(np.float64), to_numpy(ref).astype(np.float64)
    assert str(got.dtype) == str(ref.dtype) == dtype, f"{what}: dtype {got.dtype} vs {ref.dtype}, expected {dtype}"
    assert got64.shape == ref64.shape, f"{what}: shape {got64.shape} vs {ref64.shape}"
    np.testing.assert_array_equal(np.isnan(got64), np.isnan(ref64), err_msg=f"{what}: NaN positions differ")
    np.testing.assert_array_equal(np.where(np.isinf(got64), got64, 0), np.where(np.isinf(ref64), ref64, 0),
                                  err_msg=f"{what}: infinities differ")
    finite = np.isfinite(ref64)
    if scale is None:
        scale = max(1.0, float(np.abs(ref64[finite]).max(initial=0.0)))
    err = np.abs(got64[finite] - ref64[finite]).max(initial=0.0)
    tol = TOL[arithmetic or dtype]
    assert err <= tol * scale, f"{what}: max error {err:.3g} > {tol:g} * {scale:.3g} ({arithmetic or dtype})"


def assert_fast_path_pair(fwd, bwd, x, dy, dtype, what, **kw):
    """A forward and its backward on the fast path against the reference path (inside
    ``npformer.kernels.disabled()``), and each backward on the other path's cache."""
    from npformer import kernels
    y, cache = fwd(x, **kw)
    with kernels.disabled():
        y_ref, cache_ref = fwd(x, **kw)
        dx_ref = bwd(dy, cache_ref)
        dx_ref_on_fast = bwd(dy, cache)
    assert_close(y, y_ref, dtype, what=f"{what} forward")
    scale = max(1.0, float(np.abs(dy.astype(np.float64)).max()) * float(np.abs(x.astype(np.float64)).max()))
    grads = bwd(dy, cache), bwd(dy, cache_ref), dx_ref_on_fast
    for label, g in zip(("fast", "fast on the reference cache", "reference on the fast cache"), grads):
        for gi, ri in zip(g if isinstance(g, tuple) else (g,), dx_ref if isinstance(dx_ref, tuple) else (dx_ref,)):
            if ri is not None:
                assert_close(gi, ri, dtype, scale=scale, what=f"{what} backward, {label}")


# Examples of a whole-model gradient check on CuPy. Each example checks every tensor of its model
# (model_check's directions), about 220 forward passes for test_seq2seq_gradcheck's (1.2 s on NumPy on
# the 2-core machine); on a GPU each pass is hundreds of launches, and the first H200 check's 15
# examples ran past its 89 s per-test timeout. NumPy runs the profile's count of the same examples,
# so the option combinations are all covered there; CuPy checks its kernels on the first few.
CUPY_MODEL_EXAMPLES = 5


def given_per_backend(**strategies):
    """``@given(**strategies)`` for a whole-model gradient check ``test(xp, **drawn)``: the profile's
    number of examples on NumPy, at most :data:`CUPY_MODEL_EXAMPLES` on CuPy (each just as thorough)."""
    def wrap(body):
        everything = given(**strategies)(body)
        fewer = settings(max_examples=min(settings.default.max_examples, CUPY_MODEL_EXAMPLES))(
            given(**strategies)(body))

        def test(xp):
            (fewer if xp.__name__ == "cupy" else everything)(xp)
        test.__name__, test.__qualname__, test.__doc__, test.__module__ = (body.__name__, body.__qualname__,
                                                                         body.__doc__, body.__module__)
        return test
    return wrap


def model_check(xp, max_elements: int) -> dict:
    """How a whole model's gradcheck samples its parameters: ``max_elements`` elements of each on
    NumPy; on CuPy one random direction per tensor (chainer's check_backward: four forward passes
    per tensor, every element at once), because there each forward pass is hundreds of tiny kernel
    launches and element sampling took minutes. The tolerance is the same either way."""
    if xp.__name__ == "cupy":
        return {"mode": "direction"}
    return {"mode": "elements", "max_elements": max_elements}


def assert_gradcheck(report):
    """Fail with the full report (tensor, worst index, both values, eps, tolerances, seed)."""
    assert report.passed, "\n" + str(report)


def assert_same_dropout(cache, ref, *, stored: bool | None = None) -> None:
    """Two dropout caches (npformer.ops.dropout.DropoutCache) drop the same entries with the same scale,
    whichever form each keeps its mask in; ``stored``: whether ``cache`` must hold the mask's booleans
    (False: only its seed), when it dropped anything."""
    from npformer.ops.dropout import keep_mask
    assert cache.dropped == ref.dropped
    if ref.dropped:
        np.testing.assert_array_equal(host(keep_mask(cache)), host(keep_mask(ref)))
        assert cache.scale == ref.scale
        if stored is not None:
            assert (cache.keep is not None) == stored and (cache.draws is None) == stored


def host(a):
    return to_numpy(a)


def assert_same_bits(got, want, what: str = "") -> None:
    """got and want hold the same bytes (host copies of either backend's arrays; NaN payloads and the sign
    of zero included), where equal values would not do."""
    bits = [np.ascontiguousarray(host(x)).view(np.uint8) for x in (got, want)]
    np.testing.assert_array_equal(bits[0], bits[1], err_msg=what)


def assert_packed_self_attention(path: str, dtype, p: float, seed: int = 0, b: int = 2, t: int = 7, h: int = 3,
                                 hs: int = 4):
    """Self-attention on NumPy through the CPU fast path ``path`` ("cpu" or "numba"): the attention's
    output lies in memory as (B, T, H, hs), so merging the heads is a view; the backward's packed
    fast path (npformer.kernels.multihead) gives the reference op's results on the same caches bit
    for bit (the same products on the same values), and the reference path's to rounding (in
    ``kernels.disabled()``); the dropout mask is drawn once per forward from one seed."""
    from npformer import kernels
    from npformer.backend import default_rng
    from npformer.ops import multihead
    e = h * hs
    x = randn(np, (b, t, e), seed, dtype)
    weights = (randn(np, (3 * e, e), seed + 1, dtype, scale=0.3), randn(np, (3 * e,), seed + 2, dtype),
               randn(np, (e, e), seed + 3, dtype, scale=0.3), randn(np, (e,), seed + 4, dtype))
    dout = randn(np, (b, t, e), seed + 5, dtype)
    kw = dict(is_causal=True, need_weights=False, dropout_p=p)

    def forward():
        return multihead.self_attention_forward(x, h, *weights, rng=default_rng(seed, "numpy"), **kw)
    out, _, cache = forward()
    merged = cache.out_proj.x                                                    # (B, T, E): the merged heads
    assert merged.flags.c_contiguous and merged.shape == (b, t, e)
    heads = multihead.split_heads(merged, h)                                     # what attention returned
    assert np.shares_memory(multihead.merge_heads(heads), merged)
    assert kernels.implementation(multihead.self_attention_backward, dout, cache) == path
    got = multihead.self_attention_backward(dout, cache)
    same = multihead.self_attention_backward.reference(dout, cache)             # then a merge copy
    with kernels.disabled():
        out_ref, _, cache_ref = forward()
        ref = multihead.self_attention_backward(dout, cache_ref)
    assert_close(out, out_ref, dtype, what="self-attention out")
    names = ("dx", "din_proj_weight", "din_proj_bias", "dout_proj_weight", "dout_proj_bias")
    for g, s, r, name in zip(got, same, ref, names):
        assert g.dtype == np.dtype(dtype) and g.shape == r.shape, name
        np.testing.assert_array_equal(g, s, err_msg=name)
        assert_close(g, r, dtype, what=name)
    crossed = multihead.self_attention_backward(dout, cache_ref)                # the reference path's cache
    for g, r, name in zip(crossed, ref, names):
        assert_close(g, r, dtype, what=f"{name} on the reference cache")


def assert_blocked_attention(path: str, set_threads, tq: int, tk: int, dtype, alignment: str):
    """Attention on the CPU fast path ``path`` ("cpu" or "numba") in the tiny_blocks fixture's blocks:
    of query rows (scores per head > 8), of several heads and of batch elements (1x1: one block of both
    on one thread, a block each on two), causal in ``alignment`` with a padded key and dropout, on 1, 2
    and 3 threads (``set_threads``, the thread_count fixture): the reference's outputs and gradients,
    the same dropout mask bit for bit and the generator left in the same state; the results bit for
    bit the same for every thread count."""
    from npformer import kernels
    from npformer.backend import default_rng
    from npformer.ops import attention
    b, h, hs = 2, 3, 4
    q, k, v = (randn(np, (b, h, t, hs), i, dtype) for i, t in enumerate((tq, tk, tk)))
    dout = randn(np, (b, h, tq, hs), 3, dtype)
    pad = np.zeros((b, tk), bool)
    pad[1, -1] = True
    kw = dict(key_padding_mask=pad, is_causal=True, causal_alignment=alignment, dropout_p=0.3, need_weights=True)
    assert kernels.implementation(attention.scaled_dot_product_attention_forward, q, k, v, **kw) == path

    def run():
        rng = default_rng(5, "numpy")
        out, weights, cache = attention.scaled_dot_product_attention_forward(q, k, v, rng=rng, **kw)
        grads = attention.scaled_dot_product_attention_backward(dout, cache)
        return (out, weights, *grads), cache.dropout.keep, rng.random(3)
    with kernels.disabled():
        ref, ref_mask, ref_next = run()
    results = []
    for n in (1, 2, 3):
        set_threads(n)
        got, mask, nxt = run()
        np.testing.assert_array_equal(mask, ref_mask)
        np.testing.assert_array_equal(nxt, ref_next)
        for name, g, r in zip(("out", "weights", "dq", "dk", "dv"), got, ref):
            assert_close(g, r, dtype, what=f"attention {name}, {n} threads")
        results.append(got)
    for other in results[1:]:
        for g, r in zip(other, results[0]):
            np.testing.assert_array_equal(g, r)


def assert_future_keys_unread(path: str, dtype):
    """Causal attention on the CPU fast path ``path`` never reads the keys and values in the future of
    every query (top-left, Tq 3 of Tk 7: keys 3 to 6): set to NaN, they change no bit of the outputs
    and gradients, and their dk and dv are 0. (The reference's full products would spread the NaN: a
    masked score is NaN + -inf.)"""
    from npformer import kernels
    from npformer.ops import attention
    b, h, tq, tk, hs = 2, 3, 3, 7, 4
    q, k, v = (randn(np, (b, h, t, hs), i, dtype) for i, t in enumerate((tq, tk, tk)))
    dout = randn(np, (b, h, tq, hs), 3, dtype)
    poisoned_k, poisoned_v = k.copy(), v.copy()
    poisoned_k[:, :, tq:] = poisoned_v[:, :, tq:] = np.nan
    assert kernels.implementation(attention.scaled_dot_product_attention_forward, q, k, v, is_causal=True) == path

    def run(k, v):
        out, weights, cache = attention.scaled_dot_product_attention_forward(q, k, v, is_causal=True,
                                                                             need_weights=True)
        return (out, weights, *attention.scaled_dot_product_attention_backward(dout, cache))
    got, want = run(poisoned_k, poisoned_v), run(k, v)
    for name, g, w in zip(("out", "weights", "dq", "dk", "dv"), got, want):
        assert_same_bits(g, w, what=f"attention {name}")
    for g in got[3:]:
        assert not g[:, :, tq:].any()


def posing_as_cupy(monkeypatch, a):
    """``a`` (a NumPy array) viewed as an array of a fake ``cupy`` module put in ``sys.modules`` for
    the test: a NumPy subclass that npformer's backend checks take for a CuPy array."""
    import sys
    import types

    class FakeCupyArray(np.ndarray):
        pass
    fake = types.ModuleType("cupy")
    fake.ndarray = FakeCupyArray
    monkeypatch.setitem(sys.modules, "cupy", fake)
    return a.view(FakeCupyArray)


def assert_scores_beyond_float16(xp, forward, backward):
    """Attention (``forward``, ``backward``: an op's pair, called on ``xp`` arrays) in float16 with
    |q|, |k| about 1e4 (hs 8): scaled scores of about 1e8, beyond float16's 65,504, and dout v^T
    beyond it in the backward. Scores, softmax and products in float32 (as PyTorch's CPU attention):
    finite, and within the rounding of that arithmetic of the exact (float64) result of the same
    float16 inputs.

    The softmax here is one-hot (scores 1e7 apart), so out is a row of v, dS = P (dP - D) is exactly 0
    and so are dq and dk: what a float32 computation gives for them is the rounding of dP - D, two
    dot products of hs terms of up to max|dout| max|v| (7e5 here) that cancel. To first order
    (Higham's gamma_hs for each), |dS error| <= 2 hs u32 max|dout| max|v|, and dq (dk) sums T of them
    times |k| (|q|) and the scale: 6.0e4 here. The float32 path's dq came out at up to 324 from that
    rounding, the H200's float16 tensor cores at 0 in 79 of 160 entries: both right, the exact answer
    is 0 (comparing with the float32 path's 324 failed the H200). out and dv, well conditioned, are
    within float16's rounding of the exact ones."""
    from npformer import kernels
    from npformer.ops.attention import scaled_dot_product_attention_backward as sdpa_backward
    from npformer.ops.attention import scaled_dot_product_attention_forward as sdpa_forward
    r = np.random.default_rng(0)
    q16, k16, v16 = (xp.asarray((r.standard_normal((2, 2, 5, 8)) * 1e4).astype(np.float16)) for _ in range(3))
    dout16 = xp.asarray((r.standard_normal((2, 2, 5, 8)) * 10).astype(np.float16))
    pad = np.array([[False] * 4 + [True], [False] * 5])
    q, k, v, dout = (host(a).astype(np.float64) for a in (q16, k16, v16, dout16))
    with kernels.disabled():                                    # the exact result, in float64 on the host
        reference = sdpa_forward(q, k, v, key_padding_mask=pad, is_causal=True)
        exact = [reference[0], *sdpa_backward(dout, reference[-1])]
    result = forward(q16, k16, v16, key_padding_mask=xp.asarray(pad), is_causal=True)
    got = [host(a) for a in (result[0], *backward(dout16, result[-1]))]
    t, hs = q.shape[-2:]
    ds_error = 2 * hs * 2.0 ** -24 * np.abs(dout).max() * np.abs(v).max()
    cancelled = {"dq": t * np.abs(k).max() * ds_error / hs ** 0.5, "dk": t * np.abs(q).max() * ds_error / hs ** 0.5}
    for name, g, want in zip(("out", "dq", "dk", "dv"), got, exact):
        assert g.dtype == np.float16 and np.isfinite(g).all(), name
        bound = 4e-3 * np.abs(want).max() + cancelled.get(name, 0.0)
        np.testing.assert_allclose(g.astype(np.float64), want, atol=bound, rtol=0, err_msg=name)
