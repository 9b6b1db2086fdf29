"""``ConfigurableEncoderLayer``: float64 gradchecks over every switch (pre/post norm, residual or not,
activation, bias, dropout with a fixed seed, causal, padding), exact agreement with
``TransformerEncoderLayer`` when the residuals are on, and bad arguments."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from npformer.nn import TransformerEncoderLayer
from npformer.nn.experimental import ConfigurableEncoderLayer
from npformer.tools.gradcheck import gradcheck_module
from tests.helpers import assert_gradcheck, host, padding_masks, randn, seeds

options = st.fixed_dictionaries({
    "norm_first": st.booleans(), "residual": st.booleans(), "activation": st.sampled_from(["relu", "gelu"]),
    "bias": st.booleans(), "dropout": st.sampled_from([0.0, 0.2])})
dims = st.sampled_from([(4, 1), (4, 2), (6, 3)])          # (d_model, nhead)


@given(b=st.integers(1, 2), t=st.integers(1, 5), dims=dims, opts=options, causal=st.booleans(),
       seed=seeds, data=st.data())
def test_gradcheck(xp, b, t, dims, opts, causal, seed, data):
    d, h = dims
    layer = ConfigurableEncoderLayer(d, h, dim_feedforward=5, rng=seed, backend=xp.__name__,
                                     **opts).to(dtype="float64")
    pad = xp.asarray(data.draw(padding_masks(b, t)))
    report = gradcheck_module(
        layer, {"src": randn(xp, (b, t, d), seed)},
        forward=lambda m, src: m(src, src_key_padding_mask=pad, is_causal=causal),
        dropout_seed=seed, seed=seed)
    assert_gradcheck(report)


@given(norm_first=st.booleans(), dropout=st.sampled_from([0.0, 0.3]), seed=seeds)
def test_with_residuals_it_is_the_transformer_encoder_layer(xp, norm_first, dropout, seed):
    ref = TransformerEncoderLayer(6, 2, dim_feedforward=7, dropout=dropout, norm_first=norm_first, rng=seed,
                                  backend=xp.__name__).to(dtype="float64")
    ours = ConfigurableEncoderLayer(6, 2, dim_feedforward=7, dropout=dropout, norm_first=norm_first,
                                    residual=True, backend=xp.__name__).to(dtype="float64")
    assert list(ours.state_dict()) == list(ref.state_dict())
    ours.load_state_dict(ref.state_dict())
    x, dout = randn(xp, (2, 4, 6), seed), randn(xp, (2, 4, 6), seed + 1)
    outs, dxs = [], []
    for m in (ref, ours):
        m.manual_seed(seed)
        outs.append(m(x, is_causal=True))
        dxs.append(m.backward(dout))
    np.testing.assert_allclose(host(outs[1]), host(outs[0]), rtol=0, atol=1e-13)
    np.testing.assert_allclose(host(dxs[1]), host(dxs[0]), rtol=0, atol=1e-13)
    ref_grads = ref.grads()
    for name, g in ours.grads().items():
        np.testing.assert_allclose(host(g), host(ref_grads[name]), rtol=0, atol=1e-13, err_msg=name)


def test_without_residuals_the_input_has_only_the_sublayer_path(xp):
    """Post-norm without residuals: y = norm2(FF(norm1(SA(x)))) computed by hand from the blocks."""
    m = ConfigurableEncoderLayer(4, 2, dim_feedforward=5, dropout=0.0, residual=False, rng=1,
                                 backend=xp.__name__).to(dtype="float64")
    x = randn(xp, (2, 3, 4), 0)
    a, _ = m.self_attn(x, x, x, need_weights=False)
    h = m.norm1(a)
    expected = m.norm2(m.linear2(xp.maximum(m.linear1(h), 0)))
    m.clear_saved()
    np.testing.assert_allclose(host(m(x)), host(expected), rtol=1e-13, atol=1e-14)


def test_bad_arguments():
    with pytest.raises(ValueError, match="activation: expected one of 'relu', 'gelu', 'gelu_tanh'"):
        ConfigurableEncoderLayer(4, 2, activation="tanh")
    with pytest.raises(ValueError, match="not divisible"):
        ConfigurableEncoderLayer(5, 2)
