"""cross_entropy_forward / cross_entropy_backward: numpy references, gradcheck over all reductions
with smoothing and ignored targets, ignore_index invariants, mean = sum / count, all-ignored batch,
extreme and 16-bit logits (and their loss in float32, ``loss_dtype``), dtypes, views, torch oracle,
bad input."""
import importlib.util

import numpy as np
import pytest
from hypothesis import given, strategies as st

from npformer.errors import RangeError
from npformer.kernels import disabled
from npformer.ops.cross_entropy import cross_entropy_backward, cross_entropy_forward
from npformer.tools.gradcheck import gradcheck
from tests.helpers import NO_TORCH, assert_gradcheck, batch, host, randn, seeds, seq

IGNORE = -100


def reference_log_softmax(z):
    z = np.asarray(z, dtype=np.float64)
    m = z.max(axis=-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(axis=-1, keepdims=True))


def reference_losses(z, t, smoothing=0.0, ignore_index=IGNORE):
    """Per-position -sum_j q_j log p_j by an explicit loop; 0 at ignored positions."""
    logp, t = reference_log_softmax(z), np.asarray(t)
    v = logp.shape[-1]
    out = np.zeros(t.shape)
    for idx in np.ndindex(*t.shape):
        if t[idx] == ignore_index:
            continue
        q = np.full(v, smoothing / v)
        q[t[idx]] += 1.0 - smoothing
        out[idx] = -(q * logp[idx]).sum()
    return out


def reference_dlogits(z, t, dloss, reduction, smoothing=0.0, ignore_index=IGNORE):
    """(softmax - q) * dloss / N_valid per row, zero rows where ignored."""
    p = np.exp(reference_log_softmax(z))
    t, v = np.asarray(t), p.shape[-1]
    valid = t != ignore_index
    n = max(int(valid.sum()), 1) if reduction == "mean" else 1
    d = np.broadcast_to(np.asarray(dloss, dtype=np.float64), t.shape)
    g = np.zeros(p.shape)
    for idx in np.ndindex(*t.shape):
        if valid[idx]:
            q = np.full(v, smoothing / v)
            q[t[idx]] += 1.0 - smoothing
            g[idx] = (p[idx] - q) * d[idx] / n
    return g


@st.composite
def ce_cases(draw):
    """Lead shape (B, T) or (N,), V, targets with hypothesis-chosen ignored positions."""
    lead = (draw(batch), draw(seq)) if draw(st.booleans()) else (draw(st.integers(1, 7)),)
    v = draw(st.integers(1, 6))
    n = int(np.prod(lead))
    t = draw(st.lists(st.integers(0, v - 1), min_size=n, max_size=n))
    ignored = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    t = np.where(ignored, IGNORE, t).astype(np.int64).reshape(lead)
    return lead, v, t


@given(case=ce_cases(), reduction=st.sampled_from(["mean", "sum", "none"]),
       smoothing=st.sampled_from([0.0, 0.1]) | st.floats(0.0, 1.0), seed=seeds,
       scale=st.sampled_from([0.5, 3.0]))
def test_cross_entropy_gradcheck_and_references(xp, case, reduction, smoothing, seed, scale):
    lead, v, t_h = case
    z, t = randn(xp, lead + (v,), seed, scale=scale), xp.asarray(t_h)
    kw = {"reduction": reduction, "label_smoothing": smoothing}
    loss, cache = cross_entropy_forward(z, t, **kw)
    per = reference_losses(host(z), t_h, smoothing)
    n_valid = int((t_h != IGNORE).sum())
    want = {"none": per, "sum": per.sum(), "mean": per.sum() / max(n_valid, 1)}[reduction]
    assert loss.shape == (lead if reduction == "none" else ())
    np.testing.assert_allclose(host(loss), want, rtol=1e-12, atol=1e-13)
    dloss = randn(xp, loss.shape, seed + 1)
    np.testing.assert_allclose(host(cross_entropy_backward(dloss, cache)),
                               reference_dlogits(host(z), t_h, host(dloss), reduction, smoothing),
                               rtol=1e-12, atol=1e-14)

    def forward(logits, targets):                        # first output: the loss (0-d for mean/sum)
        return cross_entropy_forward(logits, targets, **kw)

    report = gradcheck(forward, cross_entropy_backward, {"logits": z, "targets": t}, seed=seed)
    assert_gradcheck(report)


