"""Transformer-XL's relative attention and its relative shift: a loop reference built from distances,
gradchecks of all seven inputs over shapes, memory lengths 0..3, padding and dropout with a fixed seed,
invariants (plain causal attention when the positional terms vanish, blocked memory changes nothing),
fully masked rows, float32, views, huge scores (float16 ones computed in float32) and every bad input."""
import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

from npformer.backend import backend_name, default_rng
from npformer.ops.attention import scaled_dot_product_attention_forward as sdpa_forward
from npformer.ops.relative_attention import (rel_shift_backward, rel_shift_forward,
                                             relative_attention_backward as rel_backward,
                                             relative_attention_forward as rel_forward)
from npformer.tools.gradcheck import gradcheck
from tests.helpers import (assert_close, assert_gradcheck, batch, head_size, heads, host, padding_masks, randn, seeds,
                           seq)

mems = st.integers(0, 3)


def inputs(xp, b, h, tq, m, hs, c, seed, hv=3, dtype="float64"):
    tk = m + tq
    return {"q": randn(xp, (b, h, tq, hs), seed, dtype), "k": randn(xp, (b, h, tk, hs), seed + 1, dtype),
            "v": randn(xp, (b, h, tk, hv), seed + 2, dtype), "r": randn(xp, (tk, c), seed + 3, dtype),
            "r_weight": randn(xp, (h * hs, c), seed + 4, dtype, scale=0.5),
            "bias_u": randn(xp, (h, hs), seed + 5, dtype), "bias_v": randn(xp, (h, hs), seed + 6, dtype)}


def reference(q, k, v, r, r_weight, bias_u, bias_v, pad=None):
    """Loops over b, h, i and the allowed keys j <= M + i: the paper's four terms from the distance
    d = M + i - j, with R_d = r[Tk - 1 - d]; a query with no key left gets zeros."""
    b, h, tq, hs = q.shape
    tk = k.shape[2]
    m = tk - tq
    out = np.zeros((b, h, tq, v.shape[-1]))
    for bi, hi, i in np.ndindex(b, h, tq):
        w_r = r_weight[hi * hs:(hi + 1) * hs]                                 # (hs, C)
        keys = [j for j in range(m + i + 1) if pad is None or not pad[bi, j]]
        if not keys:
            continue
        s = np.array([(q[bi, hi, i] + bias_u[hi]) @ k[bi, hi, j]
                      + (q[bi, hi, i] + bias_v[hi]) @ (w_r @ r[tk - 1 - (m + i - j)]) for j in keys])
        e = np.exp((s - s.max()) / math.sqrt(hs))
        out[bi, hi, i] = (e / e.sum()) @ v[bi, hi, keys]
    return out


@given(lead=st.lists(st.integers(1, 3), max_size=2), tq=seq, m=mems, seed=seeds)
def test_rel_shift_moves_row_i_left_by_tq_minus_1_minus_i_and_gradcheck(xp, lead, tq, m, seed):
    tk = tq + m
    x = randn(xp, (*lead, tq, tk), seed)
    out, _ = rel_shift_forward(x)
    hx, ho = host(x), host(out)
    for i, j in np.ndindex(tq, tk):
        if j <= i + m:                                   # the causal part: distance m + i - j >= 0
            np.testing.assert_array_equal(ho[..., i, j], hx[..., i, j + tq - 1 - i])
    assert_gradcheck(gradcheck(rel_shift_forward, rel_shift_backward, {"x": x}, seed=seed))


@given(b=batch, h=heads, hs=head_size, tq=seq, m=mems, c=st.integers(1, 4), seed=seeds, data=st.data())
def test_matches_distance_loops_and_gradcheck_with_memory_and_padding(xp, b, h, hs, tq, m, c, seed, data):
    pad = data.draw(padding_masks(b, m + tq)) if data.draw(st.booleans()) else None
    kw = {} if pad is None else {"key_padding_mask": xp.asarray(pad)}
    x = inputs(xp, b, h, tq, m, hs, c, seed)
    out, _ = rel_forward(**x, **kw)
    np.testing.assert_allclose(host(out), reference(*(host(a) for a in x.values()), pad=pad),
                               rtol=1e-12, atol=1e-13)
    assert_gradcheck(gradcheck(rel_forward, rel_backward, x, kwargs=kw, seed=seed))


