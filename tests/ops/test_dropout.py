"""dropout: inverted scaling, seeded mask, identity in eval, gradcheck with a fixed mask, a mask kept as its seed."""
import contextlib

import numpy as np
import pytest
from hypothesis import given, strategies as st

from npformer.backend import backend_name, default_rng
from npformer.kernels import disabled
from npformer.ops.attention import scaled_dot_product_attention_backward, scaled_dot_product_attention_forward
from npformer.ops.dropout import (DropoutCache, dropout_backward, dropout_forward, dropout_term, dropout_term_backward,
                                  keep_mask, keep_threshold, seed_draws)
from npformer.tools.gradcheck import gradcheck
from tests.helpers import assert_gradcheck, host, randn, seeds

shapes = st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple)


@given(shape=shapes, p=st.sampled_from([0.0, 0.1, 0.5, 0.9]), seed=seeds)
def test_dropout_gradcheck_with_fixed_mask(xp, shape, p, seed):
    name = backend_name(xp)

    def forward(x):   # a fresh generator per call: the same mask at every finite-difference point
        return dropout_forward(x, p, rng=default_rng(seed, name))

    assert_gradcheck(gradcheck(forward, dropout_backward, {"x": randn(xp, shape, seed)}, seed=seed))


def _seeded(xp, x, p, seed):
    """The cache of dropout_forward(x, p, default_rng(seed)) with its mask kept as the seed's draws (as
    the fused CUDA kernels keep it)."""
    return DropoutCache.of_seed(seed_draws(default_rng(seed, backend_name(xp)), x, xp), p, x)


@given(shape=shapes, p=st.sampled_from([0.1, 0.5, 0.9]), seed=seeds)
def test_a_mask_kept_as_its_seed_is_the_stored_mask(xp, shape, p, seed):
    """DropoutCache.of_seed keeps the two draws the forward made its seed of, not the booleans:
    keep_mask remakes the forward's mask, and both backwards give the stored cache's gradient bit for
    bit; the float64 gradient check holds through the remade mask."""
    x, dout = randn(xp, shape, seed), randn(xp, shape, seed + 1)
    _, stored = dropout_forward(x, p, rng=default_rng(seed, backend_name(xp)))
    seeded = _seeded(xp, x, p, seed)
    assert seeded.keep is None and seeded.dropped and seeded.scale == stored.scale
    np.testing.assert_array_equal(host(keep_mask(seeded)), host(stored.keep))
    assert keep_mask(stored) is stored.keep
    for backward in (dropout_backward, dropout_term_backward):
        np.testing.assert_array_equal(host(backward(dout, seeded)), host(backward(dout, stored)))

    def forward(x):   # the stored forward's output, its mask kept as the seed
        return dropout_forward(x, p, rng=default_rng(seed, backend_name(xp)))[0], _seeded(xp, x, p, seed)

    assert_gradcheck(gradcheck(forward, dropout_backward, {"x": x}, seed=seed))


@pytest.mark.parametrize("fast", [True, False])
def test_attention_backward_takes_a_mask_kept_as_its_seed(xp, fast):
    """The plain attention's backward (reference, and the CPU fast path) remakes its weights' dropout
    mask from a cache that keeps only the seed, to the stored cache's gradients bit for bit."""
    q, k, v, dout = (randn(xp, (2, 3, 5, 4), s) for s in range(4))
    _, _, cache = scaled_dot_product_attention_forward(q, k, v, is_causal=True, dropout_p=0.3,
                                                       rng=default_rng(7, backend_name(xp)))
    seeded = cache._replace(dropout=_seeded(xp, cache.p, 0.3, 7))
    with contextlib.nullcontext() if fast else disabled():
        for got, ref in zip(scaled_dot_product_attention_backward(dout, seeded),
                            scaled_dot_product_attention_backward(dout, cache)):
            np.testing.assert_array_equal(host(got), host(ref))


