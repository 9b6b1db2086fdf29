"""The fused-residual fast path of the Transformer layers (npformer.nn.fused_layers) against the
plain layers (a module per step): the same outputs, input gradients and parameter gradients, with
and without dropout, post- and pre-norm, encoder and decoder. On the CPU the residual ops have no
kernel, so the test makes the layers take the fused path (its ops then run their references, which
is what a kernel is tested against in tests/kernels)."""
import numpy as np
import pytest

from npformer import kernels, nn
from npformer.nn import fused_layers


def _run(layer, inputs, dout, fused, monkeypatch):
    fused_ops = []
    add_norm = fused_layers._add_norm
    with monkeypatch.context() as m:
        m.setattr(fused_layers, "takes_fused_blocks", lambda x: fused)
        m.setattr(fused_layers, "_add_norm", lambda *a: fused_ops.append(1) or add_norm(*a))
        layer.zero_grad()
        layer.manual_seed(11)
        out = layer(*inputs, **({"tgt_is_causal": True, "tgt_mask": None} if len(inputs) == 2 else {"is_causal": True}))
        grads = layer.backward(dout)
    assert bool(fused_ops) == fused                                  # the path asked for ran
    grads = grads if isinstance(grads, tuple) else (grads,)
    return out, grads, {k: g.copy() for k, g in layer.grads().items()}


@pytest.mark.parametrize("decoder", [False, True], ids=["encoder", "decoder"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post", "pre"])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_the_fused_residual_path_gives_the_plain_layers_results(decoder, norm_first, dropout, monkeypatch):
    rng = np.random.default_rng(0)
    cls = nn.TransformerDecoderLayer if decoder else nn.TransformerEncoderLayer
    layer = cls(8, 2, 16, dropout=dropout, activation="gelu", norm_first=norm_first, dtype="float64", rng=1)
    x = rng.standard_normal((2, 5, 8))
    inputs = (x, rng.standard_normal((2, 4, 8))) if decoder else (x,)
    dout = rng.standard_normal((2, 5, 8))
    with kernels.disabled():
        plain = _run(layer, inputs, dout, False, monkeypatch)
        fused = _run(layer, inputs, dout, True, monkeypatch)
    np.testing.assert_allclose(fused[0], plain[0], rtol=0, atol=1e-13)
    assert len(fused[1]) == len(plain[1]) == (2 if decoder else 1)
    for f, p in zip(fused[1], plain[1]):
        np.testing.assert_allclose(f, p, rtol=0, atol=1e-12)
    assert fused[2].keys() == plain[2].keys()
    for k in plain[2]:
        np.testing.assert_allclose(fused[2][k], plain[2][k], rtol=0, atol=1e-12, err_msg=k)
    assert not any(m._saved for m in layer.modules())                 # every cache consumed


def test_a_layer_takes_the_fused_path_where_the_fused_kernel_runs():
    x = np.zeros((2, 3, 4), np.float32)
    assert not fused_layers.takes_fused_blocks(x)                    # NumPy: no residual kernel