@given(b=batch, h=heads, tq=seq, m=mems, seed=seeds, p=st.sampled_from([0.1, 0.5]))
def test_gradcheck_dropout_fixed_seed(xp, b, h, tq, m, seed, p):
    name = backend_name(xp)

    def forward(**kw):                                   # a fresh generator per call: the same mask
        return rel_forward(**kw, dropout_p=p, rng=default_rng(seed, name))
    x = inputs(xp, b, h, tq, m, 2, 3, seed)
    out_eval, _ = rel_forward(**x, dropout_p=p, training=False)
    out_train, _ = forward(**x)
    assert not np.allclose(host(out_eval), host(out_train)) or p == 0
    assert_gradcheck(gradcheck(forward, rel_backward, x, seed=seed))


@given(b=batch, h=heads, hs=head_size, tq=seq, m=mems, seed=seeds)
def test_without_positional_terms_it_is_causal_attention_over_memory(xp, b, h, hs, tq, m, seed):
    x = inputs(xp, b, h, tq, m, hs, 3, seed)
    x["r_weight"] = x["r_weight"] * 0
    x["bias_u"] = x["bias_u"] * 0
    out, _ = rel_forward(**x)
    ref, _, _ = sdpa_forward(x["q"], x["k"], x["v"], is_causal=True, causal_alignment="bottom_right")
    np.testing.assert_allclose(host(out), host(ref), rtol=1e-12, atol=1e-13)


@given(b=batch, h=heads, tq=seq, m=mems, extra=st.integers(1, 3), seed=seeds)
def test_blocked_extra_memory_in_front_changes_nothing(xp, b, h, tq, m, extra, seed):
    """Distances are counted from each query, so keys added before the memory (blocked) leave every
    score of the other keys where it was: the shift aligns the same distances whatever M is."""
    x = inputs(xp, b, h, tq, m, 2, 3, seed)
    big = inputs(xp, b, h, tq, m + extra, 2, 3, seed + 100)
    for name in ("k", "v"):
        big[name][:, :, extra:] = x[name]
    big["r"][extra:] = x["r"]                           # rows of distances M + Tq - 1 .. 0, as before
    for name in ("q", "r_weight", "bias_u", "bias_v"):
        big[name] = x[name]
    pad = xp.asarray(np.arange(m + extra + tq)[None].repeat(b, 0) < extra)   # (B, Tk): the extra keys
    small, _ = rel_forward(**x)
    out, cache = rel_forward(**big, key_padding_mask=pad)
    np.testing.assert_allclose(host(out), host(small), rtol=1e-12, atol=1e-13)
    dk = host(rel_backward(randn(xp, out.shape, seed + 7), cache)[1])
    assert not dk[:, :, :extra].any()                    # blocked keys get no gradient


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_fully_masked_rows_zero_output_zero_grads_no_nan(xp, dtype):
    x = inputs(xp, 2, 2, 3, 2, 4, 5, 0, dtype=dtype)
    pad = np.zeros((2, 5), bool)
    pad[1] = True                                        # batch 1: every key is padding
    mask = np.zeros((3, 5), bool)
    mask[2] = True                                       # query 2 may attend nothing
    out, cache = rel_forward(**x, key_padding_mask=xp.asarray(pad), attn_mask=xp.asarray(mask))
    grads = rel_backward(randn(xp, out.shape, 3, dtype), cache)
    assert all(g.dtype == x["q"].dtype and np.isfinite(host(g)).all() for g in (out, *grads))
    assert not host(out)[1].any() and not host(out)[:, :, 2].any()
    dq, dk, dv = (host(g) for g in grads[:3])
    assert not dq[1].any() and not dk[1].any() and not dv[1].any() and not dq[:, :, 2].any()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_huge_scores_stay_finite_and_pick_the_largest(xp, dtype):
    x = inputs(xp, 1, 1, 2, 1, 4, 3, 0, dtype=dtype)
    x["q"] = xp.full((1, 1, 2, 4), 50.0, dtype=x["q"].dtype)
    k = np.full((1, 1, 3, 4), -50.0, dtype)
    k[..., 0, :] = 50.0                                  # key 0 (the memory) scores 1e4 for both queries
    x["k"] = xp.asarray(k)
    x["r_weight"] = x["r_weight"] * 0
    out, cache = rel_forward(**x, scale=2.0)
    grads = rel_backward(xp.ones_like(out), cache)
    assert all(np.isfinite(host(g)).all() for g in (out, *grads))
    np.testing.assert_array_equal(host(out), np.broadcast_to(host(x["v"])[:, :, 0:1], out.shape))


