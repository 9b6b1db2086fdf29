"""linear_cross_entropy: gradcheck over hypothesis shapes, chunks, masks and reductions; the unfused
ops' numbers (bit for bit in one chunk); float16 as mixed precision computes it, with no float32 copy
of the logits; the chunk's size; the memory it saves; torch; bad input."""
import json

import numpy as np
import pytest
from hypothesis import given, strategies as st

from benchmarks.head_memory import main as head_memory_main, peak_bytes
from npformer.backend import get_array_module
from npformer.errors import InputTypeError, RangeError, ShapeError
from npformer.ops import linear_cross_entropy as lce_module
from npformer.ops.cross_entropy import cross_entropy_backward, cross_entropy_forward
from npformer.ops.linear import linear_backward, linear_forward
from npformer.ops.linear_cross_entropy import chunk_rows_for, linear_cross_entropy
from npformer.tools.gradcheck import check_gradients
from tests.helpers import NO_TORCH, assert_gradcheck, host, randn, seeds

IGNORE = -100


def unfused(x, w, t, b=None, dloss=1.0, reduction="mean", smoothing=0.0):
    """The same step by the separate ops: logits, cross-entropy in the accumulation dtype, backward."""
    xp = get_array_module(x)
    z, lin = linear_forward(x, w, b)
    acc = xp.float32 if x.dtype == xp.float16 else x.dtype
    loss, ce = cross_entropy_forward(z.astype(acc), t, reduction=reduction, label_smoothing=smoothing)
    dz = cross_entropy_backward(xp.asarray(dloss, dtype=acc), ce).astype(x.dtype)
    return (loss,) + linear_backward(dz, lin)


@st.composite
def cases(draw):
    """Lead shape (B, T) or (N,), C, V, targets with hypothesis-chosen ignored positions, chunk rows."""
    lead = (draw(st.integers(1, 3)), draw(st.integers(1, 5))) if draw(st.booleans()) else (draw(st.integers(1, 7)),)
    c, v = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    n = int(np.prod(lead))
    t = draw(st.lists(st.integers(0, v - 1), min_size=n, max_size=n))
    ignored = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    t = np.where(ignored, IGNORE, t).astype(np.int64).reshape(lead)
    return lead, c, v, t, draw(st.integers(1, n + 1))


@given(case=cases(), bias=st.booleans(), reduction=st.sampled_from(["mean", "sum"]),
       smoothing=st.sampled_from([0.0, 0.1]), seed=seeds)
def test_gradcheck_over_shapes_chunks_and_ignored_targets(xp, case, bias, reduction, smoothing, seed):
    """The gradients it returns for a random ``dloss`` are those of ``dloss * loss`` by finite differences."""
    lead, c, v, t_h, chunk = case
    arrays = {"x": randn(xp, lead + (c,), seed), "weight": randn(xp, (v, c), seed + 1)}
    if bias:
        arrays["bias"] = randn(xp, (v,), seed + 2)
    t = xp.asarray(t_h)
    dloss = randn(xp, (), seed + 3)
    kw = dict(reduction=reduction, label_smoothing=smoothing, chunk_rows=chunk)

    def run():
        return linear_cross_entropy(arrays["x"], arrays["weight"], t, arrays.get("bias"), **kw).loss

    got = linear_cross_entropy(arrays["x"], arrays["weight"], t, arrays.get("bias"), dloss=dloss, **kw)
    analytic = {"x": got.dx, "weight": got.dweight, "bias": got.dbias}
    assert_gradcheck(check_gradients(run, arrays, analytic, dloss, seed=seed, label="linear_cross_entropy"))
    assert got.loss.shape == () and got.loss.dtype == xp.float64
    np.testing.assert_array_equal(host(got.valid), t_h != IGNORE)


