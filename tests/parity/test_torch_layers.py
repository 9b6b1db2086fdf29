"""Parity with PyTorch: the same weights, inputs and upstream gradient through torch.nn's
batch-first modules and npformer's, comparing outputs, input gradients and every parameter
gradient. Float64: max abs difference < 1e-10. Skipped (with the reason) when torch is absent."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

torch = pytest.importorskip("torch", reason="torch not installed: the PyTorch parity tests need it "
                                            "(pip install torch==2.13.0)")

from npformer import nn  # noqa: E402
from npformer.ops.cross_entropy import cross_entropy_backward, cross_entropy_forward  # noqa: E402
from tests.helpers import padding_masks, seeds  # noqa: E402

ATOL64 = 1e-10
pytestmark = pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask")


@pytest.fixture(autouse=True, scope="module")
def _float64_modules():
    """torch modules built here are float64; restore the default for the rest of the session."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


def _t(a, grad=False):
    return torch.tensor(np.asarray(a), requires_grad=grad)


def _rand(rng, *shape):
    return rng.standard_normal(shape)


def _compare_params(ours, theirs):
    tg = {k: p.grad for k, p in theirs.named_parameters()}
    for name, p in ours.named_parameters():
        assert name in tg, f"{name} has no PyTorch counterpart"
        np.testing.assert_allclose(p.grad, tg[name].numpy(), rtol=0, atol=ATOL64, err_msg=name)


def _copy(theirs, ours):
    return ours.to(dtype="float64").load_state_dict(theirs.state_dict())   # same names, no renaming


dims = st.sampled_from([(4, 1), (4, 2), (6, 3), (8, 2)])


@given(b=st.integers(1, 3), tq=st.integers(1, 6), tk=st.integers(1, 6), dims=dims, bias=st.booleans(),
       self_attn=st.booleans(), seed=seeds, data=st.data())
def test_multihead_attention(b, tq, tk, dims, bias, self_attn, seed, data):
    e, h = dims
    rng = np.random.default_rng(seed)
    theirs = torch.nn.MultiheadAttention(e, h, bias=bias, batch_first=True)
    ours = _copy(theirs, nn.MultiheadAttention(e, h, bias=bias))
    if self_attn:
        tk = tq
    pad = data.draw(padding_masks(b, tk))
    pad[:, 0] = False                                     # with the causal-like mask: no empty row
    use_float = data.draw(st.booleans())
    attn_mask = _rand(rng, tq, tk) if use_float else data.draw(
        st.just(np.triu(np.ones((tq, tk), bool), 1)))     # causal-like bool; no row fully masked
    q = _rand(rng, b, tq, e)
    kv = q if self_attn else _rand(rng, b, tk, e)
    dout = _rand(rng, b, tq, e)
    out, w = ours(q, kv, kv, key_padding_mask=pad, attn_mask=attn_mask)
    grads = ours.backward(dout)
    tq_, tkv = _t(q, True), (None if self_attn else _t(kv, True))
    tkv_ = tq_ if self_attn else tkv
    tout, tw = theirs(tq_, tkv_, tkv_, key_padding_mask=_t(pad), attn_mask=_t(attn_mask))
    tout.backward(_t(dout))
    np.testing.assert_allclose(out, tout.detach().numpy(), rtol=0, atol=ATOL64)
    np.testing.assert_allclose(w, tw.detach().numpy(), rtol=0, atol=ATOL64)
    np.testing.assert_allclose(grads[0], tq_.grad.numpy(), rtol=0, atol=ATOL64)
    if not self_attn:
        np.testing.assert_allclose(grads[1], tkv.grad.numpy(), rtol=0, atol=ATOL64)
    _compare_params(ours, theirs)


layer_opts = st.fixed_dictionaries({"norm_first": st.booleans(), "activation": st.sampled_from(["relu", "gelu"]),
                                    "bias": st.booleans()})


@given(b=st.integers(1, 3), t=st.integers(1, 6), dims=dims, opts=layer_opts, causal=st.booleans(),
       seed=seeds, data=st.data())
