"""Transformer-XL: whole-model gradient checks (float64, dropout with a fixed seed) with and without
memory, the stop-gradient into the memory, segment-by-segment evaluation equal to one forward over
the concatenation, the memory's contents and every bad input."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from npformer.models.decoding import eval_mode
from npformer.models.transformer_xl import TransformerXL, TransformerXLConfig
from npformer.ops.cross_entropy import cross_entropy_backward, cross_entropy_forward
from npformer.tools.gradcheck import gradcheck_module
from tests.helpers import assert_gradcheck, given_per_backend, host, model_check, randn, seeds

V = 7


def _model(xp, seed, **kw):
    cfg = dict(vocab_size=V, n_layer=2, n_head=2, d_model=8, dim_feedforward=12, dropout=0.0)
    return TransformerXL(TransformerXLConfig(**{**cfg, **kw}), dtype="float64", backend=xp.__name__, rng=seed)


def _ids(xp, shape, seed):
    return xp.asarray(np.random.default_rng(seed).integers(0, V, size=shape))


def _snapshot(model):
    """Every array held in every module's saved caches, copied, by (module, entry, path)."""
    from npformer.tools.gradcheck import _array_fields
    return {(name, i, path): host(a).copy() for name, m in model.named_modules()
            for i, entry in enumerate(m._saved) for path, a in _array_fields(entry).items()}


@given_per_backend(seed=seeds, m=st.integers(0, 3), t=st.integers(1, 4), n_layer=st.integers(1, 2),
                   tie=st.booleans(), activation=st.sampled_from(["gelu", "relu"]))
def test_gradcheck_with_and_without_memory_and_dropout(xp, seed, m, t, n_layer, tie, activation):
    model = _model(xp, seed, n_layer=n_layer, tie_embeddings=tie, dropout=0.1, activation=activation, mem_len=3)
    for name, p in model.named_parameters():            # u and v at unit scale: a dropped term would show
        if name.endswith(("r_w_bias", "r_r_bias")):
            p.data = randn(xp, p.shape, seed + len(name))
    mems = None if m == 0 else [randn(xp, (2, m, 8), seed + 10 + i) for i in range(n_layer)]
    idx, targets = _ids(xp, (2, t), seed), _ids(xp, (2, t), seed + 1)
    saved = {}

    def forward(model, idx):
        logits, new_mems = model(idx, mems)
        assert new_mems[0].shape == (2, min(m + t, 3), 8)
        loss, saved["ce"] = cross_entropy_forward(logits, targets)
        return loss

    def backward(model, dloss):
        assert model.backward(cross_entropy_backward(dloss, saved["ce"])) is None
        return ()
    report = gradcheck_module(model, {"idx": idx}, forward=forward, backward=backward, dropout_seed=seed,
                              seed=seed, **model_check(xp, 5))
    assert_gradcheck(report)


@given(seed=seeds, n_layer=st.integers(1, 3), seg=st.integers(1, 4), n_seg=st.integers(2, 4))
def test_segments_with_memory_equal_one_forward_over_the_concatenation(xp, seed, n_layer, seg, n_seg):
    """With a memory that covers everything before it, each segment attends to exactly the positions
    (and distances) the long forward lets it attend: the recurrence reproduces the long forward."""
    model = _model(xp, seed, n_layer=n_layer, mem_len=seg * n_seg)
    idx = _ids(xp, (2, seg * n_seg), seed)
    with eval_mode(model):
        full, _ = model(idx)
        parts, mems = [], None
        for s in range(0, seg * n_seg, seg):
            logits, mems = model(idx[:, s:s + seg], mems)
            parts.append(logits)
        short, _ = model(idx[:, -seg:], None)                                  # no memory: differs
    np.testing.assert_allclose(host(xp.concatenate(parts, axis=1)), host(full), rtol=0, atol=1e-12)
    assert mems[0].shape == (2, seg * n_seg, 8)
    assert not np.allclose(host(short), host(full)[:, -seg:], atol=1e-6)


def test_a_memory_of_one_segment_reaches_one_segment_per_layer_back(xp):
    """mem_len = T: segment 2 still equals the long forward (its memory holds all of segment 1), while
    segment 3 does not (segment 1 fell out of the memory)."""
    model = _model(xp, 0, mem_len=4)
    idx = _ids(xp, (2, 12), 1)
    with eval_mode(model):
        full, _ = model(idx)
        s1, mems = model(idx[:, :4])
        s2, mems = model(idx[:, 4:8], mems)
        s3, mems = model(idx[:, 8:], mems)
        longer, _ = model(idx[:, 8:], None)
    np.testing.assert_allclose(host(s2), host(full)[:, 4:8], rtol=0, atol=1e-12)
    assert not np.allclose(host(s3), host(full)[:, 8:], atol=1e-6)
    assert not np.allclose(host(s3), host(longer), atol=1e-6)                  # but the memory is used


