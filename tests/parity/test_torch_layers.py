"""Parity with PyTorch: the same weights, inputs and upstream gradient through torch.nn's
batch-first modules and npformer's, comparing outputs, input gradients and every parameter
gradient. Float64: max abs difference < 1e-10; float32: max abs difference < 1e-5 of the reference's
largest magnitude. Hypothesis chooses sizes, options and masks. Weights go both ways: torch's
state_dict loads into npformer, and npformer's exported arrays load strictly into torch. Where the
two differ on purpose (a query with every key masked; cross-entropy with every target ignored) a
test shows the difference. Skipped (with the reason) when torch is absent."""
import warnings

import numpy as np
import pytest
from hypothesis import given, strategies as st

torch = pytest.importorskip("torch", reason="torch not installed: the PyTorch parity tests need it "
                                            "(pip install torch==2.13.0)")

from npformer import nn  # noqa: E402
from npformer.interop import from_arrays, to_numpy_state_dict  # noqa: E402
from npformer.ops.cross_entropy import cross_entropy_backward, cross_entropy_forward  # noqa: E402
from tests.helpers import seeds  # noqa: E402

ATOL64, RTOL32 = 1e-10, 1e-5
pytestmark = [pytest.mark.torch, pytest.mark.filterwarnings("ignore:Support for mismatched"),
              pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")]


@pytest.fixture(autouse=True, scope="module")
def _float64_modules():
    """torch modules built here are float64; restore the default for the rest of the session."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


def _t(a, grad=False):
    return None if a is None else torch.tensor(np.asarray(a), requires_grad=grad)


def _rand(rng, *shape):
    return rng.standard_normal(shape)


def _close(ours, theirs, name, dtype=np.float64):
    theirs = theirs.detach().numpy() if isinstance(theirs, torch.Tensor) else np.asarray(theirs)
    assert ours.dtype == dtype, f"{name}: dtype {ours.dtype}, expected {dtype}"
    if dtype == np.float64:
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=ATOL64, err_msg=name)
    else:    # float32: relative to the tensor's scale (a zero-mean gradient entry has no scale of its own)
        err, scale = np.abs(ours - theirs).max(initial=0), np.abs(theirs).max(initial=0)
        assert err <= RTOL32 * scale, f"{name}: max abs diff {err:.3g} > {RTOL32} x max |ref| {scale:.3g}"


def _compare_params(ours, theirs, dtype=np.float64):
    tg = {k: p.grad for k, p in theirs.named_parameters()}
    names = [name for name, _ in ours.named_parameters()]
    assert sorted(names) == sorted(tg), "npformer's and torch's parameter names differ"
    for name, p in ours.named_parameters():
        _close(p.grad, tg[name], name, dtype)


def _copy(theirs, ours):
    return ours.to(dtype="float64").load_state_dict(theirs.state_dict())   # same names, no renaming


@st.composite
def masks(draw, b, tq, tk, kind, heads=1, padding=True):
    """(attn_mask or None, key_padding_mask or None) of the kind asked for, with no query left
    without a key: a bool mask keeps key ``free[q]`` open for query q in every batch row."""
    pad_kind = draw(st.sampled_from(["none", "bool", "float"])) if padding else "none"
    rng = np.random.default_rng(draw(seeds))
    free = rng.integers(0, tk, tq)
    attn = None
    if kind == "causal":                                 # top-left: key 0 is visible to every query
        attn, free = np.triu(np.ones((tq, tk), bool), 1), np.zeros(tq, int)
    elif kind == "bool":
        attn = rng.random((tq, tk)) < 0.4
        attn[np.arange(tq), free] = False
    elif kind == "float":
        attn = rng.standard_normal((tq, tk))
    elif kind == "float_per_head":                       # (B*H, Tq, Tk), row b*H + h, as torch
        attn = rng.standard_normal((b * heads, tq, tk))
    pad = None
    if pad_kind == "bool":
        pad = rng.random((b, tk)) < 0.4
        pad[:, free] = False
    elif pad_kind == "float":
        pad = rng.standard_normal((b, tk))
    return attn, pad


mask_kinds = st.sampled_from(["none", "causal", "bool", "float"])
dims = st.sampled_from([(4, 1), (4, 2), (6, 3), (8, 2)])
layer_opts = st.fixed_dictionaries({"norm_first": st.booleans(), "activation": st.sampled_from(["relu", "gelu"]),
                                    "bias": st.booleans()})


# -- MultiheadAttention ------------------------------------------------------------------------------

@given(b=st.integers(1, 3), tq=st.integers(1, 6), tk=st.integers(1, 6), dims=dims, bias=st.booleans(),
       sharing=st.sampled_from(["self", "self_general", "kv", "none"]), kind=st.sampled_from(["none", "causal", "bool", "float",
                                                                              "float_per_head"]),
       average=st.booleans(), seed=seeds, data=st.data())
def test_multihead_attention(b, tq, tk, dims, bias, sharing, kind, average, seed, data):
    e, h = dims
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    theirs = torch.nn.MultiheadAttention(e, h, bias=bias, batch_first=True)
    ours = _copy(theirs, nn.MultiheadAttention(e, h, bias=bias))
    self_attention = sharing in ("self", "self_general")
    tk = tq if self_attention else tk
    attn, pad = data.draw(masks(b, tq, tk, kind, heads=h))
    q = _rand(rng, b, tq, e)
    k = q if self_attention else _rand(rng, b, tk, e)
    v = k if sharing != "none" else _rand(rng, b, tk, e)
    dout = _rand(rng, b, tq, e)
    options = dict(key_padding_mask=pad, attn_mask=attn, average_attn_weights=average, is_causal=kind == "causal")
    # "self": the packed self-attention call ours(x); "self_general": ours(x, x, x), three gradients summed
    out, w = ours(q, **options) if sharing == "self" else ours(q, k, v, **options)
    dq, dk, dv = ours.backward(dout)
    if sharing == "self_general":
        dq, dk, dv = dq + dk + dv, None, None
    elif sharing == "kv":
        dk, dv = dk + dv, None
    tq_ = _t(q, True)
    tk_ = tq_ if self_attention else _t(k, True)
    tv_ = tk_ if sharing != "none" else _t(v, True)
    tout, tw = theirs(tq_, tk_, tv_, key_padding_mask=_t(pad), attn_mask=_t(attn),
                      average_attn_weights=average, is_causal=kind == "causal")
    tout.backward(_t(dout))
    _close(out, tout, "out")
    _close(w, tw, "weights")
    _close(dq, tq_.grad, "dquery")
    if not self_attention:
        _close(dk, tk_.grad, "dkey")
    if sharing == "none":
        _close(dv, tv_.grad, "dvalue")
    _compare_params(ours, theirs)


# -- layers --------------------------------------------------------------------------------------

@given(b=st.integers(1, 3), t=st.integers(1, 6), dims=dims, opts=layer_opts, kind=mask_kinds,
       seed=seeds, data=st.data())
def test_encoder_layer(b, t, dims, opts, kind, seed, data):
    d, h = dims
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    theirs = torch.nn.TransformerEncoderLayer(d, h, 7, dropout=0.0, batch_first=True, **opts)
    ours = _copy(theirs, nn.TransformerEncoderLayer(d, h, 7, dropout=0.0, **opts))
    mask, pad = data.draw(masks(b, t, t, kind))
    causal = kind == "causal"                  # torch takes is_causal as a hint beside the mask
    x, dout = _rand(rng, b, t, d), _rand(rng, b, t, d)
    out = ours(x, src_mask=mask, src_key_padding_mask=pad, is_causal=causal)
    dx = ours.backward(dout)
    tx = _t(x, True)
    tout = theirs(tx, src_mask=_t(mask), src_key_padding_mask=_t(pad), is_causal=causal)
    tout.backward(_t(dout))
    _close(out, tout, "out")
    _close(dx, tx.grad, "dsrc")
    _compare_params(ours, theirs)


@given(b=st.integers(1, 3), t=st.integers(1, 5), s=st.integers(1, 6), dims=dims, opts=layer_opts,
       tgt_kind=mask_kinds, mem_kind=st.sampled_from(["none", "bool", "float"]), seed=seeds, data=st.data())
def test_decoder_layer_cross_attention(b, t, s, dims, opts, tgt_kind, mem_kind, seed, data):
    d, h = dims
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    theirs = torch.nn.TransformerDecoderLayer(d, h, 7, dropout=0.0, batch_first=True, **opts)
    ours = _copy(theirs, nn.TransformerDecoderLayer(d, h, 7, dropout=0.0, **opts))
    tgt_mask, tgt_pad = data.draw(masks(b, t, t, tgt_kind))
    mem_mask, mem_pad = data.draw(masks(b, t, s, mem_kind))          # Tq = t != Tk = s
    causal = tgt_kind == "causal"
    x, mem, dout = _rand(rng, b, t, d), _rand(rng, b, s, d), _rand(rng, b, t, d)
    kw = dict(tgt_mask=tgt_mask, memory_mask=mem_mask, tgt_key_padding_mask=tgt_pad,
              memory_key_padding_mask=mem_pad, tgt_is_causal=causal)
    out = ours(x, mem, **kw)
    dx, dmem = ours.backward(dout)
    tx, tmem = _t(x, True), _t(mem, True)
    tout = theirs(tx, tmem, **{k: v if isinstance(v, bool) else _t(v) for k, v in kw.items()})
    tout.backward(_t(dout))
    _close(out, tout, "out")
    _close(dx, tx.grad, "dtgt")
    _close(dmem, tmem.grad, "dmemory")
    _compare_params(ours, theirs)


# -- stacks and the whole Transformer ------------------------------------------------------------

@given(b=st.integers(1, 3), t=st.integers(1, 5), dims=dims, opts=layer_opts, layers=st.integers(1, 3),
       final_norm=st.booleans(), kind=mask_kinds, seed=seeds, data=st.data())
def test_encoder_stack(b, t, dims, opts, layers, final_norm, kind, seed, data):
    d, h = dims
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    theirs = torch.nn.TransformerEncoder(
        torch.nn.TransformerEncoderLayer(d, h, 7, dropout=0.0, batch_first=True, **opts), layers,
        torch.nn.LayerNorm(d, bias=opts["bias"]) if final_norm else None, enable_nested_tensor=False)
    with torch.no_grad():                        # the layers are deep copies: make them differ
        for p in theirs.parameters():
            p.add_(torch.randn(p.shape) * 0.3)
    ours = _copy(theirs, nn.TransformerEncoder(nn.TransformerEncoderLayer(d, h, 7, dropout=0.0, **opts), layers,
                                               nn.LayerNorm(d, bias=opts["bias"]) if final_norm else None))
    mask, pad = data.draw(masks(b, t, t, kind))
    x, dout = _rand(rng, b, t, d), _rand(rng, b, t, d)
    out = ours(x, mask=mask, src_key_padding_mask=pad, is_causal=kind == "causal")
    dx = ours.backward(dout)
    tx = _t(x, True)
    tout = theirs(tx, mask=_t(mask), src_key_padding_mask=_t(pad), is_causal=kind == "causal")
    tout.backward(_t(dout))
    _close(out, tout, "out")
    _close(dx, tx.grad, "dsrc")
    _compare_params(ours, theirs)


@given(b=st.integers(1, 3), t=st.integers(1, 5), s=st.integers(1, 5), dims=dims, opts=layer_opts,
       layers=st.integers(1, 3), final_norm=st.booleans(), seed=seeds, data=st.data())
def test_decoder_stack(b, t, s, dims, opts, layers, final_norm, seed, data):
    d, h = dims
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    theirs = torch.nn.TransformerDecoder(
        torch.nn.TransformerDecoderLayer(d, h, 7, dropout=0.0, batch_first=True, **opts), layers,
        torch.nn.LayerNorm(d, bias=opts["bias"]) if final_norm else None)
    with torch.no_grad():                        # the layers are deep copies: make them differ
        for p in theirs.parameters():
            p.add_(torch.randn(p.shape) * 0.3)
    ours = _copy(theirs, nn.TransformerDecoder(nn.TransformerDecoderLayer(d, h, 7, dropout=0.0, **opts), layers,
                                               nn.LayerNorm(d, bias=opts["bias"]) if final_norm else None))
    tgt_mask, tgt_pad = data.draw(masks(b, t, t, "causal"))
    _, mem_pad = data.draw(masks(b, t, s, "none"))
    x, mem, dout = _rand(rng, b, t, d), _rand(rng, b, s, d), _rand(rng, b, t, d)
    kw = dict(tgt_mask=tgt_mask, tgt_key_padding_mask=tgt_pad, memory_key_padding_mask=mem_pad)
    out = ours(x, mem, tgt_is_causal=True, **kw)
    dx, dmem = ours.backward(dout)
    tx, tmem = _t(x, True), _t(mem, True)
    tout = theirs(tx, tmem, tgt_is_causal=True, **{k: _t(v) for k, v in kw.items()})
    tout.backward(_t(dout))
    _close(out, tout, "out")
    _close(dx, tx.grad, "dtgt")
    _close(dmem, tmem.grad, "dmemory (summed over the layers)")
    _compare_params(ours, theirs)


@given(b=st.integers(1, 3), s=st.integers(1, 5), t=st.integers(1, 5), dims=dims, opts=layer_opts,
       enc_layers=st.integers(1, 2), dec_layers=st.integers(1, 2), seed=seeds, data=st.data())
def test_full_transformer(b, s, t, dims, opts, enc_layers, dec_layers, seed, data):
    d, h = dims
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # torch: nested tensors off when norm_first
        theirs = torch.nn.Transformer(d, h, enc_layers, dec_layers, 9, dropout=0.0, batch_first=True, **opts)
    ours = _copy(theirs, nn.Transformer(d, h, enc_layers, dec_layers, 9, dropout=0.0, **opts))
    _, src_pad = data.draw(masks(b, s, s, "none"))
    tgt_mask, tgt_pad = data.draw(masks(b, t, t, "causal"))
    src, tgt, dout = _rand(rng, b, s, d), _rand(rng, b, t, d), _rand(rng, b, t, d)
    kw = dict(tgt_mask=tgt_mask, src_key_padding_mask=src_pad, tgt_key_padding_mask=tgt_pad,
              memory_key_padding_mask=src_pad)
    out = ours(src, tgt, tgt_is_causal=True, **kw)
    dsrc, dtgt = ours.backward(dout)
    tsrc, ttgt = _t(src, True), _t(tgt, True)
    tout = theirs(tsrc, ttgt, tgt_is_causal=True, **{k: _t(v) for k, v in kw.items()})
    tout.backward(_t(dout))
    _close(out, tout, "out")
    _close(dsrc, tsrc.grad, "dsrc")
    _close(dtgt, ttgt.grad, "dtgt")
    _compare_params(ours, theirs)


# -- the loss ------------------------------------------------------------------------------------

@given(b=st.integers(1, 3), t=st.integers(1, 5), v=st.integers(2, 9), ignore_index=st.sampled_from([-100, 0]),
       smoothing=st.sampled_from([0.0, 0.1, 0.3]), reduction=st.sampled_from(["mean", "sum", "none"]),
       seed=seeds)
def test_cross_entropy_with_ignore_index_and_smoothing(b, t, v, ignore_index, smoothing, reduction, seed):
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    logits = rng.standard_normal((b, t, v)) * 3
    targets = rng.integers(0, v, size=(b, t))
    targets[rng.random((b, t)) < 0.3] = ignore_index
    targets[0, 0] = 1                                     # at least one target counts
    loss, cache = cross_entropy_forward(logits, targets, ignore_index=ignore_index, label_smoothing=smoothing,
                                        reduction=reduction)
    dloss = np.asarray(0.7) if reduction != "none" else rng.standard_normal((b, t))
    dlogits = cross_entropy_backward(dloss, cache)
    tl = _t(logits, True)
    tloss = torch.nn.functional.cross_entropy(tl.permute(0, 2, 1), _t(targets), ignore_index=ignore_index,
                                              label_smoothing=smoothing, reduction=reduction)
    tloss.backward(_t(dloss))
    _close(np.asarray(loss), tloss, "loss")
    _close(dlogits, tl.grad, "dlogits")


def test_cross_entropy_all_ignored_differs_from_pytorch_on_purpose():
    """Every target ignored: the mean over zero targets is 0/0. PyTorch returns NaN; npformer
    returns 0 with a zero gradient (docs/pages/gradient-checks.md, Conventions), so an all-padding batch
    is harmless."""
    logits = np.random.default_rng(0).standard_normal((2, 3, 5))
    targets = np.full((2, 3), -100)
    loss, cache = cross_entropy_forward(logits, targets, reduction="mean")
    tloss = torch.nn.functional.cross_entropy(_t(logits).permute(0, 2, 1), _t(targets), reduction="mean")
    assert np.isnan(tloss.item())
    assert float(loss) == 0.0 and not cross_entropy_backward(np.asarray(1.0), cache).any()


# -- float32, the same checks relative to scale, every module kind -------------------------------

def _build(kind, lib, **kw):
    """The module ``kind`` from ``torch.nn`` or ``npformer.nn``, the same shape of arguments."""
    tb = dict(batch_first=True) if lib is torch.nn else {}
    enc = lambda: lib.TransformerEncoderLayer(8, 2, 12, dropout=0.0, activation="gelu", **tb, **kw)  # noqa: E731
    dec = lambda: lib.TransformerDecoderLayer(8, 2, 12, dropout=0.0, norm_first=True, **tb, **kw)  # noqa: E731
    nested = dict(enable_nested_tensor=False) if lib is torch.nn else {}
    return {"MultiheadAttention": lambda: lib.MultiheadAttention(8, 2, **tb, **kw),
            "TransformerEncoderLayer": enc, "TransformerDecoderLayer": dec,
            "TransformerEncoder": lambda: lib.TransformerEncoder(enc(), 2, lib.LayerNorm(8), **nested),
            "TransformerDecoder": lambda: lib.TransformerDecoder(dec(), 2, lib.LayerNorm(8)),
            "Transformer": lambda: lib.Transformer(8, 2, 2, 1, 12, dropout=0.0, **tb, **kw)}[kind]()


def _inputs_and_masks(rng, dtype):
    x, mem = rng.standard_normal((2, 4, 8)).astype(dtype), rng.standard_normal((2, 5, 8)).astype(dtype)
    pad = np.zeros((2, 5), bool)
    pad[1, 3:] = True
    return x, mem, pad, np.triu(np.ones((4, 4), bool), 1)


def _forward(kind, module, x, mem, pad, causal):
    """One call of ``module`` on (x, mem) with padding on the memory and a causal mask on x; the
    same code drives torch tensors and npformer arrays."""
    if kind == "MultiheadAttention":
        return module(x, mem, mem, key_padding_mask=pad)[0]
    if kind in ("TransformerEncoderLayer", "TransformerEncoder"):
        arg = "src_mask" if kind.endswith("Layer") else "mask"
        return module(x, **{arg: causal}, is_causal=True)
    if kind in ("TransformerDecoderLayer", "TransformerDecoder"):
        return module(x, mem, tgt_mask=causal, memory_key_padding_mask=pad, tgt_is_causal=True)
    return module(mem, x, tgt_mask=causal, src_key_padding_mask=pad, memory_key_padding_mask=pad,
                  tgt_is_causal=True)


def _input_grads(kind, grads):
    """npformer's backward result as [d x, d mem] (mem's gradient is None where it is not an input)."""
    if kind == "MultiheadAttention":
        return [grads[0], grads[1] + grads[2]]           # mem was key and value: the sum
    if kind in ("TransformerEncoderLayer", "TransformerEncoder"):
        return [grads, None]
    if kind == "Transformer":
        return [grads[1], grads[0]]                      # (dsrc, dtgt); x is tgt, mem is src
    return list(grads)


KINDS = ["MultiheadAttention", "TransformerEncoderLayer", "TransformerDecoderLayer", "TransformerEncoder",
         "TransformerDecoder", "Transformer"]


def _check_both_ways(kind, ours, theirs, dtype):
    rng = np.random.default_rng(KINDS.index(kind))
    torch.manual_seed(KINDS.index(kind))
    x, mem, pad, causal = _inputs_and_masks(rng, dtype)
    dout = rng.standard_normal((2, 4, 8)).astype(dtype)
    out = _forward(kind, ours, x, mem, pad, causal)
    dx, dmem = _input_grads(kind, ours.backward(dout))
    tx, tmem = torch.tensor(x, requires_grad=True), torch.tensor(mem, requires_grad=True)
    tout = _forward(kind, theirs, tx, tmem, _t(pad), _t(causal))
    tout.backward(torch.tensor(dout))
    _close(out, tout, "out", dtype)
    _close(dx, tx.grad, "dx", dtype)
    if dmem is not None:
        _close(dmem, tmem.grad, "dmemory", dtype)
    _compare_params(ours, theirs, dtype)


@pytest.mark.parametrize("kind", KINDS)
def test_float32_parity_relative(kind):
    """Float32 output, input gradients and every parameter gradient: max abs diff < 1e-5 x the
    reference's largest magnitude."""
    torch.manual_seed(0)
    theirs = _build(kind, torch.nn).float()
    ours = _build(kind, nn).load_state_dict(from_arrays(theirs.state_dict()))
    _check_both_ways(kind, ours, theirs, np.float32)


