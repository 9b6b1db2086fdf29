"""One-pass cross-entropy against the reference op: loss, row normalisers and dlogits for every
reduction, label smoothing and ignore_index, masked (-inf) classes, extreme logits; either backward on
either cache; 16-bit logits with a float32 loss; float64 gradchecks through the kernels; what it
allocates; bad targets."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from npformer.kernels import cuda, disabled
from npformer.kernels.cuda import runtime
from npformer.ops.cross_entropy import cross_entropy_backward, cross_entropy_forward
from npformer.tools.gradcheck import gradcheck
from tests.helpers import assert_gradcheck, host, randn, seeds
from tests.kernels.cuda.conftest import DTYPES, assert_close

IGNORE = -100
smoothings = st.sampled_from([0.0, 0.1]) | st.floats(0.0, 1.0)


@st.composite
def cases(draw):
    """(lead, V, targets) with hypothesis-chosen ignored positions; V up to 2 x 256 + 1 per thread."""
    lead = draw(st.lists(st.integers(1, 4), min_size=0, max_size=2).map(tuple))
    v = draw(st.sampled_from([1, 2, 5, 33, 257, 1000]))
    n = int(np.prod(lead))
    t = np.array(draw(st.lists(st.integers(0, v - 1), min_size=n, max_size=n)), dtype=np.int64)
    ignored = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=bool)
    return lead, v, np.where(ignored, IGNORE, t).reshape(lead)


def _compare(fx, z, t_h, dtype, reduction, smoothing, seed):
    t = fx.xp.asarray(t_h)
    kw = dict(reduction=reduction, label_smoothing=smoothing)
    with disabled():
        loss_ref, c_ref = cross_entropy_forward(z, t, **kw)
    loss, cache = cuda.cross_entropy_forward(z, t, **kw)
    rows = max(1, int(np.prod(t_h.shape)))
    zmax = float(np.abs(host(z).astype(np.float64))[np.isfinite(host(z))].max(initial=1.0))
    loss_scale = max(1.0, 2 * zmax + np.log(z.shape[-1])) * (rows if reduction == "sum" else 1)
    assert_close(loss, loss_ref, dtype, scale=loss_scale, what="loss")
    acc = str(c_ref.shift.dtype)
    assert_close(cache.shift, c_ref.shift, acc, what="shift")
    assert_close(cache.log_sum, c_ref.log_sum, acc, scale=max(1.0, np.log(z.shape[-1])), what="log_sum")
    assert cache.smoothing == c_ref.smoothing and cache.logits is z
    dloss = randn(fx.xp, loss.shape, seed + 1, dtype)
    with disabled():
        dz_ref = cross_entropy_backward(dloss, c_ref)
        plain_on_fused = cross_entropy_backward(dloss, cache)
    scale = max(1.0, 2 * float(np.abs(host(dloss).astype(np.float64)).max()))   # |p - q| <= 1 (x 2 for rounding)
    for label, dz in (("fused", cuda.cross_entropy_backward(dloss, cache)),
                      ("plain backward on the fused cache", plain_on_fused),
                      ("fused backward on the plain cache", cuda.cross_entropy_backward(dloss, c_ref))):
        assert_close(dz, dz_ref, dtype, scale=scale, what=f"{label}: dlogits")


@given(case=cases(), reduction=st.sampled_from(["mean", "sum", "none"]), smoothing=smoothings,
       dtype=st.sampled_from(DTYPES), seed=seeds, scale=st.sampled_from([0.5, 4.0]))
def test_matches_the_reference(fx, case, reduction, smoothing, dtype, seed, scale):
    lead, v, t_h = case
    _compare(fx, randn(fx.xp, lead + (v,), seed, dtype, scale=scale), t_h, dtype, reduction, smoothing, seed)


@given(case=cases(), smoothing=st.sampled_from([0.0, 0.1]), dtype=st.sampled_from(DTYPES), seed=seeds)
def test_masked_classes_and_rows(fx, case, smoothing, dtype, seed):
    """-inf logits (classes masked out), never at a valid target; a wholly masked row when ignored."""
    lead, v, t_h = case
    z = host(randn(fx.xp, lead + (v,), seed, dtype, scale=3.0)).copy()
    masked = np.random.default_rng(seed).random(z.shape) < 0.4
    flat_t, flat_z, flat_m = t_h.reshape(-1), z.reshape(-1, v), masked.reshape(-1, v)
    for r in range(flat_t.size):
        if flat_t[r] == IGNORE:
            flat_m[r] = r % 2 == 0 or flat_m[r]          # some ignored rows wholly masked
        else:
            flat_m[r, flat_t[r]] = False
    flat_z[flat_m] = -np.inf
    _compare(fx, fx.xp.asarray(z), t_h, dtype, "mean", smoothing, seed)


@given(case=cases(), reduction=st.sampled_from(["mean", "sum", "none"]), smoothing=st.sampled_from([0.0, 0.1]),
       dtype=st.sampled_from([d for d in DTYPES if d in ("float16", "bfloat16")]), seed=seeds)
def test_float32_loss_of_16bit_logits_reads_them_as_they_are(fx, case, reduction, smoothing, dtype, seed):
    """``loss_dtype=float32``: the kernels read the 16-bit logits and write the 16-bit gradient, and give
    bit for bit what they give on a float32 copy (its gradient then rounded), the mixed-precision recipe
    of the reference op."""
    lead, v, t_h = case
    z, t = randn(fx.xp, lead + (v,), seed, dtype, scale=3.0), fx.xp.asarray(t_h)
    kw = dict(reduction=reduction, label_smoothing=smoothing)
    loss, cache = cuda.cross_entropy_forward(z, t, loss_dtype="float32", **kw)
    want, want_cache = cuda.cross_entropy_forward(z.astype("float32"), t, **kw)
    assert loss.dtype == "float32" and cache.logits is z
    for got, ref in ((loss, want), (cache.shift, want_cache.shift), (cache.log_sum, want_cache.log_sum)):
        np.testing.assert_array_equal(host(got), host(ref))
    dloss = randn(fx.xp, loss.shape, seed + 1, "float32", scale=1024.0)
    dz = cuda.cross_entropy_backward(dloss, cache)
    assert dz.dtype == dtype
    np.testing.assert_array_equal(host(dz), host(cuda.cross_entropy_backward(dloss, want_cache).astype(dtype)))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_extreme_logits_stay_exact(fx, dtype):
    """Huge logits: the row's max is subtracted before the log-sum, as in the reference."""
    big = {"float32": 1e30, "float64": 1e300}[dtype]
    z = fx.xp.asarray(np.array([[big, big, -big, 0.0], [big, 1.0, 2.0, 3.0], [-big, 1.0, 2.0, 3.0]], dtype=dtype))
    t = fx.xp.asarray(np.array([0, 1, 3]))
    for s in (0.0, 0.2):
        with disabled():
            ref, _ = cross_entropy_forward(z, t, reduction="none", label_smoothing=s)
        got, _ = cuda.cross_entropy_forward(z, t, reduction="none", label_smoothing=s)
        np.testing.assert_allclose(host(got), host(ref), rtol=1e-6)   # row 0: log 2, from the two equal maxima
        assert abs(float(host(got)[0]) - (1 - s) * np.log(2)) < 1e-5 or s