def test_inverted_scaling_keeps_the_mean(xp):
    x = xp.ones((200_000,))
    out, cache = dropout_forward(x, 0.3, rng=default_rng(0, backend_name(xp)))
    kept = host(out) != 0
    np.testing.assert_allclose(host(out)[kept], 1 / 0.7, rtol=1e-15)
    assert abs(kept.mean() - 0.7) < 0.005                # 7 standard deviations of a binomial mean
    np.testing.assert_array_equal(host(dropout_backward(x, cache)), host(out))


@pytest.mark.parametrize("p, training", [(0.0, True), (0.5, False), (0.5, True)])
def test_a_dropout_term_and_its_gradient_are_their_inputs_when_nothing_drops(xp, p, training):
    """Inside an op that only reads them (a residual sum, a product's input), an identity dropout
    copies nothing either way; an active one is the dropout op's, forward and backward."""
    x, dout = randn(xp, (3, 4), 0), randn(xp, (3, 4), 1)
    rng = default_rng(2, backend_name(xp))
    term, cache = dropout_term(x, p, rng=rng, training=training)
    grad = dropout_term_backward(dout, cache)
    if p == 0.0 or not training:
        assert term is x and grad is dout
        return
    ref, ref_cache = dropout_forward(x, p, rng=default_rng(2, backend_name(xp)), training=training)
    np.testing.assert_array_equal(host(term), host(ref))
    np.testing.assert_array_equal(host(grad), host(dropout_backward(dout, ref_cache)))
    with pytest.raises(Exception, match="dout"):
        dropout_term_backward(dout[:2], cache)


def test_same_seed_same_mask_other_seed_other_mask(xp):
    x = randn(xp, (50, 50), 0)
    name = backend_name(xp)
    a, _ = dropout_forward(x, 0.5, rng=default_rng(1, name))
    b, _ = dropout_forward(x, 0.5, rng=default_rng(1, name))
    c, _ = dropout_forward(x, 0.5, rng=default_rng(2, name))
    assert xp.array_equal(a, b) and not xp.array_equal(a, c)


def test_eval_mode_and_p0_are_identity_copies(xp):
    x = randn(xp, (3, 4), 0)
    for kwargs in ({"p": 0.5, "training": False}, {"p": 0.0}):
        out, cache = dropout_forward(x, **kwargs)
        assert xp.array_equal(out, x) and out is not x
        dout = randn(xp, (3, 4), 1)
        assert xp.array_equal(dropout_backward(dout, cache), dout)


def test_p1_drops_everything(xp):
    x = randn(xp, (3, 4), 0)
    out, cache = dropout_forward(x, 1.0, rng=default_rng(0, backend_name(xp)))
    assert not host(out).any() and not host(dropout_backward(x, cache)).any()
    assert np.all(np.isfinite(host(out)))


NEAR_ONE = 0.99999          # 1 / (1 - p) = 1e5, beyond float16's 65504


def _kept_at(xp, shape, p, seed, values):
    """A float16 x of ``shape`` that holds ``values`` at the first entries dropout(p, seed) keeps and
    small values elsewhere (the mask depends on the seed and the shape alone), and those entries."""
    _, cache = dropout_forward(xp.zeros(shape, xp.float16), p, rng=default_rng(seed, backend_name(xp)))
    kept = np.flatnonzero(host(keep_mask(cache)))
    assert kept.size >= len(values), "a seed whose mask keeps enough entries"
    x = host(randn(np, shape, seed, "float16", scale=1e-3))
    x.reshape(-1)[kept[:len(values)]] = values
    return xp.asarray(x), kept