@pytest.mark.parametrize("kind", KINDS)
def test_export_to_pytorch_every_module_kind(kind):
    """npformer's own weights (its initialisation, shifted so no bias or gain is trivially 0 or 1),
    exported as host arrays, load strictly into the torch module; both then agree in forward and
    backward (float64), and torch's state_dict loads back into npformer unchanged."""
    ours = _build(kind, nn, rng=7).to(dtype="float64")
    for i, p in enumerate(ours.parameters()):
        p.data = p.data + 0.1 * np.random.default_rng(i).standard_normal(p.shape)
    theirs = _build(kind, torch.nn)
    theirs.load_state_dict({k: torch.from_numpy(v) for k, v in to_numpy_state_dict(ours).items()}, strict=True)
    back = _build(kind, nn).to(dtype="float64").load_state_dict(from_arrays(theirs.state_dict()))
    for (name, a), b in zip(ours.state_dict().items(), back.state_dict().values()):
        np.testing.assert_array_equal(a, b, err_msg=name)
    _check_both_ways(kind, ours, theirs, np.float64)


def test_half_precision_torch_state_dicts_convert():
    """from_arrays takes torch float16 and bfloat16 tensors (NumPy has no bfloat16: via float32)."""
    theirs = torch.nn.Linear(3, 2)
    for dt in (torch.float16, torch.bfloat16):
        host = from_arrays(theirs.to(dt).state_dict())
        assert host["weight"].dtype == (np.float16 if dt == torch.float16 else np.float32)
        np.testing.assert_array_equal(host["weight"], theirs.weight.detach().float().numpy())


