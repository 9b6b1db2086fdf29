"""Flat parameter and gradient buffers (npformer.nn.flat): the layout, gradients landing in the buffer
after a backward (the same as an unflattened model's), zeroing as one fill, parameters leaving the
buffer when their data is replaced, Module.to / load_state_dict / deepcopy, and bad input."""
import copy

import numpy as np
import pytest

from npformer.models.gpt import GPT, GPTConfig
from npformer.nn.flat import ALIGN, flat_gradients, flat_parameters, flatten_parameters
from npformer.nn.linear import Linear
from npformer.ops.cross_entropy import cross_entropy_backward, cross_entropy_forward
from tests.helpers import host

CFG = GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, d_model=8, dropout=0.1)


def _gpt(xp, dtype="float64"):
    return GPT(CFG, dtype=dtype, backend="numpy" if xp.__name__ == "numpy" else "cupy", rng=0)


def _backward(xp, model, seed=0):
    r = np.random.default_rng(seed)
    model.manual_seed(seed)
    x, y = xp.asarray(r.integers(0, 11, (2, 8))), xp.asarray(r.integers(0, 11, (2, 8)))
    logits = model(x)
    _, cache = cross_entropy_forward(logits, y)
    model.backward(cross_entropy_backward(xp.ones((), logits.dtype), cache))


def test_layout_views_and_offsets(xp):
    model = _gpt(xp)
    before = {n: host(p.data).copy() for n, p in model.named_parameters()}
    flat = flatten_parameters(model)
    assert flat_parameters(model) is flat and len(flat.buffers) == 1
    buf = flat.buffers[0]
    offsets = flat.offsets()
    assert list(offsets) == buf.names and sorted(buf.names) == sorted(before)   # the tied head weight once
    decays = [p.decay for p in buf.params]
    assert decays == sorted(decays, reverse=True)                  # decayed parameters first, then the rest
    for (name, p), slot in zip(zip(buf.names, buf.params), buf.slots):
        dtype, start, stop = offsets[name]
        assert start % ALIGN == 0 and stop - start == p.size and slot.end == -(-stop // ALIGN) * ALIGN
        np.testing.assert_array_equal(host(buf.data[start:stop]).reshape(p.shape), before[name])
        assert p.flat is slot and p.data is slot.data
        p.data[...] += 1.0                                          # a write through the view lands in the buffer
        np.testing.assert_array_equal(host(buf.data[start:stop]).reshape(p.shape), before[name] + 1.0)
    gaps = np.ones(buf.size, bool)
    for s in buf.slots:
        gaps[s.start:s.stop] = False
    assert not host(buf.data)[gaps].any()                           # the gaps hold zeros
    assert model.head.weight is model.wte.weight


def test_backward_grads_land_in_the_buffer_and_equal_an_unflattened_model_s(xp):
    plain, flat_model = _gpt(xp), _gpt(xp)
    flat = flatten_parameters(flat_model)
    _backward(xp, plain)
    flat_model.zero_grad()
    _backward(xp, flat_model)
    buf = flat.buffers[0]
    for name, p in flat_model.named_parameters():
        assert p.grad is p.flat.grad                                # the grad is the buffer's view
    for (name, q), p in zip(plain.named_parameters(), flat_model.parameters()):
        # the same arithmetic on arrays at other addresses: BLAS may add in another order
        np.testing.assert_allclose(host(p.grad), host(q.grad), rtol=1e-12, atol=1e-14, err_msg=name)
    assert [d for d, _ in flat_gradients(flat_model)] == [buf.dtype] and flat_gradients(flat_model)[0][1] is buf.grad
    _backward(xp, flat_model, seed=1)                               # gradients accumulate in place
    _backward(xp, plain, seed=1)
    for (name, q), p in zip(plain.named_parameters(), flat_model.parameters()):
        np.testing.assert_allclose(host(p.grad), host(q.grad), rtol=1e-12, atol=1e-14, err_msg=name)


def test_zero_grad_is_one_fill_and_unused_parameters_hold_zeros(xp):
    model = _gpt(xp)
    flat = flatten_parameters(model)
    _backward(xp, model)
    buf = flat.buffers[0]
    assert host(buf.grad).any()
    model.zero_grad()
    assert all(p.grad is None for p in model.parameters()) and not host(buf.grad).any()
    model.wpe.weight.accumulate(xp.ones(model.wpe.weight.shape))  # only one parameter receives a gradient
    np.testing.assert_array_equal(host(buf.grad).sum(), model.wpe.weight.size)
    assert sum(p.grad is not None for p in model.parameters()) == 1
    flat.attach_grads()                                             # after an all-reduce: every slot is a grad
    assert all(p.grad is p.flat.grad for p in model.parameters())
    model.wpe.zero_grad()                                           # a part of the model: its slots only
    assert model.wpe.weight.grad is None and not host(buf.grad).any()
    assert model.wte.weight.grad is not None


def test_replacing_data_leaves_the_buffer_and_to_flattens_again(xp):
    model = _gpt(xp, "float32")
    flat = flatten_parameters(model)
    p = model.wpe.weight
    p.data = p.data.copy()                                         # a new array: out of the buffer
    assert p.flat is None and not flat.intact() and flat_parameters(model) is None and flat_gradients(model) == []
    p.accumulate(xp.ones(p.shape, dtype=p.dtype))
    assert p.grad.base is None                                      # its own array, not the buffer's view
    model.zero_grad()                                               # still works, per parameter
    values = {n: host(q.data).astype(np.float64) for n, q in model.named_parameters()}
    model.to(dtype="float16")                                       # flattened again, in the new dtype
    again = flat_parameters(model)
    assert again is not None and again is not flat and again.buffers[0].dtype == np.float16
    for n, q in model.named_parameters():
        np.testing.assert_array_equal(host(q.data), values[n].astype(np.float16))


def test_load_state_dict_writes_into_the_buffer_and_a_deep_copy_is_not_flat(xp):
    model, other = _gpt(xp), GPT(CFG, dtype="float64", backend="numpy" if xp.__name__ == "numpy" else "cupy", rng=5)
    flat = flatten_parameters(model)
    model.load_state_dict(other.state_dict())
    assert flat.intact()
    for (n, p), q in zip(model.named_parameters(), other.parameters()):
        np.testing.assert_array_equal(host(p.data), host(q.data), err_msg=n)
    twin = copy.deepcopy(model)
    assert flat_parameters(twin) is None and all(p.flat is None for p in twin.parameters())
    for p, q in zip(twin.parameters(), model.parameters()):
        np.testing.assert_array_equal(host(p.data), host(q.data))
    twin.wte.weight.data[...] = 0                                   # owns its arrays
    assert host(model.wte.weight.data).any()


def test_several_dtypes_get_a_buffer_each_and_bad_input_is_refused(xp):
    layer = Linear(3, 4, dtype="float32", backend="numpy" if xp.__name__ == "numpy" else "cupy", rng=0)
    layer.bias.data = layer.bias.data.astype(xp.float64)
    flat = flatten_parameters(layer)
    assert [str(b.dtype) for b in flat.buffers] == ["float32", "float64"]
    assert flat.offsets() == {"weight": (np.dtype("float32"), 0, 12), "bias": (np.dtype("float64"), 0, 4)}
    with pytest.raises(TypeError, match="expected an npformer Module"):
        flatten_parameters([layer.weight])