def test_encoder_layer(b, t, dims, opts, causal, seed, data):
    d, h = dims
    rng = np.random.default_rng(seed)
    theirs = torch.nn.TransformerEncoderLayer(d, h, 7, dropout=0.0, batch_first=True, **opts)
    ours = _copy(theirs, nn.TransformerEncoderLayer(d, h, 7, dropout=0.0, **opts))
    pad = data.draw(padding_masks(b, t))
    if causal:
        pad[:, 0] = False                                 # key 0 is visible to every causal row
    mask = np.triu(np.ones((t, t), bool), 1) if causal else None
    x, dout = _rand(rng, b, t, d), _rand(rng, b, t, d)
    out = ours(x, src_mask=mask, src_key_padding_mask=pad, is_causal=causal)
    dx = ours.backward(dout)
    tx = _t(x, True)
    tout = theirs(tx, src_mask=None if mask is None else _t(mask), src_key_padding_mask=_t(pad),
                  is_causal=causal)
    tout.backward(_t(dout))
    np.testing.assert_allclose(out, tout.detach().numpy(), rtol=0, atol=ATOL64)
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=0, atol=ATOL64)
    _compare_params(ours, theirs)


@given(b=st.integers(1, 3), t=st.integers(1, 5), s=st.integers(1, 6), dims=dims, opts=layer_opts,
       seed=seeds, data=st.data())
def test_decoder_layer_cross_attention(b, t, s, dims, opts, seed, data):
    d, h = dims
    rng = np.random.default_rng(seed)
    theirs = torch.nn.TransformerDecoderLayer(d, h, 7, dropout=0.0, batch_first=True, **opts)
    ours = _copy(theirs, nn.TransformerDecoderLayer(d, h, 7, dropout=0.0, **opts))
    mem_pad = data.draw(padding_masks(b, s))
    causal = np.triu(np.ones((t, t), bool), 1)
    x, mem, dout = _rand(rng, b, t, d), _rand(rng, b, s, d), _rand(rng, b, t, d)
    out = ours(x, mem, tgt_mask=causal, memory_key_padding_mask=mem_pad, tgt_is_causal=True)
    dx, dmem = ours.backward(dout)
    tx, tmem = _t(x, True), _t(mem, True)
    tout = theirs(tx, tmem, tgt_mask=_t(causal), memory_key_padding_mask=_t(mem_pad), tgt_is_causal=True)
    tout.backward(_t(dout))
    np.testing.assert_allclose(out, tout.detach().numpy(), rtol=0, atol=ATOL64)
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=0, atol=ATOL64)
    np.testing.assert_allclose(dmem, tmem.grad.numpy(), rtol=0, atol=ATOL64)
    _compare_params(ours, theirs)


@given(seed=seeds, norm_first=st.booleans(), layers=st.integers(1, 3))
def test_full_transformer(seed, norm_first, layers):
    rng = np.random.default_rng(seed)
    theirs = torch.nn.Transformer(8, 2, layers, layers, 16, dropout=0.0, batch_first=True,
                                  norm_first=norm_first)
    ours = _copy(theirs, nn.Transformer(8, 2, layers, layers, 16, dropout=0.0, norm_first=norm_first))
    src, tgt, dout = _rand(rng, 2, 5, 8), _rand(rng, 2, 4, 8), _rand(rng, 2, 4, 8)
    src_pad = np.zeros((2, 5), bool)
    src_pad[1, 3:] = True
    causal = np.triu(np.ones((4, 4), bool), 1)
    out = ours(src, tgt, tgt_mask=causal, src_key_padding_mask=src_pad, memory_key_padding_mask=src_pad)
    dsrc, dtgt = ours.backward(dout)
    tsrc, ttgt = _t(src, True), _t(tgt, True)
    tout = theirs(tsrc, ttgt, tgt_mask=_t(causal), src_key_padding_mask=_t(src_pad),
                  memory_key_padding_mask=_t(src_pad))
    tout.backward(_t(dout))
    np.testing.assert_allclose(out, tout.detach().numpy(), rtol=0, atol=ATOL64)
    np.testing.assert_allclose(dsrc, tsrc.grad.numpy(), rtol=0, atol=ATOL64)
    np.testing.assert_allclose(dtgt, ttgt.grad.numpy(), rtol=0, atol=ATOL64)
    _compare_params(ours, theirs)


