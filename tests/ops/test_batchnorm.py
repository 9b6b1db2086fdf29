"""batch_norm_forward / batch_norm_backward: loop reference, running statistics, padding mask, gradcheck,
constant features, one value per feature, bad input."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from npformer.ops.batchnorm import RunningStats, batch_norm_backward, batch_norm_forward
from npformer.tools.gradcheck import gradcheck
from tests.helpers import NO_TORCH, assert_gradcheck, host, randn, seeds

# (N, C) or (B, T, C) with at least 2 positions in all, so that training has a variance
shapes = st.one_of(st.tuples(st.integers(2, 6), st.integers(1, 5)),
                   st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(1, 5))
                   .filter(lambda s: s[0] * s[1] >= 2))


@st.composite
def keep_masks(draw, shape):
    """Bool padding masks of ``shape[:-1]`` (True = padding) leaving at least 2 positions free."""
    lead = shape[:-1]
    flags = np.array(draw(st.lists(st.booleans(), min_size=int(np.prod(lead)), max_size=int(np.prod(lead)))))
    free = draw(st.lists(st.integers(0, flags.size - 1), min_size=2, max_size=2, unique=True))
    flags[free] = False
    return flags.reshape(lead)


def reference(x, w, b, eps, keep=None):
    """Per feature, with Python loops over the positions: the definition, written plainly."""
    x = np.asarray(x, np.float64)
    rows = x.reshape(-1, x.shape[-1])
    keep = np.ones(rows.shape[0], bool) if keep is None else np.asarray(keep).reshape(-1)
    y = np.empty_like(rows)
    means, variances = [], []
    for c in range(rows.shape[1]):
        vals = [rows[i, c] for i in range(rows.shape[0]) if keep[i]]
        mu = sum(vals) / len(vals)
        var = sum((v - mu) ** 2 for v in vals) / len(vals)
        means.append(mu)
        variances.append(var)
        for i in range(rows.shape[0]):
            y[i, c] = (rows[i, c] - mu) / np.sqrt(var + eps) * w[c] + b[c]
    return y.reshape(x.shape), np.array(means), np.array(variances), int(keep.sum())


@given(shape=shapes, affine=st.sampled_from(["both", "weight", "none"]), training=st.booleans(),
       masked=st.booleans(), data=st.data(), seed=seeds)
def test_batch_norm_gradcheck_and_reference(xp, shape, affine, training, masked, data, seed):
    c = shape[-1]
    inputs = {"x": randn(xp, shape, seed, scale=2.0) + 1.0}
    if affine != "none":
        inputs["weight"] = randn(xp, (c,), seed + 1)
    if affine == "both":
        inputs["bias"] = randn(xp, (c,), seed + 2)
    mask = xp.asarray(data.draw(keep_masks(shape))) if masked else None
    running = RunningStats(randn(xp, (c,), seed + 3), xp.asarray(np.random.default_rng(seed).random(c) + 0.5))
    kwargs = dict(running=running, training=training, padding_mask=mask, momentum=0.3)
    y, new, _ = batch_norm_forward(**inputs, **kwargs)
    w = host(inputs.get("weight", xp.ones(c)))
    b = host(inputs.get("bias", xp.zeros(c)))
    if training:
        ref, mu, var, n = reference(host(inputs["x"]), w, b, 1e-5, None if mask is None else ~host(mask))
        np.testing.assert_allclose(host(new.mean), 0.7 * host(running.mean) + 0.3 * mu, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(host(new.var), 0.7 * host(running.var) + 0.3 * var * n / (n - 1),
                                   rtol=1e-12, atol=1e-12)
    else:
        xr = (host(inputs["x"]) - host(running.mean)) / np.sqrt(host(running.var) + 1e-5)
        ref = xr * w + b
        assert new is running
    np.testing.assert_allclose(host(y), ref, rtol=1e-10, atol=1e-10)
    assert_gradcheck(gradcheck(batch_norm_forward, batch_norm_backward, inputs, kwargs=kwargs, seed=seed))


def test_training_statistics_are_zero_mean_unit_variance_per_feature(xp):
    x = randn(xp, (4, 6, 3), 0, scale=3.0) + 5.0
    y, _, _ = batch_norm_forward(x)
    rows, var = host(y).reshape(-1, 3), host(x).reshape(-1, 3).var(0)
    np.testing.assert_allclose(rows.mean(0), 0, atol=1e-13)
    np.testing.assert_allclose(rows.var(0), var / (var + 1e-5), rtol=1e-12)


def test_padding_mask_leaves_padding_out_of_the_statistics(xp):
    x = randn(xp, (3, 5, 4), 1)
    mask = np.zeros((3, 5), bool)
    mask[0, 2:] = mask[2, 4:] = True
    y1, r1, _ = batch_norm_forward(x, running=RunningStats(xp.zeros(4), xp.ones(4)), padding_mask=xp.asarray(mask))
    changed = host(x).copy()
    changed[mask] = 1e3                                   # whatever the padding holds
    y2, r2, _ = batch_norm_forward(xp.asarray(changed), running=RunningStats(xp.zeros(4), xp.ones(4)),
                                   padding_mask=xp.asarray(mask))
    np.testing.assert_array_equal(host(y1)[~mask], host(y2)[~mask])
    np.testing.assert_array_equal(host(r1.mean), host(r2.mean))
    np.testing.assert_array_equal(host(r1.var), host(r2.var))
    # the same valid positions packed without padding give the same normalisation
    packed, _, _ = batch_norm_forward(xp.asarray(host(x)[~mask]))
    np.testing.assert_allclose(host(y1)[~mask], host(packed), rtol=1e-12, atol=1e-12)
    # without the mask the padding moves every valid output
    y3, _, _ = batch_norm_forward(xp.asarray(changed))
    assert np.abs(host(y3)[~mask] - host(y1)[~mask]).max() > 1e-2


def test_all_false_mask_equals_no_mask(xp):
    x = randn(xp, (2, 3, 4), 2)
    a, ra, _ = batch_norm_forward(x, running=RunningStats(xp.zeros(4), xp.ones(4)))
    b, rb, _ = batch_norm_forward(x, running=RunningStats(xp.zeros(4), xp.ones(4)),
                                  padding_mask=xp.zeros((2, 3), dtype=bool))
    np.testing.assert_allclose(host(a), host(b), rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(host(ra.var), host(rb.var), rtol=1e-13)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_constant_features_give_the_bias_and_no_nan(xp, dtype):
    x = xp.full((4, 3, 5), 1e3, dtype=dtype)
    w, b = xp.ones(5, dtype=dtype) * 2, xp.arange(5, dtype=dtype)
    running = RunningStats(xp.zeros(5, dtype=dtype), xp.ones(5, dtype=dtype))
    y, new, cache = batch_norm_forward(x, w, b, running)
    assert y.dtype == x.dtype and new.mean.dtype == x.dtype
    np.testing.assert_array_equal(host(y), np.broadcast_to(host(b), (4, 3, 5)))
    np.testing.assert_array_equal(host(new.var), 0.9 * np.ones(5, dtype=dtype))   # the unbiased variance is 0
    dy = randn(xp, (4, 3, 5), 3, dtype=dtype)
    grads = batch_norm_backward(dy, cache)
    assert all(np.isfinite(host(g)).all() for g in grads)
    # xhat = 0 and rstd = 1 / sqrt(eps): a small change of x is amplified, not lost,
    # dx = rstd * w * (dy - mean(dy)) (the xhat term vanishes)
    g = host(dy).astype(np.float64).reshape(-1, 5) * 2
    expected = (g - g.mean(0)) / np.sqrt(1e-5)
    tol = 1e-2 if dtype == "float16" else 1e-5
    np.testing.assert_allclose(host(grads[0]).astype(np.float64).reshape(-1, 5), expected, rtol=tol, atol=tol)


def test_one_value_per_feature_in_training_is_an_error(xp):
    """Training needs a variance: (1, C), or (1, 1, C), or one free position, raise (as torch does);
    eval mode at batch size 1 is fine, and (1, T, C) trains on the T positions of its one sequence."""
    w, b = randn(xp, (3,), 1), randn(xp, (3,), 2)
    for x in (randn(xp, (1, 3), 0), randn(xp, (1, 1, 3), 0)):
        with pytest.raises(ValueError, match="more than 1 .*value per feature, got 1"):
            batch_norm_forward(x, w, b)
    mask = xp.asarray(np.array([[False, True, True]]))
    with pytest.raises(ValueError, match="got 1 in x"):
        batch_norm_forward(randn(xp, (1, 3, 3), 0), w, b, padding_mask=mask)
    running = RunningStats(randn(xp, (3,), 4), xp.ones(3) * 2.0)
    y, _, _ = batch_norm_forward(randn(xp, (1, 3), 0), w, b, running, training=False)
    expected = (host(randn(xp, (1, 3), 0)) - host(running.mean)) / np.sqrt(2.0 + 1e-5) * host(w) + host(b)
    np.testing.assert_allclose(host(y), expected, rtol=1e-12)
    y, _, _ = batch_norm_forward(randn(xp, (1, 4, 3), 0), w, b)
    assert np.isfinite(host(y)).all()


def test_float32_matches_float64_and_keeps_its_dtype(xp):
    x64 = randn(xp, (8, 64, 16), 1, scale=4.0) + 3.0
    w, b = randn(xp, (16,), 2), randn(xp, (16,), 3)
    r64 = RunningStats(xp.zeros(16), xp.ones(16))
    r32 = RunningStats(*(a.astype(xp.float32) for a in r64))
    y32, n32, c32 = batch_norm_forward(x64.astype(xp.float32), w.astype(xp.float32), b.astype(xp.float32), r32)
    y64, n64, c64 = batch_norm_forward(x64, w, b, r64)
    assert y32.dtype == n32.mean.dtype == n32.var.dtype == xp.float32
    np.testing.assert_allclose(host(y32), host(y64), rtol=1e-4, atol=1e-4)
    d = randn(xp, (8, 64, 16), 4)
    g32, g64 = batch_norm_backward(d.astype(xp.float32), c32), batch_norm_backward(d, c64)
    assert all(g.dtype == xp.float32 for g in g32)
    for a, e in zip(g32, g64):
        np.testing.assert_allclose(host(a), host(e), rtol=1e-3, atol=1e-3)


def test_pure_and_views(xp):
    base = randn(xp, (4, 6), 0)
    x = base.T                                            # (6, 4) non-contiguous
    before = base.copy()
    running = RunningStats(xp.zeros(4), xp.ones(4))
    y, new, cache = batch_norm_forward(x, running=running)
    batch_norm_backward(randn(xp, (6, 4), 1), cache)
    assert xp.array_equal(base, before)
    assert float(abs(running.mean).sum()) == 0 and float(running.var.sum()) == 4   # not updated in place
    np.testing.assert_allclose(host(y), reference(host(x), np.ones(4), np.zeros(4), 1e-5)[0], rtol=1e-12)


def test_parity_with_torch_functional_batch_norm(xp):
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    x = randn(xp, (3, 5, 4), 7)
    w, b = randn(xp, (4,), 8), randn(xp, (4,), 9)
    rm, rv = randn(xp, (4,), 10), xp.ones(4) * 1.5
    y, new, _ = batch_norm_forward(x, w, b, RunningStats(rm, rv), momentum=0.2)
    tx = torch.tensor(host(x)).transpose(1, 2)            # torch's (N, C, L)
    trm, trv = torch.tensor(host(rm)), torch.tensor(host(rv))
    ty = torch.nn.functional.batch_norm(tx, trm, trv, torch.tensor(host(w)), torch.tensor(host(b)),
                                        training=True, momentum=0.2, eps=1e-5)
    np.testing.assert_allclose(host(y), ty.transpose(1, 2).numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(host(new.mean), trm.numpy(), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(host(new.var), trv.numpy(), rtol=1e-12)


def test_batch_norm_bad_input(xp):
    x = randn(xp, (2, 3, 4), 0)
    with pytest.raises(ValueError, match=r"x: expected a 2 or 3-d array \(N, C\) or \(B, T, C\)"):
        batch_norm_forward(randn(xp, (4,), 0))
    with pytest.raises(ValueError, match=r"weight: expected shape \(4,\)"):
        batch_norm_forward(x, randn(xp, (3,), 1))
    with pytest.raises(ValueError, match=r"padding_mask: expected shape \(2, 3\)"):
        batch_norm_forward(x, padding_mask=xp.zeros((2, 4), dtype=bool))
    with pytest.raises(TypeError, match="padding_mask: expected a bool array"):
        batch_norm_forward(x, padding_mask=xp.zeros((2, 3)))
    with pytest.raises(ValueError, match=r"running mean: expected shape \(4,\)"):
        batch_norm_forward(x, running=RunningStats(xp.zeros(3), xp.ones(4)))
    with pytest.raises(TypeError, match="running: expected RunningStats"):
        batch_norm_forward(x, running=xp.zeros(4))
    with pytest.raises(ValueError, match="eval mode normalises with the running statistics"):
        batch_norm_forward(x, training=False)
    with pytest.raises(ValueError, match="eps: expected a finite number > 0"):
        batch_norm_forward(x, eps=0.0)
    with pytest.raises(ValueError, match="eps: expected a number that stays > 0 in float32, .* got 1e-50, which "
                                         "float32 rounds to 0"):   # a constant feature's xhat would be NaN
        batch_norm_forward(x.astype(xp.float32), eps=1e-50)
    y, _, _ = batch_norm_forward(xp.full((4, 2), 3.0), eps=1e-50)   # float64 keeps it: xhat = 0
    assert not host(y).any()
    with pytest.raises(ValueError, match=r"momentum: expected a probability in \[0, 1\]"):
        batch_norm_forward(x, momentum=1.5)
    with pytest.raises(TypeError, match="dtype mismatch"):
        batch_norm_forward(x, xp.ones(4, dtype=xp.float32))
    with pytest.raises(TypeError, match="x: expected a floating-point array"):
        batch_norm_forward(xp.ones((2, 4), dtype=xp.int32))


def test_zero_features_give_empty_results(xp):
    """A layer of 0 features (x (..., 0)) is well defined: empty y and gradients of the right shapes,
    in training and in eval, where ``reshape(-1, 0)`` raised NumPy's ambiguity error."""
    x = xp.ones((4, 3, 0))
    running = RunningStats(xp.zeros(0), xp.ones(0))
    for training in (True, False):
        y, _, cache = batch_norm_forward(x, xp.ones(0), xp.zeros(0), running, training=training)
        dx, dw, db = batch_norm_backward(xp.ones((4, 3, 0)), cache)
        assert (y.shape, dx.shape, dw.shape, db.shape) == ((4, 3, 0), (4, 3, 0), (0,), (0,))