@given(case=cases(), bias=st.booleans(), reduction=st.sampled_from(["mean", "sum"]), seed=seeds)
def test_chunks_give_the_unfused_numbers(xp, case, bias, reduction, seed):
    """Any chunking: the unfused ops' loss and gradients to float64 rounding; one chunk: bit for bit."""
    lead, c, v, t_h, chunk = case
    x, w, t = randn(xp, lead + (c,), seed), randn(xp, (v, c), seed + 1), xp.asarray(t_h)
    b = randn(xp, (v,), seed + 2) if bias else None
    want = unfused(x, w, t, b, dloss=0.75, reduction=reduction)
    got = linear_cross_entropy(x, w, t, b, dloss=0.75, reduction=reduction, chunk_rows=chunk)
    for g, r in zip(got[:4], want):
        assert (g is None) == (r is None)
        if g is not None:
            np.testing.assert_allclose(host(g), host(r), rtol=1e-13, atol=1e-15)
    whole = linear_cross_entropy(x, w, t, b, dloss=0.75, reduction=reduction)       # one chunk (default)
    for g, r in zip(whole[:4], want):
        if g is not None:
            np.testing.assert_array_equal(host(g), host(r))


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_low_precision_as_the_unfused_mixed_step(xp, dtype):
    """16-bit x: logits rounded to float32 for the loss, the loss scale as dloss, dz back in float16; the
    loss is float32. One chunk: the unfused recipe bit for bit; five: within a few roundings of it (dW
    summed in float32 first, then rounded once)."""
    x, w = randn(xp, (6, 7, 16), 0, dtype=dtype), randn(xp, (33, 16), 1, dtype=dtype, scale=0.3)
    t = xp.asarray(np.random.default_rng(2).integers(0, 33, (6, 7)))
    scale = xp.asarray(1024.0, dtype=xp.float32)
    want = unfused(x, w, t, dloss=scale)
    got = linear_cross_entropy(x, w, t, dloss=scale)
    assert got.loss.dtype == xp.float32 and got.dx.dtype == x.dtype and got.dweight.dtype == x.dtype
    for g, r in zip(got[:3], want[:3]):
        np.testing.assert_array_equal(host(g), host(r))
    chunked = linear_cross_entropy(x, w, t, dloss=scale, chunk_rows=9)
    np.testing.assert_allclose(host(chunked.loss), host(want[0]), rtol=1e-6)
    for g, r in zip(chunked[1:3], want[1:3]):          # (a product of fewer rows may round otherwise)
        r = host(r).astype(np.float64)
        ulp = float(np.finfo(dtype).eps) * float(abs(r).max())
        np.testing.assert_allclose(host(g).astype(np.float64), r, rtol=0, atol=4 * ulp)


def test_a_chunk_hands_its_16bit_logits_to_the_loss_uncopied(monkeypatch):
    """No float32 copy of a chunk's logits: the cross-entropy reads them as the head wrote them and
    returns their gradient in float16 (``loss_dtype``: its loss in float32)."""
    x, w = randn(np, (6, 8), 0, dtype="float16"), randn(np, (40, 8), 1, dtype="float16")
    t = np.arange(6) % 40
    seen = []
    real = lce_module.cross_entropy_forward

    def spy(z, *args, **kwargs):
        loss, cache = real(z, *args, **kwargs)
        seen.append((z.dtype, loss.dtype, cache.logits is z))
        return loss, cache
    monkeypatch.setattr(lce_module, "cross_entropy_forward", spy)
    got = linear_cross_entropy(x, w, t, chunk_rows=4)
    assert seen == [(np.float16, np.float32, True)] * 2
    assert got.loss.dtype == np.float32 and got.dx.dtype == got.dweight.dtype == np.float16


def test_all_ignored_gives_zero_loss_and_zero_gradients(xp):
    x, w = randn(xp, (3, 4), 0), randn(xp, (5, 4), 1)
    t = xp.full((3,), IGNORE, dtype=xp.int64)
    for chunk in (1, 2, None):
        got = linear_cross_entropy(x, w, t, randn(xp, (5,), 2), chunk_rows=chunk)
        assert float(got.loss) == 0.0
        assert not host(got.dx).any() and not host(got.dweight).any() and not host(got.dbias).any()