@pytest.mark.parametrize("fast", [True, False])
def test_float16_dropout_scales_in_float32_where_1_over_1_minus_p_overflows(xp, fast):
    """p = 0.99999: 1 / (1 - p) = 1e5 would round to inf in float16 and every dropped entry be
    0 * inf = NaN. The scale is a float32 scalar and x m / (1 - p) is computed in float32, rounded
    once: a dropped entry is 0, a kept one x * 1e5 rounded to float16, inf only where that exceeds
    float16's range (+-1 -> +-inf, 1e-3 -> 100, -0.375 -> -37500, 0 -> 0); the gradient the same."""
    values = [1.0, -1.0, 1e-3, -0.375, 0.0]
    shape = (1 << 20,)                                   # about 10 kept; the CPU fast path's size
    x, kept = _kept_at(xp, shape, NEAR_ONE, 3, values)
    with contextlib.nullcontext() if fast else disabled(), np.errstate(over="ignore"):   # +-1e5: inf
        out, cache = dropout_forward(x, NEAR_ONE, rng=default_rng(3, backend_name(xp)))
        dx = dropout_backward(x, cache)
    assert cache.scale.dtype == np.float32 and cache.scale == np.float32(1e5)
    for got in (host(out), host(dx)):
        assert got.dtype == np.float16 and not np.isnan(got).any()
        dropped = np.ones(got.shape, bool)
        dropped[kept] = False
        assert not got[dropped].any()
        with np.errstate(over="ignore"):
            want = (host(x)[kept].astype(np.float64) / (1 - NEAR_ONE)).astype(np.float16)   # inf beyond 65504
        np.testing.assert_array_equal(got[kept], want)
        # 1e-3 is 0.0010004 in float16 (x 1e5: 100.0625), -37500 rounds to -37504
        np.testing.assert_array_equal(got[kept[:len(values)]], [np.inf, -np.inf, 100.0625, -37504, 0])


@pytest.mark.parametrize("fast", [True, False])
def test_float16_attention_dropout_where_1_over_1_minus_p_overflows(xp, fast):
    """The attention's weights dropped at p = 0.99999 in float16: the kept weights are P * 1e5 (P
    about 1/Tk: finite), the rest 0; output and gradients are the float64 formula's on the forward's
    mask, within float16 rounding (they were all NaN)."""
    b, h, t, hs = 2, 4, 256, 4
    q, k, v, dout = (randn(xp, (b, h, t, hs), s, "float16", scale=0.5) for s in range(4))
    with contextlib.nullcontext() if fast else disabled():
        out, _, cache = scaled_dot_product_attention_forward(q, k, v, dropout_p=NEAR_ONE,
                                                             rng=default_rng(5, backend_name(xp)))
        dq, dk, dv = scaled_dot_product_attention_backward(dout, cache)
    m = host(keep_mask(cache.dropout))
    assert m.any()
    p_drop = host(cache.p).astype(np.float64) * m / (1 - NEAR_ONE)        # (B, H, T, T)
    v64, g64 = host(v).astype(np.float64), host(dout).astype(np.float64)
    for got, want in ((out, p_drop @ v64), (dv, p_drop.swapaxes(-1, -2) @ g64)):
        got = host(got)
        assert got.dtype == np.float16 and np.isfinite(got).all()
        np.testing.assert_allclose(got, want, rtol=4e-3, atol=4e-3 * np.abs(want).max())
    assert all(np.isfinite(host(g)).all() for g in (dq, dk))


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_dropout_preserves_dtype(xp, dtype):
    x = randn(xp, (4, 5), 0, dtype=dtype)
    out, cache = dropout_forward(x, 0.2, rng=default_rng(0, backend_name(xp)))
    assert out.dtype == x.dtype and dropout_backward(out, cache).dtype == x.dtype


def test_dropout_bad_input(xp):
    x = randn(xp, (2, 2), 0)
    with pytest.raises(ValueError, match=r"p: expected a probability in \[0, 1\], got 1.5"):
        dropout_forward(x, 1.5, rng=default_rng(0))
    with pytest.raises(ValueError, match="needs rng"):
        dropout_forward(x, 0.5)
    with pytest.raises(TypeError, match="x: expected a floating-point array"):
        dropout_forward(xp.ones((2,), dtype=bool), 0.5, rng=default_rng(0))


GOLDEN, MIX1, MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB   # written out, not imported


def splitmix64(z: int) -> int:
    """splitmix64's output function (Steele, Lea and Flood 2014) in Python integers, as its authors
    write it, the last xor-shift included."""
    z = (z ^ (z >> 30)) * MIX1 % 2 ** 64
    z = (z ^ (z >> 27)) * MIX2 % 2 ** 64
    return z ^ (z >> 31)