def test_float16_scores_beyond_its_range_are_computed_in_float32(xp):
    """|q|, |k| ~ 300 with hs = 8 give scores of about 1e5, beyond float16's 65504: the scores, the
    softmax and the products are computed in float32 (as ops.attention computes them) and rounded where
    returned, so the float16 output and all seven gradients are the float64 op's on the same values
    within float16 rounding (they were NaN)."""
    x = inputs(xp, 2, 2, 3, 2, 8, 4, 0, dtype="float16")
    x["q"], x["k"] = randn(xp, (2, 2, 3, 8), 7, "float16", 300.0), randn(xp, (2, 2, 5, 8), 8, "float16", 300.0)
    x64 = {n: a.astype(xp.float64) for n, a in x.items()}   # the same values, in float64
    s = host(x64["q"] + x64["bias_u"][:, None, :]) @ host(x64["k"]).swapaxes(-1, -2) / math.sqrt(8)
    assert np.abs(s).max() > 65504
    dout = randn(xp, (2, 2, 3, 3), 9, "float16")
    with np.errstate(over="raise", invalid="raise"):     # nothing overflows on the way
        out, cache = rel_forward(**x)
        grads = rel_backward(dout, cache)
    out64, cache64 = rel_forward(**x64)
    grads64 = rel_backward(dout.astype(xp.float64), cache64)
    names = ("out", "dq", "dk", "dv", "dr", "dr_weight", "dbias_u", "dbias_v")
    for name, got, want in zip(names, (out, *grads), (out64, *grads64)):
        assert got.dtype == xp.float16 and np.isfinite(host(got)).all(), name
        assert_close(got, want.astype(xp.float16), "float16", what=name)   # 4 float16 ulp at the largest


def test_float32_preserved_views_and_no_mutation(xp):
    x = inputs(xp, 2, 3, 4, 2, 5, 6, 0, dtype="float32")
    x["k"] = randn(xp, (2, 6, 3, 5), 1, "float32").transpose(0, 2, 1, 3)      # head-split views
    x["v"] = randn(xp, (2, 3, 4, 6), 2, "float32").swapaxes(-1, -2)
    assert not x["k"].flags.c_contiguous and not x["v"].flags.c_contiguous
    before = {n: host(a).copy() for n, a in x.items()}
    out, cache = rel_forward(**x)
    dout = randn(xp, out.shape, 3, "float32")
    grads = rel_backward(dout, cache)
    assert all(g.dtype == xp.float32 for g in (out, *grads))
    assert all(np.array_equal(host(x[n]), before[n]) for n in x)
    c_out, c_cache = rel_forward(**{n: xp.ascontiguousarray(a) for n, a in x.items()})
    np.testing.assert_allclose(host(out), host(c_out), rtol=1e-6, atol=1e-6)
    for g, c in zip(grads, rel_backward(dout, c_cache)):
        np.testing.assert_allclose(host(g), host(c), rtol=1e-5, atol=1e-5)


def test_bad_input(xp):
    x = inputs(xp, 2, 1, 3, 1, 4, 5, 0)
    with pytest.raises(ValueError, match=r"Tk = M \+ Tq >= Tq"):
        rel_forward(**{**x, "k": x["k"][:, :, :2], "v": x["v"][:, :, :2], "r": x["r"][:2]})
    with pytest.raises(ValueError, match=r"r: expected one row per key, shape \(Tk, C\)=\(4, \*\)"):
        rel_forward(**{**x, "r": x["r"][:3]})
    with pytest.raises(ValueError, match=r"r_weight: expected shape \(4, 5\)"):
        rel_forward(**{**x, "r_weight": x["r_weight"][:, :4]})
    with pytest.raises(ValueError, match=r"bias_u: expected shape \(1, 4\)"):
        rel_forward(**{**x, "bias_u": x["bias_u"][0]})
    with pytest.raises(ValueError, match=r"q: expected a 4-d array"):
        rel_forward(**{**x, "q": x["q"][0]})
    with pytest.raises(TypeError, match="dtype mismatch: q is float64 but bias_v is float32"):
        rel_forward(**{**x, "bias_v": x["bias_v"].astype(xp.float32)})
    with pytest.raises(ValueError, match=r"key_padding_mask: expected shape \(B, Tk\)=\(2, 4\)"):
        rel_forward(**x, key_padding_mask=xp.zeros((2, 3), bool))
    with pytest.raises(ValueError, match="dropout with p > 0 in training mode needs rng"):
        rel_forward(**x, dropout_p=0.5)
    with pytest.raises(ValueError, match="scale: expected a finite number, got inf"):
        rel_forward(**x, scale=float("inf"))
    with pytest.raises(ValueError, match=r"Tk >= Tq"):
        rel_shift_forward(randn(xp, (3, 2), 0))