def test_chunk_rows_keep_a_chunks_logits_within_the_budget():
    assert chunk_rows_for(8192, 50257, 4) == 1171          # GPT-2's step: 7 chunks of 1171 rows
    assert chunk_rows_for(4096, 65, 4) == 4096             # a character model: one chunk
    assert chunk_rows_for(10, 10 ** 9, 4) == 1             # at least one row
    for n, v, size in [(8192, 50257, 4), (1000, 3000, 8), (7, 5, 2)]:
        rows = chunk_rows_for(n, v, size, budget=1 << 20)
        assert rows * v * size <= 1 << 20 or rows == 1
        chunks = -(-n // rows)
        assert (chunks - 1) * rows < n <= chunks * rows     # evenly: no near-empty last chunk
        assert rows - (n - (chunks - 1) * rows) < chunks


def test_the_default_chunk_follows_the_budget(monkeypatch):
    """A smaller budget makes more chunks, as a budget of 96 bytes does here (2 rows of 6 float64
    logits): the numbers of the unfused ops still."""
    x, w = randn(np, (5, 3), 0), randn(np, (6, 3), 1)
    t = np.array([0, 5, IGNORE, 2, 1])
    calls = []
    real = lce_module.linear_forward
    monkeypatch.setattr(lce_module, "linear_forward", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    monkeypatch.setattr(lce_module, "LOGITS_CHUNK_BYTES", 96)
    got = linear_cross_entropy(x, w, t)
    assert calls == [2, 2, 1]
    for g, r in zip(got[:3], unfused(x, w, t)):
        np.testing.assert_allclose(g, r, rtol=1e-13, atol=1e-15)


def test_memory_stays_near_one_chunks_logits():
    """NumPy reports its allocations to tracemalloc: the unfused step holds the (N, V) logits and
    their gradient (8 MiB each here); in chunks of 128 rows the peak is a few chunks' logits (0.5 MiB
    each: the logits, the gradient, the kernels' temporaries) beside dx and dW."""
    n, c, v = 2048, 32, 1024
    x, w = randn(np, (n, c), 0, dtype="float32"), randn(np, (v, c), 1, dtype="float32")
    t = np.random.default_rng(2).integers(0, v, n)
    logits_bytes = n * v * 4

    whole = peak_bytes(lambda: unfused(x, w, t))
    chunked = peak_bytes(lambda: linear_cross_entropy(x, w, t, chunk_rows=128))
    assert whole >= 2 * logits_bytes
    chunk_bytes, grads_bytes = 128 * v * 4, (n * c + v * c) * 4     # a chunk's logits; dx and dW
    assert chunked <= 4 * chunk_bytes + 2 * grads_bytes < logits_bytes / 2, (chunked, whole)


def test_the_head_memory_benchmark_runs_and_reports_both_ways(tmp_path, capsys):
    out = tmp_path / "head.json"
    assert head_memory_main(["--rows", "64", "--vocab", "300", "--d", "8", "--repeats", "1",
                             "--chunk-bytes", "4096", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "chunks of 3 rows (22 chunks)" in printed and "dW: largest difference" in printed
    report = json.loads(out.read_text())
    assert report["chunk_rows"] == 3 and report["unfused"]["peak_mib"] > report["chunked"]["peak_mib"] > 0
    assert lce_module.LOGITS_CHUNK_BYTES == 1 << 28          # (--chunk-bytes changes no default)


def test_matches_torch_linear_and_cross_entropy(xp):
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    x_h, w_h, b_h = (host(randn(xp, s, i)) for i, s in enumerate([(4, 5, 8), (11, 8), (11,)]))
    t_h = np.random.default_rng(3).integers(0, 11, (4, 5))
    t_h[1, 2] = t_h[3, 0] = IGNORE
    for reduction in ("mean", "sum"):
        for s in (0.0, 0.2):
            tx, tw, tb = (torch.tensor(a, requires_grad=True) for a in (x_h, w_h, b_h))
            z = torch.nn.functional.linear(tx, tw, tb)
            tl = torch.nn.functional.cross_entropy(z.reshape(-1, 11), torch.tensor(t_h.reshape(-1)),
                                                   reduction=reduction, label_smoothing=s)
            (2.5 * tl).backward()
            got = linear_cross_entropy(xp.asarray(x_h), xp.asarray(w_h), xp.asarray(t_h), xp.asarray(b_h),
                                       dloss=2.5, reduction=reduction, label_smoothing=s, chunk_rows=3)
            np.testing.assert_allclose(host(got.loss), tl.item(), rtol=1e-13)
            for g, r in zip(got[1:4], (tx, tw, tb)):
                np.testing.assert_allclose(host(g), r.grad.numpy(), rtol=1e-12, atol=1e-15)


def test_bad_input_is_named(xp):
    x, w, t = randn(xp, (2, 3, 4), 0), randn(xp, (5, 4), 1), xp.zeros((2, 3), dtype=xp.int64)
    with pytest.raises(ShapeError, match="targets: expected shape \\(2, 3\\)"):
        linear_cross_entropy(x, w, t[:, :2])
    with pytest.raises(ShapeError, match="C_in=3 .* got shape \\(2, 3, 4\\)"):
        linear_cross_entropy(x, randn(xp, (5, 3), 1), t)
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(x, w, t, reduction="none")
    with pytest.raises(RangeError, match="chunk_rows"):
        linear_cross_entropy(x, w, t, chunk_rows=0)
    with pytest.raises(RangeError, match="class ids must be in \\[0, 5\\)"):
        linear_cross_entropy(x, w, xp.full((2, 3), 5, dtype=xp.int64), chunk_rows=2)
    with pytest.raises(TypeError, match="targets"):
        linear_cross_entropy(x, w, xp.zeros((2, 3)))


def test_dloss_must_be_a_finite_number_or_a_0d_float_array(xp):
    """dloss None became a NaN array (every gradient NaN, silently) and "a" a bare ValueError. A 0-d
    float array is taken as it is, on its device, unread (a loss scale there)."""
    x, w, t = randn(xp, (2, 4), 0), randn(xp, (5, 4), 1), xp.zeros((2,), dtype=xp.int64)
    for bad in (None, "a", True, [1.0]):
        with pytest.raises(InputTypeError, match="dloss: expected a real number or a 0-d float array, got"):
            linear_cross_entropy(x, w, t, dloss=bad)
    for bad in (float("nan"), float("inf")):
        with pytest.raises(RangeError, match="dloss: expected a finite number, got"):
            linear_cross_entropy(x, w, t, dloss=bad)
    with pytest.raises(ShapeError, match="dloss: expected a number or a 0-d array .* shape \\(1,\\)"):
        linear_cross_entropy(x, w, t, dloss=xp.ones((1,)))
    with pytest.raises(InputTypeError, match="dloss: expected a floating-point array"):
        linear_cross_entropy(x, w, t, dloss=xp.asarray(2))
    want = linear_cross_entropy(x, w, t, dloss=2.0)
    for good in (2, np.float64(2.0), xp.asarray(2.0)):
        np.testing.assert_array_equal(host(linear_cross_entropy(x, w, t, dloss=good).dx), host(want.dx))