@given(case=ce_cases(), seed=seeds)
def test_no_smoothing_is_minus_log_softmax_at_target(xp, case, seed):
    lead, v, t_h = case
    z = randn(xp, lead + (v,), seed, scale=2.0)
    loss, _ = cross_entropy_forward(z, xp.asarray(t_h), reduction="none")
    logp = reference_log_softmax(host(z))
    for idx in np.ndindex(*lead):
        want = 0.0 if t_h[idx] == IGNORE else -logp[idx + (t_h[idx],)]
        assert float(host(loss)[idx]) == pytest.approx(want, rel=1e-12, abs=1e-13)


@given(case=ce_cases(), smoothing=st.sampled_from([0.0, 0.2]), seed=seeds)
def test_mean_is_sum_over_count_and_rows_sum_to_zero(xp, case, smoothing, seed):
    lead, v, t_h = case
    z, t = randn(xp, lead + (v,), seed), xp.asarray(t_h)
    mean, cm = cross_entropy_forward(z, t, label_smoothing=smoothing)
    total, cs = cross_entropy_forward(z, t, reduction="sum", label_smoothing=smoothing)
    count = int((t_h != IGNORE).sum())
    assert float(mean) == pytest.approx(float(total) / max(count, 1), rel=1e-13, abs=1e-15)
    one = xp.ones((), dtype=z.dtype)
    g_mean, g_sum = host(cross_entropy_backward(one, cm)), host(cross_entropy_backward(one, cs))
    np.testing.assert_allclose(g_mean * max(count, 1), g_sum, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(g_sum.sum(axis=-1), 0.0, atol=1e-14)   # sum(p) = sum(q) = 1


def test_ignored_positions_change_nothing(xp):
    """Changing the logits of ignored positions changes neither the loss nor any other gradient."""
    t_h = np.array([[1, IGNORE, 3], [IGNORE, 0, 2]])
    z = host(randn(xp, (2, 3, 4), 0))
    z2 = z.copy()
    z2[0, 1], z2[1, 0] = [50.0, -7.0, 3.0, 1e4], [-1e4, 0.0, 2.0, 9.0]
    t = xp.asarray(t_h)
    for reduction in ("mean", "sum", "none"):
        for s in (0.0, 0.3):
            l1, c1 = cross_entropy_forward(xp.asarray(z), t, reduction=reduction, label_smoothing=s)
            l2, c2 = cross_entropy_forward(xp.asarray(z2), t, reduction=reduction, label_smoothing=s)
            np.testing.assert_array_equal(host(l1), host(l2))
            dloss = randn(xp, l1.shape, 1)
            g1, g2 = host(cross_entropy_backward(dloss, c1)), host(cross_entropy_backward(dloss, c2))
            np.testing.assert_array_equal(g1, g2)
            assert not g1[0, 1].any() and not g1[1, 0].any()
            if reduction == "none":
                assert host(l1)[0, 1] == 0 and host(l1)[1, 0] == 0


def test_all_ignored_mean_gives_zero_not_nan(xp):
    """Deliberate difference: torch returns nan here; npformer returns 0 and a zero gradient."""
    z, t = randn(xp, (2, 3, 5), 0), xp.full((2, 3), IGNORE, dtype=xp.int64)
    for reduction in ("mean", "sum"):
        loss, cache = cross_entropy_forward(z, t, reduction=reduction, label_smoothing=0.1)
        assert loss.shape == () and float(loss) == 0.0
        assert xp.array_equal(cross_entropy_backward(xp.ones(()), cache), xp.zeros_like(z))


def test_matches_torch_and_documents_the_nan_difference(xp):
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    F = torch.nn.functional
    z_h = host(randn(xp, (3, 4, 6), 0, scale=2.0))
    t_h = np.random.default_rng(1).integers(0, 6, size=(3, 4))
    t_h[0, 1] = t_h[2, 3] = IGNORE
    for reduction in ("mean", "sum", "none"):
        for s in (0.0, 0.25):
            tz = torch.tensor(z_h.reshape(-1, 6), requires_grad=True)
            tl = F.cross_entropy(tz, torch.tensor(t_h.reshape(-1)), reduction=reduction, label_smoothing=s)
            loss, cache = cross_entropy_forward(xp.asarray(z_h), xp.asarray(t_h), reduction=reduction,
                                                label_smoothing=s)
            np.testing.assert_allclose(host(loss).reshape(-1), tl.detach().numpy().reshape(-1), rtol=1e-12)
            d = np.random.default_rng(2).standard_normal(host(loss).shape)
            tl.backward(torch.tensor(d.reshape(-1) if reduction == "none" else d))
            dz = host(cross_entropy_backward(xp.asarray(d), cache))
            np.testing.assert_allclose(dz.reshape(-1, 6), tz.grad.numpy(), rtol=1e-11, atol=1e-15)
    all_ignored = F.cross_entropy(torch.zeros(2, 3, dtype=torch.float64), torch.tensor([IGNORE, IGNORE]))
    assert torch.isnan(all_ignored)                      # torch: 0 / 0; npformer: 0 (tested above)


def test_ignore_index_may_be_a_class_and_targets_any_int_dtype(xp):
    z = randn(xp, (4, 3), 0)
    t_h = np.array([0, 2, 1, 2])
    loss, _ = cross_entropy_forward(z, xp.asarray(t_h), ignore_index=2, reduction="none")
    ref = reference_losses(host(z), t_h, ignore_index=2)
    np.testing.assert_allclose(host(loss), ref, rtol=1e-13)
    assert host(loss)[1] == 0 and host(loss)[3] == 0
    for dtype in ("uint8", "int16", "uint64"):
        loss, _ = cross_entropy_forward(z, xp.asarray(t_h.astype(dtype)), reduction="none")
        np.testing.assert_allclose(host(loss), reference_losses(host(z), t_h), rtol=1e-13)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_extreme_logits_are_finite(xp, dtype):
    """Logits of +-1e4: loss 2e4 (or 0) exactly as the math says, gradients finite, in every dtype."""
    z = xp.asarray(np.array([[1e4, -1e4, 0.0], [1e4, -1e4, -1e4], [-1e4, -1e4, -1e4]])).astype(dtype)
    t = xp.asarray(np.array([1, 0, 2]))
    for s in (0.0, 0.1):
        for reduction in ("mean", "sum", "none"):
            loss, cache = cross_entropy_forward(z, t, reduction=reduction, label_smoothing=s)
            assert loss.dtype == z.dtype and np.all(np.isfinite(host(loss)))
            dz = cross_entropy_backward(xp.ones(loss.shape, dtype=z.dtype), cache)
            assert dz.dtype == z.dtype and np.all(np.isfinite(host(dz)))
    loss, _ = cross_entropy_forward(z, t, reduction="none")
    np.testing.assert_allclose(host(loss).astype(np.float64), [2e4, 0.0, np.log(3)], rtol=1e-3)


def test_float16_mean_accumulates_in_float32(xp):
    """50,000 losses of log 4: the float16 sum would overflow (max 65504); the mean is log 4."""
    z = xp.zeros((50_000, 4), dtype=xp.float16)
    t = xp.asarray(np.arange(50_000) % 4)
    loss, cache = cross_entropy_forward(z, t)
    assert loss.dtype == xp.float16
    np.testing.assert_allclose(float(loss), np.log(4), rtol=1e-3)
    dz = cross_entropy_backward(xp.ones((), dtype=xp.float16), cache)
    assert dz.dtype == xp.float16 and np.all(np.isfinite(host(dz)))


# bfloat16 where ml_dtypes (an optional extra) is installed: importing it names numpy.dtype("bfloat16")
SIXTEEN_BIT = ["float16"] + (["bfloat16"] if importlib.util.find_spec("ml_dtypes") else [])
if "bfloat16" in SIXTEEN_BIT:
    importlib.import_module("ml_dtypes")


@given(case=ce_cases(), reduction=st.sampled_from(["mean", "sum", "none"]), smoothing=st.sampled_from([0.0, 0.1]),
       dtype=st.sampled_from(SIXTEEN_BIT), seed=seeds)
def test_float32_loss_of_16bit_logits_is_that_of_a_float32_copy(xp, case, reduction, smoothing, dtype, seed):
    """``loss_dtype=float32`` on 16-bit logits: the loss unrounded and dlogits rounded once to the logits'
    dtype, bit for bit what the op gives on a float32 copy (the mixed-precision recipe), with no copy:
    the cache holds the 16-bit logits themselves."""
    lead, v, t_h = case
    z = randn(xp, lead + (v,), seed, dtype, scale=3.0)
    t = xp.asarray(t_h)
    kw = dict(reduction=reduction, label_smoothing=smoothing)
    dloss = randn(xp, () if reduction != "none" else lead, seed + 1, "float32", scale=1024.0)
    with disabled():                                     # the reference on both (a fast path may take float32 only)
        loss, cache = cross_entropy_forward(z, t, loss_dtype=xp.float32, **kw)
        want, want_cache = cross_entropy_forward(z.astype(xp.float32), t, **kw)
        dz, want_dz = cross_entropy_backward(dloss, cache), cross_entropy_backward(dloss, want_cache)
    assert loss.dtype == xp.float32 and cache.logits is z and cache.loss_dtype == xp.float32
    np.testing.assert_array_equal(host(loss), host(want))
    assert dz.dtype == z.dtype
    np.testing.assert_array_equal(host(dz), host(want_dz.astype(z.dtype)))


def test_loss_dtype_is_the_logits_or_their_accumulation_dtype(xp):
    z, t = randn(xp, (3, 4), 0, "float16"), xp.asarray(np.array([0, 1, 3]))
    assert cross_entropy_forward(z, t, loss_dtype="float16")[0].dtype == xp.float16
    for dtype in ("float32", "float64"):                 # float32: the default for float32 logits
        loss, cache = cross_entropy_forward(z.astype(dtype), t, loss_dtype=dtype)
        assert loss.dtype == dtype and cache.loss_dtype == dtype
    for bad in ("float64", "int32", "not a dtype", 4):
        with pytest.raises(RangeError, match=r"loss_dtype: expected None, the logits' dtype float16 or their "
                                             r"accumulation dtype float32, got "):
            cross_entropy_forward(z, t, loss_dtype=bad)
    with pytest.raises(RangeError, match=r"accumulation dtype float32, got dtype\('float64'\)"):
        cross_entropy_forward(z.astype(xp.float32), t, loss_dtype=np.dtype("float64"))
    _, cache = cross_entropy_forward(z, t, loss_dtype="float32")
    with pytest.raises(TypeError, match=r"dloss: expected the dtype of the loss of reduction='mean', float32, "
                                        r"got .*float16"):
        cross_entropy_backward(xp.ones((), dtype=xp.float16), cache)


def test_float32_matches_float64_and_inputs_untouched(xp):
    z64 = randn(xp, (8, 50), 0, scale=4.0)
    z32 = z64.astype(xp.float32)
    t = xp.asarray(np.random.default_rng(1).integers(0, 50, size=8))
    before_z, before_t = z32.copy(), t.copy()
    l32, c32 = cross_entropy_forward(z32, t, label_smoothing=0.1)
    l64, c64 = cross_entropy_forward(z64, t, label_smoothing=0.1)
    dloss = xp.asarray(np.array(1.5, dtype=np.float32))
    d32 = cross_entropy_backward(dloss, c32)
    assert l32.dtype == xp.float32 and l32.shape == () and d32.dtype == xp.float32
    assert xp.array_equal(z32, before_z) and xp.array_equal(t, before_t)
    assert float(dloss) == 1.5
    np.testing.assert_allclose(float(l32), float(l64), rtol=1e-6)
    np.testing.assert_allclose(host(d32), host(cross_entropy_backward(xp.asarray(1.5), c64)),
                               rtol=1e-4, atol=1e-7)


def test_cache_holds_no_array_of_the_logits_size_of_its_own(xp):
    """Only the logits themselves (not a copy) and per-row normalisers: log p = (z - shift) - log_sum."""
    z = randn(xp, (2, 3, 5), 0)
    _, cache = cross_entropy_forward(z, xp.zeros((2, 3), dtype=xp.int64))
    big = [f for f in cache if hasattr(f, "shape") and f.shape == z.shape]
    assert len(big) == 1 and big[0] is z
    assert cache.shift.shape == cache.log_sum.shape == (2, 3, 1)
    np.testing.assert_allclose(host((z - cache.shift) - cache.log_sum), reference_log_softmax(host(z)), rtol=1e-13)


def test_non_contiguous_logits_and_targets(xp):
    z = randn(xp, (5, 4, 3), 0).transpose(2, 1, 0)      # (3, 4, 5) non-contiguous
    t_h = np.random.default_rng(1).integers(0, 5, size=(4, 3))
    t_h[1, 2] = IGNORE
    t = xp.asarray(t_h).T                                # (3, 4) transposed view
    dloss = randn(xp, (4, 3), 2).T                       # (3, 4) transposed view
    loss, cache = cross_entropy_forward(z, t, reduction="none", label_smoothing=0.1)
    np.testing.assert_allclose(host(loss), reference_losses(host(z), t_h.T, 0.1), rtol=1e-13)
    np.testing.assert_allclose(host(cross_entropy_backward(dloss, cache)),
                               reference_dlogits(host(z), t_h.T, host(dloss), "none", 0.1), rtol=1e-12)


def test_single_example_and_single_class(xp):
    z = randn(xp, (5,), 0)                               # logits (V,) with a 0-d target
    loss, cache = cross_entropy_forward(z, xp.asarray(np.array(3)))
    assert loss.shape == () and float(loss) == pytest.approx(-reference_log_softmax(host(z))[3])
    assert cross_entropy_backward(xp.ones(()), cache).shape == (5,)
    loss, cache = cross_entropy_forward(randn(xp, (4, 1), 1), xp.zeros(4, dtype=xp.int64))
    assert float(loss) == 0.0                            # one class: log p = 0
    assert not cross_entropy_backward(xp.ones(()), cache).any()


def test_bad_input(xp):
    z, t = randn(xp, (2, 3, 4), 0), xp.zeros((2, 3), dtype=xp.int64)
    with pytest.raises(TypeError, match="targets: expected an integer array"):
        cross_entropy_forward(z, t.astype(xp.float64))
    with pytest.raises(TypeError, match="logits: expected a floating-point array"):
        cross_entropy_forward(t, t)
    with pytest.raises(ValueError, match=r"targets: expected shape \(2, 3\).*got .*shape \(3, 2\)"):
        cross_entropy_forward(z, t.T)
    with pytest.raises(ValueError, match=r"targets: expected shape \(2, 3\).*got .*shape \(2, 3, 4\)"):
        cross_entropy_forward(z, xp.zeros((2, 3, 4), dtype=xp.int64))
    for bad in (4, -1, 7):
        t_bad = xp.asarray(np.array([[0, 1, bad], [0, 0, 0]]))
        with pytest.raises(ValueError, match=rf"in \[0, 4\) or ignore_index=-100, got {bad} \(V=4\)"):
            cross_entropy_forward(z, t_bad)
    for s in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"label_smoothing: expected a probability in \[0, 1\]"):
            cross_entropy_forward(z, t, label_smoothing=s)
    with pytest.raises(ValueError, match="reduction: expected one of .*, got 'batchmean'"):
        cross_entropy_forward(z, t, reduction="batchmean")
    with pytest.raises(ValueError, match=r"logits: expected rows \(\.\.\., V\) with at least one value each"):
        cross_entropy_forward(xp.zeros((2, 0)), xp.zeros(2, dtype=xp.int64))
    _, cache = cross_entropy_forward(z, t)
    with pytest.raises(ValueError, match=r"dloss: expected the shape of the loss of reduction='mean', \(\)"):
        cross_entropy_backward(xp.ones((2, 3)), cache)
    _, cache = cross_entropy_forward(z, t, reduction="none")
    with pytest.raises(ValueError, match=r"dloss: expected the shape of the loss of reduction='none', \(2, 3\)"):
        cross_entropy_backward(xp.ones(()), cache)
    with pytest.raises(TypeError, match="dloss: expected a numpy or cupy array"):
        cross_entropy_backward(1.0, cache)
