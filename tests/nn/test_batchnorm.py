"""BatchNorm1d: gradcheck in both modes, running statistics, buffers and state dicts, torch parity."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from npformer.nn import BatchNorm1d, StateDictError
from npformer.nn.module import no_grad
from npformer.tools.gradcheck import gradcheck_module
from tests.helpers import NO_TORCH, assert_gradcheck, host, randn, seeds

TORCH_KEYS = ["weight", "bias", "running_mean", "running_var", "num_batches_tracked"]


@given(b=st.integers(1, 3), t=st.integers(2, 4), c=st.integers(1, 4), training=st.booleans(),
       masked=st.booleans(), seed=seeds)
def test_batchnorm1d_gradcheck(xp, b, t, c, training, masked, seed):
    bn = BatchNorm1d(c, dtype="float64", backend=xp.__name__)
    bn.weight.data, bn.bias.data = randn(xp, (c,), seed), randn(xp, (c,), seed + 1)
    bn.running_mean, bn.running_var = randn(xp, (c,), seed + 2), xp.ones(c) * 0.7
    bn.train(training)
    mask = np.zeros((b, t), bool)
    if masked:
        mask[0, 1:] = True                               # t >= 2 keeps position (0, 0) and every row > 0
        if b == 1:
            mask[0, 1] = False
    inputs = {"x": randn(xp, (b, t, c), seed + 3, scale=2.0)}
    report = gradcheck_module(bn, inputs, forward=lambda m, x: m(x, xp.asarray(mask)), seed=seed)
    assert_gradcheck(report)


def test_running_statistics_update_in_training_only(xp):
    bn = BatchNorm1d(3, momentum=0.5, dtype="float64", backend=xp.__name__)
    x = randn(xp, (4, 5, 3), 0, scale=2.0) + 1.0
    rows = host(x).reshape(-1, 3)
    bn(x)
    np.testing.assert_allclose(host(bn.running_mean), 0.5 * rows.mean(0), rtol=1e-12)
    np.testing.assert_allclose(host(bn.running_var), 0.5 + 0.5 * rows.var(0, ddof=1), rtol=1e-12)
    assert int(bn.num_batches_tracked) == 1
    bn.eval()
    before = host(bn.running_mean).copy()
    y = bn(x)
    np.testing.assert_array_equal(host(bn.running_mean), before)
    assert int(bn.num_batches_tracked) == 1
    expected = (host(x) - before) / np.sqrt(host(bn.running_var) + 1e-5)
    np.testing.assert_allclose(host(y), expected, rtol=1e-12)
    bn.train()
    with no_grad():                                      # as torch: the mode decides, not grad
        bn(x)
    assert int(bn.num_batches_tracked) == 2
    bn.clear_saved()


def test_momentum_none_is_the_cumulative_average(xp):
    bn = BatchNorm1d(2, momentum=None, dtype="float64", backend=xp.__name__)
    batches = [randn(xp, (6, 2), s) + s for s in range(3)]
    with no_grad():
        for x in batches:
            bn(x)
    means = [host(x).mean(0) for x in batches]
    np.testing.assert_allclose(host(bn.running_mean), np.mean(means, axis=0), rtol=1e-12)
    np.testing.assert_allclose(host(bn.running_var), np.mean([host(x).var(0, ddof=1) for x in batches], 0),
                               rtol=1e-12)


def test_one_value_per_feature_raises_and_leaves_the_state_alone(xp):
    bn = BatchNorm1d(3, backend=xp.__name__)
    with pytest.raises(ValueError, match="more than 1 .*value per feature"):
        bn(randn(xp, (1, 3), 0, dtype="float32"))
    assert int(bn.num_batches_tracked) == 0 and not bn._saved
    bn.eval()
    assert bn(randn(xp, (1, 3), 0, dtype="float32")).shape == (1, 3)   # inference at batch size 1


def test_track_running_stats_false_uses_batch_statistics_in_eval(xp):
    bn = BatchNorm1d(3, track_running_stats=False, dtype="float64", backend=xp.__name__).eval()
    x = randn(xp, (5, 3), 0) * 3 + 2
    y = host(bn(x))
    np.testing.assert_allclose(y.mean(0), 0, atol=1e-12)
    assert list(bn.state_dict()) == ["weight", "bias"]
    bn.clear_saved()


def test_buffers_are_not_parameters_but_are_in_the_state_dict(xp):
    bn = BatchNorm1d(4, backend=xp.__name__)
    assert [n for n, _ in bn.named_parameters()] == ["weight", "bias"]
    sd = bn.state_dict()
    assert list(sd) == TORCH_KEYS
    assert sd["num_batches_tracked"].dtype == np.int64 and sd["num_batches_tracked"].shape == ()
    assert BatchNorm1d(4, affine=False).state_dict().keys() == {"running_mean", "running_var",
                                                                 "num_batches_tracked"}


def test_state_dict_round_trip_and_errors(xp):
    a = BatchNorm1d(3, dtype="float64", backend=xp.__name__)
    with no_grad():
        a(randn(xp, (4, 2, 3), 0) * 2 + 1)
    b = BatchNorm1d(3, dtype="float64", backend=xp.__name__)
    b.load_state_dict({k: host(v) for k, v in a.state_dict().items()})    # host arrays convert
    for k in TORCH_KEYS:
        np.testing.assert_array_equal(host(b.state_dict()[k]), host(a.state_dict()[k]))
    c = BatchNorm1d(3, dtype="float64", backend=xp.__name__)
    bad = dict(a.state_dict())
    del bad["running_var"]
    bad["weight"] = xp.ones(5)
    with pytest.raises(StateDictError, match=r"missing keys: \['running_var'\]"):
        c.load_state_dict(bad)
    bad = dict(a.state_dict(), running_mean=xp.ones(5))
    with pytest.raises(StateDictError, match=r"running_mean: expected shape \(3,\), got \(5,\)"):
        c.load_state_dict(bad)
    bad = dict(a.state_dict(), weight=xp.ones(5))
    with pytest.raises(StateDictError, match="weight: expected shape"):
        c.load_state_dict(bad)
    # nothing was written by the failed loads
    assert float(abs(c.running_mean).sum()) == 0 and int(c.num_batches_tracked) == 0
    assert float(c.weight.data.sum()) == 3


def test_to_casts_the_statistics_and_keeps_the_counter_an_integer(xp):
    bn = BatchNorm1d(3, backend=xp.__name__).to(dtype="float64")
    assert bn.weight.dtype == bn.running_mean.dtype == bn.running_var.dtype == xp.float64
    assert bn.num_batches_tracked.dtype == xp.int64


def test_module_used_twice_gets_two_backward_calls(xp):
    bn = BatchNorm1d(3, dtype="float64", backend=xp.__name__)
    x1, x2 = randn(xp, (4, 3), 0), randn(xp, (5, 3), 1) + 2
    d1, d2 = randn(xp, (4, 3), 2), randn(xp, (5, 3), 3)
    bn(x1), bn(x2)
    g2, g1 = bn.backward(d2), bn.backward(d1)
    total = host(bn.weight.grad).copy()
    bn.zero_grad()
    bn(x1)
    np.testing.assert_allclose(host(bn.backward(d1)), host(g1), rtol=1e-13)
    one = host(bn.weight.grad).copy()
    bn.zero_grad()
    bn(x2)
    np.testing.assert_allclose(host(bn.backward(d2)), host(g2), rtol=1e-13)
    np.testing.assert_allclose(total, one + host(bn.weight.grad), rtol=1e-13)


def test_bad_construction():
    with pytest.raises(ValueError, match="num_features: expected an int >= 1, got 0"):
        BatchNorm1d(0)
    with pytest.raises(ValueError, match="eps: expected a finite number > 0"):
        BatchNorm1d(3, eps=0)
    with pytest.raises(ValueError, match=r"momentum \(None: cumulative average\): expected a probability"):
        BatchNorm1d(3, momentum=2.0)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_parity_with_torch_batchnorm1d(momentum):
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    c = 5
    ours = BatchNorm1d(c, momentum=momentum, dtype="float64")
    ref = torch.nn.BatchNorm1d(c, momentum=momentum, dtype=torch.float64)
    with torch.no_grad():
        ref.weight.copy_(torch.linspace(0.5, 1.5, c, dtype=torch.float64))
        ref.bias.copy_(torch.linspace(-1, 1, c, dtype=torch.float64))
    ours.load_state_dict({k: v.numpy() for k, v in ref.state_dict().items()})
    assert list(ours.state_dict()) == list(ref.state_dict())
    rng = np.random.default_rng(0)
    for step in range(4):                                    # training: several steps of (B, T, C) batches
        x = rng.standard_normal((3, 6, c)) * (step + 1) + step
        dy = rng.standard_normal((3, 6, c))
        ours.zero_grad()
        y = ours(x)
        dx = ours.backward(dy)
        tx = torch.tensor(x.transpose(0, 2, 1), requires_grad=True)      # torch's (N, C, L)
        ref.zero_grad()
        ty = ref(tx)
        ty.backward(torch.tensor(dy.transpose(0, 2, 1)))
        np.testing.assert_allclose(y, ty.detach().numpy().transpose(0, 2, 1), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(dx, tx.grad.numpy().transpose(0, 2, 1), rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(host(ours.weight.grad), ref.weight.grad.numpy(), rtol=1e-10)
        np.testing.assert_allclose(host(ours.bias.grad), ref.bias.grad.numpy(), rtol=1e-10)
    for k, v in ref.state_dict().items():
        np.testing.assert_allclose(host(ours.state_dict()[k]), v.numpy(), rtol=1e-12)
    ours.eval(), ref.eval()
    x = rng.standard_normal((1, c))                          # inference at batch size 1
    with torch.no_grad():
        np.testing.assert_allclose(ours(x), ref(torch.tensor(x)).numpy(), rtol=1e-12)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        ref.train()(torch.tensor(x))                         # torch refuses one value in training too


def test_any_container_saves_loads_and_moves_the_running_statistics(xp):
    """Buffers live in Module itself: a plain container of a BatchNorm1d keeps them in its state dict."""
    from npformer.nn import Linear, Module

    class Net(Module):
        def __init__(self):
            super().__init__()
            self.proj = Linear(3, 3, dtype="float64", backend=xp.__name__, rng=0)
            self.bn = BatchNorm1d(3, dtype="float64", backend=xp.__name__)

    a = Net()
    with no_grad():
        a.bn(randn(xp, (5, 3), 1) * 3 + 2)
    assert list(a.state_dict()) == ["proj.weight", "proj.bias", "bn.weight", "bn.bias", "bn.running_mean",
                                    "bn.running_var", "bn.num_batches_tracked"]
    assert [n for n, _ in a.named_parameters()] == ["proj.weight", "proj.bias", "bn.weight", "bn.bias"]
    b = Net().load_state_dict(a.state_dict())
    np.testing.assert_array_equal(host(b.bn.running_mean), host(a.bn.running_mean))
    assert int(b.bn.num_batches_tracked) == 1
    b.to(dtype="float32")
    assert b.bn.running_var.dtype == xp.float32 and b.bn.num_batches_tracked.dtype == xp.int64