@given(seed=seeds, smoothing=st.sampled_from([0.0, 0.1, 0.3]), reduction=st.sampled_from(["mean", "sum", "none"]))
def test_cross_entropy_with_ignore_index_and_smoothing(seed, smoothing, reduction):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((3, 4, 7)) * 3
    targets = rng.integers(0, 7, size=(3, 4))
    targets[0, 1] = targets[2, 3] = 0                     # ignored (pad id 0)
    loss, cache = cross_entropy_forward(logits, targets, ignore_index=0, label_smoothing=smoothing,
                                        reduction=reduction)
    dloss = np.asarray(0.7) if reduction != "none" else rng.standard_normal((3, 4))
    dlogits = cross_entropy_backward(dloss, cache)
    tl = _t(logits, True)
    tloss = torch.nn.functional.cross_entropy(tl.permute(0, 2, 1), _t(targets), ignore_index=0,
                                              label_smoothing=smoothing, reduction=reduction)
    tloss.backward(_t(dloss))
    np.testing.assert_allclose(loss, tloss.detach().numpy(), rtol=0, atol=ATOL64)
    np.testing.assert_allclose(dlogits, tl.grad.numpy(), rtol=0, atol=ATOL64)


def test_float32_parity_relative():
    """Float32: the same check with relative tolerance 1e-5."""
    rng = np.random.default_rng(0)
    theirs = torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True).float()
    ours = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0)
    ours.load_state_dict(theirs.state_dict())
    x = rng.standard_normal((2, 5, 16)).astype(np.float32)
    out = ours(x)
    tout = theirs(torch.tensor(x))
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, tout.detach().numpy(), rtol=1e-5, atol=1e-5)


def test_fully_masked_row_differs_from_pytorch_on_purpose():
    """A query with every key masked: PyTorch gives NaN, npformer gives zeros (documented)."""
    theirs = torch.nn.MultiheadAttention(4, 2, batch_first=True)
    ours = _copy(theirs, nn.MultiheadAttention(4, 2))
    x = np.random.default_rng(0).standard_normal((1, 3, 4))
    mask = np.zeros((3, 3), bool)
    mask[1] = True                                       # query 1 may attend nothing
    out, _ = ours(x, x, x, attn_mask=mask)
    tout, _ = theirs(_t(x), _t(x), _t(x), attn_mask=_t(mask))
    assert np.isnan(tout.detach().numpy()[0, 1]).all()
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[0, 1], ours.out_proj.bias.data)   # zero attention -> only the bias
    np.testing.assert_allclose(out[0, [0, 2]], tout.detach().numpy()[0, [0, 2]], atol=ATOL64)


def test_weights_round_trip_npformer_to_pytorch():
    """npformer's exported arrays load into PyTorch's Transformer, and both then agree."""
    from npformer.interop import from_arrays, to_numpy_state_dict
    ours = nn.Transformer(8, 2, 2, 1, 16, dropout=0.0, rng=3).to(dtype="float64")
    theirs = torch.nn.Transformer(8, 2, 2, 1, 16, dropout=0.0, batch_first=True)
    theirs.load_state_dict({k: torch.from_numpy(v) for k, v in to_numpy_state_dict(ours).items()})
    back = nn.Transformer(8, 2, 2, 1, 16, dropout=0.0).to(dtype="float64")
    back.load_state_dict(from_arrays(theirs.state_dict()))
    rng = np.random.default_rng(0)
    src, tgt = rng.standard_normal((2, 5, 8)), rng.standard_normal((2, 3, 8))
    np.testing.assert_allclose(ours(src, tgt), theirs(_t(src), _t(tgt)).detach().numpy(), rtol=0, atol=ATOL64)
    np.testing.assert_array_equal(back(src, tgt), ours(src, tgt))