# -- where npformer differs on purpose -------------------------------------------------------------

def test_fully_masked_row_differs_from_pytorch_on_purpose():
    """A query with every key masked: PyTorch gives NaN (0/0 in its softmax), npformer gives zero
    attention, so the output is the out-projection's bias and the gradients are finite
    (docs/pages/gradient-checks.md, Conventions: one empty row must not poison a batch). Every other row agrees."""
    torch.manual_seed(0)
    theirs = torch.nn.MultiheadAttention(4, 2, batch_first=True)
    ours = _copy(theirs, nn.MultiheadAttention(4, 2))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 4))
    mask = np.zeros((3, 3), bool)
    mask[1] = True                                       # query 1 may attend nothing
    pad = np.zeros((2, 3), bool)
    pad[1] = True                                        # batch row 1 is all padding
    out, _ = ours(x, attn_mask=mask, key_padding_mask=pad)                  # self-attention
    dx = ours.backward(rng.standard_normal((2, 3, 4)))[0]
    tx = _t(x, True)
    tout, _ = theirs(tx, tx, tx, attn_mask=_t(mask), key_padding_mask=_t(pad))
    tout.sum().backward()
    tout = tout.detach().numpy()
    assert np.isnan(tout[0, 1]).all() and np.isnan(tout[1]).all() and np.isnan(tx.grad.numpy()).any()
    assert np.isfinite(out).all() and np.isfinite(dx).all()
    for p in ours.parameters():
        assert np.isfinite(p.grad).all()
    np.testing.assert_allclose(out[0, 1], ours.out_proj.bias.data)  # zero attention -> only the bias
    np.testing.assert_allclose(out[1], np.broadcast_to(ours.out_proj.bias.data, (3, 4)))
    np.testing.assert_allclose(out[0, [0, 2]], tout[0, [0, 2]], rtol=0, atol=ATOL64)