def test_no_gradient_flows_into_the_memory(xp):
    """Backward of segment 2 leaves segment 1's caches and its memory as they were: segment 1's own
    backward afterwards gives exactly the gradients it gives alone."""
    model = _model(xp, 0, mem_len=4, dropout=0.0)
    x1, y1, x2, y2 = (_ids(xp, (2, 4), s) for s in range(4))

    def step(x, y, mems=None):
        logits, new = model(x, mems)
        _, ce = cross_entropy_forward(logits, y)
        return new, ce

    mems, ce1 = step(x1, y1)
    kept = [host(m).copy() for m in mems]
    before = _snapshot(model)
    _, ce2 = step(x2, y2, mems)
    model.backward(cross_entropy_backward(xp.ones(()), ce2))
    assert _snapshot(model).keys() == before.keys()                        # segment 1's caches, untouched
    assert all(np.array_equal(a, _snapshot(model)[k]) for k, a in before.items())
    assert all(np.array_equal(host(m), k) for m, k in zip(mems, kept))
    model.zero_grad()
    model.backward(cross_entropy_backward(xp.ones(()), ce1))               # segment 1's backward still runs
    after = {k: host(g).copy() for k, g in model.grads().items()}
    model.zero_grad()
    _, ce = step(x1, y1)                                                     # segment 1 on its own
    model.backward(cross_entropy_backward(xp.ones(()), ce))
    for k, g in model.grads().items():
        np.testing.assert_array_equal(host(g), after[k])
    assert sum(len(m._saved) for m in model.modules()) == 0


def test_memory_holds_the_last_mem_len_inputs_of_each_layer_as_fresh_copies(xp):
    model = _model(xp, 0, mem_len=6)
    idx = _ids(xp, (2, 4), 1)
    with eval_mode(model):
        _, mems = model(idx)
        assert [m.shape for m in mems] == [(2, 4, 8)] * 2                       # fewer than mem_len so far
        emb = host(model.wte.weight.data)[host(idx)] * np.sqrt(8)               # layer 0's input
        np.testing.assert_allclose(host(mems[0]), emb, rtol=0, atol=1e-12)
        _, mems2 = model(idx, mems)
        assert [m.shape for m in mems2] == [(2, 6, 8)] * 2
        np.testing.assert_array_equal(host(mems2[0])[:, :2], host(mems[0])[:, 2:])
        _, longer = model(idx, mems2, mem_len=10)                               # a longer memory at evaluation
        assert longer[0].shape == (2, 10, 8)
        assert model(idx, mems2, mem_len=0)[1] is None
    logits, fresh = model(idx)                                                  # with caches kept
    before = _snapshot(model)
    for m in fresh:
        m[...] = 0                                                              # writing to the memory
    assert all(np.array_equal(a, _snapshot(model)[k]) for k, a in before.items())   # touches no cache
    model.clear_saved()


def test_float32_in_float32_out(xp):
    cfg = TransformerXLConfig(vocab_size=V, n_layer=1, n_head=2, d_model=8, mem_len=4)
    model = TransformerXL(cfg, backend=xp.__name__, rng=0)
    logits, mems = model(_ids(xp, (2, 3), 0))
    assert logits.dtype == xp.float32 and mems[0].dtype == xp.float32
    logits, _ = model(_ids(xp, (2, 3), 1), mems)
    model.backward(xp.ones_like(logits))
    assert all(g.dtype == xp.float32 for g in model.grads().values())


def test_bad_input(xp):
    model = _model(xp, 0, mem_len=2)
    idx = _ids(xp, (2, 3), 0)
    mem = randn(xp, (2, 2, 8), 0)
    with pytest.raises(TypeError, match=r"idx: expected an integer array"):
        model(xp.zeros((2, 3)))
    with pytest.raises(ValueError, match="at least one token"):
        model(idx[:, :0])
    with pytest.raises(ValueError, match="mems: expected None or a list of 2 arrays"):
        model(idx, [mem])
    with pytest.raises(ValueError, match=r"mems\[1\]: expected shape \(B, M, C\)=\(2, 2, 8\)"):
        model(idx, [mem, mem[:, :1]])
    with pytest.raises(ValueError, match=r"mems\[0\]: expected shape \(B, M, C\)=\(2, 2, 8\)"):
        model(idx, [mem[:1], mem[:1]])
    with pytest.raises(ValueError, match=r"mems\[0\]: expected a 3-d array \(B, M, C\)"):
        model(idx, [mem[0], mem])
    with pytest.raises(TypeError, match=r"mems\[0\]: expected the model's dtype float64"):
        model(idx, [mem.astype(xp.float32)] * 2)
    with pytest.raises(ValueError, match="mem_len: expected an int >= 0"):
        model(idx, mem_len=-1)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 7\)"):
        model(idx + 7)
    with pytest.raises(ValueError, match="d_model 10 is not divisible by n_head 4"):
        TransformerXLConfig(vocab_size=5, d_model=10, n_head=4)
    with pytest.raises(ValueError, match="mem_len: expected an int >= 0"):
        TransformerXLConfig(vocab_size=5, mem_len=-2)
    model.clear_saved()