def drawn_seed(rng) -> int:
    """The seed a dropout draws: two float64 uniforms' top 32 bits, high half first."""
    hi, lo = (int(u * 2.0 ** 32) for u in rng.random(2))
    return hi << 32 | lo


@pytest.mark.parametrize("p", [1e-9, 1e-7, 0.1, 0.3, 0.5, 0.9, 0.999999, 1 - 2.0 ** -30, 1.0])
def test_keep_threshold_is_the_exact_comparison(p):
    """The kernels compare integers, z >> 40 >= keep_threshold(p): for every one of the 2^24 values it
    is the real-number comparison (z >> 40) / 2^24 >= p (exact in float64)."""
    u = np.arange(1 << 24, dtype=np.float64) * 2.0 ** -24 >= p
    assert keep_threshold(p) == (int(np.argmax(u)) if u.any() else 1 << 24)


@pytest.mark.parametrize("p", [1e-9, 0.1, 0.3333, 0.5, 0.999999])
@pytest.mark.parametrize("shape", [(8, 4, 128, 128), (3, 5), (70_001, 2)])
def test_mask_is_splitmix64_of_the_seed_and_the_flat_index(shape, p):
    """Element n is kept when the top 24 bits of splitmix64(seed + n golden), over 2^24, are >= p,
    the seed being the generator's next two float64 draws; checked in Python integers at 2000
    indices (the ends included) of masks made by whichever path serves NumPy arrays; the
    generator then goes on as after those two draws."""
    x = np.ones(shape, dtype=np.float32)
    a, b = default_rng(11, "numpy"), default_rng(11, "numpy")
    out, cache = dropout_forward(x, p, rng=a)
    seed = drawn_seed(b)
    flat = cache.keep.reshape(-1)
    for n in {0, x.size - 1, *np.random.default_rng(3).integers(0, x.size, 1998).tolist()}:
        u = (splitmix64((seed + n * GOLDEN) % 2 ** 64) >> 40) / 2 ** 24
        assert flat[n] == (u >= p), n
    np.testing.assert_array_equal(out, cache.keep * np.float32(1 / (1 - p)))
    np.testing.assert_array_equal(a.random(7), b.random(7))


def test_mask_with_other_bit_generators():
    x = np.ones((64, 64), dtype=np.float32)
    for bitgen in (np.random.MT19937, np.random.Philox, np.random.SFC64):
        a, b = np.random.Generator(bitgen(5)), np.random.Generator(bitgen(5))
        _, cache = dropout_forward(x, 0.25, rng=a)
        seed = drawn_seed(b)
        n = np.arange(x.size)
        keep = [(splitmix64((seed + int(i) * GOLDEN) % 2 ** 64) >> 40) >= 0.25 * 2 ** 24 for i in n]
        np.testing.assert_array_equal(cache.keep.reshape(-1), keep)


def test_masks_look_independent_across_neighbours_and_calls(xp):
    """Counter-based bits must not echo their counters: at p = 0.5 over 2^20 elements, neighbours
    along the flat index, a row apart, and the same element in the next call (the next seed) agree
    half the time, and each bit position's keep rate is 1 - p (5 standard deviations each)."""
    name = backend_name(xp)
    rng = default_rng(7, name)
    x = xp.ones((1024, 1024), dtype=xp.float32)
    first, second = (host(dropout_forward(x, 0.5, rng=rng)[1].keep) for _ in range(2))
    n, sd = first.size, 0.5 / np.sqrt(first.size)
    for a, b in ((first[:, 1:], first[:, :-1]), (first[1:], first[:-1]), (first, second)):
        assert abs((a == b).mean() - 0.5) < 5 * sd * np.sqrt(n / a.size)
    rates = first.reshape(-1, 64).mean(axis=0)            # element n's rate by n % 64
    assert np.all(np.abs(rates - 0.5) < 5 * 0.5 / np.sqrt(n / 64))