@given(lead=st.tuples(st.integers(1, 3), st.integers(1, 3)), v=st.integers(1, 6),
       reduction=st.sampled_from(["mean", "sum", "none"]), smoothing=st.sampled_from([0.0, 0.3]), seed=seeds)
def test_gradcheck_float64(fx, lead, v, reduction, smoothing, seed):
    t_h = np.random.default_rng(seed).integers(0, v, lead)
    t_h.reshape(-1)[::3] = IGNORE

    def forward(logits, targets):
        return cuda.cross_entropy_forward(logits, targets, reduction=reduction, label_smoothing=smoothing)

    inputs = {"logits": randn(fx.xp, lead + (v,), seed, scale=2.0), "targets": fx.xp.asarray(t_h)}
    assert_gradcheck(gradcheck(forward, cuda.cross_entropy_backward, inputs, seed=seed))


def test_only_the_gradient_is_of_the_logits_size(fx, monkeypatch):
    """Forward makes nothing of (N, V); backward makes exactly dlogits (no softmax, no one-hot)."""
    z = randn(fx.xp, (6, 50), 0, "float32")
    t = fx.xp.asarray(np.arange(6) % 50)
    made = []
    xp = fx.xp

    class Recording:
        def __getattr__(self, name):
            attr = getattr(xp, name)
            if name in ("empty", "zeros", "ones", "empty_like", "zeros_like", "ascontiguousarray", "where", "exp"):
                def call(*args, **kwargs):
                    out = attr(*args, **kwargs)
                    made.append(tuple(out.shape))
                    return out
                return call
            return attr
    monkeypatch.setattr(runtime, "array_module", lambda: Recording())
    loss, cache = cuda.cross_entropy_forward(z, t, label_smoothing=0.1)
    assert (6, 50) not in made
    made.clear()
    dz = cuda.cross_entropy_backward(xp.ones((), "float32"), cache)
    assert made.count((6, 50)) == 1 and dz.shape == (6, 50)


@pytest.mark.parametrize("dtype", DTYPES)
def test_many_rows_and_float16_mean(fx, dtype):
    z = fx.xp.zeros((5000, 4), dtype=dtype)
    t = fx.xp.asarray(np.arange(5000) % 4)
    loss, cache = cuda.cross_entropy_forward(z, t)
    # the mean in float32, rounded once to the dtype: within its eps (float16 2^-10 ~ 1e-3, bfloat16 2^-8)
    np.testing.assert_allclose(float(loss), np.log(4), rtol=2.0 ** -8 if dtype == "bfloat16" else 1e-3)
    dz = cuda.cross_entropy_backward(fx.xp.ones((), dtype=dtype), cache)
    assert dz.dtype == dtype and np.isfinite(host(dz)).all()


def test_bad_input_is_refused(fx):
    z, t = randn(fx.xp, (2, 3, 4), 0), fx.xp.zeros((2, 3), dtype=np.int64)
    with pytest.raises(ValueError, match=r"in \[0, 4\) or ignore_index=-100, got 7 \(V=4\)"):
        cuda.cross_entropy_forward(z, fx.xp.asarray(np.array([[0, 1, 7], [0, 0, 0]])))
    with pytest.raises(ValueError, match=r"targets: expected shape \(2, 3\)"):
        cuda.cross_entropy_forward(z, t.T)
    with pytest.raises(ValueError, match="reduction: expected one of"):
        cuda.cross_entropy_forward(z, t, reduction="avg")
    _, cache = cuda.cross_entropy_forward(z, t)
    with pytest.raises(ValueError, match=r"dloss: expected the shape of the loss of reduction='mean', \(\)"):
        cuda.cross_entropy_backward(fx.xp.ones((2, 3)), cache)
